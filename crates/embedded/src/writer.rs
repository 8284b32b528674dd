//! The writer thread: batches calls, commits them as one transaction and
//! serves receives.

use super::*;

pub(super) struct Writer {
    pub(super) db: Arc<Database>,
    pub(super) acks: Arc<PendingAcks>,
    /// Receives that found nothing, oldest first.
    pub(super) waiting: Vec<Lease>,
    /// By `ready` table name.
    pub(super) queues: HashMap<String, Overlay>,
    /// When the first change not yet durable was made (in memory or by a
    /// commit without fsync).
    pub(super) dirty_since: Option<Instant>,
    /// Until then every hand-out is made durable before it is answered:
    /// set for [`CAREFUL_FOR`] when the file was not closed cleanly.
    pub(super) careful_until: Option<Instant>,
}

impl Writer {
    pub(super) fn run(mut self, inbox: mpsc::Receiver<Call>) {
        loop {
            let mut calls = Vec::new();
            let wake = self.next_wake();
            let first = match wake {
                None => inbox.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(at) => inbox.recv_timeout(at.saturating_duration_since(Instant::now())),
            };
            match first {
                Ok(call) => calls.push(call),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            while calls.len() < MAX_BATCH {
                match inbox.try_recv() {
                    Ok(call) => calls.push(call),
                    Err(_) => break,
                }
            }
            self.batch(calls);
        }
        // Every source on the file is gone: nobody waits any more, and what
        // is held in memory is written, durably, before the file closes.
        for lease in self.waiting.drain(..) {
            let _ = lease.reply.send(Ok(Vec::new()));
        }
        let (reply, _) = oneshot::channel();
        let closed = Change::Write {
            work: Some(Box::new(|tx| mark_open(tx, false))),
            durable: true,
            reply,
        };
        let (reply, _) = oneshot::channel();
        self.batch(vec![
            Call::Change(Change::Flush { reply }),
            Call::Change(closed),
        ]);
    }

    pub(super) fn next_wake(&self) -> Option<Instant> {
        // Dirty, the writer wakes at `dirty_since + FLUSH_EVERY` at the
        // latest, before any ack made from now on is due.
        let acks = self.acks.before_wait(self.dirty_since.is_some());
        let flush = self
            .dirty_since
            .into_iter()
            .chain(acks)
            .min()
            .map(|t| t + FLUSH_EVERY);
        if self.queues.values().any(|o| !o.doomed.is_empty()) {
            return Some(Instant::now());
        }
        let lease = self.waiting.iter().map(|l| l.next_try).min();
        flush
            .into_iter()
            .chain(lease)
            .chain(self.next_stale())
            .min()
    }

    /// A transaction, fsynced, that writes everything held in memory: makes
    /// what was committed without fsync durable, and the hand-outs since.
    pub(super) fn commit_durable(&mut self, now: Instant) -> Result<(), SourceError> {
        let tx = self.db.begin_write().map_err(store_error)?;
        let written = self.queues.values_mut().try_for_each(|overlay| {
            write_removals(&tx, overlay)?;
            write_doomed(&tx, overlay)?;
            write_held(&tx, overlay)
        });
        let result = written.and_then(|()| tx.commit().map_err(store_error));
        match &result {
            Ok(()) => self.durable_at(now),
            Err(_) => forget_cursors(&mut self.queues),
        }
        result
    }

    /// After a durable commit, which wrote everything held before it: what
    /// is left in memory was done since.
    pub(super) fn durable_at(&mut self, now: Instant) {
        self.dirty_since = if self.queues.values().all(Overlay::is_clean) {
            None
        } else {
            Some(now)
        };
    }

    /// Everything at hand: acks in memory; one transaction for the changes,
    /// the removals held back, leases that ran out and (when due) the held
    /// leases; then the receives; then depth reads.
    pub(super) fn batch(&mut self, calls: Vec<Call>) {
        let now = Instant::now();
        // A poke only says when the acks it announces must be written; the
        // wake-up for that time is enough, and the next call takes them.
        let pokes_only = !calls.is_empty() && calls.iter().all(|c| matches!(c, Call::Poke));
        if pokes_only && self.acks.since().is_some_and(|t| now < t + FLUSH_EVERY) {
            return;
        }
        if let Some((took, acks, since)) = self.acks.take() {
            self.took(took, since);
            self.ack(acks, since);
        }
        let mut leases = std::mem::take(&mut self.waiting);
        let mut changes = Vec::new();
        let mut depths = Vec::new();
        let mut interrupted = Vec::new();
        let mut fills = Vec::new();
        for call in calls {
            match call {
                Call::Lease(lease) if lease.max == 0 => {
                    let _ = lease.reply.send(Ok(Vec::new()));
                }
                Call::Lease(lease) => leases.push(lease),
                Call::Poke => {}
                Call::Change(change) => changes.push(change),
                Call::Depth { tables, dlq, reply } => depths.push((tables, dlq, reply)),
                Call::Interrupt { tables } => interrupted.push(tables.ready.clone()),
                Call::Fill { tables, max, terms } => fills.push((tables, max, terms)),
            }
        }
        // Before any receive is tried, so it finds those rows: what went
        // stale; what waits for a receive that came here instead (it
        // looked before the read-ahead was made); all of it at a flush,
        // which a stop asks for.
        let closing = changes.iter().any(|c| matches!(c, Change::Flush { .. }));
        let missed: Vec<Arc<Tables>> = leases
            .iter()
            .filter(|l| !l.tables.ahead.is_empty())
            .map(|l| l.tables.clone())
            .collect();
        self.give_back_ahead(now, closing, &missed);
        // Tried now, and answered even when nothing is due.
        for lease in &mut leases {
            if interrupted.contains(&lease.tables.ready) {
                lease.deadline = lease.deadline.min(now);
                lease.next_try = now;
            }
        }
        let flush = self.dirty_since.is_some_and(|t| now >= t + FLUSH_EVERY)
            || changes.iter().any(|c| matches!(c, Change::Flush { .. }))
            || self.queues.values().any(|o| !o.doomed.is_empty());
        let write = flush || !changes.is_empty() || self.must_retake(&leases, now);
        // Waiting receives are tried when their time comes, and after a
        // transaction, which may have made something due.
        let (tried, not_yet): (Vec<_>, Vec<_>) =
            leases.into_iter().partition(|l| write || l.next_try <= now);
        self.waiting = not_yet;
        if write {
            self.write(changes, tried, flush, now);
        } else if !tried.is_empty() {
            let tried = tried.into_iter().map(|l| (l, Leased::default())).collect();
            if let Some(late) = self.serve(tried, now) {
                let result = self.commit_durable(now);
                answer_leases(late, result);
            }
        }
        if !closing {
            for (tables, max, terms) in fills {
                self.fill_ahead(&tables, max, &terms);
            }
        }
        for (tables, dlq, reply) in depths {
            let _ = reply.send(self.depth(&tables, &dlq));
        }
    }

    /// Acks in memory: a held lease's row in `ready`, or a `leased` row, is
    /// marked for removal. An ack for a lease that is no longer held (it ran
    /// out, and a newer delivery will settle the message) changes nothing.
    /// `since`: when the oldest was made, which starts the wait for their
    /// write.
    pub(super) fn ack(&mut self, acks: Vec<Ack>, since: Instant) {
        let mut in_leased = Vec::new();
        let mut changed = false;
        for ack in acks {
            let overlay = overlay_of(&mut self.queues, &ack.tables);
            match overlay.held_row(ack.key) {
                Some(row) => {
                    overlay.held.remove(&ack.key.1);
                    overlay.acked_ready.push(row);
                    changed = true;
                }
                None => {
                    let at = overlay.leased_key(ack.key);
                    in_leased.push((ack, at));
                }
            }
        }
        if !in_leased.is_empty() {
            let stored = self.db.begin_read().map_err(store_error).and_then(|tx| {
                in_leased
                    .iter()
                    .map(|(ack, at)| {
                        let leased = tx
                            .open_table(QueueTable::new(&ack.tables.leased))
                            .map_err(store_error)?;
                        Ok(leased.get(*at).map_err(store_error)?.is_some())
                    })
                    .collect::<Result<Vec<bool>, SourceError>>()
            });
            match stored {
                Ok(stored) => {
                    for ((ack, at), stored) in in_leased.into_iter().zip(stored) {
                        if stored {
                            let overlay = overlay_of(&mut self.queues, &ack.tables);
                            overlay.acked_leased.insert(at);
                            overlay.extended.remove(&ack.key.1);
                            changed = true;
                        }
                    }
                }
                // Its caller heard Ok already: the ack is lost, and the
                // message is delivered again when its lease runs out, as
                // after a crash between the app's answer and the ack.
                Err(e) => tracing::warn!(
                    error = %e,
                    acks = in_leased.len(),
                    "embedded queue: acks of leases in the file could not be checked; their messages will be delivered again"
                ),
            }
        }
        if changed {
            self.dirty_since = Some(self.dirty_since.map_or(since, |t| t.min(since)));
        }
    }

    /// Whether a receive that will be tried finds a lease that ran out,
    /// which takes a transaction to hand out again.
    pub(super) fn must_retake(&self, leases: &[Lease], now: Instant) -> bool {
        let due: Vec<&Lease> = leases.iter().filter(|l| l.next_try <= now).collect();
        if due.is_empty() {
            return false;
        }
        let Ok(tx) = self.db.begin_read() else {
            // The transaction will fail the same way, and say why.
            return true;
        };
        let now_ms = now_ms();
        due.iter().any(|lease| {
            let acked = self
                .queues
                .get(&lease.tables.ready)
                .map(|o| &o.acked_leased);
            lease_ran_out(&tx, &lease.tables, acked, now_ms)
        })
    }

    /// One transaction: the removals held back, `changes`, the leases that
    /// ran out for the receives in `tried`, and with `flush` the held leases
    /// written to `leased` and an fsync. Then the receives are served.
    pub(super) fn write(
        &mut self,
        mut changes: Vec<Change>,
        tried: Vec<Lease>,
        flush: bool,
        now: Instant,
    ) {
        let now_ms = now_ms();
        let tx = match self.db.begin_write() {
            Ok(tx) => tx,
            Err(e) => return fail(changes, tried, store_error(e)),
        };
        let mut outcomes = Vec::with_capacity(changes.len());
        let mut leased = Vec::with_capacity(tried.len());
        let mut durable = flush || changes.iter().any(Change::durable);
        let applied = (|| {
            for overlay in self.queues.values_mut() {
                write_removals(&tx, overlay)?;
                // Dead letters are answered for only once durable.
                durable |= write_doomed(&tx, overlay)?;
            }
            for change in &mut changes {
                outcomes.push(apply(&tx, change, &mut self.queues, now_ms)?);
            }
            for lease in &tried {
                let overlay = overlay_of(&mut self.queues, &lease.tables);
                let l = retake(&tx, lease, overlay, now_ms)?;
                durable |= l.retaken;
                leased.push(l);
            }
            // An fsync is paid anyway: it takes what is held along, and
            // while sends keep coming no flush needs one of its own.
            if durable {
                for overlay in self.queues.values_mut() {
                    write_held(&tx, overlay)?;
                }
            }
            Ok(())
        })();
        if let Err(e) = applied {
            // The overlay may already say what the aborted transaction did;
            // the worst that leaves is a message handed out twice, once the
            // cursors no longer skip rows it still has.
            forget_cursors(&mut self.queues);
            return fail(changes, tried, e);
        }
        // With receives to serve, commit without fsync, serve them, then
        // fsync: a message may so reach the app before its send is durable.
        // That is fine: the send has not returned yet, and a crash takes the
        // message and its hand-out back together.
        let split = durable && !tried.is_empty();
        let mut tx = tx;
        let committed = if durable && !split {
            Ok(())
        } else {
            tx.set_durability(Durability::None).map_err(store_error)
        }
        .and_then(|()| tx.commit().map_err(store_error));
        if let Err(e) = committed {
            forget_cursors(&mut self.queues);
            return fail(changes, tried, e);
        }
        if durable && !split {
            self.durable_at(now);
        } else {
            self.dirty_since.get_or_insert(now);
        }
        let mut changes: Vec<_> = changes.into_iter().zip(outcomes).collect();
        if !split {
            for (change, outcome) in changes.drain(..) {
                change.answer(Ok(outcome));
            }
        } else {
            let (early, late): (Vec<_>, Vec<_>) =
                changes.into_iter().partition(|(c, _)| !c.durable());
            for (change, outcome) in early {
                change.answer(Ok(outcome));
            }
            changes = late;
        }
        let late = self.serve(tried.into_iter().zip(leased).collect(), now);
        let result = if split || late.is_some() {
            self.commit_durable(now)
        } else {
            Ok(())
        };
        for (change, outcome) in changes {
            change.answer(result.clone().map(|()| outcome));
        }
        if let Some(late) = late {
            answer_leases(late, result);
        }
    }

    /// Hands out due messages to the receives in `tried` (which may already
    /// hold leases taken back in the transaction), answers them, keeps those
    /// that found nothing waiting, and returns those that must wait for the
    /// fsync.
    pub(super) fn serve(
        &mut self,
        tried: Vec<(Lease, Leased)>,
        now: Instant,
    ) -> Option<Vec<(Lease, Leased)>> {
        let now_ms = now_ms();
        let tx = match self.db.begin_read() {
            Ok(tx) => tx,
            Err(e) => {
                answer_leases(tried, Err(store_error(e)));
                return None;
            }
        };
        let mut late = Vec::new();
        let mut full = Vec::new();
        for (mut lease, mut leased) in tried {
            let overlay = overlay_of(&mut self.queues, &lease.tables);
            let room = lease.max.saturating_sub(leased.deliveries.len());
            let budget = Budget {
                room,
                bytes: READ_BUDGET
                    .saturating_sub(leased.deliveries.iter().map(|d| d.message.body.len()).sum()),
                has_one: !leased.deliveries.is_empty(),
            };
            let fresh = tx
                .open_table(QueueTable::new(&lease.tables.ready))
                .map_err(store_error)
                .and_then(|ready| hand_out(&ready, overlay, &lease.terms, now_ms, budget));
            match fresh {
                Ok(fresh) if !fresh.is_empty() => {
                    leased.deliveries.extend(fresh);
                    self.dirty_since.get_or_insert(now);
                }
                Ok(_) => {}
                Err(e) => {
                    let _ = lease.reply.send(Err(e));
                    continue;
                }
            }
            if !leased.deliveries.is_empty() {
                if leased.retaken || self.careful_until.is_some_and(|t| now < t) {
                    late.push((lease, leased));
                } else {
                    // Came back full: a backlog waits, and the next read
                    // is handed out now, while the app works on this one.
                    if leased.deliveries.len() == lease.max {
                        full.push((lease.tables.clone(), lease.max, lease.terms.clone()));
                    }
                    let _ = lease.reply.send(Ok(leased.deliveries));
                }
            } else if lease.deadline <= now {
                let _ = lease.reply.send(Ok(Vec::new()));
            } else {
                let due = next_due(&tx, overlay).ok().flatten().map(|due| {
                    let wait = due.saturating_sub(now_ms).max(1);
                    now + Duration::from_millis(wait)
                });
                lease.next_try = due
                    .unwrap_or(lease.deadline)
                    .min(lease.deadline)
                    .min(now + FALLBACK_POLL);
                self.waiting.push(lease);
            }
        }
        drop(tx);
        for (tables, max, terms) in full {
            self.fill_ahead(&tables, max, &terms);
        }
        (!late.is_empty()).then_some(late)
    }
}

/// Whether `leased` holds a lease that ran out by `now_ms` and was not
/// acked since (`acked`).
pub(super) fn lease_ran_out(
    tx: &redb::ReadTransaction,
    tables: &Tables,
    acked: Option<&HashSet<(u64, u64)>>,
    now_ms: u64,
) -> bool {
    tx.open_table(QueueTable::new(&tables.leased))
        .ok()
        .and_then(|leased| leased.range((0, 0)..=(now_ms, u64::MAX)).ok())
        .is_some_and(|mut rows| {
            rows.any(|row| row.is_ok_and(|(k, _)| !acked.is_some_and(|a| a.contains(&k.value()))))
        })
}
