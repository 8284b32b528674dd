//! Redis Streams.
//!
//! - The work stream is `--queue`, read by the consumer group `--group` in
//!   batches with a plain blocking `XREADGROUP` on a socket of its own,
//!   whose reply courier reads as it arrives (`read_connection.rs`,
//!   `reply.rs`): an entry over `--max-body` is discarded on the way in,
//!   never buffered whole, and dead-lettered inside Redis after
//!   (`poison.rs`, `read.rs`).
//! - Acks are pipelined: concurrent acks become one `XACK` with many ids.
//! - A retry is the message's fields stored in the sorted set
//!   `<queue>.retry` (score = due time in ms) and the `XACK`, in one script
//!   that checks every key before it writes; a dead letter is `XADD <dlq>`
//!   and an `XACK` that runs only if that `XADD` wrote, in one MULTI
//!   (`settle.rs`). Either settles completely or not at all.
//! - Due retries are claimed, then moved back with `XADD` (`mover.rs`); the
//!   original id and the attempt count travel as `courier-*` fields.
//! - Deliveries left pending longer than the visibility timeout (a crashed
//!   replica) are reclaimed with `XAUTOCLAIM`; this replica's own pending
//!   entries are read back first thing after a restart. Before either, an
//!   entry handed out `max_deliveries` times is dead-lettered inside Redis.
//! - Deliveries in flight are kept claimed (`XCLAIM ... JUSTID`).
//!
//! Derived keys append to the queue name, so a hash-tagged name like
//! `{orders}` keeps `{orders}.retry` and `{orders}.dlq` in its slot.
//!
//! A single node, a Redis Cluster and a master found through Sentinel are
//! reached through one [`connection::Connection`] (`connection.rs`).
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

mod cluster;
mod connection;
mod dead_letters;
mod depth;
mod entries;
mod mover;
mod poison;
mod rate;
mod read;
mod read_connection;
mod reply;
mod settle;
mod tls;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use redis::Value;
use tokio::sync::Mutex;

use connection::{Connection, Endpoint};
use courier_core::model::Delivery;
use courier_core::source::shared::{RECEIVE_WAIT, Seal};
use courier_core::source::{
    Batcher, Broker, Capabilities, Consumer, DeadLetterStore, Depth, ErrorKind, LiveSettings,
    Observed, Settlement, Source, SourceError, SourceOptions, WithStore, settle_by_parts,
};
use dead_letters::RedisStore;
use read::{NewEntries, Reader};

/// Redis Streams on one server (`redis://host:port/db`, `rediss://` for
/// TLS), a Redis Cluster (`redis+cluster://`) or the master of a set of
/// Sentinels (`redis+sentinel://`).
pub const BROKER: Broker = Broker {
    name: "redis",
    messaging_system: "redis",
    schemes: &[
        "redis",
        "rediss",
        "redis+cluster",
        "rediss+cluster",
        "redis+sentinel",
        "rediss+sentinel",
    ],
    tls_schemes: &["rediss", "rediss+cluster", "rediss+sentinel"],
    url_form: connection::URL_FORMS,
    check_url: |url| Endpoint::parse(url).map(drop),
    open: |url, options| {
        Box::pin(async move {
            Ok(Arc::new(RedisSource::connect(url.as_str(), options).await?) as Arc<dyn Source>)
        })
    },
    admin: |url, options| {
        Box::pin(async move {
            Ok(Arc::new(RedisStore::open(url.as_str(), options).await?)
                as Arc<dyn DeadLetterStore>)
        })
    },
};

pub struct RedisSource {
    /// Queue, group and consumer; what can change live is in `live`.
    options: SourceOptions,
    /// The visibility timeout, dead-letter queue and delivery limit in
    /// force: the start values until a live policy change replaces them.
    live: Arc<std::sync::Mutex<LiveSettings>>,
    /// The server is a Redis Cluster node: a dead-letter queue must share
    /// the queue's hash slot.
    cluster: bool,
    commands: Connection,
    reader: Mutex<Reader>,
    /// The blocking read under way, which a stop ends early.
    waiting: std::sync::Mutex<read::Waiting>,
    acks: Batcher<String>,
    retry_key: String,
    mover: Arc<mover::MoverControl>,
    /// Proves which copies courier stored (`<queue>.courier-key`).
    seal: Arc<Seal>,
    store: RedisStore,
    /// Dead-lettered by the scripts, inside Redis ([`Observed::dead_lettered_inside`]).
    dead_lettered_inside: std::sync::atomic::AtomicU64,
}

