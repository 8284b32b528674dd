//! The records of `courier dlq` jobs ([`DeadLetterStore::job_records`]):
//! what a record and its key may be, and what the brokers that keep no
//! value under a key (SQS, Pub/Sub) share. Those keep each record as a
//! message of a queue or topic of their own, the key and a version in
//! message attributes ([`KEY`], [`VERSION`]). A write sends a new version
//! and then takes the versions before it away; until it has, two versions
//! stand, and the newer wins wherever two are found ([`newest`]). How a
//! broker reads and settles those messages stays in its crate.
//!
//! [`DeadLetterStore::job_records`]: super::DeadLetterStore::job_records

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use super::SourceError;

/// The largest job record `courier dlq` puts; a store may refuse larger.
pub const JOB_RECORD_MAX: usize = 16 * 1024;

/// A job record's key: 1 to 64 of `a-z`, `0-9` and `-`, so that every
/// broker can carry it in a name, a header or a KV key as it is.
pub fn is_job_key(key: &str) -> bool {
    (1..=64).contains(&key.len())
        && key
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Refuses a key that is not [`is_job_key`]: its record would be written
/// and then never listed.
pub fn check_key(key: &str) -> Result<(), SourceError> {
    if is_job_key(key) {
        Ok(())
    } else {
        Err(SourceError::invalid(format!(
            "{key:?} is not a dlq job key: 1 to 64 of a-z, 0-9 and -"
        )))
    }
}

/// Refuses a record over [`JOB_RECORD_MAX`], as too large.
pub fn check_size(record: &[u8]) -> Result<(), SourceError> {
    if record.len() > JOB_RECORD_MAX {
        return Err(SourceError::too_large(format!(
            "a dlq job record of {} bytes is over the {JOB_RECORD_MAX} bytes a record may have",
            record.len()
        )));
    }
    Ok(())
}

/// The message attribute with a record's job key.
pub const KEY: &str = "courier-job-key";
/// The message attribute with a record's version: nanoseconds since the
/// epoch at its write, and always above the versions of the key that write
/// found ([`next_version`]), so that a clock behind another process's still
/// makes it newer.
pub const VERSION: &str = "courier-job-version";

/// The name of what keeps the records beside a dead-letter queue: `base`
/// and `suffix`, or, where that is over the broker's `max` bytes, as much
/// of the start of `base` as fits with `-`, a 16-hex-digit hash of the
/// whole `base`, and `suffix` (a few bytes less where the cut would split
/// a character). The hash keeps apart two long names that share their
/// start. These names are on users' brokers already: the same arguments
/// must give the same name in every release.
pub fn name_within(base: &str, suffix: &str, max: usize) -> String {
    if base.len() + suffix.len() <= max {
        return format!("{base}{suffix}");
    }
    let hash = format!("-{:016x}", fnv1a(base));
    let keep = floor_char_boundary(base, max.saturating_sub(suffix.len() + hash.len()));
    format!("{}{hash}{suffix}", &base[..keep])
}

/// FNV-1a: a hash that stays the same across builds and Rust releases,
/// since names made from it must ([`name_within`]).
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The largest char boundary of `text` at or before `at`
/// (`str::floor_char_boundary`, not stable at this crate's Rust version).
fn floor_char_boundary(text: &str, at: usize) -> usize {
    (0..=at.min(text.len()))
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0)
}

/// A message of a jobs queue, as read.
#[derive(Debug, Clone, PartialEq)]
pub struct Held {
    /// The broker's id of the message.
    pub id: String,
    /// `None`: not a record courier wrote (no job key, or a body that does
    /// not decode); left where it is.
    pub key: Option<String>,
    pub version: u128,
    pub record: Bytes,
    /// When the broker took the message: what its retention counts from.
    pub sent: SystemTime,
}

