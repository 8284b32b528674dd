//! The embedded queue (`embedded:<dir>`): a durable local queue in one redb
//! file, `<dir>/courier.redb`, for the demo, local development and tests.
//!
//! Per queue there are three tables:
//! - `ready/<queue>`: `(due ms, seq) -> fields`; new messages are due at
//!   once, scheduled retries at their time.
//! - `leased/<queue>`: `(visible again at ms, seq) -> fields`; handed out and
//!   not yet settled. A lease that runs out makes the message deliverable
//!   again (the visibility timeout), counting one more attempt.
//! - `dlq/<name>`: `seq -> fields` of dead letters.
//! - `jobs/<name>`: `job key -> record` of the `courier dlq` jobs on the
//!   dead letters of `<name>`, made by the first put.
//!
//! A redb file is held by one process at a time. Inside a process every
//! source opened on the same directory shares one handle, and one writer
//! thread does every change to it, because a redb transaction costs about
//! 90 µs of CPU whatever it holds and a row a few µs:
//! - **Group commit.** Sends, retries, dead letters, replays and purges that
//!   arrive while the writer is busy share the next transaction, and each is
//!   answered once that transaction is durable (fsynced).
//! - **Hand-outs and acks in memory.** A receive takes due messages by
//!   reading `ready` and noting them as held; an ack notes the message as
//!   done, and is not even a call to the writer: it waits in a list the
//!   writer takes before its next step. Neither writes: the rows they make
//!   obsolete are removed, and the messages still held are moved to
//!   `leased`, by the next transaction, at most [`FLUSH_EVERY`] later. Memory only ever holds back *removals*, so
//!   the file at any commit holds every message that is not settled (see
//!   [`FLUSH_EVERY`] for why a crash then costs redeliveries, never a loss).
//! - **Wake-ups.** A receive that finds nothing waits inside the writer; it
//!   is tried again after each transaction (a send reaches it at once) and
//!   at the next due time it saw (a retry reaches it when due).
//! - **Read-ahead.** A receive answered full is followed by the next one's
//!   hand-out, which the next receive takes without a call to the writer
//!   ([`ahead`]).
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

// The overlay's maps are looked up a few times for every message (a
// hand-out, its take, its ack): SipHash cost some 3,000 instructions a
// message of a drain (callgrind, `courier-bench all --counts-only`). Their
// keys are the file's own sequence numbers and queue names.
use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use redb::{
    Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
    TableHandle, WriteTransaction,
};
use tokio::sync::oneshot;

use courier_core::model::{DeadLetter, Delivery, F_DELIVERIES, Failure, PAYLOAD};
use courier_core::source::shared::{self, IN_PROCESS_WAIT};
use courier_core::source::{
    Broker, Capabilities, Consumer, DeadLetterStore, Depth, LiveSettings, Observed, SettleParts,
    Settlement, Source, SourceError, SourceOptions, SourceUrl, WithStore, decode_fields,
    encode_fields, settle_by_parts,
};

mod ahead;
mod calls;
mod dead_letters;
mod depth;
mod file;
mod overlay;
mod read;
mod settle;
mod writer;

use ahead::*;
use calls::*;
use dead_letters::EmbeddedStore;
use file::*;
use overlay::*;
use read::*;
use settle::*;
use writer::*;

