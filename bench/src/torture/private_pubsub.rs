//! The torture run on Google Pub/Sub: Google's emulator of the harness's
//! own (the Cloud SDK's `cloud-pubsub-emulator`, as the project's tests
//! start it) on a free port, which this process and every courier it
//! starts reach through `PUBSUB_EMULATOR_HOST` ([`set_environment`]); the
//! producer (the plain gRPC `Publish`, each until the emulator answered
//! with a message id); and what the checker reads: every message of the
//! work subscription and of `<subscription>.retry`, where courier keeps
//! its retry copies (pulled, kept leased while the reading lasts, then
//! given back), and the dead letters through courier's own dead-letter
//! store.
//!
//! The emulator keeps everything in memory, so the nemesis never SIGKILLs
//! it; it SIGSTOPs the JVM. Counting a subscription without taking its
//! messages from courier needs snapshots, so the settle period ends when
//! the app has heard nothing for 10 s, as on the embedded queue.

use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::bail;
use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::{
    ModifyAckDeadlineRequest, PublishRequest, PubsubMessage, PullRequest,
    publisher_client::PublisherClient, subscriber_client::SubscriberClient,
};
use tonic::transport::Channel;

use super::{Holdings, Hostile, PrivateServer, Produced, TortureArgs, admin_letters, message};
use crate::torture_app::ids_in;

/// The project of the run's topics and subscriptions.
const PROJECT: &str = "courier-torture";

/// The emulator's launcher, as the Cloud SDK installs it; it execs java,
/// so the process group the nemesis stops is the JVM.
const EMULATOR: &str =
    "/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator";

/// Points this process (and so every courier it starts) at an emulator on
/// `port`. Called before any thread starts.
pub(crate) fn set_environment(port: u16) {
    // SAFETY: called from `main` before the runtime and its threads exist;
    // nothing reads the environment concurrently.
    unsafe {
        std::env::set_var("PUBSUB_EMULATOR_HOST", format!("127.0.0.1:{port}"));
    }
}

/// Pub/Sub takes at most this many attributes on a message
/// (cloud.google.com/pubsub/quotas; courier refuses more before it
/// publishes, though the emulator does not check).
const MAX_ATTRIBUTES: usize = 100;

/// The extra headers of the corpus's `headers-N` on Pub/Sub: with the
/// id's, 100 attributes, the most a producer can send. courier's retry
/// copies and dead letters of such a message carry its record beside them
/// in an envelope (`crates/pubsub/src/fields.rs`); before that they could
/// not be stored, and the harness sent 80 (finding 5 of
/// docs/reliability.md).
const EXTRA_ATTRIBUTES: usize = 99;
// With the id's attribute, at most what Pub/Sub takes.
const _: () = assert!(EXTRA_ATTRIBUTES < MAX_ATTRIBUTES);

/// The corpus as Pub/Sub takes it: at most 100 attributes. The 900 and
/// 2,000 extra headers are [`EXTRA_ATTRIBUTES`]. The kind is what was
/// sent, so the checker expects exactly that: delivered.
pub(super) fn adapt(kind: Hostile) -> Hostile {
    match kind {
        Hostile::ManyHeaders(n) => Hostile::ManyHeaders(n.min(EXTRA_ATTRIBUTES)),
        other => other,
    }
}

/// The emulator's JVM for a torture run, as the test suite starts it: a
/// small heap and the quick compiler only, which start in seconds.
pub(crate) const QUICK_START: &str = "-Xmx384m -XX:TieredStopAtLevel=1";

/// The emulator's JVM for the load runs: the full JIT and a heap for what
/// the runs hold in it. With [`QUICK_START`], drains of 100,000 messages
/// had the bare loop at 10,453 and 12,501 msg/s, and its third drain
/// unfinished after five minutes, the JVM at its 384 MiB; with these
/// options (and each drain's topics deleted after it) 15,252, 19,765 and
/// 19,552.
pub(crate) const FOR_LOAD: &str = "-Xmx2g";

pub(crate) struct PrivatePubSub {
    pub(crate) server: PrivateServer,
}

impl PrivatePubSub {
    pub(super) fn url(&self) -> String {
        format!("pubsub://{PROJECT}")
    }

