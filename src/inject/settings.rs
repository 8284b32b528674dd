//! What the injector knows before it sees a pod: the names it uses, the
//! annotations it reads, the defaults every sidecar gets, and how one pod's
//! annotations become checked [`Settings`].

use std::collections::BTreeMap;
use std::time::Duration;

use crate::duration;
use crate::source::sasl::Mechanism;
use crate::source::{BROKERS, redact, url_forms};
use crate::telemetry;

// === Names ===

/// The label that opts a pod in; the webhook configuration selects on it.
pub const INJECT_LABEL: &str = "courier.dev/inject";
/// The injected container's name, and how an injected pod is recognised.
pub const CONTAINER_NAME: &str = "courier";
/// The sidecar's metrics port name, for probes and PodMonitors.
pub const METRICS_PORT_NAME: &str = "courier-metrics";
/// Where the sidecar finds the Secret of `courier.dev/tls-secret`.
pub(super) const TLS_MOUNT_PATH: &str = "/etc/courier/tls";
/// The pod volume of that Secret.
pub(super) const TLS_VOLUME: &str = "courier-tls";
/// Where the sidecar finds the Secret of `courier.dev/seal-keys-secret`.
pub(super) const SEAL_MOUNT_PATH: &str = "/etc/courier/seal";
/// The pod volume of that Secret.
pub(super) const SEAL_VOLUME: &str = "courier-seal";
/// The key of that Secret that holds the keys file.
pub(super) const SEAL_KEYS_FILE: &str = "keys";
/// Where Kubernetes mounts the service account token.
pub(super) const TOKEN_MOUNT_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// The UID and GID of the image's non-root user (distroless `nonroot`).
pub(super) const SIDECAR_UID: i64 = 65532;
/// Added to the drain timeout for the pod's grace period: time to stop the
/// HTTP server and close the broker connection after the drain.
pub(super) const GRACE_MARGIN: Duration = Duration::from_secs(5);
/// The sidecar's drain endpoint, which the app containers' `preStop` hooks GET.
pub const DRAIN_PATH: &str = "/drain";
/// Kubernetes' own default `terminationGracePeriodSeconds`.
pub(super) const DEFAULT_GRACE_SECONDS: i64 = 30;

