//! Deliveries the app is working on, and the keep-alive that keeps them
//! claimed by this consumer: a delivery that outlasts the visibility timeout
//! (a slow app, a timeout raised live) must not be handed to another
//! consumer while it runs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::model::Delivery;

#[derive(Default)]
pub struct InFlight {
    next: AtomicU64,
    /// Shared with the delivery task, not copied: a copy of every delivery
    /// (its id, headers and fields) cost allocations per message. Hashed
    /// with foldhash: std's SipHash cost more than the map's own work.
    deliveries: Mutex<foldhash::HashMap<u64, Arc<Delivery>>>,
}

/// A delivery registered in flight; dropping it takes it out.
pub struct Ticket {
    registry: Arc<InFlight>,
    id: u64,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.id);
    }
}

impl InFlight {
    fn lock(&self) -> std::sync::MutexGuard<'_, foldhash::HashMap<u64, Arc<Delivery>>> {
        self.deliveries.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn register(self: &Arc<Self>, delivery: &Arc<Delivery>) -> Ticket {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(id, Arc::clone(delivery));
        Ticket {
            registry: self.clone(),
            id,
        }
    }

    /// What is in flight now.
    pub fn snapshot(&self) -> Vec<Delivery> {
        self.lock().values().map(|d| Delivery::clone(d)).collect()
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How often deliveries in flight are kept claimed: three times per
/// visibility timeout, so one failed keep-alive still leaves time for the
/// next.
pub fn keep_alive_interval(visibility_timeout: Duration) -> Duration {
    (visibility_timeout / 3).max(Duration::from_millis(100))
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn delivery(id: &str) -> Delivery {
        Delivery::from_fields(
            id,
            vec![(Bytes::from_static(b"payload"), Bytes::from_static(b"{}"))],
            0,
            id.to_string(),
            None,
        )
    }

    #[test]
    fn a_ticket_holds_its_delivery_in_flight() {
        let registry = Arc::new(InFlight::default());
        let a = registry.register(&Arc::new(delivery("a")));
        let b = registry.register(&Arc::new(delivery("b")));
        let mut ids: Vec<String> = registry.snapshot().into_iter().map(|d| d.receipt).collect();
        ids.sort();
        assert_eq!(ids, ["a", "b"]);
        drop(a);
        assert_eq!(registry.snapshot()[0].receipt, "b");
        drop(b);
        assert!(registry.is_empty());
    }

    #[test]
    fn the_interval_is_a_third_of_the_visibility() {
        assert_eq!(
            keep_alive_interval(Duration::from_secs(60)),
            Duration::from_secs(20)
        );
        assert_eq!(
            keep_alive_interval(Duration::ZERO),
            Duration::from_millis(100)
        );
    }
}
