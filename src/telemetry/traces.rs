//! OpenTelemetry traces: a span per delivery attempt, a child of the
//! producer's `traceparent`, exported over OTLP/HTTP with protobuf when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is
//! set. Off, nothing here runs: no layer is installed and the dispatcher
//! makes no span.
//!
//! The export leaves from the SDK's batch thread through courier's own
//! hyper client on the runtime, so a collector that is slow or gone costs a
//! full queue of dropped spans, never a delivery's time.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http::Uri;
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{Status, TracerProvider as _};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The `tracing` target of delivery spans: the export layer takes only
/// these, and the log output never shows them.
pub const TARGET: &str = "courier::traces";

/// How long the export may take to finish at shutdown; a collector that is
/// gone must not hold up the pod's exit.
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(5);

/// The export's per-request limit when `OTEL_EXPORTER_OTLP_TIMEOUT` is not
/// set, the specification's default.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Which spans are kept (`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    AlwaysOn,
    AlwaysOff,
    /// Keeps this fraction of traces, by trace id.
    Ratio(f64),
    /// Follows the producer's sampled flag; `root` decides for a message
    /// that carries no `traceparent`.
    ParentBased {
        root: Root,
    },
}

/// What a parent-based sampler does for a span without a parent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Root {
    AlwaysOn,
    AlwaysOff,
    Ratio(f64),
}

impl Sampling {
    fn sampler(self) -> Sampler {
        let root = |root: Root| match root {
            Root::AlwaysOn => Sampler::AlwaysOn,
            Root::AlwaysOff => Sampler::AlwaysOff,
            Root::Ratio(ratio) => Sampler::TraceIdRatioBased(ratio),
        };
        match self {
            Sampling::AlwaysOn => Sampler::AlwaysOn,
            Sampling::AlwaysOff => Sampler::AlwaysOff,
            Sampling::Ratio(ratio) => Sampler::TraceIdRatioBased(ratio),
            Sampling::ParentBased { root: r } => Sampler::ParentBased(Box::new(root(r))),
        }
    }
}

/// The trace export as the standard `OTEL_*` variables ask for it.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSettings {
    /// The full URL spans are POSTed to (`…/v1/traces`).
    pub endpoint: Uri,
    pub sampling: Sampling,
    /// Per export request.
    pub timeout: Duration,
    /// Neither `OTEL_SERVICE_NAME` nor `service.name` in
    /// `OTEL_RESOURCE_ATTRIBUTES`: the service is called `courier`.
    pub default_service_name: bool,
    /// The PEM file of the CA that signed an `https://` collector's
    /// certificate, with the variable that named it; else the system's roots.
    pub certificate: Option<(&'static str, PathBuf)>,
}

/// Reads the standard variables through `var`; `Ok(None)` when traces are
/// off (no endpoint, `OTEL_SDK_DISABLED=true`, `OTEL_TRACES_EXPORTER=none`).
/// A value courier cannot follow is an error that names the variable.
pub fn settings_from_env(
    var: impl Fn(&str) -> Option<String>,
) -> Result<Option<TraceSettings>, String> {
    let var = |name: &str| var(name).filter(|v| !v.trim().is_empty());
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    match var("OTEL_TRACES_EXPORTER").as_deref().map(str::trim) {
        None | Some("otlp") => {}
        Some("none") => return Ok(None),
        Some(other) => {
            return Err(format!(
                "OTEL_TRACES_EXPORTER {other:?}: courier exports traces over OTLP only; write otlp, or none to turn them off"
            ));
        }
    }
    // The signal's own variable is the whole URL; the generic one is a base
    // that the signal's path is added to, as the specification says.
    let (name, value, endpoint) = match (
        var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        var("OTEL_EXPORTER_OTLP_ENDPOINT"),
    ) {
        (Some(url), _) => {
            let endpoint = url.trim().to_string();
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", url, endpoint)
        }
        (None, Some(base)) => {
            let endpoint = format!("{}/v1/traces", base.trim().trim_end_matches('/'));
            ("OTEL_EXPORTER_OTLP_ENDPOINT", base, endpoint)
        }
        (None, None) => return Ok(None),
    };
    let endpoint = collector_url(&endpoint).map_err(|why| format!("{name} {value:?}: {why}"))?;
    for name in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        if let Some(protocol) = var(name) {
            if protocol.trim() != "http/protobuf" {
                return Err(format!(
                    "{name} {protocol:?}: courier exports OTLP over HTTP with protobuf only; write http/protobuf or leave it unset"
                ));
            }
            break;
        }
    }
    let mut timeout = DEFAULT_TIMEOUT;
    for name in [
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
    ] {
        if let Some(millis) = var(name) {
            let millis: u64 = millis.trim().parse().map_err(|_| {
                format!("{name} {millis:?} is not a number of milliseconds; write it like 10000")
            })?;
            timeout = Duration::from_millis(millis);
            break;
        }
    }
    let sampling = sampling(
        var("OTEL_TRACES_SAMPLER").as_deref(),
        var("OTEL_TRACES_SAMPLER_ARG").as_deref(),
    )?;
    let certificate = [
        "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
        "OTEL_EXPORTER_OTLP_CERTIFICATE",
    ]
    .into_iter()
    .find_map(|name| Some((name, PathBuf::from(var(name)?.trim()))));
    let named_in_attributes = var("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|attributes| {
        attributes
            .split(',')
            .any(|pair| pair.split('=').next().map(str::trim) == Some("service.name"))
    });
    Ok(Some(TraceSettings {
        endpoint,
        sampling,
        timeout,
        default_service_name: var("OTEL_SERVICE_NAME").is_none() && !named_in_attributes,
        certificate,
    }))
}

