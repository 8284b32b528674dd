//! Every row of the design's classification and timing tables.

use std::time::Duration;

use bytes::Bytes;

use super::*;
use crate::model::{DeadLetterReason, Directives};

fn answered(status: u16) -> Outcome {
    Outcome::Answered {
        status,
        retry_after: None,
        retry_after_invalid: false,
        excerpt: Bytes::new(),
        directives: Default::default(),
    }
}

fn answered_with_retry_after(status: u16, secs: u64) -> Outcome {
    Outcome::Answered {
        status,
        retry_after: Some(Duration::from_secs(secs)),
        retry_after_invalid: false,
        excerpt: Bytes::new(),
        directives: Default::default(),
    }
}

/// An answer with the app's say: `Courier-Dead-Letter: <reason>` when
/// `dead_letter` is given, `Courier-Retry: never` when `never`.
fn saying(status: u16, dead_letter: Option<&str>, never: bool) -> Outcome {
    Outcome::Answered {
        status,
        retry_after: None,
        retry_after_invalid: false,
        excerpt: Bytes::new(),
        directives: Directives {
            dead_letter: dead_letter.map(str::to_string),
            retry_never: never,
            retry_unknown: None,
        },
    }
}

const NO_JITTER: f64 = 0.0;

fn no_jitter_policy() -> Policy {
    Policy::test().backoff_of(
        Duration::from_secs(1),
        Duration::from_secs(300),
        2.0,
        Jitter::None,
    )
}

#[test]
fn classification_table() {
    let policy = Policy::default();
    let rows: &[(Outcome, Class)] = &[
        (answered(200), Class::Success),
        (answered(201), Class::Success),
        (answered(204), Class::Success),
        (answered(299), Class::Success),
        (answered(408), Class::Transient),
        (answered(429), Class::Transient),
        (answered(500), Class::Transient),
        (answered(502), Class::Transient),
        (answered(503), Class::Transient),
        (answered(504), Class::Transient),
        (answered(599), Class::Transient),
        (answered(501), Class::Permanent),
        (answered(400), Class::Permanent),
        (answered(401), Class::Permanent),
        (answered(404), Class::Permanent),
        (answered(409), Class::Permanent),
        (answered(422), Class::Permanent),
        (answered(301), Class::Permanent),
        (answered(304), Class::Permanent),
        (answered(100), Class::Permanent),
        (Outcome::Timeout, Class::Timeout),
        (
            Outcome::Unreachable {
                error: "refused".into(),
            },
            Class::Unreachable,
        ),
        (
            Outcome::ConnectionLost {
                error: "reset".into(),
            },
            Class::ConnectionLost,
        ),
        (
            Outcome::Undeliverable {
                error: "too big".into(),
            },
            Class::Undeliverable,
        ),
    ];
    for (outcome, want) in rows {
        assert_eq!(policy.classify(outcome), *want, "{outcome:?}");
    }
}

fn unreachable() -> Outcome {
    Outcome::Unreachable {
        error: "connection refused".into(),
    }
}

fn connection_lost() -> Outcome {
    Outcome::ConnectionLost {
        error: "connection reset by peer".into(),
    }
}

fn undeliverable() -> Outcome {
    Outcome::Undeliverable {
        error: "too big".into(),
    }
}

