//! courier-bench: measures courier against the bare loop of each broker (the
//! simplest correct consumer with the same client crate), the app's own
//! limit and a Celery worker, on one machine, in one run, as ratios.
//!
//! - [`app`]: the trivial hyper app that answers 200, and the stopwatch.
//! - [`bare`]: the bare loops (`courier-bench bare`, run as a child).
//! - [`counts`]: instructions (callgrind) and system calls (strace) per
//!   message.
//! - [`load`]: the closed-loop load generator (the limit) and paced direct
//!   requests (the latency baseline).
//! - [`sources`]: the brokers, their pre-fill and clean-up.
//! - [`servers`]: the brokers the harness runs itself (Kafka's mock
//!   cluster, moto for SQS, the Pub/Sub emulator).
//! - [`child`]: courier and Celery as child processes, and what `/proc` says
//!   they cost.
//! - [`runs`]: drain, latency, two replicas, the Celery peer, the retry
//!   backlog.
//! - [`report`]: the table, `BENCHMARKS.md` and the targets.
//! - [`dead_letters`]: `courier-bench dlq`, `courier dlq list` and `replay
//!   --dry-run` over a million dead letters on Redis (issue 29), then
//!   `courier console`'s pages of them (issue 30), with a part of
//!   `BENCHMARKS.md` of its own.
//! - [`batches`]: `courier-bench batch`, courier's batches (1, 10, 100
//!   messages a POST) and one courier with a failing subscription beside
//!   two healthy ones (issue 32), with a part of `BENCHMARKS.md` of its
//!   own.
//!
//! `cargo run --profile dist -p courier-bench -- all` runs everything and
//! rewrites the generated part of `BENCHMARKS.md` (it refuses a tree with
//! uncommitted changes unless `--allow-dirty`, which marks every row);
//! `--smoke` is the tiny run the test suite makes. `-- dlq` is the
//! dead-letter run, apart: it needs nothing but Redis.
#![deny(rust_2018_idioms)]

mod app;
mod bare;
mod batches;
mod celery;
mod child;
mod counts;
mod dead_letters;
mod idle;
mod load;
mod report;
mod runs;
mod servers;
mod sources;
mod torture;
mod torture_app;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::{Args, Parser, Subcommand};

use counts::Tool;
use report::{Machine, Results, Row, Settings, Side};
use runs::{Bench, Consumer, Ctx};
use sources::Kind;

#[derive(Debug, Parser)]
#[command(
    name = "courier-bench",
    about = "Benchmarks courier against each broker's bare loop, the app's own limit and a Celery worker, in one run."
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Every measurement, then the table and BENCHMARKS.md.
    All(Options),
    /// One bare loop, until SIGTERM (the harness starts it as a child).
    Bare(bare::BareArgs),
    /// A producer, courier, an app answering at random and a nemesis
    /// (SIGKILL and restarts of courier, SIGSTOP and restarts of the app and
    /// the broker, live policy edits) for --minutes, then a checker that
    /// accounts for every message id; exits non-zero on a lost, stuck or
    /// unexpected message or RSS growing over 10 %. Brokers: redis (a
    /// private redis-server, stopped and killed too) and embedded.
    Torture(torture::TortureArgs),
    /// The torture run's app (the harness starts it as a child).
    #[command(hide = true)]
    TortureApp(torture_app::AppArgs),
    /// `courier dlq list` (the first 50, and a --filter over all) and
    /// `replay --dry-run` over --letters dead letters on Redis, timed with
    /// their peak RSS against issue 29's targets, then `courier console`'s
    /// first page and RSS against issue 30's; writes its own part of
    /// BENCHMARKS.md.
    Dlq(dead_letters::DlqArgs),
    /// One command of the dlq run, and what it cost (the harness starts it
    /// as a child).
    #[command(hide = true)]
    DlqLaunch(dead_letters::LaunchArgs),
    /// Drains with --batch-max-messages 1, 10 and 100 against the same
    /// app, and one courier with three subscriptions, one of which the app
    /// answers 503, beside the two healthy ones alone (issue 32); writes
    /// its own part of BENCHMARKS.md.
    Batch(batches::BatchArgs),
}

