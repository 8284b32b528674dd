//! The RetryPolicy as an operator meets it: the real `kubectl` (v1.32, on
//! PATH) applies, edits and deletes policies on a stand-in API server
//! (`scripts/kube-stub`: kmock plus what kubectl and the watcher need),
//! while the built `courier` binary runs as a child process against a real
//! Redis and a real HTTP app, following the policy with `--policy`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::common::*;

const SETTLE: Duration = Duration::from_secs(20);
const NS: &str = "shop";
const POD: &str = "courier-test-0";

// === The sidecar as a child process ===

struct Sidecar {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Sidecar {
    fn start(stub: &KubeStub, fixture: &Fixture, app: &TestApp, policy: &str) -> Self {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let log = stub.dir.path().join(format!("courier-{policy}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_courier"))
            .args([
                "run",
                "--source",
                &fixture.source_arg(),
                "--queue",
                &fixture.queue,
            ])
            .args(["--app", &app.url(), "--policy", policy])
            .args(["--listen", &addr.to_string(), "--drain-timeout", "2s"])
            // The scripted 503s here are on purpose, many in a row; the
            // app-health gate would pause pulling and slow the test down.
            .args(["--app-failure-run", "0"])
            .env_remove("COURIER_POLICY_FILE")
            .env("KUBECONFIG", stub.sidecar_kubeconfig())
            .env("POD_NAMESPACE", NS)
            .env("POD_NAME", POD)
            .env("COURIER_LOG_LEVEL", "info")
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("start courier");
        Self { child, addr, log }
    }

    async fn wait_ready(&self) {
        wait_for(
            "/readyz to answer 200",
            Duration::from_secs(30),
            async || get(self.addr, "/readyz").await.starts_with("HTTP/1.1 200"),
        )
        .await;
    }

