//! The connection, the durable consumer, and what every source of the
//! process shares.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::AtomicI64;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::context::{
    ConsumerInfoError, ConsumerInfoErrorKind, CreateStreamError, CreateStreamErrorKind,
    GetStreamError, GetStreamErrorKind,
};
use async_nats::jetstream::message::AckKind;
use async_nats::jetstream::stream::{
    Config as StreamConfig, ConsumerError, ConsumerErrorKind, DeleteMessageError,
    DeleteMessageErrorKind, RawMessageError, RawMessageErrorKind, RetentionPolicy, StorageType,
};
use async_nats::jetstream::{self};
use async_nats::{ConnectErrorKind, ConnectOptions};

use super::NatsSource;
use super::dead_letters::dead_letter_stream;
use crate::source::{SourceError, SourceOptions};

/// Checks a `nats://` URL at start.
pub fn check_url(text: &str) -> Result<(), String> {
    async_nats::ServerAddr::from_str(text)
        .map(drop)
        .map_err(|e| {
            format!(
                "{}: {e}; write it like nats://host:4222 or nats://user:pass@host:4222",
                crate::source::redact(text)
            )
        })
}

/// `%40` → `@`: URL user info is percent-encoded.
pub(super) fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub(super) fn check_stream_name(name: &str) -> Result<(), SourceError> {
    if name.is_empty() || name != dead_letter_stream(name) {
        return Err(SourceError::Invalid(format!(
            "--queue {name:?} is not a JetStream stream name: it names the stream, and stream names cannot contain '.', '*', '>', '/', '\\' or whitespace"
        )));
    }
    Ok(())
}

pub(super) fn unavailable(e: impl std::fmt::Display) -> SourceError {
    SourceError::Unavailable(format!("NATS: {e}"))
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

pub(super) fn js_code(e: &impl JsCode) -> Option<ErrorCode> {
    e.code()
}

/// What every source of this process on one consumer shares: deliveries
/// handed out and not yet settled.
pub(super) fn held_counter(key: &str) -> Arc<AtomicI64> {
    static HELD: OnceLock<Mutex<HashMap<String, Arc<AtomicI64>>>> = OnceLock::new();
    HELD.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key.to_string())
        .or_default()
        .clone()
}

impl NatsSource {
    pub async fn connect(url: &str, options: SourceOptions) -> Result<Self, SourceError> {
        let redacted = crate::source::redact(url);
        check_stream_name(&options.queue)?;
        let addr = async_nats::ServerAddr::from_str(url)
            .map_err(|e| SourceError::Invalid(format!("--source {redacted}: {e}")))?;
        // async-nats does not read credentials from the URL itself.
        let connect = match (addr.username(), addr.password()) {
            (Some(user), Some(pass)) => {
                ConnectOptions::with_user_and_password(percent_decode(user), percent_decode(pass))
            }
            (Some(token), None) => ConnectOptions::with_token(percent_decode(token)),
            _ => ConnectOptions::new(),
        };
        let client = connect
            .name(format!("courier {} ({})", options.consumer, options.queue))
            .ping_interval(Duration::from_secs(10))
            .connection_timeout(Duration::from_secs(5))
            .max_reconnects(None)
            .connect(url)
            .await
            .map_err(|e| match e.kind() {
                ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => {
                    SourceError::Broker(format!(
                        "NATS at {redacted} refused the credentials ({e}); check the user and password in --source"
                    ))
                }
                ConnectErrorKind::ServerParse => {
                    SourceError::Invalid(format!("--source {redacted}: {e}"))
                }
                _ => SourceError::Unavailable(format!("{redacted}: {e}")),
            })?;
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
                    SourceError::Broker(format!("cannot create stream {:?}: {e}", options.queue))
                })?;
                let mut stream = js.get_stream(&options.queue).await.map_err(unavailable)?;
                stream.info().await.map_err(unavailable)?.clone()
            }
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => {
                return Err(SourceError::Invalid(format!(
                    "stream {:?} does not exist on {redacted}; create it (nats stream add {} --subjects {}), or start `courier run` with --create to create a work-queue stream capturing subject {:?}",
                    options.queue, options.queue, options.queue, options.queue
                )));
            }
            Err(e) => {
                return Err(SourceError::Unavailable(format!(
                    "{redacted}: cannot read stream {:?} ({e}); is JetStream enabled (nats-server -js)?",
                    options.queue
                )));
            }
        };
        let send_subject = info
            .config
            .subjects
            .iter()
            .find(|s| !s.split('.').any(|t| t == "*" || t == ">"))
            .cloned();
        let held = held_counter(&format!("{}/{}/{}", redacted, options.queue, options.group));
        Ok(Self {
            client,
            js,
            send_subject,
            replicas: info.config.num_replicas.max(1),
            consumer: tokio::sync::Mutex::new(None),
            in_flight: Arc::default(),
            first_attempts: Mutex::new(HashMap::new()),
            held,
            puller: tokio::sync::Mutex::new(None),
            dead_letter_streams: Mutex::new(Vec::new()),
            progress: Mutex::new(None),
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
                    ack_wait: self.options.visibility_timeout,
                    max_deliver: -1,
                    max_ack_pending: -1,
                    ..Default::default()
                };
                stream.create_consumer(config).await.map_err(|e| {
                    SourceError::Broker(format!(
                        "cannot create the durable consumer {:?} on stream {:?}: {e}",
                        self.options.group, self.options.queue
                    ))
                })?
            }
            Err(e) => return Err(unavailable(e)),
        };
        let info = consumer.info().await.map_err(unavailable)?;
        if info.config.ack_policy != AckPolicy::Explicit {
            return Err(SourceError::Invalid(format!(
                "consumer {:?} on stream {:?} does not use explicit acks; courier needs AckPolicy explicit (delete it and let courier create it)",
                self.options.group, self.options.queue
            )));
        }
        let ack_wait = info.config.ack_wait;
        self.start_progress(ack_wait);
        let consumer = Arc::new(consumer);
        *slot = Some(consumer.clone());
        Ok(consumer)
    }

    /// Sends `+WPI` for every delivery in flight, every third of `AckWait`,
    /// so none runs out of it however long the app takes.
    pub(super) fn start_progress(&self, ack_wait: Duration) {
        let every = (ack_wait / 3).max(Duration::from_millis(500));
        let (client, in_flight) = (self.client.clone(), self.in_flight.clone());
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let due: Vec<String> = in_flight
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .keys()
                    .cloned()
                    .collect();
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_credentials_are_percent_decoded() {
        assert_eq!(percent_decode("p%40ss%2Fword"), "p@ss/word");
        assert_eq!(percent_decode("plain%"), "plain%");
    }

    #[test]
    fn a_queue_must_be_a_stream_name() {
        assert!(check_stream_name("orders").is_ok());
        assert!(check_stream_name("orders.v1").is_err());
    }
}
