//! A batch of messages in one POST, and the app's status per entry
//! (docs/batches.md).
//!
//! The request is `{"entries": [...]}` (`application/json`), each entry a
//! message with its id, its headers as a single delivery would carry them
//! and its body (`json` for a JSON body, `body` for text, `body` in base64
//! with `"encoding": "base64"` for other bytes). When every message is a
//! CloudEvent the request is CloudEvents' batched mode instead
//! (`application/cloudevents-batch+json`): an array of events in the JSON
//! format, each with the extension attributes `courierid` (the entry's id)
//! and `courierattempt`.
//!
//! The app answers 2xx with `{"statuses": [{"id", "status", "reason"?}]}`.
//! Reading the answer never guesses in the app's favour: an id that is no
//! entry's is ignored, an entry named twice with different statuses counts
//! as not mentioned, and an answer that cannot be read (not JSON, too
//! large) mentions no entry; an entry not mentioned is retried.

use std::collections::HashMap;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::{Bytes, BytesMut};
use http::header::{CONTENT_TYPE, HOST, HeaderValue, RETRY_AFTER};
use http::{Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use serde::de::IgnoredAny;
use serde_json::Value;

use super::cloudevents::{self, Event};
use super::pool::Failure;
use super::{Envelope, Forwarder, QueueName, TraceHeaders, is_reserved, parse_retry_after};
use super::{QUEUE, read_directives};
use crate::model::{EXCERPT_LIMIT, Message, Outcome};

/// The request's content type when its entries are courier's own.
pub const ENTRIES_TYPE: &str = "application/json";
/// The request's content type in CloudEvents' batched mode.
pub const CLOUDEVENTS_BATCH_TYPE: &str = "application/cloudevents-batch+json";
/// How many messages the batch holds, on the request.
static BATCH_SIZE: http::HeaderName = http::HeaderName::from_static("courier-batch-size");
/// An answer is read up to this, plus [`ANSWER_PER_ENTRY`] for each entry;
/// a longer one is not read and mentions no entry.
const ANSWER_BASE: usize = 64 * 1024;
/// Room for an entry's status with a reason of [`EXCERPT_LIMIT`] bytes.
const ANSWER_PER_ENTRY: usize = 2 * 1024;

/// One message of a batch.
#[derive(Clone, Copy)]
pub struct BatchEntry<'a> {
    pub message: &'a Message,
    pub attempt: u32,
    pub replay_count: u32,
}

/// The messages of one request, all to one path.
pub struct Batch<'a> {
    pub entries: &'a [BatchEntry<'a>],
    pub queue: &'a QueueName,
    /// A route's path in place of the app URL's own.
    pub path: Option<&'a Uri>,
}

/// What the app said of one entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    Success,
    Retry,
    /// Dead-letter it, with the app's reason (at most [`EXCERPT_LIMIT`]
    /// bytes of it).
    Drop {
        reason: Option<String>,
    },
}

/// An entry's status and the status object as the app sent it, for the
/// dead letter's excerpt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Said {
    pub status: Status,
    pub excerpt: Bytes,
}

/// The statuses of a 2xx answer, one per entry in the batch's order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Statuses {
    /// `None`: the answer does not mention the entry (or mentions it with
    /// statuses that disagree): it is retried.
    pub entries: Vec<Option<Said>>,
    /// Statuses whose id is no entry's, or that are not readable.
    pub unknown: usize,
    /// Entries named more than once with different statuses.
    pub conflicting: usize,
    /// Why the answer could not be read at all, when it could not.
    pub unreadable: Option<String>,
}

/// The app's answer to a batch: the request's [`Outcome`] (what the gate,
/// the limit and the hold learn from), and for a 2xx its statuses.
#[derive(Debug)]
pub struct BatchAnswer {
    pub outcome: Outcome,
    pub statuses: Option<Statuses>,
}

/// How many bytes a message takes in a batch's request, about: what a
/// batch is cut by, so that its request stays within `--max-body`.
pub fn entry_size(message: &Message) -> usize {
    let headers: usize = message
        .headers
        .iter()
        .map(|(n, v)| n.len() + v.len() + 8)
        .sum();
    // Base64 is 4/3 of the bytes; JSON escapes rarely add more in text.
    headers + message.body.len() * 4 / 3 + 256
}

