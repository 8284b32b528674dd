//! Dead letters of the embedded queue that cannot be read (a bug, a disk
//! fault, a tool that wrote the wrong bytes): listed and reported, not a
//! failure of the whole listing; purged like any other; a replay says why
//! it cannot be done instead of sending the app a stand-in.

mod common;

use bytes::Bytes;
use common::*;
use courier::source::{SourceError, encode_fields};
use redb::ReadableTable;

type DlqTable<'a> = redb::TableDefinition<'a, u64, &'static [u8]>;
const META: redb::TableDefinition<'_, &str, u64> = redb::TableDefinition::new("meta");

/// Stores `rows` as the next dead letters of the fixture's dead-letter
/// queue straight into the redb file (table `dlq/<name>` keyed by seq, the
/// sequence in `meta`), the way a bug or a broken tool would; returns their
/// ids. The file must not be open in this process.
fn store_dead_letters(fixture: &Fixture, rows: &[Vec<u8>]) -> Vec<String> {
    let dir = fixture.dir().expect("an embedded fixture");
    std::fs::create_dir_all(&dir).unwrap();
    let db = redb::Database::create(dir.join("courier.redb")).unwrap();
    let tx = db.begin_write().unwrap();
    let mut ids = Vec::new();
    {
        let mut meta = tx.open_table(META).unwrap();
        let mut dlq = tx
            .open_table(DlqTable::new(&format!("dlq/{}", fixture.dlq())))
            .unwrap();
        for row in rows {
            let seq = meta.get("seq").unwrap().map_or(0, |v| v.value()) + 1;
            meta.insert("seq", seq).unwrap();
            dlq.insert(seq, row.as_slice()).unwrap();
            ids.push(seq.to_string());
        }
    }
    tx.commit().unwrap();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_dead_letter_is_listed_purgeable_and_not_replayed() {
    const RAW: &[u8] = b"\xc1\x00 not a stored dead letter";
    let fixture = Fixture::embedded();
    let good = encode_fields(&[
        (Bytes::from_static(b"payload"), Bytes::from_static(b"fine")),
        (
            Bytes::from_static(b"courier-reason"),
            Bytes::from_static(b"permanent-status"),
        ),
    ]);
    let ids = store_dead_letters(&fixture, &[RAW.to_vec(), good]);
    let (bad_id, good_id) = (&ids[0], &ids[1]);
    let source = fixture.open().await;
    let dlq = fixture.dlq();

    let letters = source.dead_letters(&dlq, 100).await.unwrap();
    assert_eq!(letters.len(), 2, "both are listed: {letters:?}");
    let bad = letters.iter().find(|l| &l.id == bad_id).unwrap();
    assert_eq!(bad.body.as_ref(), RAW, "its raw bytes are the body");
    let error = bad.field("courier-error").expect("the listing says why");
    assert!(error.contains("cannot be read"), "{error}");
    let good = letters.iter().find(|l| &l.id == good_id).unwrap();
    assert_eq!(good.body.as_ref(), b"fine");

    let refused = source.replay(&dlq, bad).await.unwrap_err();
    assert!(
        matches!(&refused, SourceError::Invalid(m) if m.contains("cannot be read") && m.contains("purge")),
        "a replay of it says why not and what to do: {refused}"
    );
    assert_eq!(
        source.dead_letters(&dlq, 100).await.unwrap().len(),
        2,
        "a refused replay moves nothing"
    );

    source.replay(&dlq, good).await.unwrap();
    let back = source.receive(10).await.unwrap();
    assert_eq!(back.len(), 1, "{back:?}");
    assert_eq!(back[0].message.body.as_ref(), b"fine");
    source.ack(&back[0]).await.unwrap();

    source.purge(&dlq, bad).await.unwrap();
    assert!(source.dead_letters(&dlq, 100).await.unwrap().is_empty());
}
