//! Reads: pull requests on one subscription, and what a delivery is
//! turned into before the app sees it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

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
use courier_core::model::{Delivery, F_FIRST_ATTEMPT_AT, parse_time, rfc3339};
use courier_core::source::SourceError;
use courier_core::source::shared::{F_RETRY_AT, HELD_WAIT, replace};

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
    /// The server ended the last request because its next message alone
    /// was over the byte bound: the next request asks for that one.
    oversized: bool,
}

/// What one read asking for more than one message may bring in, in bytes,
/// so that a batch of large messages cannot exhaust the sidecar's memory;
/// never less than one message of the server's largest size, or that
/// message could never be read.
const READ_BYTES: usize = 8 << 20;

/// A message's subject, reply subject and protocol line on top of the
/// server's `max_payload` (which counts headers and body).
const MESSAGE_OVERHEAD: usize = 64 << 10;

/// The outcome of admitting one message of a read.
enum Admitted {
    /// For the app, with its stream sequence.
    Deliver(Delivery, u64),
    /// A waiting copy's first delivery: `Nak`ed with the time still to wait.
    Wait(String, Duration),
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
        max_bytes: usize,
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
        // One message is bounded by the server's max_payload; more are
        // bounded by `max_bytes` too.
        let max = if std::mem::take(&mut self.oversized) {
            1
        } else {
            max
        };
        let request = BatchConfig {
            batch: max,
            max_bytes: if max > 1 { max_bytes } else { 0 },
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
                Some(StatusCode::REQUEST_TERMINATED)
                    if got.is_empty()
                        && message
                            .description
                            .as_deref()
                            .is_some_and(|d| d.to_ascii_lowercase().contains("maxbytes")) =>
                {
                    self.oversized = true;
                    break;
                }
                status if got.is_empty() => {
                    return Err(SourceError::broker(format!(
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

/// What a delivery's reply subject says, read as async-nats'
/// `jetstream::Message::info` reads it (ADR-15): after `$JS.ACK.`, either
/// `<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<published
/// ns>.<pending>`, or 9 tokens or more that begin with `<domain>.<account
/// hash>`. Only what courier uses is parsed: `info` split the subject with a
/// string searcher and parsed every token, some 2,100 instructions a
/// message (BENCHMARKS.md, the profile).
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Metadata {
    pub(super) sequence: u64,
    pub(super) delivered: u64,
    published: SystemTime,
}

impl Metadata {
    pub(super) fn read(reply: &str) -> Option<Self> {
        let tokens = reply.strip_prefix("$JS.ACK.")?.as_bytes();
        let mut token: [&[u8]; 8] = [b""; 8];
        let (mut count, mut start) = (0, 0);
        for end in memchr::memchr_iter(b'.', tokens).chain([tokens.len()]) {
            if let Some(slot) = token.get_mut(count) {
                *slot = &tokens[start..end];
            }
            (count, start) = (count + 1, end + 1);
        }
        let delivered_at = match count {
            7 => 2,
            n if n >= 9 => 4,
            _ => return None,
        };
        let number = |i: usize| digits(token[delivered_at + i]);
        Some(Self {
            delivered: number(0)?,
            sequence: number(1)?,
            published: UNIX_EPOCH + Duration::from_nanos(number(3)?),
        })
    }
}

/// A token of decimal digits, as a number.
fn digits(token: &[u8]) -> Option<u64> {
    if token.is_empty() {
        return None;
    }
    token.iter().try_fold(0u64, |n, &b| {
        let digit = b.wrapping_sub(b'0');
        if digit > 9 {
            return None;
        }
        n.checked_mul(10)?.checked_add(u64::from(digit))
    })
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
                    oversized: false,
                });
            }
            // A consumer someone else created may cap what one request asks.
            let limits = &consumer.cached_info().config;
            let mut max = max.max(1);
            if limits.max_batch > 0 {
                max = max.min(limits.max_batch as usize);
            }
            let mut wait = HELD_WAIT;
            if !limits.max_expires.is_zero() {
                wait = wait.min(limits.max_expires);
            }
            let mut max_bytes =
                READ_BYTES.max(self.client.server_info().max_payload + MESSAGE_OVERHEAD);
            if limits.max_bytes > 0 {
                max_bytes = max_bytes.min(limits.max_bytes as usize);
            }
            let puller = puller.as_mut().expect("created above");
            puller.pull(&consumer, max, wait, max_bytes).await?
        };
        let max_deliveries = self.live().max_deliveries;
        let mut deliveries = Vec::with_capacity(got.len());
        let mut waiting = Vec::new();
        let mut refused = None;
        for message in got {
            // One message that cannot be admitted does not cost the others
            // their read: it is left to the server, which hands it out again
            // after AckWait.
            match self.admit(&message, max_deliveries) {
                Ok(Admitted::Deliver(delivery, sequence)) => deliveries.push((delivery, sequence)),
                Ok(Admitted::Wait(receipt, delay)) => waiting.push((receipt, delay)),
                Err(e) => {
                    tracing::warn!(error = %e, "a message from JetStream was left unread");
                    refused.get_or_insert(e);
                }
            }
        }
        for (receipt, delay) in waiting {
            // Unsent, the copy only waits for AckWait instead.
            if let Err(e) = self
                .client
                .publish(receipt, AckKind::Nak(Some(delay)).into())
                .await
            {
                tracing::warn!(error = %e, "a waiting retry copy could not be put back");
            }
        }
        if deliveries.is_empty()
            && let Some(e) = refused
        {
            return Err(e);
        }
        // Registered last, with nothing awaited after: a read that fails or
        // is dropped before here leaves nothing in flight (and kept in
        // progress) that no one will settle.
        Ok(deliveries
            .into_iter()
            .map(|(delivery, sequence)| {
                self.hand_out(&delivery.receipt, sequence);
                delivery
            })
            .collect())
    }

    /// Turns a delivery into one for the app (or, handed out too often, one
    /// to dead-letter without offering it), or makes the first delivery of
    /// a waiting copy wait.
    fn admit(
        &self,
        message: &async_nats::Message,
        max_deliveries: u32,
    ) -> Result<Admitted, SourceError> {
        let Some(reply) = message.reply.as_ref() else {
            return Err(SourceError::broker("a message without a reply subject"));
        };
        let Some(metadata) = Metadata::read(reply.as_str()) else {
            return Err(SourceError::broker(format!(
                "a message without JetStream metadata (reply subject {:?})",
                reply.as_str()
            )));
        };
        let (sequence, delivered) = (metadata.sequence, metadata.delivered.max(1) as u32);
        // `as_str`, not `to_string`: a subject's `Display` went through the
        // formatting machinery for every message.
        let receipt = reply.as_str().to_string();
        // Only a copy courier sealed carries courier's state.
        let fields = self
            .seal
            .open(from_headers(&message.payload, message.headers.as_ref()));
        let waits = field(&fields, F_RETRY_AT).and_then(|t| parse_time(t.as_bytes()));
        if let Some(at) = waits
            && delivered == 1
        {
            let delay = at.duration_since(SystemTime::now()).unwrap_or_default();
            return Ok(Admitted::Wait(receipt, delay));
        }
        let mut fields = replace(fields, F_SUBJECT, message.subject.as_str().to_string());
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
                let at = first.get(&sequence).copied().unwrap_or(metadata.published);
                fields.push((F_FIRST_ATTEMPT_AT.into(), Bytes::from(rfc3339(at))));
            }
        }
        let mut delivery = Delivery::from_fields(&sequence.to_string(), fields, extra, receipt);
        // A poison pill: every delivery of it ended without a settlement
        // (the sidecar crashed or hung on it). JetStream's own counter says
        // so; the dispatcher dead-letters it as undeliverable without
        // offering it to the app again. Unless the delivery before this one
        // was a `Nak` of this process: then the count holds attempts of a
        // policy with a higher maxAttempts, and the answer to this one
        // decides (`attempts-exhausted`).
        let retried_here = self
            .retried
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&sequence)
            == Some(&(metadata.delivered.saturating_sub(1)));
        if delivered > max_deliveries && !retried_here {
            delivery.problem = Some(format!(
                "handed out {delivered} times without being settled (the limit is {max_deliveries}, maxAttempts + 2)"
            ));
        }
        Ok(Admitted::Deliver(delivery, sequence))
    }
}

