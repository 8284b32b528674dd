//! `courier-bench torture`: a producer, courier, a random app and a nemesis
//! for N minutes, then a checker that accounts for every message id.
//!
//! - The producer writes ids `tqid-NNNNNNNN` (in a header and in the body)
//!   at `--rate`, a `--hostile` share of them from a hostile corpus
//!   ([`Hostile`]), with the broker's own client.
//! - courier is the built binary (`--courier`, default the `courier` beside
//!   this one), `courier run ... --policy-file`, restarted after each kill.
//! - The app ([`crate::torture_app`]) is a child process answering by a
//!   plan decided from the seed and the id, and logging what it saw.
//! - The nemesis SIGKILLs and restarts courier, SIGSTOPs and restarts the
//!   app, edits the policy, and for a broker the harness runs privately
//!   SIGSTOPs it, and SIGKILLs it too where it keeps its data on disk
//!   (Redis, NATS; not the in-memory Kafka mock, moto and the Pub/Sub
//!   emulator); a shared one (RabbitMQ) is never faulted.
//! - The checker (after a settle period in which the app answers 200 to all
//!   but the poisoned ids) reads the dead letters and what the broker still
//!   holds, and the app's log; see [`check`].
//!
//! Each broker's part (its server, producer and reader) is a module of its
//! own: `private_redis`, `private_nats`, `shared_rabbitmq`,
//! `embedded_queue`, `private_kafka`, `private_moto` (SQS),
//! `private_pubsub`; [`Broker`] dispatches to them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;

use crate::child::{Courier, Process};
use crate::torture_app::{self, ID_HEADER, Plan, Rng, Seen, id_of, ids_in};
use courier::model::{PAYLOAD, default_dead_letter_queue};
use courier::source::SourceOptions;
use private_kafka::PrivateKafka;
use private_moto::PrivateMoto;
use private_nats::PrivateNats;
use private_pubsub::PrivatePubSub;
use private_redis::PrivateRedis;

mod embedded_queue;
pub(crate) mod private_kafka;
pub(crate) mod private_moto;
mod private_nats;
pub(crate) mod private_pubsub;
mod private_redis;
mod shared_rabbitmq;

#[derive(Debug, Clone, clap::Args)]
pub struct TortureArgs {
    /// The broker: redis or nats (a private redis-server or `nats-server
    /// -js` the harness starts, kills and stops), rabbitmq (the shared
    /// node, never faulted), kafka, sqs or pubsub (a private `kafka-mock`,
    /// moto server or Pub/Sub emulator, stopped, never killed: they keep
    /// everything in memory), or embedded (courier's own
    /// queue; production happens while courier is down, since one process
    /// holds the file).
    #[arg(long)]
    pub broker: String,
    /// Minutes of traffic and faults, before the settle period.
    #[arg(long, default_value_t = 1.0)]
    pub minutes: f64,
    /// Seconds of traffic instead of --minutes.
    #[arg(long)]
    pub seconds: Option<f64>,
    /// Seed of the app's answers, the corpus and the nemesis.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Messages produced per second.
    #[arg(long, default_value_t = 20.0)]
    pub rate: f64,
    /// Share of the messages taken from the hostile corpus.
    #[arg(long, default_value_t = 0.1)]
    pub hostile: f64,
    /// Longest settle period, after the traffic stops and the app turns
    /// healthy (ends sooner once the broker holds nothing).
    #[arg(long, default_value_t = 90)]
    pub settle_secs: u64,
    /// courier's --max-body; the corpus has bodies just under and over it
    /// (on SQS at most 240 KiB, so that the one over it is a message SQS
    /// takes; on Kafka at most 32 KiB, so that the mock's partitions, 5 MiB
    /// each, keep every dead letter).
    #[arg(long, default_value_t = 256 * 1024)]
    pub max_body: usize,
    /// Seconds of each courier process's life before its RSS counts as the
    /// start (on Kafka at least 25).
    #[arg(long, default_value_t = 15)]
    pub warmup_secs: u64,
    /// A life shorter than warm-up plus this many seconds is reported, not judged.
    #[arg(long, default_value_t = 30)]
    pub rss_min_secs: u64,
    /// RabbitMQ: the `frame_max` courier asks for (`?frame_max=` in its
    /// --source) [default: courier's own].
    #[arg(long)]
    pub amqp_frame_max: Option<u32>,
    /// No faults: the producer, courier and the app only.
    #[arg(long)]
    pub no_nemesis: bool,
    /// The courier binary [default: `courier` beside this program].
    #[arg(long)]
    pub courier: Option<PathBuf>,
    /// Kafka: the `kafka-mock` binary [default: `kafka-mock`, else
    /// `courier-bench-kafka-mock`, beside this program].
    #[arg(long)]
    pub kafka_mock: Option<PathBuf>,
    /// Write the report as JSON here too.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Where logs and the embedded queue go [default: a new temporary directory, removed after a pass].
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
}

/// Where the broker cannot be counted, the settle period ends once the app
/// has heard nothing for this long: longer than any backoff and
/// Retry-After, and than a killed courier's messages take to come back
/// (its leases, 10 s on Pub/Sub, while the next courier looks at the retry
/// subscription every 10 s). At 10 s a message leased to a killed courier
/// came back after the period had ended, and was reported lost.
const QUIET: Duration = Duration::from_secs(20);

/// The brokers the torture run supports.
pub const BROKERS: [&str; 7] = [
    "redis", "nats", "rabbitmq", "embedded", "kafka", "sqs", "pubsub",
];

// === The hostile corpus ===

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hostile {
    /// This many extra headers.
    ManyHeaders(usize),
    /// One header of 60 KiB.
    HugeValue,
    /// A body 1 KiB under --max-body.
    NearMax,
    /// A body one byte over --max-body.
    OverMax,
    /// `courier-attempt: 99`, `courier-seal: x`, a forged message id, first
    /// attempt and delivery count.
    Forged,
    /// Bookkeeping fields that are not UTF-8 or not numbers, and a header
    /// value that is not UTF-8.
    Undecodable,
    /// A header named `Payload`.
    PayloadHeader,
    /// A structured CloudEvent with this many extension attributes.
    CloudEvent(usize),
}

impl Hostile {
    const ALL: [Hostile; 10] = [
        Hostile::ManyHeaders(900),
        Hostile::ManyHeaders(2000),
        Hostile::HugeValue,
        Hostile::NearMax,
        Hostile::OverMax,
        Hostile::Forged,
        Hostile::Undecodable,
        Hostile::PayloadHeader,
        Hostile::CloudEvent(40),
        Hostile::CloudEvent(1500),
    ];

    fn of(seed: u64, n: u64, share: f64) -> Option<Hostile> {
        let mut r = Rng::new(seed, n.wrapping_add(2 << 40));
        r.chance(share)
            .then(|| Hostile::ALL[r.below(Hostile::ALL.len() as u64) as usize])
    }

