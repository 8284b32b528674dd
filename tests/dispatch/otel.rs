//! OpenTelemetry traces through the built binary: a real Redis, a real app
//! on loopback, and an OTLP/HTTP receiver here that decodes what courier
//! exports with the protocol's own protobuf types.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use courier::telemetry::serve_http;
use http::Response;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use prost::Message as _;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const LIMIT: Duration = Duration::from_secs(60);

/// The producer's span, as a W3C `traceparent` carries it.
const PRODUCER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PRODUCER_SPAN: &str = "00f067aa0ba902b7";
const PRODUCER_STATE: &str = "shop=orders,vendor=abc";

fn producer_headers() -> Vec<(String, String)> {
    vec![
        (
            "traceparent".into(),
            format!("00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01"),
        ),
        ("tracestate".into(), PRODUCER_STATE.into()),
    ]
}

// === The collector ===

/// One export request as the receiver saw it.
struct Export {
    path: String,
    content_type: String,
    request: ExportTraceServiceRequest,
}

/// The receiver's answer to one request.
type Answer = std::pin::Pin<Box<dyn std::future::Future<Output = Response<Full<Bytes>>> + Send>>;

/// An OTLP/HTTP receiver on loopback: every request is decoded as a trace
/// export and kept, and answered as a collector answers.
struct Receiver {
    addr: SocketAddr,
    exports: Arc<Mutex<Vec<Export>>>,
    stop: CancellationToken,
    /// Behind TLS, with a certificate of its own CA.
    tls: bool,
}

impl Receiver {
    async fn start() -> Self {
        Self::start_on("127.0.0.1:0").await
    }

    async fn start_on(addr: &str) -> Self {
        let (receiver, listener) = Self::bind(addr, false).await;
        let handler = receiver.handler();
        tokio::spawn(serve_http(listener, receiver.stop.clone(), handler));
        receiver
    }

