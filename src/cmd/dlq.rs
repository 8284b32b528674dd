//! `courier dlq`: inspect, replay and purge dead letters, the same words for
//! every source.
//!
//! Exit codes: 0 done, 1 some dead letters failed (each failure is listed),
//! 2 bad usage (including `purge` without `--yes`, which says how many it
//! would delete).

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use base64::Engine;
use clap::{Args, Subcommand, ValueEnum};

use super::args::{SourceArgs, UsageError, check_queue, parse_source};
use crate::duration;
use crate::model::{DeadLetter, F_LAST_ATTEMPT_AT, default_dead_letter_queue, parse_time};
use crate::policy::CodeMatch;
use crate::source::{self, Source, SourceOptions};

#[derive(Debug, Clone, Args)]
pub struct DlqArgs {
    #[command(subcommand)]
    pub action: DlqAction,
}

#[derive(Debug, Clone, Subcommand)]
pub enum DlqAction {
    /// One line per dead letter, oldest first (newest last).
    List {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        filter: Filter,
        /// text: one line each; json: JSON lines with every field and the body.
        #[arg(long, env = "COURIER_OUTPUT", value_enum, default_value = "text")]
        output: Output,
    },
    /// The whole dead letter: metadata, headers, body.
    Show {
        #[command(flatten)]
        target: Target,
        /// The dead letter's id, as `list` prints it.
        id: String,
        #[arg(long, env = "COURIER_OUTPUT", value_enum, default_value = "text")]
        output: Output,
    },
    /// Sends dead letters back to the work queue (attempt count reset, the
    /// original Idempotency-Key kept).
    Replay {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        filter: Filter,
        #[command(flatten)]
        selection: Selection,
        /// List what would move, move nothing.
        #[arg(long, env = "COURIER_DRY_RUN")]
        dry_run: bool,
        /// At most this many messages per second, so a replay does not flatten
        /// an app that just recovered.
        #[arg(long, env = "COURIER_RATE")]
        rate: Option<f64>,
    },
    /// Deletes dead letters; refuses without --yes.
    Purge {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        filter: Filter,
        #[command(flatten)]
        selection: Selection,
        /// Really delete.
        #[arg(long, env = "COURIER_YES")]
        yes: bool,
    },
}

#[derive(Debug, Clone, Args)]
pub struct Target {
    #[command(flatten)]
    pub source: SourceArgs,
    /// The dead-letter queue, when the policy names one other than <queue>.dlq.
    #[arg(long, env = "COURIER_DLQ")]
    pub dlq: Option<String>,
}

#[derive(Debug, Clone, Default, Args)]
pub struct Filter {
    /// Only this reason: permanent-status, attempts-exhausted or undeliverable.
    #[arg(long, env = "COURIER_REASON")]
    pub reason: Option<String>,
    /// Only this last HTTP status, exact ("400") or class ("4xx").
    #[arg(long, env = "COURIER_STATUS")]
    pub status: Option<String>,
    /// Only dead letters whose last attempt is older than this (e.g. 1h).
    #[arg(long, env = "COURIER_OLDER_THAN", value_parser = duration::parse_flag)]
    pub older_than: Option<Duration>,
    /// Only dead letters whose last attempt is newer than this.
    #[arg(long, env = "COURIER_NEWER_THAN", value_parser = duration::parse_flag)]
    pub newer_than: Option<Duration>,
    /// At most this many, oldest first.
    #[arg(long, env = "COURIER_LIMIT")]
    pub limit: Option<usize>,
}

#[derive(Debug, Clone, Default, Args)]
pub struct Selection {
    /// A dead letter's id; repeatable.
    #[arg(long = "id", env = "COURIER_ID")]
    pub ids: Vec<String>,
    /// Every dead letter (with filters: every one that matches).
    #[arg(long, env = "COURIER_ALL")]
    pub all: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Text,
    Json,
}

const REASONS: [&str; 3] = ["permanent-status", "attempts-exhausted", "undeliverable"];

