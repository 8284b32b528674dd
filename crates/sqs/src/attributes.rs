//! Fields ↔ an SQS message: the body, and at most 10 message attributes.
//!
//! - The body is SQS text (XML characters, not empty). A body that is not
//!   goes base64-encoded with the attribute `content-transfer-encoding:
//!   base64`, which a producer with binary bodies sets too; courier decodes
//!   it and does not forward it.
//! - Every `courier-*` field goes into one String attribute,
//!   `courier-record`: a JSON object of field name to value.
//! - Producer headers are one String attribute each while everything fits
//!   in 10 attributes and each name is one SQS takes; otherwise all of them
//!   go into one String attribute, `courier-headers`: a JSON array of
//!   `[name, value]` pairs, in order.

use std::collections::HashMap;

use aws_sdk_sqs::types::{Message, MessageAttributeValue};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;

use courier_core::model::PAYLOAD;
use courier_core::source::SourceError;
use courier_core::source::shared::is_courier_field;

/// The attribute holding every `courier-*` field.
pub const RECORD: &str = "courier-record";
/// The attribute holding the producer headers when they do not fit one
/// attribute each.
pub const HEADERS: &str = "courier-headers";
/// `base64`: the body is base64 of the real one.
pub const ENCODING: &str = "content-transfer-encoding";
/// SQS takes at most this many message attributes.
pub const MAX_ATTRIBUTES: usize = 10;

/// Whether SQS takes `name` as a message attribute name: 1 to 256 of
/// `A-Za-z0-9_-.`, no `..`, no `.` at either end, not `AWS.`/`Amazon.`.
pub fn attribute_name_ok(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    !name.is_empty()
        && name.len() <= 256
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
        && !name.contains("..")
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !lower.starts_with("aws.")
        && !lower.starts_with("amazon.")
}

/// Whether SQS takes `text` as a body or a String attribute value: the XML
/// characters (tab, LF, CR, U+0020..U+D7FF, U+E000..U+FFFD, above U+FFFF).
pub fn is_sqs_text(text: &str) -> bool {
    text.chars().all(|c| {
        matches!(c, '\t' | '\n' | '\r' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}')
            || c > '\u{FFFF}'
    })
}

pub(super) fn string(value: String) -> Result<MessageAttributeValue, SourceError> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .map_err(|e| SourceError::broker(format!("a message attribute: {e}")))
}

/// What an SQS message is made of.
pub struct Wire {
    pub body: String,
    pub attributes: HashMap<String, MessageAttributeValue>,
}

/// Fields as an SQS message.
pub fn to_wire(fields: &[(Bytes, Bytes)]) -> Result<Wire, SourceError> {
    // The first `payload` field is the body, as `Delivery::from_fields`
    // reads it; a later one is a producer's header of that name.
    let mut body = None;
    let mut record = serde_json::Map::new();
    let mut headers = Vec::new();
    for (name, value) in fields {
        if name.as_ref() == PAYLOAD.as_bytes() && body.is_none() {
            body = Some(value.clone());
        } else if is_courier_field(name) {
            record.insert(
                String::from_utf8_lossy(name).into_owned(),
                serde_json::Value::String(String::from_utf8_lossy(value).into_owned()),
            );
        } else {
            headers.push((
                String::from_utf8_lossy(name).into_owned(),
                String::from_utf8_lossy(value).into_owned(),
            ));
        }
    }
    let body = body.unwrap_or_default();
    let mut attributes = HashMap::new();
    let text = std::str::from_utf8(&body)
        .ok()
        .filter(|t| !t.is_empty() && is_sqs_text(t));
    let body = match text {
        Some(text) => text.to_string(),
        None => {
            attributes.insert(ENCODING.to_string(), string("base64".into())?);
            BASE64.encode(&body)
        }
    };
    if !record.is_empty() {
        let json = serde_json::Value::Object(record).to_string();
        attributes.insert(RECORD.to_string(), string(json)?);
    }
    let reserved = |n: &str| {
        n.eq_ignore_ascii_case(RECORD)
            || n.eq_ignore_ascii_case(HEADERS)
            || n.eq_ignore_ascii_case(ENCODING)
    };
    let each_fits = attributes.len() + headers.len() <= MAX_ATTRIBUTES
        && headers
            .iter()
            .all(|(n, v)| attribute_name_ok(n) && !reserved(n) && !v.is_empty() && is_sqs_text(v))
        && {
            let mut names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
            names.sort_unstable();
            names.windows(2).all(|w| w[0] != w[1])
        };
    if each_fits {
        for (name, value) in headers {
            attributes.insert(name, string(value)?);
        }
    } else if !headers.is_empty() {
        let pairs: Vec<[String; 2]> = headers.into_iter().map(|(n, v)| [n, v]).collect();
        let json = serde_json::to_string(&pairs).expect("strings serialize");
        attributes.insert(HEADERS.to_string(), string(json)?);
    }
    Ok(Wire { body, attributes })
}