/// The request body and the ids the statuses are matched by.
struct Built {
    body: Vec<u8>,
    content_type: &'static str,
    /// Each entry's id, unique in the batch.
    ids: Vec<String>,
    /// Other names an entry answers to: a CloudEvent's own `id`, when no
    /// other entry has it.
    aliases: Vec<Option<String>>,
}

// === impl Forwarder ===

impl Forwarder {
    /// Why a message cannot go in a batch, when it cannot: it claims to be
    /// a CloudEvent and is not a valid one. A single delivery says the same
    /// and dead-letters it as undeliverable.
    pub fn unbatchable(&self, message: &Message) -> bool {
        self.event(message).is_err()
    }

    /// Offers `batch` in one request and reads the statuses of a 2xx
    /// answer; the whole exchange takes at most `timeout`.
    pub async fn deliver_batch(&self, batch: &Batch<'_>, timeout: Duration) -> BatchAnswer {
        let (request, built) = match self.build_batch(batch) {
            Ok(built) => built,
            Err(error) => {
                return BatchAnswer {
                    outcome: Outcome::Undeliverable { error },
                    statuses: None,
                };
            }
        };
        let limit = ANSWER_BASE + ANSWER_PER_ENTRY * batch.entries.len();
        match tokio::time::timeout(timeout, self.exchange_batch(request, limit)).await {
            Ok((outcome, body)) => {
                let statuses = match (&outcome, body) {
                    (Outcome::Answered { status, .. }, answer) if (200..300).contains(status) => {
                        Some(match answer {
                            Some(answer) => read_statuses(&answer, &built.ids, &built.aliases),
                            None => Statuses {
                                entries: vec![None; built.ids.len()],
                                unreadable: Some(format!(
                                    "the answer is longer than {limit} bytes"
                                )),
                                ..Statuses::default()
                            },
                        })
                    }
                    _ => None,
                };
                BatchAnswer { outcome, statuses }
            }
            Err(_) => BatchAnswer {
                outcome: Outcome::Timeout,
                statuses: None,
            },
        }
    }

    fn build_batch(&self, batch: &Batch<'_>) -> Result<(Request<Full<Bytes>>, Built), String> {
        let events: Option<Vec<Event>> = match self.cloudevents {
            cloudevents::Mode::Off => None,
            _ => batch
                .entries
                .iter()
                .map(|entry| self.event(entry.message).ok().flatten())
                .collect(),
        };
        let mut built = match events {
            Some(events) if !batch.entries.is_empty() => event_batch(batch, &events)?,
            _ => self.entry_batch(batch)?,
        };
        let queue = batch.queue.header.clone().ok_or_else(|| {
            format!(
                "queue {:?} is not a valid header value",
                batch.queue.as_str()
            )
        })?;
        let request = Request::builder()
            .method(Method::POST)
            .uri(batch.path.unwrap_or(&self.path).clone())
            .header(HOST, self.host.clone())
            .header(CONTENT_TYPE, HeaderValue::from_static(built.content_type))
            .header(QUEUE.clone(), queue)
            .header(BATCH_SIZE.clone(), HeaderValue::from(batch.entries.len()))
            .body(Full::new(Bytes::from(std::mem::take(&mut built.body))))
            .map_err(|e| e.to_string())?;
        Ok((request, built))
    }

    /// `{"entries": [...]}`: each message with the headers a single
    /// delivery would carry.
    fn entry_batch(&self, batch: &Batch<'_>) -> Result<Built, String> {
        let ids = unique_ids(batch.entries.iter().map(|e| e.message.id.as_str()));
        let mut out = String::with_capacity(
            batch
                .entries
                .iter()
                .map(|e| entry_size(e.message))
                .sum::<usize>()
                + 16,
        );
        out.push_str("{\"entries\":[");
        for (i, (entry, id)) in batch.entries.iter().zip(&ids).enumerate() {
            if i > 0 {
                out.push(',');
            }
            self.write_entry(&mut out, entry, id, batch.queue);
        }
        out.push_str("]}");
        Ok(Built {
            body: out.into_bytes(),
            content_type: ENTRIES_TYPE,
            aliases: vec![None; ids.len()],
            ids,
        })
    }

