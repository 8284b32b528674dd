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
//! A redb file is held by one process at a time; inside a process every
//! source opened on the same directory shares one handle.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};

use super::{
    Batcher, DeadLetter, Delivery, Depth, F_DELIVERIES, Failure, PAYLOAD, Source, SourceError,
    SourceOptions, decode_fields, encode_fields,
};

type QueueTable<'a> = TableDefinition<'a, (u64, u64), &'static [u8]>;
type DlqTable<'a> = TableDefinition<'a, u64, &'static [u8]>;
const META: TableDefinition<'_, &str, u64> = TableDefinition::new("meta");
/// Idempotency key -> ms until which its ack is remembered.
type AckedTable<'a> = TableDefinition<'a, &'static str, u64>;
const SEQ: &str = "seq";
/// How often an idle receive looks again.
const POLL: Duration = Duration::from_millis(20);
/// How long one receive waits when nothing is due.
const WAIT: Duration = Duration::from_secs(1);

pub struct EmbeddedSource {
    store: Arc<Store>,
    acks: Batcher<(u64, u64)>,
}

/// The tables of one queue; its methods are synchronous and run on the
/// blocking pool.
struct Store {
    db: Arc<Database>,
    options: SourceOptions,
    ready: String,
    leased: String,
}

fn store_error(e: impl std::fmt::Display) -> SourceError {
    SourceError::Broker(format!("embedded queue: {e}"))
}

fn now_ms() -> u64 {
    ms(SystemTime::now())
}

fn ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

/// One handle per file per process.
fn shared_database(dir: &Path) -> Result<Arc<Database>, SourceError> {
    static OPEN: OnceLock<Mutex<HashMap<PathBuf, Weak<Database>>>> = OnceLock::new();
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
    if let Some(db) = open.get(&path).and_then(Weak::upgrade) {
        return Ok(db);
    }
    // A handle of this process that was just dropped may still be closing
    // the file (its drop runs on another thread); give it a moment before
    // calling the file another process's.
    let mut tries = 0;
    let db = loop {
        match Database::create(&path) {
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
    open.insert(path, Arc::downgrade(&db));
    Ok(db)
}

impl EmbeddedSource {
    pub fn open(dir: &Path, options: SourceOptions) -> Result<Self, SourceError> {
        let db = shared_database(dir)?;
        let ready = format!("ready/{}", options.queue);
        let leased = format!("leased/{}", options.queue);
        let acks = {
            let db = db.clone();
            let leased = leased.clone();
            Batcher::spawn(512, move |keys: Vec<(u64, u64)>| {
                let (db, leased) = (db.clone(), leased.clone());
                async move {
                    blocking(move || {
                        let tx = db.begin_write().map_err(store_error)?;
                        {
                            let mut table = tx
                                .open_table(QueueTable::new(&leased))
                                .map_err(store_error)?;
                            for key in keys {
                                table.remove(key).map_err(store_error)?;
                            }
                        }
                        tx.commit().map_err(store_error)
                    })
                    .await
                }
            })
        };
        let store = Store {
            db,
            options,
            ready,
            leased,
        };
        // Create the tables now so that a read before the first write works.
        let tx = store.db.begin_write().map_err(store_error)?;
        tx.open_table(QueueTable::new(&store.ready))
            .map_err(store_error)?;
        tx.open_table(QueueTable::new(&store.leased))
            .map_err(store_error)?;
        tx.open_table(DlqTable::new(&dlq_table(&store.options.dead_letter_queue)))
            .map_err(store_error)?;
        tx.open_table(META).map_err(store_error)?;
        tx.commit().map_err(store_error)?;
        Ok(Self {
            store: Arc::new(store),
            acks,
        })
    }

    /// Runs `f` with the store on the blocking pool.
    async fn with_store<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Store) -> Result<T, SourceError> + Send + 'static,
    ) -> Result<T, SourceError> {
        let store = self.store.clone();
        blocking(move || f(&store)).await
    }
}

fn dlq_table(name: &str) -> String {
    format!("dlq/{name}")
}

impl Store {
    fn acked_table(&self) -> String {
        format!("acked/{}", self.options.queue)
    }

