//! `kafka-mock`: a Kafka cluster in one process, librdkafka's mock cluster
//! (the real Kafka wire protocol, in memory), for tests and for trying
//! courier without a Kafka installation.
//!
//! Prints the bootstrap servers (`127.0.0.1:port,...`) on the first line of
//! stdout and serves until killed. Commands on stdin, one a line, answered
//! `ok` or `error: ...`: `down <broker>` and `up <broker>` (brokers are
//! numbered from 1), `leader <topic> <partition> <broker>` (the mock moves
//! no leader by itself; `none` for the broker leaves the partition without
//! a leader, so a record for it waits and fails after the producer's
//! `message.timeout.ms`) and `coordinator <group> <broker>`. With
//! `--exit-on-eof` it ends when stdin closes, so a test that started it
//! cannot leave it behind.
//!
//! The mock speaks plaintext Kafka only. With `--tls-cert`/`--tls-key` or
//! `--sasl`, each broker gets a front: a listener on 127.0.0.1 that
//! terminates TLS (a client certificate signed by `--tls-client-ca`
//! required, if given) and SASL, then relays the connection to the
//! broker's own port. The brokers advertise their fronts, so the
//! bootstrap line and every Metadata answer lead clients through them,
//! and a broker that is `down` has its front closed with it. Each `--sasl`
//! is one account, `PLAIN:user:password`, `SCRAM-SHA-256:user:password`,
//! `SCRAM-SHA-512:user:password` or `OAUTHBEARER:token` (the exact bearer
//! token accepted); the mechanisms offered are those named. Before its
//! login a connection may send only ApiVersions, SaslHandshake and
//! SaslAuthenticate (v0 and v1); each login is logged on stderr, without
//! its password or token.
//!
//! With `KAFKA_MOCK_DEBUG` set (librdkafka's debug contexts: `mock`,
//! `mock,cgrp`, ...) the cluster logs what it does to stderr, its group
//! coordinator's joins, syncs and session expiries among it.
//!
//! `kafka-mock [--brokers N] [--exit-on-eof] [--tls-cert FILE --tls-key FILE
//! [--tls-client-ca FILE]] [--sasl MECHANISM:CREDENTIALS]...`
#![deny(rust_2018_idioms)]
#![deny(unsafe_code)]

#[path = "kafka-mock/front.rs"]
mod front;
#[path = "kafka-mock/sasl.rs"]
mod sasl;

use std::ffi::{CString, c_int};
use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use rdkafka::client::{Client, ClientContext};
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::mocking::{MockCluster, MockCoordinator};
use rdkafka::producer::{NoCustomPartitioner, Producer, ProducerContext, ThreadedProducer};

use front::Fronts;

const USAGE: &str = "usage: kafka-mock [--brokers N] [--exit-on-eof] \
                     [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]] \
                     [--sasl MECHANISM:CREDENTIALS]...";

