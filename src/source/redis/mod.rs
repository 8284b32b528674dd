//! Redis Streams.
//!
//! - The work stream is `--queue`, read by the consumer group `--group` with
//!   blocking `XREADGROUP` in batches on a connection of its own (a shared
//!   multiplexed connection would time out a long `RECEIVE_WAIT`).
//! - Acks are pipelined: concurrent acks become one `XACK` with many ids.
//! - A retry is the message's fields stored in the sorted set
//!   `<queue>.retry` (score = due time in ms) and the `XACK`, in one MULTI. A
//!   Lua script moves due entries back to the stream with `XADD`; the
//!   original id and the attempt count travel as `courier-*` fields.
//! - A dead letter is `XADD <dlq>` and `XACK` in one MULTI.
//! - Deliveries left pending longer than the visibility timeout (a crashed
//!   replica) are reclaimed with `XAUTOCLAIM`; this replica's own pending
//!   entries are read back first thing after a restart.
//!
//! Derived keys append to the queue name, so a hash-tagged name like
//! `{orders}` keeps `{orders}.retry` and `{orders}.dlq` in its slot.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Script, Value};
use tokio::sync::Mutex;

use super::shared::{RECEIVE_WAIT, not_there};
use super::{
    Batcher, Broker, Capabilities, Depth, Source, SourceError, SourceOptions, encode_fields,
};
use crate::model::{DeadLetter, Delivery, Failure, PAYLOAD};

/// How often due retries are moved back, and reclaiming is checked.
const MOVE_INTERVAL: Duration = Duration::from_millis(50);
const MOVE_BATCH: usize = 500;

/// Moves due retries back to the work stream. KEYS[1] the retry set,
/// KEYS[2] the stream; ARGV[1] now in ms, ARGV[2] the most to move.
const MOVE_DUE: &str = r"
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, member in ipairs(due) do
  redis.call('XADD', KEYS[2], '*', unpack(cmsgpack.unpack(member)))
  redis.call('ZREM', KEYS[1], member)
end
return #due
";

/// Moves one dead letter back to the work stream, in one step so that two
/// replays of the same letter cannot both write it. KEYS[1] the stream,
/// KEYS[2] the dead-letter stream; ARGV[1] the dead letter's id, ARGV[2] the
/// replayed message's fields.
const REPLAY: &str = r"
if redis.call('XDEL', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[1], '*', unpack(cmsgpack.unpack(ARGV[2])))
return 1
";

/// Redis Streams: `redis://host:port/db` (`rediss://` for TLS).
pub const BROKER: Broker = Broker {
    name: "redis",
    schemes: &["redis", "rediss"],
    url_form: "redis://host:port/db",
    check_url: |_| Ok(()),
    open: |url, options| {
        Box::pin(async move {
            Ok(Arc::new(RedisSource::connect(url.as_str(), options).await?) as Arc<dyn Source>)
        })
    },
};

pub struct RedisSource {
    options: SourceOptions,
    commands: ConnectionManager,
    reader: Mutex<Reader>,
    acks: Batcher<String>,
    retry_key: String,
    mover_stop: Arc<AtomicBool>,
}

struct Reader {
    connection: ConnectionManager,
    /// After a restart, this consumer's own pending entries come first.
    history_done: bool,
    /// The last history entry handed out: the next history read starts
    /// after it, so entries already in flight are not handed out twice.
    history_from: String,
    last_reclaim: Instant,
}

fn broker_error(e: redis::RedisError) -> SourceError {
    if e.is_io_error() || e.is_connection_refusal() || e.is_timeout() || e.is_connection_dropped() {
        SourceError::Unavailable(e.to_string())
    } else {
        SourceError::Broker(e.to_string())
    }
}