/// The pod annotations the injector reads.
pub mod annotations {
    /// Broker URL (`redis://…`, `amqp://…`, `nats://…`, `kafka://…`); or use
    /// `SOURCE_SECRET`.
    pub const SOURCE: &str = "courier.dev/source";
    /// Name of a Secret in the pod's namespace holding the broker URL.
    pub const SOURCE_SECRET: &str = "courier.dev/source-secret";
    /// The key in that Secret; `url` when not given.
    pub const SOURCE_SECRET_KEY: &str = "courier.dev/source-secret-key";
    /// Queue (stream, subject) to consume. Required, unless
    /// [`SUBSCRIPTIONS`] lists the queues.
    pub const QUEUE: &str = "courier.dev/queue";
    /// Several queues for the one sidecar: the subscriptions document
    /// (YAML), passed as `COURIER_SUBSCRIPTIONS`.
    pub const SUBSCRIPTIONS: &str = "courier.dev/subscriptions";
    /// Consumer group; courier's default (`courier`) when not given.
    pub const GROUP: &str = "courier.dev/group";
    /// Port the app listens on, on localhost.
    pub const APP_PORT: &str = "courier.dev/app-port";
    /// Full app URL, instead of `APP_PORT`.
    pub const APP_URL: &str = "courier.dev/app-url";
    /// Name of the RetryPolicy in the pod's namespace.
    pub const POLICY: &str = "courier.dev/policy";
    /// Deliveries with the app at once, at most (`--concurrency`).
    pub const CONCURRENCY: &str = "courier.dev/concurrency";
    /// How long in-flight deliveries may finish on shutdown (`25s`).
    pub const DRAIN_TIMEOUT: &str = "courier.dev/drain-timeout";
    /// Port of `/metrics`, `/healthz`, `/readyz` (9464).
    pub const METRICS_PORT: &str = "courier.dev/metrics-port";
    /// Log level or filter of the sidecar.
    pub const LOG_LEVEL: &str = "courier.dev/log-level";
    /// `true` or `false`: overrides the injector's `--native-sidecars`.
    pub const NATIVE_SIDECAR: &str = "courier.dev/native-sidecar";
    /// Name of a Secret in the pod's namespace with `ca.crt` (and, for
    /// mutual TLS, `tls.crt` and `tls.key`), mounted read-only into the
    /// sidecar for `rediss://`, `amqps://`, NATS `tls://` and `kafkas://`.
    pub const TLS_SECRET: &str = "courier.dev/tls-secret";
    /// `true`: the sidecar presents `tls.crt` and `tls.key` of that Secret
    /// (mutual TLS).
    pub const TLS_CLIENT_CERT: &str = "courier.dev/tls-client-cert";
    /// Name of a Secret in the pod's namespace whose key `keys` is the
    /// seal's keys file (`--seal-keys-file`), mounted read-only into the
    /// sidecar; without it the broker keeps a key per queue.
    pub const SEAL_KEYS_SECRET: &str = "courier.dev/seal-keys-secret";
    /// Name of a Secret in the pod's namespace with the keys `username` and
    /// `password` (with OAUTHBEARER the OAuth client id and secret): Kafka's
    /// SASL login, given to the sidecar as `secretKeyRef` variables.
    pub const KAFKA_SASL_SECRET: &str = "courier.dev/kafka-sasl-secret";
    /// The SASL mechanism (`--kafka-sasl-mechanism`, passed through).
    pub const KAFKA_SASL_MECHANISM: &str = "courier.dev/kafka-sasl-mechanism";
    /// OAUTHBEARER: the token endpoint (`--kafka-oauth-token-url`, passed
    /// through).
    pub const KAFKA_OAUTH_TOKEN_URL: &str = "courier.dev/kafka-oauth-token-url";
    /// OAUTHBEARER: the scope (`--kafka-oauth-scope`, passed through).
    pub const KAFKA_OAUTH_SCOPE: &str = "courier.dev/kafka-oauth-scope";
    /// The OpenTelemetry collector that trace spans go to
    /// (`OTEL_EXPORTER_OTLP_ENDPOINT`); `$(HOST_IP)` is the node's address.
    pub const OTEL_ENDPOINT: &str = "courier.dev/otel-endpoint";
    /// `OTEL_SERVICE_NAME` of the sidecar's spans; `courier` when not given.
    pub const OTEL_SERVICE_NAME: &str = "courier.dev/otel-service-name";
    /// `OTEL_TRACES_SAMPLER`, and its ratio `OTEL_TRACES_SAMPLER_ARG`.
    pub const OTEL_SAMPLER: &str = "courier.dev/otel-sampler";
    pub const OTEL_SAMPLER_ARG: &str = "courier.dev/otel-sampler-arg";
    pub const CPU_REQUEST: &str = "courier.dev/cpu-request";
    pub const MEMORY_REQUEST: &str = "courier.dev/memory-request";
    pub const CPU_LIMIT: &str = "courier.dev/cpu-limit";
    pub const MEMORY_LIMIT: &str = "courier.dev/memory-limit";
}

/// The annotations that become the sidecar's OpenTelemetry variables,
/// annotation → variable; the endpoint turns traces on.
pub const TRACE_ANNOTATIONS: &[(&str, &str)] = &[
    (annotations::OTEL_ENDPOINT, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    (annotations::OTEL_SERVICE_NAME, "OTEL_SERVICE_NAME"),
    (annotations::OTEL_SAMPLER, "OTEL_TRACES_SAMPLER"),
    (annotations::OTEL_SAMPLER_ARG, "OTEL_TRACES_SAMPLER_ARG"),
];

/// The keys of the Secret of `courier.dev/kafka-sasl-secret`, and the
/// variables of `courier run` they become.
pub const KAFKA_SASL_USERNAME_KEY: &str = "username";
pub const KAFKA_SASL_PASSWORD_KEY: &str = "password";
/// `--kafka-sasl-username`'s variable.
pub const KAFKA_SASL_USERNAME_ENV: &str = "COURIER_KAFKA_SASL_USERNAME";
/// The variable `courier run` reads the SASL password from
/// (`cmd::args::KAFKA_SASL_PASSWORD_ENV`, which the injector does not
/// import; tests/kubernetes/helm_annotations.rs checks that they agree).
pub const KAFKA_SASL_PASSWORD_ENV: &str = "COURIER_KAFKA_SASL_PASSWORD";
/// The schemes of Kafka's URLs, from the broker table: none in a build
/// without Kafka, whose injector then takes no Kafka login annotation.
fn kafka_schemes() -> &'static [&'static str] {
    BROKERS
        .iter()
        .find(|b| b.name == "kafka")
        .map_or(&[], |b| b.schemes)
}