    /// Whether the contract makes it a dead letter, `undeliverable`, before
    /// the app sees it: more headers than courier's cap (1,000), a body
    /// over --max-body.
    fn undeliverable(self) -> bool {
        match self {
            Hostile::ManyHeaders(n) | Hostile::CloudEvent(n) => n > courier::forward::MAX_HEADERS,
            Hostile::OverMax => true,
            _ => false,
        }
    }

    fn name(self) -> String {
        match self {
            Hostile::ManyHeaders(n) => format!("headers-{n}"),
            Hostile::HugeValue => "huge-header-value".into(),
            Hostile::NearMax => "body-near-max".into(),
            Hostile::OverMax => "body-over-max".into(),
            Hostile::Forged => "forged-courier-fields".into(),
            Hostile::Undecodable => "undecodable-bookkeeping".into(),
            Hostile::PayloadHeader => "header-named-payload".into(),
            Hostile::CloudEvent(n) => format!("cloudevent-{n}-attributes"),
        }
    }
}

fn b(s: impl Into<Vec<u8>>) -> Bytes {
    Bytes::from(s.into())
}

/// The fields of message `n` (`payload` is the body), as every broker's
/// producer writes them. `headers_apart`: the broker carries headers apart
/// from the body (not Redis, whose fields are the message), so the corpus's
/// header named `payload` is spelt exactly so.
fn message(
    n: u64,
    hostile: Option<Hostile>,
    max_body: usize,
    headers_apart: bool,
) -> Vec<(Bytes, Bytes)> {
    let id = id_of(n);
    let padded = |size: usize| {
        let head = format!("{{\"id\":\"{id}\",\"pad\":\"");
        let mut body = head.into_bytes();
        body.resize(size.saturating_sub(2).max(body.len()), b'x');
        body.extend_from_slice(b"\"}");
        Bytes::from(body)
    };
    let mut body = b(format!("{{\"id\":\"{id}\"}}"));
    let mut fields = vec![(b(ID_HEADER), b(id.clone()))];
    match hostile {
        None => {}
        Some(Hostile::ManyHeaders(k)) => {
            fields.extend((0..k).map(|i| (b(format!("x-h{i}")), b(format!("v{i}")))));
        }
        Some(Hostile::HugeValue) => fields.push((b("x-huge"), b(vec![b'h'; 60 * 1024]))),
        Some(Hostile::NearMax) => body = padded(max_body - 1024),
        Some(Hostile::OverMax) => body = padded(max_body + 1),
        Some(Hostile::Forged) => fields.extend([
            (b("courier-attempt"), b("99")),
            (b("courier-seal"), b("x")),
            (b("courier-message-id"), b(format!("forged-{n}"))),
            (b("courier-first-attempt-at"), b("1999-01-01T00:00:00Z")),
            (b("courier-deliveries"), b("999")),
            (b("courier-reason"), b("permanent-status")),
        ]),
        Some(Hostile::Undecodable) => fields.extend([
            (
                b("courier-attempt"),
                Bytes::from_static(&[0xff, 0xfe, 0x00]),
            ),
            (
                b("courier-first-attempt-at"),
                Bytes::from_static(b"\xffnot a date"),
            ),
            (b("courier-deliveries"), b("-1")),
            (
                b("courier-seal"),
                Bytes::from_static(&[0x00, 0xff, 0x80, 0x7f]),
            ),
            (b("x-binary"), Bytes::from_static(&[0xff, 0xfe, 0xfd])),
        ]),
        Some(Hostile::PayloadHeader) => fields.push((
            b(if headers_apart { "payload" } else { "Payload" }),
            b("not the body"),
        )),
        Some(Hostile::CloudEvent(k)) => {
            let mut event = serde_json::json!({
                "specversion": "1.0",
                "id": id,
                "source": "/courier-bench/torture",
                "type": "dev.courier.torture",
                "datacontenttype": "application/json",
                "data": {"id": id},
            });
            for i in 0..k {
                event[format!("ext{i}")] = serde_json::Value::from(format!("v{i}"));
            }
            body = b(event.to_string());
            fields.push((b("content-type"), b("application/cloudevents+json")));
        }
    }
    fields.insert(0, (Bytes::from_static(PAYLOAD.as_bytes()), body));
    fields
}

// === The brokers ===

/// A dead letter as the checker reads it.
#[derive(Debug, Clone)]
struct Letter {
    ids: Vec<u64>,
    reason: String,
    status: String,
    error: String,
    attempts: String,
}

impl Letter {
    fn of(fields: &[(Bytes, Bytes)]) -> Self {
        let get = |name: &str| {
            fields
                .iter()
                .rev()
                .find(|(n, _)| n.as_ref() == name.as_bytes())
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default()
        };
        let mut ids = Vec::new();
        if let Some((_, v)) = fields
            .iter()
            .find(|(n, _)| n.as_ref() == ID_HEADER.as_bytes())
        {
            ids_in(v, &mut ids);
        }
        if ids.is_empty() {
            for (_, v) in fields {
                ids_in(v, &mut ids);
            }
        }
        ids.sort_unstable();
        ids.dedup();
        Letter {
            ids,
            reason: get("courier-reason"),
            status: get("courier-status"),
            error: get("courier-error"),
            attempts: get("courier-attempts"),
        }
    }
}

/// What the broker holds at the end: the dead letters, and the ids of
/// messages not settled (unread, in flight, scheduled for a retry).
#[derive(Debug, Default)]
struct Holdings {
    letters: Vec<Letter>,
    pending: HashSet<u64>,
    /// What the broker lost on its own (the Kafka mock drops the oldest
    /// records past 5 MiB a partition): each a failure of the run, since
    /// the ids it held cannot be accounted for, with the figures.
    discrepancies: Vec<String>,
}

/// The dead letters of `queue` (its default dead-letter queue, which the
/// run's policy keeps), read through courier's own dead-letter store: what
/// `courier dlq list` shows, the same code on every broker.
async fn admin_letters(url: &str, queue: &str) -> anyhow::Result<Vec<Letter>> {
    let source_url = courier::source::parse_url(url).map_err(anyhow::Error::msg)?;
    let store = courier::source::open_admin(&source_url, SourceOptions::new(queue)).await?;
    let letters = store
        .dead_letters(&default_dead_letter_queue(queue), usize::MAX)
        .await?;
    Ok(letters
        .iter()
        .map(|l| {
            let mut fields = vec![(Bytes::from_static(PAYLOAD.as_bytes()), l.body.clone())];
            fields.extend(
                l.fields
                    .iter()
                    .map(|(n, v)| (b(n.as_bytes()), b(v.as_bytes()))),
            );
            Letter::of(&fields)
        })
        .collect())
}

