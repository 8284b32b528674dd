//! The seal on the copies courier stores: proof that a `courier-*` state
//! (attempt, first attempt, enqueue time, deliveries, the lineage of a
//! replay, the digest an edit keeps) was written by courier and not by a producer. Every broker that stores copies uses it.

use std::path::Path;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use ring::hmac;

use super::shared::{F_RETRY_AT, F_SUBJECT, without};
use crate::model::{
    F_ATTEMPT, F_DELIVERIES, F_EDITED_FROM_DIGEST, F_ENQUEUED_AT, F_FIRST_ATTEMPT_AT, F_HISTORY,
    F_LEGACY_REPLAYS, F_MESSAGE_ID, F_REPLAY_COUNT, F_REPLAYED_FROM, F_SEAL,
};

/// The `courier-*` fields that are courier's state about a stored copy,
/// in the order the seal covers them. Redis's scripts list them too
/// (`redis/poison.rs`), in the same order. A field is covered only where
/// present, so a copy stored before `courier-enqueued-at` or the lineage
/// fields were added still opens; new fields go at the end. The old
/// `courier-replays` stays covered so that a copy an earlier release
/// sealed with it keeps its count.
pub const STATE_FIELDS: [&str; 12] = [
    F_MESSAGE_ID,
    F_ATTEMPT,
    F_FIRST_ATTEMPT_AT,
    F_RETRY_AT,
    F_DELIVERIES,
    F_LEGACY_REPLAYS,
    F_SUBJECT,
    F_ENQUEUED_AT,
    F_REPLAY_COUNT,
    F_REPLAYED_FROM,
    F_HISTORY,
    F_EDITED_FROM_DIGEST,
];

/// The length of a seal key in bytes; at most one SHA-1 block (64), so
/// that the HMAC pads are the key itself, padded (see [`Seal::pads`]).
pub const SEAL_KEY_BYTES: usize = 32;

/// Proof that courier wrote the `courier-*` state of a copy it stored
/// (a retry, a re-published redelivery, a replayed dead letter): the field
/// `courier-seal`, an HMAC over [`STATE_FIELDS`]. A producer can write any
/// `courier-*` field, but not a seal: a copy without a valid one is a new
/// message, and its `courier-*` fields are dropped ([`Seal::open`]).
///
/// The keys are either the one random key kept in the broker per queue
/// ([`Seal::new`]; its seals carry no id), or the keys of a file, each
/// with an id and a time it comes into force ([`Seal::parse_keys`]; its
/// seals say `<id>:<hex>`). Of a file's keys, the newest in force signs; a
/// key whose time has not come is accepted but does not sign yet, so
/// every replica knows it before any uses it; a key replaced by a newer
/// one is still accepted for `window` after the newer one came into force,
/// so copies sealed before a rotation keep their state.
///
/// HMAC-SHA1, because Redis's scripts must check a seal too (a poison pill
/// is dead-lettered inside Redis) and SHA-1 is the one hash they have
/// (`redis.sha1hex`); an HMAC does not rely on the hash's collision
/// resistance, only on it being a pseudo-random function.
pub struct Seal {
    /// By the time each comes into force, oldest first.
    keys: Vec<SealKey>,
    window: Duration,
}

struct SealKey {
    /// None for the broker-kept key.
    id: Option<String>,
    since: SystemTime,
    key: hmac::Key,
    secret: Vec<u8>,
}

impl std::fmt::Debug for Seal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<&str> = self.keys.iter().filter_map(|k| k.id.as_deref()).collect();
        write!(f, "Seal(keys {ids:?}, ..)")
    }
}

/// A key id in a seal keys file: what `courier-seal` names, so short and
/// without the `:` that ends it.
const MAX_ID_LEN: usize = 32;

impl SealKey {
    fn new(id: Option<String>, since: SystemTime, secret: &[u8]) -> Result<Self, String> {
        if secret.is_empty() || secret.len() > 64 {
            return Err(format!(
                "a seal key is 1 to 64 bytes, this one is {}",
                secret.len()
            ));
        }
        Ok(Self {
            id,
            since,
            key: hmac::Key::new(hmac::HMAC_SHA1_FOR_LEGACY_USE_ONLY, secret),
            secret: secret.to_vec(),
        })
    }

