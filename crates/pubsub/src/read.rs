//! Reads: unary pulls from the retry and the work subscription, a lease at
//! receipt, and admitting a message (its attempt, a poison pill, a copy
//! not yet due).
//!
//! The attempt of a copy is deterministic because a copy is held at most
//! once: `courier-attempt` + max(0, `delivery_attempt` − 1 − held), where
//! held is 1 when the copy's due time is later than its publish time
//! (courier's reader receives it at once and holds it), else 0.

use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::ReceivedMessage;

use super::connection::{MAX_HOLD_SECS, MIN_LEASE_SECS};
use super::fields::{from_message, publish_time};
use super::{PubSubSource, Sub, lock, work_in_flight};
use courier_core::model::{Delivery, F_ATTEMPT, F_FIRST_ATTEMPT_AT, parse_time, rfc3339};
use courier_core::source::SourceError;
use courier_core::source::shared::{F_RETRY_AT, HELD_WAIT, RECEIVE_WAIT, field, replace};
use tokio::time::Instant;

/// How often an empty queue is asked again within one receive, while
/// deliveries are in flight (one may store a retry copy at any moment).
const POLL: Duration = Duration::from_millis(50);
/// On the emulator, while a backlog waits, a pull of the work subscription
/// waits this long at most for what was pulled before to be settled. The
/// emulator's pull copies the subscription's whole undelivered set whenever
/// any of its messages is leased (`MessageBacklog.updateExpiredAckDeadlines`),
/// so a pull beside deliveries in flight cost it time in proportion to the
/// backlog: at 100,000 messages courier drained at a fifth of the rate of a
/// loop that pulls only once everything it had is acked.
pub const EMULATOR_SETTLE_WAIT: Duration = Duration::from_millis(50);
/// The retry subscription is looked at this often, besides when a copy
/// this process stored or held falls due and while looks bring copies
/// back: for copies of other replicas that stopped.
const RETRY_LOOK: Duration = Duration::from_secs(10);
/// How long after a known copy's due time the retry subscription is still
/// asked every [`POLL`] while it has not come back: Pub/Sub hands a held
/// message out again when its lease ends, a moment after.
const RETRY_GRACE: Duration = Duration::from_secs(5);
/// Due times of copies the reader keeps, at most; one over it is found by
/// the look every [`RETRY_LOOK`].
pub(super) const MOST_DUE: usize = 4096;
/// The shortest wait a held pull is asked for.
const SHORTEST_HOLD: Duration = Duration::from_secs(1);
/// How much later than the wait it is meant for a resting reader's held
/// pull has its deadline. The emulator answers a held pull empty a second
/// before its deadline (measured: 1.5 s answered at 0.5 s, 3 s at 2.0 s,
/// 10 s at 9.0 s, 30 s at 29.0 s, none at 89 s), so a deadline of
/// [`HELD_WAIT`] had it asked again every 2 s, a third more often than a
/// wait of `HELD_WAIT` needs; a message published meanwhile is answered
/// at once all the same. Only for the rest's own wait: a pull held until a
/// copy falls due keeps the due time as its deadline, since a service that
/// holds a pull to its deadline would look at the copy a second late.
const ANSWER_MARGIN: Duration = Duration::from_secs(1);
/// How often a busy reader that watches for copies an earlier process held
/// looks at the retry subscription ([`Watch`]); an idle one holds a pull on
/// it instead.
const WATCH_LOOK: Duration = Duration::from_millis(500);

/// Whether the reader watches the retry subscription for copies an
/// earlier process held: it was killed, and their leases end when it said,
/// which no one here knows. Decided by the first depth count, which tells
/// the copies in the retry subscription from those this process holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Watch {
    /// No depth count yet: watched for, until this time at most (the
    /// longest hold from the start), in case the count is slow to come.
    Unknown(Instant),
    /// Until this time at most (the longest hold from the count): copies
    /// this process does not hold are there.
    On(Instant),
    /// None are, or the watch is over: copies of other processes are
    /// theirs to look for, or found by the look every [`RETRY_LOOK`].
    Off,
}