    fn write_entry(&self, out: &mut String, entry: &BatchEntry<'_>, id: &str, queue: &QueueName) {
        let message = entry.message;
        let envelope = Envelope {
            message,
            queue,
            attempt: entry.attempt,
            replay_count: entry.replay_count,
            trace: None::<&TraceHeaders>,
            path: None,
        };
        let content_type = message.header("content-type");
        let mut headers: Vec<(String, String)> = Vec::with_capacity(message.headers.len() + 6);
        for (name, value) in &message.headers {
            if !is_reserved(name) && http::HeaderName::from_bytes(name.as_bytes()).is_ok() {
                headers.push((name.to_ascii_lowercase(), value.clone()));
            }
        }
        headers.push((
            "content-type".into(),
            content_type.unwrap_or("application/octet-stream").into(),
        ));
        headers.push(("idempotency-key".into(), self.idempotency_key(&envelope)));
        headers.push(("courier-message-id".into(), message.id.clone()));
        headers.push(("courier-attempt".into(), entry.attempt.to_string()));
        headers.push(("courier-queue".into(), queue.as_str().into()));
        if entry.replay_count > 0 {
            headers.push((
                "courier-replay-count".into(),
                entry.replay_count.to_string(),
            ));
        }
        out.push_str("{\"id\":");
        out.push_str(&json_string(id));
        out.push_str(",\"headers\":{");
        // A name given twice is one member, its values joined as HTTP
        // joins a repeated header.
        let mut joined: Vec<(String, String)> = Vec::with_capacity(headers.len());
        for (name, value) in headers {
            match joined.iter_mut().find(|(n, _)| *n == name) {
                Some((_, v)) => {
                    v.push_str(", ");
                    v.push_str(&value);
                }
                None => joined.push((name, value)),
            }
        }
        for (i, (name, value)) in joined.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&json_string(name));
            out.push(':');
            out.push_str(&json_string(value));
        }
        out.push('}');
        let body = &message.body;
        let json = content_type.is_some_and(is_json_type)
            && serde_json::from_slice::<IgnoredAny>(body).is_ok();
        match (json, std::str::from_utf8(body)) {
            // Valid JSON, embedded as it is.
            (true, Ok(text)) => {
                out.push_str(",\"json\":");
                out.push_str(text);
            }
            (_, Ok(text)) => {
                out.push_str(",\"body\":");
                out.push_str(&json_string(text));
            }
            (_, Err(_)) => {
                out.push_str(",\"body\":");
                out.push_str(&json_string(&BASE64.encode(body)));
                out.push_str(",\"encoding\":\"base64\"");
            }
        }
        out.push('}');
    }

    async fn exchange_batch(
        &self,
        request: Request<Full<Bytes>>,
        limit: usize,
    ) -> (Outcome, Option<Bytes>) {
        let (response, lent) = match self.pool.send(request).await {
            Ok(sent) => sent,
            Err(Failure::NeverSent(error)) => return (Outcome::Unreachable { error }, None),
            Err(Failure::Lost(error)) => return (Outcome::ConnectionLost { error }, None),
        };
        let status = response.status().as_u16();
        let (retry_after, retry_after_invalid) = match response.headers().get(RETRY_AFTER) {
            None => (None, false),
            Some(value) => {
                let parsed = value
                    .to_str()
                    .ok()
                    .and_then(|v| parse_retry_after(v, std::time::SystemTime::now()));
                (parsed, parsed.is_none())
            }
        };
        let directives = read_directives(response.headers());
        let mut body = response.into_body();
        let mut read = BytesMut::new();
        let mut whole = false;
        loop {
            let Some(frame) = body.frame().await else {
                whole = true;
                break;
            };
            let Ok(frame) = frame else { break };
            if let Ok(data) = frame.into_data() {
                if read.len() + data.len() > limit {
                    break;
                }
                read.extend_from_slice(&data);
            }
        }
        // Only a connection whose answer was read to its end can carry the
        // next request.
        if whole {
            self.pool.give_back(lent);
        }
        let read = read.freeze();
        let excerpt = read.slice(..read.len().min(EXCERPT_LIMIT));
        let outcome = Outcome::Answered {
            status,
            retry_after,
            retry_after_invalid,
            excerpt,
            directives,
        };
        (outcome, whole.then_some(read))
    }
}

