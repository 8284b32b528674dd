//! Depth from stream and consumer info; the oldest dead letter's age from
//! its `courier-last-attempt-at`; the oldest waiting message's age from the
//! stored time of the first message the consumer has not delivered. Read on
//! the dead-letter store, so that the sidecar's gauges and an admin
//! handle's `depth_of` are one reading: it only asks for info and reads
//! messages by sequence, so it creates nothing and consumes nothing.

use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::ErrorCode;

use super::connection::{js_code, missing_stream, unavailable};
use super::dead_letters::{NatsStore, dead_letter_stream};
use super::fields::from_headers;
use courier_core::model::{DeadLetter, dead_letter_age};
use courier_core::source::{Depth, SourceError};

impl NatsStore {
    /// The work stream's depth as the durable consumer `group` sees it,
    /// with the dead letters on `subject`. `pending` is what the sources of
    /// this process hold: none in a process that only administers, where
    /// everything the consumer has out counts as retry backlog, as on a
    /// replica that holds nothing.
    pub(super) async fn depth(&self, subject: &str) -> Result<Depth, SourceError> {
        let stream = self
            .js
            .get_stream_no_info(&self.queue)
            .await
            .map_err(unavailable)?;
        let stream_info = match stream.get_info().await {
            Ok(info) => info,
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => {
                return Err(missing_stream(&self.queue, &self.redacted));
            }
            Err(e) => return Err(unavailable(e)),
        };
        // The first stream sequence no consumer of the group was handed.
        let (ready, ack_pending, first_waiting) = match stream.consumer_info(&self.group).await {
            Ok(info) => (
                info.num_pending,
                info.num_ack_pending as u64,
                info.delivered.stream_sequence + 1,
            ),
            Err(e) if js_code(&e) == Some(ErrorCode::CONSUMER_NOT_FOUND) => (
                stream_info.state.messages,
                0,
                stream_info.state.first_sequence,
            ),
            Err(e) => return Err(unavailable(e)),
        };
        let oldest_waiting_age = if ready == 0 {
            Some(Duration::ZERO)
        } else {
            // One message read by sequence, at most every depth interval,
            // and only while messages wait; a stream that lost it meanwhile
            // (acked on a work queue, discarded by a limit) leaves the age
            // unknown until the next poll.
            match stream
                .raw_message_builder()
                .sequence(first_waiting.max(stream_info.state.first_sequence))
                .next_by_subject(">")
                .send()
                .await
            {
                Ok(m) => Some(
                    SystemTime::now()
                        .duration_since(SystemTime::from(m.time))
                        .unwrap_or_default(),
                ),
                Err(e) if js_code(&e) == Some(ErrorCode::NO_MESSAGE_FOUND) => None,
                Err(e) => return Err(unavailable(e)),
            }
        };
        let held = (self.held.load(Ordering::SeqCst).max(0) as u64).min(ack_pending);
        let (dead_letters, oldest_dead_letter_age) =
            match self.js.get_stream(dead_letter_stream(subject)).await {
                Ok(s) if s.cached_info().state.messages > 0 => {
                    let state = &s.cached_info().state;
                    let oldest = s
                        .raw_message_builder()
                        .sequence(state.first_sequence)
                        .next_by_subject(subject.to_string())
                        .send()
                        .await;
                    let at = match oldest {
                        Ok(m) => DeadLetter::from_fields(
                            m.sequence.to_string(),
                            from_headers(&m.payload, Some(&m.headers)),
                        )
                        .dead_lettered_at()
                        .unwrap_or_else(|| SystemTime::from(m.time)),
                        Err(e) if js_code(&e) == Some(ErrorCode::NO_MESSAGE_FOUND) => {
                            SystemTime::from(state.first_timestamp)
                        }
                        Err(e) => return Err(unavailable(e)),
                    };
                    (state.messages, Some(dead_letter_age(at, SystemTime::now())))
                }
                Ok(_) => (0, None),
                Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => (0, None),
                Err(e) => return Err(unavailable(e)),
            };
        Ok(Depth {
            ready: Some(ready),
            pending: held,
            retry_backlog: ack_pending - held,
            dead_letters,
            oldest_dead_letter_age,
            // Not yet delivered, plus delivered and not acked: a retry
            // waiting for its delay (a `Nak` with delay) counts here too, as
            // it stays in the work stream.
            queue_depth: Some(ready + ack_pending),
            oldest_waiting_age,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicI64;

    use bytes::Bytes;
    use courier_core::model::Failure;
    use courier_core::source::{
        Consumer, DeadLetterStore, ErrorKind, Observed, SettleBy, SourceOptions,
    };
    use futures::TryStreamExt;

    use super::*;
    use crate::NatsSource;

    const NATS: &str = "nats://127.0.0.1:4222";

    /// Two readings taken one after the other: equal, but for the ages,
    /// which grow by the time between them.
    fn assert_same(admin: &Depth, sidecar: &Depth) {
        let close = |a: Option<Duration>, b: Option<Duration>| match (a, b) {
            (Some(a), Some(b)) => a.abs_diff(b) < Duration::from_secs(2),
            (a, b) => a == b,
        };
        assert_eq!(
            (
                admin.ready,
                admin.pending,
                admin.retry_backlog,
                admin.dead_letters,
                admin.queue_depth
            ),
            (
                sidecar.ready,
                sidecar.pending,
                sidecar.retry_backlog,
                sidecar.dead_letters,
                sidecar.queue_depth
            ),
            "admin {admin:?}, sidecar {sidecar:?}"
        );
        assert!(
            close(admin.oldest_dead_letter_age, sidecar.oldest_dead_letter_age)
                && close(admin.oldest_waiting_age, sidecar.oldest_waiting_age),
            "admin {admin:?}, sidecar {sidecar:?}"
        );
    }

    /// Against the NATS server on loopback: an admin handle reads the
    /// figures the sidecar's gauges read, before the durable consumer
    /// exists and with messages waiting, in flight, `Nak`ed for a retry and
    /// dead-lettered; a handle of a process that holds nothing counts the
    /// deliveries in flight as retry backlog, as the docs say of a replica.
    /// A missing stream is named, and the handle creates no stream and no
    /// consumer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_admin_handle_reads_the_depth_the_sidecar_reads() {
        let queue = format!(
            "unit-depth-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        );
        let mut options = SourceOptions::new(&queue);
        let dlq = options.live.dead_letter_queue.clone();
        let admin = NatsStore::open(NATS, options.clone())
            .await
            .expect("NATS JetStream on 127.0.0.1:4222");

        let err = admin.depth_of(&dlq).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
        assert!(err.message().contains(&queue), "{err}");
        assert!(
            admin.js.get_stream(&queue).await.is_err(),
            "a stream was made"
        );

        options.create = true;
        let source = NatsSource::connect(NATS, options).await.unwrap();
        for i in 0..6 {
            admin.send(Bytes::from(format!("m{i}")), &[]).await.unwrap();
        }
        let before = source.depth().await.unwrap();
        assert_same(&admin.depth_of(&dlq).await.unwrap().unwrap(), &before);
        assert_eq!((before.ready, before.pending), (Some(6), 0), "{before:?}");

        let got = source.receive(8).await.unwrap();
        assert_eq!(got.len(), 6);
        let now = SystemTime::now();
        source
            .dead_letter(
                &got[0],
                &Failure::permanent_422(&queue, &dlq, &got[0].message.id),
            )
            .await
            .unwrap();
        source
            .retry(&got[1], 2, now, now + Duration::from_secs(3600))
            .await
            .unwrap();
        source.ack(&got[2]).await.unwrap();
        for i in 6..8 {
            admin.send(Bytes::from(format!("m{i}")), &[]).await.unwrap();
        }

        let sidecar = source.depth().await.unwrap();
        let read = admin.depth_of(&dlq).await.unwrap().unwrap();
        assert_same(&read, &sidecar);
        assert_eq!(
            (
                read.ready,
                read.pending,
                read.retry_backlog,
                read.dead_letters,
                read.queue_depth
            ),
            (Some(2), 3, 1, 1, Some(6)),
            "{read:?}"
        );
        assert!(read.oldest_dead_letter_age.is_some(), "{read:?}");
        assert!(read.oldest_waiting_age.is_some(), "{read:?}");

        let options = SourceOptions::new(&queue);
        let elsewhere = NatsStore::new(
            admin.client.clone(),
            &options,
            &admin.redacted,
            Arc::new(AtomicI64::new(0)),
            None,
            None,
        );
        let alone = elsewhere.depth_of(&dlq).await.unwrap().unwrap();
        assert_eq!(
            (alone.pending, alone.retry_backlog),
            (0, 4),
            "nothing held here: {alone:?}"
        );
        assert_eq!(
            (alone.ready, alone.dead_letters, alone.queue_depth),
            (read.ready, read.dead_letters, read.queue_depth)
        );

        let stream = admin.js.get_stream(&queue).await.unwrap();
        let consumers: Vec<String> = stream.consumer_names().try_collect().await.unwrap();
        assert_eq!(consumers, ["courier"], "only the sidecar's consumer");

        source.close().await;
        drop(source);
        let _ = admin.js.delete_stream(&queue).await;
        let _ = admin.js.delete_stream(dead_letter_stream(&dlq)).await;
    }
}
