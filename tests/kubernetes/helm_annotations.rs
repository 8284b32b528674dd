//! Every `courier run` flag is either set by a pod annotation or listed as
//! "not an annotation" with its reason (`courier::inject::flags`), and the
//! table in docs/kubernetes.md has a row for each; a new flag without
//! either fails here. The pass-through annotations reach the sidecar as
//! their flag's variable, and a bad value refuses the pod.

use std::collections::BTreeSet;

use clap::CommandFactory;
use courier::cmd::Cli;
use courier::inject::flags::{ANNOTATED, NOT_ANNOTATIONS, PASSTHROUGH};
use courier::inject::settings::TRACE_ANNOTATIONS;
use courier::inject::{Decision, SidecarDefaults, inject_document};
use serde_json::{Value, json};

fn run_flags() -> BTreeSet<String> {
    let mut cli = Cli::command();
    cli.build();
    let run = cli
        .find_subcommand("run")
        .expect("courier run exists")
        .clone();
    run.get_arguments()
        .filter_map(|a| a.get_long())
        .filter(|long| !matches!(*long, "help" | "version"))
        .map(str::to_string)
        .collect()
}

fn covered() -> Vec<String> {
    PASSTHROUGH
        .iter()
        .map(|p| p.flag)
        .chain(ANNOTATED.iter().map(|(flag, _)| *flag))
        .chain(NOT_ANNOTATIONS.iter().map(|(flag, _)| *flag))
        .map(str::to_string)
        .collect()
}

fn docs() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/kubernetes.md")).unwrap()
}

#[test]
fn every_run_flag_is_an_annotation_or_says_why_not() {
    let flags = run_flags();
    let covered = covered();
    let missing: Vec<_> = flags.iter().filter(|f| !covered.contains(f)).collect();
    assert!(
        missing.is_empty(),
        "courier run flags with neither an annotation nor a NOT_ANNOTATIONS entry in src/inject/flags.rs: {missing:?}"
    );
    let unknown: Vec<_> = covered.iter().filter(|f| !flags.contains(*f)).collect();
    assert!(
        unknown.is_empty(),
        "src/inject/flags.rs names flags courier run does not have: {unknown:?}"
    );
    let mut seen = BTreeSet::new();
    for flag in &covered {
        assert!(
            seen.insert(flag),
            "--{flag} is listed twice in src/inject/flags.rs"
        );
    }
}

#[test]
fn the_docs_have_a_row_for_every_annotation_and_every_exception() {
    let docs = docs();
    let annotations = PASSTHROUGH
        .iter()
        .map(|p| p.annotation)
        .chain(ANNOTATED.iter().flat_map(|(_, a)| a.split(", ")))
        .chain(TRACE_ANNOTATIONS.iter().map(|(a, _)| *a));
    for annotation in annotations {
        assert!(
            docs.contains(&format!("| `{annotation}`")),
            "docs/kubernetes.md has no annotation row for {annotation}"
        );
    }
    for (flag, _) in NOT_ANNOTATIONS {
        assert!(
            docs.contains(&format!("| `--{flag}` |")),
            "docs/kubernetes.md does not say why --{flag} is not an annotation"
        );
    }
}

/// The walkthrough's Deployment with `extra` annotations; a `null` one
/// removes the annotation.
fn deployment(extra: Value) -> Value {
    let mut annotations = json!({
        "courier.dev/source-secret": "orders-broker",
        "courier.dev/queue": "orders",
    });
    for (k, v) in extra.as_object().unwrap() {
        if v.is_null() {
            annotations.as_object_mut().unwrap().remove(k);
        } else {
            annotations[k] = v.clone();
        }
    }
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "orders", "namespace": "shop"},
        "spec": {
            "selector": {"matchLabels": {"app": "orders"}},
            "template": {
                "metadata": {
                    "labels": {"app": "orders", "courier.dev/inject": "true"},
                    "annotations": annotations,
                },
                "spec": {"containers": [{"name": "orders", "image": "orders:1"}]},
            },
        },
    })
}

