//! The reader's connection for new entries: a plain socket (TCP, or TLS for
//! `rediss`) that courier speaks RESP on itself, so that an `XREADGROUP`
//! reply is read as it arrives (`reply.rs`) and an entry over `--max-body`
//! is discarded on the way in instead of loaded whole, as a client crate
//! that builds the whole reply first would.
//!
//! It opens as the redis client would: `HELLO 3` when the URL asks for RESP3,
//! `AUTH` with the URL's credentials, `SELECT` of its database. It goes to
//! the server that holds the stream: the one node, the master the Sentinels
//! name, or the node of a Redis Cluster that owns the stream's hash slot
//! (`connection.rs`), following MOVED and ASK. A connection that failed, or
//! whose reply was cut short (a read given up midway), is dropped; the next
//! read opens a new one, to the server that holds the stream then.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use redis::{ConnectionAddr, ConnectionInfo, ProtocolVersion};
use rustls::ClientConfig;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use super::reply::{ProtocolError, Reply, ReplyParser};
use courier_core::source::Tls;

/// How long connecting, and each handshake reply, may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The least room a read from the socket is given.
const READ_CHUNK: usize = 64 * 1024;

trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// One server and how to open a connection to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Node {
    pub host: String,
    pub port: u16,
    tls: bool,
    username: Option<String>,
    password: Option<String>,
    db: i64,
    resp3: bool,
}

impl Node {
    /// The server of `info`, with its credentials, database and protocol.
    pub(super) fn of(info: &ConnectionInfo) -> Result<Self, ReadError> {
        let (host, port, tls) = match info.addr() {
            ConnectionAddr::Tcp(host, port) => (host.clone(), *port, false),
            ConnectionAddr::TcpTls {
                host,
                port,
                insecure: false,
                ..
            } => (host.clone(), *port, true),
            ConnectionAddr::TcpTls { insecure: true, .. } => {
                return Err(ReadError::Unsupported(
                    "a rediss:// URL with #insecure (no certificate check) is not supported; give the CA that signed the server's certificate with --tls-ca-file".into(),
                ));
            }
            other => {
                return Err(ReadError::Unsupported(format!(
                    "the address {other} is not a TCP one"
                )));
            }
        };
        let settings = info.redis_settings();
        Ok(Self {
            host,
            port,
            tls,
            username: settings.username().map(str::to_string),
            password: settings.password().map(str::to_string),
            db: settings.db(),
            resp3: matches!(settings.protocol(), ProtocolVersion::RESP3),
        })
    }

    /// The same settings at another address (a Redis Cluster's node).
    pub(super) fn at(&self, host: &str, port: u16) -> Self {
        Self {
            host: host.to_string(),
            port,
            ..self.clone()
        }
    }

    /// The commands that open a connection, in order, with their names.
    fn handshake(&self) -> Vec<(&'static str, redis::Cmd)> {
        let mut commands = Vec::new();
        match (self.resp3, &self.password) {
            (true, password) => {
                let mut hello = redis::cmd("HELLO");
                hello.arg(3);
                if let Some(password) = password {
                    hello
                        .arg("AUTH")
                        .arg(self.username.as_deref().unwrap_or("default"))
                        .arg(password);
                }
                commands.push(("HELLO", hello));
            }
            (false, Some(password)) => {
                let mut auth = redis::cmd("AUTH");
                if let Some(user) = &self.username {
                    auth.arg(user);
                }
                commands.push(("AUTH", auth.arg(password).clone()));
            }
            (false, None) => {}
        }
        if self.db != 0 {
            commands.push(("SELECT", redis::cmd("SELECT").arg(self.db).clone()));
        }
        commands
    }
}