fn main() -> ExitCode {
    let mut brokers = 1;
    let mut exit_on_eof = false;
    let (mut tls_cert, mut tls_key, mut tls_client_ca) = (None, None, None);
    let mut accounts = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--brokers" => match args.next().and_then(|n| n.parse().ok()) {
                Some(n) if n >= 1 => brokers = n,
                _ => return usage("--brokers takes a number from 1"),
            },
            "--exit-on-eof" => exit_on_eof = true,
            flag @ ("--tls-cert" | "--tls-key" | "--tls-client-ca") => {
                let Some(file) = args.next().map(PathBuf::from) else {
                    return usage(&format!("{flag} takes a file"));
                };
                match flag {
                    "--tls-cert" => tls_cert = Some(file),
                    "--tls-key" => tls_key = Some(file),
                    _ => tls_client_ca = Some(file),
                }
            }
            "--sasl" => match args.next().as_deref().map(sasl::Account::parse) {
                Some(Ok(account)) => accounts.push(account),
                Some(Err(why)) => return usage(&why),
                None => return usage("--sasl takes MECHANISM:CREDENTIALS"),
            },
            other => return usage(&format!("unknown argument {other:?}")),
        }
    }
    let tls = match (&tls_cert, &tls_key, &tls_client_ca) {
        (None, None, None) => None,
        (Some(cert), Some(key), client_ca) => match front::tls(cert, key, client_ca.as_deref()) {
            Ok(tls) => Some(tls),
            Err(e) => {
                eprintln!("kafka-mock: {e}");
                return ExitCode::FAILURE;
            }
        },
        (None, Some(_), _) => return usage("--tls-key needs --tls-cert"),
        (Some(_), None, _) => return usage("--tls-cert needs --tls-key"),
        (None, None, Some(_)) => return usage("--tls-client-ca needs --tls-cert and --tls-key"),
    };
    let front = match (tls, accounts.is_empty()) {
        (None, true) => None,
        (tls, _) => Some(front::Config {
            tls,
            sasl: (!accounts.is_empty()).then(|| sasl::Accounts::new(accounts)),
        }),
    };
    let debug = std::env::var("KAFKA_MOCK_DEBUG").ok();
    if debug.is_none() && front.is_none() {
        let cluster = match MockCluster::new(brokers) {
            Ok(cluster) => cluster,
            Err(e) => {
                eprintln!("kafka-mock: cannot start the mock cluster: {e}");
                return ExitCode::FAILURE;
            }
        };
        return serve(&cluster, &cluster.bootstrap_servers(), None, exit_on_eof);
    }
    // The cluster of a client: the same mock, made through the client
    // property that creates one, whose log is the client's and whose
    // handle reaches the brokers' advertised addresses.
    let mut config = ClientConfig::new();
    config.set("test.mock.num.brokers", brokers.to_string());
    if front.is_some() {
        // That client connects to the cluster like any other, plaintext
        // and without SASL whatever it is told; sent to the fronts by
        // their Metadata, it would fail there again and again, each time
        // a line on stderr. The brokers' addresses are IPv4: this keeps
        // it from connecting at all, and from re-bootstrapping, which
        // would triple its failures in the debug log.
        config
            .set("broker.address.family", "v6")
            .set("metadata.recovery.strategy", "none");
    }
    let quiet = debug.is_none();
    if let Some(debug) = debug {
        config
            .set("debug", debug)
            .set_log_level(RDKafkaLogLevel::Debug);
    }
    let client: ThreadedProducer<Stderr, NoCustomPartitioner> =
        match config.create_with_context(Stderr { quiet }) {
            Ok(client) => client,
            Err(e) => {
                eprintln!("kafka-mock: cannot start the mock cluster: {e}");
                return ExitCode::FAILURE;
            }
        };
    let Some(cluster) = client.client().mock_cluster() else {
        eprintln!("kafka-mock: the client made no mock cluster");
        return ExitCode::FAILURE;
    };
    // The mock writes this list once, at its start, broker 1 first: the
    // brokers' own addresses even after they advertise others.
    let own = cluster.bootstrap_servers();
    let Some(front) = front else {
        return serve(&cluster, &own, None, exit_on_eof);
    };
    let addrs: Vec<SocketAddr> = own.split(',').filter_map(|a| a.parse().ok()).collect();
    if addrs.len() != brokers as usize {
        eprintln!("kafka-mock: cannot read the brokers' addresses from {own:?}");
        return ExitCode::FAILURE;
    }
    let fronts = match Fronts::start(front, &addrs) {
        Ok(fronts) => fronts,
        Err(e) => {
            eprintln!("kafka-mock: cannot start the fronts: {e}");
            return ExitCode::FAILURE;
        }
    };
    for (id, at) in (1..).zip(fronts.addrs()) {
        if let Err(e) = advertise(client.client(), id, *at) {
            eprintln!("kafka-mock: {e}");
            return ExitCode::FAILURE;
        }
    }
    let bootstrap = fronts
        .addrs()
        .iter()
        .map(SocketAddr::to_string)
        .collect::<Vec<_>>()
        .join(",");
    serve(&cluster, &bootstrap, Some(&fronts), exit_on_eof)
}

