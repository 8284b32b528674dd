//! A RetryPolicy document read from a file (`--policy-file`) and reloaded
//! when the file changes. The file is polled rather than watched with inotify
//! because Kubernetes updates a mounted ConfigMap by swapping a symlink,
//! which inotify watches on the file itself miss.

use std::path::{Path, PathBuf};
use std::time::Duration;

pub use super::Reload;
use super::{API_VERSION, KIND, Policy, PolicyUpdate, RetryPolicyDocument};

/// Why a policy file was refused.
#[derive(Debug, thiserror::Error)]
pub enum PolicyFileError {
    #[error("cannot read policy file {path}: {error}")]
    Unreadable {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("policy file {path}: {problem}")]
    Invalid { path: PathBuf, problem: String },
}

/// Parses and validates a RetryPolicy document.
pub fn parse(text: &str) -> Result<Policy, String> {
    let doc: RetryPolicyDocument =
        serde_saphyr::from_str(text).map_err(|e| format!("not a RetryPolicy document: {e}"))?;
    if doc.api_version != API_VERSION {
        return Err(format!(
            "apiVersion: expected {API_VERSION:?}, got {:?}",
            doc.api_version
        ));
    }
    if doc.kind != KIND {
        return Err(format!("kind: expected {KIND:?}, got {:?}", doc.kind));
    }
    let name = if doc.metadata.name.is_empty() {
        "file".to_string()
    } else {
        doc.metadata.name.clone()
    };
    Policy::from_spec(&name, &doc.spec).map_err(|e| e.to_string())
}

/// Reads the file once; generation 1.
pub fn load(path: &Path) -> Result<Policy, PolicyFileError> {
    let text = std::fs::read_to_string(path).map_err(|error| PolicyFileError::Unreadable {
        path: path.to_path_buf(),
        error,
    })?;
    let mut policy = parse(&text).map_err(|problem| PolicyFileError::Invalid {
        path: path.to_path_buf(),
        problem,
    })?;
    policy.generation = 1;
    Ok(policy)
}

/// Polls `path` every `interval`; a changed file is parsed and either
/// applied (generation + 1) or refused. `on_reload` sees every outcome.
pub fn watch(
    path: PathBuf,
    update: PolicyUpdate,
    interval: Duration,
    mut on_reload: impl FnMut(&Reload) + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    // Read now, not when the task first runs: an edit made in between
    // would otherwise be taken as the starting content and never applied.
    let mut last = std::fs::read(&path).ok();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(interval).await;
            let now = match std::fs::read(&path) {
                Ok(bytes) => Some(bytes),
                Err(e) => {
                    if last.is_some() {
                        on_reload(&Reload::Rejected(format!(
                            "cannot read policy file {}: {e}",
                            path.display()
                        )));
                    }
                    last = None;
                    continue;
                }
            };
            if now == last {
                continue;
            }
            last = now.clone();
            let text = String::from_utf8_lossy(now.as_deref().unwrap_or_default());
            let parsed = parse(&text)
                .map_err(|problem| format!("policy file {}: {problem}", path.display()));
            on_reload(&update.offer(parsed, None));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_design_document_parses_to_the_defaults() {
        let text = include_str!("../../examples/defaults.yaml");
        let policy = parse(text).unwrap();
        assert_eq!(
            policy,
            Policy {
                name: "orders".into(),
                ..Policy::default()
            }
        );
    }

    #[test]
    fn errors_name_the_field() {
        let rows = [
            ("maxAttempts: 0", "spec.maxAttempts"),
            ("timeout: soon", "spec.timeout"),
            ("backoff: {initial: 10s, max: 1s}", "spec.backoff.max"),
            ("backoff: {multiplier: 0.5}", "spec.backoff.multiplier"),
            ("backoff: {jitter: sometimes}", "jitter"),
            ("statusCodes: {retry: [\"6xx\"]}", "spec.statusCodes.retry"),
            (
                "statusCodes: {retry: [\"503\"], deadLetter: [\"503\"]}",
                "spec.statusCodes",
            ),
            ("maxAttemps: 3", "maxAttemps"),
        ];
        for (spec, field) in rows {
            let text =
                format!("apiVersion: courier.dev/v1alpha1\nkind: RetryPolicy\nspec:\n  {spec}\n");
            let err = parse(&text).unwrap_err();
            assert!(err.contains(field), "{spec}: {err}");
        }
    }

    #[test]
    fn wrong_kind_is_refused() {
        let err = parse("apiVersion: v1\nkind: ConfigMap\n").unwrap_err();
        assert!(err.contains("apiVersion"), "{err}");
    }
}
