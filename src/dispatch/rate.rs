//! The RetryPolicy's `rateLimit`: a token bucket on deliveries to the app,
//! apart from the concurrency limit and its adaptation.
//!
//! Tokens are taken ahead: the bucket may go below zero, and a delivery
//! learns at once how long it waits for its turn. Waits are so spaced
//! `1 / perSecond` apart with one timer per delivery and no polling, and a
//! read asks for no more messages than get their turn within about a
//! second ([`Bucket::room`]), so no message waits long holding its lease.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::policy::RateLimit;

/// How far ahead a read may take tokens: the messages it asks for all get
/// their turn within this.
const READ_HORIZON: Duration = Duration::from_secs(1);

#[derive(Default)]
pub struct Bucket {
    state: Mutex<Option<State>>,
}

struct State {
    /// Below zero: tokens taken ahead by deliveries still waiting.
    tokens: f64,
    at: Instant,
    per_second: f64,
    burst: f64,
}

impl State {
    /// Full at the first use; a live edit keeps what is left (at most the
    /// new burst) and what is owed, and refills at the new rate from now.
    fn refilled<'a>(
        state: &'a mut Option<State>,
        limit: &RateLimit,
        now: Instant,
    ) -> &'a mut State {
        let burst = f64::from(limit.burst);
        let state = state.get_or_insert(State {
            tokens: burst,
            at: now,
            per_second: limit.per_second,
            burst,
        });
        let elapsed = now.saturating_duration_since(state.at).as_secs_f64();
        state.tokens = (state.tokens + elapsed * state.per_second).min(state.burst);
        state.at = now;
        state.per_second = limit.per_second;
        state.burst = burst;
        state.tokens = state.tokens.min(burst);
        state
    }
}

impl Bucket {
    /// Takes a token under `limit`: how long the delivery waits before it
    /// may go.
    pub fn take(&self, limit: &RateLimit) -> Duration {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let state = State::refilled(&mut state, limit, Instant::now());
        state.tokens -= 1.0;
        if state.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-state.tokens / state.per_second)
        }
    }

    /// How many messages a read may ask for so that each gets its turn
    /// within [`READ_HORIZON`]; `Err` is how long to wait before one would.
    pub fn room(&self, limit: &RateLimit) -> Result<usize, Duration> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let state = State::refilled(&mut state, limit, Instant::now());
        let within = state.tokens + state.per_second * READ_HORIZON.as_secs_f64();
        if within >= 1.0 {
            Ok(within.floor().min(usize::MAX as f64) as usize)
        } else {
            Err(Duration::from_secs_f64((1.0 - within) / state.per_second))
        }
    }
}

/// A read's size under a bucket kept elsewhere (`scope: queue` on the
/// broker), which this replica cannot see: a burst and a second's worth.
pub fn shared_room(limit: &RateLimit) -> usize {
    let within = f64::from(limit.burst) + limit.per_second * READ_HORIZON.as_secs_f64();
    within.floor().clamp(1.0, usize::MAX as f64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::RateScope;

    fn limit(per_second: f64, burst: u32) -> RateLimit {
        RateLimit {
            per_second,
            burst,
            scope: RateScope::Pod,
        }
    }

    /// The turns given to `n` deliveries taken at once.
    fn turns(bucket: &Bucket, limit: &RateLimit, n: usize) -> Vec<Duration> {
        (0..n).map(|_| bucket.take(limit)).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_goes_at_once_then_turns_are_spaced_by_the_rate() {
        let bucket = Bucket::default();
        let rate = limit(20.0, 5);
        let waits = turns(&bucket, &rate, 9);
        assert_eq!(&waits[..5], &[Duration::ZERO; 5]);
        for (i, wait) in waits[5..].iter().enumerate() {
            let expected = 0.05 * (i + 1) as f64;
            assert!(
                (wait.as_secs_f64() - expected).abs() < 1e-9,
                "{i}: {wait:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_quiet_spell_refills_up_to_the_burst_only() {
        let bucket = Bucket::default();
        let rate = limit(20.0, 5);
        turns(&bucket, &rate, 5);
        tokio::time::advance(Duration::from_secs(60)).await;
        let waits = turns(&bucket, &rate, 6);
        assert_eq!(&waits[..5], &[Duration::ZERO; 5]);
        assert!(waits[5] > Duration::ZERO);
    }

    /// A minute of steady demand is the rate times the minute plus the
    /// burst, and no second holds more than rate + burst turns.
    #[tokio::test(start_paused = true)]
    async fn a_minute_of_demand_gives_the_rate_and_no_window_over_rate_plus_burst() {
        let bucket = Bucket::default();
        let rate = limit(20.0, 5);
        let start = Instant::now();
        let mut at = Vec::new();
        // Deliveries come as fast as their turns: each takes its token
        // when the one before went.
        loop {
            let wait = bucket.take(&rate);
            tokio::time::advance(wait).await;
            let now = Instant::now() - start;
            if now >= Duration::from_secs(60) {
                break;
            }
            at.push(now);
        }
        assert!((1200..=1206).contains(&at.len()), "{}", at.len());
        let most = at
            .iter()
            .map(|from| {
                at.iter()
                    .filter(|t| **t >= *from && **t < *from + Duration::from_secs(1))
                    .count()
            })
            .max()
            .unwrap();
        assert!(most <= 25, "{most} in one second");
    }

    #[tokio::test(start_paused = true)]
    async fn an_edit_applies_to_the_next_turn() {
        let bucket = Bucket::default();
        turns(&bucket, &limit(1.0, 1), 1);
        let slow = bucket.take(&limit(1.0, 1));
        assert_eq!(slow, Duration::from_secs(1));
        // Now 100 a second: what is owed is paid at the new rate.
        let fast = bucket.take(&limit(100.0, 1));
        assert!(fast <= Duration::from_millis(20), "{fast:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_read_asks_for_a_second_of_turns_and_waits_when_owed_more() {
        let bucket = Bucket::default();
        let rate = limit(20.0, 5);
        assert_eq!(bucket.room(&rate), Ok(25));
        turns(&bucket, &rate, 25);
        let wait = bucket.room(&rate).unwrap_err();
        assert!((wait.as_secs_f64() - 0.05).abs() < 1e-9, "{wait:?}");
        tokio::time::advance(wait).await;
        assert_eq!(bucket.room(&rate), Ok(1));
        assert_eq!(shared_room(&rate), 25);
        assert_eq!(shared_room(&limit(0.1, 1)), 1);
    }
}
