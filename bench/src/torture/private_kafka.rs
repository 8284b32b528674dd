//! The torture run on Kafka: librdkafka's mock cluster (three brokers in
//! one `kafka-mock` process of the harness's own, on ports it picks), the
//! producer (an rdkafka `FutureProducer` with `acks=all`, each record tried
//! until its delivery report says the cluster has it), and what the
//! checker reads: every record of the work topic and of `<queue>.retry`
//! that the group has not settled, and the dead letters through courier's
//! own dead-letter store.
//!
//! The mock keeps everything in memory, so the nemesis never SIGKILLs it
//! (that would lose every record by design); it SIGSTOPs it.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use super::{
    GROUP, Holdings, Hostile, PrivateServer, Produced, TortureArgs, admin_letters, message,
};
use crate::torture_app::ids_in;

/// The `--max-body` a Kafka run uses at most. The mock keeps 5 MiB per
/// partition and drops the oldest records past that; a 10-minute run
/// dead-letters about 110 bodies over --max-body and 110 of 2,000 headers
/// or 1,500 CloudEvent attributes (30 KiB each), which at 256 KiB overflow
/// the dead-letter topic's four partitions (seed 3: 680 letters gone).
pub(super) const KAFKA_MAX_BODY: usize = 32 * 1024;

/// The warm-up a Kafka run's courier lives get at least: a courier started
/// after a kill gets partitions only once the group has rebalanced, about
/// the killed member's 10 s session later, so at 15 s its RSS is often
/// still that of a courier without traffic (seed 3: one life 51.7 ->
/// 60.8 MiB, while every life with traffic sat at 57-60 MiB).
pub(super) const KAFKA_WARMUP_SECS: u64 = 25;

/// A `kafka-mock` of the harness's own: it prints its bootstrap servers on
/// the first line of its output.
pub(crate) struct PrivateKafka {
    pub(super) server: PrivateServer,
    bin: PathBuf,
    bootstrap: String,
}

impl PrivateKafka {
    pub(crate) fn new(server: PrivateServer, bin: PathBuf) -> Self {
        Self {
            server,
            bin,
            bootstrap: String::new(),
        }
    }

    pub(super) fn url(&self) -> String {
        format!("kafka://{}", self.bootstrap)
    }

    pub(crate) fn bootstrap(&self) -> &str {
        &self.bootstrap
    }

