//! The HTTP client to the app: builds the request from a message and turns
//! the app's answer into an [`Outcome`]. What an outcome *means* is the
//! policy's business ([`crate::policy::Policy::classify`]). A message that
//! is a CloudEvent is offered in the mode of the HTTP binding asked for
//! ([`cloudevents`]).

pub mod batch;
pub mod cloudevents;
mod pool;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::{Bytes, BytesMut};
use http::header::{CONTENT_TYPE, HOST, HeaderName, HeaderValue, RETRY_AFTER};
use http::uri::PathAndQuery;
use http::{Method, Request, Uri};
use http_body_util::{BodyExt, Full};

use crate::model::{Directives, EXCERPT_LIMIT, Message, Outcome};
use cloudevents::Event;
use pool::{Failure, Pool};

/// The names of the headers courier sets, made once: inserting by `&str`
/// parsed and checked each name on every delivery (BENCHMARKS.md, the
/// profile).
static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
static MESSAGE_ID: HeaderName = HeaderName::from_static("courier-message-id");
static ATTEMPT: HeaderName = HeaderName::from_static("courier-attempt");
static REPLAY_COUNT: HeaderName = HeaderName::from_static("courier-replay-count");
static QUEUE: HeaderName = HeaderName::from_static("courier-queue");
static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
static TRACESTATE: HeaderName = HeaderName::from_static("tracestate");
/// The app's directives, looked up in every answer: looked up by `&str`,
/// each name was parsed again every time.
static RETRY: HeaderName = HeaderName::from_static("courier-retry");
static DEAD_LETTER: HeaderName = HeaderName::from_static("courier-dead-letter");
/// What is added to a message's own headers: the host, courier's content
/// type, key, id, attempt, replay count and queue, then hyper's content
/// length.
const ADDED_HEADERS: usize = 8;
/// The most headers (the message's own and a CloudEvent's attributes)
/// offered to the app; a message with more is undeliverable. http's
/// `HeaderMap` panics past about 24,000 entries, and HTTP servers refuse
/// far fewer (hyper takes 100 by default, nginx 8 KiB of them).
pub const MAX_HEADERS: usize = 1000;

/// Answer bodies are read (so the connection can be reused) up to this size;
/// beyond it the connection is dropped instead of reading a huge body.
const DRAIN_LIMIT: usize = 256 * 1024;

/// Reads `Retry-After` as delta-seconds or an HTTP-date. A date in the past
/// is zero; `None` means the value is not readable.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Absurdly long digit strings saturate rather than being refused.
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The app's say over a retry, from its answer's headers. The reason is
/// kept as sent, up to [`EXCERPT_LIMIT`] bytes (cut at a character
/// boundary); a value that is not UTF-8 is read lossily rather than lost.
pub fn read_directives(headers: &http::HeaderMap) -> Directives {
    let text = |name: &HeaderName| {
        headers.get(name).map(|value| {
            let mut text = String::from_utf8_lossy(value.as_bytes()).trim().to_string();
            if text.len() > EXCERPT_LIMIT {
                let mut end = EXCERPT_LIMIT;
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                text.truncate(end);
            }
            text
        })
    };
    let retry = text(&RETRY);
    Directives {
        dead_letter: text(&DEAD_LETTER),
        retry_never: retry
            .as_deref()
            .is_some_and(|v| v.eq_ignore_ascii_case("never")),
        retry_unknown: retry.filter(|v| !v.eq_ignore_ascii_case("never")),
    }
}

/// A queue's name with its `courier-queue` header value, made once per
/// queue: made per delivery it cost a check and a copy of the name each
/// time (BENCHMARKS.md, the profile).
pub struct QueueName {
    name: String,
    /// `None`: the name cannot be a header value, and every delivery says so.
    header: Option<HeaderValue>,
}

impl QueueName {
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_string(),
            header: HeaderValue::from_str(name).ok(),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.name
    }
}

