//! At rest and waking (issue 28): what a consumer costs while its queue is
//! empty, and how soon it delivers once there is work.
//!
//! - [`rest`]: over `secs` of an empty queue, the consumer's CPU and RSS and
//!   the data segments it sent the broker: each a request, or a pipeline of
//!   them. They are read from the kernel's counters of the consumer's own
//!   sockets to the broker's port (`ss -ti`), so every broker is counted the
//!   same way and the shared broker's other clients are left out. A Kafka
//!   cluster is three brokers, each counted on its own port as "the
//!   broker" (and summed). SQS is counted in moto's log, a line per request
//!   it answered: the AWS SDK's connections to moto do not all live from
//!   one reading to the next, and the harness's own client is closed while
//!   the consumer rests, so every line is the consumer's.
//! - [`wake`]: from starting the process to the app receiving the one
//!   message that waited before the start; and the pickup latency, from
//!   sending a message to a queue idle for `--idle-gap-secs` (longer than
//!   the longest wait any consumer asks its broker to hold: courier's Redis
//!   read blocks up to 5 s) to its arrival, the
//!   median of `pickups` of them (on the embedded queue, courier runs
//!   inside the harness for its pickups, and the bare loop's are not
//!   measured: one process holds the file).

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::time::Instant;

use crate::app::{SENT_HEADER, now_ns};
use crate::child::Process;
use crate::runs::{Consumer, Ctx, InProcess, Running, consumer_command, stop};
use crate::sources::{Kind, Target};

/// How long the consumer settles after its start before the rest is
/// counted: connecting, creating its group and the first reads.
const SETTLE: Duration = Duration::from_secs(3);
/// The same on the Kafka mock, whose group coordinator waits 3 s before
/// a new group's first assignment; joining and the first fetches take
/// some seconds more.
const KAFKA_SETTLE: Duration = Duration::from_secs(10);
/// The longest wait for one delivery.
const DELIVERY_LIMIT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct Rest {
    pub secs: f64,
    pub cpu_secs: f64,
    /// `cpu_secs` summed from each thread's CPU time
    /// ([`ThreadCpu`](crate::child::ThreadCpu)); else (nothing could be
    /// read) counted in 10 ms ticks.
    pub exact: bool,
    /// Threads of the consumer that ended during the rest.
    pub threads_ended: usize,
    pub rss_kib: u64,
    /// Requests sent to the broker: data segments, or on SQS the lines of
    /// moto's log; `None` for the embedded queue, which has no broker to
    /// send to.
    pub segments: Option<u64>,
    /// The same for each broker of a cluster (Kafka); empty for a broker
    /// of one server.
    pub by_broker: Vec<u64>,
}

impl Rest {
    /// Percent of one core.
    pub fn cpu_percent(&self) -> f64 {
        self.cpu_secs / self.secs * 100.0
    }

    pub fn requests_per_second(&self) -> Option<f64> {
        Some(self.segments? as f64 / self.secs)
    }

    /// The busiest broker's requests a second, on a cluster.
    pub fn busiest_broker_per_second(&self) -> Option<f64> {
        Some(*self.by_broker.iter().max()? as f64 / self.secs)
    }
}

#[derive(Debug, Clone)]
pub struct Wake {
    /// Process start to the first message delivered.
    pub first_delivery: Duration,
    /// Send to receipt of a message to an idle queue, the median; `None`
    /// where it cannot be measured.
    pub pickup: Result<Duration, String>,
}

