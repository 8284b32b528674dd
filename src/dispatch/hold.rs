//! The Retry-After hold: a 429 with `Retry-After` (when the policy honours
//! it) holds every new delivery to the app until then. The limit is the
//! app's, not the message's.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::model::Outcome;
use crate::policy::Policy;

#[derive(Default)]
pub struct Hold {
    until: Mutex<Option<Instant>>,
}

impl Hold {
    /// The end of the hold, while one is in force.
    pub fn until(&self) -> Option<Instant> {
        let until = *self.until.lock().unwrap_or_else(|e| e.into_inner());
        until.filter(|t| *t > Instant::now())
    }

    /// Holds until `until`, unless a longer hold is already in force.
    pub fn extend(&self, until: Instant) {
        let mut hold = self.until.lock().unwrap_or_else(|e| e.into_inner());
        if hold.is_none_or(|t| t < until) {
            *hold = Some(until);
        }
    }

    /// Applies what an answer asks for, if it asks for a hold.
    pub fn observe(&self, policy: &Policy, outcome: &Outcome) {
        if let Some(wait) = asked_hold(policy, outcome) {
            self.extend(Instant::now() + wait);
        }
    }
}

/// How long an answer asks the app to be left alone: a 429's Retry-After,
/// capped by the policy, when the policy honours it.
pub fn asked_hold(policy: &Policy, outcome: &Outcome) -> Option<Duration> {
    match outcome {
        Outcome::Answered {
            status: 429,
            retry_after: Some(wait),
            ..
        } if policy.retry_after.honor => Some((*wait).min(policy.retry_after.max)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn answered(status: u16, retry_after: Option<u64>) -> Outcome {
        Outcome::Answered {
            status,
            retry_after: retry_after.map(Duration::from_secs),
            retry_after_invalid: false,
            excerpt: Bytes::new(),
            directives: Default::default(),
        }
    }

    #[test]
    fn only_an_honoured_429_with_retry_after_holds() {
        let honoured = Policy::test().retry_after_honored(true, Duration::from_secs(60));
        let ignored = Policy::test().retry_after_honored(false, Duration::from_secs(60));
        let rows = [
            (&honoured, answered(429, Some(5)), Some(5)),
            (&honoured, answered(429, Some(3600)), Some(60)),
            (&honoured, answered(429, None), None),
            (&honoured, answered(503, Some(5)), None),
            (&honoured, Outcome::Timeout, None),
            (&ignored, answered(429, Some(5)), None),
        ];
        for (policy, outcome, want) in rows {
            assert_eq!(
                asked_hold(policy, &outcome),
                want.map(Duration::from_secs),
                "{outcome:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_hold_ends_on_time_and_only_grows() {
        let hold = Hold::default();
        assert_eq!(hold.until(), None);
        let policy = Policy::test().retry_after_honored(true, Duration::from_secs(60));
        hold.observe(&policy, &answered(429, Some(5)));
        let end = hold.until().expect("held");
        hold.observe(&policy, &answered(429, Some(1)));
        assert_eq!(hold.until(), Some(end), "a shorter hold does not cut it");
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(hold.until(), Some(end));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(hold.until(), None, "over at the time asked for");
    }
}
