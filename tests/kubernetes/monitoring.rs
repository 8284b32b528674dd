//! The metrics as Prometheus sees them: `promtool check metrics` on a real
//! scrape, every metric the shipped rules and dashboard use present in that
//! scrape, and a real Prometheus server evaluating the shipped alert rules
//! against a running sidecar (DLQ alert fires, then resolves after a replay).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::*;

fn tool(name: &str) -> String {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    assert!(
        !found.is_empty(),
        "{name} is not installed; scripts/test installs it (Debian package prometheus)"
    );
    found
}

/// Plain HTTP GET; enough for Prometheus's API on loopback.
fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).unwrap();
    out.split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default()
}

/// The body of a scrape, without the HTTP head.
async fn metrics_text(addr: SocketAddr) -> String {
    let raw = scrape(addr).await;
    raw.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or(raw)
}

async fn sidecar_with_traffic() -> (Fixture, TestApp, Running) {
    let fixture = Fixture::redis();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    for body in [
        "ok",
        "script:503,200",
        "script:400,200",
        "script:400,200\nb",
        "script:400,200\nc",
    ] {
        fixture.send(&source, body).await;
    }
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    wait_settled(&source, Duration::from_secs(20)).await;
    (fixture, app, running)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_a_real_scrape_and_every_shipped_metric_is_in_it() {
    let (_fixture, _app, running) = sidecar_with_traffic().await;
    let text = metrics_text(running.metrics_addr).await;
    running.stop().await;

    let mut child = Command::new(tool("promtool"))
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics:\n{}{}\non:\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let names = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/monitoring/metric-names.txt"
    ))
    .unwrap();
    let exposed: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    for name in names
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let present = exposed.iter().any(|e| {
            *e == name
                || e.strip_prefix(name)
                    .is_some_and(|rest| ["_bucket", "_sum", "_count"].contains(&rest))
        });
        assert!(
            present,
            "{name} is used by the shipped rules or dashboard but missing from a real scrape:\n{text}"
        );
    }
}

struct Prometheus {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A private Prometheus scraping `target` every second, with the shipped
/// rules made quick (`for:` shortened to 2s).
async fn prometheus(target: SocketAddr) -> Prometheus {
    let dir = tempfile::tempdir().unwrap();
    let rules = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/monitoring/prometheus/courier-rules.yaml"
    ))
    .unwrap();
    let quick: String = rules
        .lines()
        .map(|l| {
            if l.trim_start().starts_with("for:") {
                l.split("for:").next().unwrap().to_string() + "for: 2s"
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(dir.path().join("rules.yaml"), quick).unwrap();
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files: [rules.yaml]\nscrape_configs:\n  - job_name: courier\n    static_configs:\n      - targets: ['{target}']\n        labels: {{namespace: test}}\n"
    );
    std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
    let addr = free_addr();
    let child = Command::new(tool("prometheus"))
        .arg(format!(
            "--config.file={}",
            dir.path().join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address={addr}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let server = Prometheus {
        child,
        addr,
        _dir: dir,
    };
    wait_for(
        "Prometheus to be ready",
        Duration::from_secs(30),
        async || TcpStream::connect(addr).is_ok() && http_get(addr, "/-/ready").contains("Ready"),
    )
    .await;
    server
}

fn query(prom: &Prometheus, expr: &str) -> Option<f64> {
    let body = http_get(
        prom.addr,
        &format!("/api/v1/query?query={}", urlencode(expr)),
    );
    let json: serde_json::Value = serde_json::from_str(&body).ok()?;
    json["data"]["result"][0]["value"][1].as_str()?.parse().ok()
}

fn alert_state(prom: &Prometheus, name: &str, queue: &str) -> Option<String> {
    let json: serde_json::Value =
        serde_json::from_str(&http_get(prom.addr, "/api/v1/alerts")).ok()?;
    json["data"]["alerts"]
        .as_array()?
        .iter()
        .find(|a| a["labels"]["alertname"] == name && a["labels"]["queue"] == queue)
        .and_then(|a| a["state"].as_str().map(str::to_string))
}

fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'-' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dlq_alert_fires_through_prometheus_and_resolves_after_a_replay() {
    let (fixture, _app, running) = sidecar_with_traffic().await;
    let prom = prometheus(running.metrics_addr).await;
    let depth = format!("courier_dlq_depth{{queue=\"{}\"}}", fixture.queue);

    wait_for(
        "Prometheus to see 3 dead letters",
        Duration::from_secs(30),
        async || query(&prom, &depth) == Some(3.0),
    )
    .await;
    wait_for(
        "CourierDeadLettersPresent to fire",
        Duration::from_secs(30),
        async || {
            alert_state(&prom, "CourierDeadLettersPresent", &fixture.queue).as_deref()
                == Some("firing")
        },
    )
    .await;

    // Replay them all; the app now accepts them (their scripts say 200 next).
    let source = fixture.open().await;
    for letter in source.dead_letters(&fixture.dlq(), 100).await.unwrap() {
        source.replay(&fixture.dlq(), &letter).await.unwrap();
    }
    wait_settled(&source, Duration::from_secs(20)).await;
    wait_for(
        "Prometheus to see the DLQ empty",
        Duration::from_secs(30),
        async || query(&prom, &depth) == Some(0.0),
    )
    .await;
    wait_for(
        "CourierDeadLettersPresent to resolve",
        Duration::from_secs(30),
        async || alert_state(&prom, "CourierDeadLettersPresent", &fixture.queue).is_none(),
    )
    .await;
    running.stop().await;
}

/// `courier console --prometheus-url`: the overview's sparkline is the
/// sidecars' `courier_dlq_depth` as Prometheus scraped it (its own
/// sampling set to once an hour could not have drawn it), and the figure
/// it ends on is the queue's dead letters. A Prometheus that does not
/// answer leaves the console's own samples.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_draws_the_dead_letter_history_from_prometheus() {
    let (fixture, _app, running) = sidecar_with_traffic().await;
    let prom = prometheus(running.metrics_addr).await;
    let depth = format!("courier_dlq_depth{{queue=\"{}\"}}", fixture.queue);
    wait_for(
        "Prometheus to scrape the dead-letter depth",
        Duration::from_secs(30),
        async || query(&prom, &depth) == Some(3.0),
    )
    .await;
    let overview = |prometheus_url: String| {
        let fixture = fixture.clone();
        async move {
            let addr = free_addr();
            let mut console = courier_command()
                .args([
                    "console",
                    "--listen",
                    &addr.to_string(),
                    "--sample-every",
                    "1h",
                ])
                .arg("--queue")
                .arg(format!("{}#{}", fixture.source_arg(), fixture.queue))
                .args(["--prometheus-url", &prometheus_url])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start courier console");
            wait_for(
                "the console to answer",
                Duration::from_secs(20),
                async || TcpStream::connect(addr).is_ok(),
            )
            .await;
            let page = http_get(addr, "/");
            let _ = console.kill();
            let mut said = String::new();
            let _ = console.stderr.take().unwrap().read_to_string(&mut said);
            let _ = console.wait();
            format!("{page}\nthe console said: {said}")
        }
    };
    let page = overview(format!("http://{}", prom.addr)).await;
    assert!(
        page.contains("data-source=\"prometheus\"") && page.contains("now 3\""),
        "{page}"
    );
    let page = overview(format!("http://{}", free_addr())).await;
    assert!(page.contains("data-source=\"console\""), "{page}");
    running.stop().await;
}