fn broker_error(e: redis::RedisError) -> SourceError {
    let text = e.to_string();
    if let Some(fix) = refusal(&e) {
        SourceError::refused(format!("Redis refused courier ({text}); {fix}")).caused_by(e)
    } else if e.is_io_error()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.is_connection_dropped()
    {
        SourceError::unavailable(text).caused_by(e)
    } else {
        SourceError::broker(text).caused_by(e)
    }
}

/// What to fix when Redis turned down who courier is, which no retry
/// changes: the password, the user's permissions, the database index.
fn refusal(e: &redis::RedisError) -> Option<&'static str> {
    if e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("NOAUTH" | "WRONGPASS"))
    {
        Some("check the user name and password in --source (redis://USER:PASSWORD@HOST)")
    } else if e.code() == Some("NOPERM") {
        Some(
            "the Redis user's ACL must allow courier's stream and script commands on the queue's keys (QUEUE, QUEUE.retry, QUEUE.dlq, QUEUE.courier-key)",
        )
    } else if e.to_string().contains("DB index is out of range") {
        Some(
            "check the database index at the end of --source (redis://HOST:PORT/DB; the server's `databases` setting bounds it, 16 by default)",
        )
    } else {
        None
    }
}

/// A connection to `endpoint` whose replies may take `timeout`.
async fn connect_to(
    endpoint: &Endpoint,
    url: &str,
    options: &SourceOptions,
    timeout: Duration,
) -> Result<Connection, SourceError> {
    endpoint.connect(timeout, &options.tls).await.map_err(|e| {
        let text = format!(
            "{}: {}",
            courier_core::source::redact(url),
            courier_core::source::redact_error(url, &e)
        );
        // A client the TLS files cannot make is bad configuration, not an
        // outage.
        if let Some(fix) = refusal(&e) {
            SourceError::refused(format!("{text}; {fix}"))
        } else if e.kind() == redis::ErrorKind::InvalidClientConfig {
            SourceError::invalid(text)
        } else {
            SourceError::unavailable(text)
        }
    })
}

impl RedisSource {
    pub async fn connect(url: &str, options: SourceOptions) -> Result<Self, SourceError> {
        let endpoint = Endpoint::parse(url).map_err(SourceError::invalid)?;
        let commands = connect_to(&endpoint, url, &options, Duration::from_secs(10)).await?;
        // Reads get a connection of their own, whose replies may take as
        // long as a read waits.
        let reader = connect_to(
            &endpoint,
            url,
            &options,
            RECEIVE_WAIT + Duration::from_secs(10),
        )
        .await?;
        let mut con = commands.clone();
        let cluster = endpoint.is_cluster() || cluster::is_cluster(&mut con).await?;
        if cluster
            && let Some(problem) =
                cluster::slot_problem(&options.queue, &options.live.dead_letter_queue)
        {
            return Err(SourceError::invalid(format!(
                "{}: {problem}",
                courier_core::source::redact(url)
            )));
        }
        // Start at 0, not $: what producers wrote before courier's first
        // start is work too.
        let created: redis::RedisResult<Value> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&options.queue)
            .arg(&options.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut con)
            .await;
        if let Err(e) = created
            && e.code() != Some("BUSYGROUP")
        {
            return Err(broker_error(e));
        }
        let seal = match &options.seal {
            Some(seal) => seal.clone(),
            None => Arc::new(seal_of(&mut con, &options.queue).await?),
        };
        let source = Self {
            store: RedisStore {
                queue: options.queue.clone(),
                group: options.group.clone(),
                commands: commands.clone(),
                seal: tokio::sync::OnceCell::new_with(Some(seal.clone())),
            },
            seal,
            dead_lettered_inside: Default::default(),
            retry_key: depth::retry_key(&options.queue),
            acks: settle::ack_batcher(&commands, &options.queue, &options.group),
            commands,
            reader: Mutex::new(Reader::new(
                reader,
                NewEntries::new(endpoint, options.tls.clone()),
            )),
            waiting: std::sync::Mutex::default(),
            mover: Arc::default(),
            live: Arc::new(std::sync::Mutex::new(options.live.clone())),
            cluster,
            options,
        };
        source.spawn_mover();
        Ok(source)
    }

    /// The live settings in force now.
    fn live(&self) -> LiveSettings {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// `<queue>.acked:<idempotency key>`: derived from the queue name, so a
    /// hash-tagged queue keeps it in its slot.
    fn acked_key(&self, key: &str) -> String {
        format!("{}.acked:{key}", self.options.queue)
    }
}

