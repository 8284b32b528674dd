//! The dispatcher's steps, one by one: reading (failures and readiness),
//! judging and settling (the verdict table with the gate as an input), the
//! Retry-After hold, the keep-alive of deliveries in flight. Time is paused
//! where only timers are involved. Deliveries to an app go to a real HTTP
//! app on loopback, in real time: a paused clock would jump past the app's
//! answer. The source is a small in-memory one: this tests the dispatcher,
//! not a broker (the conformance suite does that).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::*;
use crate::model::{DeadLetter, Failure, Outcome};
use crate::policy::{GateState, Jitter, Policy};
use crate::source::{Capabilities, Depth, SourceError};

// === An in-memory source ===

#[derive(Default)]
struct Memory {
    ready: VecDeque<Delivery>,
    scheduled: Vec<(SystemTime, Delivery)>,
    acked: Vec<String>,
    /// (message id, next attempt, due)
    retried: Vec<(String, u32, SystemTime)>,
    dead: Vec<(String, Failure)>,
    kept_alive: Vec<Vec<String>>,
}

#[derive(Default)]
struct MemorySource {
    state: Mutex<Memory>,
    fail_reads: AtomicBool,
}

fn delivery(id: &str, body: &str) -> Delivery {
    Delivery::from_fields(
        id,
        vec![(
            Bytes::from_static(b"payload"),
            Bytes::from(body.to_string()),
        )],
        0,
        id.to_string(),
    )
}

impl MemorySource {
    fn with(bodies: &[&str]) -> Arc<Self> {
        let source = Self::default();
        source.state().ready = bodies
            .iter()
            .enumerate()
            .map(|(i, body)| delivery(&format!("{i}-0"), body))
            .collect();
        Arc::new(source)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Memory> {
        self.state.lock().unwrap()
    }
}

#[async_trait]
impl Source for MemorySource {
    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        if self.fail_reads.load(Ordering::SeqCst) {
            return Err(SourceError::Unavailable("connection refused".into()));
        }
        let out: Vec<Delivery> = {
            let mut s = self.state();
            let now = SystemTime::now();
            let (due, later) = std::mem::take(&mut s.scheduled)
                .into_iter()
                .partition(|(at, _)| *at <= now);
            s.scheduled = later;
            s.ready.extend(due.into_iter().map(|(_, d)| d));
            let n = max.min(s.ready.len());
            s.ready.drain(..n).collect()
        };
        if out.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(out)
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), SourceError> {
        self.state().acked.push(delivery.message.id.clone());
        Ok(())
    }

    async fn retry(
        &self,
        delivery: &Delivery,
        next_attempt: u32,
        first_attempt_at: SystemTime,
        at: SystemTime,
    ) -> Result<(), SourceError> {
        let id = delivery.message.id.clone();
        let again = Delivery::from_fields(
            &id,
            delivery.fields_for_retry(next_attempt, first_attempt_at),
            0,
            id.clone(),
        );
        let mut s = self.state();
        s.retried.push((id, next_attempt, at));
        s.scheduled.push((at, again));
        Ok(())
    }

    async fn dead_letter(&self, delivery: &Delivery, failure: &Failure) -> Result<(), SourceError> {
        self.state()
            .dead
            .push((delivery.message.id.clone(), failure.clone()));
        Ok(())
    }

    async fn depth(&self) -> Result<Depth, SourceError> {
        Ok(Depth::default())
    }

    async fn dead_letters(&self, _: &str, _: usize) -> Result<Vec<DeadLetter>, SourceError> {
        Ok(Vec::new())
    }

    async fn replay(&self, _: &str, _: &DeadLetter) -> Result<(), SourceError> {
        Ok(())
    }

    async fn purge(&self, _: &str, _: &DeadLetter) -> Result<(), SourceError> {
        Ok(())
    }

    async fn send(&self, body: Bytes, _: &[(String, String)]) -> Result<String, SourceError> {
        let mut s = self.state();
        let id = format!("{}-0", s.ready.len() + 1000);
        s.ready
            .push_back(delivery(&id, &String::from_utf8_lossy(&body)));
        Ok(id)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }

    async fn keep_alive(&self, in_flight: &[Delivery]) -> Result<(), SourceError> {
        let mut ids: Vec<String> = in_flight.iter().map(|d| d.message.id.clone()).collect();
        ids.sort();
        self.state().kept_alive.push(ids);
        Ok(())
    }
}

// === Fixtures ===

fn fast_policy(max_attempts: u32) -> Policy {
    let mut policy = Policy::test().max_attempts(max_attempts).backoff_of(
        Duration::from_millis(10),
        Duration::from_millis(50),
        2.0,
        Jitter::None,
    );
    policy.timeout = Duration::from_secs(5);
    policy
}

fn dispatcher(source: Arc<MemorySource>, app: SocketAddr, policy: Policy) -> Dispatcher {
    Dispatcher {
        source,
        forwarder: Forwarder::new(format!("http://{app}/").parse().unwrap(), 4),
        policy: LivePolicy::fixed(policy),
        metrics: Arc::new(Metrics::new()),
        queue: "orders".into(),
        concurrency: 4,
        max_body: 1 << 20,
        drain_timeout: Duration::from_secs(5),
        visibility_timeout: Duration::from_secs(60),
        health: Arc::new(telemetry::Health::default()),
        app_health_path: None,
        app_failure_run: gate::FAILURE_RUN,
        dedup_window: None,
    }
}

