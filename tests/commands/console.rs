//! `courier console` in a real browser: headless Chromium through
//! chromedriver (tests/common/browser.rs) drives the built binary serving
//! a queue's dead letters on Redis and on NATS, as an operator would: log
//! in with the token, read the overview's figures, filter, open a letter,
//! edit and replay it, replay by filter at a rate and watch the job
//! finish, purge with the confirmation. Then what must be refused is: a
//! request without the token, a write to a read-only console, and a POST
//! from a page of another site. The Redis run also takes the screenshots
//! docs/ shows (`COURIER_DOC_SCREENSHOTS=1` writes them there).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::common::browser::Session;
use crate::common::*;

const TOKEN: &str = "console-test-token-0123456789";

/// A `courier console` process on a free port, stopped when dropped.
struct Console {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Console {
    fn start(fixture: &Fixture, writes: bool, token: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let mut command = courier_command();
        command
            .args([
                "console",
                "--listen",
                &addr.to_string(),
                "--sample-every",
                "1s",
            ])
            .arg("--queue")
            .arg(format!("{}#{}", fixture.source_arg(), fixture.queue))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if writes {
            command.arg("--allow-writes");
        }
        if token {
            command.arg("--token-file").arg(&token_file);
        }
        let child = command.spawn().expect("start courier console");
        let console = Self {
            child,
            addr,
            _dir: dir,
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "the console did not answer on {addr}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        console
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// A request as a script (not a browser) would send it: the status and
    /// the whole answer.
    async fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> (u16, String) {
        let mut stream = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        let mut request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        for (name, value) in headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("\r\n");
        request.push_str(body);
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        let status = answer
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        (status, answer)
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The form token a console page carries.
fn form_token(page: &str) -> String {
    let at = page
        .find("name=\"form_token\" value=\"")
        .expect("a form token")
        + 25;
    page[at..at + 32].to_string()
}

/// Five dead letters: three of tenant acme and two of tenant other, each
/// answered 400 (then 200, once replayed).
async fn dead_letters(fixture: &Fixture) {
    drop(fixture.open().await);
    wait_released(fixture).await;
    let producer = fixture.producer().await;
    for (i, tenant) in ["acme", "acme", "acme", "other", "other"]
        .iter()
        .enumerate()
    {
        producer
            .send(
                format!("script:400,200\n{{\"order\":{i}}}"),
                &[("x-tenant".to_string(), tenant.to_string())],
            )
            .await;
    }
    producer.release(fixture).await;
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let running = Running::start(run_config(fixture, &app, fast_policy())).await;
    let dlq = fixture.dlq();
    wait_for("five dead letters", SETTLE, async || {
        source
            .dead_letters(&dlq, 100)
            .await
            .is_ok_and(|l| l.len() == 5)
    })
    .await;
    running.stop().await;
    release(fixture, source).await;
}

async fn dead_letter_count(fixture: &Fixture) -> usize {
    let source = fixture.open().await;
    let n = source
        .dead_letters(&fixture.dlq(), 100)
        .await
        .unwrap()
        .len();
    release(fixture, source).await;
    n
}

/// Where a screenshot is written: into docs/, which shows them, when
/// COURIER_DOC_SCREENSHOTS=1 asks for new ones; else beside the build, so
/// that a test run leaves the working tree as it was (each run's picture
/// differs: the queue's name, the ages).
fn docs_image(name: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    if std::env::var("COURIER_DOC_SCREENSHOTS").as_deref() == Ok("1") {
        return root.join("docs").join(name);
    }
    let dir = root.join("target").join("tmp").join("screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

async fn works_its_dead_letters(fixture: Fixture, screenshots: bool) {
    dead_letters(&fixture).await;
    let console = Console::start(&fixture, true, true);

    // Without the token: refused, whatever is asked.
    let (status, _) = console.request("GET", "/", &[], "").await;
    assert_eq!(status, 401, "a request without the token");
    let (status, _) = console
        .request(
            "GET",
            "/q/0",
            &[("Authorization", "Bearer wrong-token-000000")],
            "",
        )
        .await;
    assert_eq!(status, 401, "a request with another token");
    let (status, _) = console.request("GET", "/healthz", &[], "").await;
    assert_eq!(status, 200, "the probe needs no token");

    let browser = Session::start().await;
    browser.set_viewport_size(1280, 720).await;
    browser.goto(&console.url("/")).await;
    browser
        .wait_for_element("#token")
        .await
        .send_keys(TOKEN)
        .await;
    browser.find("#login button").await.click().await;

    // The overview: the dead letters the broker holds, once sampled.
    let row = format!("tr[data-queue=\"{}\"]", fixture.queue);
    browser
        .wait_for("the overview to count five dead letters", || async {
            browser.refresh().await;
            let cell = browser.try_find(&format!("{row} .dead-letters")).await?;
            (cell.text().await == "5").then_some(())
        })
        .await;
    let oldest = browser.find(&format!("{row} .oldest")).await.text().await;
    assert_ne!(oldest, "—", "the oldest dead letter's age is shown");
    if screenshots {
        browser
            .wait_for("a sparkline of a few samples", || async {
                browser.refresh().await;
                let svg = browser.try_find(&format!("{row} svg[data-points]")).await?;
                let points: usize = svg.attribute("data-points").await?.parse().ok()?;
                (points >= 3).then_some(())
            })
            .await;
        browser
            .screenshot(&docs_image("console-overview.png"))
            .await;
    }

    // Filter: the three letters of tenant acme.
    browser.find(&format!("{row} a")).await.click().await;
    let filter = browser.wait_for_element("#filter").await;
    filter.send_keys(r#"headers["x-tenant"] == "acme""#).await;
    browser.find("#filter-form button").await.click().await;
    browser.wait_for_url("filter=").await;
    let rows = browser.find_all("#letters tbody tr").await;
    assert_eq!(rows.len(), 3, "{}", browser.describe_page().await);
    assert_eq!(
        browser
            .find("#by-reason li[data-key=\"permanent-status\"] b")
            .await
            .text()
            .await,
        "3"
    );
    assert_eq!(
        browser
            .find("#by-status li[data-key=\"400\"] b")
            .await
            .text()
            .await,
        "3"
    );

    // Open one: its headers, its body pretty-printed, its attempt.
    browser.find("#letters tbody tr a").await.click().await;
    browser.wait_for_element("#letter-id").await;
    assert!(
        browser
            .find("#headers")
            .await
            .text()
            .await
            .contains("x-tenant")
    );
    assert_eq!(browser.find("#status").await.text().await, "400");
    assert!(
        browser
            .find("#body")
            .await
            .text()
            .await
            .contains("script:400,200")
    );
    if screenshots {
        browser.screenshot(&docs_image("console-letter.png")).await;
    }
    browser.back().await;

    // Replay every acme letter at 5 a second, and watch the job finish.
    browser
        .wait_for_element("#replay-rate")
        .await
        .send_keys("5/s")
        .await;
    browser.find("#replay-filter-button").await.click().await;
    browser.wait_for_url("/jobs").await;
    browser
        .wait_for("the replay job to finish", || async {
            let row = browser.try_find("#jobs tr[data-state=\"done\"]").await?;
            (row.find(".done").await.text().await == "3/3").then_some(())
        })
        .await;
    assert_eq!(
        dead_letter_count(&fixture).await,
        2,
        "the acme letters left the dead-letter queue"
    );

    // Edit one of the others and replay it.
    browser.goto(&console.url("/q/0")).await;
    browser.find("#letters tbody tr a").await.click().await;
    let id = browser.wait_for_element("#letter-id").await.text().await;
    let patch = browser.find("#patch").await;
    patch.clear().await;
    patch
        .send_keys(r#"[{"op":"replace","path":"/headers/x-tenant","value":"fixed"}]"#)
        .await;
    browser.find("#edit-replay").await.click().await;
    let edited = browser.wait_for_element("#edit-output").await.text().await;
    assert!(
        edited.contains(&format!("replayed {id} edited")),
        "{edited}"
    );
    assert_eq!(dead_letter_count(&fixture).await, 1);

    // Purge the last one: the page shows the count and wants the queue's
    // name typed.
    browser.goto(&console.url("/q/0")).await;
    browser.find("#purge-link").await.click().await;
    let count = browser.wait_for_element("#purge-count").await;
    assert_eq!(count.attribute("data-count").await.as_deref(), Some("1"));
    browser
        .find("#confirm")
        .await
        .send_keys("not the name")
        .await;
    browser
        .find("#purge-why")
        .await
        .send_keys("browser test")
        .await;
    browser.find("#purge-button").await.click().await;
    browser
        .wait_for_text("#problem", "type the queue's name")
        .await;
    assert_eq!(
        dead_letter_count(&fixture).await,
        1,
        "a wrong name purges nothing"
    );
    browser.back().await;
    let confirm = browser.wait_for_element("#confirm").await;
    confirm.clear().await;
    confirm.send_keys(&fixture.queue).await;
    browser.find("#purge-button").await.click().await;
    browser
        .wait_for("the purge job to finish", || async {
            browser
                .try_find("#jobs tr[data-job^=\"purge-\"][data-state=\"done\"]")
                .await
        })
        .await;
    assert_eq!(dead_letter_count(&fixture).await, 0);
}

/// A console without --allow-writes refuses a write, even one with its
/// form token from its own page; and offers no write on its pages.
async fn read_only_refuses_writes(fixture: Fixture) {
    dead_letters(&fixture).await;
    let console = Console::start(&fixture, false, false);
    let (status, page) = console.request("GET", "/q/0", &[], "").await;
    assert_eq!(status, 200);
    assert!(!page.contains("replay-filter"), "no write offered: {page}");
    let (status, page) = console
        .request(
            "POST",
            "/q/0/replay",
            &[("Content-Type", "application/x-www-form-urlencoded")],
            "all=1&form_token=x",
        )
        .await;
    assert_eq!(status, 403, "{page}");
    assert!(page.contains("read-only"), "{page}");
    assert_eq!(dead_letter_count(&fixture).await, 5);
}

/// A page of another site that posts to the console (the form token
/// copied in, as if it had leaked) is refused: the browser says where the
/// request comes from. Nothing is replayed.
async fn refuses_a_cross_site_post(fixture: Fixture) {
    dead_letters(&fixture).await;
    let console = Console::start(&fixture, true, false);
    let (_, page) = console.request("GET", "/q/0", &[], "").await;
    let token = form_token(&page);
    let attacker = format!(
        "<!doctype html><html><body><form id=\"f\" method=\"post\" action=\"{}\">\
         <input name=\"form_token\" value=\"{token}\"><input name=\"all\" value=\"1\"></form>\
         <button id=\"go\" onclick=\"document.getElementById('f').submit()\">go</button></body></html>",
        console.url("/q/0/replay")
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let other = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(courier::telemetry::serve_http(
        listener,
        stop.clone(),
        move |_| {
            let page = attacker.clone();
            async move {
                Response::builder()
                    .header("content-type", "text/html")
                    .body(Full::new(Bytes::from(page)))
                    .unwrap()
            }
        },
    ));
    let browser = Session::start().await;
    browser.goto(&format!("http://{other}/")).await;
    browser.find("#go").await.click().await;
    browser.wait_for_text("#problem", "another site").await;
    stop.cancel();
    assert_eq!(dead_letter_count(&fixture).await, 5, "nothing was replayed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_on_redis_works_its_dead_letters_in_a_browser() {
    works_its_dead_letters(Fixture::redis(), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_on_nats_works_its_dead_letters_in_a_browser() {
    works_its_dead_letters(Fixture::nats(), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_read_only_refuses_writes() {
    read_only_refuses_writes(Fixture::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_refuses_a_cross_site_post() {
    refuses_a_cross_site_post(Fixture::redis()).await;
}

/// Replay two ticked letters, then replay the rest at one every 3 s and
/// cancel that job from the jobs page: the two leave the dead-letter
/// queue, the cancelled job shows `cancelled`, and the letters it did not
/// reach stay. (At one a second the three were replayed in 2 s, before a
/// loaded CI machine's browser had clicked cancel: the job showed `done`.)
async fn replays_selected_and_cancels(fixture: Fixture) {
    dead_letters(&fixture).await;
    let console = Console::start(&fixture, true, false);
    let browser = Session::start().await;
    browser.goto(&console.url("/q/0")).await;
    let boxes = browser.find_all("#letters input[type=checkbox]").await;
    assert_eq!(boxes.len(), 5);
    boxes[0].click().await;
    boxes[1].click().await;
    browser.find("#replay-selected-button").await.click().await;
    browser.wait_for_url("/jobs").await;
    browser
        .wait_for("the replay of the two to finish", || async {
            let row = browser.try_find("#jobs tr[data-state=\"done\"]").await?;
            (row.find(".done").await.text().await == "2/2").then_some(())
        })
        .await;
    assert_eq!(dead_letter_count(&fixture).await, 3);

    browser.goto(&console.url("/q/0")).await;
    browser
        .wait_for_element("#replay-rate")
        .await
        .send_keys("20/m")
        .await;
    browser.find("#replay-filter-button").await.click().await;
    browser.wait_for_url("/jobs").await;
    let cancel = browser
        .wait_for("the running job's cancel button", || async {
            browser
                .try_find("#jobs tr[data-state=\"running\"] form.cancel button")
                .await
        })
        .await;
    cancel.click().await;
    browser
        .wait_for("the job to show cancelled", || async {
            browser.refresh().await;
            browser.try_find("#jobs tr[data-state=\"cancelled\"]").await
        })
        .await;
    let left = dead_letter_count(&fixture).await;
    assert!((1..3).contains(&left), "{left} of 3 left after the cancel");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_replays_selected_letters_and_cancels_a_job() {
    replays_selected_and_cancels(Fixture::redis()).await;
}
