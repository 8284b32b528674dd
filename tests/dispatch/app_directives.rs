//! The app's say over a retry (docs/design.md, "The app's say"), end to end
//! with a sidecar against a real broker and a real HTTP app on loopback:
//! - `Courier-Dead-Letter: <reason>` dead-letters at once, on a 500 or a
//!   404 alike, as `app-dead-letter` with the app's words in
//!   `courier-app-directive`; on a 2xx it changes nothing (an ack);
//! - `Courier-Retry: never` makes a 503 final (`permanent-status`, the
//!   directive recorded); another value is ignored;
//! - `appDirectives: false` turns both off;
//! - `Retry-After` is honoured on every retryable status, not only 429/503.
//!
//! Each on every broker: the new dead-letter field goes through each
//! source's own dead-letter path.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use courier::source::{DeadLetter, Source};

const SETTLE: Duration = Duration::from_secs(30);

async fn letter_of(source: &Arc<dyn Source>, fixture: &Fixture, id: &str) -> DeadLetter {
    fixture
        .dead_letters(source)
        .await
        .into_iter()
        .find(|l| l.field("courier-message-id") == Some(id))
        .unwrap_or_else(|| panic!("no dead letter for message {id}"))
}

/// Sends each script as its own message, runs a sidecar with `policy`
/// until every one is settled, and returns the ids in the same order.
async fn run_scripts(
    fixture: &Fixture,
    app: &TestApp,
    policy: courier::policy::Policy,
    bodies: &[&str],
) -> (Arc<dyn Source>, Vec<String>) {
    let source = fixture.open().await;
    let mut ids = Vec::new();
    for body in bodies {
        ids.push(fixture.send(&source, body.to_string()).await);
    }
    let running = Running::start(run_config(fixture, app, policy)).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    (source, ids)
}

/// (body, deliveries the app sees, dead-letter reason or none for an ack,
/// the `courier-app-directive` recorded)
type Row<'a> = (&'a str, usize, Option<&'a str>, Option<&'a str>);

