//! Reads: long polls, admitting a message (attempt, poison pill, a waiting
//! copy), and FIFO groups.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_sqs::types::{Message, MessageSystemAttributeName};
use bytes::Bytes;

use super::attributes::from_message;
use super::connection::sdk_error;
use super::{InFlight, SqsSource, lock};
use courier_core::model::{Delivery, F_ATTEMPT, F_FIRST_ATTEMPT_AT, parse_time, rfc3339};
use courier_core::source::SourceError;
use courier_core::source::shared::{F_RETRY_AT, HELD_WAIT, RECEIVE_WAIT, field};

/// SQS returns at most this many messages a call.
const PER_CALL: usize = 10;

/// What one received message becomes.
enum Admitted {
    Deliver(Delivery, InFlight),
    /// The first receive of a copy still waiting for its due time.
    Wait {
        message: Message,
        fields: Vec<(Bytes, Bytes)>,
        at: SystemTime,
        sent_at: SystemTime,
        /// FIFO: the due time is the process's, not the message's.
        in_process: bool,
        /// Its first receive, which its attempt count leaves out.
        first: bool,
    },
}

/// A system attribute of a received message.
fn system<'a>(message: &'a Message, name: &MessageSystemAttributeName) -> Option<&'a str> {
    message
        .attributes()
        .and_then(|a| a.get(name))
        .map(String::as_str)
}

fn millis(text: Option<&str>) -> Option<SystemTime> {
    text?
        .parse::<u64>()
        .ok()
        .map(|ms| UNIX_EPOCH + Duration::from_millis(ms))
}

impl SqsSource {
    /// The visibility timeout a receive asks for, in whole seconds.
    pub(super) fn visibility_secs(&self) -> i32 {
        let timeout = self.live().visibility_timeout;
        (timeout.as_millis().div_ceil(1000) as i32).clamp(1, super::settle::MAX_VISIBILITY as i32)
    }

    /// One `ReceiveMessage` for up to `max` (at most 10), waiting `wait`
    /// seconds for a first one.
    async fn receive_call(&self, max: usize, wait: i32) -> Result<Vec<Message>, SourceError> {
        let out = self
            .client
            .receive_message()
            .queue_url(&self.queue_url)
            .max_number_of_messages(max.clamp(1, PER_CALL) as i32)
            .wait_time_seconds(wait)
            .visibility_timeout(self.visibility_secs())
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await
            .map_err(|e| sdk_error("receiving from SQS", e))?;
        Ok(out.messages.unwrap_or_default())
    }

    pub(super) async fn read(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        let max = max.max(1);
        let mut out = self.waiting_group_heads(max);
        if out.len() >= max {
            return Ok(out);
        }
        // FIFO: a read brings in no more while as many wait in the source
        // as the app may have at once.
        if self.fifo && lock(&self.groups).waiting_count() >= self.options.in_flight_messages() {
            if out.is_empty() {
                tokio::time::sleep(RECEIVE_WAIT / 4).await;
            }
            return Ok(out);
        }
        let want = max - out.len();
        // Retries this process keeps invisible until their due time, due
        // now: visible, so that this receive takes them.
        self.surface_due().await;
        // A FIFO group's next message may be free to go at any moment (its
        // earlier one acked): no long poll while some wait here.
        let waiting = self.fifo && self.refresh_waiting().await;
        let wait = if out.is_empty() && !waiting {
            HELD_WAIT.as_secs() as i32
        } else {
            0
        };
        // Not past the next due time of such a retry: the poll ends by then.
        let surfacing = self.next_surfacing();
        let wait = surfacing.map_or(wait, |due| wait.min(due.as_secs() as i32));
        let mut messages = self.receive_call(want, wait).await?;
        if messages.is_empty() && out.is_empty() && waiting {
            tokio::time::sleep(RECEIVE_WAIT / 10).await;
        }
        // Under a second to go, less than the poll's unit: waited out here,
        // then the retry made visible and received.
        if messages.is_empty()
            && out.is_empty()
            && let Some(due) = self.next_surfacing()
            && due < Duration::from_secs(1)
        {
            tokio::time::sleep(due).await;
            self.surface_due().await;
            messages = self.receive_call(want, 0).await?;
        }
        if messages.len() == PER_CALL.min(want) && want > PER_CALL {
            // A backlog: the rest in parallel, without waiting.
            let rest = want - messages.len();
            let calls = (0..rest.div_ceil(PER_CALL))
                .map(|i| self.receive_call((rest - i * PER_CALL).min(PER_CALL), 0));
            for got in futures::future::join_all(calls).await {
                match got {
                    Ok(more) => messages.extend(more),
                    Err(e) => tracing::debug!(error = %e, "a parallel receive failed"),
                }
            }
        }
        let max_deliveries = self.live().max_deliveries;
        for message in messages {
            match self.admit(message, max_deliveries) {
                Admitted::Deliver(delivery, held) => {
                    if let Some(delivery) = self.through_group(delivery, held) {
                        out.push(delivery);
                    }
                }
                Admitted::Wait {
                    message,
                    fields,
                    at,
                    sent_at,
                    in_process,
                    first,
                } => {
                    self.wait_copy(&message, fields, at, sent_at, in_process, first)
                        .await
                }
            }
        }
        Ok(out)
    }

