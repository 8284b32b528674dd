//! The steps with paused time: reading, judging and settling, the
//! Retry-After hold, the keep-alive.

use super::*;

// === Reading ===

#[tokio::test(start_paused = true)]
async fn reads_that_keep_failing_make_courier_not_ready_until_one_works() {
    let source = MemorySource::with(&["a"]);
    let shared = Shared::new(dispatcher(
        source.clone(),
        closed_port().await,
        fast_policy(3),
    ));
    shared.d.health.set_ready(true);
    let shutdown = CancellationToken::new();
    let mut reader = Reader::default();
    source.fail_reads.store(true, Ordering::SeqCst);
    for failures in 1..=READ_FAILURE_RUN {
        let clock = Instant::now();
        assert!(matches!(
            shared.read(&mut reader, &shutdown).await,
            Flow::Again
        ));
        assert_eq!(reader.failures, failures);
        assert_eq!(
            clock.elapsed(),
            Duration::from_millis(100 * 2u64.pow(failures)),
            "a failed read waits before the next, longer each time"
        );
        assert_eq!(
            shared.d.health.is_ready(),
            failures < READ_FAILURE_RUN,
            "after {failures} failed reads"
        );
    }
    assert_eq!(shared.read_errors.get(), u64::from(READ_FAILURE_RUN));
    source.fail_reads.store(false, Ordering::SeqCst);
    assert!(matches!(
        shared.read(&mut reader, &shutdown).await,
        Flow::Launch(_)
    ));
    assert_eq!(reader.ahead.len(), 1);
    assert!(shared.d.health.is_ready(), "one good read: ready again");
}

#[tokio::test(start_paused = true)]
async fn a_read_returns_one_round_of_the_limit() {
    let bodies: Vec<String> = (0..10).map(|i| format!("m{i}")).collect();
    let bodies: Vec<&str> = bodies.iter().map(String::as_str).collect();
    let source = MemorySource::with(&bodies);
    let shared = Shared::new(dispatcher(source, closed_port().await, fast_policy(3)));
    let mut reader = Reader::default();
    let flow = shared.read(&mut reader, &CancellationToken::new()).await;
    assert!(matches!(flow, Flow::Launch(_)));
    assert_eq!(reader.ahead.len(), 4, "the limit is --concurrency 4");
}

/// A stop while the source waits on an empty queue asks the source to end
/// the wait, and the read returns then, not when the wait would have.
#[tokio::test(start_paused = true)]
async fn a_stop_interrupts_a_waiting_read() {
    const WAIT: Duration = Duration::from_secs(30);
    let source = Arc::new(MemorySource {
        long_wait: Some(WAIT),
        ..MemorySource::default()
    });
    let shared = Shared::new(dispatcher(source, closed_port().await, fast_policy(3)));
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop.cancel();
    });
    let clock = Instant::now();
    let mut reader = Reader::default();
    let flow = shared.read(&mut reader, &shutdown).await;
    assert!(matches!(flow, Flow::Launch(_)));
    assert!(reader.ahead.is_empty());
    assert_eq!(
        clock.elapsed(),
        Duration::from_secs(1),
        "the read ended at the stop, not after its {WAIT:?} wait"
    );
}

// === Judging and settling ===

