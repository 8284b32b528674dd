//! An `XREADGROUP` reply read as it arrives from the socket, bounded in
//! bytes: an entry over `--max-body` is counted and its bytes discarded as
//! they come, never buffered whole, and only its id is kept, so the caller
//! can dead-letter it inside Redis (`poison.rs`).
//!
//! The accounting is the one the dead-letter script's `too_large` does: the
//! `payload` field's value is the body, every other field's name and value
//! together are "the rest", and an entry is over when either is over the
//! limit. An entry within the limit costs at most twice the limit in
//! buffered bytes before it is known to be over.
//!
//! RESP2 (`*` arrays, `*-1` for no entries) and RESP3 (`%` maps, `_`) are
//! read alike; an error reply (`-`, `!`) is returned as text.

use bytes::{Buf, Bytes, BytesMut};

use super::entries::Entry;

/// The longest header line (a `*`, `$` or `+` line, an error's text) a
/// reply may have: anything longer is not Redis.
const LONGEST_LINE: usize = 64 * 1024;
/// Field names at most this long are read even in an entry already over
/// the limit, to tell `payload` from the rest in its sizes.
const SHORT_NAME: usize = 64;

/// An entry over the limit: its id and sizes; its fields were discarded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Oversized {
    pub id: String,
    /// The `payload` field's bytes.
    pub body: u64,
    /// Every other field's name and value bytes.
    pub rest: u64,
}

/// What one read handed out.
#[derive(Debug, Default)]
pub(super) struct Batch {
    pub entries: Vec<Entry>,
    pub oversized: Vec<Oversized>,
}

#[derive(Debug)]
pub(super) enum Reply {
    Batch(Batch),
    /// An error reply: `MOVED 1234 10.0.0.1:7000`, `NOGROUP ...`.
    Error(String),
}

/// The bytes are not an `XREADGROUP` reply; the connection cannot be used
/// again.
#[derive(Debug, thiserror::Error)]
#[error("Redis sent a reply courier cannot read as an XREADGROUP answer: {0}")]
pub(super) struct ProtocolError(String);

impl ProtocolError {
    pub(super) fn new(what: String) -> Self {
        Self(what)
    }
}

/// Where a value stands in the reply's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// The whole reply: an array of `[stream, entries]` pairs (RESP2), or a
    /// map of stream to entries (RESP3).
    Top { map: bool },
    /// One `[stream, entries]` pair.
    Stream,
    /// A stream's entries.
    Entries,
    /// One `[id, fields]` entry.
    Entry,
    /// An entry's flat `name, value, ...` list.
    Fields,
}

struct Frame {
    role: Role,
    /// Elements still to come.
    remaining: u64,
    /// Elements seen so far.
    index: u64,
}

/// The entry being read.
#[derive(Default)]
struct Building {
    id: Option<String>,
    fields: Vec<(Bytes, Bytes)>,
    /// The name of the field whose value comes next.
    name: Option<Bytes>,
    /// That field is the body.
    name_is_payload: bool,
    body: u64,
    rest: u64,
    /// Fields were discarded: the entry is over the limit.
    over: bool,
    /// The entry was deleted since it was added (nil fields).
    deleted: bool,
}

impl Building {
    /// What the value that comes next counts toward.
    fn total(&self) -> u64 {
        match self.name_is_payload {
            true => self.body,
            false => self.rest,
        }
    }

    fn total_mut(&mut self) -> &mut u64 {
        match self.name_is_payload {
            true => &mut self.body,
            false => &mut self.rest,
        }
    }

    fn give_up_fields(&mut self) {
        self.over = true;
        self.fields = Vec::new();
        self.name = None;
    }
}

/// One reply in the making. Feed it what the socket gave with
/// [`ReplyParser::parse`] until it returns the reply.
pub(super) struct ReplyParser {
    limit: u64,
    stack: Vec<Frame>,
    batch: Batch,
    entry: Building,
    /// Bytes of a discarded bulk string (and its CRLF) still to come.
    skip: u64,
    /// How many bytes the next step needs in the buffer at least.
    need: usize,
}