/// Data segments sent so far by process `pid` on each of its sockets to
/// 127.0.0.1:`port`, by local port.
fn segments_by_socket(pid: u32, port: u16) -> anyhow::Result<HashMap<u16, u64>> {
    let out = std::process::Command::new("ss")
        .args(["-tinpH", &format!("( dport = :{port} )")])
        .output()
        .context("cannot run ss (iproute2)")?;
    if !out.status.success() {
        bail!("ss failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let owner = format!("pid={pid},");
    let mut found = HashMap::new();
    let mut socket: Option<u16> = None;
    for line in text.lines() {
        if !line.starts_with(char::is_whitespace) {
            // ESTAB 0 0 127.0.0.1:35280 127.0.0.1:4222 users:(("x",pid=1,fd=15))
            socket = line
                .contains(&owner)
                .then(|| line.split_whitespace().nth(3))
                .flatten()
                .and_then(|local| local.rsplit_once(':')?.1.parse().ok());
            continue;
        }
        if let Some(local) = socket.take() {
            let sent = line
                .split_whitespace()
                .find_map(|field| field.strip_prefix("data_segs_out:"))
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            found.insert(local, sent);
        }
    }
    Ok(found)
}

/// Segments sent between two readings; a socket opened in between counts
/// from zero.
fn sent_between(before: &HashMap<u16, u64>, after: &HashMap<u16, u64>) -> u64 {
    after
        .iter()
        .map(|(port, now)| now.saturating_sub(before.get(port).copied().unwrap_or(0)))
        .sum()
}

/// What the consumer `pid` has sent `target`'s brokers so far, one map per
/// broker: its sockets' segments by local port, or (SQS) moto's log lines
/// under the key 0. `None` for the embedded queue.
fn sent_so_far(target: &Target, pid: u32) -> anyhow::Result<Option<Vec<HashMap<u16, u64>>>> {
    if target.kind == Kind::Sqs {
        let (_, log) = crate::servers::moto().map_err(anyhow::Error::msg)?;
        let requests = std::fs::read_to_string(&log)
            .with_context(|| format!("cannot read moto's log {}", log.display()))?
            .lines()
            // `127.0.0.1 - - [date] "POST / HTTP/1.1" 200 -`, the method
            // in colour when the answer is an error.
            .filter(|line| line.contains(" HTTP/1."))
            .count() as u64;
        return Ok(Some(vec![HashMap::from([(0, requests)])]));
    }
    let ports = target.ports();
    if ports.is_empty() {
        return Ok(None);
    }
    ports
        .into_iter()
        .map(|port| segments_by_socket(pid, port))
        .collect::<anyhow::Result<_>>()
        .map(Some)
}

/// `who` on an empty queue of `kind` for `secs`.
pub async fn rest(ctx: &Ctx, kind: Kind, who: Consumer, secs: u64) -> anyhow::Result<Rest> {
    let target = Target::new(kind, &format!("{}-rest", who.name()), &ctx.work_dir);
    target.reachable().map_err(anyhow::Error::msg)?;
    let result = rest_on(ctx, &target, who, secs).await;
    target.cleanup().await;
    result
}

async fn rest_on(ctx: &Ctx, target: &Target, who: Consumer, secs: u64) -> anyhow::Result<Rest> {
    // The queue must exist for the bare loop; the producer makes it (the
    // embedded queue's file is made by whoever opens it, in its folder).
    if let Some(dir) = target.embedded_dir() {
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
    } else {
        let producer = target.producer().await?;
        producer.close().await;
    }
    let log = ctx
        .work_dir
        .join(format!("{}-{}-rest.log", who.name(), target.kind.name()));
    let mut running = Running::start(ctx, who, target, log).await?;
    tokio::time::sleep(if target.kind == Kind::Kafka {
        KAFKA_SETTLE
    } else {
        SETTLE
    })
    .await;
    let pid = running.process().pid;
    let read = || sent_so_far(target, pid);
    let mut threads = crate::child::ThreadCpu::start(pid);
    let (usage_before, sockets_before) = (running.usage(), read()?);
    let started = Instant::now();
    let end = started + Duration::from_secs(secs);
    while Instant::now() < end {
        let left = end.saturating_duration_since(Instant::now());
        tokio::time::sleep(crate::child::THREAD_READ_EVERY.min(left)).await;
        threads.read(pid);
    }
    let (usage_after, sockets_after) = (running.usage(), read()?);
    threads.read(pid);
    let elapsed = started.elapsed();
    let exited = running.exited();
    stop(running.into_process()).await;
    if let Some(status) = exited {
        bail!("the consumer exited ({status}) while at rest");
    }
    let by_broker: Vec<u64> = sockets_before
        .zip(sockets_after)
        .map(|(before, after)| {
            before
                .iter()
                .zip(&after)
                .map(|(before, after)| sent_between(before, after))
                .collect()
        })
        .unwrap_or_default();
    let exact = threads.secs();
    Ok(Rest {
        secs: elapsed.as_secs_f64(),
        cpu_secs: exact.unwrap_or(usage_after.cpu_secs - usage_before.cpu_secs),
        exact: exact.is_some(),
        threads_ended: threads.ended(),
        rss_kib: usage_after.rss_kib,
        segments: (!by_broker.is_empty()).then(|| by_broker.iter().sum()),
        by_broker: if by_broker.len() > 1 {
            by_broker
        } else {
            Vec::new()
        },
    })
}

/// Start to first delivery, then `pickups` pickups from an idle queue.
pub async fn wake(
    ctx: &Ctx,
    kind: Kind,
    who: Consumer,
    pickups: usize,
    gap: Duration,
) -> anyhow::Result<Wake> {
    let target = Target::new(kind, &format!("{}-wake", who.name()), &ctx.work_dir);
    target.reachable().map_err(anyhow::Error::msg)?;
    let result = wake_on(ctx, &target, who, pickups, gap).await;
    target.cleanup().await;
    result
}

async fn wake_on(
    ctx: &Ctx,
    target: &Target,
    who: Consumer,
    pickups: usize,
    gap: Duration,
) -> anyhow::Result<Wake> {
    target.prefill(1, &ctx.body).await?;
    ctx.app.reset(false);
    let log = ctx
        .work_dir
        .join(format!("{}-{}-wake.log", who.name(), target.kind.name()));
    // Spawned as it is, not through `Running::start`, which for courier
    // also waits (polling its log) for `/metrics`: that wait is not the
    // consumer's.
    let (program, args) = consumer_command(ctx, who, target)?;
    let mut command = std::process::Command::new(program);
    command.args(args);
    let started = Instant::now();
    let process = Process::spawn(command, &log)?;
    let got = ctx.app.wait_for(1, DELIVERY_LIMIT).await;
    let first_delivery = started.elapsed();
    if got < 1 {
        stop(process).await;
        bail!("the waiting message was not delivered within {DELIVERY_LIMIT:?}");
    }
    let pickup = match (target.kind, who) {
        // The embedded queue is one file held by one process: courier runs
        // inside the harness for its pickups, so the producer can share
        // its handle, as in the latency run.
        (Kind::Embedded, Consumer::Courier) => {
            stop(process).await;
            let in_process = InProcess::start(ctx, target).await?;
            let pickup = pickup(ctx, target, pickups, gap).await;
            in_process.stop().await;
            return Ok(Wake {
                first_delivery,
                pickup: pickup.map_err(|e| format!("{e:#}")),
            });
        }
        (Kind::Embedded, Consumer::Bare) => Err(
            "not measured: the bare loop holds the file, and nothing else can send to it"
                .to_string(),
        ),
        _ => pickup(ctx, target, pickups, gap)
            .await
            .map_err(|e| format!("{e:#}")),
    };
    stop(process).await;
    Ok(Wake {
        first_delivery,
        pickup,
    })
}

/// How far apart the idle gaps of one wake run's pickups are spread, in
/// all: the longest wait a consumer asks its broker to hold.
const GAP_SPREAD: Duration = Duration::from_secs(3);

/// The median of `n` sends to a queue idle for `gap` and a share of
/// [`GAP_SPREAD`], each to its receipt. Where the broker answers an empty
/// wait only at its end (Kafka's mock), a consumer asks again at a fixed
/// period after each delivery, and gaps of one length fall at one point of
/// that period every time: 6 s gaps made the bare loop's 500 ms fetches
/// pick up in 6.9 ms, every time, and courier's 3 s ones in 3 s. Spread
/// gaps fall across the period, as arrivals do.
async fn pickup(ctx: &Ctx, target: &Target, n: usize, gap: Duration) -> anyhow::Result<Duration> {
    let producer = target.producer().await?;
    let n = n.max(1);
    let mut times = Vec::with_capacity(n);
    for i in 0..n {
        tokio::time::sleep(gap + GAP_SPREAD * i as u32 / n as u32).await;
        ctx.app.reset(true);
        let headers = [(SENT_HEADER.to_string(), now_ns().to_string())];
        producer.send(ctx.body.clone(), &headers).await?;
        if ctx.app.wait_for(1, DELIVERY_LIMIT).await < 1 {
            bail!("a message sent to the idle queue was not delivered within {DELIVERY_LIMIT:?}");
        }
        let latency = ctx
            .app
            .latencies()
            .first()
            .copied()
            .context("no latency recorded")?;
        times.push(Duration::from_nanos(latency));
    }
    producer.close().await;
    times.sort();
    Ok(times[times.len() / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_counted_per_socket_of_the_process() {
        let before = HashMap::from([(35280, 498), (35288, 5)]);
        // 35288 closed, 35300 opened since.
        let after = HashMap::from([(35280, 502), (35300, 3)]);
        assert_eq!(sent_between(&before, &after), 7);
    }
}