/// CloudEvents' batched mode: every event in the JSON format, each with
/// `courierid` and `courierattempt`.
fn event_batch(batch: &Batch<'_>, events: &[Event]) -> Result<Built, String> {
    let ids = unique_ids(batch.entries.iter().map(|e| e.message.id.as_str()));
    let mut members = Vec::with_capacity(events.len());
    for ((entry, event), id) in batch.entries.iter().zip(events).zip(&ids) {
        let rendered = event.render(cloudevents::Mode::Structured, &entry.message.body);
        let mut object: serde_json::Map<String, Value> = serde_json::from_slice(&rendered.body)
            .map_err(|e| format!("CloudEvent {id}: not a JSON object ({e})"))?;
        object.insert("courierid".into(), Value::String(id.clone()));
        object.insert("courierattempt".into(), Value::from(entry.attempt));
        members.push(Value::Object(object));
    }
    // An event's own id is a name for it only where no other entry has it.
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for event in events {
        *counts
            .entry(event.attribute("id").unwrap_or_default())
            .or_default() += 1;
    }
    let aliases = events
        .iter()
        .map(|event| {
            let own = event.attribute("id").unwrap_or_default();
            (counts[own] == 1 && !ids.iter().any(|id| id == own)).then(|| own.to_string())
        })
        .collect();
    let body = serde_json::to_vec(&members).map_err(|e| e.to_string())?;
    Ok(Built {
        body,
        content_type: CLOUDEVENTS_BATCH_TYPE,
        ids,
        aliases,
    })
}

/// The messages' ids, made unique in the batch: a second message with an
/// id already taken (a redelivered copy beside its original) is `<id>#2`.
fn unique_ids<'a>(ids: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut taken: HashMap<String, usize> = HashMap::new();
    let mut out = Vec::new();
    for id in ids {
        let mut candidate = id.to_string();
        let mut n = 1;
        while taken.contains_key(&candidate) {
            n += 1;
            candidate = format!("{id}#{n}");
        }
        taken.insert(candidate.clone(), out.len());
        out.push(candidate);
    }
    out
}

/// Reads the statuses of a 2xx answer to the entries `ids` (and their
/// `aliases`). Never fails: what cannot be read mentions no entry.
pub fn read_statuses(answer: &[u8], ids: &[String], aliases: &[Option<String>]) -> Statuses {
    let mut statuses = Statuses {
        entries: vec![None; ids.len()],
        ..Statuses::default()
    };
    let list = match serde_json::from_slice::<Value>(answer) {
        Ok(Value::Object(mut object)) => match object.remove("statuses") {
            Some(Value::Array(list)) => list,
            _ => {
                statuses.unreadable = Some("the answer has no \"statuses\" array".into());
                return statuses;
            }
        },
        Ok(_) => {
            statuses.unreadable = Some("the answer is not a JSON object".into());
            return statuses;
        }
        Err(e) => {
            statuses.unreadable = Some(format!("the answer is not JSON ({e})"));
            return statuses;
        }
    };
    let mut index: HashMap<&str, usize> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (id.as_str(), i))
        .collect();
    for (i, alias) in aliases.iter().enumerate() {
        if let Some(alias) = alias {
            index.entry(alias.as_str()).or_insert(i);
        }
    }
    let mut conflicting = vec![false; ids.len()];
    for item in list {
        let Some((id, said)) = read_status(&item) else {
            statuses.unknown += 1;
            continue;
        };
        let Some(&at) = index.get(id.as_str()) else {
            statuses.unknown += 1;
            continue;
        };
        match &statuses.entries[at] {
            Some(before) if before.status != said.status => conflicting[at] = true,
            Some(_) => {}
            None => statuses.entries[at] = Some(said),
        }
    }
    for (entry, conflict) in statuses.entries.iter_mut().zip(conflicting) {
        if conflict {
            *entry = None;
            statuses.conflicting += 1;
        }
    }
    statuses
}

