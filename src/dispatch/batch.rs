//! Batches: several messages in one POST (`--batch-max-messages`,
//! `--batch-max-wait`; docs/batches.md).
//!
//! The loop reads as the single-message loop does (pause, hold, gate and
//! read failures the same), and sends a batch when `max_messages` are
//! waiting or the oldest has waited `max_wait`. A read stays under way
//! while a batch is formed and sent, so a broker that holds an empty read
//! (NATS, SQS, Pub/Sub) does not hold a partial batch past its wait.
//!
//! A batch is one delivery task holding one concurrency slot. Its messages
//! are grouped by the path the policy's routes give them (a request goes to
//! one path) and cut so that a request stays within about `--max-body`.
//! An answer the app could not give for the whole batch (5xx, 4xx, a
//! timeout, a lost connection) splits it in halves, sent one after the
//! other, until the failing message stands alone: only a message standing
//! alone is judged by the RetryPolicy, so its neighbours use no attempt,
//! and a poison message among N is found within log2(N) + 1 requests.

use std::future::Future;
use std::ops::Range;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::FutureExt;
use futures::future::join_all;
use http::Uri;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::deliver::{panic_message, scopeguard};
use super::deliveries::Deliveries;
use super::limit::Slot;
use super::{DrainReport, Flow, MAX_BATCH, READ_AHEAD_WAIT, Reader, Shared, pause_begins, rate};
use crate::forward::batch::{Batch, BatchEntry, Said, Status, Statuses, entry_size};
use crate::model::{Delivery, Directives, Outcome};
use crate::policy::{EntryAnswer, Policy, decide, decide_entry};
use crate::source::SourceError;

/// How messages are batched; `None` in [`super::DeliverySettings`] is one
/// message per POST.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSettings {
    /// At most this many messages in one POST (2 to [`Self::MAX_MESSAGES`]).
    pub max_messages: usize,
    /// How long a batch that is not full waits for more messages.
    pub max_wait: Duration,
}

impl BatchSettings {
    /// The most messages in one POST: beyond it a request outgrows what
    /// apps read in one go, and a poison message costs more requests.
    pub const MAX_MESSAGES: usize = 1000;
    /// Long enough to gather a burst, short enough not to be felt as
    /// latency by a trickle.
    pub const DEFAULT_MAX_WAIT: Duration = Duration::from_millis(50);

    /// From `--batch-max-messages` and `--batch-max-wait`: `None` for 1
    /// (batches off), an error that says what is allowed for 0 or above
    /// [`Self::MAX_MESSAGES`].
    pub fn from_flags(max_messages: usize, max_wait: Duration) -> Result<Option<Self>, String> {
        match max_messages {
            0 => Err("--batch-max-messages must be at least 1 (1: no batches)".into()),
            1 => Ok(None),
            n if n > Self::MAX_MESSAGES => Err(format!(
                "--batch-max-messages {n} is over the most a batch may hold, {}",
                Self::MAX_MESSAGES
            )),
            n => Ok(Some(Self {
                max_messages: n,
                max_wait,
            })),
        }
    }
}

/// A read from the broker under way while batches form.
type Read = Pin<Box<dyn Future<Output = Result<Vec<Delivery>, SourceError>> + Send>>;

/// The reading side of the batch loop.
#[derive(Default)]
struct Batcher {
    /// Messages read and not yet in a batch, the failures and probes.
    reader: Reader,
    /// When the oldest message waiting in `reader.ahead` was read.
    since: Option<Instant>,
    pending: Option<Read>,
    /// After a failed read, or while the rate limit has no room: no read
    /// before this.
    read_after: Option<Instant>,
}

/// What woke the loop.
enum Woke {
    Stop,
    Again,
    Slot(Slot),
    Read(Result<Vec<Delivery>, SourceError>),
    GiveBack,
}

/// Which entries of a batch are settled, so that after a panic only the
/// others are dead-lettered.
type Settled = [AtomicBool];

