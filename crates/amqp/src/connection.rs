//! Opening, re-opening and closing the connection, and the consumer.

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::FieldTable;
use lapin::uri::AMQPUri;
use lapin::{BasicProperties, Connection, ConnectionProperties, ErrorKind};
use tokio::sync::mpsc;

use super::convert::fields_of;
use super::dead_letters::AmqpStore;
use super::errors::{broker_error, lost, short};
use super::queues::QueueKind;
use super::seal::read_seal;
use super::session::Session;
use super::{AmqpSource, CONNECT_TIMEOUT, FRAME_MAX, QueueState, new_id, queue_state};
use courier_core::model::Delivery;
use courier_core::source::shared::IN_PROCESS_WAIT;
use courier_core::source::{SourceError, SourceOptions, Tls};

/// How long a stop waits for deliveries on their way to the consumer
/// before cancelling it (`settle_prefetch`).
const PREFETCH_SETTLE_LIMIT: Duration = Duration::from_secs(2);

/// The `--tls-*` files as lapin takes them: the CA is trusted beside the
/// system's roots, the client certificate and key go as PEM.
fn tls_config(tls: &Tls) -> OwnedTLSConfig {
    OwnedTLSConfig {
        identity: tls.client_pem().map(|(cert, key)| OwnedIdentity::PKCS8 {
            pem: cert.to_vec(),
            key: key.to_vec(),
        }),
        cert_chain: tls
            .ca_pem()
            .map(|pem| String::from_utf8_lossy(pem).into_owned()),
    }
}

/// Where a connection goes and what it is called: shared by a consumer and
/// the dead-letter store on it. Opening a session with it declares nothing.
pub(super) struct Link {
    pub(super) uri: AMQPUri,
    pub(super) redacted: String,
    /// The connection name's consumer and queue, for the management UI.
    name: String,
    tls: Tls,
    pub(super) state: Arc<QueueState>,
    pub(super) generation: AtomicU64,
    /// Set when the consumer failed on a frame over the frame size courier
    /// asked for: a message's headers travel in one frame, so that message
    /// would come first again, forever. Connections from then on take the
    /// broker's frame size.
    large_frames: Arc<AtomicBool>,
    /// `?frame_max=` was in the URL: the operator's choice stands.
    frame_max_given: bool,
}

impl Link {
    pub(super) fn parse(url: &str, options: &SourceOptions) -> Result<Self, SourceError> {
        let mut uri = AMQPUri::from_str(url).map_err(|e| {
            SourceError::invalid(format!(
                "--source {}: {}",
                courier_core::source::redact(url),
                courier_core::source::redact_error(url, e)
            ))
        })?;
        // A peer that vanishes without closing the socket is noticed within
        // two heartbeats.
        uri.query.heartbeat.get_or_insert(10);
        uri.query.connection_timeout.get_or_insert(5_000);
        let frame_max_given = uri.query.frame_max.is_some();
        uri.query.frame_max.get_or_insert(FRAME_MAX);
        short(&options.queue)?;
        let key = format!(
            "{}:{}/{}/{}",
            uri.authority.host, uri.authority.port, uri.vhost, options.queue
        );
        Ok(Self {
            uri,
            redacted: courier_core::source::redact(url),
            name: format!("courier {} ({})", options.consumer, options.queue),
            tls: options.tls.clone(),
            state: queue_state(&key),
            generation: AtomicU64::new(0),
            large_frames: Arc::default(),
            frame_max_given,
        })
    }

