//! Where courier talks to Redis, and the one place its connections are
//! built: a single node (`redis://`), a Redis Cluster (`redis+cluster://`)
//! or the master a set of Sentinels names (`redis+sentinel://`).
//!
//! Every command goes through a [`Connection`]. On a cluster it goes to the
//! node that owns its key's hash slot: the client follows MOVED and ASK and
//! refreshes its slot map when a node fails and a replica takes over. A
//! script or a MULTI goes by its first key, so the keys of one settlement
//! share the queue's slot (`cluster.rs` checks the hash tags). Through
//! Sentinel it goes to the master the Sentinels name: when that master is
//! lost (the connection fails, or it answers READONLY because it was made a
//! replica), the Sentinels are asked again and the new master is used from
//! then on; the failed command's error goes back to its caller, who tries
//! again as after any broker error.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::io::tcp::TcpSettings;
use redis::{
    AsyncConnectionConfig, Cmd, ConnectionInfo, IntoConnectionInfo, Pipeline, RedisError,
    RedisFuture, RedisResult, Value,
};

use super::read_connection::{Node, ReadError};
use super::tls;
use courier_core::source::{Tls, redact, redact_error};

/// How long connecting to one node may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How a cluster command is retried inside redis-rs before courier sees the
/// error. The crate's defaults (16 retries, each wait drawn from 1.28 s up
/// to a doubling bound) kept one command waiting 30 s and more across a
/// master's failover, long after the replica had taken over: one in six
/// runs of `redis_cluster::a_master_killed_mid_drain_loses_nothing`, and
/// past its 90 s limit under CI's load. Here a command gives up within
/// about 5 s and courier's own loop, which backs off to at most 5 s, tries
/// again on the refreshed slot map.
const CLUSTER_RETRIES: u32 = 6;
const CLUSTER_RETRY_MIN_WAIT_MS: u64 = 100;
const CLUSTER_RETRY_MAX_WAIT_MS: u64 = 1_000;
/// The port of a Sentinel when the URL gives none.
const SENTINEL_PORT: u16 = 26379;

/// The URL forms, for help texts and errors.
pub(super) const URL_FORMS: &str = "redis://host:port/db, redis+cluster://host:port[,host:port], redis+sentinel://host:port[,host:port]/MASTER_NAME/DB";

/// Where a `--source` URL points.
#[derive(Debug, Clone)]
pub(super) enum Endpoint {
    /// One server: `redis://host:port/db`.
    Node(Box<ConnectionInfo>),
    /// Any reachable nodes of a Redis Cluster; the client learns the rest.
    Cluster(Vec<ConnectionInfo>),
    /// The Sentinels to ask for the master named `master_name`.
    Sentinel(Arc<Sentinels>),
}

/// The Sentinels of one master, and how to reach whichever server they
/// name.
#[derive(Debug)]
pub(super) struct Sentinels {
    sentinels: Vec<ConnectionInfo>,
    master_name: String,
    /// `redis` or `rediss`: the scheme the master is reached with.
    scheme: &'static str,
    /// `user:password@` or nothing; the master's (and the Sentinels')
    /// credentials.
    userinfo: String,
    db: i64,
}