#[derive(Debug, Clone, Args)]
struct Options {
    /// Messages pre-filled and drained per run on redis, amqp, nats and
    /// embedded (the stand-ins have their own: --kafka-messages,
    /// --sqs-messages, --pubsub-messages).
    #[arg(long, default_value_t = 100_000)]
    messages: u64,
    /// Messages fed to the Celery worker (about 440 msg/s: 100,000 would take minutes).
    #[arg(long, default_value_t = 5_000)]
    celery_messages: u64,
    /// Entries of the retry-backlog run.
    #[arg(long, default_value_t = 1_000_000)]
    backlog: u64,
    /// Messages per second of the latency runs on redis, amqp, nats and
    /// embedded (and of the direct request; the stand-ins have their own:
    /// --kafka-rate, --sqs-rate, --pubsub-rate).
    #[arg(long, default_value_t = 1_000)]
    rate: u64,
    /// Seconds of each latency run (after 1 s of warm-up).
    #[arg(long, default_value_t = 10)]
    latency_secs: u64,
    /// Seconds of the limit run (after 1 s of warm-up).
    #[arg(long, default_value_t = 10)]
    limit_secs: u64,
    /// Timed drains of each source, courier and its bare loop in turn; the
    /// throughput ratio is the median of the runs' ratios.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Messages of each counted run (callgrind, strace) per consumer and
    /// source; the middle 80 % of them, while they flow, is counted.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(10..))]
    count_messages: u64,
    /// Sources whose instructions and system calls are counted (any of
    /// --sources).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "redis,amqp,nats,embedded"
    )]
    count_sources: Vec<String>,
    /// Skip the callgrind and strace counts.
    #[arg(long)]
    no_counts: bool,
    /// Messages of the two-replica run.
    #[arg(long, default_value_t = 100_000)]
    replica_messages: u64,
    /// Skip the two-replica run.
    #[arg(long)]
    no_replicas: bool,
    /// Run on a tree with uncommitted changes; every row is marked "uncommitted".
    #[arg(long)]
    allow_dirty: bool,
    /// courier's --concurrency, the bare loops' and the limit's connections.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Sources of the load runs (drains and latency), comma-separated:
    /// redis, amqp, nats, embedded on the servers `scripts/services`
    /// starts; kafka, sqs, pubsub on stand-ins the harness starts for the
    /// run (librdkafka's mock cluster, moto, the Pub/Sub emulator), which
    /// are drained and fed at their own sizes (--kafka-messages,
    /// --kafka-rate, --sqs-..., --pubsub-...) [default: every broker,
    /// redis,amqp,nats,embedded,kafka,sqs,pubsub; with --smoke the first
    /// four]
    #[arg(long, value_delimiter = ',')]
    sources: Option<Vec<String>>,
    /// Messages pre-filled and drained per run on Kafka, librdkafka's mock
    /// cluster (--messages is for the other brokers): the mock keeps at
    /// most 5 MiB a partition and deletes older records unread, so more
    /// than about 50,000 never all arrive.
    #[arg(long, default_value_t = KAFKA_MESSAGES)]
    kafka_messages: u64,
    /// Messages per second of Kafka's latency runs (--rate is for the
    /// other brokers).
    #[arg(long, default_value_t = KAFKA_RATE)]
    kafka_rate: u64,
    /// Messages pre-filled and drained per run on SQS: moto, one Python
    /// process, drains about 70 a second here.
    #[arg(long, default_value_t = SQS_MESSAGES)]
    sqs_messages: u64,
    /// Messages per second of SQS's latency runs (each one `SendMessage`
    /// to moto).
    #[arg(long, default_value_t = SQS_RATE)]
    sqs_rate: u64,
    /// Messages pre-filled and drained per run on Pub/Sub: issue 28's
    /// 100,000 (the bare loop drains the emulator at 14,000 to 22,000 a
    /// second here).
    #[arg(long, default_value_t = PUBSUB_MESSAGES)]
    pubsub_messages: u64,
    /// Messages per second of Pub/Sub's latency runs.
    #[arg(long, default_value_t = PUBSUB_RATE)]
    pubsub_rate: u64,
    /// Skip the Celery peer.
    #[arg(long)]
    no_celery: bool,
    /// Skip the retry-backlog run.
    #[arg(long)]
    no_backlog: bool,
    /// Seconds of each source's empty queue in the rest runs.
    #[arg(long, default_value_t = 60)]
    rest_secs: u64,
    /// Messages sent to an idle queue in each wake run (the median is kept).
    #[arg(long, default_value_t = 5)]
    pickups: usize,
    /// The same on Pub/Sub, where a pickup is the publish and 0 to 50 ms
    /// for either consumer (the emulator looks every 50 ms): a median of 5
    /// differs between two equal consumers by more than 5 ms by chance.
    #[arg(long, default_value_t = PUBSUB_PICKUPS)]
    pubsub_pickups: usize,
    /// Seconds a queue stays empty before each pickup of the wake runs:
    /// longer than the longest wait any consumer asks its broker to hold.
    #[arg(long, default_value_t = 6)]
    idle_gap_secs: u64,
    /// Sources of the rest and wake runs. Every broker by default: an idle
    /// run sends a handful of messages.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "redis,amqp,nats,embedded,kafka,sqs,pubsub"
    )]
    idle_sources: Vec<String>,
    /// Skip the rest and wake runs.
    #[arg(long)]
    no_idle: bool,
    /// The courier binary [default: built with `cargo build --profile dist`, beside this one].
    #[arg(long)]
    courier: Option<PathBuf>,
    /// Kafka: the `kafka-mock` binary [default: `kafka-mock`, else
    /// `courier-bench-kafka-mock`, beside this program].
    #[arg(long)]
    kafka_mock: Option<PathBuf>,
    /// Where to write the report [default: BENCHMARKS.md at the repository root; none with --smoke].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Attach `perf record` to courier during each drain (target/bench/perf-<source>.data).
    #[arg(long)]
    perf: bool,
    /// Tiny sizes, no Celery, and by default only the four sources on the
    /// shared servers (no stand-in to start): checks that the harness
    /// works.
    #[arg(long)]
    smoke: bool,
    /// Only the instruction and system-call counts (no limit, drains,
    /// latency, replicas, Celery or backlog): for comparing two builds.
    #[arg(long, conflicts_with = "no_counts")]
    counts_only: bool,
}

