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
//!
//! An API server that refuses the list (403: the service account may not read
//! RetryPolicies here) or does not know the resource (404: the CRD is not
//! installed) is a state of its own, [`PolicyStatus::problem`]: it says what
//! to grant or install, and the sidecar shows it on `/readyz`, in
//! `courier_policy_ready` and in a warning repeated at most every
//! [`PROBLEM_LOG_INTERVAL`]. The watcher keeps trying with its backoff, so
//! a grant made later takes effect without a restart.

use std::path::Path;
use std::time::{Duration, Instant};

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

use super::crd::{ACCEPTED, PAUSED};
use super::{Policy, PolicyUpdate, Reload, RetryPolicy};

/// Where Kubernetes puts the pod's namespace when no `POD_NAMESPACE` is set.
pub const SERVICE_ACCOUNT_NAMESPACE: &str =
    "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// The service account token Kubernetes mounts; its `sub` claim names the
/// account, for the message that says what to grant.
pub const SERVICE_ACCOUNT_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

/// The field manager and reporting controller name courier uses.
pub const MANAGER: &str = "courier";

/// The resource courier reads, as RBAC rules and `kubectl` name it.
pub const RESOURCE: &str = "retrypolicies.courier.dev";

/// An unchanged problem is logged again at most this often.
pub const PROBLEM_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Which RetryPolicy to follow, and the pod that Events are recorded on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyRef {
    pub name: String,
    pub namespace: String,
    /// `POD_NAME`; without it Events are recorded on the RetryPolicy itself.
    pub pod: Option<String>,
    /// The pod's service account (`system:serviceaccount:NS:NAME`), read
    /// from its token when mounted; named in what-to-grant messages.
    pub service_account: Option<String>,
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
        .map(|target| Self {
            service_account: std::fs::read_to_string(SERVICE_ACCOUNT_TOKEN)
                .ok()
                .and_then(|token| token_subject(&token)),
            ..target
        })
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
            service_account: None,
        })
    }

    /// `namespace/name`, as log lines and messages show it.
    pub fn label(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The RetryPolicy, as an Event's `regarding`.
    fn reference(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some(RetryPolicy::api_version(&()).into_owned()),
            kind: Some(RetryPolicy::kind(&()).into_owned()),
            name: Some(self.name.clone()),
            namespace: Some(self.namespace.clone()),
            ..ObjectReference::default()
        }
    }
}

/// The `sub` claim of a service account token (a JWT), without checking
/// its signature: it only names the account in a message.
fn token_subject(token: &str) -> Option<String> {
    use base64::Engine as _;
    let payload = token.trim().split('.').nth(1)?;
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&json).ok()?;
    claims["sub"].as_str().map(str::to_string)
}

/// Where following the policy stands, for readiness and the gauge.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyStatus {
    /// The policy has been read once (found or not): pulling may start.
    pub read: bool,
    /// Why the API server refuses it (403, 404) and what to do, while it does.
    pub problem: Option<String>,
}

/// What a 403 or 404 from the API server means for `target`, and what to
/// do about it; `None` for any other error (the API server unreachable, a
/// dropped watch), which the watcher's backoff rides out.
pub fn problem_of(error: &watcher::Error, target: &PolicyRef) -> Option<String> {
    let (watcher::Error::InitialListFailed(kube::Error::Api(status))
    | watcher::Error::WatchStartFailed(kube::Error::Api(status))
    | watcher::Error::WatchFailed(kube::Error::Api(status))) = error
    else {
        return match error {
            watcher::Error::WatchError(status) => problem_of_code(status.code, target),
            _ => None,
        };
    };
    problem_of_code(status.code, target)
}