/// One token at the front of the buffer.
enum Head {
    /// Not all there yet.
    Incomplete,
    /// `*n` / `%n` (`None` for `*-1`), with the header's length.
    Aggregate {
        len: Option<u64>,
        map: bool,
        used: usize,
    },
    /// `$n` (`None` for `$-1`).
    Bulk { len: Option<u64>, used: usize },
    /// `+text`, `:n`.
    Simple { text: Bytes, used: usize },
    /// `_`.
    Null { used: usize },
    /// `-text` or `!n` with its text.
    Error { text: String, used: usize },
}

impl ReplyParser {
    /// A parser for one reply; fields over `limit` bytes are discarded.
    pub(super) fn new(limit: usize) -> Self {
        Self {
            limit: limit as u64,
            stack: Vec::new(),
            batch: Batch::default(),
            entry: Building::default(),
            skip: 0,
            need: 1,
        }
    }

    /// How many bytes the buffer should hold before the next call can make
    /// progress: the caller reserves room for them.
    pub(super) fn need(&self) -> usize {
        self.need
    }

    /// Consumes from `buf` what it can; returns the reply once it is whole.
    /// What it leaves in `buf` is the start of a token it needs more of.
    pub(super) fn parse(&mut self, buf: &mut BytesMut) -> Result<Option<Reply>, ProtocolError> {
        loop {
            if self.skip > 0 {
                let n = self.skip.min(buf.len() as u64);
                buf.advance(n as usize);
                self.skip -= n;
                if self.skip > 0 {
                    self.need = 1;
                    return Ok(None);
                }
                if let Some(reply) = self.close_value()? {
                    return Ok(Some(reply));
                }
                continue;
            }
            let head = head(buf)?;
            let done = match head {
                Head::Incomplete => {
                    self.need = buf.len() + 1;
                    return Ok(None);
                }
                Head::Error { text, used } => {
                    if !self.stack.is_empty() {
                        return Err(ProtocolError(format!("an error inside the reply: {text}")));
                    }
                    buf.advance(used);
                    return Ok(Some(Reply::Error(text)));
                }
                Head::Aggregate { len, map, used } => {
                    buf.advance(used);
                    self.open(len, map)?
                }
                Head::Null { used } => {
                    buf.advance(used);
                    self.nil()?
                }
                Head::Simple { text, used } => {
                    buf.advance(used);
                    self.string(text)?
                }
                Head::Bulk { len: None, used } => {
                    buf.advance(used);
                    self.nil()?
                }
                Head::Bulk {
                    len: Some(len),
                    used,
                } => match self.keeps(len) {
                    true => {
                        let whole = used + len as usize + 2;
                        if buf.len() < whole {
                            self.need = whole;
                            return Ok(None);
                        }
                        buf.advance(used);
                        let text = buf.split_to(len as usize).freeze();
                        if &buf[..2] != b"\r\n" {
                            return Err(ProtocolError("a bulk string not ended by CRLF".into()));
                        }
                        buf.advance(2);
                        self.string(text)?
                    }
                    false => {
                        buf.advance(used);
                        self.discard(len);
                        self.skip = len + 2;
                        continue;
                    }
                },
            };
            if let Some(reply) = done {
                return Ok(Some(reply));
            }
        }
    }

    /// The role of the value that starts now.
    fn next_role(&self) -> Option<(Role, u64)> {
        self.stack.last().map(|f| (f.role, f.index))
    }

    /// Whether the bulk string of `len` bytes that starts now is kept;
    /// false: it is discarded as it arrives.
    fn keeps(&self, len: u64) -> bool {
        let Some((Role::Fields, index)) = self.next_role() else {
            return true;
        };
        let entry = &self.entry;
        match index % 2 {
            // A name: read when it may be `payload` (which counts toward
            // nothing), or when it is within the limit anyway.
            0 => len as usize <= SHORT_NAME || (!entry.over && len <= self.limit),
            _ => !entry.over && entry.total() + len <= self.limit,
        }
    }

