//! The torture run on Amazon SQS: a moto server of the harness's own
//! (`scripts/moto-server`, as the project's tests start it) on a free
//! port, which this process and every courier it starts reach through
//! `AWS_ENDPOINT_URL` ([`set_environment`]); the producer (aws-sdk-sqs
//! `SendMessage`, each until SQS answered with a message id); and what the
//! checker reads: every message the work queue holds (received once,
//! without a delete, then made visible again) and the dead letters through
//! courier's own dead-letter store.
//!
//! moto keeps everything in memory, so the nemesis never SIGKILLs it; it
//! SIGSTOPs it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use bytes::Bytes;
use courier::source::sqs::{
    ENCODING, HEADERS, MAX_ATTRIBUTES, RECORD, attribute_name_ok, dead_letter_queue_name,
    is_sqs_text,
};

use super::{
    Holdings, Hostile, Letter, PrivateServer, Produced, TortureArgs, admin_letters, message,
};
use crate::torture_app::{id_of, ids_in};

/// The region of the run's queues.
const REGION: &str = "us-east-1";

/// The `--max-body` an SQS run uses at most: the corpus's body one byte
/// over it, with its attributes, must still be a message SQS takes (256
/// KiB, body and attributes together, which moto checks as SQS does), or
/// the id courier is to dead-letter as `undeliverable` could not be
/// produced at all.
pub(super) const SQS_MAX_BODY: usize = 240 * 1024;

/// Points this process (and so every courier it starts) at a moto on
/// `port`, with moto's fake credentials. Called before any thread starts.
pub(crate) fn set_environment(port: u16) {
    // SAFETY: called from `main` before the runtime and its threads exist;
    // nothing reads the environment concurrently.
    unsafe {
        std::env::set_var("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}"));
        std::env::set_var("AWS_ACCESS_KEY_ID", "testing");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "testing");
        std::env::set_var("AWS_REGION", REGION);
        std::env::remove_var("AWS_PROFILE");
        std::env::remove_var("AWS_ENDPOINT_URL_SQS");
    }
}

/// A moto server of the harness's own, on the port [`set_environment`]
/// named.
pub(crate) struct PrivateMoto {
    pub(crate) server: PrivateServer,
}

impl PrivateMoto {
    pub(crate) fn url(&self) -> String {
        format!("sqs://{REGION}")
    }

