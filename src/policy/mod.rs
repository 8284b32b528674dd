//! The RetryPolicy: the document operators write, its validation, and the
//! pure decision that turns an [`Outcome`] into a [`Verdict`].
//!
//! The document ([`RetryPolicySpec`]) keeps every field optional and in the
//! user's own form (durations as strings), so it can be read from a file
//! ([`file`]) or from the cluster ([`cluster`], the CRD in [`crd`]).
//! [`Policy::from_spec`] validates it once into a [`Policy`] with real
//! types; everything downstream uses only that.

pub mod cluster;
pub mod crd;
mod decide;
pub mod file;
mod live;

pub use crd::RetryPolicyStatus;
pub use decide::{Decision, GateState, Verdict, decide};
pub use live::{LivePolicy, PolicyUpdate, Reload};

use std::fmt;
use std::time::Duration;

use ::kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::duration;
use crate::model::{Class, Outcome, default_dead_letter_queue};

// === The document ===

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

// === The validated policy ===

/// A status code or class as written in `statusCodes`: `"503"` or `"5xx"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeMatch {
    Exact(u16),
    Class(u16),
}

impl CodeMatch {
    pub fn parse(text: &str) -> Option<Self> {
        let b = text.as_bytes();
        if b.len() != 3 || !(b'1'..=b'5').contains(&b[0]) {
            return None;
        }
        if &text[1..] == "xx" {
            return Some(Self::Class(u16::from(b[0] - b'0')));
        }
        text.parse().ok().map(Self::Exact)
    }

    pub fn matches(self, status: u16) -> bool {
        match self {
            Self::Exact(code) => code == status,
            Self::Class(class) => status / 100 == class,
        }
    }
}

impl fmt::Display for CodeMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exact(code) => write!(f, "{code}"),
            Self::Class(class) => write!(f, "{class}xx"),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    pub multiplier: f64,
    pub jitter: Jitter,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RetryAfter {
    pub honor: bool,
    pub max: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub struct StatusCodes {
    pub retry: Vec<CodeMatch>,
    pub dead_letter: Vec<CodeMatch>,
}

/// A validated policy. Build one with [`Policy::from_spec`] or take the
/// defaults with [`Policy::default`].
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// `metadata.name`, or `default` for the built-in policy.
    pub name: String,
    /// Bumped on every applied change; travels in `courier-policy`.
    pub generation: i64,
    pub max_attempts: u32,
    pub timeout: Duration,
    pub backoff: Backoff,
    pub retry_after: RetryAfter,
    pub status_codes: StatusCodes,
    /// `None` means `<queue>.dlq`.
    pub dead_letter_queue: Option<String>,
}

/// The defaults of every field, in one place, as the design documents them.
impl Default for Policy {
    fn default() -> Self {
        Self {
            name: "default".into(),
            generation: 0,
            max_attempts: 5,
            timeout: Duration::from_secs(30),
            backoff: Backoff {
                initial: Duration::from_secs(1),
                max: Duration::from_secs(300),
                multiplier: 2.0,
                jitter: Jitter::Full,
            },
            retry_after: RetryAfter {
                honor: true,
                max: Duration::from_secs(3600),
            },
            status_codes: StatusCodes {
                retry: vec![
                    CodeMatch::Exact(408),
                    CodeMatch::Exact(429),
                    CodeMatch::Class(5),
                ],
                dead_letter: vec![CodeMatch::Exact(501), CodeMatch::Class(4)],
            },
            dead_letter_queue: None,
        }
    }
}

/// A policy field that breaks a rule; shown to the operator as
/// `spec.backoff.max: must be ...`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct PolicyError {
    pub field: String,
    pub problem: String,
}

impl PolicyError {
    fn new(field: &str, problem: impl Into<String>) -> Self {
        Self {
            field: field.to_string(),
            problem: problem.into(),
        }
    }
}

