//! The sidecar injector, end to end: AdmissionReview fixtures in
//! `tests/fixtures/inject/` go through [`courier::inject::review`], the
//! returned JSON Patch is applied to the pod, and the result must equal the
//! expected pod next to the fixture. One test runs the built binary as
//! `courier inject` over HTTPS with a generated certificate, and rotates it.
//!
//! After a deliberate change to what is injected, rewrite the expected pods
//! with `COURIER_BLESS=1 cargo test --test kubernetes -- inject::` and review
//! the diff.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use bytes::Bytes;
use clap::CommandFactory;
use courier::cmd::Cli;
use courier::inject::{self, SidecarDefaults};
use http_body_util::{BodyExt, Full};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::common::free_addr;

const IMAGE: &str = "courier:test";

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/inject")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn defaults() -> SidecarDefaults {
    SidecarDefaults {
        image: IMAGE.into(),
        ..SidecarDefaults::default()
    }
}

/// What one fixture came back with.
struct Reviewed {
    response: Value,
    /// The pod after the patch (or unchanged, without one).
    pod: Value,
    /// The pod as it came.
    original: Value,
}

impl Reviewed {
    fn allowed(&self) -> bool {
        self.response["allowed"]
            .as_bool()
            .expect("allowed is a bool")
    }

    fn message(&self) -> &str {
        self.response["status"]["message"].as_str().unwrap_or("")
    }

    fn warnings(&self) -> Vec<String> {
        self.response["warnings"]
            .as_array()
            .map(|w| w.iter().map(|s| s.as_str().unwrap().to_string()).collect())
            .unwrap_or_default()
    }

    fn has_patch(&self) -> bool {
        self.response.get("patch").is_some()
    }

    fn sidecar(&self) -> Value {
        let spec = &self.pod["spec"];
        spec["initContainers"]
            .as_array()
            .into_iter()
            .chain(spec["containers"].as_array())
            .flatten()
            .find(|c| c["name"] == "courier")
            .cloned()
            .expect("a courier container")
    }
}

/// Sends the answer for `review` through the same JSON the API server gets.
fn answer(review: &Value, defaults: &SidecarDefaults) -> Value {
    let body = serde_json::to_vec(review).unwrap();
    inject::review(&body, defaults)
}

/// Applies an AdmissionReview answer to the pod of its request.
fn apply(request: &Value, answer: &Value) -> Reviewed {
    let original = request["request"]["object"].clone();
    let response = answer["response"].clone();
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1", "{answer}");
    assert_eq!(answer["kind"], "AdmissionReview", "{answer}");
    assert_eq!(
        response["uid"], request["request"]["uid"],
        "the uid is echoed"
    );
    let mut pod = original.clone();
    if let Some(encoded) = response.get("patch") {
        assert_eq!(response["patchType"], "JSONPatch");
        let raw = base64::engine::general_purpose::STANDARD
            .decode(encoded.as_str().expect("the patch is base64 text"))
            .expect("the patch is base64");
        let patch: json_patch::Patch = serde_json::from_slice(&raw).expect("a JSON Patch");
        json_patch::patch(&mut pod, &patch).expect("the patch applies to the pod");
    }
    Reviewed {
        response,
        pod,
        original,
    }
}

fn review_fixture(name: &str) -> Reviewed {
    let request = read_json(&fixtures().join(format!("{name}.review.json")));
    apply(&request, &answer(&request, &defaults()))
}

/// The patched pod must equal `<name>.expected.json`.
/// The pod with its `/drain` secret (new for every admission) masked.
fn masked(pod: &Value) -> Value {
    serde_json::from_str(&courier::inject::mask_drain_tokens(&pod.to_string())).unwrap()
}

fn assert_expected(name: &str, pod: &Value) {
    let path = fixtures().join(format!("{name}.expected.json"));
    let pod = &masked(pod);
    if std::env::var_os("COURIER_BLESS").is_some() {
        std::fs::write(&path, serde_json::to_string_pretty(pod).unwrap() + "\n").unwrap();
    }
    let expected = read_json(&path);
    if &expected != pod {
        panic!(
            "{name}: the injected pod differs from {}\n--- got\n{}\n",
            path.display(),
            serde_json::to_string_pretty(pod).unwrap()
        );
    }
}

// === Fixtures ===