/// A collector's URL: `http://` or `https://` with a host.
fn collector_url(text: &str) -> Result<Uri, String> {
    let uri: Uri = text
        .parse()
        .map_err(|_| "not a URL; write it like http://otel-collector:4318".to_string())?;
    match (uri.scheme_str(), uri.host()) {
        (Some("http" | "https"), Some(host)) if !host.is_empty() => Ok(uri),
        _ => Err(
            "not an http:// or https:// URL with a host; write it like http://otel-collector:4318"
                .into(),
        ),
    }
}

/// The sampler the spec's names ask for; the ratio (`OTEL_TRACES_SAMPLER_ARG`)
/// defaults to 1.
fn sampling(name: Option<&str>, arg: Option<&str>) -> Result<Sampling, String> {
    let ratio = || match arg.map(str::trim) {
        None => Ok(1.0),
        Some(text) => match text.parse::<f64>() {
            Ok(ratio) if (0.0..=1.0).contains(&ratio) => Ok(ratio),
            _ => Err(format!(
                "OTEL_TRACES_SAMPLER_ARG {text:?} is not a ratio between 0 and 1; write it like 0.25"
            )),
        },
    };
    Ok(
        match name.map(str::trim).unwrap_or("parentbased_always_on") {
            "always_on" => Sampling::AlwaysOn,
            "always_off" => Sampling::AlwaysOff,
            "traceidratio" => Sampling::Ratio(ratio()?),
            "parentbased_always_on" => Sampling::ParentBased {
                root: Root::AlwaysOn,
            },
            "parentbased_always_off" => Sampling::ParentBased {
                root: Root::AlwaysOff,
            },
            "parentbased_traceidratio" => Sampling::ParentBased {
                root: Root::Ratio(ratio()?),
            },
            other => {
                return Err(format!(
                    "OTEL_TRACES_SAMPLER {other:?} is not a sampler courier has; write always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off or parentbased_traceidratio"
                ));
            }
        },
    )
}

// === impl Traces ===

/// The running export. Shut it down after the drain so that the last
/// spans reach the collector before the process exits.
pub struct Traces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

impl Traces {
    /// Starts the batch export to the collector; the export's requests run
    /// on `runtime`, and `tls` verifies an `https://` collector.
    pub fn start(
        settings: &TraceSettings,
        tls: rustls::ClientConfig,
        runtime: tokio::runtime::Handle,
    ) -> Result<Self, String> {
        let collector = Collector::new(runtime, settings.timeout, tls);
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(settings.endpoint.to_string())
            .with_timeout(settings.timeout)
            .with_http_client(collector)
            .build()
            .map_err(|e| format!("cannot set up the trace export: {e}"))?;
        let mut resource = Resource::builder();
        if settings.default_service_name {
            resource = resource.with_service_name("courier");
        }
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(settings.sampling.sampler())
            .with_resource(resource.build())
            .build();
        let tracer = provider.tracer("courier");
        Ok(Self { provider, tracer })
    }

