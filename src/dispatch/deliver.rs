//! One delivery, start to end: offer the message to the app, judge the
//! outcome (the gate, the limit and the hold learn from it, then the policy
//! decides with the gate's state as an input), settle it with the broker.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::Uri;
use tokio::time::Instant;

use super::gate::Evidence;
use super::limit::{Signal, Slot};
use super::{Shared, Traces};
use crate::forward::{Envelope, TraceHeaders};
use crate::model::{Class, DeadLetterReason, Delivery, Failure, Outcome};
use crate::policy::{Decision, Policy, Routed, Verdict, decide};
use crate::source::{ErrorKind, Settlement, SourceError};
use crate::telemetry::traces;

impl Shared {
    /// `slot` is the delivery's place among those with the app: given up
    /// once the app has answered, for a place among the settlements under
    /// way ([`Shared::settling`]), so the next message goes to the app while
    /// this one is settled; kept to the end under a dedup window.
    pub(super) async fn deliver(&self, delivery: Arc<Delivery>, slot: Option<Slot>) {
        self.m.received.inc();
        if self.d.dedup_window.is_some()
            && delivery.problem.is_none()
            && self.already_acked(&delivery).await
        {
            return;
        }
        let policy = self.d.policy.current();
        if let Some(age) = self.expired(&delivery, &policy) {
            self.dead_letter_expired(&delivery, &policy, age).await;
            return;
        }
        let Some(path) = self.route(&delivery, &policy).await else {
            return;
        };
        let _in_flight = self.in_flight.register(&delivery);
        self.await_turn(&policy).await;
        // A pause that came while this delivery waited for its turn.
        if self.defer_if_held(&delivery).await {
            return;
        }
        let started_at = SystemTime::now();
        let clock = Instant::now();
        // Without the trace export, one check of an Option and no span.
        let span = self
            .d
            .traces
            .as_ref()
            .map(|traces| self.span(traces, &delivery));
        let trace = span.as_ref().and_then(|(_, headers)| headers.as_ref());
        let outcome = self.offer(&delivery, &policy, trace, path).await;
        let decision = self
            .judge(&outcome, &policy, delivery.attempt, clock.elapsed())
            .await;
        if let Some((span, _)) = &span {
            traces::record_result(span, decision.class.as_str(), outcome.status());
        }
        // Only an answer frees the slot early: after a timeout or a lost
        // connection the app may still be working on the message, and the
        // next one would pile up on it (brokers
        // `chaos::embedded_slow_app_gets_no_pile_up` saw 6 at once at
        // --concurrency 4). Under a dedup window the slot is kept too: the
        // next delivery's check must find this one's ack (at
        // `--concurrency 1`, a duplicate right behind the original is
        // dropped, not offered).
        let answered = outcome.status().is_some();
        let (_slot, _settling) = match slot {
            Some(slot) if answered && self.d.dedup_window.is_none() => {
                (None, Some(self.settling(slot).await))
            }
            slot => (slot, None),
        };
        self.settle(&delivery, &outcome, &decision, &policy, started_at)
            .await;
    }

    /// Trades the app's slot for one of `--concurrency` places among the
    /// settlements under way. A broker that batches its acks (Pub/Sub's
    /// `Acknowledge`, Redis's pipeline) writes the next batch while the app
    /// already has the next messages, instead of holding every slot on the
    /// write before it: at db32ef3 a Pub/Sub delivery held its slot through
    /// an ack of 8.7 ids on average, and throughput stayed under the bare
    /// loop's, which acks 16 at a time. The bound keeps what is read and
    /// not yet settled within twice `--concurrency`; the slot is held until
    /// a place is free, so a broker slow to settle slows the reads too.
    async fn settling(&self, slot: Slot) -> tokio::sync::OwnedSemaphorePermit {
        let permit = self
            .settling
            .clone()
            .acquire_owned()
            .await
            .expect("the settling semaphore is never closed");
        drop(slot);
        permit
    }

    /// The span of this attempt, a child of the producer's trace context,
    /// and the headers that make it the parent of the app's span.
    fn span(&self, traces: &Traces, delivery: &Delivery) -> (tracing::Span, Option<TraceHeaders>) {
        let message = &delivery.message;
        let attempt = traces::Attempt {
            system: traces.system,
            queue: &self.d.queue,
            group: &traces.group,
            message_id: &message.id,
            attempt: delivery.attempt,
            body_size: message.body.len(),
        };
        let (span, propagation) = traces::attempt_span(&attempt, &message.headers);
        let headers = propagation.traceparent.map(|traceparent| TraceHeaders {
            traceparent,
            tracestate: propagation.tracestate,
        });
        (span, headers)
    }

