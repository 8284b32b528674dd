//! The keep-alive connections to the app: one origin, HTTP/1.1, idle
//! connections reused most recent first, at most `max_idle` kept.
//!
//! hyper-util's pooled client does the same for any number of origins: it
//! keys every checkout and every return by hashing the origin (SipHash, fed
//! byte by byte) and comparing it, and moves the request through a few more
//! futures. Replacing it took some 9,900 instructions off each delivery of
//! a Redis drain, a fifth of courier's cost per message (BENCHMARKS.md).
//! courier talks to one app, so its pool is a stack.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// An idle connection older than this is closed rather than reused: an app
/// server may have given up on it by then.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// A reused connection is ready at once; one that is not within this long
/// is closed and another one taken.
const READY_WAIT: Duration = Duration::from_millis(500);

type Sender = SendRequest<Full<Bytes>>;

pub(super) struct Pool {
    host: String,
    port: u16,
    idle: Mutex<Vec<Idle>>,
    max_idle: usize,
}

struct Idle {
    sender: Sender,
    since: Instant,
}

/// A connection lent out for one exchange; [`Pool::give_back`] returns it
/// once the answer has been read whole, and dropping it closes it.
pub(super) struct Lent {
    sender: Sender,
}

/// Why an exchange did not get an answer.
pub(super) enum Failure {
    /// Nothing reached the app: no connection could be made, or a fresh
    /// connection closed before the request was written.
    NeverSent(String),
    /// The request was written, or may have been: the app may have seen it.
    Lost(String),
}

impl Pool {
    pub(super) fn new(host: &str, port: u16, max_idle: usize) -> Self {
        Self {
            host: host.trim_matches(['[', ']']).to_string(),
            port,
            idle: Mutex::new(Vec::with_capacity(max_idle)),
            max_idle: max_idle.max(1),
        }
    }

    fn idle(&self) -> MutexGuard<'_, Vec<Idle>> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends `request` on an idle connection, or a new one. A request that
    /// a reused connection hands back unsent (the app closed it while it
    /// was idle) is sent again on another: the app never saw it.
    pub(super) async fn send(
        &self,
        mut request: Request<Full<Bytes>>,
    ) -> Result<(Response<Incoming>, Lent), Failure> {
        loop {
            let (mut sender, reused) = match self.take_idle().await {
                Some(sender) => (sender, true),
                None => (self.connect().await?, false),
            };
            match sender.try_send_request(request).await {
                Ok(response) => return Ok((response, Lent { sender })),
                Err(mut error) => match error.take_message() {
                    Some(unsent) if reused => request = unsent,
                    Some(_) => return Err(Failure::NeverSent(chain(error.error()))),
                    None => return Err(Failure::Lost(chain(error.error()))),
                },
            }
        }
    }

    /// Keeps a connection whose answer was read whole, for the next
    /// request.
    pub(super) fn give_back(&self, lent: Lent) {
        if lent.sender.is_closed() {
            return;
        }
        let mut idle = self.idle();
        if idle.len() < self.max_idle {
            idle.push(Idle {
                sender: lent.sender,
                since: Instant::now(),
            });
        }
    }

    /// The most recently used idle connection that is still open and
    /// ready; closed, stale or stuck ones are dropped on the way.
    async fn take_idle(&self) -> Option<Sender> {
        loop {
            let Idle { mut sender, since } = self.idle().pop()?;
            if sender.is_closed() || since.elapsed() >= IDLE_TIMEOUT {
                continue;
            }
            if sender.is_ready() {
                return Some(sender);
            }
            // Its last answer was read, but the connection task has not
            // yet said it is free.
            if let Ok(Ok(())) = tokio::time::timeout(READY_WAIT, sender.ready()).await {
                return Some(sender);
            }
        }
    }

    async fn connect(&self) -> Result<Sender, Failure> {
        let connect = tokio::net::TcpStream::connect((self.host.as_str(), self.port));
        let stream = match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => {
                return Err(Failure::NeverSent(format!(
                    "cannot connect to {}:{}: {e}",
                    self.host, self.port
                )));
            }
            Err(_) => {
                return Err(Failure::NeverSent(format!(
                    "cannot connect to {}:{}: no answer within {} s",
                    self.host,
                    self.port,
                    CONNECT_TIMEOUT.as_secs()
                )));
            }
        };
        // Requests are small and written whole: Nagle's delay would only
        // hold them back.
        let _ = stream.set_nodelay(true);
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| Failure::NeverSent(chain(&e)))?;
        tokio::spawn(async move {
            // Its end (the app closed it, or courier dropped the sender) is
            // seen by the sender: nothing to report here.
            let _ = connection.await;
        });
        Ok(sender)
    }
}

/// The error with its causes, e.g. `connection closed before message
/// completed`.
pub(super) fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
