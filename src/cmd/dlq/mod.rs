//! `courier dlq`: inspect, replay, edit and purge dead letters, the same
//! words for every source.
//!
//! Exit codes: 0 done, 1 some dead letters failed (each failure is listed),
//! 2 bad usage (including `purge` without `--yes`, which says how many it
//! would delete).

use std::ffi::OsString;
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};

use super::args::{SealArgs, SourceArgs, UsageError};
use crate::duration;
use crate::model::default_dead_letter_queue;
use crate::source::{self, DeadLetterStore, SourceOptions};

pub(crate) mod audit;
pub(crate) mod edit;
pub(crate) mod filter;
pub(crate) mod jobs;
pub(crate) mod show;

use filter::{Walk, require_selection, select};
pub use show::to_json;
use show::{line, text};

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
        /// At most this many messages a second (50, 50/s, 600/m, 3600/h), so a
        /// replay does not flatten an app that just recovered.
        #[arg(long, env = "COURIER_RATE", value_parser = parse_rate)]
        rate: Option<f64>,
        /// Replay into this queue instead of --queue (whose dead letters they
        /// are), on the same --source; it must exist.
        #[arg(long, env = "COURIER_TO", value_name = "QUEUE")]
        to: Option<String>,
        /// Why, for the audit trail (the JSON line on stderr and the Event on
        /// the RetryPolicy), e.g. an incident number.
        #[arg(long, env = "COURIER_WHY")]
        why: Option<String>,
    },
    /// Changes one dead letter with a JSON Patch (RFC 6902) and replays it as
    /// replay does (attempt 1, the same Idempotency-Key, Courier-Replay-Count);
    /// its record keeps the digest of the original (courier-edited-from-digest).
    Edit {
        #[command(flatten)]
        target: Target,
        /// The dead letter's id, as `list` prints it.
        id: String,
        /// The JSON Patch file, `-` for standard input. It applies to
        /// {"headers": {"NAME": "VALUE", ...}, "body": BODY}: BODY is the body
        /// parsed as JSON when it is a JSON object or array, else its text; a
        /// body that is not UTF-8 is "body_base64" (its base64) instead of
        /// "body". courier-* fields are not in it and cannot be patched. E.g.
        /// [{"op":"replace","path":"/body/amount","value":5},
        /// {"op":"add","path":"/headers/x-fixed","value":"1"}]; `[]` with
        /// --dry-run prints the document as it is.
        #[arg(long, env = "COURIER_PATCH", value_name = "FILE")]
        patch: std::path::PathBuf,
        /// Print the edited document, change nothing.
        #[arg(long, env = "COURIER_DRY_RUN")]
        dry_run: bool,
        /// Why, for the audit trail (the JSON line on stderr and the Event on
        /// the RetryPolicy), e.g. an incident number.
        #[arg(long, env = "COURIER_WHY")]
        why: Option<String>,
    },
    /// The replay and purge jobs: list them (the default), resume one that
    /// was interrupted, cancel one.
    Jobs {
        #[command(subcommand)]
        action: JobsAction,
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
        /// Why, for the audit trail (the JSON line on stderr and the Event on
        /// the RetryPolicy); required, since a purge cannot be undone.
        #[arg(long, env = "COURIER_WHY")]
        why: Option<String>,
    },
}

#[derive(Debug, Clone, Subcommand)]
pub enum JobsAction {
    /// The replay and purge jobs on the dead-letter queue, oldest first:
    /// state (running, interrupted, done, cancelled), done/total, letters a
    /// second, when and by whom started, and why (the default).
    List {
        #[command(flatten)]
        target: Target,
        #[arg(long, env = "COURIER_OUTPUT", value_enum, default_value = "text")]
        output: Output,
    },
    /// Resumes an interrupted job (its process killed or gone): it acts on
    /// the letters of its snapshot still in the dead-letter queue, at its
    /// rate. Running the same replay or purge again resumes it too.
    Resume {
        #[command(flatten)]
        target: Target,
        /// The job's id, as `dlq jobs` lists it.
        id: String,
    },
    /// Stops a running job at its next letter (an interrupted one is marked
    /// cancelled, so nothing resumes it); the letters it did not reach stay
    /// in the dead-letter queue.
    Cancel {
        #[command(flatten)]
        target: Target,
        /// The job's id, as `dlq jobs` lists it.
        id: String,
        /// Why, for the audit trail.
        #[arg(long, env = "COURIER_WHY")]
        why: Option<String>,
    },
}

