//! Where a replayed message has been: its earlier dead letters, carried in
//! `courier-history` from each replay to the next dead letter, so that the
//! last one shows them all. The format is compact JSON, written and read
//! here without a JSON library: the model is a leaf that every broker crate
//! compiles after, and the format is courier's own, a flat array of flat
//! objects.

use std::fmt::Write;

/// The most earlier dead letters `courier-history` keeps: the newest.
pub const HISTORY_ENTRIES: usize = 10;

/// The longest `courier-history`, in bytes: entries are dropped, oldest
/// first, until it fits. Pub/Sub cuts every `courier-*` attribute value to
/// 1 KiB, its limit on one and the smallest any broker sets on a field, and
/// a cut history would no longer match the seal over it. Ten entries fit
/// where dead-letter ids are short (NATS and embedded sequence numbers);
/// with Redis's ids about nine do, with SQS's 36-character ids seven.
pub const HISTORY_BYTES: usize = 1024;

/// One earlier dead-lettering of a replayed message: the dead letter it was
/// replayed from, as its record had it. The JSON keys are in parentheses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryEntry {
    /// The dead letter's id in its dead-letter queue (`id`).
    pub id: String,
    /// Its `courier-reason` (`reason`).
    pub reason: String,
    /// Its `courier-status` (`status`, a number; left out when there was
    /// no answer).
    pub status: Option<u16>,
    /// Its `courier-attempts` (`attempts`).
    pub attempts: u32,
    /// Its `courier-last-attempt-at`, as stored (`at`, RFC 3339).
    pub at: String,
}

/// A replayed message's earlier dead letters, oldest first: the value of
/// `courier-history`, at most [`HISTORY_ENTRIES`] of them in at most
/// [`HISTORY_BYTES`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct History(pub Vec<HistoryEntry>);

impl History {
    /// Reads a `courier-history` value; `None` when it is not one.
    /// Keys this release does not know are skipped, so a history a later
    /// release wrote with more of them still reads.
    pub fn parse(text: &str) -> Option<Self> {
        let mut reader = Reader {
            text: text.as_bytes(),
            at: 0,
        };
        if !reader.eat(b'[') {
            return None;
        }
        let mut entries = Vec::new();
        if !reader.eat(b']') {
            loop {
                entries.push(reader.entry()?);
                if reader.eat(b']') {
                    break;
                }
                if !reader.eat(b',') {
                    return None;
                }
            }
        }
        reader.skip_space();
        (reader.at == reader.text.len()).then_some(Self(entries))
    }

