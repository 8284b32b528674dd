//! Dead-letter expressions: the one language (CEL, the Common Expression
//! Language) in which an operator says which dead letters they mean, for
//! `courier dlq --filter` and the console's filter box, and which messages
//! a route takes (`routes[].match` in the RetryPolicy). An [`Expr`] is
//! parsed once and evaluated against one [`DeadLetter`] or one [`Message`]
//! at a time; it knows nothing of the command line.
//!
//! The variables are [`VARIABLES`]: the `courier-*` record (`reason`,
//! `status`, `attempts`, `error`, `queue`, the two attempt times and `age`),
//! the producer's `headers`, the JSON `body`, and a CloudEvent's `type`,
//! `source`, `subject` and `data`; docs/design.md ("Dead-letter
//! expressions") says what each holds.
//!
//! A value the letter does not have is null (`status` of an `undeliverable`
//! letter) or missing (`headers["x-tenant"]`, `body.order`). CEL makes
//! `status >= 500` on null, or a missing key, an evaluation error; here such
//! an error means "no match", as a comparison with NULL is in SQL: the
//! letter is not selected, and nothing is reported, since in one
//! dead-letter queue some letters have what an expression asks about and
//! others do not. Any other error (comparing a string with an int, a bad
//! regular expression) is returned, for the caller to count and report,
//! and is not a match either.

use std::cell::OnceCell;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::SystemTime;

use base64::Engine;
use bytes::Bytes;
use cel::common::ast::{EntryExpr, Expr as Node, IdedExpr};
use cel::common::types::{
    CelBool, CelBytes, CelDouble, CelDuration, CelInt, CelList, CelMap, CelMapKey, CelNull,
    CelString, CelTimestamp, CelUInt,
};
use cel::common::value::Val;
use cel::{Context, Env, ExecutionError, Program, Value};

use crate::forward::cloudevents::attribute_of;
use crate::model::{
    DeadLetter, F_ATTEMPTS, F_ERROR, F_FIRST_ATTEMPT_AT, F_QUEUE, F_REASON, F_STATUS, Message,
    dead_letter_age, parse_time,
};

/// Every variable an expression may name, in the order errors list them.
pub const VARIABLES: [&str; 14] = [
    "reason",
    "status",
    "attempts",
    "error",
    "queue",
    "first_attempt_at",
    "last_attempt_at",
    "age",
    "headers",
    "body",
    "type",
    "source",
    "subject",
    "data",
];

/// The variables a route's `match` may name: a message being read has no
/// dead-letter record yet. `attempts` is the attempt this delivery is (1 on
/// the first), as `Courier-Attempt` says.
pub const MESSAGE_VARIABLES: [&str; 8] = [
    "queue", "attempts", "headers", "body", "type", "source", "subject", "data",
];

/// A body larger than this is not parsed: `body` is null and a binary
/// event's `data` too. A filter runs over every letter of a queue, and a
/// 1 MiB JSON body already takes milliseconds to parse; the bodies
/// expressions look into (an order, an event) are far smaller.
pub const MAX_PARSED_BODY: usize = 1 << 20;

/// The call targets that are function namespaces rather than variables
/// (`optional.of(x)`, `optional.none()`): the standard library's only one.
const NAMESPACES: [&str; 1] = ["optional"];

/// The standard CEL environment: its functions, macros (`has`, `all`,
/// `exists`, ...), `duration`/`timestamp` and `matches`. Built once.
static ENV: LazyLock<Arc<Env>> = LazyLock::new(|| Arc::new(Env::stdlib()));

/// A parsed expression, cheap to clone and to share between threads.
#[derive(Clone)]
pub struct Expr {
    source: Arc<str>,
    program: Arc<Program>,
    /// Which of [`VARIABLES`] it names: only those are computed for a
    /// letter, so an expression that does not name `body` never parses one.
    uses: Uses,
}

impl fmt::Debug for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Expr").field(&self.source).finish()
    }
}

/// What went wrong with an expression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExprError {
    /// Not an expression: a syntax error, or a name that is no variable.
    /// `line` and `column` count from 1 (0: the parser did not say where).
    Parse {
        line: usize,
        column: usize,
        message: String,
        /// The line of the expression the error is on.
        snippet: String,
        /// The variables the expression could have named, listed after
        /// the error.
        variables: &'static [&'static str],
    },
    /// Evaluating it on one letter failed for a reason other than a value
    /// the letter does not have (a type mismatch, a bad regular expression).
    Evaluation(String),
    /// It evaluated to something other than true or false; what it was.
    NotBool(String),
}