impl Shared {
    /// [`Shared::pull_until`] with batches.
    pub(super) async fn pull_batches_until(
        self: &Arc<Self>,
        stop: &CancellationToken,
        settings: BatchSettings,
    ) -> DrainReport {
        let mut deliveries = Deliveries::new();
        let mut batcher = Batcher::default();
        loop {
            match deliveries
                .alongside(self.next_batch(&mut batcher, stop, settings))
                .await
            {
                Flow::Stop => break,
                Flow::Again => {}
                Flow::Launch(slot) => {
                    self.launch_batches(&mut batcher, slot, &mut deliveries, settings)
                }
            }
        }
        deliveries
            .alongside(async {
                self.finish_read(&mut batcher).await;
                self.give_back(&mut batcher.reader.ahead, Instant::now())
                    .await;
            })
            .await;
        self.drain(deliveries).await
    }

    /// One turn of the batch loop: what [`Shared::next`] does before a
    /// read, then send a batch that is full or has waited enough, or wait
    /// for the read under way, starting one where there is room.
    async fn next_batch(
        self: &Arc<Self>,
        b: &mut Batcher,
        stop: &CancellationToken,
        settings: BatchSettings,
    ) -> Flow {
        if stop.is_cancelled() {
            return Flow::Stop;
        }
        // What a read brings while the app is held, down or paused goes
        // back with the rest; a probe must not read beside it.
        if self.is_paused() || self.hold.until().is_some() || self.gate.is_closed() {
            self.finish_read(b).await;
        }
        if let Some(flow) = self.wait_while_paused(&mut b.reader, stop).await {
            return flow;
        }
        if let Some(until) = self.hold.until() {
            self.give_back(&mut b.reader.ahead, until).await;
            tokio::select! {
                _ = stop.cancelled() => return Flow::Stop,
                _ = tokio::time::sleep_until(until) => {}
            }
        }
        if self.gate.is_closed() {
            self.give_back(&mut b.reader.ahead, Instant::now()).await;
            tokio::select! {
                _ = stop.cancelled() => return Flow::Stop,
                _ = tokio::time::sleep(super::gate::probe_delay(b.reader.probes)) => {}
            }
            b.reader.probes += 1;
            self.probe(&mut b.reader).await;
            return Flow::Again;
        }
        b.reader.probes = 0;
        let now = Instant::now();
        let waiting = b.reader.ahead.len();
        if waiting == 0 {
            b.since = None;
        }
        let due = b.since.map(|since| since + settings.max_wait);
        let ready = waiting >= settings.max_messages || due.is_some_and(|due| due <= now);
        if b.pending.is_none() && b.read_after.is_none_or(|at| at <= now) {
            b.read_after = None;
            let room = self.batch_capacity(settings).saturating_sub(waiting);
            if room > 0 {
                match self.read_room() {
                    Ok(allowed) => {
                        let want = room.min(allowed).min(settings.max_messages.max(MAX_BATCH));
                        let source = self.d.source.clone();
                        b.pending = Some(Box::pin(async move { source.receive(want).await }));
                    }
                    Err(wait) => b.read_after = Some(now + wait),
                }
            }
        }
        let give_back_at = b
            .since
            .map(|since| since + READ_AHEAD_WAIT.max(settings.max_wait));
        let read_after = b.read_after;
        let reading = b.pending.is_some();
        let woke = {
            let pending = &mut b.pending;
            tokio::select! {
                _ = stop.cancelled() => Woke::Stop,
                _ = pause_begins(self.d.policy.watch()) => Woke::Again,
                slot = self.limiter.acquire(), if ready => Woke::Slot(slot),
                read = async {
                    match pending.as_mut() {
                        Some(read) => read.await,
                        None => std::future::pending().await,
                    }
                }, if reading => Woke::Read(read),
                _ = sleep_until_some(due), if !ready => Woke::Again,
                _ = sleep_until_some(give_back_at), if ready => Woke::GiveBack,
                _ = sleep_until_some(read_after), if !reading => Woke::Again,
            }
        };
        match woke {
            Woke::Stop => Flow::Stop,
            Woke::Again => Flow::Again,
            Woke::Slot(slot) => Flow::Launch(slot),
            Woke::Read(read) => {
                b.pending = None;
                self.absorb(b, read);
                Flow::Again
            }
            Woke::GiveBack => {
                // No slot came free for a while: another replica should
                // have these.
                self.give_back(&mut b.reader.ahead, Instant::now()).await;
                b.since = None;
                Flow::Again
            }
        }
    }

