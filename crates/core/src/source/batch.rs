//! Pipelined settlement: settlements from many concurrent deliveries go to
//! the broker in one round trip (one per batch of deliveries ready to
//! settle, not one per delivery), and each caller still learns its own
//! result. They are gathered in a shared list with one answer per round: a
//! channel send and a oneshot per settlement cost about as much as the rest
//! of the ack (BENCHMARKS.md, the profile).

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use tokio::sync::Notify;

use super::SourceError;

pub struct Batcher<T> {
    shared: Arc<Shared<T>>,
}

struct Shared<T> {
    rounds: Mutex<Rounds<T>>,
    /// Wakes the writer when a round gets its first settlement, or on close.
    work: Notify,
    max_batch: usize,
    linger: Option<Linger>,
    /// Wakes a lingering writer when its round reaches `linger.fill`.
    filled: Notify,
}

/// How long a round may wait for more settlements before it is written:
/// until it holds `fill` or `most` has passed since its first. For a
/// broker whose every call costs the server more than its ids do.
#[derive(Debug, Clone, Copy)]
pub struct Linger {
    pub fill: usize,
    pub most: std::time::Duration,
}

struct Rounds<T> {
    /// Rounds that filled up, oldest first, ahead of the one filling.
    full: VecDeque<Round<T>>,
    filling: Round<T>,
    /// The batcher was dropped, or its writer stopped.
    closed: bool,
}

/// Settlements written in one command, and the answer they share.
struct Round<T> {
    items: Vec<T>,
    answer: Arc<Answer>,
}

impl<T> Default for Round<T> {
    fn default() -> Self {
        Self {
            items: Vec::new(),
            answer: Arc::default(),
        }
    }
}

#[derive(Default)]
struct Answer {
    result: OnceLock<Result<(), SourceError>>,
    ready: Notify,
}

impl Answer {
    fn give(&self, result: Result<(), SourceError>) {
        let _ = self.result.set(result);
        self.ready.notify_waiters();
    }

    async fn wait(&self) -> Result<(), SourceError> {
        loop {
            // Registered before the answer is looked at, so an answer given
            // in between still wakes this waiter.
            let ready = self.ready.notified();
            let mut ready = std::pin::pin!(ready);
            ready.as_mut().enable();
            if let Some(result) = self.result.get() {
                return result.clone();
            }
            ready.await;
        }
    }
}

/// A round's answer while its write is under way: should the write never
/// end (its task panicked or was dropped), the round learns so.
struct Owed(Arc<Answer>);

impl Drop for Owed {
    fn drop(&mut self) {
        if self.0.result.get().is_none() {
            self.0.give(Err(stopped()));
        }
    }
}

fn stopped() -> SourceError {
    SourceError::broker("the settlement writer has stopped")
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, Rounds<T>> {
        self.rounds.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits, up to `linger.most`, for the round filling to hold
    /// `linger.fill`, unless a round is already full or the batcher closed.
    async fn linger(&self, linger: Linger) {
        let until = tokio::time::Instant::now() + linger.most;
        loop {
            let filled = self.filled.notified();
            let mut filled = std::pin::pin!(filled);
            filled.as_mut().enable();
            {
                let rounds = self.lock();
                if rounds.closed
                    || !rounds.full.is_empty()
                    || rounds.filling.items.len() >= linger.fill
                {
                    return;
                }
            }
            if tokio::time::timeout_at(until, filled).await.is_err() {
                return;
            }
        }
    }

    /// The next round to write, if any.
    fn next_round(&self) -> Option<Round<T>> {
        let mut rounds = self.lock();
        match rounds.full.pop_front() {
            Some(round) => Some(round),
            None if rounds.filling.items.is_empty() => None,
            None => Some(std::mem::take(&mut rounds.filling)),
        }
    }
}

/// Held by the writer task: when it ends, however it ends, every waiting
/// settlement learns that it was not written.
struct Writer<T>(Arc<Shared<T>>);

impl<T> Drop for Writer<T> {
    fn drop(&mut self) {
        let mut rounds = self.0.lock();
        rounds.closed = true;
        let filling = std::mem::take(&mut rounds.filling);
        for round in rounds.full.drain(..).chain([filling]) {
            round.answer.give(Err(stopped()));
        }
    }
}

impl<T: Send + 'static> Batcher<T> {
    pub fn spawn<F, Fut>(max_batch: usize, flush: F) -> Self
    where
        F: Fn(Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), SourceError>> + Send,
    {
        Self::spawn_lingering(max_batch, None, flush)
    }

    /// [`Batcher::spawn`], a round waiting as `linger` says before it is
    /// written.
    pub fn spawn_lingering<F, Fut>(max_batch: usize, linger: Option<Linger>, flush: F) -> Self
    where
        F: Fn(Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), SourceError>> + Send,
    {
        let max_batch = max_batch.max(1);
        let shared = Arc::new(Shared {
            rounds: Mutex::new(Rounds {
                full: VecDeque::new(),
                filling: Round::default(),
                closed: false,
            }),
            work: Notify::new(),
            max_batch,
            linger: linger.map(|l| Linger {
                fill: l.fill.clamp(1, max_batch),
                ..l
            }),
            filled: Notify::new(),
        });
        let writer = Writer(shared.clone());
        tokio::spawn(async move {
            let shared = &writer.0;
            loop {
                shared.work.notified().await;
                // The first settlement woke this task ahead of the other
                // deliveries that are ready to settle (tokio runs a task
                // woken by another next): let them run first, so the round
                // trip carries all of them, not one each.
                tokio::task::yield_now().await;
                if let Some(linger) = shared.linger {
                    shared.linger(linger).await;
                }
                while let Some(round) = shared.next_round() {
                    let answer = Owed(round.answer);
                    answer.0.give(flush(round.items).await);
                }
                if shared.lock().closed {
                    return;
                }
            }
        });
        Self { shared }
    }

    pub async fn submit(&self, item: T) -> Result<(), SourceError> {
        let answer = {
            let mut rounds = self.shared.lock();
            if rounds.closed {
                return Err(stopped());
            }
            if rounds.filling.items.len() >= self.shared.max_batch {
                let full = std::mem::take(&mut rounds.filling);
                rounds.full.push_back(full);
            }
            rounds.filling.items.push(item);
            if rounds.filling.items.len() == 1 {
                self.shared.work.notify_one();
            }
            if self
                .shared
                .linger
                .is_some_and(|l| rounds.filling.items.len() == l.fill)
            {
                self.shared.filled.notify_one();
            }
            rounds.filling.answer.clone()
        };
        answer.wait().await
    }
}