/// An SQS message as fields: `payload`, the headers, then the
/// `courier-*` fields of its record (not yet checked against the seal).
pub fn from_message(message: &Message) -> Vec<(Bytes, Bytes)> {
    let empty = HashMap::new();
    let attributes = message.message_attributes().unwrap_or(&empty);
    from_parts(message.body().unwrap_or_default(), attributes)
}

pub fn from_parts(
    body: &str,
    attributes: &HashMap<String, MessageAttributeValue>,
) -> Vec<(Bytes, Bytes)> {
    let text = |name: &str| {
        attributes
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .and_then(|(_, v)| v.string_value())
    };
    let encoded = text(ENCODING).is_some_and(|e| e.trim().eq_ignore_ascii_case("base64"));
    let payload = match encoded.then(|| BASE64.decode(body.trim())) {
        Some(Ok(bytes)) => Bytes::from(bytes),
        // Not base64 after all: the body as it came.
        _ => Bytes::copy_from_slice(body.as_bytes()),
    };
    let mut fields = vec![(Bytes::from_static(PAYLOAD.as_bytes()), payload)];
    let mut names: Vec<&String> = attributes.keys().collect();
    names.sort();
    for name in names {
        let lower = name.to_ascii_lowercase();
        if lower == RECORD || lower == HEADERS || lower == ENCODING {
            continue;
        }
        let value = &attributes[name];
        let value = match (value.string_value(), value.binary_value()) {
            (Some(s), _) => Bytes::copy_from_slice(s.as_bytes()),
            (None, Some(b)) => Bytes::copy_from_slice(b.as_ref()),
            (None, None) => Bytes::new(),
        };
        fields.push((Bytes::copy_from_slice(name.as_bytes()), value));
    }
    if let Some(json) = text(HEADERS)
        && let Ok(pairs) = serde_json::from_str::<Vec<(String, String)>>(json)
    {
        for (name, value) in pairs {
            fields.push((Bytes::from(name), Bytes::from(value)));
        }
    }
    if let Some(json) = text(RECORD)
        && let Ok(serde_json::Value::Object(record)) = serde_json::from_str(json)
    {
        for (name, value) in record {
            // Only courier-* names: a record cannot smuggle in a header.
            if let (true, serde_json::Value::String(value)) =
                (is_courier_field(name.as_bytes()), value)
            {
                fields.push((Bytes::from(name), Bytes::from(value)));
            }
        }
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;
    use courier_core::source::shared::field;

    fn round_trip(fields: &[(Bytes, Bytes)]) -> (Wire, Vec<(Bytes, Bytes)>) {
        let wire = to_wire(fields).unwrap();
        let back = from_parts(&wire.body, &wire.attributes);
        (wire, back)
    }

    /// Found by the torture run (on NATS and RabbitMQ, the same loop
    /// here): a copy of a message with a producer's header named `payload`
    /// took that header as its body.
    #[test]
    fn a_header_named_payload_stays_a_header_in_a_copy() {
        let fields = vec![
            (Bytes::from("payload"), Bytes::from("the body")),
            (Bytes::from("payload"), Bytes::from("a header")),
        ];
        let (wire, back) = round_trip(&fields);
        assert_eq!(wire.body, "the body");
        assert_eq!(back, fields);
    }

    #[test]
    fn few_headers_are_an_attribute_each_and_the_record_is_one() {
        let fields = vec![
            (Bytes::from("payload"), Bytes::from("{}")),
            (Bytes::from("content-type"), Bytes::from("application/json")),
            (Bytes::from("courier-reason"), Bytes::from("undeliverable")),
            (Bytes::from("courier-attempts"), Bytes::from("3")),
        ];
        let (wire, back) = round_trip(&fields);
        assert_eq!(wire.body, "{}");
        let mut names: Vec<_> = wire.attributes.keys().cloned().collect();
        names.sort();
        assert_eq!(names, ["content-type", "courier-record"]);
        assert_eq!(field(&back, "payload"), Some("{}"));
        assert_eq!(field(&back, "content-type"), Some("application/json"));
        assert_eq!(field(&back, "courier-reason"), Some("undeliverable"));
        assert_eq!(field(&back, "courier-attempts"), Some("3"));
        assert_eq!(back.len(), 4);
    }

    #[test]
    fn many_or_odd_headers_share_one_attribute() {
        let mut fields = vec![(Bytes::from("payload"), Bytes::from("x"))];
        for i in 0..12 {
            fields.push((Bytes::from(format!("h{i}")), Bytes::from(format!("v{i}"))));
        }
        let (wire, back) = round_trip(&fields);
        assert_eq!(wire.attributes.len(), 1);
        assert!(wire.attributes.contains_key(HEADERS));
        assert_eq!(field(&back, "h11"), Some("v11"));
        assert_eq!(back.len(), 13);
        let odd = vec![
            (Bytes::from("payload"), Bytes::from("x")),
            (Bytes::from("x note"), Bytes::from("a\r\nb")),
            (Bytes::from("empty"), Bytes::new()),
            (Bytes::from("AWS.trace"), Bytes::from("t")),
        ];
        let (wire, back) = round_trip(&odd);
        assert_eq!(wire.attributes.len(), 1);
        assert_eq!(field(&back, "x note"), Some("a\r\nb"));
        assert_eq!(field(&back, "empty"), Some(""));
        assert_eq!(field(&back, "AWS.trace"), Some("t"));
    }

    #[test]
    fn a_body_sqs_cannot_carry_goes_base64() {
        let binary = Bytes::from_static(&[0, 159, 146, 150, 255, 254, b'\n', 0]);
        let fields = vec![(Bytes::from("payload"), binary.clone())];
        let (wire, back) = round_trip(&fields);
        assert_eq!(wire.body, BASE64.encode(&binary));
        assert!(wire.attributes.contains_key(ENCODING));
        assert_eq!(back, fields);
    }

    #[test]
    fn a_record_holds_only_courier_fields() {
        let mut attributes = HashMap::new();
        attributes.insert(
            RECORD.to_string(),
            string(r#"{"courier-attempt":"4","x-smuggled":"1","courier-n":5}"#.into()).unwrap(),
        );
        let back = from_parts("b", &attributes);
        assert_eq!(field(&back, "courier-attempt"), Some("4"));
        assert_eq!(back.len(), 2);
    }

    #[test]
    fn attribute_names_rows() {
        for ok in ["content-type", "a.b", "X_1", "traceparent"] {
            assert!(attribute_name_ok(ok), "{ok}");
        }
        for bad in ["", "a b", ".a", "a.", "a..b", "AWS.x", "amazon.y", "a:b"] {
            assert!(!attribute_name_ok(bad), "{bad}");
        }
        assert!(is_sqs_text("zamówienie\r\n\t"));
        assert!(!is_sqs_text("a\u{0}b"));
        assert!(!is_sqs_text("\u{FFFE}"));
    }
}
