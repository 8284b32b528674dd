//! Adaptive concurrency: how many deliveries may be in flight, between 1 and
//! `--concurrency`, moved by what the app says (AIMD). Up by about one per
//! round of healthy answers; halved on a 429, a timeout or a run of 503s;
//! trimmed when latency climbs well above the best the app has recently
//! shown. A run of 503s is the app saying it is drowning: the answer to it
//! is backpressure, not a pause of the whole queue (see [`super::gate`]).
//! At the floor of one delivery at a time, further overload signals space
//! the deliveries out (a pause doubling from 10 ms to 1 s, gone at the next
//! healthy answer): an app that refuses at once would otherwise get one
//! request after another, thousands a second (a path answering 503 beside
//! healthy subscriptions took a quarter of their throughput that way).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::model::Class;

/// Latency above this multiple of the recent best counts as rising.
const LATENCY_RISE: f64 = 2.0;
/// Latencies under this are loopback noise and never count as rising.
const LATENCY_FLOOR: Duration = Duration::from_millis(20);
/// The "recent best" is forgotten this often, so a slower app can settle.
const BASELINE_WINDOW: Duration = Duration::from_secs(30);
/// Consecutive 503s that count as one overload signal: a few messages the
/// app always refuses must not hold the limit down.
pub const UNAVAILABLE_RUN: u32 = 3;
/// The first pause between deliveries once an overload comes at the floor.
const FLOOR_PAUSE_FIRST: Duration = Duration::from_millis(10);
/// The longest: one delivery a second to an app that keeps refusing.
const FLOOR_PAUSE_MOST: Duration = Duration::from_secs(1);

/// Signals that move the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// A healthy answer in this time.
    Healthy(Duration),
    /// 429 or a timeout: the app says it has too much.
    Overloaded,
    /// 503: a run of [`UNAVAILABLE_RUN`] of these is an overload.
    Unavailable,
    /// Anything else: no information about load.
    Neutral,
}

impl Signal {
    pub fn from_class(class: Class, status: Option<u16>, latency: Duration) -> Self {
        match (class, status) {
            (Class::Success, _) => Self::Healthy(latency),
            (Class::Timeout, _) | (_, Some(429)) => Self::Overloaded,
            (_, Some(503)) => Self::Unavailable,
            _ => Self::Neutral,
        }
    }
}

struct State {
    limit: f64,
    in_flight: usize,
    last_decrease: Option<Instant>,
    baseline: Option<Duration>,
    baseline_since: Instant,
    /// 503s since the last healthy answer.
    unavailable: u32,
    /// 503s in a row since the last healthy answer, never reset by the
    /// signal they make.
    refused: u32,
    /// Between deliveries while overloads come at the floor; zero otherwise.
    pause: Duration,
    /// The next delivery goes no sooner than this.
    next_at: Option<Instant>,
}

pub struct Limiter {
    state: Mutex<State>,
    released: Notify,
    max: usize,
}

/// A slot in flight; dropping it frees it.
pub struct Slot {
    limiter: Arc<Limiter>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.limiter.lock().in_flight -= 1;
        self.limiter.released.notify_waiters();
    }
}

