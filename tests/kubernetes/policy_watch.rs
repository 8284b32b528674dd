//! The cluster policy source against kube's mock client
//! (`tower_test::mock`): the API server's answers are scripted request by
//! request, so the watcher's edge cases are exact. A relist after a dropped
//! watch, a malformed object in the stream, a deletion, an API server that
//! forbids the list (403) or does not know the resource (404) until a grant
//! or the CRD appears.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use courier::policy::cluster::{self, PolicyRef, PolicyStatus};
use courier::policy::{LivePolicy, Policy, Reload};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use kube::client::Body;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

const NS: &str = "shop";
const NAME: &str = "orders";

fn policy_object(generation: i64, resource_version: u64, spec: Value) -> Value {
    json!({
        "apiVersion": "courier.dev/v1alpha1",
        "kind": "RetryPolicy",
        "metadata": {
            "name": NAME,
            "namespace": NS,
            "uid": "5f0a1c2e-0000-4000-8000-000000000001",
            "generation": generation,
            "resourceVersion": resource_version.to_string(),
        },
        "spec": spec,
    })
}

fn list(items: Vec<Value>, resource_version: u64) -> Value {
    json!({
        "apiVersion": "courier.dev/v1alpha1",
        "kind": "RetryPolicyList",
        "metadata": { "resourceVersion": resource_version.to_string() },
        "items": items,
    })
}

fn event(kind: &str, object: Value) -> Value {
    json!({ "type": kind, "object": object })
}

fn gone() -> Value {
    json!({ "type": "ERROR", "object": {
        "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 410,
        "reason": "Expired", "message": "too old resource version",
    }})
}

/// What the scripted API server saw, for assertions.
#[derive(Debug, Default)]
struct Seen {
    lists: usize,
    watches: usize,
    /// Bodies of POSTed Events.
    events: Vec<Value>,
    /// Bodies of status patches.
    statuses: Vec<Value>,
}

/// Answers list requests and watch requests from their scripts, in order
/// (a `Status` in the list script is answered with its code).
/// A watch body is finite: the stream ends after its last event, as when a
/// connection drops. Once its script is used up a request is held open and
/// never answered, as a quiet watch is. Events and status writes are
/// recorded and accepted.
fn scripted_api(
    mut lists: VecDeque<Value>,
    mut watches: VecDeque<Vec<Value>>,
) -> (kube::Client, Arc<Mutex<Seen>>) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let record = seen.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Some((request, respond)) = handle.next_request().await {
            let uri = request.uri().to_string();
            let method = request.method().clone();
            let body = request.into_body().collect().await.unwrap().to_bytes();
            let answer = |status: StatusCode, body: Vec<u8>| {
                Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(Body::from(body))
                    .unwrap()
            };
            if method == http::Method::POST && uri.contains("/events") {
                record
                    .lock()
                    .unwrap()
                    .events
                    .push(serde_json::from_slice(&body).unwrap());
                respond.send_response(answer(StatusCode::CREATED, body.to_vec()));
            } else if method == http::Method::PATCH && uri.contains("/status") {
                let patch: Value = serde_json::from_slice(&body).unwrap();
                record.lock().unwrap().statuses.push(patch.clone());
                let mut object = policy_object(1, 99, json!({}));
                object["status"] = patch["status"].clone();
                respond.send_response(answer(StatusCode::OK, object.to_string().into_bytes()));
            } else if uri.contains("watch=true") {
                record.lock().unwrap().watches += 1;
                match watches.pop_front() {
                    Some(events) => {
                        let mut body = Vec::new();
                        for event in events {
                            body.extend(event.to_string().into_bytes());
                            body.push(b'\n');
                        }
                        respond.send_response(answer(StatusCode::OK, body));
                    }
                    None => held.push(respond),
                }
            } else if method == http::Method::GET {
                record.lock().unwrap().lists += 1;
                match lists.pop_front() {
                    Some(list) => {
                        // A Status in the script is a refusal, with its code.
                        let status = list["code"]
                            .as_u64()
                            .and_then(|code| StatusCode::from_u16(code as u16).ok())
                            .unwrap_or(StatusCode::OK);
                        respond.send_response(answer(status, list.to_string().into_bytes()))
                    }
                    None => held.push(respond),
                }
            } else {
                panic!("the scripted API server did not expect {method} {uri}");
            }
        }
    });
    (kube::Client::new(service, NS), seen)
}

/// A cluster policy source on a scripted API server, and what it reported.
struct Following {
    live: LivePolicy,
    status: watch::Receiver<PolicyStatus>,
    reloads: mpsc::UnboundedReceiver<Reload>,
    seen: Arc<Mutex<Seen>>,
    task: tokio::task::JoinHandle<()>,
}