    pub(super) fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.server.port)
    }

    /// Starts moto (the script installs it into `.venv-moto/` on its first
    /// run, which may take minutes) and waits until its port answers.
    pub(crate) async fn start(&mut self) -> anyhow::Result<()> {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/moto-server");
        let mut command = Command::new(&script);
        command.args(["-p", &self.server.port.to_string()]);
        self.server.spawn("moto", command)?;
        let deadline = Instant::now() + Duration::from_secs(300);
        while std::net::TcpStream::connect(("127.0.0.1", self.server.port)).is_err() {
            if let Some(p) = self.server.process.as_mut()
                && let Some(status) = p.exited()
            {
                bail!("moto exited ({status}): {}", p.log_tail(10));
            }
            if Instant::now() > deadline {
                bail!("moto did not answer within 300 s ({})", script.display());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    /// The plain SDK client, as an application makes one (the SDK's
    /// default HTTPS client is not built, src/Cargo.toml says why).
    async fn client(&self) -> aws_sdk_sqs::Client {
        client(&self.endpoint()).await
    }

    /// Creates the work queue as `courier run --create` does (and the seal
    /// key's tag), by opening courier's own source once.
    pub(super) async fn create_queue(&self, queue: &str) -> anyhow::Result<()> {
        let url = courier::source::parse_url(&self.url()).map_err(anyhow::Error::msg)?;
        let mut options = courier::source::SourceOptions::new(queue);
        options.create = true;
        let source = courier::source::open(&url, options).await?;
        source.close().await;
        Ok(())
    }

    /// The work queue's visible, invisible (received, or retried by a
    /// visibility change) and delayed (copies) messages; moto's counts are
    /// exact.
    async fn counts(&self, client: &aws_sdk_sqs::Client, url: &str) -> anyhow::Result<[u64; 3]> {
        let out = client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::All)
            .send()
            .await?;
        let attributes = out.attributes().context("no queue attributes")?;
        let n = |name: QueueAttributeName| {
            attributes
                .get(&name)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        Ok([
            n(QueueAttributeName::ApproximateNumberOfMessages),
            n(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
            n(QueueAttributeName::ApproximateNumberOfMessagesDelayed),
        ])
    }

    async fn queue_url(&self, client: &aws_sdk_sqs::Client, queue: &str) -> anyhow::Result<String> {
        crate::servers::sqs_queue_url(client, queue).await
    }

    /// Whether the work queue holds nothing: no message visible, in flight
    /// or delayed.
    pub(super) async fn settled(&self, queue: &str) -> bool {
        let client = self.client().await;
        let check = async {
            let url = self.queue_url(&client, queue).await?;
            self.counts(&client, &url).await
        };
        matches!(
            tokio::time::timeout(Duration::from_secs(5), check).await,
            Ok(Ok([0, 0, 0]))
        )
    }

    /// The ids of every message of the work queue, and the dead letters as
    /// `courier dlq list` reads them. SQS shows a message only to a
    /// receive, and not while it is invisible or delayed: courier is
    /// stopped by now, so what it had in flight (visibility 6 s, retries of
    /// at most 2 s, copies' delays) comes back within a minute; this waits
    /// for that, then receives each message once and gives it back.
    pub(super) async fn holdings(&self, queue: &str) -> anyhow::Result<Holdings> {
        let client = self.client().await;
        let url = self.queue_url(&client, queue).await?;
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut counts = self.counts(&client, &url).await?;
        while counts[1] + counts[2] > 0 {
            if Instant::now() > deadline {
                bail!(
                    "the work queue still holds {} invisible and {} delayed messages after 60 s",
                    counts[1],
                    counts[2]
                );
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            counts = self.counts(&client, &url).await?;
        }
        let mut out = Holdings::default();
        let mut handles = Vec::new();
        let mut seen = 0u64;
        while seen < counts[0] {
            let got = client
                .receive_message()
                .queue_url(&url)
                .max_number_of_messages(10)
                .visibility_timeout(120)
                .message_attribute_names("All")
                .send()
                .await?
                .messages
                .unwrap_or_default();
            if got.is_empty() {
                break;
            }
            for m in got {
                seen += 1;
                ids_in(m.body().unwrap_or_default().as_bytes(), &mut out.pending);
                for value in m.message_attributes().into_iter().flat_map(|a| a.values()) {
                    ids_in(
                        value.string_value().unwrap_or_default().as_bytes(),
                        &mut out.pending,
                    );
                }
                handles.extend(m.receipt_handle().map(str::to_string));
            }
        }
        if seen < counts[0] {
            bail!(
                "received {seen} of the {} messages the work queue holds",
                counts[0]
            );
        }
        for handle in handles {
            let _ = client
                .change_message_visibility()
                .queue_url(&url)
                .receipt_handle(handle)
                .visibility_timeout(0)
                .send()
                .await;
        }
        out.letters = admin_letters(&self.url(), queue).await?;
        self.check_letters(&client, queue, &mut out).await?;
        Ok(out)
    }

    /// Counts the dead-letter queue (`<queue>-dlq`) with moto's exact
    /// counts; when courier's store listed fewer letters than it holds,
    /// says so and judges the ids by every message of the queue, received
    /// once (with a visibility longer than the reading) and given back.
    async fn check_letters(
        &self,
        client: &aws_sdk_sqs::Client,
        queue: &str,
        out: &mut Holdings,
    ) -> anyhow::Result<()> {
        let name = dead_letter_queue_name(&format!("{queue}.dlq"));
        let Ok(url) = self.queue_url(client, &name).await else {
            return Ok(());
        };
        let mut counts = self.counts(client, &url).await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while counts[1] + counts[2] > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_secs(1)).await;
            counts = self.counts(client, &url).await?;
        }
        let held: u64 = counts.iter().sum();
        if held <= out.letters.len() as u64 {
            return Ok(());
        }
        let started = Instant::now();
        let mut letters = Vec::new();
        let mut handles = Vec::new();
        while (letters.len() as u64) < held {
            let got = client
                .receive_message()
                .queue_url(&url)
                .max_number_of_messages(10)
                .visibility_timeout(300)
                .message_attribute_names("All")
                .send()
                .await?
                .messages
                .unwrap_or_default();
            if got.is_empty() {
                break;
            }
            for m in got {
                letters.push(Letter::of(&letter_fields(&m)));
                handles.extend(m.receipt_handle().map(str::to_string));
            }
        }
        let secs = started.elapsed().as_secs_f64();
        for handle in handles {
            let _ = client
                .change_message_visibility()
                .queue_url(&url)
                .receipt_handle(handle)
                .visibility_timeout(0)
                .send()
                .await;
        }
        out.discrepancies.push(format!(
            "courier's dead-letter store listed {} letters of {name}, which holds {held} (moto's count; receiving them all took {secs:.1} s here)",
            out.letters.len()
        ));
        out.letters = letters;
        Ok(())
    }
}

async fn client(endpoint: &str) -> aws_sdk_sqs::Client {
    use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
        .build_https();
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new(REGION))
        .endpoint_url(endpoint)
        .http_client(http)
        .load()
        .await;
    aws_sdk_sqs::Client::new(&config)
}

/// An SQS message as fields, by the format docs/sources.md gives: the body
/// (base64 when `content-transfer-encoding` says so), each attribute, the
/// pairs of `courier-headers` and the fields of `courier-record`.
fn letter_fields(m: &aws_sdk_sqs::types::Message) -> Vec<(Bytes, Bytes)> {
    use base64::Engine;
    let empty = HashMap::new();
    let attributes = m.message_attributes().unwrap_or(&empty);
    let text = |name: &str| attributes.get(name).and_then(|v| v.string_value());
    let body = m.body().unwrap_or_default();
    let body = match text(ENCODING) {
        Some("base64") => base64::engine::general_purpose::STANDARD
            .decode(body)
            .map(Bytes::from)
            .unwrap_or_else(|_| Bytes::copy_from_slice(body.as_bytes())),
        _ => Bytes::copy_from_slice(body.as_bytes()),
    };
    let mut fields = vec![(Bytes::from_static(courier::model::PAYLOAD.as_bytes()), body)];
    for (name, value) in attributes {
        if ![RECORD, HEADERS, ENCODING].contains(&name.as_str()) {
            let value = value.string_value().unwrap_or_default();
            fields.push((Bytes::from(name.clone()), Bytes::from(value.to_string())));
        }
    }
    if let Some(pairs) =
        text(HEADERS).and_then(|j| serde_json::from_str::<Vec<(String, String)>>(j).ok())
    {
        fields.extend(
            pairs
                .into_iter()
                .map(|(n, v)| (Bytes::from(n), Bytes::from(v))),
        );
    }
    if let Some(serde_json::Value::Object(record)) =
        text(RECORD).and_then(|j| serde_json::from_str(j).ok())
    {
        for (name, value) in record {
            if let serde_json::Value::String(value) = value {
                fields.push((Bytes::from(name), Bytes::from(value)));
            }
        }
    }
    fields
}

fn string(value: String) -> Option<MessageAttributeValue> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .ok()
}

