//! The RetryPolicy document as operators write it: every field optional and
//! in the user's own form (durations as strings). The same types are the
//! cluster's custom resource; their schema and CEL rules become the CRD.

use ::kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::crd::{self, RetryPolicyStatus};

/// `apiVersion` of the RetryPolicy document.
pub const API_VERSION: &str = "courier.dev/v1alpha1";
/// `kind` of the RetryPolicy document.
pub const KIND: &str = "RetryPolicy";

/// A whole RetryPolicy document as written in a file or stored in the cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RetryPolicyDocument {
    pub api_version: String,
    pub kind: String,
    #[serde(default)]
    pub metadata: Metadata,
    #[serde(default)]
    pub spec: RetryPolicySpec,
}

/// The part of Kubernetes object metadata a policy file uses; the rest is
/// accepted and ignored so a `kubectl get -o yaml` dump can be used as is.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Metadata {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// How courier retries and dead-letters a queue's messages. Every field is
/// optional; an omitted field takes its default.
// The same type is the cluster's RetryPolicy custom resource: the schema and
// CEL rules on these types become the CRD (`courier crd`, `crds/`), so the API
// server refuses what `Policy::from_spec` refuses. The doc comments are the
// CRD's descriptions, so they speak to operators.
// The printer columns repeat `type_ = "string"`, which clippy takes for a
// duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, CustomResource, KubeSchema)]
#[kube(
    group = "courier.dev",
    version = "v1alpha1",
    kind = "RetryPolicy",
    namespaced,
    shortname = "rp",
    status = "RetryPolicyStatus",
    derive = "PartialEq",
    doc = "How courier retries and dead-letters the messages of a queue.",
    printcolumn(
        name = "Attempts",
        type_ = "integer",
        json_path = ".spec.maxAttempts",
        description = "deliveries in all (default 5)"
    ),
    printcolumn(
        name = "Initial",
        type_ = "string",
        json_path = ".spec.backoff.initial",
        description = "first backoff (default 1s)"
    ),
    printcolumn(
        name = "Max",
        type_ = "string",
        json_path = ".spec.backoff.max",
        description = "longest backoff (default 5m)"
    ),
    printcolumn(
        name = "Timeout",
        type_ = "string",
        json_path = ".spec.timeout",
        description = "per attempt (default 30s)"
    ),
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status",
        description = "whether a sidecar could use the last change"
    ),
    printcolumn(
        name = "Paused",
        type_ = "boolean",
        json_path = ".spec.paused",
        description = "whether fetching is stopped (default false)"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    cel
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RetryPolicySpec {
    /// Deliveries in all, the first included; 1..1000 (default 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_attempts: Option<i64>,
    /// Time the app gets per attempt, e.g. `30s` (default 30s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = crd::DURATION_PATTERN), length(max = 64))]
    #[x_kube(validation = Rule::new("duration(self) > duration('0s')").message("timeout must be greater than 0: it is the time the app gets per attempt"))]
    pub timeout: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<BackoffSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<RetryAfterSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_codes: Option<StatusCodesSpec>,
    /// Where dead letters go; `""` (the default) means `<queue>.dlq`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub dead_letter_queue: Option<String>,
    /// Whether the app's answer headers `Courier-Dead-Letter: <reason>`
    /// (dead-letter now) and `Courier-Retry: never` (a retryable answer is
    /// final) count (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_directives: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimitSpec>,
    /// true: every replica stops fetching; deliveries in flight finish and
    /// settle, and nothing more reaches the app until this is false again
    /// or `pausedUntil` passes (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<bool>,
    /// With `paused: true`, the pause ends by itself at this time (RFC 3339,
    /// e.g. `2026-12-06T18:00:00Z`); `""` (the default) pauses until edited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = crd::TIME_OR_EMPTY_PATTERN), length(max = 64))]
    pub paused_until: Option<String>,
    /// Why the queue is paused, for whoever finds it so; shown in the
    /// `Paused` condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub paused_reason: Option<String>,
    /// A message older than this when it is read (from the broker's enqueue
    /// time, else its first attempt) is dead-lettered with reason `expired`
    /// instead of delivered, e.g. `24h`; `""` (the default) means no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = crd::DURATION_OR_EMPTY_PATTERN), length(max = 64))]
    #[x_kube(validation = Rule::new("self == '' || duration(self) > duration('0s')").message("maxAge must be a duration greater than 0 such as 24h, or empty for no limit"))]
    pub max_age: Option<String>,
    /// Where each message goes on the app, by what it holds: the first
    /// route whose `match` is true for a message sends it to that route's
    /// `path`; when none is, `unrouted` says what happens. At most 100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 100))]
    pub routes: Option<Vec<RouteSpec>>,
    /// What happens to a message no route matches: default (delivered to
    /// the app URL's own path), ack (acked without being offered, counted
    /// in courier_filtered_total) or dead-letter (reason `unrouted`)
    /// (default default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unrouted: Option<Unrouted>,
}

/// One route: a condition over the message and the path it sends the
/// message to.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteSpec {
    /// A CEL condition over the message, e.g. `type == "order.created" &&
    /// data.total > 100`; the variables are queue, attempts, headers, body
    /// (a JSON body), and a CloudEvent's type, source, subject and data
    /// (required).
    #[serde(rename = "match")]
    #[schemars(length(min = 1, max = 4096))]
    pub expression: String,
    /// The path on the app the message is posted to, e.g. `/orders/big`;
    /// it replaces the app URL's path and query (required).
    #[schemars(regex(pattern = crd::ROUTE_PATH_PATTERN), length(max = 1024))]
    pub path: String,
}

