//! Changes inside the batch transaction: sends, retries, dead letters and
//! the writes of dead-letter tools.

use super::*;

/// The async side: an ack is noted for the writer's next look
/// ([`PendingAcks`]); a retry or a dead letter is a call to the writer
/// thread, answered once durable.
#[async_trait]
impl SettleParts for EmbeddedSource {
    async fn settle_ack(&self, delivery: &Delivery) -> Result<(), SourceError> {
        let key = parse_receipt(&delivery.receipt)?;
        let tables = self.tables.clone();
        self.file.ack(Ack { tables, key })
    }

    async fn settle_retry(
        &self,
        delivery: &Delivery,
        next_attempt: u32,
        first_attempt_at: SystemTime,
        at: SystemTime,
    ) -> Result<(), SourceError> {
        let data = encode_fields(&delivery.fields_for_retry(next_attempt, first_attempt_at));
        self.settle(delivery, Then::Retry { at: ms(at), data })
            .await
    }

    async fn settle_dead_letter(
        &self,
        delivery: &Delivery,
        failure: &Failure,
    ) -> Result<(), SourceError> {
        let fields = shared::with_payload(delivery.fields_for_dead_letter(failure));
        let then = Then::DeadLetter {
            table: dlq_table(&failure.dead_letter_queue),
            data: encode_fields(&fields),
        };
        self.settle(delivery, then).await
    }
}

pub(super) fn apply(
    tx: &WriteTransaction,
    change: &mut Change,
    queues: &mut HashMap<String, Overlay>,
    now_ms: u64,
) -> Result<Outcome, SourceError> {
    match change {
        Change::Send { tables, data, .. } => {
            let seq = next_seq(tx)?;
            stored_ready(queues, tables, (now_ms, seq));
            tx.open_table(QueueTable::new(&tables.ready))
                .map_err(store_error)?
                .insert((now_ms, seq), data.as_slice())
                .map_err(store_error)?;
            Ok(Outcome::Seq(seq))
        }
        Change::Settle {
            tables, key, then, ..
        } => {
            // A lease still held in memory has its row in `ready`; else it
            // is in `leased`, unless it ran out and was handed out again,
            // and then the newer delivery settles the message.
            let overlay = queues.get_mut(&tables.ready);
            let row = overlay.as_ref().and_then(|o| o.held_row(*key));
            let held = match (row, overlay) {
                (Some(row), Some(overlay)) => {
                    overlay.held.remove(&key.1);
                    overlay.taken.remove(&row);
                    tx.open_table(QueueTable::new(&tables.ready))
                        .map_err(store_error)?
                        .remove(row)
                        .map_err(store_error)?
                        .is_some()
                }
                (_, overlay) => {
                    let at = overlay.as_ref().map_or(*key, |o| o.leased_key(*key));
                    if let Some(overlay) = overlay {
                        overlay.extended.remove(&key.1);
                    }
                    tx.open_table(QueueTable::new(&tables.leased))
                        .map_err(store_error)?
                        .remove(at)
                        .map_err(store_error)?
                        .is_some()
                }
            };
            if held {
                match then {
                    Then::Retry { at, data } => {
                        stored_ready(queues, tables, (*at, key.1));
                        tx.open_table(QueueTable::new(&tables.ready))
                            .map_err(store_error)?
                            .insert((*at, key.1), data.as_slice())
                            .map_err(store_error)?;
                    }
                    Then::DeadLetter { table, data } => {
                        let id = next_seq(tx)?;
                        tx.open_table(DlqTable::new(table))
                            .map_err(store_error)?
                            .insert(id, data.as_slice())
                            .map_err(store_error)?;
                    }
                }
            }
            Ok(Outcome::Unit(Ok(())))
        }
        Change::Write { work, .. } => match work.take().map(|work| {
            // It may store anything anywhere.
            forget_cursors(queues);
            work(tx)
        }) {
            // A refusal (a bad id, a letter that is gone) is the caller's
            // alone: the batch's other changes still commit.
            Some(Err(e)) if is_refusal(&e) => Ok(Outcome::Unit(Err(e))),
            Some(Err(e)) => Err(e),
            Some(Ok(())) | None => Ok(Outcome::Unit(Ok(()))),
        },
        Change::KeepAlive {
            tables,
            keys,
            visibility,
            ..
        } => {
            let overlay = overlay_of(queues, tables);
            keep_alive(tx, overlay, keys, now_ms + *visibility)?;
            Ok(Outcome::Unit(Ok(())))
        }
        Change::Flush { .. } => Ok(Outcome::Unit(Ok(()))),
    }
}

/// Moves the leases that receipts name to end at `until`: in memory for a
/// lease still held, in `leased` for one written there. A lease that is no
/// longer this delivery's (settled, or taken back and handed out again) is
/// left alone.
fn keep_alive(
    tx: &WriteTransaction,
    overlay: &mut Overlay,
    keys: &[(u64, u64)],
    until: u64,
) -> Result<(), SourceError> {
    let mut leased = tx
        .open_table(QueueTable::new(&overlay.tables.leased))
        .map_err(store_error)?;
    for &key in keys {
        if overlay.held_row(key).is_some() {
            if let Some(held) = overlay.held.get_mut(&key.1) {
                held.until = held.until.max(until);
            }
            continue;
        }
        let at = overlay.leased_key(key);
        if at.0 >= until || overlay.acked_leased.contains(&at) {
            continue;
        }
        let Some(record) = leased
            .remove(at)
            .map_err(store_error)?
            .map(|v| v.value().to_vec())
        else {
            continue;
        };
        leased
            .insert((until, key.1), record.as_slice())
            .map_err(store_error)?;
        overlay.extended.insert(key.1, (key.0, until));
    }
    Ok(())
}

/// An error a [`Change::Write`] returns having written nothing.
pub(super) fn is_refusal(e: &SourceError) -> bool {
    matches!(
        e.kind(),
        courier_core::source::ErrorKind::Invalid | courier_core::source::ErrorKind::Gone
    )
}

pub(super) fn next_seq(tx: &WriteTransaction) -> Result<u64, SourceError> {
    let mut meta = tx.open_table(META).map_err(store_error)?;
    let seq = meta
        .get(SEQ)
        .map_err(store_error)?
        .map(|v| v.value())
        .unwrap_or(0)
        + 1;
    meta.insert(SEQ, seq).map_err(store_error)?;
    Ok(seq)
}