    async fn metrics(&self) -> String {
        scrape(self.addr).await
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, as Kubernetes stops a pod, and a clean exit.
    fn stop(mut self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let exit = self.child.wait().unwrap();
        assert!(
            exit.success(),
            "courier exited with {exit}:\n{}",
            self.log()
        );
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

async fn get(addr: SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return String::new();
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut out = String::new();
    let _ = stream.read_to_string(&mut out).await;
    out
}

async fn dead_letter_field(fixture: &Fixture, id: &str, field: &str) -> Option<String> {
    dead_letter_field_in(fixture, &fixture.dlq(), id, field).await
}

/// [`dead_letter_field`] of a letter in the dead-letter queue `dlq`.
async fn dead_letter_field_in(
    fixture: &Fixture,
    dlq: &str,
    id: &str,
    field: &str,
) -> Option<String> {
    let source = fixture.open().await;
    let letters = source.dead_letters(dlq, 1000).await.unwrap();
    letters
        .iter()
        .find(|l| l.field("courier-message-id") == Some(id))
        .and_then(|l| l.field(field).map(str::to_string))
}

const ORDERS: &str = "apiVersion: courier.dev/v1alpha1
kind: RetryPolicy
metadata:
  name: orders
spec:
  maxAttempts: 3
  timeout: 500ms
  backoff: {initial: 20ms, max: 50ms, jitter: none}
";

// === The tests ===

/// apply, run, edit (3 -> 1 attempts), a refused edit, delete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_apply_edit_and_delete_steer_the_running_sidecar() {
    let stub = KubeStub::start(NS);
    stub.apply(ORDERS);
    let fixture = Fixture::redis();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let sidecar = Sidecar::start(&stub, &fixture, &app, "orders");
    sidecar.wait_ready().await;
    assert!(
        sidecar
            .metrics()
            .await
            .contains("courier_policy_generation{policy=\"orders\"} 1")
    );

    let first = fixture.send(&source, "script:503\nfirst").await;
    wait_settled(&source, SETTLE).await;
    assert_eq!(app.received_body(b"script:503\nfirst").len(), 3);
    assert_eq!(
        dead_letter_field(&fixture, &first, "courier-policy")
            .await
            .as_deref(),
        Some("orders@1")
    );

    // kubectl edit: maxAttempts 3 -> 1. Edit-to-effect is measured from the
    // moment kubectl returns (the API server has the change) to the sidecar
    // having put it in force.
    let started = Instant::now();
    stub.edit("orders", "s/maxAttempts: 3/maxAttempts: 1/");
    let edited = Instant::now();
    wait_for(
        "the edit to take effect",
        Duration::from_secs(2),
        async || {
            sidecar
                .metrics()
                .await
                .contains("courier_policy_generation{policy=\"orders\"} 2")
        },
    )
    .await;
    let effect = edited.elapsed();
    println!(
        "edit-to-effect: {} ms after kubectl edit returned ({} ms including kubectl itself)",
        effect.as_millis(),
        started.elapsed().as_millis()
    );
    let second = fixture.send(&source, "script:503\nsecond").await;
    wait_settled(&source, SETTLE).await;
    assert_eq!(
        app.received_body(b"script:503\nsecond").len(),
        1,
        "after the edit the next failing message is dead-lettered after one attempt"
    );
    assert_eq!(
        dead_letter_field(&fixture, &second, "courier-reason")
            .await
            .as_deref(),
        Some("attempts-exhausted")
    );
    assert_eq!(
        dead_letter_field(&fixture, &second, "courier-policy")
            .await
            .as_deref(),
        Some("orders@2")
    );
    assert_eq!(
        stub.kubectl_ok(&[
            "get",
            "rp",
            "orders",
            "-o",
            "jsonpath={.status.observedGeneration} {.status.conditions[0].type}={.status.conditions[0].status}",
        ]),
        "2 Accepted=True"
    );

    // The CRD's printer columns, evaluated by kubectl's own JSONPath engine
    // (the stub serves no Tables, so `kubectl get rp` cannot show them).
    let columns: Vec<String> = courier::policy::crd::definition().spec.versions[0]
        .additional_printer_columns
        .iter()
        .flatten()
        .filter(|c| c.name != "Age")
        .map(|c| format!("{}:{}", c.name.to_uppercase(), c.json_path))
        .collect();
    let table = stub.kubectl_ok(&[
        "get",
        "rp",
        "orders",
        "-o",
        &format!("custom-columns={}", columns.join(",")),
    ]);
    let rows: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows,
        [
            vec![
                "ATTEMPTS", "INITIAL", "MAX", "TIMEOUT", "ACCEPTED", "PAUSED"
            ],
            vec!["1", "20ms", "50ms", "500ms", "True", "<none>"]
        ],
        "{table}"
    );

    // A change the sidecar cannot use (the stub, like a cluster with an
    // older CRD, does not validate): refused loudly, the last good stays.
    stub.edit("orders", "s/maxAttempts: 1/maxAttempts: 0/");
    wait_for(
        "the refusal to be counted",
        Duration::from_secs(5),
        async || {
            sidecar
                .metrics()
                .await
                .contains("courier_policy_reloads_total{result=\"rejected\"} 1")
        },
    )
    .await;
    assert!(
        sidecar.log().contains("policy change rejected"),
        "{}",
        sidecar.log()
    );
    wait_for("the Event on the pod", Duration::from_secs(5), async || {
        let events = stub.json(&["get", "events.v1.events.k8s.io", "-n", NS]);
        events["items"].as_array().unwrap().iter().any(|e| {
            e["reason"] == "PolicyRejected"
                && e["regarding"]["kind"] == "Pod"
                && e["regarding"]["name"] == POD
                && e["note"]
                    .as_str()
                    .unwrap_or("")
                    .contains("spec.maxAttempts")
        })
    })
    .await;
    wait_for(
        "status Accepted=False",
        Duration::from_secs(5),
        async || {
            let rp = stub.json(&["get", "rp", "orders"]);
            rp["status"]["observedGeneration"] == 3
                && rp["status"]["conditions"][0]["status"] == "False"
        },
    )
    .await;
    fixture.send(&source, "script:503\nthird").await;
    wait_settled(&source, SETTLE).await;
    assert_eq!(
        app.received_body(b"script:503\nthird").len(),
        1,
        "the last good policy (maxAttempts 1) stays in force"
    );

    // kubectl delete: the built-in defaults (5 attempts) come back.
    stub.kubectl_ok(&["delete", "rp", "orders"]);
    wait_for(
        "the defaults to take over",
        Duration::from_secs(2),
        async || {
            sidecar
                .metrics()
                .await
                .contains("courier_policy_generation{policy=\"default\"} 0")
        },
    )
    .await;
    assert!(sidecar.log().contains("the built-in defaults are in force"));
    let fourth = fixture.send(&source, "script:503,503,200\nfourth").await;
    wait_settled(&source, SETTLE).await;
    assert_eq!(
        app.received_body(b"script:503,503,200\nfourth").len(),
        3,
        "the defaults retry where maxAttempts 1 would have given up"
    );
    assert_eq!(
        dead_letter_field(&fixture, &fourth, "courier-reason").await,
        None
    );
    sidecar.stop();
}

/// Both examples, applied with kubectl, each followed by a sidecar.
const FLOW: &str = "apiVersion: courier.dev/v1alpha1
kind: RetryPolicy
metadata:
  name: flow
spec:
  maxAttempts: 3
  timeout: 5s
";

/// Each flow-control field edited with `kubectl edit` while the sidecar
/// runs: `rateLimit` paces deliveries, `paused` stops them and shows in
/// the status's `Paused` condition, `maxAge` dead-letters what waited
/// through the pause, and `pausedUntil` resumes by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_edit_of_each_flow_control_field_steers_the_sidecar() {
    let stub = KubeStub::start(NS);
    stub.apply(FLOW);
    let fixture = Fixture::redis();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let sidecar = Sidecar::start(&stub, &fixture, &app, "flow");
    sidecar.wait_ready().await;
    let gauge = async |name: &str| series(&sidecar.metrics().await, name, &fixture.queue);
    let paused_condition = || {
        stub.kubectl_ok(&[
            "get",
            "rp",
            "flow",
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Paused\")].status} {.status.conditions[?(@.type==\"Paused\")].reason}",
        ])
    };

