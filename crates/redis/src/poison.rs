//! Dead letters written inside Redis, before courier loads the entry:
//!
//! - a poison pill, an entry handed out `max_deliveries` times without ever
//!   being settled (it crashes or hangs whoever takes it), found by Redis's
//!   own delivery counter;
//! - an entry larger than `--max-body`, so a 300 MB entry, or many large
//!   ones in one read, never reach courier's memory.
//!
//! Both are dead-lettered as `undeliverable`, with the entry's fields and
//! the `courier-*` failure fields every dead letter has.

use std::sync::LazyLock;

use super::connection::Connection;
use redis::Script;

use super::{RedisSource, broker_error};
use courier_core::model::rfc3339;
use courier_core::source::SourceError;

/// The widest entry (field names plus values) a script writes with its
/// fields: a Lua script cannot pass more than about 8,000 values to one
/// command. A wider one is dead-lettered with its body only, and says so.
const WIDEST: usize = 7_800;

/// What the scripts below share. `dead_letter` writes entry `id` of
/// KEYS[1] (its `fields`) to the dead-letter stream KEYS[2] and acks it;
/// `too_large` says why an entry is over the byte budget, or nil;
/// `writable` whether the dead-letter key can take an `XADD`; `sealed`
/// whether an entry's `courier-*` state carries courier's seal by one of
/// the accepted keys (`Seal::script_keys`: for each, its id's length in
/// one byte, the id, and the HMAC's 64-byte inner and outer pads, from
/// which the seal is recomputed): only then are its
/// message id, attempt and first-attempt time courier's.
const SHARED: &str = r"
local skip = {
  ['courier-message-id'] = 1, ['courier-attempt'] = 1, ['courier-first-attempt-at'] = 1,
  ['courier-enqueued-at'] = 1, ['courier-deliveries'] = 1, ['courier-reason'] = 1,
  ['courier-status'] = 1, ['courier-error'] = 1, ['courier-attempts'] = 1,
  ['courier-last-attempt-at'] = 1, ['courier-queue'] = 1, ['courier-response-excerpt'] = 1,
  ['courier-policy'] = 1, ['courier-seal'] = 1,
}
local state = {
  'courier-message-id', 'courier-attempt', 'courier-first-attempt-at', 'courier-retry-at',
  'courier-deliveries', 'courier-replays', 'courier-subject', 'courier-enqueued-at',
  'courier-replay-count', 'courier-replayed-from', 'courier-history',
  'courier-edited-from-digest',
}
local function unhex(h)
  return (h:gsub('..', function(c) return string.char(tonumber(c, 16)) end))