/// The verdict table, through the dispatcher: the gate's state goes into
/// the decision, and the source sees the settlement the verdict asks for.
#[tokio::test(start_paused = true)]
async fn judge_and_settle_rows() {
    struct Row {
        outcome: Outcome,
        attempt: u32,
        gate: GateState,
        /// "ack", "retry N" (the next attempt) or the dead-letter reason.
        want: &'static str,
    }
    let rows = [
        Row {
            outcome: answered(200, None),
            attempt: 1,
            gate: GateState::Open,
            want: "ack",
        },
        Row {
            outcome: answered(503, None),
            attempt: 1,
            gate: GateState::Open,
            want: "retry 2",
        },
        Row {
            outcome: answered(503, None),
            attempt: 3,
            gate: GateState::Open,
            want: "attempts-exhausted",
        },
        Row {
            outcome: answered(503, None),
            attempt: 3,
            gate: GateState::Closed,
            want: "retry 3",
        },
        Row {
            outcome: Outcome::Timeout,
            attempt: 2,
            gate: GateState::Closed,
            want: "retry 2",
        },
        Row {
            outcome: Outcome::ConnectionLost {
                error: "reset".into(),
            },
            attempt: 2,
            gate: GateState::Closed,
            want: "retry 3",
        },
        Row {
            outcome: Outcome::ConnectionLost {
                error: "reset".into(),
            },
            attempt: 3,
            gate: GateState::Open,
            want: "attempts-exhausted",
        },
        Row {
            outcome: Outcome::Unreachable {
                error: "refused".into(),
            },
            attempt: 3,
            gate: GateState::Open,
            want: "retry 3",
        },
        Row {
            outcome: answered(400, None),
            attempt: 1,
            gate: GateState::Closed,
            want: "permanent-status",
        },
        Row {
            outcome: Outcome::Undeliverable {
                error: "too big".into(),
            },
            attempt: 1,
            gate: GateState::Open,
            want: "undeliverable",
        },
    ];
    for (i, row) in rows.into_iter().enumerate() {
        let source = MemorySource::with(&[]);
        let mut d = dispatcher(source.clone(), closed_port().await, fast_policy(3));
        // With a health path only the path opens a closed gate, so the row's
        // state holds while the outcome is judged.
        d.app_health_path = Some("/healthz".into());
        let shared = Shared::new(d);
        if row.gate == GateState::Closed {
            shared.report(Evidence::HealthPath(false)).await;
        }
        assert_eq!(shared.gate.state(), row.gate);
        let policy = shared.d.policy.current();
        let decision = shared
            .judge(&row.outcome, &policy, row.attempt, Duration::from_millis(1))
            .await;
        let message = delivery(&format!("{i}-0"), "body");
        let mut message = message;
        message.attempt = row.attempt;
        shared
            .settle(
                &message,
                &row.outcome,
                &decision,
                &policy,
                SystemTime::now(),
            )
            .await;
        let s = source.state();
        let got = if !s.acked.is_empty() {
            "ack".to_string()
        } else if let Some((_, next, _)) = s.retried.first() {
            format!("retry {next}")
        } else if let Some((_, failure)) = s.dead.first() {
            assert_eq!(failure.attempts, row.attempt);
            assert_eq!(failure.status, row.outcome.status());
            failure.reason.as_str().to_string()
        } else {
            "nothing".to_string()
        };
        assert_eq!(
            got, row.want,
            "{:?} at attempt {} with the gate {:?}",
            row.outcome, row.attempt, row.gate
        );
    }
}

