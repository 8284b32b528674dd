//! The decision: a pure function from an outcome, the attempt, and the
//! app-health gate's state to a verdict.

use std::time::Duration;

use super::Policy;
use crate::model::{Class, DeadLetterReason, Outcome};

/// How to settle a delivery.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Ack,
    /// Deliver again after `delay`. When `attempt_used` is false the app never
    /// saw the message (it was unreachable) and the attempt is not counted.
    Retry {
        delay: Duration,
        attempt_used: bool,
    },
    DeadLetter {
        reason: DeadLetterReason,
    },
}

/// The class travels with the verdict: it is the metric label and log field.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub class: Class,
    pub verdict: Verdict,
}

/// The app-health gate as the decision sees it: closed while the app is
/// down (no connection, or its `--app-health-path` failing). A failure while
/// it is closed is the app's, not the message's, and uses no attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateState {
    Open,
    Closed,
}

/// The decision, a pure function: no I/O, no clock; `jitter_sample` is a
/// uniform random number in [0, 1) supplied by the caller.
///
/// | class | gate open | gate closed |
/// |---|---|---|
/// | success | ack | ack |
/// | transient, timeout | retry using an attempt; dead-letter when used up | retry, no attempt used |
/// | connection-lost | retry using an attempt; dead-letter when used up | the same: a message that crashes the app must not loop |
/// | unreachable | retry, no attempt used | retry, no attempt used |
/// | permanent | dead-letter | dead-letter |
/// | undeliverable | dead-letter | dead-letter |
///
/// The app's say (`Policy::classify`): `Courier-Dead-Letter` makes any
/// answer but a 2xx permanent, reason `app-dead-letter`; `Courier-Retry:
/// never` makes a retryable answer permanent, reason `permanent-status`.
/// `Retry-After` sets the least delay of every retry an answer leads to,
/// whatever its status.
pub fn decide(
    policy: &Policy,
    outcome: &Outcome,
    attempt: u32,
    gate: GateState,
    jitter_sample: f64,
) -> Decision {
    let class = policy.classify(outcome);
    let attempt = attempt.max(1);
    let retry_after = match outcome {
        Outcome::Answered { retry_after, .. } => *retry_after,
        _ => None,
    };
    let delay = || {
        let backoff = policy.jittered_backoff(attempt, jitter_sample);
        match retry_after {
            Some(asked) if policy.retry_after.honor => {
                backoff.max(asked.min(policy.retry_after.max))
            }
            _ => backoff,
        }
    };
    let free_retry = || Verdict::Retry {
        delay: delay(),
        attempt_used: false,
    };
    let use_an_attempt = || {
        if attempt >= policy.max_attempts {
            Verdict::DeadLetter {
                reason: DeadLetterReason::AttemptsExhausted,
            }
        } else {
            Verdict::Retry {
                delay: delay(),
                attempt_used: true,
            }
        }
    };
    let verdict = match (class, gate) {
        (Class::Success, _) => Verdict::Ack,
        (Class::Transient | Class::Timeout, GateState::Open) => use_an_attempt(),
        (Class::Transient | Class::Timeout, GateState::Closed) => free_retry(),
        (Class::ConnectionLost, _) => use_an_attempt(),
        (Class::Unreachable, _) => free_retry(),
        (Class::Permanent, _) => Verdict::DeadLetter {
            reason: match outcome {
                Outcome::Answered { directives, .. }
                    if policy.app_directives && directives.dead_letter.is_some() =>
                {
                    DeadLetterReason::AppDeadLetter
                }
                _ => DeadLetterReason::PermanentStatus,
            },
        },
        (Class::Undeliverable, _) => Verdict::DeadLetter {
            reason: DeadLetterReason::Undeliverable,
        },
    };
    Decision { class, verdict }
}

/// What the app said of one entry of a batch it answered 2xx
/// (docs/batches.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryAnswer {
    Success,
    /// `retry`, or the entry was not mentioned.
    Retry,
    /// `drop`: dead-letter it now.
    Drop,
}

/// The decision for one entry of a batch answered 2xx: success is an ack;
/// retry uses an attempt, as a transient answer does, and dead-letters as
/// `attempts-exhausted` when they are used up; drop dead-letters at once
/// as `app-dead-letter`. The batch's status says nothing of the entry, so
/// `statusCodes` and the gate take no part; the batch answer's
/// `Retry-After` sets the least delay of a retry, as on a single answer.
pub fn decide_entry(
    policy: &Policy,
    answer: EntryAnswer,
    attempt: u32,
    retry_after: Option<Duration>,
    jitter_sample: f64,
) -> Decision {
    let attempt = attempt.max(1);
    match answer {
        EntryAnswer::Success => Decision {
            class: Class::Success,
            verdict: Verdict::Ack,
        },
        EntryAnswer::Retry => Decision {
            class: Class::Transient,
            verdict: if attempt >= policy.max_attempts {
                Verdict::DeadLetter {
                    reason: DeadLetterReason::AttemptsExhausted,
                }
            } else {
                let backoff = policy.jittered_backoff(attempt, jitter_sample);
                Verdict::Retry {
                    delay: match retry_after {
                        Some(asked) if policy.retry_after.honor => {
                            backoff.max(asked.min(policy.retry_after.max))
                        }
                        _ => backoff,
                    },
                    attempt_used: true,
                }
            },
        },
        EntryAnswer::Drop => Decision {
            class: Class::Permanent,
            verdict: Verdict::DeadLetter {
                reason: DeadLetterReason::AppDeadLetter,
            },
        },
    }
}