    /// A bulk string of `len` bytes is discarded: it counts, and the entry
    /// is over the limit.
    fn discard(&mut self, len: u64) {
        let index = self.stack.last().map_or(0, |f| f.index);
        let entry = &mut self.entry;
        match index % 2 {
            0 => {
                entry.rest += len;
                entry.name_is_payload = false;
            }
            _ => *entry.total_mut() += len,
        }
        entry.give_up_fields();
    }

    /// A string value (bulk or simple) that was kept.
    fn string(&mut self, text: Bytes) -> Result<Option<Reply>, ProtocolError> {
        let Some((role, index)) = self.next_role() else {
            return Err(ProtocolError("a string where an array was expected".into()));
        };
        match (role, index) {
            (Role::Top { map: true }, i) if i % 2 == 0 => {}
            (Role::Stream, 0) => {}
            (Role::Entry, 0) => {
                self.entry.id = Some(
                    String::from_utf8(text.to_vec())
                        .map_err(|_| ProtocolError("an entry id that is not text".into()))?,
                );
            }
            (Role::Fields, i) if i % 2 == 0 => {
                let entry = &mut self.entry;
                entry.name_is_payload = text.as_ref() == courier_core::model::PAYLOAD.as_bytes();
                if !entry.name_is_payload {
                    entry.rest += text.len() as u64;
                    if entry.rest > self.limit {
                        entry.give_up_fields();
                    }
                }
                if !entry.over {
                    entry.name = Some(text);
                }
            }
            (Role::Fields, _) => {
                let entry = &mut self.entry;
                *entry.total_mut() += text.len() as u64;
                if entry.total() > self.limit {
                    entry.give_up_fields();
                }
                if !entry.over
                    && let Some(name) = entry.name.take()
                {
                    entry.fields.push((name, text));
                }
            }
            (role, i) => {
                return Err(ProtocolError(format!(
                    "a string as element {i} of {role:?}"
                )));
            }
        }
        self.close_value()
    }

    /// `*-1`, `$-1` or `_`.
    fn nil(&mut self) -> Result<Option<Reply>, ProtocolError> {
        match self.next_role() {
            // No entries (a read that found none, or a BLOCK that ended).
            None => Ok(Some(Reply::Batch(std::mem::take(&mut self.batch)))),
            Some((Role::Entry, 1)) => {
                self.entry.deleted = true;
                self.close_value()
            }
            Some((Role::Stream, 1)) | Some((Role::Top { map: true }, _)) => self.close_value(),
            Some((role, i)) => Err(ProtocolError(format!("a nil as element {i} of {role:?}"))),
        }
    }

    /// `*n` or `%n` (`len` None: `*-1`).
    fn open(&mut self, len: Option<u64>, map: bool) -> Result<Option<Reply>, ProtocolError> {
        let Some(len) = len else {
            return self.nil();
        };
        let role = match self.next_role() {
            None => Role::Top { map },
            Some((Role::Top { map: false }, _)) if !map => Role::Stream,
            Some((Role::Top { map: true }, i)) if i % 2 == 1 && !map => Role::Entries,
            Some((Role::Stream, 1)) if !map => Role::Entries,
            Some((Role::Entries, _)) if !map => Role::Entry,
            Some((Role::Entry, 1)) if !map => Role::Fields,
            Some((role, i)) => {
                return Err(ProtocolError(format!(
                    "an aggregate as element {i} of {role:?}"
                )));
            }
        };
        let remaining = match map {
            true => len
                .checked_mul(2)
                .ok_or_else(|| ProtocolError("a map too large".into()))?,
            false => len,
        };
        if role == Role::Entry {
            self.entry = Building::default();
        }
        if role == Role::Fields {
            self.entry.fields = Vec::with_capacity((remaining / 2).min(64) as usize);
        }
        self.stack.push(Frame {
            role,
            remaining,
            index: 0,
        });
        match remaining {
            0 => self.close_frame(),
            _ => Ok(None),
        }
    }