/// The design's verdict table, every class under both gate states.
#[test]
fn verdict_table() {
    use GateState::{Closed, Open};
    let policy = no_jitter_policy().max_attempts(3);
    let retry = |secs: u64| Verdict::Retry {
        delay: Duration::from_secs(secs),
        attempt_used: true,
    };
    let free = |secs: u64| Verdict::Retry {
        delay: Duration::from_secs(secs),
        attempt_used: false,
    };
    let dead = |reason| Verdict::DeadLetter { reason };
    let exhausted = dead(DeadLetterReason::AttemptsExhausted);
    let permanent = dead(DeadLetterReason::PermanentStatus);
    let app_dead = dead(DeadLetterReason::AppDeadLetter);
    let rows: Vec<(Outcome, u32, GateState, Verdict)> = vec![
        // 2xx acks whatever the gate says.
        (answered(200), 1, Open, Verdict::Ack),
        (answered(200), 3, Open, Verdict::Ack),
        (answered(204), 1, Closed, Verdict::Ack),
        // Transient answers use an attempt while the app is up...
        (answered(503), 1, Open, retry(1)),
        (answered(503), 2, Open, retry(2)),
        (answered(503), 3, Open, exhausted.clone()),
        (answered(429), 1, Open, retry(1)),
        (answered(408), 2, Open, retry(2)),
        (answered(500), 2, Open, retry(2)),
        (Outcome::Timeout, 1, Open, retry(1)),
        (Outcome::Timeout, 3, Open, exhausted.clone()),
        // ...and none while the gate says it is down: an outage of any
        // length dead-letters nothing.
        (answered(503), 3, Closed, free(4)),
        (answered(500), 1, Closed, free(1)),
        (Outcome::Timeout, 3, Closed, free(4)),
        // A lost connection may be the message crashing the app: it uses
        // an attempt under either gate state.
        (connection_lost(), 1, Open, retry(1)),
        (connection_lost(), 2, Closed, retry(2)),
        (connection_lost(), 3, Open, exhausted.clone()),
        (connection_lost(), 3, Closed, exhausted.clone()),
        // No connection: the app never saw the message.
        (unreachable(), 3, Open, free(4)),
        (unreachable(), 3, Closed, free(4)),
        (unreachable(), 100, Open, free(300)),
        // An answer is an answer: permanent under either state.
        (answered(400), 1, Open, permanent.clone()),
        (answered(501), 1, Open, permanent.clone()),
        (answered(302), 1, Open, permanent.clone()),
        (answered(404), 2, Closed, permanent.clone()),
        (
            undeliverable(),
            1,
            Open,
            dead(DeadLetterReason::Undeliverable),
        ),
        (
            undeliverable(),
            1,
            Closed,
            dead(DeadLetterReason::Undeliverable),
        ),
        // The app's say. Courier-Dead-Letter stops any answer but a 2xx,
        // at any attempt, under either gate state.
        (
            saying(500, Some("poison"), false),
            1,
            Open,
            app_dead.clone(),
        ),
        (
            saying(503, Some("poison"), false),
            1,
            Closed,
            app_dead.clone(),
        ),
        (saying(429, Some(""), false), 2, Open, app_dead.clone()),
        (
            saying(404, Some("no such order"), false),
            1,
            Open,
            app_dead.clone(),
        ),
        (saying(302, Some("moved"), true), 1, Open, app_dead.clone()),
        // A 2xx is an ack: the app has the message.
        (saying(200, Some("poison"), false), 1, Open, Verdict::Ack),
        (saying(204, None, true), 1, Open, Verdict::Ack),
        // Courier-Retry: never makes a retryable answer final...
        (saying(503, None, true), 1, Open, permanent.clone()),
        (saying(500, None, true), 1, Closed, permanent.clone()),
        (saying(408, None, true), 2, Open, permanent.clone()),
        (saying(429, None, true), 1, Open, permanent.clone()),
        // ...and leaves a permanent one as it was.
        (saying(400, None, true), 1, Open, permanent.clone()),
    ];
    for (outcome, attempt, gate, want) in rows {
        let got = decide(&policy, &outcome, attempt, gate, NO_JITTER).verdict;
        assert_eq!(got, want, "{outcome:?} at attempt {attempt}, gate {gate:?}");
    }
}

