//! The delivery loop, in steps: wait while the app is held or down, read
//! up to one round of the concurrency limit, launch a delivery per message
//! (offer, judge, settle: [`deliver`]) that runs beside the loop
//! ([`deliveries`]), and on shutdown stop pulling and let what is in flight
//! finish, up to the drain timeout.
//!
//! Guards around the app: the [`limit`] (how many deliveries may be in
//! flight, adapted to the app's answers), the [`gate`] (stop pulling while
//! the app is down) and the Retry-After [`hold`]. Beside the loop, deliveries
//! in flight are kept claimed ([`in_flight`]) and the app is watched.

mod batch;
mod deliver;
mod deliveries;
pub mod gate;
pub mod hold;
pub mod in_flight;
pub mod limit;
pub mod live;
mod rate;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, SystemTime};

use futures::FutureExt;
use prometheus_client::metrics::counter::Counter;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use http::Uri;

use crate::forward::cloudevents::Mode as CloudEventsMode;
use crate::forward::{Forwarder, QueueName};
use crate::model::{Class, DeadLetterReason, Delivery};
use crate::policy::LivePolicy;
use crate::source::{Consumer, ErrorKind, Settlement, SourceOptions};
use crate::telemetry::{self, Metrics, QueueLabels, QueueMetrics};

pub use batch::BatchSettings;
use deliveries::Deliveries;
use gate::{Change, Evidence, Gate};
use hold::Hold;
use in_flight::InFlight;
use limit::{Limiter, Slot};

/// At most this many messages are asked for in one read.
const MAX_BATCH: usize = 256;
/// A message read ahead waits at most this long for a free slot before it
/// goes back to the broker: a read-ahead helps a fast app, and must not hold
/// messages the broker could hand to another replica while a slow one works.
const READ_AHEAD_WAIT: Duration = Duration::from_secs(2);
/// How often the app (or its health path) is checked while deliveries flow.
const APP_PROBE_INTERVAL: Duration = Duration::from_secs(5);
/// How often the app is asked, doubling, while courier waits for it before
/// the first delivery: an app that is starting is usually up within seconds,
/// and every moment waited is latency.
const START_PROBE_MIN: Duration = Duration::from_millis(100);
const START_PROBE_MAX: Duration = Duration::from_millis(500);
/// Failed reads in a row after which `/readyz` says not ready.
pub const READ_FAILURE_RUN: u32 = 3;

/// The delivery loop of one queue; [`Dispatcher::new`] takes each setting
/// from the part that owns it.
pub struct Dispatcher {
    source: Arc<dyn Consumer>,
    forwarder: Forwarder,
    policy: LivePolicy,
    metrics: Arc<Metrics>,
    /// Readiness follows the gate and the broker reads.
    health: Arc<telemetry::Health>,
    /// From the [`SourceOptions`].
    queue: String,
    concurrency: usize,
    max_body: usize,
    /// The configured visibility timeout; the one in force follows the
    /// policy's timeout ([`live::visibility_for`]).
    visibility_timeout: Duration,
    /// From the [`AppSettings`].
    app_health_path: Option<String>,
    app_failure_run: u32,
    /// From the [`DeliverySettings`], the window only where the source
    /// keeps one.
    drain_timeout: Duration,
    dedup_window: Option<Duration>,
    batch: Option<BatchSettings>,
    /// With the trace export running: a span per delivery attempt, whose
    /// `traceparent` the app receives.
    traces: Option<Traces>,
}

/// The app: where it listens and how courier follows its health.
#[derive(Debug, Clone)]
pub struct AppSettings {
    /// `--app`: where each message is POSTed.
    pub url: Uri,
    /// GET on this path says whether the app is up (2xx) or down.
    pub health_path: Option<String>,
    /// Consecutive 503s or timeouts after which the health path is asked at
    /// once; 0: only the periodic check asks. No effect without a path.
    pub failure_run: u32,
    /// How CloudEvents are offered to the app (`--cloudevents`).
    pub cloudevents: CloudEventsMode,
}