impl Held {
    /// A message read with the attributes `key` ([`KEY`]) and `version`
    /// ([`VERSION`]) and the record `record`, `None` where its body does
    /// not decode. A version that is missing or not a number is 0, below
    /// any courier wrote.
    pub fn new(
        id: String,
        key: Option<&str>,
        version: Option<&str>,
        record: Option<Bytes>,
        sent: SystemTime,
    ) -> Self {
        let key = key.filter(|k| is_job_key(k)).map(str::to_string);
        Self {
            id,
            key: key.filter(|_| record.is_some()),
            version: version.and_then(|v| v.parse().ok()).unwrap_or(0),
            record: record.unwrap_or_default(),
            sent,
        }
    }
}

/// Where each key's newest record is in `held`: the highest version, the
/// first of equal ones (a refresh cut short leaves two alike).
pub fn newest(held: &[Held]) -> HashMap<&str, usize> {
    let mut newest: HashMap<&str, usize> = HashMap::new();
    for (i, h) in held.iter().enumerate() {
        let Some(key) = h.key.as_deref() else {
            continue;
        };
        match newest.get(key) {
            Some(&j) if held[j].version >= h.version => {}
            _ => {
                newest.insert(key, i);
            }
        }
    }
    newest
}

/// The records a listing returns: each key's newest.
pub fn newest_records(held: &[Held]) -> Vec<(String, Bytes)> {
    newest(held)
        .into_iter()
        .map(|(key, i)| (key.to_string(), held[i].record.clone()))
        .collect()
}

/// The version of a record of `key` written at `now` to be the newest of
/// those in `held`: now, or just above the newest version of `key` held
/// when the clock is behind that.
pub fn next_version(held: &[Held], key: &str, now: SystemTime) -> u128 {
    let now = now
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    held.iter()
        .filter(|h| h.key.as_deref() == Some(key))
        .map(|h| h.version + 1)
        .fold(now, u128::max)
}

/// A write or a removal of one key's record, for the fate of the messages
/// it reads.
#[derive(Debug, Clone, Copy)]
pub struct Writing<'a> {
    pub key: &'a str,
    /// The versions of `key` below this are taken away: those before a
    /// write's own. `None` takes them all (a removal, or a write that reads
    /// before it sends).
    pub below: Option<u128>,
    /// The id of the write's own message, where it was sent before the
    /// read, which stays.
    pub own: Option<&'a str>,
    /// A record of another key older than this is sent afresh, so that the
    /// broker's retention does not drop it.
    pub refresh_after: Duration,
}

/// What a write does with a message it read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Deliverable again at once.
    GiveBack,
    /// Deleted or acked: a version of the key written before the write, or
    /// of the key removed, or an outranked version of another key. No
    /// listing would return it.
    Remove,
    /// Sent afresh with the same key and version, then removed: a record
    /// of another key nearing the broker's retention.
    Refresh,
}

