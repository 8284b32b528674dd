//! What callers ask the writer for, and how they are answered.

use super::*;

pub(super) type Reply<T> = oneshot::Sender<Result<T, SourceError>>;
pub(super) type Work = Box<dyn FnOnce(&WriteTransaction) -> Result<(), SourceError> + Send>;

/// What callers ask the writer for.
pub(super) enum Call {
    Lease(Lease),
    Ack(Ack),
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
}

/// An ack of the lease a receipt names.
pub(super) struct Ack {
    pub(super) tables: Arc<Tables>,
    pub(super) key: (u64, u64),
    pub(super) reply: Reply<()>,
}

/// A receive: answered with what is due, or kept waiting until something is
/// or `deadline` passes.
pub(super) struct Lease {
    pub(super) tables: Arc<Tables>,
    pub(super) max: usize,
    pub(super) visibility: u64,
    /// Where a message handed out too often is dead-lettered, and how
    /// often is too often (the live settings when the receive was made).
    pub(super) dead_letter_queue: String,
    pub(super) max_deliveries: u32,
    pub(super) deadline: Instant,
    /// When the writer tries it again if nothing else happens first.
    pub(super) next_try: Instant,
    pub(super) reply: Reply<Vec<Delivery>>,
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
