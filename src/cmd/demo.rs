//! `courier demo`: the embedded queue in a temporary directory, a sample app
//! on a free loopback port that answers a realistic mix, a few hundred
//! messages, a live progress line and a summary. No broker needed.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use clap::Args;

use super::args::UsageError;
use crate::dispatch::{AppSettings, DeliverySettings};
use crate::model::default_dead_letter_queue;
use crate::policy::{Jitter, Policy};
use crate::sidecar::{EndpointSettings, PolicySettings, RunConfig, Sidecar};
use crate::source::{self, SourceOptions, embedded};
use crate::telemetry::{DeadLetterLabels, Metrics, QueueLabels, serve_http};

const QUEUE: &str = "orders";

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Messages to send through the demo.
    #[arg(long, env = "COURIER_DEMO_MESSAGES", default_value_t = 300)]
    pub messages: usize,
    /// Keep the queue in DIR (instead of a temporary directory) and keep the
    /// sidecar and the sample app running after the summary, until Ctrl-C:
    /// the metrics URL stays live, and `courier dlq` can read DIR afterwards.
    #[arg(long, value_name = "DIR")]
    pub keep: Option<std::path::PathBuf>,
}

/// How the sample app treats order `n`: mostly 200; some 503 twice then
/// 200; a burst of 429 with `Retry-After: 1` among the first orders; some
/// 400; a few always 503. The 429s stay in one early burst: courier holds
/// every delivery for the Retry-After, so a 429 spread through the whole run
/// would make the demo mostly a wait.
fn sample_answer(n: usize, attempt: u32) -> (u16, Option<&'static str>, &'static str) {
    match n % 20 {
        0 => (
            400,
            None,
            r#"{"error":"invalid order: quantity must be positive"}"#,
        ),
        1 | 2 if attempt == 1 && n < 40 => (429, Some("1"), r#"{"error":"slow down"}"#),
        3..=5 if attempt <= 2 => (503, None, r#"{"error":"database is restarting"}"#),
        7 if n % 40 == 7 => (503, None, r#"{"error":"payment provider down"}"#),
        _ => (200, None, r#"{"ok":true}"#),
    }
}

/// The sample app's answer to one request.
async fn sample_request(req: Request<Incoming>) -> Response<Full<Bytes>> {
    let attempt: u32 = req
        .headers()
        .get("courier-attempt")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(1);
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let n: usize = std::str::from_utf8(&body)
        .ok()
        .and_then(|b| {
            b.split('"')
                .find_map(|part| part.strip_prefix("order-")?.parse().ok())
        })
        .unwrap_or(0);
    let (status, retry_after, text) = sample_answer(n, attempt);
    let mut response = Response::builder()
        .status(status)
        .header("content-type", "application/json");
    if let Some(value) = retry_after {
        response = response.header("retry-after", value);
    }
    response
        .body(Full::new(Bytes::from_static(text.as_bytes())))
        .unwrap_or_default()
}

fn counter_sum(metrics: &Metrics) -> (u64, u64, u64, HashMap<&'static str, u64>) {
    let q = QueueLabels {
        queue: QUEUE.into(),
    };
    let acked = metrics.acks.get_or_create(&q).get();
    let retried = metrics.retries.get_or_create(&q).get();
    let mut by_reason = HashMap::new();
    for reason in ["permanent-status", "attempts-exhausted", "undeliverable"] {
        let n = metrics
            .dead_letters
            .get_or_create(&DeadLetterLabels {
                queue: QUEUE.into(),
                reason,
            })
            .get();
        by_reason.insert(reason, n);
    }
    let dead = by_reason.values().sum();
    (acked, retried, dead, by_reason)
}

pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let DemoArgs { messages, keep } = args;
    let started = Instant::now();
    // A kept queue's directory outlives the demo; the temporary one goes
    // with it.
    let temporary = match &keep {
        Some(_) => None,
        None => Some(tempfile::tempdir().context("cannot create a temporary directory")?),
    };
    let dir = match (&keep, &temporary) {
        (Some(dir), _) => {
            std::fs::create_dir_all(dir)
                .map_err(|e| UsageError(format!("--keep {}: {e}", dir.display())))?;
            dir.clone()
        }
        (None, Some(temporary)) => temporary.path().to_path_buf(),
        (None, None) => unreachable!("a temporary directory when nothing is kept"),
    };
    let app_listener = TcpListener::bind("127.0.0.1:0").await?;
    let app_addr = app_listener.local_addr()?;
    let app_stop = CancellationToken::new();
    let app = tokio::spawn(serve_http(app_listener, app_stop.clone(), sample_request));

    let url = embedded::url(&dir);
    let producer = source::open(&url, SourceOptions::new(QUEUE)).await?;
    for n in 0..messages {
        let body = format!(r#"{{"order":"order-{n}","amount":{}}}"#, 10 + n % 90);
        let headers = [("content-type".to_string(), "application/json".to_string())];
        producer.send(Bytes::from(body), &headers).await?;
    }

    let policy = Policy {
        name: "demo".into(),
        generation: 1,
        max_attempts: 4,
        timeout: Duration::from_secs(5),
        ..Policy::default()
    }
    .backoff_of(
        Duration::from_millis(100),
        Duration::from_secs(1),
        2.0,
        Jitter::Equal,
    );
    let mut options = SourceOptions::new(QUEUE);
    options.live.visibility_timeout = Duration::from_secs(30);
    let config = RunConfig {
        source: url,
        options,
        app: AppSettings::new(format!("http://{app_addr}/").parse()?),
        delivery: DeliverySettings {
            drain_timeout: Duration::from_secs(5),
            dedup_window: None,
            batch: None,
        },
        policy: PolicySettings::fixed(policy),
        endpoint: EndpointSettings {
            listen: "127.0.0.1:0".parse()?,
            drain_token: None,
            drain_resume_after: Duration::from_secs(90),
            depth_interval: Duration::from_secs(1),
            readiness: crate::telemetry::Readiness::default(),
        },
    };
    println!(
        "courier demo: {messages} orders through the embedded queue to a sample app at http://{app_addr}/"
    );
    println!(
        "the app answers mostly 200, some 503 then 200, an early burst of 429 with Retry-After: 1, some 400, a few always 503\n"
    );
    let sidecar = Sidecar::new(config);
    let metrics = sidecar.metrics.clone();
    let shutdown = CancellationToken::new();
    let (metrics_addr, handle) = sidecar.start(shutdown.clone()).await?;
    println!("metrics at http://{metrics_addr}/metrics\n");

    let deadline = Instant::now() + Duration::from_secs(60);
    let mut stdout = std::io::stdout();
    // A progress line rewritten in place is for a person at a terminal; in
    // a pipe or a log it would be one long line of carriage returns.
    let live = stdout.is_terminal();
    loop {
        let (acked, retried, dead, _) = counter_sum(&metrics);
        let in_flight = metrics
            .in_flight
            .get_or_create(&QueueLabels {
                queue: QUEUE.into(),
            })
            .get();
        if live {
            print!(
                "\r  acked {acked:>5}   retries {retried:>5}   dead-lettered {dead:>4}   in flight {in_flight:>3}   {:>5.1}s",
                started.elapsed().as_secs_f64()
            );
            let _ = stdout.flush();
        }
        if acked + dead >= messages as u64 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    if live {
        println!("\n");
    }
    let (acked, retried, dead, by_reason) = counter_sum(&metrics);
    println!("summary after {:.1}s", started.elapsed().as_secs_f64());
    println!("  sent            {messages}");
    println!("  acked           {acked}");
    println!("  retries         {retried}");
    println!("  dead-lettered   {dead}");
    let mut reasons: Vec<_> = by_reason.into_iter().filter(|(_, n)| *n > 0).collect();
    reasons.sort();
    for (reason, n) in reasons {
        println!("    {reason:<18} {n}");
    }
    let dead_letters = producer
        .dead_letters(&default_dead_letter_queue(QUEUE), 1)
        .await?;
    if let Some(letter) = dead_letters.first() {
        println!(
            "\na dead letter and its fields (`courier demo --keep DIR` keeps the queue for `courier dlq`):"
        );
        println!("  id: {}", letter.id);
        for (name, value) in &letter.fields {
            println!("  {name}: {value}");
        }
        println!("  body: {}", String::from_utf8_lossy(&letter.body));
    }
    if keep.is_some() {
        println!(
            "\nstill running: metrics at http://{metrics_addr}/metrics, the app at http://{app_addr}/; Ctrl-C to stop"
        );
        let _ = tokio::signal::ctrl_c().await;
    }
    shutdown.cancel();
    handle.await.context("the sidecar task failed")??;
    app_stop.cancel();
    let _ = app.await;
    producer.close().await;
    if keep.is_some() {
        let source = format!("--source embedded:{} --queue {QUEUE}", dir.display());
        println!(
            "\nthe queue stays in {}; read its dead letters with",
            dir.display()
        );
        println!("  courier dlq list {source}");
        println!("  courier dlq show {source} ID");
    }
    let lost = messages as u64 - acked - dead;
    if lost > 0 {
        println!("\n{lost} messages did not finish within the demo's minute");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}