impl AppSettings {
    /// The app at `url`, with no health path and the default failure run.
    pub fn new(url: Uri) -> Self {
        Self {
            url,
            health_path: None,
            failure_run: gate::FAILURE_RUN,
            cloudevents: CloudEventsMode::default(),
        }
    }
}

/// How deliveries end, beyond what the policy says.
#[derive(Debug, Clone)]
pub struct DeliverySettings {
    /// How long what is in flight may finish after SIGTERM.
    pub drain_timeout: Duration,
    /// Acked idempotency keys are remembered this long, and a redelivery of
    /// one is acked without reaching the app.
    pub dedup_window: Option<Duration>,
    /// Several messages in one POST (docs/batches.md); `None`: one
    /// message per POST.
    pub batch: Option<BatchSettings>,
}

impl Dispatcher {
    /// The dispatcher of `source`'s queue: the queue, the concurrency, the
    /// body limit and the visibility timeout from the `options` it was
    /// opened with; the app's address and health from `app`. A dedup
    /// window on a source that keeps none is ignored, with a warning.
    pub fn new(
        source: Arc<dyn Consumer>,
        policy: LivePolicy,
        options: &SourceOptions,
        app: &AppSettings,
        delivery: &DeliverySettings,
        metrics: Arc<Metrics>,
        health: Arc<telemetry::Health>,
    ) -> Self {
        let dedup_window = delivery.dedup_window.filter(|_| {
            let supported = source.capabilities().dedup;
            if !supported {
                tracing::warn!(queue = %options.queue, "--dedup-window: this source keeps no deduplication window; deliveries are not deduplicated");
            }
            supported
        });
        Self {
            forwarder: Forwarder::new(app.url.clone(), options.concurrency)
                .with_cloudevents(app.cloudevents),
            source,
            policy,
            metrics,
            health,
            queue: options.queue.clone(),
            concurrency: options.concurrency,
            max_body: options.max_body,
            visibility_timeout: options.live.visibility_timeout,
            app_health_path: app.health_path.clone(),
            app_failure_run: app.failure_run,
            drain_timeout: delivery.drain_timeout,
            dedup_window,
            batch: delivery.batch,
            traces: None,
        }
    }

    /// A span per delivery attempt, for the trace export.
    pub fn with_traces(mut self, traces: Traces) -> Self {
        self.traces = Some(traces);
        self
    }
}

/// What every delivery span of this run says besides the message's own.
#[derive(Debug, Clone)]
pub struct Traces {
    /// `messaging.system`, the broker's ([`crate::source::Broker`]).
    pub system: &'static str,
    /// `messaging.consumer.group.name`.
    pub group: String,
}

/// How the drain went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainReport {
    /// Deliveries that were in flight at shutdown and finished.
    pub finished: usize,
    /// Deliveries cut off at the drain deadline; left unsettled, so the broker
    /// hands them out again.
    pub abandoned: usize,
}

/// The reading side of the loop: messages read and not yet handed to a
/// delivery task, failed reads in a row, probes while the gate is closed.
struct Reader {
    ahead: VecDeque<Delivery>,
    read_at: Instant,
    failures: u32,
    probes: u32,
}

impl Default for Reader {
    fn default() -> Self {
        Self {
            ahead: VecDeque::new(),
            read_at: Instant::now(),
            failures: 0,
            probes: 0,
        }
    }
}

impl Reader {
    /// After a failed read: 200 ms doubling up to 5 s.
    fn retry_wait(&self) -> Duration {
        Duration::from_millis(100 * 2u64.pow(self.failures.min(6))).min(Duration::from_secs(5))
    }
}

/// Resolves when a change to the policy pauses the queue.
async fn pause_begins(mut watch: LivePolicy) {
    loop {
        if !watch.changed().await {
            // The policy can no longer change.
            return std::future::pending().await;
        }
        if watch.current().paused_at(SystemTime::now()).is_some() {
            return;
        }
    }
}

