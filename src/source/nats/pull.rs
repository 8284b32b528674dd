//! Reads: pull requests on one subscription, and what a delivery is
//! turned into before the app sees it.

use std::time::{Duration, SystemTime};

use async_nats::jetstream::Message;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::consumer::pull::BatchConfig;
use async_nats::jetstream::message::AckKind;
use async_nats::{StatusCode, Subscriber};
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use tokio::time::Instant;

use super::NatsSource;
use super::connection::unavailable;
use super::fields::{F_SUBJECT, field, from_headers};
use crate::model::{Delivery, F_FIRST_ATTEMPT_AT, parse_time, rfc3339};
use crate::source::SourceError;
use crate::source::shared::{F_RETRY_AT, RECEIVE_WAIT, replace};

/// One subscription, for the life of the source, that receives the answers
/// to all its pull requests; each request has a reply subject of its own
/// under it. async-nats' `fetch` and `batch` subscribe and unsubscribe for
/// every request, which costs two more protocol round trips per read, and
/// a message the server sent to a request the reader stopped waiting for
/// was lost with the dropped subscription (and counted as an attempt when
/// AckWait handed it out again). Here it waits for the next read.
pub(super) struct Puller {
    subscriber: Subscriber,
    inbox: String,
    requests: u64,
}

impl Puller {
    /// Up to `max` messages: what earlier requests left, else one request
    /// that the server holds until a message arrives (at most `wait`) and
    /// ends as soon as it has delivered what the stream had (`no_wait` with
    /// `expires`). So a read is one publish and one answer, a message is
    /// handed out as soon as it is stored, and the request is over when the
    /// read returns (unless it gave up waiting for an answer).
    pub(super) async fn pull(
        &mut self,
        consumer: &PullConsumer,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<async_nats::Message>, SourceError> {
        let mut got = Vec::new();
        while got.len() < max {
            match self.subscriber.next().now_or_never() {
                Some(Some(message)) if is_delivery(&message) => got.push(message),
                Some(Some(_)) => {}
                Some(None) => return Err(unavailable("the pull subscription ended")),
                None => break,
            }
        }
        if !got.is_empty() {
            return Ok(got);
        }
        self.requests += 1;
        let reply = format!("{}.{}", self.inbox, self.requests);
        let request = BatchConfig {
            batch: max,
            expires: Some(wait),
            no_wait: true,
            ..Default::default()
        };
        let sent = Instant::now();
        consumer
            .request_batch(request, reply.clone().into())
            .await
            .map_err(unavailable)?;
        // A request whose answer was lost with the connection must not hold
        // the reader forever.
        let deadline = sent + wait + Duration::from_secs(5);
        while got.len() < max {
            let message = match tokio::time::timeout_at(deadline, self.subscriber.next()).await {
                Ok(Some(message)) => message,
                Ok(None) => return Err(unavailable("the pull subscription ended")),
                Err(_) if got.is_empty() => {
                    return Err(unavailable("no answer to a pull request"));
                }
                Err(_) => break,
            };
            if is_delivery(&message) {
                got.push(message);
                continue;
            }
            // Status messages come on the request's own reply subject; one
            // on another is the end of an earlier request.
            if message.subject.as_str() != reply {
                continue;
            }
            match message.status {
                Some(StatusCode::IDLE_HEARTBEAT) => continue,
                Some(StatusCode::TIMEOUT | StatusCode::NOT_FOUND) => {
                    // An empty end before the wait is over means other
                    // readers' requests are waiting for the messages there
                    // are ("Requests Pending"): pause, or the dispatcher's
                    // next read would ask again at once, and again.
                    if got.is_empty() && sent.elapsed() < wait / 2 {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    break;
                }
                status if got.is_empty() => {
                    return Err(SourceError::Broker(format!(
                        "JetStream refused a pull request: {} {}",
                        status.map(|s| s.as_u16()).unwrap_or_default(),
                        message.description.unwrap_or_default()
                    )));
                }
                _ => break,
            }
        }
        Ok(got)
    }
}

/// A message from the stream, not a status about a pull request.
pub(super) fn is_delivery(message: &async_nats::Message) -> bool {
    matches!(message.status, None | Some(StatusCode::OK))
}

impl NatsSource {
    pub(super) async fn read_batch(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        let consumer = self.consumer().await?;
        let got = {
            let mut puller = self.puller.lock().await;
            if puller.is_none() {
                let inbox = self.client.new_inbox();
                let subscriber = self
                    .client
                    .subscribe(format!("{inbox}.*"))
                    .await
                    .map_err(unavailable)?;
                *puller = Some(Puller {
                    subscriber,
                    inbox,
                    requests: 0,
                });
            }
            // A consumer someone else created may cap what one request asks.
            let limits = &consumer.cached_info().config;
            let mut max = max.max(1);
            if limits.max_batch > 0 {
                max = max.min(limits.max_batch as usize);
            }
            let mut wait = RECEIVE_WAIT;
            if !limits.max_expires.is_zero() {
                wait = wait.min(limits.max_expires);
            }
            let puller = puller.as_mut().expect("created above");
            puller.pull(&consumer, max, wait).await?
        };
        let mut out = Vec::with_capacity(got.len());
        for message in got {
            let message = Message {
                message,
                context: self.js.clone(),
            };
            if let Some(d) = self.admit(message).await? {
                out.push(d);
            }
        }
        Ok(out)
    }

    /// Turns a delivery into one for the app, or makes the first delivery
    /// of a waiting copy wait.
    pub(super) async fn admit(&self, message: Message) -> Result<Option<Delivery>, SourceError> {
        let info = message.info().map_err(|e| {
            SourceError::Broker(format!("a message without JetStream metadata: {e}"))
        })?;
        let (sequence, delivered) = (info.stream_sequence, info.delivered.max(1) as u32);
        let Some(receipt) = message.reply.as_ref().map(|r| r.to_string()) else {
            return Err(SourceError::Broker(
                "a message without a reply subject".into(),
            ));
        };
        let fields = from_headers(&message.payload, message.headers.as_ref());
        let waits = field(&fields, F_RETRY_AT).and_then(|t| parse_time(t.as_bytes()));
        if let Some(at) = waits
            && delivered == 1
        {
            let delay = at.duration_since(SystemTime::now()).unwrap_or_default();
            self.client
                .publish(receipt, AckKind::Nak(Some(delay)).into())
                .await
                .map_err(unavailable)?;
            return Ok(None);
        }
        let mut fields = replace(fields, F_SUBJECT, message.subject.to_string());
        let extra = delivered - 1 - u32::from(waits.is_some());
        if field(&fields, F_FIRST_ATTEMPT_AT).is_none() {
            let mut first = self
                .first_attempts
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if extra == 0 {
                first.insert(sequence, SystemTime::now());
            } else {
                // Another replica or an earlier run offered it first: the
                // time it was stored is the closest bound known.
                let at = first
                    .get(&sequence)
                    .copied()
                    .unwrap_or_else(|| SystemTime::from(info.published));
                fields.push((F_FIRST_ATTEMPT_AT.into(), Bytes::from(rfc3339(at))));
            }
        }
        self.hand_out(&receipt, sequence);
        Ok(Some(Delivery::from_fields(
            &sequence.to_string(),
            fields,
            extra,
            receipt,
        )))
    }
}
