//! Which dead letters a command acts on: the filter flags, ids, and the
//! read of the dead-letter queue that applies them. `--filter` is an
//! [`Expr`](crate::expr::Expr), parsed by clap, so that a bad one stops the
//! command before it connects; the other filter flags are shorthands it is
//! ANDed with.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::{Filter, Selection};
use crate::cmd::args::UsageError;
use crate::expr::ExprError;
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
            || self.expression.is_some()
    }

    /// Whether `letter` is selected: every shorthand flag given holds, then
    /// `--filter`, which is evaluated only on the letters they let through.
    fn matches(
        &self,
        letter: &DeadLetter,
        status: Option<CodeMatch>,
        now: SystemTime,
    ) -> Result<bool, ExprError> {
        if !self.shorthands_match(letter, status, now) {
            return Ok(false);
        }
        self.expression
            .as_ref()
            .map_or(Ok(true), |expr| expr.matches(letter, now))
    }

    fn shorthands_match(
        &self,
        letter: &DeadLetter,
        status: Option<CodeMatch>,
        now: SystemTime,
    ) -> bool {
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
pub(crate) fn age(letter: &DeadLetter, now: SystemTime) -> Option<Duration> {
    Some(dead_letter_age(letter.dead_lettered_at()?, now))
}

/// The dead letters `--filter` could not be evaluated on (a type mismatch,
/// a result that is not true or false): they are not selected, and the
/// command says so once on stderr, with a few of them, rather than
/// stopping a bulk replay or purge halfway or letting them pass unseen.
/// A letter that lacks what the expression asks about is no error
/// (`crate::expr`).
#[derive(Debug, Default)]
struct Unevaluated {
    count: usize,
    examples: Vec<String>,
}

impl Unevaluated {
    const EXAMPLES: usize = 3;

    /// `matched` of `letter`, an error counted as no match.
    fn tally(&mut self, letter: &DeadLetter, matched: Result<bool, ExprError>) -> bool {
        matched.unwrap_or_else(|e| {
            self.count += 1;
            if self.examples.len() < Self::EXAMPLES {
                self.examples.push(format!("{}: {e}", letter.id));
            }
            false
        })
    }

    fn warning(&self) -> Option<String> {
        (self.count > 0).then(|| {
            let more = self.count - self.examples.len();
            format!(
                "warning: --filter could not be evaluated on {} dead letter{}, left out: {}{}",
                self.count,
                if self.count == 1 { "" } else { "s" },
                self.examples.join("; "),
                if more > 0 {
                    format!("; and {more} more")
                } else {
                    String::new()
                }
            )
        })
    }
}

/// How many dead letters a walk reads at a time where the broker pages:
/// a page is held whole, and a letter's body may be up to `--max-body`.
const PAGE: usize = 256;

/// A walk over a dead-letter queue that applies a command's selection: the
/// ids given (if any), the shorthand flags and `--filter`, all judged at
/// one `now`, so that a letter's age does not change between the count and
/// the act. Where the broker pages ([`DeadLetterStore::dead_letters_after`])
/// it holds one page at a time, whatever the queue's length; elsewhere it
/// lists the queue once and walks that list each time.
pub(crate) struct Walk<'a> {
    source: &'a Arc<dyn DeadLetterStore>,
    dlq: &'a str,
    filter: &'a Filter,
    status: Option<CodeMatch>,
    ids: &'a [String],
    now: SystemTime,
    /// The whole queue, where the broker cannot page.
    listed: Option<Vec<DeadLetter>>,
    /// Letters dead-lettered after this are left out where the broker
    /// cannot page: a resumed job's bound, when the snapshot's last letter
    /// may be gone from a queue listed anew ([`Walk::born_by`]).
    born_by: Option<SystemTime>,
    /// Where a walk starts: after this letter ([`Walk::after`]).
    start_after: Option<String>,
}

/// What a walk selected.
#[derive(Debug, Default)]
pub(crate) struct Walked {
    /// How many letters were selected (and handed to the callback).
    pub selected: usize,
    /// The last selected letter's id: the bound of a snapshot.
    pub last: Option<String>,
    /// The ids given that were not found.
    pub missing: Vec<String>,
}

impl<'a> Walk<'a> {
    pub(crate) fn new(
        source: &'a Arc<dyn DeadLetterStore>,
        dlq: &'a str,
        filter: &'a Filter,
        ids: &'a [String],
    ) -> Result<Self, UsageError> {
        Ok(Self {
            source,
            dlq,
            status: filter.check()?,
            filter,
            ids,
            now: SystemTime::now(),
            listed: None,
            born_by: None,
            start_after: None,
        })
    }

    /// Walks start after the letter `id` (a page's cursor): where the
    /// broker pages, by id order; elsewhere after its place in the listing,
    /// and nowhere when it is no longer there (the console then says the
    /// page's last letter is gone).
    pub(crate) fn after(mut self, id: Option<String>) -> Self {
        self.start_after = id;
        self
    }