#[derive(Debug, Clone, Args)]
pub struct Target {
    #[command(flatten)]
    pub source: SourceArgs,
    #[command(flatten)]
    pub seal: SealArgs,
    /// The dead-letter queue [default: the policy's deadLetterQueue, else <queue>.dlq].
    #[arg(long, env = "COURIER_DLQ")]
    pub dlq: Option<String>,
    /// The policy file whose deadLetterQueue to use (the sidecar's --policy-file).
    #[arg(long, env = "COURIER_POLICY_FILE", conflicts_with = "policy")]
    pub policy_file: Option<std::path::PathBuf>,
    /// The RetryPolicy whose deadLetterQueue to use, read once from the
    /// cluster (the sidecar's --policy; in its container it is already set).
    #[arg(long, env = "COURIER_POLICY")]
    pub policy: Option<String>,
}

#[derive(Debug, Clone, Default, Args)]
pub struct Filter {
    /// Only this reason: permanent-status, attempts-exhausted, undeliverable or app-dead-letter.
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
    /// Only dead letters this expression (CEL) is true for, e.g. 'status >= 500 &&
    /// headers["x-tenant"] == "acme"'; ANDed with the other filters. Variables: reason, status, attempts, error, queue, first_attempt_at, last_attempt_at, age,
    /// headers, body (the JSON body), and of a CloudEvent type, source, subject, data
    /// (docs/design.md, "Dead-letter expressions").
    #[arg(
        long = "filter",
        env = "COURIER_FILTER",
        value_name = "EXPR",
        value_parser = crate::expr::Expr::parse
    )]
    pub expression: Option<crate::expr::Expr>,
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

/// The dead-letter queue the command works on: `--dlq`, else the one of the
/// policy the sidecar follows (`--policy-file`, `--policy`: the same
/// variables the sidecar reads, so that in its container the command finds
/// the letters where the sidecar put them), else `<queue>.dlq`.
async fn dead_letter_queue(target: &Target) -> anyhow::Result<String> {
    let queue = &target.source.queue;
    if let Some(dlq) = &target.dlq {
        return Ok(dlq.clone());
    }
    if let Some(path) = &target.policy_file {
        let policy = crate::policy::file::load(path).map_err(|e| UsageError(e.to_string()))?;
        return Ok(policy.dead_letter_queue_for(queue));
    }
    let Some(name) = &target.policy else {
        return Ok(default_dead_letter_queue(queue));
    };
    let policy_ref = crate::policy::cluster::PolicyRef::from_env(name).map_err(UsageError)?;
    let label = policy_ref.label();
    let (live, update) = crate::policy::LivePolicy::new(crate::policy::Policy::default());
    let (watcher, mut status) = crate::policy::cluster::follow(policy_ref, update, |_| {})
        .await
        .with_context(|| {
            format!("--policy {label}: cannot set up a Kubernetes API client; give --dlq instead")
        })?;
    let read = tokio::time::timeout(Duration::from_secs(15), status.wait_for(|s| s.read))
        .await
        .is_ok_and(|read| read.is_ok());
    let problem = status.borrow().problem.clone();
    watcher.abort();
    match (read, problem) {
        (true, None) => Ok(live.current().dead_letter_queue_for(queue)),
        (_, Some(problem)) => anyhow::bail!("--policy {label}: {problem}; give --dlq instead"),
        _ => anyhow::bail!("--policy {label}: not read within 15 s; give --dlq instead"),
    }
}