    fn idempotency_key(&self, delivery: &Delivery) -> String {
        self.d.forwarder.idempotency_key(&Envelope {
            message: &delivery.message,
            queue: &self.queue,
            attempt: delivery.attempt,
            replay_count: delivery.replay_count,
            trace: None,
            path: None,
        })
    }

    /// Offers the message to the app, unless it cannot be offered at all;
    /// `trace` replaces the message's own trace context, `path` the app
    /// URL's path.
    pub(super) async fn offer(
        &self,
        delivery: &Delivery,
        policy: &Policy,
        trace: Option<&TraceHeaders>,
        path: Option<&Uri>,
    ) -> Outcome {
        if let Some(problem) = &delivery.problem {
            return Outcome::Undeliverable {
                error: problem.clone(),
            };
        }
        let size = delivery.message.body.len();
        if size > self.d.max_body {
            return Outcome::Undeliverable {
                error: format!(
                    "the body is {size} bytes, over --max-body {}",
                    self.d.max_body
                ),
            };
        }
        let envelope = Envelope {
            message: &delivery.message,
            queue: &self.queue,
            attempt: delivery.attempt,
            replay_count: delivery.replay_count,
            trace,
            path,
        };
        // A guard, so that a delivery that panics does not stay counted.
        let in_flight = scopeguard(&self.m.in_flight);
        let clock = Instant::now();
        let outcome = self.d.forwarder.deliver(&envelope, policy.timeout).await;
        drop(in_flight);
        self.m.duration.observe(clock.elapsed().as_secs_f64());
        outcome
    }

    /// What the outcome means. The gate, the limit and the Retry-After hold
    /// learn from it first, so the decision sees the gate as it is now.
    pub(super) async fn judge(
        &self,
        outcome: &Outcome,
        policy: &Policy,
        attempt: u32,
        latency: Duration,
    ) -> Decision {
        self.learn(outcome, policy, latency).await;
        let decision = decide(policy, outcome, attempt, self.gate.state(), rand::random());
        if let Outcome::Answered {
            status, directives, ..
        } = outcome
            && policy.app_directives
        {
            if let Some(value) = &directives.retry_unknown {
                tracing::warn!(
                    status,
                    value,
                    "the app answered Courier-Retry with a value other than never; ignored"
                );
            }
            if decision.class == Class::Success
                && (directives.dead_letter.is_some() || directives.retry_never)
            {
                tracing::warn!(
                    status,
                    reason = directives.dead_letter,
                    "the app answered 2xx with Courier-Dead-Letter or Courier-Retry: never; a 2xx is an ack, so the message was acked"
                );
            }
        }
        if let Some(counter) = self.m.delivery(decision.class.as_str()) {
            counter.inc();
        }
        decision
    }

    /// The gate, the limit and the Retry-After hold learn from an answer
    /// of the app's (to one message or to a batch).
    pub(super) async fn learn(&self, outcome: &Outcome, policy: &Policy, latency: Duration) {
        let class = policy.classify(outcome);
        if let Some(evidence) = Evidence::from_outcome(class, outcome) {
            self.report(evidence).await;
        }
        self.limiter
            .observe(Signal::from_class(class, outcome.status(), latency));
        self.show_limit();
        self.hold.observe(policy, outcome);
        if let Outcome::Answered {
            retry_after_invalid,
            ..
        } = outcome
        {
            if *retry_after_invalid {
                self.m.retry_after_invalid.inc();
            }
            if !self.gate.is_closed() {
                self.m.app_up.set(1);
            }
        }
    }

    /// Settles the delivery as decided. A settlement the broker refuses
    /// leaves the message with the broker, which hands it out again.
    pub(super) async fn settle(
        &self,
        delivery: &Delivery,
        outcome: &Outcome,
        decision: &Decision,
        policy: &Policy,
        started_at: SystemTime,
    ) {
        self.settle_noting(delivery, outcome, decision, policy, started_at, None)
            .await;
    }

