//! The dead-letter store: list, replay and purge the dead-letter tables,
//! and send to the work queue. Opened alone (`courier dlq`, `courier
//! send`), it opens the queue's file when there is one and makes nothing:
//! no directory, no file, no table, no writer thread. Reading a queue
//! without a file or a dead-letter table finds no dead letters. Its writes
//! are transactions of its own, or the writer's next one while a consumer
//! of this process runs the writer. A send makes the file and the work
//! table when they are missing, as the first message of a local queue
//! must; replay and purge write only where the letter is. The records of
//! `courier dlq` jobs are in [`jobs`]: the first put makes the file and
//! their table.

use std::sync::atomic::{AtomicU64, Ordering};

use super::*;

mod jobs;

#[cfg(test)]
pub(super) use jobs::RECORDS_PER_QUEUE;

/// The dead letters of one queue's file, and sends to it.
pub(super) struct EmbeddedStore {
    dir: PathBuf,
    tables: Arc<Tables>,
    /// The consumer's file, or the one an admin handle found; `None` while
    /// the directory has none.
    file: Mutex<Option<Arc<File>>>,
}

impl EmbeddedStore {
    /// A consumer's store, on its file and writer.
    pub(super) fn of(dir: &Path, file: Arc<File>, tables: Arc<Tables>) -> Self {
        Self {
            dir: dir.to_path_buf(),
            tables,
            file: Mutex::new(Some(file)),
        }
    }

    /// An admin handle: the queue's file if there is one, nothing made.
    pub(super) fn open(dir: &Path, options: SourceOptions) -> Result<Self, SourceError> {
        Ok(Self {
            dir: dir.to_path_buf(),
            tables: Arc::new(Tables::of(&options.queue)),
            file: Mutex::new(existing_file(dir)?),
        })
    }

    /// The file, looked for again while there was none.
    fn file(&self) -> Result<Option<Arc<File>>, SourceError> {
        let mut slot = self.file.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = existing_file(&self.dir)?;
        }
        Ok(slot.clone())
    }

    /// The file, made when missing.
    fn file_to_write(&self) -> Result<Arc<File>, SourceError> {
        let mut slot = self.file.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(file) = slot.as_ref() {
            return Ok(file.clone());
        }
        let file = shared_file(&self.dir)?;
        *slot = Some(file.clone());
        Ok(file)
    }
}

/// Whether the write transaction has the table `name`: a dead-letter table
/// is looked for with this first, as opening one in a write makes it.
fn has_table(tx: &WriteTransaction, name: &str) -> Result<bool, SourceError> {
    Ok(tx
        .list_tables()
        .map_err(store_error)?
        .any(|table| table.name() == name))
}