/// One status object: its id (a string, or a number written as one) and
/// what it says; `None` when it says nothing readable.
fn read_status(item: &Value) -> Option<(String, Said)> {
    let object = item.as_object()?;
    let id = match object.get("id")? {
        Value::String(id) => id.clone(),
        Value::Number(n) => n.to_string(),
        _ => return None,
    };
    let word = object.get("status")?.as_str()?;
    let status = if word.eq_ignore_ascii_case("success") {
        Status::Success
    } else if word.eq_ignore_ascii_case("retry") {
        Status::Retry
    } else if word.eq_ignore_ascii_case("drop") {
        let reason = object
            .get("reason")
            .and_then(Value::as_str)
            .map(|r| cut(r.trim()));
        Status::Drop { reason }
    } else {
        return None;
    };
    let excerpt = serde_json::to_vec(item).unwrap_or_default();
    let excerpt = Bytes::from(excerpt).slice(..);
    let excerpt = excerpt.slice(..excerpt.len().min(EXCERPT_LIMIT));
    Some((id, Said { status, excerpt }))
}

/// At most [`EXCERPT_LIMIT`] bytes of `text`, cut at a character boundary.
fn cut(text: &str) -> String {
    let mut end = text.len().min(EXCERPT_LIMIT);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

fn json_string(text: &str) -> String {
    serde_json::to_string(text).expect("a string serializes")
}

/// Whether a content type says JSON: `application/json` or `…+json`.
fn is_json_type(content_type: &str) -> bool {
    let media = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    media == "application/json" || media.ends_with("+json")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("m{i}")).collect()
    }

    fn read(answer: &str, n: usize) -> Statuses {
        read_statuses(answer.as_bytes(), &ids(n), &vec![None; n])
    }

    fn statuses_of(statuses: &Statuses) -> Vec<Option<Status>> {
        statuses
            .entries
            .iter()
            .map(|s| s.as_ref().map(|s| s.status.clone()))
            .collect()
    }

    #[test]
    fn each_status_is_read_and_an_unmentioned_entry_has_none() {
        let answer = r#"{"statuses":[
            {"id":"m0","status":"success"},
            {"id":"m1","status":"RETRY"},
            {"id":"m2","status":"drop","reason":"  unknown SKU  "},
            {"id":"m4","status":"drop"}]}"#;
        let statuses = read(answer, 5);
        assert_eq!(
            statuses_of(&statuses),
            [
                Some(Status::Success),
                Some(Status::Retry),
                Some(Status::Drop {
                    reason: Some("unknown SKU".into())
                }),
                None,
                Some(Status::Drop { reason: None }),
            ]
        );
        assert_eq!(statuses.unknown, 0);
        assert!(statuses.unreadable.is_none());
        let excerpt = &statuses.entries[2].as_ref().unwrap().excerpt;
        assert!(
            std::str::from_utf8(excerpt)
                .unwrap()
                .contains("unknown SKU")
        );
    }

    /// Nothing the app sends makes an entry acked that it did not say
    /// success for, and nothing makes an entry lost: every entry ends with
    /// a status or none (retried).
    #[test]
    fn hostile_answers_ack_nothing_unsaid() {
        let unreadable = [
            "",
            "not json",
            "[]",
            "{\"statuses\":{}}",
            "{\"statuses\":\"success\"}",
            "{\"other\":[]}",
            "{\"statuses\":[{\"id\":\"m0\",\"status\":\"success\"}",
        ];
        for answer in unreadable {
            let statuses = read(answer, 3);
            assert!(statuses.unreadable.is_some(), "{answer:?}");
            assert_eq!(statuses_of(&statuses), [None, None, None], "{answer:?}");
        }
        // Unknown ids, odd members and unknown words mention no entry.
        let odd = r#"{"statuses":[
            {"id":"nobody","status":"success"},
            {"id":"m0","status":"maybe"},
            {"id":"m0"},
            {"status":"success"},
            {"id":["m1"],"status":"success"},
            {"id":"m1","status":5},
            "m2", 7, null]}"#;
        let statuses = read(odd, 3);
        assert_eq!(statuses_of(&statuses), [None, None, None]);
        assert_eq!(statuses.unknown, 9);
        // Duplicates: the same status twice is that status; statuses that
        // disagree are no status at all.
        let duplicates = r#"{"statuses":[
            {"id":"m0","status":"success"},{"id":"m0","status":"success"},
            {"id":"m1","status":"success"},{"id":"m1","status":"drop"},
            {"id":"m2","status":"retry"},{"id":"m2","status":"success"},{"id":"m2","status":"retry"}]}"#;
        let statuses = read(duplicates, 3);
        assert_eq!(statuses_of(&statuses), [Some(Status::Success), None, None]);
        assert_eq!(statuses.conflicting, 2);
        // A numeric id is read as its text.
        let numeric = read_statuses(
            br#"{"statuses":[{"id":17,"status":"success"}]}"#,
            &["17".to_string()],
            &[None],
        );
        assert_eq!(statuses_of(&numeric), [Some(Status::Success)]);
    }

    #[test]
    fn a_huge_reason_is_cut_and_a_huge_answer_is_still_bounded() {
        let reason = "é".repeat(EXCERPT_LIMIT);
        let answer =
            format!(r#"{{"statuses":[{{"id":"m0","status":"drop","reason":"{reason}"}}]}}"#);
        let statuses = read(&answer, 1);
        let Some(Said {
            status: Status::Drop {
                reason: Some(reason),
            },
            excerpt,
        }) = &statuses.entries[0]
        else {
            panic!("{statuses:?}");
        };
        assert!(reason.len() <= EXCERPT_LIMIT && reason.len() > EXCERPT_LIMIT - 2);
        assert!(excerpt.len() <= EXCERPT_LIMIT);
        // A hundred thousand statuses for entries that do not exist.
        let many: Vec<String> = (0..100_000)
            .map(|i| format!(r#"{{"id":"x{i}","status":"success"}}"#))
            .collect();
        let answer = format!(r#"{{"statuses":[{}]}}"#, many.join(","));
        let statuses = read(&answer, 2);
        assert_eq!(statuses_of(&statuses), [None, None]);
        assert_eq!(statuses.unknown, 100_000);
    }

    #[test]
    fn ids_are_unique_in_a_batch() {
        let ids = unique_ids(["a", "b", "a", "a#2", "a"].into_iter());
        assert_eq!(ids, ["a", "b", "a#2", "a#2#2", "a#3"]);
    }

    fn message(id: &str, body: &'static [u8], headers: &[(&str, &str)]) -> Message {
        Message {
            id: id.into(),
            body: Bytes::from_static(body),
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
        }
    }

    fn body_of(request: Request<Full<Bytes>>) -> (String, Value) {
        let content_type = request.headers()[CONTENT_TYPE]
            .to_str()
            .unwrap()
            .to_string();
        let body = futures::executor::block_on(request.into_body().collect())
            .unwrap()
            .to_bytes();
        (content_type, serde_json::from_slice(&body).unwrap())
    }

    #[test]
    fn entries_carry_id_headers_and_a_body_in_the_form_that_fits() {
        let forwarder = Forwarder::new("http://127.0.0.1:8080/orders".parse().unwrap(), 1);
        let queue = QueueName::new("orders");
        let messages = [
            message(
                "1-0",
                br#"{"total": 5}"#,
                &[
                    ("content-type", "application/json"),
                    ("x-tenant", "7"),
                    ("courier-x", "no"),
                ],
            ),
            message("2-0", b"plain text", &[]),
            message(
                "3-0",
                b"\xff\x00bytes",
                &[("content-type", "application/octet-stream")],
            ),
            message("1-0", b"{not json", &[("content-type", "application/json")]),
        ];
        let entries: Vec<BatchEntry<'_>> = messages
            .iter()
            .map(|message| BatchEntry {
                message,
                attempt: 2,
                replay_count: 0,
            })
            .collect();
        let batch = Batch {
            entries: &entries,
            queue: &queue,
            path: None,
        };
        let (request, built) = forwarder.build_batch(&batch).unwrap();
        assert_eq!(request.uri(), "/orders");
        assert_eq!(request.headers()["courier-batch-size"], "4");
        assert_eq!(built.ids, ["1-0", "2-0", "3-0", "1-0#2"]);
        let (content_type, body) = body_of(request);
        assert_eq!(content_type, ENTRIES_TYPE);
        let entries = body["entries"].as_array().unwrap();
        assert_eq!(entries[0]["id"], "1-0");
        assert_eq!(entries[0]["json"]["total"], 5);
        assert_eq!(entries[0]["headers"]["x-tenant"], "7");
        assert_eq!(entries[0]["headers"]["courier-attempt"], "2");
        assert_eq!(entries[0]["headers"]["idempotency-key"], "orders:1-0");
        assert_eq!(entries[0]["headers"]["content-type"], "application/json");
        assert!(entries[0]["headers"].get("courier-x").is_none());
        assert_eq!(entries[1]["body"], "plain text");
        assert!(entries[1].get("encoding").is_none());
        assert_eq!(entries[2]["encoding"], "base64");
        assert_eq!(
            BASE64.decode(entries[2]["body"].as_str().unwrap()).unwrap(),
            b"\xff\x00bytes"
        );
        assert_eq!(entries[3]["id"], "1-0#2");
        assert_eq!(entries[3]["body"], "{not json");
    }

    #[test]
    fn a_batch_of_events_is_cloudevents_batched_mode() {
        let forwarder = Forwarder::new("http://127.0.0.1:8080/".parse().unwrap(), 1);
        let queue = QueueName::new("orders");
        let messages = [
            message(
                "1-0",
                br#"{"specversion":"1.0","id":"e1","source":"/shop","type":"order.created","data":{"total":5}}"#,
                &[],
            ),
            message(
                "2-0",
                b"binary data",
                &[
                    ("ce-specversion", "1.0"),
                    ("ce-id", "e2"),
                    ("ce-source", "/shop"),
                    ("ce-type", "order.paid"),
                    ("content-type", "text/plain"),
                ],
            ),
        ];
        let entries: Vec<BatchEntry<'_>> = messages
            .iter()
            .map(|message| BatchEntry {
                message,
                attempt: 1,
                replay_count: 0,
            })
            .collect();
        let batch = Batch {
            entries: &entries,
            queue: &queue,
            path: None,
        };
        let (request, built) = forwarder.build_batch(&batch).unwrap();
        assert_eq!(built.aliases, [Some("e1".into()), Some("e2".into())]);
        let (content_type, body) = body_of(request);
        assert_eq!(content_type, CLOUDEVENTS_BATCH_TYPE);
        let events = body.as_array().unwrap();
        assert_eq!(events[0]["id"], "e1");
        assert_eq!(events[0]["courierid"], "1-0");
        assert_eq!(events[0]["courierattempt"], 1);
        assert_eq!(events[0]["data"]["total"], 5);
        assert_eq!(events[1]["type"], "order.paid");
        assert_eq!(events[1]["data"], "binary data");
        // Statuses name an entry by its courierid or its event id.
        let statuses = read_statuses(
            br#"{"statuses":[{"id":"e1","status":"success"},{"id":"2-0","status":"retry"}]}"#,
            &built.ids,
            &built.aliases,
        );
        assert_eq!(
            statuses_of(&statuses),
            [Some(Status::Success), Some(Status::Retry)]
        );
        // One message that is no event: courier's own entries for all.
        let mixed = [messages[0].clone(), message("3-0", b"plain", &[])];
        let entries: Vec<BatchEntry<'_>> = mixed
            .iter()
            .map(|message| BatchEntry {
                message,
                attempt: 1,
                replay_count: 0,
            })
            .collect();
        let batch = Batch {
            entries: &entries,
            queue: &queue,
            path: None,
        };
        let (request, _) = forwarder.build_batch(&batch).unwrap();
        assert_eq!(body_of(request).0, ENTRIES_TYPE);
    }
}