impl fmt::Display for ExprError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Parse {
                line,
                column,
                message,
                snippet,
                variables,
            } => {
                match (line, column) {
                    (0, _) => write!(f, "{message}")?,
                    (1, column) => write!(f, "at column {column}: {message}")?,
                    (line, column) => write!(f, "at line {line}, column {column}: {message}")?,
                }
                if *column > 0 {
                    write!(f, "\n  {snippet}\n  {:>column$}", "^")?;
                }
                write!(f, "\nthe variables: {}", variables.join(", "))
            }
            Self::Evaluation(message) => write!(f, "{message}"),
            Self::NotBool(what) => write!(
                f,
                "the expression evaluated to {what}, not to true or false (write a condition, such as status >= 500)"
            ),
        }
    }
}

impl std::error::Error for ExprError {}

impl Expr {
    /// Parses `source`, and checks that every name it uses is a variable
    /// (or a CEL type, such as `int` in `type(status) == int`): a typo is
    /// an error here, where it says where it is, rather than on every
    /// letter.
    pub fn parse(source: &str) -> Result<Expr, ExprError> {
        Self::parse_over(source, &VARIABLES)
    }

    /// Parses a route's `match`: as [`Expr::parse`], but only the
    /// [`MESSAGE_VARIABLES`] may be named, since a message being read has
    /// no dead-letter record (`reason`, `status`, ...) to look at.
    pub fn parse_route(source: &str) -> Result<Expr, ExprError> {
        Self::parse_over(source, &MESSAGE_VARIABLES)
    }

    fn parse_over(source: &str, variables: &'static [&'static str]) -> Result<Expr, ExprError> {
        let program = ENV.compile(source).map_err(|errors| {
            let first = errors.errors.first();
            let (line, column) = first.map_or((0, 0), |e| {
                (
                    usize::try_from(e.pos.0).unwrap_or(0),
                    usize::try_from(e.pos.1).unwrap_or(0),
                )
            });
            let mut message = first.map_or_else(|| errors.to_string(), |e| e.msg.clone());
            if errors.errors.len() > 1 {
                message.push_str(&format!(" (and {} more)", errors.errors.len() - 1));
            }
            parse_error(source, line, column, message, variables)
        })?;
        let mut names = Vec::new();
        free_names(program.expression(), &mut Vec::new(), &mut names);
        let mut uses = Uses::default();
        let mut unknown: Option<(&str, u32)> = None;
        for (name, id) in names {
            let known = variables.contains(&name);
            if let Some(i) = VARIABLES.iter().position(|v| *v == name).filter(|_| known) {
                uses.0 |= 1 << i;
            } else if VARIABLES.contains(&name) || ENV.types().find_type(name).is_none() {
                let at = program
                    .source_info()
                    .offset_for(id)
                    .map_or(0, |(start, _)| start);
                if unknown.is_none_or(|(_, first)| at < first) {
                    unknown = Some((name, at));
                }
            }
        }
        if let Some((name, at)) = unknown {
            let (line, column) = line_and_column(source, at as usize);
            let message = if VARIABLES.contains(&name) {
                format!("{name:?} describes a dead letter; a route sees only the message")
            } else {
                format!("{name:?} is not a variable")
            };
            return Err(parse_error(source, line, column, message, variables));
        }
        Ok(Expr {
            source: source.into(),
            program: Arc::new(program),
            uses,
        })
    }

    /// The expression as it was written.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether `letter` is one the expression means, at `now` (for `age`).
    /// `Ok(false)` also when it asks about something the letter does not
    /// have (the module's doc says why); an error when evaluating it fails
    /// otherwise or it is not a condition.
    pub fn matches(&self, letter: &DeadLetter, now: SystemTime) -> Result<bool, ExprError> {
        self.evaluate(&View {
            record: Record::Letter(letter),
            fields: &letter.fields,
            body: &letter.body,
            now,
            json: OnceCell::new(),
        })
    }

    /// Whether a route takes `message`, read from `queue` for its
    /// `attempt`-th delivery; as [`Expr::matches`] otherwise.
    pub fn matches_message(
        &self,
        message: &Message,
        queue: &str,
        attempt: u32,
    ) -> Result<bool, ExprError> {
        self.evaluate(&View {
            record: Record::Message { queue, attempt },
            fields: &message.headers,
            body: &message.body,
            now: SystemTime::UNIX_EPOCH,
            json: OnceCell::new(),
        })
    }

    fn evaluate(&self, view: &View<'_>) -> Result<bool, ExprError> {
        let mut context = Context::with_env(Arc::clone(&ENV));
        for (i, name) in VARIABLES.iter().enumerate() {
            if self.uses.0 & (1 << i) != 0 {
                context.add_variable_as_val(*name, view.value(name));
            }
        }
        match self.program.execute(&context) {
            Ok(Value::Bool(matched)) => Ok(matched),
            Ok(other) => Err(ExprError::NotBool(describe(&other))),
            Err(e) if is_absent(&e) => Ok(false),
            Err(e) => Err(ExprError::Evaluation(e.to_string())),
        }
    }
}

