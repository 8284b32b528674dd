//! The audit trail of the commands that change a dead-letter queue (`dlq
//! replay`, `dlq edit`, `dlq purge`): one JSON line on standard error, whatever the log
//! level, and, where the queue's RetryPolicy is named (`--policy`, set in
//! the sidecar's container) and the API server answers, a Normal Event on
//! that RetryPolicy. Both name the selection, the counts, the operator's
//! `--why` and who ran it.
//!
//! The caller is who the API server says the command authenticated as (a
//! SelfSubjectReview); without a cluster, the local user and host, marked
//! as such, since nothing vouches for them.

use std::time::{Duration, SystemTime};

use super::{Filter, Selection, Target};
use crate::duration;
use crate::model::rfc3339;
use crate::policy::cluster::{AuditTrail, PolicyRef};

/// How long the audit waits on the API server, per request: the operation
/// is done by then, and a slow API server must not hang the command.
const API_WAIT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    Replay,
    Edit,
    Purge,
    /// A replay or purge job cancelled (`dlq jobs cancel`).
    Cancel,
}

impl Action {
    fn verb(self) -> &'static str {
        match self {
            Action::Replay => "replay",
            Action::Edit => "edit",
            Action::Purge => "purge",
            Action::Cancel => "cancel",
        }
    }

    /// The Event's reason, as `kubectl get events` shows it.
    fn event_reason(self) -> &'static str {
        match self {
            Action::Replay => "DeadLettersReplayed",
            Action::Edit => "DeadLetterEdited",
            Action::Purge => "DeadLettersPurged",
            Action::Cancel => "DeadLetterJobCancelled",
        }
    }

    fn past(self) -> &'static str {
        match self {
            Action::Replay => "replayed",
            Action::Edit => "edited and replayed",
            Action::Purge => "purged",
            Action::Cancel => "cancelled",
        }
    }
}

/// What one command did.
pub(crate) struct Record<'a> {
    pub action: Action,
    pub queue: &'a str,
    pub dead_letter_queue: &'a str,
    /// Which letters: the selection flags as given.
    pub selection: String,
    /// How many the snapshot held.
    pub selected: usize,
    /// How many were replayed or deleted.
    pub done: usize,
    /// How many failed, or were not found by id.
    pub failed: usize,
    pub why: Option<&'a str>,
    /// Messages per second, for a replay with `--rate`.
    pub rate: Option<f64>,
    /// The job it was (`courier dlq jobs`), for a replay or purge.
    pub job: Option<&'a str>,
}

/// What an edit changed, which its audit line records beside the counts:
/// the patch as given, and the digest of the letter it was applied to (the
/// `courier-edited-from-digest` of the message it replayed).
pub(crate) struct EditNote<'a> {
    pub patch: &'a serde_json::Value,
    pub original: &'a str,
}

/// The letter and patch of `dlq edit`, as an operator would type them again.
pub(crate) fn describe_edit(id: &str, patch: &std::path::Path) -> String {
    format!(
        "{} --patch {}",
        quote(id),
        quote(&patch.display().to_string())
    )
}

/// The selection flags of a command, as an operator would type them again.
pub(crate) fn describe(filter: &Filter, selection: &Selection) -> String {
    let mut parts = Vec::new();
    if let Some(expression) = &filter.expression {
        parts.push(format!("--filter {}", quote(expression.source())));
    }
    if let Some(reason) = &filter.reason {
        parts.push(format!("--reason {}", quote(reason)));
    }
    if let Some(status) = &filter.status {
        parts.push(format!("--status {}", quote(status)));
    }
    if let Some(older) = filter.older_than {
        parts.push(format!("--older-than {}", duration::format(older)));
    }
    if let Some(newer) = filter.newer_than {
        parts.push(format!("--newer-than {}", duration::format(newer)));
    }
    if let Some(limit) = filter.limit {
        parts.push(format!("--limit {limit}"));
    }
    for id in &selection.ids {
        parts.push(format!("--id {}", quote(id)));
    }
    if selection.all {
        parts.push("--all".into());
    }
    parts.join(" ")
}