/// The load runs' sources when `--sources` is not given: every broker.
const SOURCES: [&str; 7] = [
    "redis", "amqp", "nats", "embedded", "kafka", "sqs", "pubsub",
];
/// ... and with `--smoke`: the shared servers' four, so that the smoke run
/// starts no stand-in (the Pub/Sub emulator alone takes seconds to start).
const SMOKE_SOURCES: [&str; 4] = ["redis", "amqp", "nats", "embedded"];

// The stand-ins' sizes, from what each drained here (2 shared cores,
// 2026-12-05, both consumers alike) so that the three together add about
// 6 minutes to `all` with 3 runs: the mock cluster 5,500 to 57,000 msg/s
// (and a group join of 3 s a start), moto about 72 msg/s (one Python
// process using a whole core: 14 ms of its CPU a message), the emulator
// about 5,000 msg/s. The mock keeps at most 5 MiB a partition and deletes
// older records unread (librdkafka's `rd_kafka_mock_partition_init`): on
// its 4 partitions 100,000 messages of 256 bytes lost some 20,000 before
// the bare loop read them; 30,000 stay well under.
const KAFKA_MESSAGES: u64 = 30_000;
const KAFKA_RATE: u64 = 1_000;
const SQS_MESSAGES: u64 = 1_000;
const SQS_RATE: u64 = 20;
const PUBSUB_MESSAGES: u64 = 100_000;
const PUBSUB_RATE: u64 = 500;
/// 25 pickups of a 6 s gap add about 3 minutes a consumer to `all`; the
/// median's chance spread is then about a third of a median of 5's.
const PUBSUB_PICKUPS: usize = 25;

impl Options {
    /// The load runs' sources (after `apply_smoke`, which fills in the
    /// default).
    fn sources(&self) -> Vec<String> {
        self.sources.clone().unwrap_or_default()
    }

    /// Messages of each drain on `kind`: a stand-in's own size, else
    /// --messages.
    fn messages_for(&self, kind: Kind) -> u64 {
        match kind {
            Kind::Kafka => self.kafka_messages,
            Kind::Sqs => self.sqs_messages,
            Kind::PubSub => self.pubsub_messages,
            _ => self.messages,
        }
    }

    /// Messages per second of the latency runs on `kind`.
    fn rate_for(&self, kind: Kind) -> u64 {
        match kind {
            Kind::Kafka => self.kafka_rate,
            Kind::Sqs => self.sqs_rate,
            Kind::PubSub => self.pubsub_rate,
            _ => self.rate,
        }
    }

