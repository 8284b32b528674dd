//! Read-ahead. While a backlog drains, a receive that came back full is
//! followed at once by the next one's hand-out, done by the writer while
//! the app works; the next receive takes it here without a round trip to
//! the writer's thread, which was what kept courier's slots idle between
//! reads (about a fifth of the time of a drain).
//!
//! What waits here is handed out in the overlay ([`Overlay::ahead`]) but
//! never written: a crash leaves its rows in `ready`, delivered to nobody.
//! A receive that takes it tells the writer ([`Took`]), which makes it a
//! held lease like any other. What no receive takes soon (a hold, a closed
//! gate, a stop, a slow app) the writer gives back, unread and uncounted.

use std::collections::VecDeque;

use super::*;

/// The longest a hand-out waits here: it is given back after this, or a
/// tenth of the lease's length if shorter, so a receive that takes it
/// late still has most of its lease.
pub(super) const AHEAD_FOR: Duration = Duration::from_secs(1);

/// The bytes of stored messages one read-ahead takes at most. A read-ahead
/// saves a round trip per read, which counts for small messages; one over
/// this is left for the receive itself.
pub(super) const AHEAD_BYTES: usize = 1 << 20;

/// The hand-outs waiting for a source's next receive.
#[derive(Default)]
pub(super) struct Ahead {
    stock: Mutex<Stock>,
}

#[derive(Default)]
struct Stock {
    deliveries: VecDeque<Delivery>,
    /// From then on they are the writer's to give back, no receive's.
    stale_at: Option<Instant>,
}

impl Ahead {
    fn stock(&self) -> std::sync::MutexGuard<'_, Stock> {
        self.stock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Up to `max` of what waits, oldest first, unless it went stale; and
    /// whether nothing is left.
    pub(super) fn take(&self, max: usize) -> (Vec<Delivery>, bool) {
        let mut stock = self.stock();
        if stock.stale_at.is_none_or(|t| Instant::now() >= t) {
            return (Vec::new(), stock.deliveries.is_empty());
        }
        let n = max.min(stock.deliveries.len());
        let taken: Vec<Delivery> = stock.deliveries.drain(..n).collect();
        (taken, stock.deliveries.is_empty())
    }

    pub(super) fn is_empty(&self) -> bool {
        self.stock().deliveries.is_empty()
    }

    /// When what waits goes stale; none while nothing waits.
    pub(super) fn stale_at(&self) -> Option<Instant> {
        let stock = self.stock();
        stock.stale_at.filter(|_| !stock.deliveries.is_empty())
    }

    pub(super) fn fill(&self, deliveries: Vec<Delivery>, stale_at: Instant) {
        let mut stock = self.stock();
        stock.deliveries.extend(deliveries);
        stock.stale_at = Some(stale_at);
    }

    /// Everything that waits, for the writer to give back.
    pub(super) fn drain(&self) -> Vec<Delivery> {
        let mut stock = self.stock();
        stock.stale_at = None;
        stock.deliveries.drain(..).collect()
    }
}

/// Read-ahead hand-outs a receive took: to become held leases.
pub(super) struct Took {
    pub(super) tables: Arc<Tables>,
    pub(super) seqs: Vec<u64>,
}

/// The seq a delivery's receipt names.
pub(super) fn seq_of(delivery: &Delivery) -> Option<u64> {
    parse_receipt(&delivery.receipt).ok().map(|(_, seq)| seq)
}

impl Writer {
    /// Hands out the next read of `tables` ahead of its receive: only while
    /// nothing waits there already, and not while a lease that ran out
    /// waits to be taken back (a write only a receive of the writer's
    /// does: a read-ahead always at hand would leave it waiting for as long
    /// as the backlog lasts) or hand-outs must be durable before they are
    /// answered ([`CAREFUL_FOR`]).
    pub(super) fn fill_ahead(&mut self, tables: &Arc<Tables>, max: usize, terms: &Terms) {
        let now = Instant::now();
        if max == 0 || !tables.ahead.is_empty() || self.careful_until.is_some_and(|t| now < t) {
            return;
        }
        let Ok(tx) = self.db.begin_read() else {
            return;
        };
        let now_ms = now_ms();
        let overlay = overlay_of(&mut self.queues, tables);
        if lease_ran_out(&tx, tables, Some(&overlay.acked_leased), now_ms) {
            return;
        }
        let budget = Budget {
            room: max,
            bytes: AHEAD_BYTES,
            has_one: true,
        };
        // A failed read is left to the next receive, which reports it.
        let Ok(found) = tx
            .open_table(QueueTable::new(&tables.ready))
            .map_err(store_error)
            .and_then(|ready| hand_out(&ready, overlay, terms, now_ms, budget))
        else {
            return;
        };
        if found.is_empty() {
            return;
        }
        for seq in found.iter().filter_map(seq_of) {
            if let Some(held) = overlay.held.remove(&seq) {
                overlay.ahead.insert(seq, held);
            }
        }
        if !overlay.ahead_of.iter().any(|t| Arc::ptr_eq(t, tables)) {
            overlay.ahead_of.push(tables.clone());
        }
        let fresh_for = AHEAD_FOR.min(Duration::from_millis(terms.visibility / 10));
        tables.ahead.fill(found, now + fresh_for);
    }

    /// What receives took from the read-ahead becomes held, to be written
    /// within [`FLUSH_EVERY`] like any hand-out.
    pub(super) fn took(&mut self, took: Vec<Took>, since: Instant) {
        for Took { tables, seqs } in took {
            let overlay = overlay_of(&mut self.queues, &tables);
            for seq in seqs {
                if let Some(held) = overlay.ahead.remove(&seq) {
                    overlay.held.insert(seq, held);
                    self.dirty_since.get_or_insert(since);
                }
            }
        }
    }

    /// Gives back what waits ahead and went stale, what waits for a source
    /// in `missed`, and all of it with `all`.
    pub(super) fn give_back_ahead(&mut self, now: Instant, all: bool, missed: &[Arc<Tables>]) {
        let due: Vec<Arc<Tables>> = self
            .queues
            .values()
            .flat_map(|o| &o.ahead_of)
            .filter(|t| {
                all || missed.iter().any(|m| Arc::ptr_eq(m, t))
                    || t.ahead.stale_at().is_none_or(|at| at <= now)
            })
            .cloned()
            .collect();
        for tables in due {
            self.give_back(&tables);
        }
    }

    /// Gives back what waits in `tables`' read-ahead: its rows are in
    /// `ready`, untouched, for the next receive.
    fn give_back(&mut self, tables: &Arc<Tables>) {
        let overlay = overlay_of(&mut self.queues, tables);
        overlay.ahead_of.retain(|t| !Arc::ptr_eq(t, tables));
        for seq in tables.ahead.drain().iter().filter_map(seq_of) {
            if let Some(held) = overlay.ahead.remove(&seq) {
                overlay.taken.remove(&held.ready_key);
                // The cursor is past its row.
                overlay.cursor = None;
            }
        }
    }

    /// When the read-ahead that goes stale first does.
    pub(super) fn next_stale(&self) -> Option<Instant> {
        self.queues
            .values()
            .flat_map(|o| &o.ahead_of)
            .filter_map(|t| t.ahead.stale_at())
            .min()
    }
}
