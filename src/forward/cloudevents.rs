//! The CloudEvents 1.0 HTTP binding: whether a message is a CloudEvent, and
//! the request it is offered as, in binary mode (attributes as `ce-*`
//! headers, the data as the body) or structured mode (the event in the JSON
//! format as the body). Pure: a message in, headers and a body out.
//!
//! A message carries an event in one of two forms. Structured: its body is
//! the event in the JSON format (`specversion` at the top level). Binary:
//! its headers carry the attributes (`ce-`, and the `ce_` / `cloudEvents_` /
//! `cloudEvents:` prefixes of the Kafka and AMQP bindings), its body is the
//! data and its content type the `datacontenttype`. Header values on a
//! message are taken as they are: only the HTTP binding percent-encodes.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use serde::de::IgnoredAny;
use serde_json::Value;

use crate::model::Message;

/// How a CloudEvent is offered to the app (`--cloudevents`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Mode {
    /// Attributes as `ce-*` headers, the data as the body.
    #[default]
    Binary,
    /// `Content-Type: application/cloudevents+json`, the event as the body.
    Structured,
    /// No CloudEvents handling: every message is offered as it is.
    Off,
}

impl Mode {
    /// The flag's values, for the injector's annotation check.
    pub const NAMES: [&'static str; 3] = ["binary", "structured", "off"];
}

/// The media type of the JSON event format (structured mode).
pub const STRUCTURED_TYPE: &str = "application/cloudevents+json";

/// Header prefixes that carry attributes on a message: HTTP and RabbitMQ
/// (`ce-`), Kafka (`ce_`), AMQP 1.0 (`cloudEvents_`, `cloudEvents:`).
const PREFIXES: [&str; 4] = ["ce-", "ce_", "cloudEvents_", "cloudEvents:"];

/// The attribute a message header carries, if it is one (`ce-id` → `id`).
pub fn attribute_of(header: &str) -> Option<&str> {
    PREFIXES.iter().find_map(|prefix| {
        let head = header.get(..prefix.len())?;
        head.eq_ignore_ascii_case(prefix)
            .then(|| &header[prefix.len()..])
    })
}

/// Whether a message header is a CloudEvents attribute. An event's own
/// headers are written from the event, so the message's are not forwarded
/// beside them (in structured mode a stray `ce-*` header would make the
/// app's SDK read the request as binary).
pub fn is_attribute_header(name: &str) -> bool {
    attribute_of(name).is_some()
}

/// A message read as a CloudEvent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Context attributes except `datacontenttype`: lowercase names, values
    /// in their canonical string form.
    attributes: Vec<(String, String)>,
    datacontenttype: Option<String>,
    data: Data,
    /// The message's body is the event in the JSON format.
    structured: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Data {
    Absent,
    /// The JSON text of a structured event's `data` (a JSON value).
    Json(Bytes),
    /// Bytes as they are: a binary message's body, a structured event's
    /// `data_base64` decoded, or its string `data` with a non-JSON type.
    Bytes(Bytes),
}

/// What the app is sent for an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// `ce-*` headers (binary mode), values percent-encoded as the HTTP
    /// binding asks.
    pub headers: Vec<(String, String)>,
    /// `None`: an event without data and without `datacontenttype`.
    pub content_type: Option<String>,
    pub body: Bytes,
}

/// Reads a message as a CloudEvent. `Ok(None)`: it is not one. An error: it
/// says it is one (a `specversion`, or the structured content type) but is
/// not a valid CloudEvents 1.0 event; the message says what is wrong.
///
/// Cheap for a message that is not an event: its headers are scanned for a
/// `specversion` attribute and, when the body is a JSON object (first byte
/// `{`), the body for the text `"specversion"`; JSON is parsed only when
/// that text is there.
pub fn read(message: &Message) -> Result<Option<Event>, String> {
    let content_type = message.header("content-type");
    let structured_type = content_type.is_some_and(|ct| media_type(ct) == STRUCTURED_TYPE);
    if !structured_type
        && message.headers.iter().any(|(name, _)| {
            attribute_of(name).is_some_and(|a| a.eq_ignore_ascii_case("specversion"))
        })
    {
        return from_headers(message).map(Some);
    }
    let json_or_none = content_type.is_none_or(is_json);
    if structured_type || (json_or_none && looks_structured(&message.body)) {
        return from_body(&message.body, structured_type);
    }
    Ok(None)
}