/// A bit per entry of [`VARIABLES`].
#[derive(Debug, Clone, Copy, Default)]
struct Uses(u16);

fn parse_error(
    source: &str,
    line: usize,
    column: usize,
    message: String,
    variables: &'static [&'static str],
) -> ExprError {
    let snippet = source
        .lines()
        .nth(line.saturating_sub(1))
        .unwrap_or_default()
        .to_string();
    ExprError::Parse {
        line,
        column,
        message,
        snippet,
        variables,
    }
}

/// The 1-based line and column, in characters, of the byte `offset` (the
/// parser's offsets count bytes).
fn line_and_column(source: &str, offset: usize) -> (usize, usize) {
    let mut line = 1;
    let mut column = 1;
    for (_, c) in source.char_indices().take_while(|(at, _)| *at < offset) {
        if c == '\n' {
            line += 1;
            column = 1;
        } else {
            column += 1;
        }
    }
    (line, column)
}

/// The identifiers `node` names that no comprehension (`all`, `exists`,
/// `map`, ...) binds, with the node that names each.
fn free_names<'a>(node: &'a IdedExpr, bound: &mut Vec<&'a str>, found: &mut Vec<(&'a str, u64)>) {
    match &node.expr {
        Node::Ident(name) => {
            // `@it`, `@result`: the variables macros expand into.
            if !name.starts_with('@') && !bound.contains(&name.as_str()) {
                found.push((name, node.id));
            }
        }
        Node::Select(select) => free_names(&select.operand, bound, found),
        Node::Call(call) => {
            if let Some(target) = &call.target {
                let namespace = matches!(&target.expr, Node::Ident(name)
                    if NAMESPACES.contains(&name.as_str()) && !bound.contains(&name.as_str()));
                if !namespace {
                    free_names(target, bound, found);
                }
            }
            for arg in &call.args {
                free_names(arg, bound, found);
            }
        }
        Node::Comprehension(comprehension) => {
            free_names(&comprehension.iter_range, bound, found);
            free_names(&comprehension.accu_init, bound, found);
            let outer = bound.len();
            bound.push(&comprehension.iter_var);
            if let Some(second) = &comprehension.iter_var2 {
                bound.push(second);
            }
            bound.push(&comprehension.accu_var);
            free_names(&comprehension.loop_cond, bound, found);
            free_names(&comprehension.loop_step, bound, found);
            free_names(&comprehension.result, bound, found);
            bound.truncate(outer);
        }
        Node::List(list) => {
            for element in &list.elements {
                free_names(element, bound, found);
            }
        }
        Node::Map(map) => {
            for entry in &map.entries {
                entry_names(&entry.expr, bound, found);
            }
        }
        Node::Struct(object) => {
            for entry in &object.entries {
                entry_names(&entry.expr, bound, found);
            }
        }
        Node::Literal(_) | Node::Unspecified => {}
    }
}

fn entry_names<'a>(
    entry: &'a EntryExpr,
    bound: &mut Vec<&'a str>,
    found: &mut Vec<(&'a str, u64)>,
) {
    match entry {
        EntryExpr::MapEntry(e) => {
            free_names(&e.key, bound, found);
            free_names(&e.value, bound, found);
        }
        EntryExpr::StructField(field) => free_names(&field.value, bound, found),
    }
}

/// An error that only says the letter lacks what the expression asks
/// about: an operand that is null (`status >= 500` without a status,
/// `body.order` on a body that is not JSON, `type.startsWith(...)` on a
/// message that is not an event), a key that is not in a map
/// (`headers["x-tenant"]`, `body.order.total`), an index past a list's end.
fn is_absent(error: &ExecutionError) -> bool {
    match error {
        ExecutionError::NoSuchKey(_) | ExecutionError::IndexOutOfBounds(_) => true,
        ExecutionError::NoSuchOverload(overload) => {
            overload.argument_types().iter().any(|t| t == "null_type")
        }
        ExecutionError::ValuesNotComparable(a, b) => {
            matches!(a, Value::Null) || matches!(b, Value::Null)
        }
        _ => false,
    }
}

