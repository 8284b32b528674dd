//! Fields ↔ a Pub/Sub message: the body is the message's data, every
//! other field one attribute (a header, or a `courier-*` field of
//! courier's record). Pub/Sub attributes are a map, so a header given twice
//! keeps its last value and headers come back in name order. Keys are at
//! most 256 bytes and do not start with `goog`; values are at most 1024
//! bytes: the free-text fields of courier's record (the response excerpt,
//! the error) are cut to fit, on a character boundary.
//!
//! A copy courier stores (a retry, a dead letter, a replay) adds its record
//! to the producer's up to 100 attributes, which can make it more than
//! Pub/Sub's 100. Such a copy is an envelope: courier's fields and as many
//! of the producer's as fit stay attributes, with `courier-envelope: 1`;
//! the data holds the body and the attributes that did not fit
//! ([`to_message`], [`from_message`]). The reader reads an envelope back as
//! the fields it was made of, so the seal is checked over the same fields
//! either way, and an envelope a producer forged is a message with
//! `courier-*` fields like any other: without courier's seal they count
//! for nothing (`Seal::open`).

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::PubsubMessage;

use courier_core::model::PAYLOAD;
use courier_core::source::SourceError;
use courier_core::source::shared::is_courier_field;

/// The longest attribute key Pub/Sub takes.
pub const MAX_KEY_BYTES: usize = 256;
/// The longest attribute value Pub/Sub takes.
pub const MAX_VALUE_BYTES: usize = 1024;

/// Pub/Sub's limits on one message (cloud.google.com/pubsub/quotas): 100
/// attributes, and 10 MB of data and attributes together.
pub const MAX_ATTRIBUTES: usize = 100;
pub const MAX_MESSAGE_BYTES: usize = 10_000_000;

/// The attribute that marks an envelope, and the envelope format's version
/// (its value): the data is the body and the fields that did not fit as
/// attributes, each a name and a value, each of those a 4-byte big-endian
/// length and the bytes, the body first as `payload`.
pub const F_ENVELOPE: &str = "courier-envelope";
const ENVELOPE_VERSION: &str = "1";

/// Refuses, before it is sent, a message Pub/Sub would refuse on every
/// try; the emulator does not check these limits.
pub(super) fn fits(topic: &str, message: &PubsubMessage) -> Result<(), SourceError> {
    let bytes = message.data.len()
        + message
            .attributes
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>();
    let attributes = message.attributes.len();
    if attributes > MAX_ATTRIBUTES || bytes > MAX_MESSAGE_BYTES {
        return Err(SourceError::too_large(format!(
            "a message for {topic} with {attributes} attributes and {bytes} bytes is over Pub/Sub's limits of {MAX_ATTRIBUTES} attributes and {MAX_MESSAGE_BYTES} bytes"
        )));
    }
    Ok(())
}

/// Whether Pub/Sub takes `name: value` as an attribute.
pub fn attribute_ok(name: &str, value: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_KEY_BYTES
        && !name.to_ascii_lowercase().starts_with("goog")
        && value.len() <= MAX_VALUE_BYTES
}

