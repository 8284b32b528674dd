//! The pipeline assembled: wires a source, the policy, the forwarder, the dispatcher
//! and the telemetry endpoint together, and takes them down in order.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::dispatch::{self, AppSettings, DeliverySettings, Dispatcher, DrainReport};
use crate::model::{Class, DeadLetterReason};
use crate::policy::file::Reload;
use crate::policy::{self, LivePolicy, Policy};
use crate::source::{self, ErrorKind, Source, SourceOptions, SourceUrl};
use crate::telemetry::{
    self, Drain, Health, Metrics, PolicyLabels, QueueLabels, Readiness, ResultLabels,
};

/// Everything `courier run` needs, checked, grouped by the part that uses
/// it.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// The broker, and how its source is opened (the queue, the
    /// concurrency, the body limit, the visibility timeout).
    pub source: SourceUrl,
    pub options: SourceOptions,
    pub app: AppSettings,
    pub delivery: DeliverySettings,
    pub policy: PolicySettings,
    pub endpoint: EndpointSettings,
}

/// The policy at start, and where its changes come from.
#[derive(Debug, Clone)]
pub struct PolicySettings {
    pub initial: Policy,
    /// `--policy-file`, checked for changes every `poll`.
    pub file: Option<PathBuf>,
    /// The RetryPolicy to watch in the cluster (`--policy`).
    pub cluster: Option<policy::cluster::PolicyRef>,
    pub poll: Duration,
}

impl PolicySettings {
    /// `initial`, never changed.
    pub fn fixed(initial: Policy) -> Self {
        Self {
            initial,
            file: None,
            cluster: None,
            poll: Duration::from_secs(1),
        }
    }
}

/// The metrics port and what it answers besides the metrics.
#[derive(Debug, Clone)]
pub struct EndpointSettings {
    pub listen: SocketAddr,
    /// The secret `/drain` requires (`COURIER_DRAIN_TOKEN`); none: loopback only.
    pub drain_token: Option<String>,
    /// A `/drain` that no SIGTERM follows within this ends, and pulling
    /// starts again (`--drain-resume-after`).
    pub drain_resume_after: Duration,
    /// How often the queue's depth is read for the metrics.
    pub depth_interval: Duration,
    /// What `/readyz` looks at.
    pub readiness: Readiness,
}

/// A sidecar ready to start; its metrics and health are readable from
/// outside (the demo shows progress from them).
pub struct Sidecar {
    /// One per subscription, at least one; the first's endpoint settings
    /// serve them all (one port, one `/drain`, one `/readyz`).
    configs: Vec<RunConfig>,
    pub metrics: Arc<Metrics>,
    pub health: Arc<Health>,
    /// A span per delivery attempt, for the trace export.
    traced: bool,
}

impl Sidecar {
    pub fn new(config: RunConfig) -> Self {
        Self::with_subscriptions(vec![config])
    }

    /// A sidecar running every subscription of `configs` (at least one):
    /// each with its own source, policy, dispatcher and app path, sharing
    /// the process's metrics and its endpoint.
    ///
    /// # Panics
    /// When `configs` is empty.
    pub fn with_subscriptions(configs: Vec<RunConfig>) -> Self {
        assert!(
            !configs.is_empty(),
            "a sidecar runs one subscription at least"
        );
        let metrics = Arc::new(Metrics::new());
        for config in &configs {
            // The series exist at zero from the start, for dashboards and rate().
            metrics.for_queue(
                &config.options.queue,
                &Class::result_labels(),
                &DeadLetterReason::labels(),
            );
        }
        // Without --policy there is nothing to read: ready from the start.
        let policy_free = configs.iter().all(|c| c.policy.cluster.is_none());
        metrics.policy_ready.set(i64::from(policy_free));
        // Presumed up until a delivery or a check says otherwise, as the
        // gate does: a 0 before courier has even tried the app would blame
        // it (CourierAppDown) for a broker that cannot be reached.
        metrics.app_up.set(1);
        Self {
            health: Arc::new(Health::new(configs[0].endpoint.readiness)),
            configs,
            metrics,
            traced: false,
        }
    }