/// What a collector on the node is reached by in `courier.dev/otel-endpoint`;
/// the injector defines it from the downward API.
pub(super) const HOST_IP: &str = "$(HOST_IP)";

// === Defaults (the injector's flags) ===

pub const DEFAULT_IMAGE: &str = concat!("courier:", env!("CARGO_PKG_VERSION"));
pub const DEFAULT_CPU_REQUEST: &str = "50m";
pub const DEFAULT_MEMORY_REQUEST: &str = "64Mi";
pub const DEFAULT_MEMORY_LIMIT: &str = "256Mi";
pub const DEFAULT_METRICS_PORT: u16 = 9464;
/// courier run's own default `--drain-timeout`.
pub(super) const DEFAULT_DRAIN: Duration = Duration::from_secs(25);

/// What every injected sidecar gets unless the pod's annotations say
/// otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidecarDefaults {
    pub image: String,
    pub image_pull_policy: String,
    pub native_sidecars: bool,
    pub resources: Resources,
    /// `json` or `human`.
    pub log_format: String,
}

/// Requests and limits; `None` leaves one out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resources {
    pub cpu_request: Option<String>,
    pub memory_request: Option<String>,
    pub cpu_limit: Option<String>,
    pub memory_limit: Option<String>,
}

impl Default for SidecarDefaults {
    fn default() -> Self {
        Self {
            image: DEFAULT_IMAGE.into(),
            image_pull_policy: "IfNotPresent".into(),
            native_sidecars: false,
            resources: Resources {
                cpu_request: Some(DEFAULT_CPU_REQUEST.into()),
                memory_request: Some(DEFAULT_MEMORY_REQUEST.into()),
                cpu_limit: None,
                memory_limit: Some(DEFAULT_MEMORY_LIMIT.into()),
            },
            log_format: "json".into(),
        }
    }
}

impl SidecarDefaults {
    /// The defaults of the chart (charts/courier/values.yaml) and of
    /// `courier inject`'s flags: the same, so that a preview without
    /// `--values` shows what a default install injects. Differs from
    /// [`Default`] only in `native_sidecars`, which the webhook tests pin off.
    pub fn chart() -> Self {
        Self {
            native_sidecars: true,
            ..Self::default()
        }
    }
}

// === One pod's settings ===

