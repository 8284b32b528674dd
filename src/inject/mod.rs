//! The sidecar injector: `courier inject`, a mutating admission webhook that
//! adds the courier container to pods that opt in.
//!
//! A pod opts in with the label `courier.dev/inject: "true"` (the webhook
//! configuration selects on it, so other pods never reach us) and says where
//! to consume from with `courier.dev/*` annotations. [`decide`] is a pure
//! function from the pod to a [`Decision`]: inject (with a JSON Patch), skip
//! (with the reason), or deny (with a message naming what is missing). The
//! HTTPS server around it reloads its certificate when the files change, so
//! a rotated Secret needs no restart.
//!
//! `courier inject --pod FILE` runs the same decision offline and prints the
//! pod (or the workload's pod template) as the webhook would leave it.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use clap::{Args, ValueEnum};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use k8s_openapi::api::core::v1::Pod;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::cmd::args::{UsageError, parse_app, parse_source};
use crate::duration;
use crate::telemetry::LogFormat;

// === Names ===

/// The label that opts a pod in; the webhook configuration selects on it.
pub const INJECT_LABEL: &str = "courier.dev/inject";
/// The injected container's name, and how an injected pod is recognised.
pub const CONTAINER_NAME: &str = "courier";
/// The sidecar's metrics port name, for probes and PodMonitors.
pub const METRICS_PORT_NAME: &str = "courier-metrics";
/// Where Kubernetes mounts the service account token.
const TOKEN_MOUNT_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// The UID and GID of the image's non-root user (distroless `nonroot`).
const SIDECAR_UID: i64 = 65532;
/// Added to the drain timeout for the pod's grace period: time to stop the
/// HTTP server and close the broker connection after the drain.
const GRACE_MARGIN: Duration = Duration::from_secs(5);
/// Kubernetes' own default `terminationGracePeriodSeconds`.
const DEFAULT_GRACE_SECONDS: i64 = 30;

/// The pod annotations the injector reads.
pub mod annotations {
    /// Broker URL (`redis://…`, `amqp://…`, `nats://…`); or use `SOURCE_SECRET`.
    pub const SOURCE: &str = "courier.dev/source";
    /// Name of a Secret in the pod's namespace holding the broker URL.
    pub const SOURCE_SECRET: &str = "courier.dev/source-secret";
    /// The key in that Secret; `url` when not given.
    pub const SOURCE_SECRET_KEY: &str = "courier.dev/source-secret-key";
    /// Queue (stream, subject) to consume. Required.
    pub const QUEUE: &str = "courier.dev/queue";
    /// Consumer group; courier's default (`courier`) when not given.
    pub const GROUP: &str = "courier.dev/group";
    /// Port the app listens on, on localhost.
    pub const APP_PORT: &str = "courier.dev/app-port";
    /// Full app URL, instead of `APP_PORT`.
    pub const APP_URL: &str = "courier.dev/app-url";
    /// Name of the RetryPolicy in the pod's namespace.
    pub const POLICY: &str = "courier.dev/policy";
    /// Deliveries in flight at most.
    pub const CONCURRENCY: &str = "courier.dev/concurrency";
    /// How long in-flight deliveries may finish on shutdown (`25s`).
    pub const DRAIN_TIMEOUT: &str = "courier.dev/drain-timeout";
    /// Port of `/metrics`, `/healthz`, `/readyz` (9464).
    pub const METRICS_PORT: &str = "courier.dev/metrics-port";
    /// Log level or filter of the sidecar.
    pub const LOG_LEVEL: &str = "courier.dev/log-level";
    /// `true` or `false`: overrides the injector's `--native-sidecars`.
    pub const NATIVE_SIDECAR: &str = "courier.dev/native-sidecar";
    pub const CPU_REQUEST: &str = "courier.dev/cpu-request";
    pub const MEMORY_REQUEST: &str = "courier.dev/memory-request";
    pub const CPU_LIMIT: &str = "courier.dev/cpu-limit";
    pub const MEMORY_LIMIT: &str = "courier.dev/memory-limit";
}

// === Defaults (the injector's flags) ===

