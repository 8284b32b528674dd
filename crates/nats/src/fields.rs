//! Fields ↔ NATS headers: the body is the payload field, every other
//! field a header; and the key of the seal on the copies courier stores.

use std::str::FromStr;

use async_nats::jetstream::Context;
use async_nats::jetstream::kv::CreateErrorKind;
use async_nats::jetstream::stream::{Config as StreamConfig, DiscardPolicy, StorageType};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;

use courier_core::model::PAYLOAD;
use courier_core::source::SourceError;
use courier_core::source::shared::Seal;

pub(super) use courier_core::source::shared::F_SUBJECT;

/// A header value NATS can carry: no CR or LF.
fn header_value(value: &[u8]) -> HeaderValue {
    let text = String::from_utf8_lossy(value).replace(['\r', '\n'], " ");
    HeaderValue::from_str(&text).unwrap_or_default()
}

/// Fields as NATS headers; the body is returned apart. Names NATS cannot
/// carry are left out (the forwarder would drop them anyway), and so are
/// `Nats-*` headers, which steer the publish (a `Nats-Msg-Id` would make
/// JetStream drop a retry copy as a duplicate). The first `payload` field
/// is the body, as [`Delivery::from_fields`](courier_core::model::Delivery) reads
/// it; a later one is a producer's header of that name and stays a header.
pub(super) fn to_headers(fields: &[(Bytes, Bytes)]) -> (Bytes, HeaderMap) {
    let mut body = None;
    let mut headers = HeaderMap::new();
    for (name, value) in fields {
        if name.as_ref() == PAYLOAD.as_bytes() && body.is_none() {
            body = Some(value.clone());
            continue;
        }
        let name = String::from_utf8_lossy(name);
        if name.to_ascii_lowercase().starts_with("nats-") {
            continue;
        }
        match HeaderName::from_str(&name) {
            Ok(n) => headers.append(n, header_value(value)),
            Err(_) => {
                tracing::debug!(header = %name, "a header name NATS cannot carry is left out")
            }
        }
    }
    (body.unwrap_or_default(), headers)
}

fn text(name: &HeaderName) -> &str {
    name.as_ref()
}

/// A `Nats-Expected-*` header: a precondition the server checks when it
/// stores the message, not part of the message.
fn is_publish_precondition(name: &HeaderName) -> bool {
    const PREFIX: &[u8] = b"nats-expected-";
    let name = text(name).as_bytes();
    name.len() >= PREFIX.len() && name[..PREFIX.len()].eq_ignore_ascii_case(PREFIX)
}

/// A stored message as fields: its payload and headers, without the
/// publish preconditions (`Nats-Expected-*`). A copy courier publishes
/// (a retry while the app was unreachable) goes without any `Nats-*`
/// header, so keeping them would show the app a header on one attempt that
/// the later ones lack.
pub(super) fn from_headers(payload: &Bytes, headers: Option<&HeaderMap>) -> Vec<(Bytes, Bytes)> {
    let mut fields = vec![(Bytes::from_static(PAYLOAD.as_bytes()), payload.clone())];
    if let Some(headers) = headers {
        let mut named: Vec<_> = headers
            .iter()
            .filter(|(name, _)| !is_publish_precondition(name))
            .collect();
        named.sort_by(|(a, _), (b, _)| text(a).cmp(text(b)));
        for (name, values) in named {
            for value in values {
                fields.push((
                    Bytes::copy_from_slice(text(name).as_bytes()),
                    Bytes::copy_from_slice(value.as_str().as_bytes()),
                ));
            }
        }
    }
    fields
}

pub(super) use courier_core::source::shared::field;

/// The key-value bucket that holds the seal key of every stream courier
/// consumes, one key per stream (named after it).
pub(super) const SEAL_BUCKET: &str = "courier-seal-keys";