impl Endpoint {
    /// Reads a `--source` URL; the error says what to write instead and
    /// never holds the password.
    pub(super) fn parse(url: &str) -> Result<Self, String> {
        let shown = redact(url);
        // A malformed URL may put the password where a host goes, and the
        // messages quote the part they could not read.
        let wrong =
            |what: String| format!("{shown:?}: {}; use {URL_FORMS}", redact_error(url, what));
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| wrong("no \"://\" after the scheme".into()))?;
        let (node_scheme, kind) = match scheme.split_once('+') {
            None => (scheme, ""),
            Some((node, kind)) => (node, kind),
        };
        let node_scheme = match node_scheme {
            "redis" => "redis",
            "rediss" => "rediss",
            other => return Err(wrong(format!("unknown scheme {other:?}"))),
        };
        if kind.is_empty() {
            return node_info(url)
                .map(|info| Self::Node(Box::new(info)))
                .map_err(wrong);
        }
        // The credentials stand before the first host and serve every one;
        // the cut is at the last `@`, as in `redact`.
        let (userinfo, after) = match rest.rsplit_once('@') {
            Some((user, after)) => (format!("{user}@"), after),
            None => (String::new(), rest),
        };
        let (hosts, path) = after.split_once('/').unwrap_or((after, ""));
        let hosts: Vec<&str> = hosts.split(',').collect();
        if hosts.iter().any(|h| h.trim().is_empty()) {
            return Err(wrong("an empty host in the host list".into()));
        }
        let nodes = |default_port: Option<u16>| {
            hosts
                .iter()
                .map(|host| {
                    let host = match (default_port, host.rsplit_once(':')) {
                        (Some(port), None) => format!("{host}:{port}"),
                        _ => host.to_string(),
                    };
                    node_info(&format!("{node_scheme}://{userinfo}{host}"))
                        .map_err(|e| wrong(format!("host {host:?}: {e}")))
                })
                .collect::<Result<Vec<_>, _>>()
        };
        match kind {
            "cluster" => {
                if !matches!(path, "" | "0") {
                    return Err(wrong(format!(
                        "a Redis Cluster has only database 0, not {path:?}"
                    )));
                }
                Ok(Self::Cluster(nodes(None)?))
            }
            "sentinel" => {
                let (master_name, db) = path.split_once('/').unwrap_or((path, ""));
                if master_name.is_empty() {
                    return Err(wrong(
                        "no master name after the Sentinel hosts (the name the Sentinels monitor it by, e.g. mymaster)".into(),
                    ));
                }
                let db = match db.trim_end_matches('/') {
                    "" => 0,
                    db => db
                        .parse()
                        .map_err(|_| wrong(format!("the database {db:?} is not a number")))?,
                };
                Ok(Self::Sentinel(Arc::new(Sentinels {
                    sentinels: nodes(Some(SENTINEL_PORT))?,
                    master_name: master_name.to_string(),
                    scheme: node_scheme,
                    userinfo,
                    db,
                })))
            }
            other => Err(wrong(format!("unknown scheme suffix \"+{other}\""))),
        }
    }

    /// Whether this is a Redis Cluster by its URL (a `redis://` node may be
    /// one too: `cluster.rs` asks it).
    pub(super) fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }

    /// The server the reader's connection for new entries
    /// (`read_connection.rs`) goes to, for stream `key`: the node, the
    /// master the Sentinels name now, or the Redis Cluster node that owns
    /// the key's hash slot in the slot map `commands` has now.
    pub(super) async fn read_node(
        &self,
        tls: &Tls,
        key: &str,
        commands: &mut Connection,
    ) -> Result<Node, ReadError> {
        let failed = |e: RedisError| {
            ReadError::Io(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                e.to_string(),
            ))
        };
        match self {
            Self::Node(info) => Node::of(info),
            Self::Sentinel(sentinels) => {
                let (_, info) = sentinels.master(tls).await.map_err(failed)?;
                Node::of(&info)
            }
            Self::Cluster(seeds) => {
                let slots: Value = redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async(commands)
                    .await
                    .map_err(failed)?;
                let slot = super::cluster::slot(key);
                let (host, port) = slot_owner(&slots, slot).ok_or_else(|| {
                    ReadError::Io(std::io::Error::new(
                        std::io::ErrorKind::NotConnected,
                        format!("no node of the Redis Cluster serves hash slot {slot} now"),
                    ))
                })?;
                let seed = seeds
                    .first()
                    .ok_or_else(|| ReadError::Unsupported("a cluster URL without a node".into()))?;
                Ok(Node::of(seed)?.at(&host, port))
            }
        }
    }

    /// A connection whose replies may take up to `response_timeout`, with
    /// the `--tls-*` files for `rediss` URLs.
    pub(super) async fn connect(
        &self,
        response_timeout: Duration,
        tls: &Tls,
    ) -> RedisResult<Connection> {
        match self {
            Self::Node(info) => Ok(Connection::Node(
                manager((**info).clone(), response_timeout, tls).await?,
            )),
            Self::Cluster(nodes) => {
                let mut builder = ClusterClientBuilder::new(nodes.clone())
                    .connection_timeout(CONNECT_TIMEOUT)
                    .response_timeout(response_timeout)
                    .retries(CLUSTER_RETRIES)
                    .min_retry_wait(CLUSTER_RETRY_MIN_WAIT_MS)
                    .max_retry_wait(CLUSTER_RETRY_MAX_WAIT_MS)
                    .tcp_settings(nodelay());
                if let Some(certificates) = tls::certificates(tls) {
                    builder = builder.certs(certificates);
                }
                Ok(Connection::Cluster(
                    builder.build()?.get_async_connection().await?,
                ))
            }
            Self::Sentinel(sentinels) => {
                let (address, info) = sentinels.master(tls).await?;
                let manager = manager(info, response_timeout, tls).await?;
                Ok(Connection::Sentinel(SentinelConnection {
                    sentinels: sentinels.clone(),
                    tls: tls.clone(),
                    response_timeout,
                    current: Arc::new(Mutex::new(Current {
                        address,
                        generation: 0,
                        manager,
                    })),
                    following: Arc::new(tokio::sync::Mutex::new(())),
                }))
            }
        }
    }
}

