//! Poison pills: an entry handed out `max_deliveries` times without ever
//! being settled (it crashes or hangs whoever takes it) is dead-lettered as
//! `undeliverable` by Redis's own delivery counter, inside Redis, before
//! courier loads it again.

use redis::Script;
use redis::aio::ConnectionManager;

use super::{RedisSource, broker_error};
use crate::model::rfc3339;
use crate::source::SourceError;

/// The widest entry (field names plus values) the script below writes
/// itself: a Lua script cannot pass more than about 8,000 values to one
/// command. A wider pill is handed out once more, marked undeliverable, and
/// dead-lettered by the dispatcher instead.
const WIDEST: usize = 7_800;

/// Dead-letters the pending entries (idle at least ARGV[2] ms, from ARGV[3],
/// of consumer ARGV[5] or of anyone) that were delivered ARGV[6] times or
/// more. The dead letter carries the entry's fields and the same `courier-*`
/// failure fields every dead letter has. KEYS[1] the stream, KEYS[2] the
/// dead-letter stream; ARGV[1] the group, ARGV[4] the most to look at,
/// ARGV[7] now (RFC 3339), ARGV[8] the widest entry to write here.
const DEAD_LETTER_POISON: &str = r"
local range = {KEYS[1], ARGV[1], 'IDLE', ARGV[2], ARGV[3], '+', ARGV[4]}
if ARGV[5] ~= '' then range[#range + 1] = ARGV[5] end
local pending = redis.call('XPENDING', unpack(range))
local max = tonumber(ARGV[6])
local dlq = redis.call('TYPE', KEYS[2]).ok
local skip = {
  ['courier-message-id'] = 1, ['courier-attempt'] = 1, ['courier-first-attempt-at'] = 1,
  ['courier-deliveries'] = 1, ['courier-reason'] = 1, ['courier-status'] = 1,
  ['courier-error'] = 1, ['courier-attempts'] = 1, ['courier-last-attempt-at'] = 1,
  ['courier-queue'] = 1, ['courier-response-excerpt'] = 1, ['courier-policy'] = 1,
}
local moved = 0
for _, p in ipairs(pending) do
  local id, times = p[1], tonumber(p[4])
  if times >= max then
    local entry = redis.call('XRANGE', KEYS[1], id, id)[1]
    if not entry then
      redis.call('XACK', KEYS[1], ARGV[1], id)
    elseif (dlq == 'stream' or dlq == 'none') and #entry[2] <= tonumber(ARGV[8]) then
      local fields = entry[2]
      local out, has_payload = {}, false
      local message_id, attempt, first = id, 1, ARGV[7]
      for i = 1, #fields, 2 do
        local name, value = fields[i], fields[i + 1]
        if name == 'courier-message-id' then message_id = value
        elseif name == 'courier-attempt' then attempt = math.max(tonumber(value) or 1, 1)
        elseif name == 'courier-first-attempt-at' then first = value end
        if not skip[name] then
          if name == 'payload' then has_payload = true end
          out[#out + 1] = name
          out[#out + 1] = value
        end
      end
      if not has_payload then
        table.insert(out, 1, '')
        table.insert(out, 1, 'payload')
      end
      local failure = {
        'courier-reason', 'undeliverable',
        'courier-status', '',
        'courier-error', 'handed out ' .. times .. ' times without being settled',
        'courier-attempts', tostring(attempt + times - 1),
        'courier-first-attempt-at', first,
        'courier-last-attempt-at', ARGV[7],
        'courier-queue', KEYS[1],
        'courier-message-id', message_id,
        'courier-response-excerpt', '',
        'courier-policy', '',
      }
      for _, v in ipairs(failure) do out[#out + 1] = v end
      redis.call('XADD', KEYS[2], '*', unpack(out))
      redis.call('XACK', KEYS[1], ARGV[1], id)
      dlq = 'stream'
      moved = moved + 1
    end
  end
end
return moved
";

/// Which pending entries to look at.
pub(super) struct Pending<'a> {
    /// Only entries idle this long (ms).
    pub idle_ms: u64,
    /// `-`, or `(<id>` to start after an id.
    pub start: String,
    /// Only this consumer's entries.
    pub consumer: Option<&'a str>,
    pub count: usize,
}

impl RedisSource {
    /// Dead-letters the poison pills among `pending`; returns how many.
    pub(super) async fn dead_letter_poison(
        &self,
        con: &mut ConnectionManager,
        pending: Pending<'_>,
    ) -> Result<u64, SourceError> {
        let live = self.live();
        Script::new(DEAD_LETTER_POISON)
            .key(&self.options.queue)
            .key(&live.dead_letter_queue)
            .arg(&self.options.group)
            .arg(pending.idle_ms)
            .arg(pending.start)
            .arg(pending.count)
            .arg(pending.consumer.unwrap_or(""))
            .arg(live.max_deliveries.max(1))
            .arg(rfc3339(std::time::SystemTime::now()))
            .arg(WIDEST)
            .invoke_async(con)
            .await
            .map_err(broker_error)
    }
}
