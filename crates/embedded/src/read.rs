//! Handing out: due messages of `ready`, leases that ran out, and what a
//! delivery of a stored record is.

use super::*;
use courier_core::model::{F_ENQUEUED_AT, rfc3339};

/// Takes back leases that ran out, oldest first, and leases them again
/// until `now + visibility`: up to `lease.max` of them and
/// [`READ_BUDGET`] bytes (always one at least). One handed out
/// `max_deliveries` times already is dead-lettered instead.
pub(super) fn retake(
    tx: &WriteTransaction,
    lease: &Lease,
    overlay: &mut Overlay,
    now: u64,
) -> Result<Leased, SourceError> {
    // Past `now` even with no visibility timeout, or the loop below would
    // find the lease it just stored.
    let until = now + lease.terms.visibility.max(1);
    let mut leased = tx
        .open_table(QueueTable::new(&lease.tables.leased))
        .map_err(store_error)?;
    let mut deliveries = Vec::new();
    let mut bytes = 0;
    let mut doomed = Vec::new();
    loop {
        let Some((key, data)) = leased
            .range((0, 0)..=(now, u64::MAX))
            .map_err(store_error)?
            .next()
            .transpose()
            .map_err(store_error)?
            .map(|(k, v)| (k.value(), v.value().to_vec()))
        else {
            break;
        };
        if !deliveries.is_empty() && bytes + data.len() > READ_BUDGET {
            break;
        }
        leased.remove(key).map_err(store_error)?;
        overlay.extended.remove(&key.1);
        // A lease's key is when it runs out: the record carries the time
        // it was sent ([`LeaseRecord::encode`]).
        match fate(key.1, &data, until, lease.terms.max_deliveries, None) {
            Fate::Deliver(delivery, record) => {
                leased
                    .insert((until, key.1), record.encode().as_slice())
                    .map_err(store_error)?;
                bytes += data.len();
                deliveries.push(delivery);
            }
            Fate::DeadLetter(why) => doomed.push((key.1, data, why)),
        }
        if deliveries.len() == lease.max {
            break;
        }
    }
    drop(leased);
    let dead_lettered = !doomed.is_empty();
    for (seq, data, why) in doomed {
        let record = undeliverable(
            seq,
            &data,
            &why,
            &lease.tables.queue,
            &lease.terms.dead_letter_queue,
        );
        store_dead_letter(tx, &lease.terms.dead_letter_queue, &record)?;
    }
    Ok(Leased {
        retaken: !deliveries.is_empty() || dead_lettered,
        deliveries,
    })
}

/// What a receive may still take.
pub(super) struct Budget {
    pub(super) room: usize,
    pub(super) bytes: usize,
    /// It has a delivery already, so it need not take one over `bytes`.
    pub(super) has_one: bool,
}

/// Hands out due messages of `ready` that are not taken, within `budget`,
/// and notes them as held. One unfit to hand out is noted to be
/// dead-lettered instead.
pub(super) fn hand_out(
    ready: &impl ReadableTable<(u64, u64), &'static [u8]>,
    overlay: &mut Overlay,
    terms: &Terms,
    now: u64,
    mut budget: Budget,
) -> Result<Vec<Delivery>, SourceError> {
    let mut out = Vec::new();
    if budget.room == 0 {
        return Ok(out);
    }
    let until = now + terms.visibility;
    let from = match overlay.cursor {
        Some(cursor) => Bound::Excluded(cursor),
        None => Bound::Unbounded,
    };
    for row in ready
        .range::<(u64, u64)>((from, Bound::Included((now, u64::MAX))))
        .map_err(store_error)?
    {
        let (key, data) = row.map_err(store_error)?;
        let key = key.value();
        if overlay.taken.contains(&key) {
            // Every row passed is taken, before or now.
            overlay.cursor = Some(key);
            continue;
        }
        let size = data.value().len();
        if (budget.has_one || !out.is_empty()) && size > budget.bytes {
            break;
        }
        overlay.cursor = Some(key);
        overlay.taken.insert(key);
        // A row of `ready` is keyed by when it is due, which for a message
        // as sent is when it was sent (a retry carries the original's).
        match fate(
            key.1,
            data.value(),
            until,
            terms.max_deliveries,
            Some(key.0),
        ) {
            Fate::Deliver(delivery, record) => {
                overlay.held.insert(
                    key.1,
                    Held {
                        ready_key: key,
                        receipt_until: until,
                        until,
                        record,
                    },
                );
                budget.bytes = budget.bytes.saturating_sub(size);
                out.push(delivery);
                if out.len() == budget.room {
                    break;
                }
            }
            Fate::DeadLetter(why) => overlay.doomed.push(Doomed {
                ready_key: key,
                why,
                dead_letter_queue: terms.dead_letter_queue.clone(),
            }),
        }
    }
    Ok(out)
}

