//! The commands behind the binary, and how their failures become exit
//! codes: 0 done, 1 failed, 2 bad usage.

use std::io::Read;
use std::process::ExitCode;

use anyhow::Context;
use bytes::Bytes;
use clap::Parser;
use tokio_util::sync::CancellationToken;

use crate::config::{Cli, Command, RunConfig, SendArgs, UsageError, check_queue, parse_source};
use crate::sidecar::Sidecar;
use crate::source::{self, SourceOptions};
use crate::telemetry;

/// Parses the command line, runs the command, and maps the result to an
/// exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo's own progress line is the output; its per-message warnings
    // (the dead letters it makes on purpose) would only bury it.
    let level = match cli.command {
        Command::Demo(_) if cli.log_level == "info" => "error",
        _ => cli.log_level.as_str(),
    };
    telemetry::init_logging(cli.log_format, level);
    let mut builder = match cli.threads {
        1 => tokio::runtime::Builder::new_current_thread(),
        0 => tokio::runtime::Builder::new_multi_thread(),
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli.command)) {
        Ok(code) => code,
        Err(e) if e.downcast_ref::<UsageError>().is_some() => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Run(args) => {
            let config = RunConfig::from_args(&args)?;
            run(config).await
        }
        Command::Send(args) => send(args).await,
        Command::Crd => {
            print!("{}", crate::policy::crd::definition_yaml());
            Ok(ExitCode::SUCCESS)
        }
        Command::Demo(args) => crate::demo::run(args.messages).await,
        Command::Dlq(args) => crate::dlq::run(args).await,
        Command::Inject(args) => crate::inject::run(args).await,
    }
}

async fn run(config: RunConfig) -> anyhow::Result<ExitCode> {
    let shutdown = CancellationToken::new();
    // Listening for signals first: a SIGTERM during start-up drains too.
    let signals = tokio::spawn(wait_for_signal(shutdown.clone()));
    let (addr, sidecar) = Sidecar::new(config).start(shutdown.clone()).await?;
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    let result = sidecar.await.context("the sidecar task failed")?;
    signals.abort();
    result.map(|_| ExitCode::SUCCESS)
}

/// SIGTERM (Kubernetes) or SIGINT (a terminal) starts the drain.
async fn wait_for_signal(shutdown: CancellationToken) {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: draining"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: draining"),
    }
    shutdown.cancel();
}

async fn send(args: SendArgs) -> anyhow::Result<ExitCode> {
    let url = parse_source(&args.source.source)?;
    check_queue(&args.source.queue)?;
    let body = if args.body == "-" {
        let mut buf = Vec::new();
        std::io::stdin()
            .read_to_end(&mut buf)
            .context("cannot read the body from stdin")?;
        Bytes::from(buf)
    } else {
        Bytes::from(args.body.into_bytes())
    };
    let source = source::open(&url, SourceOptions::new(&args.source.queue))
        .await
        .with_context(|| format!("cannot open --source {url}"))?;
    let id = source.send(body, &args.headers).await?;
    source.close().await;
    println!("{id}");
    Ok(ExitCode::SUCCESS)
}
