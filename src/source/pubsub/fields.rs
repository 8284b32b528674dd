//! Fields ↔ a Pub/Sub message: the body is the message's data, every
//! other field one attribute (a header, or a `courier-*` field of
//! courier's record). Pub/Sub attributes are a map, so a header given twice
//! keeps its last value and headers come back in name order. Keys are at
//! most 256 bytes and do not start with `goog`; values are at most 1024
//! bytes: the free-text fields of courier's record (the response excerpt,
//! the error) are cut to fit, on a character boundary.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::PubsubMessage;

use crate::model::PAYLOAD;
use crate::source::SourceError;
use crate::source::shared::is_courier_field;

/// The longest attribute key Pub/Sub takes.
pub const MAX_KEY_BYTES: usize = 256;
/// The longest attribute value Pub/Sub takes.
pub const MAX_VALUE_BYTES: usize = 1024;

/// Pub/Sub's limits on one message (cloud.google.com/pubsub/quotas): 100
/// attributes, and 10 MB of data and attributes together.
pub const MAX_ATTRIBUTES: usize = 100;
pub const MAX_MESSAGE_BYTES: usize = 10_000_000;

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

/// Fields as a Pub/Sub message.
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
    PubsubMessage {
        data: data.unwrap_or_default(),
        attributes,
        ..PubsubMessage::default()
    }
}

/// A Pub/Sub message as fields: `payload`, then the attributes in name
/// order (the `courier-*` ones not yet checked against the seal).
pub(super) fn from_message(message: &PubsubMessage) -> Vec<(Bytes, Bytes)> {
    let mut names: Vec<&String> = message.attributes.keys().collect();
    names.sort();
    let mut fields = Vec::with_capacity(names.len() + 1);
    fields.push((Bytes::from_static(PAYLOAD.as_bytes()), message.data.clone()));
    for name in names {
        fields.push((
            Bytes::copy_from_slice(name.as_bytes()),
            Bytes::copy_from_slice(message.attributes[name].as_bytes()),
        ));
    }
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
    use crate::source::shared::field;

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