    /// Where the listing resumes for [`Walk::after`].
    fn listed_start(&self) -> usize {
        match (&self.listed, &self.start_after) {
            (Some(all), Some(id)) => all
                .iter()
                .position(|l| &l.id == id)
                .map_or(all.len(), |i| i + 1),
            _ => 0,
        }
    }

    /// The walk of a snapshot taken earlier: ages are judged at its
    /// instant, and where the broker cannot page (so a letter's id does
    /// not bound the set), letters dead-lettered after it are left out.
    /// A letter whose time is unknown stays in: it cannot be newer than a
    /// record written by this release.
    pub(crate) fn of_snapshot(mut self, at: SystemTime) -> Self {
        self.now = at;
        self.born_by = Some(at);
        self
    }

    /// The instant ages are judged at, which a job records.
    pub(crate) fn now(&self) -> SystemTime {
        self.now
    }

    fn after_snapshot(&self, letter: &DeadLetter) -> bool {
        self.listed.is_some()
            && self
                .born_by
                .zip(letter.dead_lettered_at())
                .is_some_and(|(bound, at)| at > bound)
    }

    /// Calls `each` on every selected letter, oldest first, up to and
    /// including the letter `through` and at most `limit` of them. Letters
    /// `--filter` cannot be evaluated on are left out, and said so on
    /// stderr when `report` is set (once per command: the count's walk).
    pub(crate) async fn each(
        &mut self,
        through: Option<&str>,
        limit: usize,
        report: bool,
        mut each: impl AsyncFnMut(DeadLetter) -> anyhow::Result<()>,
    ) -> anyhow::Result<Walked> {
        let mut walked = Walked::default();
        let mut found = vec![false; self.ids.len()];
        let mut unevaluated = Unevaluated::default();
        if let Some(letters) = self.look_up().await? {
            for (i, letter) in letters.into_iter().enumerate() {
                let Some(letter) = letter else { continue };
                found[i] = true;
                if walked.selected < limit
                    && unevaluated
                        .tally(&letter, self.filter.matches(&letter, self.status, self.now))
                {
                    walked.selected += 1;
                    walked.last = Some(letter.id.clone());
                    each(letter).await?;
                }
            }
            return Ok(self.finish(walked, found, unevaluated, report));
        }
        let mut after: Option<String> = self.start_after.clone();
        let mut listed_at = self.listed_start();
        'pages: while walked.selected < limit {
            let page = match &self.listed {
                Some(all) => {
                    let page: Vec<DeadLetter> =
                        all.iter().skip(listed_at).take(PAGE).cloned().collect();
                    listed_at += page.len();
                    page
                }
                None => {
                    let paged = self
                        .source
                        .dead_letters_after(self.dlq, after.as_deref(), through, PAGE)
                        .await?;
                    match paged {
                        Some(page) => page,
                        None => {
                            self.listed =
                                Some(self.source.dead_letters(self.dlq, usize::MAX).await?);
                            listed_at = self.listed_start();
                            continue;
                        }
                    }
                }
            };
            if page.is_empty() {
                break;
            }
            after = page.last().map(|l| l.id.clone());
            for letter in page {
                // A queue listed anew for a resumed job may not be in its
                // snapshot's order (RabbitMQ puts back what a listing held
                // in another order): there the snapshot's instant bounds
                // the set, not its last letter's place.
                let at_bound = through == Some(letter.id.as_str())
                    && !(self.listed.is_some() && self.born_by.is_some());
                let wanted = match self.ids.iter().position(|id| *id == letter.id) {
                    Some(i) => {
                        found[i] = true;
                        true
                    }
                    None => self.ids.is_empty(),
                };
                let matched = wanted
                    && !self.after_snapshot(&letter)
                    && unevaluated
                        .tally(&letter, self.filter.matches(&letter, self.status, self.now));
                if matched {
                    walked.selected += 1;
                    walked.last = Some(letter.id.clone());
                    each(letter).await?;
                }
                let all_found = !self.ids.is_empty() && found.iter().all(|f| *f);
                if at_bound || all_found || walked.selected >= limit {
                    break 'pages;
                }
            }
        }
        Ok(self.finish(walked, found, unevaluated, report))
    }

    /// The letters of the ids given, each read alone, where the broker
    /// can (`DeadLetterStore::dead_letter_by_id`): `show ID` or `replay
    /// --id` on a queue of a million letters reads one. `None` when no ids
    /// were given or the broker cannot.
    async fn look_up(&self) -> anyhow::Result<Option<Vec<Option<DeadLetter>>>> {
        if self.ids.is_empty() || self.listed.is_some() {
            return Ok(None);
        }
        let mut letters = Vec::with_capacity(self.ids.len());
        for id in self.ids {
            match self.source.dead_letter_by_id(self.dlq, id).await? {
                Some(letter) => letters.push(letter),
                None => return Ok(None),
            }
        }
        Ok(Some(letters))
    }

    fn finish(
        &self,
        mut walked: Walked,
        found: Vec<bool>,
        unevaluated: Unevaluated,
        report: bool,
    ) -> Walked {
        walked.missing = self
            .ids
            .iter()
            .zip(found)
            .filter(|(_, found)| !found)
            .map(|(id, _)| id.clone())
            .collect();
        if report && let Some(warning) = unevaluated.warning() {
            eprintln!("{warning}");
        }
        walked
    }
}

