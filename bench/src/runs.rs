//! The measurements, one function each: drain, latency, the Celery peer and
//! the retry backlog. Each returns its figures or why it could not run.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail};
use bytes::Bytes;
use courier::source::{Delivery, encode_fields};
use tokio::time::Instant;

use crate::app::{App, SENT_HEADER, now_ns};
use crate::celery;
use crate::child::{Courier, Process, Usage};
use crate::sources::{Kind, Target};

/// What every run needs.
pub struct Bench {
    pub app: App,
    pub courier: PathBuf,
    pub work_dir: PathBuf,
    pub body: Bytes,
    pub concurrency: usize,
    pub perf: bool,
}

pub type Ctx = Arc<Bench>;

// === Drain ===

#[derive(Debug, Clone)]
pub struct Drain {
    pub messages: u64,
    /// First to last receipt at the app.
    pub span: Duration,
    /// From starting courier to the last receipt (includes connecting).
    pub wall: Duration,
    pub prefill: Duration,
    /// Over the drain, courier's peak RSS and CPU from first receipt to last.
    pub peak_kib: u64,
    pub cpu_secs: f64,
    /// The broker server's CPU seconds over the same window (`None` for
    /// the embedded queue, or when its process could not be found): what a
    /// consumer's way of reading costs on the broker's side of the same
    /// two cores.
    pub broker_cpu_secs: Option<f64>,
    /// courier's adaptive concurrency limit when the drain ended.
    pub limit_at_end: Option<f64>,
}

impl Drain {
    pub fn rate(&self) -> f64 {
        self.messages.saturating_sub(1) as f64 / self.span.as_secs_f64().max(1e-9)
    }

    pub fn cpu_per_10k(&self) -> f64 {
        self.cpu_secs / self.messages as f64 * 10_000.0
    }

    pub fn broker_cpu_per_10k(&self) -> Option<f64> {
        Some(self.broker_cpu_secs? / self.messages as f64 * 10_000.0)
    }
}

async fn start_courier(ctx: &Ctx, args: Vec<String>, log: PathBuf) -> anyhow::Result<Courier> {
    let binary = ctx.courier.clone();
    tokio::task::spawn_blocking(move || Courier::start(&binary, &args, &log)).await?
}

pub(crate) async fn stop(process: Process) {
    let _ = tokio::task::spawn_blocking(move || drop(process)).await;
}

fn courier_args(ctx: &Ctx, target: &Target, extra: &[&str]) -> Vec<String> {
    let mut args = target.run_args();
    args.extend([
        "--app".into(),
        ctx.app.url(),
        "--concurrency".into(),
        ctx.concurrency.to_string(),
    ]);
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// What consumes a queue in a run: courier, or the bare loop of its broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consumer {
    Courier,
    Bare,
}

impl Consumer {
    pub fn name(self) -> &'static str {
        match self {
            Consumer::Courier => "courier",
            Consumer::Bare => "bare",
        }
    }
}

/// The program and arguments that consume `target` (without a wrapper
/// such as valgrind): courier's release binary, or this harness's `bare`
/// subcommand.
pub fn consumer_command(
    ctx: &Ctx,
    who: Consumer,
    target: &Target,
) -> anyhow::Result<(PathBuf, Vec<String>)> {
    match who {
        Consumer::Courier => {
            let mut args = vec!["--log-format".to_string(), "json".into(), "run".into()];
            args.extend(courier_args(ctx, target, &["--listen", "127.0.0.1:0"]));
            Ok((ctx.courier.clone(), args))
        }
        Consumer::Bare => {
            let mut args = vec![
                "bare".to_string(),
                "--source".into(),
                target.kind.name().into(),
                "--url".into(),
                target.url.clone(),
                "--queue".into(),
                target.queue.clone(),
                "--app".into(),
                ctx.app.url(),
                "--concurrency".into(),
                ctx.concurrency.to_string(),
            ];
            if let Some(dir) = target.embedded_dir() {
                args.push("--dir".into());
                args.push(dir.to_string_lossy().into_owned());
            }
            Ok((std::env::current_exe()?, args))
        }
    }
}

/// A consumer running as a child process.
pub(crate) enum Running {
    Courier(Courier),
    Bare(Process),
}

