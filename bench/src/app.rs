//! The trivial app: a hyper HTTP/1.1 server that reads the request body and
//! answers 200. It is also the stopwatch: it counts what it receives, notes
//! the first and the last receipt, and for requests stamped with
//! [`SENT_HEADER`] records how long ago they were stamped.

use std::collections::HashSet;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// Header (and message header) carrying the time a message was enqueued, in
/// nanoseconds on [`now_ns`]'s clock. Producer and app share this process,
/// so they share the clock.
pub const SENT_HEADER: &str = "x-bench-sent";

/// Nanoseconds since the harness started, on a monotonic clock.
pub fn now_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

const NONE: u64 = u64::MAX;

#[derive(Default)]
struct Receipts {
    count: AtomicU64,
    first: AtomicU64,
    last: AtomicU64,
    record: AtomicBool,
    latencies: Mutex<Vec<u64>>,
    /// `courier-message-id`s seen, while [`App::track_ids`] is on.
    track: AtomicBool,
    ids: Mutex<HashSet<String>>,
    duplicates: AtomicU64,
    /// Receipt numbers whose wall-clock time is noted ([`App::mark`]), 0
    /// for none, and those times in ns since the epoch (0 until reached).
    marks: [AtomicU64; 2],
    marked_at: [AtomicU64; 2],
}

/// A running app; dropping it does not stop it (it lives as long as the
/// harness).
#[derive(Clone)]
pub struct App {
    pub addr: SocketAddr,
    receipts: Arc<Receipts>,
}

impl App {
    pub async fn start() -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let receipts = Arc::new(Receipts::default());
        receipts.first.store(NONE, Ordering::Relaxed);
        let app = Self { addr, receipts };
        let shared = app.receipts.clone();
        tokio::spawn(serve(
            listener,
            |_| {},
            move |request| handle(shared.clone(), request),
        ));
        Ok(app)
    }

    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// Forgets every receipt; `record` turns latency recording on or off.
    pub fn reset(&self, record: bool) {
        let r = &self.receipts;
        r.record.store(false, Ordering::SeqCst);
        r.latencies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        r.count.store(0, Ordering::SeqCst);
        r.first.store(NONE, Ordering::SeqCst);
        r.last.store(0, Ordering::SeqCst);
        r.record.store(record, Ordering::SeqCst);
        r.track.store(false, Ordering::SeqCst);
        r.ids.lock().unwrap_or_else(|e| e.into_inner()).clear();
        r.duplicates.store(0, Ordering::SeqCst);
        for (mark, at) in r.marks.iter().zip(&r.marked_at) {
            mark.store(0, Ordering::SeqCst);
            at.store(0, Ordering::SeqCst);
        }
    }

    /// Until the next reset, notes the wall-clock time of the `from`-th and
    /// the `to`-th receipt, as the app's handler counts them.
    pub fn mark(&self, from: u64, to: u64) {
        let r = &self.receipts;
        for ((mark, at), n) in r.marks.iter().zip(&r.marked_at).zip([from, to]) {
            at.store(0, Ordering::SeqCst);
            mark.store(n, Ordering::SeqCst);
        }
    }

    /// The times [`App::mark`] asked for, in seconds since the epoch, once
    /// both receipts arrived.
    pub fn marked(&self) -> Option<(f64, f64)> {
        let [from, to] = [0, 1].map(|i| self.receipts.marked_at[i].load(Ordering::SeqCst));
        (from != 0 && to != 0).then(|| (from as f64 / 1e9, to as f64 / 1e9))
    }

    /// From now until the next reset, notes every `courier-message-id` and
    /// counts the ones that arrive again.
    pub fn track_ids(&self) {
        self.receipts.track.store(true, Ordering::SeqCst);
    }

    /// Distinct message ids received, and receipts of an id seen before.
    pub fn ids(&self) -> (u64, u64) {
        let r = &self.receipts;
        let distinct = r.ids.lock().unwrap_or_else(|e| e.into_inner()).len() as u64;
        (distinct, r.duplicates.load(Ordering::SeqCst))
    }

    pub fn count(&self) -> u64 {
        self.receipts.count.load(Ordering::SeqCst)
    }

    /// Time between the first and the last receipt since the last reset.
    pub fn span(&self) -> Option<Duration> {
        let first = self.receipts.first.load(Ordering::SeqCst);
        let last = self.receipts.last.load(Ordering::SeqCst);
        (first != NONE && last >= first).then(|| Duration::from_nanos(last - first))
    }

    /// Stamp-to-receipt latencies recorded since the last reset, in ns.
    pub fn latencies(&self) -> Vec<u64> {
        self.receipts
            .latencies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Waits until `n` requests arrived, or `timeout` passed; the count then.
    pub async fn wait_for(&self, n: u64, timeout: Duration) -> u64 {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let count = self.count();
            if count >= n || tokio::time::Instant::now() >= deadline {
                return count;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// Accepts connections on `listener` for ever, each served over HTTP/1.1
/// with keep-alive by `handle`, after `configure` set the connection up.
pub async fn serve<F, Fut, E>(
    listener: TcpListener,
    configure: impl Fn(&mut http1::Builder) + Send + Sync + 'static,
    handle: F,
) where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Response<Full<Bytes>>, E>> + Send + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let configure = Arc::new(configure);
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (handle, configure) = (handle.clone(), configure.clone());
        tokio::spawn(async move {
            let mut builder = http1::Builder::new();
            builder.keep_alive(true);
            configure(&mut builder);
            let _ = builder
                .serve_connection(TokioIo::new(stream), service_fn(handle))
                .await;
        });
    }
}

async fn handle(
    receipts: Arc<Receipts>,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let sent = request
        .headers()
        .get(SENT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if receipts.track.load(Ordering::Relaxed)
        && let Some(id) = request
            .headers()
            .get("courier-message-id")
            .and_then(|v| v.to_str().ok())
        && !receipts
            .ids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string())
    {
        receipts.duplicates.fetch_add(1, Ordering::SeqCst);
    }
    // A real app reads what it was sent; so does this one.
    let _ = request.into_body().collect().await;
    let now = now_ns();
    if let Some(sent) = sent
        && receipts.record.load(Ordering::Relaxed)
    {
        receipts
            .latencies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(now.saturating_sub(sent));
    }
    let _ = receipts
        .first
        .compare_exchange(NONE, now, Ordering::SeqCst, Ordering::SeqCst);
    receipts.last.fetch_max(now, Ordering::SeqCst);
    let count = receipts.count.fetch_add(1, Ordering::SeqCst) + 1;
    for (mark, at) in receipts.marks.iter().zip(&receipts.marked_at) {
        if mark.load(Ordering::SeqCst) == count {
            let wall = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            at.store(wall.as_nanos() as u64, Ordering::SeqCst);
        }
    }
    Ok(Response::new(Full::new(Bytes::new())))
}
