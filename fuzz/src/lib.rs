//! The bodies of courier's fuzz targets, one function per target. Each takes
//! raw bytes, feeds them to one parser or decoder, and checks what must hold
//! for every input: no panic, no unbounded allocation, and the properties
//! named in each function (round trips, ranges).
//!
//! The same functions run two ways: under libFuzzer through `cargo fuzz`
//! (`fuzz_targets/*.rs`, nightly; `scripts/fuzz`), and on stable as a seeded
//! smoke test over the seeds, the kept regressions and random mutations of
//! them (`tests/commands/fuzz_smoke.rs`, part of `cargo test`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use courier::forward::cloudevents::{self, Mode, STRUCTURED_TYPE};
use courier::forward::parse_retry_after;
use courier::model::{DeadLetterReason, Delivery, Directives, Failure, Message, Outcome};
use courier::policy::{CodeMatch, GateState, Verdict, decide};
use courier::source::{decode_fields, encode_fields};

/// A target's body: checks one input, panics on a finding.
pub type Check = fn(&[u8]);

/// The targets by name, as `cargo fuzz` knows them.
pub const TARGETS: &[(&str, Check)] = &[
    ("retry_after", retry_after),
    ("policy_document", policy_document),
    ("code_match", code_match),
    ("redis_entry", redis_entry),
    ("embedded_record", embedded_record),
    ("cloudevent", cloudevent),
];

/// A fixed "now" so that runs are reproducible: 2026-11-29 12:00:00 UTC.
fn now() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_795_953_600)
}

/// The last second an HTTP-date can name (9999-12-31 23:59:59 UTC).
const LAST_HTTP_DATE: u64 = 253_402_300_799;

/// `Retry-After` as delta-seconds or an HTTP-date.
///
/// - never panics, whatever the text;
/// - all digits (after trimming) is exactly that many seconds, saturating;
/// - anything else that parses is a date: zero once it has passed, and the
///   same instant measured from two "nows" differs by exactly their gap;
/// - a number or date made from the input reads back as itself.
pub fn retry_after(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let parsed = parse_retry_after(text, now());
        let trimmed = text.trim();
        if !trimmed.is_empty() && trimmed.bytes().all(|b| b.is_ascii_digit()) {
            let secs = trimmed.parse::<u64>().unwrap_or(u64::MAX);
            assert_eq!(parsed, Some(Duration::from_secs(secs)), "{text:?}");
        } else if let Some(delay) = parsed {
            let far_future = UNIX_EPOCH + Duration::from_secs(LAST_HTTP_DATE + 1);
            assert_eq!(
                parse_retry_after(text, far_future),
                Some(Duration::ZERO),
                "a date is in the past seen from after the last HTTP-date: {text:?}"
            );
            let earlier = now() - Duration::from_secs(3600);
            let from_earlier = parse_retry_after(text, earlier).expect("parses again");
            if !delay.is_zero() {
                assert_eq!(from_earlier, delay + Duration::from_secs(3600), "{text:?}");
            }
        }
    }
    let mut word = [0u8; 8];
    let n = data.len().min(8);
    word[..n].copy_from_slice(&data[..n]);
    let n = u64::from_le_bytes(word);
    assert_eq!(
        parse_retry_after(&n.to_string(), now()),
        Some(Duration::from_secs(n))
    );
    let at = UNIX_EPOCH + Duration::from_secs(n % (LAST_HTTP_DATE + 1));
    let date = httpdate::fmt_http_date(at);
    let want = at.duration_since(now()).unwrap_or(Duration::ZERO);
    assert_eq!(parse_retry_after(&date, now()), Some(want), "{date}");
}

