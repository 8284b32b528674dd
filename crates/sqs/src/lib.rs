//! Amazon SQS (`sqs://REGION`, aws-sdk-sqs).
//!
//! - `--queue` is a queue name or URL. Credentials come from the standard
//!   AWS chain, another endpoint (LocalStack, moto) from `AWS_ENDPOINT_URL`.
//!   With `--create`, a missing queue is created (FIFO when its name ends in
//!   `.fifo`). The SDK talks HTTPS over rustls with ring, the one crypto
//!   provider in the process (kube's).
//! - A read is a long poll (`ReceiveMessage`, `WaitTimeSeconds` 1) for up to
//!   10 messages; when it comes back full and more slots are free, further
//!   calls of 10 go out in parallel without waiting. A message is received
//!   with the visibility timeout courier's policy needs, and kept invisible
//!   while the app works on it (`keep_alive`).
//! - Ack: `DeleteMessage`, gathered into `DeleteMessageBatch` calls of up to
//!   10; each ack learns its own entry's result (a partial failure fails
//!   only those acks, whose messages SQS hands out again).
//! - Retry: `ChangeMessageVisibility` to the delay; the next receive's
//!   `ApproximateReceiveCount` is the attempt. SQS keeps a message invisible
//!   at most 12 h after it was sent: a longer delay, and a retry that must
//!   not use up an attempt (the app was unreachable), is a copy sent with
//!   `DelaySeconds` (at most 15 min, whole seconds rounded down) and
//!   `courier-retry-at`, sealed; the original is deleted only
//!   once SQS took the copy. The first receive of such a copy is never
//!   offered: it is made invisible for the time still to wait, or, when
//!   that is still over the 12 h, sent on as a new copy; a later receive
//!   before its due time (the reader of the first died) is sent on too.
//!   SQS counts whole seconds: a retry this process made invisible it makes
//!   visible itself at its due time (SQS's own timeout, at most a second
//!   later, is the fallback when the process is gone). The 12 h and 15 min
//!   can be lowered for tests and trials (`COURIER_SQS_MAX_VISIBILITY`,
//!   `COURIER_SQS_MAX_DELAY`).
//! - Attempts: `courier-attempt` of a sealed copy (1 for a producer's
//!   message) plus the receives SQS counted, less the copy's waiting one.
//!   A message received more than `max_deliveries` times is dead-lettered as
//!   undeliverable without being offered.
//! - FIFO queues keep `MessageGroupId` order: a group has at most one
//!   message with the app; later ones of the group that came in the same
//!   read wait in the source. A retry of a group's message gives those back
//!   (visibility 0): SQS holds the group while the retried one is
//!   invisible, and hands them out again after it. FIFO queues have no
//!   per-message delay, so there a retry is always a visibility change
//!   (capped at the 12 h); what a FIFO retry that uses no attempt or waits
//!   longer would need is kept in the process (docs/sources.md).
//! - Dead letters are sent to `<queue>-dlq` (`<name>-dlq.fifo` for a FIFO
//!   queue; the policy's queue otherwise), created on first use, then the
//!   original is deleted; a dead letter SQS did not take leaves the original
//!   invisible for 5 s and then handed out again.
//! - `courier dlq` and `courier send` open the dead-letter store alone
//!   (`SqsStore`): queues found with `GetQueueUrl`, never created, no tag
//!   written but the seal key by a first replay that needs it.
//! - The records of `courier dlq` jobs are messages of a standard queue
//!   beside the dead-letter queue, `<its name>-courier-jobs`, one per job
//!   with the newest version winning; made by the first record written,
//!   with SQS's longest retention (`jobs`). A replay is not exact: its
//!   send and its delete cannot be one change in SQS.
//! - A native `RedrivePolicy` whose `maxReceiveCount` is below the policy's
//!   `maxAttempts` is warned about at start and on every policy change.
//!
//! Files: `connection` (URL, client, queues, seal, redrive), `attributes`
//! (fields ↔ body and message attributes), `read` (receive, admit, FIFO
//! groups), `settle` (ack, retry, dead letter), `dead_letters` (the
//! dead-letter store: browse, replay, purge, send), `jobs` (the records of
//! `courier dlq` jobs), `depth`.
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

mod attributes;
mod connection;
mod dead_letters;
mod depth;
mod jobs;
mod read;
mod settle;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use async_trait::async_trait;
use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::QueueAttributeName;
use tokio::sync::mpsc;

use courier_core::model::Delivery;
use courier_core::source::shared::Seal;
use courier_core::source::{
    Broker, Capabilities, Consumer, DeadLetterStore, Depth, LiveSettings, Observed, REMEMBERED,
    Recent, Settlement, Source, SourceError, SourceOptions, WithStore, settle_by_parts,
};
use dead_letters::{SqsStore, WorkQueue};