#[cfg(test)]
mod tests {
    use async_nats::jetstream::consumer::pull::BatchConfig;

    use super::*;
    use courier_core::source::{DeadLetterStore, SettleParts, SourceOptions};

    #[test]
    fn reply_subject_rows() {
        let at = |ns: u64| UNIX_EPOCH + Duration::from_nanos(ns);
        let rows = [
            (
                "$JS.ACK.orders.courier.2.17.9.1764590000123456789.4",
                Some((17, 2, 1764590000123456789)),
            ),
            (
                "$JS.ACK._.ACCHASH.orders.courier.1.5.5.1764590000000000001.0",
                Some((5, 1, 1764590000000000001)),
            ),
            (
                "$JS.ACK.hub.ACCHASH.orders.courier.3.8.7.1764590000000000002.1.r4nd0m",
                Some((8, 3, 1764590000000000002)),
            ),
            (
                "$JS.ACK.hub.ACCHASH.orders.courier.3.8.7.1764590000000000002.1.r4nd0m.more",
                Some((8, 3, 1764590000000000002)),
            ),
            ("$JS.ACK.orders.courier.2.17.9.1764590000123456789", None),
            ("$JS.ACK.orders.courier.x.17.9.1764590000123456789.4", None),
            ("$JS.ACK.orders.courier.2.-1.9.1764590000123456789.4", None),
            ("$JS.ACK.orders.courier.2..9.1764590000123456789.4", None),
            ("$JS.ACK.orders.courier.2.18446744073709551616.9.1.4", None),
            ("_INBOX.abc.1", None),
            ("", None),
        ];
        for (reply, want) in rows {
            let want = want.map(|(sequence, delivered, ns)| Metadata {
                sequence,
                delivered,
                published: at(ns),
            });
            assert_eq!(Metadata::read(reply), want, "{reply}");
        }
    }

