//! courier's fields as AMQP properties and headers, and back.

use bytes::Bytes;
use lapin::BasicProperties;
use lapin::message::Delivery as AmqpDelivery;
use lapin::types::{AMQPValue, FieldTable, ShortString};

use courier_core::model::{DeadLetter, PAYLOAD};

pub(super) const CONTENT_TYPE: &str = "content-type";

/// Headers RabbitMQ adds when it dead-letters or redelivers; they describe
/// courier's own tier hops, not the producer's message.
pub(super) fn is_broker_header(name: &str) -> bool {
    name == "x-death"
        || name == "x-delivery-count"
        || name == "x-received-from"
        || name.starts_with("x-first-death-")
        || name.starts_with("x-last-death-")
}

/// An AMQP header value as text; tables and arrays have no text form and
/// are left out.
pub(super) fn value_bytes(value: &AMQPValue) -> Option<Bytes> {
    Some(match value {
        AMQPValue::LongString(s) => Bytes::copy_from_slice(s.as_bytes()),
        AMQPValue::ShortString(s) => Bytes::copy_from_slice(s.as_str().as_bytes()),
        AMQPValue::ByteArray(b) => Bytes::copy_from_slice(b.as_slice()),
        AMQPValue::Boolean(b) => Bytes::from(b.to_string()),
        AMQPValue::ShortShortInt(v) => Bytes::from(v.to_string()),
        AMQPValue::ShortShortUInt(v) => Bytes::from(v.to_string()),
        AMQPValue::ShortInt(v) => Bytes::from(v.to_string()),
        AMQPValue::ShortUInt(v) => Bytes::from(v.to_string()),
        AMQPValue::LongInt(v) => Bytes::from(v.to_string()),
        AMQPValue::LongUInt(v) => Bytes::from(v.to_string()),
        AMQPValue::LongLongInt(v) => Bytes::from(v.to_string()),
        AMQPValue::Float(v) => Bytes::from(v.to_string()),
        AMQPValue::Double(v) => Bytes::from(v.to_string()),
        AMQPValue::Timestamp(v) => Bytes::from(v.to_string()),
        AMQPValue::DecimalValue(d) => {
            Bytes::from((f64::from(d.value) / 10f64.powi(i32::from(d.scale))).to_string())
        }
        AMQPValue::FieldArray(_) | AMQPValue::FieldTable(_) | AMQPValue::Void => return None,
    })
}

pub(super) fn header<'a>(properties: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    properties.headers().as_ref()?.inner().get(name)
}

pub(super) fn header_u32(properties: &BasicProperties, name: &str) -> Option<u32> {
    match header(properties, name)? {
        AMQPValue::LongLongInt(v) => u32::try_from(*v).ok(),
        AMQPValue::LongInt(v) => u32::try_from(*v).ok(),
        AMQPValue::LongUInt(v) => Some(*v),
        other => std::str::from_utf8(&value_bytes(other)?).ok()?.parse().ok(),
    }
}

/// A message as courier's fields: `payload`, `content-type`, then the
/// headers (broker bookkeeping left out).
pub(super) fn fields_of(delivery: &AmqpDelivery) -> Vec<(Bytes, Bytes)> {
    fields_with_body(&delivery.properties, Bytes::copy_from_slice(&delivery.data))
}

/// [`fields_of`] a delivery whose body was taken out of it, so a large one
/// is not held twice.
pub(super) fn fields_with_body(props: &BasicProperties, body: Bytes) -> Vec<(Bytes, Bytes)> {
    let mut fields = vec![(Bytes::from_static(PAYLOAD.as_bytes()), body)];
    if let Some(ct) = props.content_type() {
        fields.push((
            Bytes::from_static(CONTENT_TYPE.as_bytes()),
            Bytes::copy_from_slice(ct.as_str().as_bytes()),
        ));
    }
    if let Some(headers) = props.headers() {
        for (name, value) in headers {
            if is_broker_header(name.as_str()) {
                continue;
            }
            if let Some(value) = value_bytes(value) {
                fields.push((Bytes::copy_from_slice(name.as_str().as_bytes()), value));
            }
        }
    }
    fields
}