    /// Starts the cluster, three brokers so that every topic is replicated
    /// as in the project's tests, and waits for its bootstrap servers.
    pub(crate) async fn start(&mut self) -> anyhow::Result<()> {
        let mut command = Command::new(&self.bin);
        command.args(["--brokers", "3"]);
        self.server.spawn("kafka-mock", command)?;
        let log = self
            .server
            .process
            .as_ref()
            .map(|p| p.log.clone())
            .context("kafka-mock is not running")?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if let Some(line) = text.lines().find(|l| l.starts_with("127.0.0.1:")) {
                self.bootstrap = line.trim().to_string();
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("kafka-mock printed no bootstrap servers within 30 s: {text}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Has the cluster make the work and retry topics and courier's seal
    /// key, as `courier run --create` does, by opening courier's own source
    /// once: the producer needs the topic before courier's first start.
    pub(super) async fn create_topics(&self, queue: &str) -> anyhow::Result<()> {
        let url = courier::source::parse_url(&self.url()).map_err(anyhow::Error::msg)?;
        let mut options = courier::source::SourceOptions::new(queue);
        options.group = GROUP.into();
        options.create = true;
        let source = courier::source::open(&url, options).await?;
        source.close().await;
        Ok(())
    }

    /// Whether the group has settled every record of both topics.
    pub(super) async fn settled(&self, queue: &str) -> bool {
        let (bootstrap, queue) = (self.bootstrap.clone(), queue.to_string());
        tokio::task::spawn_blocking(move || {
            unsettled(&bootstrap, &queue).is_ok_and(|open| open.iter().all(|o| o.is_empty()))
        })
        .await
        .unwrap_or(false)
    }

    /// The ids of every record the group has not settled (in its value or
    /// a header), and the dead letters as `courier dlq list` reads them.
    /// The mock keeps at most 5 MiB per partition (librdkafka's
    /// rdkafka_mock.c drops the oldest records past that): records it
    /// dropped before they were settled are reported, not counted against
    /// courier.
    pub(super) async fn holdings(&self, queue: &str) -> anyhow::Result<Holdings> {
        let (bootstrap, topic) = (self.bootstrap.clone(), queue.to_string());
        let mut out =
            tokio::task::spawn_blocking(move || read_unsettled(&bootstrap, &topic)).await??;
        out.letters = admin_letters(&self.url(), queue).await?;
        let (bootstrap, topic) = (self.bootstrap.clone(), queue.to_string());
        out.discrepancies =
            tokio::task::spawn_blocking(move || dropped(&bootstrap, &topic)).await??;
        Ok(out)
    }
}

/// The records the mock dropped before they were settled, one line per
/// topic: of the work and retry topics those below the low watermark but
/// at or above the group's committed offset (what it dropped below that
/// was settled already), of the dead-letter topic any.
fn dropped(bootstrap: &str, queue: &str) -> anyhow::Result<Vec<String>> {
    let consumer = inspector(bootstrap, queue)?;
    let mut out = Vec::new();
    for (topic, settled_below) in [
        (queue.to_string(), true),
        (format!("{queue}.retry"), true),
        (format!("{queue}.dlq"), false),
    ] {
        let metadata = consumer.fetch_metadata(Some(&topic), REQUEST)?;
        let partitions: Vec<i32> = metadata
            .topics()
            .iter()
            .filter(|t| t.error().is_none())
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect();
        let mut wanted = TopicPartitionList::new();
        for p in &partitions {
            wanted.add_partition(&topic, *p);
        }
        let committed = consumer.committed_offsets(wanted, REQUEST)?;
        let mut lows = Vec::new();
        for p in partitions {
            let (low, high) = consumer.fetch_watermarks(&topic, p, REQUEST)?;
            let commit = match committed.find_partition(&topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) if settled_below => o,
                _ => 0,
            };
            if low > commit {
                lows.push(format!("[{p}] {commit}..{low} of {high}"));
            }
        }
        if !lows.is_empty() {
            out.push(format!(
                "the Kafka mock dropped records of {topic} before they were settled (it keeps 5 MiB per partition): {}",
                lows.join(", ")
            ));
        }
    }
    Ok(out)
}

/// One partition's records the group has not settled: from its committed
/// offset (the oldest kept when it committed none) to the high watermark,
/// less the offsets the commit's metadata lists as settled out of order
/// (courier's format, crates/kafka/src/offsets.rs: `1;h=12:1;d=14-20,22`).
struct Open {
    topic: String,
    partition: i32,
    offsets: BTreeSet<i64>,
}

impl Open {
    fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }
}

fn settled_in(metadata: &str) -> BTreeSet<i64> {
    let mut done = BTreeSet::new();
    let mut parts = metadata.split(';');
    if parts.next() != Some("1") {
        return done;
    }
    for list in parts.filter_map(|p| p.strip_prefix("d=")) {
        for item in list.split(',').filter(|i| !i.is_empty()) {
            let (start, end) = item.split_once('-').unwrap_or((item, item));
            if let (Ok(start), Ok(end)) = (start.parse::<i64>(), end.parse::<i64>()) {
                done.extend(start..=end);
            }
        }
    }
    done
}

const REQUEST: Duration = Duration::from_secs(10);

/// A consumer of courier's group (`<group>.<queue>`) that never joins it
/// nor commits: it reads the group's commits and assigns partitions itself.
fn inspector(bootstrap: &str, queue: &str) -> anyhow::Result<BaseConsumer> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("{GROUP}.{queue}"))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("allow.auto.create.topics", "false")
        .create()?)
}

/// What the group has not settled of the work topic and `<queue>.retry`.
fn unsettled_with(consumer: &BaseConsumer, queue: &str) -> anyhow::Result<Vec<Open>> {
    let mut out = Vec::new();
    for topic in [queue.to_string(), format!("{queue}.retry")] {
        let metadata = consumer.fetch_metadata(Some(&topic), REQUEST)?;
        let partitions: Vec<i32> = metadata
            .topics()
            .iter()
            .filter(|t| t.error().is_none())
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect();
        let mut wanted = TopicPartitionList::new();
        for p in &partitions {
            wanted.add_partition(&topic, *p);
        }
        let committed = consumer.committed_offsets(wanted, REQUEST)?;
        for p in partitions {
            let (low, high) = consumer.fetch_watermarks(&topic, p, REQUEST)?;
            let (from, metadata) = match committed.find_partition(&topic, p) {
                Some(e) => match e.offset() {
                    Offset::Offset(o) => (o.max(low), e.metadata().to_string()),
                    _ => (low, String::new()),
                },
                None => (low, String::new()),
            };
            let done = settled_in(&metadata);
            out.push(Open {
                topic: topic.clone(),
                partition: p,
                offsets: (from..high).filter(|o| !done.contains(o)).collect(),
            });
        }
    }
    Ok(out)
}