#[derive(Debug, thiserror::Error)]
pub(super) enum ReadError {
    /// The connection failed or timed out: the server may be back soon.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The server refused a step of opening the connection.
    #[error("Redis refused {command}: {text}")]
    Refused { command: &'static str, text: String },
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// What this connection cannot do at all.
    #[error("{0}")]
    Unsupported(String),
}

/// A connection that has opened, and whose last reply was read whole.
pub(super) struct ReadConnection {
    io: Box<dyn Io>,
    buf: BytesMut,
    /// The server's id for this connection (`CLIENT ID`), by which another
    /// connection ends its blocking read (`CLIENT UNBLOCK`); `None` where
    /// the server does not let courier ask (an ACL, a renamed command).
    pub(super) client_id: Option<i64>,
    pub(super) node: Node,
}

impl ReadConnection {
    /// Connects to `node` and opens the connection; `tls` for `rediss`.
    pub(super) async fn open(node: &Node, tls: &TlsConfig) -> Result<Self, ReadError> {
        let opened = async {
            let tcp = TcpStream::connect((node.host.as_str(), node.port)).await?;
            tcp.set_nodelay(true)?;
            let io: Box<dyn Io> = match node.tls {
                false => Box::new(tcp),
                true => {
                    let name = ServerName::try_from(node.host.clone()).map_err(|e| {
                        std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
                    })?;
                    let connector = tokio_rustls::TlsConnector::from(tls.get()?);
                    Box::new(connector.connect(name, tcp).await?)
                }
            };
            let mut connection = Self {
                io,
                buf: BytesMut::with_capacity(READ_CHUNK),
                client_id: None,
                node: node.clone(),
            };
            let handshake = node.handshake();
            let mut packed = Vec::new();
            for (_, command) in &handshake {
                command.write_packed_command(&mut packed);
            }
            redis::cmd("CLIENT")
                .arg("ID")
                .write_packed_command(&mut packed);
            connection.io.write_all(&packed).await?;
            for (command, _) in &handshake {
                if let Err(text) = connection.small_reply().await? {
                    return Err(ReadError::Refused { command, text });
                }
            }
            connection.client_id = connection.integer_reply().await?;
            Ok(connection)
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, opened).await {
            Ok(opened) => opened,
            Err(_) => Err(ReadError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "connecting to {}:{} took over {CONNECT_TIMEOUT:?}",
                    node.host, node.port
                ),
            ))),
        }
    }

    /// Sends `XREADGROUP` (`packed`), after `ASKING` when `asking`, and
    /// reads its reply as it arrives, discarding fields over `limit`.
    pub(super) async fn read_group(
        &mut self,
        packed: &[u8],
        asking: bool,
        limit: usize,
    ) -> Result<Reply, ReadError> {
        if asking {
            let mut both = redis::cmd("ASKING").get_packed_command();
            both.extend_from_slice(packed);
            self.io.write_all(&both).await?;
            if let Err(text) = self.small_reply().await? {
                return Ok(Reply::Error(text));
            }
        } else {
            self.io.write_all(packed).await?;
        }
        let mut parser = ReplyParser::new(limit);
        loop {
            if !self.buf.is_empty()
                && let Some(reply) = parser.parse(&mut self.buf)?
            {
                return Ok(reply);
            }
            self.fill(parser.need()).await?;
        }
    }

    /// Reads from the socket into the buffer, with room for `need` bytes
    /// in all.
    async fn fill(&mut self, need: usize) -> Result<(), ReadError> {
        let room = need.saturating_sub(self.buf.len()).max(READ_CHUNK);
        self.buf.reserve(room);
        if self.io.read_buf(&mut self.buf).await? == 0 {
            return Err(ReadError::Io(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "Redis closed the connection",
            )));
        }
        Ok(())
    }

    /// Ends the blocking read of connection `client_id` on `node` as if
    /// its wait had run out (`CLIENT UNBLOCK ... TIMEOUT`), from a
    /// connection of its own; whether one was waiting.
    pub(super) async fn unblock(
        node: &Node,
        tls: &TlsConfig,
        client_id: i64,
    ) -> Result<bool, ReadError> {
        let mut connection = Self::open(node, tls).await?;
        let unblock = redis::cmd("CLIENT")
            .arg("UNBLOCK")
            .arg(client_id)
            .arg("TIMEOUT")
            .get_packed_command();
        let answer = async {
            connection.io.write_all(&unblock).await?;
            connection.integer_reply().await
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, answer).await {
            Ok(answer) => Ok(answer? == Some(1)),
            Err(_) => Err(ReadError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer to CLIENT UNBLOCK within {CONNECT_TIMEOUT:?}"),
            ))),
        }
    }

    /// One reply that should be an integer: `None` for an error reply or
    /// any other kind of value.
    async fn integer_reply(&mut self) -> Result<Option<i64>, ReadError> {
        loop {
            if let Some((used, _)) = value_end(&self.buf, 0)? {
                let value = self.buf.split_to(used);
                return Ok(value
                    .strip_prefix(b":")
                    .and_then(|rest| std::str::from_utf8(rest).ok())
                    .and_then(|text| text.trim_end().parse().ok()));
            }
            self.fill(0).await?;
        }
    }

    /// One reply of the handshake (or `ASKING`): `Err(text)` for an error
    /// reply, whatever else it is otherwise.
    async fn small_reply(&mut self) -> Result<Result<(), String>, ReadError> {
        loop {
            if let Some((used, error)) = value_end(&self.buf, 0)? {
                let _ = self.buf.split_to(used);
                return Ok(match error {
                    Some(text) => Err(text),
                    None => Ok(()),
                });
            }
            self.fill(0).await?;
        }
    }
}