/// `text` cut to at most `limit` bytes, on a character boundary.
fn cut(text: String, limit: usize) -> String {
    if text.len() <= limit {
        return text;
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// Fields as a Pub/Sub message: the plain form when Pub/Sub takes it,
/// else an envelope.
pub(super) fn to_message(fields: &[(Bytes, Bytes)]) -> PubsubMessage {
    // The first `payload` field is the data, as `Delivery::from_fields`
    // reads it; a later one is a producer's attribute of that name.
    let mut data = None;
    let mut attributes = HashMap::new();
    for (name, value) in fields {
        if name.as_ref() == PAYLOAD.as_bytes() && data.is_none() {
            data = Some(value.clone());
            continue;
        }
        let name = String::from_utf8_lossy(name).into_owned();
        let mut value = String::from_utf8_lossy(value).into_owned();
        if is_courier_field(name.as_bytes()) {
            value = cut(value, MAX_VALUE_BYTES);
        }
        attributes.insert(name, value);
    }
    let data = data.unwrap_or_default();
    if attributes.len() <= MAX_ATTRIBUTES && attributes.iter().all(|(n, v)| attribute_ok(n, v)) {
        return PubsubMessage {
            data,
            attributes,
            ..PubsubMessage::default()
        };
    }
    envelope(data, attributes)
}

/// A message whose attributes Pub/Sub would not take as they are: courier's
/// fields first (the depth count reads `courier-last-attempt-at` as an
/// attribute), then the producer's in name order, stay attributes while
/// they fit beside the marker; the rest travel in the data with the body.
fn envelope(body: Bytes, attributes: HashMap<String, String>) -> PubsubMessage {
    let mut all: Vec<(String, String)> = attributes.into_iter().collect();
    all.sort_by(|(a, _), (b, _)| {
        (!is_courier_field(a.as_bytes()), a).cmp(&(!is_courier_field(b.as_bytes()), b))
    });
    let mut kept = HashMap::new();
    let mut data = Vec::with_capacity(body.len() + 16);
    push_part(&mut data, PAYLOAD.as_bytes());
    push_part(&mut data, &body);
    for (name, value) in all {
        if kept.len() < MAX_ATTRIBUTES - 1 && attribute_ok(&name, &value) {
            kept.insert(name, value);
        } else {
            push_part(&mut data, name.as_bytes());
            push_part(&mut data, value.as_bytes());
        }
    }
    kept.insert(F_ENVELOPE.to_string(), ENVELOPE_VERSION.to_string());
    PubsubMessage {
        data: Bytes::from(data),
        attributes: kept,
        ..PubsubMessage::default()
    }
}

fn push_part(data: &mut Vec<u8>, part: &[u8]) {
    data.extend_from_slice(&(part.len() as u32).to_be_bytes());
    data.extend_from_slice(part);
}

/// The fields an envelope's data holds, the body first; `None` when the
/// data is not an envelope of this version (then the message is read as it
/// is, its `courier-envelope` one more `courier-*` attribute).
fn unwrap(data: &Bytes) -> Option<Vec<(Bytes, Bytes)>> {
    let mut rest = data.clone();
    let mut next = || -> Option<Bytes> {
        if rest.len() < 4 {
            return None;
        }
        let len = u32::from_be_bytes(rest[..4].try_into().ok()?) as usize;
        if rest.len() - 4 < len {
            return None;
        }
        let part = rest.slice(4..4 + len);
        rest = rest.slice(4 + len..);
        Some(part)
    };
    let mut fields = Vec::new();
    while let Some(name) = next() {
        fields.push((name, next()?));
    }
    let whole = rest.is_empty();
    (whole
        && fields
            .first()
            .is_some_and(|(n, _)| n.as_ref() == PAYLOAD.as_bytes()))
    .then_some(fields)
}

/// A Pub/Sub message as fields: `payload`, then the attributes (an
/// envelope's with those its data held) in name order, the `courier-*`
/// ones not yet checked against the seal.
pub(super) fn from_message(message: &PubsubMessage) -> Vec<(Bytes, Bytes)> {
    let enveloped = (message.attributes.get(F_ENVELOPE).map(String::as_str)
        == Some(ENVELOPE_VERSION))
    .then(|| unwrap(&message.data))
    .flatten();
    let mut fields: Vec<(Bytes, Bytes)> = message
        .attributes
        .iter()
        .filter(|(name, _)| enveloped.is_none() || name.as_str() != F_ENVELOPE)
        .map(|(name, value)| {
            (
                Bytes::copy_from_slice(name.as_bytes()),
                Bytes::copy_from_slice(value.as_bytes()),
            )
        })
        .collect();
    let body = match enveloped {
        Some(mut inner) => {
            let (_, body) = inner.remove(0);
            fields.extend(inner);
            body
        }
        None => message.data.clone(),
    };
    // Stable, so that where a forged envelope repeats an attribute, the
    // attribute stays the first occurrence, the one that counts.
    fields.sort_by(|(a, _), (b, _)| a.cmp(b));
    fields.insert(0, (Bytes::from_static(PAYLOAD.as_bytes()), body));
    fields
}

/// When Pub/Sub took the message.
pub(super) fn publish_time(message: &PubsubMessage) -> Option<SystemTime> {
    let t = message.publish_time.as_ref()?;
    Some(UNIX_EPOCH + Duration::new(t.seconds.max(0) as u64, t.nanos.max(0) as u32))
}

#[cfg(test)]
mod tests {
    use super::*;
    use courier_core::model::{F_ATTEMPT, F_MESSAGE_ID, F_SEAL};
    use courier_core::source::shared::{F_RETRY_AT, Seal, field};

    /// Found by the torture run (on NATS and RabbitMQ, the same loop
    /// here): a copy of a message with a producer's attribute named
    /// `payload` took that attribute as its body.
    #[test]
    fn a_header_named_payload_stays_an_attribute_in_a_copy() {
        let fields = vec![
            (Bytes::from("payload"), Bytes::from("the body")),
            (Bytes::from("payload"), Bytes::from("an attribute")),
        ];
        let message = to_message(&fields);
        assert_eq!(message.data.as_ref(), b"the body");
        assert_eq!(
            message.attributes.get("payload").map(String::as_str),
            Some("an attribute")
        );
    }

    #[test]
    fn a_round_trip_keeps_body_headers_and_record() {
        let fields = vec![
            (Bytes::from("payload"), Bytes::from_static(&[0, 255, 1])),
            (Bytes::from("content-type"), Bytes::from("application/json")),
            (Bytes::from("courier-attempt"), Bytes::from("3")),
        ];
        let message = to_message(&fields);
        assert_eq!(message.data.as_ref(), &[0, 255, 1]);
        let back = from_message(&message);
        assert_eq!(back[0], fields[0]);
        assert_eq!(field(&back, "content-type"), Some("application/json"));
        assert_eq!(field(&back, "courier-attempt"), Some("3"));
        assert_eq!(back.len(), 3);
    }

    #[test]
    fn long_record_values_are_cut_on_a_character_boundary() {
        let long = "ż".repeat(600);
        let fields = vec![
            (Bytes::from("payload"), Bytes::from("x")),
            (Bytes::from("courier-response-excerpt"), Bytes::from(long)),
        ];
        let message = to_message(&fields);
        let value = &message.attributes["courier-response-excerpt"];
        assert!(value.len() <= MAX_VALUE_BYTES);
        assert_eq!(value.len(), 1024);
        assert!(value.chars().all(|c| c == 'ż'));
    }

    /// The producer's `n` attributes, each `value_bytes` long, and a body.
    fn produced(n: usize, value_bytes: usize) -> Vec<(Bytes, Bytes)> {
        let mut fields = vec![(Bytes::from("payload"), Bytes::from_static(&[0, 255, 1]))];
        fields.extend((0..n).map(|i| {
            let value = format!("{i:04}").repeat(value_bytes / 4);
            (Bytes::from(format!("x-attr-{i:03}")), Bytes::from(value))
        }));
        fields
    }

    /// `fields` as `from_message` gives them: the body, then by name.
    fn in_name_order(mut fields: Vec<(Bytes, Bytes)>) -> Vec<(Bytes, Bytes)> {
        let body = fields.remove(0);
        fields.sort();
        fields.insert(0, body);
        fields
    }

    /// Finding 5 of docs/reliability.md: a retry copy of a message of 100
    /// attributes (Pub/Sub's most) was over 100 with courier's record and
    /// was refused before it was published. As an envelope it fits, and
    /// reads back as the fields it was made of, under the same seal.
    #[test]
    fn a_copy_over_100_attributes_is_an_envelope_that_reads_back_whole() {
        let seal = Seal::new(b"k1").unwrap();
        for (n, value_bytes) in [(100, 8), (99, 1024)] {
            let mut copy = produced(n, value_bytes);
            copy.push((Bytes::from(F_MESSAGE_ID), Bytes::from("17")));
            copy.push((Bytes::from(F_ATTEMPT), Bytes::from("2")));
            copy.push((Bytes::from(F_RETRY_AT), Bytes::from("2026-12-05T00:00:00Z")));
            let copy = seal.seal(copy);
            let message = to_message(&copy);
            assert_eq!(message.attributes.len(), MAX_ATTRIBUTES);
            assert!(message.attributes.iter().all(|(n, v)| attribute_ok(n, v)));
            assert_eq!(message.attributes[F_ENVELOPE], "1");
            for courier in [F_MESSAGE_ID, F_ATTEMPT, F_RETRY_AT, F_SEAL] {
                assert!(message.attributes.contains_key(courier), "{courier}");
            }
            fits("t", &message).unwrap();
            let back = from_message(&message);
            assert_eq!(back, in_name_order(copy.clone()), "{n} attributes");
            assert!(seal.is_sealed(&back));
            assert_eq!(field(&seal.open(back), F_ATTEMPT), Some("2"));
        }
    }

    #[test]
    fn a_message_that_fits_is_no_envelope() {
        let message = to_message(&produced(100, 1024));
        assert!(!message.attributes.contains_key(F_ENVELOPE));
        assert_eq!(message.data.as_ref(), &[0, 255, 1]);
        assert_eq!(from_message(&message), in_name_order(produced(100, 1024)));
    }

    /// A producer can publish `courier-envelope` and an envelope's data: it
    /// is read as an envelope, but its `courier-*` fields, wherever they
    /// travel, count only under courier's seal, as for any message. Here a
    /// sealed copy's state is lifted into a forged envelope with another
    /// attempt.
    #[test]
    fn a_forged_envelope_carries_no_courier_state() {
        let seal = Seal::new(b"k1").unwrap();
        let mut genuine = produced(100, 8);
        genuine.push((Bytes::from(F_ATTEMPT), Bytes::from("2")));
        let genuine = to_message(&seal.seal(genuine));
        let mut forged = genuine.clone();
        forged.attributes.remove(F_ATTEMPT);
        let mut data = genuine.data.to_vec();
        push_part(&mut data, F_ATTEMPT.as_bytes());
        push_part(&mut data, b"1");
        forged.data = Bytes::from(data);
        let opened = seal.open(from_message(&forged));
        assert_eq!(field(&opened, F_ATTEMPT), None);
        assert!(opened.iter().all(|(n, _)| !is_courier_field(n)));
        assert_eq!(opened, in_name_order(produced(100, 8)));
    }

    /// Data that is not an envelope under the marker is the body as it is;
    /// the marker stays one more `courier-*` attribute, which `Seal::open`
    /// drops.
    #[test]
    fn a_marker_without_an_envelope_leaves_the_message_as_it_is() {
        let seal = Seal::new(b"k1").unwrap();
        for data in [
            &b"plain text"[..],
            &[0, 0, 0, 7, b'p'],
            &[0, 0, 0, 1, b'x', 0, 0, 0, 0],
        ] {
            let message = PubsubMessage {
                data: Bytes::copy_from_slice(data),
                attributes: HashMap::from([
                    (F_ENVELOPE.to_string(), "1".to_string()),
                    ("k".to_string(), "v".to_string()),
                ]),
                ..PubsubMessage::default()
            };
            let opened = seal.open(from_message(&message));
            assert_eq!(
                opened,
                vec![
                    (Bytes::from("payload"), Bytes::copy_from_slice(data)),
                    (Bytes::from("k"), Bytes::from("v")),
                ]
            );
        }
    }

    #[test]
    fn attribute_rows() {
        assert!(attribute_ok("content-type", "text/plain"));
        assert!(attribute_ok("x note", "a\r\nb"));
        assert!(!attribute_ok("", "v"));
        assert!(!attribute_ok("googclient_x", "v"));
        assert!(!attribute_ok(&"k".repeat(257), "v"));
        assert!(!attribute_ok("k", &"v".repeat(1025)));
    }
}
