//! The app-health gate. It protects an app that is down and must never
//! stall a queue because of a few messages, so only two things close it: no
//! connection to the app, and the app's own `--app-health-path` failing.
//! Answers never close it, not even 503s (a run of those lowers the
//! concurrency limit instead, see [`super::limit`]). While it is closed
//! courier pulls nothing and probes the app with backoff; its state is an
//! input of [`crate::policy::decide`], which uses up no attempts on a
//! transient failure while it is closed.

use std::sync::Mutex;
use std::time::Duration;

use crate::model::{Class, Outcome};
use crate::policy::GateState;

/// Consecutive 503s or timeouts after which the health path is asked at
/// once, by default (`--app-failure-run`).
pub const FAILURE_RUN: u32 = 5;
/// Probe backoff bounds while closed.
pub const PROBE_MIN: Duration = Duration::from_millis(200);
pub const PROBE_MAX: Duration = Duration::from_secs(5);

/// What courier learned about the app.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evidence {
    /// No connection: refused, no route, reset before the request left.
    Unreachable,
    /// It answered, or accepted a connection.
    Reachable,
    /// It answered 503, or did not answer in time: maybe down, maybe
    /// drowning. Only the health path can tell, when there is one.
    Failing,
    /// What `--app-health-path` said: 2xx or not.
    HealthPath(bool),
}

impl Evidence {
    /// What a delivery's outcome says about the app, if anything.
    pub fn from_outcome(class: Class, outcome: &Outcome) -> Option<Self> {
        match (class, outcome.status()) {
            (Class::Unreachable, _) => Some(Self::Unreachable),
            (Class::Timeout, _) | (_, Some(503)) => Some(Self::Failing),
            // The app took the connection and lost it: it was there. If it
            // crashed, the next connection is refused and says so.
            (Class::ConnectionLost | Class::Undeliverable, _) => None,
            _ => Some(Self::Reachable),
        }
    }
}

/// What a report did to the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Opened,
    Closed,
    /// A run of failures: ask the health path now, and report its answer.
    CheckHealth,
    Unchanged,
}

#[derive(Default)]
struct State {
    closed: bool,
    failures: u32,
}

pub struct Gate {
    state: Mutex<State>,
    /// With a health path, only it opens the gate, and a run of this many
    /// failures asks it at once (0: only the periodic check asks).
    failure_run: u32,
    health_path: bool,
}

