//! Dead letters of the embedded queue that cannot be read (a bug, a disk
//! fault, a tool that wrote the wrong bytes): listed and reported, not a
//! failure of the whole listing; purged like any other; a replay says why
//! it cannot be done instead of sending the app a stand-in.

use crate::common::*;
use bytes::Bytes;
use courier::source::{ErrorKind, encode_fields};
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
        {
            let m = refused.message();
            refused.kind() == ErrorKind::Invalid
                && m.contains("cannot be read")
                && m.contains("purge")
        },
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

/// What a user of `courier dlq` sees: the listing shows the corrupt dead
/// letter beside the good one; `replay --all` replays the good one and
/// names the corrupt one as not replayed (exit 1, a partial failure);
/// `purge` deletes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn courier_dlq_lists_skips_and_purges_a_corrupt_dead_letter() {
    let fixture = Fixture::embedded();
    let good = encode_fields(&[(Bytes::from_static(b"payload"), Bytes::from_static(b"fine"))]);
    let ids = store_dead_letters(&fixture, &[b"\xc1 junk".to_vec(), good]);
    let (bad_id, good_id) = (&ids[0], &ids[1]);
    let dlq = |args: &[&str]| {
        let out = courier_command()
            .arg("dlq")
            .args(args)
            .args(["--source", &fixture.source_arg(), "--queue", &fixture.queue])
            .env("NO_COLOR", "1")
            .output()
            .expect("run courier dlq");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };

    let (code, out, err) = dlq(&["list"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains(bad_id.as_str()) && out.contains(good_id.as_str()),
        "{out}"
    );

    let (code, out, err) = dlq(&["replay", "--all"]);
    assert_eq!(code, Some(1), "a partial failure: {out}{err}");
    assert!(
        err.contains(bad_id.as_str()) && err.contains("cannot be read"),
        "the corrupt one is named, and why: {err}"
    );
    let (_, out, _) = dlq(&["list", "--output", "json"]);
    let left: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(left.len(), 1, "the good one was replayed: {out}");
    assert_eq!(left[0]["id"], bad_id.as_str());

    let (code, _, err) = dlq(&["purge", "--all", "--yes", "--why", "test"]);
    assert_eq!(code, Some(0), "{err}");
    let (_, out, _) = dlq(&["list", "--output", "json"]);
    assert!(out.trim().is_empty(), "{out}");

    let source = fixture.open().await;
    let back = source.receive(10).await.unwrap();
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].message.body.as_ref(), b"fine");
}