fn unsettled(bootstrap: &str, queue: &str) -> anyhow::Result<Vec<Open>> {
    unsettled_with(&inspector(bootstrap, queue)?, queue)
}

/// Reads every unsettled record, partition by partition, from its first
/// unsettled offset to the watermark it had.
fn read_unsettled(bootstrap: &str, queue: &str) -> anyhow::Result<Holdings> {
    let consumer = inspector(bootstrap, queue)?;
    let mut out = Holdings::default();
    for open in unsettled_with(&consumer, queue)? {
        let (Some(&first), Some(&last)) = (open.offsets.first(), open.offsets.last()) else {
            continue;
        };
        let mut wanted = TopicPartitionList::new();
        wanted.add_partition_offset(&open.topic, open.partition, Offset::Offset(first))?;
        consumer.assign(&wanted)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if Instant::now() > deadline {
                bail!(
                    "reading {}[{}] from {first} to {last} took over 30 s",
                    open.topic,
                    open.partition
                );
            }
            let Some(got) = consumer.poll(Duration::from_millis(100)) else {
                continue;
            };
            let record = got?;
            if open.offsets.contains(&record.offset()) {
                ids_in(record.payload().unwrap_or_default(), &mut out.pending);
                if let Some(headers) = record.headers() {
                    for h in headers.iter() {
                        ids_in(h.value.unwrap_or_default(), &mut out.pending);
                    }
                }
            }
            if record.offset() >= last {
                break;
            }
        }
        consumer.unassign()?;
    }
    Ok(out)
}

/// The producer: a record to the work topic at the rate, its value the
/// body and every other field a header (Kafka headers are bytes, so the
/// corpus goes as it is), each tried until its delivery report came back.
pub(super) fn spawn_producer(
    bootstrap: String,
    queue: String,
    args: TortureArgs,
    produced: Arc<Mutex<Produced>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let producer: FutureProducer = match ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("acks", "all")
            // A report within 10 s or an error: the broker may be stopped.
            .set("message.timeout.ms", "10000")
            .set("message.max.bytes", "2000000")
            .create()
        {
            Ok(p) => p,
            Err(e) => {
                eprintln!("torture: no Kafka producer: {e}");
                return;
            }
        };
        let period = Duration::from_secs_f64(1.0 / args.rate.max(0.1));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut n = 0u64;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            tick.tick().await;
            let kind: Option<Hostile> = Hostile::of(args.seed, n, args.hostile);
            let mut fields = message(n, kind, args.max_body, true);
            let body = fields.remove(0).1;
            let names: Vec<String> = fields
                .iter()
                .map(|(k, _)| String::from_utf8_lossy(k).into_owned())
                .collect();
            let give_up = Instant::now() + Duration::from_secs(60);
            loop {
                let mut headers = OwnedHeaders::new_with_capacity(fields.len());
                for (name, (_, value)) in names.iter().zip(&fields) {
                    headers = headers.insert(Header {
                        key: name.as_str(),
                        value: Some(value.as_ref()),
                    });
                }
                let record = FutureRecord::<(), [u8]>::to(&queue)
                    .payload(body.as_ref())
                    .headers(headers);
                let error = match producer.send(record, Duration::from_secs(10)).await {
                    Ok(_) => {
                        produced.lock().unwrap().ids.push((n, kind));
                        break;
                    }
                    Err((e, _)) => e.to_string(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_settled_offsets_of_a_commit() {
        assert_eq!(settled_in("1;h=3:1,4:2;d=5-6,9"), BTreeSet::from([5, 6, 9]));
        assert!(settled_in("").is_empty());
        assert!(settled_in("2;d=1").is_empty());
    }
}