/// Where the RESP value starting at `at` ends, and its text if it is an
/// error; `None` while it is not all in `buf`. For the small replies of the
/// handshake.
fn value_end(buf: &[u8], at: usize) -> Result<Option<(usize, Option<String>)>, ProtocolError> {
    let Some(&kind) = buf.get(at) else {
        return Ok(None);
    };
    let Some(end) = memchr::memmem::find(&buf[at..], b"\r\n").map(|e| at + e) else {
        return Ok(None);
    };
    let line = std::str::from_utf8(&buf[at + 1..end]).unwrap_or("");
    let after = end + 2;
    let count = || -> Result<i64, ProtocolError> {
        line.parse()
            .map_err(|_| ProtocolError::new(format!("a length {line:?} in a reply")))
    };
    match kind {
        b'+' | b':' | b'_' | b'#' | b',' | b'(' => Ok(Some((after, None))),
        b'-' => Ok(Some((after, Some(line.to_string())))),
        b'$' | b'=' | b'!' => {
            let len = count()?;
            if len < 0 {
                return Ok(Some((after, None)));
            }
            let whole = after + len as usize + 2;
            if buf.len() < whole {
                return Ok(None);
            }
            let error = (kind == b'!')
                .then(|| String::from_utf8_lossy(&buf[after..after + len as usize]).into_owned());
            Ok(Some((whole, error)))
        }
        b'*' | b'~' | b'>' | b'%' | b'|' => {
            let n = count()?;
            let n = match kind {
                b'%' | b'|' => n * 2,
                _ => n,
            };
            let mut next = after;
            for _ in 0..n.max(0) {
                match value_end(buf, next)? {
                    Some((end, _)) => next = end,
                    None => return Ok(None),
                }
            }
            // An attribute comes before the value it describes.
            match kind {
                b'|' => value_end(buf, next),
                _ => Ok(Some((next, None))),
            }
        }
        other => Err(ProtocolError::new(format!(
            "a value of type {:?} in a reply",
            char::from(other)
        ))),
    }
}

/// The TLS client configuration of `rediss` connections: the `--tls-*`
/// files', else the system's roots (built once, when first needed).
#[derive(Clone)]
pub(super) struct TlsConfig {
    tls: Tls,
    built: Arc<std::sync::OnceLock<Arc<ClientConfig>>>,
}

impl TlsConfig {
    pub(super) fn new(tls: Tls) -> Self {
        Self {
            tls,
            built: Arc::default(),
        }
    }

    pub(super) fn tls(&self) -> &Tls {
        &self.tls
    }

    fn get(&self) -> std::io::Result<Arc<ClientConfig>> {
        if let Some(config) = self.built.get() {
            return Ok(config.clone());
        }
        let config = match self.tls.client_config() {
            Some(config) => config,
            None => courier_core::source::tls::client_config("--tls-ca-file", None, "broker")
                .map_err(std::io::Error::other)?,
        };
        Ok(self.built.get_or_init(|| Arc::new(config)).clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshake_replies_are_measured_whole() {
        let hello = b"%2\r\n$6\r\nserver\r\n$5\r\nredis\r\n$5\r\nproto\r\n:3\r\n+OK\r\n";
        assert_eq!(value_end(hello, 0).unwrap(), Some((hello.len() - 5, None)));
        for cut in 0..hello.len() - 5 {
            assert_eq!(value_end(&hello[..cut], 0).unwrap(), None, "cut at {cut}");
        }
        let refused = b"-WRONGPASS invalid username-password pair\r\n";
        assert_eq!(
            value_end(refused, 0).unwrap(),
            Some((
                refused.len(),
                Some("WRONGPASS invalid username-password pair".into())
            ))
        );
        assert_eq!(
            value_end(b"!3\r\nERR\r\n", 0).unwrap(),
            Some((9, Some("ERR".into())))
        );
        assert!(value_end(b"?\r\n", 0).is_err());
    }

    #[test]
    fn the_handshake_follows_the_url() {
        let node = |url: &str| {
            Node::of(&redis::IntoConnectionInfo::into_connection_info(url).unwrap()).unwrap()
        };
        let names = |node: Node| -> Vec<String> {
            node.handshake()
                .iter()
                .map(|(_, c)| {
                    String::from_utf8_lossy(&c.get_packed_command())
                        .split("\r\n")
                        .skip(2)
                        .step_by(2)
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .collect()
        };
        assert!(names(node("redis://127.0.0.1:6379/0")).is_empty());
        assert_eq!(
            names(node("redis://:pw@127.0.0.1:6379/2")),
            ["AUTH pw", "SELECT 2"]
        );
        assert_eq!(
            names(node("redis://u:pw@127.0.0.1:6379/0?protocol=resp3")),
            ["HELLO 3 AUTH u pw"]
        );
        let tls = node("rediss://localhost:6380/0");
        assert!(tls.tls);
        assert_eq!(tls.at("10.0.0.1", 7000).host, "10.0.0.1");
    }
}
