//! The torture run on Redis: a redis-server of the harness's own, the
//! producer (`XADD`), and what the checker reads of every key of the queue.

use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{
    GROUP, Holdings, Hostile, Letter, PrivateServer, Produced, TortureArgs, message, wait_answering,
};
use crate::torture_app::ids_in;

/// A redis-server of the harness's own (never the shared one on 6379),
/// with an append-only file fsynced on every write, so a SIGKILL loses
/// nothing it acknowledged.
pub(super) struct PrivateRedis {
    pub(super) server: PrivateServer,
}

impl PrivateRedis {
    pub(super) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.server.port)
    }

    pub(super) async fn start(&mut self) -> anyhow::Result<()> {
        let mut command = Command::new("redis-server");
        command
            .args(["--port", &self.server.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "yes"])
            .args(["--appendfsync", "always"])
            .args(["--dir", &self.server.dir.display().to_string()]);
        self.server.spawn("redis", command)?;
        wait_answering("the private redis-server", async || {
            let Ok(mut con) = self.connect().await else {
                return false;
            };
            redis::cmd("PING")
                .query_async::<String>(&mut con)
                .await
                .is_ok()
        })
        .await
    }

    async fn connect(&self) -> anyhow::Result<redis::aio::MultiplexedConnection> {
        let client = redis::Client::open(self.url())?;
        // The checker's XRANGE of an hour's dead letters (442 MB in the
        // 60-minute run) takes seconds; the client's default of 500 ms
        // ended that run's check with "timed out". Calls the nemesis can
        // stall have their own timeouts.
        let config =
            redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(60)));
        Ok(tokio::time::timeout(
            Duration::from_secs(3),
            client.get_multiplexed_async_connection_with_config(&config),
        )
        .await??)
    }
}

/// `XRANGE key from to`: each entry's fields.
async fn xrange(
    con: &mut redis::aio::MultiplexedConnection,
    key: &str,
    from: &str,
    to: &str,
) -> anyhow::Result<Vec<Vec<(Bytes, Bytes)>>> {
    let entries: Vec<(String, Vec<Vec<u8>>)> = redis::cmd("XRANGE")
        .arg(key)
        .arg(from)
        .arg(to)
        .query_async(con)
        .await?;
    Ok(entries
        .into_iter()
        .map(|(_, flat)| {
            flat.chunks(2)
                .filter(|c| c.len() == 2)
                .map(|c| (Bytes::from(c[0].clone()), Bytes::from(c[1].clone())))
                .collect()
        })
        .collect())
}

/// The group's last-delivered id on `key` ("0-0" before it read anything).
async fn last_delivered(
    con: &mut redis::aio::MultiplexedConnection,
    key: &str,
) -> anyhow::Result<String> {
    let groups: Vec<Vec<redis::Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(key)
        .query_async(con)
        .await?;
    let text = |v: &redis::Value| redis::from_redis_value_ref::<String>(v).ok();
    for group in groups {
        let map: HashMap<String, &redis::Value> = group
            .chunks(2)
            .filter_map(|pair| Some((text(pair.first()?)?, pair.get(1)?)))
            .collect();
        if map.get("name").and_then(|v| text(v)).as_deref() == Some(GROUP) {
            return Ok(map
                .get("last-delivered-id")
                .and_then(|v| text(v))
                .unwrap_or_else(|| "0-0".into()));
        }
    }
    Ok("0-0".into())
}

/// Every key of the queue (`<queue>*`: the stream, `.retry`, `.dlq` and
/// whatever else courier keeps), read whole: the dead letters from `.dlq`,
/// and the ids of everything else except the stream's acked entries.
pub(super) async fn holdings(r: &PrivateRedis, queue: &str) -> anyhow::Result<Holdings> {
    let mut con = r.connect().await?;
    let mut out = Holdings::default();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{queue}*"))
        .query_async(&mut con)
        .await?;
    let dlq = format!("{queue}.dlq");
    for key in keys {
        let kind: String = redis::cmd("TYPE").arg(&key).query_async(&mut con).await?;
        let mut entries = Vec::new();
        let mut blobs: Vec<Vec<u8>> = Vec::new();
        match kind.as_str() {
            "stream" if key == dlq => {
                for fields in xrange(&mut con, &key, "-", "+").await? {
                    out.letters.push(Letter::of(&fields));
                }
            }
            "stream" if key == queue => {
                // Unacked: the group's pending entries, and every entry after
                // its last-delivered id.
                let last = last_delivered(&mut con, &key).await?;
                entries.extend(xrange(&mut con, &key, &format!("({last}"), "+").await?);
                let pending: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
                    .arg(&key)
                    .arg(GROUP)
                    .arg("-")
                    .arg("+")
                    .arg(1_000_000)
                    .query_async(&mut con)
                    .await
                    .unwrap_or_default();
                for (id, ..) in pending {
                    entries.extend(xrange(&mut con, &key, &id, &id).await?);
                }
            }
            "stream" => entries.extend(xrange(&mut con, &key, "-", "+").await?),
            "string" => blobs = vec![redis::cmd("GET").arg(&key).query_async(&mut con).await?],
            other => {
                let (command, range): (&str, &[i64]) = match other {
                    "zset" => ("ZRANGE", &[0, -1]),
                    "list" => ("LRANGE", &[0, -1]),
                    "hash" => ("HGETALL", &[]),
                    "set" => ("SMEMBERS", &[]),
                    _ => continue,
                };
                blobs = redis::cmd(command)
                    .arg(&key)
                    .arg(range)
                    .query_async(&mut con)
                    .await?;
            }
        }
        for (_, value) in entries.iter().flatten() {
            ids_in(value, &mut out.pending);
        }
        for blob in blobs {
            ids_in(&blob, &mut out.pending);
        }
    }
    Ok(out)
}

/// The Redis producer: XADD at the rate, each id tried until it is written.
pub(super) fn spawn_producer(
    url: String,
    queue: String,
    args: TortureArgs,
    produced: Arc<Mutex<Produced>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let client = match redis::Client::open(url) {
            Ok(c) => c,
            Err(_) => return,
        };
        let mut con: Option<redis::aio::MultiplexedConnection> = None;
        let period = Duration::from_secs_f64(1.0 / args.rate.max(0.1));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut n = 0u64;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            tick.tick().await;
            let kind = Hostile::of(args.seed, n, args.hostile);
            let fields = message(n, kind, args.max_body, false);
            let give_up = Instant::now() + Duration::from_secs(60);
            loop {
                if con.is_none() {
                    con = tokio::time::timeout(
                        Duration::from_secs(3),
                        client.get_multiplexed_async_connection(),
                    )
                    .await
                    .ok()
                    .and_then(Result::ok);
                }
                let written = match &mut con {
                    Some(c) => {
                        let mut cmd = redis::cmd("XADD");
                        cmd.arg(&queue).arg("*");
                        for (k, v) in &fields {
                            cmd.arg(k.as_ref()).arg(v.as_ref());
                        }
                        matches!(
                            tokio::time::timeout(
                                Duration::from_secs(5),
                                cmd.query_async::<String>(c)
                            )
                            .await,
                            Ok(Ok(_))
                        )
                    }
                    None => false,
                };
                if written {
                    produced.lock().unwrap().ids.push((n, kind));
                    break;
                }
                con = None;
                produced.lock().unwrap().write_retries += 1;
                if Instant::now() > give_up {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            n += 1;
        }
    })
}
