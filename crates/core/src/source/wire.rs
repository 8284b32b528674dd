//! A message's fields as one binary value: a MessagePack array of strings
//! `[name, value, name, value, ...]`, the member of a Redis retry set.
//! Strings of bytes, so bodies that are not UTF-8 survive unchanged. Only
//! courier reads it back (the retry mover decodes it and writes the fields
//! with a plain `XADD`); the shorter forms Lua's `cmsgpack.pack` writes are
//! still read, for retries an earlier version stored.

use bytes::Bytes;

const ARRAY32: u8 = 0xdd;
const STR32: u8 = 0xdb;

pub fn encode_fields(fields: &[(Bytes, Bytes)]) -> Vec<u8> {
    let size: usize = fields.iter().map(|(n, v)| n.len() + v.len() + 10).sum();
    let mut out = Vec::with_capacity(size + 5);
    out.push(ARRAY32);
    out.extend_from_slice(&((fields.len() * 2) as u32).to_be_bytes());
    for (name, value) in fields {
        for part in [name, value] {
            out.push(STR32);
            out.extend_from_slice(&(part.len() as u32).to_be_bytes());
            out.extend_from_slice(part);
        }
    }
    out
}

/// Reads what [`encode_fields`] wrote, and the shorter MessagePack string and
/// array forms Lua's `cmsgpack.pack` may write.
pub fn decode_fields(data: &Bytes) -> Option<Vec<(Bytes, Bytes)>> {
    let mut at = 0usize;
    let take = |at: &mut usize, n: usize| -> Option<Bytes> {
        let end = at.checked_add(n)?;
        let slice = data.get(*at..end)?;
        *at = end;
        Some(data.slice_ref(slice))
    };
    let be = |b: &[u8]| b.iter().fold(0usize, |acc, x| (acc << 8) | usize::from(*x));
    let marker = *data.first()?;
    at += 1;
    let count = match marker {
        0x90..=0x9f => usize::from(marker & 0x0f),
        0xdc => be(&take(&mut at, 2)?),
        ARRAY32 => be(&take(&mut at, 4)?),
        _ => return None,
    };
    if count % 2 != 0 {
        return None;
    }
    // Every item takes at least one byte: a header claiming more items than
    // there are bytes left must not reserve memory for them (a five-byte
    // record once asked for 128 GiB and aborted the process).
    let mut items = Vec::with_capacity(count.min(data.len() - at));
    for _ in 0..count {
        let marker = *data.get(at)?;
        at += 1;
        let len = match marker {
            0xa0..=0xbf => usize::from(marker & 0x1f),
            0xd9 | 0xc4 => be(&take(&mut at, 1)?),
            0xda | 0xc5 => be(&take(&mut at, 2)?),
            STR32 | 0xc6 => be(&take(&mut at, 4)?),
            _ => return None,
        };
        items.push(take(&mut at, len)?);
    }
    if at != data.len() {
        return None;
    }
    let mut fields = Vec::with_capacity(count / 2);
    let mut it = items.into_iter();
    while let (Some(n), Some(v)) = (it.next(), it.next()) {
        fields.push((n, v));
    }
    Some(fields)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_binary_fields() {
        let fields = vec![
            (
                Bytes::from("payload"),
                Bytes::from(vec![0u8, 159, 146, 150, 255]),
            ),
            (Bytes::from("content-type"), Bytes::from("application/json")),
            (Bytes::from("empty"), Bytes::new()),
        ];
        let encoded = Bytes::from(encode_fields(&fields));
        assert_eq!(decode_fields(&encoded), Some(fields));
    }

    #[test]
    fn reads_short_forms() {
        let data = Bytes::from_static(&[0x92, 0xa1, b'a', 0xd9, 2, b'b', b'c']);
        assert_eq!(
            decode_fields(&data),
            Some(vec![(Bytes::from("a"), Bytes::from("bc"))])
        );
    }

    #[test]
    fn a_huge_array_count_is_refused_without_reserving_it() {
        let data = Bytes::from_static(&[ARRAY32, 0xff, 0xff, 0xff, 0xfe]);
        assert_eq!(decode_fields(&data), None);
    }

    #[test]
    fn refuses_garbage() {
        for data in [&b""[..], &[0x91, 0xa1, b'a'], &[0x92, 0xa5, b'a'], &[0x01]] {
            assert_eq!(decode_fields(&Bytes::copy_from_slice(data)), None);
        }
    }
}