pub(crate) async fn open(target: &Target) -> anyhow::Result<(Arc<dyn DeadLetterStore>, String)> {
    let (url, tls, sasl) = target.source.parse()?;
    let queue = &target.source.queue;
    let dlq = dead_letter_queue(target).await?;
    let mut options = SourceOptions::new(queue);
    options.live.dead_letter_queue = dlq.clone();
    options.tls = tls;
    options.sasl = sasl;
    options.seal = target.seal.load()?;
    let source = source::open_admin(&url, options)
        .await
        .with_context(|| format!("cannot open --source {url}"))?;
    Ok((source, dlq))
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
            let now = SystemTime::now();
            if output == Output::Text {
                writeln!(
                    out,
                    "{:<22} {:>5}  {:<18} {:>6} {:>8}  EXCERPT",
                    "ID", "AGE", "REASON", "STATUS", "ATTEMPTS"
                )?;
            }
            // Printed as read: a page at a time, so the first lines of a
            // long queue come at once and nothing is gathered.
            let limit = filter.limit.unwrap_or(usize::MAX);
            Walk::new(&source, &dlq, &filter, &[])?
                .each(None, limit, true, async |letter| {
                    match output {
                        Output::Text => writeln!(out, "{}", line(&letter, now))?,
                        Output::Json => writeln!(out, "{}", to_json(&letter))?,
                    }
                    Ok(())
                })
                .await?;
            source.flush().await;
            Ok(ExitCode::SUCCESS)
        }
        DlqAction::Show { target, id, output } => {
            let (source, dlq) = open(&target).await?;
            let (letters, missing) =
                select(&source, &dlq, &Filter::default(), std::slice::from_ref(&id)).await?;
            source.flush().await;
            let Some(letter) = letters.first() else {
                eprintln!(
                    "error: no dead letter {} in {dlq}",
                    missing.first().unwrap_or(&id)
                );
                return Ok(ExitCode::FAILURE);
            };
            match output {
                Output::Json => writeln!(out, "{}", to_json(letter))?,
                Output::Text => write!(out, "{}", text(letter))?,
            }
            Ok(ExitCode::SUCCESS)
        }
        DlqAction::Replay {
            target,
            filter,
            selection,
            dry_run,
            rate,
            to,
            why,
        } => {
            require_selection("replay", &filter, &selection)?;
            let (source, dlq) = open(&target).await?;
            // Another queue's store writes the replays there, and reads and
            // removes the letters from this queue's dead-letter queue, which
            // every store takes by name.
            let (source, into) = match to {
                Some(to) if to != target.source.queue => {
                    let mut into = target.clone();
                    into.source.queue = to.clone();
                    into.dlq = Some(dlq.clone());
                    (open(&into).await?.0, to)
                }
                _ => (source, target.source.queue.clone()),
            };
            if dry_run {
                let now = SystemTime::now();
                let limit = filter.limit.unwrap_or(usize::MAX);
                let snapshot = Walk::new(&source, &dlq, &filter, &selection.ids)?
                    .each(None, limit, true, async |letter| {
                        writeln!(out, "would replay {}", line(&letter, now))?;
                        Ok(())
                    })
                    .await?;
                writeln!(
                    out,
                    "{} dead letters would be replayed to {into}",
                    snapshot.selected
                )?;
                source.flush().await;
                return Ok(report_missing(&snapshot.missing));
            }
            jobs::start(
                jobs::Bulk {
                    kind: jobs::Kind::Replay,
                    target: &target,
                    source,
                    dlq,
                    into,
                    filter,
                    selection,
                    rate,
                    why,
                },
                &mut out,
            )
            .await
        }
        DlqAction::Purge {
            target,
            filter,
            selection,
            yes,
            why,
        } => {
            require_selection("purge", &filter, &selection)?;
            let (source, dlq) = open(&target).await?;
            let why = why.filter(|w| !w.trim().is_empty());
            if !yes || why.is_none() {
                let limit = filter.limit.unwrap_or(usize::MAX);
                let snapshot = Walk::new(&source, &dlq, &filter, &selection.ids)?
                    .each(None, limit, true, async |_| Ok(()))
                    .await?;
                source.flush().await;
                let missing = match (yes, &why) {
                    (false, None) => "--yes --why TEXT",
                    (false, Some(_)) => "--yes",
                    (true, _) => "--why TEXT (the reason the audit trail records)",
                };
                return Err(UsageError(format!(
                    "purge would delete {} dead letters from {dlq}; add {missing} to delete them",
                    snapshot.selected
                ))
                .into());
            }
            jobs::start(
                jobs::Bulk {
                    kind: jobs::Kind::Purge,
                    target: &target,
                    source,
                    dlq,
                    into: target.source.queue.clone(),
                    filter,
                    selection,
                    rate: None,
                    why,
                },
                &mut out,
            )
            .await
        }
        DlqAction::Edit {
            target,
            id,
            patch,
            dry_run,
            why,
        } => edit::run(&target, &id, &patch, dry_run, why.as_deref(), &mut out).await,
        DlqAction::Jobs { action } => match action {
            JobsAction::List { target, output } => jobs::list(&target, output, &mut out).await,
            JobsAction::Resume { target, id } => jobs::resume(&target, &id, &mut out).await,
            JobsAction::Cancel { target, id, why } => {
                jobs::cancel(&target, &id, why, &mut out).await
            }
        },
    }
}

