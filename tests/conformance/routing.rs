//! Routing by content (`routes`, `unrouted` in the RetryPolicy): a sidecar
//! in this process following a policy file the test edits as an operator
//! edits the RetryPolicy, against a real broker and a real app.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use courier::source::Source;

/// The rule of the issue: big new orders go to `/big`.
const BIG: &str = r#"type == \"order.created\" && data.total > 100"#;

/// A structured CloudEvent `id` of `kind` with `data.total` = `total`.
async fn send_event(source: &Arc<dyn Source>, id: &str, kind: &str, total: u64) {
    let body = format!(
        r#"{{"specversion":"1.0","id":"{id}","source":"/shop","type":"{kind}","data":{{"total":{total}}}}}"#
    );
    let headers = [(
        "content-type".to_string(),
        "application/cloudevents+json".to_string(),
    )];
    source
        .send(body.into(), &headers)
        .await
        .expect("send an event");
}

/// The paths the app received event `id` (a binary-mode `ce-id`) or plain
/// body `id` at.
fn paths_of(app: &TestApp, id: &str) -> Vec<String> {
    app.received()
        .into_iter()
        .filter(|r| r.header("ce-id") == Some(id) || r.body == id.as_bytes())
        .map(|r| r.path)
        .collect()
}

/// Waits until the applied policy's reload counter reaches `n`.
async fn applied(metrics: std::net::SocketAddr, n: f64) {
    wait_for("the policy change", Duration::from_secs(20), async || {
        let text = scrape(metrics).await;
        text.lines().any(|l| {
            l.starts_with("courier_policy_reloads_total{result=\"applied\"}")
                && l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) == Some(n)
        })
    })
    .await;
}

/// Big orders go to `/big`, the rest to the app URL's path; a live edit
/// moves the bar and sends what no route takes to the dead-letter queue as
/// `unrouted`, a second makes it acked unoffered (counted as filtered).
pub async fn routes_send_messages_by_content_and_follow_live_edits(fixture: Fixture) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_policy(
        dir.path(),
        &format!("timeout: 5s\nroutes: [{{match: \"{BIG}\", path: /big}}]"),
    );
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let policy = courier::policy::file::load(&path).expect("the test's policy is valid");
    let mut config = run_config_for(&fixture, &format!("http://{}/orders", app.addr), policy);
    config.policy.file = Some(path.clone());
    config.options.concurrency = 4;
    let running = Running::start_second_of_two(config).await;
    let metric = async |name: &str, queue_and_more: &str| {
        series(&scrape(running.metrics_addr).await, name, queue_and_more).unwrap_or(0.0)
    };

    send_event(&source, "big-1", "order.created", 150).await;
    send_event(&source, "small-1", "order.created", 50).await;
    fixture.send(&source, "plain-1").await;
    wait_for("the first three", Duration::from_secs(30), async || {
        ["big-1", "small-1", "plain-1"]
            .iter()
            .all(|id| !paths_of(&app, id).is_empty())
    })
    .await;
    assert_eq!(paths_of(&app, "big-1"), ["/big"]);
    assert_eq!(paths_of(&app, "small-1"), ["/orders"]);
    assert_eq!(paths_of(&app, "plain-1"), ["/orders"]);

    // The operator raises the bar, routes the other orders by name, and
    // dead-letters whatever no route takes.
    write_policy(
        dir.path(),
        "timeout: 5s\nroutes: [{match: 'type == \"order.created\" && data.total > 1000', path: /big}, {match: 'type.startsWith(\"order.\")', path: '/orders/other?from=route'}]\nunrouted: dead-letter",
    );
    applied(running.metrics_addr, 1.0).await;
    send_event(&source, "big-2", "order.created", 150).await;
    send_event(&source, "huge-2", "order.created", 5000).await;
    fixture.send(&source, "plain-2").await;
    wait_for("the second three", Duration::from_secs(30), async || {
        !paths_of(&app, "big-2").is_empty()
            && !paths_of(&app, "huge-2").is_empty()
            && metric(
                "courier_dead_letters_total",
                &format!("{}\",reason=\"unrouted", fixture.queue),
            )
            .await
                == 1.0
    })
    .await;
    assert_eq!(paths_of(&app, "big-2"), ["/orders/other?from=route"]);
    assert_eq!(paths_of(&app, "huge-2"), ["/big"]);

    write_policy(
        dir.path(),
        &format!("timeout: 5s\nroutes: [{{match: \"{BIG}\", path: /big}}]\nunrouted: ack"),
    );
    applied(running.metrics_addr, 2.0).await;
    fixture.send(&source, "plain-3").await;
    send_event(&source, "big-3", "order.created", 150).await;
    wait_for("the filtered one", Duration::from_secs(30), async || {
        !paths_of(&app, "big-3").is_empty()
            && metric("courier_filtered_total", &fixture.queue).await == 1.0
    })
    .await;
    wait_settled(&source, Duration::from_secs(15)).await;
    // small-1 and plain-1 (to the app URL's path), plain-2 and plain-3.
    assert_eq!(metric("courier_unrouted_total", &fixture.queue).await, 4.0);
    assert_eq!(
        metric("courier_route_errors_total", &fixture.queue).await,
        0.0
    );
    // The suite runs beside a first subscription: its series are there,
    // and none of this queue's messages went to it.
    let first = format!("{}-first", fixture.queue);
    let text = scrape(running.metrics_addr).await;
    assert!(
        text.contains(&format!(
            "courier_messages_received_total{{queue=\"{first}\"}} 0"
        )),
        "the first subscription's series: {text}"
    );
    running.stop().await;

    assert!(
        paths_of(&app, "plain-2").is_empty(),
        "unrouted reached the app"
    );
    assert!(
        paths_of(&app, "plain-3").is_empty(),
        "filtered reached the app"
    );
    assert_eq!(paths_of(&app, "big-3"), ["/big"]);
    let letters = fixture.read_dead_letters().await;
    assert_eq!(
        letters.len(),
        1,
        "only plain-2 is a dead letter: {letters:?}"
    );
    let letter = &letters[0];
    assert_eq!(letter.body, "plain-2");
    assert_eq!(
        letter.field("courier-reason"),
        Some("unrouted"),
        "{letter:?}"
    );
    let error = letter.field("courier-error").unwrap_or_default();
    assert!(
        error.contains("none of the policy's 2 routes matched"),
        "{error}"
    );
}