/// A RetryPolicy document (`--policy-file`, the CRD's spec).
///
/// - parsing never panics, whatever the text;
/// - an accepted policy keeps every rule the design states: 1..=1000
///   attempts, a timeout above zero, `initial <= max`, a finite multiplier
///   `>= 1`, no code in both lists;
/// - deciding with it never panics, for any outcome, attempt and jitter,
///   and every delay it returns can be added to the clock (as the
///   dispatcher does to schedule a retry).
pub fn policy_document(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(policy) = courier::policy::file::parse(text) else {
        return;
    };
    assert!((1..=1000).contains(&policy.max_attempts), "{policy:?}");
    assert!(!policy.timeout.is_zero(), "{policy:?}");
    assert!(policy.backoff.initial <= policy.backoff.max, "{policy:?}");
    assert!(
        policy.backoff.multiplier.is_finite() && policy.backoff.multiplier >= 1.0,
        "{policy:?}"
    );
    let codes = &policy.status_codes;
    assert!(
        !codes.retry.iter().any(|m| codes.dead_letter.contains(m)),
        "{policy:?}"
    );
    let outcomes = [
        answered(200, None),
        answered(204, None),
        answered(302, None),
        answered(400, None),
        answered(408, None),
        answered(429, Some(Duration::from_secs(u64::MAX))),
        answered(429, Some(Duration::ZERO)),
        answered(500, None),
        answered(501, None),
        answered(503, Some(Duration::from_secs(7))),
        answered(599, None),
        answered(999, None),
        saying(200, true, true),
        saying(404, true, false),
        saying(500, true, false),
        saying(503, false, true),
        saying(400, false, true),
        Outcome::Timeout,
        Outcome::Unreachable {
            error: "refused".into(),
        },
        Outcome::ConnectionLost {
            error: "reset".into(),
        },
        Outcome::Undeliverable {
            error: "too large".into(),
        },
    ];
    let last = policy.max_attempts;
    let attempts = [0, 1, 2, last.saturating_sub(1), last, last + 1, u32::MAX];
    for outcome in &outcomes {
        for attempt in attempts {
            // The dispatcher's samples are uniform in [0, 1).
            for (sample, gate) in [0.0, 0.5, 0.999_999]
                .into_iter()
                .flat_map(|s| [(s, GateState::Open), (s, GateState::Closed)])
            {
                let decision = decide(&policy, outcome, attempt, gate, sample);
                match decision.verdict {
                    Verdict::Ack => assert!(
                        matches!(
                            outcome,
                            Outcome::Answered {
                                status: 200..=299,
                                ..
                            }
                        ),
                        "{outcome:?} acked"
                    ),
                    Verdict::Retry { delay, .. } => {
                        let cap = policy.backoff.max.max(policy.retry_after.max);
                        assert!(delay <= cap, "{delay:?} over {cap:?}");
                        assert!(SystemTime::now().checked_add(delay).is_some());
                    }
                    Verdict::DeadLetter { reason } => {
                        if reason == DeadLetterReason::AttemptsExhausted {
                            assert!(attempt.max(1) >= policy.max_attempts);
                        }
                        // Only the app's header, and only when the policy
                        // lets it count, is an app-dead-letter.
                        if reason == DeadLetterReason::AppDeadLetter {
                            assert!(policy.app_directives, "{policy:?}");
                            assert!(policy.directive_in_force(outcome).is_some(), "{outcome:?}");
                        }
                    }
                }
            }
        }
    }
}

fn answered(status: u16, retry_after: Option<Duration>) -> Outcome {
    Outcome::Answered {
        status,
        retry_after,
        retry_after_invalid: false,
        excerpt: Bytes::new(),
        directives: Default::default(),
    }
}

/// An answer with the app's say: `Courier-Dead-Letter` and `Courier-Retry: never`.
fn saying(status: u16, dead_letter: bool, retry_never: bool) -> Outcome {
    Outcome::Answered {
        status,
        retry_after: Some(Duration::from_secs(7)),
        retry_after_invalid: false,
        excerpt: Bytes::new(),
        directives: Directives {
            dead_letter: dead_letter.then(|| "poison".to_string()),
            retry_never,
            retry_unknown: None,
        },
    }
}

