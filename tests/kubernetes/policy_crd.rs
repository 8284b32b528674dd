//! The RetryPolicy CRD: the committed YAML never drifts from the Rust type,
//! and the generated schema refuses what the sidecar would refuse, before
//! anything reads it. The OpenAPI part is checked with a JSON-schema
//! validator, the CEL rules with kube's client-side CEL evaluation; both
//! run on the schema exactly as `courier crd` prints it.

use std::path::{Path, PathBuf};

use courier::model::{Class, Outcome};
use courier::policy::crd;
use courier::policy::file;
use courier::policy::{Policy, RetryPolicy};
use serde_json::Value;

use crate::common::root;

// === Drift ===

/// `crds/retrypolicy.yaml`, and the copy in any Helm chart, hold exactly
/// what the Rust type generates. Regenerate with
/// `cargo run -- crd > crds/retrypolicy.yaml`.
#[test]
fn committed_crd_files_match_the_rust_type() {
    let generated = crd::definition_yaml();
    let mut files = vec![root().join("crds/retrypolicy.yaml")];
    if let Ok(charts) = std::fs::read_dir(root().join("charts")) {
        for chart in charts.flatten() {
            let copy = chart.path().join("crds/retrypolicy.yaml");
            if copy.exists() {
                files.push(copy);
            }
        }
    }
    for path in files {
        let committed = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        assert!(
            committed == generated,
            "{} differs from the CRD the Rust type generates; run `cargo run -- crd > {}`",
            path.display(),
            path.strip_prefix(root()).unwrap_or(&path).display()
        );
    }
}

#[test]
fn courier_crd_prints_the_committed_file() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_courier"))
        .arg("crd")
        .output()
        .expect("run courier crd");
    assert!(out.status.success(), "{out:?}");
    let committed = std::fs::read_to_string(root().join("crds/retrypolicy.yaml")).unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), committed);
}

// === Validation by the schema ===