    /// The receiver behind TLS: its certificate names 127.0.0.1 and is
    /// signed by a CA of its own, whose PEM is written to `ca_file`.
    async fn start_tls(ca_file: &std::path::Path) -> Self {
        let (receiver, listener) = Self::bind("127.0.0.1:0", true).await;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_tls(ca_file)));
        let (handler, stop) = (receiver.handler(), receiver.stop.clone());
        tokio::spawn(async move {
            loop {
                let tcp = tokio::select! {
                    _ = stop.cancelled() => return,
                    accepted = listener.accept() => accepted.unwrap().0,
                };
                let (acceptor, handler) = (acceptor.clone(), handler.clone());
                tokio::spawn(async move {
                    let Ok(stream) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(move |req| {
                        let answer = handler(req);
                        async move { Ok::<_, std::convert::Infallible>(answer.await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        receiver
    }

    async fn bind(addr: &str, tls: bool) -> (Self, TcpListener) {
        let listener = TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("the receiver cannot listen on {addr}: {e}"));
        let receiver = Self {
            addr: listener.local_addr().unwrap(),
            exports: Arc::default(),
            stop: CancellationToken::new(),
            tls,
        };
        (receiver, listener)
    }

    /// Decodes and keeps each export, and answers as a collector does.
    fn handler(
        &self,
    ) -> impl Fn(http::Request<Incoming>) -> Answer + Clone + Send + Sync + 'static {
        let exports = self.exports.clone();
        move |req| {
            let exports = exports.clone();
            Box::pin(async move {
                let path = req.uri().path().to_string();
                let content_type = req
                    .headers()
                    .get("content-type")
                    .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                    .unwrap_or_default();
                let body = req.into_body().collect().await.unwrap().to_bytes();
                let request = ExportTraceServiceRequest::decode(body)
                    .expect("the body is an OTLP trace export in protobuf");
                exports.lock().unwrap().push(Export {
                    path,
                    content_type,
                    request,
                });
                Response::builder()
                    .header("content-type", "application/x-protobuf")
                    .body(Full::new(Bytes::from(
                        ExportTraceServiceResponse::default().encode_to_vec(),
                    )))
                    .unwrap()
            })
        }
    }

    fn endpoint(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// Every span exported so far, with its resource's attributes.
    fn spans(&self) -> Vec<(HashMap<String, String>, Span)> {
        let exports = self.exports.lock().unwrap();
        let mut spans = Vec::new();
        for export in exports.iter() {
            for resource_spans in &export.request.resource_spans {
                let resource = resource_spans
                    .resource
                    .as_ref()
                    .map(|r| attributes(&r.attributes))
                    .unwrap_or_default();
                for scope in &resource_spans.scope_spans {
                    for span in &scope.spans {
                        spans.push((resource.clone(), span.clone()));
                    }
                }
            }
        }
        spans
    }

    fn requests(&self) -> usize {
        self.exports.lock().unwrap().len()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A server configuration with a certificate for 127.0.0.1 signed by a
/// fresh CA, whose certificate is written to `ca_file`.
fn server_tls(ca_file: &std::path::Path) -> rustls::ServerConfig {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "courier test collector CA");
    let ca_key = KeyPair::generate().unwrap();
    std::fs::write(ca_file, ca.self_signed(&ca_key).unwrap().pem()).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    let key = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap();
    rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], key)
        .unwrap()
}

/// Attributes as text: strings as they are, integers in decimal.
fn attributes(attributes: &[KeyValue]) -> HashMap<String, String> {
    attributes
        .iter()
        .filter_map(|kv| {
            let value = match kv.value.as_ref()?.value.as_ref()? {
                Value::StringValue(s) => s.clone(),
                Value::IntValue(i) => i.to_string(),
                Value::BoolValue(b) => b.to_string(),
                Value::DoubleValue(d) => d.to_string(),
                other => format!("{other:?}"),
            };
            Some((kv.key.clone(), value))
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One run of `courier run`: a fresh Redis queue, the app, the process.
struct Run {
    fixture: Fixture,
    app: TestApp,
    courier: CourierProcess,
    _dir: tempfile::TempDir,
}

impl Run {
    /// Sends each of `bodies` with the producer's trace context, then
    /// starts courier with a fast retry policy and `env`; returns the ids.
    async fn start(bodies: &[String], env: &[(&str, &str)]) -> (Self, Vec<String>) {
        Self::start_on(Fixture::redis(), bodies, env).await
    }

    /// [`Run::start`] on the queue of `fixture`.
    async fn start_on(
        fixture: Fixture,
        bodies: &[String],
        env: &[(&str, &str)],
    ) -> (Self, Vec<String>) {
        let app = TestApp::start().await;
        let producer = fixture.producer().await;
        let mut ids = Vec::new();
        for body in bodies {
            ids.push(producer.send(body.clone(), &producer_headers()).await);
        }
        let dir = tempfile::tempdir().unwrap();
        let policy = write_policy(
            dir.path(),
            "maxAttempts: 5\nbackoff: {initial: 100ms, max: 100ms, jitter: none}",
        );
        let args = run_args(&fixture, &app, &policy, "traced");
        let courier = CourierProcess::run_with_env(&args, env);
        let run = Self {
            fixture,
            app,
            courier,
            _dir: dir,
        };
        (run, ids)
    }

    /// Waits until `count` messages are acked, then stops courier with
    /// SIGTERM and checks it exited cleanly.
    async fn acked_then_stopped(&mut self, count: usize) {
        let addr = self.courier.metrics_addr().await;
        let queue = self.fixture.queue.clone();
        wait_for("the acks", LIMIT, async || {
            metric(&scrape(addr).await, "courier_acks_total", &queue) >= count as f64
        })
        .await;
        self.courier.terminate();
        let status = self.courier.exit_within(LIMIT).await;
        assert!(status.success(), "{status}\n{}", self.courier.log());
    }

    /// The log lines in which the OpenTelemetry SDK warns of, or reports, a
    /// failed export.
    fn export_problems(&self) -> Vec<serde_json::Value> {
        self.courier
            .log()
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|line| {
                line["target"]
                    .as_str()
                    .is_some_and(|t| t.starts_with("opentelemetry"))
                    && matches!(line["level"].as_str(), Some("WARN" | "ERROR"))
            })
            .collect()
    }

    /// The app received `body` once, with the producer's trace context as
    /// the producer sent it.
    fn assert_untouched(&self, body: &str) {
        let received = self.app.received_body(body.as_bytes());
        assert_eq!(received.len(), 1);
        assert_eq!(
            received[0].header("traceparent"),
            Some(format!("00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01").as_str())
        );
        assert_eq!(received[0].header("tracestate"), Some(PRODUCER_STATE));
    }
}

// === The tests ===

crate::per_source!(
    [redis => Fixture::redis(), amqp => Fixture::amqp(), nats => Fixture::nats()],
    [three_attempts_export_three_spans_under_the_producers_span]
);

/// The test, on every broker that runs here as a service: answers
/// 503, 503, 200 make three spans, each a child of the producer's span in
/// its trace, each with its attempt, result and status; the app is sent
/// each attempt's own span as its parent. The batch export waits longer
/// than the test runs, so the spans can arrive only through the flush at
/// shutdown.
async fn three_attempts_export_three_spans_under_the_producers_span(fixture: Fixture) {
    let system = match fixture.broker {
        BrokerKind::Redis => "redis",
        BrokerKind::Amqp => "rabbitmq",
        BrokerKind::Nats => "nats",
        other => panic!("no messaging.system expected for {other:?}"),
    };
    let receiver = Receiver::start().await;
    let endpoint = receiver.endpoint();
    let body = "script:503,503,200";
    let (mut run, ids) = Run::start_on(
        fixture,
        &[body.to_string()],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            (
                "OTEL_RESOURCE_ATTRIBUTES",
                "deployment.environment.name=test",
            ),
            ("OTEL_BSP_SCHEDULE_DELAY", "600000"),
        ],
    )
    .await;
    run.acked_then_stopped(1).await;
    let (fixture, courier) = (&run.fixture, &run.courier);
    assert_eq!(run.export_problems(), Vec::<serde_json::Value>::new());

    {
        let exports = receiver.exports.lock().unwrap();
        assert!(!exports.is_empty(), "nothing exported\n{}", courier.log());
        for export in exports.iter() {
            assert_eq!(export.path, "/v1/traces");
            assert_eq!(export.content_type, "application/x-protobuf");
        }
    }
    let mut spans = receiver.spans();
    assert_eq!(spans.len(), 3, "one span per attempt: {spans:#?}");
    spans.sort_by_key(|(_, span)| attributes(&span.attributes)["courier.attempt"].clone());
    let received = run.app.received_body(body.as_bytes());
    assert_eq!(received.len(), 3);
    let expected = [
        ("1", "503", "transient", StatusCode::Error),
        ("2", "503", "transient", StatusCode::Error),
        ("3", "200", "success", StatusCode::Ok),
    ];
    for (((resource, span), (attempt, status, result, code)), request) in
        spans.iter().zip(expected).zip(&received)
    {
        assert_eq!(resource["service.name"], "courier");
        assert_eq!(resource["deployment.environment.name"], "test");
        assert_eq!(
            hex(&span.trace_id),
            PRODUCER_TRACE,
            "in the producer's trace"
        );
        assert_eq!(
            hex(&span.parent_span_id),
            PRODUCER_SPAN,
            "a child of the producer's span"
        );
        assert_eq!(span.trace_state, PRODUCER_STATE, "tracestate carried");
        assert_eq!(span.kind, SpanKind::Consumer as i32);
        assert_eq!(span.name, format!("process {}", fixture.queue));
        let attrs = attributes(&span.attributes);
        assert_eq!(attrs["messaging.system"], system);
        assert_eq!(attrs["messaging.operation.type"], "process");
        assert_eq!(attrs["messaging.destination.name"], fixture.queue);
        assert_eq!(attrs["messaging.consumer.group.name"], "courier");
        assert_eq!(attrs["messaging.message.id"], ids[0]);
        assert_eq!(attrs["courier.attempt"], attempt);
        assert_eq!(attrs["http.response.status_code"], status);
        assert_eq!(attrs["courier.result"], result);
        let span_status = span.status.as_ref().expect("a status");
        assert_eq!(span_status.code, code as i32, "attempt {attempt}");
        if code == StatusCode::Error {
            assert_eq!(attrs["error.type"], result);
        } else {
            assert!(!attrs.contains_key("error.type"));
        }

        assert_eq!(request.attempt().to_string(), attempt);
        assert_eq!(
            request.header("traceparent"),
            Some(format!("00-{PRODUCER_TRACE}-{}-01", hex(&span.span_id)).as_str()),
            "attempt {attempt}: the app's parent is this attempt's span"
        );
        assert_eq!(request.header("tracestate"), Some(PRODUCER_STATE));
    }
    let ids: std::collections::HashSet<_> = spans.iter().map(|(_, s)| hex(&s.span_id)).collect();
    assert_eq!(ids.len(), 3, "three distinct spans");
}

/// The second test: without the variable nothing is exported, and
/// the app receives the producer's trace context untouched. The receiver
/// listens where an SDK exports by default (localhost:4318), so a default
/// that turned the export on would reach it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_endpoint_nothing_is_exported_and_the_traceparent_passes_unchanged() {
    let receiver = Receiver::start_on("127.0.0.1:4318").await;
    // Every other variable a pod may carry, none of which turns export on.
    let (mut run, _) = Run::start(
        &["untraced".to_string()],
        &[
            ("OTEL_SERVICE_NAME", "orders"),
            ("OTEL_TRACES_SAMPLER", "always_on"),
            ("OTEL_BSP_SCHEDULE_DELAY", "10"),
        ],
    )
    .await;
    run.acked_then_stopped(1).await;
    run.assert_untouched("untraced");
    assert_eq!(receiver.requests(), 0, "nothing reached the receiver");
}

/// `OTEL_SDK_DISABLED=true` turns the export off even with the endpoint
/// set, here naming a receiver that listens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disabled_sdk_exports_nothing() {
    let receiver = Receiver::start().await;
    let endpoint = receiver.endpoint();
    let (mut run, _) = Run::start(
        &["disabled".to_string()],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_SDK_DISABLED", "true"),
            ("OTEL_BSP_SCHEDULE_DELAY", "10"),
        ],
    )
    .await;
    run.acked_then_stopped(1).await;
    run.assert_untouched("disabled");
    assert_eq!(receiver.requests(), 0, "nothing reached the receiver");
}

/// A collector that is not there never holds deliveries up: with the
/// endpoint on a closed port every message is delivered and acked, and
/// courier still stops when asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_collector_does_not_stop_deliveries() {
    let closed = {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        listener.local_addr().unwrap()
    };
    let endpoint = format!("http://{closed}");
    const MESSAGES: usize = 50;
    let bodies: Vec<String> = (0..MESSAGES).map(|n| format!("m{n}")).collect();
    let (mut run, _) = Run::start(
        &bodies,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_BSP_SCHEDULE_DELAY", "10"),
            ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "1"),
        ],
    )
    .await;
    run.acked_then_stopped(MESSAGES).await;
    assert!(
        !run.export_problems().is_empty(),
        "the log says the export fails\n{}",
        run.courier.log()
    );
    assert_eq!(run.app.reached(&bodies.into_iter().collect()), MESSAGES);
    for request in run.app.received() {
        let traceparent = request.header("traceparent").unwrap_or_default();
        assert!(
            traceparent.starts_with(&format!("00-{PRODUCER_TRACE}-"))
                && !traceparent.contains(PRODUCER_SPAN),
            "courier's own span is the app's parent: {traceparent}"
        );
    }
}

