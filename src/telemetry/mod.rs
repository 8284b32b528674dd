//! Metrics (registered once, here, with the `courier_` prefix), the
//! `/metrics`, `/healthz` and `/readyz` endpoints, logging set-up, and the
//! OpenTelemetry trace export ([`traces`]).

mod endpoint;
pub mod guard;
pub mod traces;

pub use endpoint::{Drain, EndpointLimits, IDLE_DRAIN, bind, serve, serve_http, serve_within};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    pub queue: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeliveryLabels {
    pub queue: String,
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeadLetterLabels {
    pub queue: String,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabels {
    pub policy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VersionLabels {
    pub version: &'static str,
}

/// Buckets for a localhost HTTP round trip: 1 ms to 60 s.
const DURATION_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
];

/// Every metric courier exports. Names are without `_total`: the client
/// appends it to counters.
pub struct Metrics {
    registry: Registry,
    pub received: Family<QueueLabels, Counter>,
    pub deliveries: Family<DeliveryLabels, Counter>,
    pub acks: Family<QueueLabels, Counter>,
    pub retries: Family<QueueLabels, Counter>,
    pub dead_letters: Family<DeadLetterLabels, Counter>,
    pub delivery_duration: Family<QueueLabels, Histogram>,
    pub in_flight: Family<QueueLabels, Gauge>,
    pub dlq_depth: Family<QueueLabels, Gauge>,
    pub dlq_oldest_age: Family<QueueLabels, Gauge<f64, AtomicU64>>,
    pub retry_backlog: Family<QueueLabels, Gauge>,
    /// Absent while the broker cannot count (a Redis group's lag is nil).
    pub queue_depth: Family<QueueLabels, Gauge>,
    /// Absent where the broker cannot tell (RabbitMQ), never a made-up 0.
    pub queue_oldest_age: Family<QueueLabels, Gauge<f64, AtomicU64>>,
    pub app_up: Gauge,
    /// 1 while the source is open and its connection up.
    pub broker_up: Gauge,
    /// 1 from a `/drain` until SIGTERM or the drain's end.
    pub draining: Gauge,
    pub policy_ready: Gauge,
    pub policy_generation: Family<PolicyLabels, Gauge>,
    pub policy_reloads: Family<ResultLabels, Counter>,
    pub retry_after_invalid: Family<QueueLabels, Counter>,
    pub settle_errors: Family<QueueLabels, Counter>,
    pub depth_poll_errors: Family<QueueLabels, Counter>,
    pub broker_read_errors: Family<QueueLabels, Counter>,
    pub concurrency_limit: Family<QueueLabels, Gauge>,
    pub dedup_hits: Family<QueueLabels, Counter>,
    pub unrouted: Family<QueueLabels, Counter>,
    pub filtered: Family<QueueLabels, Counter>,
    pub route_errors: Family<QueueLabels, Counter>,
    /// 1 while the queue's RetryPolicy pauses it.
    pub paused: Family<QueueLabels, Gauge>,
    /// `rateLimit.perSecond` in force; 0 without a rate limit.
    pub rate_limit: Family<QueueLabels, Gauge<f64, AtomicU64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("courier");
        let metrics = Self {
            received: Family::default(),
            deliveries: Family::default(),
            acks: Family::default(),
            retries: Family::default(),
            dead_letters: Family::default(),
            delivery_duration: Family::new_with_constructor(|| Histogram::new(DURATION_BUCKETS)),
            in_flight: Family::default(),
            dlq_depth: Family::default(),
            dlq_oldest_age: Family::default(),
            retry_backlog: Family::default(),
            queue_depth: Family::default(),
            queue_oldest_age: Family::default(),
            app_up: Gauge::default(),
            broker_up: Gauge::default(),
            draining: Gauge::default(),
            policy_ready: Gauge::default(),
            policy_generation: Family::default(),
            policy_reloads: Family::default(),
            retry_after_invalid: Family::default(),
            settle_errors: Family::default(),
            depth_poll_errors: Family::default(),
            broker_read_errors: Family::default(),
            concurrency_limit: Family::default(),
            dedup_hits: Family::default(),
            unrouted: Family::default(),
            filtered: Family::default(),
            route_errors: Family::default(),
            paused: Family::default(),
            rate_limit: Family::default(),
            registry: Registry::default(),
        };
        let m = &metrics;
        registry.register(
            "messages_received",
            "Messages taken from the broker",
            m.received.clone(),
        );
        registry.register(
            "deliveries",
            "Deliveries to the app, by how the answer was classified",
            m.deliveries.clone(),
        );
        registry.register("acks", "Messages acked after a 2xx", m.acks.clone());
        registry.register(
            "retries",
            "Messages scheduled for a later retry",
            m.retries.clone(),
        );
        registry.register(
            "dead_letters",
            "Messages dead-lettered, by reason",
            m.dead_letters.clone(),
        );
        registry.register(
            "delivery_duration_seconds",
            "Time from sending a message to the app to its whole answer",
            m.delivery_duration.clone(),
        );
        registry.register(
            "in_flight",
            "Deliveries waiting for the app's answer",
            m.in_flight.clone(),
        );
        registry.register(
            "dlq_depth",
            "Dead letters in the dead-letter queue",
            m.dlq_depth.clone(),
        );
        registry.register(
            "dlq_oldest_age_seconds",
            "Age of the oldest dead letter",
            m.dlq_oldest_age.clone(),
        );
        registry.register(
            "retry_backlog",
            "Messages scheduled for a later retry, in the broker",
            m.retry_backlog.clone(),
        );
        registry.register(
            "queue_depth",
            "Messages waiting in the work queue, as the broker counts them; absent while the broker cannot count them",
            m.queue_depth.clone(),
        );
        registry.register(
            "queue_oldest_age_seconds",
            "Age of the oldest message in the work queue not yet handed to a consumer; absent where the broker cannot tell",
            m.queue_oldest_age.clone(),
        );
        registry.register(
            "app_up",
            "1 when the app answered the last delivery",
            m.app_up.clone(),
        );
        registry.register(
            "broker_up",
            "1 while the source is open and connected to the broker; 0 while it cannot be opened or the connection is lost",
            m.broker_up.clone(),
        );
        registry.register(
            "draining",
            "1 while a /drain holds courier from pulling (until SIGTERM, or until it ends with no SIGTERM)",
            m.draining.clone(),
        );
        registry.register(
            "policy_ready",
            "1 when the RetryPolicy could be read (or none is followed); 0 while it is forbidden, not installed or not read yet",
            m.policy_ready.clone(),
        );
        registry.register(
            "policy_generation",
            "Generation of the RetryPolicy in force",
            m.policy_generation.clone(),
        );
        registry.register(
            "policy_reloads",
            "Policy changes, applied or rejected",
            m.policy_reloads.clone(),
        );
        registry.register(
            "retry_after_invalid",
            "Retry-After headers that could not be read and were ignored",
            m.retry_after_invalid.clone(),
        );
        registry.register(
            "settle_errors",
            "Acks, retries or dead letters the broker refused; the message is redelivered",
            m.settle_errors.clone(),
        );
        registry.register(
            "depth_poll_errors",
            "Failed polls of queue depths",
            m.depth_poll_errors.clone(),
        );
        registry.register(
            "broker_read_errors",
            "Failed reads from the broker; a run of them makes /readyz fail until a read works",
            m.broker_read_errors.clone(),
        );
        registry.register(
            "concurrency_limit",
            "Deliveries allowed in flight now, adapted to the app's answers",
            m.concurrency_limit.clone(),
        );
        registry.register(
            "dedup_hits",
            "Redeliveries of messages acked within --dedup-window, acked without reaching the app",
            m.dedup_hits.clone(),
        );
        registry.register(
            "unrouted",
            "Messages none of the RetryPolicy's routes matched; spec.unrouted says what was done with them",
            m.unrouted.clone(),
        );
        registry.register(
            "filtered",
            "Messages acked without reaching the app because no route matched them (spec.unrouted: ack)",
            m.filtered.clone(),
        );
        registry.register(
            "route_errors",
            "Route conditions that failed to evaluate on a message (a type mismatch, say); that route did not take it",
            m.route_errors.clone(),
        );
        registry.register(
            "paused",
            "1 while the queue's RetryPolicy pauses it (spec.paused): nothing is fetched",
            m.paused.clone(),
        );
        registry.register(
            "rate_limit",
            "Deliveries a second the RetryPolicy allows (spec.rateLimit.perSecond); 0 for no limit",
            m.rate_limit.clone(),
        );
        let build_info = Family::<VersionLabels, Gauge>::default();
        build_info
            .get_or_create(&VersionLabels {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        registry.register("build_info", "courier's version", build_info);
        for result in ["applied", "rejected"] {
            let _ = m.policy_reloads.get_or_create(&ResultLabels { result });
        }
        Self {
            registry,
            ..metrics
        }
    }

    /// Creates one queue's series at zero, so dashboards and `rate()` see
    /// them before the first event, and returns handles to them looked up
    /// once: the delivery path then touches only atomics, not the label
    /// maps. `results` and `reasons` are every value of the `result` and
    /// `reason` labels.
    pub fn for_queue(
        &self,
        queue: &str,
        results: &[&'static str],
        reasons: &[&'static str],
    ) -> QueueMetrics {
        let q = QueueLabels {
            queue: queue.to_string(),
        };
        let results = results
            .iter()
            .map(|&result| {
                let labels = DeliveryLabels {
                    queue: queue.to_string(),
                    result,
                };
                (result, self.deliveries.get_or_create(&labels).clone())
            })
            .collect();
        let reasons = reasons
            .iter()
            .map(|&reason| {
                let labels = DeadLetterLabels {
                    queue: queue.to_string(),
                    reason,
                };
                (reason, self.dead_letters.get_or_create(&labels).clone())
            })
            .collect();
        QueueMetrics {
            received: self.received.get_or_create(&q).clone(),
            acks: self.acks.get_or_create(&q).clone(),
            retries: self.retries.get_or_create(&q).clone(),
            in_flight: self.in_flight.get_or_create(&q).clone(),
            duration: self.delivery_duration.get_or_create(&q).clone(),
            results,
            reasons,
            retry_after_invalid: self.retry_after_invalid.get_or_create(&q).clone(),
            settle_errors: self.settle_errors.get_or_create(&q).clone(),
            dedup_hits: self.dedup_hits.get_or_create(&q).clone(),
            unrouted: self.unrouted.get_or_create(&q).clone(),
            filtered: self.filtered.get_or_create(&q).clone(),
            route_errors: self.route_errors.get_or_create(&q).clone(),
            concurrency_limit: self.concurrency_limit.get_or_create(&q).clone(),
            app_up: self.app_up.clone(),
            paused: self.paused.get_or_create(&q).clone(),
            rate_limit: self.rate_limit.get_or_create(&q).clone(),
        }
    }

    /// The OpenMetrics exposition text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The classic Prometheus text format (0.0.4), for scrapers and tools
    /// that do not ask for OpenMetrics (promtool, curl, older agents).
    pub fn encode_prometheus_text(&self) -> String {
        to_prometheus_text(&self.encode())
    }
}

/// OpenMetrics names a counter family without `_total` in its HELP and TYPE
/// lines and ends with `# EOF`; the classic format names the family after
/// its samples and has no EOF marker.
fn to_prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "].into_iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{p}{name}_total {tail}"))
        });
        match meta {
            Some(renamed) => out.push_str(&renamed),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// One queue's series; see [`Metrics::for_queue`].
#[derive(Clone)]
pub struct QueueMetrics {
    pub received: Counter,
    pub acks: Counter,
    pub retries: Counter,
    pub in_flight: Gauge,
    pub duration: Histogram,
    /// `courier_deliveries_total` by `result` label.
    results: Vec<(&'static str, Counter)>,
    /// `courier_dead_letters_total` by `reason` label.
    reasons: Vec<(&'static str, Counter)>,
    pub retry_after_invalid: Counter,
    pub settle_errors: Counter,
    pub dedup_hits: Counter,
    pub unrouted: Counter,
    pub filtered: Counter,
    pub route_errors: Counter,
    pub concurrency_limit: Gauge,
    pub app_up: Gauge,
    pub paused: Gauge,
    pub rate_limit: Gauge<f64, AtomicU64>,
}

impl QueueMetrics {
    /// `courier_deliveries_total{result}`; `None` for a label that was not
    /// registered (what was never offered to the app has no result).
    pub fn delivery(&self, result: &str) -> Option<&Counter> {
        self.results
            .iter()
            .find(|(label, _)| *label == result)
            .map(|(_, counter)| counter)
    }

    /// `courier_dead_letters_total{reason}`.
    pub fn dead_letter(&self, reason: &str) -> Option<&Counter> {
        self.reasons
            .iter()
            .find(|(label, _)| *label == reason)
            .map(|(_, counter)| counter)
    }
}

// === Health ===

/// What `/readyz` looks at (`courier run --readiness`, annotation
/// `courier.dev/readiness`). Draining is never ready, whatever the mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Readiness {
    /// Ready when courier consumes: the source open, the broker connected,
    /// its reads working, the policy readable and the app up (the default,
    /// and what every earlier version did).
    #[default]
    Broker,
    /// Ready unless the app is known down (the gate closed) or the policy is
    /// not readable; the broker is not looked at, so an app that also serves
    /// HTTP stays in its Service during a broker outage.
    App,
    /// Always ready, until a drain: pod readiness is left to the app.
    #[value(name = "none")]
    Always,
}

impl Readiness {
    pub fn as_str(self) -> &'static str {
        match self {
            Readiness::Broker => "broker",
            Readiness::App => "app",
            Readiness::Always => "none",
        }
    }
}

/// What `/healthz` and `/readyz` report. Not ready, with a reason: draining,
/// the policy unreadable, not started (the source not open), the broker
/// connection lost, reads from the broker failing in a row, the app down
/// (the gate closed); which of them count follows [`Readiness`].
#[derive(Default)]
pub struct Health {
    readiness: Readiness,
    ready: AtomicBool,
    reads_failing: AtomicBool,
    app_down: AtomicBool,
    draining: AtomicBool,
    /// Why the RetryPolicy cannot be read, while it cannot.
    policy_problem: std::sync::Mutex<Option<String>>,
    /// Why the source cannot be opened, while it cannot.
    source_problem: std::sync::Mutex<Option<String>>,
    /// With several subscriptions, each one's health by its queue: ready
    /// only when every one is.
    parts: std::sync::OnceLock<Vec<(String, Arc<Health>)>>,
    /// Asks the open source whether it consumes, when `/readyz` or a scrape
    /// asks: nothing has to look on a timer for them (issue 28).
    connection: std::sync::RwLock<Option<Box<dyn Fn() -> bool + Send + Sync>>>,
}

impl Health {
    pub fn new(readiness: Readiness) -> Self {
        Self {
            readiness,
            ..Self::default()
        }
    }

    /// The subscriptions' own health, by queue, which `/readyz` asks too.
    /// Set once.
    pub fn set_parts(&self, parts: Vec<(String, Arc<Health>)>) {
        let _ = self.parts.set(parts);
    }

    /// Started (the source is open) or stopped.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    /// How to ask the open source whether it consumes, each time readiness
    /// is asked.
    pub fn ask_connection(&self, connected: impl Fn() -> bool + Send + Sync + 'static) {
        *self.connection.write().unwrap_or_else(|e| e.into_inner()) = Some(Box::new(connected));
    }

    /// Whether the source consumes, asked now; `None` before it is open.
    fn broker_connected(&self) -> Option<bool> {
        self.connection
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|connected| connected())
    }

    /// `courier_broker_up` as of now: whether the source consumes, or with
    /// several subscriptions whether every open one does; `None` when no
    /// source is open to ask.
    pub fn broker_up(&self) -> Option<bool> {
        let parts = self.parts.get().map(|parts| {
            parts
                .iter()
                .filter_map(|(_, part)| part.broker_connected())
                .collect::<Vec<_>>()
        });
        match (self.broker_connected(), parts) {
            (Some(own), _) => Some(own),
            (None, Some(parts)) if !parts.is_empty() => Some(parts.iter().all(|up| *up)),
            _ => None,
        }
    }

    /// A run of failed reads from the broker, until one works.
    pub fn set_broker_reads_failing(&self, failing: bool) {
        self.reads_failing.store(failing, Ordering::SeqCst);
    }

    /// Follows the app-health gate.
    pub fn set_app_up(&self, up: bool) {
        self.app_down.store(!up, Ordering::SeqCst);
    }

    /// A drain was asked for (`/drain`): not ready until it ends, which
    /// only a drain that no SIGTERM followed does.
    pub fn set_draining(&self, draining: bool) {
        self.draining.store(draining, Ordering::SeqCst);
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Why the RetryPolicy cannot be read; `None` once it can.
    pub fn set_policy_problem(&self, problem: Option<String>) {
        *self
            .policy_problem
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = problem;
    }

    /// Why the source cannot be opened (the broker unreachable, the
    /// credentials refused); `None` once it is open.
    pub fn set_source_problem(&self, problem: Option<String>) {
        *self
            .source_problem
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = problem;
    }

    /// Why `/readyz` fails, or `None` when ready: this health's own
    /// reason, else the first subscription's that is not ready.
    pub fn not_ready(&self) -> Option<String> {
        self.own_not_ready().or_else(|| {
            self.parts.get()?.iter().find_map(|(queue, part)| {
                part.not_ready()
                    .map(|reason| format!("subscription {queue}: {reason}"))
            })
        })
    }

    fn own_not_ready(&self) -> Option<String> {
        let is = |flag: &AtomicBool| flag.load(Ordering::SeqCst);
        if is(&self.draining) {
            return Some("draining: not pulling, finishing the deliveries in flight".into());
        }
        if self.readiness == Readiness::Always {
            return None;
        }
        let policy = self
            .policy_problem
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(problem) = policy {
            return Some(problem);
        }
        if is(&self.app_down) {
            return Some("the app is down: deliveries paused, probing it".into());
        }
        if self.readiness == Readiness::App {
            return None;
        }
        if !is(&self.ready) {
            let source = self
                .source_problem
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            return Some(match source {
                Some(problem) => format!("the broker: {problem}; trying again"),
                None => "starting: the policy or the source is not ready yet".into(),
            });
        }
        if self.broker_connected() == Some(false) {
            return Some("the broker connection is lost".into());
        }
        if is(&self.reads_failing) {
            return Some("reads from the broker keep failing".into());
        }
        None
    }

    pub fn is_ready(&self) -> bool {
        self.not_ready().is_none()
    }
}

// === Logging ===

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Human,
    Json,
}

/// Texts no log line may show (a broker's password, the drain secret),
/// whatever wrote the line: courier's own code redacts what it logs, but a
/// library logging its connect options at debug (async-nats prints the
/// password) does not.
static SECRETS: std::sync::RwLock<Vec<String>> = std::sync::RwLock::new(Vec::new());

/// Shorter than this, a "secret" would blank ordinary words out of every
/// line; such a credential is weak anyway, and courier's own messages
/// still redact it.
const SHORTEST_SECRET: usize = 4;

/// From now on every log line shows `***` where it would show `secret`,
/// also as JSON or Rust's debug format escapes it.
pub fn hide_in_logs(secret: &str) {
    if secret.len() < SHORTEST_SECRET {
        return;
    }
    let escaped = format!("{secret:?}");
    let forms = [
        secret.to_string(),
        escaped[1..escaped.len() - 1].to_string(),
    ];
    let mut secrets = SECRETS.write().unwrap_or_else(|e| e.into_inner());
    for form in forms {
        if !secrets.contains(&form) {
            secrets.push(form);
        }
    }
    // Longest first, so that a secret containing another is hidden whole.
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
}

/// `line` with every registered secret replaced by `***`.
fn without_secrets(line: &[u8]) -> Option<Vec<u8>> {
    let secrets = SECRETS.read().unwrap_or_else(|e| e.into_inner());
    if secrets.is_empty() {
        return None;
    }
    let mut text = String::from_utf8_lossy(line).into_owned();
    let mut changed = false;
    for secret in secrets.iter() {
        if text.contains(secret.as_str()) {
            text = text.replace(secret.as_str(), "***");
            changed = true;
        }
    }
    changed.then(|| text.into_bytes())
}

/// Standard error, through [`without_secrets`]. The fmt layer writes each
/// event with one `write_all` of the whole formatted line.
struct Redacting;

impl std::io::Write for Redacting {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match without_secrets(buf) {
            Some(clean) => std::io::stderr().write_all(&clean)?,
            None => std::io::stderr().write_all(buf)?,
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

fn redacting_stderr() -> Redacting {
    Redacting
}

/// Installs the global subscriber; `RUST_LOG` overrides `level`. Human
/// logs are coloured only on a terminal: escape codes in a log file or a
/// collector's pipe are noise. With `traces`, delivery spans also go to
/// the trace export (and never into the log).
pub fn init_logging(format: LogFormat, level: &str, traces: Option<&traces::Traces>) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        // lapin logs every channel the broker closes as an ERROR, and
        // courier's passive declares (does this queue or delay tier exist?)
        // close one whenever the answer is no: 29 lines of a healthy start.
        // A channel closed for a real fault fails the call that used it,
        // which courier reports itself. RUST_LOG shows them all.
        let filter = tracing_subscriber::EnvFilter::new(level);
        match level.contains("lapin") {
            true => filter,
            false => filter.add_directive("lapin::channel=off".parse().expect("a valid directive")),
        }
    });
    let ansi = std::io::stderr().is_terminal();
    let Some(traces) = traces else {
        // Without traces the subscriber is the plain one, as it was before
        // traces existed: nothing of them is on the delivery path.
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(ansi)
            .with_writer(redacting_stderr);
        // A second init (tests start several sidecars in one process) is fine.
        let _ = match format {
            LogFormat::Json => builder.json().flatten_event(true).try_init(),
            LogFormat::Human => builder.try_init(),
        };
        return;
    };
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = filter.add_directive(
        format!("{}=off", traces::TARGET)
            .parse()
            .expect("a valid directive"),
    );
    let log = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(redacting_stderr);
    let log = match format {
        LogFormat::Json => log.json().flatten_event(true).boxed(),
        LogFormat::Human => log.boxed(),
    };
    let _ = tracing_subscriber::registry()
        .with(log.with_filter(filter))
        .with(traces.layer())
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registered_secret_never_reaches_a_log_line() {
        hide_in_logs("hunter2-\"quoted\"");
        hide_in_logs("abc");
        let line =
            br#"connect options: password: Some("hunter2-\"quoted\""), raw hunter2-"quoted" abc"#;
        let clean = String::from_utf8(without_secrets(line).unwrap()).unwrap();
        assert!(!clean.contains("hunter2"), "{clean}");
        assert_eq!(
            clean,
            r#"connect options: password: Some("***"), raw *** abc"#
        );
        assert!(without_secrets(b"nothing secret here").is_none());
    }

    /// With several subscriptions the gauge is up while every open one
    /// consumes, and `/readyz` names the one that does not.
    #[test]
    fn the_broker_is_up_while_every_subscription_consumes() {
        use std::sync::atomic::AtomicBool;
        let top = Health::default();
        assert_eq!(top.broker_up(), None, "nothing is open to ask");
        let (orders, refunds) = (Arc::new(Health::default()), Arc::new(Health::default()));
        top.set_parts(vec![
            ("orders".into(), orders.clone()),
            ("refunds".into(), refunds.clone()),
        ]);
        for part in [&orders, &refunds] {
            part.set_ready(true);
        }
        top.set_ready(true);
        assert_eq!(top.broker_up(), None, "neither source is open yet");
        orders.ask_connection(|| true);
        assert_eq!(top.broker_up(), Some(true));
        let refunds_up = Arc::new(AtomicBool::new(false));
        refunds.ask_connection({
            let up = refunds_up.clone();
            move || up.load(Ordering::SeqCst)
        });
        assert_eq!(top.broker_up(), Some(false));
        assert_eq!(
            top.not_ready().as_deref(),
            Some("subscription refunds: the broker connection is lost")
        );
        refunds_up.store(true, Ordering::SeqCst);
        assert_eq!(top.broker_up(), Some(true));
        assert_eq!(top.not_ready(), None);
    }

    #[test]
    fn classic_text_names_counter_families_after_their_samples() {
        let metrics = Metrics::new();
        metrics.for_queue("orders", &["success"], &["undeliverable"]);
        let text = metrics.encode_prometheus_text();
        assert!(
            text.contains("# TYPE courier_acks_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("# HELP courier_acks_total Messages acked"),
            "{text}"
        );
        assert!(
            text.contains("courier_acks_total{queue=\"orders\"} 0\n"),
            "{text}"
        );
        assert!(text.contains("# TYPE courier_in_flight gauge\n"), "{text}");
        assert!(!text.contains("# EOF"));
        assert!(metrics.encode().contains("# TYPE courier_acks counter"));
    }
}
