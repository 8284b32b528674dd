//! Handing out entries: this consumer's own pending entries after a
//! restart, entries another replica left pending too long, then new ones.

use std::time::{Duration, Instant};

use super::connection::{Connection, Endpoint};
use redis::Value;

use super::entries::{as_u64, id_time, parse_entries, parse_read_reply};
use super::mover::Throttle;
use super::poison::Pending;
use super::read_connection::Node;
use super::read_connection::{ReadConnection, ReadError, TlsConfig};
use super::reply::{Batch, Oversized, Reply};
use super::{RedisSource, broker_error};
use courier_core::model::Delivery;
use courier_core::source::SourceError;

/// How long a reply to a blocking read may take beyond its wait before the
/// connection is given up.
const REPLY_SLACK: Duration = Duration::from_secs(10);
/// How often entries another replica left pending too long are looked for
/// (at most: once a visibility timeout when that is shorter). A read of new
/// entries blocks until the next look is due, so an idle queue costs Redis
/// a read and a look each this often; a stop does not wait it out
/// ([`RedisSource::interrupt_read`]).
const RECLAIM_EVERY: Duration = Duration::from_secs(5);
/// The shortest wait a blocking read is given: `BLOCK 0` would wait
/// forever.
const SHORTEST_BLOCK: Duration = Duration::from_millis(10);
/// `CLIENT UNBLOCK` tries while the read it ends is still on its way to
/// the server.
const UNBLOCK_TRIES: usize = 20;
/// MOVED and ASK redirections followed in one read, at most.
const REDIRECTS: usize = 5;

pub(super) struct Reader {
    /// For history and reclaims, whose replies the redis client reads.
    pub(super) connection: Connection,
    /// For new entries: see `read_connection.rs`.
    new_entries: NewEntries,
    /// After a restart, this consumer's own pending entries come first.
    history_done: bool,
    /// The last history entry handed out: the next history read starts
    /// after it, so entries already in flight are not handed out twice.
    history_from: String,
    last_reclaim: Instant,
    /// Failures of the poison-pill check, logged at most once an interval.
    trouble: Throttle,
    /// Failures to dead-letter entries over `--max-body`, logged at most
    /// once an interval.
    oversized_trouble: Throttle,
}

/// Where new entries are read, and the connection there while it is
/// sound.
pub(super) struct NewEntries {
    endpoint: Endpoint,
    tls: TlsConfig,
    /// Taken out for each read and put back only when its reply was read
    /// whole: a read cut short leaves none, and the next read connects.
    connection: Option<ReadConnection>,
    /// A Redis Cluster named another node with MOVED: the next connection
    /// goes there.
    moved_to: Option<(String, u16)>,
}

impl NewEntries {
    pub(super) fn new(endpoint: Endpoint, tls: courier_core::source::Tls) -> Self {
        Self {
            endpoint,
            tls: TlsConfig::new(tls),
            connection: None,
            moved_to: None,
        }
    }
}

/// The blocking read of new entries under way, for
/// [`RedisSource::interrupt_read`].
#[derive(Default)]
pub(super) struct Waiting {
    /// A stop came during this receive: its read does not block.
    stop: bool,
    /// The connection blocked in `XREADGROUP` now: its server, TLS
    /// settings and client id.
    on: Option<(Node, TlsConfig, i64)>,
}

impl Reader {
    /// How long a read of new entries may block: until the next look for
    /// entries left pending is due.
    fn block_for(&self, visibility_timeout: Duration) -> Duration {
        let next = self.last_reclaim + RECLAIM_EVERY.min(visibility_timeout);
        next.saturating_duration_since(Instant::now())
            .max(SHORTEST_BLOCK)
    }

    pub(super) fn new(connection: Connection, new_entries: NewEntries) -> Self {
        Self {
            connection,
            new_entries,
            history_done: false,
            history_from: "0".into(),
            last_reclaim: Instant::now(),
            trouble: Throttle::new(),
            oversized_trouble: Throttle::new(),
        }
    }
}

/// What one read of new entries asks for.
struct Read {
    max: usize,
    block: Duration,
}

/// A redirection in a Redis Cluster error reply.
#[derive(Debug, PartialEq, Eq)]
enum Redirect {
    Moved(String, u16),
    Ask(String, u16),
}

/// `MOVED 3999 127.0.0.1:6381`, `ASK 3999 127.0.0.1:6381`.
fn redirect(text: &str) -> Option<Redirect> {
    let mut words = text.split_whitespace();
    let kind = words.next()?;
    let _slot = words.next()?;
    let (host, port) = words.next()?.rsplit_once(':')?;
    let port = port.parse().ok()?;
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    match kind {
        "MOVED" => Some(Redirect::Moved(host, port)),
        "ASK" => Some(Redirect::Ask(host, port)),
        _ => None,
    }
}

impl RedisSource {
    pub(super) async fn read(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        let read = self.read_until_stopped(max).await;
        self.waiting().stop = false;
        read
    }