    // rateLimit: 5 a second, a burst of 1: ten messages take about 1.8 s.
    stub.edit(
        "flow",
        r"s/^spec:$/spec:\n  rateLimit:\n    perSecond: 5\n    burst: 1/",
    );
    wait_for("the rate limit", Duration::from_secs(5), async || {
        gauge("courier_rate_limit").await == Some(5.0)
    })
    .await;
    for i in 0..10 {
        fixture.send(&source, format!("paced-{i}")).await;
    }
    wait_settled(&source, SETTLE).await;
    let times: Vec<Instant> = app.received().iter().map(|r| r.at).collect();
    assert_eq!(times.len(), 10);
    let span = *times.iter().max().unwrap() - *times.iter().min().unwrap();
    assert!(
        span >= Duration::from_millis(1600),
        "ten deliveries at 5 a second with a burst of 1 took {span:?}"
    );

    // paused: true, with a reason.
    stub.edit(
        "flow",
        r"s/^spec:$/spec:\n  paused: true\n  pausedReason: payments incident/",
    );
    wait_for("the pause", Duration::from_secs(2), async || {
        gauge("courier_paused").await == Some(1.0)
    })
    .await;
    wait_for("the Paused condition", Duration::from_secs(5), async || {
        paused_condition() == "True Paused"
    })
    .await;
    let message = stub.kubectl_ok(&[
        "get",
        "rp",
        "flow",
        "-o",
        "jsonpath={.status.conditions[?(@.type==\"Paused\")].message}",
    ]);
    assert!(message.contains("payments incident"), "{message}");
    let held = fixture.send(&source, "waited-through-the-pause").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(app.received().len(), 10, "delivered while paused");
    assert!(
        get(sidecar.addr, "/readyz")
            .await
            .starts_with("HTTP/1.1 200"),
        "a pause is not an outage"
    );