    /// Takes up to `max` due messages and expired leases, and leases them.
    fn lease(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        let now = now_ms();
        let until = now + self.options.visibility_timeout.as_millis() as u64;
        let tx = self.db.begin_write().map_err(store_error)?;
        let mut out = Vec::new();
        {
            let mut ready = tx
                .open_table(QueueTable::new(&self.ready))
                .map_err(store_error)?;
            let mut leased = tx
                .open_table(QueueTable::new(&self.leased))
                .map_err(store_error)?;
            let mut taken: Vec<((u64, u64), Vec<u8>)> = Vec::new();
            for table in [&mut leased, &mut ready] {
                let remaining = max - taken.len();
                if remaining == 0 {
                    break;
                }
                let due: Vec<((u64, u64), Vec<u8>)> = table
                    .range((0, 0)..=(now, u64::MAX))
                    .map_err(store_error)?
                    .take(remaining)
                    .map(|row| row.map(|(k, v)| (k.value(), v.value().to_vec())))
                    .collect::<Result<_, _>>()
                    .map_err(store_error)?;
                for (key, _) in &due {
                    table.remove(*key).map_err(store_error)?;
                }
                taken.extend(due);
            }
            for ((_, seq), data) in taken {
                let mut fields = decode_fields(&Bytes::from(data))
                    .ok_or_else(|| store_error(format!("message {seq} is not readable")))?;
                let earlier = take_deliveries(&mut fields);
                fields.push((F_DELIVERIES.into(), Bytes::from((earlier + 1).to_string())));
                leased
                    .insert((until, seq), encode_fields(&fields).as_slice())
                    .map_err(store_error)?;
                out.push(Delivery::from_fields(
                    &seq.to_string(),
                    fields,
                    earlier,
                    format!("{until}:{seq}"),
                ));
            }
        }
        tx.commit().map_err(store_error)?;
        Ok(out)
    }

    /// Removes a lease and, when it was still held, runs `then` in the same
    /// transaction. A lease that ran out belongs to a newer delivery, which
    /// will settle the message itself.
    fn settle(
        &self,
        receipt: &str,
        then: impl FnOnce(&redb::WriteTransaction, u64) -> Result<(), SourceError>,
    ) -> Result<(), SourceError> {
        let key = parse_receipt(receipt)?;
        let tx = self.db.begin_write().map_err(store_error)?;
        let held = {
            let mut leased = tx
                .open_table(QueueTable::new(&self.leased))
                .map_err(store_error)?;
            leased.remove(key).map_err(store_error)?.is_some()
        };
        if held {
            then(&tx, key.1)?;
        }
        tx.commit().map_err(store_error)
    }

    fn next_seq(tx: &redb::WriteTransaction) -> Result<u64, SourceError> {
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
    SourceError::Invalid(format!(
        "dead letter {id} is not in {} (already replayed or purged?)",
        table.trim_start_matches("dlq/")
    ))
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

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, SourceError> + Send + 'static,
) -> Result<T, SourceError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| store_error(format!("worker failed: {e}")))?
}

