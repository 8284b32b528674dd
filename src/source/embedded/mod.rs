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
//!   done. Neither writes: the rows they make obsolete are removed, and the
//!   messages still held are moved to `leased`, by the next transaction, at
//!   most [`FLUSH_EVERY`] later. Memory only ever holds back *removals*, so
//!   the file at any commit holds every message that is not settled (see
//!   [`FLUSH_EVERY`] for why a crash then costs redeliveries, never a loss).
//! - **Wake-ups.** A receive that finds nothing waits inside the writer; it
//!   is tried again after each transaction (a send reaches it at once) and
//!   at the next due time it saw (a retry reaches it when due).

use std::collections::{HashMap, HashSet};
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

use super::shared::{self, RECEIVE_WAIT};
use super::{
    Broker, Capabilities, Depth, Source, SourceError, SourceOptions, SourceUrl, decode_fields,
    encode_fields,
};
use crate::model::{DeadLetter, Delivery, F_DELIVERIES, Failure, PAYLOAD};

type QueueTable<'a> = TableDefinition<'a, (u64, u64), &'static [u8]>;
type DlqTable<'a> = TableDefinition<'a, u64, &'static [u8]>;
const META: TableDefinition<'_, &str, u64> = TableDefinition::new("meta");
/// Idempotency key -> ms until which its ack is remembered.
type AckedTable<'a> = TableDefinition<'a, &'static str, u64>;
const SEQ: &str = "seq";
/// A waiting receive is tried again at least this often. Every change goes
/// through the writer, which tries waiting receives after each transaction
/// and at the next due time, so this only covers what the writer cannot
/// see: the wall clock (due times are wall-clock ms) jumping.
const FALLBACK_POLL: Duration = Duration::from_millis(200);
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
///   again.
/// - Sends, retries, dead letters, replays and purges create a message or
///   move it somewhere new: they are answered only once durable, so a send
///   that returned Ok is never lost, a retry never lost nor fired early, a
///   dead letter never lost nor written twice.
const FLUSH_EVERY: Duration = Duration::from_millis(20);
/// redb's page cache. The default (1 GiB) grows with the file: 77 MB of RSS
/// for a 100,000-message backlog. Reads past it come from the kernel's page
/// cache, which the queue's access pattern (oldest keys first) suits.
const CACHE_BYTES: usize = 4 << 20;
/// At most this many calls go into one transaction.
const MAX_BATCH: usize = 1024;

