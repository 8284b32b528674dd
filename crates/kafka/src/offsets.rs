//! One partition's settling state: which offsets are read and not yet
//! settled, how often each was handed out, and what the group may commit.
//!
//! Kafka keeps one number per partition and group, the committed offset:
//! everything below it is done. Deliveries of a partition run concurrently
//! and settle in any order, so the ledger commits the lowest offset still
//! open, and keeps what it knows above that in the commit's metadata: the
//! hand-outs of each open offset (Kafka has no delivery counter; this is
//! courier's, for the poison-pill rule) and the offsets already settled
//! (skipped when a restart reads them again). The metadata is text:
//! `1;h=12:1,13:2;d=14-20,22` (format 1, handed-out counts, settled ranges),
//! with `;c` at the end when a replica that stopped cleanly wrote it.
//!
//! A hand-out's count is committed without waiting for Kafka's answer,
//! except where a crash could hide a poison pill ([`Ledger::careful`]).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// What a commit's metadata may hold at most: Kafka's default
/// `offset.metadata.max.bytes` is 4096.
const METADATA_BYTES: usize = 4000;

/// The metadata's mark of a commit made by a clean stop: every hand-out is
/// counted in it, and nothing was handed out after it.
const CLEAN: &str = "c";

/// After taking over a partition whose last commit is not a clean stop's
/// (its reader crashed, was killed, or lost the partition to a rebalance),
/// every hand-out's count is committed, and Kafka's answer awaited, before
/// the app sees it, for this long. A message that crashed courier the
/// moment it was handed out is at the head of what is read again, so a
/// short window catches it: it is counted from the second crash on, and
/// dead-lettered after `max_deliveries` instead of crash-looping courier.
pub(super) const CAREFUL_FOR: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    /// Read (or known from the metadata) and not settled; handed out this
    /// many times in all.
    Open(u32),
    Done,
}

/// What to do with an offset just read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Read {
    /// Settled already (before a restart, or below the commit point).
    Skip,
    /// To be handed out; it was handed out this many times before.
    Fresh(u32),
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Ledger {
    /// Offsets at or above the commit point that the ledger knows of.
    entries: BTreeMap<i64, Entry>,
    /// The next offset to read: one past the highest read.
    next: i64,
    /// Until then hand-outs are committed before they are delivered: the
    /// partition's last commit was not a clean stop's ([`CAREFUL_FOR`]).
    careful_until: Option<Instant>,
    /// A commit of this ledger was awaited and taken. Until then the group
    /// may have nothing committed for the partition, and a hand-out whose
    /// unawaited commit a crash undid would leave nothing that says so.
    pub(super) synced: bool,
}

impl Ledger {
    /// The ledger of a partition whose group committed `offset` with
    /// `metadata` (`None`: nothing committed yet, reading starts at
    /// `first_read`).
    pub(super) fn resume(committed: Option<(i64, &str)>, first_read: i64) -> Self {
        let Some((offset, metadata)) = committed else {
            return Self {
                entries: BTreeMap::new(),
                next: first_read,
                careful_until: None,
                synced: false,
            };
        };
        let mut entries = decode(metadata);
        entries.retain(|o, _| *o >= offset);
        let clean = metadata.split(';').skip(1).any(|part| part == CLEAN);
        Self {
            entries,
            next: offset,
            careful_until: (!clean).then(|| Instant::now() + CAREFUL_FOR),
            synced: true,
        }
    }

    /// Whether a hand-out that makes `handed` hand-outs of one offset must
    /// be committed, and the commit awaited, before the app sees it: the
    /// offset was handed out before and never settled (a poison pill shows
    /// so), the partition was taken over from a reader that did not stop
    /// cleanly, within [`CAREFUL_FOR`], or nothing of it was committed yet.
    pub(super) fn careful(&self, handed: u32, now: Instant) -> bool {
        handed > 1 || !self.synced || self.careful_until.is_some_and(|t| now < t)
    }

    /// Registers an offset just read.
    pub(super) fn read(&mut self, offset: i64) -> Read {
        if offset < self.commit_point() {
            return Read::Skip;
        }
        self.next = self.next.max(offset + 1);
        match self.entries.get(&offset) {
            Some(Entry::Done) => Read::Skip,
            Some(Entry::Open(handed)) => Read::Fresh(*handed),
            None => {
                self.entries.insert(offset, Entry::Open(0));
                Read::Fresh(0)
            }
        }
    }