    /// A new connection with its consumer and publisher channels; it
    /// declares nothing.
    pub(super) async fn open(&self) -> Result<Session, SourceError> {
        let properties =
            ConnectionProperties::default().with_connection_name(self.name.clone().into());
        let runtime = lapin::runtime::default_runtime()
            .map_err(|e| SourceError::unavailable(format!("{}: {e}", self.redacted)))?;
        let mut uri = self.uri.clone();
        if self.large_frames.load(Ordering::SeqCst) {
            // lapin takes the broker's frame_max when courier asks for none.
            uri.query.frame_max = Some(0);
        }
        let connection = tokio::time::timeout(
            CONNECT_TIMEOUT,
            Connection::connect_uri_with_config(uri, properties, tls_config(&self.tls), runtime),
        )
        .await
        .map_err(|_| {
            SourceError::unavailable(format!(
                "{}: no answer within {CONNECT_TIMEOUT:?}",
                self.redacted
            ))
        })?
        .map_err(|e| self.connect_error(e))?;
        let consume = connection
            .create_channel()
            .await
            .map_err(|e| self.connect_error(e))?;
        let publish = connection
            .create_channel()
            .await
            .map_err(|e| self.connect_error(e))?;
        publish
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(broker_error)?;
        Ok(Session {
            generation: self.generation.fetch_add(1, Ordering::SeqCst) + 1,
            connection,
            consume,
            publish,
            admin: tokio::sync::Mutex::new(None),
            inbox: tokio::sync::Mutex::new(None),
            consumer_tag: Mutex::new(None),
            pump: Mutex::new(None),
            declared: Mutex::new(HashSet::new()),
            outstanding: Arc::default(),
            broken: Arc::default(),
            state: self.state.clone(),
        })
    }

    /// Connections of this link take the broker's frame size from the
    /// start, unless the URL gives one: for the commands (`courier dlq`),
    /// which read whatever a queue holds once and keep no buffers for long.
    pub(super) fn with_broker_frames(self) -> Self {
        self.large_frames
            .store(!self.frame_max_given, Ordering::SeqCst);
        self
    }

    fn connect_error(&self, e: lapin::Error) -> SourceError {
        let user = &self.uri.authority.userinfo.username;
        match e.kind() {
            ErrorKind::ProtocolError(p)
                if matches!(p.kind(), AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)) =>
            {
                SourceError::refused(format!(
                    "RabbitMQ at {} refused the login of user {user:?} ({p}); check the user name and password in --source",
                    self.redacted
                ))
            }
            ErrorKind::ProtocolError(p)
                if matches!(p.kind(), AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)) =>
            {
                SourceError::refused(format!(
                    "RabbitMQ at {} does not let user {user:?} into vhost {:?} ({p}); check the vhost in --source (%2f is /) and the user's permissions",
                    self.redacted, self.uri.vhost
                ))
            }
            ErrorKind::ProtocolError(p) => {
                SourceError::broker(format!("RabbitMQ at {}: {p}", self.redacted))
            }
            _ => SourceError::unavailable(format!("{}: {e}", self.redacted)),
        }
    }
}

impl AmqpSource {
    pub async fn connect(url: &str, options: SourceOptions) -> Result<Self, SourceError> {
        let link = Arc::new(Link::parse(url, &options)?);
        let session = Arc::new(link.open().await?);
        let opened = async {
            session
                .require(
                    &options.queue,
                    options.create.then(|| QueueKind::from(options.queue_type)),
                    &link.uri.vhost,
                )
                .await?;
            match &options.seal {
                Some(seal) => Ok(seal.clone()),
                None => read_seal(&session, &options.queue).await.map(Arc::new),
            }
        }
        .await;
        let seal = match opened {
            Ok(seal) => seal,
            Err(e) => {
                session.retire();
                return Err(e);
            }
        };
        Ok(Self {
            store: AmqpStore::new(link.clone(), &options.queue, Some(seal.clone())),
            link,
            session: Mutex::new(Some(session)),
            connecting: tokio::sync::Mutex::new(()),
            consuming: AtomicBool::new(false),
            interrupted: tokio::sync::Notify::new(),
            properties: Mutex::new(HashMap::new()),
            dead_letter_queue: Mutex::new(options.live.dead_letter_queue.clone()),
            max_deliveries: AtomicU32::new(options.live.max_deliveries),
            kind: Mutex::new(None),
            seal,
            options,
        })
    }

