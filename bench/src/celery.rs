//! The peer: a Celery worker (prefork, concurrency 2, acks_late) on Redis
//! whose task POSTs each message to the same app. The harness makes its own
//! virtualenv, `bench/.venv`, from `bench/celery/requirements.txt`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::child::{Process, Usage, group_usage};

/// Redis database of the Celery broker: away from courier's queues in db 0.
pub const BROKER: &str = "redis://127.0.0.1:6379/15";

pub fn bench_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn venv() -> PathBuf {
    bench_dir().join(".venv")
}

/// Creates `bench/.venv` with the pinned requirements, unless it already
/// has exactly them. Returns the virtualenv's Python.
pub fn ensure_venv() -> anyhow::Result<PathBuf> {
    let requirements = bench_dir().join("celery/requirements.txt");
    let wanted = std::fs::read_to_string(&requirements)
        .with_context(|| format!("cannot read {}", requirements.display()))?;
    let stamp = venv().join("requirements.installed");
    let python = venv().join("bin/python");
    if python.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(&wanted) {
        return Ok(python);
    }
    eprintln!(
        "  creating {} (celery[redis] from PyPI)...",
        venv().display()
    );
    run(Command::new("python3").arg("-m").arg("venv").arg(venv()))?;
    run(Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-r",
        ])
        .arg(&requirements))?;
    std::fs::write(&stamp, wanted)?;
    Ok(python)
}

fn run(command: &mut Command) -> anyhow::Result<()> {
    let status = command
        .status()
        .with_context(|| format!("cannot run {:?}", command.get_program()))?;
    if !status.success() {
        bail!("{command:?} failed: {status}");
    }
    Ok(())
}

/// Versions of Python and Celery in the virtualenv.
pub fn versions(python: &Path) -> String {
    Command::new(python)
        .args([
            "-c",
            "import sys, celery, kombu; print(f'Python {sys.version.split()[0]}, Celery {celery.__version__}, kombu {kombu.__version__}')",
        ])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

fn env(command: &mut Command, app_url: &str, queue: &str) {
    command
        .current_dir(bench_dir().join("celery"))
        .env("BENCH_BROKER", BROKER)
        .env("BENCH_APP", app_url)
        .env("BENCH_QUEUE", queue)
        .env("PYTHONDONTWRITEBYTECODE", "1");
}

/// Enqueues `n` tasks carrying `body` (ASCII).
pub fn feed(python: &Path, app_url: &str, queue: &str, n: u64, body: &str) -> anyhow::Result<()> {
    let mut command = Command::new(python);
    command.arg("feed.py").arg(n.to_string()).arg(body);
    env(&mut command, app_url, queue);
    let out = command.output().context("cannot run feed.py")?;
    if !out.status.success() {
        bail!(
            "feed.py failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Starts `celery worker --pool prefork --concurrency 2` on `queue`.
pub fn worker(python: &Path, app_url: &str, queue: &str, log: &Path) -> anyhow::Result<Process> {
    let mut command = Command::new(python);
    command.args([
        "-m",
        "celery",
        "-A",
        "bench_tasks",
        "worker",
        "--pool",
        "prefork",
        "--concurrency",
        "2",
        "--loglevel",
        "WARNING",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "-Q",
        queue,
    ]);
    env(&mut command, app_url, queue);
    Process::spawn(command, log)
}

pub fn usage(worker: &Process) -> Usage {
    group_usage(worker.pid)
}

/// Removes the queue and kombu's bookkeeping from the broker database.
pub async fn cleanup(queue: &str) {
    let result = async {
        let client = redis::Client::open(BROKER)?;
        let mut con = client.get_multiplexed_async_connection().await?;
        redis::cmd("UNLINK")
            .arg(queue)
            .arg(format!("_kombu.binding.{queue}"))
            .arg("unacked")
            .arg("unacked_index")
            .arg("unacked_mutex")
            .query_async::<()>(&mut con)
            .await?;
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        eprintln!("  (cleanup of the Celery queue failed: {e:#})");
    }
}
