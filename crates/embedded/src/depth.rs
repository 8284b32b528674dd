//! The depth of a queue as this process knows it: the tables, less what
//! the writer holds or acked in memory. The sidecar's gauges read it in the
//! writer; an admin handle of a process without a writer reads the tables
//! alone, which are then all there is to know.

use super::*;

impl Writer {
    /// The queue's depth as this process knows it: the tables, less what is
    /// held or acked in memory.
    pub(super) fn depth(&self, tables: &Tables, dlq: &str) -> Result<Depth, SourceError> {
        let tx = self.db.begin_read().map_err(store_error)?;
        read(&tx, self.queues.get(&tables.ready), tables, dlq)
    }
}

/// The depth of the queue of `tables` in the file `tx` reads, with what
/// `overlay` (the writer's memory, when it runs) says is held, acked or
/// read ahead, and the dead letters of the table `dlq`. It only reads: a
/// queue without a work table is an error that names it.
pub(super) fn read(
    tx: &redb::ReadTransaction,
    overlay: Option<&Overlay>,
    tables: &Tables,
    dlq: &str,
) -> Result<Depth, SourceError> {
    let now = now_ms();
    let ready = match tx.open_table(QueueTable::new(&tables.ready)) {
        Ok(ready) => ready,
        Err(redb::TableError::TableDoesNotExist(_)) => {
            return Err(SourceError::gone(format!(
                "the embedded queue has no queue {:?}: nothing was sent to it and no sidecar opened it",
                tables.queue
            )));
        }
        Err(e) => return Err(store_error(e)),
    };
    // An admin handle's send makes the work table alone.
    let leased = match tx.open_table(QueueTable::new(&tables.leased)) {
        Ok(leased) => leased.len().map_err(store_error)?,
        Err(redb::TableError::TableDoesNotExist(_)) => 0,
        Err(e) => return Err(store_error(e)),
    };
    // Counts the retries scheduled for later, not the due messages: during
    // a drain there are none, where a backlog can be large.
    let later = ready.range((now + 1, 0)..).map_err(store_error)?.count() as u64;
    let total = ready.len().map_err(store_error)?;
    // What waits ahead of a receive is taken but still ready.
    let (taken, held, acked_leased) = overlay.map_or((0, 0, 0), |o| {
        (
            o.taken.len().saturating_sub(o.ahead.len()),
            o.held.len(),
            o.acked_leased.len(),
        )
    });
    // The oldest due row nobody holds: rows are ordered by due time, so the
    // first one not taken waited longest (a new message is due when sent, a
    // retry when its time came).
    let mut oldest_due = None;
    for row in ready.range(..(now + 1, 0)).map_err(store_error)? {
        let key = row.map_err(store_error)?.0.value();
        if !overlay.is_some_and(|o| o.taken.contains(&key)) {
            oldest_due = Some(key.0);
            break;
        }
    }
    let (dead_letters, oldest) = dead_letters(tx, dlq)?;
    let ready = total.saturating_sub(later + taken as u64);
    let pending = (leased + held as u64).saturating_sub(acked_leased as u64);
    Ok(Depth {
        ready: Some(ready),
        pending,
        retry_backlog: later,
        dead_letters,
        oldest_dead_letter_age: oldest,
        queue_depth: Some(ready + pending),
        oldest_waiting_age: Some(Duration::from_millis(
            oldest_due.map_or(0, |due| now.saturating_sub(due)),
        )),
    })
}

/// How many dead letters `dlq` (a table name) holds and the oldest one's
/// age; none when no dead letter was ever written there (a dead-letter
/// queue the policy just named).
fn dead_letters(
    tx: &redb::ReadTransaction,
    dlq: &str,
) -> Result<(u64, Option<Duration>), SourceError> {
    let dlq = match tx.open_table(DlqTable::new(dlq)) {
        Ok(dlq) => dlq,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok((0, None)),
        Err(e) => return Err(store_error(e)),
    };
    let oldest = match dlq.first().map_err(store_error)? {
        Some((_, v)) => decode_fields(&Bytes::copy_from_slice(v.value()))
            .and_then(|f| {
                let at = f.iter().find(|(n, _)| {
                    n.as_ref() == courier_core::model::F_LAST_ATTEMPT_AT.as_bytes()
                })?;
                courier_core::model::parse_time(&at.1)
            })
            .map(|t| SystemTime::now().duration_since(t).unwrap_or_default()),
        None => None,
    };
    Ok((dlq.len().map_err(store_error)?, oldest))
}