/// A retry copy or a dead letter the broker refuses as too large (at
/// 21da363 a Kafka record over librdkafka's 1,000,000 bytes: the write
/// failed on every redelivery and the partition's commits stopped) is
/// dead-lettered at once as a letter that fits: `undeliverable`, saying
/// what it left out, with the answer that decided it. Small ones are not.
#[tokio::test(start_paused = true)]
async fn a_copy_refused_as_too_large_is_dead_lettered_as_one_that_fits() {
    let rows = [
        (
            answered(503, None),
            "big body",
            Some("the retry copy was refused"),
        ),
        (
            answered(400, None),
            "big body",
            Some("the dead letter was refused"),
        ),
        (answered(400, None), "ok", None),
    ];
    for (i, (outcome, body, cut)) in rows.into_iter().enumerate() {
        let source = Arc::new(MemorySource {
            refuse_over: Some(3),
            ..Default::default()
        });
        let d = dispatcher(source.clone(), closed_port().await, fast_policy(3));
        let metrics = d.metrics.clone();
        let shared = Shared::new(d);
        let policy = shared.d.policy.current();
        let decision = shared
            .judge(&outcome, &policy, 1, Duration::from_millis(1))
            .await;
        let message = delivery(&format!("{i}-0"), body);
        shared
            .settle(&message, &outcome, &decision, &policy, SystemTime::now())
            .await;
        let s = source.state();
        assert!(s.retried.is_empty(), "row {i}: {:?}", s.retried);
        let [(_, failure)] = s.dead.as_slice() else {
            panic!("row {i}: one dead letter, got {:?}", s.dead);
        };
        assert_eq!(failure.status, outcome.status(), "row {i}");
        let text = metrics.encode();
        match cut {
            Some(what) => {
                assert_eq!(failure.reason, DeadLetterReason::Undeliverable, "row {i}");
                let note = failure.cut.clone().unwrap_or_default();
                assert!(
                    note.contains(what) && note.contains("body (8 bytes)"),
                    "row {i}: {note}"
                );
                assert!(
                    text.contains(
                        r#"courier_dead_letters_total{queue="orders",reason="undeliverable"} 1"#
                    ),
                    "row {i}: {text}"
                );
                assert!(
                    text.contains(r#"courier_settle_errors_total{queue="orders"} 0"#),
                    "row {i}: {text}"
                );
            }
            None => {
                assert_eq!(failure.reason, DeadLetterReason::PermanentStatus, "row {i}");
                assert_eq!(failure.cut, None, "row {i}");
            }
        }
    }
}

#[tokio::test(start_paused = true)]
async fn answers_do_not_close_the_gate_a_refused_connection_does() {
    let source = MemorySource::with(&[]);
    let shared = Shared::new(dispatcher(source, closed_port().await, fast_policy(3)));
    shared.d.health.set_ready(true);
    let policy = shared.d.policy.current();
    for _ in 0..20 {
        shared
            .judge(&answered(503, None), &policy, 1, Duration::from_millis(1))
            .await;
    }
    assert_eq!(shared.gate.state(), GateState::Open, "503s never close it");
    assert!(shared.limiter.limit() < 4, "a run of 503s lowers the limit");
    assert_eq!(deliveries_counted(&shared, "transient"), 20);
    let refused = Outcome::Unreachable {
        error: "refused".into(),
    };
    shared.judge(&refused, &policy, 1, Duration::ZERO).await;
    assert_eq!(shared.gate.state(), GateState::Closed);
    assert!(
        !shared.d.health.is_ready(),
        "not ready while the app is down"
    );
    shared
        .judge(&answered(503, None), &policy, 1, Duration::ZERO)
        .await;
    assert_eq!(
        shared.gate.state(),
        GateState::Open,
        "an answer, even 503, opens it"
    );
    assert!(shared.d.health.is_ready());
}

// === The Retry-After hold ===

#[tokio::test(start_paused = true)]
async fn a_429_holds_new_deliveries_which_go_back_due_when_it_ends() {
    let source = MemorySource::with(&[]);
    let shared = Shared::new(dispatcher(
        source.clone(),
        closed_port().await,
        fast_policy(3),
    ));
    let policy = shared.d.policy.current();
    shared
        .judge(&answered(429, Some(5)), &policy, 1, Duration::ZERO)
        .await;
    let held = delivery("7-0", "held");
    let asked_at = SystemTime::now();
    assert!(shared.defer_if_held(&held).await, "held for 5 s");
    {
        let s = source.state();
        let (id, next, due) = &s.retried[0];
        assert_eq!((id.as_str(), *next), ("7-0", 1), "no attempt used");
        let wait = due.duration_since(asked_at).unwrap();
        let asked = Duration::from_secs(5);
        assert!(
            wait.abs_diff(asked) < Duration::from_millis(100),
            "{wait:?}"
        );
    }
    tokio::time::advance(Duration::from_secs(5)).await;
    assert!(!shared.defer_if_held(&held).await, "the hold is over");
    // The loop waits the hold out before reading again.
    shared
        .judge(&answered(429, Some(3)), &policy, 1, Duration::ZERO)
        .await;
    let clock = Instant::now();
    let mut reader = Reader::default();
    let _ = shared.next(&mut reader, &CancellationToken::new()).await;
    assert!(
        clock.elapsed() >= Duration::from_secs(3),
        "{:?}",
        clock.elapsed()
    );
}

// === Keep-alive ===

#[tokio::test(start_paused = true)]
async fn deliveries_in_flight_are_kept_claimed_a_third_of_the_visibility_apart() {
    let source = MemorySource::with(&[]);
    let mut d = dispatcher(source.clone(), closed_port().await, fast_policy(3));
    d.visibility_timeout = Duration::from_secs(90);
    let shared = Arc::new(Shared::new(d));
    let keep_alive = tokio::spawn(shared.clone().keep_alive());
    let a = shared.in_flight.register(&Arc::new(delivery("1-0", "a")));
    let b = shared.in_flight.register(&Arc::new(delivery("2-0", "b")));
    tokio::time::sleep(Duration::from_secs(31)).await;
    assert_eq!(source.state().kept_alive, [vec!["1-0", "2-0"]]);
    drop(a);
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(source.state().kept_alive[1], ["2-0"]);
    drop(b);
    tokio::time::sleep(Duration::from_secs(90)).await;
    assert_eq!(
        source.state().kept_alive.len(),
        2,
        "nothing in flight, nothing to keep"
    );
    keep_alive.abort();
}

/// Found at 21da363: Pub/Sub leases at most 600 s, but keep-alives came a
/// third of the visibility timeout apart, so under a 30 min timeout the
/// lease lapsed and another replica got the message while the app still
/// worked on it. Keep-alives come a third of the broker's longest claim
/// apart when that is shorter.
#[tokio::test(start_paused = true)]
async fn keep_alives_follow_the_brokers_longest_claim() {
    let source = Arc::new(MemorySource {
        longest_claim: Some(Duration::from_secs(600)),
        ..MemorySource::default()
    });
    let mut d = dispatcher(source.clone(), closed_port().await, fast_policy(3));
    d.visibility_timeout = Duration::from_secs(1830);
    let shared = Arc::new(Shared::new(d));
    let keep_alive = tokio::spawn(shared.clone().keep_alive());
    let _held = shared.in_flight.register(&Arc::new(delivery("1-0", "a")));
    // Within one 600 s lease: at least two renewals.
    tokio::time::sleep(Duration::from_secs(590)).await;
    assert!(
        source.state().kept_alive.len() >= 2,
        "{:?}",
        source.state().kept_alive
    );
    keep_alive.abort();
}
