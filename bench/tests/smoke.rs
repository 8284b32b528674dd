//! The harness's smoke run: tiny sizes, every part once, against the real
//! brokers and a debug build of courier. It checks that the harness works
//! (figures come out, the report is written), never how fast anything is.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn smoke_run_measures_every_part_and_writes_the_report() {
    let harness = PathBuf::from(env!("CARGO_BIN_EXE_courier-bench"));
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // The courier binary of the same profile, next to the harness.
    let status = Command::new(cargo)
        .args(["build", "-p", "courier", "--bin", "courier"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("cargo runs");
    assert!(status.success(), "building courier failed");
    let courier = harness.with_file_name("courier");
    let dir = tempfile::tempdir().expect("a temp dir");
    let report = dir.path().join("BENCHMARKS.md");
    let out = Command::new(&harness)
        .args(["all", "--smoke", "--courier"])
        .arg(&courier)
        .arg("--out")
        .arg(&report)
        .output()
        .expect("the harness runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");

    // Redis and embedded have figures; RabbitMQ and NATS have figures or
    // say why not.
    let row = |name: &str| {
        stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no {name} row in:\n{stdout}\n{stderr}"))
            .to_string()
    };
    for name in ["redis", "embedded"] {
        let line = row(name);
        let rate: f64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} drained nothing: {line}\n{stdout}\n{stderr}"));
        assert!(rate > 0.0, "{line}");
        assert!(!line.contains("n/a"), "{name}: {line}\n{stdout}\n{stderr}");
    }
    for name in ["amqp", "nats"] {
        row(name);
    }
    assert!(stdout.contains("limit (direct)"), "{stdout}");
    assert!(
        stdout.contains("retry backlog 10000: RSS"),
        "{stdout}\n{stderr}"
    );
    assert!(stdout.contains("0 delivered early"), "{stdout}");

    let text = std::fs::read_to_string(&report).expect("the report is written");
    for part in [
        "courier-bench:begin",
        "Smoke run",
        "### Throughput, cost and latency",
        "courier, Redis Streams",
        "### Retry backlog",
        "### Targets (issue 8)",
        "courier-bench:end",
    ] {
        assert!(text.contains(part), "{part:?} missing from:\n{text}");
    }
}
