//! Depth: ready and pending from the consumer group, the retry backlog,
//! the dead-letter stream's length and oldest age, and the age of the first
//! entry the group has not delivered yet. One reading ([`read`]) serves the
//! sidecar's gauges and an admin handle's `depth_of` alike: it only reads,
//! so it neither makes the stream nor joins the group.

use std::sync::LazyLock;
use std::time::{Duration, SystemTime};

use redis::{Script, Value};

use super::broker_error;
use super::connection::Connection;
use super::entries::{as_bytes, as_u64, id_time};
use courier_core::model::{F_LAST_ATTEMPT_AT, dead_letter_age, parse_time};
use courier_core::source::{Depth, SourceError};

/// Every figure of a depth reading in one command, so that an idle
/// sidecar's gauges cost Redis one request a `--depth-interval`. KEYS[1]
/// the stream, KEYS[2] the retry set, KEYS[3] the dead-letter stream (one
/// hash slot on a Redis Cluster: `cluster.rs`); ARGV[1] the group, ARGV[2]
/// `courier-last-attempt-at`. Returns the dead-letter stream's length, the
/// retry set's size, the oldest dead letter's id and ARGV[2] field (the
/// letter itself, whose body may be as large as a message can be, never
/// travels for a gauge), `XINFO GROUPS` as Redis answers it, and the id of
/// the first entry after the group's last-delivered-id (the oldest one no
/// consumer was handed yet) unless the group's lag is 0; nil when the
/// stream is not there (an admin handle names a stream no producer wrote to
/// and no sidecar opened), as `XINFO` would refuse it.
const DEPTH: &str = r"
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local oldest = {}
local first = redis.call('XRANGE', KEYS[3], '-', '+', 'COUNT', 1)[1]
if first then
  oldest[1] = first[1]
  local fields = first[2]
  for i = 1, #fields, 2 do
    if fields[i] == ARGV[2] then oldest[2] = fields[i + 1] break end
  end
end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
local waiting = false
for _, group in ipairs(groups) do
  local info = {}
  for i = 1, #group, 2 do info[group[i]] = group[i + 1] end
  if info['name'] == ARGV[1] and info['lag'] ~= 0 then
    local next = redis.call('XRANGE', KEYS[1], '(' .. info['last-delivered-id'], '+', 'COUNT', 1)[1]
    if next then waiting = next[1] end
  end
end
return {redis.call('XLEN', KEYS[3]), redis.call('ZCARD', KEYS[2]), oldest, groups, waiting}
";

static DEPTH_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(DEPTH));

/// `<queue>.retry`: the sorted set of the queue's scheduled retries.
pub(super) fn retry_key(queue: &str) -> String {
    format!("{queue}.retry")
}

/// The depth of the stream `queue` as the consumer group `group` sees it,
/// with the dead letters of `dead_letter_queue`: what the sidecar's gauges
/// show ([`courier_core::source::Observed::depth`]) and what `courier
/// console` reads through an admin handle. A group that is not there (no
/// sidecar has opened the queue) leaves what only it can tell unknown: the
/// ready count, the queue depth and the oldest waiting age.
pub(super) async fn read(
    con: &Connection,
    queue: &str,
    group: &str,
    dead_letter_queue: &str,
) -> Result<Depth, SourceError> {
    let mut con = con.clone();
    let reply: Option<(u64, u64, Value, Value, Option<String>)> = DEPTH_SCRIPT
        .key(queue)
        .key(retry_key(queue))
        .key(dead_letter_queue)
        .arg(group)
        .arg(F_LAST_ATTEMPT_AT)
        .invoke_async(&mut con)
        .await
        .map_err(broker_error)?;
    let Some((dlq_len, backlog, oldest, groups, waiting)) = reply else {
        return Err(SourceError::gone(format!(
            "there is no stream {queue:?} on this Redis: no producer has written to it and no \
             sidecar has opened it (check the queue name)"
        )));
    };
    let now = SystemTime::now();
    // The age is the time since it was dead-lettered (its
    // courier-last-attempt-at), as on every broker; the stream id's time
    // stands in for a letter that does not say.
    let oldest_age = match oldest {
        Value::Array(parts) if !parts.is_empty() => {
            let text = |v: Option<&Value>| {
                v.and_then(as_bytes)
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
            };
            let written = text(parts.first()).and_then(|id| id_time(&id));
            text(parts.get(1))
                .and_then(|at| parse_time(at.as_bytes()))
                .or(written)
                .map(|at| dead_letter_age(at, now))
        }
        _ => None,
    };
    let group = group_counts(groups, group);
    let oldest_waiting = match (&group.last_delivered, group.lag) {
        // Without the group nothing says which entries it has had.
        (None, _) => None,
        // The group has delivered everything: no entry waits.
        (_, Some(0)) => Some(Duration::ZERO),
        _ => Some(
            waiting
                .and_then(|id| id_time(&id))
                .map_or(Duration::ZERO, |at| {
                    now.duration_since(at).unwrap_or_default()
                }),
        ),
    };
    Ok(Depth {
        // A nil lag is Redis saying it cannot count, not that nothing
        // waits: both counts stay unknown until it can again.
        ready: group.lag,
        pending: group.pending,
        retry_backlog: backlog,
        dead_letters: dlq_len,
        oldest_dead_letter_age: oldest_age,
        queue_depth: group.lag.map(|lag| lag + group.pending),
        oldest_waiting_age: oldest_waiting,
    })
}