impl Running {
    pub(crate) async fn start(
        ctx: &Ctx,
        who: Consumer,
        target: &Target,
        log: PathBuf,
    ) -> anyhow::Result<Self> {
        match who {
            Consumer::Courier => Ok(Self::Courier(
                start_courier(ctx, courier_args(ctx, target, &[]), log).await?,
            )),
            Consumer::Bare => {
                let (program, args) = consumer_command(ctx, who, target)?;
                let mut command = std::process::Command::new(program);
                command.args(args);
                Ok(Self::Bare(Process::spawn(command, &log)?))
            }
        }
    }

    pub(crate) fn process(&self) -> &Process {
        match self {
            Self::Courier(c) => &c.process,
            Self::Bare(p) => p,
        }
    }

    pub(crate) fn into_process(self) -> Process {
        match self {
            Self::Courier(c) => c.process,
            Self::Bare(p) => p,
        }
    }

    pub(crate) fn usage(&self) -> Usage {
        crate::child::usage(self.process().pid)
    }

    /// Whether the process has exited, and how.
    pub(crate) fn exited(&mut self) -> Option<std::process::ExitStatus> {
        match self {
            Self::Courier(c) => c.process.exited(),
            Self::Bare(p) => p.exited(),
        }
    }

    /// One of courier's metrics; the bare loop has none.
    fn metric(&self, name: &str) -> Option<f64> {
        match self {
            Self::Courier(c) => c.metric(name),
            Self::Bare(_) => None,
        }
    }
}

/// Drains so far in this run: each gets a queue of its own.
static DRAINS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Pre-fills `n` messages, starts the consumer, and times it draining them
/// into the app. Each drain has a fresh queue: the stand-ins' queues are
/// not removed (`Target::cleanup`), and a second drain of the same Pub/Sub
/// subscription by the bare loop ran at 333 msg/s where the first ran at
/// 10,000; the mock cluster's partitions would also keep every run's
/// records against its 5 MiB a partition.
pub async fn drain(ctx: &Ctx, kind: Kind, who: Consumer, n: u64) -> anyhow::Result<Drain> {
    let run = DRAINS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
    let target = Target::new(kind, &format!("{}-drain{run}", who.name()), &ctx.work_dir);
    target.reachable().map_err(anyhow::Error::msg)?;
    let result = drain_target(ctx, &target, who, n).await;
    target.cleanup().await;
    result
}

