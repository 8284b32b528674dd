//! The `/metrics`, `/healthz`, `/readyz` and `/drain` endpoint, and the
//! plain HTTP server the demo's sample app and the tests' apps use.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::guard::{Admission, Guarded};
use super::{Health, Metrics};

/// What the endpoint allows a client. The port is often reachable from the
/// whole cluster, and idle or slow connections must not pile up in the
/// sidecar.
#[derive(Debug, Clone, Copy)]
pub struct EndpointLimits {
    /// A client gets this long to send its request head; a connection that
    /// sends nothing (or a byte a minute) is closed, idle keep-alive included.
    pub header_read_timeout: Duration,
    /// Connections served at once; more are closed at accept.
    pub max_connections: usize,
    /// Connections one address may hold at once: the kubelet's probes and
    /// the scraper come from addresses of their own and always find room.
    pub max_per_peer: usize,
    /// An answer the peer takes nothing of for this long (a client that
    /// pipelines requests and never reads) ends its connection.
    pub write_stall: Duration,
}

impl Default for EndpointLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            max_connections: 64,
            max_per_peer: 8,
            write_stall: Duration::from_secs(10),
        }
    }
}

/// What `/drain` asks of the sidecar, who may ask it, and its answer.
///
/// The pod's `preStop` hook calls it, so the app gets SIGTERM only after
/// courier stopped sending it work. A drain goes in rounds: asked by the
/// first call of a round, answered to every call (those waiting and any
/// later one) once the deliveries in flight are settled. Kubernetes also
/// runs `preStop` when it restarts only the app container (a failed
/// liveness probe), and then no SIGTERM follows: the dispatcher ends the
/// round after a bound and pulls again ([`Drain::resume`]).
pub struct Drain {
    /// The secret a caller must present (`Authorization: Bearer …`); with
    /// none, only loopback peers may call.
    token: Option<String>,
    round: std::sync::Mutex<Round>,
    done: watch::Sender<Option<String>>,
}

struct Round {
    asked: CancellationToken,
    /// Deliveries are being pulled, so a drain has something to wait for.
    pulling: bool,
}

impl Default for Drain {
    fn default() -> Self {
        Self::new(None)
    }
}

/// The answer to a drain asked while nothing was pulled (the source still
/// opening, or the app still starting).
pub const IDLE_DRAIN: &str = "drained: 0 deliveries finished, 0 left unsettled for redelivery\n";

impl Drain {
    /// A drain that requires `token` from every caller; `None`: loopback only.
    pub fn new(token: Option<String>) -> Self {
        Self {
            token: token.filter(|t| !t.is_empty()),
            round: std::sync::Mutex::new(Round {
                asked: CancellationToken::new(),
                pulling: false,
            }),
            done: watch::channel(None).0,
        }
    }

    fn round(&self) -> std::sync::MutexGuard<'_, Round> {
        self.round.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stop pulling; repeated calls change nothing. Asked while nothing is
    /// pulled, the round is answered at once.
    pub fn ask(&self) {
        let round = self.round();
        round.asked.cancel();
        if !round.pulling && self.done.borrow().is_none() {
            self.done.send_replace(Some(IDLE_DRAIN.into()));
        }
    }

    /// Whether the current round was asked for.
    pub fn is_asked(&self) -> bool {
        self.round().asked.is_cancelled()
    }

    /// The dispatcher starts pulling: the token that a drain of this round
    /// cancels (already cancelled when one was asked before).
    pub fn start_pulling(&self) -> CancellationToken {
        let mut round = self.round();
        round.pulling = true;
        round.asked.clone()
    }

    /// The deliveries in flight are settled (or given up at the drain
    /// timeout); `summary` is what every `/drain` call of this round answers.
    pub fn finish(&self, summary: String) {
        self.round().pulling = false;
        self.done.send_replace(Some(summary));
    }

    /// Ends the round: the next call drains again.
    pub fn resume(&self) {
        let mut round = self.round();
        round.asked = CancellationToken::new();
        round.pulling = false;
        self.done.send_replace(None);
    }

    /// What the round's drain answers, once it has finished.
    pub async fn finished(&self) -> String {
        let mut done = self.done.subscribe();
        match done.wait_for(Option::is_some).await {
            Ok(summary) => summary.clone().unwrap_or_default(),
            Err(_) => "stopped\n".into(),
        }
    }

    /// Resolves once no drain is under way or finished: the round ended,
    /// and pulling started again.
    pub async fn resumed(&self) {
        let mut done = self.done.subscribe();
        let _ = done.wait_for(Option::is_none).await;
    }