    /// Makes a span of every delivery attempt and forwards its
    /// `traceparent` to the app; the trace export must be running.
    pub fn traced(self, traced: bool) -> Self {
        Self { traced, ..self }
    }

    /// Binds the telemetry endpoint and returns its address (useful with
    /// port 0), then runs until `shutdown` and drains. A `/drain` call
    /// drains earlier: nothing is pulled after it until `shutdown` ends the
    /// run, or until `drain_resume_after` passes without one.
    pub async fn start(
        self,
        shutdown: CancellationToken,
    ) -> anyhow::Result<(
        SocketAddr,
        tokio::task::JoinHandle<anyhow::Result<DrainReport>>,
    )> {
        let listen = self.configs[0].endpoint.listen;
        let listener = telemetry::bind(listen)
            .await
            .with_context(|| format!("cannot listen on --listen {listen}"))?;
        let addr = listener.local_addr()?;
        let handle = tokio::spawn(self.run(listener, shutdown));
        Ok((addr, handle))
    }

    async fn run(
        self,
        listener: tokio::net::TcpListener,
        shutdown: CancellationToken,
    ) -> anyhow::Result<DrainReport> {
        let Self {
            configs,
            metrics,
            health,
            traced,
        } = self;
        let server_stop = CancellationToken::new();
        let drain = Arc::new(Drain::new(configs[0].endpoint.drain_token.clone()));
        let server = tokio::spawn(telemetry::serve(
            listener,
            metrics.clone(),
            health.clone(),
            drain.clone(),
            server_stop.clone(),
        ));
        let result = match configs.as_slice() {
            [config] => {
                run_sidecar(
                    config,
                    &metrics,
                    &health,
                    traced,
                    &drain,
                    shutdown.clone(),
                    true,
                )
                .await
            }
            many => run_subscriptions(many, &metrics, &health, traced, &drain, shutdown).await,
        };
        drain.finish(match &result {
            Ok(report) => report.to_string(),
            Err(e) => format!("stopped: {e:#}\n"),
        });
        server_stop.cancel();
        let _ = server.await;
        result
    }
}

fn show_policy(metrics: &Metrics, previous: Option<&Policy>, policy: &Policy) {
    if let Some(previous) = previous.filter(|p| p.name != policy.name) {
        metrics.policy_generation.remove(&PolicyLabels {
            policy: previous.name.clone(),
        });
    }
    metrics
        .policy_generation
        .get_or_create(&PolicyLabels {
            policy: policy.name.clone(),
        })
        .set(policy.generation);
}

/// What every policy source reports through, file or cluster: the log
/// line, the reload counter and the generation gauge.
fn report_reloads(metrics: Arc<Metrics>, initial: Policy) -> impl FnMut(&Reload) + Send + 'static {
    let mut in_force = initial;
    move |reload| match reload {
        Reload::Applied(policy) => {
            tracing::info!(policy = %policy.label(), "policy change applied");
            show_policy(&metrics, Some(&in_force), policy);
            in_force = (**policy).clone();
            metrics
                .policy_reloads
                .get_or_create(&ResultLabels { result: "applied" })
                .inc();
        }
        Reload::Rejected(problem) => {
            tracing::warn!(%problem, "policy change rejected; the last good policy stays in force");
            metrics
                .policy_reloads
                .get_or_create(&ResultLabels { result: "rejected" })
                .inc();
        }
    }
}

