//! The file handle: one per redb file per process, its tables, its writer
//! thread, and how sources and stores hand it their calls.

use super::*;

/// The file's name in the queue's directory.
const FILE_NAME: &str = "courier.redb";

/// The process's handle of the queue in `dir`, with the directory and the
/// file made when missing. It has no writer until a consumer starts one
/// ([`File::start_writer`]).
pub(super) fn shared_file(dir: &Path) -> Result<Arc<File>, SourceError> {
    std::fs::create_dir_all(dir).map_err(|e| {
        SourceError::invalid(format!(
            "cannot create the embedded queue directory {}: {e}",
            dir.display()
        ))
    })?;
    handle(dir, true)?
        .ok_or_else(|| store_error(format!("{} was not made", dir.join(FILE_NAME).display())))
}

/// The process's handle of the queue in `dir` if its file exists; makes
/// nothing.
pub(super) fn existing_file(dir: &Path) -> Result<Option<Arc<File>>, SourceError> {
    if !dir.join(FILE_NAME).is_file() {
        return Ok(None);
    }
    handle(dir, false)
}

/// One handle per file per process; `create`: the file is made when
/// missing, else a missing file is `None`.
fn handle(dir: &Path, create: bool) -> Result<Option<Arc<File>>, SourceError> {
    static OPEN: OnceLock<Mutex<HashMap<PathBuf, Weak<File>>>> = OnceLock::new();
    let path = dir
        .canonicalize()
        .map_err(|e| SourceError::invalid(format!("{}: {e}", dir.display())))?
        .join(FILE_NAME);
    let mut open = OPEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(file) = open.get(&path).and_then(Weak::upgrade) {
        return Ok(Some(file));
    }
    let mut builder = redb::Builder::new();
    builder.set_cache_size(CACHE_BYTES);
    // A handle of this process that was just dropped may still be closing
    // the file on another thread; give it a moment before calling the file
    // another process's.
    let mut tries = 0;
    let db = loop {
        let opened = match create {
            true => builder.create(&path),
            false => builder.open(&path),
        };
        match opened {
            Ok(db) => break db,
            Err(redb::DatabaseError::DatabaseAlreadyOpen) if tries < 40 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
                return Err(SourceError::invalid(format!(
                    "the embedded queue {} is open in another process; an embedded queue serves one process at a time (stop the other courier first)",
                    path.display()
                )));
            }
            Err(redb::DatabaseError::Storage(redb::StorageError::Io(e)))
                if !create && e.kind() == std::io::ErrorKind::NotFound =>
            {
                return Ok(None);
            }
            Err(other) => return Err(store_error(other)),
        }
    };
    let file = Arc::new(File {
        db: Arc::new(db),
        path: path.clone(),
        writer: OnceLock::new(),
        direct: Mutex::new(()),
    });
    open.insert(path, Arc::downgrade(&file));
    Ok(Some(file))
}

impl File {
    /// Starts the writer thread unless it runs: the first consumer on the
    /// file does. It marks the file open, and notes whether the last
    /// process on it left without closing it ([`CAREFUL_FOR`]).
    pub(super) fn start_writer(&self) -> Result<(), SourceError> {
        let _direct = self.direct.lock().unwrap_or_else(|e| e.into_inner());
        if self.writer.get().is_some() {
            return Ok(());
        }
        let careful_until = opened(&self.db)?.then(|| {
            tracing::warn!(
                file = %self.path.display(),
                "embedded queue: the last process on this file did not close it; for {CAREFUL_FOR:?} every hand-out is made durable before it is delivered, so a message that crashes courier is counted and dead-lettered after max_deliveries"
            );
            Instant::now() + CAREFUL_FOR
        });
        let (calls, inbox) = mpsc::channel();
        let acks = Arc::new(PendingAcks::default());
        let writer = Writer {
            db: self.db.clone(),
            acks: acks.clone(),
            waiting: Vec::new(),
            queues: HashMap::new(),
            dirty_since: None,
            careful_until,
        };
        let thread = std::thread::Builder::new()
            .name("courier-embedded".into())
            .spawn(move || writer.run(inbox))
            .map_err(store_error)?;
        let _ = self.writer.set(Writing {
            calls,
            acks,
            thread,
        });
        Ok(())
    }

    /// Whether a consumer of this process runs the writer.
    pub(super) fn has_writer(&self) -> bool {
        self.writer.get().is_some()
    }

    /// Hands `call` to the writer and waits for its answer.
    pub(super) async fn call<T>(
        &self,
        call: impl FnOnce(Reply<T>) -> Call,
    ) -> Result<T, SourceError> {
        self.submit(call)?.await.map_err(|_| writer_gone())?
    }

    /// Leaves `ack` for the writer's next step ([`PendingAcks`]), waking it
    /// only for the first ack since its last.
    pub(super) fn ack(&self, ack: Ack) -> Result<(), SourceError> {
        let writing = self.writer.get().ok_or_else(writer_gone)?;
        if writing.acks.push(ack) {
            writing.calls.send(Call::Poke).map_err(|_| writer_gone())?;
        }
        Ok(())
    }

    /// Tells the writer a receive took what it read ahead, the way acks
    /// reach it ([`PendingAcks`]), and with `fill` asks for the next.
    pub(super) fn took(&self, took: Took, fill: Option<Call>) -> Result<(), SourceError> {
        let writing = self.writer.get().ok_or_else(writer_gone)?;
        let poke = writing.acks.push_took(took);
        if let Some(call) = fill.or(poke.then_some(Call::Poke)) {
            writing.calls.send(call).map_err(|_| writer_gone())?;
        }
        Ok(())
    }

