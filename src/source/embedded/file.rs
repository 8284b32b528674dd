//! The file handle: one per redb file per process, its tables, and how a
//! source hands calls to the writer thread.

use super::*;

/// One handle per file per process.
pub(super) fn shared_file(dir: &Path) -> Result<Arc<File>, SourceError> {
    static OPEN: OnceLock<Mutex<HashMap<PathBuf, Weak<File>>>> = OnceLock::new();
    std::fs::create_dir_all(dir).map_err(|e| {
        SourceError::invalid(format!(
            "cannot create the embedded queue directory {}: {e}",
            dir.display()
        ))
    })?;
    let path = dir
        .canonicalize()
        .map_err(|e| SourceError::invalid(format!("{}: {e}", dir.display())))?
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
                return Err(SourceError::invalid(format!(
                    "the embedded queue {} is open in another process; an embedded queue serves one process at a time (stop the other courier first)",
                    path.display()
                )));
            }
            Err(other) => return Err(store_error(other)),
        }
    };
    let careful_until = opened(&db)?.then(|| {
        tracing::warn!(
            file = %path.display(),
            "embedded queue: the last process on this file did not close it; for {CAREFUL_FOR:?} every hand-out is made durable before it is delivered, so a message that crashes courier is counted and dead-lettered after max_deliveries"
        );
        Instant::now() + CAREFUL_FOR
    });
    let db = Arc::new(db);
    let (calls, inbox) = mpsc::channel();
    let writer = Writer {
        db: db.clone(),
        waiting: Vec::new(),
        queues: HashMap::new(),
        dirty_since: None,
        careful_until,
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
            queue: options.queue.clone(),
            ready: format!("ready/{}", options.queue),
            leased: format!("leased/{}", options.queue),
            acked: format!("acked/{}", options.queue),
        };
        create_tables(&file.db, &tables, &dlq_table(&options.dead_letter_queue))?;
        Ok(Self {
            file,
            tables: Arc::new(tables),
            live: Mutex::new(options.live()),
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
        let (reply, answer) = oneshot::channel();
        self.file
            .calls
            .as_ref()
            .ok_or_else(writer_gone)?
            .send(call(reply))
            .map_err(|_| writer_gone())?;
        answer.await.map_err(|_| writer_gone())?
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
    /// transaction. `work` must write nothing when it returns
    /// [`SourceError::Invalid`]; any other error aborts the transaction.
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
        let (file, tables) = (self.file.clone(), self.tables.clone());
        tokio::task::spawn_blocking(move || {
            let tx = file.db.begin_read().map_err(store_error)?;
            f(&tx, &tables)
        })
        .await
        .map_err(|e| store_error(format!("worker failed: {e}")))?
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