pub const DEFAULT_IMAGE: &str = concat!("courier:", env!("CARGO_PKG_VERSION"));
pub const DEFAULT_CPU_REQUEST: &str = "50m";
pub const DEFAULT_MEMORY_REQUEST: &str = "64Mi";
pub const DEFAULT_MEMORY_LIMIT: &str = "256Mi";
pub const DEFAULT_METRICS_PORT: u16 = 9464;
/// courier run's own default `--drain-timeout`.
const DEFAULT_DRAIN: Duration = Duration::from_secs(25);

/// `courier inject`: the flags of the webhook server, and the defaults it
/// gives every sidecar.
#[derive(Debug, Clone, Args)]
pub struct InjectArgs {
    /// Address of the HTTPS server (/mutate, /healthz, /readyz).
    #[arg(long, env = "COURIER_LISTEN", default_value = "0.0.0.0:8443")]
    pub listen: String,
    /// PEM certificate chain of the server; reloaded when it changes.
    #[arg(
        long,
        env = "COURIER_TLS_CERT",
        default_value = "/etc/courier/tls/tls.crt"
    )]
    pub tls_cert: PathBuf,
    /// PEM private key of the server; reloaded when it changes.
    #[arg(
        long,
        env = "COURIER_TLS_KEY",
        default_value = "/etc/courier/tls/tls.key"
    )]
    pub tls_key: PathBuf,
    /// How often the certificate files are checked for changes.
    #[arg(long, env = "COURIER_TLS_RELOAD_INTERVAL", default_value = "10s", value_parser = duration::parse_flag)]
    pub tls_reload_interval: Duration,
    #[command(flatten)]
    pub sidecar: SidecarArgs,
    /// Instead of serving: read a Pod, or a workload with a pod template,
    /// from FILE (- for stdin) and print it as the webhook would leave it.
    #[arg(long, env = "COURIER_INJECT_POD", value_name = "FILE")]
    pub pod: Option<PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct SidecarArgs {
    /// Image of the injected container.
    #[arg(long, env = "COURIER_SIDECAR_IMAGE", default_value = DEFAULT_IMAGE)]
    pub sidecar_image: String,
    /// Pull policy of the injected container.
    #[arg(long, env = "COURIER_SIDECAR_IMAGE_PULL_POLICY", default_value = "IfNotPresent",
          value_parser = ["Always", "IfNotPresent", "Never"])]
    pub sidecar_image_pull_policy: String,
    /// Inject a native sidecar (an init container with restartPolicy
    /// Always; Kubernetes 1.29+), which starts before and stops after the
    /// app. A pod can override this with courier.dev/native-sidecar.
    #[arg(long, env = "COURIER_NATIVE_SIDECARS")]
    pub native_sidecars: bool,
    /// CPU request of the sidecar, unless the pod says courier.dev/cpu-request.
    #[arg(long, env = "COURIER_SIDECAR_CPU_REQUEST", default_value = DEFAULT_CPU_REQUEST)]
    pub sidecar_cpu_request: String,
    /// Memory request of the sidecar, unless the pod says courier.dev/memory-request.
    #[arg(long, env = "COURIER_SIDECAR_MEMORY_REQUEST", default_value = DEFAULT_MEMORY_REQUEST)]
    pub sidecar_memory_request: String,
    /// CPU limit of the sidecar (none when empty), unless the pod says courier.dev/cpu-limit.
    #[arg(long, env = "COURIER_SIDECAR_CPU_LIMIT", default_value = "")]
    pub sidecar_cpu_limit: String,
    /// Memory limit of the sidecar (none when empty), unless the pod says courier.dev/memory-limit.
    #[arg(long, env = "COURIER_SIDECAR_MEMORY_LIMIT", default_value = DEFAULT_MEMORY_LIMIT)]
    pub sidecar_memory_limit: String,
    /// Log format of the sidecar.
    #[arg(
        long,
        env = "COURIER_SIDECAR_LOG_FORMAT",
        value_enum,
        default_value = "json"
    )]
    pub sidecar_log_format: LogFormat,
}

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