/// A value, as an error message names it.
fn describe(value: &Value) -> String {
    match value {
        Value::Int(i) => format!("the int {i}"),
        Value::UInt(u) => format!("the uint {u}"),
        Value::Float(f) => format!("the double {f}"),
        Value::String(s) => {
            let shown: String = s.chars().take(60).collect();
            format!("the string {shown:?}")
        }
        Value::Null => "null".into(),
        Value::Duration(d) => format!("a duration ({d})"),
        Value::Timestamp(t) => format!("the timestamp {}", t.to_rfc3339()),
        other => format!("a {}", other.type_of()),
    }
}

/// One letter or message as the variables see it; the body is parsed at
/// most once, when a variable needs it.
struct View<'a> {
    record: Record<'a>,
    /// A letter's stored fields (its record and the producer's headers),
    /// or a message's headers.
    fields: &'a [(String, String)],
    body: &'a Bytes,
    now: SystemTime,
    json: OnceCell<Option<serde_json::Value>>,
}

/// What the record variables (`reason`, `queue`, `attempts`, ...) read.
enum Record<'a> {
    Letter(&'a DeadLetter),
    /// A message being read, which a route looks at: only the queue and
    /// the attempt are known ([`MESSAGE_VARIABLES`]).
    Message {
        queue: &'a str,
        attempt: u32,
    },
}

type Boxed<'a> = Box<dyn Val + 'a>;

impl<'a> View<'a> {
    fn value(&self, name: &str) -> Boxed<'_> {
        let letter = match self.record {
            Record::Letter(letter) => letter,
            Record::Message { queue, attempt } => {
                return match name {
                    "queue" => string(queue),
                    "attempts" => Box::new(CelInt::from(i64::from(attempt))),
                    "headers" => self.headers(),
                    "body" => self.json().map_or_else(null, json),
                    "type" | "source" | "subject" => self.attribute(name),
                    "data" => self.data(),
                    _ => null(),
                };
            }
        };
        match name {
            "reason" => string(letter.field(F_REASON).unwrap_or_default()),
            "status" => int(letter.field(F_STATUS)),
            "attempts" => int(letter.field(F_ATTEMPTS)),
            "error" => string(letter.field(F_ERROR).unwrap_or_default()),
            "queue" => string(letter.field(F_QUEUE).unwrap_or_default()),
            "first_attempt_at" => timestamp(
                letter
                    .field(F_FIRST_ATTEMPT_AT)
                    .and_then(|v| parse_time(v.as_bytes())),
            ),
            "last_attempt_at" => timestamp(letter.dead_lettered_at()),
            "age" => match letter
                .dead_lettered_at()
                .and_then(|at| chrono::Duration::from_std(dead_letter_age(at, self.now)).ok())
            {
                Some(age) => Box::new(CelDuration::from(age)),
                None => Box::new(CelNull),
            },
            "headers" => self.headers(),
            "body" => self.json().map_or_else(null, json),
            "type" | "source" | "subject" => self.attribute(name),
            "data" => self.data(),
            _ => null(),
        }
    }

    /// The producer's fields, names lower-cased; of a name given twice,
    /// the first, as [`DeadLetter::field`] reads it.
    fn headers(&self) -> Boxed<'_> {
        let mut map: HashMap<CelMapKey<'_>, Boxed<'_>> = HashMap::new();
        for (name, value) in self.producer_fields() {
            let key = if name.bytes().any(|b| b.is_ascii_uppercase()) {
                CelMapKey::from(name.to_ascii_lowercase())
            } else {
                CelMapKey::from(name.as_str())
            };
            map.entry(key).or_insert_with(|| string(value));
        }
        Box::new(CelMap::from(map))
    }

    fn producer_fields(&self) -> impl Iterator<Item = &'a (String, String)> {
        self.fields.iter().filter(|(name, _)| {
            !name
                .get(..8)
                .is_some_and(|p| p.eq_ignore_ascii_case("courier-"))
        })
    }

    /// The body as JSON: only when it is at most [`MAX_PARSED_BODY`] and
    /// its content type, if it has one, is JSON (`application/json`,
    /// `text/json`, `*/*+json`), as the CloudEvents binding reads a body.
    fn json(&self) -> Option<&serde_json::Value> {
        self.json
            .get_or_init(|| {
                let body = self.body;
                let typed_json = self
                    .fields
                    .iter()
                    .find(|(name, _)| name.eq_ignore_ascii_case("content-type"))
                    .is_none_or(|(_, value)| is_json_type(value));
                (body.len() <= MAX_PARSED_BODY && typed_json)
                    .then(|| serde_json::from_slice(body).ok())
                    .flatten()
            })
            .as_ref()
    }

    /// Binary mode: the attributes are headers (`ce-specversion`, ...,
    /// with the prefixes every binding uses).
    fn is_binary_event(&self) -> bool {
        self.attribute_header("specversion").is_some()
    }

    fn attribute_header(&self, attribute: &str) -> Option<&'a str> {
        self.producer_fields()
            .find(|(name, _)| attribute_of(name).is_some_and(|a| a.eq_ignore_ascii_case(attribute)))
            .map(|(_, value)| value.as_str())
    }

    /// Structured mode: the body is the event in the JSON format.
    fn structured_event(&self) -> Option<&serde_json::Map<String, serde_json::Value>> {
        self.json()?
            .as_object()
            .filter(|event| event.contains_key("specversion"))
    }

    fn attribute(&self, attribute: &str) -> Boxed<'_> {
        if self.is_binary_event() {
            return self.attribute_header(attribute).map_or_else(null, string);
        }
        match self.structured_event().and_then(|e| e.get(attribute)) {
            Some(serde_json::Value::String(value)) => string(value),
            _ => null(),
        }
    }

    /// A binary event's data is the body: JSON when it parses as JSON, else
    /// its text, else its bytes. A structured event's is its `data` member,
    /// or its `data_base64` decoded.
    fn data(&self) -> Boxed<'_> {
        if self.is_binary_event() {
            let body = self.body;
            return match self.json() {
                Some(value) => json(value),
                None if body.len() > MAX_PARSED_BODY => null(),
                None => match std::str::from_utf8(body) {
                    Ok(text) => string(text),
                    Err(_) => Box::new(CelBytes::from(body.as_ref())),
                },
            };
        }
        let Some(event) = self.structured_event() else {
            return null();
        };
        if let Some(data) = event.get("data") {
            return json(data);
        }
        event
            .get("data_base64")
            .and_then(serde_json::Value::as_str)
            .and_then(|text| base64::engine::general_purpose::STANDARD.decode(text).ok())
            .map_or_else(null, |bytes| Box::new(CelBytes::from(bytes)))
    }
}