fn looks_structured(body: &[u8]) -> bool {
    body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
        && memchr::memmem::find(body, b"\"specversion\"").is_some()
}

/// The media type of a `Content-Type` value, lowercase, without parameters.
fn media_type(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

/// `application/json`, `text/json` and any `+json` type, as the JSON event
/// format and the SDKs read them.
fn is_json(content_type: &str) -> bool {
    let media = media_type(content_type);
    let Some((kind, subtype)) = media.split_once('/') else {
        return false;
    };
    (kind == "application" || kind == "text") && (subtype == "json" || subtype.ends_with("+json"))
}

fn is_text(content_type: &str) -> bool {
    let media = media_type(content_type);
    media.starts_with("text/") || media.ends_with("/xml") || media.ends_with("+xml")
}

fn from_headers(message: &Message) -> Result<Event, String> {
    let mut attributes: Vec<(String, String)> = Vec::new();
    // The first occurrence of an attribute wins; a set, not a scan of what
    // was kept, so that many `ce-*` headers cost linear time (found at
    // 21da363: the scan was quadratic in the header count).
    let mut seen = std::collections::HashSet::new();
    let mut datacontenttype = None;
    for (name, value) in &message.headers {
        let Some(attribute) = attribute_of(name) else {
            continue;
        };
        let attribute = attribute_name(attribute)?;
        if attribute == "datacontenttype" {
            datacontenttype.get_or_insert_with(|| value.clone());
        } else if seen.insert(attribute.clone()) {
            attributes.push((attribute, value.clone()));
        }
    }
    let datacontenttype =
        datacontenttype.or_else(|| message.header("content-type").map(str::to_string));
    let data = match message.body.is_empty() {
        true => Data::Absent,
        false => Data::Bytes(message.body.clone()),
    };
    Event::checked(attributes, datacontenttype, data, false)
}

fn from_body(body: &Bytes, structured_type: bool) -> Result<Option<Event>, String> {
    // Validated whole first (no allocation), then split into members by
    // position, so that `data` is a slice of the body and not a copy.
    let object = serde_json::from_slice::<IgnoredAny>(body)
        .map_err(|e| e.to_string())
        .and_then(|_| members(body).ok_or_else(|| "not an object".to_string()));
    let object = match object {
        Ok(object) => object,
        Err(_) if !structured_type => return Ok(None),
        Err(e) => {
            return Err(format!(
                "the body is {STRUCTURED_TYPE} but not a JSON object ({e})"
            ));
        }
    };
    if !object.iter().any(|(name, _)| name == "specversion") {
        if structured_type {
            return Err(format!(
                "the body is {STRUCTURED_TYPE} but has no \"specversion\"; a CloudEvent in the JSON format needs specversion, id, source and type"
            ));
        }
        return Ok(None);
    }
    let mut attributes = Vec::new();
    let mut datacontenttype = None;
    let mut data = None;
    let mut data_base64 = None;
    for (name, span) in object {
        let raw = &body[span];
        match name.as_str() {
            "data" => data = Some(raw),
            "data_base64" => data_base64 = Some(raw),
            _ => {
                let name = attribute_name(&name)?;
                let Some(value) = attribute_value(&name, raw)? else {
                    continue;
                };
                match name.as_str() {
                    "datacontenttype" => datacontenttype = Some(value),
                    _ => attributes.push((name, value)),
                }
            }
        }
    }
    let data = match (data, data_base64) {
        (Some(_), Some(_)) => {
            return Err(
                "both \"data\" and \"data_base64\" are given; an event has one at most".into(),
            );
        }
        (None, Some(raw)) => match serde_json::from_slice::<Option<String>>(raw) {
            Ok(None) => Data::Absent,
            Ok(Some(text)) => Data::Bytes(
                BASE64
                    .decode(text.trim())
                    .map(Bytes::from)
                    .map_err(|e| format!("\"data_base64\" is not base64 ({e})"))?,
            ),
            Err(_) => return Err("\"data_base64\" is not a string".into()),
        },
        (Some(raw), None) => structured_data(body, raw, datacontenttype.as_deref()),
        (None, None) => Data::Absent,
    };
    Event::checked(attributes, datacontenttype, data, true).map(Some)
}

/// A structured event's `data`: its JSON text, taken from the body without
/// a copy, or the string it holds when the content type is not JSON.
fn structured_data(body: &Bytes, raw: &[u8], datacontenttype: Option<&str>) -> Data {
    if raw == b"null" {
        return Data::Absent;
    }
    if raw.starts_with(b"\"")
        && !datacontenttype.is_none_or(is_json)
        && let Ok(string) = serde_json::from_slice::<String>(raw)
    {
        return Data::Bytes(Bytes::from(string));
    }
    Data::Json(body.slice_ref(raw))
}

/// The members of the JSON object `body` (valid JSON, checked before) as
/// (name, span of the value's text), in order; `None` when it is not an
/// object.
fn members(body: &[u8]) -> Option<Vec<(String, std::ops::Range<usize>)>> {
    let mut out = Vec::new();
    let mut at = skip_space(body, 0);
    if body.get(at) != Some(&b'{') {
        return None;
    }
    at = skip_space(body, at + 1);
    if body.get(at) == Some(&b'}') {
        return Some(out);
    }
    loop {
        let key_end = skip_value(body, at);
        let name = serde_json::from_slice::<String>(&body[at..key_end]).ok()?;
        at = skip_space(body, key_end);
        if body.get(at) != Some(&b':') {
            return None;
        }
        let start = skip_space(body, at + 1);
        let end = skip_value(body, start);
        out.push((name, start..end));
        at = skip_space(body, end);
        match body.get(at) {
            Some(b',') => at = skip_space(body, at + 1),
            Some(b'}') => return Some(out),
            _ => return None,
        }
    }
}

fn skip_space(body: &[u8], mut at: usize) -> usize {
    while body.get(at).is_some_and(u8::is_ascii_whitespace) {
        at += 1;
    }
    at
}

/// The end of the JSON value that starts at `at` in valid JSON.
fn skip_value(body: &[u8], mut at: usize) -> usize {
    let mut depth = 0usize;
    loop {
        let Some(&byte) = body.get(at) else {
            // An escape at the very end skips past it; valid JSON has none.
            return at.min(body.len());
        };
        match byte {
            b'"' => {
                at += 1;
                while let Some(&b) = body.get(at) {
                    at += if b == b'\\' { 2 } else { 1 };
                    if b == b'"' {
                        break;
                    }
                }
                if depth == 0 {
                    return at;
                }
                continue;
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                if depth == 0 {
                    return at;
                }
                depth -= 1;
                if depth == 0 {
                    return at + 1;
                }
            }
            b',' | b':' if depth == 0 => return at,
            b if depth == 0 && b.is_ascii_whitespace() => return at,
            _ => {}
        }
        at += 1;
    }
}

/// An attribute name as HTTP can carry it: lowercase, and a valid header
/// name once prefixed with `ce-`.
fn attribute_name(name: &str) -> Result<String, String> {
    let lower = name.to_ascii_lowercase();
    let valid = !lower.is_empty()
        && lower
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$&'*+-.^_`|~".contains(&b));
    match valid {
        true => Ok(lower),
        false => Err(format!(
            "{name:?} is not a CloudEvents attribute name; names are lowercase letters and digits"
        )),
    }
}

/// An attribute's value in its canonical string form; `None` for `null`,
/// which the JSON format reads as absent.
fn attribute_value(name: &str, raw: &[u8]) -> Result<Option<String>, String> {
    match serde_json::from_slice::<Value>(raw) {
        Ok(Value::String(s)) => Ok(Some(s)),
        Ok(Value::Number(n)) => Ok(Some(n.to_string())),
        Ok(Value::Bool(b)) => Ok(Some(b.to_string())),
        Ok(Value::Null) => Ok(None),
        _ => Err(format!(
            "attribute {name:?} is an object or an array; CloudEvents attributes are strings, numbers or booleans"
        )),
    }
}

impl Event {
    fn checked(
        attributes: Vec<(String, String)>,
        datacontenttype: Option<String>,
        data: Data,
        structured: bool,
    ) -> Result<Self, String> {
        let event = Self {
            attributes,
            datacontenttype,
            data,
            structured,
        };
        match event.attribute("specversion") {
            Some("1.0") => {}
            Some(other) => {
                return Err(format!(
                    "specversion {other:?} is not supported; courier speaks CloudEvents 1.0"
                ));
            }
            None => {}
        }
        for required in ["specversion", "id", "source", "type"] {
            if event.attribute(required).is_none_or(str::is_empty) {
                return Err(format!(
                    "{required:?} is missing; CloudEvents 1.0 requires specversion, id, source and type"
                ));
            }
        }
        Ok(event)
    }

    pub fn attribute(&self, name: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// `<source>:<id>`, the event's identity (the spec: producers keep the
    /// pair unique, so a consumer may take equal pairs as duplicates),
    /// percent-encoded like a `ce-*` header so that it is a header value.
    pub fn key(&self) -> String {
        let source = self.attribute("source").unwrap_or_default();
        let id = self.attribute("id").unwrap_or_default();
        percent_encode(&format!("{source}:{id}"))
    }

    /// The request for `mode` (`Binary` or `Structured`; `Off` never reads
    /// an event).
    pub fn render(&self, mode: Mode, body: &Bytes) -> Rendered {
        match mode {
            Mode::Structured => self.structured(body),
            Mode::Binary | Mode::Off => self.binary(),
        }
    }

    fn binary(&self) -> Rendered {
        let headers = self
            .attributes
            .iter()
            .map(|(name, value)| (format!("ce-{name}"), percent_encode(value)))
            .collect();
        let (content_type, body) = match &self.data {
            Data::Absent => (self.datacontenttype.clone(), Bytes::new()),
            Data::Json(json) => (
                Some(
                    self.datacontenttype
                        .clone()
                        .unwrap_or_else(|| "application/json".into()),
                ),
                json.clone(),
            ),
            Data::Bytes(bytes) => (self.datacontenttype.clone(), bytes.clone()),
        };
        Rendered {
            headers,
            content_type,
            body,
        }
    }

    /// A structured message's body is sent as it is (no copy); an event
    /// that came as headers is written in the JSON format.
    fn structured(&self, body: &Bytes) -> Rendered {
        let body = match self.structured {
            true => body.clone(),
            false => Bytes::from(self.to_json()),
        };
        Rendered {
            headers: Vec::new(),
            content_type: Some(STRUCTURED_TYPE.into()),
            body,
        }
    }

    /// The event in the JSON format. Attribute values are strings: a
    /// message's headers do not say an extension's type. Data that is JSON
    /// by its content type (or with none) and parses is embedded as `data`;
    /// text is a `data` string; anything else is `data_base64`.
    fn to_json(&self) -> Vec<u8> {
        let mut members: Vec<(String, String)> = self
            .attributes
            .iter()
            .map(|(name, value)| (name.clone(), json_string(value)))
            .collect();
        if let Some(ct) = &self.datacontenttype {
            members.push(("datacontenttype".into(), json_string(ct)));
        }
        let ct = self.datacontenttype.as_deref();
        match &self.data {
            Data::Absent => {}
            Data::Json(json) => members.push(("data".into(), lossy(json))),
            Data::Bytes(bytes) => {
                let json =
                    ct.is_none_or(is_json) && serde_json::from_slice::<IgnoredAny>(bytes).is_ok();
                let text = std::str::from_utf8(bytes)
                    .ok()
                    .filter(|_| ct.is_none_or(is_text));
                members.push(match (json, text) {
                    (true, _) => ("data".into(), lossy(bytes)),
                    (false, Some(text)) => ("data".into(), json_string(text)),
                    (false, None) => ("data_base64".into(), json_string(&BASE64.encode(bytes))),
                });
            }
        }
        let mut out = String::from("{");
        for (i, (name, value)) in members.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&json_string(name));
            out.push(':');
            out.push_str(value);
        }
        out.push('}');
        out.into_bytes()
    }
}