/// `appDirectives: false`: the app's headers change nothing, and no
/// dead letter records one.
#[test]
fn app_directives_off_table() {
    let off = no_jitter_policy().max_attempts(3).app_directives(false);
    let on = no_jitter_policy().max_attempts(3);
    let retry = |secs: u64| Verdict::Retry {
        delay: Duration::from_secs(secs),
        attempt_used: true,
    };
    let permanent = Verdict::DeadLetter {
        reason: DeadLetterReason::PermanentStatus,
    };
    let rows: Vec<(Outcome, Verdict)> = vec![
        (saying(500, Some("poison"), false), retry(1)),
        (saying(503, None, true), retry(1)),
        (saying(404, Some("no such order"), false), permanent.clone()),
        (saying(200, Some("poison"), true), Verdict::Ack),
    ];
    for (outcome, want) in rows {
        let got = decide(&off, &outcome, 1, GateState::Open, NO_JITTER).verdict;
        assert_eq!(got, want, "{outcome:?}");
        assert_eq!(off.directive_in_force(&outcome), None, "{outcome:?}");
    }
    // What the dead letter records when they are on.
    let rows = [
        (
            saying(500, Some("poison"), false),
            Some("Courier-Dead-Letter: poison"),
        ),
        (
            saying(404, Some("no such order"), true),
            Some("Courier-Dead-Letter: no such order"),
        ),
        (saying(503, None, true), Some("Courier-Retry: never")),
        (saying(400, None, true), None),
        (saying(503, None, false), None),
        (saying(200, Some("poison"), true), None),
        (Outcome::Timeout, None),
    ];
    for (outcome, want) in rows {
        assert_eq!(
            on.directive_in_force(&outcome).as_deref(),
            want,
            "{outcome:?}"
        );
    }
}

/// Retry-After sets the least delay on every retryable status, not only
/// 429 and 503; a timeout has no header, so its backoff stands.
#[test]
fn retry_after_on_every_retryable_status() {
    let policy = no_jitter_policy().retry_after_honored(true, Duration::from_secs(60));
    let retry = |secs: u64| Verdict::Retry {
        delay: Duration::from_secs(secs),
        attempt_used: true,
    };
    for status in [408, 429, 500, 502, 503, 504] {
        let got = decide(
            &policy,
            &answered_with_retry_after(status, 7),
            1,
            GateState::Open,
            NO_JITTER,
        );
        assert_eq!(got.class, Class::Transient, "{status}");
        assert_eq!(got.verdict, retry(7), "{status}");
    }
    // A status a policy makes retryable (404 and 409 while an app starts,
    // examples/app-starting.yaml) honours it the same way.
    let starting = Policy::from_spec(
        "starting",
        &serde_saphyr::from_str::<RetryPolicySpec>(
            "statusCodes: {retry: [\"404\", \"409\", \"408\", \"429\", \"5xx\"], deadLetter: [\"501\", \"4xx\"]}\nbackoff: {jitter: none}",
        )
        .unwrap(),
    )
    .unwrap();
    for status in [404, 409] {
        assert_eq!(
            decide(
                &starting,
                &answered_with_retry_after(status, 7),
                1,
                GateState::Open,
                NO_JITTER
            )
            .verdict,
            retry(7),
            "{status}"
        );
    }
    assert_eq!(
        decide(&policy, &Outcome::Timeout, 1, GateState::Open, NO_JITTER).verdict,
        retry(1)
    );
    // Courier-Retry: never beats Retry-After: the answer is final.
    let mut final_answer = answered_with_retry_after(503, 7);
    if let Outcome::Answered { directives, .. } = &mut final_answer {
        directives.retry_never = true;
    }
    assert_eq!(
        decide(&policy, &final_answer, 1, GateState::Open, NO_JITTER).verdict,
        Verdict::DeadLetter {
            reason: DeadLetterReason::PermanentStatus
        }
    );
}

#[test]
fn the_class_travels_with_the_verdict() {
    let policy = Policy::test();
    let class = |outcome: Outcome| decide(&policy, &outcome, 1, GateState::Open, NO_JITTER).class;
    assert_eq!(class(connection_lost()), Class::ConnectionLost);
    assert_eq!(Class::ConnectionLost.as_str(), "connection-lost");
    assert!(Class::result_labels().contains(&"connection-lost"));
    assert_eq!(class(unreachable()), Class::Unreachable);
    assert_eq!(class(answered(503)), Class::Transient);
    assert_eq!(class(saying(503, Some("poison"), false)), Class::Permanent);
    assert_eq!(class(saying(503, None, true)), Class::Permanent);
    assert_eq!(class(saying(200, Some("poison"), true)), Class::Success);
    assert_eq!(DeadLetterReason::AppDeadLetter.as_str(), "app-dead-letter");
    assert!(DeadLetterReason::labels().contains(&"app-dead-letter"));
}