fn null<'a>() -> Boxed<'a> {
    Box::new(CelNull)
}

fn string(value: &str) -> Boxed<'_> {
    Box::new(CelString::from(value))
}

/// An integer field; null when it is absent or empty (`courier-status` of
/// a letter the app never answered) or not a number.
fn int<'a>(field: Option<&str>) -> Boxed<'a> {
    match field.and_then(|v| v.trim().parse::<i64>().ok()) {
        Some(n) => Box::new(CelInt::from(n)),
        None => null(),
    }
}

fn timestamp<'a>(at: Option<SystemTime>) -> Boxed<'a> {
    match at {
        Some(at) => Box::new(CelTimestamp::from(
            chrono::DateTime::<chrono::Utc>::from(at).fixed_offset(),
        )),
        None => null(),
    }
}

/// A JSON value as CEL's: integers are ints (uints past `i64::MAX`), other
/// numbers doubles; strings and keys are borrowed from the parsed body.
fn json(value: &serde_json::Value) -> Boxed<'_> {
    use serde_json::Value as J;
    match value {
        J::Null => null(),
        J::Bool(b) => Box::new(CelBool::from(*b)),
        J::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Box::new(CelInt::from(i)),
            (None, Some(u)) => Box::new(CelUInt::from(u)),
            _ => Box::new(CelDouble::from(n.as_f64().unwrap_or(f64::NAN))),
        },
        J::String(s) => string(s),
        J::Array(items) => Box::new(CelList::from(items.iter().map(json).collect::<Vec<_>>())),
        J::Object(members) => Box::new(CelMap::from(
            members
                .iter()
                .map(|(k, v)| (CelMapKey::from(k.as_str()), json(v)))
                .collect::<HashMap<_, _>>(),
        )),
    }
}