/// How the reader paces itself between receives.
pub(super) struct Pace {
    /// The last receive found nothing and nothing was in flight: the next
    /// asks only the held pull on the work subscription.
    resting: bool,
    /// The last look at the retry subscription.
    looked: Instant,
    /// The last look brought copies back: the subscription may hold more.
    found: bool,
    /// When copies this process stored or held fall due.
    due: std::collections::BTreeSet<Instant>,
    /// Whether copies an earlier process held are watched for.
    watch: Watch,
}

impl Pace {
    /// The pace of a new reader, whose copies are held `longest_hold` at
    /// most.
    pub(super) fn new(longest_hold: Duration) -> Self {
        let now = Instant::now();
        Self {
            resting: false,
            looked: now,
            // A new reader looks at once: copies may wait from before.
            found: true,
            due: std::collections::BTreeSet::new(),
            watch: Watch::Unknown(now + longest_hold),
        }
    }
}

impl Pace {
    /// When the retry subscription is looked at next: at once after a look
    /// that found copies, else when a known copy falls due or the
    /// heartbeat comes, or, while watching, every [`WATCH_LOOK`].
    fn next_look(&self, now: Instant) -> Instant {
        if self.found {
            return self.looked;
        }
        let heartbeat = if self.watching(now) {
            self.looked + WATCH_LOOK
        } else {
            self.looked + RETRY_LOOK
        };
        self.due
            .first()
            .map_or(heartbeat, |due| heartbeat.min(*due))
    }

    /// Whether copies an earlier process held are watched for now.
    fn watching(&self, now: Instant) -> bool {
        matches!(self.watch, Watch::Unknown(until) | Watch::On(until) if now < until)
    }

    /// A depth count found `unknown` copies in the retry subscription that
    /// this process neither holds nor has with the app: the first count
    /// starts a watch when there are any (for `longest_hold` at most),
    /// and a later one ends it when there are none left; no later count
    /// starts one (another replica's held copies are its own). Whether a
    /// watch started.
    fn counted(&mut self, now: Instant, unknown: u64, longest_hold: Duration) -> bool {
        let first = matches!(self.watch, Watch::Unknown(_));
        self.watch = match self.watch {
            Watch::Unknown(_) if unknown > 0 => Watch::On(now + longest_hold),
            Watch::On(until) if unknown > 0 && now < until => Watch::On(until),
            _ => Watch::Off,
        };
        first && self.watch != Watch::Off
    }

    /// How long a resting reader's held pull may wait: [`HELD_WAIT`], or
    /// until a known copy falls due when that is sooner. Not until the
    /// heartbeat: a look a held pull late costs nothing, but a pull cut to
    /// the time left before it left the work subscription unwatched (a
    /// pull held under [`SHORTEST_HOLD`] is not made: the emulator answers
    /// it at once), and a message arriving then waited for the look.
    fn hold(&self, now: Instant) -> Duration {
        if self.found {
            return Duration::ZERO;
        }
        let due = self
            .due
            .first()
            .map(|due| due.saturating_duration_since(now));
        HELD_WAIT.min(due.unwrap_or(Duration::MAX))
    }

    /// A look at the retry subscription brought `copies` back: what was
    /// due is accounted for (a copy not yet due is held again, and its time
    /// noted again). With none back, a due time is kept for
    /// [`RETRY_GRACE`].
    fn looked_at(&mut self, now: Instant, copies: usize) {
        self.looked = now;
        self.found = copies > 0;
        let done_by = if copies > 0 {
            now
        } else {
            now.checked_sub(RETRY_GRACE).unwrap_or(now)
        };
        self.due.retain(|due| *due > done_by);
    }
}

/// The deadline of a resting reader's held pull meant to wait `hold`
/// ([`Pace::hold`]): [`ANSWER_MARGIN`] more for the rest's own wait, the
/// wait itself when a copy falls due sooner.
fn held_deadline(hold: Duration) -> Duration {
    if hold >= HELD_WAIT {
        HELD_WAIT + ANSWER_MARGIN
    } else {
        hold
    }
}

/// How long before its due time a copy is kept in the process rather than
/// held by its lease: a lease counts whole seconds, and rounded up it made
/// a retry up to a second late.
const KEEP: Duration = Duration::from_secs(1);

/// What a copy not yet due, and how long before its due time, becomes.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Waiting {
    /// Kept in the process until due, then offered: under [`KEEP`] to go.
    Keep,
    /// Held by its lease for this many seconds: the whole seconds to go,
    /// rounded down (never past its due time), at most the longest hold.
    Hold(u64),
    /// Published afresh and the old one acked: it was held once already.
    Renew,
}

