//! Replays and purges as jobs: each has an id and a record on the broker,
//! beside the dead-letter queue ([`DeadLetterStore::put_job_record`]), that
//! says what it selected (the selection flags, the snapshot's instant, count
//! and last letter), how far it got, who started it and why. So
//! `courier dlq jobs` lists them from anywhere, `jobs cancel` stops one
//! from another process, and a job whose process died (`kill -9`, a node
//! gone) is resumed, by `jobs resume ID` or by running the same command
//! again.
//!
//! The dead-letter queue is the job's progress: a letter replayed or
//! purged is no longer in it, so a resumed job walks what is left of its
//! snapshot, judged at the snapshot's instant, and acts on exactly the
//! letters the killed process had not. Where a replay is one change on the
//! broker ([`Capabilities::exact_replay`]), every letter then ends in
//! exactly one place; elsewhere the letter in flight at the kill may be in
//! both.
//!
//! A running job rewrites its record every [`HEARTBEAT`] and looks for a
//! cancel between letters, at most every [`CANCEL_CHECK`]. It is taken for
//! dead when its process is gone (same host) or it has not been heard
//! from for [`STALE`].
//!
//! [`Capabilities::exact_replay`]: crate::source::Capabilities::exact_replay

use std::collections::HashMap;
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::audit::{self, Auditor};
use super::filter::Walk;
use super::{Filter, Output, Progress, Selection, Target, open, report_failures};
use crate::cmd::args::UsageError;
use crate::duration;
use crate::model::rfc3339;
use crate::source::{DeadLetterStore, ErrorKind, JOB_RECORD_MAX};

/// How often a running job rewrites its record (its progress, and that it
/// is alive).
const HEARTBEAT: Duration = Duration::from_secs(1);
/// How often, at most, a running job looks for a cancel: between two
/// letters, so a cancel stops it at the next one.
const CANCEL_CHECK: Duration = Duration::from_millis(250);
/// A job not heard from for this long is taken for dead, where its process
/// cannot be looked at (another host).
const STALE: Duration = Duration::from_secs(10);
/// Finished jobs' records are kept this long, then removed by the next job
/// that starts on the queue.
const KEEP_FINISHED: Duration = Duration::from_secs(7 * 24 * 3600);
/// At most this many finished jobs' records are kept per dead-letter queue.
const KEEP_AT_MOST: usize = 50;
/// How long `jobs cancel` waits for a running job to stop.
const CANCEL_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Kind {
    Replay,
    Purge,
}

impl Kind {
    fn verb(self) -> &'static str {
        match self {
            Kind::Replay => "replay",
            Kind::Purge => "purge",
        }
    }

    fn audit(self) -> audit::Action {
        match self {
            Kind::Replay => audit::Action::Replay,
            Kind::Purge => audit::Action::Purge,
        }
    }
}

/// A job's state as recorded. A `running` job whose process is gone is
/// shown as `interrupted` ([`Job::shown_state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum State {
    Running,
    Done,
    Cancelled,
}

/// The selection a job was started with, kept so that a resume selects the
/// same letters: the flags as given, the expression as its text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Spec {
    reason: Option<String>,
    status: Option<String>,
    older_than_ms: Option<u64>,
    newer_than_ms: Option<u64>,
    filter: Option<String>,
    ids: Vec<String>,
}

impl Spec {
    fn of(filter: &Filter, selection: &Selection) -> Self {
        Self {
            reason: filter.reason.clone(),
            status: filter.status.clone(),
            older_than_ms: filter.older_than.map(|d| d.as_millis() as u64),
            newer_than_ms: filter.newer_than.map(|d| d.as_millis() as u64),
            filter: filter.expression.as_ref().map(|e| e.source().to_string()),
            ids: selection.ids.clone(),
        }
    }

    fn filter(&self) -> anyhow::Result<Filter> {
        Ok(Filter {
            reason: self.reason.clone(),
            status: self.status.clone(),
            older_than: self.older_than_ms.map(Duration::from_millis),
            newer_than: self.newer_than_ms.map(Duration::from_millis),
            expression: self
                .filter
                .as_deref()
                .map(crate::expr::Expr::parse)
                .transpose()
                .map_err(|e| anyhow::anyhow!("the job's --filter no longer parses: {e}"))?,
            limit: None,
        })
    }
}

