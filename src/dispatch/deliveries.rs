//! The deliveries in flight, run beside the loop that reads and launches
//! them. On one thread (the default) the loop's own task polls them: a task
//! per delivery cost a spawn, a task cell and its bookkeeping on every
//! message (BENCHMARKS.md, the profile), and on one thread a task of its
//! own runs no sooner. On more threads each delivery is a task, so they
//! spread over the threads. Either way the loop never waits for a delivery,
//! and a delivery that panics ends alone: its message stays with the
//! broker, unsettled, and is handed out again.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::future::CatchUnwind;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::task::JoinSet;

/// One delivery, start to end; boxed, so it is moved as a pointer.
pub(super) type Delivering = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

pub(super) enum Deliveries {
    /// Polled by the dispatcher's task whenever it awaits something.
    Polled(FuturesUnordered<CatchUnwind<AssertUnwindSafe<Delivering>>>),
    /// A task each, on a runtime with more than one thread.
    Spawned(JoinSet<()>),
}

impl Deliveries {
    /// The way that suits the runtime this runs on.
    pub(super) fn new() -> Self {
        match Handle::current().runtime_flavor() {
            RuntimeFlavor::CurrentThread => Self::Polled(FuturesUnordered::new()),
            _ => Self::Spawned(JoinSet::new()),
        }
    }

    pub(super) fn launch(&mut self, delivery: Delivering) {
        match self {
            Self::Polled(set) => set.push(AssertUnwindSafe(delivery).catch_unwind()),
            Self::Spawned(set) => {
                set.spawn(delivery);
            }
        }
    }

    /// Deliveries launched and not yet seen to end.
    pub(super) fn len(&self) -> usize {
        match self {
            Self::Polled(set) => set.len(),
            Self::Spawned(set) => set.len(),
        }
    }

    /// Runs `work` to its end while the deliveries go on beside it.
    pub(super) async fn alongside<F: Future>(&mut self, work: F) -> F::Output {
        let mut work = std::pin::pin!(work);
        std::future::poll_fn(|cx| {
            self.progress(cx);
            work.as_mut().poll(cx)
        })
        .await
    }

    /// Lets every delivery that can go on go on, and forgets those that
    /// ended.
    pub(super) async fn catch_up(&mut self) {
        self.alongside(std::future::ready(())).await;
    }

    /// Waits until every delivery has ended.
    pub(super) async fn finish(&mut self) {
        match self {
            Self::Polled(set) => {
                while let Some(ended) = set.next().await {
                    if ended.is_err() {
                        panicked();
                    }
                }
            }
            Self::Spawned(set) => {
                while let Some(ended) = set.join_next().await {
                    if ended.is_err_and(|e| e.is_panic()) {
                        panicked();
                    }
                }
            }
        }
    }

    /// Ends the deliveries left without settling them; the broker hands
    /// their messages out again.
    pub(super) async fn abandon(&mut self) {
        match self {
            Self::Polled(set) => set.clear(),
            Self::Spawned(set) => {
                set.abort_all();
                while set.join_next().await.is_some() {}
            }
        }
    }

    fn progress(&mut self, cx: &mut Context<'_>) {
        match self {
            Self::Polled(set) => {
                while let Poll::Ready(Some(ended)) = set.poll_next_unpin(cx) {
                    if ended.is_err() {
                        panicked();
                    }
                }
            }
            Self::Spawned(set) => {
                while let Some(ended) = set.try_join_next() {
                    if ended.is_err_and(|e| e.is_panic()) {
                        panicked();
                    }
                }
            }
        }
    }
}

fn panicked() {
    tracing::error!(
        "a delivery panicked; its message stays with the broker, unsettled, and is handed out again"
    );
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::oneshot;

    use super::*;

    /// The loop goes on beside a delivery that never ends and one that
    /// panics, and another delivery still ends; on either runtime.
    async fn one_delivery_ends_whatever_the_others_do(deliveries: &mut Deliveries) {
        let (done, ended) = oneshot::channel();
        deliveries.launch(Box::pin(std::future::pending()));
        deliveries.launch(Box::pin(async { panic!("a delivery that panics") }));
        deliveries.launch(Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            done.send(()).unwrap();
        }));
        deliveries.alongside(ended).await.unwrap();
        // A task on another thread is seen to end once it has.
        while deliveries.len() > 1 {
            deliveries
                .alongside(tokio::time::sleep(Duration::from_millis(1)))
                .await;
        }
        deliveries.catch_up().await;
        assert_eq!(deliveries.len(), 1, "only the delivery that never ends");
        deliveries.abandon().await;
        assert_eq!(deliveries.len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn on_one_thread_the_loop_polls_them() {
        let mut deliveries = Deliveries::new();
        assert!(matches!(deliveries, Deliveries::Polled(_)));
        one_delivery_ends_whatever_the_others_do(&mut deliveries).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on_more_threads_each_is_a_task() {
        let mut deliveries = Deliveries::new();
        assert!(matches!(deliveries, Deliveries::Spawned(_)));
        one_delivery_ends_whatever_the_others_do(&mut deliveries).await;
    }
}
