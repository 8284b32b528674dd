//! Fields ↔ Kafka records: the body is the record's value, every other
//! field a header (Kafka headers are bytes, so nothing is lost either way);
//! and the names of the topics courier derives from the work topic.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};

use courier_core::model::PAYLOAD;

/// The header with the time a retry copy is due.
pub(super) use courier_core::source::shared::F_RETRY_AT;

/// Where retries of `topic` wait.
pub(super) fn retry_topic(topic: &str) -> String {
    format!("{topic}.retry")
}

/// Where the ids of the dead letters of `dead_letter_topic` that were
/// replayed or purged are recorded: Kafka cannot delete one record.
pub(super) fn removed_topic(dead_letter_topic: &str) -> String {
    format!("{dead_letter_topic}.removed")
}

/// Where the records of the `courier dlq` jobs on `dead_letter_topic` are
/// kept (`jobs.rs`).
pub(super) fn jobs_topic(dead_letter_topic: &str) -> String {
    format!("{dead_letter_topic}.courier-jobs")
}

/// The id courier gives a record: `<partition>-<offset>`, as the
/// producer's delivery report tells it.
pub(super) fn record_id(partition: i32, offset: i64) -> String {
    format!("{partition}-{offset}")
}

/// The partition and offset of a [`record_id`].
pub(super) fn parse_record_id(id: &str) -> Option<(i32, i64)> {
    let (partition, offset) = id.split_once('-')?;
    Some((partition.parse().ok()?, offset.parse().ok()?))
}

/// When the record was written: its timestamp, the producer's
/// (`CreateTime`) or the broker's (`LogAppendTime`) as the topic says,
/// when it has one after the epoch.
pub(super) fn record_time(message: &OwnedMessage) -> Option<SystemTime> {
    let ms = message.timestamp().to_millis().filter(|ms| *ms > 0)?;
    Some(UNIX_EPOCH + Duration::from_millis(ms as u64))
}

/// A record's value and headers as fields, the value first. A header
/// without a value (Kafka allows a null) is an empty field.
pub(super) fn from_record(message: &OwnedMessage) -> Vec<(Bytes, Bytes)> {
    let mut fields = vec![(
        Bytes::from_static(PAYLOAD.as_bytes()),
        Bytes::copy_from_slice(message.payload().unwrap_or_default()),
    )];
    if let Some(headers) = message.headers() {
        for header in headers.iter() {
            fields.push((
                Bytes::copy_from_slice(header.key.as_bytes()),
                Bytes::copy_from_slice(header.value.unwrap_or_default()),
            ));
        }
    }
    fields
}

/// Fields as a record's value and headers. A header name must be text:
/// one that is not is left out (the forwarder would drop it anyway). The
/// first `payload` field is the value, as `Delivery::from_fields` reads
/// it; a later one is a producer's header of that name.
pub(super) fn to_record(fields: &[(Bytes, Bytes)]) -> (Bytes, OwnedHeaders) {
    let mut body = None;
    let mut headers = OwnedHeaders::new_with_capacity(fields.len());
    for (name, value) in fields {
        if name.as_ref() == PAYLOAD.as_bytes() && body.is_none() {
            body = Some(value.clone());
            continue;
        }
        match std::str::from_utf8(name) {
            Ok(key) => {
                headers = headers.insert(Header {
                    key,
                    value: Some(value.as_ref()),
                });
            }
            Err(_) => tracing::debug!("a header name that is not UTF-8 is left out"),
        }
    }
    (body.unwrap_or_default(), headers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::Timestamp;

    #[test]
    fn fields_round_trip_through_a_record() {
        let fields = vec![
            (
                Bytes::from_static(PAYLOAD.as_bytes()),
                Bytes::from(vec![0u8, 255, 10]),
            ),
            (Bytes::from("content-type"), Bytes::from("text/plain")),
            (Bytes::from("x-multi"), Bytes::from("line\r\nbreak é")),
            (Bytes::from("empty"), Bytes::new()),
            // A producer's header named like the body's field, after it.
            (
                Bytes::from_static(PAYLOAD.as_bytes()),
                Bytes::from("a header"),
            ),
        ];
        let (body, headers) = to_record(&fields);
        let message = OwnedMessage::new(
            Some(body.to_vec()),
            None,
            "t".into(),
            Timestamp::NotAvailable,
            0,
            0,
            Some(headers),
        );
        assert_eq!(from_record(&message), fields);
    }

    #[test]
    fn a_record_time_is_its_timestamp_when_it_has_one() {
        let record = |timestamp| OwnedMessage::new(None, None, "t".into(), timestamp, 0, 0, None);
        let at = UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        for (timestamp, want) in [
            (Timestamp::CreateTime(1_700_000_000_123), Some(at)),
            (Timestamp::LogAppendTime(1_700_000_000_123), Some(at)),
            (Timestamp::CreateTime(-1), None),
            (Timestamp::CreateTime(0), None),
            (Timestamp::NotAvailable, None),
        ] {
            assert_eq!(record_time(&record(timestamp)), want, "{timestamp:?}");
        }
    }

    #[test]
    fn record_ids_round_trip() {
        assert_eq!(parse_record_id(&record_id(3, 17)), Some((3, 17)));
        for bad in ["", "3", "x-1", "1-x", "-1"] {
            assert_eq!(parse_record_id(bad), None, "{bad}");
        }
    }
}
