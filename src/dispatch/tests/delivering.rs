//! Whole runs against a real app on loopback, in real time.

use super::*;

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

/// Found at 21da363: a delivery that panicked was caught and forgotten, its
/// message left unsettled (a Kafka offset held open until a restart, an SQS
/// FIFO group busy for good) to panic again at every redelivery. Now it is
/// dead-lettered as undeliverable with the panic's message, once, and the
/// other messages flow; on one thread and on several.
#[tokio::test]
async fn a_delivery_that_panics_is_dead_lettered_once() {
    a_panic_is_settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_that_panics_on_a_task_of_its_own_is_dead_lettered_once() {
    a_panic_is_settled().await;
}

async fn a_panic_is_settled() {
    let app = crashing_app().await;
    let source = MemorySource::with(&["ok 1", "panic in the ack", "ok 2"]);
    let shutdown = CancellationToken::new();
    let d = dispatcher(source.clone(), app, fast_policy(3));
    let metrics = d.metrics.clone();
    let run = tokio::spawn(d.run(shutdown.clone()));
    wait_until("two acks and a dead letter", || {
        let s = source.state();
        s.acked.len() == 2 && s.dead.len() == 1
    })
    .await;
    // Nothing more comes of it: no second dead letter, no retry.
    tokio::time::sleep(Duration::from_millis(300)).await;
    shutdown.cancel();
    run.await.unwrap();
    let s = source.state();
    assert_eq!(s.dead.len(), 1);
    assert!(s.retried.is_empty(), "{:?}", s.retried);
    let (id, failure) = &s.dead[0];
    assert_eq!(id, "1-0");
    assert_eq!(failure.reason, DeadLetterReason::Undeliverable);
    let error = failure.error.clone().unwrap_or_default();
    assert!(error.contains("a test panic on 1-0"), "{error}");
    let text = metrics.encode();
    assert!(
        text.contains(r#"courier_dead_letters_total{queue="orders",reason="undeliverable"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"courier_in_flight{queue="orders"} 0"#),
        "{text}"
    );
}

/// An app's slot is free once it has answered: while the broker has not
/// answered the acks, the app gets the next messages, up to
/// `--concurrency` (4) settlements under way beside its 4, and no more,
/// so what is read and unsettled stays bounded.
#[tokio::test]
async fn the_app_gets_the_next_message_while_an_ack_is_under_way() {
    let app = crashing_app().await;
    let bodies: Vec<String> = (0..12).map(|i| format!("ok {i}")).collect();
    let bodies: Vec<&str> = bodies.iter().map(String::as_str).collect();
    let mut source = Arc::into_inner(MemorySource::with(&bodies)).unwrap();
    source.ack_gate = Some(tokio::sync::Semaphore::new(0));
    let source = Arc::new(source);
    let shutdown = CancellationToken::new();
    let d = dispatcher(source.clone(), app, fast_policy(3));
    let metrics = d.metrics.clone();
    let run = tokio::spawn(d.run(shutdown.clone()));
    let answered = || {
        let text = metrics.encode();
        text.lines()
            .find_map(|l| {
                l.strip_prefix(r#"courier_deliveries_total{queue="orders",result="success"} "#)
            })
            .map_or(0, |n| n.parse::<u64>().unwrap())
    };
    wait_until("eight answers with no ack answered", || answered() == 8).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        answered(),
        8,
        "four with the app and four settling, no more"
    );
    assert!(source.state().acked.is_empty());
    source.ack_gate.as_ref().unwrap().add_permits(12);
    wait_until("every message acked", || source.state().acked.len() == 12).await;
    assert_eq!(answered(), 12);
    shutdown.cancel();
    run.await.unwrap();
}

/// An app that does not listen yet (still starting) is sent nothing, not
/// even a refused delivery: nothing is read from the broker, courier is not
/// ready, and once the app listens everything arrives at attempt 1. A
/// refused connection later, mid-run, is a free retry (`steps.rs`,
/// `tests/dispatch/dispatch_gate.rs`).
#[tokio::test]
async fn an_app_not_listening_yet_is_waited_for_before_the_first_delivery() {
    let app = closed_port().await;
    let source = MemorySource::with(&["a", "b", "c"]);
    let d = dispatcher(source.clone(), app, fast_policy(2));
    let health = d.health.clone();
    let metrics = d.metrics.clone();
    health.set_ready(true);
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(d.run(shutdown.clone()));
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!health.is_ready(), "not ready while the app is not up");
    assert!(metrics.encode().contains("courier_app_up 0"));
    {
        let s = source.state();
        assert_eq!(s.ready.len(), 3, "nothing was read");
        assert!(s.retried.is_empty(), "{:?}", s.retried);
        assert!(s.dead.is_empty(), "{:?}", s.dead);
    }
    let listener = TcpListener::bind(app).await.unwrap();
    let stop = CancellationToken::new();
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let seen = attempts.clone();
    tokio::spawn(telemetry::serve_http(
        listener,
        stop.clone(),
        move |req: Request<Incoming>| {
            let seen = seen.clone();
            async move {
                let attempt = req.headers().get("courier-attempt").cloned();
                seen.lock().unwrap().push(attempt);
                Response::new(Full::new(Bytes::from_static(b"ok")))
            }
        },
    ));
    wait_until("every message acked", || source.state().acked.len() == 3).await;
    assert!(health.is_ready());
    shutdown.cancel();
    run.await.unwrap();
    stop.cancel();
    assert!(source.state().dead.is_empty());
    assert!(source.state().retried.is_empty());
    let attempts = attempts.lock().unwrap();
    assert_eq!(attempts.len(), 3, "{attempts:?}");
    assert!(
        attempts
            .iter()
            .all(|a| a.as_ref().is_some_and(|v| v == "1")),
        "{attempts:?}"
    );
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