/// `text` in single quotes where a shell would need them.
fn quote(text: &str) -> String {
    let plain = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:/=".contains(c));
    if plain {
        text.to_string()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

/// Writes an edit's audit line, which also has the patch and the digest,
/// and, where it can, the Event. Problems reaching the API server are
/// warnings: the edit is done, and the line says what it did either way.
pub(crate) async fn write_edit(target: &Target, record: &Record<'_>, edit: &EditNote<'_>) {
    Auditor::connect(target)
        .await
        .write(record, Some(edit))
        .await;
}

/// Who runs the command and where its Events go, learnt once: a job
/// records its caller when it starts, and its audit line when it ends.
pub(crate) struct Auditor {
    trail: Option<AuditTrail>,
    /// The caller, as the audit line and a job's record name them.
    pub by: String,
}

impl Auditor {
    pub(crate) async fn connect(target: &Target) -> Self {
        let trail = match &target.policy {
            Some(name) => match PolicyRef::from_env(name) {
                Ok(policy) => {
                    match tokio::time::timeout(API_WAIT, AuditTrail::connect(policy)).await {
                        Ok(Ok(trail)) => Some(trail),
                        Ok(Err(e)) => {
                            eprintln!(
                                "warning: audit: no Kubernetes API client: {e}; no Event is recorded"
                            );
                            None
                        }
                        Err(_) => {
                            eprintln!(
                                "warning: audit: no Kubernetes API client within {API_WAIT:?}; no Event is recorded"
                            );
                            None
                        }
                    }
                }
                Err(e) => {
                    eprintln!("warning: audit: {e}; no Event is recorded");
                    None
                }
            },
            None => None,
        };
        let caller = match &trail {
            Some(trail) => match tokio::time::timeout(API_WAIT, trail.caller()).await {
                Ok(Ok(name)) => Some(name),
                Ok(Err(e)) => {
                    eprintln!("warning: audit: the API server did not say who this is: {e}");
                    None
                }
                Err(_) => {
                    eprintln!(
                        "warning: audit: the API server did not say who this is within {API_WAIT:?}"
                    );
                    None
                }
            },
            None => None,
        };
        Self {
            trail,
            by: caller.unwrap_or_else(local_caller),
        }
    }

    pub(crate) async fn write(&self, record: &Record<'_>, edit: Option<&EditNote<'_>>) {
        let by = &self.by;
        eprintln!("{}", line(record, edit, by, SystemTime::now()));
        let Some(trail) = &self.trail else { return };
        let note = note(record, edit, by);
        let recorded = tokio::time::timeout(
            API_WAIT,
            trail.record(record.action.event_reason(), record.action.verb(), &note),
        )
        .await;
        let policy = trail.target().label();
        match recorded {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                eprintln!("warning: audit: cannot record the Event on RetryPolicy {policy}: {e}")
            }
            Err(_) => eprintln!(
                "warning: audit: the Event on RetryPolicy {policy} was not recorded within {API_WAIT:?}"
            ),
        }
    }
}

/// The OS user and host, marked as unverified.
fn local_caller() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown".into());
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    format!("local:{user}@{host}")
}

/// The audit line: one JSON object, so log shippers can take it apart.
fn line(record: &Record<'_>, edit: Option<&EditNote<'_>>, by: &str, now: SystemTime) -> String {
    let mut line = serde_json::json!({
        "audit": record.action.verb(),
        "at": rfc3339(now),
        "queue": record.queue,
        "dead_letter_queue": record.dead_letter_queue,
        "selection": record.selection,
        "selected": record.selected,
        "done": record.done,
        "failed": record.failed,
        "why": record.why,
        "rate": record.rate,
        "job": record.job,
        "by": by,
    });
    if let Some(edit) = edit {
        line["patch"] = edit.patch.clone();
        line["edited_from_digest"] = edit.original.into();
    }
    line.to_string()
}