fn follow(lists: Vec<Value>, watches: Vec<Vec<Value>>) -> Following {
    let (client, seen) = scripted_api(lists.into(), watches.into());
    let (live, update) = LivePolicy::new(Policy::default());
    let (status_tx, status) = watch::channel(PolicyStatus::default());
    let (tx, reloads) = mpsc::unbounded_channel();
    let target = PolicyRef {
        name: NAME.into(),
        namespace: NS.into(),
        pod: Some("orders-7d9f-abcde".into()),
        service_account: Some("system:serviceaccount:shop:orders".into()),
    };
    let task = cluster::watch(client, target, update, status_tx, move |reload: &Reload| {
        tx.send(reload.clone()).unwrap();
    });
    Following {
        live,
        status,
        reloads,
        seen,
        task,
    }
}

impl Following {
    async fn next(&mut self) -> Reload {
        tokio::time::timeout(Duration::from_secs(10), self.reloads.recv())
            .await
            .expect("a reload within 10s")
            .expect("the source is running")
    }

    async fn applied(&mut self) -> Arc<Policy> {
        match self.next().await {
            Reload::Applied(policy) => policy,
            Reload::Rejected(problem) => panic!("expected an applied change, got: {problem}"),
        }
    }

    async fn rejected(&mut self) -> String {
        match self.next().await {
            Reload::Rejected(problem) => problem,
            Reload::Applied(policy) => panic!("expected a refusal, got {policy:?}"),
        }
    }

