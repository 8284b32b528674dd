//! `courier dlq edit ID --patch FILE`: one dead letter changed with a JSON
//! Patch (RFC 6902) and replayed, for a message that is refused for what it
//! says (a field its producer got wrong) and would be refused again as it
//! is.
//!
//! The patch applies to the letter's message, not to its record:
//! `{"headers": {NAME: VALUE, ...}, "body": BODY}`, where BODY is the body
//! parsed as JSON when it is a JSON object or array, and its text
//! otherwise, so that `"body"` as a string always means the body's bytes
//! are that text. A body that is not UTF-8 is `"body_base64"` instead.
//! courier's `courier-*` fields are not in the document: they are its
//! state (the record, the lineage, the seal's), and a patch that names one
//! is refused. The edited message is replayed like `dlq replay` replays
//! ([`DeadLetter::edited`]), and its record keeps the digest of the
//! original ([`DeadLetter::digest`]).
//!
//! Whatever goes wrong before the write (a patch that does not apply, a
//! document the patch made that is no message) leaves the dead letter as
//! it was.

use std::io::{Read, Write};
use std::path::Path;
use std::process::ExitCode;

use base64::Engine;
use bytes::Bytes;
use serde_json::{Map, Value};

use super::filter::select;
use super::{Filter, Target, audit, open};
use crate::cmd::args::UsageError;
use crate::model::{DeadLetter, F_EDITED_FROM_DIGEST};

const HEADERS: &str = "headers";
const BODY: &str = "body";
const BODY_BASE64: &str = "body_base64";

/// Runs `courier dlq edit`: exit 0 when replayed (or, with `dry_run`, when
/// the patch applies), 1 when the letter is not there, the patch does not
/// apply to it or the replay fails, 2 (a [`UsageError`]) when the patch
/// cannot be read as one, before anything connects.
pub(super) async fn run(
    target: &Target,
    id: &str,
    patch_path: &Path,
    dry_run: bool,
    why: Option<&str>,
    out: &mut impl Write,
) -> anyhow::Result<ExitCode> {
    let patch = read_patch(patch_path)?;
    let selection = audit::describe_edit(id, patch_path);
    apply_and_replay(target, id, patch, &selection, dry_run, why, out).await
}