/// An address nothing listens on.
async fn closed_port() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap()
}

fn answered(status: u16, retry_after: Option<u64>) -> Outcome {
    Outcome::Answered {
        status,
        retry_after: retry_after.map(Duration::from_secs),
        retry_after_invalid: false,
        excerpt: Bytes::new(),
    }
}

fn deliveries_counted(shared: &Shared, result: &str) -> u64 {
    shared.m.delivery(result).map_or(0, |c| c.get())
}

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
    let a = shared.in_flight.register(&delivery("1-0", "a"));
    let b = shared.in_flight.register(&delivery("2-0", "b"));
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

// === Delivering, to a real app on loopback ===

/// A raw HTTP/1.1 app: answers 200 to every request on a kept-alive
/// connection, except a body containing `crash`, after which it resets the
/// connection without an answer, as an app killed by the message would.
async fn crashing_app() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let Some(head_end) = seen.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&seen[..head_end]).to_ascii_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    while seen.len() < head_end + 4 + length {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    }
                    let body: Vec<u8> = seen
                        .drain(..head_end + 4 + length)
                        .skip(head_end + 4)
                        .collect();
                    if body.windows(5).any(|w| w == b"crash") {
                        let _ = stream.set_zero_linger();
                        return;
                    }
                    let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                    if stream.write_all(ok).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_message_that_crashes_the_app_uses_its_attempts_and_is_dead_lettered() {
    let app = crashing_app().await;
    let source = MemorySource::with(&["ok 1", "crash", "ok 2", "ok 3", "ok 4"]);
    let shared_metrics;
    let shutdown = CancellationToken::new();
    let run = {
        let d = dispatcher(source.clone(), app, fast_policy(3));
        shared_metrics = d.metrics.clone();
        tokio::spawn(d.run(shutdown.clone()))
    };
    wait_until("four acks and a dead letter", || {
        let s = source.state();
        s.acked.len() == 4 && s.dead.len() == 1
    })
    .await;
    shutdown.cancel();
    run.await.unwrap();
    let s = source.state();
    let (id, failure) = &s.dead[0];
    assert_eq!(id, "1-0");
    assert_eq!(failure.reason, DeadLetterReason::AttemptsExhausted);
    assert_eq!(failure.attempts, 3);
    assert!(failure.error.is_some(), "{failure:?}");
    assert!(
        shared_metrics
            .encode()
            .contains(r#"courier_deliveries_total{queue="orders",result="connection-lost"} 3"#),
        "{}",
        shared_metrics.encode()
    );
}

#[tokio::test]
async fn an_app_that_refuses_connections_costs_no_attempts_and_gets_everything_when_back() {
    let app = closed_port().await;
    let source = MemorySource::with(&["a", "b", "c"]);
    let d = dispatcher(source.clone(), app, fast_policy(2));
    let health = d.health.clone();
    health.set_ready(true);
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(d.run(shutdown.clone()));
    wait_until("a few refused deliveries", || {
        source.state().retried.len() >= 4
    })
    .await;
    assert!(!health.is_ready(), "not ready while the app is down");
    {
        let s = source.state();
        assert!(s.dead.is_empty(), "{:?}", s.dead);
        assert!(
            s.retried.iter().all(|(_, next, _)| *next == 1),
            "{:?}",
            s.retried
        );
    }
    let listener = TcpListener::bind(app).await.unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(telemetry::serve_http(
        listener,
        stop.clone(),
        |_req: Request<Incoming>| async { Response::new(Full::new(Bytes::from_static(b"ok"))) },
    ));
    wait_until("every message acked", || source.state().acked.len() == 3).await;
    assert!(health.is_ready());
    shutdown.cancel();
    run.await.unwrap();
    stop.cancel();
    assert!(source.state().dead.is_empty());
}

#[tokio::test]
async fn a_few_always_503_messages_dead_letter_while_the_rest_flow() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(telemetry::serve_http(
        listener,
        stop.clone(),
        |req: Request<Incoming>| async {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let status = if body.starts_with(b"bad") { 503 } else { 200 };
            Response::builder()
                .status(status)
                .body(Full::new(Bytes::new()))
                .unwrap()
        },
    ));
    let mut bodies: Vec<String> = (0..300).map(|i| format!("good {i}")).collect();
    for i in [10, 150, 290] {
        bodies.insert(i, format!("bad {i}"));
    }
    let bodies: Vec<&str> = bodies.iter().map(String::as_str).collect();
    let source = MemorySource::with(&bodies);
    let d = dispatcher(source.clone(), app, fast_policy(3));
    let health = d.health.clone();
    health.set_ready(true);
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(d.run(shutdown.clone()));
    wait_until("300 acks and 3 dead letters", || {
        let s = source.state();
        assert!(health.is_ready(), "503s never make courier not ready");
        s.acked.len() == 300 && s.dead.len() == 3
    })
    .await;
    shutdown.cancel();
    run.await.unwrap();
    stop.cancel();
    let s = source.state();
    for (_, failure) in &s.dead {
        assert_eq!(failure.reason, DeadLetterReason::AttemptsExhausted);
        assert_eq!((failure.attempts, failure.status), (3, Some(503)));
    }
}