    /// A value of the innermost aggregate ended.
    fn close_value(&mut self) -> Result<Option<Reply>, ProtocolError> {
        let Some(frame) = self.stack.last_mut() else {
            return Err(ProtocolError("a value after the end of the reply".into()));
        };
        frame.index += 1;
        frame.remaining -= 1;
        match frame.remaining {
            0 => self.close_frame(),
            _ => Ok(None),
        }
    }

    /// The innermost aggregate ended; it is itself a value of the one
    /// around it.
    fn close_frame(&mut self) -> Result<Option<Reply>, ProtocolError> {
        let Some(frame) = self.stack.pop() else {
            return Err(ProtocolError("the end of an aggregate never opened".into()));
        };
        if frame.role == Role::Entry {
            let entry = std::mem::take(&mut self.entry);
            let id = entry
                .id
                .ok_or_else(|| ProtocolError("an entry without an id".into()))?;
            if entry.over {
                self.batch.oversized.push(Oversized {
                    id,
                    body: entry.body,
                    rest: entry.rest,
                });
            } else if !entry.deleted {
                self.batch.entries.push((id, entry.fields));
            }
        }
        match self.stack.is_empty() {
            true => Ok(Some(Reply::Batch(std::mem::take(&mut self.batch)))),
            false => self.close_value(),
        }
    }
}

