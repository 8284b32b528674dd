//! The commands behind the binary, their flags, and how their failures
//! become exit codes: 0 done, 1 failed, 2 bad usage. The pipeline they run
//! lives outside this folder; nothing outside it imports from here.

pub mod args;
pub mod console;
pub mod crd;
#[cfg(feature = "embedded")]
pub mod demo;
pub mod dlq;
pub mod inject;
pub mod run;
pub mod send;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::telemetry::{self, LogFormat};
use args::UsageError;

#[derive(Debug, Parser)]
#[command(
    name = "courier",
    version,
    about = "A consumer sidecar: pulls messages from a broker, POSTs each to the app, settles it from the answer.",
    propagate_version = true
)]
pub struct Cli {
    /// Log format.
    #[arg(
        long,
        env = "COURIER_LOG_FORMAT",
        value_enum,
        default_value = "human",
        global = true
    )]
    pub log_format: LogFormat,
    /// Log level or filter (RUST_LOG syntax); RUST_LOG wins when set.
    #[arg(long, env = "COURIER_LOG_LEVEL", default_value = "info", global = true)]
    pub log_level: String,
    /// Threads that move messages. 1 keeps courier on one core, next to
    /// the app it serves, and spends the least CPU per message; 0 uses one
    /// per core, for an app faster than one core of courier can feed.
    #[arg(long, env = "COURIER_THREADS", default_value_t = 1, global = true)]
    pub threads: usize,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the sidecar: pull, forward, settle.
    Run(run::RunArgs),
    /// Print the RetryPolicy CustomResourceDefinition (YAML) for kubectl apply.
    Crd,
    /// Enqueue one message.
    Send(send::SendArgs),
    /// Everything on the embedded queue with a sample app; no broker needed.
    #[cfg(feature = "embedded")]
    Demo(demo::DemoArgs),
    /// Inspect, replay, edit and purge dead letters.
    Dlq(dlq::DlqArgs),
    /// A dead-letter console in the browser: every queue's health, and its
    /// dead letters to read (and, with --allow-writes, replay, edit, purge).
    Console(console::ConsoleArgs),
    /// The admission webhook that adds the sidecar to pods that opt in.
    Inject(inject::InjectArgs),
}

/// Parses the command line, runs the command, and maps the result to an
/// exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse_from(dlq::with_jobs_list(std::env::args_os()));
    // The demo's own progress line is the output; its per-message warnings
    // (the dead letters it makes on purpose) would only bury it.
    let level = match cli.command {
        #[cfg(feature = "embedded")]
        Command::Demo(_) if cli.log_level == "info" => "error",
        _ => cli.log_level.as_str(),
    };
    // Traces follow the standard OTEL_* variables, and only the sidecar
    // exports them: a bad value stops `run` before anything starts.
    let trace_settings = match &cli.command {
        Command::Run(_) => match trace_settings() {
            Ok(settings) => settings,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        },
        _ => None,
    };
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
    let traces = match trace_settings
        .map(|(settings, tls)| {
            telemetry::traces::Traces::start(&settings, tls, runtime.handle().clone())
        })
        .transpose()
    {
        Ok(traces) => traces,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    telemetry::init_logging(cli.log_format, level, traces.as_ref());
    match runtime.block_on(dispatch(cli.command, traces)) {
        Ok(code) => code,
        Err(e) if e.downcast_ref::<UsageError>().is_some() => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("error: {}", report(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, each cause left out when what came before
/// already says it: a broker error's message often quotes the client
/// library's error it carries as its cause.
fn report(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

/// The trace export the `OTEL_*` variables ask for, with the TLS
/// configuration that verifies the collector; `None` when traces are off.
fn trace_settings()
-> Result<Option<(telemetry::traces::TraceSettings, rustls::ClientConfig)>, String> {
    let Some(settings) = telemetry::traces::settings_from_env(|name| std::env::var(name).ok())?
    else {
        return Ok(None);
    };
    let (name, file) = match &settings.certificate {
        Some((name, file)) => (*name, Some(file.as_path())),
        None => ("OTEL_EXPORTER_OTLP_CERTIFICATE", None),
    };
    let tls = crate::source::tls::client_config(name, file, "collector")?;
    Ok(Some((settings, tls)))
}

async fn dispatch(
    command: Command,
    traces: Option<telemetry::traces::Traces>,
) -> anyhow::Result<ExitCode> {
    match command {
        Command::Run(args) => run::run(run::configs(&args)?, traces).await,
        Command::Send(args) => send::run(args).await,
        Command::Crd => crd::run(),
        #[cfg(feature = "embedded")]
        Command::Demo(args) => demo::run(args).await,
        Command::Dlq(args) => dlq::run(args).await,
        Command::Console(args) => console::run(args).await,
        Command::Inject(args) => inject::run(args).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_the_message_already_quotes_is_said_once() {
        let cause = std::io::Error::other("NOAUTH Authentication required");
        let e = crate::source::SourceError::refused(format!("Redis refused courier ({cause})"))
            .caused_by(cause);
        let e = anyhow::Error::new(e).context("cannot open --source redis://h");
        assert_eq!(
            report(&e),
            "cannot open --source redis://h: Redis refused courier (NOAUTH Authentication required)"
        );
        let e = anyhow::anyhow!("inner").context("outer");
        assert_eq!(report(&e), "outer: inner");
    }
}