impl SidecarArgs {
    /// Checks the flags; a bad quantity fails here, not in every pod.
    pub fn defaults(&self) -> Result<SidecarDefaults, UsageError> {
        let quantity = |flag: &str, value: &str| -> Result<Option<String>, UsageError> {
            let value = value.trim();
            if value.is_empty() {
                return Ok(None);
            }
            if !is_quantity(value) {
                return Err(UsageError(format!(
                    "--{flag} {value:?} is not a Kubernetes quantity; write it like 100m, 64Mi or 1"
                )));
            }
            Ok(Some(value.to_string()))
        };
        if self.sidecar_image.trim().is_empty() {
            return Err(UsageError(
                "--sidecar-image is empty; name the courier image to inject".into(),
            ));
        }
        Ok(SidecarDefaults {
            image: self.sidecar_image.trim().to_string(),
            image_pull_policy: self.sidecar_image_pull_policy.clone(),
            native_sidecars: self.native_sidecars,
            resources: Resources {
                cpu_request: quantity("sidecar-cpu-request", &self.sidecar_cpu_request)?,
                memory_request: quantity("sidecar-memory-request", &self.sidecar_memory_request)?,
                cpu_limit: quantity("sidecar-cpu-limit", &self.sidecar_cpu_limit)?,
                memory_limit: quantity("sidecar-memory-limit", &self.sidecar_memory_limit)?,
            },
            log_format: self
                .sidecar_log_format
                .to_possible_value()
                .map(|v| v.get_name().to_string())
                .unwrap_or_else(|| "json".into()),
        })
    }
}

// === Decision ===

/// What the injector does with one pod, and why.
#[derive(Debug, Clone)]
pub enum Decision {
    /// Add the sidecar: the patch, and whether it went in as a native sidecar.
    Inject {
        patch: json_patch::Patch,
        native: bool,
        warnings: Vec<String>,
    },
    /// Leave the pod as it is.
    Skip(Skip),
    /// Refuse the pod: it asked for a sidecar that could not start.
    Deny(String),
}

/// Why a pod is left alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// Only pod creation is mutated.
    NotACreate,
    /// The pod does not carry `courier.dev/inject: "true"`.
    NotOptedIn,
    /// The pod already has a container named `courier`.
    AlreadyInjected,
    /// `hostNetwork: true`: the sidecar's port would be the node's.
    HostNetwork,
}

impl Skip {
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::NotACreate => "not-a-create",
            Skip::NotOptedIn => "not-opted-in",
            Skip::AlreadyInjected => "already-injected",
            Skip::HostNetwork => "host-network",
        }
    }

    pub fn message(self) -> &'static str {
        match self {
            Skip::NotACreate => "courier: only pod creation is mutated",
            Skip::NotOptedIn => {
                "courier: the pod does not carry the label courier.dev/inject=true; not injected"
            }
            Skip::AlreadyInjected => {
                "courier: the pod already has a container named courier; left as it is"
            }
            Skip::HostNetwork => {
                "courier: hostNetwork pods are not injected (the sidecar's metrics port would be the node's); run courier as a container of your own there"
            }
        }
    }
}

impl Decision {
    /// The short reason, for logs and audit annotations.
    pub fn reason(&self) -> &'static str {
        match self {
            Decision::Inject { native: true, .. } => "injected-native-sidecar",
            Decision::Inject { native: false, .. } => "injected",
            Decision::Skip(skip) => skip.as_str(),
            Decision::Deny(_) => "denied",
        }
    }

    /// The sentence that explains it, returned to the API server.
    pub fn message(&self) -> String {
        match self {
            Decision::Inject { native: true, .. } => {
                "courier: sidecar injected as a native sidecar (init container, restartPolicy Always)".into()
            }
            Decision::Inject { native: false, .. } => {
                "courier: sidecar injected as a container".into()
            }
            Decision::Skip(skip) => skip.message().into(),
            Decision::Deny(message) => message.clone(),
        }
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message())
    }
}

/// The sidecar's settings, read from the pod's annotations and checked.
#[derive(Debug, Clone)]
struct Settings {
    source: SourceSetting,
    queue: String,
    group: Option<String>,
    app: Option<String>,
    policy: Option<String>,
    concurrency: Option<usize>,
    drain: Option<Duration>,
    metrics_port: u16,
    log_level: Option<String>,
    native: bool,
    resources: Resources,
}

#[derive(Debug, Clone)]
enum SourceSetting {
    Url(String),
    Secret { name: String, key: String },
}

