//! Reading Redis replies into stream entries and numbers.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use redis::Value;

/// A stream entry: its id and its fields in stored order.
pub(super) type Entry = (String, Vec<(Bytes, Bytes)>);

pub(super) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

pub(super) fn as_bytes(v: &Value) -> Option<Bytes> {
    match v {
        Value::BulkString(b) => Some(Bytes::copy_from_slice(b)),
        Value::SimpleString(s) => Some(Bytes::copy_from_slice(s.as_bytes())),
        Value::Int(i) => Some(Bytes::from(i.to_string())),
        _ => None,
    }
}

pub(super) fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        other => std::str::from_utf8(&as_bytes(other)?).ok()?.parse().ok(),
    }
}

/// Takes a string reply by value so a body is moved into `Bytes`, not copied.
pub(super) fn into_bytes(v: Value) -> Option<Bytes> {
    match v {
        Value::BulkString(b) => Some(Bytes::from(b)),
        other => as_bytes(&other),
    }
}

/// `[[id, [field, value, ...]], ...]`; entries deleted since (nil fields)
/// are skipped.
pub(super) fn parse_entries(v: Value) -> Vec<Entry> {
    let Value::Array(entries) = v else {
        return Vec::new();
    };
    entries
        .into_iter()
        .filter_map(|entry| {
            let Value::Array(parts) = entry else {
                return None;
            };
            let mut parts = parts.into_iter();
            let id = match parts.next()? {
                // An id is ASCII: the reply's own buffer becomes the String.
                Value::BulkString(b) => String::from_utf8(b)
                    .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()),
                other => String::from_utf8_lossy(&as_bytes(&other)?).into_owned(),
            };
            let Value::Array(flat) = parts.next()? else {
                return None;
            };
            let mut fields = Vec::with_capacity(flat.len() / 2);
            let mut flat = flat.into_iter();
            while let (Some(name), Some(value)) = (flat.next(), flat.next()) {
                fields.push((into_bytes(name)?, into_bytes(value)?));
            }
            Some((id, fields))
        })
        .collect()
}

/// An `XREADGROUP`/`XREAD` reply: `[[stream, entries]]` (RESP2) or a map.
pub(super) fn parse_read_reply(v: Value) -> Vec<Entry> {
    match v {
        Value::Array(streams) => streams
            .into_iter()
            .flat_map(|s| match s {
                Value::Array(parts) => parts
                    .into_iter()
                    .nth(1)
                    .map(parse_entries)
                    .unwrap_or_default(),
                _ => Vec::new(),
            })
            .collect(),
        Value::Map(streams) => streams
            .into_iter()
            .flat_map(|(_, e)| parse_entries(e))
            .collect(),
        _ => Vec::new(),
    }
}

/// The stream id's first part is the time it was added, in ms.
pub(super) fn id_time(id: &str) -> Option<SystemTime> {
    let ms: u64 = id.split('-').next()?.parse().ok()?;
    Some(UNIX_EPOCH + Duration::from_millis(ms))
}