/// A free retry still honours Retry-After: the app asked for the wait.
#[test]
fn a_closed_gate_keeps_retry_after() {
    let policy = no_jitter_policy();
    assert_eq!(
        decide(
            &policy,
            &answered_with_retry_after(503, 30),
            1,
            GateState::Closed,
            NO_JITTER
        )
        .verdict,
        Verdict::Retry {
            delay: Duration::from_secs(30),
            attempt_used: false
        }
    );
}

#[test]
fn one_attempt_means_no_retry() {
    let policy = no_jitter_policy().max_attempts(1);
    assert_eq!(
        decide(&policy, &answered(503), 1, GateState::Open, NO_JITTER).verdict,
        Verdict::DeadLetter {
            reason: DeadLetterReason::AttemptsExhausted
        }
    );
}

#[test]
fn status_code_matching_exact_beats_class() {
    let spec = RetryPolicySpec {
        status_codes: Some(StatusCodesSpec {
            retry: Some(vec!["409".into(), "5xx".into()]),
            dead_letter: Some(vec!["4xx".into(), "503".into()]),
        }),
        ..Default::default()
    };
    let policy = Policy::from_spec("p", &spec).unwrap();
    let rows = [
        (409, Class::Transient),
        (400, Class::Permanent),
        (503, Class::Permanent),
        (500, Class::Transient),
        // Nobody listed 408 or 429 here: unmatched non-2xx is permanent.
        (408, Class::Permanent),
        (429, Class::Permanent),
        (302, Class::Permanent),
    ];
    for (status, want) in rows {
        assert_eq!(policy.classify(&answered(status)), want, "{status}");
    }
}

#[test]
fn backoff_grows_and_is_capped() {
    let policy = Policy::test().backoff_of(
        Duration::from_secs(1),
        Duration::from_secs(10),
        2.0,
        Jitter::None,
    );
    let rows = [
        (1, 1),
        (2, 2),
        (3, 4),
        (4, 8),
        (5, 10),
        (50, 10),
        (u32::MAX, 10),
    ];
    for (n, secs) in rows {
        assert_eq!(policy.backoff(n), Duration::from_secs(secs), "n={n}");
    }
    let flat = Policy::test().backoff_of(
        Duration::from_millis(500),
        Duration::from_secs(10),
        1.0,
        Jitter::None,
    );
    assert_eq!(flat.backoff(7), Duration::from_millis(500));
}

#[test]
fn jitter_modes() {
    let base = Duration::from_secs(8);
    let policy = |jitter| Policy::test().backoff_of(base, base, 2.0, jitter);
    let rows = [
        (Jitter::None, 0.0, base),
        (Jitter::None, 0.99, base),
        (Jitter::Full, 0.0, Duration::ZERO),
        (Jitter::Full, 0.5, Duration::from_secs(4)),
        (Jitter::Full, 0.75, Duration::from_secs(6)),
        (Jitter::Equal, 0.0, Duration::from_secs(4)),
        (Jitter::Equal, 0.5, Duration::from_secs(6)),
        (Jitter::Equal, 1.0, Duration::from_secs(8)),
    ];
    for (jitter, sample, want) in rows {
        assert_eq!(
            policy(jitter).jittered_backoff(1, sample),
            want,
            "{jitter:?} {sample}"
        );
    }
}