/// What a copy `left` before its due time becomes; `may_hold`: it was not
/// held yet ([`holds`]).
pub(super) fn waiting(left: Duration, hold_limit: u64, may_hold: bool) -> Waiting {
    if left < KEEP {
        Waiting::Keep
    } else if may_hold {
        Waiting::Hold(left.as_secs().min(hold_limit))
    } else {
        Waiting::Renew
    }
}

/// What one pulled message becomes.
enum Admitted {
    Deliver(Delivery),
    /// A copy due in under [`KEEP`]: offered at that time.
    Later(Delivery, SystemTime),
    /// A copy not yet due, received for the first time: leased until due.
    Hold {
        ack_id: String,
        secs: u64,
    },
    /// A copy not yet due that was held once already (or cannot be held as
    /// long as it must wait): published afresh with the same due time and
    /// the attempts it has used, the old one acked.
    Renew {
        ack_id: String,
        fields: Vec<(Bytes, Bytes)>,
    },
}

/// The lease a visibility timeout takes, in whole seconds (10 to 600).
pub(super) fn lease_for(visibility: Duration) -> u64 {
    ceil_secs(visibility).clamp(MIN_LEASE_SECS, MAX_HOLD_SECS)
}

/// Whole seconds, rounded up: never early.
pub(super) fn ceil_secs(d: Duration) -> u64 {
    d.as_millis().div_ceil(1000) as u64
}

/// The attempts a copy's deliveries used beyond its record: each delivery
/// Pub/Sub counted (`delivery_attempt`) but the first, less its one hold.
/// 0 when Pub/Sub does not count (no dead-letter policy).
pub(super) fn uncounted_deliveries(delivery_attempt: i32, held: bool) -> u32 {
    let extra = i64::from(delivery_attempt) - 1 - i64::from(held);
    extra.max(0) as u32
}

/// Whether a copy not yet due is held (for its remaining time, at most
/// Pub/Sub's longest lease) rather than renewed: only when it has not been
/// held yet, which is its first delivery when it was due later than its
/// publish. Without Pub/Sub's count every delivery holds.
pub(super) fn holds(delivery_attempt: i32, held: bool) -> bool {
    delivery_attempt <= 0 || (delivery_attempt == 1 && held)
}

impl PubSubSource {
    /// The lease of a message with the app, in whole seconds (10 to 600).
    pub(super) fn lease_secs(&self) -> u64 {
        lease_for(self.live().visibility_timeout)
    }

