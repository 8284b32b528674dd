//! How much sits where.

use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::options::{BasicGetOptions, BasicNackOptions};
use lapin::protocol::AMQPSoftError;

use super::AmqpSource;
use super::convert::header_text;
use super::errors::{Timed, broker_error, is_soft, short, timed};
use super::session::Session;
use super::tiers::tier_queue;
use crate::model::{F_LAST_ATTEMPT_AT, parse_time};
use crate::source::{Depth, SourceError};

impl AmqpSource {
    pub(super) async fn oldest_dead_letter_age(
        &self,
        session: &Session,
    ) -> Result<Option<Duration>, SourceError> {
        let channel = session.admin().await?;
        let got = timed(channel.basic_get(
            short(&self.options.dead_letter_queue)?,
            BasicGetOptions { no_ack: false },
        ))
        .await;
        let message = match got {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(None),
            Err(e) => {
                session.drop_admin().await;
                return match e {
                    Timed::Broker(e) if is_soft(&e, AMQPSoftError::NOTFOUND) => Ok(None),
                    e => Err(e.into()),
                };
            }
        };
        let props = &message.delivery.properties;
        let at = header_text(props, F_LAST_ATTEMPT_AT)
            .and_then(|t| parse_time(t.as_bytes()))
            .or_else(|| {
                props
                    .timestamp()
                    .map(|s| UNIX_EPOCH + Duration::from_secs(s))
            });
        let requeued = channel
            .basic_nack(
                message.delivery.delivery_tag,
                BasicNackOptions {
                    multiple: false,
                    requeue: true,
                },
            )
            .await;
        if let Err(e) = requeued {
            session.drop_admin().await;
            return Err(broker_error(e));
        }
        Ok(at.map(|t| SystemTime::now().duration_since(t).unwrap_or_default()))
    }

    pub(super) async fn read_depth(&self) -> Result<Depth, SourceError> {
        let session = self.session().await?;
        let ready = session.passive_count(&self.options.queue).await?;
        session
            .ensure_dead_letter_queue(&self.options.dead_letter_queue)
            .await?;
        let dead_letters = session
            .passive_count(&self.options.dead_letter_queue)
            .await?
            .unwrap_or(0);
        let tiers: Vec<u64> = self
            .state
            .tiers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .copied()
            .collect();
        let mut retry_backlog = 0u64;
        for ms in tiers {
            let name = tier_queue(&self.options.queue, Duration::from_millis(ms));
            match session.passive_count(&name).await? {
                Some(n) => retry_backlog += u64::from(n),
                None => {
                    self.state
                        .tiers
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&ms);
                }
            }
        }
        let oldest_dead_letter_age = if dead_letters > 0 {
            self.oldest_dead_letter_age(&session).await?
        } else {
            None
        };
        Ok(Depth {
            ready: u64::from(ready.unwrap_or(0)),
            pending: self.state.unacked.load(Ordering::SeqCst).max(0) as u64,
            retry_backlog,
            dead_letters: u64::from(dead_letters),
            oldest_dead_letter_age,
        })
    }
}