type QueueTable<'a> = TableDefinition<'a, (u64, u64), &'static [u8]>;
type DlqTable<'a> = TableDefinition<'a, u64, &'static [u8]>;
const META: TableDefinition<'_, &str, u64> = TableDefinition::new("meta");
/// Idempotency key -> ms until which its ack is remembered.
type AckedTable<'a> = TableDefinition<'a, &'static str, u64>;
const SEQ: &str = "seq";
/// In `meta`: 1 while a process has the file open, 0 once it closed it.
const OPEN: &str = "open";
/// After opening a file its last process did not close (it crashed, or was
/// killed), every hand-out is made durable before it is answered for this
/// long, instead of within [`FLUSH_EVERY`]: a message that crashes courier
/// the moment it is handed out is so counted (`courier-deliveries`), and
/// after `max_deliveries` crashes dead-lettered instead of crash-looping
/// courier for ever. It comes first after a restart (it is still at the
/// head of `ready`, or its lease runs out), so a short window catches it.
const CAREFUL_FOR: Duration = Duration::from_secs(10);
/// A waiting receive is tried again at least this often. Every change goes
/// through the writer, which tries waiting receives after each transaction
/// and at the next due time, so this only covers what the writer cannot
/// see: the wall clock (due times are wall-clock ms) jumping. Each is a
/// wake-up of an idle sidecar, so not more than one a second.
const FALLBACK_POLL: Duration = Duration::from_secs(1);
/// What receives and acks did in memory is written, with an fsync, at most
/// this long after the first of it.
///
/// Until then a crash undoes it: redb comes back at its last durable
/// commit, a consistent earlier state of the queue in which every message
/// not yet settled is still in `ready` or `leased`, because memory only
/// holds back removals.
/// - An ack undone leaves the message leased or ready: it is delivered
///   again, as if the crash had come between the app's 2xx and the ack,
///   which at-least-once allows.
/// - A hand-out undone leaves the message ready as it was: it is delivered
///   again with the same attempt number, so the delivery the app may have
///   seen is not counted. The count can so fall behind the deliveries, never
///   run ahead of them: a dead letter may come later, never earlier, and
///   never twice. It weakens "a delivery that was never settled counts as
///   an attempt" for a message that crashes courier within this window of
///   being handed out; a lease that is taken back after it ran out (a sign
///   of such trouble) is therefore made durable before it is handed out
///   again, and so is every hand-out for a while after an unclean stop
///   (see [`CAREFUL_FOR`]).
/// - Sends, retries, dead letters, replays and purges create a message or
///   move it somewhere new: they are answered only once durable, so a send
///   that returned Ok is never lost, a retry never lost nor fired early, a
///   dead letter never lost nor written twice.
const FLUSH_EVERY: Duration = Duration::from_millis(20);
/// redb's page cache. The default (1 GiB) grows with the file: 77 MB of RSS
/// for a 100,000-message backlog. Reads past it come from the kernel's page
/// cache, which the queue's access pattern (oldest keys first) suits.
const CACHE_BYTES: usize = 4 << 20;
/// A receive hands out at most this many bytes of stored messages in all,
/// and always one message at least, so a backlog of big messages cannot
/// take more memory than this per read.
const READ_BUDGET: usize = 16 << 20;
/// A stored message over this many bytes is dead-lettered as
/// `undeliverable` instead of handed out (it is never loaded into a
/// delivery), and `send` refuses one: only another tool can store it.
const RECORD_LIMIT: usize = 32 << 20;
/// At most this many calls go into one transaction.
const MAX_BATCH: usize = 1024;

/// The built-in queue: `embedded:<dir>`.
pub const BROKER: Broker = Broker {
    name: "embedded",
    messaging_system: "embedded",
    schemes: &["embedded"],
    tls_schemes: &[],
    url_form: "embedded:<dir>",
    check_url: |text| dir_of(text).map(drop),
    open: |url, options| {
        Box::pin(async move {
            let dir = dir_of(url.as_str()).map_err(SourceError::invalid)?;
            Ok(Arc::new(EmbeddedSource::open(&dir, options)?) as Arc<dyn Source>)
        })
    },
    admin: |url, options| {
        Box::pin(async move {
            let dir = dir_of(url.as_str()).map_err(SourceError::invalid)?;
            Ok(Arc::new(EmbeddedStore::open(&dir, options)?) as Arc<dyn DeadLetterStore>)
        })
    },
};

/// The directory an `embedded:<dir>` URL names.
pub fn dir_of(url: &str) -> Result<PathBuf, String> {
    match url
        .strip_prefix("embedded:")
        .map(|d| d.trim_start_matches("//"))
    {
        Some(dir) if !dir.is_empty() => Ok(PathBuf::from(dir)),
        _ => Err(format!(
            "{url:?} names no directory; write embedded:/path/to/dir"
        )),
    }
}