    /// How many messages may wait read ahead: a batch for each slot of the
    /// limit, within bounds so that a large limit does not hold thousands.
    fn batch_capacity(&self, settings: BatchSettings) -> usize {
        let n = settings.max_messages;
        n.saturating_mul(self.limiter.limit())
            .clamp(n, (2 * n).max(MAX_BATCH))
    }

    /// How many messages the rate limit lets a read ask for now; `Err` is
    /// how long until it lets one.
    fn read_room(&self) -> Result<usize, Duration> {
        let policy = self.d.policy.current();
        let Some(limit) = policy.rate_limit else {
            return Ok(usize::MAX);
        };
        if self.shared_rate(&policy) {
            return Ok(rate::shared_room(&limit));
        }
        self.rate.room(&limit)
    }

    /// Ends the read under way (the source is asked to end its wait) and
    /// keeps what it brought.
    async fn finish_read(&self, b: &mut Batcher) {
        if let Some(read) = b.pending.take() {
            self.d.source.interrupt().await;
            let read = read.await;
            self.absorb(b, read);
        }
    }

    fn absorb(&self, b: &mut Batcher, read: Result<Vec<Delivery>, SourceError>) {
        match self.received(read, &mut b.reader) {
            Some(deliveries) if !deliveries.is_empty() => {
                let now = Instant::now();
                if b.reader.ahead.is_empty() {
                    b.since = Some(now);
                }
                b.reader.ahead.extend(deliveries);
                b.reader.read_at = now;
            }
            Some(_) => {}
            None => b.read_after = Some(Instant::now() + b.reader.retry_wait()),
        }
    }

    /// A batch task per full (or waited-out) batch, as long as slots are
    /// free.
    fn launch_batches(
        self: &Arc<Self>,
        b: &mut Batcher,
        first: Slot,
        deliveries: &mut Deliveries,
        settings: BatchSettings,
    ) {
        let mut slot = Some(first);
        loop {
            let waiting = b.reader.ahead.len();
            if waiting == 0 {
                b.since = None;
                break;
            }
            let due = b
                .since
                .is_some_and(|since| since + settings.max_wait <= Instant::now());
            if waiting < settings.max_messages && !due {
                break;
            }
            let Some(taken) = slot.take().or_else(|| self.limiter.try_acquire()) else {
                break;
            };
            let batch: Vec<Delivery> = b
                .reader
                .ahead
                .drain(..waiting.min(settings.max_messages))
                .collect();
            // What is left came with the last read or before it: its wait
            // counts from that read, near enough.
            b.since = (!b.reader.ahead.is_empty()).then_some(b.reader.read_at);
            let shared = self.clone();
            deliveries.launch(Box::pin(async move {
                shared.deliver_batch_guarded(batch).await;
                drop(taken);
            }));
        }
    }

    /// The gate's probe with a batch app: the message alone, in a batch.
    pub(super) async fn deliver_batch_of_one(&self, delivery: Delivery) {
        self.deliver_batch_guarded(vec![delivery]).await;
    }

    /// [`Shared::deliver_batch`]; a panic dead-letters, as undeliverable,
    /// the entries not settled before it.
    async fn deliver_batch_guarded(&self, batch: Vec<Delivery>) {
        let batch: Vec<Arc<Delivery>> = batch.into_iter().map(Arc::new).collect();
        let settled: Vec<AtomicBool> = batch.iter().map(|_| AtomicBool::new(false)).collect();
        let delivered = AssertUnwindSafe(self.deliver_batch(&batch, &settled))
            .catch_unwind()
            .await;
        if let Err(panic) = delivered {
            let what = panic_message(panic.as_ref());
            for (delivery, settled) in batch.iter().zip(&settled) {
                if !settled.load(Ordering::Relaxed) {
                    self.after_panic(delivery, what.clone()).await;
                }
            }
        }
    }

