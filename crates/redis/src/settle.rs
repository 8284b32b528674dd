//! Settling a delivery: pipelined acks, a retry stored in `<queue>.retry`,
//! a dead letter in the dead-letter stream, each together with the `XACK`.

use std::time::{SystemTime, UNIX_EPOCH};

use super::connection::Connection;
use async_trait::async_trait;
use bytes::Bytes;
use redis::{Script, Value};

use super::{RedisSource, broker_error};
use courier_core::model::{Delivery, Failure};
use courier_core::source::{Batcher, SettleParts, SourceError, encode_fields, shared};

/// Concurrent acks become one `XACK` with many ids.
pub(super) fn ack_batcher(commands: &Connection, stream: &str, group: &str) -> Batcher<String> {
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

/// Stores a retry and acks the delivery, or does neither. Redis does not
/// undo the writes of a script that fails halfway, so every key is checked
/// before anything is written. KEYS[1] the retry set, KEYS[2] the stream;
/// ARGV[1] the group, ARGV[2] the entry id, ARGV[3] the due time in ms,
/// ARGV[4] the stored fields.
const RETRY: &str = r"
local retry = redis.call('TYPE', KEYS[1]).ok
if retry ~= 'zset' and retry ~= 'none' then
  return redis.error_reply('WRONGTYPE ' .. KEYS[1] .. ' holds a ' .. retry .. ', not the sorted set of retries: the retry was not stored and the message was not acked; delete or rename that key')
end
local stream = redis.call('TYPE', KEYS[2]).ok
if stream ~= 'stream' then
  return redis.error_reply('WRONGTYPE ' .. KEYS[2] .. ' holds a ' .. stream .. ', not the work stream: the retry was not stored')
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
return 1
";

/// Runs in the same MULTI right after the `XADD` of a dead letter and acks
/// the delivery only if that `XADD` wrote: the stream it wrote to exists
/// and is a stream (an `XADD` to a key of another type fails, and a failed
/// command inside MULTI does not stop the ones after it). The dead letter is
/// written by `XADD` itself, not from Lua, because a script cannot pass more
/// than about 8,000 values to one command and a message may have more
/// fields. KEYS[1] the dead-letter stream, KEYS[2] the work stream; ARGV[1]
/// the group, ARGV[2] the entry id.
const ACK_IF_WRITTEN: &str = r"
local dlq = redis.call('TYPE', KEYS[1]).ok
if dlq ~= 'stream' then
  return redis.error_reply('WRONGTYPE ' .. KEYS[1] .. ' holds a ' .. dlq .. ', not a dead-letter stream: the dead letter was not written and the message was not acked; delete or rename that key')
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
return 1
";

/// Resets the idle time of this consumer's entries that are still in
/// flight, so `XAUTOCLAIM` elsewhere does not take them while the app works
/// on them. An entry another consumer has claimed meanwhile is left to it.
/// KEYS[1] the stream; ARGV[1] the group, ARGV[2] this consumer, ARGV[3..]
/// the entry ids.
const KEEP_CLAIMED: &str = r"
local kept = 0
for i = 3, #ARGV do
  local owner = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if owner[1] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    kept = kept + 1
  end
end
return kept
";

impl RedisSource {
    pub(super) async fn keep_claimed(&self, in_flight: &[Delivery]) -> Result<(), SourceError> {
        if in_flight.is_empty() {
            return Ok(());
        }
        let mut con = self.commands.clone();
        let script = Script::new(KEEP_CLAIMED);
        let mut invocation = script.key(&self.options.queue);
        invocation
            .arg(&self.options.group)
            .arg(&self.options.consumer);
        for delivery in in_flight {
            invocation.arg(&delivery.receipt);
        }
        invocation
            .invoke_async::<Value>(&mut con)
            .await
            .map(drop)
            .map_err(broker_error)
    }
}

/// `XADD <stream> * <fields...>`.
pub(super) fn xadd(stream: &str, fields: &[(Bytes, Bytes)]) -> redis::Cmd {
    let mut xadd = redis::cmd("XADD");
    xadd.arg(stream).arg("*");
    for (name, value) in fields {
        xadd.arg(name.as_ref()).arg(value.as_ref());
    }
    xadd
}

#[async_trait]
impl SettleParts for RedisSource {
    async fn settle_ack(&self, delivery: &Delivery) -> Result<(), SourceError> {
        self.acks.submit(delivery.receipt.clone()).await
    }

    async fn settle_retry(
        &self,
        delivery: &Delivery,
        next_attempt: u32,
        first_attempt_at: SystemTime,
        at: SystemTime,
    ) -> Result<(), SourceError> {
        let member = encode_fields(
            &self
                .seal
                .seal(delivery.fields_for_retry(next_attempt, first_attempt_at)),
        );
        let due = at
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis() as u64;
        let mut con = self.commands.clone();
        Script::new(RETRY)
            .key(&self.retry_key)
            .key(&self.options.queue)
            .arg(&self.options.group)
            .arg(&delivery.receipt)
            .arg(due)
            .arg(member)
            .invoke_async::<Value>(&mut con)
            .await
            .map_err(broker_error)?;
        self.mover.retry_stored();
        Ok(())
    }

    async fn settle_dead_letter(
        &self,
        delivery: &Delivery,
        failure: &Failure,
    ) -> Result<(), SourceError> {
        let fields = shared::with_payload(delivery.fields_for_dead_letter(failure));
        let mut con = self.commands.clone();
        let mut pipe = redis::pipe();
        pipe.atomic()
            .add_command(xadd(&failure.dead_letter_queue, &fields))
            .ignore()
            .cmd("EVAL")
            .arg(ACK_IF_WRITTEN)
            .arg(2)
            .arg(&failure.dead_letter_queue)
            .arg(&self.options.queue)
            .arg(&self.options.group)
            .arg(&delivery.receipt);
        pipe.query_async::<Value>(&mut con)
            .await
            .map(drop)
            .map_err(broker_error)
    }
}
