//! Dead-letter browsing: list, replay, purge.

use super::*;

impl EmbeddedSource {
    pub(super) async fn list_dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        let table = dlq_table(dead_letter_queue);
        self.read(move |tx, _| {
            let dlq = match tx.open_table(DlqTable::new(&table)) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(store_error(e)),
            };
            let mut out = Vec::new();
            for row in dlq.iter().map_err(store_error)?.take(limit) {
                let (id, data) = row.map_err(store_error)?;
                let data = Bytes::copy_from_slice(data.value());
                let letter = match decode_fields(&data) {
                    Some(fields) => DeadLetter::from_fields(id.value().to_string(), fields),
                    // Listed with its raw bytes as the body rather than
                    // hiding every other dead letter behind an error.
                    None => {
                        let mut letter = DeadLetter::from_fields(
                            id.value().to_string(),
                            vec![(PAYLOAD.into(), data.clone())],
                        );
                        letter.fields.push((
                            crate::model::F_ERROR.into(),
                            format!(
                                "the stored dead letter cannot be read ({} bytes); its raw bytes are the body",
                                data.len()
                            ),
                        ));
                        letter
                    }
                };
                out.push(letter);
            }
            Ok(out)
        })
        .await
    }

    pub(super) async fn replay_dead_letter(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let data = encode_fields(&letter.fields_for_replay());
        let (table, id) = (
            dlq_table(dead_letter_queue),
            parse_dead_letter_id(&letter.id)?,
        );
        self.write(true, move |tx, tables| {
            let mut dlq = tx.open_table(DlqTable::new(&table)).map_err(store_error)?;
            let readable = dlq
                .get(id)
                .map_err(store_error)?
                .map(|stored| decode_fields(&Bytes::copy_from_slice(stored.value())).is_some());
            match readable {
                None => return Err(not_there(&table, id)),
                // What the listing showed of it is a stand-in (its raw
                // bytes), not the message: replaying that would send the
                // app something no producer wrote.
                Some(false) => return Err(unreadable(&table, id)),
                Some(true) => {}
            }
            dlq.remove(id).map_err(store_error)?;
            drop(dlq);
            let seq = next_seq(tx)?;
            tx.open_table(QueueTable::new(&tables.ready))
                .map_err(store_error)?
                .insert((now_ms(), seq), data.as_slice())
                .map_err(store_error)?;
            Ok(())
        })
        .await
    }

    pub(super) async fn purge_dead_letter(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let (table, id) = (
            dlq_table(dead_letter_queue),
            parse_dead_letter_id(&letter.id)?,
        );
        self.write(true, move |tx, _| {
            let removed = tx
                .open_table(DlqTable::new(&table))
                .map_err(store_error)?
                .remove(id)
                .map_err(store_error)?
                .is_some();
            if removed {
                Ok(())
            } else {
                Err(not_there(&table, id))
            }
        })
        .await
    }
}

pub(super) fn not_there(table: &str, id: u64) -> SourceError {
    shared::not_there(table.trim_start_matches("dlq/"), &id.to_string())
}

/// Why an unreadable dead letter cannot be replayed, and what to do.
fn unreadable(table: &str, id: u64) -> SourceError {
    SourceError::invalid(format!(
        "dead letter {id} in {} is stored in a form that cannot be read, so it cannot be replayed; `courier dlq list` shows its raw bytes as the body, and `courier dlq purge` deletes it",
        table.trim_start_matches("dlq/")
    ))
}

pub(super) fn parse_dead_letter_id(id: &str) -> Result<u64, SourceError> {
    id.parse().map_err(|_| {
        SourceError::invalid(format!(
            "{id:?} is not a dead-letter id of the embedded queue (a number)"
        ))
    })
}