#[test]
fn retry_after_rows() {
    let honored = no_jitter_policy().retry_after_honored(true, Duration::from_secs(60));
    let ignored = no_jitter_policy().retry_after_honored(false, Duration::from_secs(60));
    let delay = |policy: &Policy, outcome: Outcome, attempt| match decide(
        policy,
        &outcome,
        attempt,
        GateState::Open,
        NO_JITTER,
    )
    .verdict
    {
        Verdict::Retry { delay, .. } => delay,
        other => panic!("expected a retry, got {other:?}"),
    };
    // Retry-After longer than the backoff wins.
    assert_eq!(
        delay(&honored, answered_with_retry_after(429, 30), 1),
        Duration::from_secs(30)
    );
    // The backoff wins when it is longer.
    assert_eq!(
        delay(&honored, answered_with_retry_after(503, 1), 4),
        Duration::from_secs(8)
    );
    // Capped by retryAfter.max.
    assert_eq!(
        delay(&honored, answered_with_retry_after(429, 7200), 1),
        Duration::from_secs(60)
    );
    // A past date arrives as zero: the backoff stands.
    assert_eq!(
        delay(&honored, answered_with_retry_after(503, 0), 2),
        Duration::from_secs(2)
    );
    // Not honored: the backoff only.
    assert_eq!(
        delay(&ignored, answered_with_retry_after(429, 30), 1),
        Duration::from_secs(1)
    );
    // An invalid value was dropped by the reader: the backoff only.
    let invalid = Outcome::Answered {
        status: 503,
        retry_after: None,
        retry_after_invalid: true,
        excerpt: Bytes::new(),
        directives: Default::default(),
    };
    assert_eq!(delay(&honored, invalid, 1), Duration::from_secs(1));
    // A Retry-After on a permanent answer changes nothing.
    assert_eq!(
        decide(
            &honored,
            &answered_with_retry_after(400, 30),
            1,
            GateState::Open,
            NO_JITTER
        )
        .verdict,
        Verdict::DeadLetter {
            reason: DeadLetterReason::PermanentStatus
        }
    );
}

#[test]
fn validation_rejects_nonsense() {
    let spec = |yaml: &str| -> RetryPolicySpec { serde_saphyr::from_str(yaml).unwrap() };
    let rows = [
        ("maxAttempts: 0", "spec.maxAttempts"),
        ("maxAttempts: 1001", "spec.maxAttempts"),
        ("maxAttempts: -3", "spec.maxAttempts"),
        ("timeout: 0s", "spec.timeout"),
        ("timeout: 5", "spec.timeout"),
        ("backoff: {initial: 1m, max: 1s}", "spec.backoff.max"),
        ("backoff: {multiplier: 0.9}", "spec.backoff.multiplier"),
        ("retryAfter: {max: forever}", "spec.retryAfter.max"),
        (
            "statusCodes: {retry: [\"5xx\", \"50\"]}",
            "spec.statusCodes.retry",
        ),
        (
            "statusCodes: {deadLetter: [\"200\"]}",
            "spec.statusCodes.deadLetter",
        ),
        ("statusCodes: {retry: [\"2xx\"]}", "spec.statusCodes.retry"),
        ("statusCodes: {retry: [\"4xx\"]}", "spec.statusCodes"),
        ("rateLimit: {perSecond: 0}", "spec.rateLimit.perSecond"),
        ("rateLimit: {perSecond: -2}", "spec.rateLimit.perSecond"),
        ("rateLimit: {perSecond: 200000}", "spec.rateLimit.perSecond"),
        (
            "rateLimit: {perSecond: 5, burst: 0}",
            "spec.rateLimit.burst",
        ),
        ("paused: true\npausedUntil: tomorrow", "spec.pausedUntil"),
        ("maxAge: 0s", "spec.maxAge"),
        ("maxAge: 1d", "spec.maxAge"),
        (
            "routes: [{match: 'type ==', path: /a}]",
            "spec.routes[0].match",
        ),
        (
            "routes: [{match: 'true', path: /a}, {match: 'status == 500', path: /b}]",
            "spec.routes[1].match",
        ),
        (
            "routes: [{match: 'true', path: orders}]",
            "spec.routes[0].path",
        ),
        (
            "routes: [{match: 'true', path: '/a b'}]",
            "spec.routes[0].path",
        ),
    ];
    assert!(
        serde_saphyr::from_str::<RetryPolicySpec>("appDirectives: sometimes").is_err(),
        "appDirectives is a boolean"
    );
    assert!(
        !Policy::from_spec("p", &spec("appDirectives: false"))
            .unwrap()
            .app_directives
    );
    for (yaml, field) in rows {
        let err = Policy::from_spec("p", &spec(yaml)).unwrap_err();
        assert_eq!(err.field, field, "{yaml}: {err}");
    }
}

