//! Flags and `COURIER_*` variables, validated once at start. Anything wrong
//! is a [`UsageError`]: a message that says what was wrong and what to do,
//! and exit code 2, before anything has started.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use http::Uri;

use crate::duration;
use crate::policy::{self, Policy};
use crate::source::{SourceOptions, SourceUrl, default_consumer_name};
use crate::telemetry::LogFormat;

/// Bad usage: the message is printed as is and the process exits with 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

#[derive(Debug, Parser)]
#[command(
    name = "courier",
    version,
    about = "A consumer sidecar: pulls messages from a broker, POSTs each to the app, settles it from the answer.",
    propagate_version = true
)]
pub struct Cli {
    /// Log format.
    #[arg(
        long,
        env = "COURIER_LOG_FORMAT",
        value_enum,
        default_value = "human",
        global = true
    )]
    pub log_format: LogFormat,
    /// Log level or filter (RUST_LOG syntax); RUST_LOG wins when set.
    #[arg(long, env = "COURIER_LOG_LEVEL", default_value = "info", global = true)]
    pub log_level: String,
    /// Threads that move messages. 1 keeps courier on one core, next to
    /// the app it serves, and spends the least CPU per message; 0 uses one
    /// per core, for an app faster than one core of courier can feed.
    #[arg(long, env = "COURIER_THREADS", default_value_t = 1, global = true)]
    pub threads: usize,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the sidecar: pull, forward, settle.
    Run(RunArgs),
    /// Print the RetryPolicy CustomResourceDefinition (YAML) for kubectl apply.
    Crd,
    /// Enqueue one message.
    Send(SendArgs),
    /// Everything on the embedded queue with a sample app; no broker needed.
    Demo(DemoArgs),
    /// Inspect, replay and purge dead letters.
    Dlq(crate::dlq::DlqArgs),
    /// The admission webhook that adds the sidecar to pods that opt in.
    Inject(crate::inject::InjectArgs),
}

#[derive(Debug, Clone, Args)]
pub struct SourceArgs {
    /// Broker URL: redis://host:port/db, amqp://user:pass@host:port/vhost, nats://host:port or
    /// embedded:<dir>.
    #[arg(long, env = "COURIER_SOURCE")]
    pub source: String,
    /// Queue to consume: the Redis stream key, the RabbitMQ queue, the NATS stream, the embedded
    /// queue name.
    #[arg(long, env = "COURIER_QUEUE")]
    pub queue: String,
}

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Consumer group every replica joins.
    #[arg(long, env = "COURIER_GROUP", default_value = "courier")]
    pub group: String,
    /// This replica's name in the group [default: $POD_NAME, else the host name].
    #[arg(long, env = "COURIER_CONSUMER")]
    pub consumer: Option<String>,
    /// Where the app listens; messages are POSTed here.
    #[arg(long, env = "COURIER_APP", default_value = "http://127.0.0.1:8080/")]
    pub app: String,
    /// A RetryPolicy YAML document, reloaded when it changes.
    #[arg(long, env = "COURIER_POLICY_FILE", conflicts_with = "policy")]
    pub policy_file: Option<PathBuf>,
    /// A RetryPolicy in the pod's namespace, watched and applied live.
    #[arg(long, env = "COURIER_POLICY")]
    pub policy: Option<String>,
    /// Deliveries in flight at most.
    #[arg(long, env = "COURIER_CONCURRENCY", default_value_t = 16)]
    pub concurrency: usize,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "COURIER_LISTEN", default_value = "0.0.0.0:9464")]
    pub listen: String,
    /// On SIGTERM, how long in-flight deliveries may finish.
    #[arg(long, env = "COURIER_DRAIN_TIMEOUT", default_value = "25s", value_parser = duration::parse_flag)]
    pub drain_timeout: Duration,
    /// Largest body offered to the app; larger ones are dead-lettered as undeliverable.
    #[arg(long, env = "COURIER_MAX_BODY", default_value = "4MiB", value_parser = parse_size)]
    pub max_body: usize,
    /// An unsettled delivery is handed out again after this [default: policy timeout + 30s].
    #[arg(long, env = "COURIER_VISIBILITY_TIMEOUT", value_parser = duration::parse_flag)]
    pub visibility_timeout: Option<Duration>,
    /// How often queue depths are read from the broker.
    #[arg(long, env = "COURIER_DEPTH_INTERVAL", default_value = "15s", value_parser = duration::parse_flag)]
    pub depth_interval: Duration,
    /// While the app is down, probe it with GET on this path (e.g. /healthz)
    /// instead of letting one delivery through.
    #[arg(long, env = "COURIER_APP_HEALTH_PATH")]
    pub app_health_path: Option<String>,
    /// Consecutive 503s or timeouts that pause deliveries until the app
    /// recovers (0: only a refused connection pauses them).
    #[arg(long, env = "COURIER_APP_FAILURE_RUN", default_value_t = 5)]
    pub app_failure_run: u32,
    /// Remember acked messages this long (e.g. 10m) and ack a redelivery of
    /// one without sending it to the app again. Off when not given.
    #[arg(long, env = "COURIER_DEDUP_WINDOW", value_parser = duration::parse_flag)]
    pub dedup_window: Option<Duration>,
    /// Create the work queue when it is missing (AMQP: a durable classic queue; NATS: a stream
    /// capturing the subject of the same name). Without it a missing queue is an error.
    #[arg(long, env = "COURIER_CREATE")]
    pub create: bool,
}