impl RedisSource {
    pub async fn connect(url: &str, options: SourceOptions) -> Result<Self, SourceError> {
        // Nagle's algorithm with delayed ACKs holds small commands (an XACK,
        // a blocking read's reply) for up to 40 ms; redis-rs leaves it on.
        let client = redis::IntoConnectionInfo::into_connection_info(url)
            .map(|info| {
                info.set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true))
            })
            .and_then(Client::open)
            .map_err(|e| SourceError::Invalid(format!("--source {}: {e}", super::redact(url))))?;
        let base = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_number_of_retries(3)
            .set_max_delay(Duration::from_secs(2));
        let commands = client
            .get_connection_manager_with_config(
                base.clone()
                    .set_response_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .map_err(|e| SourceError::Unavailable(format!("{}: {e}", super::redact(url))))?;
        let reader = client
            .get_connection_manager_with_config(
                base.set_response_timeout(Some(RECEIVE_WAIT + Duration::from_secs(10))),
            )
            .await
            .map_err(|e| SourceError::Unavailable(format!("{}: {e}", super::redact(url))))?;
        let mut con = commands.clone();
        check_cluster_slots(&mut con, url, &options).await?;
        // Start at 0, not $: what producers wrote before courier's first
        // start is work too.
        let created: redis::RedisResult<Value> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&options.queue)
            .arg(&options.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut con)
            .await;
        if let Err(e) = created
            && e.code() != Some("BUSYGROUP")
        {
            return Err(broker_error(e));
        }
        let acks = {
            let con = commands.clone();
            let stream = options.queue.clone();
            let group = options.group.clone();
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
        };
        let source = Self {
            retry_key: format!("{}.retry", options.queue),
            commands,
            reader: Mutex::new(Reader {
                connection: reader,
                history_done: false,
                history_from: "0".into(),
                last_reclaim: Instant::now(),
            }),
            acks,
            mover_stop: Arc::new(AtomicBool::new(false)),
            options,
        };
        source.spawn_mover();
        Ok(source)
    }

    /// `<queue>.acked:<idempotency key>`: derived from the queue name, so a
    /// hash-tagged queue keeps it in its slot.
    fn acked_key(&self, key: &str) -> String {
        format!("{}.acked:{key}", self.options.queue)
    }

    fn spawn_mover(&self) {
        let mut con = self.commands.clone();
        let keys = [self.retry_key.clone(), self.options.queue.clone()];
        let stop = self.mover_stop.clone();
        tokio::spawn(async move {
            let script = Script::new(MOVE_DUE);
            while !stop.load(Ordering::Relaxed) {
                let moved: Result<usize, _> = script
                    .key(&keys[0])
                    .key(&keys[1])
                    .arg(now_ms())
                    .arg(MOVE_BATCH)
                    .invoke_async(&mut con)
                    .await;
                match moved {
                    Ok(n) if n >= MOVE_BATCH => continue,
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, queue = %keys[1], "moving due retries back failed; will try again")
                    }
                }
                tokio::time::sleep(MOVE_INTERVAL).await;
            }
        });
    }

    /// Delivery counts of entries that were handed out before (history or
    /// reclaimed), so a crash mid-delivery still counts as an attempt.
    async fn delivery_counts(&self, ids: &[String]) -> Result<Vec<u32>, SourceError> {
        let mut pipe = redis::pipe();
        for id in ids {
            pipe.cmd("XPENDING")
                .arg(&self.options.queue)
                .arg(&self.options.group)
                .arg(id)
                .arg(id)
                .arg(1);
        }
        let mut con = self.commands.clone();
        let replies: Vec<Value> = pipe.query_async(&mut con).await.map_err(broker_error)?;
        Ok(replies
            .iter()
            .map(|reply| match reply {
                Value::Array(rows) => match rows.first() {
                    Some(Value::Array(row)) => row.get(3).and_then(as_u64).unwrap_or(1) as u32,
                    _ => 1,
                },
                _ => 1,
            })
            .collect())
    }

    /// Entries this consumer was given before and never settled (a restart
    /// of the same pod), or that another replica left pending too long.
    async fn redeliveries(
        &self,
        reader: &mut Reader,
        max: usize,
    ) -> Result<Vec<Delivery>, SourceError> {
        let entries = if !reader.history_done {
            let reply: Value = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(&self.options.group)
                .arg(&self.options.consumer)
                .arg("COUNT")
                .arg(max)
                .arg("STREAMS")
                .arg(&self.options.queue)
                .arg(&reader.history_from)
                .query_async(&mut reader.connection)
                .await
                .map_err(broker_error)?;
            let entries = parse_read_reply(reply);
            if entries.len() < max {
                reader.history_done = true;
            }
            if let Some((id, _)) = entries.last() {
                reader.history_from = id.clone();
            }
            entries
        } else if reader.last_reclaim.elapsed()
            >= self.options.visibility_timeout.min(Duration::from_secs(5))
        {
            reader.last_reclaim = Instant::now();
            let reply: Value = redis::cmd("XAUTOCLAIM")
                .arg(&self.options.queue)
                .arg(&self.options.group)
                .arg(&self.options.consumer)
                .arg(self.options.visibility_timeout.as_millis() as u64)
                .arg("0-0")
                .arg("COUNT")
                .arg(max)
                .query_async(&mut reader.connection)
                .await
                .map_err(broker_error)?;
            match reply {
                Value::Array(parts) => parts
                    .into_iter()
                    .nth(1)
                    .map(parse_entries)
                    .unwrap_or_default(),
                _ => Vec::new(),
            }
        } else {
            return Ok(Vec::new());
        };
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<String> = entries.iter().map(|(id, _)| id.clone()).collect();
        let counts = self.delivery_counts(&ids).await?;
        Ok(entries
            .into_iter()
            .zip(counts)
            .map(|((id, fields), count)| {
                Delivery::from_fields(&id, fields, count.saturating_sub(1), id.clone())
            })
            .collect())
    }
}