    /// The HMAC's inner and outer key blocks (`K ^ 0x36…`, `K ^ 0x5c…`),
    /// for a Redis script to compute the same seal with `redis.sha1hex`.
    fn pads(&self) -> (Vec<u8>, Vec<u8>) {
        let mut block = self.secret.clone();
        block.resize(64, 0);
        (
            block.iter().map(|b| b ^ 0x36).collect(),
            block.iter().map(|b| b ^ 0x5c).collect(),
        )
    }
}

impl Seal {
    /// A seal with the key `secret` (as kept in the broker).
    pub fn new(secret: &[u8]) -> Result<Self, String> {
        Ok(Self {
            keys: vec![SealKey::new(None, SystemTime::UNIX_EPOCH, secret)?],
            window: Duration::ZERO,
        })
    }

    /// A new random key, as hex text, for a queue that has none yet.
    pub fn new_secret() -> String {
        let bytes: [u8; SEAL_KEY_BYTES] = rand::random();
        hex(&bytes)
    }

    /// The keys of a seal keys file (`--seal-keys-file`, a mounted
    /// Secret): one per line, `<id> <in-force-from, RFC 3339> <secret as
    /// hex, 16 to 64 bytes>`; blank lines and lines starting with `#` are
    /// skipped. At least one key must be in force `now`.
    pub fn parse_keys(text: &str, window: Duration, now: SystemTime) -> Result<Self, String> {
        let mut keys: Vec<SealKey> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = |what: String| format!("line {}: {what}", n + 1);
            let words: Vec<&str> = line.split_whitespace().collect();
            let [id, since, secret] = words[..] else {
                return Err(at(format!(
                    "{} words; a key is `<id> <in-force-from, RFC 3339> <secret as hex>`",
                    words.len()
                )));
            };
            if id.len() > MAX_ID_LEN
                || !id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
            {
                return Err(at(format!(
                    "the id {id:?} is not 1 to {MAX_ID_LEN} letters, digits, '.', '_' or '-'"
                )));
            }
            let since = crate::model::parse_time(since.as_bytes()).ok_or_else(|| {
                at(format!(
                    "{since:?} is not an RFC 3339 time like 2026-12-01T00:00:00Z"
                ))
            })?;
            let secret = unhex(secret.as_bytes())
                .filter(|s| (16..=64).contains(&s.len()))
                .ok_or_else(|| {
                    at(format!(
                        "the secret of {id:?} is not 32 to 128 hex digits (16 to 64 bytes); make one with `openssl rand -hex 32`"
                    ))
                })?;
            if let Some(other) = keys
                .iter()
                .find(|k| k.id.as_deref() == Some(id) || k.since == since)
            {
                return Err(at(format!(
                    "{id:?} has the id or the in-force time of {:?}; each key needs its own of both",
                    other.id.as_deref().unwrap_or_default()
                )));
            }
            keys.push(SealKey::new(Some(id.to_string()), since, &secret).map_err(at)?);
        }
        keys.sort_by_key(|k| k.since);
        let Some(first) = keys.first() else {
            return Err(
                "no key in it; a key is `<id> <in-force-from, RFC 3339> <secret as hex>`".into(),
            );
        };
        if first.since > now {
            return Err(format!(
                "no key is in force yet (the earliest, {:?}, is from {}); give one whose time has come",
                first.id.as_deref().unwrap_or_default(),
                crate::model::rfc3339(first.since)
            ));
        }
        Ok(Self { keys, window })
    }

    /// [`Seal::parse_keys`] of the file at `path`.
    pub fn from_keys_file(path: &Path, window: Duration) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("{}: cannot read it: {e}", path.display()))?;
        Self::parse_keys(&text, window, SystemTime::now())
            .map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The key that signs at `now`: the newest in force.
    fn signing(&self, now: SystemTime) -> &SealKey {
        self.keys
            .iter()
            .rev()
            .find(|k| k.since <= now)
            .unwrap_or(&self.keys[0])
    }

    /// The keys whose seals are accepted at `now`: all but those replaced
    /// by a newer key longer than the window ago.
    fn accepted(&self, now: SystemTime) -> impl Iterator<Item = &SealKey> {
        self.keys.iter().enumerate().filter_map(move |(i, key)| {
            let replaced = self.keys.get(i + 1).map(|next| next.since + self.window);
            replaced.is_none_or(|until| now < until).then_some(key)
        })
    }

    /// The accepted keys for a Redis script: for each, its id's length (one
    /// byte; 0 for the broker-kept key), the id, and the HMAC's inner and
    /// outer key blocks (64 bytes each).
    pub fn script_keys(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for key in self.accepted(SystemTime::now()) {
            let id = key.id.as_deref().unwrap_or_default();
            let (inner, outer) = key.pads();
            out.push(id.len() as u8);
            out.extend_from_slice(id.as_bytes());
            out.extend_from_slice(&inner);
            out.extend_from_slice(&outer);
        }
        out
    }

    /// `fields` with a seal over their state, any older seal replaced.
    pub fn seal(&self, fields: Vec<(Bytes, Bytes)>) -> Vec<(Bytes, Bytes)> {
        let mut fields = without(fields, F_SEAL);
        let key = self.signing(SystemTime::now());
        let tag = hex(hmac::sign(&key.key, &covered(&fields)).as_ref());
        let value = match &key.id {
            Some(id) => format!("{id}:{tag}"),
            None => tag,
        };
        fields.push((F_SEAL.into(), Bytes::from(value)));
        fields
    }

    /// Whether `fields` carry a valid seal over their state, by a key
    /// accepted now. The first `courier-seal` counts, as the first of
    /// every field does ([`covered`], `Delivery::from_fields`).
    pub fn is_sealed(&self, fields: &[(Bytes, Bytes)]) -> bool {
        let Some((_, value)) = fields.iter().find(|(n, _)| n.as_ref() == F_SEAL.as_bytes()) else {
            return false;
        };
        let (id, tag) = match value.iter().position(|&b| b == b':') {
            Some(colon) => (Some(&value[..colon]), &value[colon + 1..]),
            None => (None, &value[..]),
        };
        let Some(tag) = unhex(tag) else {
            return false;
        };
        let data = covered(fields);
        self.accepted(SystemTime::now())
            .filter(|k| k.id.as_deref().map(str::as_bytes) == id)
            .any(|k| hmac::verify(&k.key, &data, &tag).is_ok())
    }

    /// The fields of a stored copy as courier may read them: a sealed copy
    /// as courier stored it, without the seal; anything else as a new
    /// message, without any `courier-*` field (a producer's, a dead-letter
    /// dump re-published by hand, or a copy an older courier stored without
    /// a seal). They are dropped, not kept as headers: the app never
    /// receives `Courier-*` headers from a producer anyway.
    pub fn open(&self, fields: Vec<(Bytes, Bytes)>) -> Vec<(Bytes, Bytes)> {
        if self.is_sealed(&fields) {
            return without(fields, F_SEAL);
        }
        let before = fields.len();
        let fields: Vec<_> = fields
            .into_iter()
            .filter(|(n, _)| !is_courier_field(n))
            .collect();
        if fields.len() != before {
            tracing::debug!(
                dropped = before - fields.len(),
                "a message carried courier-* fields without courier's seal: it is a new message and they are ignored"
            );
        }
        fields
    }
}