#[test]
fn opted_in_pod_gets_the_sidecar_as_a_container() {
    let r = review_fixture("opted-in");
    assert!(r.allowed(), "{}", r.response);
    assert!(
        r.message().contains("injected as a container"),
        "{}",
        r.message()
    );
    assert_eq!(r.response["auditAnnotations"]["decision"], "injected");
    assert_expected("opted-in", &r.pod);

    let c = r.sidecar();
    assert_eq!(
        r.pod["spec"]["containers"][1]["name"], "courier",
        "appended after the app"
    );
    assert!(
        c.get("restartPolicy").is_none(),
        "a regular container has none"
    );
    assert_eq!(c["image"], IMAGE);
    assert_eq!(c["args"], json!(["run"]));
    let env = env_of(&c);
    assert_eq!(
        env["COURIER_SOURCE"],
        json!("redis://redis.shop.svc:6379/0")
    );
    assert_eq!(env["COURIER_QUEUE"], json!("{orders}"));
    assert_eq!(env["COURIER_APP"], json!("http://127.0.0.1:8080/"));
    assert_eq!(env["COURIER_LISTEN"], json!("0.0.0.0:9464"));
    assert_eq!(env["POD_NAME"]["fieldRef"]["fieldPath"], "metadata.name");
    assert_eq!(
        env["POD_NAMESPACE"]["fieldRef"]["fieldPath"],
        "metadata.namespace"
    );
    let sc = &c["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["ports"][0]["containerPort"], 9464);
    assert!(
        c.get("volumeMounts").is_none(),
        "no API token without a policy to read"
    );
    let annotations = &r.pod["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/port"], "9464");
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
    let token = env["COURIER_DRAIN_TOKEN"]
        .as_str()
        .expect("a /drain secret");
    assert!(token.starts_with("cdt_") && token.len() == 36, "{token}");
    assert_eq!(
        r.pod["spec"]["containers"][0]["lifecycle"]["preStop"],
        json!({"httpGet": {
            "path": "/drain",
            "port": 9464,
            "scheme": "HTTP",
            "httpHeaders": [{"name": "Authorization", "value": format!("Bearer {token}")}],
        }}),
        "the app container drains courier before its SIGTERM, with the sidecar's secret"
    );
    assert_eq!(
        r.pod["spec"]["terminationGracePeriodSeconds"], 60,
        "the app's 30s, then the default 25s drain and 5s"
    );
    assert_eq!(
        env["COURIER_DRAIN_RESUME_AFTER"],
        json!("65s"),
        "a drain no SIGTERM followed within the grace period and 5s ends"
    );
}