    /// Up to `max` deliveries. The retry subscription is asked only when a
    /// copy this process knows of falls due (and every [`POLL`] for
    /// [`RETRY_GRACE`] after, until it comes), while looks bring copies
    /// back, or every [`RETRY_LOOK`]: a pull of it on every read was a
    /// second call per read for a queue without retries.
    /// While deliveries are in flight, the work subscription is asked every
    /// [`POLL`]. Once nothing is in flight and nothing came, the reader
    /// rests: a pull on the work subscription that the server holds until
    /// a message comes (up to `HELD_WAIT`, with [`ANSWER_MARGIN`] more as
    /// its deadline). An idle queue then costs a pull every three seconds
    /// or so, not forty a second.
    pub(super) async fn read(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        let max = max.max(1);
        let deadline = Instant::now() + RECEIVE_WAIT;
        loop {
            let now = Instant::now();
            let idle = lock(&self.in_flight).is_empty();
            let (resting, next_look, watching) = {
                let pace = lock(&self.pace);
                let watching = pace.watching(now);
                (
                    idle && pace.resting && !watching,
                    pace.next_look(now),
                    watching,
                )
            };
            let mut out = Vec::new();
            self.hand_out_kept(max, &mut out);
            // Copies first: they were due before anything new. Each pull is
            // sized to what is still free, so nothing is pulled that would
            // have to be given back (a give-back of a copy is a delivery
            // Pub/Sub counts).
            if next_look <= now && out.len() < max {
                let copies = self.client.pull(&self.names.retry, max - out.len()).await?;
                lock(&self.pace).looked_at(now, copies.len());
                self.admit_all(Sub::Retry, copies, &mut out).await;
            }
            let settle_first = self.client.emulator && self.work_backlog.load(Ordering::Relaxed);
            // Copies in hand are not held back for the wait: the work
            // subscription is asked at the next read.
            if out.len() < max && !resting && (out.is_empty() || !settle_first) {
                if settle_first {
                    self.until_work_settled().await;
                }
                let asked = max - out.len();
                let work = self.client.pull(&self.names.work, asked).await?;
                self.work_backlog
                    .store(work.len() >= asked, Ordering::Relaxed);
                self.admit_all(Sub::Work, work, &mut out).await;
            }
            if !out.is_empty() {
                lock(&self.pace).resting = false;
                return Ok(out);
            }
            let hold = lock(&self.pace).hold(Instant::now());
            if idle && watching && hold >= SHORTEST_HOLD {
                // Copies an earlier process held come back any moment: the
                // held pull waits on the retry subscription, a second at
                // most, and the next read asks the work subscription (new
                // work waits that second at most while the watch lasts).
                let copies = self
                    .client
                    .pull_held(&self.names.retry, max, SHORTEST_HOLD)
                    .await?;
                lock(&self.pace).looked_at(Instant::now(), copies.len());
                self.admit_all(Sub::Retry, copies, &mut out).await;
                return Ok(out);
            }
            if idle && !watching && hold >= SHORTEST_HOLD {
                let work = self
                    .client
                    .pull_held(&self.names.work, max, held_deadline(hold))
                    .await?;
                self.admit_all(Sub::Work, work, &mut out).await;
                lock(&self.pace).resting = out.is_empty();
                return Ok(out);
            }
            if Instant::now() >= deadline {
                return Ok(out);
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until no delivery of the work subscription is in flight here,
    /// [`EMULATOR_SETTLE_WAIT`] at most.
    async fn until_work_settled(&self) {
        let settled = self.work_settled.notified();
        tokio::pin!(settled);
        settled.as_mut().enable();
        if !work_in_flight(&lock(&self.in_flight)) {
            return;
        }
        let _ = tokio::time::timeout(EMULATOR_SETTLE_WAIT, settled).await;
    }

    /// A depth count found `copies` in the retry subscription that are not
    /// with the app here; those this process does not hold were held by an
    /// earlier process, or are another replica's ([`Watch`]).
    pub(super) fn counted_copies(&self, copies: u64) {
        let here = lock(&self.holding).len() + lock(&self.kept).len();
        let unknown = copies.saturating_sub(here as u64);
        let longest_hold = Duration::from_secs(self.hold_limit);
        if lock(&self.pace).counted(Instant::now(), unknown, longest_hold) {
            tracing::info!(
                subscription = %self.names.retry,
                copies = unknown,
                "retry copies that this process does not hold are waiting (an earlier one held them and stopped): the retry subscription is watched for them for up to {}s",
                self.hold_limit
            );
        }
    }

    /// A copy is in the retry subscription now or falls due at `at`: the
    /// reader looks there by then.
    pub(super) fn retry_due(&self, at: Instant) {
        let mut pace = lock(&self.pace);
        if pace.due.len() < MOST_DUE {
            pace.due.insert(at);
        }
    }

    /// Leases what was pulled for the visibility timeout, then admits it.
    async fn admit_all(&self, from: Sub, pulled: Vec<ReceivedMessage>, out: &mut Vec<Delivery>) {
        if pulled.is_empty() {
            return;
        }
        let subscription = match from {
            Sub::Work => self.names.work.clone(),
            Sub::Retry => self.names.retry.clone(),
        };
        let max_deliveries = self.live().max_deliveries;
        let mut delivered = Vec::new();
        for received in pulled {
            match self.admit(from, received, max_deliveries) {
                Admitted::Deliver(delivery) => delivered.push(delivery),
                Admitted::Later(delivery, at) => {
                    let left = at.duration_since(SystemTime::now()).unwrap_or_default();
                    self.retry_due(Instant::now() + left);
                    lock(&self.kept).push((at, delivery));
                }
                Admitted::Hold { ack_id, secs } => {
                    self.retry_due(Instant::now() + Duration::from_secs(secs));
                    if let Err(e) = self
                        .client
                        .modify_deadline(&subscription, vec![ack_id], secs)
                        .await
                    {
                        tracing::warn!(error = %e, "a retry copy not yet due could not be held; it is received again after its lease");
                    }
                }
                Admitted::Renew { ack_id, fields } => self.renew(&ack_id, fields).await,
            }
        }
        self.hand_out(from, delivered, out);
    }

    /// Copies kept in the process ([`Waiting::Keep`]) that are due now,
    /// handed out into `out` up to `max` in all.
    fn hand_out_kept(&self, max: usize, out: &mut Vec<Delivery>) {
        let now = SystemTime::now();
        let due: Vec<Delivery> = {
            let mut kept = lock(&self.kept);
            let mut due = Vec::new();
            let mut i = 0;
            while i < kept.len() && out.len() + due.len() < max {
                if kept[i].0 <= now {
                    due.push(kept.swap_remove(i).1);
                } else {
                    i += 1;
                }
            }
            due
        };
        self.hand_out(Sub::Retry, due, out);
    }

    /// Puts `deliveries` of `from` in flight, into `out`, and leases them
    /// for the visibility timeout.
    fn hand_out(&self, from: Sub, deliveries: Vec<Delivery>, out: &mut Vec<Delivery>) {
        if deliveries.is_empty() {
            return;
        }
        let subscription = match from {
            Sub::Work => self.names.work.clone(),
            Sub::Retry => self.names.retry.clone(),
        };
        let mut lease = Vec::new();
        {
            let mut in_flight = lock(&self.in_flight);
            for delivery in deliveries {
                lease.push(delivery.receipt.clone());
                in_flight.insert(delivery.receipt.clone(), from);
                out.push(delivery);
            }
        }
        // A pull leases for the subscription's ack deadline, which may be far
        // from the visibility timeout courier's policy needs. Set beside the
        // deliveries, not before them: waiting for it cost every pull a round
        // trip before its first POST (a drain on the emulator went from 0.67
        // to 0.84-0.99 x the bare loop's throughput without it), and the
        // subscription's ack deadline, 10 s at least, holds the lease
        // meanwhile. An ack or a retry that overtakes it is not undone: the
        // deadline of a message already acked changes nothing. Where the
        // pull's own lease is the one needed (`--create` makes the work
        // subscription with the visibility timeout's lease as its ack
        // deadline), nothing is sent: one call fewer per pull, about a
        // tenth of the emulator's work in a drain.
        let secs = self.lease_secs();
        let leased_by_the_pull = from == Sub::Work && secs == self.work_deadline_secs;
        if leased_by_the_pull {
            return;
        }
        let client = self.client.clone();
        tokio::spawn(async move {
            if let Err(e) = client.modify_deadline(&subscription, lease, secs).await {
                tracing::debug!(error = %e, "the lease at receipt failed; the subscription's ack deadline holds");
            }
        });
    }

    /// Turns a pulled message into a delivery (or, delivered too often, one
    /// to dead-letter without offering it), a hold, or a renewal.
    fn admit(&self, from: Sub, received: ReceivedMessage, max_deliveries: u32) -> Admitted {
        let message = received.message.unwrap_or_default();
        if from == Sub::Retry {
            lock(&self.holding).remove(&message.message_id);
        }
        let publish = publish_time(&message);
        let published = publish.unwrap_or_else(SystemTime::now);
        let delivery_attempt = received.delivery_attempt;
        let fields = self.seal.open(from_message(&message));
        let due = match from {
            Sub::Retry => field(&fields, F_RETRY_AT).and_then(|t| parse_time(t.as_bytes())),
            Sub::Work => None,
        };
        // Courier's reader receives a copy due later than its publish at
        // once and holds it: one delivery that is not an attempt.
        let held = due.is_some_and(|at| at > published);
        let extra = uncounted_deliveries(delivery_attempt, held);
        let now = SystemTime::now();
        let later = due.filter(|at| *at > now);
        if let Some(at) = later {
            let left = at.duration_since(now).unwrap_or_default();
            match waiting(left, self.hold_limit, holds(delivery_attempt, held)) {
                Waiting::Keep => {}
                Waiting::Hold(secs) => {
                    let mut holding = lock(&self.holding);
                    if holding.len() < MOST_DUE {
                        holding.insert(message.message_id.clone());
                    }
                    return Admitted::Hold {
                        ack_id: received.ack_id,
                        secs,
                    };
                }
                Waiting::Renew => {
                    let attempt = field(&fields, F_ATTEMPT)
                        .and_then(|a| a.parse::<u32>().ok())
                        .unwrap_or(1)
                        .saturating_add(extra);
                    return Admitted::Renew {
                        ack_id: received.ack_id,
                        fields: replace(fields, F_ATTEMPT, attempt.to_string()),
                    };
                }
            }
        }
        let mut fields = fields;
        if field(&fields, F_FIRST_ATTEMPT_AT).is_none() && extra > 0 {
            // Offered before, by a replica that did not settle it: the
            // publish is the closest bound known.
            fields.push((F_FIRST_ATTEMPT_AT.into(), Bytes::from(rfc3339(published))));
        }
        let mut delivery =
            Delivery::from_fields(&message.message_id, fields, extra, received.ack_id, publish);
        // A poison pill: every delivery of it (but a copy's hold) ended
        // without a settlement. Pub/Sub's own counter says so.
        let handed_out = (delivery_attempt.max(0) as u32).saturating_sub(u32::from(held));
        if handed_out > max_deliveries {
            delivery.problem = Some(format!(
                "delivered {handed_out} times without being settled (the limit is {max_deliveries}, maxAttempts + 2)"
            ));
        }
        match later {
            Some(at) => Admitted::Later(delivery, at),
            None => Admitted::Deliver(delivery),
        }
    }

    /// Publishes a copy afresh (same due time) and acks the old one: it
    /// came back still not due after its one hold.
    async fn renew(&self, ack_id: &str, fields: Vec<(Bytes, Bytes)>) {
        let fields = self.seal.seal(fields);
        match self.client.publish(&self.names.retry_topic, &fields).await {
            Ok(_) => {
                self.retry_due(Instant::now());
                if let Err(e) = self.retry_acks.submit(ack_id.to_string()).await {
                    tracing::warn!(error = %e, "a retry copy was renewed but the old one not acked: it is received once more");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "a retry copy not yet due could not be renewed; it is received again after its lease");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resting reader that last looked at retries at `looked`.
    fn resting_since(looked: Instant) -> Pace {
        Pace {
            resting: true,
            looked,
            found: false,
            due: Default::default(),
            watch: Watch::Off,
        }
    }

    /// A resting reader looks at retries when a known copy falls due, keeps
    /// looking until one comes back (for the grace at most), and otherwise
    /// every `RETRY_LOOK`.
    #[test]
    fn the_retry_look_follows_the_known_due_times() {
        let start = Instant::now();
        let mut pace = resting_since(start);
        assert_eq!(pace.next_look(start), start + RETRY_LOOK);
        let due = start + Duration::from_secs(2);
        pace.due.insert(due);
        pace.due.insert(start + Duration::from_secs(30));
        assert_eq!(pace.next_look(start), due);
        // Looked at when due, nothing back yet: still due, so asked again.
        pace.looked_at(due, 0);
        assert_eq!(pace.next_look(start), due);
        // Past the grace, given up: the heartbeat from the last look.
        let late = due + RETRY_GRACE + Duration::from_millis(1);
        pace.looked_at(late, 0);
        assert_eq!(pace.next_look(start), late + RETRY_LOOK);
        // A copy back accounts for everything due by then, and the next
        // read looks again: more may wait behind it.
        pace.due.insert(late);
        pace.looked_at(late, 1);
        assert_eq!(pace.due.len(), 1);
        assert_eq!(pace.next_look(start), late);
        // Until a look finds none.
        let after = late + Duration::from_millis(5);
        pace.looked_at(after, 0);
        assert_eq!(pace.next_look(start), after + RETRY_LOOK);
    }

    /// A resting reader's held pull lasts until a known copy falls due,
    /// but not only until the heartbeat.
    #[test]
    fn a_held_pull_waits_for_a_due_copy_but_not_for_the_heartbeat() {
        let start = Instant::now();
        let mut pace = resting_since(start);
        assert_eq!(pace.hold(start), HELD_WAIT);
        let late = start + RETRY_LOOK - Duration::from_millis(200);
        assert_eq!(pace.hold(late), HELD_WAIT);
        pace.due.insert(late + Duration::from_millis(100));
        assert_eq!(pace.hold(late), Duration::from_millis(100));
        pace.looked_at(late, 1);
        assert_eq!(pace.hold(late), Duration::ZERO);
    }

    /// The rest's own wait is asked with a margin, so that a server that
    /// answers a second early (the emulator) still holds it `HELD_WAIT`;
    /// a wait for a due copy ends by its due time.
    #[test]
    fn a_resting_pull_has_a_margin_a_due_copy_none() {
        assert_eq!(held_deadline(HELD_WAIT), HELD_WAIT + ANSWER_MARGIN);
        let due = HELD_WAIT - Duration::from_millis(1);
        assert_eq!(held_deadline(due), due);
        assert_eq!(held_deadline(SHORTEST_HOLD), SHORTEST_HOLD);
    }

    /// The first depth count decides whether copies an earlier process
    /// held are watched for; a later one only ends the watch.
    #[test]
    fn copies_of_an_earlier_process_are_watched_for_a_while() {
        let start = Instant::now();
        let hold = Duration::from_secs(2);
        let mut pace = resting_since(start);
        pace.watch = Watch::Unknown(start + hold);
        // Watched for until the first count says.
        assert!(pace.watching(start));
        assert!(pace.counted(start, 1, hold));
        assert!(pace.watching(start));
        // A look every half second, not every ten.
        assert_eq!(pace.next_look(start), start + WATCH_LOOK);
        // Still some: on, but not past the longest hold.
        assert!(!pace.counted(start + Duration::from_secs(1), 1, hold));
        assert!(pace.watching(start + Duration::from_secs(1)));
        assert!(!pace.watching(start + hold));
        assert_eq!(pace.next_look(start + hold), start + RETRY_LOOK);
        // None left: over, and no later count starts one again.
        assert!(!pace.counted(start + Duration::from_secs(1), 0, hold));
        assert!(!pace.watching(start));
        assert!(!pace.counted(start, 3, hold));
        assert_eq!(pace.watch, Watch::Off);
        // None at the first count: no watch.
        let mut pace = resting_since(start);
        pace.watch = Watch::Unknown(start + hold);
        assert!(!pace.counted(start, 0, hold));
        assert_eq!(pace.watch, Watch::Off);
    }

    /// A copy waits by its lease in whole seconds, never past its due
    /// time, and the last part of a second in the process.
    #[test]
    fn a_copy_waits_by_its_lease_then_in_the_process() {
        let ms = Duration::from_millis;
        assert_eq!(waiting(ms(999), 600, true), Waiting::Keep);
        assert_eq!(waiting(ms(1), 600, false), Waiting::Keep);
        assert_eq!(waiting(ms(1_000), 600, true), Waiting::Hold(1));
        assert_eq!(waiting(ms(4_990), 600, true), Waiting::Hold(4));
        assert_eq!(waiting(ms(4_990), 2, true), Waiting::Hold(2));
        assert_eq!(waiting(ms(3_600_000), 600, true), Waiting::Hold(600));
        // Held once already and still a second or more to go.
        assert_eq!(waiting(ms(4_990), 600, false), Waiting::Renew);
    }

    #[test]
    fn attempts_of_a_copy() {
        // Due later than published: the first delivery is the hold.
        assert_eq!(uncounted_deliveries(1, true), 0);
        assert_eq!(uncounted_deliveries(2, true), 0);
        assert_eq!(uncounted_deliveries(3, true), 1);
        // Due at once (a give-back at a stop): every delivery after the
        // first was a crash.
        assert_eq!(uncounted_deliveries(1, false), 0);
        assert_eq!(uncounted_deliveries(2, false), 1);
        // No dead-letter policy: Pub/Sub counts nothing.
        assert_eq!(uncounted_deliveries(0, true), 0);
        assert_eq!(uncounted_deliveries(0, false), 0);
    }

    #[test]
    fn a_copy_is_held_at_most_once() {
        assert!(holds(1, true));
        // Still not due after its hold: renewed.
        assert!(!holds(2, true));
        assert!(!holds(3, true));
        // Published after its due time (a clock ahead of Pub/Sub's) but not
        // yet due here: renewed, so the count stays exact.
        assert!(!holds(1, false));
        // Pub/Sub counts nothing: held whenever it comes.
        assert!(holds(0, false));
        assert!(holds(0, true));
    }
}