/// The sidecar's settings, read from the pod's annotations and checked.
#[derive(Debug, Clone)]
pub(super) struct Settings {
    pub(super) source: SourceSetting,
    /// `courier.dev/queue`, or else the subscriptions document.
    pub(super) queue: Option<String>,
    pub(super) subscriptions: Option<String>,
    pub(super) group: Option<String>,
    pub(super) app: Option<String>,
    pub(super) policy: Option<String>,
    pub(super) concurrency: Option<usize>,
    pub(super) drain: Option<Duration>,
    pub(super) metrics_port: u16,
    pub(super) log_level: Option<String>,
    pub(super) native: bool,
    pub(super) resources: Resources,
    pub(super) tls: Option<TlsSecret>,
    /// The Secret of the seal's keys (`courier.dev/seal-keys-secret`).
    pub(super) seal_keys: Option<String>,
    /// The Secret of Kafka's SASL login (`courier.dev/kafka-sasl-secret`).
    pub(super) kafka_sasl: Option<String>,
    /// Annotations of [`flags::PASSTHROUGH`](super::flags::PASSTHROUGH):
    /// (variable, value), checked.
    pub(super) passthrough: Vec<(&'static str, String)>,
    /// Annotations of [`TRACE_ANNOTATIONS`]: (variable, value), checked as
    /// the sidecar checks them; empty when the pod asks for no traces.
    pub(super) traces: Vec<(&'static str, String)>,
}

/// The Secret with the broker's CA (`courier.dev/tls-secret`).
#[derive(Debug, Clone)]
pub(super) struct TlsSecret {
    pub(super) name: String,
    /// Its `tls.crt` and `tls.key` are the client certificate.
    pub(super) client_cert: bool,
}

#[derive(Debug, Clone)]
pub(super) enum SourceSetting {
    Url(String),
    Secret { name: String, key: String },
}

/// Reads every annotation and collects every problem, so that one denial
/// names all that needs fixing.
pub(super) fn read_settings(
    given: &BTreeMap<String, String>,
    defaults: &SidecarDefaults,
) -> Result<Settings, Vec<String>> {
    use annotations as a;
    let get = |key: &str| given.get(key).map(|v| v.trim()).filter(|v| !v.is_empty());
    let mut problems = Vec::new();

    let mut missing = Vec::new();
    let queue = get(a::QUEUE);
    let subscriptions = get(a::SUBSCRIPTIONS);
    match (queue, subscriptions) {
        (None, None) => missing.push(format!("{} (or {})", a::QUEUE, a::SUBSCRIPTIONS)),
        (Some(_), Some(_)) => problems.push(format!(
            "{} and {} are both set; keep one (list every queue in {})",
            a::QUEUE,
            a::SUBSCRIPTIONS,
            a::SUBSCRIPTIONS
        )),
        (None, Some(text)) => {
            if let Err(problem) = crate::subscriptions::SubscriptionsDocument::parse(text) {
                problems.push(format!("{}: {problem}", a::SUBSCRIPTIONS));
            }
        }
        (Some(_), None) => {}
    }
    let source = match (get(a::SOURCE), get(a::SOURCE_SECRET)) {
        (Some(_), Some(_)) => {
            problems.push(format!(
                "{} and {} are both set; keep one",
                a::SOURCE,
                a::SOURCE_SECRET
            ));
            None
        }
        (Some(url), None) => match check_source(url) {
            Ok(()) => Some(SourceSetting::Url(url.to_string())),
            Err(e) => {
                problems.push(format!("{}: {e}", a::SOURCE));
                None
            }
        },
        (None, Some(name)) => Some(SourceSetting::Secret {
            name: name.to_string(),
            key: get(a::SOURCE_SECRET_KEY).unwrap_or("url").to_string(),
        }),
        (None, None) => {
            missing.push(format!("{} (or {})", a::SOURCE, a::SOURCE_SECRET));
            None
        }
    };
    if !missing.is_empty() {
        problems.insert(
            0,
            format!(
                "missing annotation{} {}",
                plural(missing.len()),
                missing.join(", ")
            ),
        );
    }

    let app = match (get(a::APP_PORT), get(a::APP_URL)) {
        (Some(_), Some(_)) => {
            problems.push(format!(
                "{} and {} are both set; keep one",
                a::APP_PORT,
                a::APP_URL
            ));
            None
        }
        (Some(port), None) => match parse_port(port) {
            Some(port) => Some(format!("http://127.0.0.1:{port}/")),
            None => {
                problems.push(format!("{} {port:?} is not a port (1-65535)", a::APP_PORT));
                None
            }
        },
        (None, Some(url)) => match check_app_url(url) {
            Ok(()) => Some(url.to_string()),
            Err(e) => {
                problems.push(format!("{}: {e}", a::APP_URL));
                None
            }
        },
        (None, None) => None,
    };
    let concurrency = get(a::CONCURRENCY).and_then(|v| match v.parse::<usize>() {
        Ok(n) if n >= 1 => Some(n),
        _ => {
            problems.push(format!(
                "{} {v:?} is not a whole number of at least 1",
                a::CONCURRENCY
            ));
            None
        }
    });
    let drain = get(a::DRAIN_TIMEOUT).and_then(|v| match duration::parse(v) {
        Ok(d) => Some(d),
        Err(e) => {
            problems.push(format!("{} {v:?}: {e}", a::DRAIN_TIMEOUT));
            None
        }
    });
    let metrics_port = match get(a::METRICS_PORT) {
        None => DEFAULT_METRICS_PORT,
        Some(v) => parse_port(v).unwrap_or_else(|| {
            problems.push(format!("{} {v:?} is not a port (1-65535)", a::METRICS_PORT));
            DEFAULT_METRICS_PORT
        }),
    };
    let native = match get(a::NATIVE_SIDECAR) {
        None => defaults.native_sidecars,
        Some("true") => true,
        Some("false") => false,
        Some(v) => {
            problems.push(format!("{} {v:?} is not true or false", a::NATIVE_SIDECAR));
            defaults.native_sidecars
        }
    };
    let mut quantity = |key: &str, default: &Option<String>| match get(key) {
        None => default.clone(),
        Some(v) if is_quantity(v) => Some(v.to_string()),
        Some(v) => {
            problems.push(format!(
                "{key} {v:?} is not a Kubernetes quantity (like 100m, 64Mi or 1)"
            ));
            None
        }
    };
    let d = &defaults.resources;
    let resources = Resources {
        cpu_request: quantity(a::CPU_REQUEST, &d.cpu_request),
        memory_request: quantity(a::MEMORY_REQUEST, &d.memory_request),
        cpu_limit: quantity(a::CPU_LIMIT, &d.cpu_limit),
        memory_limit: quantity(a::MEMORY_LIMIT, &d.memory_limit),
    };

    let client_cert = match get(a::TLS_CLIENT_CERT) {
        None | Some("false") => false,
        Some("true") => true,
        Some(v) => {
            problems.push(format!("{} {v:?} is not true or false", a::TLS_CLIENT_CERT));
            false
        }
    };
    let tls = match get(a::TLS_SECRET) {
        Some(name) => Some(TlsSecret {
            name: name.to_string(),
            client_cert,
        }),
        None if client_cert => {
            problems.push(format!(
                "{} is set without {}; name the Secret that holds tls.crt and tls.key",
                a::TLS_CLIENT_CERT,
                a::TLS_SECRET
            ));
            None
        }
        None => None,
    };

    let mut passthrough = Vec::new();
    for p in super::flags::PASSTHROUGH {
        if let Some(v) = get(p.annotation) {
            match super::flags::check(p.kind, v) {
                Ok(()) => passthrough.push((p.env, v.to_string())),
                Err(e) => problems.push(format!("{} {e}", p.annotation)),
            }
        }
    }

    problems.extend(check_kafka_login(&get, source.as_ref()));

    let traces = read_traces(&get).unwrap_or_else(|problem| {
        problems.push(problem);
        Vec::new()
    });

    match (queue.or(subscriptions), source) {
        (Some(_), Some(source)) if problems.is_empty() => Ok(Settings {
            source,
            queue: queue.map(str::to_string),
            subscriptions: subscriptions.map(str::to_string),
            group: get(a::GROUP).map(str::to_string),
            app,
            policy: get(a::POLICY).map(str::to_string),
            concurrency,
            drain,
            metrics_port,
            log_level: get(a::LOG_LEVEL).map(str::to_string),
            native,
            resources,
            tls,
            seal_keys: get(a::SEAL_KEYS_SECRET).map(str::to_string),
            kafka_sasl: get(a::KAFKA_SASL_SECRET).map(str::to_string),
            passthrough,
            traces,
        }),
        _ => Err(problems),
    }
}

/// The Kafka login annotations hang together as `courier run` requires of
/// its `--kafka-*` flags: the Secret and the mechanism both or neither, the
/// OAuth annotations only with OAUTHBEARER, which needs a token URL, and
/// all of them only for a Kafka source. A source from a Secret is not
/// seen here, so it passes. The values themselves are checked with
/// [`flags::PASSTHROUGH`](super::flags::PASSTHROUGH); a mechanism that is
/// not one of the names is reported there alone.
fn check_kafka_login<'a>(
    get: &impl Fn(&str) -> Option<&'a str>,
    source: Option<&SourceSetting>,
) -> Vec<String> {
    use annotations as a;
    let oauthbearer = Mechanism::OAuthBearer.name();
    let mut problems = Vec::new();
    let mechanism = get(a::KAFKA_SASL_MECHANISM);
    let secret = get(a::KAFKA_SASL_SECRET);
    let token_url = get(a::KAFKA_OAUTH_TOKEN_URL);
    let scope = get(a::KAFKA_OAUTH_SCOPE);
    match (secret, mechanism) {
        (Some(_), None) => problems.push(format!(
            "{} is set without {}; name the mechanism to log in with ({})",
            a::KAFKA_SASL_SECRET,
            a::KAFKA_SASL_MECHANISM,
            Mechanism::NAMES.join(", ")
        )),
        (None, Some(m)) => problems.push(format!(
            "{} is set without {}; name the Secret whose keys {KAFKA_SASL_USERNAME_KEY} and {KAFKA_SASL_PASSWORD_KEY} hold {}",
            a::KAFKA_SASL_MECHANISM,
            a::KAFKA_SASL_SECRET,
            if m == oauthbearer {
                "the OAuth client id and secret"
            } else {
                "the login"
            }
        )),
        _ => {}
    }
    let known = mechanism.filter(|m| Mechanism::NAMES.contains(m));
    for (annotation, given) in [
        (a::KAFKA_OAUTH_TOKEN_URL, token_url),
        (a::KAFKA_OAUTH_SCOPE, scope),
    ] {
        if given.is_none() {
            continue;
        }
        match (mechanism, known) {
            (None, _) => problems.push(format!(
                "{annotation} is set without {}; it is for {oauthbearer}: set the mechanism to {oauthbearer}, or leave it out",
                a::KAFKA_SASL_MECHANISM
            )),
            (Some(m), Some(_)) if m != oauthbearer => problems.push(format!(
                "{annotation} is for {oauthbearer}, and {} is {m}; leave it out",
                a::KAFKA_SASL_MECHANISM
            )),
            _ => {}
        }
    }
    if known == Some(oauthbearer) && token_url.is_none() {
        problems.push(format!(
            "{} {oauthbearer} needs {}, the identity provider's token endpoint",
            a::KAFKA_SASL_MECHANISM,
            a::KAFKA_OAUTH_TOKEN_URL
        ));
    }
    if let Some(SourceSetting::Url(url)) = source {
        let scheme = url.split_once(':').map_or("", |(scheme, _)| scheme);
        let given: Vec<&str> = [
            a::KAFKA_SASL_SECRET,
            a::KAFKA_SASL_MECHANISM,
            a::KAFKA_OAUTH_TOKEN_URL,
            a::KAFKA_OAUTH_SCOPE,
        ]
        .into_iter()
        .filter(|annotation| get(annotation).is_some())
        .collect();
        if !given.is_empty() && !kafka_schemes().contains(&scheme) {
            // Only the scheme is echoed: the URL may hold credentials.
            let (is, it) = if given.len() == 1 {
                ("is", "it")
            } else {
                ("are", "them")
            };
            problems.push(format!(
                "{} {is} for Kafka, and {} has the scheme {scheme:?}; leave {it} out, or consume from a kafka:// or kafkas:// URL",
                given.join(", "),
                a::SOURCE,
            ));
        }
    }
    problems
}

/// The trace annotations as the sidecar's variables, checked by the rules
/// `courier run` applies to them ([`telemetry::traces::settings_from_env`]),
/// with the node's address standing in for `$(HOST_IP)`.
fn read_traces<'a>(
    get: &impl Fn(&str) -> Option<&'a str>,
) -> Result<Vec<(&'static str, String)>, String> {
    let given: Vec<(&'static str, &'static str, String)> = TRACE_ANNOTATIONS
        .iter()
        .filter_map(|&(annotation, var)| Some((annotation, var, get(annotation)?.to_string())))
        .collect();
    if given.is_empty() {
        return Ok(Vec::new());
    }
    if !given
        .iter()
        .any(|(a, _, _)| *a == annotations::OTEL_ENDPOINT)
    {
        let names: Vec<&str> = given.iter().map(|(a, _, _)| *a).collect();
        return Err(format!(
            "{} without {}: name the collector, or remove them",
            names.join(", "),
            annotations::OTEL_ENDPOINT
        ));
    }
    let checked = telemetry::traces::settings_from_env(|name| {
        given
            .iter()
            .find(|(_, var, _)| *var == name)
            .map(|(_, _, value)| value.replace(HOST_IP, "10.0.0.1"))
    });
    if let Err(problem) = checked {
        let annotation = given
            .iter()
            .find(|(_, var, _)| problem.starts_with(&format!("{var} ")))
            .map_or(annotations::OTEL_ENDPOINT, |(a, _, _)| *a);
        return Err(format!("{annotation}: {problem}"));
    }
    Ok(given
        .into_iter()
        .map(|(_, var, value)| (var, value))
        .collect())
}