#[test]
fn omitted_fields_take_the_defaults() {
    let policy = Policy::from_spec("p", &RetryPolicySpec::default()).unwrap();
    assert_eq!(
        policy,
        Policy {
            name: "p".into(),
            ..Policy::default()
        }
    );
    assert_eq!(policy.label(), "p@0");
}

#[test]
fn flow_control_fields_are_read_with_their_defaults() {
    let spec = |yaml: &str| -> RetryPolicySpec { serde_saphyr::from_str(yaml).unwrap() };
    let policy = Policy::from_spec(
        "p",
        &spec("rateLimit: {perSecond: 20}\nmaxAge: 90m\npaused: true\npausedReason: incident 42"),
    )
    .unwrap();
    assert_eq!(
        policy.rate_limit,
        Some(RateLimit {
            per_second: 20.0,
            burst: 5,
            scope: RateScope::Pod,
        })
    );
    assert_eq!(policy.max_age, Some(Duration::from_secs(5400)));
    let now = SystemTime::now();
    assert_eq!(
        policy.paused_at(now).map(|p| p.reason.as_str()),
        Some("incident 42")
    );
    let queue = Policy::from_spec(
        "p",
        &spec("rateLimit: {perSecond: 0.5, burst: 1, scope: queue}"),
    )
    .unwrap();
    assert_eq!(
        queue.rate_limit.map(|r| (r.burst, r.scope)),
        Some((1, RateScope::Queue))
    );
    // Empty strings mean "none", as the design's document shows them.
    let empty =
        Policy::from_spec("p", &spec("maxAge: \"\"\npausedUntil: \"\"\npaused: false")).unwrap();
    assert_eq!((empty.max_age, empty.pause), (None, None));
    assert!(
        serde_saphyr::from_str::<RetryPolicySpec>("rateLimit: {burst: 3}").is_err(),
        "perSecond is required"
    );
    assert!(
        serde_saphyr::from_str::<RetryPolicySpec>("rateLimit: {perSecond: 1, scope: cluster}")
            .is_err()
    );
}

#[test]
fn a_pause_with_an_end_is_over_at_its_end() {
    let spec: RetryPolicySpec =
        serde_saphyr::from_str("paused: true\npausedUntil: 2026-12-06T18:00:00Z").unwrap();
    let policy = Policy::from_spec("p", &spec).unwrap();
    let until = parse_time(b"2026-12-06T18:00:00Z").unwrap();
    assert!(policy.paused_at(until - Duration::from_secs(1)).is_some());
    assert!(policy.paused_at(until).is_none());
    // pausedUntil alone pauses nothing: paused says whether.
    let spec: RetryPolicySpec =
        serde_saphyr::from_str("pausedUntil: 2999-01-01T00:00:00Z").unwrap();
    assert!(Policy::from_spec("p", &spec).unwrap().pause.is_none());
}

#[test]
fn code_match_parsing() {
    assert_eq!(CodeMatch::parse("503"), Some(CodeMatch::Exact(503)));
    assert_eq!(CodeMatch::parse("5xx"), Some(CodeMatch::Class(5)));
    for bad in ["6xx", "5XX", "50", "5030", "abc", "", "0xx", "099"] {
        assert_eq!(CodeMatch::parse(bad), None, "{bad}");
    }
}