/// The CRD as the API server would read it from `crds/retrypolicy.yaml`.
fn open_api_schema() -> Value {
    let text = std::fs::read_to_string(root().join("crds/retrypolicy.yaml")).unwrap();
    let crd: Value = serde_saphyr::from_str(&text).expect("the CRD is YAML");
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

/// kubectl's default `--validate=strict` makes the API server refuse unknown
/// fields; a JSON-schema validator does the same when every object schema
/// says `additionalProperties: false`.
fn strict(mut schema: Value) -> Value {
    if let Some(object) = schema.as_object_mut() {
        if object.contains_key("properties") && !object.contains_key("additionalProperties") {
            object.insert("additionalProperties".into(), Value::Bool(false));
        }
        for (_, child) in object.iter_mut() {
            *child = strict(child.take());
        }
    } else if let Some(items) = schema.as_array_mut() {
        for child in items {
            *child = strict(child.take());
        }
    }
    schema
}

/// Why the generated schema refuses `object`, or `None` when it accepts it.
fn schema_verdict(object: &Value) -> Option<String> {
    let schema = open_api_schema();
    // OpenAPI: spec and status are what the schema describes; apiVersion,
    // kind and metadata are the API server's own.
    let spec_schema = strict(schema["properties"]["spec"].clone());
    let validator = jsonschema::validator_for(&spec_schema).expect("the spec schema compiles");
    let problems: Vec<String> = validator
        .iter_errors(&object["spec"])
        .map(|e| format!("openapi: {} at {}", e, e.instance_path()))
        .collect();
    if !problems.is_empty() {
        return Some(problems.join("; "));
    }
    // CEL: the x-kubernetes-validations rules, evaluated as the API server does.
    match kube::core::cel::Validator::new().validate(&schema, object, None) {
        Ok(()) => None,
        Err(errors) => Some(
            errors
                .as_slice()
                .iter()
                .map(|e| format!("cel: {e}"))
                .collect::<Vec<_>>()
                .join("; "),
        ),
    }
}

fn document(spec_yaml: &str) -> (String, Value) {
    let text = format!(
        "apiVersion: courier.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: orders\nspec:\n  {}\n",
        spec_yaml.replace('\n', "\n  ")
    );
    let value: Value = serde_saphyr::from_str(&text).expect("test documents are YAML");
    (text, value)
}

/// (spec, which layer refuses it, what the message must say)
const INVALID: &[(&str, &str, &str)] = &[
    ("maxAttempts: three", "openapi", "integer"),
    ("maxAttempts: 2.5", "openapi", "integer"),
    ("maxAttempts: 0", "openapi", "minimum"),
    ("maxAttempts: 1001", "openapi", "maximum"),
    ("timeout: 30", "openapi", "string"),
    ("timeout: soon", "openapi", "does not match"),
    ("timeout: -1s", "openapi", "does not match"),
    ("timeout: 0s", "cel", "timeout must be greater than 0"),
    ("backoff: {initial: 1 s}", "openapi", "does not match"),
    ("backoff: {multiplier: 0.5}", "openapi", "minimum"),
    ("backoff: {multiplier: \"2\"}", "openapi", "number"),
    ("backoff: {jitter: sometimes}", "openapi", "is not one of"),
    (
        "backoff: {initial: 10s, max: 1s}",
        "cel",
        "backoff.max must be at least backoff.initial",
    ),
    (
        "backoff: {max: 500ms}",
        "cel",
        "backoff.max must be at least backoff.initial",
    ),
    ("retryAfter: {max: 1d}", "openapi", "does not match"),
    ("retryAfter: {honor: \"yes\"}", "openapi", "boolean"),
    (
        "statusCodes: {retry: [\"6xx\"]}",
        "openapi",
        "does not match",
    ),
    (
        "statusCodes: {retry: [\"50x\"]}",
        "openapi",
        "does not match",
    ),
    ("statusCodes: {retry: [503]}", "openapi", "string"),
    (
        "statusCodes: {deadLetter: [\"2xx\"]}",
        "openapi",
        "does not match",
    ),
    (
        "statusCodes: {retry: [\"503\"], deadLetter: [\"503\"]}",
        "cel",
        "listed in both retry and deadLetter",
    ),
    (
        "statusCodes: {retry: [\"501\"]}",
        "cel",
        "listed in both retry and deadLetter",
    ),
    ("appDirectives: \"no\"", "openapi", "boolean"),
    ("appDirectives: 0", "openapi", "boolean"),
    ("maxAttemps: 3", "openapi", "maxAttemps"),
    (
        "rateLimit: {perSecond: 0}",
        "cel",
        "rateLimit.perSecond must be greater than 0",
    ),
    (
        "rateLimit: {perSecond: -0.5}",
        "cel",
        "rateLimit.perSecond must be greater than 0",
    ),
    ("rateLimit: {perSecond: 200000}", "openapi", "maximum"),
    ("rateLimit: {burst: 2}", "openapi", "perSecond"),
    ("rateLimit: {perSecond: 5, burst: 0}", "openapi", "minimum"),
    (
        "rateLimit: {perSecond: 5, scope: cluster}",
        "openapi",
        "is not one of",
    ),
    ("paused: \"yes\"", "openapi", "boolean"),
    ("pausedUntil: tomorrow", "openapi", "does not match"),
    ("maxAge: 1d", "openapi", "does not match"),
    (
        "maxAge: 0s",
        "cel",
        "maxAge must be a duration greater than 0",
    ),
];

#[test]
fn the_schema_refuses_invalid_documents_and_so_does_the_sidecar() {
    assert!(INVALID.len() >= 15);
    for (spec, layer, says) in INVALID {
        let (_, object) = document(spec);
        let verdict = schema_verdict(&object)
            .unwrap_or_else(|| panic!("the schema accepted invalid `{spec}`"));
        assert!(
            verdict.starts_with(&format!("{layer}:")),
            "`{spec}` should be refused by {layer}, got: {verdict}"
        );
        assert!(
            verdict.contains(says),
            "`{spec}`: the message should say {says:?}, got: {verdict}"
        );
        // A cluster with an older CRD lets it through; the sidecar must
        // refuse it on its own, as it reads it from the cluster.
        assert!(
            sidecar_verdict(&object).is_err(),
            "the sidecar accepted invalid `{spec}`"
        );
    }
}

fn examples() -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(root().join("examples"))
        .expect("examples/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    paths.sort();
    paths
}

/// What the sidecar makes of the object as the watcher hands it over.
fn sidecar_verdict(object: &Value) -> Result<Policy, String> {
    let policy: RetryPolicy = serde_json::from_value(object.clone()).map_err(|e| e.to_string())?;
    Policy::from_spec("orders", &policy.spec).map_err(|e| e.to_string())
}

fn accepted_by_both(name: &str, text: &str) {
    let object: Value = serde_saphyr::from_str(text).unwrap();
    if let Some(problem) = schema_verdict(&object) {
        panic!("{name}: the schema refused it: {problem}");
    }
    if let Err(problem) = sidecar_verdict(&object) {
        panic!("{name}: the sidecar refused it from the cluster: {problem}");
    }
    if let Err(problem) = file::parse(text) {
        panic!("{name}: the sidecar refused it from a file: {problem}");
    }
}

#[test]
fn examples_and_defaults_are_accepted() {
    let examples = examples();
    assert!(examples.len() >= 2, "{examples:?}");
    for path in &examples {
        accepted_by_both(
            &path.display().to_string(),
            &std::fs::read_to_string(path).unwrap(),
        );
    }
    for (name, spec) in [
        ("an empty spec", "{}"),
        (
            "an exact code beside its class",
            "statusCodes: {retry: [\"503\"], deadLetter: [\"5xx\"]}",
        ),
        (
            "Go durations",
            "timeout: 1m30s\nbackoff: {initial: 500ms, max: 1.5h}",
        ),
        (
            "max equal to initial",
            "backoff: {initial: 2s, max: 2s, multiplier: 1, jitter: none}",
        ),
    ] {
        let (text, _) = document(spec);
        accepted_by_both(name, &text);
    }
}

#[test]
fn the_examples_say_what_their_names_promise() {
    let read = |name: &str| {
        file::load(Path::new(&root().join("examples").join(name))).expect("the example loads")
    };
    let payments = read("payments.yaml");
    assert!(payments.retry_after.honor);
    assert_eq!(
        payments.retry_after.max,
        std::time::Duration::from_secs(600)
    );
    let fire_and_forget = read("fire-and-forget.yaml");
    assert_eq!(fire_and_forget.max_attempts, 1);
    // While an app starts, 404 and 409 are retried; other 4xx stay final.
    let starting = read("app-starting.yaml");
    for (status, class) in [
        (404, Class::Transient),
        (409, Class::Transient),
        (408, Class::Transient),
        (429, Class::Transient),
        (503, Class::Transient),
        (400, Class::Permanent),
        (422, Class::Permanent),
        (501, Class::Permanent),
    ] {
        let answer = Outcome::Answered {
            status,
            retry_after: None,
            retry_after_invalid: false,
            excerpt: Default::default(),
            directives: Default::default(),
        };
        assert_eq!(starting.classify(&answer), class, "{status}");
    }
    assert!(starting.app_directives);
}

/// The API server refuses a CRD whose CEL rules are too costly to
/// evaluate; kube-cel estimates the cost the same way.
#[test]
fn cel_rules_compile_within_the_cost_budget() {
    use kube::core::cel::{compile_schema, estimate_rule_cost};
    let schema = open_api_schema();
    let compiled = compile_schema(&schema);
    assert!(
        !compiled.has_errors(),
        "{:?}",
        compiled.compilation_errors()
    );
    let spec = &schema["properties"]["spec"]["properties"];
    for (path, rule) in [
        ("backoff", crd::BACKOFF_MAX_RULE),
        ("statusCodes", crd::NOT_IN_BOTH_LISTS_RULE),
    ] {
        let node = compile_schema(&spec[path]);
        // Cost only: kube-cel's scope check does not know comprehension
        // variables (`c` in `.all(c, ...)`) and would flag them.
        let warnings = estimate_rule_cost(rule, &node);
        assert!(warnings.is_empty(), "{path}: {warnings:?}");
    }
}