    /// The `tracing` layer that turns delivery spans into OpenTelemetry
    /// spans; it sees nothing but [`TARGET`].
    pub fn layer<S>(&self) -> impl tracing_subscriber::Layer<S> + 'static
    where
        S: tracing::Subscriber + Send + Sync + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        use tracing_subscriber::Layer as _;
        tracing_opentelemetry::layer()
            .with_tracer(self.tracer.clone())
            .with_threads(false)
            .with_target(false)
            .with_location(false)
            .with_tracked_inactivity(false)
            .with_filter(
                tracing_subscriber::filter::Targets::new()
                    .with_target(TARGET, tracing::Level::TRACE),
            )
    }

    /// Exports what is left, waiting at most a few seconds. Runs off the
    /// runtime's thread: the export's requests need that thread to move.
    pub async fn shutdown(self) {
        let provider = self.provider;
        let done =
            tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(SHUTDOWN_LIMIT))
                .await;
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "the last spans may not have reached the collector")
            }
            Err(e) => tracing::warn!(error = %e, "the trace export did not shut down"),
        }
    }
}

// === Delivery spans ===

/// What a delivery attempt's span says from its start.
pub struct Attempt<'a> {
    /// `messaging.system`: `redis`, `rabbitmq`, `nats`, `embedded`.
    pub system: &'static str,
    pub queue: &'a str,
    pub group: &'a str,
    pub message_id: &'a str,
    /// 1 on the first delivery.
    pub attempt: u32,
    pub body_size: usize,
}

/// The W3C headers that name a delivery span as the app's parent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Propagation {
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

impl Injector for Propagation {
    fn set(&mut self, key: &str, value: String) {
        if value.is_empty() {
            return;
        }
        match key {
            "traceparent" => self.traceparent = Some(value),
            "tracestate" => self.tracestate = Some(value),
            _ => {}
        }
    }
}

/// A message's headers as the propagator reads them, names without case.
struct Carrier<'a>(&'a [(String, String)]);

impl Extractor for Carrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(key))
            .map(|(_, value)| value.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(name, _)| name.as_str()).collect()
    }
}

/// Starts the span of one delivery attempt as a child of the producer's
/// `traceparent` (and `tracestate`) in `headers`, and returns it with the
/// headers that make it the parent of the app's span. The span ends when
/// it is dropped.
pub fn attempt_span(
    attempt: &Attempt<'_>,
    headers: &[(String, String)],
) -> (tracing::Span, Propagation) {
    let span = tracing::info_span!(
        target: TARGET,
        "process",
        otel.name = format!("process {}", attempt.queue),
        otel.kind = "consumer",
        messaging.system = attempt.system,
        messaging.operation.type = "process",
        messaging.operation.name = "process",
        messaging.destination.name = attempt.queue,
        messaging.consumer.group.name = attempt.group,
        messaging.message.id = attempt.message_id,
        messaging.message.body.size = attempt.body_size,
        courier.attempt = attempt.attempt,
    );
    let propagator = TraceContextPropagator::new();
    let parent = propagator.extract(&Carrier(headers));
    // Refused only when the span is disabled: then it has no parent to set.
    let _ = span.set_parent(parent);
    let mut propagation = Propagation::default();
    propagator.inject_context(&span.context(), &mut propagation);
    (span, propagation)
}

/// Records how the attempt ended: the result (the label of
/// `courier_deliveries_total`), the app's status if it answered, and an
/// error status for anything but a success.
pub fn record_result(span: &tracing::Span, result: &'static str, status: Option<u16>) {
    span.set_attribute("courier.result", result);
    if let Some(status) = status {
        span.set_attribute("http.response.status_code", i64::from(status));
    }
    if result == "success" {
        span.set_status(Status::Ok);
    } else {
        span.set_attribute("error.type", result);
        span.set_status(Status::error(result));
    }
}

// === impl Collector ===

/// The export's HTTP client: each request runs on courier's runtime, while
/// the SDK's batch thread waits for it.
struct Collector {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    runtime: tokio::runtime::Handle,
    timeout: Duration,
}

impl Collector {
    fn new(runtime: tokio::runtime::Handle, timeout: Duration, tls: rustls::ClientConfig) -> Self {
        let mut tcp = HttpConnector::new();
        tcp.enforce_http(false);
        tcp.set_connect_timeout(Some(timeout));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(tcp);
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            runtime,
            timeout,
        }
    }
}