/// The built-in queue: `embedded:<dir>`.
pub const BROKER: Broker = Broker {
    name: "embedded",
    schemes: &["embedded"],
    url_form: "embedded:<dir>",
    check_url: |text| dir_of(text).map(drop),
    open: |url, options| {
        Box::pin(async move {
            let dir = dir_of(url.as_str()).map_err(SourceError::Invalid)?;
            Ok(Arc::new(EmbeddedSource::open(&dir, options)?) as Arc<dyn Source>)
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
    SourceUrl::parse(&format!("embedded:{}", dir.display()))
        .expect("an embedded: URL with a directory is valid")
}

pub struct EmbeddedSource {
    file: Arc<File>,
    tables: Arc<Tables>,
    options: SourceOptions,
}

/// The names of one queue's tables.
struct Tables {
    ready: String,
    leased: String,
    acked: String,
}

/// One open redb file and its writer thread, shared by every source on the
/// directory in this process.
struct File {
    db: Arc<Database>,
    calls: Option<mpsc::Sender<Call>>,
    writer: Option<JoinHandle<()>>,
}

impl Drop for File {
    /// Stops the writer (which writes what it holds in memory, durably) and
    /// waits for it, so that the file is closed when the last source on it
    /// is gone and can be opened again at once, by this process or another.
    fn drop(&mut self) {
        drop(self.calls.take());
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

fn store_error(e: impl std::fmt::Display) -> SourceError {
    SourceError::Broker(format!("embedded queue: {e}"))
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

/// One handle per file per process.
fn shared_file(dir: &Path) -> Result<Arc<File>, SourceError> {
    static OPEN: OnceLock<Mutex<HashMap<PathBuf, Weak<File>>>> = OnceLock::new();
    std::fs::create_dir_all(dir).map_err(|e| {
        SourceError::Invalid(format!(
            "cannot create the embedded queue directory {}: {e}",
            dir.display()
        ))
    })?;
    let path = dir
        .canonicalize()
        .map_err(|e| SourceError::Invalid(format!("{}: {e}", dir.display())))?
        .join("courier.redb");
    let mut open = OPEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(file) = open.get(&path).and_then(Weak::upgrade) {
        return Ok(file);
    }
    // A handle of this process that was just dropped may still be closing
    // the file on another thread; give it a moment before calling the file
    // another process's.
    let mut tries = 0;
    let db = loop {
        match redb::Builder::new()
            .set_cache_size(CACHE_BYTES)
            .create(&path)
        {
            Ok(db) => break db,
            Err(redb::DatabaseError::DatabaseAlreadyOpen) if tries < 40 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
                return Err(SourceError::Invalid(format!(
                    "the embedded queue {} is open in another process; an embedded queue serves one process at a time (stop the other courier first)",
                    path.display()
                )));
            }
            Err(other) => return Err(store_error(other)),
        }
    };
    let db = Arc::new(db);
    let (calls, inbox) = mpsc::channel();
    let writer = Writer {
        db: db.clone(),
        waiting: Vec::new(),
        queues: HashMap::new(),
        dirty_since: None,
    };
    let writer = std::thread::Builder::new()
        .name("courier-embedded".into())
        .spawn(move || writer.run(inbox))
        .map_err(store_error)?;
    let file = Arc::new(File {
        db,
        calls: Some(calls),
        writer: Some(writer),
    });
    open.insert(path, Arc::downgrade(&file));
    Ok(file)
}

impl EmbeddedSource {
    pub fn open(dir: &Path, options: SourceOptions) -> Result<Self, SourceError> {
        let file = shared_file(dir)?;
        let tables = Tables {
            ready: format!("ready/{}", options.queue),
            leased: format!("leased/{}", options.queue),
            acked: format!("acked/{}", options.queue),
        };
        create_tables(&file.db, &tables, &dlq_table(&options.dead_letter_queue))?;
        Ok(Self {
            file,
            tables: Arc::new(tables),
            options,
        })
    }

    /// Hands `call` to the writer and waits for its answer.
    async fn call<T>(&self, call: impl FnOnce(Reply<T>) -> Call) -> Result<T, SourceError> {
        let (reply, answer) = oneshot::channel();
        self.file
            .calls
            .as_ref()
            .ok_or_else(writer_gone)?
            .send(call(reply))
            .map_err(|_| writer_gone())?;
        answer.await.map_err(|_| writer_gone())?
    }

    async fn settle(&self, delivery: &Delivery, then: Then) -> Result<(), SourceError> {
        let key = parse_receipt(&delivery.receipt)?;
        let tables = self.tables.clone();
        self.call(|reply| {
            Call::Change(Change::Settle {
                tables,
                key,
                then,
                reply,
            })
        })
        .await
    }

    /// A change that is not on the hot path, in the writer's next
    /// transaction. `work` must write nothing when it returns
    /// [`SourceError::Invalid`]; any other error aborts the transaction.
    async fn write(
        &self,
        durable: bool,
        work: impl FnOnce(&WriteTransaction, &Tables) -> Result<(), SourceError> + Send + 'static,
    ) -> Result<(), SourceError> {
        let tables = self.tables.clone();
        self.call(|reply| {
            Call::Change(Change::Write {
                work: Some(Box::new(move |tx| work(tx, &tables))),
                durable,
                reply,
            })
        })
        .await
    }

    /// Runs `f` with a read transaction on the blocking pool; reads see what
    /// the writer committed, durable or not.
    async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&redb::ReadTransaction, &Tables) -> Result<T, SourceError> + Send + 'static,
    ) -> Result<T, SourceError> {
        let (file, tables) = (self.file.clone(), self.tables.clone());
        tokio::task::spawn_blocking(move || {
            let tx = file.db.begin_read().map_err(store_error)?;
            f(&tx, &tables)
        })
        .await
        .map_err(|e| store_error(format!("worker failed: {e}")))?
    }
}

/// Creates the queue's tables, so that a read before the first write works.
/// Checked with a read first: opening a source on an existing queue (every
/// `courier send`, `courier dlq`) then writes nothing.
fn create_tables(db: &Database, tables: &Tables, dlq: &str) -> Result<(), SourceError> {
    let names = [tables.ready.as_str(), tables.leased.as_str(), dlq];
    let present = {
        let tx = db.begin_read().map_err(store_error)?;
        let mut present = 0;
        for table in tx.list_tables().map_err(store_error)? {
            if names.contains(&table.name()) {
                present += 1;
            }
        }
        present
    };
    if present == names.len() {
        return Ok(());
    }
    let tx = db.begin_write().map_err(store_error)?;
    tx.open_table(QueueTable::new(&tables.ready))
        .map_err(store_error)?;
    tx.open_table(QueueTable::new(&tables.leased))
        .map_err(store_error)?;
    tx.open_table(DlqTable::new(dlq)).map_err(store_error)?;
    tx.open_table(META).map_err(store_error)?;
    tx.commit().map_err(store_error)
}

fn dlq_table(name: &str) -> String {
    format!("dlq/{name}")
}

// === The writer ===

type Reply<T> = oneshot::Sender<Result<T, SourceError>>;
type Work = Box<dyn FnOnce(&WriteTransaction) -> Result<(), SourceError> + Send>;

/// What callers ask the writer for.
enum Call {
    Lease(Lease),
    Ack(Ack),
    Change(Change),
    Depth {
        tables: Arc<Tables>,
        dlq: String,
        reply: Reply<Depth>,
    },
}

/// An ack of the lease a receipt names.
struct Ack {
    tables: Arc<Tables>,
    key: (u64, u64),
    reply: Reply<()>,
}

/// A receive: answered with what is due, or kept waiting until something is
/// or `deadline` passes.
struct Lease {
    tables: Arc<Tables>,
    max: usize,
    visibility: u64,
    deadline: Instant,
    /// When the writer tries it again if nothing else happens first.
    next_try: Instant,
    reply: Reply<Vec<Delivery>>,
}

/// A call that writes, answered once its transaction is committed.
enum Change {
    Send {
        tables: Arc<Tables>,
        data: Vec<u8>,
        reply: Reply<u64>,
    },
    /// Ends a lease with a retry or a dead letter.
    Settle {
        tables: Arc<Tables>,
        key: (u64, u64),
        then: Then,
        reply: Reply<()>,
    },
    Write {
        work: Option<Work>,
        durable: bool,
        reply: Reply<()>,
    },
    /// Writes what is held in memory and makes everything durable.
    Flush { reply: Reply<()> },
}

impl Change {
    /// Whether the caller hears back only once the change is durable:
    /// everything that creates a message or moves it somewhere new.
    fn durable(&self) -> bool {
        match self {
            Self::Send { .. } | Self::Settle { .. } | Self::Flush { .. } => true,
            Self::Write { durable, .. } => *durable,
        }
    }

    fn answer(self, result: Result<Outcome, SourceError>) {
        match self {
            Self::Send { reply, .. } => {
                let _ = reply.send(result.and_then(|o| match o {
                    Outcome::Seq(seq) => Ok(seq),
                    Outcome::Unit(r) => r.and(Err(store_error("a send came back without an id"))),
                }));
            }
            Self::Settle { reply, .. } | Self::Write { reply, .. } | Self::Flush { reply } => {
                let _ = reply.send(result.and_then(|o| match o {
                    Outcome::Unit(r) => r,
                    Outcome::Seq(_) => Ok(()),
                }));
            }
        }
    }
}

/// What settling a lease that is still held does besides ending it.
enum Then {
    Retry { at: u64, data: Vec<u8> },
    DeadLetter { table: String, data: Vec<u8> },
}

/// What one change came to inside the transaction, to answer once it
/// commits.
enum Outcome {
    Seq(u64),
    /// Ok, or the change's own error, which wrote nothing.
    Unit(Result<(), SourceError>),
}

/// What the writer knows about one queue beyond what its tables say.
struct Overlay {
    tables: Arc<Tables>,
    /// Handed out from `ready` and not yet settled nor moved to `leased`, by
    /// seq. Their rows are still in `ready`.
    held: HashMap<u64, Held>,
    /// Rows of `ready` that are no longer there for new receives: those of
    /// `held`, and those in `acked_ready`.
    taken: HashSet<(u64, u64)>,
    /// Rows of `ready` whose message was acked while held: to delete.
    acked_ready: Vec<(u64, u64)>,
    /// Rows of `leased` whose message was acked: to delete.
    acked_leased: HashSet<(u64, u64)>,
    /// Every row of `ready` up to this key is taken (or deleted), so a
    /// receive reads on from here instead of skipping them all again.
    /// Anything that may store a row below it forgets it.
    cursor: Option<(u64, u64)>,
}

/// A message handed out from `ready`, not yet written to `leased`.
struct Held {
    ready_key: (u64, u64),
    /// The lease's end, as in the receipt.
    until: u64,
    /// What `leased` will hold: the record with its delivery counted.
    record: Vec<u8>,
}

impl Overlay {
    fn new(tables: Arc<Tables>) -> Self {
        Self {
            tables,
            held: HashMap::new(),
            taken: HashSet::new(),
            acked_ready: Vec::new(),
            acked_leased: HashSet::new(),
            cursor: None,
        }
    }

    /// Nothing here that the tables do not say already.
    fn is_clean(&self) -> bool {
        self.held.is_empty() && self.acked_ready.is_empty() && self.acked_leased.is_empty()
    }

    /// The ready row of a held lease that `key` (a receipt) names.
    fn held_row(&self, key: (u64, u64)) -> Option<(u64, u64)> {
        self.held
            .get(&key.1)
            .filter(|h| h.until == key.0)
            .map(|h| h.ready_key)
    }
}

/// What trying one receive came to.
#[derive(Default)]
struct Leased {
    deliveries: Vec<Delivery>,
    /// Some were leases that had run out (see [`FLUSH_EVERY`]).
    retaken: bool,
}

struct Writer {
    db: Arc<Database>,
    /// Receives that found nothing, oldest first.
    waiting: Vec<Lease>,
    /// By `ready` table name.
    queues: HashMap<String, Overlay>,
    /// When the first change not yet durable was made (in memory or by a
    /// commit without fsync).
    dirty_since: Option<Instant>,
}

impl Writer {
    fn run(mut self, inbox: mpsc::Receiver<Call>) {
        loop {
            let mut calls = Vec::new();
            let wake = self.next_wake();
            let first = match wake {
                None => inbox.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(at) => inbox.recv_timeout(at.saturating_duration_since(Instant::now())),
            };
            match first {
                Ok(call) => calls.push(call),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            while calls.len() < MAX_BATCH {
                match inbox.try_recv() {
                    Ok(call) => calls.push(call),
                    Err(_) => break,
                }
            }
            self.batch(calls);
        }
        // Every source on the file is gone: nobody waits any more, and what
        // is held in memory is written, durably, before the file closes.
        for lease in self.waiting.drain(..) {
            let _ = lease.reply.send(Ok(Vec::new()));
        }
        if self.dirty_since.is_some() || !self.queues.values().all(Overlay::is_clean) {
            let (reply, _) = oneshot::channel();
            self.batch(vec![Call::Change(Change::Flush { reply })]);
        }
    }

    fn next_wake(&self) -> Option<Instant> {
        let flush = self.dirty_since.map(|t| t + FLUSH_EVERY);
        let lease = self.waiting.iter().map(|l| l.next_try).min();
        flush.into_iter().chain(lease).min()
    }

    /// An empty transaction, fsynced: makes what was committed without
    /// fsync durable.
    fn commit_durable(&self) -> Result<(), SourceError> {
        let tx = self.db.begin_write().map_err(store_error)?;
        tx.commit().map_err(store_error)
    }

    /// After a durable commit, which wrote everything held before it: what
    /// is left in memory was done since.
    fn durable_at(&mut self, now: Instant) {
        self.dirty_since = if self.queues.values().all(Overlay::is_clean) {
            None
        } else {
            Some(now)
        };
    }

    /// Everything at hand: acks in memory; one transaction for the changes,
    /// the removals held back, leases that ran out and (when due) the held
    /// leases; then the receives; then depth reads.
    fn batch(&mut self, calls: Vec<Call>) {
        let now = Instant::now();
        let mut leases = std::mem::take(&mut self.waiting);
        let mut changes = Vec::new();
        let mut acks = Vec::new();
        let mut depths = Vec::new();
        for call in calls {
            match call {
                Call::Lease(lease) if lease.max == 0 => {
                    let _ = lease.reply.send(Ok(Vec::new()));
                }
                Call::Lease(lease) => leases.push(lease),
                Call::Ack(ack) => acks.push(ack),
                Call::Change(change) => changes.push(change),
                Call::Depth { tables, dlq, reply } => depths.push((tables, dlq, reply)),
            }
        }
        if !acks.is_empty() {
            self.ack(acks, now);
        }
        let flush = self.dirty_since.is_some_and(|t| now >= t + FLUSH_EVERY)
            || changes.iter().any(|c| matches!(c, Change::Flush { .. }));
        let write = flush || !changes.is_empty() || self.must_retake(&leases, now);
        // Waiting receives are tried when their time comes, and after a
        // transaction, which may have made something due.
        let (tried, not_yet): (Vec<_>, Vec<_>) =
            leases.into_iter().partition(|l| write || l.next_try <= now);
        self.waiting = not_yet;
        if write {
            self.write(changes, tried, flush, now);
        } else if !tried.is_empty() {
            let tried = tried.into_iter().map(|l| (l, Leased::default())).collect();
            if let Some(late) = self.serve(tried, now) {
                answer_leases(late, Ok(()));
            }
        }
        for (tables, dlq, reply) in depths {
            let _ = reply.send(self.depth(&tables, &dlq));
        }
    }

    /// Acks in memory: a held lease's row in `ready`, or a `leased` row, is
    /// marked for removal. An ack for a lease that is no longer held (it ran
    /// out, and a newer delivery will settle the message) changes nothing.
    fn ack(&mut self, acks: Vec<Ack>, now: Instant) {
        let mut in_leased = Vec::new();
        let mut changed = false;
        for ack in acks {
            let overlay = overlay_of(&mut self.queues, &ack.tables);
            match overlay.held_row(ack.key) {
                Some(row) => {
                    overlay.held.remove(&ack.key.1);
                    overlay.acked_ready.push(row);
                    changed = true;
                    let _ = ack.reply.send(Ok(()));
                }
                None => in_leased.push(ack),
            }
        }
        if !in_leased.is_empty() {
            let stored = self.db.begin_read().map_err(store_error).and_then(|tx| {
                in_leased
                    .iter()
                    .map(|ack| {
                        let leased = tx
                            .open_table(QueueTable::new(&ack.tables.leased))
                            .map_err(store_error)?;
                        Ok(leased.get(ack.key).map_err(store_error)?.is_some())
                    })
                    .collect::<Result<Vec<bool>, SourceError>>()
            });
            match stored {
                Ok(stored) => {
                    for (ack, stored) in in_leased.into_iter().zip(stored) {
                        if stored {
                            overlay_of(&mut self.queues, &ack.tables)
                                .acked_leased
                                .insert(ack.key);
                            changed = true;
                        }
                        let _ = ack.reply.send(Ok(()));
                    }
                }
                Err(e) => {
                    for ack in in_leased {
                        let _ = ack.reply.send(Err(e.clone()));
                    }
                }
            }
        }
        if changed {
            self.dirty_since.get_or_insert(now);
        }
    }

    /// Whether a receive that will be tried finds a lease that ran out,
    /// which takes a transaction to hand out again.
    fn must_retake(&self, leases: &[Lease], now: Instant) -> bool {
        let due: Vec<&Lease> = leases.iter().filter(|l| l.next_try <= now).collect();
        if due.is_empty() {
            return false;
        }
        let Ok(tx) = self.db.begin_read() else {
            // The transaction will fail the same way, and say why.
            return true;
        };
        let now_ms = now_ms();
        due.iter().any(|lease| {
            let acked = self
                .queues
                .get(&lease.tables.ready)
                .map(|o| &o.acked_leased);
            tx.open_table(QueueTable::new(&lease.tables.leased))
                .ok()
                .and_then(|leased| leased.range((0, 0)..=(now_ms, u64::MAX)).ok())
                .is_some_and(|mut rows| {
                    rows.any(|row| {
                        row.is_ok_and(|(k, _)| !acked.is_some_and(|a| a.contains(&k.value())))
                    })
                })
        })
    }

    /// One transaction: the removals held back, `changes`, the leases that
    /// ran out for the receives in `tried`, and with `flush` the held leases
    /// written to `leased` and an fsync. Then the receives are served.
    fn write(&mut self, mut changes: Vec<Change>, tried: Vec<Lease>, flush: bool, now: Instant) {
        let now_ms = now_ms();
        let tx = match self.db.begin_write() {
            Ok(tx) => tx,
            Err(e) => return fail(changes, tried, store_error(e)),
        };
        let mut outcomes = Vec::with_capacity(changes.len());
        let mut leased = Vec::with_capacity(tried.len());
        let mut durable = flush || changes.iter().any(Change::durable);
        let applied = (|| {
            for overlay in self.queues.values_mut() {
                write_removals(&tx, overlay)?;
            }
            for change in &mut changes {
                outcomes.push(apply(&tx, change, &mut self.queues, now_ms)?);
            }
            for lease in &tried {
                let l = retake(&tx, lease, now_ms)?;
                durable |= l.retaken;
                leased.push(l);
            }
            // An fsync is paid anyway: it takes what is held along, and
            // while sends keep coming no flush needs one of its own.
            if durable {
                for overlay in self.queues.values_mut() {
                    write_held(&tx, overlay)?;
                }
            }
            Ok(())
        })();
        if let Err(e) = applied {
            // The overlay may already say what the aborted transaction did;
            // the worst that leaves is a message handed out twice, once the
            // cursors no longer skip rows it still has.
            forget_cursors(&mut self.queues);
            return fail(changes, tried, e);
        }
        // With receives to serve, commit without fsync, serve them, then
        // fsync: a message may so reach the app before its send is durable.
        // That is fine: the send has not returned yet, and a crash takes the
        // message and its hand-out back together.
        let split = durable && !tried.is_empty();
        let mut tx = tx;
        let committed = if durable && !split {
            Ok(())
        } else {
            tx.set_durability(Durability::None).map_err(store_error)
        }
        .and_then(|()| tx.commit().map_err(store_error));
        if let Err(e) = committed {
            forget_cursors(&mut self.queues);
            return fail(changes, tried, e);
        }
        if durable && !split {
            self.durable_at(now);
        } else {
            self.dirty_since.get_or_insert(now);
        }
        let mut changes: Vec<_> = changes.into_iter().zip(outcomes).collect();
        if !split {
            for (change, outcome) in changes.drain(..) {
                change.answer(Ok(outcome));
            }
        } else {
            let (early, late): (Vec<_>, Vec<_>) =
                changes.into_iter().partition(|(c, _)| !c.durable());
            for (change, outcome) in early {
                change.answer(Ok(outcome));
            }
            changes = late;
        }
        let late = self.serve(tried.into_iter().zip(leased).collect(), now);
        let result = if split {
            let result = self.commit_durable();
            if result.is_ok() {
                self.durable_at(now);
            }
            result
        } else {
            Ok(())
        };
        for (change, outcome) in changes {
            change.answer(result.clone().map(|()| outcome));
        }
        if let Some(late) = late {
            answer_leases(late, result);
        }
    }

    /// Hands out due messages to the receives in `tried` (which may already
    /// hold leases taken back in the transaction), answers them, keeps those
    /// that found nothing waiting, and returns those that must wait for the
    /// fsync.
    fn serve(&mut self, tried: Vec<(Lease, Leased)>, now: Instant) -> Option<Vec<(Lease, Leased)>> {
        let now_ms = now_ms();
        let tx = match self.db.begin_read() {
            Ok(tx) => tx,
            Err(e) => {
                answer_leases(tried, Err(store_error(e)));
                return None;
            }
        };
        let mut late = Vec::new();
        for (mut lease, mut leased) in tried {
            let overlay = overlay_of(&mut self.queues, &lease.tables);
            let room = lease.max.saturating_sub(leased.deliveries.len());
            let fresh = tx
                .open_table(QueueTable::new(&lease.tables.ready))
                .map_err(store_error)
                .and_then(|ready| hand_out(&ready, overlay, &lease, now_ms, room));
            match fresh {
                Ok(fresh) if !fresh.is_empty() => {
                    leased.deliveries.extend(fresh);
                    self.dirty_since.get_or_insert(now);
                }
                Ok(_) => {}
                Err(e) => {
                    let _ = lease.reply.send(Err(e));
                    continue;
                }
            }
            if !leased.deliveries.is_empty() {
                if leased.retaken {
                    late.push((lease, leased));
                } else {
                    let _ = lease.reply.send(Ok(leased.deliveries));
                }
            } else if lease.deadline <= now {
                let _ = lease.reply.send(Ok(Vec::new()));
            } else {
                let due = next_due(&tx, overlay).ok().flatten().map(|due| {
                    let wait = due.saturating_sub(now_ms).max(1);
                    now + Duration::from_millis(wait)
                });
                lease.next_try = due
                    .unwrap_or(lease.deadline)
                    .min(lease.deadline)
                    .min(now + FALLBACK_POLL);
                self.waiting.push(lease);
            }
        }
        (!late.is_empty()).then_some(late)
    }

    /// The queue's depth as this process knows it: the tables, less what is
    /// held or acked in memory.
    fn depth(&self, tables: &Tables, dlq: &str) -> Result<Depth, SourceError> {
        let tx = self.db.begin_read().map_err(store_error)?;
        let now = now_ms();
        let ready = tx
            .open_table(QueueTable::new(&tables.ready))
            .map_err(store_error)?;
        let leased = tx
            .open_table(QueueTable::new(&tables.leased))
            .map_err(store_error)?;
        let dlq = tx.open_table(DlqTable::new(dlq)).map_err(store_error)?;
        // Counts the retries scheduled for later, not the due messages:
        // during a drain there are none, where a backlog can be large.
        let later = ready.range((now + 1, 0)..).map_err(store_error)?.count() as u64;
        let total = ready.len().map_err(store_error)?;
        let (taken, held, acked_leased) = self.queues.get(&tables.ready).map_or((0, 0, 0), |o| {
            (o.taken.len(), o.held.len(), o.acked_leased.len())
        });
        let oldest = match dlq.first().map_err(store_error)? {
            Some((_, v)) => decode_fields(&Bytes::copy_from_slice(v.value()))
                .and_then(|f| {
                    let at = f
                        .iter()
                        .find(|(n, _)| n.as_ref() == crate::model::F_LAST_ATTEMPT_AT.as_bytes())?;
                    crate::model::parse_time(&at.1)
                })
                .map(|t| SystemTime::now().duration_since(t).unwrap_or_default()),
            None => None,
        };
        Ok(Depth {
            ready: total.saturating_sub(later + taken as u64),
            pending: (leased.len().map_err(store_error)? + held as u64)
                .saturating_sub(acked_leased as u64),
            retry_backlog: later,
            dead_letters: dlq.len().map_err(store_error)?,
            oldest_dead_letter_age: oldest,
        })
    }
}

fn overlay_of<'a>(
    queues: &'a mut HashMap<String, Overlay>,
    tables: &Arc<Tables>,
) -> &'a mut Overlay {
    queues
        .entry(tables.ready.clone())
        .or_insert_with(|| Overlay::new(tables.clone()))
}

/// Tells every call of a batch that could not commit why.
fn fail(changes: Vec<Change>, leases: Vec<Lease>, e: SourceError) {
    for change in changes {
        change.answer(Err(e.clone()));
    }
    for lease in leases {
        let _ = lease.reply.send(Err(e.clone()));
    }
}

fn answer_leases(leases: Vec<(Lease, Leased)>, result: Result<(), SourceError>) {
    for (lease, leased) in leases {
        let _ = lease.reply.send(result.clone().map(|()| leased.deliveries));
    }
}

/// Deletes the rows acks made obsolete.
fn write_removals(tx: &WriteTransaction, overlay: &mut Overlay) -> Result<(), SourceError> {
    if !overlay.acked_ready.is_empty() {
        let mut ready = tx
            .open_table(QueueTable::new(&overlay.tables.ready))
            .map_err(store_error)?;
        for row in overlay.acked_ready.drain(..) {
            ready.remove(row).map_err(store_error)?;
            overlay.taken.remove(&row);
        }
    }
    if !overlay.acked_leased.is_empty() {
        let mut leased = tx
            .open_table(QueueTable::new(&overlay.tables.leased))
            .map_err(store_error)?;
        for row in overlay.acked_leased.drain() {
            leased.remove(row).map_err(store_error)?;
        }
    }
    Ok(())
}

/// Moves the held leases from `ready` to `leased`, with their delivery
/// counted, where a restart finds them.
fn write_held(tx: &WriteTransaction, overlay: &mut Overlay) -> Result<(), SourceError> {
    if overlay.held.is_empty() {
        return Ok(());
    }
    let mut ready = tx
        .open_table(QueueTable::new(&overlay.tables.ready))
        .map_err(store_error)?;
    let mut leased = tx
        .open_table(QueueTable::new(&overlay.tables.leased))
        .map_err(store_error)?;
    for (seq, held) in overlay.held.drain() {
        ready.remove(held.ready_key).map_err(store_error)?;
        overlay.taken.remove(&held.ready_key);
        leased
            .insert((held.until, seq), held.record.as_slice())
            .map_err(store_error)?;
    }
    Ok(())
}

/// Applies one change inside the batch's transaction; an error aborts the
/// batch.
fn apply(
    tx: &WriteTransaction,
    change: &mut Change,
    queues: &mut HashMap<String, Overlay>,
    now_ms: u64,
) -> Result<Outcome, SourceError> {
    match change {
        Change::Send { tables, data, .. } => {
            let seq = next_seq(tx)?;
            stored_ready(queues, tables, (now_ms, seq));
            tx.open_table(QueueTable::new(&tables.ready))
                .map_err(store_error)?
                .insert((now_ms, seq), data.as_slice())
                .map_err(store_error)?;
            Ok(Outcome::Seq(seq))
        }
        Change::Settle {
            tables, key, then, ..
        } => {
            // A lease still held in memory has its row in `ready`; else it
            // is in `leased`, unless it ran out and was handed out again,
            // and then the newer delivery settles the message.
            let overlay = queues.get_mut(&tables.ready);
            let row = overlay.as_ref().and_then(|o| o.held_row(*key));
            let held = match (row, overlay) {
                (Some(row), Some(overlay)) => {
                    overlay.held.remove(&key.1);
                    overlay.taken.remove(&row);
                    tx.open_table(QueueTable::new(&tables.ready))
                        .map_err(store_error)?
                        .remove(row)
                        .map_err(store_error)?
                        .is_some()
                }
                _ => tx
                    .open_table(QueueTable::new(&tables.leased))
                    .map_err(store_error)?
                    .remove(*key)
                    .map_err(store_error)?
                    .is_some(),
            };
            if held {
                match then {
                    Then::Retry { at, data } => {
                        stored_ready(queues, tables, (*at, key.1));
                        tx.open_table(QueueTable::new(&tables.ready))
                            .map_err(store_error)?
                            .insert((*at, key.1), data.as_slice())
                            .map_err(store_error)?;
                    }
                    Then::DeadLetter { table, data } => {
                        let id = next_seq(tx)?;
                        tx.open_table(DlqTable::new(table))
                            .map_err(store_error)?
                            .insert(id, data.as_slice())
                            .map_err(store_error)?;
                    }
                }
            }
            Ok(Outcome::Unit(Ok(())))
        }
        Change::Write { work, .. } => match work.take().map(|work| {
            // It may store anything anywhere.
            forget_cursors(queues);
            work(tx)
        }) {
            Some(Err(e @ SourceError::Invalid(_))) => Ok(Outcome::Unit(Err(e))),
            Some(Err(e)) => Err(e),
            Some(Ok(())) | None => Ok(Outcome::Unit(Ok(()))),
        },
        Change::Flush { .. } => Ok(Outcome::Unit(Ok(()))),
    }
}

/// A row is about to be stored in `ready`: a cursor past it must go.
fn stored_ready(queues: &mut HashMap<String, Overlay>, tables: &Tables, key: (u64, u64)) {
    if let Some(overlay) = queues.get_mut(&tables.ready)
        && overlay.cursor.is_some_and(|cursor| cursor >= key)
    {
        overlay.cursor = None;
    }
}

fn forget_cursors(queues: &mut HashMap<String, Overlay>) {
    for overlay in queues.values_mut() {
        overlay.cursor = None;
    }
}

/// Takes back up to `lease.max` leases that ran out, oldest first, and
/// leases them again until `now + visibility`.
fn retake(tx: &WriteTransaction, lease: &Lease, now: u64) -> Result<Leased, SourceError> {
    let until = now + lease.visibility;
    let mut leased = tx
        .open_table(QueueTable::new(&lease.tables.leased))
        .map_err(store_error)?;
    let expired: Vec<((u64, u64), Vec<u8>)> = leased
        .range((0, 0)..=(now, u64::MAX))
        .map_err(store_error)?
        .take(lease.max)
        .map(|row| row.map(|(k, v)| (k.value(), v.value().to_vec())))
        .collect::<Result<_, _>>()
        .map_err(store_error)?;
    let mut deliveries = Vec::with_capacity(expired.len());
    for (key, data) in expired {
        leased.remove(key).map_err(store_error)?;
        let (delivery, record) = deliver(key.1, Bytes::from(data), until);
        leased
            .insert((until, key.1), record.as_slice())
            .map_err(store_error)?;
        deliveries.push(delivery);
    }
    Ok(Leased {
        retaken: !deliveries.is_empty(),
        deliveries,
    })
}

/// Hands out up to `room` due messages of `ready` that are not taken, and
/// notes them as held.
fn hand_out(
    ready: &impl ReadableTable<(u64, u64), &'static [u8]>,
    overlay: &mut Overlay,
    lease: &Lease,
    now: u64,
    room: usize,
) -> Result<Vec<Delivery>, SourceError> {
    let mut out = Vec::new();
    if room == 0 {
        return Ok(out);
    }
    let until = now + lease.visibility;
    let from = match overlay.cursor {
        Some(cursor) => Bound::Excluded(cursor),
        None => Bound::Unbounded,
    };
    for row in ready
        .range::<(u64, u64)>((from, Bound::Included((now, u64::MAX))))
        .map_err(store_error)?
    {
        let (key, data) = row.map_err(store_error)?;
        let key = key.value();
        // Every row passed is taken, before or now.
        overlay.cursor = Some(key);
        if overlay.taken.contains(&key) {
            continue;
        }
        let (delivery, record) = deliver(key.1, Bytes::copy_from_slice(data.value()), until);
        overlay.taken.insert(key);
        overlay.held.insert(
            key.1,
            Held {
                ready_key: key,
                until,
                record,
            },
        );
        out.push(delivery);
        if out.len() == room {
            break;
        }
    }
    Ok(out)
}

/// A delivery of the stored message `seq` under a lease until `until`, and
/// the record its lease stores: the message with this delivery counted.
fn deliver(seq: u64, stored: Bytes, until: u64) -> (Delivery, Vec<u8>) {
    let receipt = format!("{until}:{seq}");
    match decode_fields(&stored) {
        Some(mut fields) => {
            let earlier = take_deliveries(&mut fields);
            fields.push((F_DELIVERIES.into(), Bytes::from((earlier + 1).to_string())));
            let record = encode_fields(&fields);
            let delivery = Delivery::from_fields(&seq.to_string(), fields, earlier, receipt);
            (delivery, record)
        }
        // A record that cannot be read (a bug, a disk fault, a tool that
        // wrote the wrong bytes) must not stop the queue behind it: it is
        // handed out as undeliverable, with its raw bytes as the body, so it
        // is dead-lettered with the reason and can be inspected.
        None => {
            let mut delivery = Delivery::from_fields(
                &seq.to_string(),
                vec![(PAYLOAD.into(), stored.clone())],
                0,
                receipt,
            );
            delivery.problem = Some(format!(
                "message {seq} is stored in a form that cannot be read ({} bytes); its raw bytes are kept as the body",
                stored.len()
            ));
            (delivery, stored.to_vec())
        }
    }
}

/// When something of the queue falls due next (a scheduled retry, a lease
/// running out), in ms.
fn next_due(tx: &redb::ReadTransaction, overlay: &Overlay) -> Result<Option<u64>, SourceError> {
    let ready = tx
        .open_table(QueueTable::new(&overlay.tables.ready))
        .map_err(store_error)?;
    let leased = tx
        .open_table(QueueTable::new(&overlay.tables.leased))
        .map_err(store_error)?;
    let from = match overlay.cursor {
        Some(cursor) => Bound::Excluded(cursor),
        None => Bound::Unbounded,
    };
    let mut first = None;
    for row in ready
        .range::<(u64, u64)>((from, Bound::Unbounded))
        .map_err(store_error)?
    {
        let key = row.map_err(store_error)?.0.value();
        if !overlay.taken.contains(&key) {
            first = Some(key.0);
            break;
        }
    }
    for row in leased.iter().map_err(store_error)? {
        let key = row.map_err(store_error)?.0.value();
        if !overlay.acked_leased.contains(&key) {
            first = Some(first.map_or(key.0, |f: u64| f.min(key.0)));
            break;
        }
    }
    Ok(first)
}

fn next_seq(tx: &WriteTransaction) -> Result<u64, SourceError> {
    let mut meta = tx.open_table(META).map_err(store_error)?;
    let seq = meta
        .get(SEQ)
        .map_err(store_error)?
        .map(|v| v.value())
        .unwrap_or(0)
        + 1;
    meta.insert(SEQ, seq).map_err(store_error)?;
    Ok(seq)
}

/// Removes the `courier-deliveries` field and returns its value.
fn take_deliveries(fields: &mut Vec<(Bytes, Bytes)>) -> u32 {
    let mut count = 0;
    fields.retain(|(name, value)| {
        if name.as_ref() == F_DELIVERIES.as_bytes() {
            count = std::str::from_utf8(value)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            false
        } else {
            true
        }
    });
    count
}

fn not_there(table: &str, id: u64) -> SourceError {
    shared::not_there(table.trim_start_matches("dlq/"), &id.to_string())
}

fn parse_dead_letter_id(id: &str) -> Result<u64, SourceError> {
    id.parse().map_err(|_| {
        SourceError::Invalid(format!(
            "{id:?} is not a dead-letter id of the embedded queue (a number)"
        ))
    })
}

fn parse_receipt(receipt: &str) -> Result<(u64, u64), SourceError> {
    receipt
        .split_once(':')
        .and_then(|(until, seq)| Some((until.parse().ok()?, seq.parse().ok()?)))
        .ok_or_else(|| store_error(format!("bad receipt {receipt:?}")))
}

#[async_trait]
impl Source for EmbeddedSource {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            per_message_delay: true,
            out_of_order_acks: true,
            dead_letter_browsing: true,
            dedup: true,
            byte_bounded_reads: false,
        }
    }

    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        let now = Instant::now();
        let tables = self.tables.clone();
        let visibility = self.options.visibility_timeout.as_millis() as u64;
        self.call(|reply| {
            Call::Lease(Lease {
                tables,
                max,
                visibility,
                deadline: now + RECEIVE_WAIT,
                next_try: now,
                reply,
            })
        })
        .await
    }

    /// Noted in memory and answered at once; see [`FLUSH_EVERY`].
    async fn ack(&self, delivery: &Delivery) -> Result<(), SourceError> {
        let key = parse_receipt(&delivery.receipt)?;
        let tables = self.tables.clone();
        self.call(|reply| Call::Ack(Ack { tables, key, reply }))
            .await
    }

    async fn retry(
        &self,
        delivery: &Delivery,
        next_attempt: u32,
        first_attempt_at: SystemTime,
        at: SystemTime,
    ) -> Result<(), SourceError> {
        let data = encode_fields(&delivery.fields_for_retry(next_attempt, first_attempt_at));
        self.settle(delivery, Then::Retry { at: ms(at), data })
            .await
    }

    async fn dead_letter(&self, delivery: &Delivery, failure: &Failure) -> Result<(), SourceError> {
        let mut fields = delivery.fields_for_dead_letter(failure);
        if !fields.iter().any(|(n, _)| n.as_ref() == PAYLOAD.as_bytes()) {
            fields.insert(0, (PAYLOAD.into(), Bytes::new()));
        }
        let then = Then::DeadLetter {
            table: dlq_table(&failure.dead_letter_queue),
            data: encode_fields(&fields),
        };
        self.settle(delivery, then).await
    }

    async fn depth(&self) -> Result<Depth, SourceError> {
        let tables = self.tables.clone();
        let dlq = dlq_table(&self.options.dead_letter_queue);
        self.call(|reply| Call::Depth { tables, dlq, reply }).await
    }

    async fn dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        let table = dlq_table(dead_letter_queue);
        self.read(move |tx, _| {
            let dlq = match tx.open_table(DlqTable::new(&table)) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(store_error(e)),
            };
            let mut out = Vec::new();
            for row in dlq.iter().map_err(store_error)?.take(limit) {
                let (id, data) = row.map_err(store_error)?;
                let data = Bytes::copy_from_slice(data.value());
                let letter = match decode_fields(&data) {
                    Some(fields) => DeadLetter::from_fields(id.value().to_string(), fields),
                    // Listed with its raw bytes as the body rather than
                    // hiding every other dead letter behind an error.
                    None => {
                        let mut letter = DeadLetter::from_fields(
                            id.value().to_string(),
                            vec![(PAYLOAD.into(), data.clone())],
                        );
                        letter.fields.push((
                            crate::model::F_ERROR.into(),
                            format!(
                                "the stored dead letter cannot be read ({} bytes); its raw bytes are the body",
                                data.len()
                            ),
                        ));
                        letter
                    }
                };
                out.push(letter);
            }
            Ok(out)
        })
        .await
    }

    async fn replay(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let data = encode_fields(&letter.fields_for_replay());
        let (table, id) = (
            dlq_table(dead_letter_queue),
            parse_dead_letter_id(&letter.id)?,
        );
        self.write(true, move |tx, tables| {
            let removed = tx
                .open_table(DlqTable::new(&table))
                .map_err(store_error)?
                .remove(id)
                .map_err(store_error)?
                .is_some();
            if !removed {
                return Err(not_there(&table, id));
            }
            let seq = next_seq(tx)?;
            tx.open_table(QueueTable::new(&tables.ready))
                .map_err(store_error)?
                .insert((now_ms(), seq), data.as_slice())
                .map_err(store_error)?;
            Ok(())
        })
        .await
    }

    async fn purge(&self, dead_letter_queue: &str, letter: &DeadLetter) -> Result<(), SourceError> {
        let (table, id) = (
            dlq_table(dead_letter_queue),
            parse_dead_letter_id(&letter.id)?,
        );
        self.write(true, move |tx, _| {
            let removed = tx
                .open_table(DlqTable::new(&table))
                .map_err(store_error)?
                .remove(id)
                .map_err(store_error)?
                .is_some();
            if removed {
                Ok(())
            } else {
                Err(not_there(&table, id))
            }
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

    async fn send(&self, body: Bytes, headers: &[(String, String)]) -> Result<String, SourceError> {
        let mut fields = vec![(Bytes::from_static(PAYLOAD.as_bytes()), body)];
        fields.extend(
            headers
                .iter()
                .map(|(n, v)| (Bytes::from(n.clone()), Bytes::from(v.clone()))),
        );
        let data = encode_fields(&fields);
        let tables = self.tables.clone();
        let seq = self
            .call(|reply| {
                Call::Change(Change::Send {
                    tables,
                    data,
                    reply,
                })
            })
            .await?;
        Ok(seq.to_string())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn open(dir: &Path) -> EmbeddedSource {
        let mut options = SourceOptions::new("q");
        options.visibility_timeout = Duration::from_secs(30);
        EmbeddedSource::open(dir, options).unwrap()
    }

    /// Stores `data` as the next message, the way a broken writer would.
    fn store_raw(source: &EmbeddedSource, data: &[u8]) -> u64 {
        let tx = source.file.db.begin_write().unwrap();
        let seq = next_seq(&tx).unwrap();
        tx.open_table(QueueTable::new(&source.tables.ready))
            .unwrap()
            .insert((now_ms(), seq), data)
            .unwrap();
        tx.commit().unwrap();
        seq
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreadable_record_is_handed_out_as_undeliverable() {
        let dir = tempfile::tempdir().unwrap();
        let source = open(dir.path());
        let raw = b"\xc1 not a record";
        let seq = store_raw(&source, raw);
        source.send(Bytes::from("good"), &[]).await.unwrap();
        let got = source.receive(10).await.unwrap();
        assert_eq!(got.len(), 2, "{got:?}");
        let (bad, good) = (&got[0], &got[1]);
        assert_eq!(bad.message.id, seq.to_string());
        assert_eq!(bad.message.body.as_ref(), raw, "the raw bytes are the body");
        assert!(
            bad.problem.as_deref().unwrap().contains("cannot be read"),
            "{:?}",
            bad.problem
        );
        assert_eq!(good.message.body, Bytes::from("good"));
        assert!(good.problem.is_none());
        // Both are leased and settle like any delivery.
        assert_eq!(source.depth().await.unwrap().pending, 2);
        source.ack(bad).await.unwrap();
        source.ack(good).await.unwrap();
        assert_eq!(source.depth().await.unwrap().pending, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_send_reaches_a_waiting_receive_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let source = Arc::new(open(dir.path()));
        let waiting = tokio::spawn({
            let source = source.clone();
            async move {
                let got = source.receive(4).await.unwrap();
                (got, Instant::now())
            }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let sent = Instant::now();
        source.send(Bytes::from("x"), &[]).await.unwrap();
        let (got, at) = waiting.await.unwrap();
        assert_eq!(got.len(), 1);
        let took = at.saturating_duration_since(sent);
        assert!(took < Duration::from_millis(150), "took {took:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_retry_reaches_a_waiting_receive_when_due_and_not_before() {
        let dir = tempfile::tempdir().unwrap();
        let source = open(dir.path());
        source.send(Bytes::from("x"), &[]).await.unwrap();
        let first = source.receive(1).await.unwrap().remove(0);
        let delay = Duration::from_millis(300);
        let scheduled = Instant::now();
        source
            .retry(&first, 2, SystemTime::now(), SystemTime::now() + delay)
            .await
            .unwrap();
        let again = source.receive(1).await.unwrap();
        let took = scheduled.elapsed();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].attempt, 2);
        // Due times are whole milliseconds.
        assert!(took + Duration::from_millis(2) >= delay, "early: {took:?}");
        assert!(took < delay + Duration::from_millis(150), "late: {took:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_sends_share_commits_and_get_their_own_ids() {
        let dir = tempfile::tempdir().unwrap();
        let source = Arc::new(open(dir.path()));
        let sends: Vec<_> = (0..200)
            .map(|i| {
                let source = source.clone();
                tokio::spawn(async move { source.send(Bytes::from(format!("{i}")), &[]).await })
            })
            .collect();
        let mut ids = std::collections::HashSet::new();
        for send in sends {
            ids.insert(send.await.unwrap().unwrap());
        }
        assert_eq!(ids.len(), 200);
        assert_eq!(source.depth().await.unwrap().ready, 200);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lease_that_runs_out_is_handed_out_again_as_the_next_attempt() {
        let dir = tempfile::tempdir().unwrap();
        let mut options = SourceOptions::new("q");
        options.visibility_timeout = Duration::from_millis(300);
        let source = EmbeddedSource::open(dir.path(), options).unwrap();
        source.send(Bytes::from("x"), &[]).await.unwrap();
        let first = source.receive(1).await.unwrap().remove(0);
        assert_eq!(first.attempt, 1);
        let again = source.receive(1).await.unwrap();
        assert_eq!(again.len(), 1, "handed out again within the wait");
        assert_eq!(again[0].attempt, 2);
        // The first delivery's lease is gone: settling it changes nothing.
        source.ack(&first).await.unwrap();
        assert_eq!(source.depth().await.unwrap().pending, 1);
        source.ack(&again[0]).await.unwrap();
        let depth = source.depth().await.unwrap();
        assert_eq!((depth.ready, depth.pending), (0, 0), "{depth:?}");
    }

    /// Hand-outs and acks live in memory for a moment; closing the last
    /// source on the file writes them, so a clean restart redelivers nothing
    /// that was acked and keeps what is still leased as leased.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn acks_and_leases_outlive_a_clean_stop() {
        let dir = tempfile::tempdir().unwrap();
        let source = open(dir.path());
        for i in 0..3 {
            source.send(Bytes::from(format!("{i}")), &[]).await.unwrap();
        }
        let got = source.receive(3).await.unwrap();
        source.ack(&got[0]).await.unwrap();
        source.ack(&got[1]).await.unwrap();
        drop(source);
        let source = open(dir.path());
        let depth = source.depth().await.unwrap();
        assert_eq!((depth.ready, depth.pending), (0, 1), "{depth:?}");
    }
}
