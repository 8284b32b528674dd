//! What the writer holds in memory beyond what the tables say: hand-outs
//! and acks not yet written, and how they are written.

use super::*;

/// What the writer knows about one queue beyond what its tables say.
pub(super) struct Overlay {
    pub(super) tables: Arc<Tables>,
    /// Handed out from `ready` and not yet settled nor moved to `leased`, by
    /// seq. Their rows are still in `ready`.
    pub(super) held: HashMap<u64, Held>,
    /// Rows of `ready` that are no longer there for new receives: those of
    /// `held`, and those in `acked_ready`.
    pub(super) taken: HashSet<(u64, u64)>,
    /// Rows of `ready` whose message was acked while held: to delete.
    pub(super) acked_ready: Vec<(u64, u64)>,
    /// Rows of `leased` whose message was acked: to delete.
    pub(super) acked_leased: HashSet<(u64, u64)>,
    /// Every row of `ready` up to this key is taken (or deleted), so a
    /// receive reads on from here instead of skipping them all again.
    /// Anything that may store a row below it forgets it.
    pub(super) cursor: Option<(u64, u64)>,
    /// Leases in `leased` that `keep_alive` moved to a later end, by seq:
    /// (the end a receipt names, the end it has now). A receipt names the
    /// lease it was handed out with; this finds where that lease is now.
    pub(super) extended: HashMap<u64, (u64, u64)>,
    /// Rows of `ready` found unfit to hand out (handed out too often, too
    /// big), taken and waiting for the next transaction to dead-letter them.
    pub(super) doomed: Vec<Doomed>,
    /// Handed out ahead of a receive ([`ahead`]), by seq: taken, but not
    /// held, as no receive has them yet. Never written.
    pub(super) ahead: HashMap<u64, Held>,
    /// The sources whose read-ahead holds them.
    pub(super) ahead_of: Vec<Arc<Tables>>,
}

/// A row of `ready` to dead-letter as `undeliverable` instead of handing it
/// out.
pub(super) struct Doomed {
    pub(super) ready_key: (u64, u64),
    pub(super) why: String,
    pub(super) dead_letter_queue: String,
}

/// A message handed out from `ready`, not yet written to `leased`.
pub(super) struct Held {
    pub(super) ready_key: (u64, u64),
    /// The lease's end as the receipt names it.
    pub(super) receipt_until: u64,
    /// The lease's end now: later than the receipt's once kept alive.
    pub(super) until: u64,
    /// What `leased` will hold.
    pub(super) record: LeaseRecord,
}

impl Overlay {
    pub(super) fn new(tables: Arc<Tables>) -> Self {
        Self {
            tables,
            held: HashMap::new(),
            taken: HashSet::new(),
            acked_ready: Vec::new(),
            acked_leased: HashSet::new(),
            cursor: None,
            extended: HashMap::new(),
            doomed: Vec::new(),
            ahead: HashMap::new(),
            ahead_of: Vec::new(),
        }
    }

    /// Nothing here that the tables do not say already.
    pub(super) fn is_clean(&self) -> bool {
        self.held.is_empty()
            && self.acked_ready.is_empty()
            && self.acked_leased.is_empty()
            && self.doomed.is_empty()
    }

    /// The ready row of a held lease that `key` (a receipt) names.
    pub(super) fn held_row(&self, key: (u64, u64)) -> Option<(u64, u64)> {
        self.held
            .get(&key.1)
            .filter(|h| h.receipt_until == key.0)
            .map(|h| h.ready_key)
    }

    /// Where in `leased` the lease a receipt names is now.
    pub(super) fn leased_key(&self, key: (u64, u64)) -> (u64, u64) {
        match self.extended.get(&key.1) {
            Some(&(named, now)) if named == key.0 => (now, key.1),
            _ => key,
        }
    }
}

