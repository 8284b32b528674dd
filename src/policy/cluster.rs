//! A RetryPolicy read from the cluster (`--policy NAME`): one object in the
//! pod's namespace, watched with kube-runtime's watcher and applied to the
//! very next decision.
//!
//! After parsing, a change takes the same path as a file reload
//! ([`PolicyUpdate::offer`]), so applying, refusing, logging and counting
//! are one code. What only the cluster has is done here: a refused change is
//! recorded as a Kubernetes Event on the pod, and the object's status says
//! whether its generation was accepted.
//!
//! The watcher relists after a dropped watch and reconnects with backoff;
//! while it is away the last good policy stays in force. An object that does
//! not deserialize (possible with an older CRD installed, which validates
//! less) is refused like any invalid change instead of ending the stream. A
//! deleted or absent policy puts the built-in defaults in force.

use std::path::Path;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::WatchStreamExt;
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Client, Resource, ResourceExt};
use tokio::sync::watch as signal;

use super::crd::ACCEPTED;
use super::{Policy, PolicyUpdate, Reload, RetryPolicy};

/// Where Kubernetes puts the pod's namespace when no `POD_NAMESPACE` is set.
pub const SERVICE_ACCOUNT_NAMESPACE: &str =
    "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// The field manager and reporting controller name courier uses.
pub const MANAGER: &str = "courier";

/// Which RetryPolicy to follow, and the pod that Events are recorded on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyRef {
    pub name: String,
    pub namespace: String,
    /// `POD_NAME`; without it Events are recorded on the RetryPolicy itself.
    pub pod: Option<String>,
}

impl PolicyRef {
    /// `name` in the pod's namespace: `POD_NAMESPACE`, else the service
    /// account's namespace file. The error is shown to the user as is.
    pub fn from_env(name: &str) -> Result<Self, String> {
        Self::resolve(
            name,
            std::env::var("POD_NAMESPACE").ok(),
            Path::new(SERVICE_ACCOUNT_NAMESPACE),
            std::env::var("POD_NAME").ok(),
        )
    }

    fn resolve(
        name: &str,
        pod_namespace: Option<String>,
        namespace_file: &Path,
        pod: Option<String>,
    ) -> Result<Self, String> {
        if !is_object_name(name) {
            return Err(format!(
                "--policy {name:?} is not a Kubernetes object name; use lower-case letters, digits, '-' and '.', like orders"
            ));
        }
        let namespace = match pod_namespace.filter(|ns| !ns.trim().is_empty()) {
            Some(ns) => ns.trim().to_string(),
            None => std::fs::read_to_string(namespace_file)
                .map(|ns| ns.trim().to_string())
                .ok()
                .filter(|ns| !ns.is_empty())
                .ok_or_else(|| {
                    format!(
                        "--policy {name}: cannot tell the pod's namespace; set POD_NAMESPACE (fieldRef metadata.namespace) or mount the service account token ({})",
                        namespace_file.display()
                    )
                })?,
        };
        Ok(Self {
            name: name.to_string(),
            namespace,
            pod: pod.filter(|p| !p.trim().is_empty()),
        })
    }