fn problem_of_code(code: u16, target: &PolicyRef) -> Option<String> {
    let (policy, namespace) = (target.label(), &target.namespace);
    match code {
        403 => {
            let to = match &target.service_account {
                Some(account) => format!("to {account}"),
                None => "to the pod's service account".into(),
            };
            Some(format!(
                "policy {policy}: forbidden (403): grant get, list, watch on {RESOURCE} in namespace {namespace} {to} (the chart does it for the namespaces in sidecar.namespaces and the accounts in sidecar.serviceAccounts)"
            ))
        }
        404 => Some(format!(
            "policy {policy}: not found (404): the API server does not know {RESOURCE}; install the CRD (helm install the chart, or courier crd | kubectl apply -f -)"
        )),
        _ => None,
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
/// account; outside: `KUBECONFIG`) and starts [`watch`]. The receiver says
/// whether the policy has been read, and why it cannot be.
pub async fn follow(
    target: PolicyRef,
    update: PolicyUpdate,
    on_reload: impl FnMut(&Reload) + Send + 'static,
) -> Result<(tokio::task::JoinHandle<()>, signal::Receiver<PolicyStatus>), kube::Error> {
    let client = Client::try_default().await?;
    let (status, status_rx) = signal::channel(PolicyStatus::default());
    Ok((watch(client, target, update, status, on_reload), status_rx))
}

/// The Kubernetes side of the audit trail of an operator's command on a
/// RetryPolicy's queue (a dead-letter replay or purge): who the API server
/// says the caller is, and a Normal Event on the RetryPolicy, so `kubectl
/// describe retrypolicy` and `kubectl get events` show what was done to
/// its queue and by whom.
pub struct AuditTrail {
    client: Client,
    target: PolicyRef,
}

impl AuditTrail {
    /// Connects with the ambient configuration, as [`follow`] does.
    pub async fn connect(target: PolicyRef) -> Result<Self, kube::Error> {
        Ok(Self {
            client: Client::try_default().await?,
            target,
        })
    }

    pub fn target(&self) -> &PolicyRef {
        &self.target
    }

    /// The caller's user name, from a SelfSubjectReview (what `kubectl auth
    /// whoami` asks): the name the API server authenticated, not one the
    /// caller could pick.
    pub async fn caller(&self) -> Result<String, kube::Error> {
        use k8s_openapi::api::authentication::v1::SelfSubjectReview;
        let reviews: Api<SelfSubjectReview> = Api::all(self.client.clone());
        let review = reviews
            .create(&Default::default(), &SelfSubjectReview::default())
            .await?;
        Ok(review
            .status
            .and_then(|s| s.user_info)
            .and_then(|u| u.username)
            .unwrap_or_else(|| "unknown".into()))
    }

    /// A Normal Event on the RetryPolicy; `note` is cut to the 1 KiB the
    /// API server keeps.
    pub async fn record(&self, reason: &str, action: &str, note: &str) -> Result<(), kube::Error> {
        let regarding = self.target.reference();
        let event = KubeEvent {
            type_: EventType::Normal,
            reason: reason.into(),
            note: Some(truncate(note, 1000)),
            action: action.into(),
            secondary: None,
        };
        Recorder::new(
            self.client.clone(),
            Reporter {
                controller: MANAGER.into(),
                instance: None,
            },
        )
        .publish(&event, &regarding)
        .await
    }
}

/// Follows one RetryPolicy until the task is aborted. `status.read` turns
/// true once the policy has been read (found or not): the sidecar is not
/// ready before; `status.problem` holds a 403 or 404 until a list works.
/// `on_reload` sees every change, applied or refused.
pub fn watch(
    client: Client,
    target: PolicyRef,
    update: PolicyUpdate,
    status: signal::Sender<PolicyStatus>,
    on_reload: impl FnMut(&Reload) + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(run(client, target, update, status, on_reload))
}

async fn run(
    client: Client,
    target: PolicyRef,
    update: PolicyUpdate,
    status: signal::Sender<PolicyStatus>,
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
    let mut logged: Option<(String, Instant)> = None;
    while let Some(item) = stream.next().await {
        match item {
            Err(error) => match problem_of(&error, &follower.target) {
                Some(problem) => {
                    let repeat = logged.as_ref().is_some_and(|(last, at)| {
                        *last == problem && at.elapsed() < PROBLEM_LOG_INTERVAL
                    });
                    if !repeat {
                        tracing::warn!(policy = %follower.target.label(), %problem, "cannot read the RetryPolicy; nothing is pulled until it can be read, and the watch keeps trying");
                        logged = Some((problem.clone(), Instant::now()));
                    }
                    status.send_if_modified(|s| {
                        let changed = s.problem.as_ref() != Some(&problem);
                        s.problem = Some(problem);
                        changed
                    });
                }
                None => tracing::warn!(
                    policy = %follower.target.label(),
                    %error,
                    "lost the RetryPolicy watch; the last good policy stays in force while reconnecting"
                ),
            },
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
                if logged.take().is_some() {
                    tracing::info!(policy = %follower.target.label(), "the RetryPolicy can be read now");
                }
                status.send_replace(PolicyStatus {
                    read: true,
                    problem: None,
                });
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
            None => self.target.reference(),
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
        // A refused change leaves the policy in force, and so its pause.
        let paused = match reload {
            Reload::Applied(policy) => Some(paused_condition(policy)),
            Reload::Rejected(_) => current.and_then(|s| {
                s.conditions
                    .iter()
                    .find(|c| c.type_ == PAUSED)
                    .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
            }),
        };
        let unchanged = current.is_some_and(|s| {
            let has = |kind: &str, status: &str, reason: &str, message: Option<&str>| {
                s.conditions.iter().any(|c| {
                    c.type_ == kind
                        && c.status == status
                        && c.reason == reason
                        && message.is_none_or(|m| c.message == m)
                })
            };
            s.observed_generation == generation
                && has(ACCEPTED, status, reason, None)
                && paused
                    .as_ref()
                    .is_none_or(|(st, re, me)| has(PAUSED, st, re, Some(me)))
        });
        if unchanged {
            return;
        }
        // A condition's transition time moves only when its status does,
        // so the Paused condition says when the pause began.
        let now = Time(Timestamp::now());
        let condition = |kind: &str, status: String, reason: String, message: String| {
            let since = current
                .and_then(|s| s.conditions.iter().find(|c| c.type_ == kind))
                .filter(|c| c.status == status)
                .map_or_else(|| now.clone(), |c| c.last_transition_time.clone());
            Condition {
                type_: kind.into(),
                status,
                reason,
                message,
                observed_generation: generation,
                last_transition_time: since,
            }
        };
        let mut conditions = vec![condition(ACCEPTED, status.into(), reason.into(), message)];
        if let Some((status, reason, message)) = paused {
            conditions.push(condition(PAUSED, status, reason, message));
        }
        let patch = serde_json::json!({
            "status": { "observedGeneration": generation, "conditions": conditions }
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

/// The `Paused` condition of a policy in force: status, reason, message.
fn paused_condition(policy: &Policy) -> (String, String, String) {
    let Some(pause) = &policy.pause else {
        return (
            "False".into(),
            "Running".into(),
            "fetching and delivering".into(),
        );
    };
    let why = if pause.reason.is_empty() {
        "no reason given (spec.pausedReason)".to_string()
    } else {
        truncate(&pause.reason, 900)
    };
    match pause.until {
        Some(until) => (
            "True".into(),
            "PausedUntil".into(),
            format!(
                "fetching nothing until {}, then resuming by itself: {why}",
                crate::model::rfc3339(until)
            ),
        ),
        None => (
            "True".into(),
            "Paused".into(),
            format!("fetching nothing until paused is set to false: {why}"),
        ),
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
                pod: Some("pod-1".into()),
                service_account: None,
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
    fn the_service_account_is_the_token_subject() {
        use base64::Engine as _;
        let claims =
            br#"{"iss":"kubernetes/serviceaccount","sub":"system:serviceaccount:shop:orders"}"#;
        let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(claims);
        let token = format!("eyJhbGciOiJSUzI1NiJ9.{payload}.c2lnbmF0dXJl\n");
        assert_eq!(
            token_subject(&token).as_deref(),
            Some("system:serviceaccount:shop:orders")
        );
        assert_eq!(token_subject("not a token"), None);
    }

    #[test]
    fn forbidden_and_not_found_say_what_to_grant_or_install() {
        let mut target = PolicyRef {
            name: "orders".into(),
            namespace: "shop".into(),
            pod: None,
            service_account: Some("system:serviceaccount:shop:orders".into()),
        };
        let forbidden = problem_of_code(403, &target).unwrap();
        assert!(
            forbidden.starts_with("policy shop/orders: forbidden (403): grant get, list, watch on retrypolicies.courier.dev in namespace shop to system:serviceaccount:shop:orders"),
            "{forbidden}"
        );
        target.service_account = None;
        assert!(
            problem_of_code(403, &target)
                .unwrap()
                .contains("to the pod's service account")
        );
        let missing = problem_of_code(404, &target).unwrap();
        assert!(missing.contains("install the CRD"), "{missing}");
        assert_eq!(problem_of_code(500, &target), None);
        assert_eq!(
            problem_of(&watcher::Error::NoResourceVersion, &target),
            None
        );
    }

    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        assert_eq!(truncate("abc", 5), "abc");
        assert_eq!(truncate("ééé", 3), "é…");
    }
}