/// Message `n` as an SQS `SendMessage`, in the format docs/sources.md
/// gives producers: the body as text (base64 with `content-transfer-encoding`
/// when SQS cannot carry it); the headers one String attribute each while
/// all fit in SQS's 10 and each is one SQS takes, otherwise all of them in
/// `courier-headers` (a JSON array of pairs, which is how a producer sends
/// 900 headers at all); `courier-*` fields in `courier-record` (a JSON
/// object), the only place courier reads them from. Bytes that are not
/// UTF-8 go as U+FFFD, as a client writing them from a string sends them.
fn send_of(
    n: u64,
    kind: Option<Hostile>,
    max_body: usize,
) -> (String, HashMap<String, MessageAttributeValue>) {
    let mut fields = message(n, kind, max_body, true);
    let body = fields.remove(0).1;
    let mut attributes = HashMap::new();
    let body = match std::str::from_utf8(&body) {
        Ok(text) if !text.is_empty() && is_sqs_text(text) => text.to_string(),
        _ => {
            use base64::Engine;
            attributes.extend(string("base64".into()).map(|v| (ENCODING.to_string(), v)));
            base64::engine::general_purpose::STANDARD.encode(&body)
        }
    };
    let mut record = serde_json::Map::new();
    let mut headers: Vec<(String, String)> = Vec::new();
    for (name, value) in &fields {
        let name = String::from_utf8_lossy(name).into_owned();
        let value = String::from_utf8_lossy(value).into_owned();
        if name.to_ascii_lowercase().starts_with("courier-") {
            record.insert(name, serde_json::Value::String(value));
        } else {
            headers.push((name, value));
        }
    }
    if !record.is_empty() {
        let json = serde_json::Value::Object(record).to_string();
        attributes.extend(string(json).map(|v| (RECORD.to_string(), v)));
    }
    let mut names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    let each_fits = attributes.len() + headers.len() <= MAX_ATTRIBUTES
        && names.windows(2).all(|w| w[0] != w[1])
        && headers.iter().all(|(n, v)| {
            attribute_name_ok(n)
                && ![RECORD, HEADERS, ENCODING].contains(&n.as_str())
                && !v.is_empty()
                && is_sqs_text(v)
        });
    if each_fits {
        for (name, value) in headers {
            attributes.extend(string(value).map(|v| (name, v)));
        }
    } else {
        let pairs: Vec<[String; 2]> = headers.into_iter().map(|(n, v)| [n, v]).collect();
        let json = serde_json::to_string(&pairs).unwrap_or_default();
        attributes.extend(string(json).map(|v| (HEADERS.to_string(), v)));
    }
    (body, attributes)
}