pub use attributes::{ENCODING, HEADERS, MAX_ATTRIBUTES, RECORD, attribute_name_ok, is_sqs_text};
pub use connection::{SEAL_TAG, check_url, redrive_warning};
pub use dead_letters::dead_letter_queue_name;
pub use jobs::jobs_queue_name;
pub use settle::{MAX_DELAY_ENV, MAX_VISIBILITY_ENV};

/// Amazon SQS: `sqs://REGION`.
pub const BROKER: Broker = Broker {
    name: "sqs",
    messaging_system: "aws_sqs",
    schemes: &["sqs"],
    tls_schemes: &[],
    url_form: "sqs://REGION",
    check_url,
    open: |url, options| {
        Box::pin(async move {
            Ok(Arc::new(SqsSource::connect(url.as_str(), options).await?) as Arc<dyn Source>)
        })
    },
    admin: |url, options| {
        Box::pin(async move {
            Ok(Arc::new(SqsStore::open(url.as_str(), options).await?) as Arc<dyn DeadLetterStore>)
        })
    },
};

/// A delivery with the app, by receipt handle.
#[derive(Debug, Clone)]
struct InFlight {
    /// SQS's id of this copy.
    sqs_id: String,
    group: Option<String>,
    sent_at: SystemTime,
    /// SQS's `ApproximateReceiveCount` at this receive.
    received: u32,
}

/// FIFO: which groups have a message with the app, and the later messages
/// of busy groups that a read brought in.
#[derive(Default)]
struct Groups {
    busy: HashSet<String>,
    waiting: HashMap<String, VecDeque<Delivery>>,
}

impl Groups {
    fn waiting_count(&self) -> usize {
        self.waiting.values().map(VecDeque::len).sum()
    }
}

/// One ack waiting for its `DeleteMessageBatch`.
struct Delete {
    receipt: String,
    done: tokio::sync::oneshot::Sender<Result<(), SourceError>>,
}

pub struct SqsSource {
    client: Client,
    options: SourceOptions,
    queue_url: String,
    fifo: bool,
    live: Mutex<LiveSettings>,
    /// The queue's native RedrivePolicy (JSON), read at start.
    redrive_policy: Option<String>,
    seal: Arc<Seal>,
    in_flight: Mutex<HashMap<String, InFlight>>,
    groups: Mutex<Groups>,
    /// When the messages waiting behind their group were last kept
    /// invisible.
    waiting_refreshed: Mutex<std::time::Instant>,
    /// When messages retried in place were first offered, by SQS id: a
    /// visibility change cannot carry `courier-first-attempt-at`. Bounded:
    /// a message another replica then received is never settled here.
    first_attempts: Mutex<Recent<String, SystemTime>>,
    /// FIFO: receives of a message that used no attempt (a retry while the
    /// app was unreachable), and due times beyond one visibility window, by
    /// SQS id. Kept in the process: a FIFO retry cannot be a copy.
    uncounted: Mutex<Recent<String, u32>>,
    due: Mutex<Recent<String, SystemTime>>,
    /// The receive count at which this process last retried a message in
    /// place, by SQS id: SQS's count goes on with receives courier settled,
    /// so only a receive after one not settled here can make a poison pill.
    retried: Mutex<Recent<String, u32>>,
    /// How long a message may wait in SQS, as courier keeps to it.
    limits: settle::Limits,
    /// Retries this process made invisible, by due time and receipt, and
    /// when SQS makes each visible by itself (whole seconds later): this
    /// process makes them visible at their due time.
    surfacing: Mutex<BTreeMap<(SystemTime, String), std::time::Instant>>,
    deletes: mpsc::UnboundedSender<Delete>,
    deleter: tokio::task::JoinHandle<()>,
    /// The dead letters and sends, on the same client.
    store: SqsStore,
}

impl SqsSource {
    pub async fn connect(url: &str, options: SourceOptions) -> Result<Self, SourceError> {
        let region = connection::region_of(url).map_err(SourceError::invalid)?;
        let client = connection::client(&region).await;
        Self::connect_with(client, &region, options).await
    }

