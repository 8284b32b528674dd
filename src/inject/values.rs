//! The chart's values, read the way the chart reads them, so that
//! `courier inject --pod FILE --values values.yaml` previews exactly the
//! sidecar the chart's injector would add. The chart passes these same
//! values to the injector as `COURIER_SIDECAR_*` variables
//! (charts/courier/templates/deployment.yaml); this is that mapping, once,
//! for the preview.

use serde_json::Value;

use super::settings::{SidecarDefaults, is_quantity};

/// The chart's appVersion, which `scripts/test-chart` keeps equal to the
/// crate's version: the image tag when neither `image.tag` nor
/// `sidecar.image.tag` is set.
const APP_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Applies the sidecar-related keys of a chart values document over
/// `defaults`; keys the document leaves out keep the defaults, which are the
/// chart's own (see the test below). Every problem is named, with its key.
pub fn apply_chart_values(defaults: &mut SidecarDefaults, values: &Value) -> Result<(), String> {
    let get = |path: &str| values.pointer(path).filter(|v| !v.is_null());
    let text = |path: &str| -> Result<Option<String>, String> {
        match get(path) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.trim().to_string())),
            // --set and YAML make numbers of quantities such as 1 or 0.5.
            Some(Value::Number(n)) => Ok(Some(n.to_string())),
            Some(other) => Err(format!("{} is {other}, not a string", dotted(path))),
        }
    };
    let mut problems = Vec::new();

    // The image, as the chart's courier.sidecarImage helper builds it.
    let repository = take(&mut problems, text("/image/repository"));
    let tag = take(&mut problems, text("/image/tag"));
    let sidecar_repository = take(&mut problems, text("/sidecar/image/repository"));
    let sidecar_tag = take(&mut problems, text("/sidecar/image/tag"));
    let non_empty = |v: Option<String>| v.filter(|s| !s.is_empty());
    if repository.is_some()
        || tag.is_some()
        || sidecar_repository.is_some()
        || sidecar_tag.is_some()
    {
        let (default_repository, _) = defaults
            .image
            .rsplit_once(':')
            .unwrap_or((defaults.image.as_str(), ""));
        let repository = non_empty(sidecar_repository)
            .or(non_empty(repository))
            .unwrap_or_else(|| default_repository.to_string());
        let tag = non_empty(sidecar_tag)
            .or(non_empty(tag))
            .unwrap_or_else(|| APP_VERSION.to_string());
        defaults.image = format!("{repository}:{tag}");
    }
    if let Some(policy) = take(&mut problems, text("/sidecar/image/pullPolicy")) {
        match policy.as_str() {
            "Always" | "IfNotPresent" | "Never" => defaults.image_pull_policy = policy,
            _ => problems.push(format!(
                "sidecar.image.pullPolicy {policy:?} is not Always, IfNotPresent or Never"
            )),
        }
    }
    match get("/sidecar/nativeSidecars") {
        None => {}
        Some(Value::Bool(b)) => defaults.native_sidecars = *b,
        Some(other) => problems.push(format!(
            "sidecar.nativeSidecars is {other}, not true or false"
        )),
    }
    if let Some(format) = take(&mut problems, text("/sidecar/logFormat")) {
        match format.as_str() {
            "json" | "human" => defaults.log_format = format,
            _ => problems.push(format!("sidecar.logFormat {format:?} is not json or human")),
        }
    }
    let resources = &mut defaults.resources;
    for (key, slot) in [
        ("cpuRequest", &mut resources.cpu_request),
        ("memoryRequest", &mut resources.memory_request),
        ("cpuLimit", &mut resources.cpu_limit),
        ("memoryLimit", &mut resources.memory_limit),
    ] {
        let path = format!("/sidecar/resources/{key}");
        match take(&mut problems, text(&path)) {
            None => {}
            Some(v) if v.is_empty() => *slot = None,
            Some(v) if is_quantity(&v) => *slot = Some(v),
            Some(v) => problems.push(format!(
                "sidecar.resources.{key} {v:?} is not a Kubernetes quantity (like 100m, 64Mi or 1)"
            )),
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

/// The value, or `None` with the problem recorded.
fn take(problems: &mut Vec<String>, result: Result<Option<String>, String>) -> Option<String> {
    result.unwrap_or_else(|e| {
        problems.push(e);
        None
    })
}

fn dotted(path: &str) -> String {
    path.trim_start_matches('/').replace('/', ".")
}

/// Which namespaces the chart's webhook is called for (its
/// `namespaceSelector`), read from the same values: never the release's own
/// namespace nor `webhook.excludeNamespaces`; with `sidecar.namespaces`,
/// only those; without, only namespaces labelled
/// `webhook.namespaceOptInLabel=enabled`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookScope {
    pub namespaces: Vec<String>,
    pub excluded: Vec<String>,
    pub opt_in_label: String,
    pub release_namespace: Option<String>,
}

/// Whether the webhook is called for a namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    Called,
    /// Called if the namespace carries the opt-in label: the values
    /// cannot tell.
    IfLabelled(String),
    /// Never called: why.
    Never(String),
}