#[test]
fn passthrough_annotations_become_the_flags_variables() {
    let given = json!({
        "courier.dev/create": "true",
        "courier.dev/app-health-path": "/healthz",
        "courier.dev/dedup-window": "10m",
        "courier.dev/visibility-timeout": "2m",
        "courier.dev/max-body": "8MiB",
        "courier.dev/readiness": "app",
        "courier.dev/cloudevents": "structured",
        "courier.dev/batch-max-messages": "100",
        "courier.dev/batch-max-wait": "20ms",
    });
    let (doc, decision) = inject_document(deployment(given), &SidecarDefaults::chart()).unwrap();
    assert!(matches!(decision, Decision::Inject { .. }), "{decision}");
    let env = doc["spec"]["template"]["spec"]["initContainers"][0]["env"].clone();
    for (name, value) in [
        ("COURIER_CREATE", "true"),
        ("COURIER_APP_HEALTH_PATH", "/healthz"),
        ("COURIER_DEDUP_WINDOW", "10m"),
        ("COURIER_VISIBILITY_TIMEOUT", "2m"),
        ("COURIER_MAX_BODY", "8MiB"),
        ("COURIER_READINESS", "app"),
        ("COURIER_CLOUDEVENTS", "structured"),
        ("COURIER_BATCH_MAX_MESSAGES", "100"),
        ("COURIER_BATCH_MAX_WAIT", "20ms"),
    ] {
        assert!(
            env.as_array()
                .unwrap()
                .contains(&json!({"name": name, "value": value})),
            "{name}={value} in {env}"
        );
    }
}

#[test]
fn a_bad_passthrough_value_refuses_the_pod_naming_every_problem() {
    let given = json!({
        "courier.dev/create": "yes",
        "courier.dev/max-body": "4 MiB",
        "courier.dev/app-health-path": "healthz",
        "courier.dev/readiness": "always",
        "courier.dev/cloudevents": "json",
        "courier.dev/batch-max-messages": "1001",
    });
    let (_, decision) = inject_document(deployment(given), &SidecarDefaults::chart()).unwrap();
    let Decision::Deny(message) = decision else {
        panic!("expected a denial, got {decision}");
    };
    for expected in [
        "courier.dev/create \"yes\" is not true or false",
        "courier.dev/max-body \"4 MiB\" is not a size",
        "courier.dev/app-health-path \"healthz\" is not a URL path",
        "courier.dev/readiness \"always\" is not one of broker, app, none",
        "courier.dev/cloudevents \"json\" is not one of binary, structured, off",
        "courier.dev/batch-max-messages \"1001\" is not a whole number from 1 to 1000",
    ] {
        assert!(message.contains(expected), "{expected:?} in {message}");
    }
}

/// The sidecar's environment after injecting `given` into the deployment,
/// or the denial.
fn sidecar_env(given: Value) -> Result<Vec<Value>, String> {
    let (doc, decision) = inject_document(deployment(given), &SidecarDefaults::chart()).unwrap();
    match decision {
        Decision::Inject { .. } => Ok(doc["spec"]["template"]["spec"]["initContainers"][0]["env"]
            .as_array()
            .unwrap()
            .clone()),
        Decision::Deny(message) => Err(message),
        other => panic!("expected an injection or a denial, got {other}"),
    }
}

/// The trace annotations become the sidecar's `OTEL_*` variables, after
/// `HOST_IP` (so that `$(HOST_IP)` in the endpoint expands) and with the
/// pod's name and namespace as resource attributes; without them the
/// sidecar gets no `OTEL_*` variable at all.
#[test]
fn trace_annotations_become_the_sidecars_otel_variables() {
    let env = sidecar_env(json!({
        "courier.dev/otel-endpoint": "http://$(HOST_IP):4318",
        "courier.dev/otel-service-name": "orders-courier",
        "courier.dev/otel-sampler": "parentbased_traceidratio",
        "courier.dev/otel-sampler-arg": "0.25",
    }))
    .unwrap();
    let position = |name: &str| {
        env.iter()
            .position(|var| var["name"] == name)
            .unwrap_or_else(|| panic!("{name} in {env:?}"))
    };
    for (name, value) in [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://$(HOST_IP):4318"),
        ("OTEL_SERVICE_NAME", "orders-courier"),
        ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
        ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
        (
            "OTEL_RESOURCE_ATTRIBUTES",
            "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),k8s.container.name=courier",
        ),
    ] {
        assert_eq!(env[position(name)]["value"], value, "{name}");
    }
    assert_eq!(
        env[position("HOST_IP")]["valueFrom"]["fieldRef"]["fieldPath"],
        "status.hostIP"
    );
    assert!(position("HOST_IP") < position("OTEL_EXPORTER_OTLP_ENDPOINT"));
    assert!(position("POD_NAMESPACE") < position("OTEL_RESOURCE_ATTRIBUTES"));

    let untraced = sidecar_env(json!({})).unwrap();
    assert!(
        !untraced.iter().any(|var| {
            let name = var["name"].as_str().unwrap();
            name.starts_with("OTEL_") || name == "HOST_IP"
        }),
        "{untraced:?}"
    );
}