#[derive(Debug, Clone, Args)]
pub struct SendArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// A message header, K=V; repeatable.
    #[arg(long = "header", env = "COURIER_HEADER", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
    /// The body, or - to read it from stdin.
    pub body: String,
}

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Messages to send through the demo.
    #[arg(long, env = "COURIER_DEMO_MESSAGES", default_value_t = 300)]
    pub messages: usize,
}

/// `4MiB`, `512KiB`, `1MB`, `1048576`.
pub fn parse_size(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: usize = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size; write it like 4MiB, 512KiB or 1048576"))?;
    let factor = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" | "kB" => 1000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => {
            return Err(format!(
                "{text:?} has an unknown unit; use B, KiB, MiB, GiB, KB, MB or GB"
            ));
        }
    };
    n.checked_mul(factor)
        .ok_or_else(|| format!("{text:?} is too large"))
}

fn parse_header(text: &str) -> Result<(String, String), String> {
    let (name, value) = text.split_once('=').ok_or_else(|| {
        format!("{text:?} is not K=V; write --header content-type=application/json")
    })?;
    if name.is_empty() {
        return Err(format!("{text:?} has an empty header name"));
    }
    if name.to_ascii_lowercase().starts_with("courier-") {
        return Err(format!(
            "{name:?}: courier-* names are courier's own bookkeeping and cannot be set by a producer"
        ));
    }
    Ok((name.to_string(), value.to_string()))
}

/// Everything `courier run` needs, checked.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub source: SourceUrl,
    pub options: SourceOptions,
    pub app: Uri,
    pub policy: Policy,
    pub policy_file: Option<PathBuf>,
    /// The RetryPolicy to watch in the cluster (`--policy`).
    pub policy_ref: Option<policy::cluster::PolicyRef>,
    /// How often the policy file is checked for changes.
    pub policy_poll: Duration,
    pub concurrency: usize,
    pub listen: SocketAddr,
    pub drain_timeout: Duration,
    pub max_body: usize,
    pub depth_interval: Duration,
    pub app_health_path: Option<String>,
    pub app_failure_run: u32,
    pub dedup_window: Option<Duration>,
}

/// Checks the queue name, so that a typo fails at start and not on the
/// first broker call.
pub fn check_queue(queue: &str) -> Result<(), UsageError> {
    if queue.trim().is_empty() {
        return Err(UsageError(
            "--queue is empty; name the stream or queue to consume".into(),
        ));
    }
    Ok(())
}

pub fn parse_source(text: &str) -> Result<SourceUrl, UsageError> {
    SourceUrl::parse(text).map_err(|e| UsageError(format!("--source: {e}")))
}

