//! Deterministic CPU figures: user-space instructions per message under
//! `valgrind --tool=callgrind`, and system calls per message under
//! `strace -c -f`, for courier and for the bare loop of the same broker.
//!
//! Timed CPU seconds on a shared machine swing with its load; these counts
//! do not. Each figure comes from two runs of the same consumer, draining
//! `n / 2` and `n` pre-filled messages: (count of the larger − count of the
//! smaller) / (n − n / 2). Start-up, connecting and shutdown cost the same
//! in both runs, so the difference subtracts them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::time::Instant;

use crate::child::Process;
use crate::runs::{Consumer, Ctx, consumer_command};
use crate::sources::{Kind, Target};

/// What a run is counted with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tool {
    /// `valgrind --tool=callgrind`: instructions executed in user space.
    Callgrind,
    /// `strace -c -f`: system calls, every thread.
    Strace,
}

impl Tool {
    pub fn name(self) -> &'static str {
        match self {
            Tool::Callgrind => "callgrind",
            Tool::Strace => "strace",
        }
    }

    fn command(self, out: &Path, program: &Path, args: &[String]) -> Command {
        let mut command = match self {
            Tool::Callgrind => {
                let mut c = Command::new("valgrind");
                c.arg("--tool=callgrind")
                    .arg(format!("--callgrind-out-file={}", out.display()));
                c
            }
            Tool::Strace => {
                let mut c = Command::new("strace");
                c.args(["-f", "-c", "-o"]).arg(out);
                c
            }
        };
        command.arg(program).args(args);
        command
    }

    /// The total out of the tool's output file.
    fn total(self, out: &Path) -> anyhow::Result<u64> {
        let text = std::fs::read_to_string(out)
            .with_context(|| format!("{} wrote no {}", self.name(), out.display()))?;
        let found = match self {
            Tool::Callgrind => callgrind_total(&text),
            Tool::Strace => strace_total(&text),
        };
        found.with_context(|| format!("no total in {}", out.display()))
    }
}

/// `summary:` (or `totals:`) of a callgrind profile: the instructions of
/// every thread.
pub fn callgrind_total(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| {
            l.strip_prefix("summary:")
                .or_else(|| l.strip_prefix("totals:"))
        })
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// The calls column of `strace -c`'s `total` line.
pub fn strace_total(text: &str) -> Option<u64> {
    let line = text
        .lines()
        .find(|l| l.split_whitespace().last() == Some("total"))?;
    // % time, seconds, usecs/call, calls, [errors], "total".
    line.split_whitespace().nth(3)?.parse().ok()
}

/// Per-message count of `tool` for `who` on `kind`, from runs of `n / 2`
/// and `n` messages.
pub async fn per_message(
    ctx: &Ctx,
    kind: Kind,
    who: Consumer,
    tool: Tool,
    n: u64,
) -> anyhow::Result<f64> {
    let half = (n / 2).max(1);
    let small = counted_run(ctx, kind, who, tool, half).await?;
    let large = counted_run(ctx, kind, who, tool, n).await?;
    if large <= small || n <= half {
        bail!(
            "{} counted {small} for {half} messages and {large} for {n}",
            tool.name()
        );
    }
    Ok((large - small) as f64 / (n - half) as f64)
}

async fn counted_run(
    ctx: &Ctx,
    kind: Kind,
    who: Consumer,
    tool: Tool,
    n: u64,
) -> anyhow::Result<u64> {
    let purpose = format!("{}-{}-{n}", who.name(), tool.name());
    let target = Target::new(kind, &purpose, &ctx.work_dir);
    target.reachable().map_err(anyhow::Error::msg)?;
    let result = counted_target(ctx, &target, who, tool, n).await;
    target.cleanup().await;
    result
}

async fn counted_target(
    ctx: &Ctx,
    target: &Target,
    who: Consumer,
    tool: Tool,
    n: u64,
) -> anyhow::Result<u64> {
    target.prefill(n, &ctx.body).await?;
    ctx.app.reset(false);
    let name = format!(
        "{}-{}-{}-{n}-{}",
        tool.name(),
        who.name(),
        target.kind.name(),
        std::process::id()
    );
    let out: PathBuf = ctx.work_dir.join(format!("{name}.out"));
    let _ = std::fs::remove_file(&out);
    let (program, args) = consumer_command(ctx, who, target)?;
    let command = tool.command(&out, &program, &args);
    let mut process = Process::spawn(command, &ctx.work_dir.join(format!("{name}.log")))?;
    // Under valgrind everything is some 50 times slower.
    let timeout = Duration::from_secs(120).max(Duration::from_millis(n * 20));
    let got = ctx.app.wait_for(n, timeout).await;
    // SIGTERM to the consumer itself (under strace it is strace's child),
    // so it shuts down cleanly and the tool writes its figures.
    let pid = match tool {
        Tool::Callgrind => Some(process.pid),
        Tool::Strace => child_of(process.pid),
    };
    if let Some(pid) = pid {
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
    }
    let exited = tokio::task::spawn_blocking(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while process.exited().is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let exited = process.exited().is_some();
        let tail = process.log_tail(5);
        drop(process);
        (exited, tail)
    })
    .await?;
    if got < n {
        bail!(
            "under {} the app received {got} of {n} messages within {} s; the log ends:\n{}",
            tool.name(),
            timeout.as_secs(),
            exited.1
        );
    }
    if !exited.0 {
        bail!("{} did not exit within 60 s of SIGTERM", who.name());
    }
    let started = Instant::now();
    // strace writes its table as it exits; give the file system a moment.
    loop {
        match tool.total(&out) {
            Ok(total) => return Ok(total),
            Err(e) if started.elapsed() > Duration::from_secs(2) => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// The first child of `pid` (the program strace started).
fn child_of(pid: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_are_read_from_the_tools_output() {
        let callgrind = "events: Ir\nfl=(1) x\n0 5\nsummary: 123456\ntotals: 123456\n";
        assert_eq!(callgrind_total(callgrind), Some(123_456));
        let strace = "% time     seconds  usecs/call     calls    errors syscall\n\
                      ------ ----------- ----------- --------- --------- ----------------\n \
                      60.00    0.000600           3       200        10 epoll_wait\n\
                      ------ ----------- ----------- --------- --------- ----------------\n\
                      100.00    0.001000           2       450        12 total\n";
        assert_eq!(strace_total(strace), Some(450));
        let no_errors = "100.00    0.001000           2       450           total\n";
        assert_eq!(strace_total(no_errors), Some(450));
    }
}