    /// Against the NATS server on loopback: a read whose batch holds a
    /// good delivery and then something that is no JetStream delivery
    /// returns the good one, registered in flight once, and nothing else
    /// stays registered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_message_that_cannot_be_admitted_leaves_nothing_in_flight() {
        let queue = format!("unit-{}-{}", std::process::id(), rand::random::<u32>());
        let mut options = SourceOptions::new(&queue);
        options.create = true;
        let source = NatsSource::connect("nats://127.0.0.1:4222", options)
            .await
            .expect("NATS JetStream on 127.0.0.1:4222");
        // The first read creates the consumer and the pull subscription.
        assert!(source.read_batch(1).await.unwrap().is_empty());
        let inbox = source.puller.lock().await.as_ref().unwrap().inbox.clone();
        DeadLetterStore::send(&source, Bytes::from_static(b"good"), &[])
            .await
            .unwrap();
        let consumer = source.consumer().await.unwrap();
        let request = BatchConfig {
            batch: 1,
            expires: Some(Duration::from_secs(1)),
            no_wait: true,
            ..Default::default()
        };
        consumer
            .request_batch(request, format!("{inbox}.by-hand").into())
            .await
            .unwrap();
        let stream = source.js.get_stream(&queue).await.unwrap();
        while stream
            .consumer_info("courier")
            .await
            .unwrap()
            .num_ack_pending
            == 0
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // After the good delivery, on the same subscription: a message
        // without JetStream metadata. The flush's round trip puts it in the
        // subscription behind the delivery.
        source
            .client
            .publish(format!("{inbox}.stray"), Bytes::from_static(b"stray"))
            .await
            .unwrap();
        source.client.flush().await.unwrap();

        let got = source.read_batch(2).await.unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].message.body.as_ref(), b"good");
        assert_eq!(source.in_flight.lock().unwrap().len(), 1);
        // The server's reply subject reads as async-nats reads it.
        let receipt = got[0].receipt.clone();
        let delivered = async_nats::jetstream::Message {
            message: async_nats::Message {
                subject: queue.clone().into(),
                reply: Some(receipt.clone().into()),
                payload: Bytes::new(),
                headers: None,
                status: None,
                description: None,
                length: 0,
            },
            context: source.js.clone(),
        };
        let info = delivered.info().unwrap();
        assert_eq!(
            Metadata::read(&receipt),
            Some(Metadata {
                sequence: info.stream_sequence,
                delivered: info.delivered as u64,
                published: SystemTime::from(info.published),
            })
        );
        source.settle_ack(&got[0]).await.unwrap();
        assert!(source.in_flight.lock().unwrap().is_empty());
        let _ = source.js.delete_stream(&queue).await;
    }
}
