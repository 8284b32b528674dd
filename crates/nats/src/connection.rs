//! The connection, the durable consumer, and what every source of the
//! process shares.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_nats::Client;
use async_nats::jetstream;
use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::context::Context;
use async_nats::jetstream::context::{
    ConsumerInfoError, ConsumerInfoErrorKind, CreateStreamError, CreateStreamErrorKind,
    GetStreamError, GetStreamErrorKind, RequestError,
};
use async_nats::jetstream::message::AckKind;
use async_nats::jetstream::stream::{
    Config as StreamConfig, ConsumerError, ConsumerErrorKind, DeleteMessageError,
    DeleteMessageErrorKind, PurgeError, PurgeErrorKind, RawMessageError, RawMessageErrorKind,
    RetentionPolicy, StorageType,
};
use async_nats::{ConnectErrorKind, ConnectOptions, ServerAddr};

use super::NatsSource;
use super::dead_letters::{NatsStore, dead_letter_stream};
use super::fields::seal_of;
use courier_core::model::Delivery;
use courier_core::source::redact::{percent_decode, redact, redact_error};
use courier_core::source::{LiveSettings, SourceError, SourceOptions};
use courier_core::source::{REMEMBERED, Recent};

/// Checks a `nats://` URL at start.
pub fn check_url(text: &str) -> Result<(), String> {
    server_addrs(text).map(drop)
}

/// The servers of a `nats://` URL: one, or several separated by commas as
/// the NATS tools write a cluster (`nats://h1:4222,h2:4222,h3:4222`). A
/// server written without a scheme takes the first one's; the credentials
/// are the first ones given. The client connects to any of them and
/// reconnects to another when its server goes away.
pub(super) fn server_addrs(text: &str) -> Result<Vec<ServerAddr>, String> {
    let scheme = text.split_once("://").map_or("nats", |(scheme, _)| scheme);
    let refused = |why: String| {
        format!(
            "{}: {why}; write it like nats://host:4222, nats://user:pass@host:4222, or nats://h1:4222,h2:4222,h3:4222 for a cluster",
            redact(text)
        )
    };
    text.split(',')
        .map(str::trim)
        .map(|server| {
            if server.is_empty() || server.ends_with("://") {
                return Err(refused("an empty server in the list".into()));
            }
            let full = if server.contains("://") {
                server.to_string()
            } else {
                format!("{scheme}://{server}")
            };
            ServerAddr::from_str(&full).map_err(|e| refused(redact_error(&full, e)))
        })
        .collect()
}

pub(super) fn check_stream_name(name: &str) -> Result<(), SourceError> {
    if name.is_empty() || name != dead_letter_stream(name) {
        return Err(SourceError::invalid(format!(
            "--queue {name:?} is not a JetStream stream name: it names the stream, and stream names cannot contain '.', '*', '>', '/', '\\' or whitespace"
        )));
    }
    Ok(())
}

pub(super) fn unavailable(e: impl std::fmt::Display) -> SourceError {
    SourceError::unavailable(format!("NATS: {e}"))
}

/// The JetStream error code an async-nats error carries, if any.
pub(super) trait JsCode {
    fn code(&self) -> Option<ErrorCode>;
}

impl JsCode for GetStreamError {
    fn code(&self) -> Option<ErrorCode> {
        match self.kind() {
            GetStreamErrorKind::JetStream(e) => Some(e.error_code()),
            _ => None,
        }
    }
}

impl JsCode for CreateStreamError {
    fn code(&self) -> Option<ErrorCode> {
        match self.kind() {
            CreateStreamErrorKind::NotFound => Some(ErrorCode::STREAM_NOT_FOUND),
            CreateStreamErrorKind::JetStream(e) => Some(e.error_code()),
            _ => None,
        }
    }
}

impl JsCode for ConsumerError {
    fn code(&self) -> Option<ErrorCode> {
        match self.kind() {
            ConsumerErrorKind::JetStream(e) => Some(e.error_code()),
            _ => None,
        }
    }
}

impl JsCode for ConsumerInfoError {
    fn code(&self) -> Option<ErrorCode> {
        match self.kind() {
            ConsumerInfoErrorKind::NotFound => Some(ErrorCode::CONSUMER_NOT_FOUND),
            ConsumerInfoErrorKind::StreamNotFound => Some(ErrorCode::STREAM_NOT_FOUND),
            ConsumerInfoErrorKind::JetStream(e) => Some(e.error_code()),
            _ => None,
        }
    }
}

