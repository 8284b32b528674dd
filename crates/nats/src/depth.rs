//! Depth from stream and consumer info; the oldest dead letter's age from
//! its `courier-last-attempt-at`; the oldest waiting message's age from the
//! stored time of the first message the consumer has not delivered.

use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::ErrorCode;

use super::NatsSource;
use super::connection::{js_code, unavailable};
use super::dead_letters::dead_letter_stream;
use super::fields::from_headers;
use courier_core::model::{DeadLetter, dead_letter_age};
use courier_core::source::{Depth, SourceError};

impl NatsSource {
    pub(super) async fn read_depth(&self) -> Result<Depth, SourceError> {
        let stream = self
            .js
            .get_stream_no_info(&self.options.queue)
            .await
            .map_err(unavailable)?;
        let stream_info = stream.get_info().await.map_err(unavailable)?;
        // The first stream sequence no consumer of the group was handed.
        let (ready, ack_pending, first_waiting) =
            match stream.consumer_info(&self.options.group).await {
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
        // Read where the current policy writes dead letters.
        let subject = self.live().dead_letter_queue;
        let (dead_letters, oldest_dead_letter_age) =
            match self.js.get_stream(dead_letter_stream(&subject)).await {
                Ok(s) if s.cached_info().state.messages > 0 => {
                    let state = &s.cached_info().state;
                    let oldest = s
                        .raw_message_builder()
                        .sequence(state.first_sequence)
                        .next_by_subject(subject.clone())
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
