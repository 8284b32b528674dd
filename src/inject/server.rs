//! The HTTPS server: accept, hand the TLS handshake the current
//! certificate, answer `/mutate`, `/healthz` and `/readyz`, and stop
//! gracefully on shutdown.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use super::review::review;
use super::settings::SidecarDefaults;
use super::tls::{ReloadingCert, server_config};
use crate::telemetry::guard::{Admission, Guarded};

/// The largest AdmissionReview read; a pod is far smaller.
const MAX_REVIEW_BYTES: usize = 4 << 20;

/// What one peer of the webhook may hold. With `failurePolicy: Fail` a
/// webhook that cannot answer stops pod creation, so idle and stalled
/// connections must not pile up.
#[derive(Debug, Clone, Copy)]
pub struct WebhookLimits {
    /// TLS handshake, and an HTTP/1 request head, within this.
    pub handshake_timeout: Duration,
    /// A connection that sends nothing for this long is closed (idle
    /// HTTP/2 connections of the API server included: it reconnects).
    pub read_idle: Duration,
    /// An answer the peer takes nothing of for this long ends it.
    pub write_stall: Duration,
    pub max_connections: usize,
    /// Connections one address may hold: a few API server replicas, each
    /// with a few connections, always find room.
    pub max_per_peer: usize,
}

impl Default for WebhookLimits {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(10),
            read_idle: Duration::from_secs(90),
            write_stall: Duration::from_secs(10),
            max_connections: 256,
            max_per_peer: 32,
        }
    }
}

/// Everything `courier inject` serves with, checked.
#[derive(Debug, Clone)]
pub struct InjectConfig {
    pub listen: SocketAddr,
    pub tls_cert: PathBuf,
    pub tls_key: PathBuf,
    pub tls_reload_interval: Duration,
    pub defaults: SidecarDefaults,
}

/// Binds `config.listen` and serves the webhook over HTTPS until
/// `shutdown`; returns the bound address and the server task. Fails at
/// once when the certificate cannot be loaded.
pub async fn serve(
    config: InjectConfig,
    shutdown: CancellationToken,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    serve_within(config, shutdown, WebhookLimits::default()).await
}

/// [`serve`] within `limits`.
pub async fn serve_within(
    config: InjectConfig,
    shutdown: CancellationToken,
    limits: WebhookLimits,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let cert = Arc::new(
        ReloadingCert::load(&config.tls_cert, &config.tls_key)
            .context("cannot load the webhook's TLS certificate")?,
    );
    let acceptor = TlsAcceptor::from(Arc::new(server_config(cert.clone())?));
    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on --listen {}", config.listen))?;
    let addr = listener.local_addr()?;
    tokio::spawn(watch_certificate(
        cert,
        config.tls_reload_interval,
        shutdown.clone(),
    ));
    let defaults = Arc::new(config.defaults);
    let handle = tokio::spawn(accept_loop(listener, acceptor, defaults, shutdown, limits));
    Ok((addr, handle))
}

async fn watch_certificate(cert: Arc<ReloadingCert>, every: Duration, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        match cert.reload() {
            Ok(true) => {
                tracing::info!(cert = %cert.cert_path().display(), "TLS certificate reloaded")
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(error = %e, "the new TLS certificate was refused; serving the previous one")
            }
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    defaults: Arc<SidecarDefaults>,
    shutdown: CancellationToken,
    limits: WebhookLimits,
) {
    let admission = Admission::new(limits.max_connections, limits.max_per_peer);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a webhook connection failed");
                    continue;
                }
            },
        };
        // Finished connections are reaped here, so the set holds only
        // those still open.
        while connections.try_join_next().is_some() {}
        let Some(admitted) = admission.admit(peer.ip()) else {
            tracing::debug!(%peer, "the webhook is at its connection cap; closing a new one");
            continue;
        };
        let (acceptor, defaults, shutdown) = (acceptor.clone(), defaults.clone(), shutdown.clone());
        connections.spawn(async move {
            let _admitted = admitted;
            let stream = Guarded::new(stream, Some(limits.read_idle), limits.write_stall);
            let tls = match tokio::time::timeout(limits.handshake_timeout, acceptor.accept(stream))
                .await
            {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let service = service_fn(move |req| {
                let defaults = defaults.clone();
                async move { Ok::<_, std::convert::Infallible>(respond(req, &defaults).await) }
            });
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.handshake_timeout);
            let conn = builder.serve_connection(TokioIo::new(tls), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = shutdown.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
    while connections.join_next().await.is_some() {}
}

async fn respond(req: Request<Incoming>, defaults: &SidecarDefaults) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: &'static str| {
        Response::builder()
            .status(status)
            .header(http::header::CONTENT_TYPE, "text/plain; charset=utf-8")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .expect("a static response")
    };
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
        (&Method::GET, "/readyz") => text(StatusCode::OK, "ready\n"),
        (&Method::POST, "/mutate") => {
            let body = match Limited::new(req.into_body(), MAX_REVIEW_BYTES)
                .collect()
                .await
            {
                Ok(b) => b.to_bytes(),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read an AdmissionReview body");
                    return text(StatusCode::BAD_REQUEST, "cannot read the body\n");
                }
            };
            match serde_json::to_vec(&review(&body, defaults)) {
                Ok(json) => Response::builder()
                    .status(StatusCode::OK)
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from(json)))
                    .expect("a JSON response"),
                Err(e) => {
                    tracing::error!(error = %e, "cannot encode the AdmissionReview answer");
                    text(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "cannot encode the answer\n",
                    )
                }
            }
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; try POST /mutate, GET /healthz or GET /readyz\n",
        ),
    }
}