/// The request line and headers a message is offered with.
pub struct Envelope<'a> {
    pub message: &'a Message,
    pub queue: &'a QueueName,
    pub attempt: u32,
    /// How often the message was replayed from a dead-letter queue
    /// (`Delivery::replay_count`): sent as `Courier-Replay-Count` when not 0.
    pub replay_count: u32,
    /// Sent in place of the message's own `traceparent` and `tracestate`:
    /// the delivery span's, so that the app's span nests under it. `None`
    /// passes the message's own on unchanged.
    pub trace: Option<&'a TraceHeaders>,
    /// The path and query posted to in place of the app URL's own: a
    /// route's (`routes[].path`), in origin form.
    pub path: Option<&'a Uri>,
}

/// The W3C trace context of a delivery attempt's span.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceHeaders {
    pub traceparent: String,
    pub tracestate: Option<String>,
}

impl TraceHeaders {
    fn names(name: &str) -> bool {
        name.eq_ignore_ascii_case("traceparent") || name.eq_ignore_ascii_case("tracestate")
    }
}

impl Envelope<'_> {
    /// The producer's `idempotency-key`, else the event's `<source>:<id>`
    /// when it is a CloudEvent, else `<queue>:<message id>`.
    fn idempotency_key(&self, event: Option<&Event>) -> String {
        match (self.message.header("idempotency-key"), event) {
            (Some(key), _) => key.to_string(),
            (None, Some(event)) => event.key(),
            (None, None) => {
                // Joined by hand: `format!` cost some 770 instructions a
                // delivery here (BENCHMARKS.md, the profile).
                let (queue, id) = (self.queue.as_str(), self.message.id.as_str());
                let mut key = String::with_capacity(queue.len() + 1 + id.len());
                key.push_str(queue);
                key.push(':');
                key.push_str(id);
                key
            }
        }
    }
}

/// Headers never forwarded from a message: hop-by-hop names, names the
/// request itself owns, and courier's own namespace.
fn is_reserved(name: &str) -> bool {
    // Compared in place: lowering a copy of every header name cost an
    // allocation per header per delivery.
    const RESERVED: [&str; 11] = [
        "host",
        "content-length",
        "connection",
        "transfer-encoding",
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "proxy-connection",
        "content-type",
        "idempotency-key",
    ];
    RESERVED.iter().any(|r| name.eq_ignore_ascii_case(r))
        || name
            .as_bytes()
            .get(..8)
            .is_some_and(|p| p.eq_ignore_ascii_case(b"courier-"))
}

// === impl Forwarder ===

/// The pooled keep-alive client to one app URL.
#[derive(Clone)]
pub struct Forwarder {
    pool: Arc<Pool>,
    app: Uri,
    /// The app URL's path and query, in the origin form a request line
    /// carries (`/orders?x=1`).
    path: Uri,
    /// The app URL's host and port, as the `Host` header says them.
    host: HeaderValue,
    cloudevents: cloudevents::Mode,
}