    /// The compact JSON that `courier-history` holds.
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(self.json_len());
        out.push('[');
        for (i, entry) in self.0.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            entry.write_json(&mut out);
        }
        out.push(']');
        out
    }

    fn json_len(&self) -> usize {
        let entries: usize = self.0.iter().map(HistoryEntry::json_len).sum();
        2 + entries + self.0.len().saturating_sub(1)
    }

    /// This history with `entry` as its newest, and its oldest entries
    /// dropped until it is within [`HISTORY_ENTRIES`] and
    /// [`HISTORY_BYTES`]. An entry too long to fit alone (not one courier
    /// made: its fields are short) leaves the history empty.
    pub fn extended(mut self, entry: HistoryEntry) -> Self {
        self.0.push(entry);
        let over = self.0.len().saturating_sub(HISTORY_ENTRIES);
        self.0.drain(..over);
        let mut len = self.json_len();
        let mut dropped = 0;
        while len > HISTORY_BYTES && dropped < self.0.len() {
            len -= self.0[dropped].json_len() + usize::from(self.0.len() - dropped > 1);
            dropped += 1;
        }
        self.0.drain(..dropped);
        self
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl HistoryEntry {
    fn write_json(&self, out: &mut String) {
        out.push_str("{\"id\":");
        push_string(out, &self.id);
        out.push_str(",\"reason\":");
        push_string(out, &self.reason);
        if let Some(status) = self.status {
            let _ = write!(out, ",\"status\":{status}");
        }
        let _ = write!(out, ",\"attempts\":{}", self.attempts);
        out.push_str(",\"at\":");
        push_string(out, &self.at);
        out.push('}');
    }

    fn json_len(&self) -> usize {
        let mut out = String::new();
        self.write_json(&mut out);
        out.len()
    }
}

/// `text` as a JSON string. Only what JSON requires is escaped, and control
/// characters, so the value is one line on every broker (a NATS header
/// cannot hold a line break).
fn push_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() && (c as u32) < 0x80 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A JSON value an entry's key may have.
enum Scalar {
    Text(String),
    Number(u64),
    Null,
    /// `true` or `false`: no key of an entry has one.
    Flag,
}

/// Reads the JSON of a history: an array of objects whose values are
/// strings, whole numbers, `null`, `true` or `false`.
struct Reader<'a> {
    text: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn skip_space(&mut self) {
        while matches!(self.text.get(self.at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// Takes `byte` after any space, if it is next.
    fn eat(&mut self, byte: u8) -> bool {
        self.skip_space();
        let next = self.text.get(self.at) == Some(&byte);
        self.at += usize::from(next);
        next
    }

    fn next(&mut self) -> Option<u8> {
        let byte = *self.text.get(self.at)?;
        self.at += 1;
        Some(byte)
    }

    fn entry(&mut self) -> Option<HistoryEntry> {
        if !self.eat(b'{') {
            return None;
        }
        let (mut id, mut reason, mut status, mut attempts, mut at) = (None, None, None, None, None);
        if !self.eat(b'}') {
            loop {
                let key = self.string()?;
                if !self.eat(b':') {
                    return None;
                }
                match (key.as_str(), self.scalar()?) {
                    ("id", Scalar::Text(v)) => id = Some(v),
                    ("reason", Scalar::Text(v)) => reason = Some(v),
                    ("status", Scalar::Number(n)) => status = Some(u16::try_from(n).ok()?),
                    ("status", Scalar::Null) => {}
                    ("attempts", Scalar::Number(n)) => attempts = Some(u32::try_from(n).ok()?),
                    ("at", Scalar::Text(v)) => at = Some(v),
                    ("id" | "reason" | "status" | "attempts" | "at", _) => return None,
                    _ => {}
                }
                if self.eat(b'}') {
                    break;
                }
                if !self.eat(b',') {
                    return None;
                }
            }
        }
        Some(HistoryEntry {
            id: id?,
            reason: reason?,
            status,
            attempts: attempts?,
            at: at?,
        })
    }

    fn scalar(&mut self) -> Option<Scalar> {
        self.skip_space();
        match *self.text.get(self.at)? {
            b'"' => self.string().map(Scalar::Text),
            b'0'..=b'9' => {
                let start = self.at;
                while self.text.get(self.at).is_some_and(u8::is_ascii_digit) {
                    self.at += 1;
                }
                let digits = std::str::from_utf8(&self.text[start..self.at]).ok()?;
                digits.parse().ok().map(Scalar::Number)
            }
            _ => {
                let (word, scalar) = [
                    ("null", Scalar::Null),
                    ("true", Scalar::Flag),
                    ("false", Scalar::Flag),
                ]
                .into_iter()
                .find(|(w, _)| self.text[self.at..].starts_with(w.as_bytes()))?;
                self.at += word.len();
                Some(scalar)
            }
        }
    }

    fn string(&mut self) -> Option<String> {
        if !self.eat(b'"') {
            return None;
        }
        let mut out = String::new();
        let mut run = self.at;
        loop {
            match self.next()? {
                b'"' => {
                    out.push_str(std::str::from_utf8(&self.text[run..self.at - 1]).ok()?);
                    return Some(out);
                }
                b'\\' => {
                    out.push_str(std::str::from_utf8(&self.text[run..self.at - 1]).ok()?);
                    out.push(self.escape()?);
                    run = self.at;
                }
                0..0x20 => return None,
                _ => {}
            }
        }
    }

    /// The character of an escape, after its backslash.
    fn escape(&mut self) -> Option<char> {
        Some(match self.next()? {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let unit = self.hex4()?;
                if (0xD800..0xDC00).contains(&unit) {
                    if self.next()? != b'\\' || self.next()? != b'u' {
                        return None;
                    }
                    let low = self.hex4()?;
                    if !(0xDC00..0xE000).contains(&low) {
                        return None;
                    }
                    char::from_u32(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00))?
                } else {
                    char::from_u32(unit)?
                }
            }
            _ => return None,
        })
    }

    fn hex4(&mut self) -> Option<u32> {
        let digits = self.text.get(self.at..self.at + 4)?;
        if !digits.iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        self.at += 4;
        u32::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, status: Option<u16>) -> HistoryEntry {
        HistoryEntry {
            id: id.into(),
            reason: "permanent-status".into(),
            status,
            attempts: 1,
            at: "2026-05-01T10:00:00.000Z".into(),
        }
    }

    #[test]
    fn a_history_is_compact_json_and_reads_back() {
        let history = History(vec![entry("1-0", Some(400)), entry("2-0", None)]);
        let json = history.to_json();
        assert_eq!(
            json,
            r#"[{"id":"1-0","reason":"permanent-status","status":400,"attempts":1,"at":"2026-05-01T10:00:00.000Z"},{"id":"2-0","reason":"permanent-status","attempts":1,"at":"2026-05-01T10:00:00.000Z"}]"#
        );
        assert_eq!(json.len(), history.json_len());
        assert_eq!(History::parse(&json), Some(history));
        assert_eq!(History::parse("[]"), Some(History::default()));
        assert_eq!(History::default().to_json(), "[]");
    }

    #[test]
    fn odd_text_survives_the_round_trip_on_one_line() {
        let odd = entry("a \"quoted\"\\ id\r\n\t\u{1}, 😀 é", Some(418));
        let json = History(vec![odd.clone()]).to_json();
        assert!(!json.contains(['\r', '\n', '\u{1}']), "{json}");
        assert_eq!(History::parse(&json), Some(History(vec![odd])));
        // Escapes another writer may use, spaces between tokens, and keys
        // this release does not know.
        let other = r#" [ { "id" : "\u0031-\ud83d\ude00\/" , "reason":"x", "status":null,
            "attempts":2, "at":"t", "new":true, "more":12 } ] "#;
        let read = History::parse(other).unwrap();
        assert_eq!(read.0[0].id, "1-😀/");
        assert_eq!(read.0[0].status, None);
        assert_eq!(read.0[0].attempts, 2);
    }

    #[test]
    fn what_is_not_a_history_reads_as_none() {
        for text in [
            "",
            "3",
            "[",
            "[{}]",
            r#"[{"id":"1","reason":"r","attempts":1}]"#,
            r#"[{"id":1,"reason":"r","attempts":1,"at":"t"}]"#,
            r#"[{"id":"1","reason":"r","attempts":-1,"at":"t"}]"#,
            r#"[{"id":"1","reason":"r","status":70000,"attempts":1,"at":"t"}]"#,
            r#"[{"id":"1","reason":"r","attempts":1,"at":"t"}] x"#,
            r#"[{"id":"1","reason":"r","attempts":1,"at":"t"},]"#,
            r#"[{"id":"1","reason":"r","attempts":1,"at":"t","x":[1]}]"#,
            r#"[{"id":"\ud83d","reason":"r","attempts":1,"at":"t"}]"#,
            "[{\"id\":\"a\nb\",\"reason\":\"r\",\"attempts\":1,\"at\":\"t\"}]",
        ] {
            assert_eq!(History::parse(text), None, "{text:?}");
        }
    }

    /// A message replayed forever carries the newest ten entries, within
    /// 1 KiB whatever the ids are like, the oldest dropped first.
    #[test]
    fn a_history_keeps_the_newest_entries_within_its_bounds() {
        let mut history = History::default();
        for i in 0..25 {
            history = history.extended(entry(&i.to_string(), Some(400)));
            assert!(history.to_json().len() <= HISTORY_BYTES);
        }
        let ids: Vec<&str> = history.0.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(
            ids,
            ["15", "16", "17", "18", "19", "20", "21", "22", "23", "24"]
        );
        // SQS's ids: fewer fit.
        let mut history = History::default();
        for i in 0..25 {
            let id = format!("0b6f3a4e-2c1d-4e8f-9a7b-1c2d3e4f{i:04}");
            history = history.extended(HistoryEntry {
                reason: "attempts-exhausted".into(),
                ..entry(&id, Some(503))
            });
            let json = history.to_json();
            assert!(json.len() <= HISTORY_BYTES, "{}", json.len());
            assert_eq!(History::parse(&json).as_ref(), Some(&history));
        }
        assert_eq!(history.0.len(), 7);
        assert!(history.0.last().unwrap().id.ends_with("0024"));
        // One entry too long to fit alone leaves none.
        let history = History::default().extended(entry(&"x".repeat(HISTORY_BYTES), None));
        assert!(history.is_empty());
    }
}