async fn drain_target(ctx: &Ctx, target: &Target, who: Consumer, n: u64) -> anyhow::Result<Drain> {
    let clock = Instant::now();
    target
        .prefill(n, &ctx.body)
        .await
        .with_context(|| format!("pre-filling {n} messages"))?;
    let prefill = clock.elapsed();
    ctx.app.reset(false);
    let log = ctx
        .work_dir
        .join(format!("{}-{}-drain.log", who.name(), target.kind.name()));
    let started = Instant::now();
    let running = Running::start(ctx, who, target, log).await?;
    let perf = (ctx.perf && who == Consumer::Courier)
        .then(|| perf_record(ctx, target.kind, running.process().pid))
        .flatten();
    // Generous: a broken source shows up as a timeout, not a hang.
    let timeout = Duration::from_secs(60).max(Duration::from_secs(n / 200));
    let deadline = Instant::now() + timeout;
    let server = target.port().and_then(crate::child::listener_pid);
    let server_cpu = || server.map(|pid| crate::child::usage(pid).cpu_secs);
    let mut at_first: Option<(Usage, Option<f64>)> = None;
    while ctx.app.count() < n && Instant::now() < deadline {
        if at_first.is_none() && ctx.app.count() > 0 {
            at_first = Some((running.usage(), server_cpu()));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let wall = started.elapsed();
    let at_last = running.usage();
    let server_at_last = server_cpu();
    let got = ctx.app.count();
    // A short blocking read of /metrics; the app's runtime has other threads.
    let limit_at_end = running.metric("courier_concurrency_limit");
    if let Some(perf) = perf {
        stop_perf(perf).await;
    }
    let tail = running.process().log_tail(5);
    stop(running.into_process()).await;
    if got < n {
        bail!(
            "the app received {got} of {n} messages within {} s; the {} log ends:\n{tail}",
            timeout.as_secs(),
            who.name()
        );
    }
    let span = ctx.app.span().context("no receipts")?;
    Ok(Drain {
        messages: n,
        span,
        wall,
        prefill,
        peak_kib: at_last.peak_kib,
        cpu_secs: at_last.cpu_secs - at_first.map(|(u, _)| u).unwrap_or_default().cpu_secs,
        broker_cpu_secs: server_at_last
            .zip(at_first.and_then(|(_, s)| s))
            .map(|(last, first)| last - first),
        limit_at_end,
    })
}

/// `perf record` attached to courier for the drain.
fn perf_record(ctx: &Ctx, kind: Kind, pid: u32) -> Option<Process> {
    let data = ctx.work_dir.join(format!("perf-{}.data", kind.name()));
    let mut command = std::process::Command::new("perf");
    command
        .args(["record", "-F", "999", "-g", "-o"])
        .arg(&data)
        .arg("-p")
        .arg(pid.to_string());
    let log = ctx.work_dir.join(format!("perf-{}.log", kind.name()));
    match Process::spawn(command, &log) {
        Ok(p) => {
            eprintln!("  perf record -> {}", data.display());
            Some(p)
        }
        Err(e) => {
            eprintln!("  (perf record failed to start: {e:#})");
            None
        }
    }
}

async fn stop_perf(perf: Process) {
    let pid = perf.pid;
    let _ = std::process::Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status();
    let _ = tokio::task::spawn_blocking(move || {
        let mut perf = perf;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while perf.exited().is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .await;
}

// === Two replicas, one group ===

#[derive(Debug, Clone)]
pub struct Replicas {
    pub messages: u64,
    /// First to last receipt at the app.
    pub span: Duration,
    /// Requests the app received, and distinct message ids among them.
    pub received: u64,
    pub distinct: u64,
    /// Receipts of a message id the app had already seen.
    pub duplicates: u64,
    /// What each replica's `courier_acks_total` said at the end.
    pub acks: Vec<Option<f64>>,
}

impl Replicas {
    pub fn rate(&self) -> f64 {
        self.messages.saturating_sub(1) as f64 / self.span.as_secs_f64().max(1e-9)
    }
}

/// Two courier processes, one Redis queue, one consumer group: pre-fills
/// `n` messages, starts both, and checks that every message reached the
/// app once.
pub async fn replicas(ctx: &Ctx, n: u64) -> anyhow::Result<Replicas> {
    let target = Target::new(Kind::Redis, "replicas", &ctx.work_dir);
    target.reachable().map_err(anyhow::Error::msg)?;
    let result = replicas_target(ctx, &target, n).await;
    target.cleanup().await;
    result
}

async fn replicas_target(ctx: &Ctx, target: &Target, n: u64) -> anyhow::Result<Replicas> {
    target.prefill(n, &ctx.body).await?;
    ctx.app.reset(false);
    ctx.app.track_ids();
    let mut replicas = Vec::new();
    for name in ["replica-a", "replica-b"] {
        let mut args = courier_args(ctx, target, &[]);
        if let Some(at) = args.iter().position(|a| a == "--consumer") {
            args[at + 1] = name.into();
        }
        let log = ctx.work_dir.join(format!("courier-redis-{name}.log"));
        replicas.push(start_courier(ctx, args, log).await?);
    }
    let timeout = Duration::from_secs(60).max(Duration::from_secs(n / 200));
    let got = ctx.app.wait_for(n, timeout).await;
    // Anything handed out twice would arrive right behind the rest.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let acks = replicas
        .iter()
        .map(|r| r.metric("courier_acks_total"))
        .collect();
    let received = ctx.app.count();
    let (distinct, duplicates) = ctx.app.ids();
    let span = ctx.app.span().context("no receipts")?;
    for replica in replicas {
        stop(replica.process).await;
    }
    if got < n {
        bail!("the app received {got} of {n} messages from two replicas");
    }
    Ok(Replicas {
        messages: n,
        span,
        received,
        distinct,
        duplicates,
        acks,
    })
}

// === Latency ===

#[derive(Debug, Clone)]
pub struct Latency {
    pub samples: usize,
    pub p50: Duration,
    pub p99: Duration,
    pub p999: Duration,
    pub max: Duration,
}

impl Latency {
    pub fn from_ns(mut ns: Vec<u64>) -> anyhow::Result<Self> {
        if ns.is_empty() {
            bail!("no samples");
        }
        ns.sort_unstable();
        let at = |p: f64| {
            let i = ((p * ns.len() as f64).ceil() as usize).clamp(1, ns.len()) - 1;
            Duration::from_nanos(ns[i])
        };
        Ok(Self {
            samples: ns.len(),
            p50: at(0.50),
            p99: at(0.99),
            p999: at(0.999),
            max: Duration::from_nanos(*ns.last().unwrap_or(&0)),
        })
    }
}

/// Direct requests to the app at `rate`, without courier.
pub async fn direct_latency(ctx: &Ctx, rate: u64, secs: u64) -> anyhow::Result<Latency> {
    ctx.app.reset(true);
    let count = rate * secs;
    crate::load::paced_direct(ctx.app.addr, rate, rate.min(1000), count, ctx.body.clone()).await?;
    collect(ctx, count).await
}

async fn collect(ctx: &Ctx, count: u64) -> anyhow::Result<Latency> {
    let deadline = Instant::now() + Duration::from_secs(15);
    while (ctx.app.latencies().len() as u64) < count && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let samples = ctx.app.latencies();
    if (samples.len() as u64) < count {
        bail!("only {} of {count} stamped messages arrived", samples.len());
    }
    Latency::from_ns(samples)
}

/// Enqueue-to-receipt latency through courier at `rate` messages/s.
pub async fn latency(
    ctx: &Ctx,
    kind: Kind,
    who: Consumer,
    rate: u64,
    secs: u64,
) -> anyhow::Result<Latency> {
    if kind == Kind::Embedded && who == Consumer::Bare {
        bail!(
            "not measured: the embedded queue is one file held by one process, and the producer shares courier's handle in the harness"
        );
    }
    let target = Target::new(kind, &format!("{}-latency", who.name()), &ctx.work_dir);
    target.reachable().map_err(anyhow::Error::msg)?;
    let result = latency_target(ctx, &target, who, rate, secs).await;
    target.cleanup().await;
    result
}

async fn latency_target(
    ctx: &Ctx,
    target: &Target,
    who: Consumer,
    rate: u64,
    secs: u64,
) -> anyhow::Result<Latency> {
    // The embedded queue is one file held by one process: courier runs
    // inside the harness there, so the producer can share its handle.
    let (running, in_process, producer) = if target.kind == Kind::Embedded {
        let in_process = InProcess::start(ctx, target).await?;
        (None, Some(in_process), target.producer().await?)
    } else {
        // The producer first: it creates the queue the bare loop consumes.
        let producer = target.producer().await?;
        let log = ctx
            .work_dir
            .join(format!("{}-{}-latency.log", who.name(), target.kind.name()));
        (
            Some(Running::start(ctx, who, target, log).await?),
            None,
            producer,
        )
    };
    // Let the consumer set up (courier's AMQP and NATS do it on the first read).
    tokio::time::sleep(Duration::from_secs(1)).await;
    ctx.app.reset(true);
    let count = rate * secs;
    let warmup = rate.min(1000);
    let interval = Duration::from_nanos(1_000_000_000 / rate.max(1));
    let start = Instant::now();
    let mut sends = Vec::with_capacity((warmup + count) as usize);
    for i in 0..warmup + count {
        tokio::time::sleep_until(start + interval * i as u32).await;
        let headers = if i >= warmup {
            vec![(SENT_HEADER.to_string(), now_ns().to_string())]
        } else {
            Vec::new()
        };
        let (producer, body) = (producer.clone(), ctx.body.clone());
        sends.push(tokio::spawn(
            async move { producer.send(body, &headers).await },
        ));
    }
    let mut failed = None;
    for send in sends {
        if let Err(e) = send.await.map_err(anyhow::Error::from).and_then(|r| Ok(r?)) {
            failed = Some(e);
        }
    }
    let result = match failed {
        Some(e) => Err(e.context("sending")),
        None => collect(ctx, count).await,
    };
    producer.close().await;
    drop(producer);
    if let Some(running) = running {
        stop(running.into_process()).await;
    }
    if let Some(in_process) = in_process {
        in_process.stop().await;
    }
    result
}

/// `courier run` inside this process (the embedded queue's latency run).
pub(crate) struct InProcess {
    shutdown: tokio_util::sync::CancellationToken,
    handle: tokio::task::JoinHandle<anyhow::Result<courier::dispatch::DrainReport>>,
}

impl InProcess {
    pub(crate) async fn start(ctx: &Ctx, target: &Target) -> anyhow::Result<Self> {
        use clap::Parser;
        let mut argv = vec!["courier".to_string(), "run".to_string()];
        argv.extend(courier_args(ctx, target, &["--listen", "127.0.0.1:0"]));
        let cli = courier::cmd::Cli::try_parse_from(argv)?;
        let courier::cmd::Command::Run(args) = cli.command else {
            bail!("not a run command");
        };
        let config = courier::cmd::run::config(&args).map_err(|e| anyhow!(e.0))?;
        let shutdown = tokio_util::sync::CancellationToken::new();
        let (_, handle) = courier::sidecar::Sidecar::new(config)
            .start(shutdown.clone())
            .await?;
        Ok(Self { shutdown, handle })
    }

    pub(crate) async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.handle.await;
    }
}

// === The Celery peer ===

#[derive(Debug, Clone)]
pub struct CeleryRun {
    pub messages: u64,
    pub span: Duration,
    pub peak_kib: u64,
    pub cpu_secs: f64,
    pub versions: String,
}

impl CeleryRun {
    pub fn rate(&self) -> f64 {
        self.messages.saturating_sub(1) as f64 / self.span.as_secs_f64().max(1e-9)
    }

    pub fn cpu_per_10k(&self) -> f64 {
        self.cpu_secs / self.messages as f64 * 10_000.0
    }
}

pub async fn celery(ctx: &Ctx, n: u64) -> anyhow::Result<CeleryRun> {
    Target::new(Kind::Redis, "celery", &ctx.work_dir)
        .reachable()
        .map_err(anyhow::Error::msg)?;
    let python = tokio::task::spawn_blocking(celery::ensure_venv).await??;
    let versions = celery::versions(&python);
    let queue = format!("courier-bench-{}-celery", std::process::id());
    let result = celery_run(ctx, &python, &queue, n).await;
    celery::cleanup(&queue).await;
    result.map(|(messages, span, peak_kib, cpu_secs)| CeleryRun {
        messages,
        span,
        peak_kib,
        cpu_secs,
        versions,
    })
}

async fn celery_run(
    ctx: &Ctx,
    python: &Path,
    queue: &str,
    n: u64,
) -> anyhow::Result<(u64, Duration, u64, f64)> {
    let body = String::from_utf8(ctx.body.to_vec()).context("the body is ASCII")?;
    let (py, url, q) = (python.to_path_buf(), ctx.app.url(), queue.to_string());
    tokio::task::spawn_blocking(move || celery::feed(&py, &url, &q, n, &body)).await??;
    ctx.app.reset(false);
    let log = ctx.work_dir.join("celery-worker.log");
    let worker = celery::worker(python, &ctx.app.url(), queue, &log)?;
    let timeout = Duration::from_secs(120).max(Duration::from_secs(n / 20));
    let deadline = Instant::now() + timeout;
    let mut at_first: Option<Usage> = None;
    while ctx.app.count() < n && Instant::now() < deadline {
        if at_first.is_none() && ctx.app.count() > 0 {
            at_first = Some(celery::usage(&worker));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let at_last = celery::usage(&worker);
    let got = ctx.app.count();
    let tail = worker.log_tail(5);
    stop(worker).await;
    if got < n {
        bail!("the app received {got} of {n} tasks' POSTs; the worker's log ends:\n{tail}");
    }
    let span = ctx.app.span().context("no receipts")?;
    Ok((
        n,
        span,
        at_last.peak_kib,
        at_last.cpu_secs - at_first.unwrap_or_default().cpu_secs,
    ))
}

// === Retry backlog ===

#[derive(Debug, Clone)]
pub struct Backlog {
    pub entries: u64,
    pub write: Duration,
    pub traffic: u64,
    pub rss_before_kib: u64,
    pub rss_after_kib: u64,
    pub peak_kib: u64,
    /// `courier_retry_backlog` as courier reported it.
    pub gauge: Option<f64>,
    /// Messages of the backlog the app received (must be 0: they are an
    /// hour away).
    pub early: u64,
}

/// Runs `traffic` messages through courier, reads its RSS, writes `entries`
/// retries due in an hour to `<queue>.retry` the way courier stores them,
/// waits until courier reports the backlog, runs `traffic` more messages,
/// and reads its RSS again.
pub async fn backlog(ctx: &Ctx, entries: u64, traffic: u64) -> anyhow::Result<Backlog> {
    let target = Target::new(Kind::Redis, "backlog", &ctx.work_dir);
    target.reachable().map_err(anyhow::Error::msg)?;
    let result = backlog_target(ctx, &target, entries, traffic).await;
    target.cleanup().await;
    result
}

async fn backlog_target(
    ctx: &Ctx,
    target: &Target,
    entries: u64,
    traffic: u64,
) -> anyhow::Result<Backlog> {
    ctx.app.reset(false);
    let log = ctx.work_dir.join("courier-redis-backlog.log");
    let args = courier_args(ctx, target, &["--depth-interval", "1s"]);
    let courier = start_courier(ctx, args, log).await?;
    let result = async {
        let through = |want: u64| {
            let (ctx, target) = (ctx.clone(), target.clone());
            async move {
                target.prefill(traffic, &ctx.body).await?;
                let got = ctx.app.wait_for(want, Duration::from_secs(120)).await;
                if got < want {
                    bail!("the app received {got} of {want} messages");
                }
                anyhow::Ok(())
            }
        };
        through(traffic).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let before = courier.usage();
        let clock = Instant::now();
        write_backlog(&target.queue, entries, &ctx.body).await?;
        let write = clock.elapsed();
        // Courier's depth poll (every second here) must see all of it.
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut gauge = None;
        while Instant::now() < deadline {
            gauge = courier.metric("courier_retry_backlog");
            if gauge.is_some_and(|g| g >= entries as f64) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        // Many rounds of the mover (every 50 ms) over the whole set.
        tokio::time::sleep(Duration::from_secs(10)).await;
        through(2 * traffic).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let after = courier.usage();
        Ok(Backlog {
            entries,
            write,
            traffic,
            rss_before_kib: before.rss_kib,
            rss_after_kib: after.rss_kib,
            peak_kib: after.peak_kib,
            gauge,
            early: ctx.app.count().saturating_sub(2 * traffic),
        })
    }
    .await;
    stop(courier.process).await;
    result
}

/// `entries` scheduled retries, encoded exactly as courier's Redis source
/// stores them (`Delivery::fields_for_retry` + `encode_fields`), due in an
/// hour.
async fn write_backlog(queue: &str, entries: u64, body: &Bytes) -> anyhow::Result<()> {
    let mut con = crate::sources::redis().await?;
    let now = SystemTime::now();
    let due = (now + Duration::from_secs(3600))
        .duration_since(UNIX_EPOCH)?
        .as_millis() as u64;
    let key = format!("{queue}.retry");
    let mut i = 0u64;
    while i < entries {
        let mut pipe = redis::pipe();
        for _ in 0..10 {
            if i >= entries {
                break;
            }
            let mut zadd = redis::cmd("ZADD");
            zadd.arg(&key);
            for _ in 0..1000 {
                if i >= entries {
                    break;
                }
                let id = format!("1700000000000-{i}");
                let fields = vec![(
                    Bytes::from_static(courier::model::PAYLOAD.as_bytes()),
                    body.clone(),
                )];
                let delivery = Delivery::from_fields(&id, fields, 0, id.clone(), Some(now));
                zadd.arg(due)
                    .arg(encode_fields(&delivery.fields_for_retry(2, now)));
                i += 1;
            }
            pipe.add_command(zadd).ignore();
        }
        pipe.query_async::<()>(&mut con).await?;
    }
    Ok(())
}