impl<T> Drop for Batcher<T> {
    /// The writer writes what was submitted, then stops.
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.work.notify_one();
        self.shared.filled.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Settlements submitted together go in one write, split at the
    /// largest batch; each caller gets its own round's result.
    #[tokio::test]
    async fn settlements_ready_together_share_one_write_and_its_result() {
        let writes = Arc::new(Mutex::new(Vec::new()));
        let seen = writes.clone();
        let batcher = Batcher::spawn(3, move |ids: Vec<u32>| {
            let seen = seen.clone();
            async move {
                let refused = ids.contains(&4);
                seen.lock().unwrap().push(ids);
                if refused {
                    Err(SourceError::broker("refused"))
                } else {
                    Ok(())
                }
            }
        });
        let results = futures::future::join_all((1..=5).map(|id| batcher.submit(id))).await;
        assert_eq!(*writes.lock().unwrap(), [vec![1, 2, 3], vec![4, 5]]);
        assert!(results[..3].iter().all(Result::is_ok), "{results:?}");
        assert!(results[3..].iter().all(Result::is_err), "{results:?}");
    }

    /// A writer that stops (its task panicked) answers every settlement
    /// waiting for it, and later ones at once: none waits forever.
    #[tokio::test]
    async fn a_stopped_writer_answers_every_waiting_settlement() {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let batcher = Batcher::spawn(8, move |_: Vec<u32>| {
            counted.fetch_add(1, Ordering::SeqCst);
            async { panic!("the write panicked") }
        });
        let results = futures::future::join_all((1..=3).map(|id| batcher.submit(id))).await;
        assert!(results.iter().all(Result::is_err), "{results:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(batcher.submit(4).await.is_err());
    }

    /// A lingering round is written once it holds `fill`, without waiting
    /// out `most`; a round that stays short is written after `most`.
    #[tokio::test(start_paused = true)]
    async fn a_lingering_round_waits_for_its_fill_or_its_time() {
        let writes = Arc::new(Mutex::new(Vec::new()));
        let seen = writes.clone();
        let linger = Linger {
            fill: 3,
            most: std::time::Duration::from_millis(50),
        };
        let batcher = Arc::new(Batcher::spawn_lingering(
            8,
            Some(linger),
            move |ids: Vec<u32>| {
                seen.lock()
                    .unwrap()
                    .push((tokio::time::Instant::now(), ids));
                async { Ok(()) }
            },
        ));
        let start = tokio::time::Instant::now();
        let submit = |id| {
            let batcher = batcher.clone();
            tokio::spawn(async move { batcher.submit(id).await })
        };
        let first = [submit(1), submit(2)];
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        let third = submit(3);
        for done in first.into_iter().chain([third]) {
            done.await.unwrap().unwrap();
        }
        let fourth = submit(4);
        fourth.await.unwrap().unwrap();
        let writes = writes.lock().unwrap();
        let at: Vec<_> = writes.iter().map(|(at, _)| *at - start).collect();
        let ids: Vec<_> = writes.iter().map(|(_, ids)| ids.clone()).collect();
        assert_eq!(ids, [vec![1, 2, 3], vec![4]]);
        let ms = std::time::Duration::from_millis;
        assert_eq!(
            at,
            [ms(10), ms(60)],
            "the fill at 10 ms; the short one after 50"
        );
    }
}