/// The seal key of stream `queue`, made on first use. The bucket is
/// created when missing; a key is created only when there is none
/// (`create` is atomic), so replicas starting together agree on it.
pub(super) async fn seal_of(
    js: &Context,
    queue: &str,
    replicas: usize,
) -> Result<Seal, SourceError> {
    let refused = |e: &dyn std::fmt::Display| {
        SourceError::broker(format!(
            "cannot use the key-value bucket {SEAL_BUCKET:?} that holds courier's seal keys ({e}); let courier's NATS user create it and write to it, or create it (nats kv add {SEAL_BUCKET})"
        ))
    };
    let store = match js.get_key_value(SEAL_BUCKET).await {
        Ok(store) => store,
        Err(_) => {
            // The bucket's stream as `nats kv add` makes it, created
            // directly: async-nats' `create_key_value` first asks for the
            // account's info, and fails to parse a 2.9 server's answer.
            let config = StreamConfig {
                name: format!("KV_{SEAL_BUCKET}"),
                description: Some(
                    "courier: the key of the seal on the copies courier stores, per stream".into(),
                ),
                subjects: vec![format!("$KV.{SEAL_BUCKET}.>")],
                max_messages_per_subject: 1,
                storage: StorageType::File,
                num_replicas: replicas,
                allow_rollup: true,
                deny_delete: true,
                allow_direct: true,
                discard: DiscardPolicy::New,
                ..Default::default()
            };
            // Another replica may have created it meanwhile.
            let created = js.create_stream(config).await.err();
            js.get_key_value(SEAL_BUCKET)
                .await
                .map_err(|e| match &created {
                    Some(created) => refused(created),
                    None => refused(&e),
                })?
        }
    };
    let key = stream_key(queue);
    match store.create(&key, Seal::new_secret().into()).await {
        Ok(_) => {}
        Err(e) if e.kind() == CreateErrorKind::AlreadyExists => {}
        Err(e) => return Err(refused(&e)),
    }
    let secret = store
        .get(&key)
        .await
        .map_err(|e| refused(&e))?
        .ok_or_else(|| refused(&format!("key {key:?} is missing")))?;
    Seal::new(&secret).map_err(|e| {
        SourceError::broker(format!(
            "the seal key {key:?} in bucket {SEAL_BUCKET:?} is not one courier wrote ({e}); delete it and courier makes a new one"
        ))
    })
}

/// A stream as a key of courier's buckets: its key in [`SEAL_BUCKET`],
/// and the first token of its keys in the job bucket. Its name when that
/// is a valid key, else `hex.<its name in hex>` (a stream name has no `.`,
/// so the two forms never meet).
pub(super) fn stream_key(queue: &str) -> String {
    let plain = queue
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_=/".contains(&b));
    if plain && !queue.is_empty() {
        return queue.to_string();
    }
    let hex: String = queue.bytes().map(|b| format!("{b:02x}")).collect();
    format!("hex.{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_drop_what_nats_cannot_carry() {
        let fields = vec![
            (Bytes::from("payload"), Bytes::from_static(&[0, 255])),
            (Bytes::from("content-type"), Bytes::from("text/plain")),
            (
                Bytes::from("courier-response-excerpt"),
                Bytes::from("a\r\nb"),
            ),
            (Bytes::from("Nats-Msg-Id"), Bytes::from("dedupe-me")),
            (Bytes::from("bad:name"), Bytes::from("x")),
        ];
        let (body, headers) = to_headers(&fields);
        assert_eq!(body, Bytes::from_static(&[0, 255]));
        let back = from_headers(&body, Some(&headers));
        assert_eq!(field(&back, "content-type"), Some("text/plain"));
        assert_eq!(field(&back, "courier-response-excerpt"), Some("a  b"));
        assert_eq!(field(&back, "Nats-Msg-Id"), None);
        assert_eq!(back.len(), 3);
    }

    #[test]
    fn a_header_named_payload_stays_a_header_in_a_copy() {
        // A producer's header called `payload` is read after the body's own
        // field; a copy courier stores (a retry, a dead letter) must keep
        // the body as the body and the header as a header.
        let mut headers = HeaderMap::new();
        headers.insert("payload", "not the body");
        headers.insert("x-id", "7");
        let fields = from_headers(&Bytes::from("the body"), Some(&headers));
        let (body, copy) = to_headers(&fields);
        assert_eq!(body, Bytes::from("the body"));
        assert_eq!(from_headers(&body, Some(&copy)), fields);
    }

    #[test]
    fn publish_preconditions_are_not_read_as_headers() {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Expected-Stream", "orders");
        headers.insert("nats-expected-last-sequence", "41");
        headers.insert("Nats-Msg-Id", "order-42");
        headers.insert("content-type", "application/json");
        let fields = from_headers(&Bytes::from("{}"), Some(&headers));
        assert_eq!(field(&fields, "Nats-Expected-Stream"), None);
        assert_eq!(field(&fields, "nats-expected-last-sequence"), None);
        assert_eq!(field(&fields, "Nats-Msg-Id"), Some("order-42"));
        assert_eq!(field(&fields, "content-type"), Some("application/json"));
        assert_eq!(field(&fields, "payload"), Some("{}"));
        assert_eq!(fields.len(), 3);
    }

    #[test]
    fn every_stream_name_is_a_seal_key() {
        assert_eq!(stream_key("orders"), "orders");
        assert_eq!(stream_key("order-s_1"), "order-s_1");
        assert_eq!(stream_key("zamówienia"), "hex.7a616dc3b37769656e6961");
        assert_eq!(stream_key("a b"), "hex.612062");
    }
}