    /// Who may drain: with a token, whoever presents it (`Authorization:
    /// Bearer <token>`, as the injected preStop hook sends it); without
    /// one, loopback peers only, since the port is usually open to the
    /// cluster for scraping.
    fn allows(
        &self,
        peer: std::net::IpAddr,
        headers: &http::HeaderMap,
    ) -> Result<(), (StatusCode, String)> {
        let Some(token) = &self.token else {
            let loopback = match peer {
                std::net::IpAddr::V4(v4) => v4.is_loopback(),
                std::net::IpAddr::V6(v6) => {
                    v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
                }
            };
            return if loopback {
                Ok(())
            } else {
                Err((
                    StatusCode::FORBIDDEN,
                    "/drain is served to loopback callers only; to drain from elsewhere, set COURIER_DRAIN_TOKEN (or --drain-token-file) and send it as Authorization: Bearer <token>\n".into(),
                ))
            };
        };
        let presented = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        match presented {
            Some(given) if same_secret(given.as_bytes(), token.as_bytes()) => Ok(()),
            Some(_) => Err((
                StatusCode::UNAUTHORIZED,
                "/drain: the bearer token is wrong\n".into(),
            )),
            None => Err((
                StatusCode::UNAUTHORIZED,
                "/drain needs Authorization: Bearer <the pod's COURIER_DRAIN_TOKEN>\n".into(),
            )),
        }
    }
}

/// Compares two secrets in time that depends on their lengths only, so
/// that timing a wrong guess tells nothing of the right one's bytes.
fn same_secret(given: &[u8], expected: &[u8]) -> bool {
    given.len() == expected.len()
        && given
            .iter()
            .zip(expected)
            .fold(0u8, |diff, (a, b)| diff | (a ^ b))
            == 0
}

/// Serves `/metrics`, `/healthz`, `/readyz` and `/drain` until `shutdown`,
/// within the default [`EndpointLimits`].
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    drain: Arc<Drain>,
    shutdown: CancellationToken,
) {
    serve_within(
        listener,
        metrics,
        health,
        drain,
        shutdown,
        EndpointLimits::default(),
    )
    .await;
}

/// [`serve`] within `limits`. HTTP/1 only: what scrapers and the kubelet
/// speak, and a protocol whose request head a timeout can bound.
pub async fn serve_within(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    drain: Arc<Drain>,
    shutdown: CancellationToken,
    limits: EndpointLimits,
) {
    let admission = Admission::new(limits.max_connections, limits.max_per_peer);
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection to the metrics endpoint failed");
                    continue;
                }
            },
        };
        let Some(permit) = admission.admit(peer.ip()) else {
            tracing::debug!(
                %peer,
                max = limits.max_connections,
                per_peer = limits.max_per_peer,
                "the metrics endpoint is at its connection cap; closing a new one"
            );
            continue;
        };
        let (metrics, health, drain, stop) = (
            metrics.clone(),
            health.clone(),
            drain.clone(),
            shutdown.clone(),
        );
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let (metrics, health, drain) = (metrics.clone(), health.clone(), drain.clone());
                async move {
                    let response = respond(&req, peer.ip(), &metrics, &health, &drain).await;
                    Ok::<_, std::convert::Infallible>(response)
                }
            });
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout);
            let stream = Guarded::new(stream, None, limits.write_stall);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = connection => {}
                _ = stop.cancelled() => {}
            }
            drop(permit);
        });
    }
}

/// The headers one request to [`serve_http`] may have.
const APP_MAX_HEADERS: usize = 1024;

/// A plain HTTP/1 and HTTP/2 server: every request on `listener` goes to
/// `handler` until `stop`, which also cuts the connections still open. The
/// demo's sample app and the tests' apps use it.
pub async fn serve_http<H, F>(listener: TcpListener, stop: CancellationToken, handler: H)
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: std::future::Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    loop {
        let stream = tokio::select! {
            _ = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting an HTTP connection failed");
                    continue;
                }
            },
        };
        let (handler, stop) = (handler.clone(), stop.clone());
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let answer = handler(req);
                async move { Ok::<_, std::convert::Infallible>(answer.await) }
            });
            let mut builder = auto::Builder::new(TokioExecutor::new());
            // hyper takes 100 headers by default; a Pub/Sub message alone
            // may carry 100 attributes, and courier adds its own headers.
            builder.http1().max_headers(APP_MAX_HEADERS);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = connection => {}
                _ = stop.cancelled() => {}
            }
        });
    }
}

