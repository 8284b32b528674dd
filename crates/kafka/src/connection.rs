//! The clients (a consumer of the group, a producer, an inspector that
//! never joins the group), their settings, the topics courier needs, the
//! seal key, and reading a topic from end to end.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{
    BaseConsumer, Consumer, ConsumerContext, RebalanceProtocol, StreamConsumer,
};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{Offset, TopicPartitionList};

use courier_core::duration::limit_from_env;
use courier_core::source::redact::redact;
use courier_core::source::sasl::Mechanism;
use courier_core::source::shared::{HELD_WAIT, Seal};
use courier_core::source::{ErrorKind, Sasl, SourceError, SourceOptions, Tls};

/// How long one metadata, offset or watermark request may take.
pub(super) const REQUEST: Duration = Duration::from_secs(10);

/// The topic that holds courier's seal key of each work topic, keyed by
/// the topic's name. Its records must outlive the copies they seal: where
/// you create topics yourself, make it compacted rather than time-limited.
const SEAL_TOPIC: &str = "courier-seal-keys";

/// Checks a `kafka://` or `kafkas://host:port[,host:port]` URL at start.
pub fn check_url(text: &str) -> Result<(), String> {
    bootstrap_servers(text).map(drop)
}

/// The bootstrap servers of a `kafka://` or `kafkas://` URL, as librdkafka
/// takes them, and whether the URL asks for TLS.
pub(super) fn bootstrap_servers(text: &str) -> Result<(String, bool), String> {
    let refused = |why: &str| {
        format!(
            "{}: {why}; write it like kafka://host:9092 or kafka://h1:9092,h2:9092 (any reachable broker is enough), kafkas://host:9093 over TLS",
            redact(text)
        )
    };
    let (hosts, tls) = match (
        text.strip_prefix("kafka://"),
        text.strip_prefix("kafkas://"),
    ) {
        (Some(hosts), _) => (hosts, false),
        (_, Some(hosts)) => (hosts, true),
        _ => return Err(refused("not a kafka:// or kafkas:// URL")),
    };
    let hosts = hosts.strip_suffix('/').unwrap_or(hosts);
    if hosts.contains('@') {
        return Err(refused(
            "a Kafka URL carries no credentials: give the SASL login with --kafka-sasl-mechanism, --kafka-sasl-username and COURIER_KAFKA_SASL_PASSWORD (or --kafka-sasl-password-file)",
        ));
    }
    if hosts.contains(['/', '?', '#']) {
        return Err(refused("a Kafka URL has no path or query"));
    }
    let mut servers = Vec::new();
    for server in hosts.split(',').map(str::trim) {
        let Some((host, port)) = server.rsplit_once(':') else {
            return Err(refused("every broker needs a port"));
        };
        if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
            return Err(refused("every broker is host:port with a port number"));
        }
        servers.push(server.to_string());
    }
    Ok((servers.join(","), tls))
}

/// What every client of one cluster connects with: the bootstrap servers,
/// TLS and the SASL login, and what librdkafka last said went wrong with
/// them, for the error a failed start ends with.
#[derive(Clone)]
pub(super) struct Cluster {
    bootstrap: String,
    tls: Option<Tls>,
    sasl: Option<Sasl>,
    trouble: Arc<Trouble>,
}

/// The last connection errors librdkafka reported on any client of a
/// cluster (its error callback), which a timed-out request does not say.
/// Several, because the error that explains a failure (a refused login) is
/// often followed by ones that do not (all brokers down).
#[derive(Default)]
pub(super) struct Trouble(Mutex<VecDeque<(RDKafkaErrorCode, String)>>);

/// How many of the last errors [`Trouble`] keeps.
const TROUBLE_KEPT: usize = 16;

impl Trouble {
    fn record(&self, code: RDKafkaErrorCode, reason: &str) {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() == TROUBLE_KEPT {
            kept.pop_front();
        }
        kept.push_back((code, reason.to_string()));
    }

