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

use super::args::{SealArgs, SourceArgs, UsageError};
use crate::duration;
use crate::model::default_dead_letter_queue;
use crate::source::{self, DeadLetterStore, SourceOptions};

mod filter;
mod show;

use filter::{require_selection, select};
use show::line;
pub use show::to_json;

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

async fn open(target: &Target) -> anyhow::Result<(Arc<dyn DeadLetterStore>, String)> {
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
                source.flush().await;
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
            source.flush().await;
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
                source.flush().await;
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
            source.flush().await;
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