impl Filter {
    fn check(&self) -> Result<Option<CodeMatch>, UsageError> {
        if let Some(reason) = &self.reason
            && !REASONS.contains(&reason.as_str())
        {
            return Err(UsageError(format!(
                "--reason {reason:?} is not a reason; use one of {}",
                REASONS.join(", ")
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

fn age(letter: &DeadLetter, now: SystemTime) -> Option<Duration> {
    let at = parse_time(letter.field(F_LAST_ATTEMPT_AT)?.as_bytes())?;
    Some(now.duration_since(at).unwrap_or_default())
}

/// Ages the way people read them: `42s`, `17m`, `3h`, `2d`.
fn short_age(age: Option<Duration>) -> String {
    let Some(age) = age else { return "?".into() };
    let s = age.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86_400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

async fn open(target: &Target) -> anyhow::Result<(Arc<dyn Source>, String)> {
    let url = parse_source(&target.source.source)?;
    check_queue(&target.source.queue)?;
    let queue = &target.source.queue;
    let dlq = target
        .dlq
        .clone()
        .unwrap_or_else(|| default_dead_letter_queue(queue));
    let mut options = SourceOptions::new(queue);
    options.dead_letter_queue = dlq.clone();
    let source = source::open(&url, options)
        .await
        .with_context(|| format!("cannot open --source {url}"))?;
    Ok((source, dlq))
}

/// The dead letters a command acts on: the ids given, or those matching
/// the filters.
async fn select(
    source: &Arc<dyn Source>,
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

fn require_selection(verb: &str, filter: &Filter, selection: &Selection) -> Result<(), UsageError> {
    if selection.ids.is_empty() && !selection.all && !filter.is_set() {
        return Err(UsageError(format!(
            "{verb} needs --id ID (repeatable), a filter (--reason, --status, --older-than, --newer-than), or --all"
        )));
    }
    Ok(())
}

/// A dead letter as one JSON object: every field, and the body (base64
/// when it is not UTF-8).
pub fn to_json(letter: &DeadLetter) -> serde_json::Value {
    let mut courier = serde_json::Map::new();
    let mut headers = serde_json::Map::new();
    for (name, value) in &letter.fields {
        let map = if name.to_ascii_lowercase().starts_with("courier-") {
            &mut courier
        } else {
            &mut headers
        };
        map.insert(name.clone(), serde_json::Value::String(value.clone()));
    }
    let (body, encoding) = match std::str::from_utf8(&letter.body) {
        Ok(text) => (text.to_string(), "utf-8"),
        Err(_) => (
            base64::engine::general_purpose::STANDARD.encode(&letter.body),
            "base64",
        ),
    };
    let mut out = serde_json::Map::new();
    out.insert("id".into(), letter.id.clone().into());
    out.extend(courier);
    out.insert("headers".into(), headers.into());
    out.insert("body".into(), body.into());
    out.insert("body_encoding".into(), encoding.into());
    out.into()
}

fn line(letter: &DeadLetter, now: SystemTime) -> String {
    let excerpt: String = letter
        .field("courier-response-excerpt")
        .unwrap_or_default()
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(60)
        .collect();
    format!(
        "{:<22} {:>5}  {:<18} {:>6} {:>8}  {}",
        letter.id,
        short_age(age(letter, now)),
        letter.field("courier-reason").unwrap_or("?"),
        letter
            .field("courier-status")
            .filter(|s| !s.is_empty())
            .unwrap_or("-"),
        letter.field("courier-attempts").unwrap_or("?"),
        excerpt
    )
}

pub async fn run(args: DlqArgs) -> anyhow::Result<ExitCode> {
    let mut out = std::io::stdout().lock();
    match args.action {
        DlqAction::List {
            target,
            filter,
            output,
        } => {
            let (source, dlq) = open(&target).await?;
            let (letters, _) = select(&source, &dlq, &filter, &[]).await?;
            let now = SystemTime::now();
            if output == Output::Text {
                writeln!(
                    out,
                    "{:<22} {:>5}  {:<18} {:>6} {:>8}  EXCERPT",
                    "ID", "AGE", "REASON", "STATUS", "ATTEMPTS"
                )?;
            }
            for letter in &letters {
                match output {
                    Output::Text => writeln!(out, "{}", line(letter, now))?,
                    Output::Json => writeln!(out, "{}", to_json(letter))?,
                }
            }
            source.close().await;
            Ok(ExitCode::SUCCESS)
        }
        DlqAction::Show { target, id, output } => {
            let (source, dlq) = open(&target).await?;
            let (letters, missing) =
                select(&source, &dlq, &Filter::default(), std::slice::from_ref(&id)).await?;
            source.close().await;
            let Some(letter) = letters.first() else {
                eprintln!(
                    "error: no dead letter {} in {dlq}",
                    missing.first().unwrap_or(&id)
                );
                return Ok(ExitCode::FAILURE);
            };
            match output {
                Output::Json => writeln!(out, "{}", to_json(letter))?,
                Output::Text => {
                    writeln!(out, "id: {}", letter.id)?;
                    for (name, value) in letter
                        .fields
                        .iter()
                        .filter(|(n, _)| n.starts_with("courier-"))
                    {
                        writeln!(out, "{name}: {value}")?;
                    }
                    writeln!(out, "headers:")?;
                    for (name, value) in letter
                        .fields
                        .iter()
                        .filter(|(n, _)| !n.starts_with("courier-"))
                    {
                        writeln!(out, "  {name}: {value}")?;
                    }
                    match std::str::from_utf8(&letter.body) {
                        Ok(text) => writeln!(out, "body ({} bytes):\n{text}", letter.body.len())?,
                        Err(_) => writeln!(
                            out,
                            "body ({} bytes, base64):\n{}",
                            letter.body.len(),
                            base64::engine::general_purpose::STANDARD.encode(&letter.body)
                        )?,
                    }
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        DlqAction::Replay {
            target,
            filter,
            selection,
            dry_run,
            rate,
        } => {
            require_selection("replay", &filter, &selection)?;
            if let Some(rate) = rate
                && !(rate.is_finite() && rate > 0.0)
            {
                return Err(UsageError(format!(
                    "--rate {rate} must be a positive number of messages per second"
                ))
                .into());
            }
            let (source, dlq) = open(&target).await?;
            let (letters, missing) = select(&source, &dlq, &filter, &selection.ids).await?;
            let now = SystemTime::now();
            if dry_run {
                for letter in &letters {
                    writeln!(out, "would replay {}", line(letter, now))?;
                }
                writeln!(
                    out,
                    "{} dead letters would be replayed to {}",
                    letters.len(),
                    target.source.queue
                )?;
                source.close().await;
                return Ok(report_missing(&missing));
            }
            let pause = rate.map(|r| Duration::from_secs_f64(1.0 / r));
            let mut failures = Vec::new();
            let mut moved = 0usize;
            let mut next = tokio::time::Instant::now();
            for letter in &letters {
                if let Some(pause) = pause {
                    tokio::time::sleep_until(next).await;
                    next += pause;
                }
                match source.replay(&dlq, letter).await {
                    Ok(()) => {
                        moved += 1;
                        writeln!(out, "replayed {}", letter.id)?;
                    }
                    Err(e) => failures.push(format!("{}: {e}", letter.id)),
                }
            }
            source.close().await;
            writeln!(
                out,
                "{moved} dead letters replayed to {}",
                target.source.queue
            )?;
            Ok(report_failures(&failures, &missing))
        }
        DlqAction::Purge {
            target,
            filter,
            selection,
            yes,
        } => {
            require_selection("purge", &filter, &selection)?;
            let (source, dlq) = open(&target).await?;
            let (letters, missing) = select(&source, &dlq, &filter, &selection.ids).await?;
            if !yes {
                source.close().await;
                return Err(UsageError(format!(
                    "purge would delete {} dead letters from {dlq}; add --yes to delete them",
                    letters.len()
                ))
                .into());
            }
            let mut failures = Vec::new();
            let mut deleted = 0usize;
            for letter in &letters {
                match source.purge(&dlq, letter).await {
                    Ok(()) => deleted += 1,
                    Err(e) => failures.push(format!("{}: {e}", letter.id)),
                }
            }
            source.close().await;
            writeln!(out, "{deleted} dead letters deleted from {dlq}")?;
            Ok(report_failures(&failures, &missing))
        }
    }
}

fn report_missing(missing: &[String]) -> ExitCode {
    report_failures(&[], missing)
}

fn report_failures(failures: &[String], missing: &[String]) -> ExitCode {
    for id in missing {
        eprintln!("failed: {id}: no such dead letter");
    }
    for failure in failures {
        eprintln!("failed: {failure}");
    }
    if failures.is_empty() && missing.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn letter(reason: &str, status: &str, last: SystemTime) -> DeadLetter {
        DeadLetter {
            id: "1".into(),
            body: Bytes::from_static(&[0xff, 0x00]),
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

    #[test]
    fn filters() {
        let now = SystemTime::now();
        let hour_ago = letter("permanent-status", "400", now - Duration::from_secs(3600));
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

    #[test]
    fn json_keeps_binary_bodies() {
        let json = to_json(&letter("undeliverable", "", SystemTime::now()));
        assert_eq!(json["body_encoding"], "base64");
        assert_eq!(json["body"], "/wA=");
        assert_eq!(json["courier-reason"], "undeliverable");
        assert_eq!(json["headers"]["traceparent"], "00-x");
    }
}
