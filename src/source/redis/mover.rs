//! Moving due retries from `<queue>.retry` back to the work stream.

use std::sync::atomic::Ordering;
use std::time::Duration;

use redis::Script;

use super::RedisSource;
use super::entries::now_ms;

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

impl RedisSource {
    pub(super) fn spawn_mover(&self) {
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
}
