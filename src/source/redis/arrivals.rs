//! Waking an idle reader the moment an entry arrives, without loading it.
//!
//! The reader's script cannot block (a Lua script never waits), and a
//! blocking `XREADGROUP` would hand courier an entry over `--max-body`
//! whole. So a connection of its own (RESP3) turns on client-side caching's
//! key tracking (`CLIENT TRACKING ON`, the default mode) and reads the
//! stream's length: Redis then remembers that this connection read the key,
//! and the next write to it (a producer's `XADD`, a retry moved back) sends
//! one `invalidate` push that names the key, never the entry. Redis forgets
//! the key once it sent that push, so a reader that never waits (a busy
//! drain) is sent nothing; acks, claims and the script's own reads do not
//! count as writes to it.
//!
//! Where this cannot work, the reader polls as before: a Redis Cluster (the
//! stream's node would need a connection of its own), or a server that
//! refuses `HELLO 3` or `CLIENT TRACKING` (Redis before 6, an ACL without
//! `+client`), which is said once in the log.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ProtocolVersion, PushInfo, PushKind, RedisError, RedisResult};
use tokio::sync::Notify;

use super::connection::Endpoint;
use super::mover::Throttle;
use super::tls;
use crate::source::Tls;

/// How long connecting the tracking connection, or one of its commands, may
/// take: the reader waits for it.
const TRACKING_TIMEOUT: Duration = Duration::from_secs(5);
/// How long after a failed connect the reader polls before trying again.
const RECONNECT_AFTER: Duration = Duration::from_secs(1);

/// What the tracking connection's pushes tell the reader.
#[derive(Default)]
struct Pushes {
    /// An `invalidate` push came, or the connection closed.
    arrived: Notify,
    /// The connection closed: the key is no longer tracked.
    lost: AtomicBool,
}

enum Tracking {
    /// Not connected; connecting again is due at `retry_at`.
    Closed { retry_at: Instant },
    /// Connected. `armed`: the stream's key is tracked, so the next write to
    /// it sends a push (or its push already came and waits in `arrived`).
    Open {
        connection: MultiplexedConnection,
        armed: bool,
    },
    /// This deployment cannot track keys: the reader polls for good.
    Off,
}

pub(super) struct Arrivals {
    endpoint: Endpoint,
    tls: Tls,
    queue: String,
    pushes: Arc<Pushes>,
    tracking: Tracking,
    /// Failures to connect, logged at most once an interval.
    trouble: Throttle,
}

impl Arrivals {
    /// `cluster`: the server is a Redis Cluster node, though its URL may
    /// not say so.
    pub(super) fn new(endpoint: Endpoint, tls: Tls, queue: String, cluster: bool) -> Self {
        let tracking = match cluster {
            true => Tracking::Off,
            false => Tracking::Closed {
                retry_at: Instant::now(),
            },
        };
        Self {
            endpoint,
            tls,
            queue,
            pushes: Arc::default(),
            tracking,
            trouble: Throttle::new(),
        }
    }

    /// After a read found no new entry: returns true when the reader should
    /// read again now, because an entry arrived (or the wait reached
    /// `deadline`), or because tracking was just armed and an entry may have
    /// come between the empty read and the arming. False when nothing can
    /// tell of an arrival, and the reader polls.
    pub(super) async fn wait(&mut self, deadline: Instant) -> bool {
        if matches!(self.tracking, Tracking::Open { .. })
            && self.pushes.lost.load(Ordering::Relaxed)
        {
            tracing::debug!(queue = %self.queue, "the Redis connection that tells of new entries closed; reconnecting");
            self.tracking = Tracking::Closed {
                retry_at: Instant::now(),
            };
        }
        if let Tracking::Closed { retry_at } = self.tracking {
            if Instant::now() < retry_at {
                return false;
            }
            self.tracking = self.open().await;
        }
        let Tracking::Open { connection, armed } = &mut self.tracking else {
            return false;
        };
        if *armed {
            let arrived = self.pushes.arrived.notified();
            // At the deadline the key is still tracked; the reader reads
            // once more, as a receive ends there.
            if tokio::time::timeout_at(deadline.into(), arrived)
                .await
                .is_ok()
            {
                *armed = false;
            }
            return true;
        }
        // A push of an earlier arming, for an entry since read, would end
        // the next wait at once for nothing.
        let _ = futures::FutureExt::now_or_never(self.pushes.arrived.notified());
        let tracked: Result<u64, RedisError> = redis::cmd("XLEN")
            .arg(&self.queue)
            .query_async(connection)
            .await;
        match tracked {
            Ok(_) => {
                *armed = true;
                true
            }
            Err(error) => {
                self.failed(&error);
                false
            }
        }
    }

    #[cfg(test)]
    fn is_armed(&self) -> bool {
        matches!(self.tracking, Tracking::Open { armed: true, .. })
    }