    /// Pickups of each wake run on `kind`.
    fn pickups_for(&self, kind: Kind) -> usize {
        match kind {
            Kind::PubSub => self.pubsub_pickups,
            _ => self.pickups,
        }
    }

    /// Every source some part of the run uses, after `apply_smoke`.
    fn kinds_used(&self) -> anyhow::Result<Vec<Kind>> {
        let mut names = self.sources();
        if !self.no_idle {
            names.extend(self.idle_sources.iter().cloned());
        }
        if !self.no_counts {
            names.extend(self.count_sources.iter().cloned());
        }
        parse_kinds(&names)
    }

    fn apply_smoke(&mut self) {
        if self.sources.is_none() {
            let names: &[&str] = if self.smoke { &SMOKE_SOURCES } else { &SOURCES };
            self.sources = Some(names.iter().map(|s| s.to_string()).collect());
        }
        if self.smoke {
            self.messages = self.messages.min(2_000);
            // Stand-ins named with --sources: enough to see them work.
            for messages in [
                &mut self.kafka_messages,
                &mut self.sqs_messages,
                &mut self.pubsub_messages,
            ] {
                *messages = (*messages).min(200);
            }
            for rate in [
                &mut self.kafka_rate,
                &mut self.sqs_rate,
                &mut self.pubsub_rate,
            ] {
                *rate = (*rate).min(50);
            }
            self.replica_messages = self.replica_messages.min(2_000);
            self.runs = 1;
            self.count_messages = self.count_messages.min(200);
            self.count_sources = vec!["redis".into()];
            self.backlog = self.backlog.min(10_000);
            self.latency_secs = 1;
            self.limit_secs = 1;
            self.no_celery = true;
            self.rest_secs = self.rest_secs.min(2);
            self.pickups = 1;
            self.pubsub_pickups = 1;
            self.idle_gap_secs = 1;
            self.idle_sources = vec!["redis".into()];
        }
        if self.counts_only {
            self.no_replicas = true;
            self.no_celery = true;
            self.no_backlog = true;
            self.no_idle = true;
        }
    }
}

fn repo_root() -> PathBuf {
    celery::bench_dir()
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

fn text_of(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            let out = String::from_utf8_lossy(&o.stdout).trim().to_string();
            if out.is_empty() {
                String::from_utf8_lossy(&o.stderr).trim().to_string()
            } else {
                out
            }
        })
        .and_then(|s| s.lines().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".into())
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(", "))
        .unwrap_or_default()
}

/// The commit a report is to describe and whether the tree has
/// uncommitted changes, which only `allow_dirty` accepts: a generated table
/// must describe a commit that exists.
fn report_commit(allow_dirty: bool) -> anyhow::Result<(String, bool)> {
    let (head, dirty) = commit()?;
    if dirty && !allow_dirty {
        bail!(
            "the working tree has uncommitted changes, and a report must describe a commit that exists: \
             commit them (or stash them), or pass --allow-dirty to mark every row \"uncommitted\""
        );
    }
    Ok((head, dirty))
}

