//! The delivery loop: read up to one round of the concurrency limit, offer
//! each to the app, settle it from the policy's verdict; on shutdown stop
//! pulling and let what is in flight finish, up to the drain timeout.
//!
//! Two guards protect the app: the [`limit`] (how many deliveries may be in
//! flight, adapted to the app's answers) and the [`gate`] (stop pulling
//! while the app is down).

pub mod gate;
pub mod limit;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::forward::{Envelope, Forwarder};
use crate::model::{Class, DeadLetterReason, Outcome};
use crate::model::{Delivery, Failure};
use crate::policy::{LivePolicy, Verdict, decide};
use crate::source::Source;
use crate::telemetry::{self, Metrics, QueueMetrics};

use gate::{Change, Gate};
use limit::{Limiter, Signal};

/// At most this many messages are asked for in one read.
const MAX_BATCH: usize = 256;
/// A message read ahead waits at most this long for a free slot before it
/// goes back to the broker: a read-ahead helps a fast app, and must not hold
/// messages the broker could hand to another replica while a slow one works.
const READ_AHEAD_WAIT: Duration = Duration::from_secs(2);
/// How often the app is probed for `courier_app_up`.
const APP_PROBE_INTERVAL: Duration = Duration::from_secs(5);

pub struct Dispatcher {
    pub source: Arc<dyn Source>,
    pub forwarder: Forwarder,
    pub policy: LivePolicy,
    pub metrics: Arc<Metrics>,
    pub queue: String,
    pub concurrency: usize,
    pub max_body: usize,
    pub drain_timeout: Duration,
    /// Readiness follows the app-health gate.
    pub health: Arc<telemetry::Health>,
    /// Probed with GET while the gate is closed; else one delivery probes.
    pub app_health_path: Option<String>,
    /// Consecutive 503s or timeouts that close the gate; 0: never.
    pub app_failure_run: u32,
    /// Acked idempotency keys are remembered this long, and a redelivery of
    /// one is acked without reaching the app.
    pub dedup_window: Option<Duration>,
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

/// Messages read and not yet handed to a delivery task.
struct ReadAhead {
    deliveries: VecDeque<Delivery>,
    read_at: Instant,
}

impl Default for ReadAhead {
    fn default() -> Self {
        Self {
            deliveries: VecDeque::new(),
            read_at: Instant::now(),
        }
    }
}

impl ReadAhead {
    fn fill(&mut self, deliveries: Vec<Delivery>) {
        self.deliveries.extend(deliveries);
        self.read_at = Instant::now();
    }
}

/// Shared by the loop and its delivery tasks.
struct Shared {
    dispatcher: Dispatcher,
    /// A 429 with Retry-After holds new deliveries until then: the limit is
    /// the app's, not the message's.
    hold_until: Mutex<Option<Instant>>,
    limiter: Arc<Limiter>,
    gate: Gate,
    m: QueueMetrics,
}

impl Dispatcher {
    /// Runs until `shutdown`, then drains.
    pub async fn run(self, shutdown: CancellationToken) -> DrainReport {
        let limiter = Limiter::new(self.concurrency);
        let gate = Gate::new(self.app_failure_run);
        let m = self.metrics.for_queue(
            &self.queue,
            &Class::result_labels(),
            &DeadLetterReason::labels(),
        );
        let shared = Arc::new(Shared {
            m,
            dispatcher: self,
            hold_until: Mutex::new(None),
            limiter: limiter.clone(),
            gate,
        });
        shared.show_limit();
        let probe = tokio::spawn({
            let shared = shared.clone();
            async move {
                loop {
                    let d = &shared.dispatcher;
                    let up =
                        d.forwarder.app_accepts_connections().await && !shared.gate.is_closed();
                    shared.m.app_up.set(i64::from(up));
                    tokio::time::sleep(APP_PROBE_INTERVAL).await;
                }
            }
        });
        let mut tasks = JoinSet::new();
        let mut ahead = ReadAhead::default();
        let mut failures = 0u32;
        let mut probes = 0u32;
        while !shutdown.is_cancelled() {
            while tasks.try_join_next().is_some() {}
            let hold = *shared.hold_until.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(until) = hold.filter(|t| *t > Instant::now()) {
                shared.give_back(&mut ahead, until).await;
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep_until(until) => {}
                }
            }
            if shared.gate.is_closed() {
                shared.give_back(&mut ahead, Instant::now()).await;
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(gate::probe_delay(probes)) => {}
                }
                probes += 1;
                shared.probe().await;
                continue;
            }
            probes = 0;
            let first = if ahead.deliveries.is_empty() {
                let first = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    slot = limiter.acquire() => slot,
                };
                // One round of the current limit is read at once, not just
                // the free slots: a read costs a round trip and a wake-up
                // whatever its size, and slots come free one by one.
                let want = limiter.limit().clamp(1, MAX_BATCH);
                // Not raced against shutdown: a read the broker already
                // answered must reach a delivery task (or go back), and a
                // read blocks about a second.
                let source = shared.dispatcher.source.clone();
                match source.receive(want).await {
                    Ok(deliveries) => {
                        failures = 0;
                        ahead.fill(deliveries);
                    }
                    Err(e) => {
                        failures += 1;
                        let wait = Duration::from_millis(100 * 2u64.pow(failures.min(6)))
                            .min(Duration::from_secs(5));
                        tracing::warn!(error = %e, retry_in = ?wait, queue = %shared.dispatcher.queue, "reading from the broker failed");
                        drop(first);
                        tokio::select! {
                            _ = shutdown.cancelled() => break,
                            _ = tokio::time::sleep(wait) => {}
                        }
                        continue;
                    }
                }
                first
            } else {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    slot = limiter.acquire() => slot,
                    _ = tokio::time::sleep_until(ahead.read_at + READ_AHEAD_WAIT) => {
                        shared.give_back(&mut ahead, Instant::now()).await;
                        continue;
                    }
                }
            };
            let mut slot = Some(first);
            while let Some(delivery) = ahead.deliveries.pop_front() {
                let Some(taken) = slot.take().or_else(|| limiter.try_acquire()) else {
                    ahead.deliveries.push_front(delivery);
                    break;
                };
                let shared = shared.clone();
                tasks.spawn(async move {
                    if !shared.defer_if_held(&delivery).await {
                        shared.deliver(delivery).await;
                    }
                    drop(taken);
                });
            }
        }
        shared.give_back(&mut ahead, Instant::now()).await;
        while tasks.try_join_next().is_some() {}
        let in_flight = tasks.len();
        let dispatcher = &shared.dispatcher;
        if in_flight > 0 {
            tracing::info!(in_flight, timeout = ?dispatcher.drain_timeout, "draining in-flight deliveries");
        }
        let drained = tokio::time::timeout(dispatcher.drain_timeout, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        let abandoned = if drained.is_err() {
            let left = tasks.len();
            tasks.abort_all();
            while tasks.join_next().await.is_some() {}
            tracing::warn!(
                left,
                "drain timeout reached; unfinished deliveries stay unacked and will be redelivered"
            );
            left
        } else {
            0
        };
        probe.abort();
        dispatcher.source.close().await;
        DrainReport {
            finished: in_flight - abandoned,
            abandoned,
        }
    }
}

