//! The fronts: per mock broker, a listener that terminates TLS and SASL,
//! which librdkafka's mock cannot speak, and relays the rest of the
//! connection to the broker's own port untouched.

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{SyncSender, sync_channel};

use rustls::RootCertStore;
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio_rustls::TlsAcceptor;

use super::sasl::{Accounts, Login, Step};
use courier::source::sasl::Mechanism;

const SASL_HANDSHAKE: i16 = 17;
const API_VERSIONS: i16 = 18;
const SASL_AUTHENTICATE: i16 = 36;
const UNSUPPORTED_SASL_MECHANISM: i16 = 33;
const SASL_AUTHENTICATION_FAILED: i16 = 58;
/// Before a login, requests are ApiVersions and SASL tokens (an OAuth
/// token is a few KiB); a bigger frame is not a client's.
const MAX_FRAME_BEFORE_LOGIN: usize = 1 << 20;

pub struct Config {
    pub tls: Option<TlsAcceptor>,
    pub sasl: Option<Accounts>,
}

/// The server side of TLS, with the ring provider named here so the
/// process needs no globally installed one.
pub fn tls(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<TlsAcceptor, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("--tls-cert {}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!(
            "--tls-cert {}: no certificate in it",
            cert.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("--tls-key {}: {e}", key.display()))?;
    let verifier = match client_ca {
        None => WebPkiClientVerifier::no_client_auth(),
        Some(path) => {
            let what =
                |e: &dyn std::fmt::Display| format!("--tls-client-ca {}: {e}", path.display());
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(path).map_err(|e| what(&e))? {
                roots
                    .add(cert.map_err(|e| what(&e))?)
                    .map_err(|e| what(&e))?;
            }
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|e| what(&e))?
        }
    };
    let config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|builder| {
            builder
                .with_client_cert_verifier(verifier)
                .with_single_cert(chain, key)
        })
        .map_err(|e| format!("--tls-cert {}: {e}", cert.display()))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The running fronts, brokers 1..N in order.
pub struct Fronts {
    addrs: Vec<SocketAddr>,
    switches: Vec<UnboundedSender<Switch>>,
}

/// Takes a front down with its broker, or back up.
struct Switch {
    up: bool,
    done: SyncSender<Result<(), String>>,
}

impl Fronts {
    /// Listens in front of each of `brokers` (the mock's own addresses,
    /// broker 1 first) on a thread of its own.
    pub fn start(config: Config, brokers: &[SocketAddr]) -> io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let config = Arc::new(config);
        let mut addrs = Vec::new();
        let mut switches = Vec::new();
        let mut fronts = Vec::new();
        for (id, broker) in (1..).zip(brokers) {
            let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
            listener.set_nonblocking(true)?;
            addrs.push(listener.local_addr()?);
            let (switch, switched) = unbounded_channel();
            switches.push(switch);
            fronts.push((id, listener, *broker, switched));
        }
        std::thread::Builder::new()
            .name("kafka-mock-front".into())
            .spawn(move || {
                runtime.block_on(async move {
                    for (id, listener, broker, switched) in fronts {
                        match TcpListener::from_std(listener) {
                            Ok(listener) => {
                                tokio::spawn(front(id, listener, broker, switched, config.clone()));
                            }
                            Err(e) => eprintln!("kafka-mock: broker {id}'s front: {e}"),
                        }
                    }
                    std::future::pending::<()>().await
                })
            })?;
        Ok(Fronts { addrs, switches })
    }

    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// Closes or reopens broker `id`'s front, so a client of a broker
    /// that is down has its connection refused, as without a front.
    /// Returns once done.
    pub fn switch(&self, id: i32, up: bool) -> Result<(), String> {
        let Some(switch) = usize::try_from(id)
            .ok()
            .and_then(|id| self.switches.get(id.checked_sub(1)?))
        else {
            return Ok(());
        };
        let (done, finished) = sync_channel(1);
        switch
            .send(Switch { up, done })
            .map_err(|_| "the fronts have stopped".to_owned())?;
        finished
            .recv()
            .map_err(|_| "the fronts have stopped".to_owned())?
    }
}

/// Accepts broker `id`'s clients until switched off, then waits to be
/// switched on again at the same address.
async fn front(
    id: i32,
    listener: TcpListener,
    broker: SocketAddr,
    mut switched: UnboundedReceiver<Switch>,
    config: Arc<Config>,
) {
    let at = match listener.local_addr() {
        Ok(at) => at,
        Err(e) => return eprintln!("kafka-mock: broker {id}'s front: {e}"),
    };
    let mut listener = Some(listener);
    loop {
        let switch = match &listener {
            Some(open) => tokio::select! {
                accepted = open.accept() => {
                    match accepted {
                        Ok((client, _)) => {
                            tokio::spawn(connection(id, client, broker, config.clone()));
                        }
                        Err(e) => eprintln!("kafka-mock: broker {id}'s front: {e}"),
                    }
                    continue;
                }
                switch = switched.recv() => switch,
            },
            None => switched.recv().await,
        };
        let Some(Switch { up, done }) = switch else {
            return;
        };
        let result = match (up, &listener) {
            (false, _) => {
                listener = None;
                Ok(())
            }
            (true, Some(_)) => Ok(()),
            (true, None) => TcpListener::bind(at)
                .await
                .map(|open| listener = Some(open))
                .map_err(|e| format!("cannot listen again on {at}: {e}")),
        };
        let _ = done.send(result);
    }
}