/// Each pod gets a secret of its own: knowing one pod's (it is in that
/// pod's spec) drains no other.
#[test]
fn every_admission_makes_a_new_drain_secret() {
    let tokens: std::collections::BTreeSet<String> = (0..20)
        .map(|_| {
            let r = review_fixture("opted-in");
            env_of(&r.sidecar())["COURIER_DRAIN_TOKEN"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(tokens.len(), 20, "{tokens:?}");
}

#[test]
fn native_sidecar_goes_last_into_init_containers_with_restart_policy_always() {
    let r = review_fixture("native-sidecar");
    assert!(r.allowed(), "{}", r.response);
    assert_eq!(
        r.response["auditAnnotations"]["decision"],
        "injected-native-sidecar"
    );
    assert_expected("native-sidecar", &r.pod);

    let init = r.pod["spec"]["initContainers"].as_array().unwrap();
    assert_eq!(init.len(), 2);
    assert_eq!(
        init[0]["name"], "migrate",
        "the pod's own init container runs first"
    );
    assert_eq!(init[1]["name"], "courier");
    assert_eq!(init[1]["restartPolicy"], "Always");
    assert_eq!(r.pod["spec"]["containers"].as_array().unwrap().len(), 1);

    let c = r.sidecar();
    let env = env_of(&c);
    assert_eq!(
        env["COURIER_SOURCE"],
        json!({"secretKeyRef": {"name": "orders-broker", "key": "redis-url"}})
    );
    assert_eq!(env["COURIER_GROUP"], json!("orders-workers"));
    assert_eq!(env["COURIER_APP"], json!("http://127.0.0.1:8080/messages"));
    assert_eq!(env["COURIER_POLICY"], json!("orders"));
    assert_eq!(env["COURIER_CONCURRENCY"], json!("4"));
    assert_eq!(env["COURIER_DRAIN_TIMEOUT"], json!("40s"));
    assert_eq!(c["resources"]["limits"]["memory"], "512Mi");
    assert_eq!(c["resources"]["requests"]["cpu"], "50m");
    assert_eq!(
        c["volumeMounts"],
        json!([{
            "name": "kube-api-access-5x2qk",
            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            "readOnly": true,
        }]),
        "the token is mounted to read the RetryPolicy"
    );
    assert_eq!(
        r.pod["spec"]["containers"][0]["lifecycle"]["preStop"]["httpGet"]["path"],
        "/drain"
    );
    assert_eq!(
        r.pod["spec"]["terminationGracePeriodSeconds"], 75,
        "the app's 30s, then a 40s drain and 5s"
    );
    let annotations = &r.pod["metadata"]["annotations"];
    assert_eq!(
        annotations["prometheus.io/port"], "8080",
        "the app's own scrape stays"
    );
    assert!(annotations.get("prometheus.io/path").is_none());
}

#[test]
fn native_sidecar_without_init_containers_creates_the_list() {
    let mut request = read_json(&fixtures().join("opted-in.review.json"));
    request["request"]["object"]["metadata"]["annotations"]["courier.dev/native-sidecar"] =
        json!("true");
    let r = apply(&request, &answer(&request, &defaults()));
    assert!(r.allowed());
    let init = r.pod["spec"]["initContainers"].as_array().unwrap();
    assert_eq!(init.len(), 1);
    assert_eq!(init[0]["restartPolicy"], "Always");

    // And the injector's default does the same without the annotation,
    // which in turn can say no.
    let native = SidecarDefaults {
        native_sidecars: true,
        ..defaults()
    };
    let request = read_json(&fixtures().join("opted-in.review.json"));
    let r = apply(&request, &answer(&request, &native));
    assert_eq!(r.pod["spec"]["initContainers"][0]["name"], "courier");
    let mut request = request;
    request["request"]["object"]["metadata"]["annotations"]["courier.dev/native-sidecar"] =
        json!("false");
    let r = apply(&request, &answer(&request, &native));
    assert!(r.pod["spec"].get("initContainers").is_none());
    assert_eq!(r.pod["spec"]["containers"][1]["name"], "courier");
}

#[test]
fn already_injected_pod_is_left_alone() {
    let r = review_fixture("already-injected");
    assert!(r.allowed());
    assert!(!r.has_patch(), "{}", r.response);
    assert_eq!(r.pod, r.original);
    assert_eq!(
        r.response["auditAnnotations"]["decision"],
        "already-injected"
    );
    assert!(
        r.message()
            .contains("already has a container named courier"),
        "{}",
        r.message()
    );
}

#[test]
fn injecting_twice_changes_nothing_the_second_time() {
    let first = review_fixture("opted-in");
    let mut request = read_json(&fixtures().join("opted-in.review.json"));
    request["request"]["object"] = first.pod.clone();
    let second = apply(&request, &answer(&request, &defaults()));
    assert!(!second.has_patch());
    assert_eq!(second.pod, first.pod);
}

#[test]
fn host_network_pod_is_skipped_with_a_warning() {
    let r = review_fixture("host-network");
    assert!(r.allowed());
    assert!(!r.has_patch());
    assert_eq!(r.pod, r.original);
    assert_eq!(r.response["auditAnnotations"]["decision"], "host-network");
    let warnings = r.warnings();
    assert_eq!(warnings.len(), 1);
    assert!(warnings[0].contains("hostNetwork"), "{warnings:?}");
}

#[test]
fn missing_annotations_deny_the_pod_and_name_them() {
    let r = review_fixture("missing-annotation");
    assert!(!r.allowed());
    assert!(!r.has_patch());
    assert_eq!(r.response["status"]["code"], 400);
    let message = r.message();
    assert!(message.contains("courier.dev/queue"), "{message}");
    assert!(message.contains("courier.dev/source"), "{message}");
    assert!(message.contains("courier.dev/source-secret"), "{message}");
    assert!(
        message.contains("courier.dev/inject"),
        "says how to opt out: {message}"
    );
    assert_eq!(r.response["auditAnnotations"]["decision"], "denied");
}

#[test]
fn every_bad_annotation_is_named_in_one_denial() {
    let mut request = read_json(&fixtures().join("opted-in.review.json"));
    let annotations = &mut request["request"]["object"]["metadata"]["annotations"];
    annotations["courier.dev/app-url"] = json!("https://127.0.0.1:8443/");
    annotations["courier.dev/concurrency"] = json!("lots");
    annotations["courier.dev/native-sidecar"] = json!("yes");
    annotations["courier.dev/cpu-limit"] = json!("two cores");
    annotations["courier.dev/drain-timeout"] = json!("soon");
    annotations["courier.dev/source-secret"] = json!("broker");
    let r = apply(&request, &answer(&request, &defaults()));
    assert!(!r.allowed());
    let message = r.message();
    for named in [
        "courier.dev/app-port and courier.dev/app-url are both set",
        "courier.dev/source and courier.dev/source-secret are both set",
        "courier.dev/concurrency \"lots\"",
        "courier.dev/native-sidecar \"yes\"",
        "courier.dev/cpu-limit \"two cores\"",
        "courier.dev/drain-timeout \"soon\"",
    ] {
        assert!(message.contains(named), "{named:?} not in {message}");
    }
}

#[test]
fn an_sqs_source_is_accepted() {
    let mut request = read_json(&fixtures().join("opted-in.review.json"));
    request["request"]["object"]["metadata"]["annotations"]["courier.dev/source"] =
        json!("sqs://eu-west-1");
    let r = apply(&request, &answer(&request, &defaults()));
    assert!(r.allowed(), "{}", r.message());
}

/// `courier.dev/subscriptions` instead of `courier.dev/queue`: checked at
/// admission with the sidecar's own parser, and passed as
/// `COURIER_SUBSCRIPTIONS`, which `courier run` reads into its
/// subscriptions (the conformance suite runs every scenario that way).
#[test]
fn subscriptions_come_from_an_annotation_checked_at_admission() {
    let document = "subscriptions:\n  - queue: orders\n    path: /orders\n  - queue: refunds\n    concurrency: 4\n    batch: {maxMessages: 50, maxWait: 20ms}\n";
    let mut request = read_json(&fixtures().join("opted-in.review.json"));
    let annotations = &mut request["request"]["object"]["metadata"]["annotations"];
    annotations
        .as_object_mut()
        .unwrap()
        .remove("courier.dev/queue");
    annotations["courier.dev/subscriptions"] = json!(document);
    let r = apply(&request, &answer(&request, &defaults()));
    assert!(r.allowed(), "{}", r.message());
    let env = env_of(&r.sidecar());
    assert_eq!(env["COURIER_SUBSCRIPTIONS"], json!(document.trim()));
    assert!(env.get("COURIER_QUEUE").is_none(), "{env}");
    let run = <Cli as clap::Parser>::try_parse_from([
        "courier",
        "run",
        "--source",
        "redis://127.0.0.1:6379",
        "--subscriptions",
        env["COURIER_SUBSCRIPTIONS"].as_str().unwrap(),
    ])
    .expect("courier run takes the variable's value");
    let courier::cmd::Command::Run(args) = run.command else {
        panic!("not run");
    };
    let configs = courier::cmd::run::configs(&args).expect("the annotation's subscriptions");
    let queues: Vec<_> = configs.iter().map(|c| c.options.queue.as_str()).collect();
    assert_eq!(queues, ["orders", "refunds"]);
    assert_eq!(configs[0].app.url.path(), "/orders");
    assert_eq!(configs[1].options.concurrency, 4);
    let batch = configs[1].delivery.batch.expect("refunds in batches");
    assert_eq!(
        (batch.max_messages, batch.max_wait),
        (50, std::time::Duration::from_millis(20))
    );
    assert_eq!(configs[1].options.messages_per_delivery, 50);
    assert_eq!(configs[0].delivery.batch, None);

    for (value, expected) in [
        (
            "subscriptions:\n  - queue: a\n  - queue: a\n",
            "courier.dev/subscriptions: subscriptions[1]: queue \"a\" is already subscriptions[0]'s",
        ),
        (
            "queue: a",
            "courier.dev/subscriptions: not a subscriptions document",
        ),
    ] {
        let mut bad = request.clone();
        bad["request"]["object"]["metadata"]["annotations"]["courier.dev/subscriptions"] =
            json!(value);
        let r = apply(&bad, &answer(&bad, &defaults()));
        assert!(!r.allowed(), "{value}");
        assert!(r.message().contains(expected), "{}", r.message());
    }
    let mut both = request.clone();
    both["request"]["object"]["metadata"]["annotations"]["courier.dev/queue"] = json!("orders");
    let r = apply(&both, &answer(&both, &defaults()));
    assert!(!r.allowed());
    assert!(
        r.message()
            .contains("courier.dev/queue and courier.dev/subscriptions are both set"),
        "{}",
        r.message()
    );
}

#[test]
fn a_pubsub_source_is_accepted() {
    let mut request = read_json(&fixtures().join("opted-in.review.json"));
    request["request"]["object"]["metadata"]["annotations"]["courier.dev/source"] =
        json!("pubsub://my-project");
    let r = apply(&request, &answer(&request, &defaults()));
    assert!(r.allowed(), "{}", r.message());
}

#[test]
fn a_bad_broker_url_denies_the_pod() {
    let mut request = read_json(&fixtures().join("opted-in.review.json"));
    request["request"]["object"]["metadata"]["annotations"]["courier.dev/source"] =
        json!("mqtt://broker:1883");
    let r = apply(&request, &answer(&request, &defaults()));
    assert!(!r.allowed());
    assert!(
        r.message().contains("courier.dev/source"),
        "{}",
        r.message()
    );
}

#[test]
fn a_bad_broker_url_denial_does_not_echo_the_credentials() {
    let mut request = read_json(&fixtures().join("opted-in.review.json"));
    request["request"]["object"]["metadata"]["annotations"]["courier.dev/source"] =
        json!("mqtt://orders:p@ss/w0rd@broker:9092");
    let r = apply(&request, &answer(&request, &defaults()));
    assert!(!r.allowed());
    let message = r.message();
    assert!(message.contains("mqtt://***@broker:9092"), "{message}");
    for secret in ["p@ss", "w0rd", "orders:"] {
        assert!(!message.contains(secret), "{secret} in {message}");
    }
}

#[test]
fn credentials_in_the_source_annotation_get_a_warning_that_does_not_repeat_them() {
    let mut request = read_json(&fixtures().join("opted-in.review.json"));
    request["request"]["object"]["metadata"]["annotations"]["courier.dev/source"] =
        json!("amqp://orders:s3cret@rabbitmq.shop.svc:5672/%2f");
    let r = apply(&request, &answer(&request, &defaults()));
    assert!(r.allowed(), "a warning, not a denial");
    let warnings = r.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("courier.dev/source-secret"),
        "says what to do instead: {warnings:?}"
    );
    assert!(!warnings[0].contains("s3cret"), "{warnings:?}");

    let plain = review_fixture("opted-in");
    assert!(plain.warnings().is_empty(), "{:?}", plain.warnings());
}

/// A Kafka login from a Secret travels through the AdmissionReview: the
/// sidecar gets `secretKeyRef`s to the Secret's `username` and `password`,
/// with no warning (nothing secret is in the pod); a login that does not
/// hang together is refused with a 400 that says what to change.
#[test]
fn a_kafka_sasl_secret_goes_through_the_review() {
    let mut request = read_json(&fixtures().join("opted-in.review.json"));
    let annotations = &mut request["request"]["object"]["metadata"]["annotations"];
    annotations["courier.dev/source"] = json!("kafkas://kafka-0.kafka.shop.svc:9093");
    annotations["courier.dev/kafka-sasl-secret"] = json!("kafka-login");
    annotations["courier.dev/kafka-sasl-mechanism"] = json!("SCRAM-SHA-512");
    let r = apply(&request, &answer(&request, &defaults()));
    assert!(r.allowed(), "{}", r.message());
    assert!(r.warnings().is_empty(), "{:?}", r.warnings());
    let env = env_of(&r.sidecar());
    assert_eq!(env["COURIER_KAFKA_SASL_MECHANISM"], json!("SCRAM-SHA-512"));
    for (name, key) in [
        ("COURIER_KAFKA_SASL_USERNAME", "username"),
        ("COURIER_KAFKA_SASL_PASSWORD", "password"),
    ] {
        assert_eq!(
            env[name],
            json!({"secretKeyRef": {"name": "kafka-login", "key": key}}),
            "{name}"
        );
    }
    let typed: k8s_openapi::api::core::v1::Container = serde_json::from_value(r.sidecar()).unwrap();
    assert_eq!(serde_json::to_value(&typed).unwrap(), r.sidecar());

    let annotations = &mut request["request"]["object"]["metadata"]["annotations"];
    annotations["courier.dev/kafka-sasl-mechanism"] = json!("OAUTHBEARER");
    let r = apply(&request, &answer(&request, &defaults()));
    assert!(!r.allowed());
    assert!(!r.has_patch());
    assert_eq!(r.response["status"]["code"], 400);
    assert_eq!(r.response["auditAnnotations"]["decision"], "denied");
    assert!(
        r.message().contains(
            "courier.dev/kafka-sasl-mechanism OAUTHBEARER needs courier.dev/kafka-oauth-token-url"
        ),
        "{}",
        r.message()
    );
}

#[test]
fn pod_without_the_label_is_not_touched() {
    let r = review_fixture("not-opted-in");
    assert!(r.allowed());
    assert!(!r.has_patch());
    assert_eq!(r.response["auditAnnotations"]["decision"], "not-opted-in");
}

#[test]
fn only_creation_is_mutated() {
    let mut request = read_json(&fixtures().join("opted-in.review.json"));
    request["request"]["operation"] = json!("UPDATE");
    request["request"]["oldObject"] = request["request"]["object"].clone();
    let r = apply(&request, &answer(&request, &defaults()));
    assert!(r.allowed());
    assert!(!r.has_patch());
}

#[test]
fn a_review_that_cannot_be_read_is_refused() {
    let answer = inject::review(b"{not json", &defaults());
    assert_eq!(answer["response"]["allowed"], false);
    assert!(
        answer["response"]["status"]["message"]
            .as_str()
            .unwrap()
            .contains("cannot read the AdmissionReview")
    );
}

/// `courier run` must understand every variable the injector sets: each
/// COURIER_* variable is one of its flags' variables, and the values parse
/// when passed as those flags.
#[test]
fn injected_configuration_is_what_courier_run_reads() {
    let cli = Cli::command();
    let run = cli.find_subcommand("run").expect("a run command");
    let known: BTreeSet<String> = cli
        .get_arguments()
        .chain(run.get_arguments())
        .filter_map(|a| {
            let env = a.get_env()?.to_str()?.to_string();
            Some(env)
        })
        .collect();
    for fixture in ["opted-in", "native-sidecar"] {
        let c = review_fixture(fixture).sidecar();
        let mut argv = vec!["courier".to_string()];
        let mut run_args = vec![];
        for (name, value) in env_of(&c).as_object().unwrap() {
            if !name.starts_with("COURIER_") {
                continue;
            }
            assert!(
                known.contains(name),
                "{name} is not a variable of courier run"
            );
            let flag = run
                .get_arguments()
                .chain(cli.get_arguments())
                .find(|a| a.get_env().and_then(|e| e.to_str()) == Some(name.as_str()))
                .and_then(|a| a.get_long())
                .unwrap();
            let value = value.as_str().unwrap_or("redis://secret.example:6379/0");
            let target = if cli.get_arguments().any(|a| a.get_long() == Some(flag)) {
                &mut argv
            } else {
                &mut run_args
            };
            target.push(format!("--{flag}={value}"));
        }
        argv.push("run".into());
        argv.extend(run_args);
        if let Err(e) = <Cli as clap::Parser>::try_parse_from(&argv) {
            panic!("courier run does not accept {argv:?}: {e}");
        }
    }
}

/// The env list of a container as name -> value (or valueFrom).
fn env_of(container: &Value) -> Value {
    let mut map = serde_json::Map::new();
    for var in container["env"].as_array().expect("an env list") {
        let name = var["name"].as_str().unwrap().to_string();
        let value = var
            .get("value")
            .cloned()
            .or_else(|| var.get("valueFrom").cloned())
            .unwrap();
        assert!(
            map.insert(name.clone(), value).is_none(),
            "{name} set twice"
        );
    }
    Value::Object(map)
}

/// The injected container survives a round trip through the Kubernetes
/// types: no misspelt field is silently dropped.
#[test]
fn injected_container_has_only_kubernetes_fields() {
    for fixture in ["opted-in", "native-sidecar"] {
        let c = review_fixture(fixture).sidecar();
        let typed: k8s_openapi::api::core::v1::Container =
            serde_json::from_value(c.clone()).unwrap();
        assert_eq!(serde_json::to_value(&typed).unwrap(), c, "{fixture}");
    }
}

// === `courier inject --pod` ===

#[test]
fn render_injects_into_a_deployment_template() {
    let dir = tempfile::tempdir().unwrap();
    let request = read_json(&fixtures().join("opted-in.review.json"));
    let pod = &request["request"]["object"];
    let deployment = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "orders", "namespace": "shop"},
        "spec": {
            "selector": {"matchLabels": {"app": "orders"}},
            "template": {"metadata": {
                "labels": pod["metadata"]["labels"],
                "annotations": pod["metadata"]["annotations"],
            }, "spec": {"containers": pod["spec"]["containers"]}},
        },
    });
    let path = dir.path().join("deployment.yaml");
    std::fs::write(&path, serde_json::to_string(&deployment).unwrap()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_courier"))
        // A regular container, as the fixtures' defaults say (the flag's
        // default is the chart's native sidecar).
        .args([
            "inject",
            "--sidecar-image",
            IMAGE,
            "--native-sidecars",
            "false",
            "--pod",
        ])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rendered: Value = serde_saphyr::from_slice(&out.stdout).unwrap();
    assert_eq!(rendered["kind"], "Deployment");
    let containers = rendered["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap();
    assert_eq!(containers.len(), 2);
    assert_eq!(containers[1]["name"], "courier");
    assert_eq!(
        rendered["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"],
        "9464"
    );

    // A pod the webhook would deny fails here too, with the same message.
    let missing = read_json(&fixtures().join("missing-annotation.review.json"));
    std::fs::write(&path, missing["request"]["object"].to_string()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_courier"))
        .args(["inject", "--pod"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("courier.dev/queue"));
}

/// `courier inject --pod` on a Deployment with the annotations of
/// docs/kubernetes.md's Kafka login example prints the sidecar with the
/// login from the Secret; without the mechanism it refuses, as the webhook
/// would, with the message.
#[test]
fn render_injects_the_docs_kafka_login() {
    let docs =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/kubernetes.md"))
            .unwrap();
    let section = docs
        .split_once("\n## Kafka login\n")
        .expect("docs/kubernetes.md has a section Kafka login")
        .1;
    let example = section
        .split_once("```yaml\n")
        .and_then(|(_, rest)| rest.split_once("```"))
        .expect("a yaml example in the section")
        .0;
    let example: Value = serde_saphyr::from_str(example).unwrap();
    let template = &example["spec"]["template"]["metadata"];
    assert_eq!(template["labels"]["courier.dev/inject"], "true");
    let mut deployment = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "orders", "namespace": "shop"},
        "spec": {
            "selector": {"matchLabels": {"app": "orders"}},
            "template": {
                "metadata": template,
                "spec": {"containers": [{"name": "orders", "image": "orders:1"}]},
            },
        },
    });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("deployment.yaml");
    let preview = |deployment: &Value| {
        std::fs::write(&path, serde_json::to_string(deployment).unwrap()).unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_courier"));
        command.args(["inject", "--pod"]).arg(&path);
        for (key, _) in std::env::vars() {
            if key.starts_with("COURIER_") {
                command.env_remove(key);
            }
        }
        command.output().unwrap()
    };

    let out = preview(&deployment);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rendered: Value = serde_saphyr::from_slice(&out.stdout).unwrap();
    let sidecar = &rendered["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(sidecar["name"], "courier", "{rendered}");
    let env = env_of(sidecar);
    assert_eq!(
        env["COURIER_SOURCE"],
        json!("kafkas://pkc-xxxx.region.provider.confluent.cloud:9092")
    );
    assert_eq!(env["COURIER_KAFKA_SASL_MECHANISM"], json!("PLAIN"));
    assert_eq!(
        env["COURIER_KAFKA_SASL_USERNAME"],
        json!({"secretKeyRef": {"name": "kafka-login", "key": "username"}})
    );
    assert_eq!(
        env["COURIER_KAFKA_SASL_PASSWORD"],
        json!({"secretKeyRef": {"name": "kafka-login", "key": "password"}})
    );
    assert!(
        rendered["spec"]["template"]["spec"]
            .get("volumes")
            .is_none(),
        "{rendered}"
    );

    let annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        .as_object_mut()
        .unwrap();
    annotations.remove("courier.dev/kafka-sasl-mechanism");
    let out = preview(&deployment);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        out.stdout.is_empty(),
        "nothing is printed for a refused pod"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "courier.dev/kafka-sasl-secret is set without courier.dev/kafka-sasl-mechanism"
        ),
        "{stderr}"
    );
}