/// The dead letters a command acts on, gathered: for `show` and the like,
/// which select a few by id.
pub(crate) async fn select(
    source: &Arc<dyn DeadLetterStore>,
    dlq: &str,
    filter: &Filter,
    ids: &[String],
) -> anyhow::Result<(Vec<DeadLetter>, Vec<String>)> {
    let mut chosen = Vec::new();
    let limit = filter.limit.unwrap_or(usize::MAX);
    let walked = Walk::new(source, dlq, filter, ids)?
        .each(None, limit, true, async |letter| {
            chosen.push(letter);
            Ok(())
        })
        .await?;
    Ok((chosen, walked.missing))
}

pub(crate) fn require_selection(
    verb: &str,
    filter: &Filter,
    selection: &Selection,
) -> Result<(), UsageError> {
    if selection.ids.is_empty() && !selection.all && !filter.is_set() {
        return Err(UsageError(format!(
            "{verb} needs --id ID (repeatable), a filter (--filter, --reason, --status, --older-than, --newer-than), or --all"
        )));
    }
    Ok(())
}

/// A dead letter as the tests of this folder read it.
#[cfg(test)]
pub(crate) fn test_letter(reason: &str, status: &str, last: SystemTime) -> DeadLetter {
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
    use crate::expr::Expr;

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
            expression: None,
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
            assert_eq!(
                filter.matches(&hour_ago, status, now).unwrap(),
                want,
                "{filter:?}"
            );
        }
        assert!(f(Some("bogus"), None, None, None).check().is_err());
        assert!(f(None, Some("4x"), None, None).check().is_err());
    }

    /// `--filter` and the shorthand flags select the letters all of them
    /// hold for; `--filter` alone is a selection for replay and purge.
    #[test]
    fn the_filter_is_anded_with_the_shorthands() {
        let now = SystemTime::now();
        let hour_ago = test_letter("permanent-status", "400", now - Duration::from_secs(3600));
        let f = |reason: Option<&str>, expression: &str| Filter {
            reason: reason.map(Into::into),
            expression: Some(Expr::parse(expression).unwrap()),
            ..Filter::default()
        };
        let rows = [
            (f(None, "status == 400"), true),
            (f(None, "status == 404"), false),
            (f(Some("permanent-status"), "age > duration('30m')"), true),
            (f(Some("undeliverable"), "status == 400"), false),
            (
                f(Some("permanent-status"), "headers.traceparent == 'x'"),
                false,
            ),
        ];
        for (filter, want) in rows {
            let status = filter.check().unwrap();
            assert_eq!(
                filter.matches(&hour_ago, status, now).unwrap(),
                want,
                "{filter:?}"
            );
        }
        let selection = Selection::default();
        assert!(require_selection("replay", &f(None, "true"), &selection).is_ok());
        let refused = require_selection("purge", &Filter::default(), &selection).unwrap_err();
        assert!(refused.0.contains("--filter"), "{refused}");
    }

    /// A letter `--filter` cannot be evaluated on is left out, counted, and
    /// named in one warning; one that lacks what it asks about is simply
    /// not selected.
    #[test]
    fn letters_the_filter_cannot_be_evaluated_on_are_left_out_and_named() {
        let now = SystemTime::now();
        let letter = |id: &str, status: &str| DeadLetter {
            id: id.into(),
            ..test_letter("permanent-status", status, now)
        };
        let type_mismatch = Expr::parse("status > 'four hundred'").unwrap();
        let absent = Expr::parse("status >= 400").unwrap();
        let mut unevaluated = Unevaluated::default();
        for id in ["1-0", "2-0", "3-0", "4-0"] {
            assert!(!unevaluated.tally(
                &letter(id, "400"),
                type_mismatch.matches(&letter(id, "400"), now)
            ));
        }
        assert!(!unevaluated.tally(&letter("5-0", ""), absent.matches(&letter("5-0", ""), now)));
        assert!(unevaluated.tally(
            &letter("6-0", "404"),
            absent.matches(&letter("6-0", "404"), now)
        ));
        let warning = unevaluated.warning().unwrap();
        assert!(
            warning.starts_with(
                "warning: --filter could not be evaluated on 4 dead letters, left out: 1-0: "
            ) && warning.contains("; 3-0: ")
                && warning.ends_with("; and 1 more"),
            "{warning}"
        );
        assert!(!warning.contains("5-0"), "{warning}");
        assert_eq!(Unevaluated::default().warning(), None);
    }
}