    // Resume with maxAge 1s: the message that waited through the pause is
    // dead-lettered as expired, never offered.
    stub.edit("flow", r"s/^  paused: true$/  paused: false\n  maxAge: 1s/");
    wait_settled(&source, SETTLE).await;
    assert_eq!(
        dead_letter_field(&fixture, &held, "courier-reason")
            .await
            .as_deref(),
        Some("expired")
    );
    assert!(app.received_body(b"waited-through-the-pause").is_empty());
    assert_eq!(gauge("courier_paused").await, Some(0.0));
    wait_for(
        "the Paused condition to clear",
        Duration::from_secs(5),
        async || paused_condition() == "False Running",
    )
    .await;

    // pausedUntil 3 s from now (maxAge taken out, or what waits for the
    // end would expire): paused, then resumed by itself.
    let until = courier::model::rfc3339(std::time::SystemTime::now() + Duration::from_secs(3));
    stub.edit(
        "flow",
        &format!(r"s/^  paused: false$/  paused: true\n  pausedUntil: {until}/;/^  maxAge: 1s$/d"),
    );
    wait_for("the timed pause", Duration::from_secs(2), async || {
        gauge("courier_paused").await == Some(1.0)
    })
    .await;
    assert_eq!(paused_condition(), "True PausedUntil");
    fixture.send(&source, "after-the-timed-pause").await;
    wait_for(
        "the pause to end by itself",
        Duration::from_secs(8),
        async || !app.received_body(b"after-the-timed-pause").is_empty(),
    )
    .await;
    let resumed = app.received_body(b"after-the-timed-pause")[0].wall;
    let until = courier::model::parse_time(until.as_bytes()).unwrap();
    assert!(resumed >= until, "delivered before pausedUntil");
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_examples_applied_with_kubectl_do_what_they_say() {
    let stub = KubeStub::start(NS);
    stub.kubectl_ok(&[
        "apply",
        "-f",
        root().join("examples/payments.yaml").to_str().unwrap(),
        "-f",
        root()
            .join("examples/fire-and-forget.yaml")
            .to_str()
            .unwrap(),
    ]);
    let app = TestApp::start().await;
    let (forget_queue, pay_queue) = (Fixture::redis(), Fixture::redis());
    let forget = Sidecar::start(&stub, &forget_queue, &app, "fire-and-forget");
    let pay = Sidecar::start(&stub, &pay_queue, &app, "payments");
    forget.wait_ready().await;
    pay.wait_ready().await;

    let forget_source = forget_queue.open().await;
    let dropped = forget_queue
        .send(&forget_source, "script:503\nforget")
        .await;
    let pay_source = pay_queue.open().await;
    pay_queue.send(&pay_source, "script:429ra1,200\npay").await;
    wait_settled(&forget_source, SETTLE).await;
    wait_settled(&pay_source, SETTLE).await;

    assert_eq!(app.received_body(b"script:503\nforget").len(), 1);
    assert_eq!(
        dead_letter_field(&forget_queue, &dropped, "courier-policy")
            .await
            .as_deref(),
        Some("fire-and-forget@1")
    );
    let paid = app.received_body(b"script:429ra1,200\npay");
    assert_eq!(paid.len(), 2, "retried once, then acked");
    let waited = paid[1].at - paid[0].at;
    assert!(
        waited >= Duration::from_millis(950),
        "Retry-After: 1 is honored, waited {waited:?}"
    );
    forget.stop();
    pay.stop();
}

/// `examples/app-starting.yaml` applied with kubectl: a sidecar following it
/// retries a 404, and honours the app's `Courier-Dead-Letter`; after
/// `kubectl edit` adds `appDirectives: false`, the header counts no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_app_starting_example_and_app_directives_through_kubectl() {
    let stub = KubeStub::start(NS);
    stub.kubectl_ok(&[
        "apply",
        "-f",
        root().join("examples/app-starting.yaml").to_str().unwrap(),
    ]);
    let fixture = Fixture::redis();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let sidecar = Sidecar::start(&stub, &fixture, &app, "app-starting");
    sidecar.wait_ready().await;