/// `application/json`, `text/json` and any `+json` type.
fn is_json_type(content_type: &str) -> bool {
    let media = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    media == "application/json" || media == "text/json" || media.ends_with("+json")
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::time::Duration;

    const ORDER: &str = r#"{"order": {"id": "A-1", "total": 150.5, "items": [{"sku": "x"}]}, "customer": "ada", "big": 18446744073709551615}"#;

    /// A dead letter of `orders` as courier writes one, dead-lettered an
    /// hour before `now`, with `extra` fields (a field named again there
    /// replaces the record's) and `body`.
    fn letter(now: SystemTime, extra: &[(&str, &str)], body: &[u8]) -> DeadLetter {
        let hour = Duration::from_secs(3600);
        let first = crate::model::rfc3339(now - 2 * hour);
        let last = crate::model::rfc3339(now - hour);
        let record = [
            ("courier-reason", "permanent-status"),
            ("courier-status", "422"),
            ("courier-error", ""),
            ("courier-attempts", "3"),
            ("courier-queue", "orders"),
            ("courier-first-attempt-at", first.as_str()),
            ("courier-last-attempt-at", last.as_str()),
            ("Content-Type", "application/json"),
            ("X-Tenant", "acme"),
        ];
        let mut fields = vec![(Bytes::from_static(b"payload"), Bytes::copy_from_slice(body))];
        for (name, value) in record
            .iter()
            .filter(|(n, _)| !extra.iter().any(|(e, _)| e.eq_ignore_ascii_case(n)))
            .chain(extra)
        {
            fields.push((
                Bytes::from(name.to_string()),
                Bytes::from(value.to_string()),
            ));
        }
        DeadLetter::from_fields("1-0".into(), fields)
    }

    fn eval(expression: &str, letter: &DeadLetter, now: SystemTime) -> Result<bool, ExprError> {
        Expr::parse(expression)
            .unwrap_or_else(|e| panic!("{expression}: {e}"))
            .matches(letter, now)
    }

    /// Every variable, and the JSON body, on a letter that has them all.
    #[test]
    fn every_variable_of_a_letter() {
        let now = SystemTime::now();
        let order = letter(now, &[], ORDER.as_bytes());
        let rows = [
            ("reason == 'permanent-status'", true),
            ("reason == 'undeliverable'", false),
            ("status == 422", true),
            ("status >= 400 && status < 500", true),
            ("status >= 500", false),
            ("attempts == 3", true),
            ("attempts > 2.5 && body.order.total > 150", true),
            ("error == ''", true),
            ("queue == 'orders'", true),
            ("first_attempt_at < last_attempt_at", true),
            ("last_attempt_at - first_attempt_at == duration('1h')", true),
            ("last_attempt_at > timestamp('2020-01-01T00:00:00Z')", true),
            ("age > duration('59m') && age < duration('61m')", true),
            ("age > duration('2h')", false),
            ("headers['content-type'] == 'application/json'", true),
            ("headers['x-tenant'] == 'acme'", true),
            ("'courier-reason' in headers", false),
            ("size(headers) == 2", true),
            ("headers.exists(name, name.startsWith('x-'))", true),
            ("has(body.order)", true),
            ("body.order.total > 100", true),
            ("body.order.total > 200", false),
            ("body.order.id.startsWith('A-')", true),
            ("body.order.items[0].sku == 'x'", true),
            ("body.customer == 'ada' && body.big > 1", true),
            ("has(body.refund)", false),
            ("type(status) == int && type(body) == map", true),
            (
                "type == null && source == null && subject == null && data == null",
                true,
            ),
            ("body.?order.total.orValue(0) > 100", true),
            ("optional.of(status).hasValue()", true),
        ];
        for (expression, want) in rows {
            assert_eq!(eval(expression, &order, now), Ok(want), "{expression}");
        }
        let failed = letter(now, &[("courier-error", "connect timed out")], b"{}");
        assert_eq!(
            eval("error.matches('timed? ?out$')", &failed, now),
            Ok(true)
        );
    }

    /// What a letter does not have selects nothing, with no error: a
    /// status the app never gave, a header or body member that is not
    /// there, a body that is not JSON, attributes of a message that is no
    /// event. CEL's own equality still holds: null is not 500.
    #[test]
    fn what_a_letter_lacks_matches_nothing() {
        let now = SystemTime::now();
        let no_status = letter(
            now,
            &[("courier-reason", "undeliverable"), ("courier-status", "")],
            ORDER.as_bytes(),
        );
        let text = letter(now, &[("content-type", "text/plain")], b"plain text");
        let json_as_text = letter(now, &[("content-type", "text/plain")], ORDER.as_bytes());
        let untyped = letter(now, &[("content-type", "")], ORDER.as_bytes());
        let mut huge = br#"{"order": {"total": 150}, "pad": ""#.to_vec();
        huge.resize(MAX_PARSED_BODY, b'x');
        huge.extend_from_slice(b"\"}");
        let huge = letter(now, &[], &huge);
        let rows: [(&str, &DeadLetter, bool); 18] = [
            ("status == null", &no_status, true),
            ("status >= 500", &no_status, false),
            ("status < 500", &no_status, false),
            ("!(status >= 500)", &no_status, false),
            (
                "status >= 500 || reason == 'undeliverable'",
                &no_status,
                true,
            ),
            ("status != 500", &no_status, true),
            ("headers['x-missing'] == 'a'", &no_status, false),
            ("body.refund.total > 1", &no_status, false),
            ("body.order.items[3].sku == 'x'", &no_status, false),
            ("type.startsWith('com.')", &no_status, false),
            ("body == null", &text, true),
            ("has(body.order)", &text, false),
            ("body.order.total > 100", &text, false),
            ("body == null", &json_as_text, true),
            ("body.order.total > 100", &untyped, false),
            ("body == null", &huge, true),
            ("body.order.total > 100", &huge, false),
            ("data == null", &huge, true),
        ];
        for (expression, letter, want) in rows {
            assert_eq!(eval(expression, letter, now), Ok(want), "{expression}");
        }
        // Without a content type a body is JSON when it parses as JSON.
        let bare = DeadLetter::from_fields(
            "2-0".into(),
            vec![(Bytes::from_static(b"payload"), Bytes::from(ORDER))],
        );
        assert_eq!(eval("body.order.total > 100", &bare, now), Ok(true));
    }

    /// A CloudEvent in binary mode (its attributes as headers, with any
    /// binding's prefix) and in structured mode (the event as the body).
    #[test]
    fn cloudevents_binary_and_structured() {
        let now = SystemTime::now();
        let binary = letter(
            now,
            &[
                ("ce-specversion", "1.0"),
                ("ce-id", "7"),
                ("ce-type", "com.example.order.created"),
                ("ce-source", "/shop"),
                ("ce-subject", "order-7"),
            ],
            br#"{"id": 7, "total": 150}"#,
        );
        let kafka = letter(
            now,
            &[
                ("ce_specversion", "1.0"),
                ("ce_type", "com.example.order.paid"),
                ("ce_source", "/billing"),
                ("content-type", "text/plain"),
            ],
            b"paid in full",
        );
        let structured = letter(
            now,
            &[("content-type", "application/cloudevents+json")],
            br#"{"specversion": "1.0", "id": "9", "type": "com.example.refund", "source": "/shop", "data": {"total": 5}}"#,
        );
        let base64 = letter(
            now,
            &[("content-type", "application/cloudevents+json")],
            br#"{"specversion": "1.0", "id": "9", "type": "t", "source": "/s", "data_base64": "aGk="}"#,
        );
        let not_an_event = letter(now, &[("ce-type", "com.example.x")], b"{}");
        let rows: [(&str, &DeadLetter, bool); 15] = [
            ("type == 'com.example.order.created'", &binary, true),
            ("source == '/shop' && subject == 'order-7'", &binary, true),
            ("data.total == 150 && body.id == 7", &binary, true),
            (
                "type.endsWith('.paid') && source == '/billing'",
                &kafka,
                true,
            ),
            ("subject == null", &kafka, true),
            ("data == 'paid in full' && body == null", &kafka, true),
            (
                "type == 'com.example.refund' && source == '/shop'",
                &structured,
                true,
            ),
            ("data.total == 5 && subject == null", &structured, true),
            ("body.specversion == '1.0'", &structured, true),
            ("has(data.total)", &structured, true),
            ("data == b'hi'", &base64, true),
            ("type == 't'", &base64, true),
            ("type == null", &not_an_event, true),
            ("headers['ce-type'] == 'com.example.x'", &not_an_event, true),
            ("data == null", &not_an_event, true),
        ];
        for (expression, letter, want) in rows {
            assert_eq!(eval(expression, letter, now), Ok(want), "{expression}");
        }
    }

    /// A parse error says what is wrong, where, and which variables there
    /// are; a name that is no variable is one, a comprehension's own
    /// variable and a type name are not.
    #[test]
    fn parse_errors_say_what_and_where() {
        let rows: [(&str, usize, usize, &str); 6] = [
            ("reasn == 'x'", 1, 1, "\"reasn\" is not a variable"),
            (
                "status >= 500 && tenant == 'acme'",
                1,
                18,
                "\"tenant\" is not a variable",
            ),
            ("'é' == reasn", 1, 8, "\"reasn\" is not a variable"),
            (
                "status == 400 &&\n  reasn == 'x'",
                2,
                3,
                "\"reasn\" is not a variable",
            ),
            ("status >=", 1, 10, "Syntax error: mismatched input '<EOF>'"),
            ("'é' ==", 1, 7, "Syntax error: mismatched input '<EOF>'"),
        ];
        for (expression, line, column, message) in rows {
            let error = Expr::parse(expression).unwrap_err();
            let ExprError::Parse {
                line: got_line,
                column: got_column,
                message: got,
                ..
            } = &error
            else {
                panic!("{expression}: {error:?}");
            };
            assert_eq!(
                (*got_line, *got_column),
                (line, column),
                "{expression}: {error}"
            );
            assert!(got.starts_with(message), "{expression}: {got}");
            let shown = error.to_string();
            assert!(
                shown.ends_with(
                    "the variables: reason, status, attempts, error, queue, first_attempt_at, \
                     last_attempt_at, age, headers, body, type, source, subject, data"
                ),
                "{shown}"
            );
        }
        let shown = Expr::parse("status >= ").unwrap_err().to_string();
        assert!(
            shown.starts_with("at column 11: Syntax error: ")
                && shown.contains("\n  status >= \n            ^\n"),
            "{shown}"
        );
        let shown = Expr::parse("status == 400 &&\n  reasn == 'x'")
            .unwrap_err()
            .to_string();
        assert!(
            shown.starts_with(
                "at line 2, column 3: \"reasn\" is not a variable\n    reasn == 'x'\n    ^\n"
            ),
            "{shown}"
        );
        for fine in [
            "headers.exists(k, k == 'x-tenant')",
            "[1, 2].map(x, x * 2).all(y, y > 0)",
            "headers.exists_one(k, k == 'x-tenant')",
            "type(status) == int || type(body) == null_type",
            "optional.none().hasValue() == false",
        ] {
            Expr::parse(fine).unwrap_or_else(|e| panic!("{fine}: {e}"));
        }
        assert!(Expr::parse("").is_err());
    }

    /// An expression that is no condition, or that fails on a letter for
    /// another reason than a missing value, is an error naming it.
    #[test]
    fn evaluation_errors_are_named() {
        let now = SystemTime::now();
        let order = letter(now, &[], ORDER.as_bytes());
        assert_eq!(
            eval("status", &order, now),
            Err(ExprError::NotBool("the int 422".into()))
        );
        assert_eq!(
            eval("reason", &order, now),
            Err(ExprError::NotBool("the string \"permanent-status\"".into()))
        );
        assert_eq!(
            eval("body.order", &order, now),
            Err(ExprError::NotBool("a map".into()))
        );
        let shown = eval("attempts + 1", &order, now).unwrap_err().to_string();
        assert!(
            shown.starts_with("the expression evaluated to the int 4, not to true or false"),
            "{shown}"
        );
        let Err(ExprError::Evaluation(mismatch)) = eval("status > 'four hundred'", &order, now)
        else {
            panic!("a type mismatch is an error");
        };
        assert!(
            mismatch.contains("'_>_'") && mismatch.contains("(int, string)"),
            "{mismatch}"
        );
        assert!(matches!(
            eval("reason.matches('(')", &order, now),
            Err(ExprError::Evaluation(_))
        ));
    }

    /// Only the variables an expression names are computed for a letter,
    /// and an expression is shared between threads.
    #[test]
    fn an_expression_knows_what_it_uses() {
        let uses = |expression: &str| {
            let bits = Expr::parse(expression).unwrap().uses.0;
            VARIABLES
                .iter()
                .enumerate()
                .filter(|(i, _)| bits & (1 << i) != 0)
                .map(|(_, name)| *name)
                .collect::<Vec<_>>()
        };
        assert_eq!(uses("status >= 500 && reason != 'x'"), ["reason", "status"]);
        assert_eq!(uses("headers.exists(body, body == 'x')"), ["headers"]);
        assert_eq!(uses("has(body.order) && type == 't'"), ["body", "type"]);
        fn shared<T: Send + Sync + Clone + 'static>() {}
        shared::<Expr>();
    }
}
