//! Settling a delivery: the ack on its channel, a retry as a confirmed
//! publish to its delay tier before the ack, a dead letter.

use std::time::SystemTime;

use async_trait::async_trait;

use super::{AmqpSource, dead_letters};
use courier_core::model::{Delivery, Failure};
use courier_core::source::{SettleParts, SourceError};

#[async_trait]
impl SettleParts for AmqpSource {
    async fn settle_ack(&self, delivery: &Delivery) -> Result<(), SourceError> {
        self.take_properties(&delivery.receipt);
        let (session, tag) = self.session_for(&delivery.receipt)?;
        session.ack(tag).await
    }

    async fn settle_retry(
        &self,
        delivery: &Delivery,
        next_attempt: u32,
        first_attempt_at: SystemTime,
        at: SystemTime,
    ) -> Result<(), SourceError> {
        let original = self.take_properties(&delivery.receipt);
        let (session, tag) = self.session_for(&delivery.receipt)?;
        let fields = delivery.fields_for_retry(next_attempt, first_attempt_at);
        let scheduled = self
            .schedule(
                &session,
                tag,
                fields,
                original.as_ref(),
                &delivery.message.id,
                at,
            )
            .await;
        // The ack follows only a confirmed publish: a retry that could not
        // be stored leaves the message with the broker.
        scheduled.map_err(|e| {
            session.give_back(tag);
            dead_letters::handed_back(e)
        })
    }

    async fn settle_dead_letter(
        &self,
        delivery: &Delivery,
        failure: &Failure,
    ) -> Result<(), SourceError> {
        self.write_dead_letter(delivery, failure).await
    }
}
