//! `courier run`: the sidecar's flags, checked into a [`RunConfig`], and the
//! run itself until SIGTERM has drained it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use clap::builder::{PossibleValuesParser, TypedValueParser};
use tokio_util::sync::CancellationToken;

use super::args::{SealArgs, SourceArgs, UsageError, parse_app, parse_size};
use crate::dispatch::{AppSettings, BatchSettings, DeliverySettings};
use crate::duration;
use crate::forward::cloudevents::Mode as CloudEventsMode;
use crate::policy::{self, Policy};
use crate::sidecar::{EndpointSettings, PolicySettings, RunConfig, Sidecar};
use crate::subscriptions::{Subscription, SubscriptionsDocument};

use crate::source::{
    LiveSettings, MAX_UNSETTLED, Ordering, QueueType, SourceOptions, default_consumer_name,
};
use crate::telemetry::Readiness;
use crate::telemetry::traces::Traces;

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    #[command(flatten)]
    pub seal: SealArgs,
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
    /// Deliveries with the app at once, at most; as many more may be
    /// settling with the broker (an ack, a retry copy, a dead letter).
    #[arg(long, env = "COURIER_CONCURRENCY", default_value_t = 16)]
    pub concurrency: usize,
    /// Address of /metrics, /healthz, /readyz and /drain.
    #[arg(long, env = "COURIER_LISTEN", default_value = "0.0.0.0:9464")]
    pub listen: String,
    /// On SIGTERM or GET /drain, how long in-flight deliveries may finish.
    #[arg(long, env = "COURIER_DRAIN_TIMEOUT", default_value = "25s", value_parser = duration::parse_flag)]
    pub drain_timeout: Duration,
    /// The secret GET /drain must present as `Authorization: Bearer <token>`
    /// (the injector makes one per pod and gives it to the preStop hook).
    /// Without one, only loopback callers may drain.
    #[arg(long, env = "COURIER_DRAIN_TOKEN", hide_env_values = true)]
    pub drain_token: Option<String>,
    /// A file holding the /drain secret (a mounted Secret); instead of --drain-token.
    #[arg(long, env = "COURIER_DRAIN_TOKEN_FILE", conflicts_with = "drain_token")]
    pub drain_token_file: Option<std::path::PathBuf>,
    /// A /drain that no SIGTERM follows within this ends and courier pulls
    /// again: Kubernetes runs the app's preStop hook also when it restarts the
    /// app container alone, and then the pod goes on.
    #[arg(long, env = "COURIER_DRAIN_RESUME_AFTER", default_value = "90s", value_parser = duration::parse_flag)]
    pub drain_resume_after: Duration,
    /// Largest body offered to the app; larger ones are dead-lettered as undeliverable.
    #[arg(long, env = "COURIER_MAX_BODY", default_value = "4MiB", value_parser = parse_size)]
    pub max_body: usize,
    /// An unsettled delivery is handed out again after this [default: policy timeout + 30s].
    #[arg(long, env = "COURIER_VISIBILITY_TIMEOUT", value_parser = duration::parse_flag)]
    pub visibility_timeout: Option<Duration>,
    /// How often queue depths are read from the broker; while nothing changes and nothing is received, up to four times less often.
    #[arg(long, env = "COURIER_DEPTH_INTERVAL", default_value = "15s", value_parser = duration::parse_flag)]
    pub depth_interval: Duration,
    /// GET on this path (e.g. /healthz) says whether the app is up (2xx) or
    /// down: checked before the first delivery (nothing is sent until it
    /// answers 2xx), every 5 s, after a run of failures, and while the app is
    /// down instead of letting one delivery through. While it fails,
    /// deliveries pause and failures use no attempts.
    #[arg(long, env = "COURIER_APP_HEALTH_PATH")]
    pub app_health_path: Option<String>,
    /// With --app-health-path: consecutive 503s or timeouts after which the
    /// health path is asked at once (0: only its periodic check). Without a
    /// health path it has no effect: answers never pause deliveries, a run
    /// of 503s lowers the concurrency limit instead.
    #[arg(long, env = "COURIER_APP_FAILURE_RUN", default_value_t = 5)]
    pub app_failure_run: u32,
    /// Remember acked messages this long (e.g. 10m) and ack a redelivery of
    /// one without sending it to the app again. Off when not given.
    #[arg(long, env = "COURIER_DEDUP_WINDOW", value_parser = duration::parse_flag)]
    pub dedup_window: Option<Duration>,
    /// Up to this many messages in one POST, a JSON array with a status per
    /// entry in the answer (docs/batches.md); 1: one message per POST. At most 1000.
    #[arg(long, env = "COURIER_BATCH_MAX_MESSAGES", default_value_t = 1)]
    pub batch_max_messages: usize,
    /// How long a batch that is not full waits for more messages.
    #[arg(long, env = "COURIER_BATCH_MAX_WAIT", default_value = "50ms", value_parser = duration::parse_flag)]
    pub batch_max_wait: Duration,
    /// Create the work queue when it is missing (AMQP: a durable queue of --queue-type; NATS: a
    /// stream capturing the subject of the same name). Without it a missing queue is an error.
    #[arg(long, env = "COURIER_CREATE")]
    pub create: bool,
    /// What /readyz looks at: broker (the source open, the broker connected and
    /// read, the policy readable, the app up), app (the app up and the policy
    /// readable; a broker outage keeps the pod ready), or none (ready until a
    /// drain). A drain is never ready.
    #[arg(long, env = "COURIER_READINESS", value_enum, default_value_t = Readiness::Broker)]
    pub readiness: Readiness,
    /// With --create on RabbitMQ: quorum (replicated over the cluster's nodes) or classic.
    #[arg(
        long,
        env = "COURIER_QUEUE_TYPE",
        default_value = "quorum",
        value_parser = PossibleValuesParser::new(QueueType::NAMES)
            .map(|name| name.parse::<QueueType>().expect("one of the names"))
    )]
    pub queue_type: QueueType,
    /// none: deliveries run as concurrently as --concurrency allows. key:
    /// messages with the same key (Kafka's record key) are never in flight
    /// together and go to the app in the order stored; a retry of one holds
    /// the later ones of its key (Kafka only).
    #[arg(
        long,
        env = "COURIER_ORDERING",
        default_value = "none",
        value_parser = PossibleValuesParser::new(Ordering::NAMES)
            .map(|name| name.parse::<Ordering>().expect("one of the names"))
    )]
    pub ordering: Ordering,
    /// How a message that is a CloudEvent (a JSON body with "specversion",
    /// or ce-* headers) is offered to the app: binary (attributes as ce-*
    /// headers, the data as the body), structured (Content-Type:
    /// application/cloudevents+json, the event as the body), or off (every
    /// message as it is).
    #[arg(long, env = "COURIER_CLOUDEVENTS", value_enum, default_value_t = CloudEventsMode::Binary)]
    pub cloudevents: CloudEventsMode,
    /// A YAML file listing several queues for this one sidecar
    /// (`subscriptions:`, each entry with `queue` and optionally `source`,
    /// `group`, `app` or `path`, `policy` or `policyFile`, `concurrency`,
    /// `create`, `batch: {maxMessages, maxWait}`);
    /// what an entry leaves out comes from the other flags. Instead of
    /// --queue. docs/subscriptions.md has the form.
    #[arg(
        long,
        env = "COURIER_SUBSCRIPTIONS_FILE",
        conflicts_with = "subscriptions"
    )]
    pub subscriptions_file: Option<PathBuf>,
    /// The same document as --subscriptions-file, as text (the injector
    /// passes the pod's courier.dev/subscriptions annotation here).
    #[arg(long, env = "COURIER_SUBSCRIPTIONS", hide_env_values = true)]
    pub subscriptions: Option<String>,
}

