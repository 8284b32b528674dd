//! Deterministic CPU figures: user-space instructions per message under
//! `valgrind --tool=callgrind`, and system calls per message under
//! `strace -f`, for courier and for the bare loop of the same broker.
//!
//! Timed CPU seconds on a shared machine swing with its load; these counts
//! do not. Only the window in which messages flow is counted: the consumer
//! drains `n` pre-filled messages, and the count covers the receipts from
//! the `n / 10`-th to the `n − n / 10`-th at the app. Start-up, connecting,
//! the first reads, the idle time before SIGTERM and shutdown fall outside
//! it. Two runs of `n / 2` and `n` messages, subtracted (the method before
//! this one), did not cancel them: the idle time between the last message
//! and the exit, and the timers that fire in it, differ from run to run
//! (under valgrind everything is some 50 times slower, and courier's
//! timers keep their wall-clock periods).
//!
//! - callgrind: `callgrind_control --zero` when the window opens and
//!   `--dump` when it closes; the figure is the dump's total over the
//!   receipts in between (the app's count read just before and just after
//!   each command, the midpoint taken: a command takes a few hundred ms to
//!   reach the process).
//! - strace: every system call with its wall-clock time (`-ttt`); the app
//!   notes the wall-clock time of the two receipts as it counts them, and
//!   the figure is the calls made between the two times over the receipts
//!   between them.

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
    /// `strace -f -ttt`: system calls, every thread.
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
                // No argument strings: only the name and the time are read.
                c.args(["-f", "-ttt", "-qq", "-s", "0", "-o"]).arg(out);
                c
            }
        };
        command.arg(program).args(args);
        command
    }
}

