//! Which pods get the sidecar and what is added to them: [`decide`] is a
//! pure function from a pod to a [`Decision`], and [`inject_document`] runs
//! it on a pod or a workload's pod template for `courier inject --pod`.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

use super::settings::{
    CONTAINER_NAME, DEFAULT_DRAIN, DEFAULT_GRACE_SECONDS, DRAIN_PATH, GRACE_MARGIN, INJECT_LABEL,
    KAFKA_SASL_PASSWORD_ENV, KAFKA_SASL_PASSWORD_KEY, KAFKA_SASL_USERNAME_ENV,
    KAFKA_SASL_USERNAME_KEY, METRICS_PORT_NAME, SEAL_KEYS_FILE, SEAL_MOUNT_PATH, SEAL_VOLUME,
    SIDECAR_UID, Settings, SidecarDefaults, SourceSetting, TLS_MOUNT_PATH, TLS_VOLUME,
    TOKEN_MOUNT_PATH, annotations, read_settings,
};
use crate::duration;
use crate::source::redact;

/// The pod volume the embedded queue's directory is mounted from.
pub const EMBEDDED_VOLUME: &str = "courier-data";

/// What the injector does with one pod, and why.
#[derive(Debug, Clone)]
pub enum Decision {
    /// Add the sidecar: the patch, and whether it went in as a native sidecar.
    Inject {
        patch: json_patch::Patch,
        native: bool,
        warnings: Vec<String>,
    },
    /// Leave the pod as it is.
    Skip(Skip),
    /// Refuse the pod: it asked for a sidecar that could not start.
    Deny(String),
}

/// Why a pod is left alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// Only pod creation is mutated.
    NotACreate,
    /// The pod does not carry `courier.dev/inject: "true"`.
    NotOptedIn,
    /// The pod already has a container named `courier`.
    AlreadyInjected,
    /// `hostNetwork: true`: the sidecar's port would be the node's.
    HostNetwork,
}

impl Skip {
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::NotACreate => "not-a-create",
            Skip::NotOptedIn => "not-opted-in",
            Skip::AlreadyInjected => "already-injected",
            Skip::HostNetwork => "host-network",
        }
    }

    pub fn message(self) -> &'static str {
        match self {
            Skip::NotACreate => "courier: only pod creation is mutated",
            Skip::NotOptedIn => {
                "courier: the pod does not carry the label courier.dev/inject=true; not injected"
            }
            Skip::AlreadyInjected => {
                "courier: the pod already has a container named courier; left as it is"
            }
            Skip::HostNetwork => {
                "courier: hostNetwork pods are not injected (the sidecar's metrics port would be the node's); run courier as a container of your own there"
            }
        }
    }
}

impl Decision {
    /// The short reason, for logs and audit annotations.
    pub fn reason(&self) -> &'static str {
        match self {
            Decision::Inject { native: true, .. } => "injected-native-sidecar",
            Decision::Inject { native: false, .. } => "injected",
            Decision::Skip(skip) => skip.as_str(),
            Decision::Deny(_) => "denied",
        }
    }

    /// The sentence that explains it, returned to the API server.
    pub fn message(&self) -> String {
        match self {
            Decision::Inject { native: true, .. } => {
                "courier: sidecar injected as a native sidecar (init container, restartPolicy Always)".into()
            }
            Decision::Inject { native: false, .. } => {
                "courier: sidecar injected as a container".into()
            }
            Decision::Skip(skip) => skip.message().into(),
            Decision::Deny(message) => message.clone(),
        }
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message())
    }
}

/// Decides what to do with a pod being created, with a new `/drain` secret
/// for it ([`decide_with_token`]).
pub fn decide(pod: &Pod, defaults: &SidecarDefaults) -> Decision {
    decide_with_token(pod, defaults, &new_drain_token())
}

/// A secret for one pod's `/drain`: 128 random bits, with a prefix that
/// tells a reader (or a secret scanner) what it is.
pub fn new_drain_token() -> String {
    format!("cdt_{:032x}", rand::random::<u128>())
}

