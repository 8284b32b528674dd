//! TLS on every broker: `rediss://` (one server, `rediss+cluster://` on a
//! three-master cluster whose bus is TLS too, `rediss+sentinel://` through
//! a TLS Sentinel), `amqps://` and NATS `tls://` with `--tls-ca-file` (and
//! `--tls-cert-file` + `--tls-key-file` for mutual TLS), through the built
//! binary as a user runs it: `courier run`,
//! `courier send` (its flags given as `COURIER_TLS_*` variables) and
//! `courier dlq list` (Kafka's `kafkas://` is in kafka_security). The
//! certificates are made here with rcgen; the
//! brokers are private TLS listeners on ports 17000-17099, started once for
//! this test binary and ended with it.

use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::common::*;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};

const REDIS_PORT: u16 = 17001;
const REDIS_MTLS_PORT: u16 = 17002;
/// Three masters each; a node's cluster bus is its port + 10000
/// (27021-27026).
const REDIS_CLUSTER_PORTS: [u16; 3] = [17021, 17022, 17023];
const REDIS_CLUSTER_MTLS_PORTS: [u16; 3] = [17024, 17025, 17026];
/// A master and the Sentinel that names it.
const REDIS_SENTINEL_PORTS: (u16, u16) = (17031, 17032);
const REDIS_SENTINEL_MTLS_PORTS: (u16, u16) = (17033, 17034);
const NATS_PORT: u16 = 17011;
const NATS_MTLS_PORT: u16 = 17012;
const RABBIT_PORT: u16 = 17091;
const RABBIT_PLAIN_PORT: u16 = 17090;
const RABBIT_DIST_PORT: u16 = 17092;
/// Nothing listens here: a check that must fail before connecting.
const NOBODY_PORT: u16 = 17099;

// === Certificates ===

/// PEM files: the CA that signed the brokers' certificates, a client
/// certificate it signed, and another CA that signed neither.
pub(super) struct Certs {
    dir: PathBuf,
    _removed_at_exit: Held,
}

impl Certs {
    pub(super) fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub(super) fn ca(&self) -> String {
        self.path("ca.crt").display().to_string()
    }

    fn client_args(&self) -> Vec<String> {
        vec![
            "--tls-cert-file".into(),
            self.path("client.crt").display().to_string(),
            "--tls-key-file".into(),
            self.path("client.key").display().to_string(),
        ]
    }
}

pub(super) fn certs() -> &'static Certs {
    static CERTS: OnceLock<Certs> = OnceLock::new();
    CERTS.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("courier-tls-")
            .tempdir()
            .unwrap()
            .keep();
        let write = |name: &str, text: String| std::fs::write(dir.join(name), text).unwrap();
        let ca_params = || {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params
                .distinguished_name
                .push(DnType::CommonName, "courier test CA");
            params
        };
        let ca_key = KeyPair::generate().unwrap();
        write("ca.crt", ca_params().self_signed(&ca_key).unwrap().pem());
        let issuer = Issuer::new(ca_params(), ca_key);
        let other_key = KeyPair::generate().unwrap();
        write(
            "other-ca.crt",
            ca_params().self_signed(&other_key).unwrap().pem(),
        );
        let leaf = |name: &str, sans: Vec<String>, usage: ExtendedKeyUsagePurpose| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(sans).unwrap();
            params.distinguished_name.push(DnType::CommonName, name);
            params.extended_key_usages = vec![usage];
            let cert = params.signed_by(&key, &issuer).unwrap();
            write(&format!("{name}.crt"), cert.pem());
            write(&format!("{name}.key"), key.serialize_pem());
        };
        leaf(
            "server",
            vec!["localhost".into(), "127.0.0.1".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        leaf(
            "client",
            vec!["courier".into()],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        write("stray.key", KeyPair::generate().unwrap().serialize_pem());
        write("not-pem.txt", "this is not a certificate\n".into());
        Certs {
            _removed_at_exit: hold(&dir, "true", &[]),
            dir,
        }
    })
}