/// The receipts (`from`, `to`) at which the counted window opens and
/// closes, for a drain of `n` messages: the middle 80 %, steady flow.
pub fn window(n: u64) -> (u64, u64) {
    let margin = (n / 10).max(1);
    (margin, n.saturating_sub(margin).max(margin + 1))
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

/// System calls in `strace -f -ttt` output entered between `from` and `to`
/// (seconds since the epoch). A call another thread interrupted shows as
/// `... <unfinished ...>` and later `<... name resumed>`: counted once, at
/// its start; signals (`---`) and exits (`+++`) are not calls.
pub fn strace_calls_between(text: &str, from: f64, to: f64) -> u64 {
    text.lines()
        .filter(|line| {
            let mut words = line.split_whitespace();
            // "<pid> <seconds.micros> <call>(...", the pid only under -f.
            let (Some(first), Some(second), Some(third)) =
                (words.next(), words.next(), words.next())
            else {
                return false;
            };
            let (time, call) = if first.contains('.') {
                (first, second)
            } else {
                (second, third)
            };
            let Ok(time) = time.parse::<f64>() else {
                return false;
            };
            !call.starts_with("<...")
                && !call.starts_with("---")
                && !call.starts_with("+++")
                && (from..=to).contains(&time)
        })
        .count() as u64
}

/// Per-message count of `tool` for `who` on `kind`, over the flowing
/// window of a drain of `n` messages.
pub async fn per_message(
    ctx: &Ctx,
    kind: Kind,
    who: Consumer,
    tool: Tool,
    n: u64,
) -> anyhow::Result<f64> {
    let purpose = format!("{}-{}-{n}", who.name(), tool.name());
    let target = Target::new(kind, &purpose, &ctx.work_dir);
    target.reachable().map_err(anyhow::Error::msg)?;
    let result = counted_target(ctx, &target, who, tool, n).await;
    target.cleanup().await;
    result
}

/// The flowing window of one counted run: receipts at the app inside it,
/// and its opening and closing times (seconds since the epoch).
struct Window {
    messages: f64,
    from: f64,
    to: f64,
}

async fn counted_target(
    ctx: &Ctx,
    target: &Target,
    who: Consumer,
    tool: Tool,
    n: u64,
) -> anyhow::Result<f64> {
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
    let dump = dump_file(&out);
    for stale in [&out, &dump] {
        let _ = std::fs::remove_file(stale);
    }
    let (program, args) = consumer_command(ctx, who, target)?;
    let command = tool.command(&out, &program, &args);
    let mut process = Process::spawn(command, &ctx.work_dir.join(format!("{name}.log")))?;
    // Under valgrind everything is some 50 times slower.
    let timeout = Duration::from_secs(120).max(Duration::from_millis(n * 20));
    let measured = measure_window(ctx, process.pid, tool, n, timeout).await;
    // SIGTERM to the consumer itself (under strace it is strace's child),
    // so it shuts down cleanly and strace writes the rest of its trace.
    let pid = match tool {
        Tool::Callgrind => Some(process.pid),
        Tool::Strace => child_of(process.pid),
    };
    if let Some(pid) = pid {
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
    }
    let (exited, tail) = tokio::task::spawn_blocking(move || {
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
    let window = measured.map_err(|e| anyhow::anyhow!("{e:#}; the log ends:\n{tail}"))?;
    if !exited {
        bail!("{} did not exit within 60 s of SIGTERM", who.name());
    }
    let count = match tool {
        Tool::Callgrind => {
            let text = std::fs::read_to_string(&dump)
                .with_context(|| format!("callgrind wrote no dump {}", dump.display()))?;
            callgrind_total(&text).with_context(|| format!("no total in {}", dump.display()))?
        }
        Tool::Strace => {
            let text = std::fs::read_to_string(&out)
                .with_context(|| format!("strace wrote no {}", out.display()))?;
            strace_calls_between(&text, window.from, window.to)
        }
    };
    if window.messages < 1.0 || count == 0 {
        bail!(
            "{} counted {count} over {:.0} messages",
            tool.name(),
            window.messages
        );
    }
    Ok(count as f64 / window.messages)
}

/// Where `callgrind_control --dump` writes the first dump of `out`.
fn dump_file(out: &Path) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

/// Waits for the window's receipts and marks them. strace: the app notes
/// the wall-clock time of the `from`-th and the `to`-th receipt itself.
/// callgrind: the counters are zeroed when the `from`-th has arrived and
/// dumped when the `to`-th has.
async fn measure_window(
    ctx: &Ctx,
    pid: u32,
    tool: Tool,
    n: u64,
    timeout: Duration,
) -> anyhow::Result<Window> {
    let (from, to) = window(n);
    let deadline = Instant::now() + timeout;
    if tool == Tool::Strace {
        ctx.app.mark(from, to);
    }
    let mut marks = [0.0; 2];
    for (mark, (at, command)) in marks.iter_mut().zip([(from, "--zero"), (to, "--dump")]) {
        wait_for(ctx, pid, tool, at, n, deadline, timeout).await?;
        if tool == Tool::Callgrind {
            let before = ctx.app.count();
            callgrind_control(pid, command).await?;
            *mark = (before + ctx.app.count()) as f64 / 2.0;
        }
    }
    match tool {
        Tool::Callgrind => Ok(Window {
            messages: marks[1] - marks[0],
            from: 0.0,
            to: 0.0,
        }),
        Tool::Strace => {
            let (t0, t1) = ctx
                .app
                .marked()
                .context("the app did not note the window's receipts")?;
            Ok(Window {
                messages: (to - from) as f64,
                from: t0,
                to: t1,
            })
        }
    }
}

/// Waits until the app has `at` receipts; fails as soon as the consumer
/// has exited (it failed: its log says why) or at the deadline.
async fn wait_for(
    ctx: &Ctx,
    pid: u32,
    tool: Tool,
    at: u64,
    n: u64,
    deadline: Instant,
    timeout: Duration,
) -> anyhow::Result<()> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let got = ctx.app.wait_for(at, left.min(Duration::from_secs(1))).await;
        if got >= at {
            return Ok(());
        }
        if !alive(pid) {
            bail!(
                "under {} the consumer exited after the app received {got} of {n} messages",
                tool.name()
            );
        }
        if left.is_zero() {
            bail!(
                "under {} the app received {got} of {n} messages within {} s",
                tool.name(),
                timeout.as_secs()
            );
        }
    }
}

/// Whether `pid` runs (a child that exited and was not reaped yet is a
/// zombie: not running).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit(')')
                .next()
                .map(|r| !r.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// `callgrind_control <command> <pid>`: the command reaches the process
/// through valgrind's gdbserver (vgdb).
async fn callgrind_control(pid: u32, command: &str) -> anyhow::Result<()> {
    let out = tokio::process::Command::new("callgrind_control")
        .arg(command)
        .arg(pid.to_string())
        .output()
        .await
        .context("cannot run callgrind_control (it comes with valgrind)")?;
    if !out.status.success() {
        bail!(
            "callgrind_control {command} {pid} failed: {}{}",
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
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
        let strace = "\
101 1700000000.000100 execve(\"/bin/courier\", [...]) = 0
101 1700000001.000000 epoll_wait(3, [...], 1024, -1) = 1
102 1700000001.500000 futex(0x7f, FUTEX_WAIT_PRIVATE, 0, NULL <unfinished ...>
101 1700000001.600000 writev(7, [...], 2) = 300
102 1700000001.700000 <... futex resumed>) = 0
101 1700000001.800000 --- SIGTERM {si_signo=SIGTERM} ---
102 1700000002.000000 recvfrom(7, \"\"..., 8192, 0, NULL, NULL) = 20
101 1700000003.000000 +++ exited with 0 +++
";
        assert_eq!(
            strace_calls_between(strace, 1_700_000_001.0, 1_700_000_002.0),
            4
        );
        assert_eq!(strace_calls_between(strace, 0.0, 2e9), 5);
        let no_pid = "1700000001.000000 write(1, \"\", 1) = 1\n";
        assert_eq!(strace_calls_between(no_pid, 0.0, 2e9), 1);
    }

    #[test]
    fn the_window_is_the_middle_of_the_drain() {
        assert_eq!(window(10_000), (1_000, 9_000));
        assert_eq!(window(200), (20, 180));
        // Tiny drains still open before they close.
        assert_eq!(window(3), (1, 2));
    }
}