// === The server, over HTTPS ===

/// A CA and a serving certificate for 127.0.0.1 and localhost, as PEM.
struct TestPki {
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
}

fn pki(ca_name: &str) -> TestPki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params
        .distinguished_name
        .push(DnType::CommonName, ca_name);
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);

    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    params
        .subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
    params
        .distinguished_name
        .push(DnType::CommonName, "courier-injector");
    let cert = params.signed_by(&key, &issuer).unwrap();
    TestPki {
        ca_pem: ca_cert.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    }
}

/// The injector's log (`--log-format json`), read from its stderr on a
/// thread, one JSON object a line.
struct Log(tokio::sync::mpsc::UnboundedReceiver<Value>);

impl Log {
    fn capture(child: &mut Child) -> Self {
        let stderr = child.stderr.take().expect("stderr is piped");
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let event =
                    serde_json::from_str(&line).unwrap_or_else(|_| json!({ "message": line }));
                if tx.send(event).is_err() {
                    break;
                }
            }
        });
        Self(rx)
    }

    /// The next line with this message, skipping the others; fails the
    /// test when none comes within `within`.
    async fn next(&mut self, message: &str, within: Duration) -> Value {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, self.0.recv()).await {
                Ok(Some(event)) if event["message"] == message => return event,
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the injector's log ended before {message:?}"),
                Err(_) => panic!("no {message:?} in the injector's log within {within:?}"),
            }
        }
    }
}