/// The app URL: `http://` only, because the app is on localhost and TLS
/// there would only cost time.
pub fn parse_app(text: &str) -> Result<Uri, UsageError> {
    let uri: Uri = text.parse().map_err(|e| {
        UsageError(format!(
            "--app {text:?} is not a URL ({e}); write it like http://127.0.0.1:8080/"
        ))
    })?;
    match uri.scheme_str() {
        Some("http") if uri.host().is_some() => Ok(uri),
        Some("http") => Err(UsageError(format!(
            "--app {text:?} has no host; write it like http://127.0.0.1:8080/"
        ))),
        Some(other) => Err(UsageError(format!(
            "--app {text:?}: scheme {other:?} is not supported; the app is reached over plain http:// on localhost"
        ))),
        None => Err(UsageError(format!(
            "--app {text:?} has no scheme; write it like http://127.0.0.1:8080/"
        ))),
    }
}

impl RunConfig {
    pub fn from_args(args: &RunArgs) -> Result<Self, UsageError> {
        let source = parse_source(&args.source.source)?;
        check_queue(&args.source.queue)?;
        let app = parse_app(&args.app)?;
        if args.concurrency == 0 {
            return Err(UsageError("--concurrency must be at least 1".into()));
        }
        let listen: SocketAddr = args.listen.parse().map_err(|_| {
            UsageError(format!(
                "--listen {:?} is not an address; write it like 0.0.0.0:9464",
                args.listen
            ))
        })?;
        let policy = match &args.policy_file {
            Some(path) => policy::file::load(path).map_err(|e| UsageError(e.to_string()))?,
            None => Policy::default(),
        };
        let policy_ref = args
            .policy
            .as_deref()
            .map(policy::cluster::PolicyRef::from_env)
            .transpose()
            .map_err(UsageError)?;
        let queue = args.source.queue.clone();
        let visibility_timeout = args
            .visibility_timeout
            .unwrap_or(policy.timeout + Duration::from_secs(30));
        if visibility_timeout <= policy.timeout {
            return Err(UsageError(format!(
                "--visibility-timeout {} must be longer than the policy timeout {}, or deliveries still in progress are handed out again",
                duration::format(visibility_timeout),
                duration::format(policy.timeout)
            )));
        }
        let options = SourceOptions {
            dead_letter_queue: policy
                .dead_letter_queue
                .clone()
                .unwrap_or_else(|| format!("{queue}.dlq")),
            queue,
            group: args.group.clone(),
            consumer: args.consumer.clone().unwrap_or_else(default_consumer_name),
            visibility_timeout,
            create: args.create,
            max_in_flight: args.concurrency,
        };
        Ok(Self {
            source,
            options,
            app,
            policy,
            policy_file: args.policy_file.clone(),
            policy_ref,
            policy_poll: Duration::from_secs(1),
            concurrency: args.concurrency,
            listen,
            drain_timeout: args.drain_timeout,
            max_body: args.max_body,
            depth_interval: args.depth_interval,
            app_health_path: args.app_health_path.clone(),
            app_failure_run: args.app_failure_run,
            dedup_window: args.dedup_window.filter(|w| !w.is_zero()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4MiB"), Ok(4 << 20));
        assert_eq!(parse_size("512KiB"), Ok(512 << 10));
        assert_eq!(parse_size("1MB"), Ok(1_000_000));
        assert_eq!(parse_size("100"), Ok(100));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("4TiB").is_err());
    }

    #[test]
    fn app_urls() {
        assert!(parse_app("http://127.0.0.1:8080/").is_ok());
        let err = parse_app("https://127.0.0.1:8443/").unwrap_err().0;
        assert!(err.contains("\"https\" is not supported"), "{err}");
        assert!(parse_app("127.0.0.1:8080").is_err());
    }

    #[test]
    fn headers() {
        assert_eq!(parse_header("a=b=c"), Ok(("a".into(), "b=c".into())));
        assert!(parse_header("novalue").is_err());
        assert!(parse_header("=x").is_err());
        assert!(parse_header("Courier-Attempt=9").is_err());
    }
}