/// `text` with every drain secret [`new_drain_token`] makes written as
/// `cdt_` and 32 zeros: two injections of the same pod differ only in
/// their secrets, and a comparison (or a stored expectation) needs that
/// difference gone.
pub fn mask_drain_tokens(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("cdt_") {
        out.push_str(&rest[..at + 4]);
        let after = &rest[at + 4..];
        let hex = after
            .bytes()
            .take_while(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
            .count();
        if hex == 32 {
            out.push_str(&"0".repeat(32));
            rest = &after[32..];
        } else {
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// Decides what to do with a pod being created. Pure: the same pod,
/// defaults and token give the same decision and the same patch. The
/// sidecar requires `drain_token` on `/drain`, and the app containers'
/// `preStop` hooks send it.
pub fn decide_with_token(pod: &Pod, defaults: &SidecarDefaults, drain_token: &str) -> Decision {
    let labels = pod.metadata.labels.as_ref();
    let opted_in = labels
        .and_then(|l| l.get(INJECT_LABEL))
        .is_some_and(|v| v == "true");
    if !opted_in {
        return Decision::Skip(Skip::NotOptedIn);
    }
    let spec = match &pod.spec {
        Some(spec) => spec,
        None => return Decision::Deny("courier: the pod has no spec".into()),
    };
    let has_sidecar = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .any(|c| c.name == CONTAINER_NAME);
    if has_sidecar {
        return Decision::Skip(Skip::AlreadyInjected);
    }
    if spec.host_network == Some(true) {
        return Decision::Skip(Skip::HostNetwork);
    }
    let empty = BTreeMap::new();
    let given = pod.metadata.annotations.as_ref().unwrap_or(&empty);
    let settings = match read_settings(given, defaults) {
        Ok(s) => s,
        Err(problems) => {
            return Decision::Deny(format!(
                "courier: cannot inject the sidecar: {}. Fix the pod template's annotations, or remove the label {INJECT_LABEL}",
                problems.join("; ")
            ));
        }
    };
    let mut warnings = Vec::new();
    let token_mount = spec
        .containers
        .iter()
        .flat_map(|c| c.volume_mounts.iter().flatten())
        .find(|m| m.mount_path == TOKEN_MOUNT_PATH);
    if settings.policy.is_some() && token_mount.is_none() {
        warnings.push(format!(
            "courier: {} is set but no container mounts a service account token, so the sidecar cannot read the RetryPolicy",
            annotations::POLICY
        ));
    }
    if let SourceSetting::Url(url) = &settings.source
        && redact(url) != *url
    {
        warnings.push(format!(
            "courier: {} holds credentials, readable by anyone who can read the pod; put the URL in a Secret and name it with {}",
            annotations::SOURCE,
            annotations::SOURCE_SECRET
        ));
    }
    // The embedded queue writes where its URL says, and the sidecar's root
    // filesystem is read-only: without a volume there it crash-loops.
    let embedded_dir = match &settings.source {
        SourceSetting::Url(url) => url
            .strip_prefix("embedded:")
            .map(|dir| dir.trim_start_matches("//").to_string()),
        SourceSetting::Secret { .. } => None,
    };
    if let Some(dir) = &embedded_dir {
        let has_volume = spec
            .volumes
            .iter()
            .flatten()
            .any(|v| v.name == EMBEDDED_VOLUME);
        if !has_volume {
            return Decision::Deny(format!(
                "courier: {} embedded:{dir}: the embedded queue writes to {dir}, and the sidecar's root filesystem is read-only; add a volume named {EMBEDDED_VOLUME} to the pod (a PersistentVolumeClaim keeps the queue across pod restarts, an emptyDir only across container restarts) and courier mounts it at {dir}",
                annotations::SOURCE
            ));
        }
    }
    let mut container = sidecar_container(&settings, defaults);
    // The sidecar reads the RetryPolicy from the API, so it needs the
    // token; only then, because nothing else in it talks to the API.
    let mut mounts = Vec::new();
    if let (Some(_), Some(mount)) = (&settings.policy, token_mount) {
        mounts.push(json!({
            "name": mount.name,
            "mountPath": TOKEN_MOUNT_PATH,
            "readOnly": true,
        }));
    }
    if let Some(dir) = &embedded_dir {
        mounts.push(json!({"name": EMBEDDED_VOLUME, "mountPath": dir}));
    }
    let mut ops = Vec::new();
    if let Some(tls) = &settings.tls {
        mounts.push(json!({
            "name": TLS_VOLUME,
            "mountPath": TLS_MOUNT_PATH,
            "readOnly": true,
        }));
        let volume = json!({"name": TLS_VOLUME, "secret": {"secretName": tls.name}});
        match &spec.volumes {
            Some(list) if !list.is_empty() => ops.push(add("/spec/volumes/-", volume)),
            _ => ops.push(add("/spec/volumes", json!([volume]))),
        }
    }
    if let Some(secret) = &settings.seal_keys {
        mounts.push(json!({
            "name": SEAL_VOLUME,
            "mountPath": SEAL_MOUNT_PATH,
            "readOnly": true,
        }));
        let volume = json!({"name": SEAL_VOLUME, "secret": {"secretName": secret}});
        match (&spec.volumes, settings.tls.is_some()) {
            (Some(list), _) if !list.is_empty() => ops.push(add("/spec/volumes/-", volume)),
            (_, true) => ops.push(add("/spec/volumes/-", volume)),
            _ => ops.push(add("/spec/volumes", json!([volume]))),
        }
    }
    if !mounts.is_empty() {
        container["volumeMounts"] = Value::Array(mounts);
    }

    let mut hooks = Vec::new();
    let hooked = add_drain_hooks(
        spec,
        settings.metrics_port,
        drain_token,
        &mut hooks,
        &mut warnings,
    );
    let drain = settings.drain.unwrap_or(DEFAULT_DRAIN);
    let drain_seconds = (drain + GRACE_MARGIN).as_secs_f64().ceil() as i64;
    let grace = spec
        .termination_grace_period_seconds
        .unwrap_or(DEFAULT_GRACE_SECONDS);
    // A preStop hook's time counts against the grace period: the drain
    // comes on top of the app's own shutdown time.
    let needed = if hooked {
        grace + drain_seconds
    } else {
        drain_seconds
    };
    // A pod being deleted sends the sidecar its SIGTERM within the grace
    // period of the drain; a drain that outlasts it came from a restart
    // of the app container alone, and courier pulls again.
    let resume_after = grace.max(needed) + GRACE_MARGIN.as_secs() as i64;
    if let Some(env) = container["env"].as_array_mut() {
        env.push(json!({"name": "COURIER_DRAIN_TOKEN", "value": drain_token}));
        env.push(
            json!({"name": "COURIER_DRAIN_RESUME_AFTER", "value": format!("{resume_after}s")}),
        );
    }
    if settings.native {
        container["restartPolicy"] = json!("Always");
        match &spec.init_containers {
            Some(list) if !list.is_empty() => ops.push(add("/spec/initContainers/-", container)),
            _ => ops.push(add("/spec/initContainers", json!([container]))),
        }
    } else {
        ops.push(add("/spec/containers/-", container));
    }
    ops.extend(hooks);
    if grace < needed {
        ops.push(add("/spec/terminationGracePeriodSeconds", json!(needed)));
    }
    // The app may be scraped through these already; then its own
    // annotations stay and a PodMonitor scrapes courier's port by name.
    if !given.contains_key("prometheus.io/scrape") {
        let port = settings.metrics_port.to_string();
        for (key, value) in [
            ("prometheus.io/scrape", "true"),
            ("prometheus.io/port", port.as_str()),
            ("prometheus.io/path", "/metrics"),
        ] {
            if !given.contains_key(key) {
                let path = format!("/metadata/annotations/{}", escape_pointer(key));
                ops.push(add(&path, json!(value)));
            }
        }
    }
    let patch: json_patch::Patch =
        serde_json::from_value(Value::Array(ops)).expect("the patch operations are well-formed");
    Decision::Inject {
        patch,
        native: settings.native,
        warnings,
    }
}

/// Gives every app container a `preStop` hook that GETs the sidecar's
/// `/drain` with the pod's drain secret, so courier stops pulling and
/// settles what is in flight before the app gets SIGTERM. It needs nothing
/// in the app's image (the kubelet makes the request, to the pod's IP). A
/// container with a `preStop` of its own keeps it, with a warning, and gets
/// the secret as `COURIER_DRAIN_TOKEN` to send from that hook: replacing
/// the hook could break the app's shutdown, and a hook has one action.
/// True when a hook was added.
fn add_drain_hooks(
    spec: &k8s_openapi::api::core::v1::PodSpec,
    metrics_port: u16,
    drain_token: &str,
    ops: &mut Vec<Value>,
    warnings: &mut Vec<String>,
) -> bool {
    let hook = json!({
        "httpGet": {
            "path": DRAIN_PATH,
            "port": metrics_port,
            "scheme": "HTTP",
            "httpHeaders": [{"name": "Authorization", "value": format!("Bearer {drain_token}")}],
        },
    });
    let mut hooked = false;
    for (i, container) in spec.containers.iter().enumerate() {
        let lifecycle = container.lifecycle.as_ref();
        if lifecycle.is_some_and(|l| l.pre_stop.is_some()) {
            warnings.push(format!(
                "courier: container {} has a preStop hook of its own, kept; courier drains only at its SIGTERM, while the app may be stopping. To drain before the app stops, call GET http://127.0.0.1:{metrics_port}{DRAIN_PATH} with the header \"Authorization: Bearer $COURIER_DRAIN_TOKEN\" first in that hook (the variable is added to the container)",
                container.name
            ));
            let token = json!({"name": "COURIER_DRAIN_TOKEN", "value": drain_token});
            ops.push(match &container.env {
                Some(env) if !env.is_empty() => add(&format!("/spec/containers/{i}/env/-"), token),
                _ => add(&format!("/spec/containers/{i}/env"), json!([token])),
            });
            continue;
        }
        let op = match lifecycle {
            Some(_) => add(
                &format!("/spec/containers/{i}/lifecycle/preStop"),
                hook.clone(),
            ),
            None => add(
                &format!("/spec/containers/{i}/lifecycle"),
                json!({"preStop": hook.clone()}),
            ),
        };
        ops.push(op);
        hooked = true;
    }
    hooked
}

fn add(path: &str, value: Value) -> Value {
    json!({ "op": "add", "path": path, "value": value })
}

/// RFC 6901: `~` and `/` in a key are escaped in a JSON Pointer.
fn escape_pointer(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// The container that is injected. Its configuration is all in `COURIER_*`
/// variables, the same ones `courier run` reads, so that a Secret can
/// supply the broker URL and the Kafka login.
fn sidecar_container(settings: &Settings, defaults: &SidecarDefaults) -> Value {
    let mut env = vec![
        json!({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
        json!({"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}),
    ];
    match &settings.source {
        SourceSetting::Url(url) => env.push(json!({"name": "COURIER_SOURCE", "value": url})),
        SourceSetting::Secret { name, key } => env.push(json!({
            "name": "COURIER_SOURCE",
            "valueFrom": {"secretKeyRef": {"name": name, "key": key}},
        })),
    }
    // Kafka's SASL login, from its Secret as the broker URL may be.
    if let Some(secret) = &settings.kafka_sasl {
        for (name, key) in [
            (KAFKA_SASL_USERNAME_ENV, KAFKA_SASL_USERNAME_KEY),
            (KAFKA_SASL_PASSWORD_ENV, KAFKA_SASL_PASSWORD_KEY),
        ] {
            env.push(json!({
                "name": name,
                "valueFrom": {"secretKeyRef": {"name": secret, "key": key}},
            }));
        }
    }
    let mut var = |name: &str, value: String| env.push(json!({"name": name, "value": value}));
    if let Some(queue) = &settings.queue {
        var("COURIER_QUEUE", queue.clone());
    }
    if let Some(subscriptions) = &settings.subscriptions {
        var("COURIER_SUBSCRIPTIONS", subscriptions.clone());
    }
    if let Some(group) = &settings.group {
        var("COURIER_GROUP", group.clone());
    }
    if let Some(app) = &settings.app {
        var("COURIER_APP", app.clone());
    }
    if let Some(policy) = &settings.policy {
        var("COURIER_POLICY", policy.clone());
    }
    if let Some(n) = settings.concurrency {
        var("COURIER_CONCURRENCY", n.to_string());
    }
    if let Some(drain) = settings.drain {
        var("COURIER_DRAIN_TIMEOUT", duration::format(drain));
    }
    var(
        "COURIER_LISTEN",
        format!("0.0.0.0:{}", settings.metrics_port),
    );
    var("COURIER_LOG_FORMAT", defaults.log_format.clone());
    if let Some(level) = &settings.log_level {
        var("COURIER_LOG_LEVEL", level.clone());
    }
    for (name, value) in &settings.passthrough {
        var(name, value.clone());
    }
    if let Some(tls) = &settings.tls {
        var("COURIER_TLS_CA_FILE", format!("{TLS_MOUNT_PATH}/ca.crt"));
        if tls.client_cert {
            var("COURIER_TLS_CERT_FILE", format!("{TLS_MOUNT_PATH}/tls.crt"));
            var("COURIER_TLS_KEY_FILE", format!("{TLS_MOUNT_PATH}/tls.key"));
        }
    }
    if settings.seal_keys.is_some() {
        var(
            "COURIER_SEAL_KEYS_FILE",
            format!("{SEAL_MOUNT_PATH}/{SEAL_KEYS_FILE}"),
        );
    }
    if !settings.traces.is_empty() {
        // Defined before the variables that may use it: Kubernetes expands
        // `$(NAME)` only from variables listed earlier.
        env.push(
            json!({"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}),
        );
        let attributes = format!(
            "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),k8s.container.name={CONTAINER_NAME}"
        );
        env.push(json!({"name": "OTEL_RESOURCE_ATTRIBUTES", "value": attributes}));
        for (name, value) in &settings.traces {
            env.push(json!({"name": name, "value": value}));
        }
    }

    let r = &settings.resources;
    let pick = |pairs: [(&str, &Option<String>); 2]| -> Value {
        pairs
            .iter()
            .filter_map(|(k, v)| v.as_ref().map(|v| (k.to_string(), json!(v))))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let mut resources = serde_json::Map::new();
    let requests = pick([("cpu", &r.cpu_request), ("memory", &r.memory_request)]);
    let limits = pick([("cpu", &r.cpu_limit), ("memory", &r.memory_limit)]);
    if requests.as_object().is_some_and(|m| !m.is_empty()) {
        resources.insert("requests".into(), requests);
    }
    if limits.as_object().is_some_and(|m| !m.is_empty()) {
        resources.insert("limits".into(), limits);
    }

    let probe = |path: &str, period: i32, failures: i32| {
        json!({
            "httpGet": {"path": path, "port": METRICS_PORT_NAME, "scheme": "HTTP"},
            "periodSeconds": period,
            "timeoutSeconds": 1,
            "failureThreshold": failures,
        })
    };
    json!({
        "name": CONTAINER_NAME,
        "image": defaults.image,
        "imagePullPolicy": defaults.image_pull_policy,
        "args": ["run"],
        "env": env,
        "ports": [{
            "name": METRICS_PORT_NAME,
            "containerPort": settings.metrics_port,
            "protocol": "TCP",
        }],
        // A native sidecar counts as started once this passes, and only
        // then does the app start: courier is listening by then.
        "startupProbe": probe("/healthz", 1, 30),
        "readinessProbe": probe("/readyz", 5, 3),
        "livenessProbe": probe("/healthz", 10, 3),
        "resources": resources,
        "securityContext": {
            "runAsNonRoot": true,
            "runAsUser": SIDECAR_UID,
            "runAsGroup": SIDECAR_UID,
            "readOnlyRootFilesystem": true,
            "allowPrivilegeEscalation": false,
            "privileged": false,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
    })
}

/// Runs the decision on a Pod, or on the pod template of a Deployment,
/// StatefulSet, DaemonSet, ReplicaSet or Job, and applies the patch: what
/// the webhook would do to the pods it makes.
pub fn inject_document(
    mut doc: Value,
    defaults: &SidecarDefaults,
) -> Result<(Value, Decision), String> {
    let kind = doc
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let template_path = if kind == "Pod" {
        None
    } else if doc.pointer("/spec/template/spec").is_some() {
        Some("/spec/template")
    } else {
        return Err(format!(
            "a {kind:?} has no pod template; give a Pod, Deployment, StatefulSet, DaemonSet, ReplicaSet or Job"
        ));
    };
    let mut pod_value = match template_path {
        None => doc.clone(),
        Some(path) => {
            let template = doc.pointer(path).cloned().unwrap_or_default();
            json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": template.get("metadata").cloned().unwrap_or_else(|| json!({})),
                "spec": template.get("spec").cloned().unwrap_or_else(|| json!({})),
            })
        }
    };
    let pod: Pod =
        serde_json::from_value(pod_value.clone()).map_err(|e| format!("not a pod: {e}"))?;
    let decision = decide(&pod, defaults);
    if let Decision::Inject { patch, .. } = &decision {
        json_patch::patch(&mut pod_value, patch)
            .map_err(|e| format!("the patch does not apply: {e}"))?;
        match template_path {
            None => doc = pod_value,
            Some(path) => {
                let template = doc.pointer_mut(path).expect("checked above");
                template["metadata"] = pod_value["metadata"].take();
                template["spec"] = pod_value["spec"].take();
            }
        }
    }
    Ok((doc, decision))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointer_escaping() {
        assert_eq!(
            escape_pointer("prometheus.io/scrape"),
            "prometheus.io~1scrape"
        );
        assert_eq!(escape_pointer("a~b"), "a~0b");
    }
}