/// The producer: a `SendMessage` to the work queue at the rate, each tried
/// until SQS answered with a message id (moto may be stopped).
pub(super) fn spawn_producer(
    queue: String,
    args: TortureArgs,
    produced: Arc<Mutex<Produced>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    endpoint: String,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let client = client(&endpoint).await;
        let mut url: Option<String> = None;
        let period = Duration::from_secs_f64(1.0 / args.rate.max(0.1));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut n = 0u64;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            tick.tick().await;
            let kind = Hostile::of(args.seed, n, args.hostile);
            let (body, attributes) = send_of(n, kind, args.max_body);
            let give_up = Instant::now() + Duration::from_secs(60);
            loop {
                let send = async {
                    if url.is_none() {
                        let got = client.get_queue_url().queue_name(&queue).send().await?;
                        url = got.queue_url().map(str::to_string);
                    }
                    let out = client
                        .send_message()
                        .queue_url(url.clone().unwrap_or_default())
                        .message_body(body.clone())
                        .set_message_attributes(Some(attributes.clone()))
                        .send()
                        .await?;
                    anyhow::Ok(out.message_id().is_some())
                };
                let error = match tokio::time::timeout(Duration::from_secs(10), send).await {
                    Ok(Ok(true)) => {
                        produced.lock().unwrap().ids.push((n, kind));
                        break;
                    }
                    Ok(Ok(false)) => format!("{}: SQS answered without a message id", id_of(n)),
                    Ok(Err(e)) => format!("{e:#}"),
                    Err(_) => "no answer within 10 s".into(),
                };
                if produced
                    .lock()
                    .unwrap()
                    .write_failed(n, kind, error, give_up)
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            n += 1;
        }
    })
}
