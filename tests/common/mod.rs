//! What the integration tests share: a real HTTP app on loopback whose
//! answers are scripted per message, the sources under test, and a way to
//! run the sidecar in-process or as the built binary.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use courier::config::RunConfig;
use courier::policy::{Jitter, Policy};
use courier::sidecar::Sidecar;
use courier::source::{self, Depth, Source, SourceOptions, SourceUrl};
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub const REDIS_URL: &str = "redis://127.0.0.1:6379/0";

// === The app ===

/// One request as the app saw it.
#[derive(Debug, Clone)]
pub struct Received {
    pub at: Instant,
    pub headers: HashMap<String, String>,
    pub body: Bytes,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }

    pub fn attempt(&self) -> u32 {
        self.header("courier-attempt")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }
}

/// A real HTTP server on 127.0.0.1. A message body may start with a script
/// line `script:<step>,<step>,...`; the app answers the n-th request for
/// that body with the n-th step (the last step repeats). A step is a status
/// (`503`), a status with Retry-After seconds (`429ra1`), or `sleepN` (wait N
/// ms, then 200). Any other body gets 200. Every request is recorded.
#[derive(Clone)]
pub struct TestApp {
    pub addr: SocketAddr,
    received: Arc<Mutex<Vec<Received>>>,
    stop: CancellationToken,
}

fn answer(step: &str) -> (u16, Option<String>, Option<u64>) {
    if let Some(ms) = step.strip_prefix("sleep") {
        return (200, None, ms.parse().ok());
    }
    if let Some((status, secs)) = step.split_once("ra") {
        return (status.parse().unwrap_or(200), Some(secs.to_string()), None);
    }
    (step.parse().unwrap_or(200), None, None)
}

impl TestApp {
    pub async fn start() -> Self {
        Self::start_on("127.0.0.1:0").await
    }

    pub async fn start_on(addr: &str) -> Self {
        let listener = TcpListener::bind(addr).await.expect("bind the test app");
        let app = Self {
            addr: listener.local_addr().unwrap(),
            received: Arc::default(),
            stop: CancellationToken::new(),
        };
        let (received, stop) = (app.received.clone(), app.stop.clone());
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    _ = stop.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(_) => continue,
                    },
                };
                let (received, stop) = (received.clone(), stop.clone());
                tokio::spawn(async move {
                    let service = service_fn(move |req: Request<Incoming>| {
                        let received = received.clone();
                        async move {
                            let headers = req
                                .headers()
                                .iter()
                                .map(|(n, v)| {
                                    (
                                        n.as_str().to_string(),
                                        String::from_utf8_lossy(v.as_bytes()).into_owned(),
                                    )
                                })
                                .collect();
                            let body = req
                                .into_body()
                                .collect()
                                .await
                                .map(|b| b.to_bytes())
                                .unwrap_or_default();
                            let at = Instant::now();
                            let seen = {
                                let mut all = received.lock().unwrap();
                                let seen =
                                    all.iter().filter(|r: &&Received| r.body == body).count();
                                all.push(Received {
                                    at,
                                    headers,
                                    body: body.clone(),
                                });
                                seen
                            };
                            let script = std::str::from_utf8(&body).ok().and_then(|b| {
                                b.lines()
                                    .next()?
                                    .strip_prefix("script:")
                                    .map(str::to_string)
                            });
                            let (status, retry_after, sleep) = match script {
                                Some(script) => {
                                    let steps: Vec<&str> = script.split(',').collect();
                                    answer(steps[seen.min(steps.len() - 1)])
                                }
                                None => (200, None, None),
                            };
                            if let Some(ms) = sleep {
                                tokio::time::sleep(Duration::from_millis(ms)).await;
                            }
                            let mut response = Response::builder().status(status);
                            if let Some(ra) = retry_after {
                                response = response.header("retry-after", ra);
                            }
                            response.body(Full::new(Bytes::from(format!(
                                "answer {status} to attempt {}",
                                seen + 1
                            ))))
                        }
                    });
                    let builder = auto::Builder::new(TokioExecutor::new());
                    let conn = builder.serve_connection(TokioIo::new(stream), service);
                    tokio::select! {
                        _ = conn => {}
                        _ = stop.cancelled() => {}
                    }
                });
            }
        });
        app
    }

    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// Requests whose body is exactly `body`, in arrival order.
    pub fn received_body(&self, body: &[u8]) -> Vec<Received> {
        self.received()
            .into_iter()
            .filter(|r| r.body.as_ref() == body)
            .collect()
    }

    pub fn stop(&self) {
        self.stop.cancel();
    }
}

