//! `courier console`: a dead-letter console in the browser. An overview of
//! every queue it is given (depth, in flight, retry backlog, dead letters,
//! the oldest one's age, and a sparkline of the dead-letter depth over the
//! last hour), each queue's dead letters a page at a time with the same
//! expressions `courier dlq --filter` takes, one letter in full, and, when
//! started with `--allow-writes`, the same replay, edit, purge and job
//! commands as `courier dlq`, through the same code (`cmd::dlq`).
//!
//! Safe by default: read-only unless `--allow-writes`; with `--token-file`,
//! every request but `/healthz` carries the token (a bearer header, or the
//! cookie the login form sets); a state-changing request must come from the
//! console's own pages (same origin, and the form's token); every page,
//! script and style is inside the binary, and the headers forbid anything
//! else (`server.rs`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use clap::{Args, Parser};
use tokio::sync::OnceCell;

use super::args::UsageError;
use super::dlq::Target;
use crate::source::{self, DeadLetterStore, Depth, SourceOptions};

mod config;
mod pages;
mod prometheus;
mod server;

pub use config::QueueSpec;

#[derive(Debug, Clone, Args)]
pub struct ConsoleArgs {
    /// Address to serve on; in a cluster 0.0.0.0:9470 behind a ClusterIP
    /// Service.
    #[arg(long, env = "COURIER_CONSOLE_LISTEN", default_value = "127.0.0.1:9470")]
    pub listen: SocketAddr,
    /// A queue to show, SOURCE#QUEUE (the broker URL, then the queue after
    /// the last #), e.g. redis://127.0.0.1:6379/0#orders; repeatable.
    #[arg(long = "queue", value_name = "SOURCE#QUEUE", value_parser = config::parse_flag)]
    pub queues: Vec<QueueSpec>,
    /// A YAML file of queues: `queues: [{name, queue, dlq, source | sourceEnv}]`;
    /// `sourceEnv` names an environment variable holding the URL (a Secret).
    #[arg(long, env = "COURIER_CONSOLE_QUEUES_FILE")]
    pub queues_file: Option<PathBuf>,
    /// Allow replay, edit, purge and cancel; without it the console only
    /// reads.
    #[arg(long, env = "COURIER_CONSOLE_ALLOW_WRITES")]
    pub allow_writes: bool,
    /// A file holding the bearer token every request must carry (one
    /// trailing newline is ignored); a browser gives it once on the login
    /// page.
    #[arg(long, env = "COURIER_CONSOLE_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Prometheus to read the last hour of dead-letter depth from
    /// (courier_dlq_depth), instead of the console's own samples.
    #[arg(long, env = "COURIER_CONSOLE_PROMETHEUS_URL")]
    pub prometheus_url: Option<String>,
    /// How often the console samples every queue's depth for its sparkline.
    #[arg(long, env = "COURIER_CONSOLE_SAMPLE_EVERY", default_value = "30s", value_parser = crate::duration::parse_flag)]
    pub sample_every: Duration,
}

/// The samples a sparkline shows: an hour at the default 30 s.
const HISTORY: usize = 120;

/// One queue the console shows: its spec, its store (opened on first use
/// and kept), and its dead-letter depth over the last samples.
pub(crate) struct Queue {
    pub spec: QueueSpec,
    store: OnceCell<Arc<dyn DeadLetterStore>>,
    history: Mutex<std::collections::VecDeque<(SystemTime, u64)>>,
    /// The last depth read, and when: what the overview shows.
    last: Mutex<Option<Reading>>,
}

/// A depth read at a moment: `None` inside where the broker's store cannot
/// read it alone, an error's text where the read failed.
pub(crate) type Reading = (SystemTime, Result<Option<Depth>, String>);

impl Queue {
    fn new(spec: QueueSpec) -> Self {
        Self {
            spec,
            store: OnceCell::new(),
            history: Mutex::default(),
            last: Mutex::default(),
        }
    }