impl Shared {
    /// A read that was already waiting on the broker when a 429 set the
    /// hold can return messages during it: they go back to the broker, due
    /// when the hold ends, with no attempt used. Stored rather than kept
    /// waiting here, so a long hold cannot outlast the visibility timeout.
    async fn defer_if_held(&self, delivery: &Delivery) -> bool {
        let hold = *self.hold_until.lock().unwrap_or_else(|e| e.into_inner());
        let Some(until) = hold.filter(|t| *t > Instant::now()) else {
            return false;
        };
        self.defer(delivery, until).await;
        true
    }

    /// Messages read ahead go back to the broker, due at `until`, with no
    /// attempt used: the app is held, down or slow, or courier is stopping,
    /// and another replica (or this one later) should have them.
    async fn give_back(&self, ahead: &mut ReadAhead, until: Instant) {
        if ahead.deliveries.is_empty() {
            return;
        }
        tracing::debug!(
            count = ahead.deliveries.len(),
            "returning messages read ahead to the broker"
        );
        for delivery in ahead.deliveries.drain(..) {
            self.defer(&delivery, until).await;
        }
    }

    async fn defer(&self, delivery: &Delivery, until: Instant) {
        let d = &self.dispatcher;
        let due = SystemTime::now() + until.saturating_duration_since(Instant::now());
        let first_attempt_at = delivery.first_attempt_at.unwrap_or_else(SystemTime::now);
        let id = delivery.message.id.as_str();
        match d
            .source
            .retry(delivery, delivery.attempt, first_attempt_at, due)
            .await
        {
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

    /// While the gate is closed: ask the app's health path, or let one
    /// delivery through as the probe. Either opens the gate when the app
    /// answers.
    async fn probe(&self) {
        let d = &self.dispatcher;
        if let Some(path) = &d.app_health_path {
            if d.forwarder.probe(path).await {
                self.gate_changed(self.gate.report(gate::Health::Answering));
            }
            return;
        }
        let slot = self.limiter.acquire().await;
        match d.source.receive(1).await {
            Ok(deliveries) => {
                for delivery in deliveries {
                    self.deliver(delivery).await;
                }
            }
            Err(e) => tracing::warn!(error = %e, "reading from the broker failed"),
        }
        drop(slot);
    }

    fn gate_changed(&self, change: Change) {
        let d = &self.dispatcher;
        match change {
            Change::Closed => {
                tracing::warn!(app = %d.forwarder.app(), "the app is down or failing: pausing deliveries and probing it");
                self.m.app_up.set(0);
                d.health.set_ready(false);
            }
            Change::Opened => {
                tracing::info!(app = %d.forwarder.app(), "the app answers again: resuming deliveries");
                self.m.app_up.set(1);
                d.health.set_ready(true);
            }
            Change::Unchanged => {}
        }
    }

    /// A redelivery of a message acked within the window: ack it again
    /// without offering it to the app.
    async fn already_acked(&self, delivery: &Delivery) -> bool {
        let d = &self.dispatcher;
        let key = Envelope {
            message: &delivery.message,
            queue: &d.queue,
            attempt: delivery.attempt,
        }
        .idempotency_key();
        match d.source.was_acked(&key).await {
            Ok(true) => {}
            Ok(false) => return false,
            Err(e) => {
                tracing::warn!(error = %e, "deduplication check failed; delivering");
                return false;
            }
        }
        match d.source.ack(delivery).await {
            Ok(()) => {
                self.m.dedup_hits.inc();
                self.m.acks.inc();
                tracing::debug!(id = %delivery.message.id, %key, "already acked within the dedup window; acked again without delivery");
            }
            Err(e) => {
                self.m.settle_errors.inc();
                tracing::error!(id = %delivery.message.id, error = %e, "settling failed; the broker will hand the message out again");
            }
        }
        true
    }

    async fn deliver(&self, delivery: Delivery) {
        let d = &self.dispatcher;
        self.m.received.inc();
        if d.dedup_window.is_some()
            && delivery.problem.is_none()
            && self.already_acked(&delivery).await
        {
            return;
        }
        let policy = d.policy.current();
        let started_at = SystemTime::now();
        let first_attempt_at = delivery.first_attempt_at.unwrap_or(started_at);
        let outcome = if let Some(problem) = &delivery.problem {
            Outcome::Undeliverable {
                error: problem.clone(),
            }
        } else if delivery.message.body.len() > d.max_body {
            Outcome::Undeliverable {
                error: format!(
                    "the body is {} bytes, over --max-body {}",
                    delivery.message.body.len(),
                    d.max_body
                ),
            }
        } else {
            let envelope = Envelope {
                message: &delivery.message,
                queue: &d.queue,
                attempt: delivery.attempt,
            };
            self.m.in_flight.inc();
            let clock = Instant::now();
            let outcome = d.forwarder.deliver(&envelope, policy.timeout).await;
            self.m.in_flight.dec();
            self.m.duration.observe(clock.elapsed().as_secs_f64());
            outcome
        };
        let latency = started_at.elapsed().unwrap_or_default();
        let jitter = rand::random::<f64>();
        let mut decision = decide(&policy, &outcome, delivery.attempt, jitter);
        self.limiter.observe(Signal::from_class(
            decision.class,
            outcome.status(),
            latency,
        ));
        self.show_limit();
        let app_health = gate::Health::from_class(decision.class, outcome.status());
        if let Some(health) = app_health {
            self.gate_changed(self.gate.report(health));
        }
        // The app is down, not this message: while the gate is closed a
        // failure uses up no attempt, so an outage dead-letters nothing.
        if self.gate.is_closed()
            && matches!(
                app_health,
                Some(gate::Health::Failing | gate::Health::Unreachable)
            )
        {
            decision.verdict = Verdict::Retry {
                delay: policy.jittered_backoff(delivery.attempt, jitter),
                attempt_used: false,
            };
        }
        if let Some(counter) = self.m.delivery(decision.class.as_str()) {
            counter.inc();
        }
        if let Outcome::Answered {
            status,
            retry_after,
            retry_after_invalid,
            ..
        } = &outcome
        {
            if !self.gate.is_closed() {
                self.m.app_up.set(1);
            }
            if *retry_after_invalid {
                self.m.retry_after_invalid.inc();
            }
            if *status == 429
                && policy.retry_after.honor
                && let Some(wait) = retry_after
            {
                let until = Instant::now() + (*wait).min(policy.retry_after.max);
                let mut hold = self.hold_until.lock().unwrap_or_else(|e| e.into_inner());
                if hold.is_none_or(|t| t < until) {
                    *hold = Some(until);
                }
            }
        }
        let id = delivery.message.id.as_str();
        let settled = match decision.verdict {
            Verdict::Ack => {
                if let Some(window) = d.dedup_window {
                    let key = Envelope {
                        message: &delivery.message,
                        queue: &d.queue,
                        attempt: delivery.attempt,
                    }
                    .idempotency_key();
                    if let Err(e) = d.source.remember_ack(&key, window).await {
                        tracing::warn!(id, error = %e, "could not remember the ack for deduplication");
                    }
                }
                let r = d.source.ack(&delivery).await;
                if r.is_ok() {
                    self.m.acks.inc();
                    tracing::debug!(id, attempt = delivery.attempt, "acked");
                }
                r
            }
            Verdict::Retry {
                delay,
                attempt_used,
            } => {
                let next = if attempt_used {
                    delivery.attempt + 1
                } else {
                    delivery.attempt
                };
                let r = d
                    .source
                    .retry(&delivery, next, first_attempt_at, SystemTime::now() + delay)
                    .await;
                if r.is_ok() {
                    self.m.retries.inc();
                    tracing::info!(
                        id,
                        attempt = delivery.attempt,
                        result = decision.class.as_str(),
                        status = outcome.status(),
                        error = outcome.error(),
                        delay = ?delay,
                        "retry scheduled"
                    );
                }
                r
            }
            Verdict::DeadLetter { reason } => {
                let failure = Failure {
                    reason,
                    status: outcome.status(),
                    error: outcome.error(),
                    attempts: delivery.attempt,
                    first_attempt_at,
                    last_attempt_at: started_at,
                    queue: d.queue.clone(),
                    message_id: delivery.message.id.clone(),
                    excerpt: outcome.excerpt(),
                    policy: policy.label(),
                    dead_letter_queue: policy.dead_letter_queue_for(&d.queue),
                };
                let r = d.source.dead_letter(&delivery, &failure).await;
                if r.is_ok() {
                    if let Some(counter) = self.m.dead_letter(reason.as_str()) {
                        counter.inc();
                    }
                    tracing::warn!(
                        id,
                        attempt = delivery.attempt,
                        reason = reason.as_str(),
                        status = outcome.status(),
                        error = outcome.error(),
                        dead_letter_queue = %failure.dead_letter_queue,
                        "dead-lettered"
                    );
                }
                r
            }
        };
        if let Err(e) = settled {
            self.m.settle_errors.inc();
            tracing::error!(id, error = %e, "settling failed; the broker will hand the message out again");
        }
    }
}