impl Forwarder {
    pub fn new(app: Uri, pool_size: usize) -> Self {
        let port = app.port_u16().unwrap_or(80);
        let name = app.host().unwrap_or("127.0.0.1");
        let host = app
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str().rsplit('@').next()?).ok())
            .unwrap_or_else(|| HeaderValue::from_static("localhost"));
        Self {
            pool: Arc::new(Pool::new(name, port, pool_size)),
            path: app
                .path_and_query()
                .and_then(|p| origin_form(p.as_str()))
                .unwrap_or_else(|| Uri::from_static("/")),
            host,
            app,
            cloudevents: cloudevents::Mode::default(),
        }
    }

    /// How CloudEvents are offered (`--cloudevents`); binary by default.
    pub fn with_cloudevents(mut self, mode: cloudevents::Mode) -> Self {
        self.cloudevents = mode;
        self
    }

    /// The message as a CloudEvent, when it is one and the mode is not off.
    fn event(&self, message: &Message) -> Result<Option<Event>, String> {
        match self.cloudevents {
            cloudevents::Mode::Off => Ok(None),
            _ => cloudevents::read(message).map_err(|e| format!("not a valid CloudEvent: {e}")),
        }
    }

    /// The `Idempotency-Key` the app is sent with this message; the dedup
    /// window remembers the same key. A message that claims to be a
    /// CloudEvent but is not a valid one keeps the queue's key here; its
    /// delivery fails as undeliverable.
    pub fn idempotency_key(&self, envelope: &Envelope<'_>) -> String {
        let event = self.event(envelope.message).ok().flatten();
        envelope.idempotency_key(event.as_ref())
    }

    pub fn app(&self) -> &Uri {
        &self.app
    }

    /// Whether the app accepts a TCP connection now; the idle-time signal
    /// behind `courier_app_up` when no deliveries are flowing.
    pub async fn app_accepts_connections(&self) -> bool {
        let host = self
            .app
            .host()
            .unwrap_or("127.0.0.1")
            .trim_matches(['[', ']']);
        let port = self.app.port_u16().unwrap_or(80);
        let connect = tokio::net::TcpStream::connect((host, port));
        matches!(
            tokio::time::timeout(Duration::from_secs(1), connect).await,
            Ok(Ok(_))
        )
    }

    /// `GET <path>` on the app's host; true on a 2xx within two seconds.
    pub async fn probe(&self, path: &str) -> bool {
        let Some(uri) = origin_form(path) else {
            return false;
        };
        let Ok(request) = Request::get(uri)
            .header(HOST, self.host.clone())
            .body(Full::new(Bytes::new()))
        else {
            return false;
        };
        let answer = tokio::time::timeout(Duration::from_secs(2), async {
            let (response, lent) = self.pool.send(request).await.ok()?;
            let success = response.status().is_success();
            // Read whole, so the connection can serve deliveries after it.
            if response.into_body().collect().await.is_ok() {
                self.pool.give_back(lent);
            }
            Some(success)
        })
        .await;
        matches!(answer, Ok(Some(true)))
    }

    /// Offers a message to the app and waits for the whole answer, at most
    /// `timeout`.
    pub async fn deliver(&self, envelope: &Envelope<'_>, timeout: Duration) -> Outcome {
        let request = match self.build(envelope) {
            Ok(request) => request,
            Err(error) => return Outcome::Undeliverable { error },
        };
        match tokio::time::timeout(timeout, self.exchange(request)).await {
            Ok(outcome) => outcome,
            Err(_) => Outcome::Timeout,
        }
    }

    fn build(&self, envelope: &Envelope<'_>) -> Result<Request<Full<Bytes>>, String> {
        let message = envelope.message;
        if message.headers.len() > MAX_HEADERS {
            return Err(too_many_headers(message.headers.len()));
        }
        let event = self.event(message)?;
        let mut builder = Request::builder()
            .method(Method::POST)
            .uri(envelope.path.unwrap_or(&self.path).clone());
        let headers = builder
            .headers_mut()
            .ok_or_else(|| "invalid request".to_string())?;
        // Room for all at once: grown header by header, the map reallocated
        // and rehashed on the way.
        headers.reserve(message.headers.len() + ADDED_HEADERS);
        headers.insert(HOST, self.host.clone());
        for (name, value) in &message.headers {
            // An event's attributes are written from the event below.
            if is_reserved(name)
                || (event.is_some() && cloudevents::is_attribute_header(name))
                || (envelope.trace.is_some() && TraceHeaders::names(name))
            {
                continue;
            }
            // Names that are not HTTP tokens, and values HTTP cannot carry,
            // are dropped rather than failing the whole delivery.
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(value),
            ) {
                headers.append(name, value);
            }
        }
        // Bytes is reference-counted: the body is handed over, not copied.
        let body = match &event {
            None => {
                let content_type = message
                    .header("content-type")
                    .and_then(|v| HeaderValue::from_str(v).ok())
                    .unwrap_or(HeaderValue::from_static("application/octet-stream"));
                headers.insert(CONTENT_TYPE, content_type);
                message.body.clone()
            }
            Some(event) => {
                let rendered = event.render(self.cloudevents, &message.body);
                if headers.len() + rendered.headers.len() > MAX_HEADERS {
                    return Err(too_many_headers(headers.len() + rendered.headers.len()));
                }
                for (name, value) in &rendered.headers {
                    let name = HeaderName::from_bytes(name.as_bytes())
                        .map_err(|_| format!("CloudEvent: {name:?} is not a header name"))?;
                    // Percent-encoded: always a valid header value.
                    let value = HeaderValue::from_str(value)
                        .map_err(|_| format!("CloudEvent: {value:?} is not a header value"))?;
                    headers.insert(name, value);
                }
                if let Some(content_type) = &rendered.content_type {
                    let value = HeaderValue::from_str(content_type).map_err(|_| {
                        format!(
                            "CloudEvent: datacontenttype {content_type:?} is not a header value"
                        )
                    })?;
                    headers.insert(CONTENT_TYPE, value);
                }
                rendered.body
            }
        };
        // Handed over as it is, not copied: the key is made for this request.
        let key =
            HeaderValue::from_maybe_shared(Bytes::from(envelope.idempotency_key(event.as_ref())))
                .map_err(|_| {
                let key = envelope.idempotency_key(event.as_ref());
                format!("idempotency key {key:?} is not a valid header value")
            })?;
        headers.insert(IDEMPOTENCY_KEY.clone(), key);
        let id = HeaderValue::from_str(&message.id)
            .map_err(|_| format!("message id {:?} is not a valid header value", message.id))?;
        headers.insert(MESSAGE_ID.clone(), id);
        headers.insert(ATTEMPT.clone(), HeaderValue::from(envelope.attempt));
        if envelope.replay_count > 0 {
            headers.insert(
                REPLAY_COUNT.clone(),
                HeaderValue::from(envelope.replay_count),
            );
        }
        let queue = envelope.queue.header.clone().ok_or_else(|| {
            format!(
                "queue {:?} is not a valid header value",
                envelope.queue.as_str()
            )
        })?;
        headers.insert(QUEUE.clone(), queue);
        if let Some(trace) = envelope.trace {
            // The propagator writes only valid W3C values; one that is not a
            // header value would be dropped like any other.
            let values = [
                (&TRACEPARENT, Some(&trace.traceparent)),
                (&TRACESTATE, trace.tracestate.as_ref()),
            ];
            for (name, value) in values {
                if let Some(Ok(value)) = value.map(|v| HeaderValue::from_str(v)) {
                    headers.insert(name.clone(), value);
                }
            }
        }
        builder.body(Full::new(body)).map_err(|e| e.to_string())
    }

    async fn exchange(&self, request: Request<Full<Bytes>>) -> Outcome {
        let (response, lent) = match self.pool.send(request).await {
            Ok(sent) => sent,
            Err(Failure::NeverSent(error)) => return Outcome::Unreachable { error },
            Err(Failure::Lost(error)) => return Outcome::ConnectionLost { error },
        };
        let status = response.status().as_u16();
        let (retry_after, retry_after_invalid) = match response.headers().get(RETRY_AFTER) {
            None => (None, false),
            Some(value) => {
                let parsed = value
                    .to_str()
                    .ok()
                    .and_then(|v| parse_retry_after(v, SystemTime::now()));
                (parsed, parsed.is_none())
            }
        };
        let directives = read_directives(response.headers());
        let mut body = response.into_body();
        let mut excerpt = BytesMut::new();
        let mut read = 0usize;
        // Only a connection whose answer was read to its end can carry the
        // next request; one left mid-body is closed.
        let mut whole = false;
        loop {
            let Some(frame) = body.frame().await else {
                whole = true;
                break;
            };
            let Ok(frame) = frame else { break };
            if let Ok(data) = frame.into_data() {
                read += data.len();
                let room = EXCERPT_LIMIT.saturating_sub(excerpt.len());
                excerpt.extend_from_slice(&data[..room.min(data.len())]);
                if read > DRAIN_LIMIT {
                    break;
                }
            }
        }
        if whole {
            self.pool.give_back(lent);
        }
        Outcome::Answered {
            status,
            retry_after,
            retry_after_invalid,
            excerpt: excerpt.freeze(),
            directives,
        }
    }
}