/// The `--source` URL of the embedded queue in `dir`.
pub fn url(dir: &Path) -> SourceUrl {
    SourceUrl::parse_among(&format!("embedded:{}", dir.display()), &[&BROKER])
        .expect("an embedded: URL with a directory is valid")
}

pub struct EmbeddedSource {
    file: Arc<File>,
    tables: Arc<Tables>,
    /// The options' live part, as the policy now says.
    live: Mutex<LiveSettings>,
    /// The dead letters and sends, on the same file and writer.
    store: EmbeddedStore,
    /// An interrupt came that no receive has met yet. Held while a receive
    /// is handed to the writer and while an interrupt is: the writer then
    /// sees the receive before the interrupt, or the receive sees the flag.
    interrupt: Mutex<bool>,
}

/// The names of one queue's tables.
struct Tables {
    queue: String,
    ready: String,
    leased: String,
    acked: String,
    /// What the writer handed out ahead for this source's next receive.
    ahead: Ahead,
}

/// One open redb file, shared by every source and store on the directory in
/// this process, and its writer thread once a consumer started it.
struct File {
    db: Arc<Database>,
    path: PathBuf,
    writer: OnceLock<Writing>,
    /// Held by a write an admin handle makes in a transaction of its own,
    /// and by the start of the writer: the writer never starts in the middle
    /// of such a write, and once it runs every write goes through it.
    direct: Mutex<()>,
}

/// The writer thread, and the way calls reach it.
struct Writing {
    calls: mpsc::Sender<Call>,
    acks: Arc<PendingAcks>,
    thread: JoinHandle<()>,
}

impl Drop for File {
    /// Stops the writer (which writes what it holds in memory, durably) and
    /// waits for it, so that the file is closed when the last source on it
    /// is gone and can be opened again at once, by this process or another.
    fn drop(&mut self) {
        if let Some(Writing { calls, thread, .. }) = self.writer.take() {
            drop(calls);
            let _ = thread.join();
        }
    }
}

fn store_error(e: impl std::fmt::Display) -> SourceError {
    SourceError::broker(format!("embedded queue: {e}"))
}

fn writer_gone() -> SourceError {
    store_error("the writer thread has stopped")
}

fn now_ms() -> u64 {
    ms(SystemTime::now())
}

fn ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

fn parse_receipt(receipt: &str) -> Result<(u64, u64), SourceError> {
    receipt
        .split_once(':')
        .and_then(|(until, seq)| Some((until.parse().ok()?, seq.parse().ok()?)))
        .ok_or_else(|| store_error(format!("bad receipt {receipt:?}")))
}