    /// The target `courier dlq` would be given for this queue: the same
    /// flags, so the same environment (seal keys, TLS files, policy) applies.
    pub fn target(&self) -> Target {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            target: Target,
        }
        let spec = &self.spec;
        Only::parse_from([
            "console",
            "--source",
            spec.url.as_str(),
            "--queue",
            &spec.queue,
            "--dlq",
            &spec.dlq,
        ])
        .target
    }

    pub async fn store(&self) -> anyhow::Result<Arc<dyn DeadLetterStore>> {
        self.store
            .get_or_try_init(|| async {
                let (url, tls, sasl) = self.target().source.parse()?;
                let mut options = SourceOptions::new(&self.spec.queue);
                options.live.dead_letter_queue = self.spec.dlq.clone();
                options.tls = tls;
                options.sasl = sasl;
                options.seal = self.target().seal.load()?;
                Ok::<_, anyhow::Error>(source::open_admin(&url, options).await?)
            })
            .await
            .cloned()
    }

    /// Reads the depth now, notes it, and adds its dead letters to the
    /// history.
    async fn sample(&self) {
        let read = match self.store().await {
            Ok(store) => store
                .depth_of(&self.spec.dlq)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(format!("{e:#}")),
        };
        let now = SystemTime::now();
        if let Ok(Some(depth)) = &read {
            let mut history = self.history.lock().unwrap_or_else(|e| e.into_inner());
            history.push_back((now, depth.dead_letters));
            while history.len() > HISTORY {
                history.pop_front();
            }
        }
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some((now, read));
    }

    pub fn last(&self) -> Option<Reading> {
        self.last.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The samples of the sparkline: from Prometheus when the console was
    /// given one (the sidecars' `courier_dlq_depth` over the last hour),
    /// else the console's own since it started.
    pub async fn history(&self, prometheus: Option<&str>) -> History {
        if let Some(url) = prometheus {
            match prometheus::dead_letters_last_hour(url, &self.spec.queue).await {
                Ok(points) => {
                    return History {
                        points,
                        from: "prometheus",
                    };
                }
                Err(e) => eprintln!(
                    "warning: console: Prometheus at {url} gave no history of {}: {e}; showing the console's own samples",
                    self.spec.queue
                ),
            }
        }
        History {
            points: self
                .history
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .copied()
                .collect(),
            from: "console",
        }
    }
}

/// A sparkline's samples, and where they came from (`prometheus` or the
/// `console`'s own), which the page says.
pub(crate) struct History {
    pub points: Vec<(SystemTime, u64)>,
    pub from: &'static str,
}

/// What every request sees.
pub(crate) struct Console {
    pub queues: Vec<Queue>,
    pub allow_writes: bool,
    pub token: Option<String>,
    /// Put in every form, and required back with every state-changing
    /// request: a page of another origin cannot read it.
    pub form_token: String,
    pub prometheus: Option<String>,
}

impl Console {
    /// Where `queue` is in the console's list: its pages' `/q/N`.
    pub fn index_of(&self, queue: &Queue) -> usize {
        self.queues
            .iter()
            .position(|q| std::ptr::eq(q, queue))
            .unwrap_or_default()
    }
}

pub async fn run(args: ConsoleArgs) -> anyhow::Result<ExitCode> {
    let mut specs = args.queues.clone();
    if let Some(path) = &args.queues_file {
        specs.extend(config::load(path).map_err(UsageError)?);
    }
    if specs.is_empty() {
        return Err(UsageError(
            "console: no queue to show; give --queue SOURCE#QUEUE or --queues-file FILE".into(),
        )
        .into());
    }
    let token = match &args.token_file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| UsageError(format!("--token-file {}: {e}", path.display())))?;
            let token = text.strip_suffix('\n').unwrap_or(&text).to_string();
            if token.len() < 16 {
                return Err(UsageError(format!(
                    "--token-file {}: the token is {} characters; use at least 16 (e.g. `openssl rand -hex 32`)",
                    path.display(),
                    token.len()
                ))
                .into());
            }
            Some(token)
        }
        None => None,
    };
    if args.allow_writes && token.is_none() && !args.listen.ip().is_loopback() {
        eprintln!(
            "warning: console: writes are allowed on {} without a token: anyone who reaches it can replay and purge",
            args.listen
        );
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| anyhow::anyhow!("console: cannot listen on {}: {e}", args.listen))?;
    let console = Arc::new(Console {
        queues: specs.into_iter().map(Queue::new).collect(),
        allow_writes: args.allow_writes,
        token,
        form_token: format!("{:032x}", rand::random::<u128>()),
        prometheus: args.prometheus_url.clone(),
    });
    eprintln!(
        "console: serving {} queue{} on http://{} ({})",
        console.queues.len(),
        if console.queues.len() == 1 { "" } else { "s" },
        listener.local_addr()?,
        if console.allow_writes {
            "writes allowed"
        } else {
            "read-only"
        }
    );
    let sampler = {
        let console = console.clone();
        let every = args.sample_every;
        tokio::spawn(async move {
            loop {
                for queue in &console.queues {
                    queue.sample().await;
                }
                tokio::time::sleep(every).await;
            }
        })
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let serving = server::serve(listener, console, stop.clone());
    tokio::select! {
        _ = serving => {}
        _ = tokio::signal::ctrl_c() => stop.cancel(),
        _ = terminated() => stop.cancel(),
    }
    sampler.abort();
    Ok(ExitCode::SUCCESS)
}

async fn terminated() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut signal) => {
            signal.recv().await;
        }
        Err(_) => std::future::pending().await,
    }
}
