//! A message, one delivery of it, and what a dead letter records.

use std::time::SystemTime;

use bytes::Bytes;

use super::fields::*;
use super::lineage::{History, HistoryEntry};
use super::outcome::DeadLetterReason;
use super::time::{parse_time, rfc3339};

// === Messages and deliveries ===

/// A message as the app will see it: id, body, headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The broker's id of the original message.
    pub id: String,
    pub body: Bytes,
    /// Producer headers, in the order they were stored.
    pub headers: Vec<(String, String)>,
}

impl Message {
    /// A header by name, ignoring case.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// One delivery of a message, with what the source needs to settle it.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub message: Message,
    /// 1 on the first delivery, +1 on each later one.
    pub attempt: u32,
    /// When the message was first offered to the app, if it has been.
    pub first_attempt_at: Option<SystemTime>,
    /// When the message first entered the queue, as far as the broker or
    /// courier knows it: the `courier-enqueued-at` a stored copy carries,
    /// else the broker's own time for this entry, else none.
    pub enqueued_at: Option<SystemTime>,
    /// How often the message was replayed from a dead-letter queue, 0 when
    /// never: `courier-replay-count` (or an earlier release's
    /// `courier-replays`), which the app receives as `Courier-Replay-Count`.
    pub replay_count: u32,
    /// Why this entry cannot be offered to the app at all (a Redis entry
    /// without `payload`, say); it is dead-lettered as `undeliverable`.
    pub problem: Option<String>,
    /// Source-specific handle used to settle this delivery.
    pub receipt: String,
    /// Every stored field, for sources that re-store the message on retry.
    fields: Vec<(Bytes, Bytes)>,
}

impl Delivery {
    /// Reads a stored message: `payload` is the body, `courier-*` fields are
    /// bookkeeping, the rest are headers. `extra_attempts` counts deliveries
    /// the broker made that courier never settled (a crash mid-flight).
    /// `broker_enqueued_at` is the broker's time for this entry, which a
    /// copy's `courier-enqueued-at` (the original's) overrides.
    pub fn from_fields(
        fallback_id: &str,
        fields: Vec<(Bytes, Bytes)>,
        extra_attempts: u32,
        receipt: String,
        broker_enqueued_at: Option<SystemTime>,
    ) -> Self {
        let mut body = None;
        let mut id = None;
        let mut attempt = 1u32;
        let mut first_attempt_at = None;
        let mut enqueued_at = None;
        let (mut replay_count, mut legacy_replays) = (None, None);
        let mut headers = Vec::new();
        // Names are compared as bytes and only a header's is made text:
        // reading every name as text first cost a UTF-8 check per field.
        // The first occurrence of a field counts, as it does for the seal
        // (`shared::sealed_state`): every source writes its own `payload`
        // first, so a producer's header of that name (Kafka, SQS, Pub/Sub)
        // is offered as a header, never taken for the body.
        let (mut seen_id, mut seen_attempt, mut seen_first, mut seen_enqueued) =
            (false, false, false, false);
        for (name, value) in &fields {
            match name.as_ref() {
                n if n == PAYLOAD.as_bytes() && body.is_none() => body = Some(value.clone()),
                n if n == F_MESSAGE_ID.as_bytes() => {
                    if !std::mem::replace(&mut seen_id, true) {
                        id = Some(String::from_utf8_lossy(value).into_owned());
                    }
                }
                n if n == F_ATTEMPT.as_bytes() => {
                    if !std::mem::replace(&mut seen_attempt, true) {
                        attempt = parse_text(value).unwrap_or(1).max(1);
                    }
                }
                n if n == F_FIRST_ATTEMPT_AT.as_bytes() => {
                    if !std::mem::replace(&mut seen_first, true) {
                        first_attempt_at = parse_time(value);
                    }
                }
                n if n == F_ENQUEUED_AT.as_bytes() => {
                    if !std::mem::replace(&mut seen_enqueued, true) {
                        enqueued_at = parse_time(value);
                    }
                }
                n if n == F_REPLAY_COUNT.as_bytes() => {
                    replay_count = replay_count.or_else(|| Some(parse_text(value)));
                }
                n if n == F_LEGACY_REPLAYS.as_bytes() => {
                    legacy_replays = legacy_replays.or_else(|| Some(parse_text(value)));
                }
                n if n
                    .get(..8)
                    .is_some_and(|p| p.eq_ignore_ascii_case(b"courier-")) => {}
                n => headers.push((
                    String::from_utf8_lossy(n).into_owned(),
                    String::from_utf8_lossy(value).into_owned(),
                )),
            }
        }
        let problem = body
            .is_none()
            .then(|| format!("the entry has no {PAYLOAD:?} field; a producer writes XADD <queue> * payload <body> [header value ...]"));
        Self {
            message: Message {
                id: id.unwrap_or_else(|| fallback_id.to_string()),
                body: body.unwrap_or_default(),
                headers,
            },
            attempt: attempt.saturating_add(extra_attempts),
            first_attempt_at,
            enqueued_at: enqueued_at.or(broker_enqueued_at),
            replay_count: replay_count.or(legacy_replays).flatten().unwrap_or(0),
            problem,
            receipt,
            fields,
        }
    }

