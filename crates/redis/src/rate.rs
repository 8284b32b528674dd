//! `rateLimit.scope: queue`: one token bucket per queue and group, kept in
//! Redis, that every replica takes its turns from. One script call per
//! delivery: Redis runs scripts one at a time, so the replicas' turns are
//! spaced as one bucket's would be, on Redis's clock, not theirs.

use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;

use super::RedisSource;
use super::broker_error;
use courier_core::source::SourceError;

/// Refills the bucket (a hash: `tokens`, `at` in µs of Redis's clock) at
/// ARGV[1] a second up to ARGV[2], takes one token, which may leave it below
/// zero (turns taken ahead), and returns the wait in µs. The key expires
/// once a full bucket would have refilled, so an idle queue leaves nothing.
const TAKE: &str = r"
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or burst
local at = tonumber(state[2]) or now
if now > at then
  tokens = tokens + (now - at) * rate / 1000000
end
if tokens > burst then tokens = burst end
tokens = tokens - 1
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
local refill = math.ceil((burst - tokens) / rate * 1000)
redis.call('PEXPIRE', KEYS[1], math.max(refill, 1000))
if tokens >= 0 then return 0 end
return math.ceil(-tokens / rate * 1000000)
";

static TAKE_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(TAKE));

impl RedisSource {
    /// The bucket's key: derived from the queue's name, so a hash-tagged
    /// queue keeps it in its slot; one per group, as each group feeds its
    /// own app.
    fn rate_key(&self) -> String {
        format!("{}.rate:{}", self.options.queue, self.options.group)
    }

    pub(super) async fn take_token(
        &self,
        per_second: f64,
        burst: u32,
    ) -> Result<Duration, SourceError> {
        let mut con = self.commands.clone();
        let wait_us: u64 = TAKE_SCRIPT
            .key(self.rate_key())
            .arg(per_second)
            .arg(burst)
            .invoke_async(&mut con)
            .await
            .map_err(broker_error)?;
        Ok(Duration::from_micros(wait_us))
    }
}