/// One broker's part of the run; each variant's code is in its module.
enum Broker {
    Redis(PrivateRedis),
    Nats(PrivateNats),
    /// The shared node: the queue's name and courier's `frame_max`.
    RabbitMq(String, Option<u32>),
    Embedded(PathBuf),
    Kafka(PrivateKafka),
    Sqs(PrivateMoto),
    PubSub(PrivatePubSub),
}

impl Broker {
    /// The broker `name` (one of [`BROKERS`]), started when the harness runs
    /// it, with the work queue made ready for the producer.
    /// `port`: the one chosen for the broker before the runtime started,
    /// where its address had to be in the environment ([`main`]).
    async fn start(
        args: &TortureArgs,
        dir: &Path,
        queue: &str,
        port: Option<u16>,
    ) -> anyhow::Result<Self> {
        let name = args.broker.as_str();
        Ok(match name {
            "redis" => {
                let mut r = PrivateRedis {
                    server: PrivateServer::new(dir.join("redis"))?,
                };
                r.start().await?;
                Broker::Redis(r)
            }
            "nats" => {
                let mut n = PrivateNats {
                    server: PrivateServer::new(dir.join("nats"))?,
                };
                n.start().await?;
                n.create_stream(queue).await?;
                Broker::Nats(n)
            }
            "rabbitmq" => {
                shared_rabbitmq::create_queue(queue).await?;
                Broker::RabbitMq(queue.to_string(), args.amqp_frame_max)
            }
            "kafka" => {
                let mut k = PrivateKafka::new(
                    PrivateServer::new(dir.join("kafka"))?,
                    beside_this(
                        args.kafka_mock.as_deref(),
                        &["kafka-mock", "courier-bench-kafka-mock"],
                    )?,
                );
                k.start().await?;
                k.create_topics(queue).await?;
                Broker::Kafka(k)
            }
            "sqs" => {
                let mut server = PrivateServer::new(dir.join("moto"))?;
                server.port = port.context("no port for moto")?;
                let mut m = PrivateMoto { server };
                m.start().await?;
                m.create_queue(queue).await?;
                Broker::Sqs(m)
            }
            "pubsub" => {
                let mut server = PrivateServer::new(dir.join("pubsub"))?;
                server.port = port.context("no port for the Pub/Sub emulator")?;
                let mut p = PrivatePubSub { server };
                p.start(private_pubsub::QUICK_START).await?;
                p.create(queue).await?;
                Broker::PubSub(p)
            }
            _ => Broker::Embedded(dir.join("queue")),
        })
    }

    fn source(&self) -> String {
        match self {
            Broker::Redis(r) => r.url(),
            Broker::Nats(n) => n.url(),
            Broker::RabbitMq(_, frame_max) => match frame_max {
                Some(bytes) => format!("{}?frame_max={bytes}", shared_rabbitmq::url()),
                None => shared_rabbitmq::url(),
            },
            Broker::Embedded(dir) => format!("embedded:{}", dir.display()),
            Broker::Kafka(k) => k.url(),
            Broker::Sqs(m) => m.url(),
            Broker::PubSub(p) => p.url(),
        }
    }

    /// Whether courier must be down for the harness to write or read (one
    /// process holds the embedded queue's file).
    fn exclusive(&self) -> bool {
        matches!(self, Broker::Embedded(_))
    }

    /// Whether the harness can tell that the broker holds nothing
    /// unsettled while courier runs; where it cannot (the embedded queue's
    /// file is courier's; counting a Pub/Sub subscription without taking
    /// its messages from courier needs snapshots), the settle period ends
    /// once the app has heard nothing for [`QUIET`].
    fn countable(&self) -> bool {
        !matches!(self, Broker::Embedded(_) | Broker::PubSub(_))
    }

    /// The broker's server, when the harness runs its own: the nemesis
    /// stops and kills it.
    fn server(&mut self) -> Option<&mut Process> {
        match self {
            Broker::Redis(r) => r.server.process.as_mut(),
            Broker::Nats(n) => n.server.process.as_mut(),
            Broker::Kafka(k) => k.server.process.as_mut(),
            Broker::Sqs(m) => m.server.process.as_mut(),
            Broker::PubSub(p) => p.server.process.as_mut(),
            Broker::RabbitMq(..) | Broker::Embedded(_) => None,
        }
    }

    /// Whether the nemesis may SIGKILL the server: not where the broker
    /// keeps its messages in memory only (the Kafka mock, moto, the Pub/Sub
    /// emulator), where a kill
    /// loses them all by design and says nothing about courier.
    fn killable(&self) -> bool {
        matches!(self, Broker::Redis(_) | Broker::Nats(_))
    }

    /// Starts the server again after a SIGKILL, on its port and files.
    async fn restart(&mut self) -> anyhow::Result<()> {
        match self {
            Broker::Redis(r) => r.start().await,
            Broker::Nats(n) => n.start().await,
            Broker::RabbitMq(..)
            | Broker::Embedded(_)
            | Broker::Kafka(_)
            | Broker::Sqs(_)
            | Broker::PubSub(_) => Ok(()),
        }
    }

    /// The producer task at `--rate`; none for the embedded queue, written
    /// while courier is down ([`Run::produce_embedded`]).
    fn spawn_producer(
        &self,
        queue: &str,
        args: &TortureArgs,
        produced: &Arc<Mutex<Produced>>,
        stop: &Arc<std::sync::atomic::AtomicBool>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let (queue, args, produced, stop) = (
            queue.to_string(),
            args.clone(),
            produced.clone(),
            stop.clone(),
        );
        match self {
            Broker::Redis(r) => Some(private_redis::spawn_producer(
                r.url(),
                queue,
                args,
                produced,
                stop,
            )),
            Broker::Nats(n) => Some(private_nats::spawn_producer(
                n.url(),
                queue,
                args,
                produced,
                stop,
            )),
            Broker::RabbitMq(..) => {
                Some(shared_rabbitmq::spawn_producer(queue, args, produced, stop))
            }
            Broker::Kafka(k) => Some(private_kafka::spawn_producer(
                k.bootstrap().to_string(),
                queue,
                args,
                produced,
                stop,
            )),
            Broker::Sqs(m) => Some(private_moto::spawn_producer(
                queue,
                args,
                produced,
                stop,
                m.endpoint(),
            )),
            Broker::PubSub(p) => Some(private_pubsub::spawn_producer(
                queue,
                args,
                produced,
                stop,
                p.endpoint(),
            )),
            Broker::Embedded(_) => None,
        }
    }