/// A job's record on the broker, as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Job {
    id: String,
    kind: Kind,
    /// `--queue`: whose dead letters they are.
    queue: String,
    /// Where a replay writes (`--to`, else `queue`).
    into: String,
    dead_letter_queue: String,
    /// The selection flags as an operator would type them again.
    selection: String,
    spec: Spec,
    /// The snapshot: its instant (ms since the epoch), its count, its last
    /// letter.
    snapshot_at_ms: u64,
    total: usize,
    through: Option<String>,
    done: usize,
    failed: usize,
    rate: Option<f64>,
    state: State,
    started_at_ms: u64,
    heard_at_ms: u64,
    finished_at_ms: Option<u64>,
    by: String,
    why: Option<String>,
    /// Where the process that runs it is: its host, pid and the pid's
    /// start time (so a reused pid is not taken for it).
    host: String,
    pid: u32,
    pid_started: Option<u64>,
    cancelled_by: Option<String>,
    /// How many times it was resumed.
    resumed: u32,
}

/// A request to stop job `job`, under key `<job>-cancel`: a record of its
/// own, so that the running job's heartbeat cannot overwrite it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Cancel {
    job: String,
    by: String,
    at_ms: u64,
    why: Option<String>,
}

fn millis(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

fn instant(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

fn cancel_key(job: &str) -> String {
    format!("{job}-cancel")
}

fn host_name() -> String {
    std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// A process's start time, in clock ticks after boot (`/proc/PID/stat`,
/// field 22): with the pid, it names one process across pid reuse.
fn process_started(pid: u32) -> Option<u64> {
    start_in_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

fn start_in_stat(stat: &str) -> Option<u64> {
    // The command name (field 2) may hold spaces and parentheses; the
    // fields after it start after its last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

impl Job {
    /// Whether the process running it is alive, as far as can be told.
    fn alive(&self, now: SystemTime) -> bool {
        if self.host == host_name() && !self.host.is_empty() {
            return process_started(self.pid).is_some_and(|s| Some(s) == self.pid_started);
        }
        now.duration_since(instant(self.heard_at_ms))
            .is_ok_and(|quiet| quiet < STALE)
            || instant(self.heard_at_ms) > now
    }

    fn shown_state(&self, now: SystemTime) -> &'static str {
        match self.state {
            State::Running if self.alive(now) => "running",
            State::Running => "interrupted",
            State::Done => "done",
            State::Cancelled => "cancelled",
        }
    }

    fn finished(&self) -> bool {
        self.state != State::Running
    }

    /// Letters a second since it started, over its whole life.
    fn pace(&self) -> f64 {
        let end = self.finished_at_ms.unwrap_or(self.heard_at_ms);
        let secs = end.saturating_sub(self.started_at_ms) as f64 / 1000.0;
        if secs > 0.0 {
            self.done as f64 / secs
        } else {
            0.0
        }
    }

    fn to_json(&self, now: SystemTime) -> serde_json::Value {
        let mut json = serde_json::to_value(self).unwrap_or_default();
        json["state"] = self.shown_state(now).into();
        json["started_at"] = rfc3339(instant(self.started_at_ms)).into();
        json["heard_at"] = rfc3339(instant(self.heard_at_ms)).into();
        json
    }
}

/// The jobs on a dead-letter queue, and the cancels asked for.
struct Board {
    jobs: Vec<Job>,
    cancels: HashMap<String, Cancel>,
}

async fn board(source: &Arc<dyn DeadLetterStore>, dlq: &str) -> anyhow::Result<Board> {
    let mut board = Board {
        jobs: Vec::new(),
        cancels: HashMap::new(),
    };
    for (key, record) in source.job_records(dlq).await? {
        if let Ok(job) = serde_json::from_slice::<Job>(&record) {
            if job.id == key {
                board.jobs.push(job);
            }
        } else if let Ok(cancel) = serde_json::from_slice::<Cancel>(&record)
            && key == cancel_key(&cancel.job)
        {
            board.cancels.insert(cancel.job.clone(), cancel);
        }
    }
    board.jobs.sort_by_key(|j| j.started_at_ms);
    Ok(board)
}

async fn put(source: &Arc<dyn DeadLetterStore>, job: &Job) -> anyhow::Result<()> {
    let record = serde_json::to_vec(job)?;
    anyhow::ensure!(
        record.len() <= JOB_RECORD_MAX,
        "the job's record is {} bytes, over the {JOB_RECORD_MAX} a record may take; select \
         fewer letters by --id, or by --filter",
        record.len()
    );
    source
        .put_job_record(&job.dead_letter_queue, &job.id, Bytes::from(record))
        .await?;
    Ok(())
}

/// A replay or purge about to run: what the command was given.
pub(crate) struct Bulk<'a> {
    pub kind: Kind,
    pub target: &'a Target,
    pub source: Arc<dyn DeadLetterStore>,
    pub dlq: String,
    pub into: String,
    pub filter: Filter,
    pub selection: Selection,
    pub rate: Option<f64>,
    pub why: Option<String>,
}

/// Starts a job for `bulk`, or resumes the interrupted one with the same
/// selection, and runs it to its end.
pub(crate) async fn start(bulk: Bulk<'_>, out: &mut impl Write) -> anyhow::Result<ExitCode> {
    let auditor = Auditor::connect(bulk.target).await;
    let selection_text = audit::describe(&bulk.filter, &bulk.selection);
    let now = SystemTime::now();
    let board = match board(&bulk.source, &bulk.dlq).await {
        Ok(board) => Some(board),
        Err(e) => {
            if e.downcast_ref::<crate::source::SourceError>()
                .is_none_or(|e| e.kind() != ErrorKind::Invalid)
            {
                return Err(e.context(format!(
                    "cannot read the dlq job records of {}; nothing was done",
                    bulk.dlq
                )));
            }
            eprintln!(
                "warning: {e:#}; this {} runs as before, unrecorded",
                bulk.kind.verb()
            );
            None
        }
    };
    if let Some(board) = &board {
        let same = |job: &&Job| {
            !job.finished()
                && job.kind == bulk.kind
                && job.into == bulk.into
                && job.selection == selection_text
                && job.rate == bulk.rate
        };
        if let Some(job) = board.jobs.iter().find(same) {
            if job.alive(now) {
                return Err(UsageError(format!(
                    "job {} with this selection is running (pid {} on {}, {}/{} done); wait for it, \
                     or stop it: courier dlq jobs cancel {}",
                    job.id, job.pid, job.host, job.done, job.total, job.id
                ))
                .into());
            }
            writeln!(
                out,
                "resuming job {}: interrupted at {} of {}",
                job.id, job.done, job.total
            )?;
            return resume_job(job.clone(), bulk.source, &bulk.dlq, &auditor, out).await;
        }
        prune(&bulk.source, &bulk.dlq, board, now).await;
    }

    let limit = bulk.filter.limit.unwrap_or(usize::MAX);
    let mut walk = Walk::new(&bulk.source, &bulk.dlq, &bulk.filter, &bulk.selection.ids)?;
    let snapshot = walk.each(None, limit, true, async |_| Ok(())).await?;
    let job = Job {
        id: format!("{}-{:08x}", bulk.kind.verb(), rand::random::<u32>()),
        kind: bulk.kind,
        queue: bulk.target.source.queue.clone(),
        into: bulk.into.clone(),
        dead_letter_queue: bulk.dlq.clone(),
        selection: selection_text,
        spec: Spec::of(&bulk.filter, &bulk.selection),
        snapshot_at_ms: millis(walk.now()),
        total: snapshot.selected,
        through: snapshot.last.clone(),
        done: 0,
        failed: 0,
        rate: bulk.rate,
        state: State::Running,
        started_at_ms: millis(now),
        heard_at_ms: millis(SystemTime::now()),
        finished_at_ms: None,
        by: auditor.by.clone(),
        why: bulk.why.clone(),
        host: host_name(),
        pid: std::process::id(),
        pid_started: process_started(std::process::id()),
        cancelled_by: None,
        resumed: 0,
    };
    let recorded = board.is_some() && snapshot.selected > 0;
    if recorded {
        put(&bulk.source, &job).await?;
        eprintln!(
            "job {}: {} {} dead letters; `courier dlq jobs` follows it",
            job.id,
            bulk.kind.verb(),
            job.total
        );
    }
    let missing = snapshot.missing;
    run(job, recorded, &bulk.source, walk, &auditor, missing, out).await
}

/// Resumes `job`, whose process is gone: counts what is left of its
/// snapshot (the letters still in the dead-letter queue), then acts on it.
async fn resume_job(
    mut job: Job,
    source: Arc<dyn DeadLetterStore>,
    dlq: &str,
    auditor: &Auditor,
    out: &mut impl Write,
) -> anyhow::Result<ExitCode> {
    // Where reading a letter hides it (SQS, Pub/Sub), the letter the killed
    // process held shows again only when its lease ends; walked before, it
    // would count as done and stay behind.
    if let Some(lease) = source.browse_lease() {
        let shown_by = instant(job.heard_at_ms) + HEARTBEAT + lease + Duration::from_secs(1);
        if let Ok(wait) = shown_by.duration_since(SystemTime::now()) {
            eprintln!(
                "job {}: waiting {} for the letters its stopped process held to show again",
                job.id,
                duration::format(Duration::from_secs(wait.as_secs() + 1))
            );
            tokio::time::sleep(wait).await;
        }
    }
    let filter = job.spec.filter()?;
    let ids = job.spec.ids.clone();
    let mut walk = Walk::new(&source, dlq, &filter, &ids)?.of_snapshot(instant(job.snapshot_at_ms));
    let remaining = job.total.saturating_sub(job.failed);
    let left = walk
        .each(job.through.as_deref(), remaining, false, async |_| Ok(()))
        .await?;
    // What is no longer there was done before the kill; the record, written
    // once a second, may say less.
    job.done = job.total.saturating_sub(job.failed + left.selected);
    job.pid = std::process::id();
    job.pid_started = process_started(job.pid);
    job.host = host_name();
    job.resumed += 1;
    job.heard_at_ms = millis(SystemTime::now());
    put(&source, &job).await?;
    eprintln!(
        "job {}: resumed by {}; {} of {} left",
        job.id, auditor.by, left.selected, job.total
    );
    run(job, true, &source, walk, auditor, Vec::new(), out).await
}

/// Acts on the walk's letters for `job`, keeping its record (when
/// `recorded`), then writes the summary and the audit line.
async fn run(
    mut job: Job,
    recorded: bool,
    source: &Arc<dyn DeadLetterStore>,
    mut walk: Walk<'_>,
    auditor: &Auditor,
    missing: Vec<String>,
    out: &mut impl Write,
) -> anyhow::Result<ExitCode> {
    let dlq = job.dead_letter_queue.clone();
    let mut pace = job.rate.map(Pace::new);
    let mut failures = Vec::new();
    let mut heard = tokio::time::Instant::now();
    let mut checked = tokio::time::Instant::now();
    let left = job.total.saturating_sub(job.done + job.failed);
    let mut progress = Progress::new(
        match job.kind {
            Kind::Replay => "replayed",
            Kind::Purge => "deleted",
        },
        job.total,
    );
    let mut cancel: Option<Cancel> = None;
    let through = job.through.clone();
    let walked = walk
        .each(through.as_deref(), left, false, async |letter| {
            if recorded && checked.elapsed() >= CANCEL_CHECK {
                checked = tokio::time::Instant::now();
                if let Ok(board) = board(source, &dlq).await {
                    cancel = board.cancels.get(&job.id).cloned();
                }
                if cancel.is_some() {
                    return Err(Stop.into());
                }
            }
            if let Some(pace) = &mut pace {
                pace.wait().await;
            }
            let acted = match job.kind {
                Kind::Replay => source.replay(&dlq, &letter).await,
                Kind::Purge => source.purge(&dlq, &letter).await,
            };
            match acted {
                Ok(()) => {
                    job.done += 1;
                    if job.kind == Kind::Replay {
                        writeln!(out, "replayed {}", letter.id)?;
                    }
                }
                Err(e) => {
                    job.failed += 1;
                    failures.push(format!("{}: {e}", letter.id));
                }
            }
            progress.show(job.done + job.failed);
            if recorded && heard.elapsed() >= HEARTBEAT {
                heard = tokio::time::Instant::now();
                job.heard_at_ms = millis(SystemTime::now());
                if let Err(e) = put(source, &job).await {
                    eprintln!("warning: job {}: its record was not updated: {e:#}", job.id);
                }
            }
            Ok(())
        })
        .await;
    progress.end();
    source.flush().await;
    let stopped = match walked {
        Ok(_) => false,
        Err(e) if e.is::<Stop>() => true,
        Err(e) => {
            if recorded {
                job.heard_at_ms = millis(SystemTime::now());
                let _ = put(source, &job).await;
            }
            return Err(e.context(format!(
                "job {} stopped at {} of {}; resume it: courier dlq jobs resume {}",
                job.id, job.done, job.total, job.id
            )));
        }
    };
    let now = SystemTime::now();
    job.state = if stopped {
        State::Cancelled
    } else {
        State::Done
    };
    job.heard_at_ms = millis(now);
    job.finished_at_ms = Some(millis(now));
    job.cancelled_by = cancel.as_ref().map(|c| c.by.clone());
    if recorded {
        put(source, &job).await?;
        if stopped {
            let _ = source.remove_job_record(&dlq, &cancel_key(&job.id)).await;
        }
    }
    match job.kind {
        Kind::Replay => writeln!(out, "{} dead letters replayed to {}", job.done, job.into)?,
        Kind::Purge => writeln!(out, "{} dead letters deleted from {dlq}", job.done)?,
    }
    auditor
        .write(
            &audit::Record {
                action: job.kind.audit(),
                queue: &job.into,
                dead_letter_queue: &dlq,
                selection: job.selection.clone(),
                selected: job.total,
                done: job.done,
                failed: job.failed + missing.len(),
                why: job.why.as_deref(),
                rate: job.rate,
                job: recorded.then_some(job.id.as_str()),
            },
            None,
        )
        .await;
    if let Some(cancel) = cancel {
        writeln!(
            out,
            "job {} cancelled by {} after {} of {}; the rest stay in {dlq}",
            job.id, cancel.by, job.done, job.total
        )?;
        report_failures(&failures, &missing);
        return Ok(ExitCode::FAILURE);
    }
    Ok(report_failures(&failures, &missing))
}

/// Stops a job's walk at a cancel.
#[derive(Debug)]
struct Stop;

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("cancelled")
    }
}

impl std::error::Error for Stop {}

/// Removes the records of finished jobs past [`KEEP_FINISHED`], and the
/// oldest beyond [`KEEP_AT_MOST`], and cancels left by jobs that are
/// finished: what bounds the records on a queue.
async fn prune(source: &Arc<dyn DeadLetterStore>, dlq: &str, board: &Board, now: SystemTime) {
    let finished: Vec<&Job> = board.jobs.iter().filter(|j| j.finished()).collect();
    let excess = finished.len().saturating_sub(KEEP_AT_MOST);
    let old = |job: &&Job| {
        now.duration_since(instant(job.finished_at_ms.unwrap_or(job.heard_at_ms)))
            .is_ok_and(|age| age > KEEP_FINISHED)
    };
    let mut keys: Vec<String> = finished
        .iter()
        .enumerate()
        .filter(|(i, job)| *i < excess || old(job))
        .map(|(_, job)| job.id.clone())
        .collect();
    keys.extend(
        board
            .cancels
            .keys()
            .filter(|id| board.jobs.iter().all(|j| &j.id != *id || j.finished()))
            .map(|id| cancel_key(id)),
    );
    for key in keys {
        if let Err(e) = source.remove_job_record(dlq, &key).await {
            eprintln!("warning: could not remove the old job record {key}: {e}");
        }
    }
}

/// `courier dlq jobs`: the jobs on the queue's dead-letter queue, oldest
/// first.
pub(crate) async fn list(
    target: &Target,
    output: Output,
    out: &mut impl Write,
) -> anyhow::Result<ExitCode> {
    let (source, dlq) = open(target).await?;
    let board = board(&source, &dlq).await?;
    let now = SystemTime::now();
    if output == Output::Text {
        writeln!(
            out,
            "{:<16} {:<11} {:>13} {:>8}  {:<24} {:<20} WHY",
            "ID", "STATE", "DONE/TOTAL", "RATE", "STARTED", "BY"
        )?;
    }
    for job in &board.jobs {
        match output {
            Output::Json => writeln!(out, "{}", job.to_json(now))?,
            Output::Text => writeln!(
                out,
                "{:<16} {:<11} {:>13} {:>8}  {:<24} {:<20} {}",
                job.id,
                job.shown_state(now),
                format!("{}/{}", job.done, job.total),
                format!("{:.1}/s", job.pace()),
                rfc3339(instant(job.started_at_ms)),
                job.by,
                job.why.as_deref().unwrap_or("-"),
            )?,
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Finds job `id` on the queue's dead-letter queue.
async fn find(
    source: &Arc<dyn DeadLetterStore>,
    dlq: &str,
    id: &str,
) -> anyhow::Result<(Job, Board)> {
    let board = board(source, dlq).await?;
    let job = board.jobs.iter().find(|j| j.id == id).cloned().ok_or_else(|| {
        UsageError(format!(
            "no job {id} on {dlq}; `courier dlq jobs` lists them (with the same --source, --queue and --dlq)"
        ))
    })?;
    Ok((job, board))
}

/// `courier dlq jobs resume ID`.
pub(crate) async fn resume(
    target: &Target,
    id: &str,
    out: &mut impl Write,
) -> anyhow::Result<ExitCode> {
    let (source, dlq) = open(target).await?;
    let (job, _) = find(&source, &dlq, id).await?;
    let now = SystemTime::now();
    match job.shown_state(now) {
        "interrupted" => {}
        "running" => {
            return Err(UsageError(format!(
                "job {id} is running (pid {} on {}, heard from {} ago); if that process is gone, \
                 try again in {}",
                job.pid,
                job.host,
                duration::format(
                    now.duration_since(instant(job.heard_at_ms))
                        .unwrap_or_default()
                ),
                duration::format(STALE)
            ))
            .into());
        }
        state => {
            return Err(
                UsageError(format!("job {id} is {state}; there is nothing to resume")).into(),
            );
        }
    }
    // A replay `--to` another queue writes through that queue's store.
    let source = if job.kind == Kind::Replay && job.into != target.source.queue {
        let mut into = target.clone();
        into.source.queue = job.into.clone();
        into.dlq = Some(dlq.clone());
        open(&into).await?.0
    } else {
        source
    };
    let auditor = Auditor::connect(target).await;
    resume_job(job, source, &dlq, &auditor, out).await
}

/// `courier dlq jobs cancel ID`: a running job stops at its next letter;
/// an interrupted one is marked cancelled, so that nothing resumes it.
pub(crate) async fn cancel(
    target: &Target,
    id: &str,
    why: Option<String>,
    out: &mut impl Write,
) -> anyhow::Result<ExitCode> {
    let (source, dlq) = open(target).await?;
    let auditor = Auditor::connect(target).await;
    let asked = ask_cancel(&source, &dlq, id, &auditor, why.as_deref()).await?;
    if let Asked::Cancelled(job) = asked {
        writeln!(
            out,
            "job {id} was interrupted at {} of {}; it is cancelled, and the rest stay in {dlq}",
            job.done, job.total
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    let deadline = tokio::time::Instant::now() + CANCEL_WAIT;
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(CANCEL_CHECK).await;
        let (job, _) = find(&source, &dlq, id).await?;
        if job.finished() {
            writeln!(
                out,
                "job {id} {} after {} of {}; the rest stay in {dlq}",
                if job.state == State::Cancelled {
                    "cancelled"
                } else {
                    "finished"
                },
                job.done,
                job.total
            )?;
            auditor
                .write(&cancel_record(&job, why.as_deref()), None)
                .await;
            return Ok(ExitCode::SUCCESS);
        }
    }
    writeln!(
        out,
        "cancel of job {id} asked; it did not stop within {}; it stops at its next letter",
        duration::format(CANCEL_WAIT)
    )?;
    if let Asked::Running(job) = asked {
        auditor
            .write(&cancel_record(&job, why.as_deref()), None)
            .await;
    }
    Ok(ExitCode::FAILURE)
}

/// What [`ask_cancel`] did.
pub(crate) enum Asked {
    /// The job runs: its cancel record is written, and it stops at its
    /// next letter.
    Running(Job),
    /// The job was interrupted: it is marked cancelled (and audited).
    Cancelled(Job),
}

/// Cancels job `id`: writes the cancel record a running job reads, or marks
/// an interrupted one cancelled (and writes its audit line). A finished
/// job, or none, is bad usage.
pub(crate) async fn ask_cancel(
    source: &Arc<dyn DeadLetterStore>,
    dlq: &str,
    id: &str,
    auditor: &Auditor,
    why: Option<&str>,
) -> anyhow::Result<Asked> {
    let (mut job, _) = find(source, dlq, id).await?;
    let now = SystemTime::now();
    match job.shown_state(now) {
        "running" => {}
        "interrupted" => {
            job.state = State::Cancelled;
            job.cancelled_by = Some(auditor.by.clone());
            job.finished_at_ms = Some(millis(now));
            put(source, &job).await?;
            auditor.write(&cancel_record(&job, why), None).await;
            return Ok(Asked::Cancelled(job));
        }
        state => {
            return Err(
                UsageError(format!("job {id} is {state}; there is nothing to cancel")).into(),
            );
        }
    }
    let request = Cancel {
        job: id.to_string(),
        by: auditor.by.clone(),
        at_ms: millis(now),
        why: why.map(str::to_string),
    };
    source
        .put_job_record(
            dlq,
            &cancel_key(id),
            Bytes::from(serde_json::to_vec(&request)?),
        )
        .await?;
    Ok(Asked::Running(job))
}

fn cancel_record<'a>(job: &'a Job, why: Option<&'a str>) -> audit::Record<'a> {
    audit::Record {
        action: audit::Action::Cancel,
        queue: &job.into,
        dead_letter_queue: &job.dead_letter_queue,
        selection: job.selection.clone(),
        selected: job.total,
        done: job.done,
        failed: job.failed,
        why,
        rate: job.rate,
        job: Some(&job.id),
    }
}

/// The jobs on a dead-letter queue as `dlq jobs --output json` prints
/// them (state as shown, times as RFC 3339), oldest first.
pub(crate) async fn listed(
    source: &Arc<dyn DeadLetterStore>,
    dlq: &str,
) -> anyhow::Result<Vec<serde_json::Value>> {
    let now = SystemTime::now();
    Ok(board(source, dlq)
        .await?
        .jobs
        .iter()
        .map(|job| job.to_json(now))
        .collect())
}

/// `--rate`: letters one `pause` apart on average, and never closer than
/// half of it. A letter late by up to half a pause (a timer woken late, a
/// slow broker call) is made up on the next ones, so that jitter on a
/// loaded machine does not slow the whole replay (with every delay kept,
/// 1,000 letters at 100/s took 11.5 s at a load of 5); one later than that
/// (a stall of a second) moves the schedule on rather than letting the
/// letters it missed through in a burst to catch up (24 at once after a
/// 1.2 s stall at 20/s), so the rate stays a ceiling the app that just
/// recovered can count on.
struct Pace {
    pause: Duration,
    next: tokio::time::Instant,
}

impl Pace {
    fn new(rate: f64) -> Self {
        Pace {
            pause: Duration::from_secs_f64(1.0 / rate),
            next: tokio::time::Instant::now(),
        }
    }

    async fn wait(&mut self) {
        let now = tokio::time::Instant::now();
        self.next = self
            .next
            .max(now.checked_sub(self.pause / 2).unwrap_or(now));
        tokio::time::sleep_until(self.next).await;
        self.next += self.pause;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(state: State) -> Job {
        let now = millis(SystemTime::now());
        Job {
            id: "replay-0000abcd".into(),
            kind: Kind::Replay,
            queue: "orders".into(),
            into: "orders".into(),
            dead_letter_queue: "orders.dlq".into(),
            selection: "--all".into(),
            spec: Spec::of(&Filter::default(), &Selection::default()),
            snapshot_at_ms: now,
            total: 10,
            through: Some("9-0".into()),
            done: 4,
            failed: 0,
            rate: Some(2.0),
            state,
            started_at_ms: now - 2000,
            heard_at_ms: now,
            finished_at_ms: None,
            by: "alice".into(),
            why: None,
            host: host_name(),
            pid: std::process::id(),
            pid_started: process_started(std::process::id()),
            cancelled_by: None,
            resumed: 0,
        }
    }

    #[test]
    fn a_job_of_a_live_process_runs_and_of_a_gone_one_is_interrupted() {
        let now = SystemTime::now();
        let running = job(State::Running);
        assert!(
            running.pid_started.is_some(),
            "this process's start is read"
        );
        assert_eq!(running.shown_state(now), "running");
        // The same pid with another start time is another process: the
        // job's own is gone.
        let reused = Job {
            pid_started: running.pid_started.map(|s| s + 1),
            ..running.clone()
        };
        assert_eq!(reused.shown_state(now), "interrupted");
        // On another host only the heartbeat tells.
        let elsewhere = Job {
            host: "another-host".into(),
            ..running.clone()
        };
        assert_eq!(elsewhere.shown_state(now), "running");
        assert_eq!(elsewhere.shown_state(now + STALE), "interrupted");
        assert_eq!(job(State::Done).shown_state(now), "done");
        assert_eq!(job(State::Cancelled).shown_state(now), "cancelled");
    }

    #[test]
    fn a_record_reads_back_with_its_selection() {
        let filter = Filter {
            reason: Some("permanent-status".into()),
            status: Some("4xx".into()),
            older_than: Some(Duration::from_secs(3600)),
            expression: Some(crate::expr::Expr::parse("status >= 500").unwrap()),
            ..Filter::default()
        };
        let selection = Selection {
            ids: vec!["1-0".into()],
            all: false,
        };
        let mut written = job(State::Running);
        written.spec = Spec::of(&filter, &selection);
        let read: Job = serde_json::from_slice(&serde_json::to_vec(&written).unwrap()).unwrap();
        assert_eq!(read.spec, written.spec);
        let again = read.spec.filter().unwrap();
        assert_eq!(
            audit::describe(&again, &selection),
            audit::describe(&filter, &selection),
            "a resume selects with the same flags"
        );
    }

    #[test]
    fn a_cancel_is_not_read_as_a_job() {
        let cancel = Cancel {
            job: "replay-0000abcd".into(),
            by: "bob".into(),
            at_ms: 0,
            why: None,
        };
        let record = serde_json::to_vec(&cancel).unwrap();
        assert!(serde_json::from_slice::<Job>(&record).is_err());
        assert_eq!(cancel_key(&cancel.job), "replay-0000abcd-cancel");
        assert!(crate::source::is_job_key(&cancel_key(&cancel.job)));
    }

    #[test]
    fn a_pid_start_is_read_past_a_name_with_spaces() {
        let stat =
            "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 1 0 987654 1000 200";
        assert_eq!(start_in_stat(stat), Some(987654));
        assert_eq!(start_in_stat("4242 (cut"), None);
        assert_eq!(process_started(u32::MAX), None, "no such process");
    }

    /// After a letter held up for a second at 10/s, the ten the schedule
    /// missed are not sent at once: the late one goes, the next half a
    /// pause later, and then 100 ms apart again.
    #[tokio::test(start_paused = true)]
    async fn a_late_letter_does_not_let_a_burst_through() {
        let mut pace = Pace::new(10.0);
        let start = tokio::time::Instant::now();
        pace.wait().await;
        pace.wait().await;
        assert_eq!(start.elapsed(), Duration::from_millis(100));
        tokio::time::sleep(Duration::from_secs(1)).await;
        let late = tokio::time::Instant::now();
        pace.wait().await;
        assert_eq!(late.elapsed(), Duration::ZERO, "a late letter goes at once");
        pace.wait().await;
        assert_eq!(late.elapsed(), Duration::from_millis(50));
        pace.wait().await;
        assert_eq!(late.elapsed(), Duration::from_millis(150));
    }

    /// A letter 30 ms late at 10/s is made up: the ones after it keep the
    /// schedule, and ten go in the second, not in 1.03 s.
    #[tokio::test(start_paused = true)]
    async fn a_little_lateness_is_made_up() {
        let mut pace = Pace::new(10.0);
        let start = tokio::time::Instant::now();
        pace.wait().await;
        pace.wait().await;
        tokio::time::sleep(Duration::from_millis(130)).await;
        pace.wait().await;
        assert_eq!(start.elapsed(), Duration::from_millis(230));
        for _ in 3..10 {
            pace.wait().await;
        }
        assert_eq!(start.elapsed(), Duration::from_millis(900));
    }
}