/// Decides what to do with a pod being created. Pure: the same pod and
/// defaults give the same decision and the same patch.
pub fn decide(pod: &Pod, defaults: &SidecarDefaults) -> Decision {
    let labels = pod.metadata.labels.as_ref();
    let opted_in = labels
        .and_then(|l| l.get(INJECT_LABEL))
        .is_some_and(|v| v == "true");
    if !opted_in {
        return Decision::Skip(Skip::NotOptedIn);
    }
    let spec = match &pod.spec {
        Some(spec) => spec,
        None => return Decision::Deny("courier: the pod has no spec".into()),
    };
    let has_sidecar = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .any(|c| c.name == CONTAINER_NAME);
    if has_sidecar {
        return Decision::Skip(Skip::AlreadyInjected);
    }
    if spec.host_network == Some(true) {
        return Decision::Skip(Skip::HostNetwork);
    }
    let empty = BTreeMap::new();
    let given = pod.metadata.annotations.as_ref().unwrap_or(&empty);
    let settings = match read_settings(given, defaults) {
        Ok(s) => s,
        Err(problems) => {
            return Decision::Deny(format!(
                "courier: cannot inject the sidecar: {}. Fix the pod template's annotations, or remove the label {INJECT_LABEL}",
                problems.join("; ")
            ));
        }
    };
    let mut warnings = Vec::new();
    let token_mount = spec
        .containers
        .iter()
        .flat_map(|c| c.volume_mounts.iter().flatten())
        .find(|m| m.mount_path == TOKEN_MOUNT_PATH);
    if settings.policy.is_some() && token_mount.is_none() {
        warnings.push(format!(
            "courier: {} is set but no container mounts a service account token, so the sidecar cannot read the RetryPolicy",
            annotations::POLICY
        ));
    }
    let mut container = sidecar_container(&settings, defaults);
    // The sidecar reads the RetryPolicy from the API, so it needs the
    // token; only then, because nothing else in it talks to the API.
    if let (Some(_), Some(mount)) = (&settings.policy, token_mount) {
        container["volumeMounts"] = json!([{
            "name": mount.name,
            "mountPath": TOKEN_MOUNT_PATH,
            "readOnly": true,
        }]);
    }

    let mut ops = Vec::new();
    if settings.native {
        container["restartPolicy"] = json!("Always");
        match &spec.init_containers {
            Some(list) if !list.is_empty() => ops.push(add("/spec/initContainers/-", container)),
            _ => ops.push(add("/spec/initContainers", json!([container]))),
        }
    } else {
        ops.push(add("/spec/containers/-", container));
    }
    let drain = settings.drain.unwrap_or(DEFAULT_DRAIN);
    let needed = (drain + GRACE_MARGIN).as_secs_f64().ceil() as i64;
    let grace = spec
        .termination_grace_period_seconds
        .unwrap_or(DEFAULT_GRACE_SECONDS);
    if grace < needed {
        ops.push(add("/spec/terminationGracePeriodSeconds", json!(needed)));
    }
    // The app may be scraped through these already; then its own
    // annotations stay and a PodMonitor scrapes courier's port by name.
    if !given.contains_key("prometheus.io/scrape") {
        let port = settings.metrics_port.to_string();
        for (key, value) in [
            ("prometheus.io/scrape", "true"),
            ("prometheus.io/port", port.as_str()),
            ("prometheus.io/path", "/metrics"),
        ] {
            if !given.contains_key(key) {
                let path = format!("/metadata/annotations/{}", escape_pointer(key));
                ops.push(add(&path, json!(value)));
            }
        }
    }
    let patch: json_patch::Patch =
        serde_json::from_value(Value::Array(ops)).expect("the patch operations are well-formed");
    Decision::Inject {
        patch,
        native: settings.native,
        warnings,
    }
}

fn add(path: &str, value: Value) -> Value {
    json!({ "op": "add", "path": path, "value": value })
}