    /// Connects a tracking connection to the server holding the stream.
    async fn open(&mut self) -> Tracking {
        let pushes = Arc::new(Pushes::default());
        let connected =
            match tokio::time::timeout(TRACKING_TIMEOUT, self.connect(pushes.clone())).await {
                Ok(Some(connected)) => connected,
                Ok(None) => return Tracking::Off,
                Err(elapsed) => Err(RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    elapsed,
                ))),
            };
        match connected {
            Ok(connection) => {
                self.pushes = pushes;
                Tracking::Open {
                    connection,
                    armed: false,
                }
            }
            Err(error) if !transient(&error) => {
                tracing::warn!(
                    %error,
                    queue = %self.queue,
                    "Redis refused the key tracking (CLIENT TRACKING over RESP3) that tells courier of new entries at once; new entries are found by asking every 20 ms instead"
                );
                Tracking::Off
            }
            Err(error) => {
                self.failed(&error);
                Tracking::Closed {
                    retry_at: Instant::now() + RECONNECT_AFTER,
                }
            }
        }
    }

    /// A RESP3 connection with key tracking on, whose pushes go to
    /// `pushes`; `None` where no one server holds the stream.
    async fn connect(&self, pushes: Arc<Pushes>) -> Option<RedisResult<MultiplexedConnection>> {
        let info = match self.endpoint.tracking_node(&self.tls).await? {
            Ok(info) => info,
            Err(error) => return Some(Err(error)),
        };
        let settings = info.redis_settings().clone();
        let info = info.set_redis_settings(settings.set_protocol(ProtocolVersion::RESP3));
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(TRACKING_TIMEOUT))
            .set_response_timeout(Some(TRACKING_TIMEOUT))
            .set_push_sender(move |push: PushInfo| {
                if push.kind == PushKind::Disconnection {
                    pushes.lost.store(true, Ordering::Relaxed);
                }
                pushes.arrived.notify_one();
                Ok::<(), std::convert::Infallible>(())
            });
        let connected = async {
            let mut connection = tls::client(info, &self.tls)?
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            redis::cmd("CLIENT")
                .arg("TRACKING")
                .arg("ON")
                .query_async::<()>(&mut connection)
                .await?;
            Ok(connection)
        };
        Some(connected.await)
    }

    /// The tracking connection failed: the reader polls until it is back.
    fn failed(&mut self, error: &RedisError) {
        if let Some(times) = self.trouble.due() {
            tracing::warn!(%error, queue = %self.queue, times, "the Redis connection that tells of new entries failed; polling until it is back");
        }
        self.tracking = Tracking::Closed {
            retry_at: Instant::now() + RECONNECT_AFTER,
        };
    }
}

/// A failure of the network or of a server that may come back, as opposed to
/// a server that answers it will not track keys.
fn transient(error: &RedisError) -> bool {
    error.is_io_error()
        || error.is_connection_refusal()
        || error.is_timeout()
        || error.is_connection_dropped()
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn redis() -> MultiplexedConnection {
        redis::Client::open("redis://127.0.0.1:6379/0")
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .expect("Redis on 127.0.0.1:6379")
    }

    /// Arrivals for a fresh stream with a consumer group, armed.
    async fn armed(con: &mut MultiplexedConnection) -> (Arrivals, String) {
        let queue = format!("arrivals-{}", rand::random::<u64>());
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&queue)
            .arg("g")
            .arg("0")
            .arg("MKSTREAM")
            .query_async(con)
            .await
            .unwrap();
        let endpoint = Endpoint::parse("redis://127.0.0.1:6379/0").unwrap();
        let mut arrivals = Arrivals::new(endpoint, Tls::default(), queue.clone(), false);
        let far = Instant::now() + Duration::from_secs(600);
        assert!(arrivals.wait(far).await, "armed: read again first");
        assert!(arrivals.is_armed());
        (arrivals, queue)
    }

    /// The wake itself: a producer's XADD ends the wait by its push, long
    /// before the deadline (which would leave the key tracked).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_to_the_stream_ends_the_wait() {
        let mut con = redis().await;
        let (mut arrivals, queue) = armed(&mut con).await;
        let _: String = redis::cmd("XADD")
            .arg(&queue)
            .arg("*")
            .arg("payload")
            .arg("x")
            .query_async(&mut con)
            .await
            .unwrap();
        assert!(
            arrivals
                .wait(Instant::now() + Duration::from_secs(600))
                .await
        );
        assert!(!arrivals.is_armed(), "woken by the push, not the deadline");
        let _: () = redis::cmd("DEL")
            .arg(&queue)
            .query_async(&mut con)
            .await
            .unwrap();
    }

    /// What a busy drain does to the stream (the script's reads, acks,
    /// claims) sends no push: only the deadline ends the wait.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_acks_and_claims_are_not_arrivals() {
        let mut con = redis().await;
        let (mut arrivals, queue) = armed(&mut con).await;
        let read = redis::Script::new(
            "return redis.call('XREADGROUP', 'GROUP', 'g', 'c', 'COUNT', 10, 'STREAMS', KEYS[1], '>')",
        );
        let _: redis::Value = read.key(&queue).invoke_async(&mut con).await.unwrap();
        for command in [
            redis::cmd("XACK").arg(&queue).arg("g").arg("1-0").clone(),
            redis::cmd("XCLAIM")
                .arg(&queue)
                .arg("g")
                .arg("c")
                .arg(0)
                .arg("1-0")
                .arg("JUSTID")
                .clone(),
            redis::cmd("XAUTOCLAIM")
                .arg(&queue)
                .arg("g")
                .arg("c")
                .arg(0)
                .arg("0-0")
                .clone(),
        ] {
            let _: redis::Value = command.query_async(&mut con).await.unwrap();
        }
        assert!(
            arrivals
                .wait(Instant::now() + Duration::from_millis(300))
                .await
        );
        assert!(
            arrivals.is_armed(),
            "no push came; the key is still tracked"
        );
        let _: () = redis::cmd("DEL")
            .arg(&queue)
            .query_async(&mut con)
            .await
            .unwrap();
    }
}