    /// The errors kept, newest first.
    fn newest_first(&self) -> Vec<(RDKafkaErrorCode, String)> {
        let kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        kept.iter().rev().cloned().collect()
    }
}

impl Cluster {
    pub(super) fn of(url: &str, options: &SourceOptions) -> Result<Self, SourceError> {
        let (bootstrap, tls) = bootstrap_servers(url).map_err(SourceError::invalid)?;
        if options
            .sasl
            .as_ref()
            .is_some_and(|s| s.mechanism == Mechanism::Plain)
            && !tls
        {
            tracing::warn!(
                "SASL PLAIN over kafka:// sends the password in the clear; use kafkas:// where the brokers take TLS"
            );
        }
        Ok(Self {
            bootstrap,
            tls: tls.then(|| options.tls.clone()),
            sasl: options.sasl.clone(),
            trouble: Arc::default(),
        })
    }

    /// The settings every client of the cluster shares: where it is, TLS
    /// and SASL.
    fn config(&self, client_id: &str) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.bootstrap)
            .set("client.id", client_id)
            // Level 6 (info): a broker's failure is logged at it, and the
            // log is how a failed start says why (`Cluster::reach`).
            .set("log_level", "6");
        let protocol = match (&self.tls, &self.sasl) {
            (None, None) => "plaintext",
            (Some(_), None) => "ssl",
            (None, Some(_)) => "sasl_plaintext",
            (Some(_), Some(_)) => "sasl_ssl",
        };
        config.set("security.protocol", protocol);
        if let Some(tls) = &self.tls {
            // The PEMs as read and checked at start, not the paths: a file
            // swapped later changes nothing until a restart, as for every
            // other broker.
            match tls.ca_pem() {
                Some(ca) => config.set("ssl.ca.pem", String::from_utf8_lossy(ca)),
                // librdkafka looks for the system's roots where Debian,
                // RHEL, Alpine and distroless keep them.
                None => config.set("ssl.ca.location", "probe"),
            };
            if let Some((cert, key)) = tls.client_pem() {
                config
                    .set("ssl.certificate.pem", String::from_utf8_lossy(cert))
                    .set("ssl.key.pem", String::from_utf8_lossy(key));
            }
            config.set("ssl.endpoint.identification.algorithm", "https");
        }
        if let Some(sasl) = &self.sasl {
            config.set("sasl.mechanism", sasl.mechanism.name());
            match sasl.mechanism {
                Mechanism::OAuthBearer => {
                    config
                        .set("sasl.oauthbearer.method", "oidc")
                        .set("sasl.oauthbearer.client.id", &sasl.username)
                        .set("sasl.oauthbearer.client.secret", sasl.secret())
                        .set(
                            "sasl.oauthbearer.token.endpoint.url",
                            sasl.token_url.as_deref().unwrap_or_default(),
                        )
                        .set("https.ca.location", "probe");
                    if let Some(scope) = &sasl.scope {
                        config.set("sasl.oauthbearer.scope", scope);
                    }
                }
                _ => {
                    config
                        .set("sasl.username", &sasl.username)
                        .set("sasl.password", sasl.secret());
                }
            }
        }
        // librdkafka's own debug contexts (`cgrp`, `consumer`, `all`, ...) for
        // finding out what the group does. They come through courier's log at
        // debug level (RUST_LOG=courier_kafka=debug); rdkafka would
        // otherwise hold librdkafka's level at what the `log` filter lets
        // through for the target `librdkafka`, which is not debug.
        if let Ok(debug) = std::env::var("COURIER_KAFKA_DEBUG") {
            config
                .set("debug", debug)
                .set("log_level", "7")
                .set_log_level(RDKafkaLogLevel::Debug);
        }
        config
    }

    /// An admin client of the cluster (CreateTopics), for the one request
    /// that needs it: made and dropped around it.
    pub(super) fn admin(&self, client_id: &str) -> KafkaResult<rdkafka::admin::AdminClient<Quiet>> {
        self.config(&format!("{client_id}-admin"))
            .create_with_context(self.quiet())
    }

    /// The context of an inspector or producer of this cluster.
    pub(super) fn quiet(&self) -> Quiet {
        Quiet {
            trouble: self.trouble.clone(),
        }
    }

    /// The first request of a start or a command, through `inspector`:
    /// tried for up to [`REQUEST`], serving the inspector's events between
    /// tries (its error callback is what says why a request failed), and
    /// given up as soon as that says what to fix.
    pub(super) fn reach(&self, inspector: &Inspector, topic: &str) -> Result<(), SourceError> {
        let deadline = std::time::Instant::now() + REQUEST;
        loop {
            let tried = inspector
                .fetch_metadata(Some(topic), Duration::from_secs(1))
                .map(drop)
                .map_err(unavailable);
            let Err(error) = tried else {
                return Ok(());
            };
            {
                // Unassigned, so a poll serves events, never a record. A
                // poll that served a log line returns as one that found
                // nothing, so the queue is served for a while instead,
                // waiting a millisecond at a time when it is empty.
                let _reading = READING.lock().unwrap_or_else(|e| e.into_inner());
                let until = std::time::Instant::now() + Duration::from_millis(50);
                while std::time::Instant::now() < until {
                    let _ = inspector.poll(Duration::from_millis(1));
                }
            }
            let error = self.explain(error);
            if error.kind() != ErrorKind::Unavailable || std::time::Instant::now() >= deadline {
                return Err(error);
            }
        }
    }

    /// Turns a failed first request into what to fix, from what librdkafka
    /// reported meanwhile: a login the brokers refused, a certificate that
    /// is not trusted, a listener that speaks another protocol. Anything
    /// else stays as it was (a broker that cannot be reached is tried
    /// again).
    pub(super) fn explain(&self, error: SourceError) -> SourceError {
        if error.kind() != ErrorKind::Unavailable {
            return error;
        }
        self.trouble
            .newest_first()
            .into_iter()
            .find_map(|(code, reason)| {
                explain(code, &reason, self.tls.as_ref(), self.sasl.as_ref())
            })
            .unwrap_or(error)
    }
}

