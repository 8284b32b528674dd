//! The torture run on NATS JetStream: a `nats-server -js` of the harness's
//! own (never the shared one on 4222) with its store on disk, the producer
//! (async-nats publishes, each until the server acknowledged it), and what
//! the checker reads: every message the work stream still holds, and the
//! dead letters through courier's own dead-letter store.

use std::process::Command;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream::RawMessageErrorKind};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;

use super::{
    Holdings, Hostile, PrivateServer, Produced, TortureArgs, admin_letters, message, wait_answering,
};
use crate::torture_app::{id_of, ids_in};

/// A nats-server of the harness's own. A work-queue stream keeps only what
/// is not settled yet, so what it holds at the end is exactly the unsettled
/// messages: unread, in flight, `Nak`ed for a retry, or a retry's copy
/// waiting for its time.
pub(super) struct PrivateNats {
    pub(super) server: PrivateServer,
}

impl PrivateNats {
    pub(super) fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.server.port)
    }

    /// Starts the server on its port and store (a restart finds the
    /// streams and consumers it had), and waits until JetStream answers.
    pub(super) async fn start(&mut self) -> anyhow::Result<()> {
        // COURIER_NATS_SERVER picks another server than the PATH's, such as
        // scripts/nats-server-current (2.15 where Debian has 2.9).
        let program = std::env::var("COURIER_NATS_SERVER").unwrap_or_else(|_| "nats-server".into());
        let mut command = Command::new(program);
        command
            .args(["-a", "127.0.0.1", "-p", &self.server.port.to_string()])
            .args([
                "-js",
                "-sd",
                &self.server.dir.join("store").display().to_string(),
            ]);
        self.server.spawn("nats", command)?;
        wait_answering("the private nats-server's JetStream", async || {
            let Ok(client) = self.connect().await else {
                return false;
            };
            matches!(
                tokio::time::timeout(
                    Duration::from_secs(2),
                    client.request("$JS.API.INFO", Bytes::new()),
                )
                .await,
                Ok(Ok(_))
            )
        })
        .await
    }

    async fn connect(&self) -> anyhow::Result<async_nats::Client> {
        Ok(tokio::time::timeout(
            Duration::from_secs(3),
            async_nats::ConnectOptions::new()
                .connection_timeout(Duration::from_secs(2))
                .connect(self.url()),
        )
        .await??)
    }

    /// Creates the work stream (and the seal's bucket) as `courier run
    /// --create` does, by opening courier's own source once: the producer
    /// needs the stream before courier's first start.
    pub(super) async fn create_stream(&self, queue: &str) -> anyhow::Result<()> {
        let url = courier::source::parse_url(&self.url()).map_err(anyhow::Error::msg)?;
        let mut options = courier::source::SourceOptions::new(queue);
        options.create = true;
        let source = courier::source::open(&url, options).await?;
        source.close().await;
        Ok(())
    }

    /// Whether the work stream holds nothing.
    pub(super) async fn settled(&self, queue: &str) -> bool {
        let Ok(client) = self.connect().await else {
            return false;
        };
        match jetstream::new(client).get_stream(queue).await {
            Ok(stream) => stream.cached_info().state.messages == 0,
            Err(_) => false,
        }
    }

    /// The ids of every message the work stream holds (in a header or the
    /// body), and the dead letters as `courier dlq list` reads them.
    pub(super) async fn holdings(&self, queue: &str) -> anyhow::Result<Holdings> {
        let client = self.connect().await?;
        let stream = jetstream::new(client).get_stream(queue).await?;
        let state = stream.cached_info().state.clone();
        let mut out = Holdings::default();
        let mut next = state.first_sequence;
        while state.messages > 0 && next <= state.last_sequence {
            let got = stream
                .raw_message_builder()
                .sequence(next)
                .next_by_subject(queue.to_string())
                .send()
                .await;
            let message = match got {
                Ok(m) => m,
                Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => break,
                Err(e) => return Err(e.into()),
            };
            next = message.sequence + 1;
            ids_in(&message.payload, &mut out.pending);
            for (_, values) in message.headers.iter() {
                for value in values {
                    ids_in(value.as_str().as_bytes(), &mut out.pending);
                }
            }
        }
        out.letters = admin_letters(&self.url(), queue).await?;
        Ok(out)
    }
}

/// Message `n` as a NATS publish: the body, and the fields as headers by
/// NATS's own rules. A header value is text without CR or LF, so bytes
/// that are not UTF-8 go as U+FFFD, as a client writing them from a string
/// sends them; a name NATS cannot carry is left out (none in the corpus
/// is). `Nats-Msg-Id` is the id, so a publish retried after a lost
/// acknowledgement is stored once.
fn publish_of(n: u64, kind: Option<Hostile>, max_body: usize) -> (Bytes, HeaderMap) {
    let mut fields = message(n, kind, max_body, true);
    let body = fields.remove(0).1;
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", id_of(n).as_str());
    for (name, value) in &fields {
        let name = HeaderName::from_str(&String::from_utf8_lossy(name));
        let value = HeaderValue::from_str(&String::from_utf8_lossy(value));
        if let (Ok(name), Ok(value)) = (name, value) {
            headers.append(name, value);
        }
    }
    (body, headers)
}

/// The producer: a publish to the work stream's subject at the rate, each
/// tried until the server acknowledged it (it may be stopped or dead).
pub(super) fn spawn_producer(
    url: String,
    queue: String,
    args: TortureArgs,
    produced: Arc<Mutex<Produced>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let Ok(client) = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connect(url)
            .await
        else {
            return;
        };
        let js = jetstream::ContextBuilder::new()
            .timeout(Duration::from_secs(5))
            .build(client);
        let period = Duration::from_secs_f64(1.0 / args.rate.max(0.1));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut n = 0u64;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            tick.tick().await;
            let kind = Hostile::of(args.seed, n, args.hostile);
            let (body, headers) = publish_of(n, kind, args.max_body);
            let give_up = Instant::now() + Duration::from_secs(60);
            loop {
                let publish = async {
                    js.publish_with_headers(queue.clone(), headers.clone(), body.clone())
                        .await?
                        .await
                };
                let error = match tokio::time::timeout(Duration::from_secs(6), publish).await {
                    Ok(Ok(_)) => {
                        produced.lock().unwrap().ids.push((n, kind));
                        break;
                    }
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => "no acknowledgement within 6 s".to_string(),
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
