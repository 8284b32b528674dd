//! What happened when a message was offered to the app ([`Outcome`]), what
//! that means ([`Class`]), and why a message is dead-lettered
//! ([`DeadLetterReason`]). `forward` makes outcomes, `policy` classifies
//! them; every other layer only reads these names.

use std::time::Duration;

use bytes::Bytes;

/// How much of the app's answer body is kept for `courier-response-excerpt`.
pub const EXCERPT_LIMIT: usize = 1024;

/// What happened when a message was offered to the app.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The app answered with a status.
    Answered {
        status: u16,
        /// A valid `Retry-After`, already turned into a delay.
        retry_after: Option<Duration>,
        /// `Retry-After` was present but unreadable (ignored, and counted).
        retry_after_invalid: bool,
        /// The first [`EXCERPT_LIMIT`] bytes of the answer body.
        excerpt: Bytes,
        /// What the app said about the message besides its status.
        directives: Directives,
    },
    /// No answer within the policy's timeout.
    Timeout,
    /// No connection: refused, no route, or reset before the request was
    /// written. The app never saw the message.
    Unreachable { error: String },
    /// The connection was lost after the request was written and before an
    /// answer: the app may have seen the message, and may have crashed on it.
    ConnectionLost { error: String },
    /// The message could not be offered at all (too large, malformed).
    Undeliverable { error: String },
}

impl Outcome {
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Answered { status, .. } => Some(*status),
            _ => None,
        }
    }

    pub fn error(&self) -> Option<String> {
        match self {
            Self::Answered { .. } => None,
            Self::Timeout => Some("timeout".into()),
            Self::Unreachable { error }
            | Self::ConnectionLost { error }
            | Self::Undeliverable { error } => Some(error.clone()),
        }
    }

    pub fn excerpt(&self) -> Bytes {
        match self {
            Self::Answered { excerpt, .. } => excerpt.clone(),
            _ => Bytes::new(),
        }
    }
}

/// The app's say over a retry, from its answer's headers (docs/design.md,
/// "The app's say"): read by `forward`, weighed by `decide` unless the
/// policy turns them off (`appDirectives: false`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Directives {
    /// `Courier-Dead-Letter: <reason>`: dead-letter now, with the app's
    /// reason (at most [`EXCERPT_LIMIT`] bytes of it).
    pub dead_letter: Option<String>,
    /// `Courier-Retry: never`: a retryable answer is final.
    pub retry_never: bool,
    /// A `Courier-Retry` value other than `never`: ignored, and logged so the
    /// app's author learns of it.
    pub retry_unknown: Option<String>,
}

impl Directives {
    /// The header that decides a dead letter, as recorded in
    /// `courier-app-directive`, when the app sent one.
    pub fn dead_letter_header(&self) -> Option<String> {
        self.dead_letter
            .as_ref()
            .map(|reason| format!("Courier-Dead-Letter: {reason}"))
    }
}

/// What an outcome means; also the `result` label of `courier_deliveries_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Success,
    Transient,
    Permanent,
    Timeout,
    Unreachable,
    /// The app may have seen the message and dropped the connection
    /// (crashed, was killed): transient, and it uses an attempt.
    ConnectionLost,
    /// The message could not be sent at all (too large, malformed).
    Undeliverable,
}

impl Class {
    /// Every class that is the `result` of a delivery the app was offered.
    pub const RESULTS: [Class; 6] = [
        Self::Success,
        Self::Transient,
        Self::Permanent,
        Self::Timeout,
        Self::Unreachable,
        Self::ConnectionLost,
    ];

    /// The `result` labels of [`Class::RESULTS`].
    pub fn result_labels() -> Vec<&'static str> {
        Self::RESULTS.iter().map(|c| c.as_str()).collect()
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Transient => "transient",
            Self::Permanent => "permanent",
            Self::Timeout => "timeout",
            Self::Unreachable => "unreachable",
            Self::ConnectionLost => "connection-lost",
            Self::Undeliverable => "undeliverable",
        }
    }
}

/// Why a message went to the dead-letter queue (`courier-reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterReason {
    PermanentStatus,
    AttemptsExhausted,
    Undeliverable,
    /// The app answered with `Courier-Dead-Letter: <reason>`.
    AppDeadLetter,
    /// Older than the policy's `maxAge` when read; never offered to the app.
    Expired,
    /// No route matched and the policy's `unrouted` is `dead-letter`;
    /// never offered to the app.
    Unrouted,
}

impl DeadLetterReason {
    pub const ALL: [DeadLetterReason; 6] = [
        Self::PermanentStatus,
        Self::AttemptsExhausted,
        Self::Undeliverable,
        Self::AppDeadLetter,
        Self::Expired,
        Self::Unrouted,
    ];

    /// The `reason` labels of every reason.
    pub fn labels() -> Vec<&'static str> {
        Self::ALL.iter().map(|r| r.as_str()).collect()
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::PermanentStatus => "permanent-status",
            Self::AttemptsExhausted => "attempts-exhausted",
            Self::Undeliverable => "undeliverable",
            Self::AppDeadLetter => "app-dead-letter",
            Self::Expired => "expired",
            Self::Unrouted => "unrouted",
        }
    }
}
