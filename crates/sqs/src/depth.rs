//! Depth from the queues' approximate counts. SQS tells no message's age
//! without receiving it (only CloudWatch has `ApproximateAgeOfOldestMessage`),
//! so neither the oldest waiting message's age nor the oldest dead letter's
//! is reported.

use aws_sdk_sqs::types::QueueAttributeName;

use super::connection::queue_attributes;
use super::dead_letters::dead_letter_queue_name;
use super::{SqsSource, lock};
use courier_core::source::{Depth, SourceError};

fn count(
    attributes: &std::collections::HashMap<QueueAttributeName, String>,
    name: QueueAttributeName,
) -> u64 {
    attributes
        .get(&name)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

impl SqsSource {
    pub(super) async fn read_depth(&self) -> Result<Depth, SourceError> {
        let work = queue_attributes(&self.client, &self.queue_url).await?;
        let visible = count(&work, QueueAttributeName::ApproximateNumberOfMessages);
        let invisible = count(
            &work,
            QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
        );
        let delayed = count(
            &work,
            QueueAttributeName::ApproximateNumberOfMessagesDelayed,
        );
        // Invisible are those with an app (here or in another replica) and
        // those waiting for a retry.
        let held = (lock(&self.in_flight).len() as u64).min(invisible);
        let name = dead_letter_queue_name(&self.live().dead_letter_queue);
        let dead_letters = match self.store.dead_letter_url(&name, false).await? {
            Some(url) => {
                let dlq = queue_attributes(&self.client, &url).await?;
                count(&dlq, QueueAttributeName::ApproximateNumberOfMessages)
                    + count(
                        &dlq,
                        QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
                    )
                    + count(&dlq, QueueAttributeName::ApproximateNumberOfMessagesDelayed)
            }
            None => 0,
        };
        Ok(Depth {
            ready: Some(visible),
            pending: held,
            retry_backlog: invisible - held + delayed,
            dead_letters,
            oldest_dead_letter_age: None,
            queue_depth: Some(visible + invisible + delayed),
            oldest_waiting_age: None,
        })
    }
}
