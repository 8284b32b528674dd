//! examples/fastapi-orders behind the built `courier`, on Redis: the
//! sidecar is killed with `kill -9` three times mid-flow and started again,
//! so deliveries the app applied but courier never acked are delivered
//! again. The service's UNIQUE Idempotency-Key turns those into "already
//! charged": its SQLite database shows every valid order charged exactly
//! once, every invalid one dead-lettered and never charged.
//!
//! The service runs in a venv of its own (`examples/fastapi-orders/.venv`,
//! made by its `setup-venv` from the pinned requirements on first use).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::*;

const SETTLE: Duration = Duration::from_secs(120);

fn example_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/fastapi-orders")
}

/// The example's venv, made on first use.
fn venv() -> PathBuf {
    let out = Command::new(example_dir().join("setup-venv"))
        .stderr(Stdio::inherit())
        .output()
        .expect("run examples/fastapi-orders/setup-venv");
    assert!(out.status.success(), "setup-venv failed: {}", out.status);
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// uvicorn serving the example; killed when dropped.
struct Orders {
    child: Child,
    addr: SocketAddr,
    db: PathBuf,
    venv: PathBuf,
}

impl Orders {
    async fn start(db: &Path, rate_limit: u32) -> Self {
        let venv = venv();
        let port = free_port();
        let child = Command::new(venv.join("bin/uvicorn"))
            .args(["app:app", "--app-dir"])
            .arg(example_dir())
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--log-level", "warning"])
            .env("ORDERS_DB", db)
            .env("ORDERS_RATE_LIMIT", rate_limit.to_string())
            // Deliveries take a moment, so some are in flight at each kill.
            .env("ORDERS_WORK_MS", "10")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("start uvicorn");
        let orders = Self {
            child,
            addr: ([127, 0, 0, 1], port).into(),
            db: db.to_path_buf(),
            venv,
        };
        wait_for("the orders service to answer", SETTLE, async || {
            get_status(orders.addr, "/healthz").await == 200
        })
        .await;
        orders
    }

    fn url(&self) -> String {
        format!("http://{}/orders", self.addr)
    }

    /// What the database says was charged (count_charges.py).
    fn counts(&self) -> serde_json::Value {
        let out = Command::new(self.venv.join("bin/python"))
            .arg(example_dir().join("count_charges.py"))
            .arg(&self.db)
            .output()
            .expect("run count_charges.py");
        assert!(
            out.status.success(),
            "count_charges.py: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("count_charges.py prints JSON")
    }
}

impl Drop for Orders {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_flow_charges_every_order_exactly_once() {
    const ORDERS: usize = 1000;
    const INVALID: usize = 25;
    const KILLS: usize = 3;
    let dir = tempfile::tempdir().unwrap();
    // A rate limit under what courier could send, so 429 + Retry-After is
    // part of the run too.
    let orders = Orders::start(&dir.path().join("orders.db"), 150).await;
    let fixture = Fixture::redis();
    let source = fixture.open().await;
    let json = vec![("content-type".to_string(), "application/json".to_string())];
    let mut cents = 0u64;
    for i in 0..ORDERS + INVALID {
        // Every 41st order is invalid (an amount of 0): 422, dead-lettered.
        let invalid = i % 41 == 40 && i / 41 < INVALID;
        let amount = if invalid { 0 } else { 100 + i as u64 % 900 };
        let body = format!(
            r#"{{"order_id": "order-{i}", "customer": "customer-{}", "amount_cents": {amount}, "currency": "EUR"}}"#,
            i % 7
        );
        if !invalid {
            cents += amount;
        }
        source.send(body.into(), &json).await.expect("send");
    }
    let policy = write_policy(
        dir.path(),
        "maxAttempts: 10\ntimeout: 5s\nbackoff: {initial: 100ms, max: 1s}",
    );
    let args: Vec<String> = [
        "--source",
        &fixture.source_arg(),
        "--queue",
        &fixture.queue,
        "--app",
        &orders.url(),
        "--policy-file",
        &policy.display().to_string(),
        "--consumer",
        "replica-a",
        "--concurrency",
        "16",
        "--listen",
        "127.0.0.1:0",
    ]
    .map(str::to_string)
    .to_vec();

    let charged = |o: &Orders| o.counts()["charges"].as_u64().unwrap() as usize;
    let mut thresholds: Vec<usize> = (0..KILLS)
        .map(|_| ORDERS / 10 + rand::random::<u32>() as usize % (ORDERS * 7 / 10))
        .collect();
    thresholds.sort();
    let mut courier = CourierProcess::run(&args);
    for (kill, threshold) in thresholds.iter().enumerate() {
        wait_for("orders charged before the kill", SETTLE, async || {
            charged(&orders) >= *threshold
        })
        .await;
        courier.kill9();
        eprintln!("kill -9 #{}: {} charged", kill + 1, charged(&orders));
        // The same --consumer: it reads back what the killed one left
        // pending at once.
        courier = CourierProcess::run(&args);
    }
    wait_for("every valid order charged", SETTLE, async || {
        orders.counts()["orders_charged"].as_u64() == Some(ORDERS as u64)
    })
    .await;
    wait_settled(&source, SETTLE).await;
    courier.terminate();
    assert!(courier.exit_within(Duration::from_secs(30)).await.success());

    let counts = orders.counts();
    eprintln!("fastapi-orders after {KILLS} kills: {counts}");
    assert_eq!(
        counts["double_charged"],
        serde_json::json!([]),
        "no order is charged twice"
    );
    assert_eq!(counts["charges"], ORDERS, "one charge per valid order");
    assert_eq!(counts["charged_cents"], cents, "the balances add up");
    let letters = source
        .dead_letters(&fixture.dlq(), 1000)
        .await
        .expect("dead letters");
    assert_eq!(letters.len(), INVALID, "every invalid order dead-lettered");
    for letter in &letters {
        assert_eq!(letter.field("courier-reason"), Some("permanent-status"));
        assert_eq!(letter.field("courier-status"), Some("422"));
        assert!(
            letter
                .field("courier-response-excerpt")
                .is_some_and(|e| e.contains("invalid order")),
            "{letter:?}"
        );
    }
}