    /// The fields to store when this message is scheduled for `next_attempt`:
    /// the copy is a new broker entry, so it carries when the message
    /// entered the queue (`courier-enqueued-at`) where that is known.
    pub fn fields_for_retry(
        &self,
        next_attempt: u32,
        first_attempt_at: SystemTime,
    ) -> Vec<(Bytes, Bytes)> {
        let mut out: Vec<(Bytes, Bytes)> = self
            .fields
            .iter()
            .filter(|(n, _)| !is_transient_bookkeeping(n))
            .cloned()
            .collect();
        out.push((F_MESSAGE_ID.into(), Bytes::from(self.message.id.clone())));
        out.push((F_ATTEMPT.into(), Bytes::from(next_attempt.to_string())));
        out.push((
            F_FIRST_ATTEMPT_AT.into(),
            Bytes::from(rfc3339(first_attempt_at)),
        ));
        if let Some(at) = self.enqueued_at {
            out.push((F_ENQUEUED_AT.into(), Bytes::from(rfc3339(at))));
        }
        out
    }

    /// The original fields plus the failure metadata: a dead letter.
    /// With [`Failure::cut`], only courier's own fields and an empty body:
    /// a letter that fits where the whole one did not.
    pub fn fields_for_dead_letter(&self, failure: &Failure) -> Vec<(Bytes, Bytes)> {
        let kept = |name: &[u8]| failure.cut.is_none() || name.starts_with(b"courier-");
        let mut out: Vec<(Bytes, Bytes)> = self
            .fields
            .iter()
            .filter(|(n, _)| !failure.names().any(|f| f.as_bytes() == n.as_ref()))
            .filter(|(n, _)| !is_transient_bookkeeping(n))
            .filter(|(n, _)| kept(n))
            .cloned()
            .collect();
        if failure.cut.is_some() {
            out.insert(0, (Bytes::from_static(PAYLOAD.as_bytes()), Bytes::new()));
        }
        out.extend(
            failure
                .fields()
                .map(|(n, v)| (Bytes::from_static(n.as_bytes()), Bytes::from(v))),
        );
        out
    }
}

/// A `courier-*` name, in any case.
fn is_courier_name(name: &str) -> bool {
    name.get(..8)
        .is_some_and(|p| p.eq_ignore_ascii_case("courier-"))
}

fn parse_text<T: std::str::FromStr>(value: &[u8]) -> Option<T> {
    std::str::from_utf8(value).ok()?.trim().parse().ok()
}

// === Failures and dead letters ===

/// Everything a dead letter records about why it could not be delivered.
#[derive(Debug, Clone)]
pub struct Failure {
    pub reason: DeadLetterReason,
    pub status: Option<u16>,
    pub error: Option<String>,
    pub attempts: u32,
    pub first_attempt_at: SystemTime,
    pub last_attempt_at: SystemTime,
    pub queue: String,
    pub message_id: String,
    pub excerpt: Bytes,
    /// `name@generation`.
    pub policy: String,
    /// Where the dead letter goes (`<queue>.dlq` unless the policy says).
    pub dead_letter_queue: String,
    /// The app's header that decided this dead letter (`Courier-Dead-Letter:
    /// <reason>` or `Courier-Retry: never`), written as
    /// `courier-app-directive` only when there was one.
    pub app_directive: Option<String>,
    /// Set when the whole letter was refused as too large: the letter then
    /// holds courier's record without the body and the producer headers,
    /// and this text (its `courier-cut`) says what was left out and why.
    pub cut: Option<String>,
}

impl Failure {
    /// A 422 at attempt 1 of `message_id` on `queue`, bound for
    /// `dead_letter_queue`: the plain dead letter the brokers' own tests
    /// settle with.
    pub fn permanent_422(queue: &str, dead_letter_queue: &str, message_id: &str) -> Self {
        let now = SystemTime::now();
        Self {
            reason: DeadLetterReason::PermanentStatus,
            status: Some(422),
            error: None,
            attempts: 1,
            first_attempt_at: now,
            last_attempt_at: now,
            queue: queue.into(),
            message_id: message_id.into(),
            excerpt: Bytes::new(),
            policy: "p@1".into(),
            dead_letter_queue: dead_letter_queue.into(),
            app_directive: None,
            cut: None,
        }
    }

    fn names(&self) -> impl Iterator<Item = &'static str> {
        [
            F_REASON,
            F_STATUS,
            F_ERROR,
            F_ATTEMPTS,
            F_FIRST_ATTEMPT_AT,
            F_LAST_ATTEMPT_AT,
            F_QUEUE,
            F_MESSAGE_ID,
            F_EXCERPT,
            F_POLICY,
            F_APP_DIRECTIVE,
            F_CUT,
        ]
        .into_iter()
    }

    /// The `courier-*` fields of a dead letter, the same for every source.
    pub fn fields(&self) -> impl Iterator<Item = (&'static str, String)> {
        let values = [
            self.reason.as_str().to_string(),
            self.status.map(|s| s.to_string()).unwrap_or_default(),
            self.error.clone().unwrap_or_default(),
            self.attempts.to_string(),
            rfc3339(self.first_attempt_at),
            rfc3339(self.last_attempt_at),
            self.queue.clone(),
            self.message_id.clone(),
            String::from_utf8_lossy(&self.excerpt).into_owned(),
            self.policy.clone(),
        ];
        let directive = self
            .app_directive
            .clone()
            .map(|directive| (F_APP_DIRECTIVE, directive));
        let cut = self.cut.clone().map(|cut| (F_CUT, cut));
        self.names().zip(values).chain(directive).chain(cut)
    }
}

