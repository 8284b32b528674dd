//! Load against the app without courier: a closed-loop HTTP/1.1 keep-alive
//! generator (the app's own limit, wrk-style: N connections, each sending its
//! next request as soon as the last answer is read), and a paced sender for
//! the direct-request latency.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::app::{SENT_HEADER, now_ns};

/// A request shaped like the one courier sends: same body, same headers.
fn request(addr: SocketAddr, body: &Bytes, n: u64, sent: Option<u64>) -> Request<Full<Bytes>> {
    let mut builder = Request::builder()
        .method(Method::POST)
        .uri(format!("http://{addr}/"))
        .header("host", addr.to_string())
        .header("content-type", "application/octet-stream")
        .header("idempotency-key", format!("bench:1700000000000-{n}"))
        .header("courier-message-id", format!("1700000000000-{n}"))
        .header("courier-attempt", "1")
        .header("courier-queue", "bench");
    if let Some(sent) = sent {
        builder = builder.header(SENT_HEADER, sent.to_string());
    }
    builder
        .body(Full::new(body.clone()))
        .expect("a valid request")
}

/// What a closed-loop run measured.
#[derive(Debug, Clone, Copy)]
pub struct Capacity {
    pub requests: u64,
    pub elapsed: Duration,
    pub errors: u64,
}

impl Capacity {
    pub fn per_second(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }
}

/// `connections` keep-alive connections, each in a loop for `warmup` and
/// then `duration`; only answers within `duration` are counted.
pub async fn closed_loop(
    addr: SocketAddr,
    connections: usize,
    warmup: Duration,
    duration: Duration,
    body: Bytes,
) -> anyhow::Result<Capacity> {
    let counting = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for c in 0..connections {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        let (counting, stop, done, errors, body) = (
            counting.clone(),
            stop.clone(),
            done.clone(),
            errors.clone(),
            body.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut n = (c as u64) << 40;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let ok = match sender.send_request(request(addr, &body, n, None)).await {
                    Ok(response) => {
                        let ok = response.status().is_success();
                        ok && response.into_body().collect().await.is_ok()
                    }
                    Err(_) => false,
                };
                if !ok {
                    errors.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                if counting.load(Ordering::Relaxed) {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    tokio::time::sleep(warmup).await;
    counting.store(true, Ordering::SeqCst);
    let started = Instant::now();
    tokio::time::sleep(duration).await;
    counting.store(false, Ordering::SeqCst);
    let elapsed = started.elapsed();
    let requests = done.load(Ordering::SeqCst);
    stop.store(true, Ordering::SeqCst);
    for worker in workers {
        let _ = worker.await;
    }
    Ok(Capacity {
        requests,
        elapsed,
        errors: errors.load(Ordering::SeqCst),
    })
}

/// Sends `count` stamped requests straight to the app at `rate` per second
/// through a pooled keep-alive client (the kind courier uses), after
/// `warmup` unstamped ones. The app records stamp-to-receipt latency.
pub async fn paced_direct(
    addr: SocketAddr,
    rate: u64,
    warmup: u64,
    count: u64,
    body: Bytes,
) -> anyhow::Result<()> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(64)
        .build(connector);
    let interval = Duration::from_nanos(1_000_000_000 / rate.max(1));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity((warmup + count) as usize);
    for i in 0..warmup + count {
        tokio::time::sleep_until(start + interval * i as u32).await;
        let stamp = (i >= warmup).then(now_ns);
        let future = client.request(request(addr, &body, i, stamp));
        tasks.push(tokio::spawn(async move {
            let response = future.await?;
            response.into_body().collect().await?;
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(())
}
