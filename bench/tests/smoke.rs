//! The harness's smoke run: tiny sizes, every part once, against the real
//! brokers and a debug build of courier (courier's own `src/main.rs`, built
//! as this package's `courier-bench-courier` binary). It checks that the
//! harness works (figures come out, the report is written), never how fast
//! anything is.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn smoke_run_measures_every_part_and_writes_the_report() {
    let harness = PathBuf::from(env!("CARGO_BIN_EXE_courier-bench"));
    // courier's main, built by the cargo that built this test, with the same
    // features and profile (bench/Cargo.toml says why not `cargo build`).
    let courier = PathBuf::from(env!("CARGO_BIN_EXE_courier-bench-courier"));
    let dir = tempfile::tempdir().expect("a temp dir");
    let report = dir.path().join("BENCHMARKS.md");
    let out = Command::new(&harness)
        .args(["all", "--smoke", "--allow-dirty", "--courier"])
        .arg(&courier)
        .arg("--out")
        .arg(&report)
        .output()
        .expect("the harness runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");

    // One line per source and consumer: source, who, msg/s, × bare, peak MB,
    // CPU-s/10k, × bare, instructions/msg, × bare, syscalls/msg, × bare, ...
    let row = |name: &str, who: &str| -> Vec<String> {
        stdout
            .lines()
            .find(|l| {
                let mut words = l.split_whitespace();
                words.next() == Some(name) && words.next() == Some(who)
            })
            .unwrap_or_else(|| panic!("no {name} {who} row in:\n{stdout}\n{stderr}"))
            .split_whitespace()
            .map(str::to_string)
            .collect()
    };
    let number = |cells: &[String], at: usize, what: &str| -> f64 {
        cells[at]
            .parse()
            .unwrap_or_else(|_| panic!("no {what} in {cells:?}\n{stdout}\n{stderr}"))
    };
    // Redis and embedded have figures for courier and the bare loop;
    // RabbitMQ and NATS have figures or say why not.
    for name in ["redis", "embedded"] {
        for who in ["bare", "courier"] {
            let cells = row(name, who);
            assert!(number(&cells, 2, "msg/s") > 0.0, "{cells:?}");
        }
        let courier = row(name, "courier");
        assert!(
            number(&courier, 3, "ratio to the bare loop") > 0.0,
            "{courier:?}"
        );
    }
    // Counted on Redis only in a smoke run: instructions and system calls
    // per message, for both.
    for who in ["bare", "courier"] {
        let cells = row("redis", who);
        assert!(number(&cells, 7, "instructions") > 0.0, "{cells:?}");
        assert!(number(&cells, 9, "system calls") > 0.0, "{cells:?}");
    }
    for name in ["amqp", "nats"] {
        row(name, "bare");
        row(name, "courier");
    }
    assert!(stdout.contains("the app's limit:"), "{stdout}");
    assert!(stdout.contains("commit "), "{stdout}");
    assert!(
        stdout.contains("retry backlog 10000: RSS"),
        "{stdout}\n{stderr}"
    );
    assert!(stdout.contains("0 delivered early"), "{stdout}");
    assert!(
        stdout.contains("two replicas: ") && stdout.contains(" distinct, 0 twice"),
        "{stdout}\n{stderr}"
    );

    let text = std::fs::read_to_string(&report).expect("the report is written");
    // The broker server's CPU over the Redis drains, measured for both
    // consumers ("-" when it was not). A smoke drain is short enough for
    // the server to use less than one clock tick, so 0 is a measurement.
    let server = text
        .lines()
        .find(|l| l.starts_with("| Redis Streams") && l.matches('|').count() == 6)
        .unwrap_or_else(|| panic!("no server CPU row for Redis in:\n{text}"));
    let cells: Vec<&str> = server.split('|').map(str::trim).collect();
    for (at, who) in [(2, "bare loop"), (3, "courier")] {
        let cpu: f64 = cells[at]
            .parse()
            .unwrap_or_else(|_| panic!("no server CPU for the {who} in {server:?}"));
        assert!(cpu >= 0.0, "{server:?}");
    }
    // At rest and waking, on Redis in a smoke run: CPU, requests a second,
    // start to first delivery and pickup are figures for both consumers.
    for who in ["bare", "courier"] {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("| Redis Streams | {who} |")))
            .unwrap_or_else(|| panic!("no rest and wake row for the Redis {who} in:\n{text}"));
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        for (at, what) in [(3, "CPU"), (4, "requests"), (6, "start"), (7, "pickup")] {
            let value: f64 = cells[at]
                .parse()
                .unwrap_or_else(|_| panic!("no {what} figure in {line:?}"));
            assert!(value >= 0.0, "{line:?}");
        }
    }
    for part in [
        "courier-bench:begin",
        "Smoke run",
        "| commit | `",
        "### courier against the bare loop of each broker",
        "| bare loop, Redis Streams",
        "| **courier**, Redis Streams",
        "### Two replicas, one group",
        "### Retry backlog",
        "### At rest, and waking (issue 28)",
        "### Targets (issue 15)",
        "courier-bench:end",
    ] {
        assert!(text.contains(part), "{part:?} missing from:\n{text}");
    }
}
