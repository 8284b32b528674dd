//! How a dead letter is shown: one line for people, JSON for tools.

use std::time::{Duration, SystemTime};

use base64::Engine;

use super::filter::age;
use crate::model::DeadLetter;

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
/// when it is not UTF-8).
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

pub(super) fn line(letter: &DeadLetter, now: SystemTime) -> String {
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

    #[test]
    fn json_keeps_binary_bodies() {
        let json = to_json(&letter("undeliverable", "", SystemTime::now()));
        assert_eq!(json["body_encoding"], "base64");
        assert_eq!(json["body"], "/wA=");
        assert_eq!(json["courier-reason"], "undeliverable");
        assert_eq!(json["headers"]["traceparent"], "00-x");
    }
}