    /// One more hand-out of `offset`; returns how many there were in all.
    pub(super) fn hand_out(&mut self, offset: i64) -> u32 {
        let entry = self.entries.entry(offset).or_insert(Entry::Open(0));
        let handed = match *entry {
            Entry::Open(handed) => handed + 1,
            Entry::Done => 1,
        };
        *entry = Entry::Open(handed);
        handed
    }

    /// Takes back the last hand-out of `offset`: it was given back unseen,
    /// so it does not count.
    pub(super) fn give_back(&mut self, offset: i64) {
        if let Some(Entry::Open(handed)) = self.entries.get_mut(&offset) {
            *handed = handed.saturating_sub(1);
        }
    }

    /// `offset` is settled; returns whether the commit point moved.
    pub(super) fn settle(&mut self, offset: i64) -> bool {
        let before = self.commit_point();
        if offset < before {
            return false;
        }
        self.entries.insert(offset, Entry::Done);
        let point = self.commit_point();
        self.entries = self.entries.split_off(&point);
        point != before
    }

    /// How many offsets the ledger holds: those read and not settled, and
    /// those settled above the lowest open one.
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether `offset` is read and not settled.
    pub(super) fn is_open(&self, offset: i64) -> bool {
        offset < self.next && matches!(self.entries.get(&offset), Some(Entry::Open(_)))
    }

    /// The offset the group may commit: the lowest one read and not
    /// settled, else the next to read.
    pub(super) fn commit_point(&self) -> i64 {
        self.entries
            .range(..self.next)
            .find(|(_, e)| matches!(e, Entry::Open(_)))
            .map_or(self.next, |(o, _)| *o)
    }

    /// The commit's metadata: hand-out counts first, which a poison pill
    /// needs; settled ranges as far as they fit (losing one only means a
    /// redelivery after a crash). `clean`: the stop's commit, after which
    /// this process hands out nothing more.
    pub(super) fn metadata(&self, clean: bool) -> String {
        let point = self.commit_point();
        let handed: Vec<String> = self
            .entries
            .range(point..)
            .filter_map(|(o, e)| match e {
                Entry::Open(n) if *n > 0 => Some(format!("{o}:{n}")),
                _ => None,
            })
            .collect();
        // Kafka refuses a commit whose metadata is too long, and then no
        // commit goes through: counts beyond the room are left out (each
        // such offset can be handed out once more than the rule says).
        let mut out = String::from("1;h=");
        for (i, item) in handed.iter().enumerate() {
            if out.len() + item.len() + 1 > METADATA_BYTES / 2 {
                break;
            }
            if i > 0 {
                out.push(',');
            }
            out.push_str(item);
        }
        let mut ranges: Vec<(i64, i64)> = Vec::new();
        for (o, e) in self.entries.range(point..) {
            if *e != Entry::Done {
                continue;
            }
            match ranges.last_mut() {
                Some((_, end)) if *end + 1 == *o => *end = *o,
                _ => ranges.push((*o, *o)),
            }
        }
        out.push_str(";d=");
        let mut first = true;
        for (start, end) in ranges {
            let range = if start == end {
                start.to_string()
            } else {
                format!("{start}-{end}")
            };
            if out.len() + range.len() + 1 > METADATA_BYTES {
                break;
            }
            if !first {
                out.push(',');
            }
            first = false;
            out.push_str(&range);
        }
        if clean {
            out.push(';');
            out.push_str(CLEAN);
        }
        out
    }
}

/// The most offsets a commit's metadata may make the ledger hold: it is
/// read from the broker, where anyone with the group's rights can write
/// it, so it is not trusted to allocate without limit.
const DECODED_MAX: usize = 100_000;