    async fn read_until_stopped(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        let mut reader = self.reader.lock().await;
        let redelivered = self.redeliveries(&mut reader, max).await?;
        if !redelivered.is_empty() {
            return Ok(redelivered);
        }
        let block = reader.block_for(self.live().visibility_timeout);
        let batch = self.read_new(&mut reader.new_entries, max, block).await?;
        if !batch.oversized.is_empty() {
            self.settle_oversized(&mut reader, &batch.oversized).await;
        }
        Ok(batch
            .entries
            .into_iter()
            .map(|(id, fields)| {
                let added = id_time(&id);
                Delivery::from_fields(&id, self.seal.open(fields), 0, id.clone(), added)
            })
            .collect())
    }

    /// Up to `max` new entries, waiting up to `block` for a first one
    /// (`XREADGROUP ... BLOCK`): the entries within `--max-body`, and the
    /// ids of those over it, whose bytes were discarded as they came. A
    /// connection failure is tried once more on a new connection (to the
    /// server that holds the stream then), and MOVED and ASK are followed.
    async fn read_new(
        &self,
        new: &mut NewEntries,
        max: usize,
        block: Duration,
    ) -> Result<Batch, SourceError> {
        let read = Read { max, block };
        let mut redirects = 0;
        let mut failures = 0;
        let mut ask: Option<(String, u16)> = None;
        loop {
            let read = match ask.take() {
                Some((host, port)) => self.read_asking(new, &host, port, &read).await,
                None => self.read_once(new, &read).await,
            };
            let text = match read {
                Ok(Reply::Batch(batch)) => return Ok(batch),
                Ok(Reply::Error(text)) => text,
                Err(ReadError::Io(error)) => {
                    failures += 1;
                    if failures < 2 {
                        continue;
                    }
                    return Err(SourceError::unavailable(format!(
                        "reading new entries: {error}"
                    )));
                }
                Err(ReadError::Unsupported(text)) => return Err(SourceError::invalid(text)),
                Err(other) => {
                    return Err(SourceError::broker(format!("reading new entries: {other}")));
                }
            };
            match redirect(&text) {
                Some(Redirect::Moved(host, port)) if redirects < REDIRECTS => {
                    redirects += 1;
                    new.connection = None;
                    new.moved_to = Some((host, port));
                }
                Some(Redirect::Ask(host, port)) if redirects < REDIRECTS => {
                    redirects += 1;
                    ask = Some((host, port));
                }
                _ => {
                    // A master made a replica by a failover: the next read
                    // asks where the stream is now.
                    if text.starts_with("READONLY") {
                        new.connection = None;
                    }
                    return Err(SourceError::broker(text));
                }
            }
        }
    }

    /// One `XREADGROUP` on the connection for new entries, connecting first
    /// when there is none.
    async fn read_once(&self, new: &mut NewEntries, read: &Read) -> Result<Reply, ReadError> {
        let mut connection = match new.connection.take() {
            Some(connection) => connection,
            None => {
                let mut commands = self.commands.clone();
                let mut node = new
                    .endpoint
                    .read_node(new.tls.tls(), &self.options.queue, &mut commands)
                    .await?;
                if let Some((host, port)) = new.moved_to.take() {
                    node = node.at(&host, port);
                }
                ReadConnection::open(&node, &new.tls).await?
            }
        };
        let on = connection
            .client_id
            .map(|id| (connection.node.clone(), new.tls.clone(), id));
        let block = self.begin_wait(on, read.block);
        let reply = self
            .read_on(&mut connection, &self.xreadgroup(read.max, block), false)
            .await;
        self.waiting().on = None;
        let reply = reply?;
        new.connection = Some(connection);
        Ok(reply)
    }