/// What becomes of a stored record about to be handed out.
#[expect(
    clippy::large_enum_variant,
    reason = "a fate is matched as soon as it is made; boxing the delivery would cost an allocation a message"
)]
pub(super) enum Fate {
    /// Handed out: the delivery, and the record its lease stores.
    Deliver(Delivery, LeaseRecord),
    /// Dead-lettered as `undeliverable`, for this reason, never offered to
    /// the app.
    DeadLetter(String),
}

/// Whether the record `seq` is handed out under a lease until `until`: not
/// when it is over [`RECORD_LIMIT`] (its body is never loaded into a
/// delivery) or was handed out `max_deliveries` times without being
/// settled (a poison pill: something about it stops courier settling it).
/// `due_ms`: the key of its row in `ready`, the time it was sent unless the
/// record carries an earlier one.
pub(super) fn fate(
    seq: u64,
    stored: &[u8],
    until: u64,
    max_deliveries: u32,
    due_ms: Option<u64>,
) -> Fate {
    if stored.len() > RECORD_LIMIT {
        return Fate::DeadLetter(format!(
            "the stored message is {} bytes, over the embedded queue's limit of {RECORD_LIMIT} bytes for one message",
            stored.len()
        ));
    }
    let stored = Bytes::copy_from_slice(stored);
    match decode_fields(&stored) {
        Some(mut fields) => {
            let earlier = take_deliveries(&mut fields);
            if earlier >= max_deliveries {
                return Fate::DeadLetter(format!(
                    "handed out {earlier} times without being settled"
                ));
            }
            let sent = due_ms.map(|ms| UNIX_EPOCH + Duration::from_millis(ms));
            let (delivery, record) = deliver_fields(seq, stored, fields, earlier, until, sent);
            Fate::Deliver(delivery, record)
        }
        None => {
            let (delivery, record) = deliver_unreadable(seq, stored, until);
            Fate::Deliver(delivery, record)
        }
    }
}

/// The dead letter of a record that is not handed out, as
/// [`Settlement::DeadLetter`](courier_core::source::Settlement::DeadLetter) would write it for an `undeliverable` delivery.
pub(super) fn undeliverable(
    seq: u64,
    stored: &[u8],
    why: &str,
    queue: &str,
    dead_letter_queue: &str,
) -> Vec<u8> {
    let now = SystemTime::now();
    let (delivery, _) = deliver(seq, Bytes::copy_from_slice(stored), 0);
    let failure = Failure {
        reason: courier_core::model::DeadLetterReason::Undeliverable,
        status: None,
        error: Some(why.to_string()),
        attempts: delivery.attempt,
        first_attempt_at: delivery.first_attempt_at.unwrap_or(now),
        last_attempt_at: now,
        queue: queue.to_string(),
        message_id: delivery.message.id.clone(),
        excerpt: Bytes::new(),
        policy: String::new(),
        dead_letter_queue: dead_letter_queue.to_string(),
        app_directive: None,
        cut: None,
    };
    let fields = shared::with_payload(delivery.fields_for_dead_letter(&failure));
    encode_fields(&fields)
}

/// Writes a dead letter to `dlq/<dead_letter_queue>` under the next seq.
pub(super) fn store_dead_letter(
    tx: &WriteTransaction,
    dead_letter_queue: &str,
    record: &[u8],
) -> Result<(), SourceError> {
    let id = next_seq(tx)?;
    tx.open_table(DlqTable::new(&dlq_table(dead_letter_queue)))
        .map_err(store_error)?
        .insert(id, record)
        .map_err(store_error)?;
    Ok(())
}

/// What a lease stores: the message with this delivery counted. Encoded
/// only when it is written, which most hand-outs never are (the ack comes
/// before the next transaction), not for every one.
pub(super) struct LeaseRecord {
    stored: Bytes,
    /// The deliveries of it, this one included; none for a record that
    /// cannot be read, which is stored as it was.
    deliveries: Option<u32>,
    /// When the message was sent: a lease's key is not, so the record
    /// carries it as `courier-enqueued-at`.
    enqueued_at: Option<SystemTime>,
}