    async fn holdings(&self, queue: &str) -> anyhow::Result<Holdings> {
        match self {
            Broker::Redis(r) => private_redis::holdings(r, queue).await,
            Broker::Nats(n) => n.holdings(queue).await,
            Broker::RabbitMq(..) => shared_rabbitmq::holdings(queue, &self.source()).await,
            Broker::Embedded(dir) => {
                let (dir, queue) = (dir.clone(), queue.to_string());
                tokio::task::spawn_blocking(move || embedded_queue::holdings(&dir, &queue)).await?
            }
            Broker::Kafka(k) => k.holdings(queue).await,
            Broker::Sqs(m) => m.holdings(queue).await,
            Broker::PubSub(p) => p.holdings(queue).await,
        }
    }

    /// Whether the broker holds nothing unsettled any more (the settle
    /// period ends early); for a broker not [`Broker::countable`], the
    /// settle loop judges by the app's log instead.
    async fn settled(&self, queue: &str) -> bool {
        match self {
            Broker::Redis(_) => self
                .holdings(queue)
                .await
                .is_ok_and(|h| h.pending.is_empty()),
            Broker::Nats(n) => n.settled(queue).await,
            Broker::RabbitMq(..) => shared_rabbitmq::settled(queue).await,
            Broker::Kafka(k) => k.settled(queue).await,
            Broker::Sqs(m) => m.settled(queue).await,
            Broker::Embedded(_) | Broker::PubSub(_) => false,
        }
    }

    /// After the check: the harness's own server goes, and the run's queues
    /// on a shared one.
    async fn finish(&mut self) {
        if let Some(p) = self.server() {
            p.kill9();
        }
        if let Broker::RabbitMq(queue, _) = self
            && let Err(e) = shared_rabbitmq::cleanup(queue).await
        {
            eprintln!("torture: the queues of {queue} were not all deleted: {e:#}");
        }
    }
}

const GROUP: &str = "torture";

// === The run ===

/// What the producer wrote: ids and their hostile kind.
#[derive(Default)]
struct Produced {
    ids: Vec<(u64, Option<Hostile>)>,
    /// Writes that failed and were tried again (the broker was down).
    write_retries: u64,
    /// Messages the producer's client refused (not counted as produced).
    refused: Vec<String>,
}

impl Produced {
    /// Message `n` was refused for good: noted, not produced.
    fn refuse(&mut self, n: u64, kind: Option<Hostile>, error: impl std::fmt::Display) {
        self.refused.push(format!(
            "{} ({:?}): {error}",
            id_of(n),
            kind.map(Hostile::name)
        ));
    }

    /// A write of message `n` failed: counted as retried, and past
    /// `give_up` refused; returns whether the producer moves on.
    fn write_failed(
        &mut self,
        n: u64,
        kind: Option<Hostile>,
        error: impl std::fmt::Display,
        give_up: Instant,
    ) -> bool {
        self.write_retries += 1;
        let past = Instant::now() > give_up;
        if past {
            self.refuse(n, kind, error);
        }
        past
    }
}

/// One courier process's life: its RSS samples, seconds since it started.
struct Life {
    pid: u32,
    started: Instant,
    samples: Vec<(f64, u64)>,
    log: PathBuf,
    ended_by: &'static str,
}

#[derive(Debug, Clone)]
struct LifeReport {
    pid: u32,
    secs: f64,
    start_kib: u64,
    end_kib: u64,
    judged: bool,
    over: bool,
    ended_by: &'static str,
    panics: usize,
    errors: usize,
}

struct Run {
    args: TortureArgs,
    dir: PathBuf,
    queue: String,
    courier_bin: PathBuf,
    /// This program, for the app child.
    app_bin: PathBuf,
    broker: Broker,
    app_port: u16,
    app: Option<Process>,
    app_starts: u32,
    courier: Option<Courier>,
    life: Option<Life>,
    lives: Vec<LifeReport>,
    policy: PathBuf,
    policy_edits: u32,
    faults: BTreeMap<&'static str, u32>,
    unplanned_exits: Vec<String>,
    produced: Arc<Mutex<Produced>>,
    /// Embedded: ids due to be written at the next courier-down window.
    next_n: u64,
}

/// A broker process of the harness's own: on a free port, with its files
/// in `dir`; the nemesis stops and kills `process`. Start `n` logs to
/// `<name>-<n>.log` in `dir`.
pub(crate) struct PrivateServer {
    pub(crate) port: u16,
    pub(super) dir: PathBuf,
    pub(crate) process: Option<Process>,
    starts: u32,
}

impl PrivateServer {
    pub(crate) fn new(dir: PathBuf) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&dir)?;
        Ok(Self {
            port: free_port(),
            dir,
            process: None,
            starts: 0,
        })
    }

    /// Starts `command` (the server on this port and these files).
    pub(super) fn spawn(&mut self, name: &str, command: Command) -> anyhow::Result<()> {
        self.starts += 1;
        let log = self.dir.join(format!("{name}-{}.log", self.starts));
        self.process =
            Some(Process::spawn(command, &log).with_context(|| format!("start {name}-server"))?);
        Ok(())
    }
}