// === Sources ===

/// A source under test, with a fresh queue of its own.
#[derive(Clone, Debug)]
pub struct Fixture {
    pub url: SourceUrl,
    pub queue: String,
    /// Keeps the embedded queue's directory alive.
    _dir: Option<Arc<tempfile::TempDir>>,
}

pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}-{}", std::process::id(), rand::random::<u32>())
}

impl Fixture {
    pub fn redis() -> Self {
        Self {
            url: SourceUrl::parse(REDIS_URL).unwrap(),
            queue: unique("test"),
            _dir: None,
        }
    }

    pub fn embedded() -> Self {
        let dir = tempfile::tempdir().unwrap();
        Self {
            url: SourceUrl::Embedded(dir.path().to_path_buf()),
            queue: unique("test"),
            _dir: Some(Arc::new(dir)),
        }
    }

    /// The `--source` text.
    pub fn source_arg(&self) -> String {
        match &self.url {
            SourceUrl::Redis(url) => url.clone(),
            SourceUrl::Embedded(dir) => format!("embedded:{}", dir.display()),
        }
    }

    pub fn dir(&self) -> Option<PathBuf> {
        match &self.url {
            SourceUrl::Embedded(dir) => Some(dir.clone()),
            SourceUrl::Redis(_) => None,
        }
    }

    pub fn dlq(&self) -> String {
        format!("{}.dlq", self.queue)
    }

    /// A handle for producing and inspecting; in-process it shares the
    /// embedded queue with a sidecar started in this process.
    pub async fn open(&self) -> Arc<dyn Source> {
        let mut options = SourceOptions::new(&self.queue);
        options.consumer = "inspector".into();
        source::open(&self.url, options)
            .await
            .expect("open the source")
    }

    pub async fn send(&self, source: &Arc<dyn Source>, body: impl Into<Bytes>) -> String {
        source.send(body.into(), &[]).await.expect("send")
    }
}

/// A policy with short, exact timings so tests stay fast.
pub fn fast_policy() -> Policy {
    Policy {
        name: "test".into(),
        generation: 1,
        max_attempts: 3,
        timeout: Duration::from_millis(500),
        ..Policy::default()
    }
    .backoff_of(
        Duration::from_millis(50),
        Duration::from_millis(200),
        2.0,
        Jitter::None,
    )
}

pub fn run_config(fixture: &Fixture, app: &TestApp, policy: Policy) -> RunConfig {
    let mut options = SourceOptions::new(&fixture.queue);
    options.consumer = unique("consumer");
    options.visibility_timeout = policy.timeout + Duration::from_secs(2);
    options.dead_letter_queue = fixture.dlq();
    RunConfig {
        source: fixture.url.clone(),
        options,
        app: app.url().parse().unwrap(),
        policy,
        policy_file: None,
        policy_poll: Duration::from_millis(100),
        concurrency: 8,
        listen: "127.0.0.1:0".parse().unwrap(),
        drain_timeout: Duration::from_secs(5),
        max_body: 1 << 20,
        depth_interval: Duration::from_millis(200),
    }
}

/// A sidecar running in this process.
pub struct Running {
    pub metrics_addr: SocketAddr,
    pub metrics: Arc<courier::telemetry::Metrics>,
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<anyhow::Result<courier::dispatch::DrainReport>>,
}

impl Running {
    pub async fn start(config: RunConfig) -> Self {
        let sidecar = Sidecar::new(config);
        let metrics = sidecar.metrics.clone();
        let stop = CancellationToken::new();
        let (metrics_addr, handle) = sidecar
            .start(stop.clone())
            .await
            .expect("start the sidecar");
        Self {
            metrics_addr,
            metrics,
            stop,
            handle,
        }
    }

    pub async fn stop(self) -> courier::dispatch::DrainReport {
        self.stop.cancel();
        self.handle.await.expect("join").expect("sidecar result")
    }
}

/// Polls `check` until it is true or `limit` passes; the failure message
/// says what was awaited.
pub async fn wait_for(what: &str, limit: Duration, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    loop {
        if check().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Waits until nothing is ready, pending or scheduled.
pub async fn wait_settled(source: &Arc<dyn Source>, limit: Duration) -> Depth {
    let mut last = Depth::default();
    wait_for("the queue to settle", limit, async || {
        last = source.depth().await.expect("depth");
        last.ready == 0 && last.pending == 0 && last.retry_backlog == 0
    })
    .await;
    last
}

/// Reads `/metrics` from a running sidecar.
pub async fn scrape(addr: SocketAddr) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to /metrics");
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).await.unwrap();
    out
}