/// The part of a key Redis Cluster hashes: the text between the first `{`
/// and the next `}`, when that is not empty.
fn hash_tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let rest = &key[open + 1..];
    let close = rest.find('}')?;
    (close > 0).then(|| &rest[..close])
}

/// On a Redis Cluster node, the stream, `<queue>.retry` and the dead-letter
/// stream must hash to one slot: a retry and a dead letter are each one
/// MULTI (or Lua script) over two of them, which a cluster refuses across
/// slots. A queue name without a hash tag would fail on the first retry, so
/// it is refused at start instead.
async fn check_cluster_slots(
    con: &mut ConnectionManager,
    url: &str,
    options: &SourceOptions,
) -> Result<(), SourceError> {
    let info: String = redis::cmd("INFO")
        .arg("cluster")
        .query_async(con)
        .await
        .map_err(broker_error)?;
    if !info.lines().any(|line| line.trim() == "cluster_enabled:1") {
        return Ok(());
    }
    let queue = &options.queue;
    let Some(tag) = hash_tag(queue) else {
        return Err(SourceError::Invalid(format!(
            "{} is a Redis Cluster node and --queue {queue:?} has no hash tag: the stream, {queue}.retry and the dead-letter stream must share a hash slot; name the queue with one, e.g. --queue \"{{{queue}}}\"",
            super::redact(url)
        )));
    };
    let dlq = &options.dead_letter_queue;
    if hash_tag(dlq) != Some(tag) {
        return Err(SourceError::Invalid(format!(
            "{} is a Redis Cluster node and the dead-letter queue {dlq:?} does not carry the queue's hash tag {{{tag}}}: give it the same tag, e.g. \"{{{tag}}}.dlq\"",
            super::redact(url)
        )));
    }
    Ok(())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

fn as_bytes(v: &Value) -> Option<Bytes> {
    match v {
        Value::BulkString(b) => Some(Bytes::copy_from_slice(b)),
        Value::SimpleString(s) => Some(Bytes::copy_from_slice(s.as_bytes())),
        Value::Int(i) => Some(Bytes::from(i.to_string())),
        _ => None,
    }
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        other => std::str::from_utf8(&as_bytes(other)?).ok()?.parse().ok(),
    }
}

type Entry = (String, Vec<(Bytes, Bytes)>);

/// Takes a string reply by value so a body is moved into `Bytes`, not copied.
fn into_bytes(v: Value) -> Option<Bytes> {
    match v {
        Value::BulkString(b) => Some(Bytes::from(b)),
        other => as_bytes(&other),
    }
}