    /// One batch, start to end: what a single delivery checks first (a
    /// message that cannot be offered, the dedup window, `maxAge`, the
    /// routes), then a request per route path and size, split as the
    /// answers ask.
    async fn deliver_batch(&self, batch: &[Arc<Delivery>], settled: &Settled) {
        let policy = self.d.policy.current();
        let mark = |i: usize| settled[i].store(true, Ordering::Relaxed);
        let mut groups: Vec<(Option<Uri>, Vec<usize>)> = Vec::new();
        for (i, delivery) in batch.iter().enumerate() {
            let message = &delivery.message;
            if delivery.problem.is_some()
                || message.body.len() > self.d.max_body
                || self.d.forwarder.unbatchable(message)
            {
                // Never offered: a single delivery dead-letters it with
                // the reason it cannot be.
                self.deliver(delivery.clone(), None).await;
                mark(i);
                continue;
            }
            self.m.received.inc();
            if self.d.dedup_window.is_some() && self.already_acked(delivery).await {
                mark(i);
                continue;
            }
            if let Some(age) = self.expired(delivery, &policy) {
                self.dead_letter_expired(delivery, &policy, age).await;
                mark(i);
                continue;
            }
            let Some(path) = self.route(delivery, &policy).await else {
                mark(i);
                continue;
            };
            let path = path.cloned();
            match groups.iter_mut().find(|(p, _)| *p == path) {
                Some((_, members)) => members.push(i),
                None => groups.push((path, vec![i])),
            }
        }
        let count = groups.iter().map(|(_, m)| m.len()).sum();
        if count == 0 {
            return;
        }
        let _in_flight: Vec<_> = groups
            .iter()
            .flat_map(|(_, members)| members)
            .map(|&i| self.in_flight.register(&batch[i]))
            .collect();
        self.await_turns(&policy, count).await;
        // A pause or a 429's hold that came while the batch waited for
        // its turn: it goes back unoffered.
        if self.is_paused() || self.hold.until().is_some() {
            for &i in groups.iter().flat_map(|(_, members)| members) {
                self.defer_if_held(&batch[i]).await;
                mark(i);
            }
            return;
        }
        for (path, members) in &groups {
            for request in cut_by_size(members, batch, self.d.max_body) {
                self.offer_batch(batch, &request, path.as_ref(), &policy, settled)
                    .await;
            }
        }
    }

    /// Waits for the turns of `count` messages under the rate limit: a
    /// batch is as many deliveries as it holds messages.
    async fn await_turns(&self, policy: &Policy, count: usize) {
        let Some(limit) = policy.rate_limit else {
            return;
        };
        let shared = self.shared_rate(policy);
        let mut wait = Duration::ZERO;
        for _ in 0..count {
            let turn = if shared {
                match self
                    .d
                    .source
                    .take_shared_token(limit.per_second, limit.burst)
                    .await
                {
                    Ok(turn) => turn,
                    Err(e) => {
                        tracing::warn!(queue = %self.d.queue, error = %e, "the rate limit shared on the broker could not be read; this replica is limited on its own meanwhile");
                        self.rate.take(&limit)
                    }
                }
            } else {
                self.rate.take(&limit)
            };
            wait = wait.max(turn);
        }
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }

    /// Offers the entries `members` of `batch` to `path`, splitting a part
    /// the app fails as a whole until each failing entry stands alone.
    /// Halves go one after the other, first half first, on this task's
    /// one slot.
    async fn offer_batch(
        &self,
        batch: &[Arc<Delivery>],
        members: &[usize],
        path: Option<&Uri>,
        policy: &Policy,
        settled: &Settled,
    ) {
        // A stack of the parts still to send; the whole batch first.
        let mut work: Vec<Range<usize>> = Vec::with_capacity(8);
        work.push(0..members.len());
        while let Some(range) = work.pop() {
            let part = &members[range.clone()];
            let entries: Vec<BatchEntry<'_>> = part
                .iter()
                .map(|&i| BatchEntry {
                    message: &batch[i].message,
                    attempt: batch[i].attempt,
                    replay_count: batch[i].replay_count,
                })
                .collect();
            let request = Batch {
                entries: &entries,
                queue: &self.queue,
                path,
            };
            let started_at = SystemTime::now();
            let clock = Instant::now();
            let in_flight = scopeguard(&self.m.in_flight);
            let answer = self
                .d
                .forwarder
                .deliver_batch(&request, policy.timeout)
                .await;
            drop(in_flight);
            let latency = clock.elapsed();
            self.m.duration.observe(latency.as_secs_f64());
            self.learn(&answer.outcome, policy, latency).await;
            if let Some(statuses) = answer.statuses {
                self.settle_statuses(
                    batch,
                    part,
                    &answer.outcome,
                    statuses,
                    policy,
                    started_at,
                    settled,
                )
                .await;
                continue;
            }
            if part.len() > 1 && self.worth_splitting(&answer.outcome) {
                tracing::debug!(queue = %self.d.queue, entries = part.len(), status = answer.outcome.status(), error = answer.outcome.error(),
                    "the app failed a batch as a whole: splitting it in halves");
                let middle = range.start + range.len() / 2;
                work.push(middle..range.end);
                work.push(range.start..middle);
                continue;
            }
            // Alone, or an answer about the app rather than a message:
            // each entry is judged as a single delivery with that answer.
            let outcome = &answer.outcome;
            join_all(part.iter().map(|&i| async move {
                let delivery = &batch[i];
                let decision = decide(
                    policy,
                    outcome,
                    delivery.attempt,
                    self.gate.state(),
                    rand::random(),
                );
                if let Some(counter) = self.m.delivery(decision.class.as_str()) {
                    counter.inc();
                }
                self.settle(delivery, outcome, &decision, policy, started_at)
                    .await;
                settled[i].store(true, Ordering::Relaxed);
            }))
            .await;
        }
    }