/// The scheme of a `courier.dev/source` URL must name a broker of this
/// build. Only the scheme: the rest of the URL is the sidecar's to check
/// when it starts, so the injector loads no broker code and a broker's URL
/// rules live in one place. What is echoed back is redacted, because the
/// denial reaches `kubectl` and the API server's logs.
pub(super) fn check_source(url: &str) -> Result<(), String> {
    let supported = || format!("use {}", url_forms());
    let scheme = match url.split_once(':') {
        Some((scheme, rest)) if !scheme.is_empty() && !rest.is_empty() => scheme,
        _ => {
            return Err(format!(
                "{:?} is not a broker URL; {}",
                redact(url),
                supported()
            ));
        }
    };
    if BROKERS.iter().any(|b| b.schemes.contains(&scheme)) {
        Ok(())
    } else {
        Err(format!(
            "unknown scheme {scheme:?} in {:?}; {}",
            redact(url),
            supported()
        ))
    }
}

/// The app is reached over plain `http://` on localhost, as `courier run`
/// requires of `--app`.
pub(super) fn check_app_url(text: &str) -> Result<(), String> {
    let example = "write it like http://127.0.0.1:8080/";
    let uri: http::Uri = text
        .parse()
        .map_err(|e| format!("{text:?} is not a URL ({e}); {example}"))?;
    match (uri.scheme_str(), uri.host()) {
        (Some("http"), Some(_)) => Ok(()),
        (Some("http"), None) => Err(format!("{text:?} has no host; {example}")),
        (Some(other), _) => Err(format!(
            "{text:?}: scheme {other:?} is not supported; the sidecar reaches the app over plain http:// on localhost"
        )),
        (None, _) => Err(format!("{text:?} has no scheme; {example}")),
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

fn parse_port(text: &str) -> Option<u16> {
    text.parse::<u16>().ok().filter(|p| *p != 0)
}

/// A Kubernetes resource quantity: a decimal number with an optional
/// binary (`Ki`…`Ei`) or decimal (`m`, `k`, `M`…`E`) suffix or exponent.
pub fn is_quantity(text: &str) -> bool {
    let number_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(number_end);
    let unsigned = number.strip_prefix(['+', '-']).unwrap_or(number);
    let number_ok = !unsigned.is_empty()
        && unsigned != "."
        && unsigned.chars().filter(|c| *c == '.').count() <= 1
        && unsigned.chars().all(|c| c.is_ascii_digit() || c == '.');
    let suffix_ok = match suffix {
        "" | "m" | "k" | "M" | "G" | "T" | "P" | "E" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" => {
            true
        }
        s => s
            .strip_prefix(['e', 'E'])
            .map(|exp| exp.strip_prefix(['+', '-']).unwrap_or(exp))
            .is_some_and(|exp| !exp.is_empty() && exp.chars().all(|c| c.is_ascii_digit())),
    };
    number_ok && suffix_ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        for good in [
            "100m", "1", "0.5", "64Mi", "1Gi", "2k", "1e3", "1E-2", "+1", ".5",
        ] {
            assert!(is_quantity(good), "{good}");
        }
        for bad in ["", "lots", "64MB", "1.2.3", "m", "1e", "Mi", "64 Mi", "."] {
            assert!(!is_quantity(bad), "{bad}");
        }
    }

    #[test]
    fn source_schemes_of_this_build() {
        for broker in BROKERS {
            for scheme in broker.schemes {
                assert_eq!(check_source(&format!("{scheme}://host/x")), Ok(()));
            }
        }
        let err = check_source("mqtt://user:hunter2@broker:9092").unwrap_err();
        assert!(err.contains("unknown scheme \"mqtt\""), "{err}");
        assert!(err.contains(&url_forms()), "names what to write: {err}");
        assert!(!err.contains("hunter2"), "{err}");
        assert!(err.contains("\"mqtt://***@broker:9092\""), "{err}");
        for bad in ["localhost", "redis:", ":6379"] {
            assert!(check_source(bad).is_err(), "{bad}");
        }
    }

    /// The problems of a pod with `courier.dev/queue` and these
    /// annotations; none when it would be injected.
    fn problems_of(pairs: &[(&str, &str)]) -> Vec<String> {
        let mut given = BTreeMap::from([(annotations::QUEUE.to_string(), "orders".to_string())]);
        given.extend(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        read_settings(&given, &SidecarDefaults::default())
            .err()
            .unwrap_or_default()
    }

    #[test]
    fn a_kafka_login_hangs_together() {
        use annotations as a;
        let kafka = (a::SOURCE, "kafkas://pkc-1.example.confluent.cloud:9092");
        for ok in [
            vec![
                kafka,
                (a::KAFKA_SASL_SECRET, "kafka-login"),
                (a::KAFKA_SASL_MECHANISM, "SCRAM-SHA-512"),
            ],
            vec![
                (a::SOURCE, "kafka://kafka.shop.svc:9092"),
                (a::KAFKA_SASL_SECRET, "kafka-login"),
                (a::KAFKA_SASL_MECHANISM, "OAUTHBEARER"),
                (
                    a::KAFKA_OAUTH_TOKEN_URL,
                    "https://idp.example.com/oauth2/token",
                ),
                (a::KAFKA_OAUTH_SCOPE, "kafka"),
            ],
            // The injector cannot see a source in a Secret.
            vec![
                (a::SOURCE_SECRET, "orders-broker"),
                (a::KAFKA_SASL_SECRET, "kafka-login"),
                (a::KAFKA_SASL_MECHANISM, "PLAIN"),
            ],
        ] {
            assert_eq!(problems_of(&ok), Vec::<String>::new(), "{ok:?}");
        }
        for (bad, expected) in [
            (
                vec![kafka, (a::KAFKA_SASL_SECRET, "kafka-login")],
                "courier.dev/kafka-sasl-secret is set without courier.dev/kafka-sasl-mechanism; name the mechanism to log in with (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER)",
            ),
            (
                vec![kafka, (a::KAFKA_SASL_MECHANISM, "PLAIN")],
                "courier.dev/kafka-sasl-mechanism is set without courier.dev/kafka-sasl-secret; name the Secret whose keys username and password hold the login",
            ),
            (
                vec![
                    kafka,
                    (a::KAFKA_SASL_SECRET, "kafka-login"),
                    (a::KAFKA_SASL_MECHANISM, "PLAIN"),
                    (a::KAFKA_OAUTH_SCOPE, "kafka"),
                ],
                "courier.dev/kafka-oauth-scope is for OAUTHBEARER, and courier.dev/kafka-sasl-mechanism is PLAIN; leave it out",
            ),
            (
                vec![
                    kafka,
                    (a::KAFKA_OAUTH_TOKEN_URL, "https://idp.example.com/token"),
                ],
                "courier.dev/kafka-oauth-token-url is set without courier.dev/kafka-sasl-mechanism; it is for OAUTHBEARER",
            ),
            (
                vec![
                    kafka,
                    (a::KAFKA_SASL_SECRET, "kafka-login"),
                    (a::KAFKA_SASL_MECHANISM, "OAUTHBEARER"),
                ],
                "courier.dev/kafka-sasl-mechanism OAUTHBEARER needs courier.dev/kafka-oauth-token-url",
            ),
            (
                vec![
                    (a::SOURCE, "redis://:hunter2@redis:6379/0"),
                    (a::KAFKA_SASL_SECRET, "kafka-login"),
                    (a::KAFKA_SASL_MECHANISM, "PLAIN"),
                ],
                "courier.dev/kafka-sasl-secret, courier.dev/kafka-sasl-mechanism are for Kafka, and courier.dev/source has the scheme \"redis\"; leave them out, or consume from a kafka:// or kafkas:// URL",
            ),
        ] {
            let problems = problems_of(&bad);
            assert!(
                problems.iter().any(|p| p.contains(expected)),
                "{expected:?} in {problems:?}"
            );
            assert!(
                !problems.iter().any(|p| p.contains("hunter2")),
                "{problems:?}"
            );
        }
        // A misspelt mechanism is named once, by its own check.
        let problems = problems_of(&[
            kafka,
            (a::KAFKA_SASL_SECRET, "kafka-login"),
            (a::KAFKA_SASL_MECHANISM, "oauthbearer"),
            (a::KAFKA_OAUTH_SCOPE, "kafka"),
        ]);
        assert_eq!(
            problems,
            vec![
                "courier.dev/kafka-sasl-mechanism \"oauthbearer\" is not one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER"
            ],
        );
    }

    #[cfg(feature = "kafka")]
    #[test]
    fn kafka_schemes_are_the_brokers() {
        assert_eq!(kafka_schemes(), ["kafka", "kafkas"]);
    }

    #[test]
    fn app_urls() {
        assert_eq!(check_app_url("http://127.0.0.1:8080/"), Ok(()));
        let err = check_app_url("https://127.0.0.1:8443/").unwrap_err();
        assert!(err.contains("\"https\" is not supported"), "{err}");
        assert!(check_app_url("127.0.0.1:8080").is_err());
        assert!(check_app_url("not a url").is_err());
    }
}