#[async_trait]
impl Consumer for EmbeddedSource {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            per_message_delay: true,
            out_of_order_acks: true,
            dead_letter_browsing: true,
            dedup: true,
            byte_bounded_reads: true,
            dead_letter_age: true,
            key_ordering: false,
            shared_rate_limit: false,
            dead_letter_jobs: true,
            exact_replay: true,
            multi_process: false,
        }
    }

    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        let now = Instant::now();
        let tables = self.tables.clone();
        let live = self.live();
        let terms = Terms {
            visibility: live.visibility_timeout.as_millis() as u64,
            dead_letter_queue: live.dead_letter_queue,
            max_deliveries: live.max_deliveries,
        };
        let (found, emptied) = self.tables.ahead.take(max);
        if !found.is_empty() {
            let took = Took {
                tables: tables.clone(),
                seqs: found.iter().filter_map(seq_of).collect(),
            };
            let fill = emptied.then(|| Call::Fill { tables, max, terms });
            self.file.took(took, fill)?;
            return Ok(found);
        }
        let answer = {
            let mut interrupted = self.interrupt.lock().unwrap_or_else(|e| e.into_inner());
            let wait = if std::mem::take(&mut *interrupted) {
                Duration::ZERO
            } else {
                IN_PROCESS_WAIT
            };
            self.file.submit(|reply| {
                Call::Lease(Lease {
                    tables,
                    max,
                    terms,
                    deadline: now + wait,
                    next_try: now,
                    reply,
                })
            })?
        };
        answer.await.map_err(|_| writer_gone())?
    }

    /// A receive waiting in the writer (found nothing yet) is answered now
    /// with what is due, maybe nothing; one not there yet waits for nothing.
    async fn interrupt(&self) {
        let mut interrupted = self.interrupt.lock().unwrap_or_else(|e| e.into_inner());
        *interrupted = true;
        let tables = self.tables.clone();
        let _ = self.file.submit::<()>(|_| Call::Interrupt { tables });
    }

    async fn settle(
        &self,
        delivery: &Delivery,
        settlement: Settlement<'_>,
    ) -> Result<(), SourceError> {
        settle_by_parts(self, delivery, settlement).await
    }

    /// Extends the leases of `in_flight` to now + the visibility timeout, in
    /// the writer's next transaction (not fsynced: after a crash there is
    /// nothing in flight to keep).
    async fn keep_alive(&self, in_flight: &[Delivery]) -> Result<(), SourceError> {
        if in_flight.is_empty() {
            return Ok(());
        }
        let keys = in_flight
            .iter()
            .map(|d| parse_receipt(&d.receipt))
            .collect::<Result<Vec<_>, _>>()?;
        let tables = self.tables.clone();
        let visibility = self.live().visibility_timeout.as_millis() as u64;
        self.call(|reply| {
            Call::Change(Change::KeepAlive {
                tables,
                keys,
                visibility,
                reply,
            })
        })
        .await
    }

    /// Not fsynced on its own, like an ack (see [`FLUSH_EVERY`]): a key lost
    /// in a crash only lets a redelivery reach the app.
    async fn remember_ack(&self, key: &str, window: Duration) -> Result<(), SourceError> {
        let key = key.to_string();
        let until = now_ms() + window.as_millis() as u64;
        self.write(false, move |tx, tables| {
            let mut acked = tx
                .open_table(AckedTable::new(&tables.acked))
                .map_err(store_error)?;
            // Forget what has run out, a little at a time, so the table
            // stays the size of one window.
            let now = now_ms();
            let expired: Vec<String> = acked
                .iter()
                .map_err(store_error)?
                .take(64)
                .filter_map(|row| row.ok())
                .filter(|(_, v)| v.value() < now)
                .map(|(k, _)| k.value().to_string())
                .collect();
            for old in expired {
                acked.remove(old.as_str()).map_err(store_error)?;
            }
            acked.insert(key.as_str(), until).map_err(store_error)?;
            Ok(())
        })
        .await
    }

    async fn was_acked(&self, key: &str) -> Result<bool, SourceError> {
        let key = key.to_string();
        self.read(move |tx, tables| {
            let acked = match tx.open_table(AckedTable::new(&tables.acked)) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(false),
                Err(e) => return Err(store_error(e)),
            };
            let until = acked
                .get(key.as_str())
                .map_err(store_error)?
                .map(|v| v.value());
            Ok(until.is_some_and(|t| t >= now_ms()))
        })
        .await
    }

    /// Writes what receives and acks did in memory, durably, so that a clean
    /// stop redelivers nothing that was acked.
    async fn close(&self) {
        if let Err(e) = self
            .call(|reply| Call::Change(Change::Flush { reply }))
            .await
        {
            tracing::warn!(error = %e, "embedded queue: the last commit failed; unsettled messages will be delivered again");
        }
    }
}

#[async_trait]
impl Observed for EmbeddedSource {
    async fn depth(&self) -> Result<Depth, SourceError> {
        let tables = self.tables.clone();
        let dlq = dlq_table(&self.live().dead_letter_queue);
        self.call(|reply| Call::Depth { tables, dlq, reply }).await
    }

    fn apply(&self, settings: &LiveSettings) {
        *self.live.lock().unwrap_or_else(|e| e.into_inner()) = settings.clone();
    }
}

impl WithStore for EmbeddedSource {
    fn store(&self) -> &dyn DeadLetterStore {
        &self.store
    }
}

#[cfg(test)]
mod tests;