#[async_trait]
impl Source for EmbeddedSource {
    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let got = self.with_store(move |s| s.lease(max)).await?;
            if !got.is_empty() || tokio::time::Instant::now() >= deadline {
                return Ok(got);
            }
            tokio::time::sleep(POLL).await;
        }
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), SourceError> {
        self.acks.submit(parse_receipt(&delivery.receipt)?).await
    }

    async fn retry(
        &self,
        delivery: &Delivery,
        next_attempt: u32,
        first_attempt_at: SystemTime,
        at: SystemTime,
    ) -> Result<(), SourceError> {
        let fields = encode_fields(&delivery.fields_for_retry(next_attempt, first_attempt_at));
        let receipt = delivery.receipt.clone();
        self.with_store(move |s| {
            s.settle(&receipt, |tx, seq| {
                let mut ready = tx
                    .open_table(QueueTable::new(&s.ready))
                    .map_err(store_error)?;
                ready
                    .insert((ms(at), seq), fields.as_slice())
                    .map_err(store_error)?;
                Ok(())
            })
        })
        .await
    }

    async fn dead_letter(&self, delivery: &Delivery, failure: &Failure) -> Result<(), SourceError> {
        let mut fields = delivery.fields_for_dead_letter(failure);
        if !fields.iter().any(|(n, _)| n.as_ref() == PAYLOAD.as_bytes()) {
            fields.insert(0, (PAYLOAD.into(), Bytes::new()));
        }
        let fields = encode_fields(&fields);
        let receipt = delivery.receipt.clone();
        let table = dlq_table(&failure.dead_letter_queue);
        self.with_store(move |s| {
            s.settle(&receipt, |tx, _| {
                let id = Store::next_seq(tx)?;
                let mut dlq = tx.open_table(DlqTable::new(&table)).map_err(store_error)?;
                dlq.insert(id, fields.as_slice()).map_err(store_error)?;
                Ok(())
            })
        })
        .await
    }

    async fn depth(&self) -> Result<Depth, SourceError> {
        self.with_store(|s| {
            let tx = s.db.begin_read().map_err(store_error)?;
            let now = now_ms();
            let ready = tx
                .open_table(QueueTable::new(&s.ready))
                .map_err(store_error)?;
            let leased = tx
                .open_table(QueueTable::new(&s.leased))
                .map_err(store_error)?;
            let dlq = tx
                .open_table(DlqTable::new(&dlq_table(&s.options.dead_letter_queue)))
                .map_err(store_error)?;
            let due = ready
                .range((0, 0)..=(now, u64::MAX))
                .map_err(store_error)?
                .count() as u64;
            let total = ready.len().map_err(store_error)?;
            let oldest = match dlq.first().map_err(store_error)? {
                Some((_, v)) => decode_fields(&Bytes::copy_from_slice(v.value()))
                    .and_then(|f| {
                        let at = f
                            .iter()
                            .find(|(n, _)| n.as_ref() == super::F_LAST_ATTEMPT_AT.as_bytes())?;
                        super::parse_time(&at.1)
                    })
                    .map(|t| SystemTime::now().duration_since(t).unwrap_or_default()),
                None => None,
            };
            Ok(Depth {
                ready: due,
                pending: leased.len().map_err(store_error)?,
                retry_backlog: total - due,
                dead_letters: dlq.len().map_err(store_error)?,
                oldest_dead_letter_age: oldest,
            })
        })
        .await
    }

    async fn dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        let table = dlq_table(dead_letter_queue);
        self.with_store(move |s| {
            let tx = s.db.begin_read().map_err(store_error)?;
            let dlq = match tx.open_table(DlqTable::new(&table)) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(store_error(e)),
            };
            let mut out = Vec::new();
            for row in dlq.iter().map_err(store_error)?.take(limit) {
                let (id, data) = row.map_err(store_error)?;
                let fields =
                    decode_fields(&Bytes::copy_from_slice(data.value())).ok_or_else(|| {
                        store_error(format!("dead letter {} is not readable", id.value()))
                    })?;
                out.push(DeadLetter::from_fields(id.value().to_string(), fields));
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
        self.with_store(move |s| {
            let tx = s.db.begin_write().map_err(store_error)?;
            let seq = Store::next_seq(&tx)?;
            {
                let mut dlq = tx.open_table(DlqTable::new(&table)).map_err(store_error)?;
                if dlq.remove(id).map_err(store_error)?.is_none() {
                    return Err(not_there(&table, id));
                }
                let mut ready = tx
                    .open_table(QueueTable::new(&s.ready))
                    .map_err(store_error)?;
                ready
                    .insert((now_ms(), seq), data.as_slice())
                    .map_err(store_error)?;
            }
            tx.commit().map_err(store_error)
        })
        .await
    }

    async fn purge(&self, dead_letter_queue: &str, letter: &DeadLetter) -> Result<(), SourceError> {
        let (table, id) = (
            dlq_table(dead_letter_queue),
            parse_dead_letter_id(&letter.id)?,
        );
        self.with_store(move |s| {
            let tx = s.db.begin_write().map_err(store_error)?;
            let removed = tx
                .open_table(DlqTable::new(&table))
                .map_err(store_error)?
                .remove(id)
                .map_err(store_error)?
                .is_some();
            if !removed {
                return Err(not_there(&table, id));
            }
            tx.commit().map_err(store_error)
        })
        .await
    }

    fn supports_dedup(&self) -> bool {
        true
    }

    async fn remember_ack(&self, key: &str, window: Duration) -> Result<(), SourceError> {
        let key = key.to_string();
        let until = now_ms() + window.as_millis() as u64;
        self.with_store(move |s| {
            let tx = s.db.begin_write().map_err(store_error)?;
            {
                let mut acked = tx
                    .open_table(AckedTable::new(&s.acked_table()))
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
            }
            tx.commit().map_err(store_error)
        })
        .await
    }

    async fn was_acked(&self, key: &str) -> Result<bool, SourceError> {
        let key = key.to_string();
        self.with_store(move |s| {
            let tx = s.db.begin_read().map_err(store_error)?;
            let acked = match tx.open_table(AckedTable::new(&s.acked_table())) {
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
        self.with_store(move |s| {
            let tx = s.db.begin_write().map_err(store_error)?;
            let seq = Store::next_seq(&tx)?;
            {
                let mut ready = tx
                    .open_table(QueueTable::new(&s.ready))
                    .map_err(store_error)?;
                ready
                    .insert((now_ms(), seq), data.as_slice())
                    .map_err(store_error)?;
            }
            tx.commit().map_err(store_error)?;
            Ok(seq.to_string())
        })
        .await
    }
}