/// What the loop does next.
enum Flow {
    Stop,
    Again,
    /// Launch what was read; the first message has this slot.
    Launch(Slot),
}

/// Shared by the loop, its delivery tasks and its helpers.
struct Shared {
    d: Dispatcher,
    hold: Hold,
    limiter: Arc<Limiter>,
    /// Places among the settlements under way, `--concurrency` of them
    /// ([`Shared::settling`]).
    settling: Arc<tokio::sync::Semaphore>,
    gate: Gate,
    in_flight: Arc<InFlight>,
    queue: QueueName,
    m: QueueMetrics,
    read_errors: Counter,
    /// The `rateLimit` bucket of this replica.
    rate: rate::Bucket,
    /// Whether the loop is waiting out a pause (`spec.paused`).
    paused: AtomicBool,
    /// The policy generation last warned about for `scope: queue` on a
    /// broker that keeps no shared bucket, so it is said once per edit.
    unshared_warned: AtomicI64,
}

impl std::fmt::Display for DrainReport {
    /// What `/drain` answers.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "drained: {} deliveries finished, {} left unsettled for redelivery",
            self.finished, self.abandoned
        )
    }
}

/// `/drain` calls, and how long a finished drain waits for the SIGTERM that
/// should follow it before courier pulls again.
pub struct Drains {
    pub drain: Arc<telemetry::Drain>,
    /// A drain no SIGTERM followed within this: Kubernetes ran the app's
    /// `preStop` to restart the app container alone (a failed liveness or
    /// startup probe), and the pod goes on.
    pub resume_after: Duration,
}

impl Dispatcher {
    /// Runs until `shutdown`, then drains.
    pub async fn run(self, shutdown: CancellationToken) -> DrainReport {
        self.run_with(shutdown, None).await
    }

    /// [`Dispatcher::run`], and a `/drain` stops pulling and settles what
    /// is in flight before `shutdown`; with no `shutdown` within
    /// `resume_after` of its end, pulling starts again.
    pub async fn run_with(
        self,
        shutdown: CancellationToken,
        drains: Option<Drains>,
    ) -> DrainReport {
        let shared = Arc::new(Shared::new(self));
        let mut helpers = Vec::new();
        let report = loop {
            // This round stops at SIGTERM or at the round's first /drain.
            let stop = shutdown.child_token();
            let linked = drains.as_ref().map(|d| {
                let (asked, stop) = (d.drain.start_pulling(), stop.clone());
                tokio::spawn(async move {
                    asked.cancelled().await;
                    stop.cancel();
                })
            });
            shared.wait_for_app(&stop).await;
            if helpers.is_empty() {
                helpers.push(tokio::spawn(shared.clone().watch_app()));
                helpers.push(tokio::spawn(shared.clone().keep_alive()));
            }
            let report = shared.pull_until(&stop).await;
            if let Some(linked) = linked {
                linked.abort();
            }
            let Some(drains) = drains.as_ref().filter(|_| !shutdown.is_cancelled()) else {
                break report;
            };
            drains.drain.finish(report.to_string());
            tracing::info!(
                finished = report.finished,
                abandoned = report.abandoned,
                resume_after = %crate::duration::format(drains.resume_after),
                "/drain: done; pulling nothing until SIGTERM"
            );
            tokio::select! {
                _ = shutdown.cancelled() => break report,
                _ = tokio::time::sleep(drains.resume_after) => {}
            }
            tracing::warn!(
                waited = %crate::duration::format(drains.resume_after),
                "no SIGTERM followed the /drain (the app container was restarted, not the pod): pulling again"
            );
            drains.drain.resume();
            shared.d.health.set_draining(false);
            shared.d.metrics.draining.set(0);
        };
        for helper in helpers {
            helper.abort();
        }
        shared.d.source.close().await;
        report
    }
}

