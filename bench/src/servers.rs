//! The brokers the harness runs itself (issue 28: every broker), once a
//! run, for the sources that have no shared server on this machine:
//! Kafka on librdkafka's mock cluster (the `kafka-mock` binary, three
//! brokers), SQS on moto and Pub/Sub on Google's emulator, each started as
//! the torture run starts its own (`torture/private_*.rs`) and stopped at
//! the end of the run.
//!
//! courier, the bare loops and the harness's own clients find moto and the
//! emulator only through the environment (`AWS_ENDPOINT_URL`,
//! `PUBSUB_EMULATOR_HOST`), which children inherit: [`reserve`] picks
//! their ports and sets it before the runtime's threads exist. Kafka's
//! address is in the source URL (`kafka://host:port,...`), known once the
//! mock has printed it.
//!
//! A server that cannot start makes its source's runs say why
//! ([`Target::reachable`](crate::sources::Target::reachable)), not the
//! whole run fail.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::sources::Kind;
use crate::torture::private_kafka::PrivateKafka;
use crate::torture::private_moto::{self, PrivateMoto};
use crate::torture::private_pubsub::{self, PrivatePubSub};
use crate::torture::{PrivateServer, beside_this, free_port};

/// The project of the run's Pub/Sub topics and subscriptions.
pub const PUBSUB_PROJECT: &str = "courier-bench";

/// Ports chosen before the runtime started, with the environment pointing
/// at them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Reserved {
    moto: Option<u16>,
    pubsub: Option<u16>,
}

/// Picks the ports of moto and the emulator, when `kinds` needs them, and
/// points this process's environment (and so every child's) at them.
/// Called from `main` before any thread starts.
pub fn reserve(kinds: &[Kind]) -> Reserved {
    let mut reserved = Reserved::default();
    if kinds.contains(&Kind::Sqs) {
        let port = free_port();
        private_moto::set_environment(port);
        reserved.moto = Some(port);
    }
    if kinds.contains(&Kind::PubSub) {
        let port = free_port();
        private_pubsub::set_environment(port);
        reserved.pubsub = Some(port);
    }
    reserved
}

/// Where the run's own brokers listen, or why one is not there.
#[derive(Debug, Default)]
struct Endpoints {
    /// The mock cluster's bootstrap servers.
    kafka: Option<Result<String, String>>,
    /// moto's port, and its log (a line per request it answered).
    sqs: Option<Result<(u16, PathBuf), String>>,
    pubsub: Option<Result<u16, String>>,
}

static ENDPOINTS: OnceLock<Endpoints> = OnceLock::new();

fn not_started(kind: Kind) -> String {
    format!(
        "the harness did not start a {} server (the source was not selected)",
        kind.name()
    )
}

/// The Kafka mock cluster's bootstrap servers, `host:port,...`.
pub fn kafka_bootstrap() -> Result<String, String> {
    ENDPOINTS
        .get()
        .and_then(|e| e.kafka.clone())
        .unwrap_or_else(|| Err(not_started(Kind::Kafka)))
}

/// moto's port and its request log.
pub fn moto() -> Result<(u16, PathBuf), String> {
    ENDPOINTS
        .get()
        .and_then(|e| e.sqs.clone())
        .unwrap_or_else(|| Err(not_started(Kind::Sqs)))
}

/// The Pub/Sub emulator's port.
pub fn pubsub_port() -> Result<u16, String> {
    ENDPOINTS
        .get()
        .and_then(|e| e.pubsub.clone())
        .unwrap_or_else(|| Err(not_started(Kind::PubSub)))
}

/// The run's own brokers; [`Servers::stop`] ends them.
pub struct Servers {
    kafka: Option<PrivateKafka>,
    moto: Option<PrivateMoto>,
    pubsub: Option<PrivatePubSub>,
}

