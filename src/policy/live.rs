//! The policy in force, shared by every delivery. A change is picked up by
//! the very next decision: each delivery reads the current policy once.

use std::sync::Arc;

use tokio::sync::watch;

use super::Policy;

/// Read side: cheap to clone, one per task.
#[derive(Clone)]
pub struct LivePolicy {
    rx: watch::Receiver<Arc<Policy>>,
}

/// Write side, held by whatever watches the policy's source.
pub struct PolicyUpdate {
    tx: watch::Sender<Arc<Policy>>,
    admit: Option<Admit>,
}

/// Runs before a parsed policy is put in force (the sidecar asks the source
/// whether it can follow it, and hands it the new settings); an error
/// refuses the change with that text, and the last good policy stays.
pub type Admit = Box<dyn Fn(&Policy) -> Result<(), String> + Send + Sync>;

impl LivePolicy {
    pub fn new(initial: Policy) -> (Self, PolicyUpdate) {
        let (tx, rx) = watch::channel(Arc::new(initial));
        (Self { rx }, PolicyUpdate { tx, admit: None })
    }

    /// A policy that never changes.
    pub fn fixed(policy: Policy) -> Self {
        Self::new(policy).0
    }

    pub fn current(&self) -> Arc<Policy> {
        self.rx.borrow().clone()
    }

    /// A reader whose [`LivePolicy::changed`] resolves on the next change
    /// from now on, not on one applied before.
    pub fn watch(&self) -> Self {
        let mut rx = self.rx.clone();
        rx.mark_unchanged();
        Self { rx }
    }

    /// Resolves when a new policy has been applied.
    pub async fn changed(&mut self) -> bool {
        self.rx.changed().await.is_ok()
    }
}

impl PolicyUpdate {
    /// Every offered policy passes `admit` before it is put in force.
    pub fn admit_with(
        mut self,
        admit: impl Fn(&Policy) -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.admit = Some(Box::new(admit));
        self
    }

    /// Puts `policy` in force and returns it as applied.
    pub fn apply(&self, policy: Policy) -> Arc<Policy> {
        let policy = Arc::new(policy);
        self.tx.send_replace(policy.clone());
        policy
    }

    pub fn current(&self) -> Arc<Policy> {
        self.tx.borrow().clone()
    }

    /// The one path every policy source takes after parsing: a usable
    /// policy is put in force, a refused one leaves the last good policy.
    /// `generation` is the source's own (`metadata.generation` in the
    /// cluster); without one the policy in force's generation + 1 is used.
    pub fn offer(&self, parsed: Result<Policy, String>, generation: Option<i64>) -> Reload {
        match parsed {
            Ok(mut policy) => {
                policy.generation = generation.unwrap_or_else(|| self.current().generation + 1);
                if let Some(Err(problem)) = self.admit.as_ref().map(|admit| admit(&policy)) {
                    return Reload::Rejected(problem);
                }
                Reload::Applied(self.apply(policy))
            }
            Err(problem) => Reload::Rejected(problem),
        }
    }
}

/// What a change offered by a policy source did.
#[derive(Debug, Clone)]
pub enum Reload {
    Applied(Arc<Policy>),
    /// The last good policy stays in force; the text says why.
    Rejected(String),
}