impl LeaseRecord {
    pub(super) fn encode(&self) -> Vec<u8> {
        let Some(deliveries) = self.deliveries else {
            return self.stored.to_vec();
        };
        let mut fields = decode_fields(&self.stored).unwrap_or_default();
        take_deliveries(&mut fields);
        if let Some(at) = self.enqueued_at
            && shared::field(&fields, F_ENQUEUED_AT).is_none()
        {
            fields.push((F_ENQUEUED_AT.into(), Bytes::from(rfc3339(at))));
        }
        fields.push((F_DELIVERIES.into(), Bytes::from(deliveries.to_string())));
        encode_fields(&fields)
    }
}

/// A delivery of the stored message `seq` under a lease until `until`, and
/// the record its lease stores.
pub(super) fn deliver(seq: u64, stored: Bytes, until: u64) -> (Delivery, LeaseRecord) {
    match decode_fields(&stored) {
        Some(mut fields) => {
            let earlier = take_deliveries(&mut fields);
            deliver_fields(seq, stored, fields, earlier, until, None)
        }
        None => deliver_unreadable(seq, stored, until),
    }
}

/// [`deliver`] of a record that was read: `earlier` deliveries of it were
/// never settled; `sent` is when it was sent, unless the record says.
fn deliver_fields(
    seq: u64,
    stored: Bytes,
    fields: Vec<(Bytes, Bytes)>,
    earlier: u32,
    until: u64,
    sent: Option<SystemTime>,
) -> (Delivery, LeaseRecord) {
    let receipt = receipt(until, seq);
    let delivery = Delivery::from_fields(&seq.to_string(), fields, earlier, receipt, sent);
    let record = LeaseRecord {
        stored,
        deliveries: Some(earlier + 1),
        enqueued_at: delivery.enqueued_at,
    };
    (delivery, record)
}

/// A record that cannot be read (a bug, a disk fault, a tool that wrote the
/// wrong bytes) must not stop the queue behind it: it is handed out as
/// undeliverable, with its raw bytes as the body, so it is dead-lettered
/// with the reason and can be inspected.
fn deliver_unreadable(seq: u64, stored: Bytes, until: u64) -> (Delivery, LeaseRecord) {
    let mut delivery = Delivery::from_fields(
        &seq.to_string(),
        vec![(PAYLOAD.into(), stored.clone())],
        0,
        receipt(until, seq),
        None,
    );
    delivery.problem = Some(format!(
        "message {seq} is stored in a form that cannot be read ({} bytes); its raw bytes are kept as the body",
        stored.len()
    ));
    let record = LeaseRecord {
        stored,
        deliveries: None,
        enqueued_at: None,
    };
    (delivery, record)
}

fn receipt(until: u64, seq: u64) -> String {
    format!("{until}:{seq}")
}

/// When something of the queue falls due next (a scheduled retry, a lease
/// running out), in ms.
pub(super) fn next_due(
    tx: &redb::ReadTransaction,
    overlay: &Overlay,
) -> Result<Option<u64>, SourceError> {
    let ready = tx
        .open_table(QueueTable::new(&overlay.tables.ready))
        .map_err(store_error)?;
    let leased = tx
        .open_table(QueueTable::new(&overlay.tables.leased))
        .map_err(store_error)?;
    let from = match overlay.cursor {
        Some(cursor) => Bound::Excluded(cursor),
        None => Bound::Unbounded,
    };
    let mut first = None;
    for row in ready
        .range::<(u64, u64)>((from, Bound::Unbounded))
        .map_err(store_error)?
    {
        let key = row.map_err(store_error)?.0.value();
        if !overlay.taken.contains(&key) {
            first = Some(key.0);
            break;
        }
    }
    for row in leased.iter().map_err(store_error)? {
        let key = row.map_err(store_error)?.0.value();
        if !overlay.acked_leased.contains(&key) {
            first = Some(first.map_or(key.0, |f: u64| f.min(key.0)));
            break;
        }
    }
    Ok(first)
}

/// Removes the `courier-deliveries` field and returns its value.
pub(super) fn take_deliveries(fields: &mut Vec<(Bytes, Bytes)>) -> u32 {
    let mut count = 0;
    fields.retain(|(name, value)| {
        if name.as_ref() == F_DELIVERIES.as_bytes() {
            count = std::str::from_utf8(value)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            false
        } else {
            true
        }
    });
    count
}