    /// Waits until the scripted server has answered `lists` lists and been
    /// asked for `watches` watches, then checks nothing was reported. The
    /// source asks for the watch that follows a relist only after it has
    /// handled what the relist returned, so a report would be there by then.
    async fn quiet_after(&mut self, lists: usize, watches: usize) {
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                {
                    let seen = self.seen.lock().unwrap();
                    if seen.lists >= lists && seen.watches >= watches {
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the relist and the watch after it happened");
        if let Ok(reload) = self.reloads.try_recv() {
            panic!("nothing changed, yet the source reported {reload:?}");
        }
    }

    /// Waits until the scripted server has recorded `events` Events and
    /// `statuses` status writes.
    async fn recorded(&self, events: usize, statuses: usize) {
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                {
                    let seen = self.seen.lock().unwrap();
                    if seen.events.len() >= events && seen.statuses.len() >= statuses {
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the Events and status writes arrived");
    }
}

impl Drop for Following {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test]
async fn a_dropped_watch_relists_and_applies_what_changed_meanwhile() {
    let mut source = follow(
        vec![
            list(vec![policy_object(1, 10, json!({"maxAttempts": 3}))], 10),
            // While the watch was away the policy changed twice.
            list(vec![policy_object(3, 30, json!({"maxAttempts": 1}))], 30),
            // A second relist finds nothing new.
            list(vec![policy_object(3, 30, json!({"maxAttempts": 1}))], 31),
        ],
        vec![
            vec![event(
                "MODIFIED",
                policy_object(2, 20, json!({"maxAttempts": 2})),
            )],
            // The connection dropped; the resumed watch is too old: relist.
            vec![gone()],
            vec![gone()],
        ],
    );
    let first = source.applied().await;
    assert_eq!((first.max_attempts, first.label()), (3, "orders@1".into()));
    assert!(
        source.status.borrow().read,
        "ready once the policy has been read"
    );
    let second = source.applied().await;
    assert_eq!(
        (second.max_attempts, second.label()),
        (2, "orders@2".into())
    );
    let third = source.applied().await;
    assert_eq!((third.max_attempts, third.label()), (1, "orders@3".into()));
    // The third watch was dropped too; the fourth follows the last relist.
    source.quiet_after(3, 4).await;
    assert_eq!(source.live.current().label(), "orders@3");
    assert!(source.seen.lock().unwrap().watches >= 3);
}

#[tokio::test]
async fn a_malformed_object_is_refused_and_the_stream_goes_on() {
    let mut source = follow(
        vec![list(
            vec![policy_object(1, 10, json!({"maxAttempts": 3}))],
            10,
        )],
        vec![vec![
            // Does not even deserialize (what an older CRD lets through).
            event(
                "MODIFIED",
                policy_object(2, 20, json!({"maxAttempts": "lots"})),
            ),
            // Deserializes, but breaks a rule.
            event("MODIFIED", policy_object(3, 30, json!({"maxAttempts": 0}))),
            event("MODIFIED", policy_object(4, 40, json!({"maxAttempts": 2}))),
        ]],
    );
    assert_eq!(source.applied().await.label(), "orders@1");
    let unreadable = source.rejected().await;
    assert!(
        unreadable.contains("not a RetryPolicy courier can read"),
        "{unreadable}"
    );
    let invalid = source.rejected().await;
    assert!(invalid.contains("spec.maxAttempts"), "{invalid}");
    let fixed = source.applied().await;
    assert_eq!((fixed.max_attempts, fixed.label()), (2, "orders@4".into()));

    // Each refusal is an Event on the pod; each generation gets a status.
    source.recorded(2, 4).await;
    let seen = source.seen.lock().unwrap();
    assert_eq!(seen.events.len(), 2, "{:?}", seen.events);
    for event in &seen.events {
        assert_eq!(event["reason"], "PolicyRejected");
        assert_eq!(event["type"], "Warning");
        assert_eq!(event["regarding"]["kind"], "Pod");
        assert_eq!(event["regarding"]["name"], "orders-7d9f-abcde");
    }
    let accepted: Vec<(i64, String)> = seen
        .statuses
        .iter()
        .map(|p| {
            let condition = &p["status"]["conditions"][0];
            (
                p["status"]["observedGeneration"].as_i64().unwrap(),
                condition["status"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        accepted,
        [
            (1, "True".into()),
            (2, "False".into()),
            (3, "False".into()),
            (4, "True".into())
        ]
    );
}

#[tokio::test]
async fn a_deleted_policy_falls_back_to_the_defaults() {
    let mut source = follow(
        vec![list(
            vec![policy_object(1, 10, json!({"maxAttempts": 1}))],
            10,
        )],
        vec![vec![event(
            "DELETED",
            policy_object(1, 11, json!({"maxAttempts": 1})),
        )]],
    );
    assert_eq!(source.applied().await.max_attempts, 1);
    let defaults = source.applied().await;
    assert_eq!(*defaults, Policy::default());
    assert_eq!(*source.live.current(), Policy::default());
}

#[tokio::test]
async fn a_missing_policy_means_the_defaults_and_counts_as_read() {
    let mut source = follow(vec![list(vec![], 5)], vec![]);
    assert_eq!(*source.applied().await, Policy::default());
    assert_eq!(
        *source.status.borrow(),
        PolicyStatus {
            read: true,
            problem: None
        }
    );
}

/// What a real API server answers a list it refuses.
fn refusal(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
        "code": code, "reason": reason, "message": message,
    })
}

/// The API server refuses the first lists (403, or 404 while the CRD is not
/// installed), then serves one: the status names the problem and what to do,
/// nothing is read meanwhile, and the list that works clears it, without a
/// restart.
async fn refused_until_it_is_not(refused: Value, says: &[&str]) {
    let mut source = follow(
        vec![
            refused.clone(),
            refused,
            list(vec![policy_object(1, 10, json!({"maxAttempts": 4}))], 10),
        ],
        vec![],
    );
    let mut status = source.status.clone();
    let problem = tokio::time::timeout(
        Duration::from_secs(10),
        status.wait_for(|s| s.problem.is_some()),
    )
    .await
    .expect("the refusal reported within 10s")
    .unwrap()
    .clone();
    assert!(!problem.read, "nothing was read: {problem:?}");
    let text = problem.problem.unwrap();
    for part in says {
        assert!(text.contains(part), "{part:?} not in {text:?}");
    }
    assert!(
        source.reloads.try_recv().is_err(),
        "no policy while refused"
    );
    // The grant (or the CRD) appears: the watcher's backoff lists again.
    assert_eq!(source.applied().await.max_attempts, 4);
    assert_eq!(
        *source.status.borrow(),
        PolicyStatus {
            read: true,
            problem: None
        }
    );
    assert!(source.seen.lock().unwrap().lists >= 3);
}

#[tokio::test]
async fn a_forbidden_policy_says_what_to_grant_until_it_is_granted() {
    refused_until_it_is_not(
        refusal(
            403,
            "Forbidden",
            "retrypolicies.courier.dev is forbidden: User \"system:serviceaccount:shop:orders\" cannot list resource \"retrypolicies\" in API group \"courier.dev\" in the namespace \"shop\"",
        ),
        &[
            "policy shop/orders: forbidden (403)",
            "grant get, list, watch on retrypolicies.courier.dev in namespace shop to system:serviceaccount:shop:orders",
        ],
    )
    .await;
}

#[tokio::test]
async fn an_uninstalled_crd_says_what_to_install_until_it_is_installed() {
    refused_until_it_is_not(
        refusal(
            404,
            "NotFound",
            "the server could not find the requested resource",
        ),
        &["policy shop/orders: not found (404)", "install the CRD"],
    )
    .await;
}

#[tokio::test]
async fn an_object_of_another_name_is_ignored() {
    let mut other = policy_object(1, 10, json!({"maxAttempts": 9}));
    other["metadata"]["name"] = json!("payments");
    let mut source = follow(
        vec![list(
            vec![other, policy_object(1, 11, json!({"maxAttempts": 2}))],
            11,
        )],
        vec![],
    );
    assert_eq!(source.applied().await.max_attempts, 2);
}
