//! The dead-letter store: list, replay and purge the dead-letter stream,
//! and send to the work stream. Opened alone (`courier dlq`, `courier
//! send`), it creates nothing: no group, no stream, and the seal key only
//! when a replay needs it.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use redis::Value;
use tokio::sync::OnceCell;

use super::broker_error;
use super::connection::{Connection, Endpoint};
use super::entries::parse_entries;
use super::settle::xadd;
use courier_core::model::{DeadLetter, PAYLOAD};
use courier_core::source::shared::{Seal, not_there};
use courier_core::source::{DeadLetterStore, Depth, SourceError, SourceOptions};

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

/// The hash of a dead-letter stream's `courier dlq` job records, one field
/// per job key. Named after the stream, so on a Cluster it shares the
/// stream's hash tag when the stream's name has one.
fn jobs_key(dead_letter_queue: &str) -> String {
    format!("{dead_letter_queue}:courier-jobs")
}

/// The work stream's dead letters, on the command connection.
pub(super) struct RedisStore {
    pub(super) queue: String,
    /// The sidecar's consumer group, whose counts `depth_of` reads.
    pub(super) group: String,
    pub(super) commands: Connection,
    /// The queue's seal: the consumer's, or read (and made if missing)
    /// when an admin handle first replays.
    pub(super) seal: OnceCell<Arc<Seal>>,
}

impl RedisStore {
    /// An admin handle: one connection, nothing written.
    pub(super) async fn open(url: &str, options: SourceOptions) -> Result<Self, SourceError> {
        let endpoint = Endpoint::parse(url).map_err(SourceError::invalid)?;
        let commands =
            super::connect_to(&endpoint, url, &options, std::time::Duration::from_secs(10)).await?;
        Ok(Self {
            seal: OnceCell::new_with(options.seal.clone()),
            queue: options.queue,
            group: options.group,
            commands,
        })
    }

    /// `XRANGE dlq start end COUNT limit`, as dead letters.
    async fn range(
        &self,
        dead_letter_queue: &str,
        start: &str,
        end: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        let mut con = self.commands.clone();
        let reply: Value = redis::cmd("XRANGE")
            .arg(dead_letter_queue)
            .arg(start)
            .arg(end)
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

    async fn seal(&self) -> Result<&Seal, SourceError> {
        let seal = self
            .seal
            .get_or_try_init(|| async {
                let mut con = self.commands.clone();
                super::seal_of(&mut con, &self.queue).await.map(Arc::new)
            })
            .await?;
        Ok(seal)
    }
}

#[async_trait]
impl DeadLetterStore for RedisStore {
    async fn dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        self.range(dead_letter_queue, "-", "+", limit).await
    }

    /// `XRANGE id id`. Text that is not an entry id (`<ms>-<seq>`) names
    /// no letter, rather than an error from Redis.
    async fn dead_letter_by_id(
        &self,
        dead_letter_queue: &str,
        id: &str,
    ) -> Result<Option<Option<DeadLetter>>, SourceError> {
        let number = |part: &str| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit());
        let entry_id = match id.split_once('-') {
            Some((ms, seq)) => number(ms) && number(seq),
            None => false,
        };
        if !entry_id {
            return Ok(Some(None));
        }
        let found = self.range(dead_letter_queue, id, id, 1).await?;
        Ok(Some(found.into_iter().next()))
    }

    /// `XRANGE (after through COUNT limit`: entry ids are ordered, so a
    /// page is one command whatever the stream's length.
    async fn dead_letters_after(
        &self,
        dead_letter_queue: &str,
        after: Option<&str>,
        through: Option<&str>,
        limit: usize,
    ) -> Result<Option<Vec<DeadLetter>>, SourceError> {
        let start = after.map_or_else(|| "-".to_string(), |id| format!("({id}"));
        self.range(dead_letter_queue, &start, through.unwrap_or("+"), limit)
            .await
            .map(Some)
    }

    async fn replay(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let sealed = self.seal().await?.seal(letter.fields_for_replay());
        let mut con = self.commands.clone();
        let (moved,): (i64,) = redis::pipe()
            .atomic()
            .add_command(xadd(&self.queue, &sealed))
            .ignore()
            .cmd("EVAL")
            .arg(REMOVE_LETTER)
            .arg(2)
            .arg(&self.queue)
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

    async fn purge(&self, dead_letter_queue: &str, letter: &DeadLetter) -> Result<(), SourceError> {
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

    async fn job_records(
        &self,
        dead_letter_queue: &str,
    ) -> Result<Vec<(String, Bytes)>, SourceError> {
        let mut con = self.commands.clone();
        let records: Vec<(String, Vec<u8>)> = redis::cmd("HGETALL")
            .arg(jobs_key(dead_letter_queue))
            .query_async(&mut con)
            .await
            .map_err(broker_error)?;
        Ok(records
            .into_iter()
            .map(|(key, record)| (key, Bytes::from(record)))
            .collect())
    }

    async fn put_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
        record: Bytes,
    ) -> Result<(), SourceError> {
        let mut con = self.commands.clone();
        redis::cmd("HSET")
            .arg(jobs_key(dead_letter_queue))
            .arg(key)
            .arg(record.as_ref())
            .query_async::<()>(&mut con)
            .await
            .map_err(broker_error)
    }

    async fn remove_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
    ) -> Result<(), SourceError> {
        let mut con = self.commands.clone();
        redis::cmd("HDEL")
            .arg(jobs_key(dead_letter_queue))
            .arg(key)
            .query_async::<()>(&mut con)
            .await
            .map_err(broker_error)
    }

    /// The sidecar's reading ([`super::depth::read`]), on this connection:
    /// it reads the group's counts and joins nothing. On a Redis Cluster
    /// the three keys must share a slot, as the sidecar requires at start.
    async fn depth_of(&self, dead_letter_queue: &str) -> Result<Option<Depth>, SourceError> {
        if matches!(self.commands, Connection::Cluster(_))
            && let Some(problem) = super::cluster::slot_problem(&self.queue, dead_letter_queue)
        {
            return Err(SourceError::invalid(problem));
        }
        super::depth::read(&self.commands, &self.queue, &self.group, dead_letter_queue)
            .await
            .map(Some)
    }

    async fn send(&self, body: Bytes, headers: &[(String, String)]) -> Result<String, SourceError> {
        let mut xadd = redis::cmd("XADD");
        xadd.arg(&self.queue)
            .arg("*")
            .arg(PAYLOAD)
            .arg(body.as_ref());
        for (name, value) in headers {
            xadd.arg(name).arg(value);
        }
        let mut con = self.commands.clone();
        xadd.query_async(&mut con).await.map_err(broker_error)
    }
}