    /// Whether a part the app did not answer 2xx is split: not when the
    /// answer is about the app (unreachable, down by the gate, a 429 or a
    /// Retry-After asking for a pause) or no request could be made;
    /// splitting then would only send more to an app that asked for less.
    fn worth_splitting(&self, outcome: &Outcome) -> bool {
        match outcome {
            Outcome::Unreachable { .. } | Outcome::Undeliverable { .. } => false,
            Outcome::Answered { status: 429, .. }
            | Outcome::Answered {
                retry_after: Some(_),
                ..
            } => false,
            _ => !self.gate.is_closed(),
        }
    }

    /// Settles each entry of a 2xx answer as its status says; an entry not
    /// mentioned is retried.
    #[allow(clippy::too_many_arguments)]
    async fn settle_statuses(
        &self,
        batch: &[Arc<Delivery>],
        part: &[usize],
        outcome: &Outcome,
        statuses: Statuses,
        policy: &Policy,
        started_at: SystemTime,
        settled: &Settled,
    ) {
        let mentioned = statuses.entries.iter().filter(|s| s.is_some()).count();
        if let Some(why) = &statuses.unreadable {
            tracing::warn!(queue = %self.d.queue, entries = part.len(), why = %why,
                "the app's answer to a batch could not be read: every entry is retried");
        } else if mentioned < part.len() || statuses.unknown > 0 || statuses.conflicting > 0 {
            tracing::warn!(queue = %self.d.queue, entries = part.len(), mentioned, unknown = statuses.unknown, conflicting = statuses.conflicting,
                "the app's answer to a batch left entries without a status (not mentioned, or named with statuses that disagree): they are retried");
        }
        let (status, retry_after) = match outcome {
            Outcome::Answered {
                status,
                retry_after,
                ..
            } => (*status, *retry_after),
            _ => (200, None),
        };
        join_all(
            part.iter()
                .zip(statuses.entries)
                .map(|(&i, said)| async move {
                    let delivery = &batch[i];
                    let (answer, excerpt, directive) = match said {
                        Some(Said { status, excerpt }) => match status {
                            Status::Success => (EntryAnswer::Success, excerpt, None),
                            Status::Retry => (EntryAnswer::Retry, excerpt, None),
                            Status::Drop { reason } => (
                                EntryAnswer::Drop,
                                excerpt,
                                Some(match reason {
                                    Some(reason) => format!("drop: {reason}"),
                                    None => "drop".to_string(),
                                }),
                            ),
                        },
                        None => (
                            EntryAnswer::Retry,
                            Bytes::from_static(b"no status for this entry in the app's answer"),
                            None,
                        ),
                    };
                    let decision = decide_entry(
                        policy,
                        answer,
                        delivery.attempt,
                        retry_after,
                        rand::random(),
                    );
                    if let Some(counter) = self.m.delivery(decision.class.as_str()) {
                        counter.inc();
                    }
                    let outcome = Outcome::Answered {
                        status,
                        retry_after: None,
                        retry_after_invalid: false,
                        excerpt,
                        directives: Directives::default(),
                    };
                    self.settle_noting(
                        delivery,
                        &outcome,
                        &decision,
                        policy,
                        started_at,
                        directive.as_deref(),
                    )
                    .await;
                    settled[i].store(true, Ordering::Relaxed);
                }),
        )
        .await;
    }
}