/// The master serving `slot` in a `CLUSTER SLOTS` reply:
/// `[[start, end, [host, port, id, ...], replicas...], ...]`.
fn slot_owner(slots: &Value, slot: u16) -> Option<(String, u16)> {
    let Value::Array(ranges) = slots else {
        return None;
    };
    ranges.iter().find_map(|range| {
        let Value::Array(parts) = range else {
            return None;
        };
        let number = |v: Option<&Value>| match v {
            Some(Value::Int(n)) => Some(*n),
            _ => None,
        };
        let (start, end) = (number(parts.first())?, number(parts.get(1))?);
        if !(start..=end).contains(&i64::from(slot)) {
            return None;
        }
        let Some(Value::Array(master)) = parts.get(2) else {
            return None;
        };
        let host = match master.first()? {
            Value::BulkString(host) => String::from_utf8_lossy(host).into_owned(),
            Value::SimpleString(host) => host.clone(),
            _ => return None,
        };
        let port = u16::try_from(number(master.get(1))?).ok()?;
        Some((host, port))
    })
}

/// Nagle's algorithm with delayed ACKs holds small commands (an XACK, a
/// read's reply) for up to 40 ms; redis-rs leaves it on.
fn nodelay() -> TcpSettings {
    TcpSettings::default().set_nodelay(true)
}

/// The connection settings of one server URL (`redis://` or `rediss://`).
pub(super) fn node_info(url: &str) -> Result<ConnectionInfo, String> {
    url.into_connection_info()
        .map(|info| info.set_tcp_settings(nodelay()))
        .map_err(|e| e.to_string())
}

/// A connection to one server that reconnects by itself.
async fn manager(
    info: ConnectionInfo,
    response_timeout: Duration,
    tls: &Tls,
) -> RedisResult<ConnectionManager> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_number_of_retries(3)
        .set_max_delay(Duration::from_secs(2))
        .set_response_timeout(Some(response_timeout));
    tls::client(info, tls)?
        .get_connection_manager_with_config(config)
        .await
}