/// Every subscription of `courier run`: the one of `--queue`, or one per
/// entry of the subscriptions document, each checked as the flags are, with
/// what an entry leaves out taken from the flags.
pub fn configs(args: &RunArgs) -> Result<Vec<RunConfig>, UsageError> {
    let (what, text) = match (&args.subscriptions_file, &args.subscriptions) {
        (None, None) => return Ok(vec![config(args)?]),
        (Some(path), _) => (
            format!("--subscriptions-file {}", path.display()),
            std::fs::read_to_string(path).map_err(|e| {
                UsageError(format!(
                    "--subscriptions-file {}: cannot read it: {e}",
                    path.display()
                ))
            })?,
        ),
        (None, Some(text)) => ("COURIER_SUBSCRIPTIONS".to_string(), text.clone()),
    };
    if !args.source.queue.is_empty() {
        return Err(UsageError(format!(
            "--queue {:?} and {what} both name queues; list every queue in the subscriptions, and leave --queue out",
            args.source.queue
        )));
    }
    let document = SubscriptionsDocument::parse(&text)
        .map_err(|problem| UsageError(format!("{what}: {problem}")))?;
    document
        .subscriptions
        .iter()
        .enumerate()
        .map(|(i, sub)| {
            config(&subscription_args(args, sub)?).map_err(|UsageError(problem)| {
                UsageError(format!(
                    "{what}: subscriptions[{i}] (queue {}): {problem}",
                    sub.queue
                ))
            })
        })
        .collect()
}