/// The commit the tree is at, and whether it has uncommitted changes.
fn commit() -> anyhow::Result<(String, bool)> {
    let git = |args: &[&str]| -> anyhow::Result<String> {
        let out = Command::new("git")
            .args(args)
            .current_dir(repo_root())
            .output()
            .context("cannot run git")?;
        if !out.status.success() {
            bail!(
                "git {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let head = git(&["rev-parse", "--short=12", "HEAD"])?;
    let status = git(&["status", "--porcelain"])?;
    Ok((head, !status.is_empty()))
}

/// The courier binary a report measures (it must exist) and the machine
/// it runs on, marked with `commit` (the head, and whether the tree was
/// dirty); warns when the machine is busy.
fn measured(courier: Option<&Path>, commit: (String, bool)) -> anyhow::Result<(PathBuf, Machine)> {
    let courier = courier_binary(courier)?;
    if !courier.exists() {
        bail!("no courier binary at {}", courier.display());
    }
    let mut machine = machine(&courier);
    (machine.commit, machine.dirty) = commit;
    if report::loaded(&machine.load_before) {
        eprintln!(
            "warning: the 1-minute load average is {} (above 1.0): timed figures will be noisy",
            machine.load_before
        );
    }
    Ok((courier, machine))
}

fn machine(courier: &Path) -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_default();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| format!("{:.1} GiB", kib as f64 / 1048576.0))
        .unwrap_or_default();
    Machine {
        date: text_of("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        cpu,
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
        memory,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| format!("Linux {}", s.trim()))
            .unwrap_or_default(),
        rustc: text_of("rustc", &["--version"]),
        courier: text_of(&courier.to_string_lossy(), &["--version"]),
        redis: text_of("redis-server", &["--version"]),
        rabbitmq: format!(
            "rabbitmq-server {}",
            text_of("dpkg-query", &["-W", "-f", "${Version}", "rabbitmq-server"])
        ),
        nats: text_of("nats-server", &["--version"]),
        celery: "not run".into(),
        load_before: loadavg(),
        load_after: String::new(),
        commit: String::new(),
        dirty: false,
    }
}

/// The courier binary: the one given, else built with the `dist` profile
/// (thin LTO, as the published image is) beside this one's target folder,
/// together with the `kafka-mock` beside it, which the Kafka runs start
/// when no --kafka-mock is given: `cargo run -p courier-bench` builds only
/// the harness, and a report made so had no Kafka rows.
fn courier_binary(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(path) = given {
        return Ok(path.to_path_buf());
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!(
        "building courier (cargo build --profile dist -p courier --bin courier --bin kafka-mock)..."
    );
    let mut build = Command::new(cargo);
    build
        .args([
            "build",
            "--profile",
            "dist",
            "-p",
            "courier",
            "--bin",
            "courier",
            "--bin",
            "kafka-mock",
        ])
        .current_dir(repo_root());
    for (name, _) in std::env::vars_os() {
        if set_by_cargo_run(&name.to_string_lossy()) {
            build.env_remove(&name);
        }
    }
    let status = build.status().context("cannot run cargo")?;
    if !status.success() {
        bail!("building courier failed");
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("no directory")?;
    // This harness runs from target/<its profile>/; courier's is target/dist/.
    Ok(dir.parent().unwrap_or(dir).join("dist").join("courier"))
}

/// Whether `cargo run` sets the variable `name` for this harness, so that
/// it must not reach the nested `cargo build`. Build scripts (ring's among
/// them) ask to be rerun when `CARGO_PKG_NAME`, `CARGO_MANIFEST_DIR` and
/// the like change, and cargo compares them with its own environment: with
/// the harness's values the nested build reran them and recompiled ring and
/// everything above it, which the next `cargo run` then undid (about 6
/// minutes each way on 2 cores). `CARGO_PROFILE_*`, `CARGO_HOME` and
/// `CARGO_TARGET_DIR` are the user's and pass through.
fn set_by_cargo_run(name: &str) -> bool {
    name.starts_with("CARGO_PKG_")
        || name.starts_with("CARGO_MANIFEST_")
        || name.starts_with("CARGO_BIN_")
        || matches!(
            name,
            "CARGO_CRATE_NAME" | "CARGO_PRIMARY_PACKAGE" | "OUT_DIR"
        )
}

fn body(bytes: usize) -> Bytes {
    // ASCII, so the same body travels as a JSON string through Celery.
    let pattern = b"courier-bench message body 0123456789 abcdefghijklmnopqrstuvwxyz ";
    Bytes::from(
        pattern
            .iter()
            .cycle()
            .take(bytes)
            .copied()
            .collect::<Vec<u8>>(),
    )
}

fn err(e: anyhow::Error) -> String {
    format!("{e:#}")
}

fn parse_kinds(names: &[String]) -> anyhow::Result<Vec<Kind>> {
    names
        .iter()
        .map(|s| Kind::parse(s).with_context(|| format!("unknown source {s:?}")))
        .collect()
}

/// The app's limit and the direct request's latency.
async fn timed_baselines(
    ctx: &Ctx,
    options: &Options,
) -> (
    Result<load::Capacity, String>,
    Result<runs::Latency, String>,
) {
    eprintln!(
        "the limit: {} connections, closed loop, {} s...",
        options.concurrency, options.limit_secs
    );
    ctx.app.reset(false);
    let limit = load::closed_loop(
        ctx.app.addr,
        options.concurrency,
        Duration::from_secs(1),
        Duration::from_secs(options.limit_secs),
        ctx.body.clone(),
    )
    .await
    .map_err(err);
    if let Ok(c) = &limit {
        eprintln!("  {:.0} requests/s ({} errors)", c.per_second(), c.errors);
    }

    eprintln!("direct-request latency at {} msg/s...", options.rate);
    let direct = runs::direct_latency(ctx, options.rate, options.latency_secs)
        .await
        .map_err(err);

    (limit, direct)
}

async fn all(options: &Options, reserved: servers::Reserved) -> anyhow::Result<Results> {
    let kinds = parse_kinds(&options.sources())?;
    let (head, dirty) = report_commit(options.allow_dirty)?;
    let idle_kinds = if options.no_idle {
        Vec::new()
    } else {
        parse_kinds(&options.idle_sources)?
    };
    let count_kinds = if options.no_counts {
        Vec::new()
    } else {
        parse_kinds(&options.count_sources)?
    };
    let (courier, machine) = measured(options.courier.as_deref(), (head, dirty))?;
    let work_dir = repo_root().join("target/bench");
    std::fs::create_dir_all(&work_dir)?;
    // Built beside courier when courier was.
    let kafka_mock = options.kafka_mock.clone().or_else(|| {
        options
            .courier
            .is_none()
            .then(|| courier.with_file_name("kafka-mock"))
    });
    let app = app::App::start().await?;
    let ctx: Ctx = Arc::new(Bench {
        app,
        courier,
        work_dir,
        body: body(256),
        concurrency: options.concurrency,
        perf: options.perf,
    });
    eprintln!("the app listens on {}", ctx.app.url());
    let servers = servers::start(
        &options.kinds_used()?,
        reserved,
        &ctx.work_dir,
        kafka_mock.as_deref(),
    )
    .await;
    let results = measure(&ctx, options, kinds, idle_kinds, count_kinds, machine).await;
    servers.stop().await;
    results
}

/// Every measurement of the run, on the servers [`all`] started.
async fn measure(
    ctx: &Ctx,
    options: &Options,
    kinds: Vec<Kind>,
    idle_kinds: Vec<Kind>,
    count_kinds: Vec<Kind>,
    mut machine: Machine,
) -> anyhow::Result<Results> {
    let idle_gap = Duration::from_secs(options.idle_gap_secs);

    let (limit, direct) = if options.counts_only {
        let skipped = || "not measured (--counts-only)".to_string();
        (Err(skipped()), Err(skipped()))
    } else {
        timed_baselines(ctx, options).await
    };

    let mut rows = Vec::new();
    for kind in kinds {
        let (messages, rate) = (options.messages_for(kind), options.rate_for(kind));
        let mut row = Row::new(kind, messages, rate);
        let timed_runs = if options.counts_only {
            0
        } else {
            options.runs.max(1)
        };
        for run in 1..=timed_runs {
            for who in [Consumer::Bare, Consumer::Courier] {
                eprintln!(
                    "{} {}: draining {} messages (run {run} of {})...",
                    kind.name(),
                    who.name(),
                    messages,
                    options.runs.max(1)
                );
                let drain = runs::drain(ctx, kind, who, messages).await.map_err(err);
                match &drain {
                    Ok(d) => eprintln!(
                        "  {:.0} msg/s, peak RSS {} KiB, {:.3} CPU-s per 10k, the broker server {}",
                        d.rate(),
                        d.peak_kib,
                        d.cpu_per_10k(),
                        d.broker_cpu_per_10k()
                            .map_or("not measured".into(), |c| format!("{c:.3}"))
                    ),
                    Err(e) => eprintln!("  not available: {e}"),
                }
                row.side_mut(who).drains.push(drain);
            }
        }
        let latency_runs = if options.counts_only {
            &[][..]
        } else {
            &[Consumer::Bare, Consumer::Courier][..]
        };
        for &who in latency_runs {
            eprintln!(
                "{} {}: latency at {} msg/s...",
                kind.name(),
                who.name(),
                rate
            );
            let latency = runs::latency(ctx, kind, who, rate, options.latency_secs)
                .await
                .map_err(err);
            match &latency {
                Ok(l) => eprintln!("  p50 {:?}, p99 {:?}, p99.9 {:?}", l.p50, l.p99, l.p999),
                Err(e) => eprintln!("  not available: {e}"),
            }
            row.side_mut(who).latency = latency;
        }
        if idle_kinds.contains(&kind) {
            for who in [Consumer::Bare, Consumer::Courier] {
                eprintln!(
                    "{} {}: {} s at rest, then waking...",
                    kind.name(),
                    who.name(),
                    options.rest_secs
                );
                let rest = idle::rest(ctx, kind, who, options.rest_secs)
                    .await
                    .map_err(err);
                match &rest {
                    Ok(r) => eprintln!(
                        "  {:.3} % of a core, {} requests/s{}, RSS {} KiB",
                        r.cpu_percent(),
                        r.requests_per_second()
                            .map_or("no broker".into(), |v| format!("{v:.2}")),
                        r.busiest_broker_per_second()
                            .map_or(String::new(), |v| format!(" (busiest broker {v:.2})")),
                        r.rss_kib
                    ),
                    Err(e) => eprintln!("  not available: {e}"),
                }
                let wake = idle::wake(ctx, kind, who, options.pickups_for(kind), idle_gap)
                    .await
                    .map_err(err);
                match &wake {
                    Ok(w) => eprintln!(
                        "  start to first delivery {:?}, pickup {:?}",
                        w.first_delivery, w.pickup
                    ),
                    Err(e) => eprintln!("  not available: {e}"),
                }
                let side = row.side_mut(who);
                side.rest = Some(rest);
                side.wake = Some(wake);
            }
        }
        if count_kinds.contains(&kind) {
            for who in [Consumer::Bare, Consumer::Courier] {
                for tool in [Tool::Callgrind, Tool::Strace] {
                    let (from, to) = counts::window(options.count_messages);
                    eprintln!(
                        "{} {}: {} over receipts {from} to {to} of {} messages...",
                        kind.name(),
                        who.name(),
                        tool.name(),
                        options.count_messages
                    );
                    let count = counts::per_message(ctx, kind, who, tool, options.count_messages)
                        .await
                        .map_err(err);
                    match &count {
                        Ok(c) => eprintln!("  {c:.0} per message"),
                        Err(e) => eprintln!("  not available: {e}"),
                    }
                    let side: &mut Side = row.side_mut(who);
                    match tool {
                        Tool::Callgrind => side.instructions = Some(count),
                        Tool::Strace => side.syscalls = Some(count),
                    }
                }
            }
        }
        rows.push(row);
    }

    let replicas = if options.no_replicas {
        None
    } else {
        eprintln!(
            "two courier replicas, one Redis group: {} messages...",
            options.replica_messages
        );
        let run = runs::replicas(ctx, options.replica_messages)
            .await
            .map_err(err);
        match &run {
            Ok(r) => eprintln!(
                "  {:.0} msg/s combined, {} received, {} distinct, {} twice",
                r.rate(),
                r.received,
                r.distinct,
                r.duplicates
            ),
            Err(e) => eprintln!("  not available: {e}"),
        }
        Some(run)
    };

    let celery = if options.no_celery {
        None
    } else {
        eprintln!(
            "celery: {} messages through a prefork worker...",
            options.celery_messages
        );
        let run = runs::celery(ctx, options.celery_messages)
            .await
            .map_err(err);
        match &run {
            Ok(c) => {
                machine.celery = c.versions.clone();
                eprintln!("  {:.0} msg/s", c.rate());
            }
            Err(e) => eprintln!("  not available: {e}"),
        }
        Some(run)
    };

    let backlog = if options.no_backlog {
        None
    } else {
        eprintln!("retry backlog of {} entries...", options.backlog);
        let traffic = (options.messages / 10).clamp(1_000, 10_000);
        Some(
            runs::backlog(ctx, options.backlog, traffic)
                .await
                .map_err(err),
        )
    };

    machine.load_after = loadavg();
    if report::loaded(&machine.load_after) {
        eprintln!(
            "warning: the 1-minute load average was {} at the end (above 1.0): timed figures are noisy",
            machine.load_after
        );
    }
    Ok(Results {
        machine,
        settings: Settings {
            messages: options.messages,
            celery_messages: options.celery_messages,
            body_bytes: ctx.body.len(),
            concurrency: options.concurrency,
            rate: options.rate,
            latency_secs: options.latency_secs,
            limit_secs: options.limit_secs,
            backlog: options.backlog,
            runs: options.runs.max(1),
            count_messages: options.count_messages,
            replica_messages: options.replica_messages,
            smoke: options.smoke,
            rest_secs: options.rest_secs,
            pickups: options.pickups,
            pubsub_pickups: options.pubsub_pickups,
            idle_gap_secs: options.idle_gap_secs,
        },
        limit,
        direct,
        rows,
        replicas,
        celery,
        backlog,
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut options = match cli.command {
        Cmd::All(options) => options,
        // Before any runtime of the harness: the bare loop has one thread.
        Cmd::Torture(args) => {
            return match torture::main(args) {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::from(1),
                Err(e) => {
                    eprintln!("courier-bench torture: {e:#}");
                    ExitCode::from(2)
                }
            };
        }
        Cmd::TortureApp(args) => {
            return match torture_app::run(args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("courier-bench torture-app: {e:#}");
                    ExitCode::FAILURE
                }
            };
        }
        Cmd::Bare(args) => {
            return match bare::run(args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("courier-bench bare: {e:#}");
                    ExitCode::FAILURE
                }
            };
        }
        // Before anything else: the less this process has touched, the
        // lower the floor under the command's peak RSS.
        Cmd::DlqLaunch(args) => {
            return match dead_letters::launch(args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("courier-bench dlq-launch: {e:#}");
                    ExitCode::FAILURE
                }
            };
        }
        Cmd::Dlq(args) => {
            return match dead_letters::main(args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("courier-bench dlq: {e:#}");
                    ExitCode::FAILURE
                }
            };
        }
        Cmd::Batch(args) => {
            return match batches::main(args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("courier-bench batch: {e:#}");
                    ExitCode::FAILURE
                }
            };
        }
    };
    options.apply_smoke();
    // Before the runtime's threads: moto and the Pub/Sub emulator are found
    // through the environment.
    let reserved = match options.kinds_used() {
        Ok(kinds) => servers::reserve(&kinds),
        Err(e) => {
            eprintln!("courier-bench: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("courier-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let out = options
        .out
        .clone()
        .or_else(|| (!options.smoke).then(|| repo_root().join("BENCHMARKS.md")));
    match runtime.block_on(all(&options, reserved)) {
        Ok(results) => {
            print!("{}", results.table());
            if let Some(out) = out {
                if let Err(e) = report::write_markdown(&out, &results.markdown()) {
                    eprintln!("courier-bench: cannot write {}: {e}", out.display());
                    return ExitCode::FAILURE;
                }
                eprintln!("wrote {}", out.display());
            }
            // Background tasks (the app, in-process courier) end with the runtime.
            runtime.shutdown_timeout(Duration::from_secs(1));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("courier-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(args: &[&str]) -> Options {
        let mut argv = vec!["courier-bench", "all"];
        argv.extend(args);
        let Cmd::All(mut options) = Cli::try_parse_from(argv).expect("valid flags").command else {
            panic!("not the all command");
        };
        options.apply_smoke();
        options
    }

    #[test]
    fn every_broker_is_a_default_source_at_its_own_size() {
        let o = options(&[]);
        assert_eq!(o.sources(), SOURCES);
        assert_eq!(o.count_sources, ["redis", "amqp", "nats", "embedded"]);
        assert_eq!(o.messages_for(Kind::Redis), 100_000);
        assert_eq!(o.messages_for(Kind::Kafka), KAFKA_MESSAGES);
        assert_eq!(o.messages_for(Kind::Sqs), SQS_MESSAGES);
        assert_eq!(o.rate_for(Kind::Sqs), SQS_RATE);
        assert_eq!(o.rate_for(Kind::PubSub), PUBSUB_RATE);
        assert_eq!(o.rate_for(Kind::Nats), 1_000);
    }

    #[test]
    fn a_smoke_run_starts_no_stand_in_unless_asked() {
        let o = options(&["--smoke"]);
        assert_eq!(o.sources(), SMOKE_SOURCES);
        assert!(
            o.kinds_used()
                .expect("known sources")
                .iter()
                .all(|k| { !matches!(k, Kind::Kafka | Kind::Sqs | Kind::PubSub) })
        );
        let o = options(&["--smoke", "--sources", "redis,sqs"]);
        assert_eq!(o.sources(), ["redis", "sqs"]);
        assert!(o.messages_for(Kind::Sqs) <= 200);
        assert!(o.rate_for(Kind::Sqs) <= 50);
    }
}
