//! The app-health gate (a circuit breaker). When the app is unreachable, or
//! a run of deliveries fails with 503s or timeouts, the gate closes: courier
//! stops pulling, probes the app with backoff, and opens again when it
//! answers. Failures while the gate is closed use up no attempts, so an app
//! outage of any length dead-letters nothing.

use std::sync::Mutex;
use std::time::Duration;

use crate::model::Class;

/// Consecutive 503s or timeouts that close the gate, by default.
pub const FAILURE_RUN: u32 = 5;
/// Probe backoff bounds while closed.
pub const PROBE_MIN: Duration = Duration::from_millis(200);
pub const PROBE_MAX: Duration = Duration::from_secs(5);

/// What a delivery's outcome says about the app's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// It answered, and not with "I am down".
    Answering,
    /// 503 or a timeout: down, or drowning.
    Failing,
    /// Connection refused or reset: not there at all.
    Unreachable,
}

impl Health {
    pub fn from_class(class: Class, status: Option<u16>) -> Option<Self> {
        match (class, status) {
            (Class::Unreachable, _) => Some(Self::Unreachable),
            (Class::Timeout, _) | (_, Some(503)) => Some(Self::Failing),
            (Class::Undeliverable, _) => None,
            _ => Some(Self::Answering),
        }
    }
}

#[derive(Default)]
struct State {
    closed: bool,
    failures: u32,
}

pub struct Gate {
    state: Mutex<State>,
    /// 0: only an unreachable app closes the gate.
    failure_run: u32,
}

impl Default for Gate {
    fn default() -> Self {
        Self::new(FAILURE_RUN)
    }
}

/// What a report did to the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Opened,
    Closed,
    Unchanged,
}

impl Gate {
    pub fn new(failure_run: u32) -> Self {
        Self {
            state: Mutex::default(),
            failure_run,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    pub fn report(&self, health: Health) -> Change {
        let mut s = self.lock();
        let was_closed = s.closed;
        match health {
            Health::Answering => {
                s.failures = 0;
                s.closed = false;
            }
            Health::Failing => {
                s.failures += 1;
                if self.failure_run > 0 && s.failures >= self.failure_run {
                    s.closed = true;
                }
            }
            Health::Unreachable => {
                s.closed = true;
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
    use super::*;

    #[test]
    fn a_run_of_failures_closes_and_an_answer_opens() {
        let gate = Gate::default();
        for _ in 1..FAILURE_RUN {
            assert_eq!(gate.report(Health::Failing), Change::Unchanged);
        }
        assert_eq!(gate.report(Health::Failing), Change::Closed);
        assert!(gate.is_closed());
        assert_eq!(gate.report(Health::Failing), Change::Unchanged);
        assert_eq!(gate.report(Health::Answering), Change::Opened);
        assert!(!gate.is_closed());
    }

    #[test]
    fn an_answer_breaks_the_run() {
        let gate = Gate::default();
        for _ in 0..10 {
            gate.report(Health::Failing);
            gate.report(Health::Failing);
            gate.report(Health::Answering);
        }
        assert!(!gate.is_closed());
    }

    #[test]
    fn a_zero_run_leaves_only_unreachable() {
        let gate = Gate::new(0);
        for _ in 0..100 {
            gate.report(Health::Failing);
        }
        assert!(!gate.is_closed());
        assert_eq!(gate.report(Health::Unreachable), Change::Closed);
    }

    #[test]
    fn unreachable_closes_at_once() {
        let gate = Gate::default();
        assert_eq!(gate.report(Health::Unreachable), Change::Closed);
    }

    #[test]
    fn classes() {
        assert_eq!(
            Health::from_class(Class::Transient, Some(503)),
            Some(Health::Failing)
        );
        assert_eq!(
            Health::from_class(Class::Timeout, None),
            Some(Health::Failing)
        );
        assert_eq!(
            Health::from_class(Class::Transient, Some(500)),
            Some(Health::Answering)
        );
        assert_eq!(
            Health::from_class(Class::Permanent, Some(400)),
            Some(Health::Answering)
        );
        assert_eq!(
            Health::from_class(Class::Unreachable, None),
            Some(Health::Unreachable)
        );
        assert_eq!(Health::from_class(Class::Undeliverable, None), None);
    }

    #[test]
    fn probes_back_off() {
        assert_eq!(probe_delay(0), PROBE_MIN);
        assert_eq!(probe_delay(1), PROBE_MIN * 2);
        assert_eq!(probe_delay(30), PROBE_MAX);
    }
}