#[test]
fn routes_pick_the_first_match_and_unrouted_says_the_rest() {
    let spec = |yaml: &str| -> RetryPolicySpec { serde_saphyr::from_str(yaml).unwrap() };
    let event = |kind: &str, total: i64| Message {
        id: "1".into(),
        body: Bytes::from(format!(
            r#"{{"specversion":"1.0","type":"{kind}","source":"/shop","id":"e1","data":{{"total":{total}}}}}"#
        )),
        headers: vec![("content-type".into(), "application/cloudevents+json".into())],
    };
    let routes = "routes:\n\
        - {match: 'type == \"order.created\" && data.total > 100', path: /big}\n\
        - {match: 'type.startsWith(\"order.\")', path: '/orders?all=1'}\n\
        - {match: 'data.total > \"ten\"', path: /never}\n";
    let policy = Policy::from_spec("p", &spec(&format!("{routes}unrouted: dead-letter"))).unwrap();
    let path = |choice: RouteChoice<'_>| match choice.routed {
        Routed::Path(uri) => uri.to_string(),
        other => format!("{other:?}"),
    };
    assert_eq!(
        path(policy.route(&event("order.created", 150), "q", 1)),
        "/big"
    );
    assert_eq!(
        path(policy.route(&event("order.created", 50), "q", 1)),
        "/orders?all=1"
    );
    let refund = policy.route(&event("refund.created", 50), "q", 1);
    assert_eq!(refund.routed, Routed::DeadLetter);
    // The third route compares an int with a string: an error, counted,
    // and not a match.
    assert_eq!((refund.unmatched, refund.errors), (true, 1));
    let acking = Policy::from_spec("p", &spec(&format!("{routes}unrouted: ack"))).unwrap();
    assert_eq!(
        acking.route(&event("refund.created", 5), "q", 1).routed,
        Routed::Ack
    );
    let defaulting = Policy::from_spec("p", &spec(routes)).unwrap();
    assert_eq!(defaulting.unrouted, Unrouted::Default);
    let choice = defaulting.route(&event("refund.created", 5), "q", 1);
    assert_eq!((choice.routed, choice.unmatched), (Routed::Default, true));
    // Without routes, every message goes to the app URL's path, unrouted
    // or not.
    let plain = Policy::from_spec("p", &spec("unrouted: dead-letter")).unwrap();
    let choice = plain.route(&event("refund.created", 5), "q", 1);
    assert_eq!((choice.routed, choice.unmatched), (Routed::Default, false));
    // A route sees the queue, the attempt and the headers.
    let by_record = Policy::from_spec(
        "p",
        &spec("routes: [{match: 'queue == \"q\" && attempts > 1 && headers[\"content-type\"].endsWith(\"json\")', path: /again}]"),
    )
    .unwrap();
    assert_eq!(path(by_record.route(&event("x", 1), "q", 2)), "/again");
    assert_eq!(path(by_record.route(&event("x", 1), "q", 1)), "Default");
}

#[test]
fn a_route_names_only_what_a_message_has() {
    let spec = |yaml: &str| -> RetryPolicySpec { serde_saphyr::from_str(yaml).unwrap() };
    let err = Policy::from_spec("p", &spec("routes: [{match: 'reason == \"x\"', path: /a}]"))
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("\"reason\" describes a dead letter; a route sees only the message"),
        "{text}"
    );
    assert!(
        text.contains("the variables: queue, attempts, headers, body, type, source, subject, data"),
        "{text}"
    );
    let many = (0..=MOST_ROUTES)
        .map(|i| format!("{{match: 'true', path: /r{i}}}"))
        .collect::<Vec<_>>()
        .join(", ");
    let err = Policy::from_spec("p", &spec(&format!("routes: [{many}]"))).unwrap_err();
    assert_eq!(err.field, "spec.routes", "{err}");
}

#[test]
fn batch_entry_decisions() {
    let policy = no_jitter_policy();
    let success = decide_entry(&policy, EntryAnswer::Success, 1, None, 0.5);
    assert_eq!(success.verdict, Verdict::Ack);
    let drop = decide_entry(&policy, EntryAnswer::Drop, 1, None, 0.5);
    assert_eq!(
        drop.verdict,
        Verdict::DeadLetter {
            reason: DeadLetterReason::AppDeadLetter
        }
    );
    let retry = decide_entry(&policy, EntryAnswer::Retry, 1, None, 0.5);
    assert!(matches!(
        retry.verdict,
        Verdict::Retry {
            attempt_used: true,
            ..
        }
    ));
    let asked = decide_entry(
        &policy,
        EntryAnswer::Retry,
        1,
        Some(Duration::from_secs(3600 * 24)),
        0.5,
    );
    let Verdict::Retry { delay, .. } = asked.verdict else {
        panic!("{asked:?}");
    };
    assert_eq!(delay, policy.retry_after.max);
    let last = decide_entry(&policy, EntryAnswer::Retry, policy.max_attempts, None, 0.5);
    assert_eq!(
        last.verdict,
        Verdict::DeadLetter {
            reason: DeadLetterReason::AttemptsExhausted
        }
    );
}