/// The properties and body to publish for `fields`: the content type
/// becomes the property, every other field a header, and of the original
/// properties those that describe the message are kept (not `expiration`,
/// which would expire a retry early, nor `user-id`, which RabbitMQ checks
/// against the publishing user).
pub(super) fn message_for(
    fields: &[(Bytes, Bytes)],
    original: Option<&BasicProperties>,
    message_id: &str,
) -> (Bytes, BasicProperties) {
    let mut props = BasicProperties::default().with_delivery_mode(2);
    if let Some(o) = original {
        if let Some(v) = o.content_encoding() {
            props = props.with_content_encoding(v.clone());
        }
        if let Some(v) = o.correlation_id() {
            props = props.with_correlation_id(v.clone());
        }
        if let Some(v) = o.reply_to() {
            props = props.with_reply_to(v.clone());
        }
        if let Some(v) = o.kind() {
            props = props.with_type(v.clone());
        }
        if let Some(v) = o.app_id() {
            props = props.with_app_id(v.clone());
        }
        if let Some(v) = o.priority() {
            props = props.with_priority(*v);
        }
        if let Some(v) = o.timestamp() {
            props = props.with_timestamp(*v);
        }
    }
    if let Ok(id) = ShortString::try_new(message_id) {
        props = props.with_message_id(id);
    }
    // The body is shared, not copied: lapin copies it into frames anyway.
    // The first `payload` field is the body, as `Delivery::from_fields`
    // reads it; a later one is a producer's header of that name.
    let mut body = None;
    let mut headers = FieldTable::default();
    for (name, value) in fields {
        let name = String::from_utf8_lossy(name);
        if name == PAYLOAD && body.is_none() {
            body = Some(value.clone());
            continue;
        }
        if name.eq_ignore_ascii_case(CONTENT_TYPE)
            && let Ok(ct) = std::str::from_utf8(value)
            && let Ok(ct) = ShortString::try_new(ct)
        {
            props = props.with_content_type(ct);
            continue;
        }
        if let Ok(name) = ShortString::try_new(name.as_ref()) {
            headers.insert(name, AMQPValue::LongString(value.to_vec().into()));
        }
    }
    (body.unwrap_or_default(), props.with_headers(headers))
}

/// A stable id for a dead letter someone else wrote without a `message_id`.
pub(super) fn content_id(fields: &[(Bytes, Bytes)]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for (n, v) in fields {
        for byte in n.iter().chain(b"\0").chain(v.iter()).chain(b"\0") {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("fnv-{hash:016x}")
}

pub(super) fn dead_letter_of(delivery: &AmqpDelivery) -> DeadLetter {
    let fields = fields_of(delivery);
    let id = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.to_string())
        .unwrap_or_else(|| content_id(&fields));
    DeadLetter::from_fields(id, fields)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_through_properties() {
        let fields = vec![
            (Bytes::from("payload"), Bytes::from_static(&[0, 255, 1])),
            (Bytes::from("content-type"), Bytes::from("application/json")),
            (Bytes::from("traceparent"), Bytes::from("00-a-b-01")),
            (Bytes::from("courier-attempt"), Bytes::from("2")),
        ];
        let (body, props) = message_for(&fields, None, "id-1");
        assert_eq!(body.as_ref(), [0, 255, 1]);
        assert_eq!(
            props.content_type().as_ref().map(|c| c.as_str()),
            Some("application/json")
        );
        assert_eq!(
            props.message_id().as_ref().map(|c| c.as_str()),
            Some("id-1")
        );
        assert_eq!(header_u32(&props, "courier-attempt"), Some(2));
        assert_eq!(
            header(&props, "traceparent").and_then(value_bytes),
            Some(Bytes::from("00-a-b-01"))
        );
        assert!(header(&props, "content-type").is_none());
    }

    #[test]
    fn a_header_named_payload_stays_a_header_in_a_copy() {
        // A producer's header called `payload` is read after the body's own
        // field; a copy courier publishes (a retry, a dead letter) must keep
        // the body as the body and the header as a header.
        let mut table = FieldTable::default();
        table.insert(
            "payload".into(),
            AMQPValue::LongString(b"not the body".to_vec().into()),
        );
        let props = BasicProperties::default().with_headers(table);
        let fields = fields_with_body(&props, Bytes::from("the body"));
        let (body, copy) = message_for(&fields, None, "id-1");
        assert_eq!(body, Bytes::from("the body"));
        assert_eq!(fields_with_body(&copy, body), fields);
    }

    #[test]
    fn broker_bookkeeping_is_not_a_header() {
        assert!(is_broker_header("x-death"));
        assert!(is_broker_header("x-first-death-queue"));
        assert!(!is_broker_header("x-tenant"));
    }
}