/// A trace annotation the sidecar would refuse at start refuses the pod,
/// naming the annotation and the rule; a sampler needs an endpoint.
#[test]
fn a_bad_trace_annotation_refuses_the_pod() {
    for (given, expected) in [
        (
            json!({"courier.dev/otel-endpoint": "collector:4318"}),
            "courier.dev/otel-endpoint: OTEL_EXPORTER_OTLP_ENDPOINT \"collector:4318\"",
        ),
        (
            json!({"courier.dev/otel-endpoint": "http://collector:4318", "courier.dev/otel-sampler": "sometimes"}),
            "courier.dev/otel-sampler: OTEL_TRACES_SAMPLER \"sometimes\"",
        ),
        (
            json!({"courier.dev/otel-endpoint": "http://collector:4318", "courier.dev/otel-sampler": "traceidratio", "courier.dev/otel-sampler-arg": "half"}),
            "courier.dev/otel-sampler-arg: OTEL_TRACES_SAMPLER_ARG \"half\"",
        ),
        (
            json!({"courier.dev/otel-sampler": "always_on"}),
            "courier.dev/otel-sampler without courier.dev/otel-endpoint",
        ),
    ] {
        let message = sidecar_env(given.clone()).unwrap_err();
        assert!(
            message.contains(expected),
            "{given}: {expected:?} in {message}"
        );
    }
}

/// `courier.dev/seal-keys-secret` mounts the Secret into the sidecar only
/// and points `--seal-keys-file` at its `keys`; beside a TLS Secret both
/// volumes are there.
#[test]
fn a_seal_keys_secret_is_mounted_into_the_sidecar_and_names_the_file() {
    let given = json!({
        "courier.dev/seal-keys-secret": "orders-seal",
        "courier.dev/seal-key-window": "48h",
    });
    let env =
        mounted_in_the_sidecar_only(given, "courier-seal", "orders-seal", "/etc/courier/seal");
    for (name, value) in [
        ("COURIER_SEAL_KEYS_FILE", "/etc/courier/seal/keys"),
        ("COURIER_SEAL_KEY_WINDOW", "48h"),
    ] {
        assert!(
            env.contains(&json!({"name": name, "value": value})),
            "{name}={value} in {env:?}"
        );
    }

    let both = json!({
        "courier.dev/seal-keys-secret": "orders-seal",
        "courier.dev/tls-secret": "broker-ca",
    });
    let (doc, _) = inject_document(deployment(both), &SidecarDefaults::chart()).unwrap();
    assert_eq!(
        doc["spec"]["template"]["spec"]["volumes"],
        json!([
            {"name": "courier-tls", "secret": {"secretName": "broker-ca"}},
            {"name": "courier-seal", "secret": {"secretName": "orders-seal"}},
        ])
    );

    let (_, decision) = inject_document(
        deployment(json!({"courier.dev/seal-key-window": "a day"})),
        &SidecarDefaults::chart(),
    )
    .unwrap();
    let Decision::Deny(message) = decision else {
        panic!("a bad window must be refused, got {decision}");
    };
    assert!(message.contains("courier.dev/seal-key-window"), "{message}");
}