/// What a connection error librdkafka reported means for the operator,
/// naming the setting to change; `None` for one that may pass (a broker
/// down).
fn explain(
    code: RDKafkaErrorCode,
    reason: &str,
    tls: Option<&Tls>,
    sasl: Option<&Sasl>,
) -> Option<SourceError> {
    let lower = reason.to_ascii_lowercase();
    if let Some(sasl) = sasl {
        if sasl.mechanism == Mechanism::OAuthBearer
            && lower.contains("oauthbearer")
            && lower.contains("token")
        {
            return Some(SourceError::refused(format!(
                "no OAuth token for Kafka: {reason}; check --kafka-oauth-token-url ({}), the client id (--kafka-sasl-username {:?}) and the client secret ({})",
                sasl.token_url.as_deref().unwrap_or_default(),
                sasl.username,
                sasl.secret_from
            )));
        }
        if lower.contains("unsupported sasl mechanism") {
            return Some(SourceError::invalid(format!(
                "the Kafka brokers do not offer SASL {}: {reason}; set --kafka-sasl-mechanism to one they offer",
                sasl.mechanism
            )));
        }
        if lower.contains("handshake not supported") || lower.contains("does not support sasl") {
            return Some(SourceError::invalid(format!(
                "the Kafka brokers at this address do not take a SASL login: {reason}; point --source at their SASL listener, or leave --kafka-sasl-mechanism out"
            )));
        }
        let refused =
            code == RDKafkaErrorCode::Authentication || lower.contains("authentication failed");
        if refused && sasl.mechanism == Mechanism::OAuthBearer {
            return Some(SourceError::refused(format!(
                "Kafka refused the OAuth token of client {:?} from {}: {reason}; check that the identity provider issues tokens this cluster accepts (its audience and --kafka-oauth-scope)",
                sasl.username,
                sasl.token_url.as_deref().unwrap_or_default()
            )));
        }
        if refused {
            return Some(SourceError::refused(format!(
                "Kafka refused the SASL {} login of {:?}: {reason}; check --kafka-sasl-username and the password ({})",
                sasl.mechanism, sasl.username, sasl.secret_from
            )));
        }
    }
    if let Some(tls) = tls {
        if lower.contains("certificate verify failed") {
            let fix = if tls.ca_pem().is_some() {
                "check that --tls-ca-file holds the CA that signed the brokers' certificates, and that they name the hosts of --source"
            } else {
                "give the CA that signed them with --tls-ca-file"
            };
            return Some(SourceError::invalid(format!(
                "certificate verify failed: the Kafka brokers' TLS certificate is not trusted: {reason}; {fix}"
            )));
        }
        if lower.contains("wrong version number")
            || lower.contains("packet length too long")
            || lower.contains("record layer failure")
        {
            return Some(SourceError::invalid(format!(
                "the Kafka brokers at this address do not speak TLS: {reason}; write kafka:// for a plaintext listener, or point kafkas:// at their TLS port"
            )));
        }
        if lower.contains("alert")
            && (lower.contains("certificate required")
                || lower.contains("handshake failure")
                || lower.contains("bad certificate")
                || lower.contains("unknown ca"))
        {
            let fix = if tls.client_pem().is_some() {
                "the brokers did not accept --tls-cert-file; check that they trust the CA that issued it"
            } else {
                "the brokers ask for a client certificate (mutual TLS); give it with --tls-cert-file and --tls-key-file"
            };
            return Some(SourceError::invalid(format!(
                "the Kafka brokers refused the TLS handshake: {reason}; {fix}"
            )));
        }
    } else if lower.contains("connecting to a ssl listener")
        || (lower.contains("disconnected") && lower.contains("state apiversion_query"))
    {
        return Some(SourceError::invalid(format!(
            "the Kafka brokers closed the connection at its first request: {reason}; if the listener takes TLS, write kafkas://"
        )));
    }
    None
}