/// Makes broker `id` advertise `at` (in Metadata and FindCoordinator
/// answers), which the rdkafka crate has no call for.
#[allow(unsafe_code)]
fn advertise<C: ClientContext>(client: &Client<C>, id: i32, at: SocketAddr) -> Result<(), String> {
    let host = CString::new(at.ip().to_string()).map_err(|e| e.to_string())?;
    // SAFETY: `client` owns the live rd_kafka_t behind native_ptr(), and
    // the mock cluster it made with test.mock.num.brokers lives as long as
    // it; rd_kafka_mock_broker_set_host_port copies `host` under the
    // cluster's lock and keeps no pointer to it.
    let advertised = unsafe {
        let cluster = rdkafka::bindings::rd_kafka_handle_mock_cluster(client.native_ptr());
        if !cluster.is_null() {
            rdkafka::bindings::rd_kafka_mock_broker_set_host_port(
                cluster,
                id,
                host.as_ptr(),
                c_int::from(at.port()),
            );
        }
        !cluster.is_null()
    };
    if advertised {
        Ok(())
    } else {
        Err("the client has no mock cluster to advertise the fronts in".into())
    }
}

/// Prints the bootstrap servers, then answers commands on stdin.
fn serve<C: ClientContext>(
    cluster: &MockCluster<'_, C>,
    bootstrap: &str,
    fronts: Option<&Fronts>,
    exit_on_eof: bool,
) -> ExitCode {
    let switch = |id: i32, up: bool| match fronts {
        Some(fronts) => fronts.switch(id, up),
        None => Ok(()),
    };
    let mut stdout = std::io::stdout();
    let _ = writeln!(stdout, "{bootstrap}");
    let _ = stdout.flush();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let answer = match line.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["down", id] => id
                .parse()
                .map_err(|_| format!("{id:?} is not a broker number"))
                .and_then(|id| {
                    cluster.broker_down(id).map_err(|e| e.to_string())?;
                    switch(id, false)
                }),
            ["up", id] => id
                .parse()
                .map_err(|_| format!("{id:?} is not a broker number"))
                .and_then(|id| {
                    cluster.broker_up(id).map_err(|e| e.to_string())?;
                    switch(id, true)
                }),
            ["leader", topic, partition, id] => {
                let id = match *id {
                    "none" => Ok(None),
                    id => id.parse().map(Some),
                };
                match (partition.parse(), id) {
                    (Ok(partition), Ok(id)) => cluster
                        .partition_leader(topic, partition, id)
                        .map_err(|e| e.to_string()),
                    _ => Err("write leader <topic> <partition> <broker|none>".into()),
                }
            }
            ["coordinator", group, id] => id
                .parse()
                .map_err(|_| format!("{id:?} is not a broker number"))
                .and_then(|id| {
                    cluster
                        .coordinator(MockCoordinator::Group(group.to_string()), id)
                        .map_err(|e| e.to_string())
                }),
            [] => continue,
            _ => Err(format!(
                "unknown command {line:?}; write down <broker>, up <broker>, leader <topic> <partition> <broker|none> or coordinator <group> <broker>"
            )),
        };
        let _ = match answer {
            Ok(()) => writeln!(stdout, "ok"),
            Err(e) => writeln!(stdout, "error: {e}"),
        };
        let _ = stdout.flush();
    }
    if exit_on_eof {
        return ExitCode::SUCCESS;
    }
    // Without --exit-on-eof, a closed stdin (`< /dev/null`) does not end
    // the cluster: it serves until killed.
    loop {
        std::thread::park();
    }
}

/// A client context that prints librdkafka's log to stderr, unless quiet
/// (no `KAFKA_MOCK_DEBUG`: the log is the client's own, of no use then).
struct Stderr {
    quiet: bool,
}

impl ClientContext for Stderr {
    fn log(&self, _level: RDKafkaLogLevel, facility: &str, message: &str) {
        if self.quiet {
            return;
        }
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        eprintln!("{:.3} {facility} {message}", at.as_secs_f64());
    }
}

impl ProducerContext for Stderr {
    type DeliveryOpaque = ();

    fn delivery(&self, _: &rdkafka::message::DeliveryResult<'_>, _: Self::DeliveryOpaque) {}
}

fn usage(why: &str) -> ExitCode {
    eprintln!("kafka-mock: {why}\n{USAGE}");
    ExitCode::from(2)
}