    let starting = "script:404,200\nstarting";
    let first = "script:500+courier-dead-letter=poison\nfirst";
    fixture.send(&source, starting).await;
    let poisoned = fixture.send(&source, first).await;
    wait_settled(&source, SETTLE).await;
    assert_eq!(app.received_body(starting.as_bytes()).len(), 2);
    assert_eq!(app.received_body(first.as_bytes()).len(), 1);
    for (field, value) in [
        ("courier-reason", "app-dead-letter"),
        ("courier-app-directive", "Courier-Dead-Letter: poison"),
        ("courier-policy", "app-starting@1"),
    ] {
        assert_eq!(
            dead_letter_field(&fixture, &poisoned, field)
                .await
                .as_deref(),
            Some(value),
            "{field}"
        );
    }

    stub.edit(
        "app-starting",
        "s/^  maxAttempts: 6$/  maxAttempts: 6\\n  appDirectives: false/",
    );
    wait_for("the edit to take effect", SETTLE, async || {
        sidecar
            .metrics()
            .await
            .contains("courier_policy_generation{policy=\"app-starting\"} 2")
    })
    .await;
    let second = "script:500+courier-dead-letter=poison,200\nsecond";
    fixture.send(&source, second).await;
    wait_settled(&source, SETTLE).await;
    assert_eq!(
        app.received_body(second.as_bytes()).len(),
        2,
        "with appDirectives: false the 500 is retried, then acked"
    );
    assert_eq!(fixture.dead_letters(&source).await.len(), 1);
    sidecar.stop();
}

/// `--policy` and `--policy-file` name two sources for one thing.
#[test]
fn policy_and_policy_file_together_are_a_usage_error() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_courier"));
        command
            .args(["run", "--source", "embedded:/tmp/x", "--queue", "q"])
            .args(args)
            .env_remove("COURIER_POLICY")
            .env_remove("COURIER_POLICY_FILE")
            .env_remove("POD_NAMESPACE");
        for (k, v) in env {
            command.env(k, v);
        }
        command.output().unwrap()
    };
    for (args, env) in [
        (
            &["--policy", "orders", "--policy-file", "/tmp/p.yaml"][..],
            &[][..],
        ),
        (
            &["--policy-file", "/tmp/p.yaml"][..],
            &[("COURIER_POLICY", "orders")][..],
        ),
    ] {
        let out = run(args, env);
        assert_eq!(out.status.code(), Some(2), "{args:?} {env:?}: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("--policy"), "{stderr}");
    }
    // Outside a pod, without POD_NAMESPACE, there is no namespace to look in.
    let out = run(&["--policy", "orders"], &[]);
    if !Path::new(courier::policy::cluster::SERVICE_ACCOUNT_NAMESPACE).exists() {
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("POD_NAMESPACE"));
    }
}

/// The API goes away: the sidecar keeps the last good policy and goes on
/// delivering, retries with backoff, and follows the policy again once the
/// API is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_outage_keeps_the_last_good_policy_and_reconnects() {
    let mut stub = KubeStub::start(NS);
    stub.apply(ORDERS);
    let fixture = Fixture::redis();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let sidecar = Sidecar::start(&stub, &fixture, &app, "orders");
    sidecar.wait_ready().await;

    stub.stop();
    wait_for(
        "the sidecar to notice",
        Duration::from_secs(10),
        async || sidecar.log().contains("lost the RetryPolicy watch"),
    )
    .await;
    fixture.send(&source, "script:503\nduring").await;
    wait_settled(&source, SETTLE).await;
    assert_eq!(
        app.received_body(b"script:503\nduring").len(),
        3,
        "the last good policy (3 attempts) stays in force"
    );
    assert!(
        get(sidecar.addr, "/readyz")
            .await
            .starts_with("HTTP/1.1 200")
    );

    stub.restart();
    stub.apply(&ORDERS.replace("maxAttempts: 3", "maxAttempts: 1"));
    wait_for(
        "the sidecar to reconnect",
        Duration::from_secs(40),
        async || {
            sidecar
                .metrics()
                .await
                .contains("courier_policy_reloads_total{result=\"applied\"} 2")
        },
    )
    .await;
    fixture.send(&source, "script:503\nafter").await;
    wait_settled(&source, SETTLE).await;
    assert_eq!(app.received_body(b"script:503\nafter").len(), 1);
    sidecar.stop();
}

