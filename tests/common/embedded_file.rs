//! The embedded queue's redb file written behind courier's back, as a bug
//! or a broken tool would.

use std::time::{SystemTime, UNIX_EPOCH};

use redb::ReadableTable;

use super::Fixture;

/// Stores `data` as the next message of the fixture's queue straight into
/// the redb file, in the layout of `crates/embedded/src/` (table
/// `ready/<queue>` keyed by `(due ms, seq)`, the sequence in table `meta`),
/// the way a bug or a broken tool would. The file must not be open in this
/// process. Returns its sequence number.
pub fn store_raw(fixture: &Fixture, data: &[u8]) -> u64 {
    type QueueTable<'a> = redb::TableDefinition<'a, (u64, u64), &'static [u8]>;
    const META: redb::TableDefinition<'_, &str, u64> = redb::TableDefinition::new("meta");
    let dir = fixture.dir().expect("an embedded fixture");
    std::fs::create_dir_all(&dir).unwrap();
    let db = redb::Database::create(dir.join("courier.redb")).unwrap();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let tx = db.begin_write().unwrap();
    let seq = {
        let mut meta = tx.open_table(META).unwrap();
        let seq = meta.get("seq").unwrap().map_or(0, |v| v.value()) + 1;
        meta.insert("seq", seq).unwrap();
        let table = format!("ready/{}", fixture.queue);
        tx.open_table(QueueTable::new(&table))
            .unwrap()
            .insert((now, seq), data)
            .unwrap();
        seq
    };
    tx.commit().unwrap();
    seq
}
