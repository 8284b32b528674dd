//! What every broker folder needs the same way: the wait of one receive,
//! editing a stored field list, and the error for a dead letter that is
//! gone. The seal on the copies courier stores is in `seal.rs`.

use std::time::Duration;

use bytes::Bytes;

use super::SourceError;
pub use super::seal::{Seal, is_courier_field};

/// How long one `receive` goes on when none is ready, where it asks the
/// broker again and again (Pub/Sub while deliveries are in flight), and the
/// unit of the short pauses between such asks.
pub const RECEIVE_WAIT: Duration = Duration::from_secs(1);

/// How long one `receive` waits for a first message when none is ready,
/// where the wait is courier's own, in the process (messages a broker
/// pushed, a client library's fetch queue, the embedded queue's writer),
/// and `interrupt` ends it: it sends the broker nothing, and an idle
/// sidecar wakes for it once in this long (issue 28: at 1 s, with the
/// sidecar's connection check, courier's own thread woke 400 times a
/// minute on an idle Kafka queue). A message that comes ends the wait at
/// once, so a longer one delays nothing.
pub const IN_PROCESS_WAIT: Duration = Duration::from_secs(5);

/// How long one `receive` asks the broker to hold its request for a first
/// message when none is ready, where courier cannot withdraw the request
/// once sent (a NATS pull request, an SQS long poll): a stop or a `/drain`
/// waits it out, because what the broker hands out meanwhile has counted
/// as a delivery. Long enough that an idle courier asks such a broker once
/// every few seconds; short enough not to hold up a drain.
pub const HELD_WAIT: Duration = Duration::from_secs(3);

/// The field with the time a stored copy is due, for brokers that cannot
/// delay one message exactly and hold it until then.
pub const F_RETRY_AT: &str = "courier-retry-at";

/// The subject a NATS message was published to; kept in retry copies and
/// dead letters, where they are published again. Here, not in `nats/`,
/// because the seal covers it (`seal::STATE_FIELDS`).
pub const F_SUBJECT: &str = "courier-subject";

/// `fields` without any field called `name`.
pub fn without(fields: Vec<(Bytes, Bytes)>, name: &str) -> Vec<(Bytes, Bytes)> {
    fields
        .into_iter()
        .filter(|(n, _)| n.as_ref() != name.as_bytes())
        .collect()
}

/// `fields` with `name` set to `value`, once.
pub fn replace(fields: Vec<(Bytes, Bytes)>, name: &str, value: String) -> Vec<(Bytes, Bytes)> {
    let mut fields = without(fields, name);
    fields.push((Bytes::copy_from_slice(name.as_bytes()), Bytes::from(value)));
    fields
}

/// `fields` with a body field, empty when they had none: a dead letter
/// always has one, so that tools and replays read it alike.
pub fn with_payload(mut fields: Vec<(Bytes, Bytes)>) -> Vec<(Bytes, Bytes)> {
    if !fields
        .iter()
        .any(|(n, _)| n.as_ref() == crate::model::PAYLOAD.as_bytes())
    {
        fields.insert(0, (crate::model::PAYLOAD.into(), Bytes::new()));
    }
    fields
}

/// The first field called `name`, when it is text.
pub fn field<'a>(fields: &'a [(Bytes, Bytes)], name: &str) -> Option<&'a str> {
    fields
        .iter()
        .find(|(n, _)| n.as_ref() == name.as_bytes())
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
}

/// A dead letter asked for by id that is not (any longer) there.
pub fn not_there(dead_letter_queue: &str, id: &str) -> SourceError {
    SourceError::gone(format!(
        "dead letter {id} is not in {dead_letter_queue} (already replayed or purged?)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replace_sets_a_field_once() {
        let fields = vec![
            (Bytes::from("a"), Bytes::from("1")),
            (Bytes::from("b"), Bytes::from("2")),
            (Bytes::from("a"), Bytes::from("3")),
        ];
        let out = replace(fields, "a", "9".into());
        assert_eq!(
            out,
            vec![
                (Bytes::from("b"), Bytes::from("2")),
                (Bytes::from("a"), Bytes::from("9")),
            ]
        );
    }
}