/// `lag`, `pending` and `last-delivered-id` of the consumer group `name` in
/// an `XINFO GROUPS` reply (flat pairs in RESP2, a map in RESP3).
fn group_counts(groups: Value, name: &str) -> GroupCounts {
    let mut counts = GroupCounts::default();
    let Value::Array(groups) = groups else {
        return counts;
    };
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
        let get = |field: &str| {
            pairs
                .iter()
                .find(|(k, _)| k == field)
                .and_then(|(_, v)| as_u64(v))
        };
        if pairs
            .iter()
            .any(|(k, v)| k == "name" && as_bytes(v).as_deref() == Some(name.as_bytes()))
        {
            counts.pending = get("pending").unwrap_or(0);
            counts.lag = get("lag");
            counts.last_delivered = pairs
                .iter()
                .find(|(k, _)| k == "last-delivered-id")
                .and_then(|(_, v)| as_bytes(v))
                .map(|b| String::from_utf8_lossy(&b).into_owned());
        }
    }
    counts
}

/// What `XINFO GROUPS` says of this consumer group.
#[derive(Debug, Default)]
struct GroupCounts {
    /// Entries not delivered to any consumer of the group yet; `None` when
    /// Redis answers nil because it cannot count them (entries ahead of
    /// the group were deleted, or the group's read counter is unknown, as
    /// after `XGROUP SETID` or on a promoted replica), or leaves it out
    /// (before Redis 7).
    lag: Option<u64>,
    /// Delivered and not acked (the group's pending entries list).
    pending: u64,
    last_delivered: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    use bytes::Bytes;
    use courier_core::model::Failure;
    use courier_core::source::{
        Consumer, DeadLetterStore, ErrorKind, Observed, SettleBy, SourceOptions,
    };

    use crate::RedisSource;
    use crate::dead_letters::RedisStore;

    const REDIS: &str = "redis://127.0.0.1:6379/0";

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

    async fn exists(con: &Connection, key: &str) -> bool {
        let n: i64 = redis::cmd("EXISTS")
            .arg(key)
            .query_async(&mut con.clone())
            .await
            .unwrap();
        n == 1
    }

    /// Against the Redis on loopback: an admin handle reads the figures
    /// the sidecar's gauges read, with messages waiting, one in flight,
    /// one scheduled for a retry and one dead-lettered; before any sidecar
    /// it names the missing stream, then leaves the group's counts unknown,
    /// and it never makes a key, a group or a consumer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_admin_handle_reads_the_depth_the_sidecar_reads() {
        let queue = format!(
            "courier-depth-of-{}",
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        );
        let options = SourceOptions::new(&queue);
        let dlq = options.live.dead_letter_queue.clone();
        let admin = RedisStore::open(REDIS, options.clone())
            .await
            .expect("Redis on 127.0.0.1:6379");
        let con = admin.commands.clone();