impl Gate {
    pub fn new(failure_run: u32, health_path: bool) -> Self {
        Self {
            state: Mutex::default(),
            failure_run,
            health_path,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// The state as [`crate::policy::decide`] takes it.
    pub fn state(&self) -> GateState {
        if self.is_closed() {
            GateState::Closed
        } else {
            GateState::Open
        }
    }

    pub fn report(&self, evidence: Evidence) -> Change {
        let mut s = self.lock();
        let was_closed = s.closed;
        match evidence {
            Evidence::Unreachable | Evidence::HealthPath(false) => {
                s.closed = true;
                s.failures = 0;
            }
            Evidence::HealthPath(true) => {
                s.closed = false;
                s.failures = 0;
            }
            Evidence::Reachable | Evidence::Failing if !self.health_path => s.closed = false,
            Evidence::Reachable => s.failures = 0,
            Evidence::Failing => {
                s.failures += 1;
                if !s.closed && self.failure_run > 0 && s.failures >= self.failure_run {
                    s.failures = 0;
                    return Change::CheckHealth;
                }
            }
        }
        match (was_closed, s.closed) {
            (false, true) => Change::Closed,
            (true, false) => Change::Opened,
            _ => Change::Unchanged,
        }
    }
}

/// The next probe delay: doubles from [`PROBE_MIN`] up to [`PROBE_MAX`].
pub fn probe_delay(probes: u32) -> Duration {
    PROBE_MIN.saturating_mul(1 << probes.min(10)).min(PROBE_MAX)
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn answered(status: u16) -> Outcome {
        Outcome::Answered {
            status,
            retry_after: None,
            retry_after_invalid: false,
            excerpt: Bytes::new(),
            directives: Default::default(),
        }
    }

    #[test]
    fn answers_never_close_it_without_a_health_path() {
        let gate = Gate::new(FAILURE_RUN, false);
        for _ in 0..100 {
            assert_eq!(gate.report(Evidence::Failing), Change::Unchanged);
        }
        assert_eq!(gate.state(), GateState::Open);
    }

    #[test]
    fn no_connection_closes_it_and_an_answer_opens_it() {
        let gate = Gate::new(FAILURE_RUN, false);
        assert_eq!(gate.report(Evidence::Unreachable), Change::Closed);
        assert_eq!(gate.state(), GateState::Closed);
        assert_eq!(gate.report(Evidence::Unreachable), Change::Unchanged);
        // Even a 503 is an answer: the app is there.
        assert_eq!(gate.report(Evidence::Failing), Change::Opened);
        assert_eq!(gate.report(Evidence::Unreachable), Change::Closed);
        assert_eq!(gate.report(Evidence::Reachable), Change::Opened);
    }

    #[test]
    fn a_run_of_failures_asks_the_health_path_which_decides() {
        let gate = Gate::new(3, true);
        assert_eq!(gate.report(Evidence::Failing), Change::Unchanged);
        assert_eq!(gate.report(Evidence::Failing), Change::Unchanged);
        assert_eq!(gate.report(Evidence::Failing), Change::CheckHealth);
        assert_eq!(gate.report(Evidence::HealthPath(true)), Change::Unchanged);
        assert_eq!(gate.state(), GateState::Open);
        for _ in 0..2 {
            gate.report(Evidence::Failing);
        }
        assert_eq!(gate.report(Evidence::Failing), Change::CheckHealth);
        assert_eq!(gate.report(Evidence::HealthPath(false)), Change::Closed);
        // Closed, only the health path opens it: answers in flight do not.
        assert_eq!(gate.report(Evidence::Reachable), Change::Unchanged);
        assert_eq!(gate.report(Evidence::Failing), Change::Unchanged);
        assert_eq!(gate.report(Evidence::HealthPath(true)), Change::Opened);
    }

    #[test]
    fn an_answer_breaks_the_run() {
        let gate = Gate::new(3, true);
        for _ in 0..10 {
            assert_eq!(gate.report(Evidence::Failing), Change::Unchanged);
            assert_eq!(gate.report(Evidence::Failing), Change::Unchanged);
            assert_eq!(gate.report(Evidence::Reachable), Change::Unchanged);
        }
    }

    #[test]
    fn a_zero_run_never_asks() {
        let gate = Gate::new(0, true);
        for _ in 0..100 {
            assert_eq!(gate.report(Evidence::Failing), Change::Unchanged);
        }
        assert_eq!(gate.report(Evidence::Unreachable), Change::Closed);
    }

    #[test]
    fn evidence_from_outcomes() {
        let rows = [
            (Class::Transient, answered(503), Some(Evidence::Failing)),
            (Class::Timeout, Outcome::Timeout, Some(Evidence::Failing)),
            (Class::Transient, answered(500), Some(Evidence::Reachable)),
            (Class::Transient, answered(429), Some(Evidence::Reachable)),
            (Class::Permanent, answered(400), Some(Evidence::Reachable)),
            (Class::Success, answered(200), Some(Evidence::Reachable)),
            (
                Class::Unreachable,
                Outcome::Unreachable {
                    error: "refused".into(),
                },
                Some(Evidence::Unreachable),
            ),
            (
                Class::ConnectionLost,
                Outcome::ConnectionLost {
                    error: "reset".into(),
                },
                None,
            ),
            (
                Class::Undeliverable,
                Outcome::Undeliverable {
                    error: "too big".into(),
                },
                None,
            ),
        ];
        for (class, outcome, want) in rows {
            assert_eq!(Evidence::from_outcome(class, &outcome), want, "{outcome:?}");
        }
    }

    #[test]
    fn probes_back_off() {
        assert_eq!(probe_delay(0), PROBE_MIN);
        assert_eq!(probe_delay(1), PROBE_MIN * 2);
        assert_eq!(probe_delay(30), PROBE_MAX);
    }
}