    /// Starts the emulator (a JVM: seconds, more under a build) with these
    /// JVM options ([`QUICK_START`] or [`FOR_LOAD`]) and waits until its
    /// port answers.
    pub(crate) async fn start(&mut self, java_opts: &str) -> anyhow::Result<()> {
        let mut command = Command::new(EMULATOR);
        command
            .arg("--host=127.0.0.1")
            .arg(format!("--port={}", self.server.port))
            .env("JAVA_OPTS", java_opts);
        self.server.spawn("pubsub-emulator", command)?;
        let deadline = Instant::now() + Duration::from_secs(120);
        while std::net::TcpStream::connect(("127.0.0.1", self.server.port)).is_err() {
            if let Some(p) = self.server.process.as_mut()
                && let Some(status) = p.exited()
            {
                bail!("the Pub/Sub emulator exited ({status}): {}", p.log_tail(10));
            }
            if Instant::now() > deadline {
                bail!("the Pub/Sub emulator did not answer within 120 s ({EMULATOR})");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    pub(super) fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.server.port)
    }

    /// Creates the work topic and subscription (with a dead-letter policy,
    /// so that Pub/Sub counts deliveries), the retry topic and
    /// subscription, the dead letters' browsing subscription and the depth
    /// shadows, as `courier run --create` does, by opening courier's own
    /// source once: the producer needs the topic, and Pub/Sub keeps a
    /// message only for the subscriptions there when it is published.
    pub(super) async fn create(&self, queue: &str) -> anyhow::Result<()> {
        let url = courier::source::parse_url(&self.url()).map_err(anyhow::Error::msg)?;
        let mut options = courier::source::SourceOptions::new(queue);
        options.create = true;
        let source = courier::source::open(&url, options).await?;
        source.close().await;
        Ok(())
    }

    /// The ids of every message of the work and retry subscriptions, and
    /// the dead letters as `courier dlq list` reads them. courier is
    /// stopped by now, but what it had leased (at least 10 s, Pub/Sub's
    /// shortest deadline; held copies until their due time) comes back only
    /// when the lease ends: pulls go on until none has brought anything
    /// for 15 s. What is pulled stays leased meanwhile, so each message is
    /// read once, and is given back at the end.
    pub(super) async fn holdings(&self, queue: &str) -> anyhow::Result<Holdings> {
        let channel = Channel::from_shared(self.endpoint())?.connect().await?;
        let mut subscriber = SubscriberClient::new(channel);
        let mut out = Holdings::default();
        let names = [
            format!("projects/{PROJECT}/subscriptions/{queue}"),
            format!("projects/{PROJECT}/subscriptions/{queue}.retry"),
        ];
        let mut leased: HashMap<&str, Vec<String>> = HashMap::new();
        let mut last_news = Instant::now();
        let deadline = Instant::now() + Duration::from_secs(90);
        while last_news.elapsed() < Duration::from_secs(15) {
            if Instant::now() > deadline {
                bail!("the subscriptions of {queue} were still handing out messages after 90 s");
            }
            for name in &names {
                loop {
                    #[allow(deprecated)]
                    let request = PullRequest {
                        subscription: name.clone(),
                        return_immediately: true,
                        max_messages: 1000,
                    };
                    let got = subscriber
                        .pull(request)
                        .await?
                        .into_inner()
                        .received_messages;
                    if got.is_empty() {
                        break;
                    }
                    last_news = Instant::now();
                    let mut ack_ids = Vec::new();
                    for received in got {
                        if let Some(m) = &received.message {
                            ids_in(&m.data, &mut out.pending);
                            for value in m.attributes.values() {
                                ids_in(value.as_bytes(), &mut out.pending);
                            }
                        }
                        ack_ids.push(received.ack_id);
                    }
                    subscriber
                        .modify_ack_deadline(ModifyAckDeadlineRequest {
                            subscription: name.clone(),
                            ack_ids: ack_ids.clone(),
                            ack_deadline_seconds: 600,
                        })
                        .await?;
                    leased.entry(name.as_str()).or_default().extend(ack_ids);
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        for (name, ack_ids) in leased {
            for chunk in ack_ids.chunks(1000) {
                let _ = subscriber
                    .modify_ack_deadline(ModifyAckDeadlineRequest {
                        subscription: name.to_string(),
                        ack_ids: chunk.to_vec(),
                        ack_deadline_seconds: 0,
                    })
                    .await;
            }
        }
        out.letters = admin_letters(&self.url(), queue).await?;
        Ok(out)
    }
}

/// Message `n` as a Pub/Sub message, by Pub/Sub's rules: the body is the
/// data; every other field an attribute, a string (bytes that are not
/// UTF-8 go as U+FFFD, as a client writing them from a string sends them),
/// of at most 1024 bytes (the 60 KiB value is cut to that), under a key of
/// at most 256 bytes not starting with `goog` (none in the corpus does).
fn publish_of(n: u64, kind: Option<Hostile>, max_body: usize) -> PubsubMessage {
    let mut fields = message(n, kind, max_body, true);
    let data = fields.remove(0).1;
    let mut attributes = HashMap::new();
    for (name, value) in &fields {
        let name = String::from_utf8_lossy(name).into_owned();
        let mut value = String::from_utf8_lossy(value).into_owned();
        let mut end = value.len().min(courier::source::pubsub::MAX_VALUE_BYTES);
        while !value.is_char_boundary(end) {
            end -= 1;
        }
        value.truncate(end);
        if courier::source::pubsub::attribute_ok(&name, &value) {
            attributes.insert(name, value);
        }
    }
    PubsubMessage {
        data,
        attributes,
        ..PubsubMessage::default()
    }
}

/// The producer: a `Publish` to the work topic at the rate, each tried
/// until the emulator answered with the message's id (it may be stopped).
pub(super) fn spawn_producer(
    queue: String,
    args: TortureArgs,
    produced: Arc<Mutex<Produced>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    endpoint: String,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let Ok(endpoint) = Channel::from_shared(endpoint) else {
            return;
        };
        let channel = endpoint
            .connect_timeout(Duration::from_secs(3))
            .connect_lazy();
        let mut publisher = PublisherClient::new(channel);
        let topic = format!("projects/{PROJECT}/topics/{queue}");
        let period = Duration::from_secs_f64(1.0 / args.rate.max(0.1));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut n = 0u64;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            tick.tick().await;
            let kind = Hostile::of(args.seed, n, args.hostile).map(adapt);
            let message = publish_of(n, kind, args.max_body);
            let give_up = Instant::now() + Duration::from_secs(60);
            loop {
                let publish = publisher.publish(PublishRequest {
                    topic: topic.clone(),
                    messages: vec![message.clone()],
                });
                let error = match tokio::time::timeout(Duration::from_secs(10), publish).await {
                    Ok(Ok(answer)) if !answer.get_ref().message_ids.is_empty() => {
                        produced.lock().unwrap().ids.push((n, kind));
                        break;
                    }
                    Ok(Ok(_)) => "the emulator answered without a message id".to_string(),
                    Ok(Err(status)) => status.to_string(),
                    Err(_) => "no answer within 10 s".to_string(),
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
