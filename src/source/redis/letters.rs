//! Browsing the dead-letter stream: list, replay, purge.

use redis::{Script, Value};

use super::entries::parse_entries;
use super::{RedisSource, broker_error};
use crate::model::DeadLetter;
use crate::source::shared::not_there;
use crate::source::{SourceError, encode_fields};

/// Moves one dead letter back to the work stream, in one step so that two
/// replays of the same letter cannot both write it. KEYS[1] the stream,
/// KEYS[2] the dead-letter stream; ARGV[1] the dead letter's id, ARGV[2] the
/// replayed message's fields.
const REPLAY: &str = r"
if redis.call('XDEL', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[1], '*', unpack(cmsgpack.unpack(ARGV[2])))
return 1
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
        let moved: i64 = Script::new(REPLAY)
            .key(&self.options.queue)
            .key(dead_letter_queue)
            .arg(&letter.id)
            .arg(encode_fields(&letter.fields_for_replay()))
            .invoke_async(&mut con)
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
