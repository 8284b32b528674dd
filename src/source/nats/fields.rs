//! Fields ↔ NATS headers: the body is the payload field, every other
//! field a header.

use std::str::FromStr;

use async_nats::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;

use crate::model::PAYLOAD;

/// The subject a message was published to; kept in dead letters for replay.
pub(super) const F_SUBJECT: &str = "courier-subject";

/// A header value NATS can carry: no CR or LF.
fn header_value(value: &[u8]) -> HeaderValue {
    let text = String::from_utf8_lossy(value).replace(['\r', '\n'], " ");
    HeaderValue::from_str(&text).unwrap_or_default()
}

/// Fields as NATS headers; the body is returned apart. Names NATS cannot
/// carry are left out (the forwarder would drop them anyway), and so are
/// `Nats-*` headers, which steer the publish (a `Nats-Msg-Id` would make
/// JetStream drop a retry copy as a duplicate).
pub(super) fn to_headers(fields: &[(Bytes, Bytes)]) -> (Bytes, HeaderMap) {
    let mut body = Bytes::new();
    let mut headers = HeaderMap::new();
    for (name, value) in fields {
        if name.as_ref() == PAYLOAD.as_bytes() {
            body = value.clone();
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
    (body, headers)
}

fn text(name: &HeaderName) -> &str {
    name.as_ref()
}

pub(super) fn from_headers(payload: &Bytes, headers: Option<&HeaderMap>) -> Vec<(Bytes, Bytes)> {
    let mut fields = vec![(Bytes::from_static(PAYLOAD.as_bytes()), payload.clone())];
    if let Some(headers) = headers {
        let mut named: Vec<_> = headers.iter().collect();
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

pub(super) fn field<'a>(fields: &'a [(Bytes, Bytes)], name: &str) -> Option<&'a str> {
    fields
        .iter()
        .find(|(n, _)| n.as_ref() == name.as_bytes())
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
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
}