/// The flags as they read for one subscription: its entry's settings over
/// the command line's.
fn subscription_args(args: &RunArgs, sub: &Subscription) -> Result<RunArgs, UsageError> {
    let mut one = args.clone();
    one.subscriptions_file = None;
    one.subscriptions = None;
    one.source.queue = sub.queue.clone();
    if let Some(source) = &sub.source {
        one.source.source = source.clone();
    }
    if let Some(group) = &sub.group {
        one.group = group.clone();
    }
    if let Some(app) = &sub.app {
        one.app = app.clone();
    }
    if let Some(path) = &sub.path {
        let app = parse_app(&args.app)?;
        let authority = app.authority().map(|a| a.as_str()).unwrap_or_default();
        one.app = format!("http://{authority}{path}");
    }
    if sub.policy.is_some() || sub.policy_file.is_some() {
        one.policy = sub.policy.clone();
        one.policy_file = sub.policy_file.clone();
    }
    if let Some(concurrency) = sub.concurrency {
        one.concurrency = concurrency;
    }
    if let Some(create) = sub.create {
        one.create = create;
    }
    if let Some(batch) = &sub.batch {
        if let Some(n) = batch.max_messages {
            one.batch_max_messages = n;
        }
        if let Some(wait) = &batch.max_wait {
            one.batch_max_wait = duration::parse(wait)
                .map_err(|e| UsageError(format!("batch.maxWait {wait:?}: {e}")))?;
        }
    }
    Ok(one)
}

/// Checks every flag of `courier run` into the config the sidecar runs with.
pub fn config(args: &RunArgs) -> Result<RunConfig, UsageError> {
    let (source, tls, sasl) = args.source.parse()?;
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
    let drain_token = match &args.drain_token_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| {
                    UsageError(format!(
                        "--drain-token-file {}: cannot read it: {e}",
                        path.display()
                    ))
                })?
                .trim()
                .to_string(),
        ),
        None => args.drain_token.as_deref().map(|t| t.trim().to_string()),
    };
    if let Some(token) = &drain_token {
        crate::telemetry::hide_in_logs(token);
    }
    if drain_token.as_deref().is_some_and(str::is_empty) {
        return Err(UsageError(
            "the /drain token (--drain-token, COURIER_DRAIN_TOKEN or --drain-token-file) is empty; give a secret, or leave it unset to allow loopback callers only".into(),
        ));
    }
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
        live: LiveSettings {
            visibility_timeout,
            dead_letter_queue: policy.dead_letter_queue_for(&queue),
            max_deliveries: policy.max_deliveries(),
        },
        queue,
        group: args.group.clone(),
        consumer: args.consumer.clone().unwrap_or_else(default_consumer_name),
        create: args.create,
        queue_type: args.queue_type,
        ordering: args.ordering,
        concurrency: args.concurrency,
        messages_per_delivery: args.batch_max_messages.max(1),
        max_body: args.max_body,
        max_unsettled: MAX_UNSETTLED,
        tls,
        sasl,
        seal: args.seal.load()?,
    };
    Ok(RunConfig {
        source,
        options,
        app: AppSettings {
            url: app,
            health_path: args.app_health_path.clone(),
            failure_run: args.app_failure_run,
            cloudevents: args.cloudevents,
        },
        delivery: DeliverySettings {
            drain_timeout: args.drain_timeout,
            dedup_window: args.dedup_window.filter(|w| !w.is_zero()),
            batch: BatchSettings::from_flags(args.batch_max_messages, args.batch_max_wait)
                .map_err(UsageError)?,
        },
        policy: PolicySettings {
            initial: policy,
            file: args.policy_file.clone(),
            cluster: policy_ref,
            poll: Duration::from_secs(1),
        },
        endpoint: EndpointSettings {
            listen,
            drain_token,
            drain_resume_after: args.drain_resume_after,
            depth_interval: args.depth_interval,
            readiness: args.readiness,
        },
    })
}

/// Runs the sidecar, with every subscription of `configs`, until SIGTERM
/// has drained it; with `traces`, the spans of the last deliveries are
/// exported before the process exits.
pub async fn run(configs: Vec<RunConfig>, traces: Option<Traces>) -> anyhow::Result<ExitCode> {
    let shutdown = CancellationToken::new();
    // Listening for signals first: a SIGTERM during start-up drains too.
    let signals = tokio::spawn(wait_for_signal(shutdown.clone()));
    let sidecar = Sidecar::with_subscriptions(configs).traced(traces.is_some());
    let result = async {
        let (addr, sidecar) = sidecar.start(shutdown.clone()).await?;
        tracing::info!(%addr, "serving /metrics, /healthz, /readyz and /drain");
        sidecar.await.context("the sidecar task failed")?
    }
    .await;
    signals.abort();
    if let Some(traces) = traces {
        traces.shutdown().await;
    }
    result.map(|_| ExitCode::SUCCESS)
}

/// SIGTERM (Kubernetes) or SIGINT (a terminal) starts the drain.
async fn wait_for_signal(shutdown: CancellationToken) {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: draining"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: draining (press Ctrl-C again to stop at once)"),
    }
    shutdown.cancel();
    // A second Ctrl-C is someone at a terminal who will not wait for the
    // drain: stop at once. What is in flight stays unsettled, and the
    // broker hands it out again. A second SIGTERM is Kubernetes repeating
    // itself, and only the grace period ends the drain.
    if tokio::signal::ctrl_c().await.is_ok() {
        tracing::warn!(
            "second SIGINT: exiting without finishing the deliveries in flight; the broker hands them out again"
        );
        std::process::exit(130);
    }
}
