//! `courier inject --pod FILE` previews what the chart's injector adds: with
//! no flags it uses the chart's defaults, with `--values` the chart's values
//! file, and the Deployment it prints is the one the webhook's JSON Patch
//! makes of the walkthrough's Deployment (`tests/fixtures/inject/deployment.yaml`).
//! `scripts/test-chart` closes the loop with Helm: the chart's rendered
//! injector settings give the same preview byte for byte.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use base64::Engine;
use courier::inject::{self, SidecarDefaults, apply_chart_values};

use crate::common::root;
use serde_json::{Value, json};

fn deployment() -> PathBuf {
    root().join("tests/fixtures/inject/deployment.yaml")
}

fn walkthrough_values() -> PathBuf {
    root().join("tests/fixtures/helm/walkthrough-values.yaml")
}

/// Runs `courier inject --pod` with no COURIER_* variables of the caller's.
fn preview(args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_courier"));
    command.arg("inject").args(args);
    for (key, _) in std::env::vars() {
        if key.starts_with("COURIER_") {
            command.env_remove(key);
        }
    }
    command.output().expect("courier runs")
}

/// What the preview printed, its `/drain` secrets masked (each run makes
/// new ones, as each admission does).
fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "courier inject failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    inject::mask_drain_tokens(&String::from_utf8(output.stdout.clone()).unwrap())
}

fn yaml(text: &str) -> Value {
    serde_saphyr::from_str(text).expect("YAML")
}

/// What the webhook does to the Deployment's pods: the pod template as an
/// AdmissionReview, answered by the injector's own code, the patch applied.
fn webhook_pod(defaults: &SidecarDefaults, deployment: &Value) -> Value {
    let template = &deployment["spec"]["template"];
    let pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": template["metadata"],
        "spec": template["spec"],
    });
    let review = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "0b8c6a8e-5d37-4c1e-9a55-3f3c1b2d4e5f",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "shop",
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod,
        },
    });
    let answer = inject::review(&serde_json::to_vec(&review).unwrap(), defaults);
    let response = &answer["response"];
    assert_eq!(response["allowed"], true, "{answer}");
    let raw = base64::engine::general_purpose::STANDARD
        .decode(response["patch"].as_str().expect("a patch"))
        .unwrap();
    let patch: json_patch::Patch = serde_json::from_slice(&raw).unwrap();
    let mut pod = review["request"]["object"].clone();
    json_patch::patch(&mut pod, &patch).unwrap();
    serde_json::from_str(&inject::mask_drain_tokens(&pod.to_string())).unwrap()
}

fn chart_defaults_with(values: &Path) -> SidecarDefaults {
    let values = yaml(&std::fs::read_to_string(values).unwrap());
    let mut defaults = SidecarDefaults::chart();
    apply_chart_values(&mut defaults, &values).unwrap();
    defaults
}

#[test]
fn without_values_the_preview_is_a_default_install() {
    let plain = preview(&["--pod", deployment().to_str().unwrap()]);
    let chart_values = root().join("charts/courier/values.yaml");
    let with_chart = preview(&[
        "--pod",
        deployment().to_str().unwrap(),
        "--values",
        chart_values.to_str().unwrap(),
    ]);
    let printed = stdout(&plain);
    assert_eq!(
        printed,
        stdout(&with_chart),
        "the flags' defaults are the chart's"
    );
    let stderr = String::from_utf8_lossy(&plain.stderr);
    assert!(stderr.contains("as a native sidecar"), "{stderr}");
    let image = format!("image: courier:{}", env!("CARGO_PKG_VERSION"));
    assert!(
        printed.contains(&image),
        "the chart's default image: {printed}"
    );
}

#[test]
fn the_preview_is_what_the_webhook_injects_with_the_charts_values() {
    let output = preview(&[
        "--pod",
        deployment().to_str().unwrap(),
        "--values",
        walkthrough_values().to_str().unwrap(),
    ]);
    let previewed = yaml(&stdout(&output));
    let original = yaml(&std::fs::read_to_string(deployment()).unwrap());
    let injected = webhook_pod(&chart_defaults_with(&walkthrough_values()), &original);

    let template = &previewed["spec"]["template"];
    assert_eq!(template["metadata"], injected["metadata"]);
    assert_eq!(template["spec"], injected["spec"]);
    let sidecar = &template["spec"]["initContainers"][0];
    assert_eq!(sidecar["name"], "courier");
    assert_eq!(
        sidecar["restartPolicy"], "Always",
        "a native sidecar, as the chart injects"
    );
    assert_eq!(
        sidecar["image"],
        format!(
            "registry.example/platform/courier:{}",
            env!("CARGO_PKG_VERSION")
        )
    );
    assert_eq!(sidecar["resources"]["limits"]["cpu"], "1");
    assert_eq!(sidecar["resources"]["limits"]["memory"], "320Mi");
    // Everything but the pod template is the user's, untouched.
    assert_eq!(previewed["spec"]["replicas"], original["spec"]["replicas"]);
    assert_eq!(previewed["metadata"], original["metadata"]);
}

