//! Child processes: courier (the built release binary) and the Celery
//! worker, with what `/proc` says they cost.

use std::fs::File;
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// Memory and CPU of a process (or a process group), from `/proc`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    /// Resident set now, KiB.
    pub rss_kib: u64,
    /// Peak resident set (`VmHWM`), KiB; for a group, the sum of peaks.
    pub peak_kib: u64,
    /// User + system CPU seconds.
    pub cpu_secs: f64,
}

fn clock_ticks() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// `(pgrp, utime + stime in ticks)` of one process.
fn stat(pid: u32) -> Option<(u32, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses; fields follow the last ')'.
    let rest = &text[text.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state(0) ppid(1) pgrp(2) ... utime(11) stime(12).
    let pgrp = fields.get(2)?.parse().ok()?;
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((pgrp, utime + stime))
}

fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

pub fn usage(pid: u32) -> Usage {
    Usage {
        rss_kib: status_kib(pid, "VmRSS:").unwrap_or(0),
        peak_kib: status_kib(pid, "VmHWM:").unwrap_or(0),
        cpu_secs: stat(pid).map_or(0.0, |(_, t)| t as f64 / clock_ticks()),
    }
}

/// Each thread's CPU time so far in nanoseconds, by thread id, from
/// `/proc/<pid>/task/*/schedstat`: exact, where [`usage`] counts 10 ms
/// ticks (over a minute at rest, ±0.03 % of a core).
pub fn thread_cpu_ns(pid: u32) -> std::collections::HashMap<u32, u64> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Default::default();
    };
    tasks
        .flatten()
        .filter_map(|task| {
            let tid: u32 = task.file_name().to_str()?.parse().ok()?;
            let text = std::fs::read_to_string(task.path().join("schedstat")).ok()?;
            Some((tid, text.split_whitespace().next()?.parse().ok()?))
        })
        .collect()
}

/// How often [`ThreadCpu`] reads each thread's CPU time.
pub const THREAD_READ_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// A process's CPU time over a stretch, from each thread's
/// [`thread_cpu_ns`] read at its start and every [`THREAD_READ_EVERY`]
/// after. A thread that ends in between counts up to its last reading:
/// tokio's blocking pool ends a thread after 10 s without work, so what it
/// spent after that reading is its exit alone. A thread started in between
/// counts from zero.
#[derive(Debug)]
pub struct ThreadCpu {
    first: std::collections::HashMap<u32, u64>,
    last: std::collections::HashMap<u32, u64>,
    /// Threads that were there at one reading and gone at a later one.
    ended: std::collections::HashSet<u32>,
}

impl ThreadCpu {
    pub fn start(pid: u32) -> Self {
        Self::from_first(thread_cpu_ns(pid))
    }

    fn from_first(first: std::collections::HashMap<u32, u64>) -> Self {
        Self {
            last: first.clone(),
            first,
            ended: Default::default(),
        }
    }

    pub fn read(&mut self, pid: u32) {
        self.add(thread_cpu_ns(pid));
    }

    fn add(&mut self, now: std::collections::HashMap<u32, u64>) {
        if now.is_empty() {
            // The process is gone: nothing was read.
            return;
        }
        for tid in self.last.keys() {
            if !now.contains_key(tid) {
                self.ended.insert(*tid);
            }
        }
        for (tid, ns) in now {
            self.first.entry(tid).or_insert(0);
            self.last.insert(tid, ns);
        }
    }

    /// How many threads ended since the start.
    pub fn ended(&self) -> usize {
        self.ended.len()
    }

    /// CPU seconds since the start; `None` when nothing could be read.
    pub fn secs(&self) -> Option<f64> {
        if self.first.is_empty() {
            return None;
        }
        let ns: u64 = self
            .last
            .iter()
            .map(|(tid, now)| now.saturating_sub(self.first.get(tid).copied().unwrap_or(0)))
            .sum();
        Some(ns as f64 / 1e9)
    }
}

/// The ids of the processes alive now, from the numbered entries of `/proc`.
fn live_pids() -> impl Iterator<Item = u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
}

/// The process listening on `127.0.0.1:port` (or every address), found
/// through `/proc/net/tcp*` and the processes' open sockets: the broker
/// server whose CPU a drain costs too.
pub fn listener_pid(port: u16) -> Option<u32> {
    let wanted = format!(":{port:04X}");
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local_address(1) ... st(3) ... inode(9); 0A is LISTEN.
            if fields.len() > 9 && fields[1].ends_with(&wanted) && fields[3] == "0A" {
                inodes.push(format!("socket:[{}]", fields[9]));
            }
        }
    }
    if inodes.is_empty() {
        return None;
    }
    for pid in live_pids() {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(link) = std::fs::read_link(fd.path())
                && inodes.iter().any(|i| link.as_os_str() == i.as_str())
            {
                return Some(pid);
            }
        }
    }
    None
}