/// Every subscription at once, each with a `Health` and a `Drain` of its
/// own: `/readyz` is ready when every one is (the process's [`Health`]
/// asks its parts), a `/drain` drains every one and answers when all have
/// finished. A subscription that cannot start at all (a configuration its
/// broker refuses) stops the others: the pod restarts and says why, as
/// with one queue. What goes wrong with one queue's messages or broker
/// stays with that subscription.
async fn run_subscriptions(
    configs: &[RunConfig],
    metrics: &Arc<Metrics>,
    health: &Arc<Health>,
    traced: bool,
    drain: &Arc<Drain>,
    shutdown: CancellationToken,
) -> anyhow::Result<DrainReport> {
    let stop = shutdown.child_token();
    let parts: Vec<(Arc<Health>, Arc<Drain>)> = configs
        .iter()
        .map(|c| {
            let health = Arc::new(Health::new(c.endpoint.readiness));
            (health, Arc::new(Drain::new(None)))
        })
        .collect();
    health.set_parts(
        configs
            .iter()
            .zip(&parts)
            .map(|(c, (part, _))| (c.options.queue.clone(), part.clone()))
            .collect(),
    );
    // The process's own part of readiness: the subscriptions say the rest.
    health.set_ready(true);
    let fan_in = tokio::spawn(drain_every_subscription(
        drain.clone(),
        configs
            .iter()
            .zip(&parts)
            .map(|(c, (_, part))| (c.options.queue.clone(), part.clone()))
            .collect(),
        health.clone(),
        metrics.clone(),
    ));
    let runs = configs
        .iter()
        .zip(&parts)
        .map(|(config, (part, part_drain))| {
            let stop = stop.clone();
            async move {
                let result = run_sidecar(
                    config,
                    metrics,
                    part,
                    traced,
                    part_drain,
                    stop.clone(),
                    false,
                )
                .await
                .with_context(|| format!("subscription {}", config.options.queue));
                if result.is_err() {
                    stop.cancel();
                }
                result
            }
        });
    let results = futures::future::join_all(runs).await;
    fan_in.abort();
    let mut report = DrainReport {
        finished: 0,
        abandoned: 0,
    };
    for result in results {
        let one = result?;
        report.finished += one.finished;
        report.abandoned += one.abandoned;
    }
    tracing::info!(
        finished = report.finished,
        abandoned = report.abandoned,
        subscriptions = configs.len(),
        "stopped"
    );
    Ok(report)
}

/// A `/drain` of the process drains every subscription: each is asked, the
/// answer waits for all and names each queue's count, and the round ends
/// once every subscription has resumed (no SIGTERM followed).
async fn drain_every_subscription(
    drain: Arc<Drain>,
    parts: Vec<(String, Arc<Drain>)>,
    health: Arc<Health>,
    metrics: Arc<Metrics>,
) {
    loop {
        drain.start_pulling().cancelled().await;
        for (_, part) in &parts {
            part.ask();
        }
        let summaries =
            futures::future::join_all(parts.iter().map(|(_, part)| part.finished())).await;
        let summary: String = parts
            .iter()
            .zip(summaries)
            .map(|((queue, _), summary)| format!("{queue}: {summary}"))
            .collect();
        drain.finish(summary);
        futures::future::join_all(parts.iter().map(|(_, part)| part.resumed())).await;
        health.set_draining(false);
        metrics.draining.set(0);
        drain.resume();
    }
}