/// Waits until `answers` says the server `what` answers, trying every
/// 50 ms for 30 s.
pub(super) async fn wait_answering(
    what: &str,
    mut answers: impl AsyncFnMut() -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !answers().await {
        if Instant::now() > deadline {
            bail!("{what} did not answer within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

impl Run {
    fn write_policy(&mut self, max_attempts: u64, timeout_ms: u64) -> anyhow::Result<()> {
        let text = format!(
            "apiVersion: courier.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: torture\nspec:\n  \
             maxAttempts: {max_attempts}\n  timeout: {timeout_ms}ms\n  backoff:\n    initial: 100ms\n    \
             max: 2s\n    multiplier: 2\n    jitter: full\n  retryAfter:\n    honor: true\n    max: 2s\n"
        );
        // Replaced by a rename, as a ConfigMap's volume is.
        let tmp = self.dir.join("policy.yaml.new");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &self.policy)?;
        Ok(())
    }

    fn start_app(&mut self, settle: bool) -> anyhow::Result<()> {
        self.app_starts += 1;
        let mut command = Command::new(&self.app_bin);
        command
            .arg("torture-app")
            .args(["--port", &self.app_port.to_string()])
            .args(["--seed", &self.args.seed.to_string()])
            .arg("--log")
            .arg(self.dir.join("app-deliveries.log"))
            .args(["--slow-ms", "4000"]);
        if settle {
            command.arg("--settle");
        }
        let log = self.dir.join(format!("app-{}.log", self.app_starts));
        self.app = Some(Process::spawn(command, &log)?);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.app_port)).is_err() {
            if Instant::now() > deadline {
                bail!("the torture app did not listen within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    fn start_courier(&mut self) -> anyhow::Result<()> {
        let n = self.lives.len() + 1;
        let log = self.dir.join(format!("courier-{n}.log"));
        let args: Vec<String> = [
            "--source",
            &self.broker.source(),
            "--queue",
            &self.queue,
            "--group",
            GROUP,
            "--consumer",
            "torture",
            "--app",
            &format!("http://127.0.0.1:{}/", self.app_port),
            "--policy-file",
            &self.policy.display().to_string(),
            "--max-body",
            &self.args.max_body.to_string(),
            "--visibility-timeout",
            "6s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let courier =
            tokio::task::block_in_place(|| Courier::start(&self.courier_bin, &args, &log))?;
        self.life = Some(Life {
            pid: courier.process.pid,
            started: Instant::now(),
            samples: Vec::new(),
            log,
            ended_by: "",
        });
        self.courier = Some(courier);
        self.sample();
        Ok(())
    }

    fn sample(&mut self) {
        if let (Some(courier), Some(life)) = (&self.courier, &mut self.life) {
            let rss = courier.usage().rss_kib;
            if rss > 0 {
                life.samples
                    .push((life.started.elapsed().as_secs_f64(), rss));
            }
        }
    }

    /// Ends courier's life: SIGKILL, or SIGTERM (`graceful`).
    fn stop_courier(&mut self, graceful: bool) {
        self.sample();
        if let Some(mut courier) = self.courier.take() {
            if graceful {
                courier.process.stop(Duration::from_secs(30));
            } else {
                courier.process.kill9();
            }
        }
        if let Some(mut life) = self.life.take() {
            if life.ended_by.is_empty() {
                life.ended_by = if graceful { "SIGTERM" } else { "SIGKILL" };
            }
            self.lives.push(self.report_life(life));
        }
    }

    fn report_life(&self, life: Life) -> LifeReport {
        let warm = self.args.warmup_secs as f64;
        let secs = life.started.elapsed().as_secs_f64();
        let start = life
            .samples
            .iter()
            .find(|(t, _)| *t >= warm)
            .or(life.samples.first())
            .map_or(0, |s| s.1);
        let end = life.samples.last().map_or(0, |s| s.1);
        let judged = secs >= warm + self.args.rss_min_secs as f64 && start > 0;
        let text = std::fs::read_to_string(&life.log).unwrap_or_default();
        LifeReport {
            pid: life.pid,
            secs,
            start_kib: start,
            end_kib: end,
            judged,
            over: judged && end * 10 > start * 11,
            ended_by: life.ended_by,
            panics: text.lines().filter(|l| l.contains("panicked")).count(),
            errors: text.lines().filter(|l| l.contains("\"ERROR\"")).count(),
        }
    }

    /// A line of `nemesis.log`: when (Unix seconds) the fault began, and
    /// for how long, so a finding can be laid beside courier's log.
    fn log_fault(&self, name: &str, until: Option<Instant>) {
        use std::io::Write as _;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let secs = until.map_or(0.0, |at| (at - Instant::now()).as_secs_f64());
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("nemesis.log"))
        {
            let _ = writeln!(f, "{now:.3}\t{name}\t{secs:.1} s");
        }
    }

    /// Restarts courier if it exited on its own (a crash is a finding).
    fn watch_courier(&mut self) -> anyhow::Result<()> {
        let exited = self.courier.as_mut().and_then(|c| c.process.exited());
        if let Some(status) = exited {
            let tail = self
                .courier
                .as_ref()
                .map(|c| c.process.log_tail(5))
                .unwrap_or_default();
            self.unplanned_exits
                .push(format!("courier exited on its own ({status}): {tail}"));
            if let Some(life) = &mut self.life {
                life.ended_by = "exited on its own";
            }
            self.stop_courier(false);
            self.start_courier()?;
        }
        Ok(())
    }
}

/// A fault in progress, undone at its time.
enum Undo {
    CourierStart,
    AppCont,
    AppStart,
    BrokerCont,
    BrokerStart,
}

pub fn main(mut args: TortureArgs) -> anyhow::Result<bool> {
    if !BROKERS.contains(&args.broker.as_str()) {
        bail!(
            "--broker {:?}: the torture run supports {}",
            args.broker,
            BROKERS.join(", ")
        );
    }
    // courier and the clients find moto and the Pub/Sub emulator only
    // through the environment, which is set here, before the runtime's
    // threads exist.
    let port = match args.broker.as_str() {
        "sqs" => {
            let port = free_port();
            private_moto::set_environment(port);
            if args.max_body > private_moto::SQS_MAX_BODY {
                eprintln!(
                    "torture: --max-body {} is {} on SQS, so that the corpus's body one byte over it is still a message SQS takes",
                    args.max_body,
                    private_moto::SQS_MAX_BODY
                );
                args.max_body = private_moto::SQS_MAX_BODY;
            }
            Some(port)
        }
        "pubsub" => {
            let port = free_port();
            private_pubsub::set_environment(port);
            Some(port)
        }
        "kafka" => {
            if args.max_body > private_kafka::KAFKA_MAX_BODY {
                eprintln!(
                    "torture: --max-body {} is {} on Kafka, so that the mock's partitions (5 MiB each) hold 10 minutes of dead letters",
                    args.max_body,
                    private_kafka::KAFKA_MAX_BODY
                );
                args.max_body = private_kafka::KAFKA_MAX_BODY;
            }
            if args.warmup_secs < private_kafka::KAFKA_WARMUP_SECS {
                eprintln!(
                    "torture: --warmup-secs {} is {} on Kafka, where a restarted courier waits for the group's rebalance",
                    args.warmup_secs,
                    private_kafka::KAFKA_WARMUP_SECS
                );
                args.warmup_secs = private_kafka::KAFKA_WARMUP_SECS;
            }
            None
        }
        _ => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(run(args, port))
}

async fn run(args: TortureArgs, port: Option<u16>) -> anyhow::Result<bool> {
    let (dir, temporary) = match &args.work_dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!(
                "courier-torture-{}-{}",
                args.broker,
                std::process::id()
            )),
            true,
        ),
    };
    std::fs::create_dir_all(&dir)?;
    let courier_bin = match &args.courier {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("no directory")?
            .join("courier"),
    };
    if !courier_bin.exists() {
        bail!(
            "no courier binary at {} (cargo build --bin courier, or --courier PATH)",
            courier_bin.display()
        );
    }
    // Both binaries are restarted for the whole run: a cargo build meanwhile
    // replaces them (and the one running is then "(deleted)"), so the run
    // keeps its own link to each.
    let courier_bin = keep(&courier_bin, &dir.join("courier"))?;
    let app_bin = keep(&std::env::current_exe()?, &dir.join("courier-bench"))?;
    let queue = format!("courier-torture-{}-{}", std::process::id(), args.seed);
    let broker = Broker::start(&args, &dir, &queue, port).await?;
    let traffic = Duration::from_secs_f64(args.seconds.unwrap_or(args.minutes * 60.0).max(1.0));
    eprintln!(
        "torture: {} for {:.0} s at {} msg/s (seed {}), then up to {} s to settle; logs in {}",
        args.broker,
        traffic.as_secs_f64(),
        args.rate,
        args.seed,
        args.settle_secs,
        dir.display()
    );
    let mut run = Run {
        policy: dir.join("policy.yaml"),
        dir: dir.clone(),
        queue: queue.clone(),
        courier_bin,
        app_bin,
        broker,
        app_port: free_port(),
        app: None,
        app_starts: 0,
        courier: None,
        life: None,
        lives: Vec::new(),
        policy_edits: 0,
        faults: BTreeMap::new(),
        unplanned_exits: Vec::new(),
        produced: Arc::new(Mutex::new(Produced::default())),
        next_n: 0,
        args: args.clone(),
    };
    run.write_policy(5, 1000)?;
    run.start_app(false)?;
    let started = Instant::now();
    let end = started + traffic;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let producer = run
        .broker
        .spawn_producer(&queue, &args, &run.produced, &stop);
    if producer.is_none() {
        run.produce_embedded(started - Duration::from_secs(2), started)
            .await?;
    }
    run.start_courier()?;

    // The traffic, and the nemesis.
    let mut rng = Rng::new(args.seed, 7);
    let gap = |rng: &mut Rng, exclusive: bool| {
        Duration::from_millis(if exclusive {
            rng.range(3_000, 8_000)
        } else {
            rng.range(5_000, 15_000)
        })
    };
    let mut next_fault = Instant::now() + gap(&mut rng, run.broker.exclusive());
    let mut undo: Option<(Instant, Undo)> = None;
    let mut last_sample = Instant::now();
    let produce_start = started - Duration::from_secs(2);
    while Instant::now() < end || undo.is_some() {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if last_sample.elapsed() >= Duration::from_secs(1) {
            run.sample();
            last_sample = Instant::now();
        }
        if let Some((at, _)) = &undo
            && Instant::now() >= *at
        {
            let (_, what) = undo.take().unwrap();
            match what {
                Undo::CourierStart => {
                    run.produce_embedded(produce_start, end).await?;
                    run.start_courier()?;
                }
                Undo::AppCont => run.app.as_ref().unwrap().signal("CONT"),
                Undo::AppStart => run.start_app(false)?,
                Undo::BrokerCont => {
                    if let Some(p) = run.broker.server() {
                        p.signal("CONT");
                    }
                }
                Undo::BrokerStart => run.broker.restart().await?,
            }
        }
        if undo.is_none() {
            run.watch_courier()?;
        }
        if args.no_nemesis || undo.is_some() || Instant::now() < next_fault || Instant::now() >= end
        {
            continue;
        }
        let exclusive = run.broker.exclusive();
        let broker_faults = run.broker.server().is_some();
        let broker_kills = run.broker.killable();
        next_fault = Instant::now() + gap(&mut rng, exclusive);
        let roll = rng.below(100);
        let ms = |rng: &mut Rng, lo, hi| Instant::now() + Duration::from_millis(rng.range(lo, hi));
        // A shared broker is never faulted: its share goes to courier.
        let roll = if !exclusive && !broker_faults && (60..80).contains(&roll) {
            roll - 60
        } else if !exclusive && !broker_kills && (70..80).contains(&roll) {
            // A broker that keeps its messages in memory only is stopped
            // instead of killed.
            roll - 10
        } else {
            roll
        };
        let (name, next) = match (exclusive, roll) {
            (true, 0..45) | (false, 0..25) => {
                run.stop_courier(false);
                (
                    "courier SIGKILL",
                    Some((ms(&mut rng, 300, 2_000), Undo::CourierStart)),
                )
            }
            (true, 45..65) | (false, 25..45) => {
                run.app.as_ref().unwrap().signal("STOP");
                (
                    "app SIGSTOP",
                    Some((ms(&mut rng, 500, 2_500), Undo::AppCont)),
                )
            }
            (true, 65..80) | (false, 45..60) => {
                run.app.as_mut().unwrap().kill9();
                (
                    "app SIGKILL",
                    Some((ms(&mut rng, 200, 1_500), Undo::AppStart)),
                )
            }
            (false, 60..70) => {
                if let Some(p) = run.broker.server() {
                    p.signal("STOP");
                }
                (
                    "broker SIGSTOP",
                    Some((ms(&mut rng, 1_000, 4_000), Undo::BrokerCont)),
                )
            }
            (false, 70..80) => {
                if let Some(p) = run.broker.server() {
                    p.kill9();
                }
                (
                    "broker SIGKILL",
                    Some((ms(&mut rng, 500, 2_000), Undo::BrokerStart)),
                )
            }
            _ => {
                let attempts = [4, 5, 6, 8][rng.below(4) as usize];
                let timeout = [800, 1200, 2000][rng.below(3) as usize];
                run.write_policy(attempts, timeout)?;
                run.policy_edits += 1;
                ("policy edit", None)
            }
        };
        *run.faults.entry(name).or_default() += 1;
        run.log_fault(name, next.as_ref().map(|(at, _)| *at));
        undo = next;
    }

    // Settle: the traffic stops, the app answers 200 to all but the poisoned.
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    if let Some(p) = producer {
        let _ = p.await;
    }
    if run.broker.exclusive() {
        run.stop_courier(false);
        run.produce_embedded(produce_start, end).await?;
        run.start_courier()?;
    }
    if let Some(app) = &mut run.app {
        app.kill9();
    }
    run.start_app(true)?;
    run.watch_courier()?;
    let settle_start = Instant::now();
    let settle_end = settle_start + Duration::from_secs(args.settle_secs);
    let app_log = dir.join("app-deliveries.log");
    let mut quiet_since = (Instant::now(), file_len(&app_log));
    let mut settled_once = false;
    eprintln!(
        "torture: traffic over ({} produced); settling...",
        run.produced.lock().unwrap().ids.len()
    );
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        run.sample();
        run.watch_courier()?;
        if Instant::now() >= settle_end {
            break;
        }
        if !run.broker.countable() {
            let len = file_len(&app_log);
            if len != quiet_since.1 {
                quiet_since = (Instant::now(), len);
            } else if quiet_since.0.elapsed() >= QUIET {
                break;
            }
        } else if run.broker.settled(&queue).await {
            // Twice in a row, a second apart: one reading is several
            // commands, and a retry the mover took from the retry set to
            // the stream between two of them is in neither (seen once on
            // Redis at two test binaries at a time: a message stuck after
            // a 3 s settle). A second later it is pending or due again.
            if settled_once {
                break;
            }
            settled_once = true;
        } else {
            settled_once = false;
        }
    }
    let settle_secs = settle_start.elapsed().as_secs_f64();
    run.stop_courier(true);
    // Bounded: a reader that hangs is an error of the run, not a wait forever.
    // 300 s: moto answers a receive of 10 in milliseconds when idle, but
    // scans the whole queue for each, and after a 10-minute SQS run under
    // load 120 s were not enough for the queue and its dead letters.
    let holdings = match tokio::time::timeout(Duration::from_secs(300), run.broker.holdings(&queue))
        .await
        .context("reading what the broker holds took over 300 s")
    {
        Ok(Ok(h)) => h,
        Ok(Err(e)) | Err(e) => {
            run.broker.finish().await;
            return Err(e);
        }
    };
    if let Some(app) = &mut run.app {
        app.kill9();
    }
    let seen = torture_app::read_log(&app_log);
    let produced = std::mem::take(&mut *run.produced.lock().unwrap());
    let report = check(
        &args,
        &produced,
        &seen,
        &holdings,
        &run,
        settle_secs,
        traffic,
    );
    print!("{}", report.text);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report.json)?)?;
    }
    run.broker.finish().await;
    if report.passed && temporary {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("torture: logs kept in {}", dir.display());
    }
    Ok(report.passed)
}

