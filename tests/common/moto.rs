//! The SQS the tests use: moto in server mode (`scripts/moto-server`),
//! one per test binary on a port of its own, started on first use. courier
//! and the plain SDK client reach it through `AWS_ENDPOINT_URL`, set for
//! this process (and so for every courier it starts) before the first
//! client is made.

use std::path::PathBuf;
use std::process::Child;
use std::sync::OnceLock;
use std::time::Duration;

/// The region of every test queue.
pub const SQS_REGION: &str = "us-east-1";

/// A running moto server; it ends when this process closes its stdin,
/// which also happens when this process dies.
pub struct Moto {
    _child: Child,
    pub port: u16,
}

impl Moto {
    pub fn start() -> Self {
        Self::start_with("")
    }

    /// A moto of its own that logs a line per request it answers to `log`.
    pub fn logging_to(log: &std::path::Path) -> Self {
        Self::start_with(&format!("2>'{}'", log.display()))
    }

    fn start_with(redirect: &str) -> Self {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/moto-server");
        // The first run installs moto in .venv-moto.
        let (child, port) = super::server_process::start_server(
            &format!("'{}' -p {{port}} {redirect}", script.display()),
            &[],
            "moto (scripts/moto-server)",
            Duration::from_secs(300),
        );
        Self {
            _child: child,
            port,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

/// The moto server this test binary shares, with the process's AWS
/// environment pointing at it.
pub fn shared_moto() -> &'static Moto {
    static SHARED: OnceLock<Moto> = OnceLock::new();
    SHARED.get_or_init(|| {
        let moto = Moto::start();
        // SAFETY: set once, before any client of this process reads them;
        // the test binary's other threads read no AWS_* variable before
        // they have the shared server, which this initialiser returns.
        unsafe {
            std::env::set_var("AWS_ENDPOINT_URL", moto.endpoint());
            std::env::set_var("AWS_ACCESS_KEY_ID", "testing");
            std::env::set_var("AWS_SECRET_ACCESS_KEY", "testing");
            std::env::set_var("AWS_REGION", SQS_REGION);
            std::env::remove_var("AWS_PROFILE");
        }
        moto
    })
}

/// The `--source` URL of the shared moto.
pub fn sqs_url() -> String {
    shared_moto();
    format!("sqs://{SQS_REGION}")
}

/// A plain SDK client on the shared moto, as an application would make
/// one.
pub async fn sqs_client() -> aws_sdk_sqs::Client {
    use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};
    let moto = shared_moto();
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
        .build_https();
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new(SQS_REGION))
        .endpoint_url(moto.endpoint())
        .http_client(http)
        .load()
        .await;
    aws_sdk_sqs::Client::new(&config)
}

/// The URL of queue `name` on the shared moto, `None` when it is missing.
pub async fn sqs_queue_url(client: &aws_sdk_sqs::Client, name: &str) -> Option<String> {
    client
        .get_queue_url()
        .queue_name(name)
        .send()
        .await
        .ok()
        .and_then(|o| o.queue_url().map(str::to_string))
}
