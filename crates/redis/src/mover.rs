//! Moving due retries from `<queue>.retry` back to the work stream.
//!
//! A due retry is first claimed (its score pushed a lease ahead, so no other
//! replica's mover takes it meanwhile), then written back with `XADD` and
//! removed from the set in one MULTI. The `XADD` is a plain command, not a
//! Lua call, so a message of any width moves (a script cannot pass more
//! than about 8,000 values to one command). A retry that cannot be decoded
//! becomes an `undeliverable` dead letter with its raw bytes as the body;
//! one that cannot be written stays claimed until the lease runs out and is
//! tried again, while the rest of the queue moves on.
//!
//! When the whole write fails (the connection dropped, a master died after
//! the claim reached its replica), the mover keeps what it claimed and
//! moves it again on its next round while the lease is its own, instead of
//! leaving those retries idle for the rest of the lease: a cluster failover
//! held them 30 s. Before writing one again it asks whether it is still in
//! the set, so a write that went through but whose answer was lost is not
//! made twice.
//!
//! The mover sleeps until the earliest retry in the set is due, and no
//! longer than [`IDLE_CHECK`]; a retry this process stores wakes it at
//! once (it may be due sooner). An idle queue costs one script call every
//! few seconds instead of twenty a second (a Redis server counted 193
//! calls of the mover's script in 10 s of an empty queue before).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use super::connection::Connection;
use bytes::Bytes;
use redis::{Script, Value};

use super::RedisSource;
use super::entries::now_ms;
use super::settle::xadd;
use courier_core::model::{DeadLetterReason, Delivery, Failure, PAYLOAD};
use courier_core::source::{LiveSettings, decode_fields};

/// The shortest wait between two rounds: after a failed write, and while
/// retries fall due one after another.
const MOVE_INTERVAL: Duration = Duration::from_millis(50);
/// The longest wait between two rounds. A retry another replica stored is
/// moved by that replica's mover when it falls due; this mover looks again
/// this often in case that replica has stopped since, and then moves it
/// at most this late.
const IDLE_CHECK: Duration = Duration::from_secs(10);
const MOVE_BATCH: usize = 500;
/// A claimed retry that was not moved (the process stopped, a key has the
/// wrong type) is due again after this.
const CLAIM_LEASE: Duration = Duration::from_secs(30);
/// The same trouble is logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// Claims due retries: pushes their score a lease ahead and returns them,
/// and the due time in ms of the earliest retry left in the set (nil when
/// it is empty), so that the mover knows how long it may sleep.
/// KEYS[1] the retry set; ARGV[1] now in ms, ARGV[2] the most to claim,
/// ARGV[3] the end of the lease in ms.
const CLAIM_DUE: &str = r"
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, member in ipairs(due) do
  redis.call('ZADD', KEYS[1], 'XX', ARGV[3], member)
end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {due, first[2] or false}
";

/// Stops the mover and wakes it early; shared by the source and its mover.
#[derive(Default)]
pub(super) struct MoverControl {
    stop: AtomicBool,
    wake: tokio::sync::Notify,
}

impl MoverControl {
    /// A retry was stored: it may be due before the mover's next round.
    pub(super) fn retry_stored(&self) {
        self.wake.notify_one();
    }

    pub(super) fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.wake.notify_one();
    }
}

/// What one round did: how many retries it moved, and when the earliest
/// one left falls due.
struct Round {
    moved: usize,
    next_due_ms: Option<u64>,
}

/// How long to sleep after a round: until the earliest retry left is due,
/// within [`MOVE_INTERVAL`] and [`IDLE_CHECK`]; nothing stored, the longest.
fn wait_after(next_due_ms: Option<u64>, now_ms: u64) -> Duration {
    next_due_ms.map_or(IDLE_CHECK, |due| {
        Duration::from_millis(due.saturating_sub(now_ms)).clamp(MOVE_INTERVAL, IDLE_CHECK)
    })
}

/// Runs right after the `XADD` of a moved retry, in the same MULTI, and
/// removes the retry only if that `XADD` wrote (a failed command inside
/// MULTI does not stop the next). KEYS[1] the stream written to, KEYS[2]
/// the retry set; ARGV[1] the retry.
const REMOVE_IF_WRITTEN: &str = r"
local t = redis.call('TYPE', KEYS[1]).ok
if t ~= 'stream' then
  return redis.error_reply('WRONGTYPE ' .. KEYS[1] .. ' holds a ' .. t .. ', not a stream: the retry stays stored; delete or rename that key')