impl Policy {
    /// Where dead letters of `queue` go: the policy's `deadLetterQueue`, else
    /// `<queue>.dlq`. The one place that name is derived.
    pub fn dead_letter_queue_for(&self, queue: &str) -> String {
        self.dead_letter_queue
            .clone()
            .unwrap_or_else(|| default_dead_letter_queue(queue))
    }

    /// Hand-outs without a settlement after which a message is a poison
    /// pill: `maxAttempts + 2`, room for a crash or two of courier itself.
    pub fn max_deliveries(&self) -> u32 {
        self.max_attempts.saturating_add(2)
    }

    /// `name@generation`, the value of the `courier-policy` dead-letter field.
    pub fn label(&self) -> String {
        format!("{}@{}", self.name, self.generation)
    }

    /// Validates a document's spec; an omitted field takes its default.
    pub fn from_spec(name: &str, spec: &RetryPolicySpec) -> Result<Self, PolicyError> {
        let defaults = Self::default();
        let max_attempts = match spec.max_attempts {
            None => defaults.max_attempts,
            Some(n @ 1..=1000) => n as u32,
            Some(n) => {
                return Err(PolicyError::new(
                    "spec.maxAttempts",
                    format!(
                        "must be between 1 and 1000 (deliveries in all, the first included), got {n}"
                    ),
                ));
            }
        };
        let duration_field = |field: &str, value: &Option<String>, default: Duration| match value {
            None => Ok(default),
            Some(text) => duration::parse(text).map_err(|e| PolicyError::new(field, e.to_string())),
        };
        let timeout = duration_field("spec.timeout", &spec.timeout, defaults.timeout)?;
        if timeout.is_zero() {
            return Err(PolicyError::new(
                "spec.timeout",
                "must be greater than 0 (it is the time the app gets per attempt)",
            ));
        }
        let backoff_spec = spec.backoff.clone().unwrap_or_default();
        let initial = duration_field(
            "spec.backoff.initial",
            &backoff_spec.initial,
            defaults.backoff.initial,
        )?;
        let max = duration_field("spec.backoff.max", &backoff_spec.max, defaults.backoff.max)?;
        if max < initial {
            return Err(PolicyError::new(
                "spec.backoff.max",
                format!(
                    "must be at least backoff.initial ({}), got {}",
                    duration::format(initial),
                    duration::format(max)
                ),
            ));
        }
        let multiplier = backoff_spec
            .multiplier
            .unwrap_or(defaults.backoff.multiplier);
        if !(multiplier.is_finite() && multiplier >= 1.0) {
            return Err(PolicyError::new(
                "spec.backoff.multiplier",
                format!("must be a number >= 1, got {multiplier}"),
            ));
        }
        let retry_after_spec = spec.retry_after.clone().unwrap_or_default();
        let retry_after = RetryAfter {
            honor: retry_after_spec.honor.unwrap_or(defaults.retry_after.honor),
            max: duration_field(
                "spec.retryAfter.max",
                &retry_after_spec.max,
                defaults.retry_after.max,
            )?,
        };
        let codes_spec = spec.status_codes.clone().unwrap_or_default();
        let codes = |field: &str, list: &Option<Vec<String>>, default: &Vec<CodeMatch>| {
            let Some(list) = list else {
                return Ok(default.clone());
            };
            list.iter()
                .map(|text| match CodeMatch::parse(text) {
                    Some(m) if matches!(m, CodeMatch::Class(2)) || matches!(m, CodeMatch::Exact(200..=299)) => {
                        Err(PolicyError::new(field, format!("{text:?} is a success code; 2xx is always an ack")))
                    }
                    Some(m) => Ok(m),
                    None => Err(PolicyError::new(
                        field,
                        format!("{text:?} is not a status code; write an exact code like \"503\" or a class like \"5xx\""),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()
        };
        let status_codes = StatusCodes {
            retry: codes(
                "spec.statusCodes.retry",
                &codes_spec.retry,
                &defaults.status_codes.retry,
            )?,
            dead_letter: codes(
                "spec.statusCodes.deadLetter",
                &codes_spec.dead_letter,
                &defaults.status_codes.dead_letter,
            )?,
        };
        if let Some(both) = status_codes
            .retry
            .iter()
            .find(|m| status_codes.dead_letter.contains(m))
        {
            return Err(PolicyError::new(
                "spec.statusCodes",
                format!("{both} is listed in both retry and deadLetter; keep it in one list"),
            ));
        }
        Ok(Self {
            name: name.to_string(),
            generation: 0,
            max_attempts,
            timeout,
            backoff: Backoff {
                initial,
                max,
                multiplier,
                jitter: backoff_spec.jitter.unwrap_or(defaults.backoff.jitter),
            },
            retry_after,
            status_codes,
            dead_letter_queue: spec.dead_letter_queue.clone().filter(|q| !q.is_empty()),
        })
    }

    /// What an answer means under this policy. Exact codes beat classes; an
    /// answer nobody listed that is not 2xx is permanent.
    pub fn classify(&self, outcome: &Outcome) -> Class {
        match outcome {
            Outcome::Answered { status, .. } => self.classify_status(*status),
            Outcome::Timeout => Class::Timeout,
            Outcome::Unreachable { .. } => Class::Unreachable,
            Outcome::ConnectionLost { .. } => Class::ConnectionLost,
            Outcome::Undeliverable { .. } => Class::Undeliverable,
        }
    }

    fn classify_status(&self, status: u16) -> Class {
        if (200..300).contains(&status) {
            return Class::Success;
        }
        let lists = [
            (&self.status_codes.retry, Class::Transient),
            (&self.status_codes.dead_letter, Class::Permanent),
        ];
        let exact = lists.iter().find(|(list, _)| {
            list.iter()
                .any(|m| matches!(m, CodeMatch::Exact(_)) && m.matches(status))
        });
        let class = || {
            lists.iter().find(|(list, _)| {
                list.iter()
                    .any(|m| matches!(m, CodeMatch::Class(_)) && m.matches(status))
            })
        };
        exact
            .or_else(class)
            .map_or(Class::Permanent, |(_, class)| *class)
    }

    /// `backoff(n) = min(max, initial × multiplier^(n-1))`, n = attempts made.
    pub fn backoff(&self, attempts_made: u32) -> Duration {
        let b = &self.backoff;
        let exponent = attempts_made.saturating_sub(1).min(1000) as i32;
        let secs = b.initial.as_secs_f64() * b.multiplier.powi(exponent);
        if !secs.is_finite() || secs >= b.max.as_secs_f64() {
            b.max
        } else {
            Duration::from_secs_f64(secs)
        }
    }

    /// The backoff with jitter applied; `sample` is uniform in [0, 1).
    pub fn jittered_backoff(&self, attempts_made: u32, sample: f64) -> Duration {
        let backoff = self.backoff(attempts_made);
        let sample = sample.clamp(0.0, 1.0);
        match self.backoff.jitter {
            Jitter::None => backoff,
            Jitter::Full => backoff.mul_f64(sample),
            Jitter::Equal => backoff / 2 + (backoff / 2).mul_f64(sample),
        }
    }
}

// === Test fixtures ===

/// A builder for policies in tests: `Policy::test().max_attempts(3)`.
impl Policy {
    pub fn test() -> Self {
        Self {
            name: "test".into(),
            ..Self::default()
        }
    }

    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }

    pub fn backoff_of(
        mut self,
        initial: Duration,
        max: Duration,
        multiplier: f64,
        jitter: Jitter,
    ) -> Self {
        self.backoff = Backoff {
            initial,
            max,
            multiplier,
            jitter,
        };
        self
    }

    pub fn retry_after_honored(mut self, honor: bool, max: Duration) -> Self {
        self.retry_after = RetryAfter { honor, max };
        self
    }
}

#[cfg(test)]
mod tests;
