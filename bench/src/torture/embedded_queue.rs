//! The torture run on the embedded queue: the producer (courier's own
//! `Source::send`, while courier is down: one process holds the file) and
//! what the checker reads of the file's tables.

use std::path::Path;
use std::time::Instant;

use bytes::Bytes;
use courier::source::decode_fields;
use futures::StreamExt;

use super::{Broker, Holdings, Hostile, Letter, Run, message};
use crate::sources::{Kind, Target};
use crate::torture_app::ids_in;

pub(super) fn holdings(dir: &Path, queue: &str) -> anyhow::Result<Holdings> {
    use redb::{ReadableDatabase, ReadableTable};
    type QueueTable<'a> = redb::TableDefinition<'a, (u64, u64), &'static [u8]>;
    type DlqTable<'a> = redb::TableDefinition<'a, u64, &'static [u8]>;
    let db = redb::Database::create(dir.join("courier.redb"))?;
    let tx = db.begin_read()?;
    let mut out = Holdings::default();
    for name in [format!("ready/{queue}"), format!("leased/{queue}")] {
        let Ok(table) = tx.open_table(QueueTable::new(&name)) else {
            continue;
        };
        for row in table.iter()? {
            let (_, v) = row?;
            ids_in(v.value(), &mut out.pending);
        }
    }
    if let Ok(table) = tx.open_table(DlqTable::new(&format!("dlq/{queue}.dlq"))) {
        for row in table.iter()? {
            let (_, v) = row?;
            let data = Bytes::copy_from_slice(v.value());
            match decode_fields(&data) {
                Some(fields) => out.letters.push(Letter::of(&fields)),
                None => {
                    let mut ids = Vec::new();
                    ids_in(&data, &mut ids);
                    out.letters.push(Letter {
                        ids,
                        reason: "(undecodable letter)".into(),
                        status: String::new(),
                        error: String::new(),
                        attempts: String::new(),
                    });
                }
            }
        }
    }
    Ok(out)
}

impl Run {
    /// Embedded: writes every message due by now, while courier is down,
    /// with courier's own `Source::send` (as `courier send` does: it drops
    /// a producer's `courier-*` headers and refuses a record over the
    /// queue's limit).
    pub(super) async fn produce_embedded(
        &mut self,
        started: Instant,
        until: Instant,
    ) -> anyhow::Result<()> {
        let Broker::Embedded(_) = &self.broker else {
            return Ok(());
        };
        let due = (until.min(Instant::now()) - started).as_secs_f64() * self.args.rate;
        let due = due.ceil() as u64;
        if due <= self.next_n {
            return Ok(());
        }
        let target = Target {
            kind: Kind::Embedded,
            url: self.broker.source(),
            queue: self.queue.clone(),
        };
        let producer = target.producer().await?;
        let (seed, share, max_body) = (self.args.seed, self.args.hostile, self.args.max_body);
        let results: Vec<_> = futures::stream::iter(self.next_n..due)
            .map(|n| {
                let kind = Hostile::of(seed, n, share);
                let mut fields = message(n, kind, max_body, true);
                let body = fields.remove(0).1;
                let headers: Vec<(String, String)> = fields
                    .iter()
                    .map(|(k, v)| {
                        (
                            String::from_utf8_lossy(k).into_owned(),
                            String::from_utf8_lossy(v).into_owned(),
                        )
                    })
                    .collect();
                let producer = producer.clone();
                async move { (n, kind, producer.send(body, &headers).await) }
            })
            .buffer_unordered(64)
            .collect()
            .await;
        producer.close().await;
        let mut produced = self.produced.lock().unwrap();
        for (n, kind, result) in results {
            match result {
                Ok(_) => produced.ids.push((n, kind)),
                Err(e) => produced.refuse(n, kind, e),
            }
        }
        self.next_n = due;
        Ok(())
    }
}