end
return redis.call('ZREM', KEYS[2], ARGV[1])
";

/// Logs one kind of trouble at most once per [`LOG_EVERY`], with how many
/// times it happened since.
pub(super) struct Throttle {
    last: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    pub(super) fn new() -> Self {
        Self {
            last: Mutex::new((None, 0)),
        }
    }

    /// `Some(times since the last log)` when this one should be logged.
    pub(super) fn due(&self) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        last.1 += 1;
        if last.0.is_some_and(|at| at.elapsed() < LOG_EVERY) {
            return None;
        }
        let times = last.1;
        *last = (Some(Instant::now()), 0);
        Some(times)
    }
}

struct Mover {
    con: Connection,
    retry_key: String,
    queue: String,
    live: Arc<Mutex<LiveSettings>>,
    trouble: Throttle,
    /// Claimed by this mover, not written back because the write failed.
    unmoved: Unmoved,
}

/// Retries this mover claimed and could not write back, and until when the
/// claim is surely still its own.
#[derive(Default)]
struct Unmoved {
    members: Vec<Vec<u8>>,
    until: Option<Instant>,
}

impl Unmoved {
    /// What is left to move again and until when, forgotten once the lease
    /// may have run out (another replica may have claimed it since).
    fn take(&mut self) -> (Vec<Vec<u8>>, Option<Instant>) {
        let members = std::mem::take(&mut self.members);
        match self.until.take() {
            Some(until) if Instant::now() < until => (members, Some(until)),
            _ => (Vec::new(), None),
        }
    }
}

impl RedisSource {
    pub(super) fn spawn_mover(&self) {
        let mut mover = Mover {
            con: self.commands.clone(),
            retry_key: self.retry_key.clone(),
            queue: self.options.queue.clone(),
            live: self.live.clone(),
            trouble: Throttle::new(),
            unmoved: Unmoved::default(),
        };
        let control: Arc<MoverControl> = self.mover.clone();
        tokio::spawn(async move {
            while !control.stop.load(Ordering::Relaxed) {
                let wait = match mover.move_due().await {
                    Ok(round) if round.moved >= MOVE_BATCH => continue,
                    // What a failed write left claimed is moved again soon.
                    Ok(_) if !mover.unmoved.members.is_empty() => MOVE_INTERVAL,
                    Ok(round) => wait_after(round.next_due_ms, now_ms()),
                    Err(e) => {
                        mover.warn(&e);
                        MOVE_INTERVAL
                    }
                };
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = control.wake.notified() => {}
                }
            }
        });
    }
}

impl Mover {
    fn warn(&self, error: &dyn std::fmt::Display) {
        if let Some(times) = self.trouble.due() {
            tracing::warn!(%error, queue = %self.queue, times, "moving due retries back failed; will try again");
        }
    }

    /// Moves up to a batch of due retries.
    async fn move_due(&mut self) -> Result<Round, redis::RedisError> {
        let (mut due, mut until) = self.still_claimed().await?;
        let mut next_due_ms = None;
        if due.len() < MOVE_BATCH {
            let now = now_ms();
            let (claimed, next): (Vec<Vec<u8>>, Option<u64>) = Script::new(CLAIM_DUE)
                .key(&self.retry_key)
                .arg(now)
                .arg(MOVE_BATCH - due.len())
                .arg(now + CLAIM_LEASE.as_millis() as u64)
                .invoke_async(&mut self.con)
                .await
                .inspect_err(|_| self.keep(&due, until))?;
            next_due_ms = next;
            if !claimed.is_empty() {
                // Half the lease: another replica reads the lease's end
                // with its own clock, which need not agree with this one.
                until = until.or(Some(Instant::now() + CLAIM_LEASE / 2));
            }
            for member in claimed {
                if !due.contains(&member) {
                    due.push(member);
                }
            }
        }
        if due.is_empty() {
            return Ok(Round {
                moved: 0,
                next_due_ms,
            });
        }
        let dead_letter_queue = self
            .live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .dead_letter_queue
            .clone();
        let mut pipe = redis::pipe();
        pipe.atomic().ignore_errors();
        for member in &due {
            let raw = Bytes::from(member.clone());
            let (target, fields) = match decode_fields(&raw) {
                Some(fields) if !fields.is_empty() => (&self.queue, fields),
                _ => {
                    tracing::warn!(queue = %self.queue, retry_set = %self.retry_key, dead_letter_queue, "a stored retry could not be decoded; it is dead-lettered as undeliverable with its raw bytes as the body");
                    (
                        &dead_letter_queue,
                        self.undecodable(raw, &dead_letter_queue),
                    )
                }
            };
            pipe.add_command(xadd(target, &fields)).ignore();
            pipe.cmd("EVAL")
                .arg(REMOVE_IF_WRITTEN)
                .arg(2)
                .arg(target)
                .arg(&self.retry_key)
                .arg(member.as_slice());
        }
        let results: Vec<Value> = pipe
            .query_async(&mut self.con)
            .await
            .inspect_err(|_| self.keep(&due, until))?;
        if let Some(Value::ServerError(e)) =
            results.iter().find(|v| matches!(v, Value::ServerError(_)))
        {
            self.warn(&format!("{e:?}"));
        }
        Ok(Round {
            moved: due.len(),
            next_due_ms,
        })
    }