/// A status-code matcher in `statusCodes`: `"503"` or `"5xx"`.
///
/// - never panics, whatever the text (including multi-byte characters);
/// - what it accepts prints back as the same text, names a code in 100..=599
///   or a class in 1..=5, and matches what it names;
/// - every code from 100 to 599 written out is accepted as itself.
pub fn code_match(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        match CodeMatch::parse(text) {
            Some(m @ CodeMatch::Exact(code)) => {
                assert!((100..=599).contains(&code), "{text:?}");
                assert_eq!(m.to_string(), text);
                assert!(m.matches(code));
                assert!(!m.matches(code.wrapping_add(1)));
            }
            Some(m @ CodeMatch::Class(class)) => {
                assert!((1..=5).contains(&class), "{text:?}");
                assert_eq!(m.to_string(), text);
                assert!(m.matches(class * 100) && m.matches(class * 100 + 99));
                assert!(!m.matches(class * 100 + 100));
            }
            None => {}
        }
    }
    let n = u16::from_le_bytes([
        data.first().copied().unwrap_or(0),
        data.get(1).copied().unwrap_or(0),
    ]);
    let parsed = CodeMatch::parse(&n.to_string());
    if (100..=599).contains(&n) {
        assert_eq!(parsed, Some(CodeMatch::Exact(n)));
    } else {
        assert_eq!(parsed, None, "{n}");
    }
}

/// Splits bytes into fields: a 4-byte little-endian count of deliveries the
/// broker made that courier never settled, then names and values separated
/// by NUL bytes.
fn fields_of(data: &[u8]) -> (u32, Vec<(Bytes, Bytes)>) {
    let (head, rest) = data.split_at(data.len().min(4));
    let mut word = [0u8; 4];
    word[..head.len()].copy_from_slice(head);
    let extra = u32::from_le_bytes(word);
    let parts: Vec<&[u8]> = if rest.is_empty() {
        Vec::new()
    } else {
        rest.split(|b| *b == 0).collect()
    };
    let fields = parts
        .chunks(2)
        .map(|pair| {
            (
                Bytes::copy_from_slice(pair[0]),
                Bytes::copy_from_slice(pair.get(1).copied().unwrap_or_default()),
            )
        })
        .collect();
    (extra, fields)
}

/// A Redis stream entry (or any stored message) read as a delivery.
///
/// - reading never panics, whatever the fields and counts;
/// - the attempt is at least 1; an entry without `payload` is a problem to
///   dead-letter, never a message for the app;
/// - a retry stores fields that read back as the same message (id, body,
///   headers) at the next attempt, through the binary encoding the retry
///   set uses;
/// - a dead letter carries each failure field exactly once.
pub fn redis_entry(data: &[u8]) {
    let (extra, fields) = fields_of(data);
    let has_payload = fields.iter().any(|(n, _)| n.as_ref() == b"payload");
    let delivery = Delivery::from_fields("1-0", fields, extra, "1-0".into(), None);
    assert!(delivery.attempt >= 1);
    assert_eq!(delivery.problem.is_none(), has_payload);
    let first = UNIX_EPOCH + Duration::from_millis(1_795_953_600_123);
    for next in [1, delivery.attempt, delivery.attempt.saturating_add(1)] {
        let stored = delivery.fields_for_retry(next, first);
        let wire = Bytes::from(encode_fields(&stored));
        assert_eq!(decode_fields(&wire).as_ref(), Some(&stored));
        let again = Delivery::from_fields("2-0", stored, 0, "2-0".into(), Some(first));
        assert_eq!(again.message, delivery.message);
        assert_eq!(again.attempt, next);
        assert_eq!(again.first_attempt_at, Some(first));
        assert_eq!(again.problem, delivery.problem);
    }
    let failure = Failure {
        reason: DeadLetterReason::PermanentStatus,
        status: Some(400),
        error: None,
        attempts: delivery.attempt,
        first_attempt_at: first,
        last_attempt_at: first,
        queue: "orders".into(),
        message_id: delivery.message.id.clone(),
        excerpt: Bytes::from_static(b"bad order"),
        policy: "fuzz@1".into(),
        dead_letter_queue: "orders.dlq".into(),
        app_directive: Some("Courier-Dead-Letter: poison".into()),
        cut: None,
    };
    let letter = delivery.fields_for_dead_letter(&failure);
    for (name, _) in failure.fields() {
        let count = letter
            .iter()
            .filter(|(n, _)| n.as_ref() == name.as_bytes())
            .count();
        assert_eq!(count, 1, "{name} in {letter:?}");
    }
}