impl Shared {
    /// Reads and delivers until `stop`, then gives back what was read ahead
    /// and lets what is in flight finish.
    async fn pull_until(self: &Arc<Self>, stop: &CancellationToken) -> DrainReport {
        if let Some(batch) = self.d.batch {
            return self.pull_batches_until(stop, batch).await;
        }
        let mut deliveries = Deliveries::new();
        let mut reader = Reader::default();
        loop {
            match deliveries.alongside(self.next(&mut reader, stop)).await {
                Flow::Stop => break,
                Flow::Again => {}
                Flow::Launch(slot) => self.launch(&mut reader.ahead, slot, &mut deliveries),
            }
        }
        deliveries
            .alongside(self.give_back(&mut reader.ahead, Instant::now()))
            .await;
        self.drain(deliveries).await
    }

    fn new(d: Dispatcher) -> Self {
        let m = d.metrics.for_queue(
            &d.queue,
            &Class::result_labels(),
            &DeadLetterReason::labels(),
        );
        let read_errors = d
            .metrics
            .broker_read_errors
            .get_or_create(&QueueLabels {
                queue: d.queue.clone(),
            })
            .clone();
        let shared = Self {
            limiter: Limiter::new(d.concurrency),
            settling: Arc::new(tokio::sync::Semaphore::new(d.concurrency.max(1))),
            gate: Gate::new(d.app_failure_run, d.app_health_path.is_some()),
            hold: Hold::default(),
            in_flight: Arc::default(),
            queue: QueueName::new(&d.queue),
            m,
            read_errors,
            rate: rate::Bucket::default(),
            paused: AtomicBool::new(false),
            unshared_warned: AtomicI64::new(-1),
            d,
        };
        shared.show_limit();
        // The gate starts open: the app is presumed up until a delivery or
        // a check says otherwise.
        shared.m.app_up.set(1);
        shared
    }

    /// One turn of the loop: wait out a hold, probe a closed gate, or read.
    async fn next(&self, reader: &mut Reader, shutdown: &CancellationToken) -> Flow {
        if shutdown.is_cancelled() {
            return Flow::Stop;
        }
        if let Some(flow) = self.wait_while_paused(reader, shutdown).await {
            return flow;
        }
        if let Some(until) = self.hold.until() {
            self.give_back(&mut reader.ahead, until).await;
            tokio::select! {
                _ = shutdown.cancelled() => return Flow::Stop,
                _ = tokio::time::sleep_until(until) => {}
            }
        }
        if self.gate.is_closed() {
            self.give_back(&mut reader.ahead, Instant::now()).await;
            tokio::select! {
                _ = shutdown.cancelled() => return Flow::Stop,
                _ = tokio::time::sleep(gate::probe_delay(reader.probes)) => {}
            }
            reader.probes += 1;
            self.probe(reader).await;
            return Flow::Again;
        }
        reader.probes = 0;
        if reader.ahead.is_empty() {
            self.read(reader, shutdown).await
        } else {
            self.wait_for_slot(reader, shutdown).await
        }
    }

    /// Reads one round of the current limit, not just the free slots: a
    /// read costs a round trip and a wake-up whatever its size, and slots
    /// come free one by one.
    async fn read(&self, reader: &mut Reader, shutdown: &CancellationToken) -> Flow {
        // A pause must not wait for a slot or for the broker's answer.
        let pause = pause_begins(self.d.policy.watch());
        tokio::pin!(pause);
        let slot = tokio::select! {
            _ = shutdown.cancelled() => return Flow::Stop,
            _ = &mut pause => return Flow::Again,
            slot = self.limiter.acquire() => slot,
        };
        let Some(room) = self.rate_room(shutdown).await else {
            return Flow::Stop;
        };
        let want = self.limiter.limit().clamp(1, MAX_BATCH).min(room);
        // Not dropped at shutdown: a read the broker already answered must
        // reach a delivery task (or go back). The source is asked to end
        // its wait instead, where it can without losing a message.
        let received = {
            let receive = self.receive(want, reader);
            tokio::pin!(receive);
            tokio::select! {
                received = &mut receive => received,
                _ = shutdown.cancelled() => {
                    self.d.source.interrupt().await;
                    receive.await
                }
                _ = &mut pause => {
                    self.d.source.interrupt().await;
                    receive.await
                }
            }
        };
        match received {
            Some(deliveries) => {
                reader.ahead.extend(deliveries);
                reader.read_at = Instant::now();
                Flow::Launch(slot)
            }
            None => {
                drop(slot);
                tokio::select! {
                    _ = shutdown.cancelled() => Flow::Stop,
                    _ = tokio::time::sleep(reader.retry_wait()) => Flow::Again,
                }
            }
        }
    }

