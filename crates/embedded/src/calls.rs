//! What callers ask the writer for, and how they are answered.

use super::*;

pub(super) type Reply<T> = oneshot::Sender<Result<T, SourceError>>;
pub(super) type Work = Box<dyn FnOnce(&WriteTransaction) -> Result<(), SourceError> + Send>;

/// What callers ask the writer for.
pub(super) enum Call {
    Lease(Lease),
    /// Acks are waiting in [`PendingAcks`]; the first of them was just
    /// added, so the writer must wake to write them within [`FLUSH_EVERY`].
    Poke,
    Change(Change),
    Depth {
        tables: Arc<Tables>,
        dlq: String,
        reply: Reply<Depth>,
    },
    /// The queue's waiting receives are answered now (a stop, a `/drain`).
    Interrupt {
        tables: Arc<Tables>,
    },
    /// A receive took all that waited ahead ([`ahead`]): the next read's
    /// hand-out, made now.
    Fill {
        tables: Arc<Tables>,
        max: usize,
        terms: Terms,
    },
}

/// An ack of the lease a receipt names.
pub(super) struct Ack {
    pub(super) tables: Arc<Tables>,
    pub(super) key: (u64, u64),
}

/// Acks made since the writer last looked, answered at once and not sent
/// to the writer one by one: an ack only changes memory (see
/// [`FLUSH_EVERY`]), and a call to the writer per ack cost a thread wake-up
/// each way, a third of courier's CPU at load. The writer takes them before
/// anything else it does, so every call made after an ack (a receive that
/// could take back the lease, a flush, a stop) sees it.
#[derive(Default)]
pub(super) struct PendingAcks {
    inner: Mutex<Pending>,
}

#[derive(Default)]
struct Pending {
    /// Taken before `acks`: an ack of a read-ahead hand-out comes after
    /// the receive that took it.
    took: Vec<Took>,
    acks: Vec<Ack>,
    /// When the oldest of `acks` was made.
    since: Option<Instant>,
    /// The writer is bound to wake within [`FLUSH_EVERY`] anyway (it holds
    /// something to write), and takes the acks then: no poke is needed.
    will_wake: bool,
}

impl PendingAcks {
    /// Adds `ack`; true when the writer must be told: it is the first since
    /// the writer last looked, and the writer is not bound to wake soon.
    pub(super) fn push(&self, ack: Ack) -> bool {
        self.add(|pending| pending.acks.push(ack))
    }

    /// Adds `took`; true when the writer must be told, as for [`Self::push`].
    pub(super) fn push_took(&self, took: Took) -> bool {
        self.add(|pending| pending.took.push(took))
    }

    fn add(&self, put: impl FnOnce(&mut Pending)) -> bool {
        let mut pending = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        put(&mut pending);
        pending.since.get_or_insert_with(Instant::now);
        pending.took.len() + pending.acks.len() == 1 && !pending.will_wake
    }

    /// When the oldest waiting ack was made.
    pub(super) fn since(&self) -> Option<Instant> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).since
    }

    /// The writer, about to wait: whether it wakes within [`FLUSH_EVERY`]
    /// whatever comes (`will_wake`), and when the oldest waiting ack was
    /// made. One lock for both, so an ack made after it pokes the writer
    /// unless the writer wakes anyway, and one made before is in `since`.
    pub(super) fn before_wait(&self, will_wake: bool) -> Option<Instant> {
        let mut pending = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        pending.will_wake = will_wake;
        pending.since
    }

    /// The waiting takes and acks, and when the oldest was made.
    pub(super) fn take(&self) -> Option<(Vec<Took>, Vec<Ack>, Instant)> {
        let mut pending = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let since = pending.since.take()?;
        Some((
            std::mem::take(&mut pending.took),
            std::mem::take(&mut pending.acks),
            since,
        ))
    }
}

/// A receive: answered with what is due, or kept waiting until something is
/// or `deadline` passes.
pub(super) struct Lease {
    pub(super) tables: Arc<Tables>,
    pub(super) max: usize,
    pub(super) terms: Terms,
    pub(super) deadline: Instant,
    /// When the writer tries it again if nothing else happens first.
    pub(super) next_try: Instant,
    pub(super) reply: Reply<Vec<Delivery>>,
}

/// What a hand-out is made under: the live settings when the receive was
/// made.
#[derive(Clone)]
pub(super) struct Terms {
    /// The lease's length, in ms.
    pub(super) visibility: u64,
    /// Where a message handed out too often is dead-lettered, and how
    /// often is too often.
    pub(super) dead_letter_queue: String,
    pub(super) max_deliveries: u32,
}

/// A call that writes, answered once its transaction is committed.
pub(super) enum Change {
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
    /// Extends the leases that receipts name to `now + visibility`.
    KeepAlive {
        tables: Arc<Tables>,
        keys: Vec<(u64, u64)>,
        visibility: u64,
        reply: Reply<()>,
    },
    /// Writes what is held in memory and makes everything durable.
    Flush { reply: Reply<()> },
}

impl Change {
    /// Whether the caller hears back only once the change is durable:
    /// everything that creates a message or moves it somewhere new.
    pub(super) fn durable(&self) -> bool {
        match self {
            Self::Send { .. } | Self::Settle { .. } | Self::Flush { .. } => true,
            Self::Write { durable, .. } => *durable,
            // A lease extension lost in a crash is moot: the deliveries it
            // kept alive died with the process.
            Self::KeepAlive { .. } => false,
        }
    }

    pub(super) fn answer(self, result: Result<Outcome, SourceError>) {
        match self {
            Self::Send { reply, .. } => {
                let _ = reply.send(result.and_then(|o| match o {
                    Outcome::Seq(seq) => Ok(seq),
                    Outcome::Unit(r) => r.and(Err(store_error("a send came back without an id"))),
                }));
            }
            Self::Settle { reply, .. }
            | Self::Write { reply, .. }
            | Self::KeepAlive { reply, .. }
            | Self::Flush { reply } => {
                let _ = reply.send(result.and_then(|o| match o {
                    Outcome::Unit(r) => r,
                    Outcome::Seq(_) => Ok(()),
                }));
            }
        }
    }
}

/// What settling a lease that is still held does besides ending it.
pub(super) enum Then {
    Retry { at: u64, data: Vec<u8> },
    DeadLetter { table: String, data: Vec<u8> },
}

/// What one change came to inside the transaction, to answer once it
/// commits.
pub(super) enum Outcome {
    Seq(u64),
    /// Ok, or the change's own error, which wrote nothing.
    Unit(Result<(), SourceError>),
}

/// Tells every call of a batch that could not commit why.
pub(super) fn fail(changes: Vec<Change>, leases: Vec<Lease>, e: SourceError) {
    for change in changes {
        change.answer(Err(e.clone()));
    }
    for lease in leases {
        let _ = lease.reply.send(Err(e.clone()));
    }
}

pub(super) fn answer_leases(leases: Vec<(Lease, Leased)>, result: Result<(), SourceError>) {
    for (lease, leased) in leases {
        let _ = lease.reply.send(result.clone().map(|()| leased.deliveries));
    }
}
