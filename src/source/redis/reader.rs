//! Handing out entries: this consumer's own pending entries after a
//! restart, entries another replica left pending too long, then new ones.

use std::time::{Duration, Instant};

use super::connection::Connection;
use redis::Value;

use super::arrivals::Arrivals;
use super::entries::{as_u64, parse_entries, parse_read_reply};
use super::mover::Throttle;
use super::poison::Pending;
use super::{RedisSource, broker_error};
use crate::model::Delivery;
use crate::source::SourceError;
use crate::source::shared::RECEIVE_WAIT;

/// The longest pause between two reads of an empty queue: the most a new
/// message waits to be picked up by an idle reader.
const POLL_MAX: Duration = Duration::from_millis(20);

pub(super) struct Reader {
    pub(super) connection: Connection,
    /// Tells of an entry's arrival, so an empty queue is not polled.
    arrivals: Arrivals,
    /// After a restart, this consumer's own pending entries come first.
    history_done: bool,
    /// The last history entry handed out: the next history read starts
    /// after it, so entries already in flight are not handed out twice.
    history_from: String,
    last_reclaim: Instant,
    /// Failures of the poison-pill check, logged at most once an interval.
    trouble: Throttle,
}

impl Reader {
    pub(super) fn new(connection: Connection, arrivals: Arrivals) -> Self {
        Self {
            connection,
            arrivals,
            history_done: false,
            history_from: "0".into(),
            last_reclaim: Instant::now(),
            trouble: Throttle::new(),
        }
    }
}

impl RedisSource {
    pub(super) async fn read(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        let mut reader = self.reader.lock().await;
        let redelivered = self.redeliveries(&mut reader, max).await?;
        if !redelivered.is_empty() {
            return Ok(redelivered);
        }
        // A script reads, so that an entry over --max-body is dead-lettered
        // inside Redis instead of loaded; a script cannot block, so an
        // empty queue is asked again when an entry arrives (`arrivals.rs`),
        // or, where nothing tells of arrivals, after a pause that grows to
        // POLL_MAX.
        let deadline = Instant::now() + RECEIVE_WAIT;
        let mut pause = Duration::from_millis(1);
        loop {
            let mut con = reader.connection.clone();
            let entries = self.read_bounded(&mut con, max).await?;
            let now = Instant::now();
            if !entries.is_empty() || now >= deadline {
                return Ok(entries
                    .into_iter()
                    .map(|(id, fields)| {
                        Delivery::from_fields(&id, self.seal.open(fields), 0, id.clone())
                    })
                    .collect());
            }
            if !reader.arrivals.wait(deadline).await {
                tokio::time::sleep(pause.min(deadline - now)).await;
                pause = (pause * 2).min(POLL_MAX);
            }
        }
    }

    /// Delivery counts of entries that were handed out before (history or
    /// reclaimed), so a crash mid-delivery still counts as an attempt.
    async fn delivery_counts(&self, ids: &[String]) -> Result<Vec<u32>, SourceError> {
        let mut pipe = redis::pipe();
        for id in ids {
            pipe.cmd("XPENDING")
                .arg(&self.options.queue)
                .arg(&self.options.group)
                .arg(id)
                .arg(id)
                .arg(1);
        }
        let mut con = self.commands.clone();
        let replies: Vec<Value> = pipe.query_async(&mut con).await.map_err(broker_error)?;
        Ok(replies
            .iter()
            .map(|reply| match reply {
                Value::Array(rows) => match rows.first() {
                    Some(Value::Array(row)) => row.get(3).and_then(as_u64).unwrap_or(1) as u32,
                    _ => 1,
                },
                _ => 1,
            })
            .collect())
    }

    /// Entries this consumer was given before and never settled (a restart
    /// of the same pod), or that another replica left pending too long.
    async fn redeliveries(
        &self,
        reader: &mut Reader,
        max: usize,
    ) -> Result<Vec<Delivery>, SourceError> {
        let live = self.live();
        let entries = if !reader.history_done {
            let start = match reader.history_from.as_str() {
                "0" => "-".to_string(),
                from => format!("({from}"),
            };
            let consumer = self.options.consumer.as_str();
            self.check_poison(reader, 0, start, Some(consumer), max)
                .await;
            let reply: Value = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(&self.options.group)
                .arg(&self.options.consumer)
                .arg("COUNT")
                .arg(max)
                .arg("STREAMS")
                .arg(&self.options.queue)
                .arg(&reader.history_from)
                .query_async(&mut reader.connection)
                .await
                .map_err(broker_error)?;
            let entries = parse_read_reply(reply);
            if entries.len() < max {
                reader.history_done = true;
            }
            if let Some((id, _)) = entries.last() {
                reader.history_from = id.clone();
            }
            entries
        } else if reader.last_reclaim.elapsed()
            >= live.visibility_timeout.min(Duration::from_secs(5))
        {
            reader.last_reclaim = Instant::now();
            let idle_ms = live.visibility_timeout.as_millis() as u64;
            self.check_poison(reader, idle_ms, "-".into(), None, max)
                .await;
            let reply: Value = redis::cmd("XAUTOCLAIM")
                .arg(&self.options.queue)
                .arg(&self.options.group)
                .arg(&self.options.consumer)
                .arg(live.visibility_timeout.as_millis() as u64)
                .arg("0-0")
                .arg("COUNT")
                .arg(max)
                .query_async(&mut reader.connection)
                .await
                .map_err(broker_error)?;
            match reply {
                Value::Array(parts) => parts
                    .into_iter()
                    .nth(1)
                    .map(parse_entries)
                    .unwrap_or_default(),
                _ => Vec::new(),
            }
        } else {
            return Ok(Vec::new());
        };
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<String> = entries.iter().map(|(id, _)| id.clone()).collect();
        let counts = self.delivery_counts(&ids).await?;
        Ok(entries
            .into_iter()
            .zip(counts)
            .map(|((id, fields), count)| {
                let mut delivery = Delivery::from_fields(
                    &id,
                    self.seal.open(fields),
                    count.saturating_sub(1),
                    id.clone(),
                );
                // A pill the script could not dead-letter itself (the
                // dead-letter key holds another type): the dispatcher
                // dead-letters it without offering it to the app.
                if count > live.max_deliveries.max(1) {
                    delivery.problem = Some(format!(
                        "handed out {} times without being settled",
                        count - 1
                    ));
                }
                delivery
            })
            .collect())
    }

    /// Dead-letters the poison pills among the entries about to be handed
    /// out again. A failure is logged and the entries are read anyway: the
    /// delivery counts catch a pill on the way out.
    async fn check_poison(
        &self,
        reader: &mut Reader,
        idle_ms: u64,
        start: String,
        consumer: Option<&str>,
        count: usize,
    ) {
        let pending = Pending {
            idle_ms,
            start,
            consumer,
            count,
        };
        let mut con = self.commands.clone();
        match self.dead_letter_pending(&mut con, pending).await {
            Ok(0) => {}
            Ok(n) => tracing::warn!(
                queue = %self.options.queue,
                dead_letters = n,
                "dead-lettered pending messages handed out too many times without being settled, or over --max-body (undeliverable)"
            ),
            Err(error) => {
                if let Some(times) = reader.trouble.due() {
                    tracing::warn!(%error, queue = %self.options.queue, times, "checking pending entries for poison pills failed; will try again");
                }
            }
        }
    }
}