/// Refuses a `--queue` that names no topic.
pub(super) fn check_topic(topic: &str) -> Result<(), SourceError> {
    if topic.is_empty() {
        return Err(SourceError::invalid(
            "--queue names the Kafka topic; it cannot be empty",
        ));
    }
    Ok(())
}

/// The work topic is not there, and courier was not asked to create it.
pub(super) fn missing_topic(topic: &str) -> SourceError {
    SourceError::invalid(format!(
        "the Kafka topic {topic:?} does not exist; create it (kafka-topics --create --topic {topic}), or start courier run with --create"
    ))
}

pub(super) fn unavailable(e: impl std::fmt::Display) -> SourceError {
    SourceError::unavailable(format!("Kafka: {e}"))
}

/// librdkafka's log, into courier's: its errors (a broker it cannot reach)
/// as warnings, the rest at debug level.
fn log(level: RDKafkaLogLevel, facility: &str, message: &str) {
    match level {
        RDKafkaLogLevel::Emerg
        | RDKafkaLogLevel::Alert
        | RDKafkaLogLevel::Critical
        | RDKafkaLogLevel::Error => {
            tracing::warn!(facility, "librdkafka: {message}")
        }
        _ => tracing::debug!(facility, "librdkafka: {message}"),
    }
}

/// The context of the inspector and the producer: librdkafka's log into
/// courier's, its errors kept for [`Cluster::explain`].
#[derive(Clone, Default)]
pub(super) struct Quiet {
    trouble: Arc<Trouble>,
}

impl ClientContext for Quiet {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        log(level, facility, message);
        // A connection closed at its first request reaches the error
        // callback only as "all brokers down"; its log line says where.
        if facility == "FAIL" {
            self.trouble
                .record(RDKafkaErrorCode::BrokerTransportFailure, message);
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::debug!(%error, "librdkafka: {reason}");
        if let Some(code) = error.rdkafka_error_code() {
            self.trouble.record(code, reason);
        }
    }
}