        let err = admin.depth_of(&dlq).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Gone, "{err}");
        assert!(err.message().contains(&queue), "{err}");
        for key in [&queue, &retry_key(&queue), &dlq] {
            assert!(!exists(&con, key).await, "{key} was made");
        }

        for i in 0..6 {
            admin.send(Bytes::from(format!("m{i}")), &[]).await.unwrap();
        }
        let no_group = admin.depth_of(&dlq).await.unwrap().unwrap();
        assert_eq!(
            no_group,
            Depth {
                ready: None,
                pending: 0,
                retry_backlog: 0,
                dead_letters: 0,
                oldest_dead_letter_age: None,
                queue_depth: None,
                oldest_waiting_age: None,
            }
        );
        let groups: Vec<Value> = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&queue)
            .query_async(&mut con.clone())
            .await
            .unwrap();
        assert!(groups.is_empty(), "a group was made: {groups:?}");

        let source = RedisSource::connect(REDIS, options).await.unwrap();
        let fresh = source.depth().await.unwrap();
        assert_same(&admin.depth_of(&dlq).await.unwrap().unwrap(), &fresh);
        assert_eq!((fresh.ready, fresh.queue_depth), (Some(6), Some(6)));

        let got = source.receive(4).await.unwrap();
        assert_eq!(got.len(), 4);
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
        source.close().await;

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
            (Some(2), 1, 1, 1, Some(3)),
            "{read:?}"
        );
        assert!(read.oldest_dead_letter_age.is_some(), "{read:?}");
        assert!(read.oldest_waiting_age.is_some(), "{read:?}");

        let consumers: Vec<Value> = redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg(&queue)
            .arg("courier")
            .query_async(&mut con.clone())
            .await
            .unwrap();
        assert_eq!(consumers.len(), 1, "only the sidecar's consumer");

        let _: () = redis::cmd("DEL")
            .arg(&queue)
            .arg(retry_key(&queue))
            .arg(&dlq)
            .arg(format!("{queue}.courier-key"))
            .query_async(&mut con.clone())
            .await
            .unwrap();
    }

    fn text(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    /// One group of an `XINFO GROUPS` reply as RESP2 sends it: flat pairs.
    fn flat(name: &str, pending: i64, lag: Value) -> Value {
        Value::Array(vec![
            text("name"),
            text(name),
            text("consumers"),
            Value::Int(1),
            text("pending"),
            Value::Int(pending),
            text("last-delivered-id"),
            text("1-0"),
            text("entries-read"),
            Value::Nil,
            text("lag"),
            lag,
        ])
    }

    #[test]
    fn a_counted_lag_is_read_for_this_group_only() {
        let reply = Value::Array(vec![
            flat("other", 9, Value::Int(90)),
            flat("courier", 2, Value::Int(5)),
        ]);
        let counts = group_counts(reply, "courier");
        assert_eq!((counts.lag, counts.pending), (Some(5), 2));
        assert_eq!(counts.last_delivered.as_deref(), Some("1-0"));
    }

    #[test]
    fn a_nil_lag_is_unknown_not_zero() {
        let counts = group_counts(
            Value::Array(vec![flat("courier", 2, Value::Nil)]),
            "courier",
        );
        assert_eq!((counts.lag, counts.pending), (None, 2));
    }

    #[test]
    fn a_resp3_map_reads_the_same() {
        let group = |lag: Value| {
            Value::Map(vec![
                (text("name"), text("courier")),
                (text("pending"), Value::Int(3)),
                (text("last-delivered-id"), text("7-0")),
                (text("lag"), lag),
            ])
        };
        let counts = group_counts(Value::Array(vec![group(Value::Int(4))]), "courier");
        assert_eq!((counts.lag, counts.pending), (Some(4), 3));
        let counts = group_counts(Value::Array(vec![group(Value::Nil)]), "courier");
        assert_eq!((counts.lag, counts.pending), (None, 3));
    }

    #[test]
    fn no_lag_field_before_redis_7_is_unknown() {
        let reply = Value::Array(vec![Value::Array(vec![
            text("name"),
            text("courier"),
            text("pending"),
            Value::Int(1),
            text("last-delivered-id"),
            text("1-0"),
        ])]);
        assert_eq!(group_counts(reply, "courier").lag, None);
    }
}