/// One subscription's pipeline until `shutdown`; `alone` when it is the
/// process's only one.
async fn run_sidecar(
    config: &RunConfig,
    metrics: &Arc<Metrics>,
    health: &Arc<Health>,
    traced: bool,
    drain: &Arc<Drain>,
    shutdown: CancellationToken,
    alone: bool,
) -> anyhow::Result<DrainReport> {
    let opened: Arc<OnceLock<Arc<dyn Source>>> = Arc::default();
    let (live, update) = LivePolicy::new(config.policy.initial.clone());
    let update = update.admit_with({
        let (opened, options) = (opened.clone(), config.options.clone());
        let url = config.source.to_string();
        move |policy| follow_policy(opened.get(), &options, &url, policy)
    });
    show_policy(metrics, None, &config.policy.initial);
    let PolicyWatch::Started(watcher) =
        watch_policy(config, update, metrics, health, &shutdown).await?
    else {
        return Ok(DrainReport {
            finished: 0,
            abandoned: 0,
        });
    };
    // Opened with the settings of the policy in force now; every later
    // change reaches the source through `follow_policy`.
    let options = options_for(&config.options, &live.current());
    let Some(source) = open_source(config, options, health, metrics, &shutdown).await? else {
        if let Some(watcher) = watcher {
            watcher.abort();
        }
        return Ok(DrainReport {
            finished: 0,
            abandoned: 0,
        });
    };
    refuse_unkept_ordering(config, source.as_ref())?;
    let _ = opened.set(source.clone());
    // A change applied while the source was opening has not reached it.
    source.apply(&dispatch::live::settings_for(
        &config.options,
        &live.current(),
    ));
    tracing::info!(
        source = %config.source,
        queue = %config.options.queue,
        group = %config.options.group,
        consumer = %config.options.consumer,
        app = %config.app.url,
        policy = %live.current().label(),
        "courier is running"
    );
    let asked = Arc::downgrade(&source);
    // A source that is gone (the run ended) does not consume.
    health.ask_connection(move || asked.upgrade().is_some_and(|source| source.connected()));
    health.set_ready(true);
    let poller = tokio::spawn(poll_depth(
        source.clone(),
        metrics.clone(),
        config.options.queue.clone(),
        config.endpoint.depth_interval,
        shutdown.clone(),
    ));
    let not_ready = {
        let (health, shutdown, source) = (health.clone(), shutdown.clone(), source.clone());
        let metrics = metrics.clone();
        tokio::spawn(async move {
            follow_connection(source.as_ref(), &metrics, &shutdown).await;
            health.set_ready(false);
        })
    };
    let dispatcher = dispatcher_for(config, source, live, metrics, health, traced);
    let drains = dispatch::Drains {
        drain: drain.clone(),
        resume_after: config.endpoint.drain_resume_after,
    };
    let report = dispatcher.run_with(shutdown, Some(drains)).await;
    // One "stopped" line per process, with its totals: several
    // subscriptions each say theirs first (`run_subscriptions`).
    if alone {
        tracing::info!(
            finished = report.finished,
            abandoned = report.abandoned,
            "stopped"
        );
    } else {
        tracing::info!(
            queue = %config.options.queue,
            finished = report.finished,
            abandoned = report.abandoned,
            "subscription stopped"
        );
    }
    if let Some(watcher) = watcher {
        watcher.abort();
    }
    let _ = poller.await;
    let _ = not_ready.await;
    Ok(report)
}

/// How following the policy started.
enum PolicyWatch {
    /// The watcher of the file or the RetryPolicy; none when neither is
    /// given.
    Started(Option<tokio::task::JoinHandle<()>>),
    /// Shut down before the RetryPolicy was read.
    ShutDown,
}

/// Starts following the policy file or the RetryPolicy, if either is
/// given. With a RetryPolicy, waits until it has been read once: nothing is
/// pulled before.
async fn watch_policy(
    config: &RunConfig,
    update: policy::PolicyUpdate,
    metrics: &Arc<Metrics>,
    health: &Arc<Health>,
    shutdown: &CancellationToken,
) -> anyhow::Result<PolicyWatch> {
    let on_reload = report_reloads(metrics.clone(), config.policy.initial.clone());
    if let Some(path) = config.policy.file.clone() {
        return Ok(PolicyWatch::Started(Some(policy::file::watch(
            path,
            update,
            config.policy.poll,
            on_reload,
        ))));
    }
    let Some(target) = config.policy.cluster.clone() else {
        return Ok(PolicyWatch::Started(None));
    };
    let (watcher, mut status) = policy::cluster::follow(target, update, on_reload)
        .await
        .context("--policy: cannot set up a Kubernetes API client")?;
    tokio::spawn(show_policy_status(
        status.clone(),
        metrics.clone(),
        health.clone(),
    ));
    tokio::select! {
        _ = status.wait_for(|status| status.read) => Ok(PolicyWatch::Started(Some(watcher))),
        _ = shutdown.cancelled() => {
            watcher.abort();
            Ok(PolicyWatch::ShutDown)
        }
    }
}

/// `--ordering key` on a source that cannot keep it ends the start.
fn refuse_unkept_ordering(config: &RunConfig, source: &dyn Source) -> anyhow::Result<()> {
    if config.options.ordering == crate::source::Ordering::Key
        && !source.capabilities().key_ordering
    {
        anyhow::bail!(
            "--ordering key: the {} source cannot keep the messages of one key in order; use Kafka, or leave --ordering at none",
            config.source.broker().name
        );
    }
    Ok(())
}