/// Writes a file as a Secret volume update does: whole, in one step, so
/// that the reloader never reads half of it.
fn replace_file(path: &Path, contents: &str) {
    let staged = path.with_extension("staged");
    std::fs::write(&staged, contents).unwrap();
    std::fs::rename(&staged, path).unwrap();
}

/// The injector process; killed when dropped if the test did not stop it.
struct Injector(Child);

impl Drop for Injector {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One HTTPS request to the injector, trusting only `ca_pem`.
async fn https(
    addr: SocketAddr,
    ca_pem: &str,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> Result<(u16, Bytes), String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let tls = TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .map_err(|e| format!("TLS: {e}"))?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let request = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    Ok((status, body.to_bytes()))
}

async fn wait_until_serving(addr: SocketAddr, ca_pem: &str, child: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok((200, _)) = https(addr, ca_pem, "GET", "/healthz", vec![]).await {
            return;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("courier inject exited early: {status}");
        }
        assert!(
            Instant::now() < deadline,
            "courier inject did not start serving"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn binary_serves_admission_reviews_over_https_and_reloads_its_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (cert_path, key_path) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let first = pki("courier test CA one");
    std::fs::write(&cert_path, &first.cert_pem).unwrap();
    std::fs::write(&key_path, &first.key_pem).unwrap();
    let addr = free_addr();

    let mut injector = Injector(
        Command::new(env!("CARGO_BIN_EXE_courier"))
            .arg("inject")
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--tls-cert")
            .arg(&cert_path)
            .arg("--tls-key")
            .arg(&key_path)
            .args(["--tls-reload-interval", "100ms", "--sidecar-image", IMAGE])
            .args(["--native-sidecars", "false"])
            .args(["--log-format", "json"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut log = Log::capture(&mut injector.0);
    wait_until_serving(addr, &first.ca_pem, &mut injector.0).await;

    let (status, body) = https(addr, &first.ca_pem, "GET", "/readyz", vec![])
        .await
        .unwrap();
    assert_eq!((status, &body[..]), (200, &b"ready\n"[..]));

    // The opted-in fixture over the wire gives the same pod as in-process.
    let request = read_json(&fixtures().join("opted-in.review.json"));
    let (status, body) = https(
        addr,
        &first.ca_pem,
        "POST",
        "/mutate",
        serde_json::to_vec(&request).unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let answer: Value = serde_json::from_slice(&body).unwrap();
    let reviewed = apply(&request, &answer);
    assert!(reviewed.allowed());
    assert_expected("opted-in", &reviewed.pod);

    // A denial travels the same way.
    let missing = read_json(&fixtures().join("missing-annotation.review.json"));
    let (_, body) = https(
        addr,
        &first.ca_pem,
        "POST",
        "/mutate",
        serde_json::to_vec(&missing).unwrap(),
    )
    .await
    .unwrap();
    let answer: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(answer["response"]["allowed"], false);

    // Rotate: a certificate from another CA replaces the first on disk (as
    // a renewed Secret would), and the server picks it up without a restart.
    // The key goes first, so the reloader may see the new key with the old
    // certificate for a moment: it refuses that pair and takes the next.
    let second = pki("courier test CA two");
    replace_file(&key_path, &second.key_pem);
    replace_file(&cert_path, &second.cert_pem);
    let reloaded = log
        .next("TLS certificate reloaded", Duration::from_secs(10))
        .await;
    assert_eq!(reloaded["cert"], cert_path.display().to_string());
    // Once the log says so, every new connection gets the new certificate.
    https(addr, &second.ca_pem, "GET", "/healthz", vec![])
        .await
        .expect("the new certificate is served");
    assert!(
        https(addr, &first.ca_pem, "GET", "/healthz", vec![])
            .await
            .is_err(),
        "the old certificate is no longer served"
    );

    // A broken file on disk is refused, and says why; the current
    // certificate stays.
    replace_file(&cert_path, "not a certificate");
    let refused = log
        .next(
            "the new TLS certificate was refused; serving the previous one",
            Duration::from_secs(10),
        )
        .await;
    let error = refused["error"].as_str().unwrap_or_default();
    assert!(error.contains("no PEM certificate"), "{refused}");
    assert!(error.contains("tls.crt"), "names the file: {refused}");
    assert!(
        https(addr, &second.ca_pem, "GET", "/healthz", vec![])
            .await
            .is_ok()
    );

    // SIGTERM stops it cleanly.
    let pid = injector.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = injector.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "courier inject did not stop on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status}");
}

#[test]
fn binary_refuses_to_start_without_a_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_courier"))
        .arg("inject")
        .args(["--listen", "127.0.0.1:0", "--tls-cert"])
        .arg(dir.path().join("missing.crt"))
        .arg("--tls-key")
        .arg(dir.path().join("missing.key"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("missing.crt"), "{stderr}");

    let out = Command::new(env!("CARGO_BIN_EXE_courier"))
        .args(["inject", "--sidecar-memory-limit", "lots"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "a bad flag is a usage error");
}

/// An app container with a preStop of its own keeps it (a hook has one
/// action), with a warning saying how to drain first; the others get the
/// drain hook, and one hook is enough to add the drain to the grace period.
#[test]
fn an_app_pre_stop_of_its_own_is_kept_with_a_warning() {
    let doc = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "orders",
            "labels": {"courier.dev/inject": "true"},
            "annotations": {"courier.dev/source-secret": "broker", "courier.dev/queue": "orders"},
        },
        "spec": {
            "terminationGracePeriodSeconds": 10,
            "containers": [
                {"name": "app", "image": "app:1",
                 "lifecycle": {"preStop": {"exec": {"command": ["/bin/stop"]}}}},
                {"name": "worker", "image": "worker:1",
                 "lifecycle": {"postStart": {"exec": {"command": ["/bin/warm"]}}}},
            ],
        },
    });
    let (pod, decision) =
        courier::inject::inject_document(doc, &courier::inject::SidecarDefaults::chart()).unwrap();
    let courier::inject::Decision::Inject { warnings, .. } = &decision else {
        panic!("expected an injection, got {decision}");
    };
    let containers = &pod["spec"]["containers"];
    assert_eq!(
        containers[0]["lifecycle"]["preStop"],
        json!({"exec": {"command": ["/bin/stop"]}})
    );
    assert!(
        warnings.iter().any(
            |w| w.contains("container app has a preStop hook of its own")
                && w.contains("GET http://127.0.0.1:9464/drain")
                && w.contains("Authorization: Bearer $COURIER_DRAIN_TOKEN")
        ),
        "{warnings:?}"
    );
    // The hook of its own can send the secret: the sidecar's, in its env.
    let sidecar = pod["spec"]["initContainers"]
        .as_array()
        .into_iter()
        .chain(containers.as_array())
        .flatten()
        .find(|c| c["name"] == "courier")
        .unwrap();
    let token = env_of(sidecar)["COURIER_DRAIN_TOKEN"].clone();
    assert_eq!(
        containers[0]["env"],
        json!([{"name": "COURIER_DRAIN_TOKEN", "value": token}])
    );
    assert_eq!(
        containers[1]["lifecycle"],
        json!({
            "postStart": {"exec": {"command": ["/bin/warm"]}},
            "preStop": {"httpGet": {
                "path": "/drain",
                "port": 9464,
                "scheme": "HTTP",
                "httpHeaders": [{"name": "Authorization", "value": format!("Bearer {}", token.as_str().unwrap())}],
            }},
        })
    );
    assert_eq!(pod["spec"]["terminationGracePeriodSeconds"], 40);
}

/// Found by reading 21da363: the webhook had no bound on how long a peer
/// may hold a connection and no connection cap, and with `failurePolicy:
/// Fail` idle TLS connections could stop pod creation. A connection that
/// sends nothing (not even a TLS handshake) is closed after the bound; one
/// address holds at most its share; the API server is still answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cannot_stop_the_webhook() {
    let dir = tempfile::tempdir().unwrap();
    let (cert_path, key_path) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let pki = pki("courier test CA limits");
    std::fs::write(&cert_path, &pki.cert_pem).unwrap();
    std::fs::write(&key_path, &pki.key_pem).unwrap();
    let config = courier::inject::InjectConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tls_cert: cert_path,
        tls_key: key_path,
        tls_reload_interval: Duration::from_secs(60),
        defaults: courier::inject::SidecarDefaults::chart(),
    };
    let limits = courier::inject::WebhookLimits {
        handshake_timeout: Duration::from_millis(500),
        read_idle: Duration::from_millis(500),
        max_per_peer: 4,
        ..courier::inject::WebhookLimits::default()
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let (addr, _server) = courier::inject::serve_within(config, stop.clone(), limits)
        .await
        .unwrap();
    let from = |local: &'static str| async move {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(format!("{local}:0").parse().unwrap()).unwrap();
        socket.connect(addr).await.unwrap()
    };
    // Four idle connections from one address fill its share; the fifth is
    // closed at once.
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(from("127.0.0.9").await);
    }
    let mut fifth = from("127.0.0.9").await;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut byte = [0u8; 1];
    let closed = tokio::time::timeout(Duration::from_secs(5), fifth.read(&mut byte)).await;
    assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
    // The API server, from elsewhere, is answered meanwhile.
    let (status, _) = https(addr, &pki.ca_pem, "GET", "/healthz", vec![])
        .await
        .unwrap();
    assert_eq!(status, 200);
    // Past the bound the idle ones are closed, and their address is served.
    for stream in &mut idle {
        let closed = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut byte)).await;
        assert!(
            matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
            "still open: {closed:?}"
        );
    }
    let mut again = from("127.0.0.9").await;
    again.write_all(b"\x16").await.unwrap();
    let held = tokio::time::timeout(Duration::from_millis(200), again.read(&mut byte)).await;
    assert!(held.is_err(), "the address has room again: {held:?}");
    let (status, _) = https(addr, &pki.ca_pem, "GET", "/readyz", vec![])
        .await
        .unwrap();
    assert_eq!(status, 200);
    stop.cancel();
}