impl ConsumerContext for Quiet {}

/// The group consumer's context: on a rebalance that takes partitions
/// away it lets their deliveries in flight finish, commits, and forgets
/// them (`rebalance`).
#[derive(Default)]
pub(super) struct Group {
    pub(super) shared: std::sync::OnceLock<super::rebalance::Shared>,
    quiet: Quiet,
}

impl ClientContext for Group {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        self.quiet.log(level, facility, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.quiet.error(error, reason);
    }
}

impl ConsumerContext for Group {
    /// librdkafka's rebalance callback, in place of rdkafka's, which gives
    /// revoked partitions up as soon as `pre_rebalance` returns: a revoke
    /// gives them up once their deliveries in flight settled
    /// (`rebalance.rs`).
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        partitions: &mut TopicPartitionList,
    ) {
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        let assigned = |done: KafkaResult<()>| {
            if let (Ok(()), Some(shared)) = (&done, self.shared.get()) {
                shared.hold_retry(consumer, partitions);
            }
            done
        };
        let done = match (err, self.shared.get()) {
            (RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS, _) if cooperative => {
                assigned(consumer.incremental_assign(partitions))
            }
            (RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS, _) => {
                assigned(consumer.assign(partitions))
            }
            (RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS, Some(shared)) => {
                shared.revoke(consumer, partitions);
                Ok(())
            }
            (err, _) => {
                if err != RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS {
                    tracing::warn!(error = ?err, "a Kafka rebalance failed; the partitions are given up and assigned again");
                }
                if cooperative {
                    consumer.incremental_unassign(partitions)
                } else {
                    consumer.unassign()
                }
            }
        };
        if let Err(e) = done {
            tracing::warn!(error = %e, "a Kafka rebalance could not be applied");
        }
    }
}

pub(super) type GroupConsumer = StreamConsumer<Group>;
pub(super) type Inspector = BaseConsumer<Quiet>;
pub(super) use super::producer::Producer;

/// The consumer group courier's `--group` names on a topic: a Kafka group
/// is cluster-wide, courier's names the readers of one queue (as a Redis
/// group or a JetStream consumer does), so the topic is part of the name
/// (docs/design.md).
pub(super) fn group_id(group: &str, topic: &str) -> String {
    format!("{group}.{topic}")
}

/// How long the group waits for a replica's heartbeat before it gives
/// the replica's partitions to another: Kafka's long-time default. Not the
/// visibility timeout: a Kafka group rebalances as a whole, and the group
/// coordinator also waits about this long for members to rejoin. So after
/// a replica was killed, its partitions (and the retry copies on them)
/// wait this long for another.
pub(super) const SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// The variable that sets another session timeout, an operations and
/// testing knob (Kafka brokers take 6 s to 30 min unless configured
/// otherwise; the mock cluster takes any).
pub const SESSION_TIMEOUT_ENV: &str = "COURIER_KAFKA_SESSION_TIMEOUT";

/// [`SESSION_TIMEOUT`], or the one of [`SESSION_TIMEOUT_ENV`].
pub(super) fn session_timeout() -> Result<Duration, SourceError> {
    limit_from_env(
        SESSION_TIMEOUT_ENV,
        SESSION_TIMEOUT,
        Duration::from_secs(30 * 60),
    )
    .map_err(SourceError::invalid)
}

/// The heartbeat of a session of `session`: every 3 s, or a third of the
/// session when that is shorter (librdkafka wants it well within).
fn heartbeat(session: Duration) -> Duration {
    (session / 3).min(Duration::from_secs(3))
}