    /// While the policy pauses the queue: gives back what was read ahead
    /// and waits for an edit, the pause's end or shutdown. Deliveries in
    /// flight go on and settle; readiness is untouched (a pause is not an
    /// outage). `None` when not paused.
    async fn wait_while_paused(
        &self,
        reader: &mut Reader,
        shutdown: &CancellationToken,
    ) -> Option<Flow> {
        // Watched before it is read, so an edit after the read wakes it.
        let mut watch = self.d.policy.watch();
        let policy = watch.current();
        self.m
            .rate_limit
            .set(policy.rate_limit.map_or(0.0, |limit| limit.per_second));
        let now = SystemTime::now();
        let Some(pause) = policy.paused_at(now) else {
            if self.paused.swap(false, Ordering::Relaxed) {
                self.m.paused.set(0);
                tracing::info!(queue = %self.d.queue, policy = %policy.label(), "resumed: the RetryPolicy no longer pauses the queue");
            }
            return None;
        };
        if !self.paused.swap(true, Ordering::Relaxed) {
            self.m.paused.set(1);
            let until = pause.until.map(crate::model::rfc3339);
            tracing::warn!(queue = %self.d.queue, policy = %policy.label(), reason = %pause.reason, until, "paused by the RetryPolicy: fetching nothing; deliveries in flight finish");
        }
        self.give_back(&mut reader.ahead, Instant::now()).await;
        let ends = pause
            .until
            .map(|until| until.duration_since(now).unwrap_or_default());
        tokio::select! {
            _ = shutdown.cancelled() => Some(Flow::Stop),
            // A policy that can no longer change (its source ended) waits
            // for the pause's end or shutdown alone.
            true = watch.changed() => Some(Flow::Again),
            _ = async {
                match ends {
                    Some(ends) => tokio::time::sleep(ends).await,
                    None => std::future::pending().await,
                }
            } => Some(Flow::Again),
        }
    }