/// [`run`] with the patch read: the console's edit comes from a form.
pub(crate) async fn apply_and_replay(
    target: &Target,
    id: &str,
    (patch, patch_json): (json_patch::Patch, Value),
    selection: &str,
    dry_run: bool,
    why: Option<&str>,
    out: &mut impl Write,
) -> anyhow::Result<ExitCode> {
    let (source, dlq) = open(target).await?;
    // An edit is of one letter, found by its id as `show` finds it: read
    // alone where the broker can, whatever the queue's length.
    let found = select(&source, &dlq, &Filter::default(), &[id.to_string()])
        .await?
        .0
        .into_iter()
        .next();
    let Some(letter) = found else {
        source.flush().await;
        eprintln!("error: no dead letter {id} in {dlq}");
        return Ok(ExitCode::FAILURE);
    };
    let (document, edited) = match apply(&letter, &patch) {
        Ok(done) => done,
        Err(e) => {
            source.flush().await;
            eprintln!("error: dead letter {id} is not edited, and stays in {dlq} as it was: {e}");
            return Ok(ExitCode::FAILURE);
        }
    };
    if dry_run {
        source.flush().await;
        writeln!(out, "{}", serde_json::to_string_pretty(&document)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    let original = edited
        .field(F_EDITED_FROM_DIGEST)
        .unwrap_or_default()
        .to_string();
    let replayed = source.replay(&dlq, &edited).await;
    source.flush().await;
    let queue = &target.source.queue;
    match &replayed {
        Ok(()) => {
            writeln!(out, "replayed {id} edited to {queue}")?;
            writeln!(out, "{F_EDITED_FROM_DIGEST}: {original}")?;
        }
        Err(e) => eprintln!("failed: {id}: {e}"),
    }
    let record = audit::Record {
        action: audit::Action::Edit,
        queue,
        dead_letter_queue: &dlq,
        selection: selection.to_string(),
        selected: 1,
        done: usize::from(replayed.is_ok()),
        failed: usize::from(replayed.is_err()),
        why,
        rate: None,
        job: None,
    };
    let note = audit::EditNote {
        patch: &patch_json,
        original: &original,
    };
    audit::write_edit(target, &record, &note).await;
    Ok(if replayed.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The patch `--patch` names (standard input for `-`), and the JSON it was
/// read from, for the audit line.
fn read_patch(path: &Path) -> Result<(json_patch::Patch, Value), UsageError> {
    let name = path.display();
    let mut text = String::new();
    let read = if path == Path::new("-") {
        std::io::stdin().read_to_string(&mut text).map(drop)
    } else {
        std::fs::read_to_string(path).map(|t| text = t)
    };
    read.map_err(|e| UsageError(format!("--patch {name}: cannot read it: {e}")))?;
    parse_patch(&text).map_err(|e| UsageError(format!("--patch {name}: {e}")))
}

/// A JSON Patch from its text, and the JSON it was read from.
pub(crate) fn parse_patch(text: &str) -> Result<(json_patch::Patch, Value), String> {
    let json: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let patch = serde_json::from_value(json.clone()).map_err(|e| {
        format!(
            "not a JSON Patch (RFC 6902), an array of operations such as \
             {{\"op\": \"replace\", \"path\": \"/body/amount\", \"value\": 5}}: {e}"
        )
    })?;
    Ok((patch, json))
}

/// A `courier-*` name, in any case: courier's state, not the message's.
fn is_courier(name: &str) -> bool {
    name.get(..8)
        .is_some_and(|p| p.eq_ignore_ascii_case("courier-"))
}

/// The document a patch applies to: the letter's headers and body.
pub(super) fn document(letter: &DeadLetter) -> Result<Value, String> {
    let mut headers = Map::new();
    for (name, value) in letter.fields.iter().filter(|(n, _)| !is_courier(n)) {
        if headers
            .insert(name.clone(), Value::String(value.clone()))
            .is_some()
        {
            return Err(format!(
                "it has the header {name:?} more than once, which a JSON object cannot hold"
            ));
        }
    }
    let mut document = Map::new();
    document.insert(HEADERS.into(), Value::Object(headers));
    match std::str::from_utf8(&letter.body) {
        Ok(text) => {
            let body = match serde_json::from_str::<Value>(text) {
                Ok(json @ (Value::Object(_) | Value::Array(_))) => json,
                _ => Value::String(text.to_string()),
            };
            document.insert(BODY.into(), body);
        }
        Err(_) => {
            let encoded = base64::engine::general_purpose::STANDARD.encode(&letter.body);
            document.insert(BODY_BASE64.into(), Value::String(encoded));
        }
    }
    Ok(Value::Object(document))
}

/// `patch` applied to `letter`'s document: the edited document, and the
/// letter to replay.
pub(super) fn apply(
    letter: &DeadLetter,
    patch: &json_patch::Patch,
) -> Result<(Value, DeadLetter), String> {
    let original = document(letter)?;
    let mut edited = original.clone();
    json_patch::patch(&mut edited, patch).map_err(|e| {
        let operation = patch
            .0
            .get(e.operation)
            .and_then(|op| serde_json::to_string(op).ok())
            .unwrap_or_default();
        let hint = if e.path.as_str().starts_with("/headers/courier-") {
            " (courier-* fields are courier's state, not in the document)"
        } else {
            ""
        };
        format!(
            "the patch's operation {} {operation} failed at {:?}: {}{hint}",
            e.operation,
            e.path.as_str(),
            e.kind
        )
    })?;
    let (body, headers) = message_of(&edited, &original, letter)?;
    Ok((edited, letter.edited(body, headers)))
}

/// The body and headers `edited` says, `original` being the letter's own
/// document: a body or header left as it was keeps its bytes and its place.
fn message_of(
    edited: &Value,
    original: &Value,
    letter: &DeadLetter,
) -> Result<(Bytes, Vec<(String, String)>), String> {
    let Value::Object(document) = edited else {
        return Err(format!(
            "the patched document is {}, not an object with \"headers\" and \"body\"",
            kind(edited)
        ));
    };
    if let Some(other) = document
        .keys()
        .find(|k| ![HEADERS, BODY, BODY_BASE64].contains(&k.as_str()))
    {
        return Err(format!(
            "the patched document has {other:?}; it holds only \"headers\" and \"body\" (or \"body_base64\")"
        ));
    }
    let headers = headers_of(document.get(HEADERS), letter)?;
    let body = match (document.get(BODY), document.get(BODY_BASE64)) {
        (Some(_), Some(_)) => {
            return Err(
                "the patched document has both \"body\" and \"body_base64\"; keep one".into(),
            );
        }
        (None, None) => {
            return Err(
                "the patched document has no \"body\"; an empty body is \"body\": \"\"".into(),
            );
        }
        (Some(body), None) if original.get(BODY) == Some(body) => letter.body.clone(),
        (None, Some(encoded)) if original.get(BODY_BASE64) == Some(encoded) => letter.body.clone(),
        (Some(body), None) => body_of(body)?,
        (None, Some(encoded)) => {
            let Value::String(encoded) = encoded else {
                return Err(format!(
                    "\"body_base64\" is {}, not a string",
                    kind(encoded)
                ));
            };
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .map_err(|e| format!("\"body_base64\" is not base64: {e}"))?;
            Bytes::from(bytes)
        }
    };
    Ok((body, headers))
}

/// The bytes of a `"body"`: a string is the text, anything else but null
/// its compact JSON.
fn body_of(body: &Value) -> Result<Bytes, String> {
    match body {
        Value::String(text) => Ok(Bytes::from(text.clone())),
        Value::Null => Err(
            "\"body\" is null, which is no body; an empty body is \"body\": \"\", the text null is \"body\": \"null\""
                .into(),
        ),
        json => serde_json::to_vec(json)
            .map(Bytes::from)
            .map_err(|e| format!("\"body\" cannot be written as JSON: {e}")),
    }
}

/// The headers of the patched document: the letter's own names first, in
/// their order, then the new ones.
fn headers_of(
    headers: Option<&Value>,
    letter: &DeadLetter,
) -> Result<Vec<(String, String)>, String> {
    let headers = match headers {
        Some(Value::Object(headers)) => headers,
        Some(other) => {
            return Err(format!(
                "\"headers\" is {}, not an object of names and values",
                kind(other)
            ));
        }
        None => {
            return Err("the patched document has no \"headers\"; none is \"headers\": {}".into());
        }
    };
    for (name, value) in headers {
        if name.is_empty() {
            return Err("a header has an empty name".into());
        }
        if is_courier(name) {
            return Err(format!(
                "the header {name:?} is courier's: courier-* fields are courier's state, not the message's, and cannot be patched"
            ));
        }
        if !value.is_string() {
            return Err(format!(
                "the header {name:?} is {}, not a string",
                kind(value)
            ));
        }
    }
    let text = |name: &str| headers[name].as_str().unwrap_or_default().to_string();
    let kept = letter
        .fields
        .iter()
        .map(|(name, _)| name.as_str())
        .filter(|name| headers.contains_key(*name));
    let mut out: Vec<(String, String)> = kept.map(|name| (name.to_string(), text(name))).collect();
    for name in headers.keys() {
        if !out.iter().any(|(n, _)| n == name) {
            out.push((name.clone(), text(name)));
        }
    }
    Ok(out)
}

/// A JSON value's kind, for an error.
fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn letter(body: &[u8], headers: &[(&str, &str)]) -> DeadLetter {
        let mut fields = vec![
            ("courier-reason".to_string(), "permanent-status".to_string()),
            ("courier-message-id".to_string(), "5-0".to_string()),
        ];
        fields.extend(headers.iter().map(|(n, v)| (n.to_string(), v.to_string())));
        DeadLetter {
            id: "17-0".into(),
            body: Bytes::copy_from_slice(body),
            fields,
        }
    }

    fn patch(ops: Value) -> json_patch::Patch {
        serde_json::from_value(ops).unwrap()
    }

    fn order() -> DeadLetter {
        letter(
            br#"{"order": "A-1", "amount": -5}"#,
            &[("content-type", "application/json"), ("x-tenant", "acme")],
        )
    }

    #[test]
    fn the_document_holds_the_headers_and_the_body_a_patch_can_reach() {
        assert_eq!(
            document(&order()).unwrap(),
            json!({
                "headers": {"content-type": "application/json", "x-tenant": "acme"},
                "body": {"order": "A-1", "amount": -5},
            })
        );
        // Text, and JSON that is no object or array, is the text: a JSON
        // string body keeps its quotes.
        for body in ["plain text", "42", r#""quoted""#, "", "{not json"] {
            assert_eq!(
                document(&letter(body.as_bytes(), &[])).unwrap(),
                json!({"headers": {}, "body": body}),
                "{body:?}"
            );
        }
        assert_eq!(
            document(&letter(&[0xff, 0x00, 0x01], &[])).unwrap(),
            json!({"headers": {}, "body_base64": "/wAB"})
        );
        let twice = letter(b"x", &[("x-a", "1"), ("x-a", "2")]);
        assert!(
            document(&twice)
                .unwrap_err()
                .contains("\"x-a\" more than once")
        );
    }

    #[test]
    fn a_patch_fixes_a_field_and_adds_a_header() {
        let original = order();
        let (document, edited) = apply(
            &original,
            &patch(json!([
                {"op": "test", "path": "/body/amount", "value": -5},
                {"op": "replace", "path": "/body/amount", "value": 5},
                {"op": "add", "path": "/headers/x-fixed", "value": "1"},
            ])),
        )
        .unwrap();
        assert_eq!(document["body"]["amount"], 5);
        assert_eq!(edited.body, Bytes::from(r#"{"amount":5,"order":"A-1"}"#));
        let headers: Vec<(&str, &str)> = edited
            .fields
            .iter()
            .filter(|(n, _)| !is_courier(n))
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            headers,
            [
                ("content-type", "application/json"),
                ("x-tenant", "acme"),
                ("x-fixed", "1")
            ]
        );
        assert_eq!(edited.id, original.id);
        assert_eq!(edited.field("courier-message-id"), Some("5-0"));
        assert_eq!(
            edited.field(F_EDITED_FROM_DIGEST),
            Some(original.digest().as_str())
        );
    }

    /// What the patch left alone keeps its bytes, whitespace and key order
    /// included, and the headers keep their order.
    #[test]
    fn what_the_patch_leaves_alone_keeps_its_bytes_and_order() {
        let original = letter(
            br#"{"b": 1,  "a": 2}"#,
            &[
                ("x-z", "1"),
                ("content-type", "application/json"),
                ("x-a", "2"),
            ],
        );
        let (_, edited) = apply(
            &original,
            &patch(json!([{"op": "replace", "path": "/headers/x-a", "value": "3"}])),
        )
        .unwrap();
        assert_eq!(edited.body, original.body);
        let names: Vec<&str> = edited
            .fields
            .iter()
            .filter(|(n, _)| !is_courier(n))
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(names, ["x-z", "content-type", "x-a"]);
        assert_eq!(edited.field("x-a"), Some("3"));

        let binary = letter(&[0xff, 0x00], &[]);
        let (_, edited) = apply(&binary, &patch(json!([]))).unwrap();
        assert_eq!(edited.body, binary.body);
        let (_, edited) = apply(
            &binary,
            &patch(json!([{"op": "replace", "path": "/body_base64", "value": "AAE="}])),
        )
        .unwrap();
        assert_eq!(edited.body.as_ref(), [0x00, 0x01]);
    }

    /// A body becomes bytes by its kind: a string is its text, a number or
    /// boolean its JSON, and a text body may become JSON or the reverse.
    #[test]
    fn a_body_is_written_by_its_kind() {
        let text = letter(b"amount=-5", &[]);
        let cases = [
            (json!("amount=5"), "amount=5"),
            (json!({"amount": 5}), r#"{"amount":5}"#),
            (json!([1, 2]), "[1,2]"),
            (json!(5), "5"),
            (json!(true), "true"),
            (json!(""), ""),
        ];
        for (value, want) in cases {
            let ops = json!([{"op": "replace", "path": "/body", "value": value}]);
            let (_, edited) = apply(&text, &patch(ops)).unwrap();
            assert_eq!(edited.body, Bytes::from(want), "{value}");
        }
        let json_body = order();
        let (_, edited) = apply(
            &json_body,
            &patch(json!([{"op": "replace", "path": "/body", "value": "plain"}])),
        )
        .unwrap();
        assert_eq!(edited.body, Bytes::from("plain"));
        let (_, edited) = apply(
            &text,
            &patch(json!([
                {"op": "remove", "path": "/body"},
                {"op": "add", "path": "/body_base64", "value": "/w=="},
            ])),
        )
        .unwrap();
        assert_eq!(edited.body.as_ref(), [0xff]);
    }

    #[test]
    fn a_patch_that_fails_or_makes_no_message_says_why() {
        let cases = [
            (
                json!([{"op": "test", "path": "/body/amount", "value": 0}]),
                "operation 0 {\"op\":\"test\",\"path\":\"/body/amount\",\"value\":0} failed at \"/body/amount\": value did not match",
            ),
            (
                json!([{"op": "replace", "path": "/body/total", "value": 1}]),
                "failed at \"/body/total\"",
            ),
            (
                json!([{"op": "remove", "path": "/headers/courier-reason"}]),
                "courier-* fields are courier's state, not in the document",
            ),
            (
                json!([{"op": "add", "path": "/headers/Courier-Attempt", "value": "1"}]),
                "\"Courier-Attempt\" is courier's",
            ),
            (
                json!([{"op": "add", "path": "/headers/x-n", "value": 1}]),
                "the header \"x-n\" is a number, not a string",
            ),
            (
                json!([{"op": "add", "path": "/headers/", "value": "1"}]),
                "an empty name",
            ),
            (
                json!([{"op": "replace", "path": "", "value": [1]}]),
                "the patched document is an array, not an object",
            ),
            (
                json!([{"op": "add", "path": "/bodyy", "value": 1}]),
                "has \"bodyy\"",
            ),
            (
                json!([{"op": "remove", "path": "/headers"}]),
                "no \"headers\"",
            ),
            (
                json!([{"op": "replace", "path": "/headers", "value": []}]),
                "\"headers\" is an array",
            ),
            (json!([{"op": "remove", "path": "/body"}]), "no \"body\""),
            (
                json!([{"op": "replace", "path": "/body", "value": null}]),
                "\"body\" is null",
            ),
            (
                json!([{"op": "add", "path": "/body_base64", "value": "AA=="}]),
                "both \"body\" and \"body_base64\"",
            ),
            (
                json!([
                    {"op": "remove", "path": "/body"},
                    {"op": "add", "path": "/body_base64", "value": "not base64!"},
                ]),
                "\"body_base64\" is not base64",
            ),
            (
                json!([
                    {"op": "remove", "path": "/body"},
                    {"op": "add", "path": "/body_base64", "value": 7},
                ]),
                "\"body_base64\" is a number, not a string",
            ),
        ];
        for (ops, want) in cases {
            let err = apply(&order(), &patch(ops.clone())).unwrap_err();
            assert!(err.contains(want), "{ops}: {err}");
        }
    }

    #[test]
    fn a_patch_is_read_from_a_file_and_must_be_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("patch.json");
        std::fs::write(
            &path,
            r#"[{"op": "add", "path": "/headers/x-fixed", "value": "1"}]"#,
        )
        .unwrap();
        let (patch, json) = read_patch(&path).unwrap();
        assert_eq!(patch.0.len(), 1);
        assert_eq!(json[0]["path"], "/headers/x-fixed");
        for (text, want) in [
            ("[{", "not JSON"),
            (r#"{"op": "add"}"#, "not a JSON Patch (RFC 6902)"),
            (
                r#"[{"op": "frobnicate", "path": "/body"}]"#,
                "not a JSON Patch",
            ),
        ] {
            std::fs::write(&path, text).unwrap();
            let err = read_patch(&path).unwrap_err().0;
            assert!(err.contains(want), "{text}: {err}");
        }
        let missing = read_patch(&dir.path().join("nope.json")).unwrap_err().0;
        assert!(missing.contains("cannot read it"), "{missing}");
    }
}