fn json_string(text: &str) -> String {
    serde_json::to_string(text).expect("a string serializes")
}

/// JSON text known to be valid (it parsed), as a string.
fn lossy(json: &Bytes) -> String {
    String::from_utf8_lossy(json).into_owned()
}

/// The HTTP binding's encoding of an attribute value: space, `"`, `%` and
/// every byte outside printable ASCII as `%XX` (UTF-8 bytes).
pub fn percent_encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        match byte {
            b' ' | b'"' | b'%' => out.push_str(&format!("%{byte:02X}")),
            0x21..=0x7e => out.push(byte as char),
            _ => out.push_str(&format!("%{byte:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(headers: &[(&str, &str)], body: &str) -> Message {
        Message {
            id: "1-0".into(),
            body: Bytes::from(body.to_string()),
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
        }
    }

    const EVENT: &str = r#"{"specversion":"1.0","id":"A-1","source":"/orders","type":"com.example.order.created","subject":"42","priority":7,"urgent":true,"datacontenttype":"application/json","data":{"id":42, "items": [1,2]}}"#;

    fn header<'a>(rendered: &'a Rendered, name: &str) -> Option<&'a str> {
        rendered
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn a_structured_event_in_binary_mode() {
        let m = message(&[], EVENT);
        let event = read(&m).unwrap().unwrap();
        let r = event.render(Mode::Binary, &m.body);
        assert_eq!(header(&r, "ce-id"), Some("A-1"));
        assert_eq!(header(&r, "ce-source"), Some("/orders"));
        assert_eq!(header(&r, "ce-type"), Some("com.example.order.created"));
        assert_eq!(header(&r, "ce-specversion"), Some("1.0"));
        assert_eq!(header(&r, "ce-priority"), Some("7"));
        assert_eq!(header(&r, "ce-urgent"), Some("true"));
        assert_eq!(header(&r, "ce-datacontenttype"), None);
        assert_eq!(r.content_type.as_deref(), Some("application/json"));
        // The data's own bytes, spacing and all: a slice of the body.
        assert_eq!(r.body, Bytes::from_static(br#"{"id":42, "items": [1,2]}"#));
        let at = m.body.len() - 1 - r.body.len();
        assert_eq!(r.body.as_ptr(), m.body[at..].as_ptr());
        assert_eq!(event.key(), "/orders:A-1");
    }

    #[test]
    fn a_structured_event_in_structured_mode_is_the_body_itself() {
        let m = message(&[("content-type", "application/cloudevents+json")], EVENT);
        let r = read(&m).unwrap().unwrap().render(Mode::Structured, &m.body);
        assert!(r.headers.is_empty());
        assert_eq!(r.content_type.as_deref(), Some(STRUCTURED_TYPE));
        assert_eq!(r.body.as_ptr(), m.body.as_ptr());
    }

    #[test]
    fn data_rows() {
        // (data members, binary Content-Type, binary body)
        let rows: [(&str, Option<&str>, &[u8]); 6] = [
            (r#""data":{"a":1}"#, Some("application/json"), br#"{"a":1}"#),
            (
                r#""datacontenttype":"text/plain","data":"hi \"you\"""#,
                Some("text/plain"),
                br#"hi "you""#,
            ),
            (r#""data":"hi""#, Some("application/json"), br#""hi""#),
            (
                r#""datacontenttype":"image/png","data_base64":"AAEC""#,
                Some("image/png"),
                &[0, 1, 2],
            ),
            (r#""data_base64":"AAEC""#, None, &[0, 1, 2]),
            (r#""data":null"#, None, b""),
        ];
        for (members, content_type, body) in rows {
            let text =
                format!(r#"{{"specversion":"1.0","id":"1","source":"s","type":"t",{members}}}"#);
            let m = message(&[], &text);
            let r = read(&m).unwrap().unwrap().render(Mode::Binary, &m.body);
            assert_eq!(r.content_type.as_deref(), content_type, "{members}");
            assert_eq!(r.body.as_ref(), body, "{members}");
        }
    }

    #[test]
    fn a_binary_message_is_an_event_by_its_headers() {
        let m = message(
            &[
                ("ce-specversion", "1.0"),
                ("CE-ID", "b-7"),
                ("ce_source", "urn:shop"),
                ("cloudEvents:type", "order.paid"),
                ("ce-note", "50% \"off\" é"),
                ("content-type", "text/plain"),
                ("x-tenant", "t1"),
            ],
            "paid",
        );
        let event = read(&m).unwrap().unwrap();
        assert_eq!(event.key(), "urn:shop:b-7");
        let r = event.render(Mode::Binary, &m.body);
        assert_eq!(header(&r, "ce-id"), Some("b-7"));
        assert_eq!(header(&r, "ce-source"), Some("urn:shop"));
        assert_eq!(header(&r, "ce-type"), Some("order.paid"));
        assert_eq!(header(&r, "ce-note"), Some("50%25%20%22off%22%20%C3%A9"));
        assert_eq!(header(&r, "x-tenant"), None, "not an attribute");
        assert_eq!(r.content_type.as_deref(), Some("text/plain"));
        assert_eq!(r.body.as_ptr(), m.body.as_ptr());

        let r = event.render(Mode::Structured, &m.body);
        let json: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(json["id"], "b-7");
        assert_eq!(json["type"], "order.paid");
        assert_eq!(json["note"], "50% \"off\" é");
        assert_eq!(json["datacontenttype"], "text/plain");
        assert_eq!(json["data"], "paid");
    }

    #[test]
    fn the_first_of_repeated_attribute_headers_wins() {
        let m = message(
            &[
                ("ce-specversion", "1.0"),
                ("ce-id", "first"),
                ("ce-source", "s"),
                ("ce-type", "t"),
                ("CE-ID", "second"),
                ("ce_id", "third"),
            ],
            "x",
        );
        let event = read(&m).unwrap().unwrap();
        assert_eq!(event.attribute("id"), Some("first"));
        let r = event.render(Mode::Binary, &m.body);
        assert_eq!(
            r.headers.iter().filter(|(n, _)| n == "ce-id").count(),
            1,
            "one ce-id header: {:?}",
            r.headers
        );
    }

    #[test]
    fn a_binary_message_in_structured_mode_embeds_json_and_encodes_bytes() {
        let head = [
            ("ce-specversion", "1.0"),
            ("ce-id", "1"),
            ("ce-source", "s"),
            ("ce-type", "t"),
        ];
        let json = |extra: &[(&str, &str)], body: &[u8]| {
            let mut m = message(&head, "");
            m.headers
                .extend(extra.iter().map(|(n, v)| (n.to_string(), v.to_string())));
            m.body = Bytes::copy_from_slice(body);
            let r = read(&m).unwrap().unwrap().render(Mode::Structured, &m.body);
            serde_json::from_slice::<Value>(&r.body).unwrap()
        };
        let j = json(&[("content-type", "application/json")], br#"{"a":[1]}"#);
        assert_eq!(j["data"], serde_json::json!({"a": [1]}));
        let j = json(&[("content-type", "application/octet-stream")], &[0xff, 0]);
        assert_eq!(j["data_base64"], "/wA=");
        assert!(j.get("data").is_none());
        let j = json(&[], b"");
        assert!(j.get("data").is_none() && j.get("data_base64").is_none());
    }

    #[test]
    fn not_events() {
        for m in [
            message(&[], r#"{"id":42}"#),
            message(&[], r#"{"order":{"specversion":"1.0"}}"#),
            message(&[], r#"["specversion"]"#),
            message(&[], r#"{"specversion" oops"#),
            message(&[("content-type", "text/plain")], EVENT),
            message(&[("ce-id", "1"), ("ce-source", "s")], "no specversion"),
        ] {
            assert_eq!(read(&m), Ok(None), "{m:?}");
        }
    }

    #[test]
    fn an_invalid_event_says_what_is_wrong() {
        let rows = [
            (
                r#"{"specversion":"1.0","id":"1","type":"t"}"#,
                "\"source\" is missing",
            ),
            (
                r#"{"specversion":"0.3","id":"1","source":"s","type":"t"}"#,
                "CloudEvents 1.0",
            ),
            (
                r#"{"specversion":"1.0","id":"1","source":"s","type":"t","ext":{"a":1}}"#,
                "\"ext\" is an object",
            ),
            (
                r#"{"specversion":"1.0","id":"1","source":"s","type":"t","data":1,"data_base64":"AA=="}"#,
                "both",
            ),
            (
                r#"{"specversion":"1.0","id":"1","source":"s","type":"t","data_base64":"!!"}"#,
                "not base64",
            ),
            (
                r#"{"specversion":"1.0","id":"1","source":"s","type":"t","bad name":"x"}"#,
                "attribute name",
            ),
        ];
        for (body, want) in rows {
            let err = read(&message(&[], body)).unwrap_err();
            assert!(err.contains(want), "{body}: {err}");
        }
        let err = read(&message(&[("content-type", STRUCTURED_TYPE)], "{}")).unwrap_err();
        assert!(err.contains("no \"specversion\""), "{err}");
        let err = read(&message(&[("content-type", STRUCTURED_TYPE)], "nope")).unwrap_err();
        assert!(err.contains("not a JSON object"), "{err}");
    }

    #[test]
    fn prefixes() {
        for name in [
            "ce-id",
            "CE-ID",
            "ce_id",
            "cloudEvents:id",
            "cloudevents_id",
        ] {
            assert!(is_attribute_header(name), "{name}");
        }
        for name in ["cex", "c", "traceparent", "content-type"] {
            assert!(!is_attribute_header(name), "{name}");
        }
    }
}