/// Injects a Deployment with `annotations` and checks that the Secret
/// `secret` is the pod volume `volume`, mounted read-only at `path` in the
/// sidecar and not in the app; returns the sidecar's variables.
fn mounted_in_the_sidecar_only(
    annotations: Value,
    volume: &str,
    secret: &str,
    path: &str,
) -> Vec<Value> {
    let (doc, decision) =
        inject_document(deployment(annotations), &SidecarDefaults::chart()).unwrap();
    assert!(matches!(decision, Decision::Inject { .. }), "{decision}");
    let spec = &doc["spec"]["template"]["spec"];
    assert_eq!(
        spec["volumes"],
        json!([{"name": volume, "secret": {"secretName": secret}}])
    );
    let sidecar = &spec["initContainers"][0];
    assert_eq!(
        sidecar["volumeMounts"],
        json!([{"name": volume, "mountPath": path, "readOnly": true}])
    );
    assert!(
        spec["containers"][0].get("volumeMounts").is_none(),
        "the app does not get the Secret: {}",
        spec["containers"][0]
    );
    sidecar["env"].as_array().unwrap().clone()
}

/// `courier.dev/tls-secret` mounts the Secret read-only into the sidecar
/// only and points the TLS flags' variables at its keys; with
/// `courier.dev/tls-client-cert: "true"` the client certificate too.
#[test]
fn a_tls_secret_is_mounted_into_the_sidecar_and_sets_the_tls_flags() {
    let given = json!({
        "courier.dev/tls-secret": "broker-tls",
        "courier.dev/tls-client-cert": "true",
    });
    let env = mounted_in_the_sidecar_only(given, "courier-tls", "broker-tls", "/etc/courier/tls");
    for (name, value) in [
        ("COURIER_TLS_CA_FILE", "/etc/courier/tls/ca.crt"),
        ("COURIER_TLS_CERT_FILE", "/etc/courier/tls/tls.crt"),
        ("COURIER_TLS_KEY_FILE", "/etc/courier/tls/tls.key"),
    ] {
        assert!(
            env.contains(&json!({"name": name, "value": value})),
            "{name}={value} in {env:?}"
        );
    }

    let (doc, _) = inject_document(
        deployment(json!({"courier.dev/tls-secret": "broker-ca"})),
        &SidecarDefaults::chart(),
    )
    .unwrap();
    let env = doc["spec"]["template"]["spec"]["initContainers"][0]["env"].to_string();
    assert!(env.contains("COURIER_TLS_CA_FILE"), "{env}");
    assert!(!env.contains("COURIER_TLS_CERT_FILE"), "CA only: {env}");

    for bad in [
        json!({"courier.dev/tls-secret": "broker-tls", "courier.dev/tls-client-cert": "yes"}),
        json!({"courier.dev/tls-client-cert": "true"}),
    ] {
        let (_, decision) =
            inject_document(deployment(bad.clone()), &SidecarDefaults::chart()).unwrap();
        let Decision::Deny(message) = decision else {
            panic!("{bad} must be refused, got {decision}");
        };
        assert!(message.contains("courier.dev/tls-client-cert"), "{message}");
    }
}

/// `extra` on a Deployment that consumes from `source` (a URL, not the
/// Secret of [`deployment`]).
fn consuming_from(source: &str, mut extra: Value) -> Value {
    extra["courier.dev/source-secret"] = Value::Null;
    extra["courier.dev/source"] = json!(source);
    extra
}

const CONFLUENT: &str = "kafkas://pkc-xxxx.region.provider.confluent.cloud:9092";