/// What a committed offset's metadata says about the offsets at and above
/// it, as [`Ledger::metadata`] wrote it; anything else (another consumer's
/// metadata, a newer format) says nothing. At most [`DECODED_MAX`]
/// offsets: the rest is ignored (read again, handed out again).
fn decode(metadata: &str) -> BTreeMap<i64, Entry> {
    let mut entries = BTreeMap::new();
    let mut parts = metadata.split(';');
    if parts.next() != Some("1") {
        return entries;
    }
    for part in parts {
        if let Some(handed) = part.strip_prefix("h=") {
            for item in handed.split(',').filter(|i| !i.is_empty()) {
                let Some((o, n)) = item.split_once(':') else {
                    continue;
                };
                if entries.len() >= DECODED_MAX {
                    break;
                }
                if let (Ok(o), Ok(n)) = (o.parse::<i64>(), n.parse::<u32>()) {
                    entries.insert(o, Entry::Open(n));
                }
            }
        } else if let Some(done) = part.strip_prefix("d=") {
            for item in done.split(',').filter(|i| !i.is_empty()) {
                let (start, end) = item.split_once('-').unwrap_or((item, item));
                let (Ok(start), Ok(end)) = (start.parse::<i64>(), end.parse::<i64>()) else {
                    continue;
                };
                for o in start..=end {
                    if entries.len() >= DECODED_MAX {
                        return entries;
                    }
                    entries.insert(o, Entry::Done);
                }
            }
        }
    }
    entries
}