/// The sidecar's service account may not read RetryPolicies in its
/// namespace (issue 16: a namespace outside `sidecar.namespaces`): it pulls
/// nothing, `/readyz` says what to grant, `courier_policy_ready` is 0, and
/// the warning is not repeated at every retry. Once the RoleBinding exists
/// the watcher's next retry reads the policy: ready, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forbidden_policy_says_what_to_grant_and_a_grant_makes_it_ready() {
    let stub = KubeStub::start_bare(NS, true);
    stub.install_crd();
    stub.apply(ORDERS);
    let fixture = Fixture::redis();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    fixture.send(&source, "waiting for the grant").await;
    let sidecar = Sidecar::start(&stub, &fixture, &app, "orders");
    let grant = "policy shop/orders: forbidden (403): grant get, list, watch on retrypolicies.courier.dev in namespace shop";
    wait_for("/readyz to say what to grant", SETTLE, async || {
        let answer = get(sidecar.addr, "/readyz").await;
        answer.starts_with("HTTP/1.1 503") && answer.contains(grant)
    })
    .await;
    assert!(
        sidecar.metrics().await.contains("courier_policy_ready 0\n"),
        "{}",
        sidecar.metrics().await
    );
    // Two retries of the watcher's backoff (0.8 s, then 1.6 s): the
    // message waits and the warning is not repeated.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        app.received().is_empty(),
        "nothing is pulled while forbidden"
    );
    let warnings = sidecar.log().matches("cannot read the RetryPolicy").count();
    assert_eq!(warnings, 1, "{}", sidecar.log());
    assert!(sidecar.log().contains(grant), "{}", sidecar.log());

    stub.apply(
        "apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: courier-sidecar, namespace: shop}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: courier-sidecar}
subjects: [{kind: ServiceAccount, name: default, namespace: shop}]
",
    );
    sidecar.wait_ready().await;
    wait_for("the waiting message delivered", SETTLE, async || {
        app.received_body(b"waiting for the grant").len() == 1
    })
    .await;
    let metrics = sidecar.metrics().await;
    assert!(metrics.contains("courier_policy_ready 1\n"), "{metrics}");
    assert!(
        metrics.contains("courier_policy_generation{policy=\"orders\"} 1"),
        "{metrics}"
    );
    assert!(sidecar.log().contains("the RetryPolicy can be read now"));
    sidecar.stop();
}

/// No RetryPolicy CRD in the cluster: the API server answers 404, and
/// `/readyz` says to install it; installing it makes the sidecar ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_crd_says_what_to_install_and_installing_it_makes_it_ready() {
    let stub = KubeStub::start_bare(NS, false);
    let fixture = Fixture::redis();
    let app = TestApp::start().await;
    let sidecar = Sidecar::start(&stub, &fixture, &app, "orders");
    wait_for("/readyz to say what to install", SETTLE, async || {
        let answer = get(sidecar.addr, "/readyz").await;
        answer.starts_with("HTTP/1.1 503")
            && answer.contains("policy shop/orders: not found (404)")
            && answer.contains("install the CRD")
    })
    .await;
    assert!(sidecar.metrics().await.contains("courier_policy_ready 0\n"));

    stub.install_crd();
    stub.apply(ORDERS);
    sidecar.wait_ready().await;
    let metrics = sidecar.metrics().await;
    assert!(metrics.contains("courier_policy_ready 1\n"), "{metrics}");
    assert!(
        metrics.contains("courier_policy_generation{policy=\"orders\"} 1"),
        "{metrics}"
    );
    sidecar.stop();
}