/// RFC 6901: `~` and `/` in a key are escaped in a JSON Pointer.
fn escape_pointer(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// Reads every annotation and collects every problem, so that one denial
/// names all that needs fixing.
fn read_settings(
    given: &BTreeMap<String, String>,
    defaults: &SidecarDefaults,
) -> Result<Settings, Vec<String>> {
    use annotations as a;
    let get = |key: &str| given.get(key).map(|v| v.trim()).filter(|v| !v.is_empty());
    let mut problems = Vec::new();

    let mut missing = Vec::new();
    let queue = get(a::QUEUE);
    if queue.is_none() {
        missing.push(a::QUEUE.to_string());
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
        (Some(url), None) => match parse_source(url) {
            Ok(_) => Some(SourceSetting::Url(url.to_string())),
            Err(e) => {
                problems.push(format!(
                    "{}: {}",
                    a::SOURCE,
                    e.0.trim_start_matches("--source: ")
                ));
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
        (None, Some(url)) => match parse_app(url) {
            Ok(_) => Some(url.to_string()),
            Err(e) => {
                problems.push(format!("{}: {}", a::APP_URL, e.0.replace("--app ", "")));
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

    match (queue, source) {
        (Some(queue), Some(source)) if problems.is_empty() => Ok(Settings {
            source,
            queue: queue.to_string(),
            group: get(a::GROUP).map(str::to_string),
            app,
            policy: get(a::POLICY).map(str::to_string),
            concurrency,
            drain,
            metrics_port,
            log_level: get(a::LOG_LEVEL).map(str::to_string),
            native,
            resources,
        }),
        _ => Err(problems),
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

/// The container that is injected. Its configuration is all in `COURIER_*`
/// variables, the same ones `courier run` reads, so that a Secret can
/// supply the broker URL.
fn sidecar_container(settings: &Settings, defaults: &SidecarDefaults) -> Value {
    let mut env = vec![
        json!({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
        json!({"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}),
    ];
    match &settings.source {
        SourceSetting::Url(url) => env.push(json!({"name": "COURIER_SOURCE", "value": url})),
        SourceSetting::Secret { name, key } => env.push(json!({
            "name": "COURIER_SOURCE",
            "valueFrom": {"secretKeyRef": {"name": name, "key": key}},
        })),
    }
    let mut var = |name: &str, value: String| env.push(json!({"name": name, "value": value}));
    var("COURIER_QUEUE", settings.queue.clone());
    if let Some(group) = &settings.group {
        var("COURIER_GROUP", group.clone());
    }
    if let Some(app) = &settings.app {
        var("COURIER_APP", app.clone());
    }
    if let Some(policy) = &settings.policy {
        var("COURIER_POLICY", policy.clone());
    }
    if let Some(n) = settings.concurrency {
        var("COURIER_CONCURRENCY", n.to_string());
    }
    if let Some(drain) = settings.drain {
        var("COURIER_DRAIN_TIMEOUT", duration::format(drain));
    }
    var(
        "COURIER_LISTEN",
        format!("0.0.0.0:{}", settings.metrics_port),
    );
    var("COURIER_LOG_FORMAT", defaults.log_format.clone());
    if let Some(level) = &settings.log_level {
        var("COURIER_LOG_LEVEL", level.clone());
    }

    let r = &settings.resources;
    let pick = |pairs: [(&str, &Option<String>); 2]| -> Value {
        pairs
            .iter()
            .filter_map(|(k, v)| v.as_ref().map(|v| (k.to_string(), json!(v))))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let mut resources = serde_json::Map::new();
    let requests = pick([("cpu", &r.cpu_request), ("memory", &r.memory_request)]);
    let limits = pick([("cpu", &r.cpu_limit), ("memory", &r.memory_limit)]);
    if requests.as_object().is_some_and(|m| !m.is_empty()) {
        resources.insert("requests".into(), requests);
    }
    if limits.as_object().is_some_and(|m| !m.is_empty()) {
        resources.insert("limits".into(), limits);
    }

    let probe = |path: &str, period: i32, failures: i32| {
        json!({
            "httpGet": {"path": path, "port": METRICS_PORT_NAME, "scheme": "HTTP"},
            "periodSeconds": period,
            "timeoutSeconds": 1,
            "failureThreshold": failures,
        })
    };
    json!({
        "name": CONTAINER_NAME,
        "image": defaults.image,
        "imagePullPolicy": defaults.image_pull_policy,
        "args": ["run"],
        "env": env,
        "ports": [{
            "name": METRICS_PORT_NAME,
            "containerPort": settings.metrics_port,
            "protocol": "TCP",
        }],
        // A native sidecar counts as started once this passes, and only
        // then does the app start: courier is listening by then.
        "startupProbe": probe("/healthz", 1, 30),
        "readinessProbe": probe("/readyz", 5, 3),
        "livenessProbe": probe("/healthz", 10, 3),
        "resources": resources,
        "securityContext": {
            "runAsNonRoot": true,
            "runAsUser": SIDECAR_UID,
            "runAsGroup": SIDECAR_UID,
            "readOnlyRootFilesystem": true,
            "allowPrivilegeEscalation": false,
            "privileged": false,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
    })
}

// === Admission review ===

/// Answers one AdmissionReview (the request body as it came) with the
/// AdmissionReview to send back, as JSON, logging the decision.
pub fn review(body: &[u8], defaults: &SidecarDefaults) -> Value {
    to_wire(answer(body, defaults))
}

/// The API server reads `response.patch` as Go reads a `[]byte`: a base64
/// string. kube-core writes the bytes as an array of numbers, so the patch
/// is re-encoded here.
fn to_wire(review: AdmissionReview<DynamicObject>) -> Value {
    let patch = review.response.as_ref().and_then(|r| r.patch.clone());
    let mut wire = serde_json::to_value(&review).expect("an AdmissionReview serializes");
    if let (Some(bytes), Some(response)) = (patch, wire.get_mut("response")) {
        response["patch"] = Value::String(BASE64.encode(bytes));
    }
    wire
}

fn answer(body: &[u8], defaults: &SidecarDefaults) -> AdmissionReview<DynamicObject> {
    let review: AdmissionReview<Pod> = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "an AdmissionReview that cannot be read");
            return AdmissionResponse::invalid(format!(
                "courier: cannot read the AdmissionReview: {e}"
            ))
            .into_review();
        }
    };
    let request: AdmissionRequest<Pod> = match review.try_into() {
        Ok(r) => r,
        Err(_) => {
            tracing::warn!("an AdmissionReview without a request");
            return AdmissionResponse::invalid("courier: the AdmissionReview has no request")
                .into_review();
        }
    };
    let decision = match (&request.operation, &request.object) {
        (Operation::Create, Some(pod)) => decide(pod, defaults),
        _ => Decision::Skip(Skip::NotACreate),
    };
    let pod_name = request
        .object
        .as_ref()
        .and_then(|p| {
            p.metadata
                .name
                .clone()
                .or_else(|| p.metadata.generate_name.as_ref().map(|g| format!("{g}*")))
        })
        .unwrap_or_else(|| request.name.clone());
    let namespace = request.namespace.clone().unwrap_or_default();
    let reason = decision.reason();
    let message = decision.message();
    match &decision {
        Decision::Deny(_) => tracing::warn!(
            uid = %request.uid, %namespace, pod = %pod_name, reason, %message,
            "admission decision"
        ),
        _ => tracing::info!(
            uid = %request.uid, %namespace, pod = %pod_name, reason, %message,
            "admission decision"
        ),
    }

    let mut response = AdmissionResponse::from(&request);
    response
        .audit_annotations
        .insert("decision".into(), reason.into());
    match decision {
        Decision::Inject {
            patch, warnings, ..
        } => {
            if !warnings.is_empty() {
                response.warnings = Some(warnings);
            }
            response.result.message = message;
            match response.with_patch(patch) {
                Ok(r) => r.into_review(),
                Err(e) => AdmissionResponse::from(&request)
                    .deny(format!("courier: cannot encode the patch: {e}"))
                    .into_review(),
            }
        }
        Decision::Skip(skip) => {
            if skip == Skip::HostNetwork {
                response.warnings = Some(vec![message.clone()]);
            }
            response.result.message = message;
            response.into_review()
        }
        Decision::Deny(_) => {
            let mut response = response.deny(&message);
            response.result.reason = "Invalid".into();
            response.result.code = 400;
            response.into_review()
        }
    }
}

/// Runs the decision on a Pod, or on the pod template of a Deployment,
/// StatefulSet, DaemonSet, ReplicaSet or Job, and applies the patch: what
/// the webhook would do to the pods it makes.
pub fn inject_document(
    mut doc: Value,
    defaults: &SidecarDefaults,
) -> Result<(Value, Decision), String> {
    let kind = doc
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let template_path = if kind == "Pod" {
        None
    } else if doc.pointer("/spec/template/spec").is_some() {
        Some("/spec/template")
    } else {
        return Err(format!(
            "a {kind:?} has no pod template; give a Pod, Deployment, StatefulSet, DaemonSet, ReplicaSet or Job"
        ));
    };
    let mut pod_value = match template_path {
        None => doc.clone(),
        Some(path) => {
            let template = doc.pointer(path).cloned().unwrap_or_default();
            json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": template.get("metadata").cloned().unwrap_or_else(|| json!({})),
                "spec": template.get("spec").cloned().unwrap_or_else(|| json!({})),
            })
        }
    };
    let pod: Pod =
        serde_json::from_value(pod_value.clone()).map_err(|e| format!("not a pod: {e}"))?;
    let decision = decide(&pod, defaults);
    if let Decision::Inject { patch, .. } = &decision {
        json_patch::patch(&mut pod_value, patch)
            .map_err(|e| format!("the patch does not apply: {e}"))?;
        match template_path {
            None => doc = pod_value,
            Some(path) => {
                let template = doc.pointer_mut(path).expect("checked above");
                template["metadata"] = pod_value["metadata"].take();
                template["spec"] = pod_value["spec"].take();
            }
        }
    }
    Ok((doc, decision))
}

// === TLS ===

/// Errors reading the webhook's certificate and key.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: no PEM certificate in it")]
    NoCertificate { path: PathBuf },
    #[error("{path}: not a PEM certificate chain: {source}")]
    BadCertificate {
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("{path}: not a PEM private key: {source}")]
    BadKey {
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("the certificate and key do not go together: {0}")]
    Mismatch(rustls::Error),
}

/// Serves whichever certificate was loaded last. The files are read again
/// when their contents change (a Secret volume swaps a symlink, so content
/// is what to compare, not the modification time).
#[derive(Debug)]
pub struct ReloadingCert {
    cert_path: PathBuf,
    key_path: PathBuf,
    state: RwLock<LoadedCert>,
}

#[derive(Debug)]
struct LoadedCert {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    key: Arc<CertifiedKey>,
}

impl ReloadingCert {
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<Self, TlsError> {
        let (cert_pem, key_pem) = read_pair(cert_path, key_path)?;
        let key = Arc::new(certified_key(cert_path, key_path, &cert_pem, &key_pem)?);
        Ok(Self {
            cert_path: cert_path.to_path_buf(),
            key_path: key_path.to_path_buf(),
            state: RwLock::new(LoadedCert {
                cert_pem,
                key_pem,
                key,
            }),
        })
    }

    /// Reads the files again; `Ok(true)` when a new pair is now served.
    /// A bad new pair is refused and the old one stays.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let (cert_pem, key_pem) = read_pair(&self.cert_path, &self.key_path)?;
        {
            let state = self.state.read().unwrap_or_else(|e| e.into_inner());
            if state.cert_pem == cert_pem && state.key_pem == key_pem {
                return Ok(false);
            }
        }
        let key = Arc::new(certified_key(
            &self.cert_path,
            &self.key_path,
            &cert_pem,
            &key_pem,
        )?);
        *self.state.write().unwrap_or_else(|e| e.into_inner()) = LoadedCert {
            cert_pem,
            key_pem,
            key,
        };
        Ok(true)
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.state
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .key
                .clone(),
        )
    }
}

fn read_pair(cert: &Path, key: &Path) -> Result<(Vec<u8>, Vec<u8>), TlsError> {
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| TlsError::Read {
            path: path.to_path_buf(),
            source,
        })
    };
    Ok((read(cert)?, read(key)?))
}

fn certified_key(
    cert_path: &Path,
    key_path: &Path,
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<CertifiedKey, TlsError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::BadCertificate {
            path: cert_path.to_path_buf(),
            source,
        })?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: cert_path.to_path_buf(),
        });
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|source| TlsError::BadKey {
        path: key_path.to_path_buf(),
        source,
    })?;
    CertifiedKey::from_der(chain, key, &rustls::crypto::ring::default_provider())
        .map_err(TlsError::Mismatch)
}

