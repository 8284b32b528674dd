//! Several subscriptions in one sidecar: each queue with its own policy,
//! app path, concurrency limit and metrics, and one queue's trouble kept to
//! that queue.

use std::time::Duration;

use crate::common::*;
use courier::policy::Policy;
use courier::sidecar::{PolicySettings, RunConfig};

const EACH: usize = 40;

/// `fixture`'s sidecar settings for a subscription posting to `path`.
fn subscription(fixture: &Fixture, app: &TestApp, path: &str, policy: Policy) -> RunConfig {
    let mut config = run_config_for(fixture, &format!("http://{}{path}", app.addr), policy);
    config.options.create = true;
    config.options.concurrency = 8;
    config
}

/// Three subscriptions; the app answers every message of the first 503
/// all along. The other two deliver everything meanwhile, their adaptive
/// limits stay at their concurrency while the first's falls, and every
/// message goes to its own subscription's path with its own queue's name.
pub async fn a_struggling_subscription_does_not_slow_the_others(fixture: Fixture) {
    let app = TestApp::start().await;
    let struggling = fixture.sibling("a");
    let (b, c) = (fixture.sibling("b"), fixture.sibling("c"));
    let failing = Policy {
        name: "failing".into(),
        max_attempts: 1000,
        ..fast_policy()
    };
    let mut first = subscription(&struggling, &app, "/a", failing.clone());
    first.policy = PolicySettings::fixed(failing);
    let configs = vec![
        first,
        subscription(&b, &app, "/b", fast_policy()),
        subscription(&c, &app, "/c", fast_policy()),
    ];
    let running = Running::start_all(configs).await;
    let (a_source, b_source, c_source) = (struggling.open().await, b.open().await, c.open().await);
    for i in 0..EACH {
        struggling
            .send(&a_source, format!("script:503\nstruggling {i}"))
            .await;
    }
    // The first queue's trouble is under way before the others get work.
    wait_for(
        "the first queue's retries",
        Duration::from_secs(30),
        async || {
            app.received()
                .iter()
                .filter(|r| r.path == "/a" && r.attempt() >= 2)
                .count()
                >= 4
        },
    )
    .await;
    for i in 0..EACH {
        b.send(&b_source, format!("b {i}")).await;
        c.send(&c_source, format!("c {i}")).await;
    }
    let delivered = |path: &'static str| {
        let app = app.clone();
        move || {
            app.received()
                .iter()
                .filter(|r| r.path == path)
                .map(|r| r.body.clone())
                .collect::<std::collections::HashSet<_>>()
                .len()
        }
    };
    let (to_b, to_c) = (delivered("/b"), delivered("/c"));
    wait_for(
        "the other two queues' messages",
        Duration::from_secs(60),
        async || to_b() == EACH && to_c() == EACH,
    )
    .await;
    let text = scrape(running.metrics_addr).await;
    let success = |queue: &str| {
        series(
            &text,
            "courier_deliveries_total",
            &format!("{queue}\",result=\"success"),
        )
    };
    assert_eq!(success(&b.queue), Some(EACH as f64), "{text}");
    assert_eq!(success(&c.queue), Some(EACH as f64), "{text}");
    assert_eq!(success(&struggling.queue), Some(0.0), "{text}");
    // The 503s halve the first queue's adaptive limit; the others' follow
    // their own answers only.
    let limit = |queue: &str| series(&text, "courier_concurrency_limit", queue).unwrap_or(0.0);
    let low = limit(&struggling.queue);
    assert!(low < 8.0, "the struggling queue's limit falls: {text}");
    assert!(
        limit(&b.queue) > low && limit(&c.queue) > low,
        "the others keep theirs: {text}"
    );
    // Each message went to its own path, named its own queue, once.
    for r in app.received() {
        let queue = r.header("courier-queue").unwrap_or_default().to_string();
        let expected = match r.path.as_str() {
            "/a" => &struggling.queue,
            "/b" => &b.queue,
            "/c" => &c.queue,
            other => panic!("a request to {other}"),
        };
        assert_eq!(&queue, expected, "{:?} at {}", r.body, r.path);
    }
    let twice = |path: &str| app.received().iter().filter(|r| r.path == path).count();
    assert_eq!((twice("/b"), twice("/c")), (EACH, EACH), "none twice");
    // Its app was not flooded meanwhile: at one delivery at a time, the
    // refusals space its deliveries out.
    let refused = app.received().iter().filter(|r| r.path == "/a").count();
    assert!(refused >= 4, "the struggling queue was offered: {refused}");
    running.stop().await;
}
