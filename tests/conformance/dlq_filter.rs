//! `courier dlq --filter` end to end, for every source that browses dead
//! letters: dead letters that differ by reason, status, a header and a JSON
//! body field, made by one run of a real sidecar against a real app, then
//! selected by expressions with the built binary as an operator would.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::process::Output;

use crate::common::*;
use crate::dlq::{courier, json_lines, stderr, stdout};
use bytes::Bytes;
use http_body_util::Full;
use tokio_util::sync::CancellationToken;

/// A real app on loopback that answers each message with the status its
/// `x-answer` header names, and with `Courier-Dead-Letter` set to its
/// `x-dead-letter` header when it has one: bodies are left free to be JSON.
async fn answering_app() -> (String, CancellationToken) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    tokio::spawn(courier::telemetry::serve_http(
        listener,
        stop.clone(),
        |request: http::Request<hyper::body::Incoming>| async move {
            let header = |name: &str| {
                request
                    .headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string)
            };
            let status: u16 = header("x-answer")
                .and_then(|s| s.parse().ok())
                .unwrap_or(200);
            let mut answer = http::Response::builder().status(status);
            if let Some(reason) = header("x-dead-letter") {
                answer = answer.header("courier-dead-letter", reason);
            }
            answer.body(Full::new(Bytes::from("answered"))).unwrap()
        },
    ));
    (url, stop)
}

/// What a listed letter is, as the test named it: its JSON body's
/// `order.id`, else its text body after `plain `.
fn marker(letter: &serde_json::Value) -> String {
    let body = letter["body"].as_str().unwrap_or_default();
    match serde_json::from_str::<serde_json::Value>(body) {
        Ok(json) => json["order"]["id"].as_str().unwrap_or("?").to_string(),
        Err(_) => body.strip_prefix("plain ").unwrap_or(body).to_string(),
    }
}

fn markers(out: &Output) -> BTreeSet<String> {
    assert!(out.status.success(), "{}", stderr(out));
    json_lines(out).iter().map(marker).collect()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|n| n.to_string()).collect()
}

pub async fn dlq_filter_selects_by_reason_status_header_and_body(fixture: Fixture) {
    let (app_url, app) = answering_app().await;
    let _app = app.drop_guard();
    let json = |id: &str, total: u32| format!(r#"{{"order": {{"id": "{id}", "total": {total}}}}}"#);
    // Over the sidecar's --max-body below: dead-lettered `undeliverable`,
    // with no status, unread by the app.
    let oversized = format!(
        r#"{{"order": {{"id": "E", "total": 1000}}, "pad": "{}"}}"#,
        "x".repeat(3000)
    );
    let letters: [(String, &[(&str, &str)]); 5] = [
        (json("A", 150), &[("x-answer", "400"), ("x-tenant", "acme")]),
        (
            json("B", 50),
            &[("x-answer", "400"), ("x-tenant", "globex")],
        ),
        (json("C", 900), &[("x-answer", "422"), ("x-tenant", "acme")]),
        (
            "plain D".to_string(),
            &[
                ("content-type", "text/plain"),
                ("x-answer", "500"),
                ("x-dead-letter", "out-of-stock"),
                ("x-tenant", "acme"),
            ],
        ),
        (oversized, &[("x-tenant", "acme")]),
    ];
    // Opened first, as a deployed sidecar has (see dlq::send_all).
    drop(fixture.open().await);
    wait_released(&fixture).await;
    let producer = fixture.producer().await;
    for (body, headers) in &letters {
        let mut headers: Vec<(String, String)> = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        if !headers.iter().any(|(n, _)| n == "content-type") {
            headers.push(("content-type".into(), "application/json".into()));
        }
        producer.send(Bytes::from(body.clone()), &headers).await;
    }
    producer.release(&fixture).await;
    {
        let source = fixture.open().await;
        let mut config = run_config_for(&fixture, &app_url, fast_policy());
        config.options.max_body = 2048;
        let running = Running::start_second_of_two(config).await;
        wait_for("five dead letters", SETTLE, async || {
            source
                .dead_letters(&fixture.dlq(), 10)
                .await
                .is_ok_and(|l| l.len() == letters.len())
        })
        .await;
        running.stop().await;
    }
    wait_released(&fixture).await;

    let list = |args: &[&str]| {
        let mut all = vec!["dlq", "list", "--output", "json"];
        all.extend_from_slice(args);
        courier(&fixture, &all)
    };
    // E has no status: left out, and no warning about it.
    let out = list(&["--filter", "status >= 400 && status < 500"]);
    assert_eq!(markers(&out), set(&["A", "B", "C"]));
    assert!(!stderr(&out).contains("warning"), "{}", stderr(&out));
    // D's body is not JSON: it has no order, and is left out.
    let out = list(&[
        "--filter",
        r#"headers["x-tenant"] == "acme" && body.order.total > 100"#,
    ]);
    assert_eq!(markers(&out), set(&["A", "C", "E"]));
    // A shorthand and the expression, ANDed.
    let out = list(&[
        "--reason",
        "permanent-status",
        "--filter",
        "body.order.total < 100",
    ]);
    assert_eq!(markers(&out), set(&["B"]));
    // An expression that cannot be evaluated on a letter selects none of
    // those and says so.
    let out = list(&["--filter", r#"body.order.total > "100""#]);
    assert_eq!(markers(&out), set(&[]));
    assert!(
        stderr(&out).contains("--filter could not be evaluated on 4 dead letters"),
        "{}",
        stderr(&out)
    );

    let ids: BTreeMap<String, String> = json_lines(&list(&[]))
        .iter()
        .map(|l| (marker(l), l["id"].as_str().unwrap().to_string()))
        .collect();
    let out = courier(
        &fixture,
        &[
            "dlq",
            "replay",
            "--filter",
            r#"headers["x-tenant"] == "globex" || reason == "app-dead-letter""#,
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let replayed: BTreeSet<String> = stdout(&out)
        .lines()
        .filter_map(|l| l.strip_prefix("replayed "))
        .map(str::to_string)
        .collect();
    assert_eq!(replayed, set(&[&ids["B"], &ids["D"]]), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("2 dead letters replayed"),
        "{}",
        stdout(&out)
    );
    assert_eq!(markers(&list(&[])), set(&["A", "C", "E"]));
}