impl Sentinels {
    /// Asks the Sentinels in turn for the master's address; the first that
    /// knows it answers. The server there must say it is a master.
    async fn master(&self, tls: &Tls) -> RedisResult<((String, u16), ConnectionInfo)> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(CONNECT_TIMEOUT));
        let mut trouble = Vec::new();
        for sentinel in &self.sentinels {
            match self.ask(sentinel, &config, tls).await {
                Ok(Ok(found)) => return Ok(found),
                Ok(Err(why)) => trouble.push(format!("{}: {why}", sentinel.addr())),
                Err(e) => trouble.push(format!("{}: {e}", sentinel.addr())),
            }
        }
        Err(RedisError::from(std::io::Error::new(
            std::io::ErrorKind::NotConnected,
            format!(
                "no Sentinel named a master {:?}: {}",
                self.master_name,
                trouble.join("; ")
            ),
        )))
    }

    /// Asks one Sentinel; `Ok(Err(why))` when it names no master that says
    /// it is one (a failover is under way).
    async fn ask(
        &self,
        sentinel: &ConnectionInfo,
        config: &AsyncConnectionConfig,
        tls: &Tls,
    ) -> RedisResult<Result<((String, u16), ConnectionInfo), String>> {
        let mut con = tls::client(sentinel.clone(), tls)?
            .get_multiplexed_async_connection_with_config(config)
            .await?;
        let named: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(&self.master_name)
            .query_async(&mut con)
            .await?;
        let Some(address) = named else {
            return Ok(Err(format!("knows no master named {:?}", self.master_name)));
        };
        let info = self.info(&address)?;
        let mut con = tls::client(info.clone(), tls)?
            .get_multiplexed_async_connection_with_config(config)
            .await?;
        let role: Vec<Value> = redis::cmd("ROLE").query_async(&mut con).await?;
        match role.first() {
            Some(Value::BulkString(role)) if role == b"master" => Ok(Ok((address, info))),
            _ => Ok(Err(format!(
                "names {}:{}, which is not a master (yet)",
                address.0, address.1
            ))),
        }
    }

    /// The connection settings of the server at `address`.
    fn info(&self, (host, port): &(String, u16)) -> RedisResult<ConnectionInfo> {
        let host = match host.contains(':') {
            true => format!("[{host}]"),
            false => host.clone(),
        };
        let url = format!(
            "{}://{}{host}:{port}/{}",
            self.scheme, self.userinfo, self.db
        );
        node_info(&url)
            .map_err(|e| RedisError::from(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))
    }
}

/// Talks to the master the Sentinels name, and asks them again when it is
/// lost.
#[derive(Clone)]
pub(super) struct SentinelConnection {
    sentinels: Arc<Sentinels>,
    tls: Tls,
    response_timeout: Duration,
    current: Arc<Mutex<Current>>,
    /// One asking of the Sentinels at a time.
    following: Arc<tokio::sync::Mutex<()>>,
}

struct Current {
    address: (String, u16),
    /// Counts the masters followed, so that many commands failing at once
    /// ask the Sentinels once.
    generation: u64,
    manager: ConnectionManager,
}

impl SentinelConnection {
    fn current(&self) -> (u64, ConnectionManager) {
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        (current.generation, current.manager.clone())
    }

    /// After `error` on the master of `generation`: if it means the master
    /// is lost, asks the Sentinels and moves to the master they name.
    async fn follow(&self, generation: u64, error: &RedisError) {
        let lost = error.is_io_error()
            || error.is_connection_refusal()
            || error.is_connection_dropped()
            || error.is_timeout()
            || error.code() == Some("READONLY");
        if !lost {
            return;
        }
        let _one = self.following.lock().await;
        if self.current().0 != generation {
            return;
        }
        let (address, info) = match self.sentinels.master(&self.tls).await {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %e, "the Redis master was lost and no Sentinel names a new one yet; will ask again");
                return;
            }
        };
        let same = self
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .address
            == address;
        if same {
            return;
        }
        match manager(info, self.response_timeout, &self.tls).await {
            Ok(manager) => {
                tracing::warn!(
                    master = %format!("{}:{}", address.0, address.1),
                    master_name = %self.sentinels.master_name,
                    "the Sentinels name a new Redis master; following it"
                );
                let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
                *current = Current {
                    address,
                    generation: generation + 1,
                    manager,
                };
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot reach the new Redis master the Sentinels name; will ask again")
            }
        }
    }
}

