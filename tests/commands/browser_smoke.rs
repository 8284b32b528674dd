//! The browser harness (tests/common/browser.rs) end to end, before the
//! console's tests rely on it: a headless Chromium through chromedriver
//! drives a page with a form and a little JavaScript that a hyper server in
//! this test serves on loopback. When this fails, the browser, chromedriver
//! or the harness is broken, not the console.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Response};
use http_body_util::{BodyExt, Full};
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::common::browser::{ENTER, Session, png_size};

/// The form page: server-rendered text, a form that POSTs to /greet, and
/// a script that marks the page and counts clicks.
const PAGE: &str = r#"<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>Harness check</title></head>
<body>
  <h1 id="heading">Served by the test</h1>
  <p id="status">script has not run</p>
  <form method="post" action="/greet">
    <label>Name <input id="name" name="name" autocomplete="off"></label>
    <button id="send" type="submit">Send</button>
  </form>
  <button id="count" type="button">Count</button> <span id="clicks">0</span>
  <button id="ask" type="button">Ask</button> <span id="answer"></span>
  <script>
    document.getElementById("status").textContent = "script ran";
    let clicks = 0;
    document.getElementById("count").addEventListener("click", () => {
      // Later than the click, as a live update would be.
      setTimeout(() => {
        document.getElementById("clicks").textContent = String(++clicks);
      }, 100);
    });
    document.getElementById("ask").addEventListener("click", () => {
      document.getElementById("answer").textContent =
        confirm("Purge 3 letters?") ? "confirmed" : "cancelled";
    });
  </script>
</body>
</html>
"#;

fn html(status: u16, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "text/html; charset=utf-8")
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

/// `application/x-www-form-urlencoded` as a browser sends it.
fn form_fields(body: &[u8]) -> HashMap<String, String> {
    fn decode(part: &str) -> String {
        let bytes = part.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'+' => out.push(b' '),
                b'%' if i + 2 < bytes.len() => {
                    let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
                    out.push(u8::from_str_radix(hex, 16).expect("a %XX escape"));
                    i += 2;
                }
                byte => out.push(byte),
            }
            i += 1;
        }
        String::from_utf8(out).expect("UTF-8 form data")
    }
    std::str::from_utf8(body)
        .expect("a form body")
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .map(|(name, value)| (decode(name), decode(value)))
        .collect()
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Serves [`PAGE`] at / and a greeting rendered from the form at POST
/// /greet, until `stop`; its address.
async fn serve_page(stop: CancellationToken) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(courier::telemetry::serve_http(
        listener,
        stop,
        |req| async move {
            match (req.method().clone(), req.uri().path()) {
                (Method::GET, "/") => html(200, PAGE.to_string()),
                (Method::POST, "/greet") => {
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    let name = form_fields(&body).remove("name").unwrap_or_default();
                    html(
                        200,
                        format!(
                            "<!doctype html><title>Greeting</title>\
                         <p id=\"greeting\">Hello, {}!</p>",
                            escape(&name)
                        ),
                    )
                }
                _ => html(404, "<p>not found</p>".into()),
            }
        },
    ));
    format!("http://{addr}")
}

#[tokio::test]
async fn browser_harness_drives_headless_chromium_through_a_form_and_scripts() {
    let started = Instant::now();
    let stop = CancellationToken::new();
    let site = serve_page(stop.clone()).await;
    let mut page = Session::start().await;
    let browser_up = started.elapsed();

    // Server-rendered text, and the page's own script.
    page.goto(&format!("{site}/")).await;
    assert_eq!(page.title().await, "Harness check");
    assert_eq!(
        page.find("#heading").await.text().await,
        "Served by the test"
    );
    page.wait_for_text("#status", "script ran").await;
    assert!(page.source().await.contains("id=\"clicks\""));

    // Something a script shows later than the click.
    let count = page.find("#count").await;
    count.click().await;
    count.click().await;
    page.wait_for_text("#clicks", "2").await;

    // A confirm(), cancelled and then accepted.
    let ask = page.find("#ask").await;
    ask.click().await;
    assert_eq!(page.wait_for_alert().await, "Purge 3 letters?");
    page.dismiss_alert().await;
    page.wait_for_text("#answer", "cancelled").await;
    ask.click().await;
    page.wait_for_alert().await;
    page.accept_alert().await;
    page.wait_for_text("#answer", "confirmed").await;
    assert_eq!(page.alert_text().await, None);

    // Scripts: a value back, and an element passed in.
    let heading = page.find("#heading").await;
    let found = page
        .execute(
            "return [document.querySelectorAll('button').length, arguments[0].id, arguments[1]];",
            vec![heading.arg(), json!(41)],
        )
        .await;
    assert_eq!(found, json!([3, "heading", 41]));

    // A form typed into and submitted with Enter: what the server rendered
    // from it, escaped both ways.
    let name = page.find("#name").await;
    name.send_keys("Ada & <Lovelace>").await;
    assert_eq!(name.property("value").await, json!("Ada & <Lovelace>"));
    assert_eq!(name.attribute("autocomplete").await.as_deref(), Some("off"));
    name.send_keys(ENTER).await;
    page.wait_for_url("/greet").await;
    let greeting = page.wait_for_text("#greeting", "Hello").await;
    assert_eq!(greeting.text().await, "Hello, Ada & <Lovelace>!");
    assert!(page.try_find("#name").await.is_none());
    assert!(page.find_all("form").await.is_empty());

    // A screenshot of the viewport asked for, as a PNG.
    page.set_viewport_size(1024, 640).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shots/greeting.png");
    let png = page.screenshot(&path).await;
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(on_disk, png);
    assert!(on_disk.len() > 100, "{} bytes", on_disk.len());
    let (width, height) = png_size(&on_disk).expect("a PNG");
    assert_eq!((width, height), (1024, 640));
    let small = page
        .find("#greeting")
        .await
        .screenshot(&dir.path().join("p.png"))
        .await;
    let (width, height) = png_size(&small).expect("a PNG of the element");
    assert!(width > 0 && height > 0 && width < 1024, "{width}x{height}");

    // A missing element: the failure names it and the page it was missing
    // from (its URL and its text).
    page.set_wait_timeout(Duration::from_millis(300));
    let shown = &page;
    let missed = shown
        .try_wait_for("an element matching \"#nowhere\"", || async move {
            shown.try_find("#nowhere").await
        })
        .await
        .expect_err("waiting for a missing element fails");
    assert!(missed.contains("\"#nowhere\""), "{missed}");
    assert!(missed.contains(&format!("{site}/greet")), "{missed}");
    assert!(missed.contains("Hello, Ada & <Lovelace>!"), "{missed}");

    drop(page);
    stop.cancel();
    eprintln!(
        "browser smoke: browser up in {browser_up:?}, all in {:?}",
        started.elapsed()
    );
}