/// The consumer of the group: nothing committed without courier (no
/// auto-commit, no offset store), earliest offsets for a new group.
pub(super) fn consumer(
    cluster: &Cluster,
    options: &SourceOptions,
    session: Duration,
) -> Result<GroupConsumer, SourceError> {
    cluster
        .config(&options.consumer)
        .set("group.id", group_id(&options.group, &options.queue))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", session.as_millis().to_string())
        .set(
            "heartbeat.interval.ms",
            heartbeat(session).as_millis().to_string(),
        )
        // The dispatcher reads only when a slot is free; a slow app must
        // not make librdkafka leave the group.
        .set("max.poll.interval.ms", "3600000")
        // A broker holds an empty fetch this long and answers it as soon as
        // a record comes, so an idle replica sends each broker a fetch every
        // 3 s, not ten a second (issue 28). The cost: a partition resumed
        // (behind a held retry copy, or at the read bound) or newly assigned
        // waits for the fetch in flight to its broker, up to this long.
        .set("fetch.wait.max.ms", HELD_WAIT.as_millis().to_string())
        .set("allow.auto.create.topics", "false")
        .create_with_context(Group {
            shared: Default::default(),
            quiet: cluster.quiet(),
        })
        .map_err(unavailable)
}

/// A consumer that reads offsets, watermarks and whole topics but never
/// joins the group, so depth and dead-letter browsing cause no rebalance.
pub(super) fn inspector(
    cluster: &Cluster,
    options: &SourceOptions,
) -> Result<Inspector, SourceError> {
    cluster
        .config(&format!("{}-inspector", options.consumer))
        .set("group.id", group_id(&options.group, &options.queue))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .set("allow.auto.create.topics", "false")
        .set("fetch.wait.max.ms", "100")
        .create_with_context(cluster.quiet())
        .map_err(unavailable)
}

/// The largest record librdkafka itself lets through (its maximum for
/// `message.max.bytes`), so that the limit is the cluster's: a topic that
/// takes records over librdkafka's default of 1,000,000 bytes takes their
/// retry copies and dead letters too, and what a topic refuses comes back
/// as the broker's `MESSAGE_TOO_LARGE`.
const PRODUCER_MAX_BYTES: &str = "1000000000";

/// The producer of retries, dead letters, replays and `send`: idempotent
/// (a retried produce is not stored twice), every write confirmed by all
/// in-sync replicas, and given up after 10 s so that a settlement that
/// cannot be written fails rather than hangs. It may create courier's own
/// topics on first use, where the brokers allow that.
pub(super) fn producer(
    cluster: &Cluster,
    options: &SourceOptions,
) -> Result<Producer, SourceError> {
    let mut config = cluster.config(&format!("{}-producer", options.consumer));
    config
        .set("message.max.bytes", PRODUCER_MAX_BYTES)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("message.timeout.ms", "10000")
        .set("linger.ms", "1")
        .set("allow.auto.create.topics", "true");
    Producer::create(&config, cluster.quiet()).map_err(unavailable)
}

/// Runs a blocking librdkafka call off the async threads.
pub(super) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, SourceError> + Send + 'static,
) -> Result<T, SourceError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| SourceError::broker(format!("a Kafka request did not finish: {e}")))?
}

/// The partitions of `topic`, or `None` when the cluster has no such topic.
pub(super) fn partitions(
    inspector: &Inspector,
    topic: &str,
) -> Result<Option<Vec<i32>>, SourceError> {
    let metadata = inspector
        .fetch_metadata(Some(topic), REQUEST)
        .map_err(unavailable)?;
    let Some(found) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Ok(None);
    };
    match found.error() {
        None => Ok(Some(found.partitions().iter().map(|p| p.id()).collect())),
        Some(e) if RDKafkaErrorCode::from(e) == RDKafkaErrorCode::UnknownTopicOrPartition => {
            Ok(None)
        }
        Some(e) => Err(unavailable(format!(
            "topic {topic:?}: {}",
            RDKafkaErrorCode::from(e)
        ))),
    }
}