/// An `https://` collector is verified with the CA that
/// `OTEL_EXPORTER_OTLP_CERTIFICATE` names; without it (the system's roots do
/// not know that CA) nothing reaches the collector, and deliveries go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_collector_is_verified_with_the_certificate_file() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    let receiver = Receiver::start_tls(&ca).await;
    let endpoint = receiver.endpoint();
    let ca = ca.display().to_string();
    let (mut run, ids) = Run::start(
        &["over tls".to_string()],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_EXPORTER_OTLP_CERTIFICATE", &ca),
        ],
    )
    .await;
    run.acked_then_stopped(1).await;
    let spans = receiver.spans();
    assert_eq!(spans.len(), 1, "{}", run.courier.log());
    assert_eq!(
        attributes(&spans[0].1.attributes)["messaging.message.id"],
        ids[0]
    );

    let unverified = Receiver::start_tls(&dir.path().join("other-ca.pem")).await;
    let endpoint = unverified.endpoint();
    let (mut run, _) = Run::start(
        &["unverified".to_string()],
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)],
    )
    .await;
    run.acked_then_stopped(1).await;
    assert_eq!(
        unverified.requests(),
        0,
        "no export to an unverified collector"
    );
    assert!(!run.export_problems().is_empty(), "{}", run.courier.log());
}