/// `[[id, [field, value, ...]], ...]`; entries deleted since (nil fields)
/// are skipped.
fn parse_entries(v: Value) -> Vec<Entry> {
    let Value::Array(entries) = v else {
        return Vec::new();
    };
    entries
        .into_iter()
        .filter_map(|entry| {
            let Value::Array(parts) = entry else {
                return None;
            };
            let mut parts = parts.into_iter();
            let id = String::from_utf8_lossy(&into_bytes(parts.next()?)?).into_owned();
            let Value::Array(flat) = parts.next()? else {
                return None;
            };
            let mut fields = Vec::with_capacity(flat.len() / 2);
            let mut flat = flat.into_iter();
            while let (Some(name), Some(value)) = (flat.next(), flat.next()) {
                fields.push((into_bytes(name)?, into_bytes(value)?));
            }
            Some((id, fields))
        })
        .collect()
}

/// An `XREADGROUP`/`XREAD` reply: `[[stream, entries]]` (RESP2) or a map.
fn parse_read_reply(v: Value) -> Vec<Entry> {
    match v {
        Value::Array(streams) => streams
            .into_iter()
            .flat_map(|s| match s {
                Value::Array(parts) => parts
                    .into_iter()
                    .nth(1)
                    .map(parse_entries)
                    .unwrap_or_default(),
                _ => Vec::new(),
            })
            .collect(),
        Value::Map(streams) => streams
            .into_iter()
            .flat_map(|(_, e)| parse_entries(e))
            .collect(),
        _ => Vec::new(),
    }
}

/// The stream id's first part is the time it was added, in ms.
fn id_time(id: &str) -> Option<SystemTime> {
    let ms: u64 = id.split('-').next()?.parse().ok()?;
    Some(UNIX_EPOCH + Duration::from_millis(ms))
}

