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
//! With `KAFKA_MOCK_DEBUG` set (librdkafka's debug contexts: `mock`,
//! `mock,cgrp`, ...) the cluster logs what it does to stderr, its group
//! coordinator's joins, syncs and session expiries among it.
//!
//! `kafka-mock [--brokers N] [--exit-on-eof]`
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

use std::io::{BufRead, Write};
use std::process::ExitCode;

use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::mocking::{MockCluster, MockCoordinator};
use rdkafka::producer::{NoCustomPartitioner, Producer, ProducerContext, ThreadedProducer};

fn main() -> ExitCode {
    let mut brokers = 1;
    let mut exit_on_eof = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--brokers" => match args.next().and_then(|n| n.parse().ok()) {
                Some(n) if n >= 1 => brokers = n,
                _ => return usage("--brokers takes a number from 1"),
            },
            "--exit-on-eof" => exit_on_eof = true,
            other => return usage(&format!("unknown argument {other:?}")),
        }
    }
    if let Ok(debug) = std::env::var("KAFKA_MOCK_DEBUG") {
        // The cluster of a client that logs: the same mock, made through
        // the client property that creates one, whose log is the client's.
        let client: ThreadedProducer<Stderr, NoCustomPartitioner> = match ClientConfig::new()
            .set("test.mock.num.brokers", brokers.to_string())
            .set("debug", debug)
            .set_log_level(RDKafkaLogLevel::Debug)
            .create_with_context(Stderr)
        {
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
        return serve(&cluster, exit_on_eof);
    }
    let cluster = match MockCluster::new(brokers) {
        Ok(cluster) => cluster,
        Err(e) => {
            eprintln!("kafka-mock: cannot start the mock cluster: {e}");
            return ExitCode::FAILURE;
        }
    };
    serve(&cluster, exit_on_eof)
}

/// Prints the bootstrap servers, then answers commands on stdin.
fn serve<C: ClientContext>(cluster: &MockCluster<'_, C>, exit_on_eof: bool) -> ExitCode {
    let mut stdout = std::io::stdout();
    let _ = writeln!(stdout, "{}", cluster.bootstrap_servers());
    let _ = stdout.flush();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let answer = match line.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["down", id] => id
                .parse()
                .map_err(|_| format!("{id:?} is not a broker number"))
                .and_then(|id| cluster.broker_down(id).map_err(|e| e.to_string())),
            ["up", id] => id
                .parse()
                .map_err(|_| format!("{id:?} is not a broker number"))
                .and_then(|id| cluster.broker_up(id).map_err(|e| e.to_string())),
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

/// A client context that prints librdkafka's log to stderr.
struct Stderr;

impl ClientContext for Stderr {
    fn log(&self, _level: RDKafkaLogLevel, facility: &str, message: &str) {
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
    eprintln!("kafka-mock: {why}\nusage: kafka-mock [--brokers N] [--exit-on-eof]");
    ExitCode::from(2)
}
