//! The inspector on demand: made when a depth read, a dead-letter browse or
//! a topic check asks for it, and closed once none has for
//! [`INSPECTOR_IDLE`]. At rest only depth reads use it, about once a
//! minute; open, its client's threads woke about six times a second, a
//! quarter of an idle courier's wake-ups on Kafka (issue 28).

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::time::Instant;

use super::connection::{Inspector, inspector};
use courier_core::source::{SourceError, SourceOptions};

/// How long an inspector nobody uses stays open: longer than the gaps
/// between the calls of one depth read or browse, shorter than the quiet
/// pace of depth reads.
pub(super) const INSPECTOR_IDLE: Duration = Duration::from_secs(10);

pub(super) struct Inspectors {
    bootstrap: String,
    options: SourceOptions,
    idle: Duration,
    open: Mutex<Open>,
}

#[derive(Default)]
struct Open {
    inspector: Option<Arc<Inspector>>,
    used_at: Option<Instant>,
}

impl Inspectors {
    /// Checks the settings by making the first inspector, which the caller
    /// is about to use.
    pub(super) fn new(bootstrap: &str, options: &SourceOptions) -> Result<Arc<Self>, SourceError> {
        Self::closing_after(bootstrap, options, INSPECTOR_IDLE)
    }

    pub(super) fn closing_after(
        bootstrap: &str,
        options: &SourceOptions,
        idle: Duration,
    ) -> Result<Arc<Self>, SourceError> {
        let inspectors = Arc::new(Self {
            bootstrap: bootstrap.to_string(),
            options: options.clone(),
            idle,
            open: Mutex::default(),
        });
        inspectors.get()?;
        Ok(inspectors)
    }

    /// The open inspector, or a new one. Outside a Tokio runtime (a test's
    /// plain thread) it is never closed.
    pub(super) fn get(self: &Arc<Self>) -> Result<Arc<Inspector>, SourceError> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.used_at = Some(Instant::now());
        if let Some(inspector) = &open.inspector {
            return Ok(inspector.clone());
        }
        let made = Arc::new(inspector(&self.bootstrap, &self.options)?);
        open.inspector = Some(made.clone());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(close_when_idle(Arc::downgrade(self)));
        }
        Ok(made)
    }

    #[cfg(test)]
    fn is_open(&self) -> bool {
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .inspector
            .is_some()
    }
}

/// Closes the inspector once it went unused for the idle time and no call
/// holds it; ends with it, or with the source.
async fn close_when_idle(inspectors: Weak<Inspectors>) {
    loop {
        let wake = {
            let Some(inspectors) = inspectors.upgrade() else {
                return;
            };
            let mut open = inspectors.open.lock().unwrap_or_else(|e| e.into_inner());
            let due = open
                .used_at
                .map_or_else(Instant::now, |at| at + inspectors.idle);
            let unused = open
                .inspector
                .as_ref()
                .is_some_and(|i| Arc::strong_count(i) == 1);
            if due <= Instant::now() && unused {
                let closed = open.inspector.take();
                drop(open);
                // Destroying a client waits for its threads to end.
                tokio::task::spawn_blocking(move || drop(closed));
                return;
            }
            // In use past its idle time: looked at again a little later.
            due.max(Instant::now() + inspectors.idle / 4)
        };
        tokio::time::sleep_until(wake).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connection::partitions;
    use rdkafka::mocking::MockCluster;

    /// Open while used, closed once idle (not while a call holds it), and
    /// made again by the next use, which works.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_inspector_is_closed_and_the_next_use_opens_it_again() {
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic("looked-at", 2, 1).unwrap();
        let options = SourceOptions::new("looked-at");
        let idle = Duration::from_millis(300);
        let inspectors =
            Inspectors::closing_after(&cluster.bootstrap_servers(), &options, idle).unwrap();
        assert!(inspectors.is_open(), "made at once, to check the settings");
        let held = inspectors.get().unwrap();
        tokio::time::sleep(idle * 3).await;
        assert!(inspectors.is_open(), "closed while a call held it");
        drop(held);
        let deadline = Instant::now() + Duration::from_secs(10);
        while inspectors.is_open() {
            assert!(Instant::now() < deadline, "still open after 10 s idle");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let inspector = inspectors.get().unwrap();
        assert!(inspectors.is_open());
        let found = tokio::task::spawn_blocking(move || partitions(&inspector, "looked-at"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(found.map(|p| p.len()), Some(2));
    }
}