/// A dead letter as read back from a dead-letter queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// The dead-letter queue's own id of this entry.
    pub id: String,
    pub body: Bytes,
    /// `courier-*` fields and the original headers, as stored.
    pub fields: Vec<(String, String)>,
}

impl DeadLetter {
    /// When it was dead-lettered: its `courier-last-attempt-at`. The age of
    /// the oldest dead letter (`courier_dlq_oldest_age_seconds`) is the time
    /// since this, on every broker.
    pub fn dead_lettered_at(&self) -> Option<SystemTime> {
        parse_time(self.field(F_LAST_ATTEMPT_AT)?.as_bytes())
    }

    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// How often the message was replayed before it became this dead
    /// letter: its `courier-replay-count`, else an earlier release's
    /// `courier-replays`, else 0.
    pub fn replay_count(&self) -> u32 {
        [F_REPLAY_COUNT, F_LEGACY_REPLAYS]
            .into_iter()
            .find_map(|name| self.field(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Its earlier dead letters (`courier-history`), oldest first; `None`
    /// when it has none, or a value that is not one.
    pub fn history(&self) -> Option<History> {
        History::parse(self.field(F_HISTORY)?)
    }

    /// This dead letter as an entry of the history of its replay.
    fn history_entry(&self) -> HistoryEntry {
        HistoryEntry {
            id: self.id.clone(),
            reason: self.field(F_REASON).unwrap_or_default().to_string(),
            status: self.field(F_STATUS).and_then(|s| s.trim().parse().ok()),
            attempts: self
                .field(F_ATTEMPTS)
                .and_then(|a| a.trim().parse().ok())
                .unwrap_or(0),
            at: self
                .field(F_LAST_ATTEMPT_AT)
                .unwrap_or_default()
                .to_string(),
        }
    }

    /// The fields of the fresh message a replay writes to the work queue:
    /// body and original headers, the original message id (so the app sees
    /// the same Idempotency-Key), and its lineage: the replay count one
    /// more (`courier-replay-count`), this letter's id
    /// (`courier-replayed-from`), and the history with this letter added
    /// (`courier-history`, bounded: [`History`]).
    /// No failure record, so the attempt count starts again at 1. The
    /// lineage is courier's state like the attempt: the broker's replay
    /// seals it, and retry copies and the next dead letter keep it.
    pub fn fields_for_replay(&self) -> Vec<(Bytes, Bytes)> {
        let mut out = vec![(Bytes::from_static(PAYLOAD.as_bytes()), self.body.clone())];
        out.extend(
            self.fields
                .iter()
                .filter(|(n, _)| !n.to_ascii_lowercase().starts_with("courier-"))
                .map(|(n, v)| (Bytes::from(n.clone()), Bytes::from(v.clone()))),
        );
        if let Some(id) = self.field(F_MESSAGE_ID) {
            out.push((F_MESSAGE_ID.into(), Bytes::from(id.to_string())));
        }
        let count = self.replay_count().saturating_add(1);
        out.push((F_REPLAY_COUNT.into(), Bytes::from(count.to_string())));
        out.push((F_REPLAYED_FROM.into(), Bytes::from(self.id.clone())));
        let history = self
            .history()
            .unwrap_or_default()
            .extended(self.history_entry());
        if !history.is_empty() {
            out.push((F_HISTORY.into(), Bytes::from(history.to_json())));
        }
        if let Some(digest) = self.field(F_EDITED_FROM_DIGEST) {
            out.push((F_EDITED_FROM_DIGEST.into(), Bytes::from(digest.to_string())));
        }
        out
    }

    /// The producer's part of this letter, the body and every field but
    /// `courier-*` ones, as a digest: `sha256:` and the hex of the SHA-256
    /// of the body as `<length>:<bytes>`, then each header as
    /// `<length>:<name><length>:<value>`, names lower-cased, sorted by
    /// name, then value (lengths in bytes, in decimal). Sorted because
    /// Pub/Sub and SQS keep headers in a map, whose order a second read
    /// need not repeat; lower-cased because HTTP names are. A body `{}`
    /// with `Content-Type: application/json` is the SHA-256 of
    /// `2:{}12:content-type16:application/json`.
    pub fn digest(&self) -> String {
        let mut headers: Vec<(String, &str)> = self
            .fields
            .iter()
            .filter(|(n, _)| !is_courier_name(n))
            .map(|(n, v)| (n.to_ascii_lowercase(), v.as_str()))
            .collect();
        headers.sort_unstable();
        let mut canonical = Vec::with_capacity(self.body.len() + 64);
        let mut part = |bytes: &[u8]| {
            canonical.extend_from_slice(format!("{}:", bytes.len()).as_bytes());
            canonical.extend_from_slice(bytes);
        };
        part(&self.body);
        for (name, value) in &headers {
            part(name.as_bytes());
            part(value.as_bytes());
        }
        let hash = ring::digest::digest(&ring::digest::SHA256, &canonical);
        let hex: String = hash.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        format!("sha256:{hex}")
    }

    /// This letter with `body` and the producer `headers` in place of its
    /// own, as `courier dlq edit` replays it: the id, courier's record and
    /// the lineage stay, so a replay removes this letter and counts as its
    /// replay, and `courier-edited-from-digest` is this letter's
    /// [`DeadLetter::digest`] (an earlier edit's replaced). `courier-*`
    /// names among `headers` are left out: they are courier's state.
    pub fn edited(&self, body: Bytes, headers: Vec<(String, String)>) -> DeadLetter {
        let mut fields: Vec<(String, String)> = self
            .fields
            .iter()
            .filter(|(n, _)| is_courier_name(n) && !n.eq_ignore_ascii_case(F_EDITED_FROM_DIGEST))
            .cloned()
            .collect();
        fields.extend(headers.into_iter().filter(|(n, _)| !is_courier_name(n)));
        fields.push((F_EDITED_FROM_DIGEST.into(), self.digest()));
        DeadLetter {
            id: self.id.clone(),
            body,
            fields,
        }
    }

    /// What a replay of this letter writes, for a broker that reads the
    /// letter again by its id before it writes (`stored`, as the broker
    /// holds it): this letter when it is an edit of `stored`
    /// ([`DeadLetter::edited`]: its `courier-edited-from-digest` is
    /// `stored`'s digest), else `stored` as the broker holds it. An edit of
    /// some other letter is refused rather than replayed unedited.
    pub fn fields_for_replay_of(&self, stored: &DeadLetter) -> Result<Vec<(Bytes, Bytes)>, String> {
        let Some(edited_from) = self.field(F_EDITED_FROM_DIGEST) else {
            return Ok(stored.fields_for_replay());
        };
        let digest = stored.digest();
        if edited_from == digest {
            return Ok(self.fields_for_replay());
        }
        if stored.field(F_EDITED_FROM_DIGEST) == Some(edited_from) {
            // The same letter as listed, carrying an earlier edit's digest.
            return Ok(stored.fields_for_replay());
        }
        Err(format!(
            "dead letter {} was edited from a letter with digest {edited_from}, but the one under that id has {digest}; nothing was replayed",
            self.id
        ))
    }

    pub fn from_fields(id: String, fields: Vec<(Bytes, Bytes)>) -> Self {
        let mut body = None;
        let mut out = Vec::new();
        for (name, value) in fields {
            // The first `payload` is the body, as for a delivery.
            if name.as_ref() == PAYLOAD.as_bytes() && body.is_none() {
                body = Some(value);
            } else {
                out.push((
                    String::from_utf8_lossy(&name).into_owned(),
                    String::from_utf8_lossy(&value).into_owned(),
                ));
            }
        }
        Self {
            id,
            body: body.unwrap_or_default(),
            fields: out,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The record of message `5-0` of `orders`, dead-lettered for `reason`.
    fn failure_of(reason: crate::model::DeadLetterReason, status: u16, attempts: u32) -> Failure {
        Failure {
            reason,
            status: Some(status),
            error: None,
            attempts,
            first_attempt_at: SystemTime::UNIX_EPOCH,
            last_attempt_at: SystemTime::UNIX_EPOCH,
            queue: "orders".into(),
            message_id: "5-0".into(),
            excerpt: Bytes::new(),
            policy: "p@1".into(),
            dead_letter_queue: "orders.dlq".into(),
            app_directive: None,
            cut: None,
        }
    }

    /// Found at 21da363: a producer's header, attribute or field named
    /// `payload` replaced the body on Kafka, SQS and Pub/Sub (each puts the
    /// body first, and the last occurrence won), and a second copy of a
    /// `courier-*` field won over the one the seal checks. The first
    /// occurrence counts everywhere; a later `payload` is a header.
    #[test]
    fn the_first_occurrence_of_a_field_counts() {
        let field = |n: &str, v: &str| (Bytes::from(n.to_string()), Bytes::from(v.to_string()));
        let d = Delivery::from_fields(
            "1-0",
            vec![
                field("payload", "the body"),
                field("courier-attempt", "2"),
                field("payload", "a producer's header"),
                field("courier-attempt", "99"),
            ],
            0,
            "1-0".into(),
            None,
        );
        assert_eq!(d.message.body, Bytes::from("the body"));
        assert_eq!(d.attempt, 2);
        assert_eq!(d.message.header("payload"), Some("a producer's header"));
        let letter = DeadLetter::from_fields(
            "1-0".into(),
            vec![field("payload", "the body"), field("payload", "a header")],
        );
        assert_eq!(letter.body, Bytes::from("the body"));
        assert_eq!(letter.field("payload"), Some("a header"));
    }

    #[test]
    fn an_entry_without_payload_is_a_problem_not_a_message() {
        let d = Delivery::from_fields(
            "1-0",
            vec![("content-type".into(), "text/plain".into())],
            0,
            "r".into(),
            None,
        );
        assert!(d.problem.is_some());
        assert_eq!(d.message.id, "1-0");
    }

    #[test]
    fn retry_fields_keep_the_original_id_and_count_attempts() {
        let d = Delivery::from_fields(
            "5-0",
            vec![
                ("payload".into(), "x".into()),
                ("traceparent".into(), "00-a-b-01".into()),
            ],
            0,
            "r".into(),
            None,
        );
        let fields = d.fields_for_retry(2, SystemTime::UNIX_EPOCH);
        let again = Delivery::from_fields("9-0", fields, 0, "r2".into(), None);
        assert_eq!(again.message.id, "5-0");
        assert_eq!(again.attempt, 2);
        assert_eq!(again.message.body, Bytes::from("x"));
        assert_eq!(again.message.header("traceparent"), Some("00-a-b-01"));
        assert_eq!(again.first_attempt_at, Some(SystemTime::UNIX_EPOCH));
    }

    /// A copy courier stores again (a retry, a give-back) is a new broker
    /// entry whose own time is the re-store's: the original's time rides
    /// along in `courier-enqueued-at` and wins over the copy's, to the
    /// millisecond, however often the message is stored again.
    #[test]
    fn the_enqueue_time_survives_a_retry_copy() {
        let sent = SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(1_700_000_000_123);
        let later = |s: u64| sent + std::time::Duration::from_secs(s);
        let d = Delivery::from_fields(
            "5-0",
            vec![("payload".into(), "x".into())],
            0,
            "r".into(),
            Some(sent),
        );
        assert_eq!(d.enqueued_at, Some(sent));
        let copy = d.fields_for_retry(2, later(1));
        let carried = copy
            .iter()
            .find(|(n, _)| n.as_ref() == F_ENQUEUED_AT.as_bytes())
            .map(|(_, v)| v.clone());
        assert_eq!(carried, Some(Bytes::from("2023-11-14T22:13:20.123Z")));
        let again = Delivery::from_fields("9-0", copy, 0, "r2".into(), Some(later(2)));
        assert_eq!(again.enqueued_at, Some(sent));
        assert_eq!(again.message.header(F_ENQUEUED_AT), None);
        let copy = again.fields_for_retry(3, later(1));
        assert_eq!(
            copy.iter()
                .filter(|(n, _)| n.as_ref() == F_ENQUEUED_AT.as_bytes())
                .count(),
            1
        );
        let third = Delivery::from_fields("12-0", copy, 0, "r3".into(), Some(later(3)));
        assert_eq!(third.enqueued_at, Some(sent));
    }

    /// Without a carried time the broker's own counts, and without either
    /// there is none, and a copy carries none.
    #[test]
    fn the_enqueue_time_is_the_carried_one_else_the_brokers_else_none() {
        let at = |ms: u64| SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(ms);
        let field = |n: &str, v: &str| (Bytes::from(n.to_string()), Bytes::from(v.to_string()));
        let read = |fields: Vec<(Bytes, Bytes)>, broker| {
            Delivery::from_fields("1-0", fields, 0, "r".into(), broker).enqueued_at
        };
        let body = field("payload", "x");
        assert_eq!(read(vec![body.clone()], Some(at(7))), Some(at(7)));
        assert_eq!(read(vec![body.clone()], None), None);
        let carried = field(F_ENQUEUED_AT, "1970-01-01T00:00:01.500Z");
        assert_eq!(
            read(vec![body.clone(), carried.clone()], Some(at(9_000))),
            Some(at(1_500))
        );
        assert_eq!(
            read(vec![body.clone(), carried.clone()], None),
            Some(at(1_500))
        );
        // The first occurrence counts, as for every courier field.
        let second = field(F_ENQUEUED_AT, "1970-01-01T00:00:02Z");
        assert_eq!(
            read(vec![body.clone(), carried, second], None),
            Some(at(1_500))
        );
        // One that cannot be read is no time: the broker's counts.
        let bad = field(F_ENQUEUED_AT, "yesterday");
        assert_eq!(read(vec![body.clone(), bad], Some(at(7))), Some(at(7)));
        let none = Delivery::from_fields("1-0", vec![body], 0, "r".into(), None);
        let copy = none.fields_for_retry(2, at(0));
        assert!(
            !copy
                .iter()
                .any(|(n, _)| n.as_ref() == F_ENQUEUED_AT.as_bytes())
        );
    }

    /// A dead letter leaves it out, as it leaves out every field about one
    /// stored copy: its record has the attempt times, and a replay is a new
    /// message that enters the queue afresh.
    #[test]
    fn a_dead_letter_does_not_carry_the_enqueue_time() {
        let d = Delivery::from_fields(
            "5-0",
            vec![
                ("payload".into(), "x".into()),
                (F_ENQUEUED_AT.into(), "2026-01-01T00:00:00.000Z".into()),
            ],
            0,
            "r".into(),
            None,
        );
        assert!(d.enqueued_at.is_some());
        let failure = failure_of(crate::model::DeadLetterReason::AttemptsExhausted, 503, 3);
        let letter = DeadLetter::from_fields("1".into(), d.fields_for_dead_letter(&failure));
        assert_eq!(letter.field(F_ENQUEUED_AT), None);
    }

    /// A letter that fits holds courier's record and the note, an empty
    /// body and none of the producer's headers; a whole one holds them all.
    #[test]
    fn a_cut_dead_letter_keeps_the_record_and_leaves_out_body_and_headers() {
        let d = Delivery::from_fields(
            "5-0",
            vec![
                ("payload".into(), "a large body".into()),
                ("traceparent".into(), "00-a-b-01".into()),
                (F_REPLAY_COUNT.into(), "1".into()),
                (
                    F_HISTORY.into(),
                    r#"[{"id":"7","reason":"expired","attempts":1,"at":"t"}]"#.into(),
                ),
            ],
            0,
            "r".into(),
            None,
        );
        let failure = failure_of(crate::model::DeadLetterReason::Undeliverable, 400, 1);
        let letter = |failure: &Failure| {
            let fields = d.fields_for_dead_letter(failure);
            DeadLetter::from_fields("1".into(), fields)
        };
        let whole = letter(&failure);
        assert_eq!(whole.body, Bytes::from("a large body"));
        assert_eq!(whole.field("traceparent"), Some("00-a-b-01"));
        assert_eq!(whole.field(F_CUT), None);
        let cut = letter(&Failure {
            cut: Some("the body (12 bytes) and 1 producer headers are left out".into()),
            ..failure
        });
        assert_eq!(cut.body, Bytes::new());
        assert_eq!(cut.field("traceparent"), None);
        assert_eq!(cut.field(F_REPLAY_COUNT), Some("1"));
        assert_eq!(cut.history().map(|h| h.0.len()), Some(1));
        assert_eq!(cut.field(F_STATUS), Some("400"));
        assert_eq!(cut.field(F_REASON), Some("undeliverable"));
        assert!(cut.field(F_CUT).is_some_and(|c| c.contains("12 bytes")));
    }

    /// A stored copy as a broker reads it back: the fields, a new entry.
    fn read(fields: Vec<(Bytes, Bytes)>) -> Delivery {
        Delivery::from_fields("99-0", fields, 0, "r".into(), None)
    }

    /// The dead letter `id` of `delivery`, answered `status` on its first
    /// attempt, as a dead-letter queue hands it back.
    fn dead_letter_of(delivery: &Delivery, id: &str, status: u16) -> DeadLetter {
        let failure = Failure {
            last_attempt_at: SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(60),
            ..failure_of(
                crate::model::DeadLetterReason::PermanentStatus,
                status,
                delivery.attempt,
            )
        };
        DeadLetter::from_fields(id.into(), delivery.fields_for_dead_letter(&failure))
    }

    /// A replay's copy counts the replay, names the letter it came from and
    /// starts the history with it; a retry copy and the next dead letter
    /// keep all three, and the next replay extends them.
    #[test]
    fn a_replay_carries_its_lineage_to_the_next_dead_letter() {
        let original = read(vec![
            ("payload".into(), "x".into()),
            ("traceparent".into(), "00-a-b-01".into()),
        ]);
        assert_eq!(original.replay_count, 0);
        let first = dead_letter_of(&original, "1700000000000-0", 400);
        assert_eq!(first.replay_count(), 0);
        assert_eq!(first.field(F_REPLAYED_FROM), None);
        assert_eq!(first.history(), None);

        let replayed = read(first.fields_for_replay());
        assert_eq!(replayed.replay_count, 1);
        assert_eq!(replayed.attempt, 1);
        assert_eq!(replayed.message.id, "5-0", "the original id, for the key");
        assert_eq!(replayed.message.header("traceparent"), Some("00-a-b-01"));
        assert_eq!(replayed.message.header(F_REPLAY_COUNT), None);

        // Retried once before it dies again: the copy keeps the lineage.
        let retried = read(replayed.fields_for_retry(2, SystemTime::UNIX_EPOCH));
        assert_eq!(retried.replay_count, 1);
        let second = dead_letter_of(&retried, "1700000000001-0", 422);
        assert_eq!(second.replay_count(), 1);
        assert_eq!(second.field(F_REPLAYED_FROM), Some("1700000000000-0"));
        assert_eq!(
            second.field(F_HISTORY),
            Some(
                r#"[{"id":"1700000000000-0","reason":"permanent-status","status":400,"attempts":1,"at":"1970-01-01T00:01:00.000Z"}]"#
            )
        );

        let again = read(second.fields_for_replay());
        assert_eq!(again.replay_count, 2);
        let third = dead_letter_of(&again, "1700000000002-0", 400);
        assert_eq!(third.replay_count(), 2);
        assert_eq!(third.field(F_REPLAYED_FROM), Some("1700000000001-0"));
        let history = third.history().unwrap();
        let rounds: Vec<(&str, Option<u16>, u32)> = history
            .0
            .iter()
            .map(|e| (e.id.as_str(), e.status, e.attempts))
            .collect();
        assert_eq!(
            rounds,
            [
                ("1700000000000-0", Some(400), 1),
                ("1700000000001-0", Some(422), 2)
            ],
            "oldest first"
        );
        // Each name once: the letter's own lineage is replaced, not repeated.
        let fields = third.fields_for_replay();
        for name in [F_REPLAY_COUNT, F_REPLAYED_FROM, F_HISTORY, F_MESSAGE_ID] {
            let count = fields
                .iter()
                .filter(|(n, _)| n.as_ref() == name.as_bytes())
                .count();
            assert_eq!(count, 1, "{name}");
        }
    }

    /// A dead letter or a stored copy an earlier release wrote counts its
    /// replays in `courier-replays`: the count goes on from it, and the new
    /// name wins where both are.
    #[test]
    fn an_earlier_releases_replay_count_is_read() {
        let letter = DeadLetter::from_fields(
            "4-0".into(),
            vec![
                ("payload".into(), "x".into()),
                (F_MESSAGE_ID.into(), "1-0".into()),
                (F_LEGACY_REPLAYS.into(), "3".into()),
            ],
        );
        assert_eq!(letter.replay_count(), 3);
        let replayed = letter.fields_for_replay();
        assert!(
            !replayed
                .iter()
                .any(|(n, _)| n.as_ref() == F_LEGACY_REPLAYS.as_bytes())
        );
        assert_eq!(read(replayed).replay_count, 4);

        let copy = |fields: &[(&str, &str)]| {
            let mut all = vec![(Bytes::from("payload"), Bytes::from("x"))];
            all.extend(
                fields
                    .iter()
                    .map(|(n, v)| (Bytes::from(n.to_string()), Bytes::from(v.to_string()))),
            );
            read(all)
        };
        let old = copy(&[(F_LEGACY_REPLAYS, "2")]);
        assert_eq!(old.replay_count, 2);
        // It dies again: the dead letter keeps the old field, which the
        // next replay reads.
        let letter = dead_letter_of(&old, "8-0", 400);
        assert_eq!(letter.replay_count(), 2);
        assert_eq!(read(letter.fields_for_replay()).replay_count, 3);
        assert_eq!(
            copy(&[(F_LEGACY_REPLAYS, "2"), (F_REPLAY_COUNT, "5")]).replay_count,
            5
        );
        assert_eq!(copy(&[(F_REPLAY_COUNT, "bad")]).replay_count, 0);
    }

    /// A message replayed and dead-lettered again and again carries the
    /// newest ten rounds and its whole count.
    #[test]
    fn the_history_of_a_message_replayed_forever_is_bounded() {
        let mut delivery = read(vec![("payload".into(), "x".into())]);
        for round in 0..25u32 {
            let letter = dead_letter_of(&delivery, &round.to_string(), 400);
            delivery = read(letter.fields_for_replay());
            assert_eq!(delivery.replay_count, round + 1);
        }
        let letter = dead_letter_of(&delivery, "last", 400);
        let history = letter.history().unwrap();
        assert_eq!(history.0.len(), crate::model::HISTORY_ENTRIES);
        assert_eq!(history.0.first().unwrap().id, "15");
        assert_eq!(history.0.last().unwrap().id, "24");
        assert!(letter.field(F_HISTORY).unwrap().len() <= crate::model::HISTORY_BYTES);
        assert_eq!(letter.replay_count(), 25);
        assert_eq!(letter.field(F_REPLAYED_FROM), Some("24"));
    }

    /// A history that is not one (a letter edited by hand) starts again
    /// from this letter rather than carrying the text on.
    #[test]
    fn an_unreadable_history_starts_again() {
        let letter = DeadLetter::from_fields(
            "9-0".into(),
            vec![
                ("payload".into(), "x".into()),
                (F_REPLAY_COUNT.into(), "2".into()),
                (F_HISTORY.into(), "[{not json".into()),
            ],
        );
        assert_eq!(letter.history(), None);
        let replayed = read(letter.fields_for_replay());
        let again = dead_letter_of(&replayed, "10-0", 400);
        let ids: Vec<String> = again
            .history()
            .unwrap()
            .0
            .into_iter()
            .map(|e| e.id)
            .collect();
        assert_eq!(ids, ["9-0"]);
        assert_eq!(again.replay_count(), 3);
    }

    fn letter_of(id: &str, body: &str, fields: &[(&str, &str)]) -> DeadLetter {
        let mut all = vec![(Bytes::from("payload"), Bytes::from(body.to_string()))];
        all.extend(
            fields
                .iter()
                .map(|(n, v)| (Bytes::from(n.to_string()), Bytes::from(v.to_string()))),
        );
        DeadLetter::from_fields(id.into(), all)
    }

    /// The digest is of the canonical form the docs give (checked against
    /// `printf '2:{}12:content-type16:application/json' | sha256sum`): the
    /// body and the producer's headers, in any order and case of names,
    /// without courier's fields.
    #[test]
    fn the_digest_is_of_the_body_and_headers_in_canonical_form() {
        let letter = letter_of(
            "1-0",
            "{}",
            &[
                ("content-type", "application/json"),
                (F_REASON, "permanent-status"),
            ],
        );
        assert_eq!(
            letter.digest(),
            "sha256:6837ec66ac647fe850175f801e659377957bf4400ef22d2fbfdfa3884e8031f8"
        );
        let both = letter_of(
            "2-0",
            r#"{"amount":-5}"#,
            &[("X-Trace", "a"), ("content-type", "application/json")],
        );
        assert_eq!(
            both.digest(),
            "sha256:3cef959a1ab6c89f386ed662a906854939613c8452af447ec848c54733efa0a5"
        );
        let reordered = letter_of(
            "3-0",
            r#"{"amount":-5}"#,
            &[
                (F_STATUS, "400"),
                ("content-type", "application/json"),
                ("x-trace", "a"),
            ],
        );
        assert_eq!(reordered.digest(), both.digest());
        for other in [
            letter_of(
                "2-0",
                r#"{"amount":5}"#,
                &[("X-Trace", "a"), ("content-type", "application/json")],
            ),
            letter_of(
                "2-0",
                r#"{"amount":-5}"#,
                &[("X-Trace", "b"), ("content-type", "application/json")],
            ),
            letter_of(
                "2-0",
                r#"{"amount":-5}"#,
                &[("content-type", "application/json")],
            ),
            // The lengths keep a name from running into its value.
            letter_of(
                "2-0",
                r#"{"amount":-5}"#,
                &[("X-Tracea", ""), ("content-type", "application/json")],
            ),
        ] {
            assert_ne!(other.digest(), both.digest(), "{other:?}");
        }
    }

    /// An edited letter replays the new body and headers with the letter's
    /// lineage (replayed once, from this letter, the same message id) and
    /// the digest of what it was; a retry copy, the next dead letter and a
    /// plain replay of that keep the digest, and a second edit replaces it.
    #[test]
    fn an_edit_replays_the_new_message_and_keeps_the_digest_of_the_original() {
        let original = read(vec![
            ("payload".into(), r#"{"amount":-5}"#.into()),
            ("content-type".into(), "application/json".into()),
            ("x-old".into(), "1".into()),
        ]);
        let first = dead_letter_of(&original, "1700000000000-0", 400);
        let edited = first.edited(
            Bytes::from(r#"{"amount":5}"#),
            vec![
                ("content-type".into(), "application/json".into()),
                ("x-fixed".into(), "1".into()),
                ("Courier-Attempt".into(), "9".into()),
            ],
        );
        assert_eq!(edited.id, first.id);
        assert_eq!(
            edited.field(F_EDITED_FROM_DIGEST),
            Some(first.digest().as_str())
        );
        let replayed = read(edited.fields_for_replay());
        assert_eq!(replayed.message.body, Bytes::from(r#"{"amount":5}"#));
        assert_eq!(replayed.message.header("x-fixed"), Some("1"));
        assert_eq!(replayed.message.header("x-old"), None);
        assert_eq!(replayed.attempt, 1, "no header makes itself the attempt");
        assert_eq!(replayed.replay_count, 1);
        assert_eq!(replayed.message.id, "5-0", "the original id, for the key");

        let retried = read(replayed.fields_for_retry(2, SystemTime::UNIX_EPOCH));
        let second = dead_letter_of(&retried, "1700000000001-0", 422);
        assert_eq!(
            second.field(F_EDITED_FROM_DIGEST),
            Some(first.digest().as_str())
        );
        assert_eq!(second.field(F_REPLAYED_FROM), Some("1700000000000-0"));
        assert_eq!(second.field("x-fixed"), Some("1"));

        let again = read(second.fields_for_replay());
        let third = dead_letter_of(&again, "1700000000002-0", 400);
        assert_eq!(
            third.field(F_EDITED_FROM_DIGEST),
            Some(first.digest().as_str())
        );
        assert_eq!(third.replay_count(), 2);

        let twice = third.edited(third.body.clone(), Vec::new());
        let fields = twice.fields_for_replay();
        let digests: Vec<&Bytes> = fields
            .iter()
            .filter(|(n, _)| n.as_ref() == F_EDITED_FROM_DIGEST.as_bytes())
            .map(|(_, v)| v)
            .collect();
        assert_eq!(digests, [&Bytes::from(third.digest())]);
    }

    /// A broker that reads the letter again before it writes (RabbitMQ,
    /// NATS, SQS, Pub/Sub) writes an edit of what it holds as edited, a
    /// letter as listed or known by its id alone as it holds it, and
    /// refuses an edit of another letter.
    #[test]
    fn a_replay_over_the_stored_letter_writes_the_edit_or_the_stored_letter() {
        let stored = letter_of(
            "7",
            r#"{"amount":-5}"#,
            &[(F_MESSAGE_ID, "5-0"), ("content-type", "application/json")],
        );
        let body = |fields: Vec<(Bytes, Bytes)>| read(fields).message.body;
        let edit = stored.edited(Bytes::from(r#"{"amount":5}"#), Vec::new());
        assert_eq!(
            body(edit.fields_for_replay_of(&stored).unwrap()),
            Bytes::from(r#"{"amount":5}"#)
        );
        let by_id = DeadLetter::from_fields("7".into(), Vec::new());
        assert_eq!(
            by_id.fields_for_replay_of(&stored),
            Ok(stored.fields_for_replay())
        );
        assert_eq!(
            stored.fields_for_replay_of(&stored),
            Ok(stored.fields_for_replay())
        );

        // A letter an earlier edit made carries that edit's digest: as
        // listed, it is replayed as the broker holds it.
        let earlier = letter_of(
            "8",
            r#"{"amount":0}"#,
            &[(F_EDITED_FROM_DIGEST, "sha256:00"), (F_MESSAGE_ID, "5-0")],
        );
        assert_eq!(
            earlier.fields_for_replay_of(&earlier),
            Ok(earlier.fields_for_replay())
        );
        let edit_of_earlier = earlier.edited(Bytes::from(r#"{"amount":1}"#), Vec::new());
        assert_eq!(
            body(edit_of_earlier.fields_for_replay_of(&earlier).unwrap()),
            Bytes::from(r#"{"amount":1}"#)
        );

        let err = edit.fields_for_replay_of(&earlier).unwrap_err();
        assert!(err.contains("nothing was replayed"), "{err}");
    }
}