    /// `namespace/name`, as log lines and messages show it.
    pub fn label(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// A DNS subdomain: what `metadata.name` of a custom resource may be.
fn is_object_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// What was last made of the object, so that a relist, a status write or a
/// repeated event does not apply (and count) the same change twice.
#[derive(Debug, Clone, PartialEq)]
enum Seen {
    Absent,
    Object {
        uid: Option<String>,
        generation: Option<i64>,
        /// The spec as JSON, or why it could not be read.
        content: Result<serde_json::Value, String>,
    },
}

/// Connects with the ambient configuration (in the pod: the service
/// account; outside: `KUBECONFIG`) and starts [`watch`]. The receiver turns
/// true once the policy has been read.
pub async fn follow(
    target: PolicyRef,
    update: PolicyUpdate,
    on_reload: impl FnMut(&Reload) + Send + 'static,
) -> Result<(tokio::task::JoinHandle<()>, signal::Receiver<bool>), kube::Error> {
    let client = Client::try_default().await?;
    let (read, read_rx) = signal::channel(false);
    Ok((watch(client, target, update, read, on_reload), read_rx))
}

/// Follows one RetryPolicy until the task is aborted. `read` turns true
/// once the policy has been read (found or not): the sidecar is not ready
/// before. `on_reload` sees every change, applied or refused.
pub fn watch(
    client: Client,
    target: PolicyRef,
    update: PolicyUpdate,
    read: signal::Sender<bool>,
    on_reload: impl FnMut(&Reload) + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(run(client, target, update, read, on_reload))
}

async fn run(
    client: Client,
    target: PolicyRef,
    update: PolicyUpdate,
    read: signal::Sender<bool>,
    mut on_reload: impl FnMut(&Reload) + Send + 'static,
) {
    let api: Api<DeserializeGuard<RetryPolicy>> =
        Api::namespaced(client.clone(), &target.namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={}", target.name));
    let mut stream = watcher(api, config).default_backoff().boxed();
    let mut follower = Follower {
        status_api: Api::namespaced(client.clone(), &target.namespace),
        client,
        target,
        update,
        seen: None,
        listed: None,
    };
    while let Some(item) = stream.next().await {
        match item {
            Err(error) => tracing::warn!(
                policy = %follower.target.label(),
                %error,
                "lost the RetryPolicy watch; the last good policy stays in force while reconnecting"
            ),
            Ok(Event::Init) => follower.listed = None,
            Ok(Event::InitApply(object)) => {
                if follower.is_ours(&object) {
                    follower.listed = Some(object);
                }
            }
            Ok(Event::InitDone) => {
                match follower.listed.take() {
                    Some(object) => follower.changed(object, &mut on_reload).await,
                    None => follower.absent(&mut on_reload),
                }
                read.send_replace(true);
            }
            Ok(Event::Apply(object)) => {
                if follower.is_ours(&object) {
                    follower.changed(object, &mut on_reload).await;
                }
            }
            Ok(Event::Delete(object)) => {
                if follower.is_ours(&object) {
                    follower.absent(&mut on_reload);
                }
            }
        }
    }
}

struct Follower {
    target: PolicyRef,
    update: PolicyUpdate,
    status_api: Api<RetryPolicy>,
    client: Client,
    seen: Option<Seen>,
    /// The object found by the list in progress.
    listed: Option<DeserializeGuard<RetryPolicy>>,
}

impl Follower {
    /// The field selector already asks for one name; this also holds when
    /// a server ignores it.
    fn is_ours(&self, object: &DeserializeGuard<RetryPolicy>) -> bool {
        object.name_any() == self.target.name
    }

    async fn changed(
        &mut self,
        object: DeserializeGuard<RetryPolicy>,
        on_reload: &mut (impl FnMut(&Reload) + Send),
    ) {
        let meta = object.meta().clone();
        let seen = Seen::Object {
            uid: meta.uid.clone(),
            generation: meta.generation,
            content: match &object.0 {
                Ok(policy) => serde_json::to_value(&policy.spec).map_err(|e| e.to_string()),
                Err(invalid) => Err(invalid.error.clone()),
            },
        };
        if self.seen.as_ref() == Some(&seen) {
            return;
        }
        self.seen = Some(seen);
        let parsed = match &object.0 {
            Ok(policy) => {
                Policy::from_spec(&self.target.name, &policy.spec).map_err(|e| e.to_string())
            }
            Err(invalid) => Err(format!(
                "not a RetryPolicy courier can read: {}",
                invalid.error
            )),
        };
        let parsed =
            parsed.map_err(|problem| format!("RetryPolicy {}: {problem}", self.target.label()));
        let reload = self.update.offer(parsed, meta.generation);
        on_reload(&reload);
        if let Reload::Rejected(problem) = &reload {
            self.record_rejection(problem).await;
        }
        let current = object.0.as_ref().ok().and_then(|p| p.status.as_ref());
        self.write_status(meta.generation, current, &reload).await;
    }

    fn absent(&mut self, on_reload: &mut (impl FnMut(&Reload) + Send)) {
        if self.seen == Some(Seen::Absent) {
            return;
        }
        self.seen = Some(Seen::Absent);
        tracing::info!(
            policy = %self.target.label(),
            "RetryPolicy not found (deleted or not created yet); the built-in defaults are in force"
        );
        let defaults = Policy::default();
        let generation = defaults.generation;
        on_reload(&self.update.offer(Ok(defaults), Some(generation)));
    }

    /// A Warning Event on the pod, so `kubectl describe pod` shows why the
    /// sidecar ignores the change; on the RetryPolicy when the pod is unknown.
    async fn record_rejection(&self, problem: &str) {
        let regarding = match &self.target.pod {
            Some(pod) => ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(pod.clone()),
                namespace: Some(self.target.namespace.clone()),
                ..ObjectReference::default()
            },
            None => ObjectReference {
                api_version: Some(RetryPolicy::api_version(&()).into_owned()),
                kind: Some(RetryPolicy::kind(&()).into_owned()),
                name: Some(self.target.name.clone()),
                namespace: Some(self.target.namespace.clone()),
                ..ObjectReference::default()
            },
        };
        let event = KubeEvent {
            type_: EventType::Warning,
            reason: "PolicyRejected".into(),
            note: Some(truncate(
                &format!("{problem}; the last good policy stays in force"),
                1000,
            )),
            action: "ApplyRetryPolicy".into(),
            secondary: None,
        };
        // A recorder of its own per refusal: a shared one would fold later
        // refusals into the first Event's series and keep its old note.
        let recorder = Recorder::new(
            self.client.clone(),
            Reporter {
                controller: MANAGER.into(),
                instance: self.target.pod.clone(),
            },
        );
        if let Err(error) = recorder.publish(&event, &regarding).await {
            tracing::warn!(%error, "cannot record the rejection as a Kubernetes Event");
        }
    }

    /// `status.observedGeneration` and the `Accepted` condition; written
    /// only when they would change, so many replicas do not churn it.
    async fn write_status(
        &self,
        generation: Option<i64>,
        current: Option<&super::RetryPolicyStatus>,
        reload: &Reload,
    ) {
        let (status, reason, message) = match reload {
            Reload::Applied(policy) => {
                ("True", "Applied", format!("in force as {}", policy.label()))
            }
            Reload::Rejected(problem) => ("False", "Invalid", truncate(problem, 1000)),
        };
        let unchanged = current.is_some_and(|s| {
            s.observed_generation == generation
                && s.conditions
                    .iter()
                    .any(|c| c.type_ == ACCEPTED && c.status == status && c.reason == reason)
        });
        if unchanged {
            return;
        }
        let condition = Condition {
            type_: ACCEPTED.into(),
            status: status.into(),
            reason: reason.into(),
            message,
            observed_generation: generation,
            last_transition_time: Time(Timestamp::now()),
        };
        let patch = serde_json::json!({
            "status": { "observedGeneration": generation, "conditions": [condition] }
        });
        let result = self
            .status_api
            .patch_status(
                &self.target.name,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await;
        if let Err(error) = result {
            tracing::debug!(%error, "cannot write the RetryPolicy status");
        }
    }
}

fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_namespace_comes_from_the_env_then_the_service_account_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("namespace");
        let from_env = PolicyRef::resolve("orders", Some("shop".into()), &file, None).unwrap();
        assert_eq!(from_env.namespace, "shop");
        let err = PolicyRef::resolve("orders", None, &file, None).unwrap_err();
        assert!(err.contains("POD_NAMESPACE"), "{err}");
        std::fs::write(&file, "payments\n").unwrap();
        let from_file = PolicyRef::resolve("orders", None, &file, Some("pod-1".into())).unwrap();
        assert_eq!(
            from_file,
            PolicyRef {
                name: "orders".into(),
                namespace: "payments".into(),
                pod: Some("pod-1".into())
            }
        );
    }

    #[test]
    fn names_must_be_object_names() {
        let file = Path::new("/nonexistent");
        for bad in ["", "Orders", "orders_v2", "-orders", "orders."] {
            assert!(
                PolicyRef::resolve(bad, Some("ns".into()), file, None).is_err(),
                "{bad:?}"
            );
        }
        assert!(PolicyRef::resolve("orders.v2-a", Some("ns".into()), file, None).is_ok());
    }

    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        assert_eq!(truncate("abc", 5), "abc");
        assert_eq!(truncate("ééé", 3), "é…");
    }
}