impl std::fmt::Debug for Collector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Collector")
            .field("timeout", &self.timeout)
            .finish()
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Collector {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> Result<http::Response<Bytes>, opentelemetry_http::HttpError> {
        let client = self.client.clone();
        let exchange = async move {
            let response = client.request(request.map(Full::new)).await?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await?.to_bytes();
            Ok::<_, opentelemetry_http::HttpError>(http::Response::from_parts(parts, body))
        };
        let timeout = self.timeout;
        self.runtime
            .spawn(async move {
                tokio::time::timeout(timeout, exchange)
                    .await
                    .map_err(|_| format!("no answer from the collector within {timeout:?}"))?
            })
            .await?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ON: (&str, &str) = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318");

    fn read(pairs: &[(&str, &str)]) -> Result<Option<TraceSettings>, String> {
        settings_from_env(|name| {
            pairs
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        })
    }

    /// The settings with the endpoint set and `pairs`.
    fn with(pairs: &[(&str, &str)]) -> Result<Option<TraceSettings>, String> {
        read(&[&[ON], pairs].concat())
    }

    fn on(pairs: &[(&str, &str)]) -> TraceSettings {
        with(pairs).unwrap().expect("traces on")
    }

    /// The error for `pairs` (the endpoint set), which must name `start`.
    fn refused(pairs: &[(&str, &str)], start: &str) {
        let error = with(pairs).unwrap_err();
        assert!(error.starts_with(start), "{error}");
    }

    #[test]
    fn without_an_endpoint_traces_are_off() {
        assert_eq!(read(&[]), Ok(None));
        assert_eq!(read(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")]), Ok(None));
        assert_eq!(read(&[("OTEL_SERVICE_NAME", "orders")]), Ok(None));
    }

    #[test]
    fn the_generic_endpoint_gets_the_traces_path_and_the_signal_one_is_used_as_it_is() {
        let endpoint = |pairs: &[(&str, &str)]| read(pairs).unwrap().unwrap().endpoint.to_string();
        assert_eq!(endpoint(&[ON]), "http://collector:4318/v1/traces");
        assert_eq!(
            endpoint(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/otlp/")]),
            "http://collector:4318/otlp/v1/traces"
        );
        assert_eq!(
            endpoint(&[
                ON,
                (
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "http://traces:9000/in"
                )
            ]),
            "http://traces:9000/in"
        );
    }

    #[test]
    fn disabled_sdk_or_no_exporter_turns_traces_off() {
        assert_eq!(with(&[("OTEL_SDK_DISABLED", "true")]), Ok(None));
        assert_eq!(with(&[("OTEL_SDK_DISABLED", "TRUE")]), Ok(None));
        on(&[("OTEL_SDK_DISABLED", "false")]);
        assert_eq!(with(&[("OTEL_TRACES_EXPORTER", "none")]), Ok(None));
        on(&[("OTEL_TRACES_EXPORTER", "otlp")]);
        refused(
            &[("OTEL_TRACES_EXPORTER", "zipkin")],
            "OTEL_TRACES_EXPORTER \"zipkin\"",
        );
    }

    #[test]
    fn a_bad_endpoint_is_named_with_its_variable() {
        for (name, value, says) in [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318", "http://"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "not a url", "not a URL"),
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "ftp://collector/",
                "http://",
            ),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://", "https://"),
        ] {
            let error = read(&[(name, value)]).unwrap_err();
            assert!(error.starts_with(&format!("{name} {value:?}: ")), "{error}");
            assert!(error.contains(says), "{error}");
        }
    }

    #[test]
    fn an_https_collector_is_verified_with_the_certificate_variable_or_the_system_roots() {
        let tls = read(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector:4318")])
            .unwrap()
            .unwrap();
        assert_eq!(tls.endpoint.to_string(), "https://collector:4318/v1/traces");
        assert_eq!(tls.certificate, None);
        let ca = on(&[("OTEL_EXPORTER_OTLP_CERTIFICATE", "/etc/ca.pem")]);
        assert_eq!(
            ca.certificate,
            Some((
                "OTEL_EXPORTER_OTLP_CERTIFICATE",
                PathBuf::from("/etc/ca.pem")
            ))
        );
        let own = on(&[
            ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/etc/ca.pem"),
            (
                "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
                "/etc/traces-ca.pem",
            ),
        ]);
        assert_eq!(
            own.certificate,
            Some((
                "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
                PathBuf::from("/etc/traces-ca.pem")
            ))
        );
    }

    #[test]
    fn only_http_protobuf_is_spoken() {
        on(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")]);
        refused(
            &[("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")],
            "OTEL_EXPORTER_OTLP_PROTOCOL \"grpc\"",
        );
        // The signal's own variable wins over the generic one.
        on(&[
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ]);
    }

    #[test]
    fn the_timeout_is_milliseconds() {
        assert_eq!(on(&[]).timeout, Duration::from_secs(10));
        let set = on(&[("OTEL_EXPORTER_OTLP_TIMEOUT", "2500")]);
        assert_eq!(set.timeout, Duration::from_millis(2500));
        refused(
            &[("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "2s")],
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT \"2s\"",
        );
    }

    #[test]
    fn sampler_rows() {
        let parent = |root| Sampling::ParentBased { root };
        let rows: [(Option<&str>, Option<&str>, Sampling); 8] = [
            (None, None, parent(Root::AlwaysOn)),
            (Some("always_on"), None, Sampling::AlwaysOn),
            (Some("always_off"), Some("0.5"), Sampling::AlwaysOff),
            (Some("traceidratio"), None, Sampling::Ratio(1.0)),
            (Some("traceidratio"), Some("0.25"), Sampling::Ratio(0.25)),
            (Some("parentbased_always_on"), None, parent(Root::AlwaysOn)),
            (
                Some("parentbased_always_off"),
                None,
                parent(Root::AlwaysOff),
            ),
            (
                Some("parentbased_traceidratio"),
                Some(" 0.1 "),
                parent(Root::Ratio(0.1)),
            ),
        ];
        for (name, arg, want) in rows {
            assert_eq!(sampling(name, arg), Ok(want), "{name:?} {arg:?}");
        }
        for (name, arg, names) in [
            (
                Some("jaeger_remote"),
                None,
                "OTEL_TRACES_SAMPLER \"jaeger_remote\"",
            ),
            (Some("sometimes"), None, "OTEL_TRACES_SAMPLER \"sometimes\""),
            (
                Some("traceidratio"),
                Some("half"),
                "OTEL_TRACES_SAMPLER_ARG \"half\"",
            ),
            (
                Some("parentbased_traceidratio"),
                Some("1.5"),
                "OTEL_TRACES_SAMPLER_ARG \"1.5\"",
            ),
        ] {
            let error = sampling(name, arg).unwrap_err();
            assert!(error.starts_with(names), "{error}");
        }
        refused(
            &[("OTEL_TRACES_SAMPLER", "xray")],
            "OTEL_TRACES_SAMPLER \"xray\"",
        );
    }

    /// The W3C context in and out, through the SDK and the layer as
    /// `courier run` installs them, without an export.
    #[test]
    fn the_span_is_the_producers_child_and_names_itself_to_the_app() {
        use tracing_subscriber::layer::SubscriberExt as _;
        const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
        const SPAN: &str = "00f067aa0ba902b7";
        let provider = SdkTracerProvider::builder()
            .with_sampler(
                Sampling::ParentBased {
                    root: Root::AlwaysOn,
                }
                .sampler(),
            )
            .build();
        let traces = Traces {
            tracer: provider.tracer("test"),
            provider,
        };
        let subscriber = tracing_subscriber::registry().with(traces.layer());
        let attempt = Attempt {
            system: "redis",
            queue: "orders",
            group: "courier",
            message_id: "1-0",
            attempt: 1,
            body_size: 2,
        };
        tracing::subscriber::with_default(subscriber, || {
            for (flags, state) in [("01", Some("shop=orders")), ("00", None)] {
                let mut headers = vec![(
                    "TraceParent".to_string(),
                    format!("00-{TRACE}-{SPAN}-{flags}"),
                )];
                if let Some(state) = state {
                    headers.push(("tracestate".into(), state.into()));
                }
                let (_span, propagation) = attempt_span(&attempt, &headers);
                let traceparent = propagation.traceparent.expect("a traceparent");
                let parts: Vec<&str> = traceparent.split('-').collect();
                assert_eq!(parts[1], TRACE, "{traceparent}");
                assert_ne!(parts[2], SPAN, "the span's own id: {traceparent}");
                assert_eq!(parts[3], flags, "the producer's sampling decision");
                assert_eq!(propagation.tracestate.as_deref(), state);
            }
            let (_span, propagation) = attempt_span(&attempt, &[]);
            let traceparent = propagation.traceparent.expect("a new trace");
            assert!(
                !traceparent.contains(TRACE) && traceparent.ends_with("-01"),
                "{traceparent}"
            );
        });
        // Without the layer there is no span context to send.
        let (_span, propagation) = attempt_span(&attempt, &[]);
        assert_eq!(propagation, Propagation::default());
    }

    #[test]
    fn the_service_is_courier_unless_the_pod_names_it() {
        let named = |pairs: &[(&str, &str)]| !on(pairs).default_service_name;
        assert!(!named(&[]));
        assert!(named(&[("OTEL_SERVICE_NAME", "orders")]));
        assert!(named(&[(
            "OTEL_RESOURCE_ATTRIBUTES",
            "team=shop, service.name=orders"
        )]));
        assert!(!named(&[(
            "OTEL_RESOURCE_ATTRIBUTES",
            "service.namespace=shop"
        )]));
    }
}