/// Takes the queue's seal key, `<queue>.courier-key`, made on first use.
/// Derived from the queue name like every other key, so a hash-tagged
/// queue keeps it in its slot.
const SEAL_KEY: &str = r"
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return redis.call('GET', KEYS[1])
";

async fn seal_of(con: &mut Connection, queue: &str) -> Result<Seal, SourceError> {
    let key = format!("{queue}.courier-key");
    let secret: Vec<u8> = redis::Script::new(SEAL_KEY)
        .key(&key)
        .arg(Seal::new_secret())
        .invoke_async(con)
        .await
        .map_err(|e| match broker_error(e) {
            e if e.kind() == ErrorKind::Broker => SourceError::broker(format!(
                "cannot read the seal key {key:?} ({}); it holds courier's key for proving which copies it stored: delete or rename that key",
                e.message()
            )),
            other => other,
        })?;
    Seal::new(&secret).map_err(|e| {
        SourceError::broker(format!(
            "the seal key {key:?} is not one courier wrote ({e}); delete it and courier makes a new one"
        ))
    })
}

#[async_trait]
impl Consumer for RedisSource {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            per_message_delay: true,
            out_of_order_acks: true,
            dead_letter_browsing: true,
            dedup: true,
            byte_bounded_reads: true,
            dead_letter_age: true,
            key_ordering: false,
            shared_rate_limit: true,
            dead_letter_jobs: true,
            exact_replay: true,
            multi_process: true,
        }
    }

    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        self.read(max).await
    }

    async fn interrupt(&self) {
        self.interrupt_read().await
    }

    async fn settle(
        &self,
        delivery: &Delivery,
        settlement: Settlement<'_>,
    ) -> Result<(), SourceError> {
        settle_by_parts(self, delivery, settlement).await
    }

    async fn take_shared_token(
        &self,
        per_second: f64,
        burst: u32,
    ) -> Result<Duration, SourceError> {
        self.take_token(per_second, burst).await
    }

    async fn remember_ack(&self, key: &str, window: Duration) -> Result<(), SourceError> {
        let mut con = self.commands.clone();
        redis::cmd("SET")
            .arg(self.acked_key(key))
            .arg(1)
            .arg("PX")
            .arg(window.as_millis().max(1) as u64)
            .arg("NX")
            .query_async::<Value>(&mut con)
            .await
            .map(drop)
            .map_err(broker_error)
    }

    async fn was_acked(&self, key: &str) -> Result<bool, SourceError> {
        let mut con = self.commands.clone();
        redis::cmd("EXISTS")
            .arg(self.acked_key(key))
            .query_async::<i64>(&mut con)
            .await
            .map(|n| n > 0)
            .map_err(broker_error)
    }

    async fn keep_alive(&self, in_flight: &[Delivery]) -> Result<(), SourceError> {
        self.keep_claimed(in_flight).await
    }

    async fn close(&self) {
        self.mover.stop();
    }
}

#[async_trait]
impl Observed for RedisSource {
    async fn depth(&self) -> Result<Depth, SourceError> {
        let dead_letter_queue = self.live().dead_letter_queue;
        depth::read(
            &self.commands,
            &self.options.queue,
            &self.options.group,
            &dead_letter_queue,
        )
        .await
    }

    fn check(&self, settings: &LiveSettings) -> Result<(), String> {
        match self.cluster {
            true => cluster::slot_problem(&self.options.queue, &settings.dead_letter_queue)
                .map_or(Ok(()), Err),
            false => Ok(()),
        }
    }

    fn apply(&self, settings: &LiveSettings) {
        *self.live.lock().unwrap_or_else(|e| e.into_inner()) = settings.clone();
    }

    fn dead_lettered_inside(&self) -> u64 {
        self.dead_lettered_inside.load(Ordering::Relaxed)
    }
}

impl WithStore for RedisSource {
    fn store(&self) -> &dyn DeadLetterStore {
        &self.store
    }
}

impl Drop for RedisSource {
    fn drop(&mut self) {
        self.mover.stop();
    }
}