// === Private brokers ===

/// A broker process that ends with this test binary, however it ends: a
/// shell holds it and, when its stdin (a pipe from this process) closes,
/// stops it and removes its directory. Statics are never dropped, so this
/// is what cleans up.
struct Held {
    _child: Child,
    _stdin: ChildStdin,
    log: PathBuf,
}

fn hold(dir: &Path, command: &str, env: &[(&str, String)]) -> Held {
    let log = dir.join("broker.log");
    let script = format!(
        "{command} >{} 2>&1 & pid=$!; read _; kill -TERM $pid; wait $pid; rm -rf {}",
        log.display(),
        dir.display()
    );
    let mut child = Command::new("sh")
        .args(["-c", &script])
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start a broker");
    let stdin = child.stdin.take().expect("piped stdin");
    Held {
        _child: child,
        _stdin: stdin,
        log,
    }
}

impl Held {
    /// Waits until the broker's log says it is ready.
    fn ready(self, line: &str, limit: Duration) -> Self {
        let start = Instant::now();
        loop {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            if log.contains(line) {
                eprintln!("{} ready after {:?}", self.log.display(), start.elapsed());
                return self;
            }
            assert!(
                start.elapsed() < limit,
                "the broker did not log {line:?} within {limit:?}:\n{log}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn broker_dir(name: &str) -> PathBuf {
    tempfile::Builder::new()
        .prefix(&format!("courier-tls-{name}-"))
        .tempdir()
        .unwrap()
        .keep()
}

/// The settings every private `redis-server` here takes: only a TLS port,
/// TLS between servers too (cluster bus, replication, a Sentinel's
/// connections), and `mutual` to ask every client for a certificate. A
/// server connecting to another shows the client certificate: the server's
/// own is for serving only.
fn redis_tls_settings(port: u16, mutual: bool, dir: &Path) -> Vec<(&'static str, String)> {
    let c = certs();
    let file = |name: &str| c.path(name).display().to_string();
    vec![
        ("port", "0".into()),
        ("tls-port", port.to_string()),
        ("bind", "127.0.0.1".into()),
        ("dir", dir.display().to_string()),
        ("tls-cert-file", file("server.crt")),
        ("tls-key-file", file("server.key")),
        ("tls-ca-cert-file", c.ca()),
        ("tls-client-cert-file", file("client.crt")),
        ("tls-client-key-file", file("client.key")),
        ("tls-auth-clients", if mutual { "yes" } else { "no" }.into()),
        ("tls-replication", "yes".into()),
    ]
}

/// [`redis_tls_settings`] as the arguments of a `redis-server` that keeps
/// nothing on disk.
fn redis_tls_args(port: u16, mutual: bool, dir: &Path) -> String {
    let mut args: Vec<String> = redis_tls_settings(port, mutual, dir)
        .into_iter()
        .map(|(name, value)| format!("--{name} {value}"))
        .collect();
    args.push("--save '' --appendonly no".into());
    args.join(" ")
}

const REDIS_READY: &str = "Ready to accept connections";

/// `redis-server` with only a TLS port; `mutual` asks every client for a
/// certificate.
fn redis(mutual: bool) -> String {
    static PLAIN: OnceLock<Held> = OnceLock::new();
    static MUTUAL: OnceLock<Held> = OnceLock::new();
    let (cell, port) = match mutual {
        false => (&PLAIN, REDIS_PORT),
        true => (&MUTUAL, REDIS_MTLS_PORT),
    };
    cell.get_or_init(|| {
        let dir = broker_dir("redis");
        let command = format!("redis-server {}", redis_tls_args(port, mutual, &dir));
        hold(&dir, &command, &[]).ready(REDIS_READY, Duration::from_secs(30))
    });
    format!("rediss://localhost:{port}/0")
}

/// `redis-cli` over TLS with the client certificate, as an operator joins
/// and inspects the private servers.
fn redis_cli(args: &[&str]) -> Output {
    let c = certs();
    Command::new("redis-cli")
        .args(["--tls", "--cacert", &c.ca()])
        .arg("--cert")
        .arg(c.path("client.crt"))
        .arg("--key")
        .arg(c.path("client.key"))
        .args(args)
        .output()
        .expect("run redis-cli (is it installed?)")
}

/// A Redis Cluster of three TLS masters (`--tls-cluster yes`), joined with
/// `redis-cli --cluster create`; `mutual` asks every client for a
/// certificate.
fn redis_cluster(mutual: bool) -> String {
    static PLAIN: OnceLock<Vec<Held>> = OnceLock::new();
    static MUTUAL: OnceLock<Vec<Held>> = OnceLock::new();
    let (cell, ports) = match mutual {
        false => (&PLAIN, REDIS_CLUSTER_PORTS),
        true => (&MUTUAL, REDIS_CLUSTER_MTLS_PORTS),
    };
    cell.get_or_init(|| {
        let nodes: Vec<Held> = ports
            .iter()
            .map(|&port| {
                let dir = broker_dir("redis-cluster");
                let command = format!(
                    "redis-server {} --cluster-enabled yes --tls-cluster yes --cluster-config-file {} --cluster-node-timeout 2000",
                    redis_tls_args(port, mutual, &dir),
                    dir.join("nodes.conf").display()
                );
                hold(&dir, &command, &[])
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|node| node.ready(REDIS_READY, Duration::from_secs(30)))
            .collect();
        let mut create = vec!["--cluster".to_string(), "create".into()];
        create.extend(ports.iter().map(|port| format!("127.0.0.1:{port}")));
        create.push("--cluster-yes".into());
        let create: Vec<&str> = create.iter().map(String::as_str).collect();
        let out = redis_cli(&create);
        assert!(out.status.success(), "redis-cli --cluster create: {}", text(&out));
        let start = Instant::now();
        for port in ports {
            loop {
                let info = redis_cli(&["-p", &port.to_string(), "cluster", "info"]);
                if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                    break;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "the TLS cluster node {port} is not ok: {}",
                    text(&info)
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        eprintln!("TLS Redis Cluster {ports:?} ok after {:?}", start.elapsed());
        nodes
    });
    format!(
        "rediss+cluster://localhost:{},localhost:{}/0",
        ports[0], ports[1]
    )
}

/// A TLS master and a TLS Sentinel that monitors it (`tls-replication yes`:
/// the Sentinel reaches the master over TLS); `mutual` asks every client,
/// the Sentinel's and the master's, for a certificate.
fn redis_sentinel(mutual: bool) -> String {
    static PLAIN: OnceLock<(Held, Held)> = OnceLock::new();
    static MUTUAL: OnceLock<(Held, Held)> = OnceLock::new();
    let (cell, (master, sentinel)) = match mutual {
        false => (&PLAIN, REDIS_SENTINEL_PORTS),
        true => (&MUTUAL, REDIS_SENTINEL_MTLS_PORTS),
    };
    cell.get_or_init(|| {
        let dir = broker_dir("redis-master");
        let command = format!("redis-server {}", redis_tls_args(master, mutual, &dir));
        let held_master = hold(&dir, &command, &[]).ready(REDIS_READY, Duration::from_secs(30));
        let dir = broker_dir("redis-sentinel");
        // The Sentinel takes the same settings in its config file, which
        // it rewrites as it learns.
        let settings: Vec<String> = redis_tls_settings(sentinel, mutual, &dir)
            .into_iter()
            .map(|(name, value)| format!("{name} {value}\n"))
            .collect();
        let config = dir.join("sentinel.conf");
        std::fs::write(
            &config,
            format!(
                "{}sentinel monitor mymaster 127.0.0.1 {master} 1\n",
                settings.concat()
            ),
        )
        .unwrap();
        let command = format!("redis-server {} --sentinel", config.display());
        let held_sentinel =
            hold(&dir, &command, &[]).ready("+monitor master mymaster", Duration::from_secs(30));
        (held_master, held_sentinel)
    });
    format!("rediss+sentinel://localhost:{sentinel}/mymaster/0")
}

/// A fresh queue for `url`. On a Redis Cluster its name is a hash tag
/// (its dead-letter queue and retry schedule share its slot) whose slot the
/// third node serves: the URL names only the first two, so courier reaches
/// it through the cluster's slot map, over TLS too.
fn fresh_queue(url: &str) -> String {
    if !url.contains("+cluster://") {
        return unique("tls");
    }
    let ports = match url.contains(&REDIS_CLUSTER_PORTS[0].to_string()) {
        true => REDIS_CLUSTER_PORTS,
        false => REDIS_CLUSTER_MTLS_PORTS,
    };
    let third = ports[2].to_string();
    let ask = |args: &[&str]| {
        let out = redis_cli(&[&["-p", third.as_str()], args].concat());
        assert!(out.status.success(), "redis-cli {args:?}: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let nodes = ask(&["cluster", "nodes"]);
    let served = nodes
        .lines()
        .find(|line| line.contains("myself"))
        .and_then(|line| line.split(' ').next_back())
        .and_then(|range| range.split_once('-'))
        .map(|(low, high)| low.parse::<u16>().unwrap()..=high.parse::<u16>().unwrap())
        .unwrap_or_else(|| panic!("the slots of node {third}: {nodes}"));
    loop {
        let queue = format!("{{{}}}", unique("tls"));
        let slot: u16 = ask(&["cluster", "keyslot", &queue]).parse().unwrap();
        if served.contains(&slot) {
            return queue;
        }
    }
}

/// `nats-server` with JetStream and a `tls {}` block; `mutual` verifies
/// client certificates.
fn nats(mutual: bool) -> String {
    static PLAIN: OnceLock<Held> = OnceLock::new();
    static MUTUAL: OnceLock<Held> = OnceLock::new();
    let (cell, port) = match mutual {
        false => (&PLAIN, NATS_PORT),
        true => (&MUTUAL, NATS_MTLS_PORT),
    };
    cell.get_or_init(|| {
        let c = certs();
        let dir = broker_dir("nats");
        let config = format!(
            "listen: \"127.0.0.1:{port}\"\njetstream {{ store_dir: \"{}\" }}\ntls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: {mutual}\n  timeout: 2\n}}\n",
            dir.join("js").display(),
            c.path("server.crt").display(),
            c.path("server.key").display(),
            c.ca(),
        );
        std::fs::write(dir.join("nats.conf"), config).unwrap();
        let command = format!("nats-server -c {}", dir.join("nats.conf").display());
        hold(&dir, &command, &[]).ready("Server is ready", Duration::from_secs(30))
    });
    format!("tls://localhost:{port}")
}

/// A RabbitMQ node of its own (`courier-tls@localhost`) with only an
/// `ssl_options` listener, run in the foreground as root without the
/// package's wrapper (which would switch to the rabbitmq user, who cannot
/// read this process's temporary files).
fn rabbit() -> String {
    static NODE: OnceLock<Held> = OnceLock::new();
    NODE.get_or_init(|| {
        let c = certs();
        let dir = broker_dir("rabbitmq");
        let config = format!(
            "listeners.tcp = none\nlisteners.ssl.default = {RABBIT_PORT}\nssl_options.cacertfile = {}\nssl_options.certfile = {}\nssl_options.keyfile = {}\nssl_options.verify = verify_none\nssl_options.fail_if_no_peer_cert = false\nloopback_users = none\n",
            c.ca(),
            c.path("server.crt").display(),
            c.path("server.key").display(),
        );
        std::fs::write(dir.join("rabbitmq.conf"), config).unwrap();
        std::fs::write(dir.join("enabled_plugins"), "[].\n").unwrap();
        let path = |name: &str| dir.join(name).display().to_string();
        let env = [
            ("HOME", dir.display().to_string()),
            ("RABBITMQ_NODENAME", "courier-tls@localhost".into()),
            ("RABBITMQ_NODE_PORT", RABBIT_PLAIN_PORT.to_string()),
            ("RABBITMQ_DIST_PORT", RABBIT_DIST_PORT.to_string()),
            ("RABBITMQ_CONFIG_FILE", path("rabbitmq.conf")),
            ("RABBITMQ_ENABLED_PLUGINS_FILE", path("enabled_plugins")),
            ("RABBITMQ_MNESIA_BASE", path("mnesia")),
            ("RABBITMQ_LOG_BASE", path("log")),
            ("RABBITMQ_PID_FILE", path("rabbitmq.pid")),
        ];
        hold(&dir, "/usr/lib/rabbitmq/bin/rabbitmq-server", &env)
            .ready("Starting broker... completed", Duration::from_secs(120))
    });
    format!("amqps://guest:guest@localhost:{RABBIT_PORT}/%2f")
}

/// Starts the broker off the async runtime: its start blocks.
async fn start(broker: fn() -> String) -> String {
    tokio::task::spawn_blocking(broker).await.unwrap()
}

// === What a user runs ===

pub(super) fn tls_env(args: &[String]) -> Vec<(String, String)> {
    args.chunks(2)
        .map(|pair| {
            let flag = pair[0].trim_start_matches("--").replace('-', "_");
            (
                format!("COURIER_{}", flag.to_ascii_uppercase()),
                pair[1].clone(),
            )
        })
        .collect()
}

/// `courier send` with the TLS files as `COURIER_TLS_*` variables.
pub(super) fn send(url: &str, queue: &str, tls: &[String], body: &str) -> Output {
    courier_command()
        .args(["send", "--source", url, "--queue", queue, body])
        .envs(tls_env(tls))
        .output()
        .expect("run courier send")
}

pub(super) fn dlq_list(url: &str, queue: &str, tls: &[String]) -> Output {
    courier_command()
        .args(["dlq", "list", "--output", "json"])
        .args(["--source", url, "--queue", queue])
        .args(tls)
        .output()
        .expect("run courier dlq list")
}

pub(super) fn text(output: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// One message acked, one retried after a 503 and then acked, one
/// dead-lettered after a 400, all over TLS; the dead letter is listed by
/// `courier dlq list` over TLS too.
pub(super) async fn delivers_over_tls(url: &str, tls: Vec<String>) {
    let app = TestApp::start().await;
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(
        dir.path(),
        "maxAttempts: 3\ntimeout: 2s\nbackoff: {initial: 50ms, max: 200ms, jitter: none}",
    );
    let queue = fresh_queue(url);
    let mut args = vec![
        "--source".to_string(),
        url.to_string(),
        "--queue".into(),
        queue.clone(),
        "--app".into(),
        app.url(),
        "--policy-file".into(),
        policy.display().to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--create".into(),
    ];
    args.extend(tls.iter().cloned());
    let mut courier = CourierProcess::run(&args);
    courier.wait_running().await;

    for body in ["fine", "script:503,200", "script:400"] {
        let out = send(url, &queue, &tls, body);
        assert!(out.status.success(), "courier send {body}: {}", text(&out));
    }
    wait_for(
        "every message to reach the app over TLS",
        Duration::from_secs(30),
        async || {
            app.received_body(b"fine").len() == 1
                && app.received_body(b"script:503,200").len() == 2
                && app.received_body(b"script:400").len() == 1
        },
    )
    .await;
    let mut listed = Vec::new();
    wait_for(
        "the dead letter to be listed over TLS",
        Duration::from_secs(30),
        async || {
            let out = dlq_list(url, &queue, &tls);
            assert!(out.status.success(), "courier dlq list: {}", text(&out));
            listed = String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
                .collect();
            !listed.is_empty()
        },
    )
    .await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["body"], "script:400");
    assert_eq!(listed[0]["courier-reason"], "permanent-status");
    let retried = app.received_body(b"script:503,200");
    assert_eq!(retried[1].attempt(), 2, "the retry came back as attempt 2");
    if let Some(port) = url.strip_prefix("rediss://localhost:") {
        // An idle reader waits in XREADGROUP over a TLS connection of its
        // own (flag b).
        let port = port.trim_end_matches("/0");
        wait_for(
            "a reader waiting over TLS",
            Duration::from_secs(30),
            async || {
                let out = redis_cli(&["-p", port, "CLIENT", "LIST"]);
                !waiting_readers(&String::from_utf8_lossy(&out.stdout)).is_empty()
            },
        )
        .await;
    }
    // Reading new entries over TLS never failed.
    assert!(
        !(url.starts_with("rediss") && courier.log().contains("reading new entries")),
        "{}",
        courier.log()
    );

    courier.terminate();
    let status = courier.exit_within(Duration::from_secs(15)).await;
    assert!(status.success(), "{status}; log:\n{}", courier.log());
}

/// `courier run` with `args` and TLS `tls` must end within `limit`; returns
/// its exit code, its stderr and how long it took.
pub(super) async fn run_ends(
    url: &str,
    tls: &[String],
    limit: Duration,
) -> (Option<i32>, String, Duration) {
    let app = TestApp::start().await;
    let mut args = vec![
        "--source".to_string(),
        url.to_string(),
        "--queue".into(),
        fresh_queue(url),
        "--app".into(),
        app.url(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--create".into(),
    ];
    args.extend(tls.iter().cloned());
    let mut courier = CourierProcess::run(&args);
    let status = courier.exit_within(limit).await;
    (status.code(), courier.log(), courier.started.elapsed())
}

pub(super) fn ca_only() -> Vec<String> {
    vec!["--tls-ca-file".into(), certs().ca()]
}

pub(super) fn mutual() -> Vec<String> {
    let mut args = ca_only();
    args.extend(certs().client_args());
    args
}

/// On a broker that requires client certificates: delivery with one, and
/// a clear refusal (exit 1, naming the flags) without.
pub(super) async fn mutual_tls_delivers_and_refuses_a_client_without_a_certificate(url: &str) {
    delivers_over_tls(url, mutual()).await;
    let out = send(url, &fresh_queue(url), &ca_only(), "no certificate");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--tls-cert-file") && err.contains("client certificate"),
        "{err}"
    );
}

// === The tests ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_over_tls_with_a_ca_file() {
    delivers_over_tls(&start(|| redis(false)).await, ca_only()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_mutual_tls_delivers_and_a_client_without_a_certificate_is_refused() {
    mutual_tls_delivers_and_refuses_a_client_without_a_certificate(&start(|| redis(true)).await)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_over_tls_with_a_ca_file() {
    delivers_over_tls(&start(|| redis_cluster(false)).await, ca_only()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_mutual_tls_delivers_and_a_client_without_a_certificate_is_refused() {
    mutual_tls_delivers_and_refuses_a_client_without_a_certificate(
        &start(|| redis_cluster(true)).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sentinel_over_tls_with_a_ca_file() {
    delivers_over_tls(&start(|| redis_sentinel(false)).await, ca_only()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sentinel_mutual_tls_delivers_and_a_client_without_a_certificate_is_refused() {
    mutual_tls_delivers_and_refuses_a_client_without_a_certificate(
        &start(|| redis_sentinel(true)).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_over_tls_with_a_ca_file() {
    delivers_over_tls(&start(rabbit).await, ca_only()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_over_tls_with_a_ca_file() {
    delivers_over_tls(&start(|| nats(false)).await, ca_only()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_mutual_tls_delivers_and_a_client_without_a_certificate_is_refused() {
    mutual_tls_delivers_and_refuses_a_client_without_a_certificate(&start(|| nats(true)).await)
        .await;
}

/// A CA that did not sign the broker's certificate ends `courier run` at
/// start, within seconds, saying so and naming the flag; it is not retried
/// as an unreachable broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_is_a_clear_error_at_start_on_every_broker() {
    let wrong = vec![
        "--tls-ca-file".to_string(),
        certs().path("other-ca.crt").display().to_string(),
    ];
    for url in [
        start(|| redis(false)).await,
        start(|| redis_cluster(false)).await,
        start(|| redis_sentinel(false)).await,
        start(rabbit).await,
        start(|| nats(false)).await,
    ] {
        let (code, log, took) = run_ends(&url, &wrong, Duration::from_secs(20)).await;
        assert_eq!(code, Some(1), "{url}: {log}");
        assert!(
            log.contains("certificate verify failed") && log.contains("--tls-ca-file"),
            "{url}: {log}"
        );
        assert!(
            took < Duration::from_secs(15),
            "{url}: took {took:?}; {log}"
        );
        eprintln!("{url}: a wrong CA ended the start after {took:?}");
    }
}

/// Unreadable, non-PEM and mismatched files are refused with exit code 2
/// by `run`, `send` and `dlq` before anything connects (nothing listens on
/// the port), each naming its flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tls_files_exit_2_before_connecting() {
    let c = certs();
    let file = |name: &str| c.path(name).display().to_string();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--tls-ca-file".into(), file("missing.crt")],
            "--tls-ca-file",
        ),
        (
            vec!["--tls-ca-file".into(), file("not-pem.txt")],
            "no PEM certificate",
        ),
        (
            vec![
                "--tls-cert-file".into(),
                file("client.crt"),
                "--tls-key-file".into(),
                file("stray.key"),
            ],
            "does not go with --tls-cert-file",
        ),
        (
            vec!["--tls-cert-file".into(), file("client.crt")],
            "without --tls-key-file",
        ),
        (
            vec![
                "--tls-cert-file".into(),
                file("client.crt"),
                "--tls-key-file".into(),
                file("client.crt"),
            ],
            "not a PEM private key",
        ),
    ];
    for scheme_url in [
        format!("rediss://127.0.0.1:{NOBODY_PORT}/0"),
        format!("amqps://guest:guest@127.0.0.1:{NOBODY_PORT}/%2f"),
        format!("tls://127.0.0.1:{NOBODY_PORT}"),
        format!("kafkas://127.0.0.1:{NOBODY_PORT}"),
    ] {
        for (tls, says) in &cases {
            let queue = unique("tls");
            let run = courier_command()
                .args(["run", "--source", &scheme_url, "--queue", &queue])
                .args(tls)
                .output()
                .unwrap();
            let sent = send(&scheme_url, &queue, tls, "x");
            let listed = dlq_list(&scheme_url, &queue, tls);
            for (what, out) in [("run", run), ("send", sent), ("dlq list", listed)] {
                let err = String::from_utf8_lossy(&out.stderr);
                assert_eq!(out.status.code(), Some(2), "{what} {tls:?}: {}", text(&out));
                assert!(err.contains(says), "{what} {tls:?}: {err}");
            }
        }
    }
}

/// TLS files with a scheme that does not use TLS are a mistake to point
/// out, not to ignore.
#[test]
fn tls_files_need_a_tls_scheme() {
    for (url, hint) in [
        ("redis://127.0.0.1:6379/0", "rediss://"),
        ("amqp://guest:guest@127.0.0.1:5672/%2f", "amqps://"),
        ("nats://127.0.0.1:4222", "tls://"),
        ("kafka://127.0.0.1:9092", "kafkas://"),
    ] {
        let out = courier_command()
            .args(["send", "--source", url, "--queue", "q", "x"])
            .env("COURIER_TLS_CA_FILE", certs().ca())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{url}: {}", text(&out));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(hint),
            "{url}: {}",
            text(&out)
        );
    }
}