async fn check_rows(fixture: Fixture, policy: courier::policy::Policy, rows: &[Row<'_>]) {
    let app = TestApp::start().await;
    let bodies: Vec<&str> = rows.iter().map(|r| r.0).collect();
    let (source, ids) = run_scripts(&fixture, &app, policy, &bodies).await;
    let letters = fixture.dead_letters(&source).await;
    for ((body, deliveries, reason, directive), id) in rows.iter().zip(&ids) {
        assert_eq!(
            app.received_body(body.as_bytes()).len(),
            *deliveries,
            "deliveries of {body:?}"
        );
        let letter = letters
            .iter()
            .find(|l| l.field("courier-message-id") == Some(id.as_str()));
        let Some(reason) = reason else {
            assert!(letter.is_none(), "{body:?} was acked, not {letter:?}");
            continue;
        };
        let letter = letter.unwrap_or_else(|| panic!("no dead letter for {body:?}"));
        assert_eq!(letter.field("courier-reason"), Some(*reason), "{body:?}");
        assert_eq!(
            letter.field("courier-app-directive"),
            *directive,
            "{body:?}: {letter:?}"
        );
        assert_eq!(letter.body.as_ref(), body.as_bytes(), "the body is kept");
    }
    assert_eq!(
        letters.len(),
        rows.iter().filter(|r| r.2.is_some()).count(),
        "{letters:?}"
    );
}

async fn courier_dead_letter_stops_any_answer_but_a_2xx(fixture: Fixture) {
    let rows: &[Row] = &[
        (
            "script:500+courier-dead-letter=unknown SKU 42\nsku",
            1,
            Some("app-dead-letter"),
            Some("Courier-Dead-Letter: unknown SKU 42"),
        ),
        (
            "script:503ra30+courier-dead-letter=poison\nbusy",
            1,
            Some("app-dead-letter"),
            Some("Courier-Dead-Letter: poison"),
        ),
        (
            "script:404+courier-dead-letter=no such order\norder",
            1,
            Some("app-dead-letter"),
            Some("Courier-Dead-Letter: no such order"),
        ),
        // The app has the message: a 2xx is an ack whatever it adds.
        ("script:200+courier-dead-letter=oops\nacked", 1, None, None),
        // The same status without the header: the policy alone decides.
        ("script:500,200\nplain", 2, None, None),
        ("script:404\nplain 404", 1, Some("permanent-status"), None),
    ];
    check_rows(fixture, fast_policy(), rows).await;
}

async fn courier_dead_letter_keeps_the_whole_record(fixture: Fixture) {
    let app = TestApp::start().await;
    let body = "script:503,500+courier-dead-letter=gave up on it\nsecond";
    let (source, ids) = run_scripts(&fixture, &app, fast_policy(), &[body]).await;
    let letter = letter_of(&source, &fixture, &ids[0]).await;
    for (name, value) in [
        ("courier-reason", "app-dead-letter"),
        (
            "courier-app-directive",
            "Courier-Dead-Letter: gave up on it",
        ),
        ("courier-status", "500"),
        ("courier-attempts", "2"),
        ("courier-policy", "test@1"),
        ("courier-queue", fixture.queue.as_str()),
        ("courier-response-excerpt", "answer 500 to attempt 2"),
    ] {
        assert_eq!(letter.field(name), Some(value), "{name} in {letter:?}");
    }
    assert_eq!(app.received_body(body.as_bytes()).len(), 2);
}

async fn courier_retry_never_makes_a_retryable_answer_final(fixture: Fixture) {
    let rows: &[Row] = &[
        (
            "script:503+courier-retry=never\nfinal",
            1,
            Some("permanent-status"),
            Some("Courier-Retry: never"),
        ),
        (
            "script:429+courier-retry=NEVER\nfinal 429",
            1,
            Some("permanent-status"),
            Some("Courier-Retry: never"),
        ),
        // Already final: nothing for the directive to decide.
        (
            "script:400+courier-retry=never\nbad",
            1,
            Some("permanent-status"),
            None,
        ),
        // Only `never` is understood; anything else is ignored (and logged).
        ("script:503+courier-retry=later,200\nlater", 2, None, None),
    ];
    check_rows(fixture, fast_policy(), rows).await;
}

async fn app_directives_off_leaves_the_policy_alone(fixture: Fixture) {
    let rows: &[Row] = &[
        (
            "script:500+courier-dead-letter=x,200\nretried",
            2,
            None,
            None,
        ),
        (
            "script:503+courier-retry=never\nexhausted",
            3,
            Some("attempts-exhausted"),
            None,
        ),
        (
            "script:404+courier-dead-letter=gone\nstatus",
            1,
            Some("permanent-status"),
            None,
        ),
    ];
    check_rows(fixture, fast_policy().app_directives(false), rows).await;
}

/// Retry-After: 1 on every retryable status makes the next attempt wait at
/// least a second (the policy's own backoff is 50 ms); a timeout carries no
/// header, so its backoff stands.
async fn retry_after_on_every_retryable_status(fixture: Fixture) {
    let app = TestApp::start().await;
    let statuses = [408, 429, 500, 502, 503, 504];
    let bodies: Vec<String> = statuses
        .iter()
        .map(|s| format!("script:{s}ra1,200\n{s}"))
        .collect();
    let refs: Vec<&str> = bodies.iter().map(String::as_str).collect();
    let (source, _) = run_scripts(&fixture, &app, fast_policy(), &refs).await;
    assert!(fixture.dead_letters(&source).await.is_empty());
    for (status, body) in statuses.iter().zip(&bodies) {
        let seen = app.received_body(body.as_bytes());
        assert_eq!(seen.len(), 2, "{status}: retried once, then acked");
        let waited = seen[1].at - seen[0].at;
        assert!(
            waited >= Duration::from_millis(950),
            "{status}: Retry-After: 1 honoured, waited {waited:?}"
        );
        eprintln!("{status} with Retry-After: 1 came back after {waited:?}");
    }
    // On its own: the 429's Retry-After also holds every delivery to the
    // app for its second (the limit is the app's), which would hide this.
    let timeout = "script:sleep700,200\ntimeout";
    run_scripts(&fixture, &app, fast_policy(), &[timeout]).await;
    let timed_out = app.received_body(timeout.as_bytes());
    assert_eq!(timed_out.len(), 2);
    let waited = timed_out[1].at - timed_out[0].at;
    // 500 ms timeout + 50 ms backoff. A Retry-After second honoured on a
    // timeout would add 1 s to that: 1.55 s at least.
    assert!(waited < Duration::from_millis(1400), "timeout: {waited:?}");
}

crate::per_source!(
    [
        redis => Fixture::redis(),
        embedded => Fixture::embedded(),
        amqp => Fixture::amqp(),
        nats => Fixture::nats(),
    ],
    [
        courier_dead_letter_stops_any_answer_but_a_2xx,
        courier_dead_letter_keeps_the_whole_record,
        courier_retry_never_makes_a_retryable_answer_final,
        app_directives_off_leaves_the_policy_alone,
        retry_after_on_every_retryable_status,
    ]
);