/// Reads the token at the front of `buf` without consuming it.
fn head(buf: &BytesMut) -> Result<Head, ProtocolError> {
    let Some(&kind) = buf.first() else {
        return Ok(Head::Incomplete);
    };
    let Some(end) = memchr::memmem::find(&buf[..buf.len().min(LONGEST_LINE + 3)], b"\r\n") else {
        if buf.len() > LONGEST_LINE + 2 {
            return Err(ProtocolError(format!(
                "a header line longer than {LONGEST_LINE} bytes"
            )));
        }
        return Ok(Head::Incomplete);
    };
    let line = &buf[1..end];
    let used = end + 2;
    let number = || -> Result<Option<u64>, ProtocolError> {
        let text = std::str::from_utf8(line).unwrap_or("");
        match text {
            "-1" => Ok(None),
            _ => text
                .parse()
                .map(Some)
                .map_err(|_| ProtocolError(format!("a length {text:?}"))),
        }
    };
    Ok(match kind {
        b'*' => Head::Aggregate {
            len: number()?,
            map: false,
            used,
        },
        b'%' => Head::Aggregate {
            len: Some(number()?.ok_or_else(|| ProtocolError("a map of length -1".into()))?),
            map: true,
            used,
        },
        b'$' => Head::Bulk {
            len: number()?,
            used,
        },
        b'+' | b':' => Head::Simple {
            text: Bytes::copy_from_slice(line),
            used,
        },
        b'_' => Head::Null { used },
        b'-' => Head::Error {
            text: String::from_utf8_lossy(line).into_owned(),
            used,
        },
        b'!' => {
            let len = number()?.ok_or_else(|| ProtocolError("an error of length -1".into()))?;
            if len > LONGEST_LINE as u64 {
                return Err(ProtocolError(format!("an error of {len} bytes")));
            }
            let whole = used + len as usize + 2;
            if buf.len() < whole {
                return Ok(Head::Incomplete);
            }
            Head::Error {
                text: String::from_utf8_lossy(&buf[used..used + len as usize]).into_owned(),
                used: whole,
            }
        }
        other => {
            return Err(ProtocolError(format!(
                "a value of type {:?}",
                char::from(other)
            )));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(out: &mut Vec<u8>, s: &[u8]) {
        out.extend_from_slice(format!("${}\r\n", s.len()).as_bytes());
        out.extend_from_slice(s);
        out.extend_from_slice(b"\r\n");
    }

    /// An entry's id and its fields.
    type Given<'a> = (&'a str, &'a [(&'a [u8], &'a [u8])]);

    /// An `XREADGROUP` reply for stream `s` with these entries, in RESP2
    /// or RESP3.
    fn reply(resp3: bool, entries: &[Given<'_>]) -> Vec<u8> {
        let mut out = Vec::new();
        match resp3 {
            true => out.extend_from_slice(b"%1\r\n"),
            false => out.extend_from_slice(b"*1\r\n*2\r\n"),
        }
        bulk(&mut out, b"s");
        out.extend_from_slice(format!("*{}\r\n", entries.len()).as_bytes());
        for (id, fields) in entries {
            out.extend_from_slice(b"*2\r\n");
            bulk(&mut out, id.as_bytes());
            out.extend_from_slice(format!("*{}\r\n", fields.len() * 2).as_bytes());
            for (name, value) in *fields {
                bulk(&mut out, name);
                bulk(&mut out, value);
            }
        }
        out
    }

    /// Parses `bytes` fed in pieces cut at `cuts`; checks that nothing is
    /// left over and that the buffer never held an oversized value.
    fn parse_cut(bytes: &[u8], cuts: &[usize], limit: usize) -> Reply {
        let mut parser = ReplyParser::new(limit);
        let mut buf = BytesMut::new();
        let mut from = 0;
        for &to in cuts.iter().chain([bytes.len()].iter()) {
            buf.extend_from_slice(&bytes[from..to]);
            from = to;
            if let Some(reply) = parser.parse(&mut buf).unwrap() {
                assert!(buf.is_empty(), "left over: {buf:?}");
                assert_eq!(to, bytes.len(), "a reply before its end");
                return reply;
            }
            assert!(
                buf.len() <= 3 * limit + LONGEST_LINE,
                "buffered {} bytes",
                buf.len()
            );
        }
        panic!("no reply from {} bytes", bytes.len());
    }

    fn batch(reply: Reply) -> Batch {
        match reply {
            Reply::Batch(b) => b,
            Reply::Error(e) => panic!("an error: {e}"),
        }
    }

    fn ids(entries: &[Entry]) -> Vec<&str> {
        entries.iter().map(|(id, _)| id.as_str()).collect()
    }

    #[test]
    fn a_reply_split_at_every_byte_boundary_reads_the_same() {
        let big = vec![b'x'; 300];
        for resp3 in [false, true] {
            let bytes = reply(
                resp3,
                &[
                    ("1-0", &[(b"payload", b"one"), (b"h", b"v")]),
                    ("2-0", &[(b"payload", &big)]),
                    ("3-0", &[(b"payload", b""), (b"courier-attempt", b"2")]),
                ],
            );
            for cut in 0..bytes.len() {
                let got = batch(parse_cut(&bytes, &[cut], 100));
                assert_eq!(ids(&got.entries), ["1-0", "3-0"], "cut at {cut}");
                assert_eq!(
                    got.entries[0].1,
                    [
                        (Bytes::from("payload"), Bytes::from("one")),
                        (Bytes::from("h"), Bytes::from("v"))
                    ]
                );
                assert_eq!(got.entries[1].1[1].1, Bytes::from("2"));
                assert_eq!(
                    got.oversized,
                    [Oversized {
                        id: "2-0".into(),
                        body: 300,
                        rest: 0
                    }]
                );
            }
            // Byte by byte.
            let every: Vec<usize> = (1..bytes.len()).collect();
            let got = batch(parse_cut(&bytes, &every, 100));
            assert_eq!(ids(&got.entries), ["1-0", "3-0"]);
        }
    }

    #[test]
    fn an_oversized_body_in_the_middle_is_discarded_as_it_arrives() {
        const LIMIT: usize = 1024;
        let big = vec![b'x'; 1 << 20];
        let bytes = reply(
            false,
            &[
                ("1-0", &[(b"payload", b"before")]),
                ("2-0", &[(b"h", b"v"), (b"payload", &big), (b"after", b"x")]),
                ("3-0", &[(b"payload", b"after")]),
            ],
        );
        // In 4 KiB reads, as a socket gives them: the buffer never holds
        // more than a read and a header.
        let cuts: Vec<usize> = (1..bytes.len() / 4096 + 1).map(|i| i * 4096).collect();
        let got = batch(parse_cut(&bytes, &cuts, LIMIT));
        assert_eq!(ids(&got.entries), ["1-0", "3-0"]);
        assert_eq!(
            got.oversized,
            [Oversized {
                id: "2-0".into(),
                body: 1 << 20,
                rest: 2 + 5 + 1
            }]
        );
    }

    #[test]
    fn the_fields_besides_the_body_are_counted_together() {
        let half = vec![b'y'; 60];
        let bytes = reply(
            false,
            &[
                ("1-0", &[(b"a", &half), (b"b", &half)]),
                ("2-0", &[(b"payload", &half), (b"a", &half[..30])]),
                // A name over the limit is discarded too.
                ("3-0", &[(&[b'n'; 200], b"v")]),
                // Two payload fields make one body, as in the script.
                ("4-0", &[(b"payload", &half), (b"payload", &half)]),
            ],
        );
        let got = batch(parse_cut(&bytes, &[], 100));
        assert_eq!(ids(&got.entries), ["2-0"]);
        let over: Vec<(&str, u64, u64)> = got
            .oversized
            .iter()
            .map(|o| (o.id.as_str(), o.body, o.rest))
            .collect();
        assert_eq!(over, [("1-0", 0, 122), ("3-0", 0, 201), ("4-0", 120, 0)]);
    }

    #[test]
    fn an_entry_at_the_limit_is_kept() {
        let exact = vec![b'z'; 100];
        let bytes = reply(true, &[("1-0", &[(b"payload", &exact)])]);
        let got = batch(parse_cut(&bytes, &[], 100));
        assert_eq!(ids(&got.entries), ["1-0"]);
        assert!(got.oversized.is_empty());
    }

    #[test]
    fn nil_replies_are_no_entries() {
        for nil in [&b"*-1\r\n"[..], b"_\r\n", b"*0\r\n", b"%0\r\n"] {
            for cut in 0..nil.len() {
                let got = batch(parse_cut(nil, &[cut], 10));
                assert!(got.entries.is_empty() && got.oversized.is_empty());
            }
        }
        // A stream with no entries, and an entry deleted since (nil fields,
        // in a read of history).
        let mut bytes = b"*1\r\n*2\r\n$1\r\ns\r\n*2\r\n*2\r\n$3\r\n1-0\r\n*-1\r\n".to_vec();
        bytes.extend_from_slice(b"*2\r\n$3\r\n2-0\r\n*2\r\n$7\r\npayload\r\n$1\r\nx\r\n");
        let got = batch(parse_cut(&bytes, &[], 10));
        assert_eq!(ids(&got.entries), ["2-0"]);
        let got = batch(parse_cut(b"*1\r\n*2\r\n$1\r\ns\r\n*0\r\n", &[], 10));
        assert!(got.entries.is_empty());
    }

    #[test]
    fn error_replies_are_returned_as_text() {
        let moved = b"-MOVED 3999 127.0.0.1:6381\r\n";
        for cut in 0..moved.len() {
            match parse_cut(moved, &[cut], 10) {
                Reply::Error(text) => assert_eq!(text, "MOVED 3999 127.0.0.1:6381"),
                other => panic!("{other:?}"),
            }
        }
        let blob = b"!21\r\nNOGROUP no such group\r\n";
        for cut in 0..blob.len() {
            match parse_cut(blob, &[cut], 10) {
                Reply::Error(text) => assert_eq!(text, "NOGROUP no such group"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn what_is_not_an_xreadgroup_reply_is_a_protocol_error() {
        for bad in [
            &b"#t\r\n"[..],
            b":1\r\n",
            b"*1\r\n$1\r\nx\r\n",
            b"*1\r\n*2\r\n$1\r\ns\r\n*1\r\n$1\r\nx\r\n",
            b"*1\r\n*2\r\n$1\r\ns\r\n*1\r\n*2\r\n$3\r\n1-0\r\n*2\r\n-ERR x\r\n",
            b"*x\r\n",
            b"$3\r\nabcde\r\n",
        ] {
            let mut parser = ReplyParser::new(10);
            let mut buf = BytesMut::from(bad);
            assert!(parser.parse(&mut buf).is_err(), "{bad:?}");
        }
    }
}
