//! Browsing the dead-letter stream: list, replay, purge.

use redis::Value;

use super::entries::parse_entries;
use super::settle::xadd;
use super::{RedisSource, broker_error};
use crate::model::DeadLetter;
use crate::source::SourceError;
use crate::source::shared::not_there;

/// Runs right after the `XADD` that writes a replayed letter back to the
/// work stream, in the same MULTI, and removes the letter. The `XADD` is a
/// plain command so a letter of any width replays (a script cannot pass
/// more than about 8,000 values to one command). If the letter is no longer
/// there (a second replay of it raced this one), the copy just written,
/// the newest entry of the stream, is taken back, so two replays cannot
/// both deliver it. If the `XADD` failed, the letter stays. KEYS[1] the
/// stream, KEYS[2] the dead-letter stream; ARGV[1] the letter's id.
const REMOVE_LETTER: &str = r"
local t = redis.call('TYPE', KEYS[1]).ok
if t ~= 'stream' then
  return redis.error_reply('WRONGTYPE ' .. KEYS[1] .. ' holds a ' .. t .. ', not the work stream: nothing was replayed')
end
if redis.call('XDEL', KEYS[2], ARGV[1]) == 1 then return 1 end
local newest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if newest[1] then redis.call('XDEL', KEYS[1], newest[1][1]) end
return 0
";

impl RedisSource {
    pub(super) async fn list_dead_letters(
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

    pub(super) async fn replay_letter(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let mut con = self.commands.clone();
        let (moved,): (i64,) = redis::pipe()
            .atomic()
            .add_command(xadd(
                &self.options.queue,
                &self.seal.seal(letter.fields_for_replay()),
            ))
            .ignore()
            .cmd("EVAL")
            .arg(REMOVE_LETTER)
            .arg(2)
            .arg(&self.options.queue)
            .arg(dead_letter_queue)
            .arg(&letter.id)
            .query_async(&mut con)
            .await
            .map_err(broker_error)?;
        if moved == 0 {
            return Err(not_there(dead_letter_queue, &letter.id));
        }
        Ok(())
    }

    pub(super) async fn purge_letter(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
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
}
