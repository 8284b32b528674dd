//! The dispatcher's steps, one by one: reading (failures and readiness),
//! judging and settling (the verdict table with the gate as an input), the
//! Retry-After hold, the keep-alive of deliveries in flight. Time is paused
//! where only timers are involved. Deliveries to an app go to a real HTTP
//! app on loopback, in real time: a paused clock would jump past the app's
//! answer. The source is a small in-memory one: this tests the dispatcher,
//! not a broker (the conformance suite does that).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

mod delivering;
mod steps;

use super::*;
use crate::model::{Failure, Outcome};
use crate::policy::{GateState, Jitter, Policy};
use crate::source::{Capabilities, Consumer, Settlement, SourceError};

// === An in-memory source ===

#[derive(Default)]
struct Memory {
    ready: VecDeque<Delivery>,
    scheduled: Vec<(SystemTime, Delivery)>,
    acked: Vec<String>,
    /// (message id, next attempt, due)
    retried: Vec<(String, u32, SystemTime)>,
    dead: Vec<(String, Failure)>,
    kept_alive: Vec<Vec<String>>,
}

#[derive(Default)]
struct MemorySource {
    state: Mutex<Memory>,
    fail_reads: AtomicBool,
    /// What `longest_claim` says, as Pub/Sub's 600 s.
    longest_claim: Option<Duration>,
    /// A retry copy or a whole dead letter of a body longer than this is
    /// refused as too large, as a broker's limit on one message would.
    refuse_over: Option<usize>,
    /// An empty receive waits this long unless interrupted, as Redis's
    /// blocking read does; else 20 ms.
    long_wait: Option<Duration>,
    interrupted: tokio::sync::Notify,
    /// Each ack takes a permit first, so a test can hold the acks back, as
    /// a broker slow to answer them would.
    ack_gate: Option<tokio::sync::Semaphore>,
}

fn delivery(id: &str, body: &str) -> Delivery {
    Delivery::from_fields(
        id,
        vec![(
            Bytes::from_static(b"payload"),
            Bytes::from(body.to_string()),
        )],
        0,
        id.to_string(),
        // The memory queue's own time for the entry, as a broker's.
        Some(SystemTime::now()),
    )
}

impl MemorySource {
    fn with(bodies: &[&str]) -> Arc<Self> {
        let source = Self::default();
        source.state().ready = bodies
            .iter()
            .enumerate()
            .map(|(i, body)| delivery(&format!("{i}-0"), body))
            .collect();
        Arc::new(source)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Memory> {
        self.state.lock().unwrap()
    }
}

#[async_trait]
impl Consumer for MemorySource {
    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        if self.fail_reads.load(Ordering::SeqCst) {
            return Err(SourceError::unavailable("connection refused"));
        }
        let out: Vec<Delivery> = {
            let mut s = self.state();
            let now = SystemTime::now();
            let (due, later) = std::mem::take(&mut s.scheduled)
                .into_iter()
                .partition(|(at, _)| *at <= now);
            s.scheduled = later;
            s.ready.extend(due.into_iter().map(|(_, d)| d));
            let n = max.min(s.ready.len());
            s.ready.drain(..n).collect()
        };
        if out.is_empty() {
            match self.long_wait {
                Some(wait) => {
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = self.interrupted.notified() => {}
                    }
                }
                None => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        Ok(out)
    }

    async fn interrupt(&self) {
        self.interrupted.notify_one();
    }

    async fn settle(
        &self,
        delivery: &Delivery,
        settlement: Settlement<'_>,
    ) -> Result<(), SourceError> {
        match settlement {
            Settlement::Ack => {
                // A stand-in for a bug met on one message (at 21da363: http's
                // HeaderMap on 24,600 headers), where the dispatcher can see it.
                if delivery.message.body.starts_with(b"panic") {
                    panic!("a test panic on {}", delivery.message.id);
                }
                if let Some(gate) = &self.ack_gate {
                    gate.acquire().await.unwrap().forget();
                }
                self.state().acked.push(delivery.message.id.clone());
                Ok(())
            }
            Settlement::Retry { .. } | Settlement::DeadLetter(Failure { cut: None, .. })
                if self
                    .refuse_over
                    .is_some_and(|limit| delivery.message.body.len() > limit) =>
            {
                Err(SourceError::too_large("over the test's limit"))
            }
            Settlement::Retry {
                next_attempt,
                first_attempt_at,
                at,
            } => {
                let id = delivery.message.id.clone();
                let again = Delivery::from_fields(
                    &id,
                    delivery.fields_for_retry(next_attempt, first_attempt_at),
                    0,
                    id.clone(),
                    // A new entry's time; the copy carries the original's.
                    Some(SystemTime::now()),
                );
                let mut s = self.state();
                s.retried.push((id, next_attempt, at));
                s.scheduled.push((at, again));
                Ok(())
            }
            Settlement::DeadLetter(failure) => {
                self.state()
                    .dead
                    .push((delivery.message.id.clone(), failure.clone()));
                Ok(())
            }
        }
    }

    fn longest_claim(&self) -> Option<Duration> {
        self.longest_claim
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }

    async fn keep_alive(&self, in_flight: &[Delivery]) -> Result<(), SourceError> {
        let mut ids: Vec<String> = in_flight.iter().map(|d| d.message.id.clone()).collect();
        ids.sort();
        self.state().kept_alive.push(ids);
        Ok(())
    }
}

// === Fixtures ===

fn fast_policy(max_attempts: u32) -> Policy {
    let mut policy = Policy::test().max_attempts(max_attempts).backoff_of(
        Duration::from_millis(10),
        Duration::from_millis(50),
        2.0,
        Jitter::None,
    );
    policy.timeout = Duration::from_secs(5);
    policy
}

fn dispatcher(source: Arc<MemorySource>, app: SocketAddr, policy: Policy) -> Dispatcher {
    let mut options = SourceOptions::new("orders");
    options.concurrency = 4;
    options.max_body = 1 << 20;
    options.live.visibility_timeout = Duration::from_secs(60);
    Dispatcher::new(
        source,
        LivePolicy::fixed(policy),
        &options,
        &AppSettings::new(format!("http://{app}/").parse().unwrap()),
        &DeliverySettings {
            drain_timeout: Duration::from_secs(5),
            dedup_window: None,
            batch: None,
        },
        Arc::new(Metrics::new()),
        Arc::new(telemetry::Health::default()),
    )
}

/// An address nothing listens on.
async fn closed_port() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap()
}

fn answered(status: u16, retry_after: Option<u64>) -> Outcome {
    Outcome::Answered {
        status,
        retry_after: retry_after.map(Duration::from_secs),
        retry_after_invalid: false,
        excerpt: Bytes::new(),
        directives: Default::default(),
    }
}

fn deliveries_counted(shared: &Shared, result: &str) -> u64 {
    shared.m.delivery(result).map_or(0, |c| c.get())
}