/// What happens to a message no route matches.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum Unrouted {
    /// Delivered to the app URL's own path.
    #[default]
    Default,
    /// Acked without being offered to the app; counted in
    /// courier_filtered_total.
    Ack,
    /// Dead-lettered with reason `unrouted`, without being offered.
    DeadLetter,
}

/// A token bucket on deliveries to the app, apart from the concurrency
/// limit: at most `burst` at once, then `perSecond`. Retries and replays
/// count against it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RateLimitSpec {
    /// Deliveries a second, e.g. `20` or `0.5`; greater than 0, at most 100000 (required).
    #[schemars(range(max = 100000))]
    #[x_kube(validation = Rule::new("double(self) > 0.0").message("rateLimit.perSecond must be greater than 0; to stop deliveries, set paused: true"))]
    pub per_second: f64,
    /// Deliveries that may go at once after a quiet spell; 1..100000 (default 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub burst: Option<i64>,
    /// pod: each replica is limited on its own; queue: the total across
    /// the replicas on the queue, kept on the broker where it can be
    /// (Redis); elsewhere each replica is limited (default pod).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<RateScope>,
}

/// pod (default): each replica delivers at most the rate; queue: all
/// replicas on the queue together, through a bucket on the broker where it
/// keeps one (Redis), else each replica on its own.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum RateScope {
    /// Each replica delivers at most the rate.
    #[default]
    Pod,
    /// All replicas on the queue together deliver at most the rate.
    Queue,
}

/// Backoff between attempts: min(max, initial x multiplier^(n-1)), jittered.
// Omitted durations take their defaults in the rule, as `Policy::from_spec` does.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(validation = Rule::new(crd::BACKOFF_MAX_RULE).message("backoff.max must be at least backoff.initial (omitted, initial is 1s and max is 5m)"))]
pub struct BackoffSpec {
    /// First backoff, e.g. `1s` (default 1s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = crd::DURATION_PATTERN), length(max = 64))]
    pub initial: Option<String>,
    /// Longest backoff, e.g. `5m` (default 5m); at least initial.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = crd::DURATION_PATTERN), length(max = 64))]
    pub max: Option<String>,
    /// Growth per attempt; >= 1 (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub multiplier: Option<f64>,
    /// full: uniform(0, backoff); equal: backoff/2 + uniform(0, backoff/2); none (default full).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jitter: Option<Jitter>,
}

/// The app's Retry-After answer header.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RetryAfterSpec {
    /// Wait at least as long as Retry-After asks (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub honor: Option<bool>,
    /// The longest Retry-After that is honored, e.g. `1h` (default 1h).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = crd::DURATION_PATTERN), length(max = 64))]
    pub max: Option<String>,
}

/// Which answers are retried and which are dead-lettered at once. An exact
/// code beats a class; anything unlisted that is not 2xx is dead-lettered.
// Omitted lists take their defaults in the rule, as `Policy::from_spec` does.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(validation = Rule::new(crd::NOT_IN_BOTH_LISTS_RULE).message("a status code is listed in both retry and deadLetter; keep it in one list (omitted, retry is 408, 429, 5xx and deadLetter is 501, 4xx)"))]
pub struct StatusCodesSpec {
    /// Codes ("503") and classes ("5xx") that are retried (default 408, 429, 5xx).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 100), inner(regex(pattern = crd::STATUS_CODE_PATTERN)))]
    pub retry: Option<Vec<String>>,
    /// Codes and classes that are dead-lettered at once (default 501, 4xx).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 100), inner(regex(pattern = crd::STATUS_CODE_PATTERN)))]
    pub dead_letter: Option<Vec<String>>,
}

/// How a backoff is randomised so that many failing messages do not return
/// to the app at the same instant.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Jitter {
    /// uniform(0, backoff)
    #[default]
    Full,
    /// backoff/2 + uniform(0, backoff/2)
    Equal,
    /// exactly backoff
    None,
}
