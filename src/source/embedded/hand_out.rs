//! Handing out: due messages of `ready`, leases that ran out, and what a
//! delivery of a stored record is.

use super::*;

/// Takes back up to `lease.max` leases that ran out, oldest first, and
/// leases them again until `now + visibility`.
pub(super) fn retake(
    tx: &WriteTransaction,
    lease: &Lease,
    now: u64,
) -> Result<Leased, SourceError> {
    let until = now + lease.visibility;
    let mut leased = tx
        .open_table(QueueTable::new(&lease.tables.leased))
        .map_err(store_error)?;
    let expired: Vec<((u64, u64), Vec<u8>)> = leased
        .range((0, 0)..=(now, u64::MAX))
        .map_err(store_error)?
        .take(lease.max)
        .map(|row| row.map(|(k, v)| (k.value(), v.value().to_vec())))
        .collect::<Result<_, _>>()
        .map_err(store_error)?;
    let mut deliveries = Vec::with_capacity(expired.len());
    for (key, data) in expired {
        leased.remove(key).map_err(store_error)?;
        let (delivery, record) = deliver(key.1, Bytes::from(data), until);
        leased
            .insert((until, key.1), record.as_slice())
            .map_err(store_error)?;
        deliveries.push(delivery);
    }
    Ok(Leased {
        retaken: !deliveries.is_empty(),
        deliveries,
    })
}

/// Hands out up to `room` due messages of `ready` that are not taken, and
/// notes them as held.
pub(super) fn hand_out(
    ready: &impl ReadableTable<(u64, u64), &'static [u8]>,
    overlay: &mut Overlay,
    lease: &Lease,
    now: u64,
    room: usize,
) -> Result<Vec<Delivery>, SourceError> {
    let mut out = Vec::new();
    if room == 0 {
        return Ok(out);
    }
    let until = now + lease.visibility;
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
        // Every row passed is taken, before or now.
        overlay.cursor = Some(key);
        if overlay.taken.contains(&key) {
            continue;
        }
        let (delivery, record) = deliver(key.1, Bytes::copy_from_slice(data.value()), until);
        overlay.taken.insert(key);
        overlay.held.insert(
            key.1,
            Held {
                ready_key: key,
                until,
                record,
            },
        );
        out.push(delivery);
        if out.len() == room {
            break;
        }
    }
    Ok(out)
}

/// A delivery of the stored message `seq` under a lease until `until`, and
/// the record its lease stores: the message with this delivery counted.
pub(super) fn deliver(seq: u64, stored: Bytes, until: u64) -> (Delivery, Vec<u8>) {
    let receipt = format!("{until}:{seq}");
    match decode_fields(&stored) {
        Some(mut fields) => {
            let earlier = take_deliveries(&mut fields);
            fields.push((F_DELIVERIES.into(), Bytes::from((earlier + 1).to_string())));
            let record = encode_fields(&fields);
            let delivery = Delivery::from_fields(&seq.to_string(), fields, earlier, receipt);
            (delivery, record)
        }
        // A record that cannot be read (a bug, a disk fault, a tool that
        // wrote the wrong bytes) must not stop the queue behind it: it is
        // handed out as undeliverable, with its raw bytes as the body, so it
        // is dead-lettered with the reason and can be inspected.
        None => {
            let mut delivery = Delivery::from_fields(
                &seq.to_string(),
                vec![(PAYLOAD.into(), stored.clone())],
                0,
                receipt,
            );
            delivery.problem = Some(format!(
                "message {seq} is stored in a form that cannot be read ({} bytes); its raw bytes are kept as the body",
                stored.len()
            ));
            (delivery, stored.to_vec())
        }
    }
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