/// The command line with `list` put after `dlq jobs` when no subcommand
/// follows (`courier dlq jobs --queue q` lists): clap has no default
/// subcommand, and a list flattened beside the subcommands would make
/// `--source` and `--queue` required before them.
pub fn with_jobs_list(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    let mut args: Vec<OsString> = args.into_iter().collect();
    let at = args
        .windows(2)
        .position(|w| w[0] == "dlq" && w[1] == "jobs")
        .map(|i| i + 2);
    if let Some(at) = at {
        let bare = match args.get(at).and_then(|a| a.to_str()) {
            None => true,
            Some("-h" | "--help") => false,
            Some(next) => next.starts_with('-'),
        };
        if bare {
            args.insert(at, "list".into());
        }
    }
    args
}

/// `--rate`: messages a second, from `N`, `N/s`, `N/m` or `N/h`.
pub(crate) fn parse_rate(text: &str) -> Result<f64, String> {
    let (number, per) = match text.trim().split_once('/') {
        Some((n, unit)) => (n, unit.trim()),
        None => (text.trim(), "s"),
    };
    let seconds = match per {
        "s" | "sec" | "second" => 1.0,
        "m" | "min" | "minute" => 60.0,
        "h" | "hour" => 3600.0,
        _ => {
            return Err(format!(
                "{per:?} is not a unit: write 50, 50/s, 600/m or 3600/h"
            ));
        }
    };
    match number.trim().parse::<f64>() {
        Ok(n) if n.is_finite() && n > 0.0 => Ok(n / seconds),
        _ => Err(format!(
            "{number:?} is not a positive number of messages: write 50, 50/s, 600/m or 3600/h"
        )),
    }
}

/// A bulk command's progress on a terminal: one line on stderr, redrawn at
/// most a few times a second, so a replay of a million letters at a
/// `--rate` says how far it is; nothing when stderr is not a terminal
/// (a script, `kubectl exec` without `-t`).
struct Progress {
    verb: &'static str,
    total: usize,
    started: tokio::time::Instant,
    shown: Option<tokio::time::Instant>,
    on: bool,
}

impl Progress {
    const EVERY: Duration = Duration::from_millis(250);

    fn new(verb: &'static str, total: usize) -> Self {
        use std::io::IsTerminal;
        Self {
            verb,
            total,
            started: tokio::time::Instant::now(),
            shown: None,
            on: std::io::stderr().is_terminal(),
        }
    }

    fn show(&mut self, done: usize) {
        let now = tokio::time::Instant::now();
        if !self.on || self.shown.is_some_and(|at| now - at < Self::EVERY) && done < self.total {
            return;
        }
        self.shown = Some(now);
        let secs = (now - self.started).as_secs_f64();
        let rate = if secs > 0.0 { done as f64 / secs } else { 0.0 };
        eprint!("\r{} {done}/{} ({rate:.0}/s)\x1b[K", self.verb, self.total);
    }

    fn end(&self) {
        if self.on && self.shown.is_some() {
            eprintln!();
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
    use std::ffi::OsString;

    use super::{parse_rate, with_jobs_list};

    #[test]
    fn a_bare_jobs_lists() {
        let run = |line: &str| -> String {
            with_jobs_list(line.split(' ').map(OsString::from))
                .iter()
                .map(|a| a.to_str().unwrap())
                .collect::<Vec<_>>()
                .join(" ")
        };
        for (given, parsed) in [
            ("courier dlq jobs", "courier dlq jobs list"),
            (
                "courier dlq jobs --queue q",
                "courier dlq jobs list --queue q",
            ),
            (
                "courier --log-level debug dlq jobs",
                "courier --log-level debug dlq jobs list",
            ),
            ("courier dlq jobs cancel x", "courier dlq jobs cancel x"),
            ("courier dlq jobs --help", "courier dlq jobs --help"),
            (
                "courier dlq list --queue jobs",
                "courier dlq list --queue jobs",
            ),
        ] {
            assert_eq!(run(given), parsed, "{given}");
        }
    }

    #[test]
    fn rates_read_per_second() {
        for (text, per_second) in [
            ("50", 50.0),
            ("50/s", 50.0),
            ("0.5", 0.5),
            ("600/m", 10.0),
            ("3600/h", 1.0),
            (" 120 / min ", 2.0),
        ] {
            assert_eq!(parse_rate(text), Ok(per_second), "{text}");
        }
        for text in ["0", "-3", "fast", "50/d", "NaN", "inf/s", ""] {
            let err = parse_rate(text).expect_err(text);
            assert!(err.contains("50/s, 600/m or 3600/h"), "{text}: {err}");
        }
    }
}
