//! A map that remembers at most a fixed number of keys, forgetting the
//! oldest first: for what a source keeps about messages it may never see
//! again (an SQS message retried in place and then received by another
//! replica is never settled here, so nothing would remove its entry).

use std::borrow::Borrow;
use std::collections::VecDeque;
use std::hash::Hash;

/// Messages remembered per map of what a broker cannot carry (first offer,
/// free receives, due times, the last retry): past it the oldest is
/// forgotten, and such a message's first-attempt time falls back to when it
/// was stored, a free receive counts as an attempt, a FIFO retry's far due
/// time is lost. About 100 bytes each.
pub const REMEMBERED: usize = 100_000;

/// At most `cap` entries; inserting a new key at the cap forgets the key
/// inserted longest ago. The order queue holds one slot per insertion and
/// is kept at most twice the cap by compaction, so the whole is bounded.
#[derive(Debug)]
pub struct Recent<K, V> {
    cap: usize,
    /// foldhash: sources write these maps once or twice per message.
    entries: foldhash::HashMap<K, (u64, V)>,
    order: VecDeque<(K, u64)>,
    next: u64,
}

impl<K: Eq + Hash + Clone, V> Recent<K, V> {
    pub fn new(cap: usize) -> Self {
        Self {
            cap: cap.max(1),
            entries: foldhash::HashMap::default(),
            order: VecDeque::new(),
            next: 0,
        }
    }

    pub fn get<Q: Eq + Hash + ?Sized>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        self.entries.get(key).map(|(_, v)| v)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn remove<Q: Eq + Hash + ?Sized>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        self.entries.remove(key).map(|(_, v)| v)
    }

    pub fn insert(&mut self, key: K, value: V) {
        if let Some(slot) = self.entries.get_mut(&key) {
            slot.1 = value;
            return;
        }
        while self.entries.len() >= self.cap {
            let Some((oldest, generation)) = self.order.pop_front() else {
                break;
            };
            if self
                .entries
                .get(&oldest)
                .is_some_and(|(g, _)| *g == generation)
            {
                self.entries.remove(&oldest);
            }
        }
        self.next += 1;
        self.order.push_back((key.clone(), self.next));
        self.entries.insert(key, (self.next, value));
        // Removed keys leave their slot in the queue: drop those once the
        // queue is twice the map.
        if self.order.len() > 2 * self.cap {
            let entries = &self.entries;
            self.order
                .retain(|(k, g)| entries.get(k).is_some_and(|(eg, _)| eg == g));
        }
    }

    /// The value of `key`, made with `make` when it has none.
    pub fn get_or_insert_with(&mut self, key: K, make: impl FnOnce() -> V) -> &mut V {
        if !self.entries.contains_key(&key) {
            self.insert(key.clone(), make());
        }
        &mut self.entries.get_mut(&key).expect("just inserted").1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_forgets_the_oldest_at_its_cap_and_stays_bounded() {
        let mut recent = Recent::new(3);
        for i in 0..3 {
            recent.insert(i, i * 10);
        }
        recent.insert(3, 30);
        assert_eq!(recent.len(), 3);
        assert_eq!(recent.get(&0), None, "the oldest is forgotten");
        assert_eq!(recent.get(&3), Some(&30));
        *recent.get_or_insert_with(1, || 0) += 1;
        assert_eq!(recent.get(&1), Some(&11));
        assert_eq!(recent.remove(&2), Some(20));
        for i in 100..10_000 {
            recent.insert(i, i);
            if i % 2 == 0 {
                recent.remove(&i);
            }
        }
        assert!(recent.len() <= 3);
        assert!(recent.order.len() <= 6, "{}", recent.order.len());
    }
}