impl JsCode for RawMessageError {
    fn code(&self) -> Option<ErrorCode> {
        match self.kind() {
            RawMessageErrorKind::NoMessageFound => Some(ErrorCode::NO_MESSAGE_FOUND),
            RawMessageErrorKind::JetStream(e) => Some(e.error_code()),
            _ => None,
        }
    }
}

impl JsCode for DeleteMessageError {
    fn code(&self) -> Option<ErrorCode> {
        match self.kind() {
            DeleteMessageErrorKind::JetStream(e) => Some(e.error_code()),
            _ => None,
        }
    }
}

impl JsCode for PurgeError {
    fn code(&self) -> Option<ErrorCode> {
        match self.kind() {
            PurgeErrorKind::JetStream(e) => Some(e.error_code()),
            _ => None,
        }
    }
}

/// A request's answer (a stream's info) carries the server's error as its
/// cause.
impl JsCode for RequestError {
    fn code(&self) -> Option<ErrorCode> {
        std::error::Error::source(self)?
            .downcast_ref::<async_nats::jetstream::Error>()
            .map(|e| e.error_code())
    }
}

pub(super) fn js_code(e: &impl JsCode) -> Option<ErrorCode> {
    e.code()
}

/// What every source of this process on one consumer (`url`, queue,
/// group) shares: deliveries handed out and not yet settled. An admin
/// handle reads the same counter for its depth.
pub(super) fn held_counter(url: &str, options: &SourceOptions) -> Arc<AtomicI64> {
    static HELD: OnceLock<Mutex<HashMap<String, Arc<AtomicI64>>>> = OnceLock::new();
    let key = format!("{}/{}/{}", redact(url), options.queue, options.group);
    HELD.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key)
        .or_default()
        .clone()
}

/// A client connected to the servers of `url`; nothing is created.
pub(super) async fn connect_client(
    url: &str,
    options: &SourceOptions,
) -> Result<Client, SourceError> {
    let redacted = redact(url);
    let servers = server_addrs(url).map_err(|e| SourceError::invalid(format!("--source {e}")))?;
    let credentials = servers
        .iter()
        .find(|addr| addr.username().is_some())
        .map(|addr| (addr.username(), addr.password()));
    // async-nats does not read credentials from the URL itself.
    let connect = match credentials.unwrap_or((None, None)) {
        (Some(user), Some(pass)) => {
            ConnectOptions::with_user_and_password(percent_decode(user), percent_decode(pass))
        }
        (Some(token), None) => ConnectOptions::with_token(percent_decode(token)),
        _ => ConnectOptions::new(),
    };
    // `tls://` verifies against --tls-ca-file and presents the client
    // certificate of the flags; without flags, against the system's roots.
    let connect = match options.tls.client_config() {
        Some(config) => connect.tls_client_config(config),
        None => connect,
    };
    connect
            .require_tls(servers.iter().any(ServerAddr::tls_required))
            .name(format!("courier {} ({})", options.consumer, options.queue))
            .ping_interval(Duration::from_secs(10))
            .connection_timeout(Duration::from_secs(5))
            .max_reconnects(None)
            .connect(servers)
            .await
            .map_err(|e| match e.kind() {
                ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => {
                    SourceError::refused(format!(
                        "NATS at {redacted} refused the credentials ({e}); check the user and password in --source"
                    ))
                }
                ConnectErrorKind::ServerParse => SourceError::invalid(format!(
                    "--source {redacted}: {}",
                    redact_error(url, &e)
                )),
                _ => SourceError::unavailable(format!("{redacted}: {e}")),
            })
}

/// What courier uses of the work stream's configuration.
#[derive(Clone)]
pub(super) struct WorkStream {
    /// Where `send` publishes: the first subject without wildcards.
    pub(super) send_subject: Option<String>,
    pub(super) subjects: Vec<String>,
    pub(super) replicas: usize,
}

impl WorkStream {
    fn of(config: &StreamConfig) -> Self {
        Self {
            send_subject: config
                .subjects
                .iter()
                .find(|s| !s.split('.').any(|t| t == "*" || t == ">"))
                .cloned(),
            subjects: config.subjects.clone(),
            replicas: config.num_replicas.max(1),
        }
    }

    /// The stream `queue`, read; a missing one is an error that says how
    /// to create it.
    pub(super) async fn read(
        js: &Context,
        queue: &str,
        redacted: &str,
    ) -> Result<Self, SourceError> {
        match js.get_stream(queue).await {
            Ok(mut stream) => Ok(Self::of(&stream.info().await.map_err(unavailable)?.config)),
            Err(e) => Err(stream_error(e, queue, redacted)),
        }
    }
}

