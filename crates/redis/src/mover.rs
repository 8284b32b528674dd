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

/// How often due retries are moved back.
const MOVE_INTERVAL: Duration = Duration::from_millis(50);
const MOVE_BATCH: usize = 500;
/// A claimed retry that was not moved (the process stopped, a key has the
/// wrong type) is due again after this.
const CLAIM_LEASE: Duration = Duration::from_secs(30);
/// The same trouble is logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// Claims due retries: pushes their score a lease ahead and returns them.
/// KEYS[1] the retry set; ARGV[1] now in ms, ARGV[2] the most to claim,
/// ARGV[3] the end of the lease in ms.
const CLAIM_DUE: &str = r"
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, member in ipairs(due) do
  redis.call('ZADD', KEYS[1], 'XX', ARGV[3], member)
end
return due
";

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
        let stop: Arc<AtomicBool> = self.mover_stop.clone();
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                match mover.move_due().await {
                    Ok(n) if n >= MOVE_BATCH => continue,
                    Ok(_) => {}
                    Err(e) => mover.warn(&e),
                }
                tokio::time::sleep(MOVE_INTERVAL).await;
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

    /// Moves up to a batch of due retries; returns how many were due.
    async fn move_due(&mut self) -> Result<usize, redis::RedisError> {
        let (mut due, mut until) = self.still_claimed().await?;
        if due.len() < MOVE_BATCH {
            let now = now_ms();
            let claimed: Vec<Vec<u8>> = Script::new(CLAIM_DUE)
                .key(&self.retry_key)
                .arg(now)
                .arg(MOVE_BATCH - due.len())
                .arg(now + CLAIM_LEASE.as_millis() as u64)
                .invoke_async(&mut self.con)
                .await
                .inspect_err(|_| self.keep(&due, until))?;
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
            return Ok(0);
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
        Ok(due.len())
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
        let delivery = Delivery::from_fields(&id, vec![(PAYLOAD.into(), raw)], 0, String::new());
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
}