    /// How many messages the rate limit lets a read ask for, after waiting
    /// until it lets one; `None` at shutdown.
    async fn rate_room(&self, shutdown: &CancellationToken) -> Option<usize> {
        loop {
            let policy = self.d.policy.current();
            let Some(limit) = policy.rate_limit else {
                return Some(usize::MAX);
            };
            if self.shared_rate(&policy) {
                return Some(rate::shared_room(&limit));
            }
            match self.rate.room(&limit) {
                Ok(room) => return Some(room),
                Err(wait) => tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    _ = tokio::time::sleep(wait) => {}
                },
            }
        }
    }

    /// Whether the rate limit is kept on the broker for every replica
    /// (`scope: queue` where the broker can); where it cannot, each replica
    /// is limited on its own, and that is said once per policy edit.
    fn shared_rate(&self, policy: &crate::policy::Policy) -> bool {
        let Some(limit) = policy.rate_limit else {
            return false;
        };
        if limit.scope != crate::policy::RateScope::Queue {
            return false;
        }
        if self.d.source.capabilities().shared_rate_limit {
            return true;
        }
        if self
            .unshared_warned
            .swap(policy.generation, Ordering::Relaxed)
            != policy.generation
        {
            tracing::warn!(queue = %self.d.queue, policy = %policy.label(), per_second = limit.per_second,
                "rateLimit.scope queue: this broker keeps no bucket shared by the replicas, so each replica is limited to the rate on its own (docs/policy.md)");
        }
        false
    }

    /// Waits for this delivery's turn under the rate limit.
    async fn await_turn(&self, policy: &crate::policy::Policy) {
        let Some(limit) = policy.rate_limit else {
            return;
        };
        let wait = if self.shared_rate(policy) {
            match self
                .d
                .source
                .take_shared_token(limit.per_second, limit.burst)
                .await
            {
                Ok(wait) => wait,
                Err(e) => {
                    tracing::warn!(queue = %self.d.queue, error = %e, "the rate limit shared on the broker could not be read; this replica is limited on its own meanwhile");
                    self.rate.take(&limit)
                }
            }
        } else {
            self.rate.take(&limit)
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }

    /// Messages are waiting from the last read: the next free slot, or give
    /// them back when none comes free soon.
    async fn wait_for_slot(&self, reader: &mut Reader, shutdown: &CancellationToken) -> Flow {
        tokio::select! {
            _ = shutdown.cancelled() => Flow::Stop,
            _ = pause_begins(self.d.policy.watch()) => Flow::Again,
            slot = self.limiter.acquire() => Flow::Launch(slot),
            _ = tokio::time::sleep_until(reader.read_at + READ_AHEAD_WAIT) => {
                self.give_back(&mut reader.ahead, Instant::now()).await;
                Flow::Again
            }
        }
    }

    /// A read from the broker. A run of [`READ_FAILURE_RUN`] failures makes
    /// courier not ready until a read works again; each failure is counted.
    async fn receive(&self, want: usize, reader: &mut Reader) -> Option<Vec<Delivery>> {
        let received = self.d.source.receive(want).await;
        self.received(received, reader)
    }

    /// What a read brought, and the failures in a row counted.
    fn received(
        &self,
        received: Result<Vec<Delivery>, crate::source::SourceError>,
        reader: &mut Reader,
    ) -> Option<Vec<Delivery>> {
        match received {
            Ok(deliveries) => {
                if reader.failures >= READ_FAILURE_RUN {
                    tracing::info!(queue = %self.d.queue, "reading from the broker works again: ready");
                }
                reader.failures = 0;
                self.d.health.set_broker_reads_failing(false);
                Some(deliveries)
            }
            Err(e) => {
                reader.failures += 1;
                self.read_errors.inc();
                // A broker that turned down courier's credentials or
                // settings reads nothing until someone fixes them: not
                // ready, and the longest wait between reads, at once
                // rather than after a run of failures.
                if matches!(e.kind(), ErrorKind::Refused | ErrorKind::Invalid) {
                    reader.failures = reader.failures.max(READ_FAILURE_RUN);
                }
                if reader.failures == READ_FAILURE_RUN {
                    tracing::warn!(queue = %self.d.queue, failures = reader.failures, "reads from the broker keep failing: not ready until one works");
                    self.d.health.set_broker_reads_failing(true);
                }
                tracing::warn!(error = %e, retry_in = ?reader.retry_wait(), queue = %self.d.queue, "reading from the broker failed");
                None
            }
        }
    }

    /// A delivery per message read, as long as slots are free; the rest
    /// wait in `ahead`.
    fn launch(
        self: &Arc<Self>,
        ahead: &mut VecDeque<Delivery>,
        first: Slot,
        deliveries: &mut Deliveries,
    ) {
        let mut slot = Some(first);
        while let Some(delivery) = ahead.pop_front() {
            let Some(taken) = slot.take().or_else(|| self.limiter.try_acquire()) else {
                ahead.push_front(delivery);
                break;
            };
            let shared = self.clone();
            // Boxed: the delivery's future (the HTTP exchange and the
            // settlement inside it) is a few KiB, and a task or a poll set
            // moves its future by value into its own cell; a box is copied
            // once (BENCHMARKS.md, the profile).
            deliveries.launch(Box::pin(async move {
                if !shared.defer_if_held(&delivery).await {
                    let delivery = Arc::new(delivery);
                    let delivered =
                        std::panic::AssertUnwindSafe(shared.deliver(delivery.clone(), Some(taken)))
                            .catch_unwind()
                            .await;
                    if let Err(panic) = delivered {
                        let what = deliver::panic_message(panic.as_ref());
                        shared.after_panic(&delivery, what).await;
                    }
                }
            }));
        }
    }

    /// Lets the deliveries in flight finish, up to the drain timeout.
    async fn drain(&self, mut deliveries: Deliveries) -> DrainReport {
        deliveries.catch_up().await;
        let in_flight = deliveries.len();
        let timeout = self.d.drain_timeout;
        if in_flight > 0 {
            tracing::info!(in_flight, timeout = ?timeout, "draining in-flight deliveries");
        }
        let drained = tokio::time::timeout(timeout, deliveries.finish()).await;
        let abandoned = if drained.is_err() {
            let left = deliveries.len();
            deliveries.abandon().await;
            tracing::warn!(
                left,
                "drain timeout reached; unfinished deliveries stay unacked and will be redelivered"
            );
            left
        } else {
            0
        };
        DrainReport {
            finished: in_flight - abandoned,
            abandoned,
        }
    }

    /// A read that was already waiting on the broker when a 429 set the
    /// hold can return messages during it: they go back to the broker, due
    /// when the hold ends, with no attempt used. Stored rather than kept
    /// waiting here, so a long hold cannot outlast the visibility timeout.
    async fn defer_if_held(&self, delivery: &Delivery) -> bool {
        if self.is_paused() {
            self.defer(delivery, Instant::now()).await;
            return true;
        }
        let Some(until) = self.hold.until() else {
            return false;
        };
        self.defer(delivery, until).await;
        true
    }

    /// Whether the policy in force pauses the queue now: a message read
    /// before the pause was seen goes back unoffered.
    fn is_paused(&self) -> bool {
        self.d
            .policy
            .current()
            .paused_at(SystemTime::now())
            .is_some()
    }

    /// Messages read ahead go back to the broker, due at `until`, with no
    /// attempt used: the app is held, down or slow, or courier is stopping,
    /// and another replica (or this one later) should have them.
    async fn give_back(&self, ahead: &mut VecDeque<Delivery>, until: Instant) {
        if ahead.is_empty() {
            return;
        }
        tracing::debug!(
            count = ahead.len(),
            "returning messages read ahead to the broker"
        );
        for delivery in ahead.drain(..) {
            self.defer(&delivery, until).await;
        }
    }

    async fn defer(&self, delivery: &Delivery, until: Instant) {
        let due = SystemTime::now() + until.saturating_duration_since(Instant::now());
        let first_attempt_at = delivery.first_attempt_at.unwrap_or_else(SystemTime::now);
        let id = delivery.message.id.as_str();
        let again = Settlement::Retry {
            next_attempt: delivery.attempt,
            first_attempt_at,
            at: due,
        };
        match self.d.source.settle(delivery, again).await {
            Ok(()) => tracing::debug!(id, "deferred: back to the broker, due again later"),
            Err(e) => {
                self.m.settle_errors.inc();
                tracing::error!(id, error = %e, "deferring failed; the broker will hand the message out again");
            }
        }
    }

    fn show_limit(&self) {
        self.m.concurrency_limit.set(self.limiter.limit() as i64);
    }

    /// Before the first delivery: waits until the app accepts connections
    /// and, with `--app-health-path`, until that path answers 2xx. An app
    /// that is still starting may take connections before it can handle a
    /// message (404, 409): without this the first messages would meet it.
    /// Meanwhile the gate is closed (`courier_app_up` 0, not ready).
    async fn wait_for_app(&self, shutdown: &CancellationToken) {
        let ready = async || {
            self.d.forwarder.app_accepts_connections().await
                && match &self.d.app_health_path {
                    Some(path) => self.d.forwarder.probe(path).await,
                    None => true,
                }
        };
        if ready().await {
            return;
        }
        let app = self.d.forwarder.app();
        tracing::info!(%app, health_path = ?self.d.app_health_path, "waiting for the app to be ready before the first delivery");
        self.gate.report(Evidence::Unreachable);
        self.m.app_up.set(0);
        self.d.health.set_app_up(false);
        let mut wait = START_PROBE_MIN;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
            if ready().await {
                break;
            }
            wait = (wait * 2).min(START_PROBE_MAX);
        }
        self.gate.report(Evidence::HealthPath(true));
        self.m.app_up.set(1);
        self.d.health.set_app_up(true);
        tracing::info!(%app, "the app is ready: delivering");
    }

    /// While the gate is closed: ask the app's health path, or let one
    /// delivery through as the probe.
    async fn probe(&self, reader: &mut Reader) {
        if let Some(path) = &self.d.app_health_path {
            let up = self.d.forwarder.probe(path).await;
            self.report(Evidence::HealthPath(up)).await;
            return;
        }
        let slot = self.limiter.acquire().await;
        if let Some(deliveries) = self.receive(1, reader).await {
            for delivery in deliveries {
                match self.d.batch {
                    // An app that takes batches is probed with a batch.
                    Some(_) => self.deliver_batch_of_one(delivery).await,
                    None => self.deliver(Arc::new(delivery), None).await,
                }
            }
        }
        drop(slot);
    }

    /// Checks the app on an interval, idle or not: its health path when it
    /// has one, else whether it takes connections. `courier_app_up` shows
    /// the gate. The first check comes after one interval: until then the
    /// deliveries themselves say how the app is.
    async fn watch_app(self: Arc<Self>) {
        loop {
            tokio::time::sleep(APP_PROBE_INTERVAL).await;
            let evidence = match &self.d.app_health_path {
                Some(path) => Evidence::HealthPath(self.d.forwarder.probe(path).await),
                None if self.d.forwarder.app_accepts_connections().await => Evidence::Reachable,
                None => Evidence::Unreachable,
            };
            self.report(evidence).await;
            self.m.app_up.set(i64::from(!self.gate.is_closed()));
        }
    }

    /// Keeps the deliveries in flight claimed, three times per visibility
    /// timeout in force, or per the longest claim the broker grants when
    /// that is shorter (at 21da363 a Pub/Sub lease, capped at 600 s, lapsed
    /// under a 30 min timeout, and another replica got the message while
    /// the app still worked on it).
    async fn keep_alive(self: Arc<Self>) {
        loop {
            let visibility =
                live::visibility_for(self.d.visibility_timeout, &self.d.policy.current());
            let claim = match self.d.source.longest_claim() {
                Some(longest) => visibility.min(longest),
                None => visibility,
            };
            tokio::time::sleep(in_flight::keep_alive_interval(claim)).await;
            let in_flight = self.in_flight.snapshot();
            if in_flight.is_empty() {
                continue;
            }
            if let Err(e) = self.d.source.keep_alive(&in_flight).await {
                tracing::warn!(error = %e, count = in_flight.len(), "keeping deliveries in flight claimed failed; trying again");
            }
        }
    }

    /// Tells the gate what was learned about the app; a run of failures
    /// asks the health path first.
    async fn report(&self, evidence: Evidence) {
        let mut change = self.gate.report(evidence);
        if change == Change::CheckHealth {
            let up = match &self.d.app_health_path {
                Some(path) => self.d.forwarder.probe(path).await,
                None => true,
            };
            change = self.gate.report(Evidence::HealthPath(up));
        }
        let app = self.d.forwarder.app();
        match change {
            Change::Closed => {
                tracing::warn!(%app, health_path = ?self.d.app_health_path, "the app is down: pausing deliveries and probing it; failures use no attempts meanwhile");
                self.m.app_up.set(0);
                self.d.health.set_app_up(false);
            }
            Change::Opened => {
                tracing::info!(%app, "the app is up again: resuming deliveries");
                self.m.app_up.set(1);
                self.d.health.set_app_up(true);
            }
            Change::CheckHealth | Change::Unchanged => {}
        }
    }
}
