//! How a dead letter is shown: one line or the whole letter for people,
//! JSON for tools.

use std::fmt::Write;
use std::time::{Duration, SystemTime};

use base64::Engine;

use super::filter::age;
use crate::model::{DeadLetter, F_HISTORY, HISTORY_BYTES, HISTORY_ENTRIES, History};

fn short_age(age: Option<Duration>) -> String {
    let Some(age) = age else { return "?".into() };
    let s = age.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86_400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

/// A dead letter as one JSON object: every field, and the body (base64
/// when it is not UTF-8). Each `courier-*` field is its stored text, so
/// `courier-history` is a string holding its JSON array (`fromjson` in jq).
pub fn to_json(letter: &DeadLetter) -> serde_json::Value {
    let mut courier = serde_json::Map::new();
    let mut headers = serde_json::Map::new();
    for (name, value) in &letter.fields {
        let map = if name.to_ascii_lowercase().starts_with("courier-") {
            &mut courier
        } else {
            &mut headers
        };
        map.insert(name.clone(), serde_json::Value::String(value.clone()));
    }
    let (body, encoding) = match std::str::from_utf8(&letter.body) {
        Ok(text) => (text.to_string(), "utf-8"),
        Err(_) => (
            base64::engine::general_purpose::STANDARD.encode(&letter.body),
            "base64",
        ),
    };
    let mut out = serde_json::Map::new();
    out.insert("id".into(), letter.id.clone().into());
    out.extend(courier);
    out.insert("headers".into(), headers.into());
    out.insert("body".into(), body.into());
    out.insert("body_encoding".into(), encoding.into());
    out.into()
}

/// The whole dead letter for people (`dlq show`): courier's record, the
/// lineage of a replayed message, the producer's headers and the body.
pub(crate) fn text(letter: &DeadLetter) -> String {
    let courier = |name: &str| name.to_ascii_lowercase().starts_with("courier-");
    let history = letter.history();
    let mut out = String::new();
    let _ = writeln!(out, "id: {}", letter.id);
    for (name, value) in letter.fields.iter().filter(|(n, _)| courier(n)) {
        // Readable below instead, unless it cannot be read.
        if history.is_some() && name.eq_ignore_ascii_case(F_HISTORY) {
            continue;
        }
        let _ = writeln!(out, "{name}: {value}");
    }
    out.push_str(&lineage(letter.replay_count(), history));
    out.push_str("headers:\n");
    for (name, value) in letter.fields.iter().filter(|(n, _)| !courier(n)) {
        let _ = writeln!(out, "  {name}: {value}");
    }
    let _ = match std::str::from_utf8(&letter.body) {
        Ok(body) => writeln!(out, "body ({} bytes):\n{body}", letter.body.len()),
        Err(_) => writeln!(
            out,
            "body ({} bytes, base64):\n{}",
            letter.body.len(),
            base64::engine::general_purpose::STANDARD.encode(&letter.body)
        ),
    };
    out
}

/// The lineage of a dead letter of a message replayed `count` times, one
/// earlier dead letter of its `history` a line, oldest first; nothing for
/// one never replayed.
fn lineage(count: u32, history: Option<History>) -> String {
    let entries = history.map(|h| h.0).unwrap_or_default();
    if count == 0 && entries.is_empty() {
        return String::new();
    }
    let times = if count == 1 { "time" } else { "times" };
    let mut out =
        format!("lineage: replayed {count} {times}; earlier dead letters, oldest first:\n");
    let missing = (count as usize).saturating_sub(entries.len());
    if missing > 0 {
        let _ = writeln!(
            out,
            "  ({missing} earlier, not in the history: it keeps the newest {HISTORY_ENTRIES} that fit in {HISTORY_BYTES} bytes)"
        );
    }
    for entry in &entries {
        let status = entry.status.map_or("-".to_string(), |s| s.to_string());
        let attempts = match entry.attempts {
            1 => "1 attempt".to_string(),
            n => format!("{n} attempts"),
        };
        let _ = writeln!(
            out,
            "  {}  {}  {}  status {status}, {attempts}",
            entry.id, entry.at, entry.reason
        );
    }
    out
}

pub(crate) fn line(letter: &DeadLetter, now: SystemTime) -> String {
    let excerpt: String = letter
        .field("courier-response-excerpt")
        .unwrap_or_default()
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(60)
        .collect();
    format!(
        "{:<22} {:>5}  {:<18} {:>6} {:>8}  {}",
        letter.id,
        short_age(age(letter, now)),
        letter.field("courier-reason").unwrap_or("?"),
        letter
            .field("courier-status")
            .filter(|s| !s.is_empty())
            .unwrap_or("-"),
        letter.field("courier-attempts").unwrap_or("?"),
        excerpt
    )
}

#[cfg(test)]
mod tests {
    use super::super::filter::test_letter as letter;
    use super::*;

    /// The dead letter `9-0` of a message replayed twice, from `1-0` and
    /// `5-0`.
    fn replayed_twice() -> DeadLetter {
        let field = |n: &str, v: &str| (n.to_string(), v.to_string());
        DeadLetter {
            id: "9-0".into(),
            body: bytes::Bytes::from_static(b"{}"),
            fields: vec![
                field("courier-reason", "permanent-status"),
                field("courier-status", "400"),
                field("courier-replay-count", "2"),
                field("courier-replayed-from", "5-0"),
                field(
                    "courier-history",
                    r#"[{"id":"1-0","reason":"attempts-exhausted","status":503,"attempts":5,"at":"2026-05-01T10:00:00.000Z"},{"id":"5-0","reason":"undeliverable","attempts":1,"at":"2026-05-01T11:00:00.000Z"}]"#,
                ),
                field("traceparent", "00-x"),
            ],
        }
    }

    #[test]
    fn show_prints_the_lineage_one_letter_a_line() {
        let shown = text(&replayed_twice());
        let want = "id: 9-0
courier-reason: permanent-status
courier-status: 400
courier-replay-count: 2
courier-replayed-from: 5-0
lineage: replayed 2 times; earlier dead letters, oldest first:
  1-0  2026-05-01T10:00:00.000Z  attempts-exhausted  status 503, 5 attempts
  5-0  2026-05-01T11:00:00.000Z  undeliverable  status -, 1 attempt
headers:
  traceparent: 00-x
body (2 bytes):
{}
";
        assert_eq!(shown, want);
    }

    /// A letter an earlier release wrote has a count and no history; one
    /// whose history cannot be read shows it as it is.
    #[test]
    fn show_says_what_the_history_does_not_hold() {
        let mut old = replayed_twice();
        old.fields
            .retain(|(n, _)| n != "courier-history" && n != "courier-replayed-from");
        old.fields[2] = ("courier-replays".into(), "3".into());
        let shown = text(&old);
        assert!(shown.contains("courier-replays: 3\n"), "{shown}");
        assert!(
            shown.contains("lineage: replayed 3 times; earlier dead letters, oldest first:\n  (3 earlier, not in the history"),
            "{shown}"
        );
        let mut odd = replayed_twice();
        odd.fields[4].1 = "[{not json".into();
        let shown = text(&odd);
        assert!(shown.contains("courier-history: [{not json\n"), "{shown}");
        assert!(shown.contains("(2 earlier, not in the history"), "{shown}");
        let mut never = replayed_twice();
        never
            .fields
            .retain(|(n, _)| !n.contains("replay") && !n.contains("history"));
        let never = text(&never);
        assert!(!never.contains("lineage"), "{never}");
    }

    #[test]
    fn json_carries_the_lineage_fields_as_stored() {
        let json = to_json(&replayed_twice());
        assert_eq!(json["courier-replay-count"], "2");
        assert_eq!(json["courier-replayed-from"], "5-0");
        let history: serde_json::Value =
            serde_json::from_str(json["courier-history"].as_str().unwrap()).unwrap();
        assert_eq!(history[0]["id"], "1-0");
        assert_eq!(history[1]["attempts"], 1);
    }

    #[test]
    fn json_keeps_binary_bodies() {
        let json = to_json(&letter("undeliverable", "", SystemTime::now()));
        assert_eq!(json["body_encoding"], "base64");
        assert_eq!(json["body"], "/wA=");
        assert_eq!(json["courier-reason"], "undeliverable");
        assert_eq!(json["headers"]["traceparent"], "00-x");
    }
}
