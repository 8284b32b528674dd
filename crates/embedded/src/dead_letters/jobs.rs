//! The records of `courier dlq` jobs: the table `jobs/<dead-letter
//! queue>`, job key -> record, in the queue's file beside the dead
//! letters. The first put makes the file and the table; listing or
//! removing without them finds nothing and makes nothing. A put and a
//! removal are written like a replay or a purge: in a transaction of the
//! admin handle's own, or the writer's next one while a consumer of this
//! process runs it, answered once durable, so that a record put is there
//! for a job resumed after a crash.

use super::*;
use courier_core::source::{JOB_RECORD_MAX, is_job_key};

type JobTable<'a> = TableDefinition<'a, &'static str, &'static [u8]>;

/// The most records one dead-letter queue keeps: the command keeps a few
/// dozen (the running jobs, their cancels and the last finished ones), and
/// a listing reads them all into memory every quarter of a second while a
/// job runs. A put of a new key beyond it is refused.
pub(crate) const RECORDS_PER_QUEUE: usize = 1024;

fn jobs_table(dead_letter_queue: &str) -> String {
    format!("jobs/{dead_letter_queue}")
}

impl EmbeddedStore {
    pub(super) async fn read_job_records(
        &self,
        dead_letter_queue: &str,
    ) -> Result<Vec<(String, Bytes)>, SourceError> {
        let Some(file) = self.file()? else {
            return Ok(Vec::new());
        };
        let table = jobs_table(dead_letter_queue);
        file.read(move |tx| {
            let jobs = match tx.open_table(JobTable::new(&table)) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(store_error(e)),
            };
            jobs.iter()
                .map_err(store_error)?
                .take(RECORDS_PER_QUEUE)
                .map(|row| {
                    let (key, record) = row.map_err(store_error)?;
                    Ok((
                        key.value().to_string(),
                        Bytes::copy_from_slice(record.value()),
                    ))
                })
                .collect()
        })
        .await
    }

    pub(super) async fn write_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
        record: Bytes,
    ) -> Result<(), SourceError> {
        check_key(key)?;
        if record.len() > JOB_RECORD_MAX {
            return Err(SourceError::invalid(format!(
                "the record of dlq job {key} is {} bytes, over the {JOB_RECORD_MAX} bytes a job record may take",
                record.len()
            )));
        }
        let file = self.file_to_write()?;
        let (table, key) = (jobs_table(dead_letter_queue), key.to_string());
        let dead_letter_queue = dead_letter_queue.to_string();
        file.write_durably(Box::new(move |tx| {
            let mut jobs = tx.open_table(JobTable::new(&table)).map_err(store_error)?;
            // Refused before anything is written: a refusal in the
            // writer's transaction must leave the batch's other changes
            // alone.
            if jobs.len().map_err(store_error)? >= RECORDS_PER_QUEUE as u64
                && jobs.get(key.as_str()).map_err(store_error)?.is_none()
            {
                return Err(SourceError::invalid(format!(
                    "{dead_letter_queue} has {RECORDS_PER_QUEUE} dlq job records already, more than courier keeps; remove the ones no job needs before starting another"
                )));
            }
            jobs.insert(key.as_str(), record.as_ref())
                .map_err(store_error)?;
            Ok(())
        }))
        .await
    }

    pub(super) async fn delete_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
    ) -> Result<(), SourceError> {
        check_key(key)?;
        let Some(file) = self.file()? else {
            return Ok(());
        };
        let (table, key) = (jobs_table(dead_letter_queue), key.to_string());
        file.write_durably(Box::new(move |tx| {
            // Opening it in a write would make it.
            if !has_table(tx, &table)? {
                return Ok(());
            }
            tx.open_table(JobTable::new(&table))
                .map_err(store_error)?
                .remove(key.as_str())
                .map_err(store_error)?;
            Ok(())
        }))
        .await
    }
}

fn check_key(key: &str) -> Result<(), SourceError> {
    if is_job_key(key) {
        return Ok(());
    }
    Err(SourceError::invalid(format!(
        "{key:?} is not a dlq job key: 1 to 64 of a-z, 0-9 and -"
    )))
}