    /// [`Shared::settle`], a dead letter recording `directive` as what the
    /// app said (a batch entry's `drop`) in place of the answer's headers.
    pub(super) async fn settle_noting(
        &self,
        delivery: &Delivery,
        outcome: &Outcome,
        decision: &Decision,
        policy: &Policy,
        started_at: SystemTime,
        directive: Option<&str>,
    ) {
        let first_attempt_at = delivery.first_attempt_at.unwrap_or(started_at);
        let failure = |reason| Failure {
            reason,
            status: outcome.status(),
            error: outcome.error(),
            attempts: delivery.attempt,
            first_attempt_at,
            last_attempt_at: started_at,
            queue: self.d.queue.clone(),
            message_id: delivery.message.id.clone(),
            excerpt: outcome.excerpt(),
            policy: policy.label(),
            dead_letter_queue: policy.dead_letter_queue_for(&self.d.queue),
            app_directive: directive
                .map(str::to_string)
                .or_else(|| policy.directive_in_force(outcome)),
            cut: None,
        };
        let (settled, what) = match decision.verdict {
            Verdict::Ack => (self.ack(delivery).await, "ack"),
            Verdict::Retry {
                delay,
                attempt_used,
            } => {
                let next = delivery.attempt + u32::from(attempt_used);
                let at = SystemTime::now() + delay;
                let retry = Settlement::Retry {
                    next_attempt: next,
                    first_attempt_at,
                    at,
                };
                let r = self.d.source.settle(delivery, retry).await;
                if r.is_ok() {
                    self.m.retries.inc();
                    tracing::info!(id = %delivery.message.id, attempt = delivery.attempt, result = decision.class.as_str(),
                        status = outcome.status(), error = outcome.error(), delay = ?delay, attempt_used, "retry scheduled");
                }
                (r, "retry copy")
            }
            Verdict::DeadLetter { reason } => (
                self.dead_letter(delivery, &failure(reason), reason).await,
                "dead letter",
            ),
        };
        // A copy over the broker's limit would be refused on every
        // redelivery, holding a Kafka offset or a FIFO group for good: the
        // message is dead-lettered at once as a letter that fits.
        let settled = match settled {
            Err(e) if e.kind() == ErrorKind::TooLarge => {
                let reason = DeadLetterReason::Undeliverable;
                let cut = Failure {
                    cut: Some(cut_note(delivery, what, &e)),
                    ..failure(reason)
                };
                self.dead_letter(delivery, &cut, reason).await
            }
            other => other,
        };
        if let Err(e) = settled {
            self.m.settle_errors.inc();
            tracing::error!(id = %delivery.message.id, error = %e, "settling failed; the broker will hand the message out again");
        }
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), SourceError> {
        if let Some(window) = self.d.dedup_window {
            let key = self.idempotency_key(delivery);
            if let Err(e) = self.d.source.remember_ack(&key, window).await {
                tracing::warn!(id = %delivery.message.id, error = %e, "could not remember the ack for deduplication");
            }
        }
        self.d.source.settle(delivery, Settlement::Ack).await?;
        self.m.acks.inc();
        tracing::debug!(id = %delivery.message.id, attempt = delivery.attempt, "acked");
        Ok(())
    }

    async fn dead_letter(
        &self,
        delivery: &Delivery,
        failure: &Failure,
        reason: DeadLetterReason,
    ) -> Result<(), SourceError> {
        self.d
            .source
            .settle(delivery, Settlement::DeadLetter(failure))
            .await?;
        if let Some(counter) = self.m.dead_letter(reason.as_str()) {
            counter.inc();
        }
        tracing::warn!(
            id = %delivery.message.id,
            attempt = delivery.attempt,
            reason = reason.as_str(),
            status = failure.status,
            error = failure.error,
            dead_letter_queue = %failure.dead_letter_queue,
            "dead-lettered"
        );
        Ok(())
    }

    /// A delivery panicked (a bug of courier's, or of a library's, on this
    /// message): dead-lettered as undeliverable with the panic's message,
    /// so it neither waits unsettled for the broker's redelivery (a Kafka
    /// offset held open, a FIFO group kept busy) nor panics again on every
    /// redelivery. An operator can replay it once courier is fixed.
    pub(super) async fn after_panic(&self, delivery: &Delivery, what: String) {
        let outcome = Outcome::Undeliverable {
            error: format!(
                "courier failed while delivering it (a panic: {what}); replay it once courier is fixed"
            ),
        };
        let policy = self.d.policy.current();
        let decision = Decision {
            class: Class::Undeliverable,
            verdict: Verdict::DeadLetter {
                reason: DeadLetterReason::Undeliverable,
            },
        };
        self.settle(delivery, &outcome, &decision, &policy, SystemTime::now())
            .await;
    }

    /// The message's age when it is older than the policy's `maxAge`: from
    /// when it entered the queue (the broker's time, carried across
    /// re-stores), else from its first attempt.
    pub(super) fn expired(&self, delivery: &Delivery, policy: &Policy) -> Option<Duration> {
        let max_age = policy.max_age?;
        let since = match (delivery.enqueued_at, delivery.first_attempt_at) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        let age = SystemTime::now().duration_since(since).ok()?;
        (age > max_age).then_some(age)
    }

