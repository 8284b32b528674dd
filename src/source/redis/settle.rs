//! Settling a delivery: pipelined acks, a retry stored in `<queue>.retry`,
//! a dead letter in the dead-letter stream, each together with the `XACK`.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use redis::Value;
use redis::aio::ConnectionManager;

use super::{RedisSource, broker_error};
use crate::model::{Delivery, Failure, PAYLOAD};
use crate::source::{Batcher, SourceError, encode_fields};

/// Concurrent acks become one `XACK` with many ids.
pub(super) fn ack_batcher(
    commands: &ConnectionManager,
    stream: &str,
    group: &str,
) -> Batcher<String> {
    let con = commands.clone();
    let stream = stream.to_string();
    let group = group.to_string();
    Batcher::spawn(512, move |ids: Vec<String>| {
        let mut con = con.clone();
        let (stream, group) = (stream.clone(), group.clone());
        async move {
            redis::cmd("XACK")
                .arg(&stream)
                .arg(&group)
                .arg(&ids)
                .query_async::<Value>(&mut con)
                .await
                .map(drop)
                .map_err(broker_error)
        }
    })
}

impl RedisSource {
    pub(super) async fn store_retry(
        &self,
        delivery: &Delivery,
        next_attempt: u32,
        first_attempt_at: SystemTime,
        at: SystemTime,
    ) -> Result<(), SourceError> {
        let member = encode_fields(&delivery.fields_for_retry(next_attempt, first_attempt_at));
        let due = at
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis() as u64;
        let mut con = self.commands.clone();
        redis::pipe()
            .atomic()
            .cmd("ZADD")
            .arg(&self.retry_key)
            .arg(due)
            .arg(member)
            .ignore()
            .cmd("XACK")
            .arg(&self.options.queue)
            .arg(&self.options.group)
            .arg(&delivery.receipt)
            .ignore()
            .query_async::<()>(&mut con)
            .await
            .map_err(broker_error)
    }

    pub(super) async fn store_dead_letter(
        &self,
        delivery: &Delivery,
        failure: &Failure,
    ) -> Result<(), SourceError> {
        let mut fields = delivery.fields_for_dead_letter(failure);
        // A dead letter always has a body field, even when the entry had none.
        if !fields.iter().any(|(n, _)| n.as_ref() == PAYLOAD.as_bytes()) {
            fields.insert(0, (PAYLOAD.into(), Bytes::new()));
        }
        let mut xadd = redis::cmd("XADD");
        xadd.arg(&failure.dead_letter_queue).arg("*");
        for (name, value) in &fields {
            xadd.arg(name.as_ref()).arg(value.as_ref());
        }
        let mut con = self.commands.clone();
        redis::pipe()
            .atomic()
            .add_command(xadd)
            .ignore()
            .cmd("XACK")
            .arg(&self.options.queue)
            .arg(&self.options.group)
            .arg(&delivery.receipt)
            .ignore()
            .query_async::<()>(&mut con)
            .await
            .map_err(broker_error)
    }
}
