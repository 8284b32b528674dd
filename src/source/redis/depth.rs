//! Depth: ready and pending from the consumer group, the retry backlog,
//! and the dead-letter stream's length and oldest age.

use std::time::SystemTime;

use redis::Value;

use super::entries::{as_bytes, as_u64, id_time, parse_entries};
use super::{RedisSource, broker_error};
use crate::model::{DeadLetter, dead_letter_age};
use crate::source::{Depth, SourceError};

impl RedisSource {
    pub(super) async fn read_depth(&self) -> Result<Depth, SourceError> {
        let mut con = self.commands.clone();
        let dlq = &self.live().dead_letter_queue;
        let (dlq_len, backlog, oldest, groups): (u64, u64, Value, Value) = redis::pipe()
            .cmd("XLEN")
            .arg(dlq)
            .cmd("ZCARD")
            .arg(&self.retry_key)
            .cmd("XRANGE")
            .arg(dlq)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1)
            .cmd("XINFO")
            .arg("GROUPS")
            .arg(&self.options.queue)
            .query_async(&mut con)
            .await
            .map_err(broker_error)?;
        // The age is the time since it was dead-lettered (its
        // courier-last-attempt-at), as on every broker; the stream id's
        // time stands in for a letter that does not say.
        let oldest_age = parse_entries(oldest)
            .into_iter()
            .next()
            .and_then(|(id, fields)| {
                let written = id_time(&id);
                let letter = DeadLetter::from_fields(id, fields);
                let at = letter.dead_lettered_at().or(written)?;
                Some(dead_letter_age(at, SystemTime::now()))
            });
        let (ready, pending) = self.group_counts(groups);
        Ok(Depth {
            ready,
            pending,
            retry_backlog: backlog,
            dead_letters: dlq_len,
            oldest_dead_letter_age: oldest_age,
        })
    }

    /// `lag` and `pending` of this consumer group in an `XINFO GROUPS`
    /// reply (flat pairs in RESP2, a map in RESP3).
    fn group_counts(&self, groups: Value) -> (u64, u64) {
        let (mut ready, mut pending) = (0, 0);
        let Value::Array(groups) = groups else {
            return (ready, pending);
        };
        for group in groups {
            let pairs: Vec<(String, Value)> = match group {
                Value::Array(flat) => flat
                    .chunks(2)
                    .filter_map(|p| {
                        Some((
                            String::from_utf8_lossy(&as_bytes(p.first()?)?).into_owned(),
                            p.get(1)?.clone(),
                        ))
                    })
                    .collect(),
                Value::Map(map) => map
                    .into_iter()
                    .filter_map(|(k, v)| {
                        Some((String::from_utf8_lossy(&as_bytes(&k)?).into_owned(), v))
                    })
                    .collect(),
                _ => continue,
            };
            let get = |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| k == name)
                    .and_then(|(_, v)| as_u64(v))
            };
            if pairs.iter().any(|(k, v)| {
                k == "name" && as_bytes(v).as_deref() == Some(self.options.group.as_bytes())
            }) {
                pending = get("pending").unwrap_or(0);
                ready = get("lag").unwrap_or(0);
            }
        }
        (ready, pending)
    }
}