impl SentinelConnection {
    /// Runs `send` on the current master; a failure that means the master
    /// is lost makes the Sentinels be asked again.
    async fn on_master<T, F>(&self, send: impl FnOnce(ConnectionManager) -> F) -> RedisResult<T>
    where
        F: Future<Output = RedisResult<T>>,
    {
        let (generation, manager) = self.current();
        let result = send(manager).await;
        if let Err(error) = &result {
            self.follow(generation, error).await;
        }
        result
    }
}

impl ConnectionLike for SentinelConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        self.on_master(move |mut master| async move { master.req_packed_command(cmd).await })
            .boxed()
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.on_master(move |mut master| async move {
            master.req_packed_commands(pipeline, offset, count).await
        })
        .boxed()
    }

    fn get_db(&self) -> i64 {
        self.sentinels.db
    }
}

/// A connection of any of the three kinds; cloning it shares it.
#[derive(Clone)]
pub(super) enum Connection {
    Node(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(SentinelConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Node(con) => con.req_packed_command(cmd),
            Self::Cluster(con) => con.req_packed_command(cmd),
            Self::Sentinel(con) => con.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Node(con) => con.req_packed_commands(pipeline, offset, count),
            Self::Cluster(con) => con.req_packed_commands(pipeline, offset, count),
            Self::Sentinel(con) => con.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Node(con) => con.get_db(),
            Self::Cluster(con) => con.get_db(),
            Self::Sentinel(con) => con.get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(info: &ConnectionInfo) -> String {
        info.addr().to_string()
    }

    #[test]
    fn cluster_urls_name_any_nodes() {
        let Ok(Endpoint::Cluster(nodes)) =
            Endpoint::parse("redis+cluster://:secret@10.0.0.1:7000,10.0.0.2:7001")
        else {
            panic!("a cluster URL");
        };
        let addrs: Vec<String> = nodes.iter().map(addr).collect();
        assert_eq!(addrs, ["10.0.0.1:7000", "10.0.0.2:7001"]);
        // The credentials before the first host serve every node.
        assert!(
            nodes
                .iter()
                .all(|n| n.redis_settings().password() == Some("secret"))
        );
        assert!(
            Endpoint::parse("redis+cluster://h:7000/")
                .unwrap()
                .is_cluster()
        );
    }

    #[test]
    fn sentinel_urls_name_the_master_and_database() {
        let Ok(Endpoint::Sentinel(s)) =
            Endpoint::parse("redis+sentinel://u:pw@s1:26379,s2/mymaster/3")
        else {
            panic!("a Sentinel URL");
        };
        let addrs: Vec<String> = s.sentinels.iter().map(addr).collect();
        assert_eq!(addrs, ["s1:26379", "s2:26379"]);
        assert_eq!((s.master_name.as_str(), s.db), ("mymaster", 3));
        let master = s.info(&("10.1.2.3".into(), 6380)).unwrap();
        assert_eq!(addr(&master), "10.1.2.3:6380");
        assert_eq!(master.redis_settings().db(), 3);
        assert_eq!(master.redis_settings().password(), Some("pw"));
        let Ok(Endpoint::Sentinel(s)) = Endpoint::parse("redis+sentinel://s1/mymaster") else {
            panic!("the database may be left out");
        };
        assert_eq!(s.db, 0);
    }

    #[test]
    fn bad_urls_say_what_to_write_without_the_password() {
        for (url, says) in [
            ("redis+cluster://:hunter2@h1:7000,", "empty host"),
            ("redis+cluster://:hunter2@h1:7000/2", "only database 0"),
            ("redis+sentinel://:hunter2@s1:26379", "no master name"),
            ("redis+sentinel://:hunter2@s1:26379/m/x", "not a number"),
            ("redis+shard://:hunter2@h1:7000", "+shard"),
        ] {
            let err = Endpoint::parse(url).unwrap_err();
            assert!(err.contains(says), "{url}: {err}");
            assert!(err.contains("redis+sentinel://host:port"), "{err}");
            assert!(!err.contains("hunter2"), "{err}");
        }
    }
}