/// A rustls server configuration that serves the reloading certificate,
/// with the ring provider named explicitly (never the process default).
pub fn server_config(cert: Arc<ReloadingCert>) -> anyhow::Result<rustls::ServerConfig> {
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .context("the TLS protocol versions")?
    .with_no_client_auth()
    .with_cert_resolver(cert);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

// === Server ===

/// The largest AdmissionReview read; a pod is far smaller.
const MAX_REVIEW_BYTES: usize = 4 << 20;

/// Everything `courier inject` serves with, checked.
#[derive(Debug, Clone)]
pub struct InjectConfig {
    pub listen: SocketAddr,
    pub tls_cert: PathBuf,
    pub tls_key: PathBuf,
    pub tls_reload_interval: Duration,
    pub defaults: SidecarDefaults,
}

impl InjectConfig {
    pub fn from_args(args: &InjectArgs) -> Result<Self, UsageError> {
        let listen = args.listen.parse().map_err(|_| {
            UsageError(format!(
                "--listen {:?} is not an address; write it like 0.0.0.0:8443",
                args.listen
            ))
        })?;
        if args.tls_reload_interval.is_zero() {
            return Err(UsageError(
                "--tls-reload-interval must be more than 0s".into(),
            ));
        }
        Ok(Self {
            listen,
            tls_cert: args.tls_cert.clone(),
            tls_key: args.tls_key.clone(),
            tls_reload_interval: args.tls_reload_interval,
            defaults: args.sidecar.defaults()?,
        })
    }
}

/// `courier inject`: serve the webhook until SIGTERM, or render one file
/// with `--pod`.
pub async fn run(args: InjectArgs) -> anyhow::Result<ExitCode> {
    if let Some(path) = &args.pod {
        let defaults = args.sidecar.defaults()?;
        return render(path, &defaults);
    }
    let config = InjectConfig::from_args(&args)?;
    let shutdown = CancellationToken::new();
    let (addr, server) = serve(config, shutdown.clone()).await?;
    tracing::info!(%addr, "serving the admission webhook on https://{addr}/mutate");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot listen for SIGTERM")?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: stopping"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: stopping"),
    }
    shutdown.cancel();
    server.await.context("the webhook server task failed")?;
    Ok(ExitCode::SUCCESS)
}