/// `courier.dev/kafka-sasl-secret` gives the sidecar the Secret's
/// `username` and `password` as `secretKeyRef` variables, as
/// `courier.dev/source-secret` gives `COURIER_SOURCE`, and mounts nothing;
/// the mechanism, token URL and scope are passed through.
#[test]
fn a_kafka_sasl_secret_becomes_secret_key_ref_variables() {
    let given = consuming_from(
        CONFLUENT,
        json!({
            "courier.dev/kafka-sasl-secret": "kafka-login",
            "courier.dev/kafka-sasl-mechanism": "PLAIN",
        }),
    );
    let (doc, decision) = inject_document(deployment(given), &SidecarDefaults::chart()).unwrap();
    assert!(matches!(decision, Decision::Inject { .. }), "{decision}");
    let spec = &doc["spec"]["template"]["spec"];
    assert!(spec.get("volumes").is_none(), "no volume: {spec}");
    let sidecar = &spec["initContainers"][0];
    assert!(sidecar.get("volumeMounts").is_none(), "{sidecar}");
    let env = sidecar["env"].as_array().unwrap();
    for expected in [
        json!({"name": "COURIER_SOURCE", "value": CONFLUENT}),
        json!({"name": "COURIER_KAFKA_SASL_MECHANISM", "value": "PLAIN"}),
        json!({"name": "COURIER_KAFKA_SASL_USERNAME",
               "valueFrom": {"secretKeyRef": {"name": "kafka-login", "key": "username"}}}),
        json!({"name": "COURIER_KAFKA_SASL_PASSWORD",
               "valueFrom": {"secretKeyRef": {"name": "kafka-login", "key": "password"}}}),
    ] {
        assert!(env.contains(&expected), "{expected} in {env:?}");
    }
    assert!(
        !env.iter()
            .any(|var| var["name"].as_str().unwrap().contains("OAUTH")),
        "{env:?}"
    );
    assert!(
        spec["containers"][0].get("env").is_none(),
        "the app does not get the login: {}",
        spec["containers"][0]
    );

    // OAUTHBEARER with its token URL and scope; kafka:// as well as kafkas://.
    let env = sidecar_env(consuming_from(
        "kafka://kafka.shop.svc:9092",
        json!({
            "courier.dev/kafka-sasl-secret": "kafka-oauth",
            "courier.dev/kafka-sasl-mechanism": "OAUTHBEARER",
            "courier.dev/kafka-oauth-token-url": "https://idp.example.com/oauth2/token",
            "courier.dev/kafka-oauth-scope": "kafka:consume",
        }),
    ))
    .unwrap();
    for expected in [
        json!({"name": "COURIER_KAFKA_SASL_MECHANISM", "value": "OAUTHBEARER"}),
        json!({"name": "COURIER_KAFKA_OAUTH_TOKEN_URL", "value": "https://idp.example.com/oauth2/token"}),
        json!({"name": "COURIER_KAFKA_OAUTH_SCOPE", "value": "kafka:consume"}),
        json!({"name": "COURIER_KAFKA_SASL_USERNAME",
               "valueFrom": {"secretKeyRef": {"name": "kafka-oauth", "key": "username"}}}),
        json!({"name": "COURIER_KAFKA_SASL_PASSWORD",
               "valueFrom": {"secretKeyRef": {"name": "kafka-oauth", "key": "password"}}}),
    ] {
        assert!(env.contains(&expected), "{expected} in {env:?}");
    }

    // A source in a Secret is not seen by the injector: the login passes.
    let env = sidecar_env(json!({
        "courier.dev/kafka-sasl-secret": "kafka-login",
        "courier.dev/kafka-sasl-mechanism": "SCRAM-SHA-512",
    }))
    .unwrap();
    assert!(
        env.contains(&json!({"name": "COURIER_KAFKA_SASL_MECHANISM", "value": "SCRAM-SHA-512"})),
        "{env:?}"
    );

    // Without the annotations, no login variable.
    let env = sidecar_env(json!({})).unwrap();
    assert!(
        !env.iter()
            .any(|var| var["name"].as_str().unwrap().starts_with("COURIER_KAFKA_")),
        "{env:?}"
    );
}

/// `courier.dev/tls-secret` applies to `kafkas://`, beside a SASL login:
/// its volume and the CA variable, and the login from its own Secret.
#[test]
fn a_tls_secret_serves_kafkas_with_a_sasl_login() {
    let given = consuming_from(
        "kafkas://kafka.shop.svc:9093",
        json!({
            "courier.dev/tls-secret": "kafka-ca",
            "courier.dev/kafka-sasl-secret": "kafka-login",
            "courier.dev/kafka-sasl-mechanism": "SCRAM-SHA-256",
        }),
    );
    let env = mounted_in_the_sidecar_only(given, "courier-tls", "kafka-ca", "/etc/courier/tls");
    for expected in [
        json!({"name": "COURIER_TLS_CA_FILE", "value": "/etc/courier/tls/ca.crt"}),
        json!({"name": "COURIER_KAFKA_SASL_MECHANISM", "value": "SCRAM-SHA-256"}),
        json!({"name": "COURIER_KAFKA_SASL_PASSWORD",
               "valueFrom": {"secretKeyRef": {"name": "kafka-login", "key": "password"}}}),
    ] {
        assert!(env.contains(&expected), "{expected} in {env:?}");
    }
}