impl WebhookScope {
    /// The scope of a values document; keys it leaves out have the chart's
    /// defaults.
    pub fn of(values: &Value, release_namespace: Option<&str>) -> Self {
        let list = |path: &str, default: &[&str]| -> Vec<String> {
            match values.pointer(path).and_then(Value::as_array) {
                Some(items) => items
                    .iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect(),
                None => default.iter().map(|s| s.to_string()).collect(),
            }
        };
        Self {
            namespaces: list("/sidecar/namespaces", &[]),
            excluded: list(
                "/webhook/excludeNamespaces",
                &["kube-system", "kube-public", "kube-node-lease"],
            ),
            opt_in_label: values
                .pointer("/webhook/namespaceOptInLabel")
                .and_then(Value::as_str)
                .unwrap_or("courier.dev/injection")
                .to_string(),
            release_namespace: release_namespace.map(str::to_string),
        }
    }

    pub fn reach(&self, namespace: &str) -> Reach {
        if self.release_namespace.as_deref() == Some(namespace) {
            return Reach::Never(format!(
                "{namespace} is the chart's own release namespace, which its webhook never injects"
            ));
        }
        if self.excluded.iter().any(|n| n == namespace) {
            return Reach::Never(format!(
                "{namespace} is in webhook.excludeNamespaces ({})",
                self.excluded.join(", ")
            ));
        }
        if self.namespaces.is_empty() {
            return Reach::IfLabelled(format!(
                "the webhook is called for namespace {namespace} only if it carries the label {}=enabled (kubectl label namespace {namespace} {}=enabled), since sidecar.namespaces is empty",
                self.opt_in_label, self.opt_in_label
            ));
        }
        if self.namespaces.iter().any(|n| n == namespace) {
            Reach::Called
        } else {
            Reach::Never(format!(
                "sidecar.namespaces ({}) does not list {namespace}",
                self.namespaces.join(", ")
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_chart_defaults_are_the_injector_defaults() {
        let text = include_str!("../../charts/courier/values.yaml");
        let values: Value = serde_saphyr::from_str(text).expect("the chart's values.yaml parses");
        let mut defaults = SidecarDefaults::chart();
        apply_chart_values(&mut defaults, &values).expect("the chart's values apply");
        assert_eq!(defaults, SidecarDefaults::chart());
    }

    #[test]
    fn image_falls_back_like_the_chart() {
        let mut d = SidecarDefaults::chart();
        apply_chart_values(
            &mut d,
            &json!({"image": {"repository": "reg/courier", "tag": ""}}),
        )
        .unwrap();
        assert_eq!(d.image, format!("reg/courier:{APP_VERSION}"));
        apply_chart_values(
            &mut d,
            &json!({"image": {"repository": "reg/courier", "tag": "1.2"},
            "sidecar": {"image": {"tag": "1.3"}}}),
        )
        .unwrap();
        assert_eq!(d.image, "reg/courier:1.3");
    }

    #[test]
    fn numbers_are_quantities_and_bad_values_are_named() {
        let mut d = SidecarDefaults::chart();
        apply_chart_values(
            &mut d,
            &json!({"sidecar": {"resources": {"cpuLimit": 1, "memoryLimit": ""}}}),
        )
        .unwrap();
        assert_eq!(d.resources.cpu_limit.as_deref(), Some("1"));
        assert_eq!(d.resources.memory_limit, None);
        let err = apply_chart_values(
            &mut d,
            &json!({"sidecar": {"nativeSidecars": "maybe", "resources": {"cpuRequest": "lots"}}}),
        )
        .unwrap_err();
        assert!(err.contains("sidecar.nativeSidecars is \"maybe\""), "{err}");
        assert!(
            err.contains("sidecar.resources.cpuRequest \"lots\""),
            "{err}"
        );
    }
}
