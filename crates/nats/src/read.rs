//! Reads: pull requests on one subscription, and what a delivery is
//! turned into before the app sees it.

use std::collections::VecDeque;
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
use courier_core::source::shared::{F_RETRY_AT, HELD_WAIT, replace};
use courier_core::source::{SettleParts, SourceError};

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
    /// The request whose answer is not all in yet: sent ahead, or one a
    /// read stopped waiting for because it had enough.
    open: Option<Request>,
    /// The last request to end was answered in full: the stream likely
    /// holds more, so the next one is sent ahead.
    answered_full: bool,
    /// Deliveries taken off the subscription between reads, so that they
    /// are kept in progress (`+WPI`); the next read's, oldest first.
    parked: VecDeque<async_nats::Message>,
}

/// A pull request sent and not yet over.
struct Request {
    reply: String,
    /// How many messages it asked for, and how many have come.
    max: usize,
    got: usize,
    /// How long the server may hold it: zero for one sent ahead.
    wait: Duration,
    sent: Instant,
}

/// What a message on the subscription means for the open request.
enum Note {
    Delivery(async_nats::Message),
    /// The server ended it short: `early` when it did so well before its
    /// wait was over.
    Short {
        early: bool,
    },
    Refused(SourceError),
    Nothing,
}

/// How long past its wait a request's end may take before the reader gives
/// up on it: an answer lost with the connection must not hold it forever.
const ANSWER_GRACE: Duration = Duration::from_secs(5);

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
    fn new(subscriber: Subscriber, inbox: String) -> Self {
        Self {
            subscriber,
            inbox,
            requests: 0,
            oversized: false,
            open: None,
            answered_full: false,
            parked: VecDeque::new(),
        }
    }

    /// Up to `max` messages: what came since the last read, else the answer
    /// to one request that the server holds until a message arrives (at
    /// most `wait`) and ends as soon as it has delivered what the stream had
    /// (`no_wait` with `expires`). A read whose request came back full sends
    /// the next one ahead, without a wait, so that the next read finds its
    /// answer in and costs no round trip while a backlog drains: 0.86 to
    /// 1.09 × the bare loop's throughput (`courier-bench all --sources
    /// nats`, 86ad8ec). Its answer is at most one read's worth, kept in
    /// progress while no read comes.
    pub(super) async fn pull(
        &mut self,
        consumer: &PullConsumer,
        max: usize,
        wait: Duration,
        max_bytes: usize,
    ) -> Result<Vec<async_nats::Message>, SourceError> {
        let mut got = Vec::new();
        self.take_waiting(&mut got, max)?;
        if self.open.is_none() && got.is_empty() {
            self.open = Some(self.send(consumer, max, wait, max_bytes).await?);
        }
        while got.len() < max
            && let Some(request) = &self.open
        {
            let deadline = request.sent + request.wait + ANSWER_GRACE;
            let message = match tokio::time::timeout_at(deadline, self.subscriber.next()).await {
                Ok(Some(message)) => message,
                Ok(None) => return Err(unavailable("the pull subscription ended")),
                Err(_) => {
                    self.open = None;
                    if got.is_empty() {
                        return Err(unavailable("no answer to a pull request"));
                    }
                    break;
                }
            };
            match self.note(message) {
                Note::Delivery(message) => got.push(message),
                Note::Nothing => {}
                Note::Short { early } => {
                    // An empty end before the wait is over means other
                    // readers' requests are waiting for the messages there
                    // are ("Requests Pending"): pause, or the dispatcher's
                    // next read would ask again at once, and again.
                    if got.is_empty() && early {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    break;
                }
                Note::Refused(e) if got.is_empty() => return Err(e),
                Note::Refused(_) => break,
            }
        }
        if self.open.is_none() && std::mem::take(&mut self.answered_full) {
            // The messages read are the caller's whatever happens to this.
            match self.send(consumer, max, Duration::ZERO, max_bytes).await {
                Ok(request) => self.open = Some(request),
                Err(e) => tracing::debug!(error = %e, "a pull request could not be sent ahead"),
            }
        }
        Ok(got)
    }

    /// Deliveries parked or already on the subscription, up to `max`.
    fn take_waiting(
        &mut self,
        got: &mut Vec<async_nats::Message>,
        max: usize,
    ) -> Result<(), SourceError> {
        let open = self.collect();
        while got.len() < max
            && let Some(message) = self.parked.pop_front()
        {
            got.push(message);
        }
        if open {
            Ok(())
        } else {
            Err(unavailable("the pull subscription ended"))
        }
    }

    /// Moves what came on the subscription into `parked`, in order, without
    /// waiting; false once the subscription has ended.
    fn collect(&mut self) -> bool {
        loop {
            match self.subscriber.next().now_or_never() {
                Some(Some(message)) => self.keep(message),
                Some(None) => return false,
                None => return true,
            }
        }
    }

    /// Parks `message` if it is a delivery, having noted it.
    fn keep(&mut self, message: async_nats::Message) {
        if let Note::Delivery(message) = self.note(message) {
            self.parked.push_back(message);
        }
    }

    /// Takes what came since the last read off the subscription and
    /// returns the reply subjects of all that waits for the next read, to
    /// be kept in progress.
    pub(super) fn park(&mut self) -> Vec<String> {
        self.collect();
        self.parked
            .iter()
            .filter_map(|m| m.reply.as_ref().map(|r| r.as_str().to_string()))
            .collect()
    }

    /// Everything that waits for a read, once the open request is over (or
    /// `within` has passed): for a source that is closing to give back.
    pub(super) async fn unread(&mut self, within: Duration) -> Vec<async_nats::Message> {
        let deadline = Instant::now() + within;
        self.park();
        while self.open.is_some() {
            match tokio::time::timeout_at(deadline, self.subscriber.next()).await {
                Ok(Some(message)) => self.keep(message),
                Ok(None) | Err(_) => break,
            }
        }
        self.parked.drain(..).collect()
    }

    /// What `message` means for the open request, which a delivery counts
    /// towards and a status on its own reply subject ends. Status messages
    /// on other subjects are the ends of requests given up on.
    fn note(&mut self, message: async_nats::Message) -> Note {
        if is_delivery(&message) {
            if let Some(request) = self.open.as_mut() {
                request.got += 1;
                if request.got >= request.max {
                    self.open = None;
                    self.answered_full = true;
                }
            }
            return Note::Delivery(message);
        }
        let Some(request) = self.open.as_ref() else {
            return Note::Nothing;
        };
        if message.subject.as_str() != request.reply {
            return Note::Nothing;
        }
        let (nothing_came, early) = (request.got == 0, request.sent.elapsed() < request.wait / 2);
        let note = match message.status {
            Some(StatusCode::IDLE_HEARTBEAT) => return Note::Nothing,
            Some(StatusCode::TIMEOUT | StatusCode::NOT_FOUND) => Note::Short { early },
            Some(StatusCode::REQUEST_TERMINATED)
                if message
                    .description
                    .as_deref()
                    .is_some_and(|d| d.to_ascii_lowercase().contains("maxbytes")) =>
            {
                self.oversized = nothing_came;
                Note::Short { early: false }
            }
            status => Note::Refused(SourceError::broker(format!(
                "JetStream refused a pull request: {} {}",
                status.map(|s| s.as_u16()).unwrap_or_default(),
                message.description.unwrap_or_default()
            ))),
        };
        self.open = None;
        self.answered_full = false;
        note
    }

    async fn send(
        &mut self,
        consumer: &PullConsumer,
        max: usize,
        wait: Duration,
        max_bytes: usize,
    ) -> Result<Request, SourceError> {
        self.requests += 1;
        let reply = format!("{}.{}", self.inbox, self.requests);
        // One message is bounded by the server's max_payload; more are
        // bounded by `max_bytes` too.
        let max = if std::mem::take(&mut self.oversized) {
            1
        } else {
            max
        };
        let batch = BatchConfig {
            batch: max,
            max_bytes: if max > 1 { max_bytes } else { 0 },
            // Without an expiry a `no_wait` request ends at once, with what
            // the stream has.
            expires: (!wait.is_zero()).then_some(wait),
            no_wait: true,
            ..Default::default()
        };
        let sent = Instant::now();
        consumer
            .request_batch(batch, reply.clone().into())
            .await
            .map_err(unavailable)?;
        Ok(Request {
            reply,
            max,
            got: 0,
            wait,
            sent,
        })
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
                *puller = Some(Puller::new(subscriber, inbox));
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
        self.admit_all(got).await
    }

    /// The deliveries of messages read: each registered in flight, once
    /// nothing in the read can fail any more.
    async fn admit_all(&self, got: Vec<async_nats::Message>) -> Result<Vec<Delivery>, SourceError> {
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

    /// At close: what a request sent ahead brought and no read took goes
    /// back to the stream as the dispatcher gives back what it read ahead,
    /// due now and without using up an attempt, rather than waiting out
    /// `AckWait` and counting one.
    pub(super) async fn give_back_unread(&self) {
        let unread = match self.puller.lock().await.as_mut() {
            Some(puller) => puller.unread(Duration::from_secs(1)).await,
            None => return,
        };
        if unread.is_empty() {
            return;
        }
        let deliveries = self.admit_all(unread).await.unwrap_or_default();
        tracing::debug!(
            count = deliveries.len(),
            "returning unread messages to the stream"
        );
        let now = SystemTime::now();
        for delivery in deliveries {
            let first = delivery.first_attempt_at.unwrap_or(now);
            if let Err(e) = self
                .settle_retry(&delivery, delivery.attempt, first, now)
                .await
            {
                tracing::warn!(error = %e, id = %delivery.message.id, "an unread message could not be given back; JetStream hands it out again after AckWait");
            }
        }
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
        let mut delivery = Delivery::from_fields(
            &sequence.to_string(),
            fields,
            extra,
            receipt,
            Some(metadata.published),
        );
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
    use courier_core::source::{Consumer, DeadLetterStore, SettleParts, SourceOptions};

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

    /// A fresh stream and source on the NATS server on loopback, with
    /// `count` messages `m0`, `m1`, ... in it.
    async fn filled(visibility: Duration, count: usize) -> (NatsSource, String) {
        let queue = format!("unit-{}-{}", std::process::id(), rand::random::<u32>());
        let mut options = SourceOptions::new(&queue);
        options.create = true;
        options.live.visibility_timeout = visibility;
        let source = NatsSource::connect("nats://127.0.0.1:4222", options)
            .await
            .expect("NATS JetStream on 127.0.0.1:4222");
        for i in 0..count {
            DeadLetterStore::send(&source, Bytes::from(format!("m{i}")), &[])
                .await
                .unwrap();
        }
        (source, queue)
    }

    /// Reads and acks until two reads in a row bring nothing (a read that
    /// only puts back waiting copies brings nothing either): each body with
    /// the attempt it was offered at.
    async fn drain(source: &NatsSource) -> Vec<(String, u32)> {
        let mut seen = Vec::new();
        let mut empty = 0;
        while empty < 2 {
            let got = source.read_batch(4).await.unwrap();
            empty = if got.is_empty() { empty + 1 } else { 0 };
            for delivery in got {
                let body = String::from_utf8_lossy(&delivery.message.body).into_owned();
                seen.push((body, delivery.attempt));
                source.settle_ack(&delivery).await.unwrap();
            }
        }
        seen.sort();
        seen
    }

    fn each_once(range: std::ops::Range<usize>) -> Vec<(String, u32)> {
        let mut want: Vec<(String, u32)> = range.map(|i| (format!("m{i}"), 1)).collect();
        want.sort();
        want
    }

    /// A full read sends the next request ahead. While no read comes for
    /// longer than `AckWait` (a hold, a closed gate), what it brought is
    /// kept in progress: the server hands nothing out twice, and every
    /// message reaches a read once, at attempt 1.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn what_a_request_sent_ahead_brought_outlives_ack_wait_unread() {
        let (source, queue) = filled(Duration::from_secs(2), 10).await;
        let first = source.read_batch(4).await.unwrap();
        assert_eq!(first.len(), 4);
        assert!(source.puller.lock().await.as_ref().unwrap().open.is_some());
        let mut seen = Vec::new();
        for delivery in &first {
            seen.push((
                String::from_utf8_lossy(&delivery.message.body).into_owned(),
                delivery.attempt,
            ));
            source.settle_ack(delivery).await.unwrap();
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
        seen.extend(drain(&source).await);
        seen.sort();
        assert_eq!(seen, each_once(0..10));
        let stream = source.js.get_stream(&queue).await.unwrap();
        let info = stream.consumer_info("courier").await.unwrap();
        assert_eq!(info.num_redelivered, 0, "{info:?}");
        let _ = source.js.delete_stream(&queue).await;
    }

    /// What a request sent ahead brought and no read took goes back at
    /// close, at once and at attempt 1: the next sidecar gets it without
    /// waiting out `AckWait` (a minute here).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn close_gives_back_what_no_read_took() {
        let (source, queue) = filled(Duration::from_secs(60), 10).await;
        let first = source.read_batch(4).await.unwrap();
        assert_eq!(first.len(), 4);
        for delivery in &first {
            source.settle_ack(delivery).await.unwrap();
        }
        Consumer::close(&source).await;
        drop(source);
        let mut options = SourceOptions::new(&queue);
        options.live.visibility_timeout = Duration::from_secs(60);
        let next = NatsSource::connect("nats://127.0.0.1:4222", options)
            .await
            .unwrap();
        assert_eq!(drain(&next).await, each_once(4..10));
        let _ = next.js.delete_stream(&queue).await;
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