/// The variables of the login are the ones `courier run` reads: the
/// mechanism, user, token URL and scope its flags' variables, the password
/// the variable it takes instead of `--kafka-sasl-password-file`; and the
/// passed-through values parse as those flags.
#[test]
fn the_kafka_login_variables_are_what_courier_run_reads() {
    let env = sidecar_env(consuming_from(
        CONFLUENT,
        json!({
            "courier.dev/kafka-sasl-secret": "kafka-login",
            "courier.dev/kafka-sasl-mechanism": "OAUTHBEARER",
            "courier.dev/kafka-oauth-token-url": "https://idp.example.com/oauth2/token",
            "courier.dev/kafka-oauth-scope": "kafka",
        }),
    ))
    .unwrap();
    let mut cli = Cli::command();
    cli.build();
    let run = cli.find_subcommand("run").unwrap().clone();
    let flag_of = |env: &str| {
        run.get_arguments()
            .find(|a| a.get_env().and_then(|e| e.to_str()) == Some(env))
            .and_then(|a| a.get_long())
    };
    let mut argv = vec![
        "courier".to_string(),
        "run".into(),
        "--queue=orders".into(),
        format!("--source={CONFLUENT}"),
    ];
    let mut login = Vec::new();
    for var in &env {
        let name = var["name"].as_str().unwrap();
        if !name.starts_with("COURIER_KAFKA_") {
            continue;
        }
        login.push(name);
        if name == courier::cmd::args::KAFKA_SASL_PASSWORD_ENV {
            assert_eq!(flag_of(name), None, "the password has no flag");
            continue;
        }
        let flag = flag_of(name).unwrap_or_else(|| panic!("{name} is no courier run variable"));
        let value = var["value"].as_str().unwrap_or("a-client-id");
        argv.push(format!("--{flag}={value}"));
    }
    assert_eq!(
        login,
        [
            "COURIER_KAFKA_SASL_USERNAME",
            "COURIER_KAFKA_SASL_PASSWORD",
            "COURIER_KAFKA_SASL_MECHANISM",
            "COURIER_KAFKA_OAUTH_TOKEN_URL",
            "COURIER_KAFKA_OAUTH_SCOPE",
        ]
    );
    if let Err(e) = <Cli as clap::Parser>::try_parse_from(&argv) {
        panic!("courier run does not accept {argv:?}: {e}");
    }
}