/// Found at 21da363, trying it as a new user would: `courier dlq list` with
/// the sidecar's COURIER_SOURCE and COURIER_QUEUE ignored the policy's
/// deadLetterQueue and printed an empty table, exit 0, while the letters
/// sat in the configured queue. With the sidecar's COURIER_POLICY in the
/// environment (as in its container) the command reads the RetryPolicy
/// and lists the letters where the sidecar put them; `--dlq` still wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_list_with_the_sidecars_environment_finds_the_policys_dead_letters() {
    let stub = KubeStub::start(NS);
    let fixture = Fixture::redis();
    let parked = format!("{}.parked", fixture.queue);
    stub.apply(&format!("{ORDERS}  deadLetterQueue: {parked}\n"));
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let sidecar = Sidecar::start(&stub, &fixture, &app, "orders");
    sidecar.wait_ready().await;
    let id = fixture.send(&source, "script:400\nparked one").await;
    wait_for("the dead letter", SETTLE, async || {
        dead_letter_field_in(&fixture, &parked, &id, "courier-reason")
            .await
            .is_some()
    })
    .await;
    drop(sidecar);

    let list = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_courier"))
            .args(["dlq", "list", "--output", "json"])
            .args(extra)
            .env("COURIER_SOURCE", fixture.source_arg())
            .env("COURIER_QUEUE", &fixture.queue)
            .env("COURIER_POLICY", "orders")
            .env_remove("COURIER_POLICY_FILE")
            .env_remove("COURIER_DLQ")
            .env("KUBECONFIG", stub.sidecar_kubeconfig())
            .env("POD_NAMESPACE", NS)
            .output()
            .expect("run courier dlq list")
    };
    let out = list(&[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(stdout.contains(&id), "{stdout}");
    let listed: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let letter = listed["id"].as_str().unwrap().to_string();
    let default = format!("{}.dlq", fixture.queue);
    let out = list(&["--dlq", &default]);
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 0);

    // The purge's audit trail: the caller as the API server names it (the
    // stub reads the token `user:NAME` as that user), on stderr and as an
    // Event on the RetryPolicy.
    let alice = stub.dir.path().join("alice-kubeconfig");
    let config = std::fs::read_to_string(stub.kubeconfig()).unwrap().replace(
        "users: []\n",
        "users:\n- name: alice\n  user:\n    token: user:alice\n",
    );
    let config = config.replace("    namespace:", "    user: alice\n    namespace:");
    std::fs::write(&alice, config).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_courier"))
        .args([
            "dlq",
            "purge",
            "--id",
            &letter,
            "--yes",
            "--why",
            "INC-9 test data",
        ])
        .env("COURIER_SOURCE", fixture.source_arg())
        .env("COURIER_QUEUE", &fixture.queue)
        .env("COURIER_POLICY", "orders")
        .env("KUBECONFIG", &alice)
        .env("POD_NAMESPACE", NS)
        .output()
        .expect("run courier dlq purge");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let audit: serde_json::Value = stderr
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no audit line: {stderr}"));
    assert_eq!(audit["by"], "alice", "{stderr}");
    assert_eq!(audit["dead_letter_queue"], parked.as_str());
    assert_eq!(audit["selection"], format!("--id {letter}"));
    let events = stub.json(&["get", "events.v1.events.k8s.io", "-n", NS]);
    let notes: Vec<&str> = events["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| {
            e["reason"] == "DeadLettersPurged"
                && e["type"] == "Normal"
                && e["regarding"]["kind"] == "RetryPolicy"
                && e["regarding"]["name"] == "orders"
        })
        .filter_map(|e| e["note"].as_str())
        .collect();
    assert_eq!(
        notes,
        [format!(
            "alice purged 1 of 1 dead letters in {parked} (--id {letter}); why: INC-9 test data"
        )],
        "{events}"
    );
    assert!(
        dead_letter_field_in(&fixture, &parked, &id, "courier-reason")
            .await
            .is_none()
    );
}