    pub(super) fn current(&self) -> Option<Arc<Session>> {
        self.session
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The live session, opening a new one when the last was lost.
    pub(super) async fn session(&self) -> Result<Arc<Session>, SourceError> {
        if let Some(s) = self.current().filter(|s| s.healthy()) {
            return Ok(s);
        }
        let _one_at_a_time = self.connecting.lock().await;
        if let Some(s) = self.current() {
            if s.healthy() {
                return Ok(s);
            }
            s.retire();
            *self.session.lock().unwrap_or_else(|e| e.into_inner()) = None;
            tracing::warn!(source = %self.link.redacted, queue = %self.options.queue, "the connection to RabbitMQ was lost; reconnecting");
        }
        let session = Arc::new(self.open_session().await?);
        *self.session.lock().unwrap_or_else(|e| e.into_inner()) = Some(session.clone());
        if self.consuming.load(Ordering::SeqCst)
            && let Err(e) = self.start_consuming(&session).await
        {
            session.retire();
            return Err(e);
        }
        Ok(session)
    }

    /// A session on which the work queue exists (declared with
    /// `--create`).
    pub(super) async fn open_session(&self) -> Result<Session, SourceError> {
        let session = self.link.open().await?;
        if let Err(e) = session
            .require(
                &self.options.queue,
                self.options
                    .create
                    .then(|| QueueKind::from(self.options.queue_type)),
                &self.link.uri.vhost,
            )
            .await
        {
            session.retire();
            return Err(e);
        }
        Ok(session)
    }

    /// Starts the consumer and the task that moves its deliveries to the
    /// inbox, counting each as held.
    pub(super) async fn start_consuming(&self, session: &Session) -> Result<(), SourceError> {
        let prefetch = self.prefetch();
        session
            .consume
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| session.fail(e))?;
        let mut consumer = session
            .consume
            .basic_consume(
                short(&self.options.queue)?,
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| session.fail(e))?;
        *session
            .consumer_tag
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(consumer.tag());
        let (tx, rx) = mpsc::unbounded_channel();
        let (outstanding, broken, state) = (
            session.outstanding.clone(),
            session.broken.clone(),
            session.state.clone(),
        );
        let queue = self.options.queue.clone();
        let large_frames = (!self.link.frame_max_given).then(|| self.link.large_frames.clone());
        let pump = tokio::spawn(async move {
            while let Some(item) = consumer.next().await {
                match item {
                    Ok(delivery) => {
                        outstanding
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(delivery.delivery_tag);
                        state.unacked.fetch_add(1, Ordering::SeqCst);
                        if tx.send(delivery).is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, %queue, "the RabbitMQ consumer failed");
                        if let Some(large_frames) = &large_frames
                            && is_frame_error(&e)
                            && !large_frames.swap(true, Ordering::SeqCst)
                        {
                            tracing::warn!(%queue, "a message's headers did not fit courier's {FRAME_MAX}-byte frames; reconnecting with the broker's frame size, which costs about 7 MiB more memory (set ?frame_max= in --source to choose)");
                        }
                        break;
                    }
                }
            }
            broken.store(true, Ordering::SeqCst);
        });
        *session.pump.lock().unwrap_or_else(|e| e.into_inner()) = Some(pump);
        *session.inbox.lock().await = Some(rx);
        Ok(())
    }

    /// How many unacked deliveries the broker may hand this consumer.
    fn prefetch(&self) -> u16 {
        self.options
            .in_flight_messages()
            .clamp(1, usize::from(u16::MAX)) as u16
    }

    /// Waits, before the consumer is cancelled, until no delivery can be on
    /// its way to it: the prefetch window is full, or the work queue has no
    /// ready message left and a round trip on the consumer channel has
    /// brought in what the queue had sent before. A delivery still on its
    /// way when the cancel is answered would be lost to courier: RabbitMQ
    /// sends a quorum queue's deliveries after `basic.cancel-ok` when the
    /// queue handed them out before it saw the cancel (the acks of the last
    /// deliveries in flight give it room to), and lapin drops a delivery for
    /// a consumer it no longer knows. Unacked on the channel, it would come
    /// back at the close with `x-delivery-count` raised, which courier must
    /// count as an attempt; caught here, it is given back as a copy with the
    /// rest of the prefetch. Only a message published between the last look
    /// and the cancel can still slip through.
    async fn settle_prefetch(&self, session: &Session) {
        let prefetch = self.prefetch();
        let deadline = tokio::time::Instant::now() + PREFETCH_SETTLE_LIMIT;
        loop {
            let held = session
                .outstanding
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .len();
            if held >= usize::from(prefetch) {
                return;
            }
            let ready = match session.passive_count(&self.options.queue).await {
                Ok(Some(ready)) => ready,
                _ => return,
            };
            // The queue answered after sending what it had handed out; the
            // consumer channel passes those deliveries on before this reply.
            if session
                .consume
                .basic_qos(prefetch, BasicQosOptions::default())
                .await
                .is_err()
            {
                return;
            }
            if ready == 0 {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::debug!(queue = %self.options.queue, held, ready, "the prefetch did not fill before the stop; cancelling the consumer anyway");
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The session a receipt belongs to, if it is still the live one.
    pub(super) fn session_for(&self, receipt: &str) -> Result<(Arc<Session>, u64), SourceError> {
        let (generation, tag) = receipt
            .split_once(':')
            .and_then(|(g, t)| Some((g.parse::<u64>().ok()?, t.parse::<u64>().ok()?)))
            .ok_or_else(|| SourceError::broker(format!("bad receipt {receipt:?}")))?;
        let session = self
            .current()
            .filter(|s| s.generation == generation && s.healthy())
            .ok_or_else(lost)?;
        Ok((session, tag))
    }

    pub(super) fn take_properties(&self, receipt: &str) -> Option<BasicProperties> {
        self.properties
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(receipt)
    }

    pub(super) async fn receive_batch(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        let session = self.session().await?;
        if !self.consuming.swap(true, Ordering::SeqCst)
            && let Err(e) = self.start_consuming(&session).await
        {
            self.consuming.store(false, Ordering::SeqCst);
            return Err(e);
        }
        let mut batch = Vec::new();
        {
            let mut inbox = session.inbox.lock().await;
            let Some(rx) = inbox.as_mut() else {
                session.broken.store(true, Ordering::SeqCst);
                return Err(SourceError::unavailable("the consumer is not running"));
            };
            // The wait is on the channel the consumer's deliveries come
            // through, in the process: a stop may end it, taking nothing.
            let got = tokio::select! {
                got = tokio::time::timeout(IN_PROCESS_WAIT, rx.recv()) => got,
                () = self.interrupted.notified() => return Ok(Vec::new()),
            };
            match got {
                Err(_) => return Ok(Vec::new()),
                Ok(None) => {
                    session.broken.store(true, Ordering::SeqCst);
                    return Err(SourceError::unavailable(
                        "the RabbitMQ consumer stopped (connection lost or queue deleted); reconnecting",
                    ));
                }
                Ok(Some(d)) => batch.push(d),
            }
            while batch.len() < max.max(1) {
                match rx.try_recv() {
                    Ok(d) => batch.push(d),
                    Err(_) => break,
                }
            }
        }
        let mut out = Vec::with_capacity(batch.len());
        for delivery in batch {
            match self.admit(&session, delivery).await {
                Ok(Some(d)) => out.push(d),
                Ok(None) => {}
                // What was taken and not handed out is requeued by the
                // broker when the broken connection is replaced.
                Err(e) => {
                    session.broken.store(true, Ordering::SeqCst);
                    for d in &out {
                        self.take_properties(&d.receipt);
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// Stops consuming and gives back, without counting an attempt, what
    /// was prefetched and never offered to the app; then closes.
    pub(super) async fn shut_down(&self) {
        self.store.close().await;
        let Some(session) = self.current() else {
            return;
        };
        let tag = session
            .consumer_tag
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(tag) = tag
            && session.healthy()
        {
            self.settle_prefetch(&session).await;
            let _ = session
                .consume
                .basic_cancel(tag, BasicCancelOptions::default())
                .await;
            let pump = session
                .pump
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some(pump) = pump {
                let _ = tokio::time::timeout(Duration::from_secs(1), pump).await;
            }
            let mut inbox = session.inbox.lock().await;
            if let Some(rx) = inbox.as_mut() {
                while let Ok(d) = rx.try_recv() {
                    let fields = fields_of(&d);
                    let id = d
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|id| id.to_string())
                        .unwrap_or_else(new_id);
                    let given_back = self
                        .move_to(
                            &session,
                            d.delivery_tag,
                            None,
                            &fields,
                            Some(&d.properties),
                            &id,
                        )
                        .await;
                    if let Err(e) = given_back {
                        tracing::warn!(error = %e, "giving back prefetched messages failed; RabbitMQ requeues them");
                        break;
                    }
                }
            }
        }
        session.retire();
        let _ = session.connection.close(200, "courier stops".into()).await;
        *self.session.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// lapin's answer to a frame over the frame size courier asked for.
fn is_frame_error(e: &lapin::Error) -> bool {
    matches!(e.kind(), ErrorKind::ProtocolError(p)
        if matches!(p.kind(), AMQPErrorKind::Hard(AMQPHardError::FRAMEERROR)))
}