/// The Event's note, one sentence.
fn note(record: &Record<'_>, edit: Option<&EditNote<'_>>, by: &str) -> String {
    let mut note = match (record.action, record.job) {
        (Action::Cancel, Some(job)) => format!(
            "{by} cancelled job {job} after {} of {} dead letters in {}",
            record.done, record.selected, record.dead_letter_queue,
        ),
        _ => format!(
            "{by} {} {} of {} dead letters in {}",
            record.action.past(),
            record.done,
            record.selected,
            record.dead_letter_queue,
        ),
    };
    if matches!(record.action, Action::Replay | Action::Edit) {
        note.push_str(&format!(" to {}", record.queue));
        if let Some(rate) = record.rate {
            note.push_str(&format!(" at {rate}/s"));
        }
    }
    note.push_str(&format!(" ({})", record.selection));
    if let Some(edit) = edit {
        note.push_str(&format!("; edited from {}", edit.original));
    }
    if record.failed > 0 {
        note.push_str(&format!("; {} failed", record.failed));
    }
    if let Some(why) = record.why {
        note.push_str(&format!("; why: {why}"));
    }
    note
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(action: Action) -> Record<'static> {
        Record {
            action,
            queue: "orders",
            dead_letter_queue: "orders.dlq",
            selection: "--filter 'status >= 500' --limit 10".into(),
            selected: 10,
            done: 9,
            failed: 1,
            why: Some("INC-42 fixed"),
            rate: Some(50.0),
            job: None,
        }
    }

    #[test]
    fn the_line_is_json_with_every_field() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let line: serde_json::Value =
            serde_json::from_str(&line(&record(Action::Replay), None, "alice", at)).unwrap();
        assert_eq!(line["audit"], "replay");
        assert_eq!(line["at"], "2027-01-15T08:00:00.000Z");
        assert_eq!(line["dead_letter_queue"], "orders.dlq");
        assert_eq!(line["selection"], "--filter 'status >= 500' --limit 10");
        assert_eq!(
            (&line["selected"], &line["done"], &line["failed"]),
            (&10.into(), &9.into(), &1.into())
        );
        assert_eq!(line["why"], "INC-42 fixed");
        assert_eq!(line["by"], "alice");
        assert_eq!(line.get("patch"), None);
    }

    #[test]
    fn the_note_says_who_did_what_to_how_many() {
        assert_eq!(
            note(&record(Action::Replay), None, "alice"),
            "alice replayed 9 of 10 dead letters in orders.dlq to orders at 50/s \
             (--filter 'status >= 500' --limit 10); 1 failed; why: INC-42 fixed"
        );
        let purge = Record {
            failed: 0,
            rate: None,
            ..record(Action::Purge)
        };
        assert_eq!(
            note(&purge, None, "bob"),
            "bob purged 9 of 10 dead letters in orders.dlq \
             (--filter 'status >= 500' --limit 10); why: INC-42 fixed"
        );
    }

    #[test]
    fn a_cancel_names_its_job() {
        let cancel = Record {
            job: Some("replay-0000abcd"),
            why: Some("wrong filter"),
            failed: 0,
            ..record(Action::Cancel)
        };
        assert_eq!(Action::Cancel.event_reason(), "DeadLetterJobCancelled");
        assert_eq!(
            note(&cancel, None, "bob"),
            "bob cancelled job replay-0000abcd after 9 of 10 dead letters in orders.dlq \
             (--filter 'status >= 500' --limit 10); why: wrong filter"
        );
        let at = SystemTime::UNIX_EPOCH;
        let line: serde_json::Value =
            serde_json::from_str(&line(&cancel, None, "bob", at)).unwrap();
        assert_eq!(
            (&line["audit"], &line["job"]),
            (&"cancel".into(), &"replay-0000abcd".into())
        );
    }

    #[test]
    fn the_selection_reads_as_flags() {
        let filter = Filter {
            reason: Some("permanent-status".into()),
            status: Some("4xx".into()),
            older_than: Some(Duration::from_secs(3600)),
            expression: Some(crate::expr::Expr::parse("headers['x-tenant'] == \"acme\"").unwrap()),
            ..Filter::default()
        };
        let selection = Selection {
            ids: vec!["1-0".into()],
            all: true,
        };
        assert_eq!(
            describe(&filter, &selection),
            r#"--filter 'headers['\''x-tenant'\''] == "acme"' --reason permanent-status --status 4xx --older-than 1h --id 1-0 --all"#
        );
    }

    #[test]
    fn an_edit_records_its_patch_and_the_original() {
        let patch = serde_json::json!([{"op": "replace", "path": "/body/amount", "value": 5}]);
        let edit = EditNote {
            patch: &patch,
            original: "sha256:ab",
        };
        let record = Record {
            selection: describe_edit("17-0", std::path::Path::new("fix amount.json")),
            selected: 1,
            done: 1,
            failed: 0,
            rate: None,
            ..record(Action::Edit)
        };
        let at = SystemTime::UNIX_EPOCH;
        let line: serde_json::Value =
            serde_json::from_str(&line(&record, Some(&edit), "alice", at)).unwrap();
        assert_eq!(line["audit"], "edit");
        assert_eq!(line["selection"], "17-0 --patch 'fix amount.json'");
        assert_eq!(line["patch"], patch);
        assert_eq!(line["edited_from_digest"], "sha256:ab");
        assert_eq!(Action::Edit.event_reason(), "DeadLetterEdited");
        assert_eq!(
            note(&record, Some(&edit), "alice"),
            "alice edited and replayed 1 of 1 dead letters in orders.dlq to orders \
             (17-0 --patch 'fix amount.json'); edited from sha256:ab; why: INC-42 fixed"
        );
    }
}