/// The dispatcher of this run, with a span per delivery when traced.
fn dispatcher_for(
    config: &RunConfig,
    source: Arc<dyn Source>,
    live: LivePolicy,
    metrics: &Arc<Metrics>,
    health: &Arc<Health>,
    traced: bool,
) -> Dispatcher {
    let dispatcher = Dispatcher::new(
        source,
        live,
        &config.options,
        &config.app,
        &config.delivery,
        metrics.clone(),
        health.clone(),
    );
    if !traced {
        return dispatcher;
    }
    dispatcher.with_traces(dispatch::Traces {
        system: config.source.broker().messaging_system,
        group: config.options.group.clone(),
    })
}

/// `courier_policy_ready` and the `/readyz` reason follow what the watch
/// reports, until the watch ends.
async fn show_policy_status(
    mut status: tokio::sync::watch::Receiver<policy::cluster::PolicyStatus>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
) {
    loop {
        let now = status.borrow_and_update().clone();
        metrics
            .policy_ready
            .set(i64::from(now.read && now.problem.is_none()));
        health.set_policy_problem(now.problem);
        if status.changed().await.is_err() {
            return;
        }
    }
}

/// A policy change, before it is put in force: the open source must be
/// able to follow it (a Redis Cluster dead-letter queue in another hash
/// slot cannot), and then takes the settings it implies (visibility
/// timeout, dead-letter queue for depth, delivery limit). A change the
/// source refuses is refused as a whole, loudly, like an invalid document.
fn follow_policy(
    source: Option<&Arc<dyn Source>>,
    options: &SourceOptions,
    url: &str,
    policy: &Policy,
) -> Result<(), String> {
    // Not open yet: it opens with the policy in force then.
    let Some(source) = source else {
        return Ok(());
    };
    let settings = dispatch::live::settings_for(options, policy);
    source.check(&settings).map_err(|problem| {
        format!(
            "policy {} cannot be followed by --source {url} (queue {}): {problem}",
            policy.label(),
            options.queue
        )
    })?;
    source.apply(&settings);
    tracing::info!(
        policy = %policy.label(),
        visibility_timeout = %crate::duration::format(settings.visibility_timeout),
        dead_letter_queue = %settings.dead_letter_queue,
        max_deliveries = settings.max_deliveries,
        "the source follows the new policy"
    );
    Ok(())
}