    /// Dead-letters a message older than `maxAge` as `expired`, unoffered.
    pub(super) async fn dead_letter_expired(
        &self,
        delivery: &Delivery,
        policy: &Policy,
        age: Duration,
    ) {
        let max_age = policy.max_age.unwrap_or_default();
        let error = format!(
            "the message is {} old, older than the policy's maxAge {}; it was not offered to the app",
            crate::duration::format(Duration::from_secs(age.as_secs())),
            crate::duration::format(max_age)
        );
        self.dead_letter_unoffered(delivery, policy, DeadLetterReason::Expired, error)
            .await;
    }

    /// Dead-letters a message that was not offered to the app, for `reason`.
    async fn dead_letter_unoffered(
        &self,
        delivery: &Delivery,
        policy: &Policy,
        reason: DeadLetterReason,
        error: String,
    ) {
        let outcome = Outcome::Undeliverable { error };
        let decision = Decision {
            class: Class::Undeliverable,
            verdict: Verdict::DeadLetter { reason },
        };
        self.settle(delivery, &outcome, &decision, policy, SystemTime::now())
            .await;
    }

    /// Where the policy's routes send this delivery: `Some(path)` to offer
    /// it there (`Some(None)`: the app URL's own path); `None` when no
    /// route matched and it was settled unoffered, acked or dead-lettered
    /// as `unrouted`, as the policy's `unrouted` says. A message that
    /// cannot be offered at all (too large, unreadable) is not looked at:
    /// `offer` dead-letters it.
    pub(super) async fn route<'p>(
        &self,
        delivery: &Delivery,
        policy: &'p Policy,
    ) -> Option<Option<&'p Uri>> {
        if policy.routes.is_empty()
            || delivery.problem.is_some()
            || delivery.message.body.len() > self.d.max_body
        {
            return Some(None);
        }
        let choice = policy.route(&delivery.message, &self.d.queue, delivery.attempt);
        if choice.errors > 0 {
            self.m.route_errors.inc_by(u64::from(choice.errors));
        }
        if choice.unmatched {
            self.m.unrouted.inc();
        }
        match choice.routed {
            Routed::Path(path) => Some(Some(path)),
            Routed::Default => Some(None),
            Routed::Ack => {
                if self.ack_unoffered(delivery).await {
                    self.m.filtered.inc();
                }
                None
            }
            Routed::DeadLetter => {
                let error = format!(
                    "none of the policy's {} routes matched the message, and its unrouted is dead-letter; it was not offered to the app",
                    policy.routes.len()
                );
                self.dead_letter_unoffered(delivery, policy, DeadLetterReason::Unrouted, error)
                    .await;
                None
            }
        }
    }

    /// A redelivery of a message acked within the window: ack it again
    /// without offering it to the app.
    pub(super) async fn already_acked(&self, delivery: &Delivery) -> bool {
        let key = self.idempotency_key(delivery);
        match self.d.source.was_acked(&key).await {
            Ok(true) => {}
            Ok(false) => return false,
            Err(e) => {
                tracing::warn!(error = %e, "deduplication check failed; delivering");
                return false;
            }
        }
        if self.ack_unoffered(delivery).await {
            self.m.dedup_hits.inc();
            tracing::debug!(id = %delivery.message.id, %key, "already acked within the dedup window; acked again without delivery");
        }
        true
    }

    /// Acks a delivery that is not offered to the app; whether the broker
    /// took the ack (else it hands the message out again).
    async fn ack_unoffered(&self, delivery: &Delivery) -> bool {
        match self.d.source.settle(delivery, Settlement::Ack).await {
            Ok(()) => {
                self.m.acks.inc();
                true
            }
            Err(e) => {
                self.m.settle_errors.inc();
                tracing::error!(id = %delivery.message.id, error = %e, "settling failed; the broker will hand the message out again");
                false
            }
        }
    }
}

/// What a panic said, when it said it as text.
pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into())
}

/// Increments `gauge` now and decrements it when dropped, on a panic too.
pub(super) fn scopeguard(gauge: &prometheus_client::metrics::gauge::Gauge) -> impl Drop + '_ {
    struct Counted<'a>(&'a prometheus_client::metrics::gauge::Gauge);
    impl Drop for Counted<'_> {
        fn drop(&mut self) {
            self.0.dec();
        }
    }
    gauge.inc();
    Counted(gauge)
}

/// What a letter that fits says it left out, and why.
fn cut_note(delivery: &Delivery, what: &str, refusal: &SourceError) -> String {
    format!(
        "the body ({} bytes) and {} producer headers are left out: the {what} was refused as too large ({refusal})",
        delivery.message.body.len(),
        delivery.message.headers.len()
    )
}