/// Makes sure `topic` exists, creating it through the producer's metadata
/// request where the cluster creates topics on first use (the mock cluster
/// does; a Kafka broker does with `auto.create.topics.enable`).
pub(super) fn ensure_topic(
    producer: &Producer,
    inspector: &Inspector,
    topic: &str,
) -> Result<Vec<i32>, SourceError> {
    if let Some(found) = partitions(inspector, topic)? {
        return Ok(found);
    }
    let _ = producer.fetch_metadata(topic, REQUEST);
    for _ in 0..50 {
        if let Some(found) = partitions(inspector, topic)?.filter(|p| !p.is_empty()) {
            return Ok(found);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(SourceError::invalid(format!(
        "topic {topic:?} does not exist and the cluster did not create it; create it (kafka-topics --create --topic {topic}) or allow auto.create.topics.enable"
    )))
}

/// Low and high watermarks by topic and partition.
pub(super) type Marks = HashMap<(String, i32), (i64, i64)>;

/// The low and high watermarks of `topics`' partitions, by topic and
/// partition. Asked as two `ListOffsets` rounds (earliest, latest), each
/// one request per leader, where `fetch_watermarks` is two requests and a
/// metadata lookup per partition: a depth read of the work, retry,
/// dead-letter and removed topics on a 3-broker cluster was 94 requests,
/// and is 6 of these and a metadata request per topic (issue 28).
pub(super) fn watermarks(
    inspector: &Inspector,
    topics: &[(&str, &[i32])],
) -> Result<Marks, SourceError> {
    let mut out = HashMap::new();
    if topics.iter().all(|(_, partitions)| partitions.is_empty()) {
        return Ok(out);
    }
    let ask = |at: Offset| -> Result<Vec<(String, i32, i64)>, SourceError> {
        let mut list = TopicPartitionList::new();
        for (topic, partitions) in topics {
            for p in *partitions {
                list.add_partition_offset(topic, *p, at)
                    .map_err(unavailable)?;
            }
        }
        let answered = inspector
            .offsets_for_times(list, REQUEST)
            .map_err(unavailable)?;
        answered
            .elements()
            .iter()
            .map(|e| {
                e.error().map_err(|err| {
                    unavailable(format!(
                        "offsets of {} [{}]: {err}",
                        e.topic(),
                        e.partition()
                    ))
                })?;
                match e.offset() {
                    Offset::Offset(o) => Ok((e.topic().to_string(), e.partition(), o)),
                    other => Err(unavailable(format!(
                        "offsets of {} [{}]: the cluster answered {other:?}",
                        e.topic(),
                        e.partition()
                    ))),
                }
            })
            .collect()
    };
    for (topic, p, low) in ask(Offset::Beginning)? {
        out.insert((topic, p), (low, low));
    }
    for (topic, p, high) in ask(Offset::End)? {
        out.entry((topic, p)).or_insert((high, high)).1 = high;
    }
    Ok(out)
}

/// One reader of whole topics at a time: an inspector's assignment is
/// the read.
pub(super) static READING: Mutex<()> = Mutex::new(());

/// Every record of `topic`, partition by partition, from the oldest kept
/// to the end as it was when the read began.
pub(super) fn read_topic(
    inspector: &Inspector,
    topic: &str,
) -> Result<Vec<OwnedMessage>, SourceError> {
    let Some(partitions) = partitions(inspector, topic)? else {
        return Ok(Vec::new());
    };
    let marks = watermarks(inspector, &[(topic, &partitions)])?;
    let mut wanted = TopicPartitionList::new();
    let mut ends = Vec::new();
    for p in partitions {
        let (low, high) = marks
            .get(&(topic.to_string(), p))
            .copied()
            .unwrap_or_default();
        if high > low {
            wanted
                .add_partition_offset(topic, p, Offset::Offset(low))
                .map_err(unavailable)?;
            ends.push((p, high));
        }
    }
    if ends.is_empty() {
        return Ok(Vec::new());
    }
    let _reading = READING.lock().unwrap_or_else(|e| e.into_inner());
    inspector.assign(&wanted).map_err(unavailable)?;
    let mut out = Vec::new();
    let deadline = std::time::Instant::now() + REQUEST;
    while !ends.is_empty() {
        if std::time::Instant::now() > deadline {
            let _ = inspector.unassign();
            return Err(unavailable(format!(
                "reading {topic:?} took over {REQUEST:?}"
            )));
        }
        let Some(got) = inspector.poll(Duration::from_millis(100)) else {
            continue;
        };
        match got {
            Ok(message) => {
                let (p, offset) = (message.partition(), message.offset());
                if let Some(at) = ends.iter().position(|(q, _)| *q == p) {
                    out.push(message.detach());
                    if offset + 1 >= ends[at].1 {
                        ends.swap_remove(at);
                    }
                }
            }
            Err(KafkaError::PartitionEOF(p)) => ends.retain(|(q, _)| *q != p),
            Err(e) => {
                let _ = inspector.unassign();
                return Err(unavailable(e));
            }
        }
    }
    let _ = inspector.unassign();
    Ok(out)
}

/// The seal key of `topic`: the first one recorded in [`SEAL_TOPIC`] under
/// its name, recorded now when there is none. Every replica records then
/// reads, and a key's records all go to one partition, so concurrent
/// starts agree on the first.
pub(super) async fn seal_of(
    producer: &Producer,
    inspector: &Arc<Inspector>,
    topic: &str,
) -> Result<Seal, SourceError> {
    let read = |inspector: Arc<Inspector>, topic: String| async move {
        blocking(move || {
            let records = read_topic(&inspector, SEAL_TOPIC)?;
            Ok(records
                .into_iter()
                .filter(|r| r.key() == Some(topic.as_bytes()))
                .min_by_key(|r| r.offset())
                .and_then(|r| r.payload().map(<[u8]>::to_vec)))
        })
        .await
    };
    if let Some(secret) = read(inspector.clone(), topic.to_string()).await? {
        return Seal::new(&secret).map_err(SourceError::broker);
    }
    let secret = Seal::new_secret();
    producer
        .send(
            SEAL_TOPIC,
            Some(topic.as_bytes()),
            Some(secret.as_bytes()),
            None,
            REQUEST,
        )
        .await
        .map_err(|e| {
            SourceError::broker(format!(
                "cannot record the seal key in the topic {SEAL_TOPIC:?} ({e}); let courier write to it, or create it"
            ))
        })?;
    let secret = read(inspector.clone(), topic.to_string())
        .await?
        .ok_or_else(|| {
            SourceError::broker(format!(
                "the seal key recorded in {SEAL_TOPIC:?} cannot be read back"
            ))
        })?;
    Seal::new(&secret).map_err(SourceError::broker)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_rows() {
        assert_eq!(
            bootstrap_servers("kafka://127.0.0.1:9092"),
            Ok(("127.0.0.1:9092".into(), false))
        );
        assert_eq!(
            bootstrap_servers("kafka://a:1, b:2/"),
            Ok(("a:1,b:2".into(), false))
        );
        assert_eq!(
            bootstrap_servers("kafkas://a:9093,b:9093"),
            Ok(("a:9093,b:9093".into(), true))
        );
        for bad in [
            "kafka://",
            "kafka://host",
            "kafka://host:0",
            "kafka://host:x",
            "kafka://a:1,",
            "kafka://a:1/topic",
            "kafka://user:pw@a:1",
            "kafka://a:1?x=1",
            "kafkas://",
            "kafkas://user:pw@a:1",
            "redis://a:1",
        ] {
            let err = bootstrap_servers(bad).unwrap_err();
            assert!(err.contains("kafka://host:9092"), "{bad}: {err}");
        }
        let err = bootstrap_servers("kafka://user:hunter2@a:1").unwrap_err();
        assert!(
            !err.contains("hunter2") && err.contains("--kafka-sasl-username"),
            "{err}"
        );
    }

    #[test]
    fn a_group_is_named_per_topic() {
        assert_eq!(group_id("courier", "orders"), "courier.orders");
    }
}