/// `path` (with its query) as the origin form of a request line; `None`
/// when it is not one.
fn origin_form(path: &str) -> Option<Uri> {
    let path = path.parse::<PathAndQuery>().ok()?;
    path.as_str().starts_with('/').then(|| Uri::from(path))
}

/// Why a message with `count` headers is not offered.
fn too_many_headers(count: usize) -> String {
    format!(
        "the message has {count} headers (its own and a CloudEvent's attributes); courier offers at most {MAX_HEADERS} to the app"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rows() {
        let now = httpdate::parse_http_date("Sun, 29 Nov 2026 12:00:00 GMT").unwrap();
        let rows: [(&str, Option<Duration>); 9] = [
            ("0", Some(Duration::ZERO)),
            ("1", Some(Duration::from_secs(1))),
            (" 120 ", Some(Duration::from_secs(120))),
            (
                "Sun, 29 Nov 2026 12:00:30 GMT",
                Some(Duration::from_secs(30)),
            ),
            ("Sun, 29 Nov 2026 11:00:00 GMT", Some(Duration::ZERO)),
            ("-5", None),
            ("1.5", None),
            ("soon", None),
            ("", None),
        ];
        for (value, want) in rows {
            assert_eq!(parse_retry_after(value, now), want, "{value:?}");
        }
        assert_eq!(
            parse_retry_after("99999999999999999999999", now),
            Some(Duration::from_secs(u64::MAX))
        );
    }

    #[test]
    fn directive_rows() {
        let read = |pairs: &[(&str, &[u8])]| {
            let mut headers = http::HeaderMap::new();
            for (name, value) in pairs {
                headers.append(
                    HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    HeaderValue::from_bytes(value).unwrap(),
                );
            }
            read_directives(&headers)
        };
        assert_eq!(read(&[]), Directives::default());
        let poison = read(&[("Courier-Dead-Letter", b" unknown SKU 42 ")]);
        assert_eq!(poison.dead_letter.as_deref(), Some("unknown SKU 42"));
        assert!(!poison.retry_never);
        assert_eq!(
            read(&[("courier-dead-letter", b"")]).dead_letter.as_deref(),
            Some(""),
            "an empty reason still says stop"
        );
        assert!(read(&[("Courier-Retry", b"never")]).retry_never);
        assert!(read(&[("courier-retry", b"NEVER")]).retry_never);
        let unknown = read(&[("Courier-Retry", b"later")]);
        assert!(!unknown.retry_never);
        assert_eq!(unknown.retry_unknown.as_deref(), Some("later"));
        let long = "é".repeat(EXCERPT_LIMIT);
        let cut = read(&[("courier-dead-letter", long.as_bytes())]);
        let reason = cut.dead_letter.unwrap();
        assert!(reason.len() <= EXCERPT_LIMIT && reason.len() > EXCERPT_LIMIT - 2);
        assert!(reason.chars().all(|c| c == 'é'));
        let binary = read(&[("courier-dead-letter", b"bad \xff byte")]);
        assert_eq!(binary.dead_letter.as_deref(), Some("bad \u{fffd} byte"));
    }

    fn small_message() -> Message {
        Message {
            id: "1-0".into(),
            body: Bytes::from_static(b"{}"),
            headers: Vec::new(),
        }
    }

    /// Found at 21da363: about 24,600 headers, or as many attributes of a
    /// CloudEvent in structured mode, made http's HeaderMap panic while
    /// the request was built. Past the cap the message is undeliverable,
    /// with a reason, and nothing panics.
    #[test]
    fn more_headers_than_the_cap_is_undeliverable_not_a_panic() {
        let forwarder = Forwarder::new("http://127.0.0.1:9/".parse().unwrap(), 1);
        let queue = QueueName::new("q");
        let many = Message {
            headers: (0..30_000).map(|i| (format!("h{i}"), "v".into())).collect(),
            ..small_message()
        };
        let error = forwarder.build(&envelope(&many, &queue)).unwrap_err();
        assert!(
            error.contains("30000 headers") && error.contains("at most 1000"),
            "{error}"
        );

        let attributes: String = (0..30_000).map(|i| format!(",\"a{i}\":\"v\"")).collect();
        let event = Message {
            body: Bytes::from(format!(
                "{{\"specversion\":\"1.0\",\"id\":\"e1\",\"source\":\"/s\",\"type\":\"t\"{attributes}}}"
            )),
            ..small_message()
        };
        let error = forwarder.build(&envelope(&event, &queue)).unwrap_err();
        assert!(
            error.contains("headers") && error.contains("at most 1000"),
            "{error}"
        );

        let at_the_cap = Message {
            headers: (0..MAX_HEADERS)
                .map(|i| (format!("h{i}"), "v".into()))
                .collect(),
            ..small_message()
        };
        assert!(forwarder.build(&envelope(&at_the_cap, &queue)).is_ok());
    }

    fn envelope<'a>(message: &'a Message, queue: &'a QueueName) -> Envelope<'a> {
        Envelope {
            message,
            queue,
            attempt: 1,
            replay_count: 0,
            trace: None,
            path: None,
        }
    }

    /// Offers [`small_message`] with a timeout of 5 s.
    async fn offer(forwarder: &Forwarder) -> Outcome {
        let message = small_message();
        forwarder
            .deliver(
                &envelope(&message, &QueueName::new("orders")),
                Duration::from_secs(5),
            )
            .await
    }

    #[tokio::test]
    async fn a_refused_connection_is_unreachable() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let forwarder = Forwarder::new(format!("http://{addr}/").parse().unwrap(), 1);
        let outcome = offer(&forwarder).await;
        assert!(
            matches!(&outcome, Outcome::Unreachable { error } if error.contains("onnect")),
            "{outcome:?}"
        );
    }

    /// What an app that crashes on a message looks like: it reads the
    /// request, then the connection goes away without an answer.
    #[tokio::test]
    async fn a_connection_dropped_after_the_request_is_lost_not_unreachable() {
        use tokio::io::AsyncReadExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            while !seen.ends_with(b"{}") {
                let n = stream.read(&mut buf).await.unwrap();
                assert!(n > 0, "the request arrives whole");
                seen.extend_from_slice(&buf[..n]);
            }
            // A reset, not a polite close: what a killed process leaves.
            stream.set_zero_linger().unwrap();
            drop(stream);
            String::from_utf8_lossy(&seen).into_owned()
        });
        let forwarder = Forwarder::new(format!("http://{addr}/").parse().unwrap(), 1);
        let outcome = offer(&forwarder).await;
        let seen = app.await.unwrap();
        assert!(seen.starts_with("POST / HTTP/1.1"), "{seen}");
        assert!(
            matches!(outcome, Outcome::ConnectionLost { .. }),
            "{outcome:?}"
        );
    }

    /// An app on loopback that answers 200 to every request, keeping each
    /// connection open (`close_after_answer` false) or closing it after
    /// its first answer, as an app server's idle timeout does; it counts
    /// the connections it accepted and checks each request line.
    async fn counting_app(close_after_answer: bool) -> (Uri, Arc<std::sync::atomic::AtomicUsize>) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 4096];
                    loop {
                        while !seen.ends_with(b"{}") {
                            match stream.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => seen.extend_from_slice(&buf[..n]),
                            }
                        }
                        let text = String::from_utf8_lossy(&seen).into_owned();
                        assert!(text.starts_with("POST /orders?x=1 HTTP/1.1\r\n"), "{text}");
                        assert!(
                            text.to_ascii_lowercase()
                                .contains(&format!("\r\nhost: {addr}\r\n")),
                            "{text}"
                        );
                        seen.clear();
                        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if stream.write_all(answer).await.is_err() || close_after_answer {
                            return;
                        }
                    }
                });
            }
        });
        (
            format!("http://{addr}/orders?x=1").parse().unwrap(),
            accepted,
        )
    }

    /// Delivers `times` messages one after another to a [`counting_app`],
    /// `pause` apart, each answered 200; returns the connections it took.
    async fn connections_for(close_after_answer: bool, times: usize, pause: Duration) -> usize {
        let (app, accepted) = counting_app(close_after_answer).await;
        let forwarder = Forwarder::new(app, 4);
        for _ in 0..times {
            let outcome = offer(&forwarder).await;
            assert!(
                matches!(outcome, Outcome::Answered { status: 200, .. }),
                "{outcome:?}"
            );
            tokio::time::sleep(pause).await;
        }
        accepted.load(std::sync::atomic::Ordering::SeqCst)
    }

    #[tokio::test]
    async fn deliveries_one_after_another_share_one_connection() {
        assert_eq!(connections_for(false, 3, Duration::ZERO).await, 1);
    }

    /// The app closed the idle connection: the next delivery goes out on a
    /// new one and is answered, neither unreachable nor lost.
    #[tokio::test]
    async fn a_connection_the_app_closed_while_idle_is_replaced() {
        assert_eq!(
            connections_for(true, 2, Duration::from_millis(100)).await,
            2
        );
    }

    #[test]
    fn a_delivery_span_replaces_the_producers_trace_context() {
        let forwarder = Forwarder::new("http://127.0.0.1:8080/".parse().unwrap(), 1);
        let message = Message {
            headers: vec![
                ("TraceParent".into(), "00-producer-01".into()),
                ("tracestate".into(), "shop=producer".into()),
                ("x-tenant".into(), "7".into()),
            ],
            ..small_message()
        };
        let values = |request: &Request<Full<Bytes>>, name: &str| -> Vec<String> {
            request
                .headers()
                .get_all(name)
                .iter()
                .map(|v| v.to_str().unwrap().to_string())
                .collect()
        };
        let queue = QueueName::new("orders");
        let untraced = forwarder.build(&envelope(&message, &queue)).unwrap();
        assert_eq!(values(&untraced, "traceparent"), ["00-producer-01"]);
        assert_eq!(values(&untraced, "tracestate"), ["shop=producer"]);

        let span = TraceHeaders {
            traceparent: "00-courier-01".into(),
            tracestate: None,
        };
        let traced = Envelope {
            trace: Some(&span),
            path: None,
            ..envelope(&message, &queue)
        };
        let request = forwarder.build(&traced).unwrap();
        assert_eq!(values(&request, "traceparent"), ["00-courier-01"]);
        assert!(
            values(&request, "tracestate").is_empty(),
            "the span's state, none"
        );
        assert_eq!(values(&request, "x-tenant"), ["7"]);
        let span = TraceHeaders {
            tracestate: Some("shop=producer".into()),
            ..span
        };
        let traced = Envelope {
            trace: Some(&span),
            path: None,
            ..envelope(&message, &queue)
        };
        let request = forwarder.build(&traced).unwrap();
        assert_eq!(values(&request, "tracestate"), ["shop=producer"]);
    }

    /// A replayed message says how often it was replayed, on every
    /// attempt; one never replayed has no such header, and a producer's
    /// header of that name is never forwarded.
    #[test]
    fn a_replayed_message_carries_its_replay_count() {
        let forwarder = Forwarder::new("http://127.0.0.1:8080/".parse().unwrap(), 1);
        let queue = QueueName::new("orders");
        let message = Message {
            headers: vec![("Courier-Replay-Count".into(), "99".into())],
            ..small_message()
        };
        let count = |envelope: &Envelope<'_>| -> Vec<String> {
            let request = forwarder.build(envelope).unwrap();
            request
                .headers()
                .get_all("courier-replay-count")
                .iter()
                .map(|v| v.to_str().unwrap().to_string())
                .collect()
        };
        assert!(count(&envelope(&message, &queue)).is_empty());
        let replayed = Envelope {
            replay_count: 2,
            attempt: 3,
            ..envelope(&message, &queue)
        };
        assert_eq!(count(&replayed), ["2"]);
    }

    #[test]
    fn reserved_headers_are_not_forwarded() {
        for name in [
            "Host",
            "content-length",
            "Connection",
            "Transfer-Encoding",
            "Courier-Attempt",
            "courier-x",
        ] {
            assert!(is_reserved(name), "{name}");
        }
        for name in ["traceparent", "tracestate", "x-tenant"] {
            assert!(!is_reserved(name), "{name}");
        }
    }
}