/// `given`, or the first of `names` beside this program.
pub(crate) fn beside_this(given: Option<&Path>, names: &[&str]) -> anyhow::Result<PathBuf> {
    if let Some(path) = given {
        return Ok(path.to_path_buf());
    }
    let exe = std::env::current_exe()?;
    let here = exe.parent().context("no directory")?;
    names
        .iter()
        .map(|n| here.join(n))
        .find(|p| p.exists())
        .with_context(|| format!("none of {} beside {}", names.join(", "), exe.display()))
}

/// A hard link to `binary` at `to` (a copy across file systems).
fn keep(binary: &Path, to: &Path) -> anyhow::Result<PathBuf> {
    let _ = std::fs::remove_file(to);
    if std::fs::hard_link(binary, to).is_err() {
        std::fs::copy(binary, to).with_context(|| format!("cannot copy {}", binary.display()))?;
    }
    Ok(to.to_path_buf())
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

// === The checker ===

struct Report {
    text: String,
    json: serde_json::Value,
    passed: bool,
}

/// Accounts for every produced id:
/// - **acked**: the broker holds it no more, and the app answered it 2xx;
/// - **dead-lettered** with a reason that matches what the app answered
///   (`permanent-status` with the 4xx it gave; `attempts-exhausted` with a
///   retried status it gave, or a transport error; `undeliverable` for the
///   corpus entries over a cap);
/// - **stuck**: the broker still holds it after the settle period;
/// - **lost**: the broker holds it no more, nothing dead-lettered it, and
///   the app never saw it;
/// - **unexpected**: gone though the app never answered 2xx, dead-lettered
///   with a reason the app's answers do not explain, delivered though over
///   a cap, or delivered with its body or header changed;
/// - **duplicates**: deliveries after the app had answered 2xx (allowed:
///   at-least-once, explained by the kills).
fn check(
    args: &TortureArgs,
    produced: &Produced,
    seen: &[Seen],
    holdings: &Holdings,
    run: &Run,
    settle_secs: f64,
    traffic: Duration,
) -> Report {
    let mut by_id: HashMap<u64, Vec<&Seen>> = HashMap::new();
    let mut anomalies: Vec<String> = Vec::new();
    for s in seen {
        if s.anomaly.is_empty() {
            by_id.entry(s.n).or_default().push(s);
        } else {
            by_id.entry(s.n).or_default().push(s);
            anomalies.push(format!(
                "{} (attempt {}): {}",
                id_of(s.n),
                s.attempt,
                s.anomaly
            ));
        }
    }
    let mut letters: HashMap<u64, Vec<&Letter>> = HashMap::new();
    let mut orphan_letters = 0;
    for l in &holdings.letters {
        if l.ids.is_empty() {
            orphan_letters += 1;
        }
        for &n in &l.ids {
            letters.entry(n).or_default().push(l);
        }
    }
    let mut acked = 0u64;
    let mut dead: BTreeMap<String, u64> = BTreeMap::new();
    let mut lost = Vec::new();
    let mut stuck = Vec::new();
    let mut unexpected: Vec<String> = Vec::new();
    let mut duplicates = 0u64;
    let mut double_letters = 0u64;
    let mut by_kind: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let seed = args.seed;
    for &(n, kind) in &produced.ids {
        let plan = Plan::of(seed, n);
        let deliveries = by_id.get(&n).map(Vec::as_slice).unwrap_or(&[]);
        let ok = |s: &&Seen| (200..300).contains(&s.answer);
        let got_2xx = deliveries.iter().any(ok);
        if let Some(first) = deliveries.iter().position(ok) {
            duplicates += (deliveries.len() - first - 1) as u64;
        }
        let id = id_of(n);
        let label = kind.map_or_else(
            || plan.name().to_string(),
            |k| format!("{} {}", plan.name(), k.name()),
        );
        let mut bad = |why: String| unexpected.push(format!("{id} ({label}): {why}"));
        if let Some(k) = kind {
            let e = by_kind.entry(k.name()).or_default();
            e.0 += 1;
            if k.undeliverable() && !deliveries.is_empty() {
                bad(format!(
                    "over a cap, yet delivered to the app {} times",
                    deliveries.len()
                ));
            }
            if k == Hostile::Forged
                && let Some(s) = deliveries.first()
                && s.attempt > 10
            {
                bad(format!(
                    "its forged courier-attempt was honoured: first delivery said attempt {}",
                    s.attempt
                ));
            }
        }
        if holdings.pending.contains(&n) {
            stuck.push(format!(
                "{id} ({label}), delivered {} times{}",
                deliveries.len(),
                if got_2xx { ", answered 2xx" } else { "" }
            ));
            continue;
        }
        if let Some(ls) = letters.get(&n) {
            if ls.len() > 1 {
                double_letters += (ls.len() - 1) as u64;
            }
            let l = ls[ls.len() - 1];
            *dead.entry(l.reason.clone()).or_default() += 1;
            if let Some(k) = kind {
                by_kind.entry(k.name()).or_default().1 += 1;
            }
            let answered = |code: &str| deliveries.iter().any(|s| s.answer.to_string() == code);
            let cause = match l.reason.as_str() {
                "undeliverable" => kind.is_some_and(Hostile::undeliverable),
                "permanent-status" => {
                    matches!(plan, Plan::Permanent(c) if c.to_string() == l.status)
                        && answered(&l.status)
                }
                "attempts-exhausted" => {
                    !matches!(plan, Plan::Permanent(_))
                        && if l.status.is_empty() {
                            !l.error.is_empty()
                        } else {
                            answered(&l.status) && !l.status.starts_with('2')
                        }
                }
                _ => false,
            };
            if !cause {
                bad(format!(
                    "dead-lettered {} (status {:?}, error {:?}, attempts {}) though the app answered {:?}",
                    l.reason,
                    l.status,
                    l.error,
                    l.attempts,
                    deliveries.iter().map(|s| s.answer).collect::<Vec<_>>()
                ));
            } else if kind.is_some_and(Hostile::undeliverable) || l.reason != "undeliverable" {
                // explained
            }
            continue;
        }
        if kind.is_some_and(Hostile::undeliverable) {
            bad("over a cap, yet not dead-lettered".into());
            continue;
        }
        if got_2xx {
            acked += 1;
        } else if deliveries.is_empty() {
            lost.push(format!("{id} ({label})"));
        } else {
            bad(format!(
                "settled without a 2xx: the app answered {:?}",
                deliveries.iter().map(|s| s.answer).collect::<Vec<_>>()
            ));
        }
    }
    let produced_set: HashSet<u64> = produced.ids.iter().map(|(n, _)| *n).collect();
    let strangers = by_id.keys().filter(|n| !produced_set.contains(n)).count();
    for a in &anomalies {
        unexpected.push(format!("the app saw {a}"));
    }
    let kills = run.faults.get("courier SIGKILL").copied().unwrap_or(0)
        + run.faults.get("app SIGKILL").copied().unwrap_or(0)
        + run.faults.get("broker SIGKILL").copied().unwrap_or(0);
    let rss_over: Vec<&LifeReport> = run.lives.iter().filter(|l| l.over).collect();
    let panics: usize = run.lives.iter().map(|l| l.panics).sum();
    let passed = lost.is_empty()
        && stuck.is_empty()
        && unexpected.is_empty()
        && rss_over.is_empty()
        && run.unplanned_exits.is_empty()
        && holdings.discrepancies.is_empty();

    let mut t = String::new();
    use std::fmt::Write as _;
    let _ = writeln!(t, "torture report: {} (seed {})", args.broker, seed);
    let _ = writeln!(
        t,
        "  traffic {:.0} s at {} msg/s, settle {:.0} s; broker write retries {}",
        traffic.as_secs_f64(),
        args.rate,
        settle_secs,
        produced.write_retries
    );
    let faults: Vec<String> = run.faults.iter().map(|(k, v)| format!("{k} {v}")).collect();
    let _ = writeln!(
        t,
        "  faults: {}",
        if faults.is_empty() {
            "none".into()
        } else {
            faults.join(", ")
        }
    );
    let _ = writeln!(t, "  produced      {}", produced.ids.len());
    let _ = writeln!(t, "  acked         {acked}");
    let dead_total: u64 = dead.values().sum();
    let reasons: Vec<String> = dead.iter().map(|(k, v)| format!("{k} {v}")).collect();
    let _ = writeln!(t, "  dead-lettered {dead_total} ({})", reasons.join(", "));
    let _ = writeln!(t, "  lost          {}", lost.len());
    let _ = writeln!(t, "  stuck         {}", stuck.len());
    let _ = writeln!(t, "  unexpected    {}", unexpected.len());
    let _ = writeln!(
        t,
        "  duplicates    {duplicates} deliveries after a 2xx ({kills} kills of courier, the app or the broker); {double_letters} second dead letters"
    );
    for r in produced.refused.iter().take(5) {
        let _ = writeln!(t, "  refused by the producer's client: {r}");
    }
    for d in &holdings.discrepancies {
        let _ = writeln!(t, "  DISCREPANCY: {d}");
    }
    if strangers > 0 || orphan_letters > 0 {
        let _ = writeln!(
            t,
            "  ids the app saw that were never produced: {strangers}; dead letters without an id: {orphan_letters}"
        );
    }
    let kinds: Vec<String> = by_kind
        .iter()
        .map(|(k, (p, d))| format!("{k} {p} ({d} dead-lettered)"))
        .collect();
    let _ = writeln!(t, "  hostile corpus: {}", kinds.join(", "));
    let _ = writeln!(t, "  courier lives (RSS KiB at warm-up -> end):");
    for (i, l) in run.lives.iter().enumerate() {
        let _ = writeln!(
            t,
            "    #{:<2} pid {:<7} {:>6.1} s  {:>7} -> {:>7}{}  ended by {}{}",
            i + 1,
            l.pid,
            l.secs,
            l.start_kib,
            l.end_kib,
            if !l.judged {
                " (too short to judge)".to_string()
            } else if l.over {
                format!(
                    " OVER 10% (+{:.1}%)",
                    (l.end_kib as f64 / l.start_kib as f64 - 1.0) * 100.0
                )
            } else {
                format!(
                    " ({:+.1}%)",
                    (l.end_kib as f64 / l.start_kib.max(1) as f64 - 1.0) * 100.0
                )
            },
            l.ended_by,
            if l.panics + l.errors > 0 {
                format!(", {} panics, {} ERROR lines in its log", l.panics, l.errors)
            } else {
                String::new()
            }
        );
    }
    for e in &run.unplanned_exits {
        let _ = writeln!(t, "  UNPLANNED EXIT: {e}");
    }
    for (what, list) in [
        ("lost", &lost),
        ("stuck", &stuck),
        ("unexpected", &unexpected),
    ] {
        for line in list.iter().take(20) {
            let _ = writeln!(t, "  {what}: {line}");
        }
        if list.len() > 20 {
            let _ = writeln!(t, "  {what}: ... {} more", list.len() - 20);
        }
    }
    let _ = writeln!(t, "  {}", if passed { "PASS" } else { "FAIL" });

    let lives: Vec<serde_json::Value> = run
        .lives
        .iter()
        .map(|l| {
            serde_json::json!({
                "pid": l.pid, "secs": l.secs, "rss_start_kib": l.start_kib, "rss_end_kib": l.end_kib,
                "judged": l.judged, "over": l.over, "ended_by": l.ended_by,
                "panics": l.panics, "error_lines": l.errors,
            })
        })
        .collect();
    let json = serde_json::json!({
        "broker": args.broker,
        "seed": seed,
        "rate": args.rate,
        "traffic_secs": traffic.as_secs_f64(),
        "settle_secs": settle_secs,
        "faults": run.faults,
        "policy_edits": run.policy_edits,
        "produced": produced.ids.len(),
        "acked": acked,
        "dead_lettered": dead,
        "lost": lost,
        "stuck": stuck,
        "unexpected": unexpected,
        "duplicates": duplicates,
        "second_dead_letters": double_letters,
        "kills": kills,
        "courier_lives": lives,
        "unplanned_exits": run.unplanned_exits,
        "courier_panics": panics,
        "discrepancies": holdings.discrepancies,
        "passed": passed,
    });
    Report {
        text: t,
        json,
        passed,
    }
}