/// Found at 21da363, trying it as a new user would: the injector accepted
/// `embedded:/data`, but the sidecar's root filesystem is read-only, so
/// the pod crash-looped. Without a volume for it the pod is refused, with
/// what to add; with the volume `courier-data` it is mounted at the
/// queue's directory, writable.
#[test]
fn an_embedded_queue_needs_a_volume_and_gets_it_mounted() {
    let pod = |volumes: Value| {
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "orders",
                "labels": {"courier.dev/inject": "true"},
                "annotations": {"courier.dev/source": "embedded:/data", "courier.dev/queue": "orders"},
            },
            "spec": {"containers": [{"name": "app", "image": "app:1"}], "volumes": volumes},
        })
    };
    let defaults = courier::inject::SidecarDefaults::chart();
    let (_, decision) = courier::inject::inject_document(pod(json!([])), &defaults).unwrap();
    let courier::inject::Decision::Deny(message) = &decision else {
        panic!("expected a denial, got {decision}");
    };
    assert!(
        message.contains("read-only")
            && message.contains("courier-data")
            && message.contains("/data"),
        "{message}"
    );
    let (injected, decision) = courier::inject::inject_document(
        pod(json!([{"name": "courier-data", "emptyDir": {}}])),
        &defaults,
    )
    .unwrap();
    assert!(
        matches!(decision, courier::inject::Decision::Inject { .. }),
        "{decision}"
    );
    let sidecar = injected["spec"]["initContainers"]
        .as_array()
        .into_iter()
        .chain(injected["spec"]["containers"].as_array())
        .flatten()
        .find(|c| c["name"] == "courier")
        .unwrap();
    assert_eq!(
        sidecar["volumeMounts"],
        json!([{"name": "courier-data", "mountPath": "/data"}])
    );
}