/// The work stream could not be read: missing, or JetStream is off.
fn stream_error(e: GetStreamError, queue: &str, redacted: &str) -> SourceError {
    if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) {
        return missing_stream(queue, redacted);
    }
    SourceError::unavailable(format!(
        "{redacted}: cannot read stream {queue:?} ({e}); is JetStream enabled (nats-server -js)?"
    ))
}

/// The work stream `queue` is not on the server: how to create it.
pub(super) fn missing_stream(queue: &str, redacted: &str) -> SourceError {
    SourceError::invalid(format!(
        "stream {queue:?} does not exist on {redacted}; create it (nats stream add {queue} --subjects {queue}), or start `courier run` with --create to create a work-queue stream capturing subject {queue:?}"
    ))
}

impl NatsSource {
    pub async fn connect(url: &str, options: SourceOptions) -> Result<Self, SourceError> {
        check_stream_name(&options.queue)?;
        let client = connect_client(url, &options).await?;
        let js = jetstream::new(client.clone());
        let info = match js.get_stream(&options.queue).await {
            Ok(mut stream) => stream.info().await.map_err(unavailable)?.clone(),
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) && options.create => {
                let config = StreamConfig {
                    name: options.queue.clone(),
                    subjects: vec![options.queue.clone()],
                    retention: RetentionPolicy::WorkQueue,
                    storage: StorageType::File,
                    ..Default::default()
                };
                js.create_stream(config).await.map_err(|e| {
                    SourceError::broker(format!("cannot create stream {:?}: {e}", options.queue))
                })?;
                let mut stream = js.get_stream(&options.queue).await.map_err(unavailable)?;
                stream.info().await.map_err(unavailable)?.clone()
            }
            Err(e) => return Err(stream_error(e, &options.queue, &redact(url))),
        };
        let work = WorkStream::of(&info.config);
        let held = held_counter(url, &options);
        let seal = match &options.seal {
            Some(seal) => seal.clone(),
            None => Arc::new(seal_of(&js, &options.queue, work.replicas).await?),
        };
        Ok(Self {
            store: NatsStore::new(
                client.clone(),
                &options,
                &redact(url),
                held.clone(),
                Some(work.clone()),
                Some(seal.clone()),
            ),
            seal,
            client,
            js,
            send_subject: work.send_subject,
            work_subjects: work.subjects,
            replicas: work.replicas,
            consumer: Arc::default(),
            in_flight: Arc::default(),
            first_attempts: Mutex::new(Recent::new(REMEMBERED)),
            retried: Mutex::new(Recent::new(REMEMBERED)),
            held,
            puller: Arc::default(),
            dead_letter_streams: Mutex::new(Vec::new()),
            progress: Mutex::new(None),
            ack_wait_ms: Arc::new(AtomicU64::new(millis(options.live.visibility_timeout))),
            live: Mutex::new(options.live.clone()),
            options,
        })
    }

    /// The durable consumer, created when missing; starts the in-progress
    /// ticker for its `AckWait`.
    pub(super) async fn consumer(&self) -> Result<Arc<PullConsumer>, SourceError> {
        let mut slot = self.consumer.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let stream = self
            .js
            .get_stream_no_info(&self.options.queue)
            .await
            .map_err(unavailable)?;
        let mut consumer: PullConsumer = match stream.consumer_info(&self.options.group).await {
            Ok(_) => stream
                .get_consumer(&self.options.group)
                .await
                .map_err(unavailable)?,
            Err(e) if js_code(&e) == Some(ErrorCode::CONSUMER_NOT_FOUND) => {
                let config = PullConfig {
                    durable_name: Some(self.options.group.clone()),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: self.live().visibility_timeout,
                    max_deliver: -1,
                    max_ack_pending: -1,
                    ..Default::default()
                };
                stream.create_consumer(config).await.map_err(|e| {
                    SourceError::broker(format!(
                        "cannot create the durable consumer {:?} on stream {:?}: {e}",
                        self.options.group, self.options.queue
                    ))
                })?
            }
            Err(e) => return Err(unavailable(e)),
        };
        let info = consumer.info().await.map_err(unavailable)?;
        if info.config.ack_policy != AckPolicy::Explicit {
            return Err(SourceError::invalid(format!(
                "consumer {:?} on stream {:?} does not use explicit acks; courier needs AckPolicy explicit (delete it and let courier create it)",
                self.options.group, self.options.queue
            )));
        }
        self.ack_wait_ms
            .store(millis(info.config.ack_wait), Ordering::SeqCst);
        self.start_progress();
        let consumer = Arc::new(consumer);
        *slot = Some(consumer.clone());
        Ok(consumer)
    }

    /// Sends `+WPI` for every delivery in flight, every third of `AckWait`,
    /// so none runs out of it however long the app takes; and for what a
    /// request sent ahead brought while no read came to take it (the
    /// dispatcher waits out a hold, a closed gate or a slow app), which is
    /// parked for the next read.
    pub(super) fn start_progress(&self) {
        let (client, in_flight) = (self.client.clone(), self.in_flight.clone());
        let (ack_wait_ms, puller) = (self.ack_wait_ms.clone(), self.puller.clone());
        let task = tokio::spawn(async move {
            loop {
                let ack_wait = Duration::from_millis(ack_wait_ms.load(Ordering::SeqCst));
                tokio::time::sleep((ack_wait / 3).max(Duration::from_millis(500))).await;
                let mut due: Vec<String> = in_flight
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .keys()
                    .cloned()
                    .collect();
                // A read holding the puller takes what waits itself.
                if let Ok(mut puller) = puller.try_lock()
                    && let Some(puller) = puller.as_mut()
                {
                    due.extend(puller.park());
                }
                for receipt in due {
                    let _ = client.publish(receipt, AckKind::Progress.into()).await;
                }
            }
        });
        if let Some(old) = self
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(task)
        {
            old.abort();
        }
    }

    /// `+WPI` for each of these deliveries: the server restarts their
    /// `AckWait` and hands them to no one else.
    pub(super) async fn in_progress(&self, in_flight: &[Delivery]) -> Result<(), SourceError> {
        let mut result = Ok(());
        for delivery in in_flight {
            if let Err(e) = self
                .client
                .publish(delivery.receipt.clone(), AckKind::Progress.into())
                .await
            {
                result = Err(unavailable(e));
            }
        }
        result
    }

    /// Takes a live policy change. The dead-letter queue (for depth) and
    /// the poison-pill limit apply at once. The visibility timeout becomes
    /// the durable consumer's `AckWait`, updated on the server (JetStream
    /// 2.10 and later allow it); in-flight deliveries are kept claimed by
    /// in-progress acks whatever it is.
    pub(super) fn follow(&self, settings: &LiveSettings) {
        let before = std::mem::replace(
            &mut *self.live.lock().unwrap_or_else(|e| e.into_inner()),
            settings.clone(),
        );
        if before.visibility_timeout == settings.visibility_timeout {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (js, slot, ack_wait_ms) = (
            self.js.clone(),
            self.consumer.clone(),
            self.ack_wait_ms.clone(),
        );
        let (queue, group) = (self.options.queue.clone(), self.options.group.clone());
        let ack_wait = settings.visibility_timeout;
        runtime.spawn(async move {
            // Not created yet: it is created with the new AckWait.
            let mut slot = slot.lock().await;
            let Some(current) = slot.as_ref() else {
                return;
            };
            let mut config = current.cached_info().config.clone();
            if config.ack_wait == ack_wait {
                return;
            }
            config.ack_wait = ack_wait;
            let updated = match js.get_stream_no_info(&queue).await {
                Ok(stream) => match stream.update_consumer(config).await {
                    Ok(_) => stream
                        .get_consumer::<PullConfig>(&group)
                        .await
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                },
                Err(e) => Err(e.to_string()),
            };
            match updated {
                Ok(consumer) => {
                    ack_wait_ms.store(millis(ack_wait), Ordering::SeqCst);
                    *slot = Some(Arc::new(consumer));
                    tracing::info!(stream = %queue, consumer = %group, ?ack_wait, "the consumer's AckWait follows the policy");
                }
                Err(e) => tracing::warn!(
                    stream = %queue,
                    consumer = %group,
                    error = %e,
                    "the consumer's AckWait could not follow the policy; deliveries in flight are still kept in progress"
                ),
            }
        });
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_url_lists_its_servers() {
        let servers = server_addrs("nats://u:p@h1:4222,h2:4223, nats://h3:4224").unwrap();
        let hosts: Vec<(String, u16)> = servers
            .iter()
            .map(|s| (s.host().to_string(), s.port()))
            .collect();
        assert_eq!(
            hosts,
            [
                ("h1".into(), 4222),
                ("h2".into(), 4223),
                ("h3".into(), 4224)
            ]
        );
        assert_eq!(servers[0].username(), Some("u"));
        assert_eq!(server_addrs("nats://h1:4222").unwrap().len(), 1);
        let error = server_addrs("nats://u:secret@h1:4222,,h3:4222").unwrap_err();
        assert!(error.contains("empty server"), "{error}");
        assert!(!error.contains("secret"), "{error}");
    }

    #[test]
    fn a_queue_must_be_a_stream_name() {
        assert!(check_stream_name("orders").is_ok());
        assert!(check_stream_name("orders.v1").is_err());
    }
}