/// Each way the login annotations do not hang together refuses the pod,
/// with what to change; a refusal never repeats the source's credentials.
#[test]
fn a_kafka_login_that_does_not_hang_together_refuses_the_pod() {
    let login = |extra: Value| {
        let mut given = json!({
            "courier.dev/kafka-sasl-secret": "kafka-login",
            "courier.dev/kafka-sasl-mechanism": "PLAIN",
        });
        for (k, v) in extra.as_object().unwrap() {
            given[k] = v.clone();
        }
        consuming_from(CONFLUENT, given)
    };
    for (given, expected) in [
        (
            login(json!({"courier.dev/kafka-sasl-mechanism": null})),
            "courier.dev/kafka-sasl-secret is set without courier.dev/kafka-sasl-mechanism; name the mechanism to log in with (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER)",
        ),
        (
            login(json!({"courier.dev/kafka-sasl-secret": null})),
            "courier.dev/kafka-sasl-mechanism is set without courier.dev/kafka-sasl-secret; name the Secret whose keys username and password hold the login",
        ),
        (
            login(
                json!({"courier.dev/kafka-sasl-secret": null, "courier.dev/kafka-sasl-mechanism": "OAUTHBEARER",
                         "courier.dev/kafka-oauth-token-url": "https://idp.example.com/oauth2/token"}),
            ),
            "courier.dev/kafka-sasl-mechanism is set without courier.dev/kafka-sasl-secret; name the Secret whose keys username and password hold the OAuth client id and secret",
        ),
        (
            login(
                json!({"courier.dev/kafka-oauth-token-url": "https://idp.example.com/oauth2/token"}),
            ),
            "courier.dev/kafka-oauth-token-url is for OAUTHBEARER, and courier.dev/kafka-sasl-mechanism is PLAIN; leave it out",
        ),
        (
            login(
                json!({"courier.dev/kafka-sasl-mechanism": "SCRAM-SHA-256", "courier.dev/kafka-oauth-scope": "kafka"}),
            ),
            "courier.dev/kafka-oauth-scope is for OAUTHBEARER, and courier.dev/kafka-sasl-mechanism is SCRAM-SHA-256; leave it out",
        ),
        (
            consuming_from(CONFLUENT, json!({"courier.dev/kafka-oauth-scope": "kafka"})),
            "courier.dev/kafka-oauth-scope is set without courier.dev/kafka-sasl-mechanism; it is for OAUTHBEARER: set the mechanism to OAUTHBEARER, or leave it out",
        ),
        (
            login(json!({"courier.dev/kafka-sasl-mechanism": "OAUTHBEARER"})),
            "courier.dev/kafka-sasl-mechanism OAUTHBEARER needs courier.dev/kafka-oauth-token-url, the identity provider's token endpoint",
        ),
        (
            consuming_from(
                "amqps://orders:s3cret@rabbitmq.shop.svc:5671/%2f",
                json!({"courier.dev/kafka-sasl-secret": "kafka-login", "courier.dev/kafka-sasl-mechanism": "PLAIN"}),
            ),
            "courier.dev/kafka-sasl-secret, courier.dev/kafka-sasl-mechanism are for Kafka, and courier.dev/source has the scheme \"amqps\"; leave them out, or consume from a kafka:// or kafkas:// URL",
        ),
        (
            consuming_from(
                "redis://redis.shop.svc:6379/0",
                json!({"courier.dev/kafka-oauth-scope": "kafka"}),
            ),
            "courier.dev/kafka-oauth-scope is for Kafka, and courier.dev/source has the scheme \"redis\"; leave it out, or consume from a kafka:// or kafkas:// URL",
        ),
        (
            login(json!({"courier.dev/kafka-sasl-mechanism": "plain"})),
            "courier.dev/kafka-sasl-mechanism \"plain\" is not one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER",
        ),
        (
            login(json!({"courier.dev/kafka-sasl-mechanism": "OAUTHBEARER",
                         "courier.dev/kafka-oauth-token-url": "ftp://idp.example.com/oauth2/token"})),
            "courier.dev/kafka-oauth-token-url \"ftp://idp.example.com/oauth2/token\" is not an http(s) URL with a host; write it like https://idp.example.com/oauth2/token",
        ),
        (
            login(json!({"courier.dev/kafka-sasl-mechanism": "OAUTHBEARER",
                         "courier.dev/kafka-oauth-token-url": "https://idp.example.com/oauth2/token",
                         "courier.dev/kafka-oauth-scope": "kafka\nadmin"})),
            "courier.dev/kafka-oauth-scope \"kafka\\nadmin\" holds a control character; write it on one line, without tabs",
        ),
    ] {
        let message = sidecar_env(given.clone()).unwrap_err();
        assert!(
            message.contains(expected),
            "{given}: {expected:?} in {message}"
        );
        assert!(!message.contains("s3cret"), "{message}");
    }
}

/// The injector's bound on `courier.dev/batch-max-messages` is the
/// sidecar's own (`BatchSettings::MAX_MESSAGES`), which it cannot import.
#[test]
fn the_batch_annotation_takes_what_the_sidecar_takes() {
    let batch = PASSTHROUGH
        .iter()
        .find(|p| p.flag == "batch-max-messages")
        .expect("a batch-max-messages annotation");
    assert_eq!(
        batch.kind,
        courier::inject::flags::Kind::Count(courier::dispatch::BatchSettings::MAX_MESSAGES as u64)
    );
}