impl Writing<'_> {
    /// The fate of `held`. `outranked`: a newer version of its key is among
    /// what the read found, where the read sees every message at once;
    /// where it decides message by message, an outranked record is refreshed
    /// all the same, and stays outranked.
    pub fn fate(&self, held: &Held, outranked: bool, now: SystemTime) -> Fate {
        let Some(key) = held.key.as_deref() else {
            return Fate::GiveBack;
        };
        if key == self.key {
            let before = self.below.is_none_or(|below| held.version < below);
            return if before && self.own != Some(held.id.as_str()) {
                Fate::Remove
            } else {
                Fate::GiveBack
            };
        }
        if outranked {
            Fate::Remove
        } else if now.duration_since(held.sent).unwrap_or_default() >= self.refresh_after {
            Fate::Refresh
        } else {
            Fate::GiveBack
        }
    }

    /// The fate of each of `held`, in order, where the read holds every
    /// message of the queue at once.
    pub fn fates(&self, held: &[Held], now: SystemTime) -> Vec<Fate> {
        let newest = newest(held);
        held.iter()
            .enumerate()
            .map(|(i, h)| {
                let outranked = h.key.as_deref().is_some_and(|k| newest.get(k) != Some(&i));
                self.fate(h, outranked, now)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(24 * 3600);

    fn held(key: Option<&str>, version: u128, age_days: u32, now: SystemTime) -> Held {
        held_as("", key, version, age_days, now)
    }

    fn held_as(id: &str, key: Option<&str>, version: u128, age_days: u32, now: SystemTime) -> Held {
        Held {
            id: id.to_string(),
            key: key.map(str::to_string),
            version,
            record: Bytes::from(format!("{key:?}@{version}")),
            sent: now - DAY * age_days,
        }
    }

    #[test]
    fn job_keys() {
        assert!(is_job_key("job-0"));
        assert!(is_job_key(&"a".repeat(64)));
        for key in ["", "Job", "a b", "job_0", "é"] {
            assert!(!is_job_key(key), "{key:?}");
            assert!(check_key(key).is_err(), "{key:?}");
        }
        assert!(!is_job_key(&"a".repeat(65)));
        assert!(check_key("job-0").is_ok());
        assert!(check_size(&[b' '; JOB_RECORD_MAX]).is_ok());
        let over = check_size(&[b' '; JOB_RECORD_MAX + 1]).unwrap_err();
        assert_eq!(over.kind(), super::super::ErrorKind::TooLarge);
    }

    #[test]
    fn names_within_a_limit() {
        assert_eq!(name_within("orders", "-jobs", 11), "orders-jobs");
        let long = "q".repeat(80);
        let name = name_within(&long, "-courier-jobs", 80);
        // Pinned: SQS queues with this name exist already.
        assert_eq!(
            name,
            format!("{}-9ab3204404945995-courier-jobs", "q".repeat(50))
        );
        assert_eq!(name, name_within(&long, "-courier-jobs", 80));
        assert_ne!(
            name,
            name_within(&format!("{}x", "q".repeat(79)), "-courier-jobs", 80)
        );
        // The cut falls before a character it would split.
        let wide = format!("{}é{}", "q".repeat(49), "q".repeat(40));
        assert_eq!(
            name_within(&wide, "-courier-jobs", 80),
            format!("{}-57896ad14a1a67f4-courier-jobs", "q".repeat(49))
        );
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c, "FNV-1a's own test value");
    }

    #[test]
    fn a_record_reads_back_from_its_attributes() {
        let now = SystemTime::now();
        let record = Some(Bytes::from_static(b"{}"));
        let h = Held::new("m".into(), Some("job-a"), Some("42"), record.clone(), now);
        assert_eq!((h.key.as_deref(), h.version), (Some("job-a"), 42));
        assert_eq!(h.record, Bytes::from_static(b"{}"));
        let foreign = Held::new(
            "m".into(),
            Some("Not A Key"),
            Some("1"),
            record.clone(),
            now,
        );
        assert_eq!(foreign.key, None);
        let undecoded = Held::new("m".into(), Some("job-a"), Some("1"), None, now);
        assert_eq!(undecoded.key, None);
        let unversioned = Held::new("m".into(), Some("job-a"), Some("x"), record, now);
        assert_eq!(unversioned.version, 0);
    }

    #[test]
    fn fate_rows() {
        let now = SystemTime::now();
        let held = [
            held(Some("job-a"), 5, 0, now),
            held(Some("job-b"), 3, 0, now),
            held(Some("job-b"), 4, 0, now),
            held(None, 9, 30, now),
            held(Some("job-c"), 1, 8, now),
            held(Some("job-c"), 1, 8, now),
            held(Some("job-d"), 2, 6, now),
        ];
        // A write that holds the whole queue before it sends (SQS's).
        let writing = |key| Writing {
            key,
            below: None,
            own: None,
            refresh_after: DAY * 7,
        };
        use Fate::*;
        assert_eq!(
            writing("job-a").fates(&held, now),
            [
                Remove,   // the key written
                Remove,   // an older version
                GiveBack, // the newest of job-b
                GiveBack, // not a record of courier's
                Refresh,  // a week old
                Remove,   // the same version twice: one is kept
                GiveBack, // not a week old yet
            ]
        );
        assert_eq!(writing("job-x").fates(&held, now)[0], GiveBack);
        assert_eq!(writing("job-b").fates(&held, now)[1..3], [Remove, Remove]);
    }

    #[test]
    fn fate_rows_message_by_message() {
        let now = SystemTime::now();
        // A write that sends before it reads, and decides as each message
        // comes (Pub/Sub's).
        let put = Writing {
            key: "job-a",
            below: Some(10),
            own: Some("own"),
            refresh_after: DAY * 3,
        };
        let remove = Writing {
            key: "job-a",
            below: None,
            own: None,
            refresh_after: DAY * 3,
        };
        use Fate::*;
        let rows = [
            // (message id, key, version, age in days, the write, the fate)
            ("m1", Some("job-a"), 5, 0, Some(&put), Remove),
            ("own", Some("job-a"), 10, 0, Some(&put), GiveBack),
            ("m2", Some("job-a"), 12, 0, Some(&put), GiveBack),
            ("m2", Some("job-a"), 12, 0, Some(&remove), Remove),
            ("m1", Some("job-a"), 5, 0, None, GiveBack),
            ("m3", Some("job-b"), 3, 0, Some(&put), GiveBack),
            ("m3", Some("job-b"), 3, 3, Some(&remove), Refresh),
            ("m3", Some("job-b"), 3, 3, None, GiveBack),
            ("m1", Some("job-a"), 3, 3, Some(&put), Remove),
            ("m4", None, 3, 30, Some(&put), GiveBack),
        ];
        for (i, &(id, key, version, age_days, writing, expected)) in rows.iter().enumerate() {
            let held = held_as(id, key, version, age_days, now);
            let fate = writing.map_or(GiveBack, |w| w.fate(&held, false, now));
            assert_eq!(fate, expected, "row {i}");
        }
    }

    #[test]
    fn versions_only_grow() {
        let now = SystemTime::now();
        let nanos = now.duration_since(UNIX_EPOCH).unwrap().as_nanos();
        let ahead = nanos + 1_000_000_000;
        let held = [
            held(Some("job-a"), ahead, 0, now),
            held(Some("job-b"), ahead + 7, 0, now),
        ];
        assert_eq!(next_version(&held, "job-a", now), ahead + 1);
        assert_eq!(next_version(&held, "job-c", now), nanos);
        assert_eq!(next_version(&[], "job-a", now), nanos);
    }

    #[test]
    fn newest_of_each_key() {
        let now = SystemTime::now();
        // (key and version of each held message, where each key's newest is)
        type Row = (
            &'static [(Option<&'static str>, u128)],
            &'static [(&'static str, usize)],
        );
        let rows: [Row; 2] = [
            (
                &[
                    (Some("job-a"), 2),
                    (Some("job-a"), 1),
                    (None, 3),
                    (Some("job-b"), 1),
                ],
                &[("job-a", 0), ("job-b", 3)],
            ),
            (
                &[
                    (Some("job-a"), 2),
                    (Some("job-a"), 3),
                    // The first of equal versions.
                    (Some("job-b"), 1),
                    (Some("job-b"), 1),
                ],
                &[("job-a", 1), ("job-b", 2)],
            ),
        ];
        for (i, (versions, expected)) in rows.into_iter().enumerate() {
            let held: Vec<Held> = versions
                .iter()
                .map(|&(key, version)| held(key, version, 0, now))
                .collect();
            let mut found: Vec<_> = newest(&held).into_iter().collect();
            found.sort();
            assert_eq!(found, expected, "row {i}");
            let mut listed = newest_records(&held);
            listed.sort();
            let records: Vec<_> = expected
                .iter()
                .map(|&(key, at)| (key.to_string(), held[at].record.clone()))
                .collect();
            assert_eq!(listed, records, "row {i}");
        }
    }
}
