//! A message, one delivery of it, and what a dead letter records.

use std::time::SystemTime;

use bytes::Bytes;

use super::fields::*;
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

    /// The fields of the fresh message a replay writes to the work queue:
    /// body and original headers, the original message id (so the app sees
    /// the same Idempotency-Key), `courier-replays` + 1, and no failure
    /// record, so the attempt count starts again at 1.
    pub fn fields_for_replay(&self) -> Vec<(Bytes, Bytes)> {
        let replays: u32 = self
            .field(F_REPLAYS)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
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
        out.push((F_REPLAYS.into(), Bytes::from((replays + 1).to_string())));
        out
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
                ("courier-replays".into(), "1".into()),
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
        assert_eq!(cut.field("courier-replays"), Some("1"));
        assert_eq!(cut.field(F_STATUS), Some("400"));
        assert_eq!(cut.field(F_REASON), Some("undeliverable"));
        assert!(cut.field(F_CUT).is_some_and(|c| c.contains("12 bytes")));
    }
}