/// Every live process of a process group, summed (a prefork worker is a
/// parent and its children).
pub fn group_usage(pgid: u32) -> Usage {
    let mut total = Usage::default();
    for pid in live_pids() {
        if stat(pid).is_some_and(|(pgrp, _)| pgrp == pgid) {
            let u = usage(pid);
            total.rss_kib += u.rss_kib;
            total.peak_kib += u.peak_kib;
            total.cpu_secs += u.cpu_secs;
        }
    }
    total
}

fn signal(pid: i64, name: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .arg("--")
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status();
}

/// A child in a process group of its own, stopped (the whole group) when
/// dropped.
pub struct Process {
    child: Child,
    pub pid: u32,
    pub log: PathBuf,
}

impl Process {
    pub fn spawn(mut command: Command, log: &Path) -> anyhow::Result<Self> {
        let out = File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .process_group(0)
            .spawn()
            .with_context(|| format!("cannot start {:?}", command.get_program()))?;
        Ok(Self {
            pid: child.id(),
            child,
            log: log.to_path_buf(),
        })
    }

    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// SIGKILL to the group, and reaps the child: no shutdown of any kind.
    pub fn kill9(&mut self) {
        if self.exited().is_none() {
            signal(-i64::from(self.pid), "KILL");
        }
        let _ = self.child.wait();
    }

    /// Sends signal `name` (`STOP`, `CONT`, ...) to the whole group.
    pub fn signal(&self, name: &str) {
        signal(-i64::from(self.pid), name);
    }

    /// SIGTERM to the group, then SIGKILL after `grace`.
    pub fn stop(&mut self, grace: Duration) {
        if self.exited().is_some() {
            return;
        }
        signal(-i64::from(self.pid), "TERM");
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.exited().is_some() {
                // Prefork children may outlive their parent for a moment.
                signal(-i64::from(self.pid), "KILL");
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        signal(-i64::from(self.pid), "KILL");
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// `courier run` as a child, with the address of its `/metrics`.
pub struct Courier {
    pub process: Process,
    pub metrics: SocketAddr,
}

impl Courier {
    /// Starts `courier run` and waits until it serves `/metrics`.
    pub fn start(binary: &Path, args: &[String], log: &Path) -> anyhow::Result<Self> {
        let mut command = Command::new(binary);
        command
            .arg("--log-format")
            .arg("json")
            .arg("run")
            .args(args)
            .arg("--listen")
            .arg("127.0.0.1:0");
        let mut process = Process::spawn(command, log)?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(addr) = metrics_addr(&process.log) {
                return Ok(Self {
                    process,
                    metrics: addr,
                });
            }
            if let Some(status) = process.exited() {
                bail!(
                    "courier exited ({status}) before serving /metrics:\n{}",
                    process.log_tail(10)
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "courier did not serve /metrics within 20 s:\n{}",
                    process.log_tail(10)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn usage(&self) -> Usage {
        usage(self.process.pid)
    }

    /// One metric's value from `/metrics` (the first sample whose line
    /// starts with `name`).
    pub fn metric(&self, name: &str) -> Option<f64> {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(self.metrics).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(
            stream,
            "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.metrics
        )
        .ok()?;
        let mut text = String::new();
        stream.read_to_string(&mut text).ok()?;
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }
}

/// The `addr` of courier's "serving /metrics" log line (JSON log format).
fn metrics_addr(log: &Path) -> Option<SocketAddr> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines().find_map(|line| {
        let value: serde_json::Value = serde_json::from_str(line).ok()?;
        // Flattened JSON events; older formats nest them under "fields".
        let fields = value.get("fields").unwrap_or(&value);
        let message = fields.get("message")?.as_str()?;
        if !message.starts_with("serving /metrics") {
            return None;
        }
        fields.get("addr")?.as_str()?.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A thread that ends counts up to its last reading, once; one that
    /// starts counts from zero.
    #[test]
    fn thread_cpu_keeps_what_an_ended_thread_spent() {
        let mut cpu = ThreadCpu::from_first(HashMap::from([(1, 100), (2, 1_000)]));
        cpu.add(HashMap::from([(1, 150), (2, 1_400)]));
        // Thread 2 ended; thread 3 started.
        cpu.add(HashMap::from([(1, 170), (3, 30)]));
        cpu.add(HashMap::from([(1, 200), (3, 50)]));
        assert_eq!(cpu.ended(), 1);
        let ns = (200 - 100) + (1_400 - 1_000) + 50;
        assert_eq!(cpu.secs(), Some(ns as f64 / 1e9));
        // A reading of a process that is gone changes nothing.
        cpu.add(HashMap::new());
        assert_eq!(cpu.secs(), Some(ns as f64 / 1e9));
    }
}