    /// Turns a received message into a delivery (or, received too often,
    /// one to dead-letter without offering it), or a waiting copy.
    fn admit(&self, message: Message, max_deliveries: u32) -> Admitted {
        let sqs_id = message.message_id().unwrap_or_default().to_string();
        let receipt = message.receipt_handle().unwrap_or_default().to_string();
        let received = system(
            &message,
            &MessageSystemAttributeName::ApproximateReceiveCount,
        )
        .and_then(|c| c.parse::<u32>().ok())
        .unwrap_or(1)
        .max(1);
        let sent = millis(system(&message, &MessageSystemAttributeName::SentTimestamp));
        let sent_at = sent.unwrap_or_else(SystemTime::now);
        let group =
            system(&message, &MessageSystemAttributeName::MessageGroupId).map(str::to_string);
        let due = lock(&self.due)
            .get(&sqs_id)
            .copied()
            .filter(|at| *at > SystemTime::now());
        if let Some(at) = due {
            return Admitted::Wait {
                message,
                fields: Vec::new(),
                at,
                sent_at,
                in_process: true,
                first: true,
            };
        }
        // Only a copy courier sealed carries courier's state.
        let fields = self.seal.open(from_message(&message));
        let waits = field(&fields, F_RETRY_AT).and_then(|t| parse_time(t.as_bytes()));
        // A copy's first receive is never offered (its attempt count
        // leaves it out), nor is a receive before its due time (the process
        // that had the first one died before it was due).
        if let Some(at) = waits
            && (received == 1 || at > SystemTime::now())
        {
            return Admitted::Wait {
                message,
                fields,
                at,
                sent_at,
                in_process: false,
                first: received == 1,
            };
        }
        let uncounted = lock(&self.uncounted).get(&sqs_id).copied().unwrap_or(0);
        let counted = received - u32::from(waits.is_some());
        let extra = (counted - 1).saturating_sub(uncounted);
        let mut fields = fields;
        if field(&fields, F_FIRST_ATTEMPT_AT).is_none() {
            let mut first = lock(&self.first_attempts);
            if extra == 0 && field(&fields, F_ATTEMPT).is_none() {
                first.insert(sqs_id.clone(), SystemTime::now());
            } else {
                // Another replica or an earlier run offered it first: the
                // time it was sent is the closest bound known.
                let at = first.get(&sqs_id).copied().unwrap_or(sent_at);
                fields.push((F_FIRST_ATTEMPT_AT.into(), Bytes::from(rfc3339(at))));
            }
        }
        let mut delivery = Delivery::from_fields(&sqs_id, fields, extra, receipt, sent);
        // A poison pill: every receive of it ended without a settlement
        // (the sidecar crashed or hung on it). SQS's own counter says so,
        // unless the receive before this one was a retry settled here: then
        // the count holds attempts of a policy with a higher maxAttempts,
        // and the answer to this one decides (`attempts-exhausted`).
        let handed_out = received.saturating_sub(uncounted);
        let retried_here = lock(&self.retried).get(&sqs_id) == Some(&(received - 1));
        if handed_out > max_deliveries && !retried_here {
            delivery.problem = Some(format!(
                "received {handed_out} times without being settled (the limit is {max_deliveries}, maxAttempts + 2)"
            ));
        }
        Admitted::Deliver(
            delivery,
            InFlight {
                sqs_id,
                group,
                sent_at,
                received,
            },
        )
    }