/// Reads depths from the broker on an interval. Never blocks deliveries; a
/// failed poll is logged and counted.
async fn poll_depth(
    source: Arc<dyn Source>,
    metrics: Arc<Metrics>,
    queue: String,
    interval: std::time::Duration,
    shutdown: CancellationToken,
) {
    let labels = QueueLabels { queue };
    let age_readable = source.capabilities().dead_letter_age;
    let inside = metrics
        .for_queue(
            &labels.queue,
            &Class::result_labels(),
            &DeadLetterReason::labels(),
        )
        .dead_letter(DeadLetterReason::Undeliverable.as_str())
        .cloned();
    let received = metrics.received.get_or_create(&labels).clone();
    let mut counted_inside = 0;
    let mut last = None;
    loop {
        // Dead letters the broker wrote for courier (a Redis script) count
        // like the dispatcher's own.
        let total = source.dead_lettered_inside();
        if let Some(counter) = &inside {
            counter.inc_by(total - counted_inside);
        }
        counted_inside = total;
        // A read still under way at shutdown is of no use, and a slow one
        // (Kafka's reads several partitions' offsets) held the exit past
        // --drain-timeout.
        let depth = tokio::select! {
            _ = shutdown.cancelled() => return,
            depth = source.depth() => depth,
        };
        let seen = depth.as_ref().ok().map(|d| {
            let counts = (d.ready, d.pending, d.retry_backlog, d.dead_letters);
            (counts, d.queue_depth, received.get())
        });
        let stretch = match (&seen, &last) {
            (Some(now), Some(before)) if now == before => QUIET_STRETCH,
            _ => 1,
        };
        last = seen;
        match depth {
            Ok(depth) => {
                metrics
                    .dlq_depth
                    .get_or_create(&labels)
                    .set(depth.dead_letters as i64);
                metrics
                    .retry_backlog
                    .get_or_create(&labels)
                    .set(depth.retry_backlog as i64);
                // No letter is old when there are none; an age the source
                // cannot read is left out, not reported as 0, so that an
                // alert on it can tell "fresh" from "unknown".
                match depth.oldest_dead_letter_age {
                    Some(age) => {
                        metrics
                            .dlq_oldest_age
                            .get_or_create(&labels)
                            .set(age.as_secs_f64());
                    }
                    None if age_readable && depth.dead_letters == 0 => {
                        metrics.dlq_oldest_age.get_or_create(&labels).set(0.0);
                    }
                    None => {
                        metrics.dlq_oldest_age.remove(&labels);
                    }
                }
                // Unknown while the broker cannot count (a Redis group's
                // lag is nil): left out, as a 0 would read as "nothing
                // waits" to an alert or an autoscaler.
                match depth.queue_depth {
                    Some(count) => {
                        metrics.queue_depth.get_or_create(&labels).set(count as i64);
                    }
                    None => {
                        metrics.queue_depth.remove(&labels);
                    }
                }
                match depth.oldest_waiting_age {
                    Some(age) => {
                        metrics
                            .queue_oldest_age
                            .get_or_create(&labels)
                            .set(age.as_secs_f64());
                    }
                    // A broker that cannot tell leaves the series out:
                    // a 0 would read as "nothing waits".
                    None => {
                        metrics.queue_oldest_age.remove(&labels);
                    }
                }
            }
            Err(e) => {
                metrics.depth_poll_errors.get_or_create(&labels).inc();
                tracing::warn!(error = %e, "reading queue depths failed");
            }
        }
        let received_before = received.get();
        for _ in 0..stretch {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(interval) => {}
            }
            if received.get() != received_before {
                break;
            }
        }
    }
}

/// Depth readings that find nothing changed, with no message received in
/// between, come further apart: this many `--depth-interval`s. An idle
/// queue's gauges then cost its broker a reading a minute by default
/// instead of four; a change, or a message received, brings the next
/// reading back to the interval. The first unchanged reading stretches the
/// wait at once: doubling it (15, 30, 60 s) made a sidecar started on a
/// quiet queue read twice in its first minute, and on Pub/Sub, where a
/// reading is some 13 calls (snapshots, seeks and pulls of the shadow
/// subscriptions), that was a third of what the idle sidecar sent.
const QUIET_STRETCH: u32 = 4;

/// Opens the source; a broker that cannot be reached is logged and tried
/// again with backoff (not ready meanwhile) instead of crash-looping. What
/// no retry changes ends the run with exit 1 and the setting to fix: a
/// configuration the broker can never accept ([`ErrorKind::Invalid`], e.g.
/// a missing queue) or credentials it turns down ([`ErrorKind::Refused`]:
/// a wrong password, a database index out of range). `None` when shut
/// down first.
async fn open_source(
    config: &RunConfig,
    options: source::SourceOptions,
    health: &Health,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<Arc<dyn Source>>> {
    let mut wait = std::time::Duration::from_secs(1);
    loop {
        match source::open(&config.source, options.clone()).await {
            Ok(source) => {
                health.set_source_problem(None);
                metrics.broker_up.set(1);
                return Ok(Some(source));
            }
            Err(e) if matches!(e.kind(), ErrorKind::Invalid | ErrorKind::Refused) => {
                return Err(e).with_context(|| format!("cannot open --source {}", config.source));
            }
            Err(e) => {
                metrics.broker_up.set(0);
                health.set_source_problem(Some(format!(
                    "cannot open --source {} (queue {}): {e}",
                    config.source, options.queue
                )));
                tracing::error!(source = %config.source, queue = %options.queue, error = %e, retry_in = ?wait, "cannot open the source; not ready, trying again");
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(None),
                    _ = tokio::time::sleep(wait) => {}
                }
                wait = (wait * 2).min(std::time::Duration::from_secs(30));
            }
        }
    }
}