/// What trying one receive came to.
#[derive(Default)]
pub(super) struct Leased {
    pub(super) deliveries: Vec<Delivery>,
    /// Some were leases that had run out (see [`FLUSH_EVERY`]).
    pub(super) retaken: bool,
}

pub(super) fn overlay_of<'a>(
    queues: &'a mut HashMap<String, Overlay>,
    tables: &Arc<Tables>,
) -> &'a mut Overlay {
    queues
        .entry(tables.ready.clone())
        .or_insert_with(|| Overlay::new(tables.clone()))
}

/// Deletes the rows acks made obsolete.
pub(super) fn write_removals(
    tx: &WriteTransaction,
    overlay: &mut Overlay,
) -> Result<(), SourceError> {
    if !overlay.acked_ready.is_empty() {
        let mut ready = tx
            .open_table(QueueTable::new(&overlay.tables.ready))
            .map_err(store_error)?;
        for row in overlay.acked_ready.drain(..) {
            ready.remove(row).map_err(store_error)?;
            overlay.taken.remove(&row);
        }
    }
    if !overlay.acked_leased.is_empty() {
        let mut leased = tx
            .open_table(QueueTable::new(&overlay.tables.leased))
            .map_err(store_error)?;
        for row in overlay.acked_leased.drain() {
            leased.remove(row).map_err(store_error)?;
        }
    }
    Ok(())
}

/// Dead-letters the rows of `ready` found unfit to hand out; whether there
/// were any.
pub(super) fn write_doomed(
    tx: &WriteTransaction,
    overlay: &mut Overlay,
) -> Result<bool, SourceError> {
    if overlay.doomed.is_empty() {
        return Ok(false);
    }
    let mut ready = tx
        .open_table(QueueTable::new(&overlay.tables.ready))
        .map_err(store_error)?;
    for doomed in std::mem::take(&mut overlay.doomed) {
        overlay.taken.remove(&doomed.ready_key);
        let Some(stored) = ready
            .remove(doomed.ready_key)
            .map_err(store_error)?
            .map(|v| v.value().to_vec())
        else {
            continue;
        };
        let record = undeliverable(
            doomed.ready_key.1,
            &stored,
            &doomed.why,
            &overlay.tables.queue,
            &doomed.dead_letter_queue,
        );
        store_dead_letter(tx, &doomed.dead_letter_queue, &record)?;
    }
    Ok(true)
}

/// Moves the held leases from `ready` to `leased`, with their delivery
/// counted, where a restart finds them.
pub(super) fn write_held(tx: &WriteTransaction, overlay: &mut Overlay) -> Result<(), SourceError> {
    if overlay.held.is_empty() {
        return Ok(());
    }
    let mut ready = tx
        .open_table(QueueTable::new(&overlay.tables.ready))
        .map_err(store_error)?;
    let mut leased = tx
        .open_table(QueueTable::new(&overlay.tables.leased))
        .map_err(store_error)?;
    for (seq, held) in overlay.held.drain() {
        ready.remove(held.ready_key).map_err(store_error)?;
        overlay.taken.remove(&held.ready_key);
        leased
            .insert((held.until, seq), held.record.encode().as_slice())
            .map_err(store_error)?;
        if held.until != held.receipt_until {
            overlay
                .extended
                .insert(seq, (held.receipt_until, held.until));
        }
    }
    Ok(())
}

/// Applies one change inside the batch's transaction; an error aborts the
/// batch.
/// A row is about to be stored in `ready`: a cursor past it must go.
pub(super) fn stored_ready(
    queues: &mut HashMap<String, Overlay>,
    tables: &Tables,
    key: (u64, u64),
) {
    if let Some(overlay) = queues.get_mut(&tables.ready)
        && overlay.cursor.is_some_and(|cursor| cursor >= key)
    {
        overlay.cursor = None;
    }
}

pub(super) fn forget_cursors(queues: &mut HashMap<String, Overlay>) {
    for overlay in queues.values_mut() {
        overlay.cursor = None;
    }
}