async fn respond(
    req: &Request<Incoming>,
    peer: std::net::IpAddr,
    metrics: &Metrics,
    health: &Health,
    drain: &Drain,
) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: String| {
        Response::builder()
            .status(status)
            .header("content-type", "text/plain; charset=utf-8")
            .body(Full::new(Bytes::from(body)))
            .unwrap_or_default()
    };
    let wants_openmetrics = req.headers().get_all(http::header::ACCEPT).iter().any(|v| {
        v.to_str()
            .unwrap_or_default()
            .contains("application/openmetrics-text")
    });
    if req.uri().path() == "/metrics"
        && let Some(up) = health.broker_up()
    {
        metrics.broker_up.set(i64::from(up));
    }
    match req.uri().path() {
        "/metrics" if wants_openmetrics => Response::builder()
            .header(
                "content-type",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )
            .body(Full::new(Bytes::from(metrics.encode())))
            .unwrap_or_default(),
        "/metrics" => Response::builder()
            .header("content-type", "text/plain; version=0.0.4; charset=utf-8")
            .body(Full::new(Bytes::from(metrics.encode_prometheus_text())))
            .unwrap_or_default(),
        // Alive while draining: a failed liveness probe would restart
        // courier in the middle of settling what is in flight.
        "/healthz" if health.draining() => text(
            StatusCode::OK,
            "ok; draining: not pulling, finishing the deliveries in flight\n".into(),
        ),
        "/healthz" => text(StatusCode::OK, "ok\n".into()),
        "/readyz" => match health.not_ready() {
            None => text(StatusCode::OK, "ready\n".into()),
            Some(reason) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {reason}\n"),
            ),
        },
        // GET as well as POST: a preStop httpGet hook can only GET.
        "/drain" if matches!(*req.method(), http::Method::GET | http::Method::POST) => {
            if let Err((status, why)) = drain.allows(peer, req.headers()) {
                tracing::warn!(%peer, status = status.as_u16(), "/drain refused");
                return text(status, why);
            }
            if !drain.is_asked() {
                tracing::info!(%peer, "/drain: stopping pulls and finishing the deliveries in flight");
            }
            health.set_draining(true);
            metrics.draining.set(1);
            drain.ask();
            text(StatusCode::OK, drain.finished().await)
        }
        "/drain" => text(
            StatusCode::METHOD_NOT_ALLOWED,
            "use GET or POST /drain\n".into(),
        ),
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; try /metrics, /healthz, /readyz or /drain\n".into(),
        ),
    }
}