/// Resolves at `at`, never without one.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// `members` cut, in order, into requests of at most about `max_body`
/// bytes each; a message larger than that alone is a request of its own.
fn cut_by_size(members: &[usize], batch: &[Arc<Delivery>], max_body: usize) -> Vec<Vec<usize>> {
    let mut requests = Vec::new();
    let mut current = Vec::new();
    let mut size = 0usize;
    for &i in members {
        let entry = entry_size(&batch[i].message);
        if !current.is_empty() && size + entry > max_body {
            requests.push(std::mem::take(&mut current));
            size = 0;
        }
        current.push(i);
        size += entry;
    }
    if !current.is_empty() {
        requests.push(current);
    }
    requests
}

/// The order in which a batch's parts are offered when every part fails:
/// the ranges of `len` entries, first half first. The poison's way down is
/// one request per level, log2(len) + 1 of them.
#[cfg(test)]
fn split_order(len: usize, fails: impl Fn(Range<usize>) -> bool) -> Vec<Range<usize>> {
    let mut offered = Vec::new();
    let mut work = Vec::with_capacity(8);
    work.push(0..len);
    while let Some(range) = work.pop() {
        offered.push(range.clone());
        if range.len() > 1 && fails(range.clone()) {
            let middle = range.start + range.len() / 2;
            work.push(middle..range.end);
            work.push(range.start..middle);
        }
    }
    offered
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_from_flags() {
        let wait = Duration::from_millis(50);
        assert_eq!(BatchSettings::from_flags(1, wait), Ok(None));
        assert!(BatchSettings::from_flags(0, wait).is_err());
        assert!(BatchSettings::from_flags(1001, wait).is_err());
        assert_eq!(
            BatchSettings::from_flags(1000, wait),
            Ok(Some(BatchSettings {
                max_messages: 1000,
                max_wait: wait
            }))
        );
    }

    /// One poison message among 100 (at each place in turn): the requests
    /// holding it are at most log2(100) + 1 = 8, every other entry is in
    /// exactly one request that succeeds, and the poison stands alone
    /// at the end.
    #[test]
    fn a_poison_message_is_found_within_log2_n_plus_one_requests() {
        for poison in 0..100 {
            let offered = split_order(100, |range| range.contains(&poison));
            let holding: Vec<_> = offered.iter().filter(|r| r.contains(&poison)).collect();
            assert!(holding.len() <= 8, "poison at {poison}: {holding:?}");
            assert_eq!(*holding.last().unwrap(), &(poison..poison + 1));
            for other in (0..100).filter(|&i| i != poison) {
                let succeeded = offered
                    .iter()
                    .filter(|r| r.contains(&other) && !r.contains(&poison))
                    .count();
                assert_eq!(succeeded, 1, "entry {other}, poison at {poison}");
            }
            assert!(offered.len() < 2 * 8, "{}", offered.len());
        }
    }

    #[test]
    fn every_size_splits_down_to_ones_within_the_bound() {
        for len in (1..=130).chain([255, 256, 257, 999, 1000]) {
            let offered = split_order(len, |_| true);
            let depth_bound = (len as f64).log2().ceil() as usize + 1;
            for i in 0..len {
                let holding = offered.iter().filter(|r| r.contains(&i)).count();
                assert!(holding <= depth_bound, "len {len}, entry {i}: {holding}");
            }
            assert_eq!(offered.iter().filter(|r| r.len() == 1).count(), len);
        }
    }

    #[test]
    fn requests_are_cut_by_size() {
        let delivery = |body: usize| {
            Arc::new(Delivery::from_fields(
                "1-0",
                vec![(
                    Bytes::from_static(b"payload"),
                    Bytes::from(vec![b'a'; body]),
                )],
                0,
                String::new(),
                None,
            ))
        };
        let batch: Vec<_> = [100, 100, 5000, 100].into_iter().map(delivery).collect();
        let cut = cut_by_size(&[0, 1, 2, 3], &batch, 1000);
        assert_eq!(cut, vec![vec![0, 1], vec![2], vec![3]]);
        assert_eq!(
            cut_by_size(&[0, 1, 3], &batch, 1 << 20),
            vec![vec![0, 1, 3]]
        );
    }
}
