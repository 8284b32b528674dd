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
mod document;
pub mod file;
mod live;

pub use crd::RetryPolicyStatus;
pub use decide::{Decision, EntryAnswer, GateState, Verdict, decide, decide_entry};
pub use document::*;
pub use live::{LivePolicy, PolicyUpdate, Reload};

use std::fmt;
use std::time::{Duration, SystemTime};

use crate::duration;
use crate::expr::Expr;
use crate::model::{Class, Message, Outcome, default_dead_letter_queue, parse_time};

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

/// A token bucket on deliveries to the app (`rateLimit`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    pub per_second: f64,
    pub burst: u32,
    pub scope: RateScope,
}

/// `paused: true`: nothing is fetched until it is edited back, or until
/// `until` when set.
#[derive(Debug, Clone, PartialEq)]
pub struct Pause {
    pub until: Option<SystemTime>,
    pub reason: String,
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
    /// Whether the app's `Courier-Dead-Letter` and `Courier-Retry` answer
    /// headers count (`appDirectives`).
    pub app_directives: bool,
    pub rate_limit: Option<RateLimit>,
    pub pause: Option<Pause>,
    /// Messages older than this are dead-lettered as `expired` (`maxAge`).
    pub max_age: Option<Duration>,
    /// The first whose condition a message meets picks its path (`routes`).
    pub routes: Vec<Route>,
    /// What happens to a message no route matches, when there are routes.
    pub unrouted: Unrouted,
}

/// A route: the messages its expression is true for go to `path`.
#[derive(Debug, Clone)]
pub struct Route {
    pub expression: Expr,
    /// In origin form (`/orders/big?x=1`), as a request line carries it.
    pub path: http::Uri,
}

/// Two routes are the same when they are written the same.
impl PartialEq for Route {
    fn eq(&self, other: &Self) -> bool {
        self.expression.source() == other.expression.source() && self.path == other.path
    }
}

/// Where the routes send one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routed<'a> {
    /// To this route's path.
    Path(&'a http::Uri),
    /// To the app URL's own path: there are no routes, or none matched and
    /// `unrouted` is `default`.
    Default,
    /// None matched; acked without being offered.
    Ack,
    /// None matched; dead-lettered as `unrouted`.
    DeadLetter,
}