#[test]
fn the_preview_prints_the_webhooks_warnings() {
    let mut deployment = yaml(&std::fs::read_to_string(deployment()).unwrap());
    let spec = &mut deployment["spec"]["template"]["spec"];
    spec["containers"][0]
        .as_object_mut()
        .unwrap()
        .remove("volumeMounts");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("no-token.yaml");
    std::fs::write(&file, serde_json::to_string(&deployment).unwrap()).unwrap();
    let output = preview(&["--pod", file.to_str().unwrap()]);
    assert!(output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("warning: courier: courier.dev/policy is set but no container mounts a service account token"),
        "{stderr}"
    );
}

#[test]
fn bad_values_are_refused_with_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("values.yaml");
    std::fs::write(&file, "sidecar:\n  resources:\n    memoryLimit: lots\n").unwrap();
    let output = preview_with_values(&file);
    assert_eq!(output.status.code(), Some(2), "bad usage");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("sidecar.resources.memoryLimit \"lots\""),
        "{stderr}"
    );
    let output = preview(&["--values", file.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "--values needs --pod");
    // The RetryPolicy the chart creates, its flow-control fields too.
    for (spec, says) in [
        (
            "rateLimit: {perSecond: 0}",
            "defaultPolicy.spec.rateLimit.perSecond: must be greater than 0",
        ),
        ("maxAge: 1d", "defaultPolicy.spec.maxAge"),
        ("pausedUntil: soon", "defaultPolicy.spec.pausedUntil"),
        ("pased: true", "unknown field `pased`"),
    ] {
        std::fs::write(
            &file,
            format!("defaultPolicy:\n  enabled: true\n  spec:\n    {spec}\n"),
        )
        .unwrap();
        let output = preview_with_values(&file);
        assert_eq!(output.status.code(), Some(2), "{spec}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(says), "{spec}: {stderr}");
    }
    std::fs::write(
        &file,
        "defaultPolicy:\n  enabled: true\n  spec:\n    rateLimit: {perSecond: 20, burst: 5, scope: queue}\n    paused: true\n    pausedReason: migration\n    maxAge: 24h\n",
    )
    .unwrap();
    let output = preview_with_values(&file);
    assert!(output.status.success(), "{output:?}");
}

/// The preview of the test deployment with the chart's values in `file`.
fn preview_with_values(file: &Path) -> Output {
    preview(&[
        "--pod",
        deployment().to_str().unwrap(),
        "--values",
        file.to_str().unwrap(),
    ])
}

/// Found at 21da363, trying it as a new user would: `courier inject --pod
/// … --values …` said "sidecar injected" for a pod in a namespace the
/// chart's webhook is never called for, though the preview promises to be
/// the install. With the values, a namespace outside `sidecar.namespaces`,
/// an excluded one, or the release's own, is said so and the pod printed
/// as it was; a listed one is injected as before.
#[test]
fn the_preview_injects_only_where_the_charts_webhook_is_called() {
    let deployment = deployment();
    let values = walkthrough_values();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--pod",
            deployment.to_str().unwrap(),
            "--values",
            values.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        preview(&args)
    };
    let original = yaml(&std::fs::read_to_string(&deployment).unwrap());
    for (extra, why) in [
        (
            &["--namespace", "billing"][..],
            "sidecar.namespaces (shop) does not list billing",
        ),
        (&["--namespace", "kube-system"], "webhook.excludeNamespaces"),
        (
            &[
                "--namespace",
                "courier-system",
                "--release-namespace",
                "courier-system",
            ],
            "release namespace",
        ),
    ] {
        let output = run(extra);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("not injected") && stderr.contains(why),
            "{extra:?}: {stderr}"
        );
        assert!(!stderr.contains("sidecar injected"), "{stderr}");
        assert_eq!(
            yaml(&stdout(&output)),
            original,
            "{extra:?}: printed as it was"
        );
    }
    // The file's own namespace, shop, is listed: injected.
    let output = run(&[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("sidecar injected"), "{stderr}");
    assert_ne!(yaml(&stdout(&output)), original);
}