async fn connection(id: i32, client: TcpStream, broker: SocketAddr, config: Arc<Config>) {
    let _ = client.set_nodelay(true);
    let result = match &config.tls {
        None => relay(client, broker, &config).await,
        Some(tls) => match tls.accept(client).await {
            Ok(client) => relay(client, broker, &config).await,
            // Gone without a word, as a port probe goes: no news.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(()),
            Err(e) => Err(format!("TLS handshake failed: {e}")),
        },
    };
    if let Err(why) = result {
        eprintln!("kafka-mock: broker {id}'s front: {why}");
    }
}

async fn relay<S>(mut client: S, broker: SocketAddr, config: &Config) -> Result<(), String>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut mock = TcpStream::connect(broker)
        .await
        .map_err(|e| format!("cannot reach the mock broker at {broker}: {e}"))?;
    let _ = mock.set_nodelay(true);
    if let Some(accounts) = &config.sasl
        && !login(&mut client, &mut mock, accounts).await?
    {
        return Ok(());
    }
    // Either side may hang up without ceremony; a reset is no news.
    let _ = tokio::io::copy_bidirectional(&mut client, &mut mock).await;
    Ok(())
}

/// Serves the requests of a connection before its SASL login: ApiVersions
/// through the mock, SaslHandshake and SaslAuthenticate here. True once
/// the client is logged in, false if it left or was refused.
async fn login<S>(client: &mut S, mock: &mut TcpStream, accounts: &Accounts) -> Result<bool, String>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut login: Option<Login> = None;
    loop {
        let Some(frame) = read_frame(client, MAX_FRAME_BEFORE_LOGIN)
            .await
            .map_err(|e| format!("reading a request before the SASL login: {e}"))?
        else {
            return Ok(false);
        };
        let mut request = Reader(&frame);
        let (Some(key), Some(version), Some(correlation)) =
            (request.i16(), request.i16(), request.i32())
        else {
            return Err("a request too short for its header; closing the connection".into());
        };
        if key == API_VERSIONS {
            write_frame(mock, &frame)
                .await
                .map_err(|e| format!("forwarding ApiVersions to the mock: {e}"))?;
            let response = read_frame(mock, usize::MAX)
                .await
                .map_err(|e| format!("reading the mock's ApiVersions answer: {e}"))?
                .ok_or("the mock hung up instead of answering ApiVersions")?;
            write_frame(client, &offer_sasl(response, version))
                .await
                .map_err(|e| format!("answering ApiVersions: {e}"))?;
            continue;
        }
        if key != SASL_HANDSHAKE && key != SASL_AUTHENTICATE {
            return Err(format!(
                "request with API key {key} before the SASL login; closing the connection"
            ));
        }
        // Both in versions 0 and 1, all librdkafka sends: request header
        // v1 (no tagged fields), response header v0.
        if !(0..=1).contains(&version) {
            return Err(format!(
                "API key {key} version {version}, more than the advertised 1; closing the connection"
            ));
        }
        let _client_id = request.string();
        let mut response = correlation.to_be_bytes().to_vec();
        let next = if key == SASL_HANDSHAKE {
            let name = request.string().flatten().unwrap_or_default();
            let offered = accounts.offers(&name);
            login = offered.map(Login::new);
            let error = match offered {
                Some(_) => 0,
                None => UNSUPPORTED_SASL_MECHANISM,
            };
            response.extend(error.to_be_bytes());
            let mechanisms = accounts.mechanisms();
            response.extend((mechanisms.len() as i32).to_be_bytes());
            for mechanism in mechanisms {
                put_string(&mut response, Some(mechanism.name()));
            }
            match offered {
                Some(_) => Next::More,
                None => Next::HangUp,
            }
        } else {
            let Some(auth) = request.bytes() else {
                return Err("a SaslAuthenticate request without auth bytes".into());
            };
            let Some(login) = login.as_mut() else {
                return Err("SaslAuthenticate before SaslHandshake; closing the connection".into());
            };
            let (error, message, reply, next) = match login.step(accounts, auth) {
                Step::Continue(reply) => (0, None, reply, Next::More),
                Step::Accepted(reply) => (0, None, reply, Next::In),
                Step::Refused => (
                    SASL_AUTHENTICATION_FAILED,
                    Some(refusal(login.mechanism())),
                    Vec::new(),
                    Next::HangUp,
                ),
            };
            response.extend(i16::to_be_bytes(error));
            put_string(&mut response, message.as_deref());
            response.extend((reply.len() as i32).to_be_bytes());
            response.extend(reply);
            if version >= 1 {
                // No re-authentication: after the login the connection is
                // the mock's, which knows nothing of SASL.
                response.extend(0i64.to_be_bytes());
            }
            next
        };
        write_frame(client, &response)
            .await
            .map_err(|e| format!("answering a SASL request: {e}"))?;
        match next {
            Next::More => {}
            Next::In => return Ok(true),
            Next::HangUp => return Ok(false),
        }
    }
}