end
local function sealed(fields, keys)
  local first = {}
  for i = 1, #fields, 2 do
    if first[fields[i]] == nil then first[fields[i]] = fields[i + 1] end
  end
  local seal = first['courier-seal']
  if seal == nil then return false end
  local id, tag = '', seal
  local colon = string.find(seal, ':', 1, true)
  if colon then id, tag = string.sub(seal, 1, colon - 1), string.sub(seal, colon + 1) end
  local covered = {}
  for _, name in ipairs(state) do
    local v = first[name]
    if v ~= nil then covered[#covered + 1] = name .. '=' .. #v .. ':' .. v .. ';' end
  end
  local data, at = table.concat(covered), 1
  while at <= #keys do
    local n = string.byte(keys, at)
    local ipad = string.sub(keys, at + 1 + n, at + n + 64)
    local opad = string.sub(keys, at + n + 65, at + n + 128)
    if string.sub(keys, at + 1, at + n) == id
      and redis.sha1hex(opad .. unhex(redis.sha1hex(ipad .. data))) == tag then
      return true
    end
    at = at + n + 129
  end
  return false
end
local function writable(key)
  local t = redis.call('TYPE', key).ok
  return t == 'stream' or t == 'none'
end
local function too_large(fields, max)
  local body, rest = 0, 0
  for i = 1, #fields, 2 do
    if fields[i] == 'payload' then body = body + #fields[i + 1]
    else rest = rest + #fields[i] + #fields[i + 1] end
  end
  if body > max then return 'the body is ' .. body .. ' bytes, over --max-body ' .. max end
  if rest > max then return 'its fields besides the body are ' .. rest .. ' bytes, over --max-body ' .. max end
  return nil
end
local function dead_letter(group, id, fields, err, extra, now, widest, keys)
  local out, has_payload = {}, false
  local message_id, attempt, first = id, 1, now
  local trusted = sealed(fields, keys)
  local keep = #fields <= widest
  if not keep then
    err = err .. ' (its ' .. (#fields / 2) .. ' fields were too many to keep; the body is kept)'
  end
  for i = 1, #fields, 2 do
    local name, value = fields[i], fields[i + 1]
    local courier = string.lower(string.sub(name, 1, 8)) == 'courier-'
    if not trusted then
    elseif name == 'courier-message-id' then message_id = value
    elseif name == 'courier-attempt' then attempt = math.max(tonumber(value) or 1, 1)
    elseif name == 'courier-first-attempt-at' then first = value end
    if not skip[name] and (trusted or not courier) and (keep or name == 'payload') then
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
    'courier-error', err,
    'courier-attempts', tostring(attempt + extra),
    'courier-first-attempt-at', first,
    'courier-last-attempt-at', now,
    'courier-queue', KEYS[1],
    'courier-message-id', message_id,
    'courier-response-excerpt', '',
    'courier-policy', '',
  }
  for _, v in ipairs(failure) do out[#out + 1] = v end
  redis.call('XADD', KEYS[2], '*', unpack(out))
  redis.call('XACK', KEYS[1], group, id)
end
";

/// Looks at pending entries about to be handed out again (idle at least
/// ARGV[2] ms, from ARGV[3], of consumer ARGV[5] or of anyone, at most
/// ARGV[4]) and dead-letters those delivered ARGV[6] times or more, and
/// those over ARGV[9] bytes. KEYS[1] the stream, KEYS[2] the dead-letter
/// stream; ARGV[1] the group, ARGV[7] now (RFC 3339), ARGV[8] the widest
/// entry to keep whole, ARGV[10] the seal's accepted keys.
/// Returns how many it dead-lettered, and how many of those it looked at
/// are left to hand out again: none, and a reclaim has nothing to claim.
const PENDING: &str = r"
local range = {KEYS[1], ARGV[1], 'IDLE', ARGV[2], ARGV[3], '+', ARGV[4]}
if ARGV[5] ~= '' then range[#range + 1] = ARGV[5] end
local pending = redis.call('XPENDING', unpack(range))
if #pending == 0 or not writable(KEYS[2]) then return {0, #pending} end
local max, budget, widest = tonumber(ARGV[6]), tonumber(ARGV[9]), tonumber(ARGV[8])
local moved, left = 0, 0
for _, p in ipairs(pending) do
  local id, times = p[1], tonumber(p[4])
  local entry = redis.call('XRANGE', KEYS[1], id, id)[1]
  if not entry then
    redis.call('XACK', KEYS[1], ARGV[1], id)
  else
    local err = nil
    if times >= max then
      err = 'handed out ' .. times .. ' times without being settled'
    else
      err = too_large(entry[2], budget)
    end
    if err then
      dead_letter(ARGV[1], id, entry[2], err, times - 1, ARGV[7], widest, ARGV[10])
      moved = moved + 1
    else
      left = left + 1
    end
  end
end
return {moved, left}
";

/// Dead-letters the new entries ARGV[6..] that the reader found over
/// ARGV[2] bytes and discarded on the way in (`reply.rs`): each is read
/// again here, inside Redis, and written to the dead-letter stream whole
/// with its `XACK`, as an entry over the limit always was. KEYS[1] the
/// stream, KEYS[2] the dead-letter stream; ARGV[1] the group, ARGV[3] now
/// (RFC 3339), ARGV[4] the widest entry to keep whole, ARGV[5] the seal's
/// accepted keys. An entry deleted since is acked. A dead-letter
/// key of another type writes nothing: the entries stay pending, and are
/// handed out again when reclaimed. Returns how many it dead-lettered.
const OVERSIZED: &str = r"
if not writable(KEYS[2]) then return 0 end
local budget, widest = tonumber(ARGV[2]), tonumber(ARGV[4])
local moved = 0
for i = 6, #ARGV do
  local id = ARGV[i]
  local entry = redis.call('XRANGE', KEYS[1], id, id)[1]
  if not entry then
    redis.call('XACK', KEYS[1], ARGV[1], id)
  else
    local err = too_large(entry[2], budget)
    if err then
      dead_letter(ARGV[1], id, entry[2], err, 0, ARGV[3], widest, ARGV[5])
      moved = moved + 1
    end
  end
end
return moved
";

static PENDING_SCRIPT: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{SHARED}\n{PENDING}")));
static OVERSIZED_SCRIPT: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{SHARED}\n{OVERSIZED}")));

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
    /// Dead-letters the poison pills and oversized entries among `pending`;
    /// returns how many, and how many of those looked at are left pending.
    pub(super) async fn dead_letter_pending(
        &self,
        con: &mut Connection,
        pending: Pending<'_>,
    ) -> Result<(u64, u64), SourceError> {
        let live = self.live();
        let keys = self.seal.script_keys();
        PENDING_SCRIPT
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
            .arg(self.options.max_body)
            .arg(&keys)
            .invoke_async(con)
            .await
            .map_err(broker_error)
            .inspect(|(n, _)| self.count_dead_lettered(*n))
    }

    fn count_dead_lettered(&self, n: u64) {
        self.dead_lettered_inside
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Dead-letters new entries the reader found over `--max-body`
    /// (`ids`), inside Redis; returns how many.
    pub(super) async fn dead_letter_oversized(&self, ids: &[&str]) -> Result<u64, SourceError> {
        let live = self.live();
        let keys = self.seal.script_keys();
        let mut invocation = OVERSIZED_SCRIPT.prepare_invoke();
        invocation
            .key(&self.options.queue)
            .key(&live.dead_letter_queue)
            .arg(&self.options.group)
            .arg(self.options.max_body)
            .arg(rfc3339(std::time::SystemTime::now()))
            .arg(WIDEST)
            .arg(&keys);
        for id in ids {
            invocation.arg(*id);
        }
        let mut con = self.commands.clone();
        invocation
            .invoke_async(&mut con)
            .await
            .map_err(broker_error)
            .inspect(|n| self.count_dead_lettered(*n))
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use courier_core::source::shared::{Seal, replace};

    /// Against the Redis on loopback: the scripts' `sealed` accepts the seal
    /// courier computes in Rust, by the broker-kept key or by any accepted
    /// key of a keys file, and refuses a forged state, no seal, or a key
    /// that is no longer accepted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_scripts_check_the_seal_courier_writes() {
        let client = redis::Client::open("redis://127.0.0.1:6379/").unwrap();
        let mut con = client
            .get_multiplexed_async_connection()
            .await
            .expect("Redis on 127.0.0.1:6379");
        let check = Script::new(&format!(
            "{SHARED}\nlocal f = {{}}\nfor i = 2, #ARGV do f[#f + 1] = ARGV[i] end\nreturn sealed(f, ARGV[1]) and 1 or 0"
        ));
        let fields = vec![
            (Bytes::from("payload"), Bytes::from_static(&[0, 255])),
            (Bytes::from("courier-message-id"), Bytes::from("17-0")),
            (Bytes::from("courier-attempt"), Bytes::from("3")),
            (
                Bytes::from("courier-first-attempt-at"),
                Bytes::from("2026-01-01T00:00:00.000Z"),
            ),
            (Bytes::from("courier-replays"), Bytes::from("1")),
            (
                Bytes::from("courier-enqueued-at"),
                Bytes::from("2025-12-31T23:59:59.000Z"),
            ),
            (Bytes::from("courier-replay-count"), Bytes::from("2")),
            (Bytes::from("courier-replayed-from"), Bytes::from("1-0")),
            (
                Bytes::from("courier-history"),
                Bytes::from(
                    r#"[{"id":"1-0","reason":"permanent-status","status":400,"attempts":1,"at":"t"}]"#,
                ),
            ),
            (
                Bytes::from("courier-edited-from-digest"),
                Bytes::from("sha256:ab"),
            ),
        ];
        let now = std::time::SystemTime::now();
        let hour = std::time::Duration::from_secs(3600);
        let line = |id: &str, ago: u32, secret: &str| {
            format!("{id} {} {secret}\n", rfc3339(now - hour * ago))
        };
        let (old, new) = ("0f".repeat(32), "e1".repeat(20));
        let by_old = Seal::parse_keys(&line("old", 48, &old), hour, now).unwrap();
        let rotating = format!("{}{}", line("old", 48, &old), line("new-1", 1, &new));
        let within = Seal::parse_keys(&rotating, 2 * hour, now).unwrap();
        let after = Seal::parse_keys(&rotating, hour / 2, now).unwrap();
        let broker_kept = Seal::new(Seal::new_secret().as_bytes()).unwrap();
        let old_copy = by_old.seal(fields.clone());
        let cases = [
            (&broker_kept, broker_kept.seal(fields.clone()), 1),
            (
                &broker_kept,
                replace(
                    broker_kept.seal(fields.clone()),
                    "courier-attempt",
                    "99".into(),
                ),
                0,
            ),
            (
                &broker_kept,
                replace(
                    broker_kept.seal(fields.clone()),
                    "courier-history",
                    "[]".into(),
                ),
                0,
            ),
            (
                &broker_kept,
                replace(
                    broker_kept.seal(fields.clone()),
                    "courier-edited-from-digest",
                    "sha256:cd".into(),
                ),
                0,
            ),
            (&broker_kept, fields.clone(), 0),
            (&within, within.seal(fields.clone()), 1),
            (&within, old_copy.clone(), 1),
            (&after, old_copy.clone(), 0),
            (&within, broker_kept.seal(fields.clone()), 0),
        ];
        for (n, (seal, fields, want)) in cases.into_iter().enumerate() {
            assert_eq!(seal.is_sealed(&fields), want == 1, "case {n} in Rust");
            let mut invocation = check.prepare_invoke();
            invocation.arg(seal.script_keys());
            for (name, value) in fields.iter() {
                invocation.arg(name.as_ref()).arg(value.as_ref());
            }
            let got: i64 = invocation.invoke_async(&mut con).await.unwrap();
            assert_eq!(got, want, "case {n} in the script: {fields:?}");
        }
    }

    /// The scripts' `state` list is the seal's `STATE_FIELDS`, in its
    /// order: a script that covered other fields would take every copy
    /// courier sealed with one of them for a producer's message.
    #[test]
    fn the_scripts_seal_covers_the_state_fields() {
        let list = SHARED
            .split("local state = {")
            .nth(1)
            .and_then(|rest| rest.split('}').next())
            .expect("the state list in SHARED");
        let names: Vec<&str> = list
            .split(',')
            .map(|name| name.trim().trim_matches('\''))
            .filter(|name| !name.is_empty())
            .collect();
        assert_eq!(names, courier_core::source::seal::STATE_FIELDS);
    }
}