/// A `courier-*` field name, in any case.
pub fn is_courier_field(name: &[u8]) -> bool {
    name.len() >= 8 && name[..8].eq_ignore_ascii_case(b"courier-")
}

/// What a seal covers: each [`STATE_FIELDS`] field present (its first
/// value), as `name=<length>:value;`.
fn covered(fields: &[(Bytes, Bytes)]) -> Vec<u8> {
    let mut out = Vec::new();
    for name in STATE_FIELDS {
        if let Some((_, value)) = fields.iter().find(|(n, _)| n.as_ref() == name.as_bytes()) {
            out.extend_from_slice(format!("{name}={}:", value.len()).as_bytes());
            out.extend_from_slice(value);
            out.push(b';');
        }
    }
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &[u8]) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    text.chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Delivery, Failure};
    use crate::source::shared::replace;

    fn stored() -> Vec<(Bytes, Bytes)> {
        vec![
            (Bytes::from("payload"), Bytes::from("x")),
            (Bytes::from("traceparent"), Bytes::from("00-a-b-01")),
            (Bytes::from(F_MESSAGE_ID), Bytes::from("1-0")),
            (Bytes::from(F_ATTEMPT), Bytes::from("2")),
            (
                Bytes::from(F_ENQUEUED_AT),
                Bytes::from("2026-01-01T00:00:00.000Z"),
            ),
        ]
    }

    #[test]
    fn a_sealed_copy_opens_as_it_was_stored() {
        let seal = Seal::new(Seal::new_secret().as_bytes()).unwrap();
        let sealed = seal.seal(stored());
        assert!(seal.is_sealed(&sealed));
        assert_eq!(seal.open(sealed), stored());
    }

    #[test]
    fn a_tampered_seal_is_rejected_and_the_state_dropped() {
        let seal = Seal::new(b"k1").unwrap();
        let sealed = seal.seal(stored());
        let without_state = vec![
            (Bytes::from("payload"), Bytes::from("x")),
            (Bytes::from("traceparent"), Bytes::from("00-a-b-01")),
        ];
        // The state changed after sealing (a forged attempt).
        let forged = replace(sealed.clone(), F_ATTEMPT, "99".into());
        assert!(!seal.is_sealed(&forged));
        assert_eq!(seal.open(forged), without_state);
        // An older enqueue time, which would expire the message at once.
        let forged = replace(
            sealed.clone(),
            F_ENQUEUED_AT,
            "2000-01-01T00:00:00.000Z".into(),
        );
        assert!(!seal.is_sealed(&forged));
        // A state field added after sealing.
        let mut added = sealed.clone();
        added.push((Bytes::from(F_REPLAY_COUNT), Bytes::from("7")));
        assert!(!seal.is_sealed(&added));
        // The seal itself altered, or not hex.
        for tag in ["00", "zz", ""] {
            let bad = replace(sealed.clone(), F_SEAL, tag.into());
            assert!(!seal.is_sealed(&bad), "{tag:?}");
        }
        // Another queue's key.
        assert!(!Seal::new(b"k2").unwrap().is_sealed(&sealed));
        // No seal at all: every courier-* field goes, in any case.
        let mut plain = stored();
        plain.push((Bytes::from("Courier-Deliveries"), Bytes::from("1000")));
        assert_eq!(seal.open(plain), without_state);
    }

    #[test]
    fn the_pads_are_the_hmac_key_blocks() {
        let seal = Seal::new(b"key").unwrap();
        let (inner, outer) = seal.keys[0].pads();
        let data = covered(&stored());
        let sha1 = |data: &[u8]| {
            ring::digest::digest(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY, data)
                .as_ref()
                .to_vec()
        };
        let inner_hash = sha1(&[inner, data.clone()].concat());
        let tag = sha1(&[outer, inner_hash].concat());
        assert_eq!(tag, hmac::sign(&seal.keys[0].key, &data).as_ref());
    }

    const HOUR: Duration = Duration::from_secs(3600);

    fn key_line(id: &str, since: SystemTime, secret: &str) -> String {
        format!("{id} {} {secret}\n", crate::model::rfc3339(since))
    }

    /// A file of `(id, offset from now, secret)`; negative offsets are in
    /// the past.
    fn file(keys: &[(&str, f64, &str)], window: Duration) -> Seal {
        let now = SystemTime::now();
        let text: String = keys
            .iter()
            .map(|(id, hours, secret)| {
                let at = if *hours < 0.0 {
                    now - HOUR.mul_f64(-hours)
                } else {
                    now + HOUR.mul_f64(*hours)
                };
                key_line(id, at, secret)
            })
            .collect();
        Seal::parse_keys(&format!("# the queue's keys\n\n{text}"), window, now).unwrap()
    }

    const A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
    const C: &str = "cccccccccccccccccccccccccccccccc";

    #[test]
    fn the_newest_key_in_force_signs_and_says_its_id() {
        let seal = file(&[("a", -240.0, A), ("b", -1.0, B), ("c", 1.0, C)], HOUR * 2);
        let sealed = seal.seal(stored());
        let value = crate::source::shared::field(&sealed, F_SEAL).unwrap();
        assert!(value.starts_with("b:"), "{value}");
        assert!(seal.is_sealed(&sealed));
        assert_eq!(seal.open(sealed), stored());
    }

    #[test]
    fn an_old_key_is_accepted_for_the_window_after_its_successor_and_not_after() {
        let by_a = file(&[("a", -240.0, A)], HOUR).seal(stored());
        let by_c = file(&[("c", -1.0, C)], HOUR).seal(stored());
        // b came into force an hour ago: a is accepted for 2 h after that,
        // and c, whose time has not come, is accepted already.
        let rotating = file(&[("a", -240.0, A), ("b", -1.0, B), ("c", 1.0, C)], HOUR * 2);
        assert!(rotating.is_sealed(&by_a));
        assert!(rotating.is_sealed(&by_c));
        // With a 30 min window, a's time ended half an hour ago.
        let rotated = file(&[("a", -240.0, A), ("b", -1.0, B)], HOUR / 2);
        assert!(!rotated.is_sealed(&by_a));
        assert_eq!(
            rotated.open(by_a.clone()),
            vec![
                (Bytes::from("payload"), Bytes::from("x")),
                (Bytes::from("traceparent"), Bytes::from("00-a-b-01")),
            ]
        );
        // A seal naming a key the file does not have, or another key's
        // id, fails; so does a seal without an id (the broker-kept key's).
        let renamed = replace(
            by_a.clone(),
            F_SEAL,
            crate::source::shared::field(&by_a, F_SEAL)
                .unwrap()
                .replacen("a:", "b:", 1),
        );
        assert!(!rotating.is_sealed(&renamed));
        let broker_kept = Seal::new(A.as_bytes()).unwrap().seal(stored());
        assert!(!rotating.is_sealed(&broker_kept));
        assert!(!Seal::new(A.as_bytes()).unwrap().is_sealed(&by_a));
    }

    #[test]
    fn a_keys_file_that_is_wrong_says_which_line_and_why() {
        let now = SystemTime::now();
        let past = now - HOUR;
        let cases = [
            ("a 2026-01-01T00:00:00Z\n".to_string(), "line 1: 2 words"),
            (key_line("a:b", past, A), "the id \"a:b\" is not"),
            (
                "a yesterday ".to_string() + A,
                "\"yesterday\" is not an RFC 3339 time",
            ),
            (key_line("a", past, "abcd"), "not 32 to 128 hex digits"),
            (
                key_line("a", past, &"zz".repeat(16)),
                "not 32 to 128 hex digits",
            ),
            (
                key_line("a", past, A) + &key_line("a", past - HOUR, B),
                "line 2: \"a\" has the id or the in-force time of \"a\"",
            ),
            (
                key_line("a", past, A) + &key_line("b", past, B),
                "line 2: \"b\" has the id or the in-force time of \"a\"",
            ),
            (key_line("a", now + HOUR, A), "no key is in force yet"),
            ("# nothing\n".to_string(), "no key in it"),
        ];
        for (text, want) in cases {
            let err = Seal::parse_keys(&text, HOUR, now).unwrap_err();
            assert!(err.contains(want), "{text:?}: {err}");
        }
        let debug = format!("{:?}", file(&[("a", -1.0, A)], HOUR));
        assert!(!debug.contains(A) && debug.contains("\"a\""), "{debug}");
    }

    /// The first `courier-seal` is the one checked, as the first of every
    /// state field is the one covered and read.
    #[test]
    fn the_first_seal_counts() {
        let seal = file(&[("a", -1.0, A)], HOUR);
        let sealed = seal.seal(stored());
        let mut second_bad = sealed.clone();
        second_bad.push((Bytes::from(F_SEAL), Bytes::from("a:00")));
        assert!(seal.is_sealed(&second_bad));
        let mut first_bad = vec![(Bytes::from(F_SEAL), Bytes::from("a:00"))];
        first_bad.extend(sealed);
        assert!(!seal.is_sealed(&first_bad));
    }

    /// A replayed copy as a replay seals it: its lineage is state.
    fn replayed() -> Vec<(Bytes, Bytes)> {
        let letter = crate::model::DeadLetter::from_fields(
            "1700000000000-0".into(),
            vec![
                (Bytes::from("payload"), Bytes::from("x")),
                (Bytes::from("traceparent"), Bytes::from("00-a-b-01")),
                (Bytes::from(F_MESSAGE_ID), Bytes::from("1-0")),
                (Bytes::from(F_REPLAY_COUNT), Bytes::from("1")),
                (
                    Bytes::from("courier-reason"),
                    Bytes::from("permanent-status"),
                ),
                (Bytes::from("courier-status"), Bytes::from("400")),
            ],
        );
        letter.fields_for_replay()
    }

    /// The lineage a replay writes opens as written under courier's seal;
    /// changed after sealing (a higher count, another letter, a shorter
    /// history) the copy is a new message and all of it is dropped.
    #[test]
    fn the_lineage_of_a_replay_is_sealed() {
        let seal = Seal::new(b"k1").unwrap();
        let sealed = seal.seal(replayed());
        assert_eq!(seal.open(sealed.clone()), replayed());
        let read = |fields| Delivery::from_fields("2-0", seal.open(fields), 0, "r".into(), None);
        let delivery = read(sealed.clone());
        assert_eq!(delivery.replay_count, 2);
        assert_eq!(delivery.message.id, "1-0");
        for (name, forged) in [
            (F_REPLAY_COUNT, "9"),
            (F_REPLAYED_FROM, "1-0"),
            (F_HISTORY, "[]"),
        ] {
            let forged = replace(sealed.clone(), name, forged.into());
            assert!(!seal.is_sealed(&forged), "{name}");
            let delivery = read(forged);
            assert_eq!(delivery.replay_count, 0, "{name}");
            assert_eq!(delivery.message.id, "2-0", "{name}");
        }
    }

    /// A producer's `courier-replay-count`, `courier-replayed-from` and
    /// `courier-history` (a replayed copy re-published by hand, say) are
    /// not trusted: the app sees a message never replayed, its dead letter
    /// carries none of them, and a replay of that letter counts 1.
    #[test]
    fn a_producers_lineage_is_not_trusted() {
        let seal = Seal::new(b"k1").unwrap();
        let mut forged = without(seal.seal(replayed()), F_SEAL);
        forged.push((Bytes::from(F_REPLAY_COUNT), Bytes::from("41")));
        let delivery = Delivery::from_fields("2-0", seal.open(forged), 0, "r".into(), None);
        assert_eq!(delivery.replay_count, 0);
        let failure = Failure {
            reason: crate::model::DeadLetterReason::PermanentStatus,
            status: Some(400),
            error: None,
            attempts: 1,
            first_attempt_at: SystemTime::UNIX_EPOCH,
            last_attempt_at: SystemTime::UNIX_EPOCH,
            queue: "orders".into(),
            message_id: delivery.message.id.clone(),
            excerpt: Bytes::new(),
            policy: "p@1".into(),
            dead_letter_queue: "orders.dlq".into(),
            app_directive: None,
            cut: None,
        };
        let letter = crate::model::DeadLetter::from_fields(
            "3-0".into(),
            delivery.fields_for_dead_letter(&failure),
        );
        for name in [F_REPLAY_COUNT, F_REPLAYED_FROM, F_HISTORY, F_LEGACY_REPLAYS] {
            assert_eq!(letter.field(name), None, "{name}");
        }
        let again = Delivery::from_fields("4-0", letter.fields_for_replay(), 0, "r".into(), None);
        assert_eq!(again.replay_count, 1);
        assert_eq!(
            crate::model::DeadLetter::from_fields(
                "5-0".into(),
                again.fields_for_dead_letter(&failure)
            )
            .history()
            .map(|h| h.0.into_iter().map(|e| e.id).collect::<Vec<_>>()),
            Some(vec!["3-0".to_string()])
        );
    }

    /// The digest an edit keeps is sealed state: changed after sealing, the
    /// copy is a new message; a producer's is dropped.
    #[test]
    fn the_digest_of_an_edit_is_sealed() {
        let seal = Seal::new(b"k1").unwrap();
        let letter = crate::model::DeadLetter::from_fields(
            "1700000000000-0".into(),
            vec![
                (Bytes::from("payload"), Bytes::from("x")),
                (Bytes::from(F_MESSAGE_ID), Bytes::from("1-0")),
            ],
        );
        let edited = letter
            .edited(Bytes::from("y"), Vec::new())
            .fields_for_replay();
        let sealed = seal.seal(edited.clone());
        assert_eq!(seal.open(sealed.clone()), edited);
        let forged = replace(sealed, F_EDITED_FROM_DIGEST, "sha256:00".into());
        assert!(!seal.is_sealed(&forged));
        let opened = seal.open(forged);
        assert!(
            !opened
                .iter()
                .any(|(n, _)| n.as_ref() == F_EDITED_FROM_DIGEST.as_bytes()),
            "{opened:?}"
        );
    }
}
