//! Depth from stream and consumer info.

use std::sync::atomic::Ordering;
use std::time::SystemTime;

use async_nats::jetstream::ErrorCode;

use super::NatsSource;
use super::connection::{js_code, unavailable};
use super::dead_letters::dead_letter_stream;
use crate::source::{Depth, SourceError};

impl NatsSource {
    pub(super) async fn read_depth(&self) -> Result<Depth, SourceError> {
        let stream = self
            .js
            .get_stream_no_info(&self.options.queue)
            .await
            .map_err(unavailable)?;
        let stream_info = stream.get_info().await.map_err(unavailable)?;
        let (ready, ack_pending) = match stream.consumer_info(&self.options.group).await {
            Ok(info) => (info.num_pending, info.num_ack_pending as u64),
            Err(e) if js_code(&e) == Some(ErrorCode::CONSUMER_NOT_FOUND) => {
                (stream_info.state.messages, 0)
            }
            Err(e) => return Err(unavailable(e)),
        };
        let held = (self.held.load(Ordering::SeqCst).max(0) as u64).min(ack_pending);
        let dlq = dead_letter_stream(&self.options.dead_letter_queue);
        let (dead_letters, oldest_dead_letter_age) = match self.js.get_stream(&dlq).await {
            Ok(s) => {
                let state = &s.cached_info().state;
                let age = (state.messages > 0).then(|| {
                    SystemTime::now()
                        .duration_since(SystemTime::from(state.first_timestamp))
                        .unwrap_or_default()
                });
                (state.messages, age)
            }
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => (0, None),
            Err(e) => return Err(unavailable(e)),
        };
        Ok(Depth {
            ready,
            pending: held,
            retry_backlog: ack_pending - held,
            dead_letters,
            oldest_dead_letter_age,
        })
    }
}