/// Where a connection goes after a SASL answer.
enum Next {
    More,
    In,
    /// As a broker does after a failed handshake or login.
    HangUp,
}

fn refusal(mechanism: Mechanism) -> String {
    format!(
        "Authentication failed: invalid credentials with SASL mechanism {}",
        mechanism.name()
    )
}

/// Adds SaslHandshake and SaslAuthenticate 0..1 to the mock's ApiVersions
/// answer: librdkafka tries SASL only when a broker lists them, and the
/// mock lists no API it has no handler for, whatever versions are set
/// for it. Only versions 0-2 are rewritten: the mock supports no more,
/// answering v3 with an error that sends the client back (librdkafka
/// 2.12 to v0).
fn offer_sasl(response: Vec<u8>, version: i16) -> Vec<u8> {
    // After the correlation id, error code and count: key, min, max.
    const ENTRIES: usize = 10;
    const ENTRY: usize = 6;
    if !(0..=2).contains(&version) {
        return response;
    }
    let mut reader = Reader(&response);
    let (Some(_correlation), Some(0), Some(count)) = (reader.i32(), reader.i16(), reader.i32())
    else {
        return response;
    };
    let Ok(listed) = usize::try_from(count) else {
        return response;
    };
    let end = ENTRIES + listed * ENTRY;
    if response.len() < end {
        return response;
    }
    let present = |key: i16| {
        response[ENTRIES..end]
            .chunks(ENTRY)
            .any(|entry| entry[..2] == key.to_be_bytes())
    };
    let added: Vec<i16> = [SASL_HANDSHAKE, SASL_AUTHENTICATE]
        .into_iter()
        .filter(|key| !present(*key))
        .collect();
    let mut rewritten = response[..6].to_vec();
    rewritten.extend((count + added.len() as i32).to_be_bytes());
    rewritten.extend(&response[ENTRIES..end]);
    for key in added {
        for value in [key, 0, 1] {
            rewritten.extend(value.to_be_bytes());
        }
    }
    rewritten.extend(&response[end..]);
    rewritten
}

/// One frame's payload (after its i32 size); None at a clean end of stream.
async fn read_frame<S: AsyncRead + Unpin>(
    stream: &mut S,
    max: usize,
) -> io::Result<Option<Vec<u8>>> {
    let mut size = [0; 4];
    match stream.read_exact(&mut size).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let size = usize::try_from(i32::from_be_bytes(size))
        .ok()
        .filter(|size| *size <= max)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not a Kafka frame"))?;
    let mut payload = vec![0; size];
    stream.read_exact(&mut payload).await?;
    Ok(Some(payload))
}

async fn write_frame<S: AsyncWrite + Unpin>(stream: &mut S, payload: &[u8]) -> io::Result<()> {
    let size = i32::try_from(payload.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "frame too big"))?;
    let mut frame = size.to_be_bytes().to_vec();
    frame.extend(payload);
    stream.write_all(&frame).await?;
    stream.flush().await
}

fn put_string(out: &mut Vec<u8>, value: Option<&str>) {
    match value {
        None => out.extend((-1i16).to_be_bytes()),
        Some(value) => {
            out.extend((value.len() as i16).to_be_bytes());
            out.extend(value.as_bytes());
        }
    }
}

/// Kafka's big-endian, length-prefixed primitives, front to back.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    fn i16(&mut self) -> Option<i16> {
        Some(i16::from_be_bytes(self.take(2)?.try_into().ok()?))
    }

    fn i32(&mut self) -> Option<i32> {
        Some(i32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }

    /// A nullable string: Some(None) is null.
    fn string(&mut self) -> Option<Option<String>> {
        let len = self.i16()?;
        if len < 0 {
            return Some(None);
        }
        let bytes = self.take(len as usize)?;
        Some(Some(String::from_utf8_lossy(bytes).into_owned()))
    }

    fn bytes(&mut self) -> Option<&'a [u8]> {
        let len = usize::try_from(self.i32()?).ok()?;
        self.take(len)
    }
}