/// What the committed metadata says of the offsets in `from..to`: how many
/// are handed out and unsettled, and how many are settled; and the first
/// one that is neither (waiting), if any. For depth, read by any process.
pub(super) fn summary(metadata: &str, from: i64, to: i64) -> (u64, u64, Option<i64>) {
    let entries = decode(metadata);
    let (mut handed, mut done) = (0, 0);
    for (_, e) in entries.range(from..to) {
        match e {
            Entry::Open(n) if *n > 0 => handed += 1,
            Entry::Open(_) => {}
            Entry::Done => done += 1,
        }
    }
    let waiting = (from..to)
        .take(entries.len() + 1)
        .find(|o| !matches!(entries.get(o), Some(Entry::Done) | Some(Entry::Open(1..))));
    (handed, done, waiting)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found at 21da363: the hand-out list had no bound, so 1,000 open
    /// offsets made metadata Kafka refuses (over `offset.metadata.max.bytes`)
    /// and every commit failed; and hostile metadata of many large ranges
    /// could make the ledger allocate without end (each range was capped,
    /// their number was not).
    #[test]
    fn metadata_fits_and_hostile_metadata_is_bounded() {
        let mut ledger = Ledger::resume(None, 1_000_000_000);
        for o in 1_000_000_000..1_000_001_000 {
            ledger.read(o);
            ledger.hand_out(o);
        }
        let metadata = ledger.metadata(false);
        assert!(metadata.len() <= METADATA_BYTES, "{}", metadata.len());
        assert!(metadata.starts_with("1;h=1000000000:1,"), "{metadata}");
        let hostile: String = (0..400)
            .map(|i| format!("{}-{},", i * 1_000_000, i * 1_000_000 + 999_999))
            .collect();
        let entries = decode(&format!("1;h=;d={hostile}"));
        assert_eq!(entries.len(), DECODED_MAX);
        let handed: String = (0..200_000).map(|i| format!("{i}:1,")).collect();
        assert_eq!(decode(&format!("1;h={handed};d=")).len(), DECODED_MAX);
    }

    #[test]
    fn out_of_order_settles_commit_in_order() {
        let mut ledger = Ledger::resume(None, 10);
        for o in 10..14 {
            assert_eq!(ledger.read(o), Read::Fresh(0));
            assert_eq!(ledger.hand_out(o), 1);
        }
        assert_eq!(ledger.commit_point(), 10);
        assert!(!ledger.settle(12));
        assert!(!ledger.settle(11));
        assert_eq!(ledger.commit_point(), 10);
        assert_eq!(ledger.metadata(false), "1;h=10:1,13:1;d=11-12");
        assert!(ledger.settle(10));
        assert_eq!(ledger.commit_point(), 13);
        assert_eq!(ledger.metadata(false), "1;h=13:1;d=");
        assert!(ledger.settle(13));
        assert_eq!(ledger.commit_point(), 14);
        assert_eq!(ledger.metadata(false), "1;h=;d=");
    }

    #[test]
    fn a_restart_resumes_counts_and_skips_what_was_settled() {
        let mut before = Ledger::resume(None, 0);
        for o in 0..4 {
            before.read(o);
            before.hand_out(o);
        }
        before.hand_out(0);
        before.settle(2);
        let metadata = before.metadata(false);
        let point = before.commit_point();

        let mut after = Ledger::resume(Some((point, &metadata)), 0);
        assert_eq!(after.read(0), Read::Fresh(2));
        assert_eq!(after.hand_out(0), 3);
        assert_eq!(after.read(1), Read::Fresh(1));
        assert_eq!(after.read(2), Read::Skip);
        assert_eq!(after.read(3), Read::Fresh(1));
        assert_eq!(after.read(4), Read::Fresh(0));
        after.settle(1);
        after.settle(3);
        after.settle(4);
        assert_eq!(after.commit_point(), 0);
        after.settle(0);
        assert_eq!(after.commit_point(), 5);
    }

    /// Hand-outs are committed before delivery only where a crash could
    /// hide a poison pill: nothing committed yet, a reader before that did
    /// not stop cleanly, or an offset handed out before.
    #[test]
    fn only_a_stops_commit_is_clean_and_otherwise_hand_outs_are_careful() {
        let now = Instant::now();
        let fresh = Ledger::resume(None, 0);
        assert!(fresh.careful(1, now), "nothing of it committed yet");
        let mut running = Ledger::resume(None, 0);
        running.read(0);
        running.hand_out(0);
        running.synced = true;
        assert!(!running.careful(1, now));
        assert!(running.careful(2, now), "handed out before");
        let metadata = running.metadata(false);
        assert_eq!(metadata, "1;h=0:1;d=");
        let crashed = Ledger::resume(Some((0, &metadata)), 0);
        assert!(crashed.careful(1, now), "its last reader did not stop");
        let later = Instant::now() + CAREFUL_FOR;
        assert!(!crashed.careful(1, later), "for a while only");
        let stopped = running.metadata(true);
        assert_eq!(stopped, "1;h=0:1;d=;c");
        let mut after_a_stop = Ledger::resume(Some((0, &stopped)), 0);
        assert!(!after_a_stop.careful(1, now));
        assert_eq!(after_a_stop.read(0), Read::Fresh(1), "the count carries");
    }

    #[test]
    fn a_hand_out_given_back_does_not_count() {
        let mut ledger = Ledger::resume(None, 0);
        ledger.read(0);
        ledger.hand_out(0);
        ledger.give_back(0);
        assert_eq!(ledger.metadata(false), "1;h=;d=");
        assert_eq!(ledger.hand_out(0), 1);
        assert_eq!(ledger.commit_point(), 0);
    }

    #[test]
    fn a_read_but_not_handed_out_offset_holds_the_commit() {
        let mut ledger = Ledger::resume(Some((5, "")), 0);
        assert_eq!(ledger.read(5), Read::Fresh(0));
        assert_eq!(ledger.read(6), Read::Fresh(0));
        ledger.hand_out(6);
        ledger.settle(6);
        assert_eq!(ledger.commit_point(), 5);
        assert!(ledger.is_open(5));
        assert_eq!(ledger.metadata(false), "1;h=;d=6");
    }

    #[test]
    fn foreign_or_hostile_metadata_says_nothing_harmful() {
        for metadata in ["", "2;h=1:9", "garbage", "1;h=x:y;d=a-b"] {
            assert!(decode(metadata).is_empty(), "{metadata}");
        }
        assert_eq!(decode("1;d=0-99999999999").len(), DECODED_MAX);
    }

    #[test]
    fn metadata_stays_within_what_kafka_keeps() {
        let mut ledger = Ledger::resume(None, 0);
        ledger.read(0);
        for o in 1..5000 {
            ledger.read(o);
            ledger.settle(o * 2 - 1);
        }
        assert!(ledger.metadata(false).len() <= METADATA_BYTES);
    }

    #[test]
    fn summary_counts_handed_and_settled() {
        let metadata = "1;h=3:1,4:2;d=5-6";
        assert_eq!(summary(metadata, 3, 10), (2, 2, Some(7)));
        assert_eq!(summary(metadata, 3, 7), (2, 2, None));
        assert_eq!(summary("", 0, 3), (0, 0, Some(0)));
        assert_eq!(summary("", 3, 3), (0, 0, None));
    }
}
