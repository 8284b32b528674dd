//! Dead-letter streams: their names, and browsing, replaying and purging
//! the letters in them.

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::message::StreamMessage;

use super::NatsSource;
use super::connection::{js_code, unavailable};
use super::fields::{F_SUBJECT, from_headers};
use crate::model::DeadLetter;
use crate::source::SourceError;
use crate::source::shared::not_there;

/// The stream that holds a dead-letter subject: stream names cannot hold
/// `.`, `*`, `>`, `/`, `\` or whitespace, so each becomes `_`.
pub fn dead_letter_stream(subject: &str) -> String {
    subject
        .chars()
        .map(|c| match c {
            '.' | '*' | '>' | '/' | '\\' => '_',
            c if c.is_whitespace() => '_',
            c => c,
        })
        .collect()
}

/// Refuses a dead-letter subject courier could not publish to, or one the
/// work stream captures (its dead letters would come back as work).
pub(super) fn check_dead_letter_subject(
    subject: &str,
    stream: &str,
    work_subjects: &[String],
) -> Result<(), String> {
    let tokens: Vec<&str> = subject.split('.').collect();
    if subject.chars().any(char::is_whitespace)
        || tokens
            .iter()
            .any(|t| t.is_empty() || *t == "*" || *t == ">")
    {
        return Err(format!(
            "the dead-letter queue {subject:?} is not a NATS subject courier can publish to: write dot-separated tokens without spaces or wildcards, like orders.dlq"
        ));
    }
    if let Some(filter) = work_subjects.iter().find(|f| captures(f, &tokens)) {
        return Err(format!(
            "the dead-letter subject {subject:?} is captured by the work stream {stream:?} (subject {filter:?}), so dead letters would be delivered again as work; name another deadLetterQueue in the policy"
        ));
    }
    Ok(())
}

/// Whether a stream subject (`*` one token, `>` the rest) captures a
/// subject of literal tokens.
fn captures(filter: &str, subject: &[&str]) -> bool {
    let mut at = 0;
    for token in filter.split('.') {
        match token {
            ">" => return at < subject.len(),
            "*" if at < subject.len() => {}
            t if subject.get(at) == Some(&t) => {}
            _ => return false,
        }
        at += 1;
    }
    at == subject.len()
}

impl NatsSource {
    pub(super) async fn stored(
        &self,
        stream: &str,
        id: &str,
    ) -> Result<Option<StreamMessage>, SourceError> {
        let Ok(sequence) = id.parse::<u64>() else {
            return Err(SourceError::Invalid(format!(
                "{id:?} is not a dead-letter id of NATS (a stream sequence number)"
            )));
        };
        let stream = match self.js.get_stream(stream).await {
            Ok(s) => s,
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => return Ok(None),
            Err(e) => return Err(unavailable(e)),
        };
        match stream.get_raw_message(sequence).await {
            Ok(m) => Ok(Some(m)),
            Err(e) if js_code(&e) == Some(ErrorCode::NO_MESSAGE_FOUND) => Ok(None),
            Err(e) => Err(unavailable(e)),
        }
    }

    pub(super) async fn browse_dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        let name = dead_letter_stream(dead_letter_queue);
        let stream = match self.js.get_stream(&name).await {
            Ok(s) => s,
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => return Ok(Vec::new()),
            Err(e) => return Err(unavailable(e)),
        };
        let state = stream.cached_info().state.clone();
        let mut out = Vec::new();
        let mut next = state.first_sequence;
        while out.len() < limit && state.messages > 0 && next <= state.last_sequence {
            let got = stream
                .raw_message_builder()
                .sequence(next)
                .next_by_subject(dead_letter_queue.to_string())
                .send()
                .await;
            let message = match got {
                Ok(m) => m,
                Err(e) if js_code(&e) == Some(ErrorCode::NO_MESSAGE_FOUND) => break,
                Err(e) => return Err(unavailable(e)),
            };
            next = message.sequence + 1;
            out.push(DeadLetter::from_fields(
                message.sequence.to_string(),
                from_headers(&message.payload, Some(&message.headers)),
            ));
        }
        Ok(out)
    }

    pub(super) async fn replay_dead_letter(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let name = dead_letter_stream(dead_letter_queue);
        let stored = self
            .stored(&name, &letter.id)
            .await?
            .ok_or_else(|| not_there(dead_letter_queue, &letter.id))?;
        let stored = DeadLetter::from_fields(
            stored.sequence.to_string(),
            from_headers(&stored.payload, Some(&stored.headers)),
        );
        let subject = stored
            .field(F_SUBJECT)
            .map(str::to_string)
            .or_else(|| self.send_subject.clone())
            .ok_or_else(|| {
                SourceError::Invalid(format!(
                    "dead letter {} does not record its subject and stream {:?} has no subject without wildcards to publish to",
                    letter.id, self.options.queue
                ))
            })?;
        // Two replays of one letter at once (two operators, a retried
        // command) both read it before either deletes it; the id makes
        // JetStream store the second publish not at all.
        let replay_id = format!("courier-replay:{name}:{}", letter.id);
        self.publish_once(
            &subject,
            &self.options.queue,
            &self.seal.seal(stored.fields_for_replay()),
            Some(&replay_id),
        )
        .await?;
        let stream = self
            .js
            .get_stream_no_info(&name)
            .await
            .map_err(unavailable)?;
        match stream
            .delete_message(letter.id.parse().unwrap_or_default())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if js_code(&e) == Some(ErrorCode::NO_MESSAGE_FOUND) => {
                Err(not_there(dead_letter_queue, &letter.id))
            }
            Err(e) => Err(unavailable(e)),
        }
    }

    pub(super) async fn purge_dead_letter(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let name = dead_letter_stream(dead_letter_queue);
        if self.stored(&name, &letter.id).await?.is_none() {
            return Err(not_there(dead_letter_queue, &letter.id));
        }
        let stream = self
            .js
            .get_stream_no_info(&name)
            .await
            .map_err(unavailable)?;
        match stream
            .delete_message(letter.id.parse().unwrap_or_default())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if js_code(&e) == Some(ErrorCode::NO_MESSAGE_FOUND) => {
                Err(not_there(dead_letter_queue, &letter.id))
            }
            Err(e) => Err(unavailable(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_letter_subject_must_be_publishable_and_not_work() {
        let work = vec!["orders".to_string(), "shop.*.created".to_string()];
        assert!(check_dead_letter_subject("orders.dlq", "orders", &work).is_ok());
        assert!(check_dead_letter_subject("shop.eu.created.dlq", "orders", &work).is_ok());
        let err = check_dead_letter_subject("shop.eu.created", "orders", &work).unwrap_err();
        assert!(err.contains("captured by the work stream"), "{err}");
        let wide = vec!["orders.>".to_string()];
        assert!(check_dead_letter_subject("orders.dlq", "orders", &wide).is_err());
        assert!(check_dead_letter_subject("orders", "orders", &wide).is_ok());
        for bad in ["", "orders.*", "a..b", "failed orders", "orders.>"] {
            let err = check_dead_letter_subject(bad, "orders", &work).unwrap_err();
            assert!(err.contains("not a NATS subject"), "{bad}: {err}");
        }
    }

    #[test]
    fn dead_letter_streams_have_no_dots() {
        assert_eq!(dead_letter_stream("orders.dlq"), "orders_dlq");
        assert_eq!(dead_letter_stream("a.*.b>"), "a___b_");
        assert_eq!(dead_letter_stream("failed orders"), "failed_orders");
    }
}