/// The embedded store's record (and the retry set's member): a MessagePack
/// array of byte strings.
///
/// - decoding never panics and never allocates more than the input
///   justifies, whatever the bytes claim about lengths and counts;
/// - what decodes re-encodes to bytes that decode to the same fields;
/// - the decoded fields read as a delivery without panicking.
pub fn embedded_record(data: &[u8]) {
    let data = Bytes::copy_from_slice(data);
    let Some(fields) = decode_fields(&data) else {
        return;
    };
    let again = Bytes::from(encode_fields(&fields));
    assert_eq!(decode_fields(&again).as_ref(), Some(&fields));
    let delivery = Delivery::from_fields("7", fields, 0, "0:7".into(), None);
    assert!(delivery.attempt >= 1);
}

/// A message read as a CloudEvent (`forward::cloudevents`): the input as a
/// body with no content type and with the structured one, and as the data
/// of a binary message whose attributes are cut from the input.
///
/// - reading never panics, whatever the bytes;
/// - an event's `<source>:<id>` key is printable ASCII (a header value);
/// - an event renders in both modes, and structured mode's body is an event
///   in the JSON format with the same id, source and type (the JSON written
///   for an event that came as headers escapes everything it must);
/// - binary mode's body of a structured event with JSON data is JSON.
pub fn cloudevent(data: &[u8]) {
    let body = Bytes::copy_from_slice(data);
    let text = String::from_utf8_lossy(data);
    let mut parts = text.splitn(4, '\n');
    let mut part = || parts.next().unwrap_or("x").to_string();
    let (id, source, kind, content_type) = (part(), part(), part(), part());
    let header = |n: &str, v: &str| (n.to_string(), v.to_string());
    let messages = [
        vec![],
        vec![header("content-type", STRUCTURED_TYPE)],
        vec![
            header("ce-specversion", "1.0"),
            header("ce-id", &id),
            header("ce-source", &source),
            header("cloudEvents:type", &kind),
            header("content-type", &content_type),
        ],
    ];
    for (i, headers) in messages.into_iter().enumerate() {
        let message = Message {
            id: "1".into(),
            body: body.clone(),
            headers,
        };
        let Ok(Some(event)) = cloudevents::read(&message) else {
            continue;
        };
        assert!(event.key().bytes().all(|b| (0x21..=0x7e).contains(&b)));
        let binary = event.render(Mode::Binary, &body);
        // A binary message's body is the producer's bytes, whatever they are.
        let structured_form = i < 2;
        if structured_form && binary.content_type.as_deref() == Some("application/json") {
            // Checked as the body was: the JSON grammar (a lone surrogate
            // escape is grammatical, though serde_json's Value refuses it).
            serde_json::from_slice::<serde::de::IgnoredAny>(&binary.body)
                .expect("JSON data is JSON");
        }
        let structured = event.render(Mode::Structured, &body);
        let again = Message {
            id: "2".into(),
            body: structured.body,
            headers: vec![header("content-type", STRUCTURED_TYPE)],
        };
        let read_back = cloudevents::read(&again)
            .unwrap_or_else(|e| panic!("structured mode wrote an invalid event: {e}"))
            .expect("an event");
        for name in ["id", "source", "type"] {
            assert_eq!(read_back.attribute(name), event.attribute(name), "{name}");
        }
    }
}