/// Logs when the source stops consuming (its broker connection lost, or
/// whatever else keeps it from consuming: `Observed::connected`) and when
/// it consumes again, and keeps `courier_broker_up` within
/// [`CONNECTION_CHECK`] where it is read other than by a scrape of
/// `/metrics` (the endpoint asks the source, as `/readyz` does), until
/// shutdown.
async fn follow_connection(source: &dyn Source, metrics: &Metrics, shutdown: &CancellationToken) {
    let mut was = true;
    loop {
        let connected = source.connected();
        if connected != was {
            if connected {
                tracing::info!("the source consumes again: ready");
            } else {
                // The source said why just before (a lost connection, or a
                // Kafka replica left without partitions).
                tracing::warn!(
                    "the source cannot consume (its broker connection is lost, or as logged before): not ready until it can"
                );
            }
            was = connected;
        }
        metrics.broker_up.set(i64::from(connected));
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(CONNECTION_CHECK) => {}
        }
    }
}

/// How often the log looks at the source's connection. Readiness and the
/// scraped gauge ask when asked, so this need not be quick, and an idle
/// sidecar wakes for it: with this and the receive's wait at 1 s, courier's
/// own thread woke 400 times a minute on an idle Kafka queue; with both at
/// 5 s, 97 times (issue 28).
const CONNECTION_CHECK: std::time::Duration = std::time::Duration::from_secs(5);

/// The options a source is opened with under `policy`: its dead-letter
/// queue, delivery limit, and a visibility timeout longer than the policy's
/// timeout.
pub fn options_for(options: &SourceOptions, policy: &Policy) -> SourceOptions {
    let settings = dispatch::live::settings_for(options, policy);
    if settings.visibility_timeout > options.live.visibility_timeout {
        tracing::info!(
            policy = %policy.label(),
            visibility_timeout = %crate::duration::format(settings.visibility_timeout),
            "the policy timeout is not much shorter than --visibility-timeout; using the policy timeout + 30s"
        );
    }
    SourceOptions {
        live: settings,
        ..options.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A change the source cannot follow is refused as a whole: the policy
    /// in force stays, and the refusal says why.
    #[test]
    fn a_change_the_source_refuses_is_refused_and_the_last_policy_stays() {
        let first = Policy::test();
        let (live, update) = LivePolicy::new(first.clone());
        let update = update.admit_with(|policy| {
            if policy.dead_letter_queue.is_some() {
                Err("the dead-letter queue is in another hash slot".into())
            } else {
                Ok(())
            }
        });
        let refused = Policy {
            dead_letter_queue: Some("elsewhere".into()),
            ..Policy::test()
        };
        match update.offer(Ok(refused), None) {
            Reload::Rejected(problem) => assert!(problem.contains("hash slot"), "{problem}"),
            Reload::Applied(policy) => panic!("applied {policy:?}"),
        }
        assert_eq!(*live.current(), first);
        let accepted = Policy::test().max_attempts(9);
        assert!(matches!(
            update.offer(Ok(accepted), None),
            Reload::Applied(_)
        ));
        assert_eq!(live.current().max_attempts, 9);
    }

    #[test]
    fn before_the_source_is_open_every_change_is_admitted() {
        let options = SourceOptions::new("orders");
        assert_eq!(
            follow_policy(None, &options, "redis://host", &Policy::test()),
            Ok(())
        );
    }

    #[test]
    fn the_source_opens_with_the_dead_letter_queue_and_a_long_enough_visibility() {
        let mut options = SourceOptions::new("orders");
        options.live.visibility_timeout = Duration::from_secs(60);
        let mut policy = Policy {
            dead_letter_queue: Some("orders.parked".into()),
            ..Policy::default()
        };
        let opened = options_for(&options, &policy);
        assert_eq!(opened.live.dead_letter_queue, "orders.parked");
        assert_eq!(opened.live.visibility_timeout, Duration::from_secs(60));
        policy.timeout = Duration::from_secs(90);
        let opened = options_for(&options, &policy);
        assert_eq!(opened.live.visibility_timeout, Duration::from_secs(120));
        assert_eq!(opened.live.max_deliveries, policy.max_deliveries());
    }
}