/// Values courier cannot follow stop `run` at start with exit code 2 and
/// the variable's name.
#[test]
fn bad_trace_settings_are_refused_at_start() {
    let fixture = Fixture::redis();
    // `courier run` with the endpoint set and `name=value`: its exit code
    // and what it wrote.
    let refused = |name: &str, value: &str| {
        let mut command = courier_command();
        command.env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318");
        let output = command
            .env(name, value)
            .args([
                "run",
                "--source",
                &fixture.source_arg(),
                "--queue",
                &fixture.queue,
            ])
            .args(["--listen", "127.0.0.1:0"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert_eq!(output.status.code(), Some(2), "{name}={value}: {stderr}");
        stderr
    };
    for (name, value) in [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "not a url"),
        ("OTEL_TRACES_SAMPLER", "sometimes"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
    ] {
        let stderr = refused(name, value);
        assert!(
            stderr.starts_with(&format!("error: {name} {value:?}")),
            "{name}={value}: {stderr}"
        );
    }
    let stderr = refused("OTEL_EXPORTER_OTLP_CERTIFICATE", "/nonexistent/ca.pem");
    assert!(
        stderr.starts_with(
            "error: OTEL_EXPORTER_OTLP_CERTIFICATE /nonexistent/ca.pem: cannot read it"
        ),
        "{stderr}"
    );
}