    /// `XREADGROUP` of up to `max` new entries, blocking up to `block`.
    fn xreadgroup(&self, max: usize, block: Option<Duration>) -> (Vec<u8>, Duration) {
        let mut command = redis::cmd("XREADGROUP");
        command
            .arg("GROUP")
            .arg(&self.options.group)
            .arg(&self.options.consumer)
            .arg("COUNT")
            .arg(max);
        if let Some(block) = block {
            command.arg("BLOCK").arg(block.as_millis() as u64);
        }
        command.arg("STREAMS").arg(&self.options.queue).arg(">");
        (command.get_packed_command(), block.unwrap_or_default())
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The wait the next read may block for: none once a stop came, else
    /// `block`, with the connection noted (`on`) for
    /// [`RedisSource::interrupt_read`].
    fn begin_wait(&self, on: Option<(Node, TlsConfig, i64)>, block: Duration) -> Option<Duration> {
        let mut waiting = self.waiting();
        if waiting.stop {
            return None;
        }
        waiting.on = on;
        Some(block)
    }

    /// Ends the read of new entries blocked now (`CLIENT UNBLOCK`, from a
    /// connection of its own), and keeps the rest of this receive from
    /// blocking. Entries Redis handed out before are returned by that read
    /// as usual. Where the server refuses, the read ends when its wait
    /// does, within [`RECLAIM_EVERY`].
    pub(super) async fn interrupt_read(&self) {
        for _ in 0..UNBLOCK_TRIES {
            let on = {
                let mut waiting = self.waiting();
                waiting.stop = true;
                waiting.on.clone()
            };
            let Some((node, tls, id)) = on else {
                return;
            };
            match ReadConnection::unblock(&node, &tls, id).await {
                Ok(true) => return,
                // The read has not reached the server yet, or has just
                // been answered: look again.
                Ok(false) => tokio::time::sleep(SHORTEST_BLOCK).await,
                Err(error) => {
                    tracing::debug!(%error, queue = %self.options.queue, "could not end the blocking read early; it ends when its wait does");
                    return;
                }
            }
        }
    }

    /// `ASKING` and `XREADGROUP` on a connection of their own to the node a
    /// slot is being migrated to, which is closed after.
    async fn read_asking(
        &self,
        new: &mut NewEntries,
        host: &str,
        port: u16,
        read: &Read,
    ) -> Result<Reply, ReadError> {
        let mut commands = self.commands.clone();
        let node = new
            .endpoint
            .read_node(new.tls.tls(), &self.options.queue, &mut commands)
            .await?
            .at(host, port);
        let mut connection = ReadConnection::open(&node, &new.tls).await?;
        let block = self.begin_wait(None, read.block);
        self.read_on(&mut connection, &self.xreadgroup(read.max, block), true)
            .await
    }

    async fn read_on(
        &self,
        connection: &mut ReadConnection,
        (packed, block): &(Vec<u8>, Duration),
        asking: bool,
    ) -> Result<Reply, ReadError> {
        let limit = *block + REPLY_SLACK;
        match tokio::time::timeout(
            limit,
            connection.read_group(packed, asking, self.options.max_body),
        )
        .await
        {
            Ok(reply) => reply,
            Err(_) => Err(ReadError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no whole reply to XREADGROUP within {limit:?}"),
            ))),
        }
    }

    /// Dead-letters the new entries found over `--max-body`, inside Redis.
    /// A failure is logged: the entries stay pending and are reclaimed
    /// later, when the poison-pill check dead-letters them.
    async fn settle_oversized(&self, reader: &mut Reader, oversized: &[Oversized]) {
        let ids: Vec<&str> = oversized.iter().map(|o| o.id.as_str()).collect();
        match self.dead_letter_oversized(&ids).await {
            Ok(n) if n as usize == ids.len() => tracing::warn!(
                queue = %self.options.queue,
                dead_letters = n,
                ids = ?ids,
                "dead-lettered entries over --max-body without loading them (undeliverable)"
            ),
            Ok(n) => {
                if let Some(times) = reader.oversized_trouble.due() {
                    tracing::warn!(
                        queue = %self.options.queue,
                        dead_letters = n,
                        over = ?oversized,
                        times,
                        "entries over --max-body could not all be dead-lettered (is the dead-letter key a stream?); they stay pending until reclaimed"
                    );
                }
            }
            Err(error) => {
                if let Some(times) = reader.oversized_trouble.due() {
                    tracing::warn!(%error, queue = %self.options.queue, times, "dead-lettering entries over --max-body failed; they stay pending until reclaimed");
                }
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
        } else if reader.last_reclaim.elapsed() >= RECLAIM_EVERY.min(live.visibility_timeout) {
            reader.last_reclaim = Instant::now();
            let idle_ms = live.visibility_timeout.as_millis() as u64;
            let left = self
                .check_poison(reader, idle_ms, "-".into(), None, max)
                .await;
            // The check looked at the same entries a claim would take:
            // none left, and an idle queue costs Redis one command here.
            if left == Some(0) {
                return Ok(Vec::new());
            }
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
                let added = id_time(&id);
                let mut delivery = Delivery::from_fields(
                    &id,
                    self.seal.open(fields),
                    count.saturating_sub(1),
                    id.clone(),
                    added,
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
    ) -> Option<u64> {
        let pending = Pending {
            idle_ms,
            start,
            consumer,
            count,
        };
        let mut con = self.commands.clone();
        match self.dead_letter_pending(&mut con, pending).await {
            Ok((0, left)) => Some(left),
            Ok((n, left)) => {
                tracing::warn!(
                    queue = %self.options.queue,
                    dead_letters = n,
                    "dead-lettered pending messages handed out too many times without being settled, or over --max-body (undeliverable)"
                );
                Some(left)
            }
            Err(error) => {
                if let Some(times) = reader.trouble.due() {
                    tracing::warn!(%error, queue = %self.options.queue, times, "checking pending entries for poison pills failed; will try again");
                }
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Redirect, redirect};

    #[test]
    fn cluster_redirections_name_the_node() {
        assert_eq!(
            redirect("MOVED 3999 127.0.0.1:6381"),
            Some(Redirect::Moved("127.0.0.1".into(), 6381))
        );
        assert_eq!(
            redirect("ASK 3999 [::1]:7000"),
            Some(Redirect::Ask("::1".into(), 7000))
        );
        assert_eq!(redirect("NOGROUP No such key 'q' or consumer group"), None);
        assert_eq!(
            redirect("READONLY You can't write against a read only replica."),
            None
        );
    }
}