impl EmbeddedStore {
    /// The dead letters whose ids are in `ids`, at most `limit`, oldest
    /// first.
    async fn page(
        &self,
        dead_letter_queue: &str,
        ids: std::ops::RangeInclusive<u64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        let Some(file) = self.file()? else {
            return Ok(Vec::new());
        };
        let table = dlq_table(dead_letter_queue);
        file.read(move |tx| {
            let dlq = match tx.open_table(DlqTable::new(&table)) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(store_error(e)),
            };
            let mut out = Vec::new();
            for row in dlq.range(ids).map_err(store_error)?.take(limit) {
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
                            courier_core::model::F_ERROR.into(),
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
}

#[async_trait]
impl DeadLetterStore for EmbeddedStore {
    /// The sidecar's reading ([`super::depth::read`]): through the writer
    /// while a consumer of this process runs it, as the sidecar's gauges
    /// do, else from the file's tables alone in a read transaction. It
    /// makes nothing: no directory, file, table or writer.
    async fn depth_of(&self, dead_letter_queue: &str) -> Result<Option<Depth>, SourceError> {
        let Some(file) = self.file()? else {
            return Err(SourceError::gone(format!(
                "there is no embedded queue in {}: nothing was sent to it and no sidecar opened it",
                self.dir.display()
            )));
        };
        let dlq = dlq_table(dead_letter_queue);
        let tables = self.tables.clone();
        if file.has_writer() {
            return file
                .call(|reply| Call::Depth { tables, dlq, reply })
                .await
                .map(Some);
        }
        file.read(move |tx| super::depth::read(tx, None, &tables, &dlq))
            .await
            .map(Some)
    }

    async fn dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        self.page(dead_letter_queue, 0..=u64::MAX, limit).await
    }

    async fn dead_letter_by_id(
        &self,
        dead_letter_queue: &str,
        id: &str,
    ) -> Result<Option<Option<DeadLetter>>, SourceError> {
        let Ok(key) = parse_dead_letter_id(id) else {
            return Ok(Some(None));
        };
        let page = self.page(dead_letter_queue, key..=key, 1).await?;
        Ok(Some(page.into_iter().next()))
    }

    /// The table's keys are ordered: a page is a range read.
    async fn dead_letters_after(
        &self,
        dead_letter_queue: &str,
        after: Option<&str>,
        through: Option<&str>,
        limit: usize,
    ) -> Result<Option<Vec<DeadLetter>>, SourceError> {
        let from = match after {
            Some(id) => match parse_dead_letter_id(id)?.checked_add(1) {
                Some(next) => next,
                None => return Ok(Some(Vec::new())),
            },
            None => 0,
        };
        let through = through.map_or(Ok(u64::MAX), parse_dead_letter_id)?;
        self.page(dead_letter_queue, from..=through, limit)
            .await
            .map(Some)
    }

    async fn replay(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let id = parse_dead_letter_id(&letter.id)?;
        let table = dlq_table(dead_letter_queue);
        let Some(file) = self.file()? else {
            return Err(not_there(&table, id));
        };
        let data = encode_fields(&letter.fields_for_replay());
        let ready = self.tables.ready.clone();
        file.write_durably(Box::new(move |tx| {
            if !has_table(tx, &table)? {
                return Err(not_there(&table, id));
            }
            let mut dlq = tx.open_table(DlqTable::new(&table)).map_err(store_error)?;
            let readable = dlq
                .get(id)
                .map_err(store_error)?
                .map(|stored| decode_fields(&Bytes::copy_from_slice(stored.value())).is_some());
            match readable {
                None => return Err(not_there(&table, id)),
                // What the listing showed of it is a stand-in (its raw
                // bytes), not the message: replaying that would send the
                // app something no producer wrote.
                Some(false) => return Err(unreadable(&table, id)),
                Some(true) => {}
            }
            dlq.remove(id).map_err(store_error)?;
            drop(dlq);
            let seq = next_seq(tx)?;
            tx.open_table(QueueTable::new(&ready))
                .map_err(store_error)?
                .insert((now_ms(), seq), data.as_slice())
                .map_err(store_error)?;
            Ok(())
        }))
        .await
    }

    async fn purge(&self, dead_letter_queue: &str, letter: &DeadLetter) -> Result<(), SourceError> {
        let id = parse_dead_letter_id(&letter.id)?;
        let table = dlq_table(dead_letter_queue);
        let Some(file) = self.file()? else {
            return Err(not_there(&table, id));
        };
        file.write_durably(Box::new(move |tx| {
            if !has_table(tx, &table)? {
                return Err(not_there(&table, id));
            }
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
        }))
        .await
    }

    /// Refuses a message over [`RECORD_LIMIT`], which could never be
    /// handed out. Only courier writes the file, and this is the one way a
    /// producer's message gets in: its `courier-*` headers are dropped here,
    /// so every `courier-*` field of a stored record is courier's own state
    /// and needs no seal.
    async fn send(&self, body: Bytes, headers: &[(String, String)]) -> Result<String, SourceError> {
        let mut fields = vec![(Bytes::from_static(PAYLOAD.as_bytes()), body)];
        fields.extend(
            headers
                .iter()
                .filter(|(n, _)| !shared::is_courier_field(n.as_bytes()))
                .map(|(n, v)| (Bytes::from(n.clone()), Bytes::from(v.clone()))),
        );
        let data = encode_fields(&fields);
        if data.len() > RECORD_LIMIT {
            return Err(SourceError::invalid(format!(
                "the message is {} bytes with its headers, over the embedded queue's limit of {RECORD_LIMIT} bytes for one message; send a smaller body (or a reference to where the data is)",
                data.len()
            )));
        }
        let file = self.file_to_write()?;
        if file.has_writer() {
            // The writer's own send keeps its read cursors, where a write
            // of any other kind makes it forget them.
            let tables = self.tables.clone();
            let seq = file
                .call(|reply| {
                    Call::Change(Change::Send {
                        tables,
                        data,
                        reply,
                    })
                })
                .await?;
            return Ok(seq.to_string());
        }
        let sent = Arc::new(AtomicU64::new(0));
        let (ready, seq) = (self.tables.ready.clone(), sent.clone());
        file.write_durably(Box::new(move |tx| {
            let next = next_seq(tx)?;
            tx.open_table(QueueTable::new(&ready))
                .map_err(store_error)?
                .insert((now_ms(), next), data.as_slice())
                .map_err(store_error)?;
            seq.store(next, Ordering::Relaxed);
            Ok(())
        }))
        .await?;
        Ok(sent.load(Ordering::Relaxed).to_string())
    }

    /// Writes what the writer holds in memory, durably; an admin handle's
    /// writes are durable when they return.
    async fn flush(&self) {
        let Ok(Some(file)) = self.file() else { return };
        if !file.has_writer() {
            return;
        }
        if let Err(e) = file
            .call(|reply| Call::Change(Change::Flush { reply }))
            .await
        {
            tracing::warn!(error = %e, "embedded queue: the last commit failed; unsettled messages will be delivered again");
        }
    }

    async fn job_records(
        &self,
        dead_letter_queue: &str,
    ) -> Result<Vec<(String, Bytes)>, SourceError> {
        self.read_job_records(dead_letter_queue).await
    }

    async fn put_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
        record: Bytes,
    ) -> Result<(), SourceError> {
        self.write_job_record(dead_letter_queue, key, record).await
    }

    async fn remove_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
    ) -> Result<(), SourceError> {
        self.delete_job_record(dead_letter_queue, key).await
    }
}

pub(super) fn not_there(table: &str, id: u64) -> SourceError {
    shared::not_there(table.trim_start_matches("dlq/"), &id.to_string())
}

/// Why an unreadable dead letter cannot be replayed, and what to do.
fn unreadable(table: &str, id: u64) -> SourceError {
    SourceError::invalid(format!(
        "dead letter {id} in {} is stored in a form that cannot be read, so it cannot be replayed; `courier dlq list` shows its raw bytes as the body, and `courier dlq purge` deletes it",
        table.trim_start_matches("dlq/")
    ))
}

pub(super) fn parse_dead_letter_id(id: &str) -> Result<u64, SourceError> {
    id.parse().map_err(|_| {
        SourceError::invalid(format!(
            "{id:?} is not a dead-letter id of the embedded queue (a number)"
        ))
    })
}