/// Where the routes send a message, and the routes whose evaluation
/// failed on it (a type mismatch: counted, and not a match).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteChoice<'a> {
    pub routed: Routed<'a>,
    /// No route matched (whatever `unrouted` then did).
    pub unmatched: bool,
    pub errors: u32,
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
            app_directives: true,
            rate_limit: None,
            pause: None,
            max_age: None,
            routes: Vec::new(),
            unrouted: Unrouted::Default,
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

    /// Where the routes send `message`, read from `queue` for its
    /// `attempt`-th delivery: the first route whose expression is true.
    pub fn route(&self, message: &Message, queue: &str, attempt: u32) -> RouteChoice<'_> {
        let mut errors = 0;
        for route in &self.routes {
            match route.expression.matches_message(message, queue, attempt) {
                Ok(true) => {
                    return RouteChoice {
                        routed: Routed::Path(&route.path),
                        unmatched: false,
                        errors,
                    };
                }
                Ok(false) => {}
                Err(_) => errors += 1,
            }
        }
        let routed = match self.unrouted {
            _ if self.routes.is_empty() => Routed::Default,
            Unrouted::Default => Routed::Default,
            Unrouted::Ack => Routed::Ack,
            Unrouted::DeadLetter => Routed::DeadLetter,
        };
        RouteChoice {
            routed,
            unmatched: !self.routes.is_empty(),
            errors,
        }
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
            app_directives: spec.app_directives.unwrap_or(defaults.app_directives),
            rate_limit: rate_limit(spec.rate_limit.as_ref())?,
            pause: pause(spec)?,
            max_age: match spec.max_age.as_deref() {
                None | Some("") => None,
                Some(text) => match duration::parse(text) {
                    Ok(age) if age.is_zero() => {
                        return Err(PolicyError::new(
                            "spec.maxAge",
                            "must be greater than 0; leave it out (or \"\") for no limit",
                        ));
                    }
                    Ok(age) => Some(age),
                    Err(e) => return Err(PolicyError::new("spec.maxAge", e.to_string())),
                },
            },
            routes: routes(spec.routes.as_deref().unwrap_or_default())?,
            unrouted: spec.unrouted.unwrap_or_default(),
        })
    }

    /// Whether the policy pauses the queue at `now`, and until when if it
    /// ends by itself.
    pub fn paused_at(&self, now: SystemTime) -> Option<&Pause> {
        self.pause
            .as_ref()
            .filter(|pause| pause.until.is_none_or(|until| now < until))
    }

    /// What an answer means under this policy. Exact codes beat classes; an
    /// answer nobody listed that is not 2xx is permanent. The app's say
    /// comes after the status: a 2xx is an ack whatever it says, and
    /// otherwise `Courier-Dead-Letter` (any status) or `Courier-Retry: never`
    /// (a retryable one) makes the answer permanent.
    pub fn classify(&self, outcome: &Outcome) -> Class {
        match outcome {
            Outcome::Answered { .. } if self.directive_in_force(outcome).is_some() => {
                Class::Permanent
            }
            Outcome::Answered { status, .. } => self.classify_status(*status),
            Outcome::Timeout => Class::Timeout,
            Outcome::Unreachable { .. } => Class::Unreachable,
            Outcome::ConnectionLost { .. } => Class::ConnectionLost,
            Outcome::Undeliverable { .. } => Class::Undeliverable,
        }
    }

    /// The app's header that turns this answer into a dead letter, as the
    /// dead letter records it, when the policy lets the app decide: its
    /// `Courier-Dead-Letter`, else `Courier-Retry: never` on a status the
    /// policy would retry. None on a 2xx: that is an ack whatever it says.
    pub fn directive_in_force(&self, outcome: &Outcome) -> Option<String> {
        let Outcome::Answered {
            status, directives, ..
        } = outcome
        else {
            return None;
        };
        let class = self.classify_status(*status);
        if !self.app_directives || class == Class::Success {
            return None;
        }
        directives.dead_letter_header().or_else(|| {
            (directives.retry_never && class == Class::Transient)
                .then(|| "Courier-Retry: never".to_string())
        })
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

/// `rateLimit`, validated: a rate above 0, a burst of at least 1.
fn rate_limit(spec: Option<&RateLimitSpec>) -> Result<Option<RateLimit>, PolicyError> {
    let Some(spec) = spec else {
        return Ok(None);
    };
    let per_second = spec.per_second;
    if !(per_second.is_finite() && per_second > 0.0 && per_second <= 100_000.0) {
        return Err(PolicyError::new(
            "spec.rateLimit.perSecond",
            format!(
                "must be greater than 0 and at most 100000, got {per_second}; to stop deliveries, set paused: true"
            ),
        ));
    }
    let burst = match spec.burst {
        None => 5,
        Some(n @ 1..=100_000) => n as u32,
        Some(n) => {
            return Err(PolicyError::new(
                "spec.rateLimit.burst",
                format!("must be between 1 and 100000, got {n}"),
            ));
        }
    };
    Ok(Some(RateLimit {
        per_second,
        burst,
        scope: spec.scope.unwrap_or_default(),
    }))
}

/// `paused`, `pausedUntil` and `pausedReason`, validated.
fn pause(spec: &RetryPolicySpec) -> Result<Option<Pause>, PolicyError> {
    let until = match spec.paused_until.as_deref() {
        None | Some("") => None,
        Some(text) => Some(parse_time(text.as_bytes()).ok_or_else(|| {
            PolicyError::new(
                "spec.pausedUntil",
                format!("{text:?} is not an RFC 3339 time; write it like 2026-12-06T18:00:00Z, or leave it empty"),
            )
        })?),
    };
    Ok(spec.paused.unwrap_or(false).then(|| Pause {
        until,
        reason: spec.paused_reason.clone().unwrap_or_default(),
    }))
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

    pub fn app_directives(mut self, on: bool) -> Self {
        self.app_directives = on;
        self
    }

    pub fn rate_limited(mut self, per_second: f64, burst: u32, scope: RateScope) -> Self {
        self.rate_limit = Some(RateLimit {
            per_second,
            burst,
            scope,
        });
        self
    }

    pub fn retry_after_honored(mut self, honor: bool, max: Duration) -> Self {
        self.retry_after = RetryAfter { honor, max };
        self
    }
}

#[cfg(test)]
mod tests;

/// At most this many routes: each is evaluated on every message until one
/// matches.
pub const MOST_ROUTES: usize = 100;

/// `spec.routes`, each expression parsed and each path checked.
fn routes(specs: &[RouteSpec]) -> Result<Vec<Route>, PolicyError> {
    if specs.len() > MOST_ROUTES {
        return Err(PolicyError::new(
            "spec.routes",
            format!(
                "has {} routes; at most {MOST_ROUTES} are allowed (each is tried on every message)",
                specs.len()
            ),
        ));
    }
    specs
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            let expression = Expr::parse_route(&spec.expression).map_err(|e| {
                PolicyError::new(&format!("spec.routes[{i}].match"), e.to_string())
            })?;
            let path = Some(spec.path.as_str())
                .filter(|p| p.starts_with('/'))
                .and_then(|p| p.parse::<http::uri::PathAndQuery>().ok())
                .map(http::Uri::from)
                .ok_or_else(|| {
                    PolicyError::new(
                        &format!("spec.routes[{i}].path"),
                        format!(
                            "{:?} is not a path on the app; write one that starts with / such as /orders/big",
                            spec.path
                        ),
                    )
                })?;
            Ok(Route { expression, path })
        })
        .collect()
}