    /// A consumer on `client`, which reaches `region`.
    async fn connect_with(
        client: Client,
        region: &str,
        options: SourceOptions,
    ) -> Result<Self, SourceError> {
        let limits = settle::Limits::from_env()?;
        if limits != settle::Limits::SQS {
            tracing::warn!(
                max_visibility_secs = limits.visibility,
                max_delay_secs = limits.delay,
                "SQS's limits on how long a message waits are lowered for this run ({} or {} is set): a retry past them is a chain of copies",
                settle::MAX_VISIBILITY_ENV,
                settle::MAX_DELAY_ENV
            );
        }
        let name = connection::queue_name(&options.queue).to_string();
        let queue_url =
            if options.queue.starts_with("http://") || options.queue.starts_with("https://") {
                options.queue.clone()
            } else {
                connection::queue_url(&client, &name, options.create)
                    .await?
                    .ok_or_else(|| connection::missing_queue(&name, region))?
            };
        let attributes = connection::queue_attributes(&client, &queue_url).await?;
        let fifo = attributes
            .get(&QueueAttributeName::FifoQueue)
            .is_some_and(|v| v == "true")
            || name.ends_with(".fifo");
        let redrive_policy = attributes.get(&QueueAttributeName::RedrivePolicy).cloned();
        let seal = match &options.seal {
            Some(seal) => seal.clone(),
            None => Arc::new(connection::seal_of(&client, &queue_url).await?),
        };
        let (deletes, receiver) = mpsc::unbounded_channel();
        let deleter = tokio::spawn(settle::delete_batches(
            client.clone(),
            queue_url.clone(),
            receiver,
        ));
        let store = SqsStore::new(
            client.clone(),
            &options,
            region,
            WorkQueue {
                url: queue_url.clone(),
                fifo,
            },
            seal.clone(),
        );
        let source = Self {
            store,
            live: Mutex::new(options.live.clone()),
            client,
            options,
            queue_url,
            fifo,
            redrive_policy,
            seal,
            in_flight: Mutex::default(),
            groups: Mutex::default(),
            waiting_refreshed: Mutex::new(std::time::Instant::now()),
            first_attempts: Mutex::new(Recent::new(REMEMBERED)),
            uncounted: Mutex::new(Recent::new(REMEMBERED)),
            due: Mutex::new(Recent::new(REMEMBERED)),
            retried: Mutex::new(Recent::new(REMEMBERED)),
            limits,
            surfacing: Mutex::default(),
            deletes,
            deleter,
        };
        source.warn_about_redrive(source.options.live.max_deliveries);
        Ok(source)
    }

    fn live(&self) -> LiveSettings {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The policy's maxAttempts is `max_deliveries - 2`.
    fn warn_about_redrive(&self, max_deliveries: u32) {
        let max_attempts = max_deliveries.saturating_sub(2).max(1);
        if let Some(warning) = self
            .redrive_policy
            .as_deref()
            .and_then(|p| redrive_warning(p, max_attempts))
        {
            tracing::warn!(queue = %self.options.queue, "{warning}");
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[async_trait]
impl Consumer for SqsSource {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            per_message_delay: true,
            out_of_order_acks: true,
            dead_letter_browsing: true,
            dedup: false,
            byte_bounded_reads: false,
            dead_letter_age: false,
            key_ordering: false,
            shared_rate_limit: false,
            dead_letter_jobs: true,
            exact_replay: false,
            multi_process: true,
        }
    }

    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        self.read(max).await
    }

    async fn settle(
        &self,
        delivery: &Delivery,
        settlement: Settlement<'_>,
    ) -> Result<(), SourceError> {
        settle_by_parts(self, delivery, settlement).await
    }

    async fn keep_alive(&self, in_flight: &[Delivery]) -> Result<(), SourceError> {
        self.keep_invisible(in_flight).await
    }

    /// FIFO messages still waiting behind their group go back to SQS at
    /// once, not after their visibility timeout.
    async fn close(&self) {
        let receipts = self.waiting_receipts();
        lock(&self.groups).waiting.clear();
        for receipt in receipts {
            lock(&self.in_flight).remove(&receipt);
            let _ = self.change_visibility(&self.queue_url, &receipt, 0).await;
        }
    }
}

#[async_trait]
impl Observed for SqsSource {
    async fn depth(&self) -> Result<Depth, SourceError> {
        let held = lock(&self.in_flight).len() as u64;
        self.store.depth(&self.live().dead_letter_queue, held).await
    }

    fn check(&self, settings: &LiveSettings) -> Result<(), String> {
        dead_letters::check_dead_letter_queue(
            &settings.dead_letter_queue,
            connection::queue_name(&self.options.queue),
        )
    }

    fn apply(&self, settings: &LiveSettings) {
        let before = std::mem::replace(&mut *lock(&self.live), settings.clone());
        if before.max_deliveries != settings.max_deliveries {
            self.warn_about_redrive(settings.max_deliveries);
        }
    }
}

impl WithStore for SqsSource {
    fn store(&self) -> &dyn DeadLetterStore {
        &self.store
    }
}

impl Drop for SqsSource {
    fn drop(&mut self) {
        self.deleter.abort();
    }
}