    /// Registers a delivery in flight, or, FIFO, keeps it behind the
    /// message of its group the app has.
    fn through_group(&self, delivery: Delivery, held: InFlight) -> Option<Delivery> {
        let group = held.group.clone();
        lock(&self.in_flight).insert(delivery.receipt.clone(), held);
        let Some(group) = group.filter(|_| self.fifo) else {
            return Some(delivery);
        };
        let mut groups = lock(&self.groups);
        let queued = groups.waiting.get(&group).is_some_and(|w| !w.is_empty());
        if groups.busy.contains(&group) || queued {
            groups.waiting.entry(group).or_default().push_back(delivery);
            return None;
        }
        groups.busy.insert(group);
        Some(delivery)
    }

    /// FIFO: the next message of each group whose earlier one is settled.
    fn waiting_group_heads(&self, max: usize) -> Vec<Delivery> {
        if !self.fifo {
            return Vec::new();
        }
        let mut groups = lock(&self.groups);
        let free: Vec<String> = groups
            .waiting
            .iter()
            .filter(|(g, w)| !w.is_empty() && !groups.busy.contains(*g))
            .map(|(g, _)| g.clone())
            .take(max)
            .collect();
        let mut out = Vec::new();
        for group in free {
            let waiting = groups.waiting.get_mut(&group).expect("listed above");
            if let Some(delivery) = waiting.pop_front() {
                out.push(delivery);
            }
            if waiting.is_empty() {
                groups.waiting.remove(&group);
            }
            groups.busy.insert(group);
        }
        out
    }

    /// The group of a settled delivery may hand out its next message.
    pub(super) fn group_done(&self, group: Option<&str>) {
        if let Some(group) = group {
            lock(&self.groups).busy.remove(group);
        }
    }

    /// The waiting messages of `group`, taken out of the source.
    pub(super) fn take_waiting(&self, group: Option<&str>) -> Vec<Delivery> {
        let Some(group) = group else {
            return Vec::new();
        };
        let mut groups = lock(&self.groups);
        groups.busy.remove(group);
        groups
            .waiting
            .remove(group)
            .map(Vec::from)
            .unwrap_or_default()
    }

    /// FIFO: keeps the messages waiting behind their group invisible,
    /// every third of the visibility timeout (the dispatcher keeps only
    /// those with the app alive); whether any wait.
    async fn refresh_waiting(&self) -> bool {
        let receipts = self.waiting_receipts();
        if receipts.is_empty() {
            return false;
        }
        let due = {
            let mut last = lock(&self.waiting_refreshed);
            let third = self.live().visibility_timeout / 3;
            let due = last.elapsed() >= third;
            if due {
                *last = std::time::Instant::now();
            }
            due
        };
        if due && let Err(e) = self.change_visibility_of(&receipts).await {
            tracing::debug!(error = %e, "messages waiting behind their group may be handed out again");
        }
        true
    }

    /// Every receipt waiting behind its group.
    pub(super) fn waiting_receipts(&self) -> Vec<String> {
        lock(&self.groups)
            .waiting
            .values()
            .flatten()
            .map(|d| d.receipt.clone())
            .collect()
    }
}