fn render(path: &Path, defaults: &SidecarDefaults) -> anyhow::Result<ExitCode> {
    let text = if path == Path::new("-") {
        std::io::read_to_string(std::io::stdin()).context("cannot read the pod from stdin")?
    } else {
        std::fs::read_to_string(path)
            .map_err(|e| UsageError(format!("--pod {}: {e}", path.display())))?
    };
    let doc: Value = serde_saphyr::from_str(&text)
        .map_err(|e| UsageError(format!("--pod {}: not YAML or JSON: {e}", path.display())))?;
    let (doc, decision) = inject_document(doc, defaults)
        .map_err(|e| UsageError(format!("--pod {}: {e}", path.display())))?;
    eprintln!("{}", decision.message());
    if let Decision::Deny(_) = decision {
        return Ok(ExitCode::from(1));
    }
    print!(
        "{}",
        serde_saphyr::to_string(&doc).context("cannot write the pod as YAML")?
    );
    Ok(ExitCode::SUCCESS)
}

/// Binds `config.listen` and serves the webhook over HTTPS until
/// `shutdown`; returns the bound address and the server task. Fails at
/// once when the certificate cannot be loaded.
pub async fn serve(
    config: InjectConfig,
    shutdown: CancellationToken,
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
    let handle = tokio::spawn(accept_loop(listener, acceptor, defaults, shutdown));
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
                tracing::info!(cert = %cert.cert_path.display(), "TLS certificate reloaded")
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
) {
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
        let (acceptor, defaults, shutdown) = (acceptor.clone(), defaults.clone(), shutdown.clone());
        connections.spawn(async move {
            let tls = match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream))
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
            let builder = auto::Builder::new(TokioExecutor::new());
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
    fn pointer_escaping() {
        assert_eq!(
            escape_pointer("prometheus.io/scrape"),
            "prometheus.io~1scrape"
        );
        assert_eq!(escape_pointer("a~b"), "a~0b");
    }
}