/// Starts the brokers `kinds` needs, with their files and logs in `dir`;
/// `kafka_mock`: the `kafka-mock` binary, when given.
pub async fn start(
    kinds: &[Kind],
    reserved: Reserved,
    dir: &Path,
    kafka_mock: Option<&Path>,
) -> Servers {
    let mut endpoints = Endpoints::default();
    let mut servers = Servers {
        kafka: None,
        moto: None,
        pubsub: None,
    };
    let why = |e: anyhow::Error| format!("{e:#}");
    if kinds.contains(&Kind::Kafka) {
        eprintln!("starting the Kafka mock cluster (three brokers)...");
        let started = async {
            let bin = beside_this(kafka_mock, &["kafka-mock", "courier-bench-kafka-mock"])?;
            let mut kafka = PrivateKafka::new(PrivateServer::new(dir.join("kafka"))?, bin);
            kafka.start().await?;
            anyhow::Ok(kafka)
        }
        .await;
        endpoints.kafka = Some(match started {
            Ok(kafka) => {
                let bootstrap = kafka.bootstrap().to_string();
                eprintln!("  at {bootstrap}");
                servers.kafka = Some(kafka);
                Ok(bootstrap)
            }
            Err(e) => Err(why(e)),
        });
    }
    if let Some(port) = reserved.moto {
        eprintln!("starting moto (SQS) on port {port}...");
        let started = async {
            let mut server = PrivateServer::new(dir.join("moto"))?;
            server.port = port;
            let mut moto = PrivateMoto { server };
            moto.start().await?;
            anyhow::Ok(moto)
        }
        .await;
        endpoints.sqs = Some(match started {
            Ok(moto) => {
                let log = moto.server.process.as_ref().map(|p| p.log.clone());
                servers.moto = Some(moto);
                log.map(|log| (port, log))
                    .ok_or_else(|| "moto is not running".to_string())
            }
            Err(e) => Err(why(e)),
        });
    }
    if let Some(port) = reserved.pubsub {
        eprintln!("starting the Pub/Sub emulator on port {port}...");
        let started = async {
            let mut server = PrivateServer::new(dir.join("pubsub"))?;
            server.port = port;
            let mut pubsub = PrivatePubSub { server };
            pubsub.start(private_pubsub::FOR_LOAD).await?;
            anyhow::Ok(pubsub)
        }
        .await;
        endpoints.pubsub = Some(match started {
            Ok(pubsub) => {
                servers.pubsub = Some(pubsub);
                Ok(port)
            }
            Err(e) => Err(why(e)),
        });
    }
    for (name, failed) in [
        (
            "kafka",
            endpoints.kafka.as_ref().and_then(|r| r.as_ref().err()),
        ),
        ("sqs", endpoints.sqs.as_ref().and_then(|r| r.as_ref().err())),
        (
            "pubsub",
            endpoints.pubsub.as_ref().and_then(|r| r.as_ref().err()),
        ),
    ] {
        if let Some(e) = failed {
            eprintln!("  the {name} server did not start: {e}");
        }
    }
    let _ = ENDPOINTS.set(endpoints);
    servers
}

impl Servers {
    /// Stops every server (SIGTERM to its process group, SIGKILL after 5 s).
    pub async fn stop(self) {
        let _ = tokio::task::spawn_blocking(move || drop(self)).await;
    }
}

/// The plain SDK client, as an application makes one: region, endpoint
/// and credentials from the environment [`reserve`] set. The SDK's default
/// HTTPS client is not built (src/Cargo.toml says why), so it gets
/// aws-smithy's hyper client on rustls with ring, as courier's does.
pub async fn sqs_client() -> aws_sdk_sqs::Client {
    use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
        .build_https();
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .http_client(http)
        .load()
        .await;
    aws_sdk_sqs::Client::new(&config)
}

/// The URL of the SQS queue `queue`.
pub async fn sqs_queue_url(client: &aws_sdk_sqs::Client, queue: &str) -> anyhow::Result<String> {
    use anyhow::Context;
    Ok(client
        .get_queue_url()
        .queue_name(queue)
        .send()
        .await?
        .queue_url()
        .context("no queue URL")?
        .to_string())
}

/// A gRPC channel to the emulator `PUBSUB_EMULATOR_HOST` names, plain
/// HTTP/2 without a token, as Google's clients talk to it.
pub async fn pubsub_channel() -> anyhow::Result<tonic::transport::Channel> {
    use anyhow::Context;
    let host = std::env::var("PUBSUB_EMULATOR_HOST").context("PUBSUB_EMULATOR_HOST is not set")?;
    Ok(
        tonic::transport::Channel::from_shared(format!("http://{host}"))?
            .connect()
            .await?,
    )
}