impl Limiter {
    pub fn new(max: usize) -> Arc<Self> {
        let max = max.max(1);
        Arc::new(Self {
            state: Mutex::new(State {
                limit: max as f64,
                in_flight: 0,
                last_decrease: None,
                baseline: None,
                baseline_since: Instant::now(),
                unavailable: 0,
                refused: 0,
                pause: Duration::ZERO,
                next_at: None,
            }),
            released: Notify::new(),
            max,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The current limit, a whole number of deliveries.
    pub fn limit(&self) -> usize {
        (self.lock().limit.floor() as usize).clamp(1, self.max)
    }

    pub fn try_acquire(self: &Arc<Self>) -> Option<Slot> {
        let mut state = self.lock();
        let limit = (state.limit.floor() as usize).clamp(1, self.max);
        if state.in_flight >= limit {
            return None;
        }
        state.in_flight += 1;
        Some(Slot {
            limiter: self.clone(),
        })
    }

    /// Waits for a free slot under the current limit, and, while
    /// overloads come at the floor, for the delivery's turn.
    pub async fn acquire(self: &Arc<Self>) -> Slot {
        let slot = loop {
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if let Some(slot) = self.try_acquire() {
                break slot;
            }
            released.await;
        };
        let turn = {
            let mut s = self.lock();
            if s.pause.is_zero() {
                None
            } else {
                let now = Instant::now();
                let turn = s.next_at.map_or(now, |at| at.max(now));
                s.next_at = Some(turn + s.pause);
                Some(turn)
            }
        };
        if let Some(turn) = turn {
            tokio::time::sleep_until(turn).await;
        }
        slot
    }

    /// The pause between deliveries now (zero unless overloads come at the
    /// floor).
    pub fn pause(&self) -> Duration {
        self.lock().pause
    }

    pub fn observe(&self, signal: Signal) {
        let now = Instant::now();
        let mut s = self.lock();
        let max = self.max as f64;
        // One decrease per round trip: a burst of 429s from one overload is
        // one signal, not sixteen.
        let may_decrease = |s: &State, rtt: Duration| {
            s.last_decrease
                .is_none_or(|t| now.duration_since(t) >= rtt.max(Duration::from_millis(100)))
        };
        let signal = match signal {
            Signal::Unavailable => {
                s.unavailable += 1;
                s.refused = s.refused.saturating_add(1);
                // Two whole rounds at the maximum refused and nothing
                // healthy: the app refuses everything, and halving once a
                // round trip would send it thousands more on the way down.
                if s.refused >= 2 * self.max as u32 && s.limit > 1.0 {
                    s.limit = 1.0;
                    s.last_decrease = Some(now);
                    s.unavailable = 0;
                    Signal::Neutral
                } else if s.unavailable >= UNAVAILABLE_RUN {
                    s.unavailable = 0;
                    Signal::Overloaded
                } else {
                    Signal::Neutral
                }
            }
            Signal::Healthy(_) => {
                s.unavailable = 0;
                s.refused = 0;
                s.pause = Duration::ZERO;
                s.next_at = None;
                signal
            }
            other => other,
        };
        match signal {
            Signal::Overloaded if s.limit <= 1.0 => {
                s.pause = (s.pause * 2).clamp(FLOOR_PAUSE_FIRST, FLOOR_PAUSE_MOST);
            }
            Signal::Overloaded => {
                let rtt = s.baseline.unwrap_or_default();
                if may_decrease(&s, rtt) {
                    s.limit = (s.limit / 2.0).max(1.0);
                    s.last_decrease = Some(now);
                }
            }
            Signal::Healthy(latency) => {
                if now.duration_since(s.baseline_since) > BASELINE_WINDOW {
                    s.baseline = None;
                    s.baseline_since = now;
                }
                let baseline = *s.baseline.get_or_insert(latency);
                if latency < baseline {
                    s.baseline = Some(latency);
                }
                let rising = latency > LATENCY_FLOOR
                    && latency.as_secs_f64() > baseline.as_secs_f64() * LATENCY_RISE;
                if rising {
                    if may_decrease(&s, latency) {
                        s.limit = (s.limit * 0.9).max(1.0);
                        s.last_decrease = Some(now);
                    }
                } else {
                    s.limit = (s.limit + 1.0 / s.limit).min(max);
                }
            }
            Signal::Neutral | Signal::Unavailable => {}
        }
        drop(s);
        self.released.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn halves_on_overload_and_climbs_back() {
        let limiter = Limiter::new(16);
        assert_eq!(limiter.limit(), 16);
        limiter.observe(Signal::Overloaded);
        assert_eq!(limiter.limit(), 8);
        // A burst from the same overload counts once.
        limiter.observe(Signal::Overloaded);
        assert_eq!(limiter.limit(), 8);
        tokio::time::advance(Duration::from_millis(150)).await;
        limiter.observe(Signal::Overloaded);
        assert_eq!(limiter.limit(), 4);
        for _ in 0..200 {
            limiter.observe(Signal::Healthy(Duration::from_millis(2)));
        }
        assert_eq!(
            limiter.limit(),
            16,
            "healthy answers restore the limit, never past the maximum"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_run_of_503s_halves_the_limit_and_a_few_do_not() {
        let limiter = Limiter::new(16);
        for _ in 0..10 {
            for _ in 1..UNAVAILABLE_RUN {
                limiter.observe(Signal::Unavailable);
            }
            limiter.observe(Signal::Healthy(Duration::from_millis(2)));
        }
        assert_eq!(limiter.limit(), 16, "503s among successes are no run");
        for _ in 0..UNAVAILABLE_RUN {
            limiter.observe(Signal::Unavailable);
        }
        assert_eq!(limiter.limit(), 8);
        assert_eq!(
            Signal::from_class(Class::Transient, Some(503), Duration::ZERO),
            Signal::Unavailable
        );
    }

    #[tokio::test(start_paused = true)]
    async fn never_below_one() {
        let limiter = Limiter::new(4);
        for _ in 0..10 {
            limiter.observe(Signal::Overloaded);
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        assert_eq!(limiter.limit(), 1);
        assert!(
            limiter.try_acquire().is_some(),
            "one delivery may always go"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn rising_latency_trims_the_limit() {
        let limiter = Limiter::new(10);
        limiter.observe(Signal::Healthy(Duration::from_millis(30)));
        assert_eq!(limiter.limit(), 10);
        limiter.observe(Signal::Healthy(Duration::from_millis(300)));
        assert_eq!(limiter.limit(), 9);
        // Sub-floor latencies are noise, whatever the ratio.
        let fast = Limiter::new(10);
        fast.observe(Signal::Healthy(Duration::from_micros(100)));
        fast.observe(Signal::Healthy(Duration::from_millis(5)));
        assert_eq!(fast.limit(), 10);
    }

    #[tokio::test(start_paused = true)]
    async fn slots_wait_for_the_limit() {
        let limiter = Limiter::new(2);
        let a = limiter.try_acquire().unwrap();
        let _b = limiter.try_acquire().unwrap();
        assert!(limiter.try_acquire().is_none());
        let waiter = tokio::spawn({
            let limiter = limiter.clone();
            async move { limiter.acquire().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(a);
        let _c = waiter.await.unwrap();
        assert!(limiter.try_acquire().is_none());
    }

    /// At the floor, an app that keeps refusing gets one delivery per
    /// pause, the pause doubling up to a second; one healthy answer ends it.
    #[tokio::test(start_paused = true)]
    async fn at_the_floor_overloads_space_deliveries_out() {
        let limiter = Limiter::new(2);
        limiter.observe(Signal::Overloaded);
        assert_eq!(limiter.limit(), 1);
        assert_eq!(limiter.pause(), Duration::ZERO, "a halving is no pause");
        for expected in [10, 20, 40, 80, 160, 320, 640, 1000, 1000] {
            for _ in 0..UNAVAILABLE_RUN {
                limiter.observe(Signal::Unavailable);
            }
            assert_eq!(limiter.pause(), Duration::from_millis(expected));
        }
        let start = Instant::now();
        for _ in 0..3 {
            drop(limiter.acquire().await);
        }
        assert_eq!(start.elapsed(), Duration::from_secs(2), "one a second");
        limiter.observe(Signal::Healthy(Duration::from_millis(2)));
        assert_eq!(limiter.pause(), Duration::ZERO);
        let start = Instant::now();
        drop(limiter.acquire().await);
        drop(limiter.acquire().await);
        assert_eq!(start.elapsed(), Duration::ZERO, "no pause after a success");
    }

    /// An app that refuses two whole rounds at the maximum, with nothing
    /// healthy between, is at the floor at once; refusals among successes
    /// never get there.
    #[tokio::test(start_paused = true)]
    async fn refusing_everything_goes_to_the_floor_at_once() {
        let limiter = Limiter::new(16);
        for _ in 0..20 {
            limiter.observe(Signal::Unavailable);
            limiter.observe(Signal::Unavailable);
            limiter.observe(Signal::Healthy(Duration::from_millis(2)));
        }
        assert_eq!(limiter.limit(), 16);
        for _ in 0..31 {
            limiter.observe(Signal::Unavailable);
        }
        assert_eq!(limiter.limit(), 8, "one halving within the round trip");
        limiter.observe(Signal::Unavailable);
        assert_eq!(limiter.limit(), 1, "32 refusals in a row");
    }
}