    /// Hands `call` to the writer; its answer comes on the receiver.
    pub(super) fn submit<T>(
        &self,
        call: impl FnOnce(Reply<T>) -> Call,
    ) -> Result<oneshot::Receiver<Result<T, SourceError>>, SourceError> {
        let (reply, answer) = oneshot::channel();
        self.writer
            .get()
            .ok_or_else(writer_gone)?
            .calls
            .send(call(reply))
            .map_err(|_| writer_gone())?;
        Ok(answer)
    }

    /// Runs `f` with a read transaction on the blocking pool; reads see what
    /// the writer committed, durable or not.
    pub(super) async fn read<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&redb::ReadTransaction) -> Result<T, SourceError> + Send + 'static,
    ) -> Result<T, SourceError> {
        let file = self.clone();
        tokio::task::spawn_blocking(move || {
            let tx = file.db.begin_read().map_err(store_error)?;
            f(&tx)
        })
        .await
        .map_err(|e| store_error(format!("worker failed: {e}")))?
    }

    /// A write of the dead-letter store, answered once durable: in the
    /// writer's next transaction while a consumer of this process runs the
    /// writer, else in a transaction of its own, so that an admin handle
    /// starts no thread. `work` returning an error writes nothing.
    pub(super) async fn write_durably(self: &Arc<Self>, work: Work) -> Result<(), SourceError> {
        let file = self.clone();
        let alone = tokio::task::spawn_blocking(move || {
            let _direct = file.direct.lock().unwrap_or_else(|e| e.into_inner());
            if file.has_writer() {
                return Err(work);
            }
            let tx = file.db.begin_write().map_err(store_error);
            Ok(tx.and_then(|tx| match work(&tx) {
                Ok(()) => tx.commit().map_err(store_error),
                Err(e) => {
                    let _ = tx.abort();
                    Err(e)
                }
            }))
        })
        .await
        .map_err(|e| store_error(format!("worker failed: {e}")))?;
        match alone {
            Ok(result) => result,
            Err(work) => {
                self.call(|reply| {
                    Call::Change(Change::Write {
                        work: Some(work),
                        durable: true,
                        reply,
                    })
                })
                .await
            }
        }
    }
}

impl Tables {
    pub(super) fn of(queue: &str) -> Self {
        Self {
            queue: queue.to_string(),
            ready: format!("ready/{queue}"),
            leased: format!("leased/{queue}"),
            acked: format!("acked/{queue}"),
            ahead: Ahead::default(),
        }
    }
}

impl EmbeddedSource {
    pub fn open(dir: &Path, options: SourceOptions) -> Result<Self, SourceError> {
        let file = shared_file(dir)?;
        file.start_writer()?;
        let tables = Arc::new(Tables::of(&options.queue));
        create_tables(
            &file.db,
            &tables,
            &dlq_table(&options.live.dead_letter_queue),
        )?;
        Ok(Self {
            store: EmbeddedStore::of(dir, file.clone(), tables.clone()),
            file,
            tables,
            live: Mutex::new(options.live.clone()),
            interrupt: Mutex::new(false),
        })
    }

    /// The live settings now.
    pub(super) fn live(&self) -> LiveSettings {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Hands `call` to the writer and waits for its answer.
    pub(super) async fn call<T>(
        &self,
        call: impl FnOnce(Reply<T>) -> Call,
    ) -> Result<T, SourceError> {
        self.file.call(call).await
    }

    pub(super) async fn settle(&self, delivery: &Delivery, then: Then) -> Result<(), SourceError> {
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
    /// transaction. `work` must write nothing when it refuses (an error of
    /// kind `Invalid` or `Gone`, [`is_refusal`]); any other error aborts
    /// the transaction.
    pub(super) async fn write(
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
    pub(super) async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&redb::ReadTransaction, &Tables) -> Result<T, SourceError> + Send + 'static,
    ) -> Result<T, SourceError> {
        let tables = self.tables.clone();
        self.file.read(move |tx| f(tx, &tables)).await
    }
}

/// Marks the file open, durably; whether it was open already, which means
/// the process that had it died without closing it.
fn opened(db: &Database) -> Result<bool, SourceError> {
    let was_open = {
        let tx = db.begin_read().map_err(store_error)?;
        match tx.open_table(META) {
            Ok(meta) => meta
                .get(OPEN)
                .map_err(store_error)?
                .is_some_and(|v| v.value() != 0),
            Err(redb::TableError::TableDoesNotExist(_)) => false,
            Err(e) => return Err(store_error(e)),
        }
    };
    let tx = db.begin_write().map_err(store_error)?;
    mark_open(&tx, true)?;
    tx.commit().map_err(store_error)?;
    Ok(was_open)
}

/// Notes in `meta` whether a process has the file open.
pub(super) fn mark_open(tx: &WriteTransaction, open: bool) -> Result<(), SourceError> {
    tx.open_table(META)
        .map_err(store_error)?
        .insert(OPEN, u64::from(open))
        .map_err(store_error)?;
    Ok(())
}

/// Creates the queue's tables, so that a read before the first write works.
/// Checked with a read first: opening a source on an existing queue (every
/// `courier send`, `courier dlq`) then takes no transaction of its own.
pub(super) fn create_tables(db: &Database, tables: &Tables, dlq: &str) -> Result<(), SourceError> {
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

pub(super) fn dlq_table(name: &str) -> String {
    format!("dlq/{name}")
}
