//! Which dead letters a command acts on: the filter flags, ids, and the
//! read of the dead-letter queue that applies them.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::{Filter, Selection};
use crate::cmd::args::UsageError;
use crate::model::{DeadLetter, DeadLetterReason, dead_letter_age};
use crate::policy::CodeMatch;
use crate::source::DeadLetterStore;

impl Filter {
    fn check(&self) -> Result<Option<CodeMatch>, UsageError> {
        if let Some(reason) = &self.reason
            && !DeadLetterReason::labels().contains(&reason.as_str())
        {
            return Err(UsageError(format!(
                "--reason {reason:?} is not a reason; use one of {}",
                DeadLetterReason::labels().join(", ")
            )));
        }
        self.status
            .as_deref()
            .map(|s| {
                CodeMatch::parse(s).ok_or_else(|| {
                    UsageError(format!("--status {s:?} is not a status; write 400 or 4xx"))
                })
            })
            .transpose()
    }

    fn is_set(&self) -> bool {
        self.reason.is_some()
            || self.status.is_some()
            || self.older_than.is_some()
            || self.newer_than.is_some()
    }

    fn matches(&self, letter: &DeadLetter, status: Option<CodeMatch>, now: SystemTime) -> bool {
        if let Some(reason) = &self.reason
            && letter.field("courier-reason") != Some(reason.as_str())
        {
            return false;
        }
        if let Some(wanted) = status {
            let got = letter
                .field("courier-status")
                .and_then(|s| s.parse::<u16>().ok());
            if !got.is_some_and(|code| wanted.matches(code)) {
                return false;
            }
        }
        let age = age(letter, now);
        if let Some(older) = self.older_than
            && age.is_none_or(|a| a <= older)
        {
            return false;
        }
        if let Some(newer) = self.newer_than
            && age.is_none_or(|a| a >= newer)
        {
            return false;
        }
        true
    }
}

/// The one definition of a dead letter's age, the same the depth gauge uses.
pub(super) fn age(letter: &DeadLetter, now: SystemTime) -> Option<Duration> {
    Some(dead_letter_age(letter.dead_lettered_at()?, now))
}

/// The dead letters a command acts on: the ids given, or those matching
/// the filters.
pub(super) async fn select(
    source: &Arc<dyn DeadLetterStore>,
    dlq: &str,
    filter: &Filter,
    ids: &[String],
) -> anyhow::Result<(Vec<DeadLetter>, Vec<String>)> {
    let status = filter.check()?;
    let now = SystemTime::now();
    let all = source.dead_letters(dlq, usize::MAX).await?;
    let mut missing = Vec::new();
    let chosen: Vec<DeadLetter> = if ids.is_empty() {
        all.into_iter()
            .filter(|l| filter.matches(l, status, now))
            .take(filter.limit.unwrap_or(usize::MAX))
            .collect()
    } else {
        let mut chosen = Vec::new();
        for id in ids {
            match all.iter().find(|l| &l.id == id) {
                Some(letter) if filter.matches(letter, status, now) => chosen.push(letter.clone()),
                Some(_) => {}
                None => missing.push(id.clone()),
            }
        }
        chosen
    };
    Ok((chosen, missing))
}

pub(super) fn require_selection(
    verb: &str,
    filter: &Filter,
    selection: &Selection,
) -> Result<(), UsageError> {
    if selection.ids.is_empty() && !selection.all && !filter.is_set() {
        return Err(UsageError(format!(
            "{verb} needs --id ID (repeatable), a filter (--reason, --status, --older-than, --newer-than), or --all"
        )));
    }
    Ok(())
}

/// A dead letter as the tests of this folder read it.
#[cfg(test)]
pub(super) fn test_letter(reason: &str, status: &str, last: SystemTime) -> DeadLetter {
    DeadLetter {
        id: "1".into(),
        body: bytes::Bytes::from_static(&[0xff, 0x00]),
        fields: vec![
            ("courier-reason".into(), reason.into()),
            ("courier-status".into(), status.into()),
            (
                "courier-last-attempt-at".into(),
                crate::model::rfc3339(last),
            ),
            ("traceparent".into(), "00-x".into()),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters() {
        let now = SystemTime::now();
        let hour_ago = test_letter("permanent-status", "400", now - Duration::from_secs(3600));
        let f = |reason: Option<&str>,
                 status: Option<&str>,
                 older: Option<u64>,
                 newer: Option<u64>| Filter {
            reason: reason.map(Into::into),
            status: status.map(Into::into),
            older_than: older.map(Duration::from_secs),
            newer_than: newer.map(Duration::from_secs),
            limit: None,
        };
        let rows = [
            (f(None, None, None, None), true),
            (f(Some("permanent-status"), None, None, None), true),
            (f(Some("undeliverable"), None, None, None), false),
            (f(None, Some("4xx"), None, None), true),
            (f(None, Some("400"), None, None), true),
            (f(None, Some("503"), None, None), false),
            (f(None, None, Some(60), None), true),
            (f(None, None, Some(7200), None), false),
            (f(None, None, None, Some(7200)), true),
            (f(None, None, None, Some(60)), false),
        ];
        for (filter, want) in rows {
            let status = filter.check().unwrap();
            assert_eq!(filter.matches(&hour_ago, status, now), want, "{filter:?}");
        }
        assert!(f(Some("bogus"), None, None, None).check().is_err());
        assert!(f(None, Some("4x"), None, None).check().is_err());
    }
}