#[async_trait]
impl Source for RedisSource {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            per_message_delay: true,
            out_of_order_acks: true,
            dead_letter_browsing: true,
            dedup: true,
            byte_bounded_reads: false,
        }
    }

    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        let mut reader = self.reader.lock().await;
        let redelivered = self.redeliveries(&mut reader, max).await?;
        if !redelivered.is_empty() {
            return Ok(redelivered);
        }
        let reply: Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(&self.options.group)
            .arg(&self.options.consumer)
            .arg("COUNT")
            .arg(max)
            .arg("BLOCK")
            .arg(RECEIVE_WAIT.as_millis() as u64)
            .arg("STREAMS")
            .arg(&self.options.queue)
            .arg(">")
            .query_async(&mut reader.connection)
            .await
            .map_err(broker_error)?;
        Ok(parse_read_reply(reply)
            .into_iter()
            .map(|(id, fields)| Delivery::from_fields(&id, fields, 0, id.clone()))
            .collect())
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), SourceError> {
        self.acks.submit(delivery.receipt.clone()).await
    }

    async fn retry(
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

    async fn dead_letter(&self, delivery: &Delivery, failure: &Failure) -> Result<(), SourceError> {
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

    async fn depth(&self) -> Result<Depth, SourceError> {
        let mut con = self.commands.clone();
        let dlq = &self.options.dead_letter_queue;
        let (dlq_len, backlog, oldest, groups): (u64, u64, Value, Value) = redis::pipe()
            .cmd("XLEN")
            .arg(dlq)
            .cmd("ZCARD")
            .arg(&self.retry_key)
            .cmd("XRANGE")
            .arg(dlq)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1)
            .cmd("XINFO")
            .arg("GROUPS")
            .arg(&self.options.queue)
            .query_async(&mut con)
            .await
            .map_err(broker_error)?;
        let oldest_age = parse_entries(oldest)
            .first()
            .and_then(|(id, _)| id_time(id))
            .map(|t| SystemTime::now().duration_since(t).unwrap_or_default());
        let (mut ready, mut pending) = (0, 0);
        if let Value::Array(groups) = groups {
            for group in groups {
                let pairs: Vec<(String, Value)> = match group {
                    Value::Array(flat) => flat
                        .chunks(2)
                        .filter_map(|p| {
                            Some((
                                String::from_utf8_lossy(&as_bytes(p.first()?)?).into_owned(),
                                p.get(1)?.clone(),
                            ))
                        })
                        .collect(),
                    Value::Map(map) => map
                        .into_iter()
                        .filter_map(|(k, v)| {
                            Some((String::from_utf8_lossy(&as_bytes(&k)?).into_owned(), v))
                        })
                        .collect(),
                    _ => continue,
                };
                let get = |name: &str| {
                    pairs
                        .iter()
                        .find(|(k, _)| k == name)
                        .and_then(|(_, v)| as_u64(v))
                };
                if pairs.iter().any(|(k, v)| {
                    k == "name" && as_bytes(v).as_deref() == Some(self.options.group.as_bytes())
                }) {
                    pending = get("pending").unwrap_or(0);
                    ready = get("lag").unwrap_or(0);
                }
            }
        }
        Ok(Depth {
            ready,
            pending,
            retry_backlog: backlog,
            dead_letters: dlq_len,
            oldest_dead_letter_age: oldest_age,
        })
    }

    async fn dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        let mut con = self.commands.clone();
        let reply: Value = redis::cmd("XRANGE")
            .arg(dead_letter_queue)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(limit.min(i64::MAX as usize))
            .query_async(&mut con)
            .await
            .map_err(broker_error)?;
        Ok(parse_entries(reply)
            .into_iter()
            .map(|(id, fields)| DeadLetter::from_fields(id, fields))
            .collect())
    }

    async fn replay(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let mut con = self.commands.clone();
        let moved: i64 = Script::new(REPLAY)
            .key(&self.options.queue)
            .key(dead_letter_queue)
            .arg(&letter.id)
            .arg(encode_fields(&letter.fields_for_replay()))
            .invoke_async(&mut con)
            .await
            .map_err(broker_error)?;
        if moved == 0 {
            return Err(not_there(dead_letter_queue, &letter.id));
        }
        Ok(())
    }

    async fn purge(&self, dead_letter_queue: &str, letter: &DeadLetter) -> Result<(), SourceError> {
        let mut con = self.commands.clone();
        let deleted: i64 = redis::cmd("XDEL")
            .arg(dead_letter_queue)
            .arg(&letter.id)
            .query_async(&mut con)
            .await
            .map_err(broker_error)?;
        if deleted == 0 {
            return Err(not_there(dead_letter_queue, &letter.id));
        }
        Ok(())
    }

    async fn send(&self, body: Bytes, headers: &[(String, String)]) -> Result<String, SourceError> {
        let mut xadd = redis::cmd("XADD");
        xadd.arg(&self.options.queue)
            .arg("*")
            .arg(PAYLOAD)
            .arg(body.as_ref());
        for (name, value) in headers {
            xadd.arg(name).arg(value);
        }
        let mut con = self.commands.clone();
        xadd.query_async(&mut con).await.map_err(broker_error)
    }

    async fn remember_ack(&self, key: &str, window: Duration) -> Result<(), SourceError> {
        let mut con = self.commands.clone();
        redis::cmd("SET")
            .arg(self.acked_key(key))
            .arg(1)
            .arg("PX")
            .arg(window.as_millis().max(1) as u64)
            .arg("NX")
            .query_async::<Value>(&mut con)
            .await
            .map(drop)
            .map_err(broker_error)
    }

    async fn was_acked(&self, key: &str) -> Result<bool, SourceError> {
        let mut con = self.commands.clone();
        redis::cmd("EXISTS")
            .arg(self.acked_key(key))
            .query_async::<i64>(&mut con)
            .await
            .map(|n| n > 0)
            .map_err(broker_error)
    }

    async fn close(&self) {
        self.mover_stop.store(true, Ordering::Relaxed);
    }
}

impl Drop for RedisSource {
    fn drop(&mut self) {
        self.mover_stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::hash_tag;

    #[test]
    fn hash_tags_follow_redis_cluster_rules() {
        assert_eq!(hash_tag("{orders}"), Some("orders"));
        assert_eq!(hash_tag("{orders}.retry"), Some("orders"));
        assert_eq!(hash_tag("app:{orders}:dlq"), Some("orders"));
        assert_eq!(hash_tag("orders"), None);
        // An empty tag hashes the whole key, as if there were none.
        assert_eq!(hash_tag("{}orders"), None);
        assert_eq!(hash_tag("{orders"), None);
        assert_eq!(hash_tag("{a}{b}"), Some("a"));
    }
}
