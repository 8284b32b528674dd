//! What the policy in force means to the source: derived afresh on every
//! applied change, so a live edit takes full effect (the visibility timeout
//! follows the timeout, depth follows the dead-letter queue).

use std::time::Duration;

use crate::policy::Policy;
use crate::source::{LiveSettings, SourceOptions};

/// A delivery may run this much longer than the policy's timeout before the
/// broker would hand it out again.
pub const VISIBILITY_MARGIN: Duration = Duration::from_secs(30);

/// The configured visibility timeout while it is longer than the policy's
/// timeout (the user chose it, and `courier run` checked it at start); else
/// the policy's timeout plus [`VISIBILITY_MARGIN`]. Deliveries in flight are
/// kept claimed besides ([`super::in_flight`]).
pub fn visibility_for(configured: Duration, policy: &Policy) -> Duration {
    if configured > policy.timeout {
        configured
    } else {
        policy.timeout + VISIBILITY_MARGIN
    }
}

/// The source's live settings under `policy`, from the options it was
/// opened with.
pub fn settings_for(options: &SourceOptions, policy: &Policy) -> LiveSettings {
    LiveSettings {
        visibility_timeout: visibility_for(options.live.visibility_timeout, policy),
        dead_letter_queue: policy.dead_letter_queue_for(&options.queue),
        max_deliveries: policy.max_deliveries(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_follow_the_policy() {
        let mut options = SourceOptions::new("orders");
        options.live.visibility_timeout = Duration::from_secs(60);
        let mut policy = Policy::test().max_attempts(5);
        policy.timeout = Duration::from_secs(10);
        let settings = settings_for(&options, &policy);
        assert_eq!(settings.visibility_timeout, Duration::from_secs(60));
        assert_eq!(settings.dead_letter_queue, "orders.dlq");
        assert_eq!(settings.max_deliveries, 7);
        policy.timeout = Duration::from_secs(120);
        policy.dead_letter_queue = Some("orders.parked".into());
        let settings = settings_for(&options, &policy);
        assert_eq!(settings.visibility_timeout, Duration::from_secs(150));
        assert_eq!(settings.dead_letter_queue, "orders.parked");
        // A short visibility the user chose stays while it outlasts the
        // timeout, and is raised once the timeout catches up.
        options.live.visibility_timeout = Duration::from_secs(2);
        policy.timeout = Duration::from_secs(1);
        assert_eq!(
            settings_for(&options, &policy).visibility_timeout,
            Duration::from_secs(2)
        );
        policy.timeout = Duration::from_secs(6);
        assert_eq!(
            settings_for(&options, &policy).visibility_timeout,
            Duration::from_secs(36)
        );
    }
}