/// Binds the endpoint address, with an error that says which flag to change.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    async fn endpoint(limits: EndpointLimits) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let health = Arc::new(Health::default());
        health.set_ready(true);
        tokio::spawn(serve_within(
            listener,
            Arc::new(Metrics::new()),
            health,
            Arc::new(Drain::default()),
            CancellationToken::new(),
            limits,
        ));
        addr
    }

    /// Reads until the server closes; the bytes it sent.
    async fn read_to_close(stream: &mut TcpStream) -> Vec<u8> {
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out))
            .await
            .expect("the server closes the connection")
            .ok();
        out
    }

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        String::from_utf8_lossy(&read_to_close(&mut stream).await).into_owned()
    }

    /// `/readyz` and `courier_broker_up` ask the source when they are
    /// asked: a connection that drops or comes back shows in the next probe
    /// and the next scrape, with nothing polling it in between (issue 28).
    #[tokio::test]
    async fn readiness_and_the_broker_gauge_ask_the_source_when_asked() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (health, metrics) = (Arc::new(Health::default()), Arc::new(Metrics::new()));
        health.set_ready(true);
        let connected = Arc::new(AtomicBool::new(true));
        health.ask_connection({
            let connected = connected.clone();
            move || connected.load(Ordering::SeqCst)
        });
        tokio::spawn(serve_within(
            listener,
            metrics.clone(),
            health,
            Arc::new(Drain::default()),
            CancellationToken::new(),
            EndpointLimits::default(),
        ));
        for up in [true, false, true] {
            connected.store(up, Ordering::SeqCst);
            let ready = get(addr, "/readyz").await;
            let scraped = get(addr, "/metrics").await;
            if up {
                assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
                assert!(scraped.contains("\ncourier_broker_up 1\n"), "{scraped}");
            } else {
                assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
                assert!(ready.contains("the broker connection is lost"), "{ready}");
                assert!(scraped.contains("\ncourier_broker_up 0\n"), "{scraped}");
            }
        }
    }

    /// Without a secret only loopback may drain: the port is usually open
    /// to the whole cluster for scraping. With one, everyone needs it.
    #[test]
    fn who_may_drain() {
        let none = http::HeaderMap::new();
        let open = Drain::new(None);
        for peer in ["127.0.0.1", "127.3.4.5", "::1", "::ffff:127.0.0.1"] {
            assert!(open.allows(peer.parse().unwrap(), &none).is_ok(), "{peer}");
        }
        for peer in ["10.1.2.3", "192.168.0.7", "::ffff:10.0.0.1", "fd00::1"] {
            let refused = open.allows(peer.parse().unwrap(), &none).unwrap_err();
            assert_eq!(refused.0, StatusCode::FORBIDDEN, "{peer}");
            assert!(refused.1.contains("COURIER_DRAIN_TOKEN"), "{}", refused.1);
        }
        let locked = Drain::new(Some("s3cret".into()));
        let mut right = http::HeaderMap::new();
        right.insert(
            http::header::AUTHORIZATION,
            "Bearer s3cret".parse().unwrap(),
        );
        let mut wrong = http::HeaderMap::new();
        wrong.insert(
            http::header::AUTHORIZATION,
            "Bearer s3cres".parse().unwrap(),
        );
        let mut short = http::HeaderMap::new();
        short.insert(http::header::AUTHORIZATION, "Bearer s3c".parse().unwrap());
        for peer in ["127.0.0.1", "10.1.2.3"] {
            let peer = peer.parse().unwrap();
            assert!(locked.allows(peer, &right).is_ok());
            for headers in [&none, &wrong, &short] {
                assert_eq!(
                    locked.allows(peer, headers).unwrap_err().0,
                    StatusCode::UNAUTHORIZED
                );
            }
        }
        assert!(Drain::new(Some(String::new())).token.is_none());
    }

    #[tokio::test]
    async fn a_client_that_sends_no_request_head_is_cut_off() {
        let addr = endpoint(EndpointLimits {
            header_read_timeout: Duration::from_millis(200),
            ..EndpointLimits::default()
        })
        .await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        silent.write_all(b"GET /metr").await.unwrap();
        let started = std::time::Instant::now();
        read_to_close(&mut silent).await;
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
    }

    #[tokio::test]
    async fn connections_over_the_cap_are_closed_and_a_freed_slot_serves_again() {
        let addr = endpoint(EndpointLimits {
            header_read_timeout: Duration::from_secs(30),
            max_connections: 2,
            ..EndpointLimits::default()
        })
        .await;
        let first = TcpStream::connect(addr).await.unwrap();
        let _second = TcpStream::connect(addr).await.unwrap();
        let mut third = TcpStream::connect(addr).await.unwrap();
        assert!(
            read_to_close(&mut third).await.is_empty(),
            "the third connection is closed without an answer"
        );
        drop(first);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let answer = get(addr, "/readyz").await;
            if answer.starts_with("HTTP/1.1 200") {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no slot came free: {answer:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A connection from `local` (any 127.x address is this machine).
    async fn connect_from(local: &str, addr: SocketAddr) -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(format!("{local}:0").parse().unwrap()).unwrap();
        socket.connect(addr).await.unwrap()
    }

    /// Found by reading 21da363: a client that pipelines `GET /metrics`
    /// and never reads blocked the server's write forever, holding one of
    /// the 64 connections; 64 of them failed the kubelet's probes. Now an
    /// answer the peer takes nothing of for the write bound ends the
    /// connection.
    #[tokio::test]
    async fn a_client_that_pipelines_and_never_reads_is_cut_off() {
        let addr = endpoint(EndpointLimits {
            header_read_timeout: Duration::from_secs(30),
            write_stall: Duration::from_millis(300),
            ..EndpointLimits::default()
        })
        .await;
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let stream = socket.connect(addr).await.unwrap();
        let (mut reader, mut writer) = stream.into_split();
        tokio::spawn(async move {
            let request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(5000);
            let _ = writer.write_all(&request).await;
        });
        // Long past the bound, without reading a byte.
        tokio::time::sleep(Duration::from_secs(2)).await;
        // Cut off: what was buffered, then the end. Still served, the
        // reading would go on until the 30 s header timeout.
        let mut sink = Vec::new();
        let ended =
            tokio::time::timeout(Duration::from_secs(5), reader.read_to_end(&mut sink)).await;
        assert!(ended.is_ok(), "the stalled connection was kept open");
        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
    }

    /// Found by reading 21da363: one address could hold every one of the
    /// endpoint's connections. It holds at most `max_per_peer`; the next
    /// from it is closed, and another address is still served.
    #[tokio::test]
    async fn one_address_cannot_hold_every_connection() {
        let addr = endpoint(EndpointLimits {
            header_read_timeout: Duration::from_secs(30),
            max_per_peer: 3,
            ..EndpointLimits::default()
        })
        .await;
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(connect_from("127.0.0.7", addr).await);
        }
        let mut fourth = connect_from("127.0.0.7", addr).await;
        assert!(
            read_to_close(&mut fourth).await.is_empty(),
            "the fourth from one address is closed without an answer"
        );
        let mut other = connect_from("127.0.0.8", addr).await;
        other
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let answer = String::from_utf8_lossy(&read_to_close(&mut other).await).into_owned();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
}