    /// Remembers `due` to be moved again while the claim lasts (`until`).
    fn keep(&mut self, due: &[Vec<u8>], until: Option<Instant>) {
        self.unmoved = Unmoved {
            members: due.to_vec(),
            until,
        };
    }

    /// The retries a failed write left claimed that are still in the set,
    /// and until when they are this mover's; one no longer there was
    /// written back after all.
    async fn still_claimed(
        &mut self,
    ) -> Result<(Vec<Vec<u8>>, Option<Instant>), redis::RedisError> {
        let (unmoved, until) = self.unmoved.take();
        if unmoved.is_empty() {
            return Ok((unmoved, None));
        }
        let scores: Vec<Option<f64>> = redis::cmd("ZMSCORE")
            .arg(&self.retry_key)
            .arg(&unmoved)
            .query_async(&mut self.con)
            .await
            .inspect_err(|_| self.keep(&unmoved, until))?;
        let still = unmoved
            .into_iter()
            .zip(scores)
            .filter_map(|(member, score)| score.map(|_| member))
            .collect();
        Ok((still, until))
    }

    /// The dead letter of a stored retry that cannot be read.
    fn undecodable(&self, raw: Bytes, dead_letter_queue: &str) -> Vec<(Bytes, Bytes)> {
        let now = SystemTime::now();
        let id = format!("{}:{}", self.retry_key, now_ms());
        let delivery =
            Delivery::from_fields(&id, vec![(PAYLOAD.into(), raw)], 0, String::new(), None);
        delivery.fields_for_dead_letter(&Failure {
            reason: DeadLetterReason::Undeliverable,
            status: None,
            error: Some(format!(
                "a retry stored in {} could not be decoded; the body is its raw bytes",
                self.retry_key
            )),
            attempts: 0,
            first_attempt_at: now,
            last_attempt_at: now,
            queue: self.queue.clone(),
            message_id: id,
            excerpt: Bytes::new(),
            policy: String::new(),
            dead_letter_queue: dead_letter_queue.to_string(),
            app_directive: None,
            cut: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trouble_is_logged_once_an_interval_with_how_often_it_happened() {
        let trouble = Throttle::new();
        assert_eq!(trouble.due(), Some(1));
        assert_eq!(trouble.due(), None);
        assert_eq!(trouble.due(), None);
        trouble.last.lock().unwrap().0 = Some(Instant::now() - LOG_EVERY);
        assert_eq!(trouble.due(), Some(3));
        assert_eq!(trouble.due(), None);
    }

    #[test]
    fn the_mover_sleeps_until_the_earliest_retry_within_its_bounds() {
        let now = 1_000_000;
        assert_eq!(wait_after(None, now), IDLE_CHECK);
        assert_eq!(
            wait_after(Some(now + 1_500), now),
            Duration::from_millis(1_500)
        );
        assert_eq!(wait_after(Some(now + 60_000), now), IDLE_CHECK);
        assert_eq!(wait_after(Some(now + 10), now), MOVE_INTERVAL);
        // Due already (claimed by another mover, or a clock behind).
        assert_eq!(wait_after(Some(now - 5_000), now), MOVE_INTERVAL);
    }
}
