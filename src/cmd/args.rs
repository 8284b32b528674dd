//! What every command's flags share: the source flags, the parsers of
//! sizes, headers and URLs, and [`UsageError`]: a message that says what was
//! wrong and what to do, and exit code 2, before anything has started.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use http::Uri;

use crate::source::sasl::Mechanism;
use crate::source::{Sasl, Seal, SourceUrl, Tls, TlsFiles};

/// Bad usage: the message is printed as is and the process exits with 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

#[derive(Debug, Clone, Args)]
pub struct SourceArgs {
    #[arg(long, env = "COURIER_SOURCE", help = source_help())]
    pub source: String,
    /// Queue to consume: the Redis stream key, the RabbitMQ queue, the NATS stream, the Kafka
    /// topic, the SQS queue name or URL, the Pub/Sub subscription, the embedded queue name.
    /// Required, except by `courier run` with --subscriptions-file or COURIER_SUBSCRIPTIONS.
    // Not required by clap: `run` takes its queues from a subscriptions
    // document instead, which clap cannot see; `check_queue` says it is
    // missing everywhere else.
    #[arg(
        long,
        env = "COURIER_QUEUE",
        default_value = "",
        hide_default_value = true
    )]
    pub queue: String,
    /// PEM file of the CA that signed the broker's certificate, for rediss://, amqps:// and NATS
    /// tls:// [default: the system's root certificates].
    #[arg(long, env = "COURIER_TLS_CA_FILE")]
    pub tls_ca_file: Option<PathBuf>,
    /// PEM client certificate for mutual TLS, with --tls-key-file.
    #[arg(long, env = "COURIER_TLS_CERT_FILE")]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of --tls-cert-file.
    #[arg(long, env = "COURIER_TLS_KEY_FILE")]
    pub tls_key_file: Option<PathBuf>,
    /// Kafka: log in with SASL by this mechanism: PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or
    /// OAUTHBEARER (OAuth 2 client credentials, with --kafka-oauth-token-url). Over kafkas:// the
    /// login goes inside TLS; over kafka:// in the clear.
    #[arg(long, env = "COURIER_KAFKA_SASL_MECHANISM")]
    pub kafka_sasl_mechanism: Option<String>,
    /// Kafka: the SASL user name; with OAUTHBEARER, the OAuth client id.
    #[arg(long, env = "COURIER_KAFKA_SASL_USERNAME")]
    pub kafka_sasl_username: Option<String>,
    /// Kafka: a file holding the SASL password (a mounted Secret; one trailing newline is
    /// ignored); with OAUTHBEARER, the OAuth client secret. Or set COURIER_KAFKA_SASL_PASSWORD.
    /// Never taken from the URL or a flag's value.
    #[arg(long, env = "COURIER_KAFKA_SASL_PASSWORD_FILE")]
    pub kafka_sasl_password_file: Option<PathBuf>,
    /// Kafka with OAUTHBEARER: the identity provider's token endpoint (https://...), where the
    /// client id and secret are exchanged for a token, again before it expires.
    #[arg(long, env = "COURIER_KAFKA_OAUTH_TOKEN_URL")]
    pub kafka_oauth_token_url: Option<String>,
    /// Kafka with OAUTHBEARER: the scope to ask the identity provider for.
    #[arg(long, env = "COURIER_KAFKA_OAUTH_SCOPE")]
    pub kafka_oauth_scope: Option<String>,
}

/// The variable that may hold the SASL password instead of a file.
pub const KAFKA_SASL_PASSWORD_ENV: &str = "COURIER_KAFKA_SASL_PASSWORD";

/// `--source`'s help, from the broker table: every URL form and TLS scheme
/// of this build, so that it cannot fall behind the brokers.
fn source_help() -> String {
    let tls: Vec<String> = crate::source::BROKERS
        .iter()
        .flat_map(|b| {
            b.tls_schemes
                .iter()
                .map(move |s| format!("{s}:// ({})", b.name))
        })
        .collect();
    format!(
        "Broker URL: {} (the brokers of this build; an unknown scheme's error lists them); over TLS: {}",
        crate::source::url_forms(),
        tls.join(", ")
    )
}

impl SourceArgs {
    /// The broker URL and what it connects with, checked: every `--tls-*`
    /// file read and parsed, and given only with a TLS scheme; the SASL
    /// login of `--kafka-sasl-*`, given only for Kafka.
    pub fn parse(&self) -> Result<(SourceUrl, Tls, Option<Sasl>), UsageError> {
        // Before anything connects: a library may log what it connects with.
        for secret in crate::source::secrets_of(&self.source) {
            crate::telemetry::hide_in_logs(&secret);
        }
        for name in ["AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"] {
            if let Ok(secret) = std::env::var(name) {
                crate::telemetry::hide_in_logs(&secret);
            }
        }
        let url = parse_source(&self.source)?;
        check_queue(&self.queue)?;
        let sasl = self.sasl(&url)?;
        let tls = self.tls(&url)?;
        Ok((url, tls, sasl))
    }

    fn tls(&self, url: &SourceUrl) -> Result<Tls, UsageError> {
        let files = TlsFiles {
            ca_file: self.tls_ca_file.clone(),
            cert_file: self.tls_cert_file.clone(),
            key_file: self.tls_key_file.clone(),
        };
        if files == TlsFiles::default() {
            return Ok(Tls::default());
        }
        if !url.uses_tls() {
            let schemes = url.broker().tls_schemes;
            let hint = match schemes.first() {
                Some(scheme) => format!("write {scheme}:// to connect over TLS"),
                None => format!("{} has no TLS", url.broker().name),
            };
            return Err(UsageError(format!(
                "--tls-* files are given but --source {url} does not connect over TLS; {hint}"
            )));
        }
        Tls::load(&files).map_err(UsageError)
    }

    /// The SASL login of `--kafka-sasl-*`: the mechanism, the user and the
    /// secret all given, the secret from its file or variable and hidden
    /// in every log line from here on.
    fn sasl(&self, url: &SourceUrl) -> Result<Option<Sasl>, UsageError> {
        let secret_env = std::env::var(KAFKA_SASL_PASSWORD_ENV)
            .ok()
            .filter(|s| !s.is_empty());
        let given: Vec<&str> = [
            ("--kafka-sasl-username", self.kafka_sasl_username.is_some()),
            (
                "--kafka-sasl-password-file",
                self.kafka_sasl_password_file.is_some(),
            ),
            (
                "--kafka-oauth-token-url",
                self.kafka_oauth_token_url.is_some(),
            ),
            ("--kafka-oauth-scope", self.kafka_oauth_scope.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, set)| set.then_some(flag))
        .collect();
        let Some(mechanism) = &self.kafka_sasl_mechanism else {
            if let Some(flag) = given.first() {
                return Err(UsageError(format!(
                    "{flag} is given without --kafka-sasl-mechanism; name the mechanism ({}) to log in with SASL",
                    Mechanism::NAMES.join(", ")
                )));
            }
            return Ok(None);
        };
        let mechanism = Mechanism::parse(mechanism)
            .map_err(|e| UsageError(format!("--kafka-sasl-mechanism {e}")))?;
        if url.broker().name != "kafka" {
            return Err(UsageError(format!(
                "--kafka-sasl-mechanism is for Kafka, and --source {url} is {}; leave the --kafka-* flags out",
                url.broker().name
            )));
        }
        let (who, what) = match mechanism {
            Mechanism::OAuthBearer => ("the OAuth client id", "the OAuth client secret"),
            _ => ("the user name", "the password"),
        };
        let username = self
            .kafka_sasl_username
            .clone()
            .filter(|u| !u.trim().is_empty())
            .ok_or_else(|| {
                UsageError(format!(
                    "--kafka-sasl-mechanism {mechanism} needs {who}: give --kafka-sasl-username (COURIER_KAFKA_SASL_USERNAME)"
                ))
            })?;
        let (secret, from) = match (&self.kafka_sasl_password_file, secret_env) {
            (Some(_), Some(_)) => {
                return Err(UsageError(format!(
                    "both --kafka-sasl-password-file and {KAFKA_SASL_PASSWORD_ENV} are set; give {what} one way"
                )));
            }
            (Some(path), None) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    UsageError(format!(
                        "--kafka-sasl-password-file {}: cannot read it: {e}",
                        path.display()
                    ))
                })?;
                let secret = text
                    .strip_suffix('\n')
                    .map(|s| s.strip_suffix('\r').unwrap_or(s))
                    .unwrap_or(&text)
                    .to_string();
                (
                    secret,
                    format!("--kafka-sasl-password-file {}", path.display()),
                )
            }
            (None, Some(secret)) => (secret, KAFKA_SASL_PASSWORD_ENV.to_string()),
            (None, None) => {
                return Err(UsageError(format!(
                    "--kafka-sasl-mechanism {mechanism} needs {what}: set {KAFKA_SASL_PASSWORD_ENV}, or give --kafka-sasl-password-file (a mounted Secret)"
                )));
            }
        };
        if secret.is_empty() {
            return Err(UsageError(format!("{from} is empty; it must hold {what}")));
        }
        crate::telemetry::hide_in_logs(&secret);
        let mut sasl = Sasl::new(mechanism, username, secret, from);
        match (mechanism, &self.kafka_oauth_token_url) {
            (Mechanism::OAuthBearer, Some(url)) => {
                let parsed: Uri = url.parse().map_err(|e| {
                    UsageError(format!(
                        "--kafka-oauth-token-url {url:?} is not a URL ({e}); write it like https://idp.example.com/oauth2/token"
                    ))
                })?;
                if !matches!(parsed.scheme_str(), Some("https" | "http")) || parsed.host().is_none()
                {
                    return Err(UsageError(format!(
                        "--kafka-oauth-token-url {url:?} is not an http(s) URL with a host; write it like https://idp.example.com/oauth2/token"
                    )));
                }
                sasl.token_url = Some(url.clone());
                sasl.scope = self.kafka_oauth_scope.clone();
            }
            (Mechanism::OAuthBearer, None) => {
                return Err(UsageError(
                    "--kafka-sasl-mechanism OAUTHBEARER needs --kafka-oauth-token-url, the identity provider's token endpoint".into(),
                ));
            }
            (_, Some(_)) => {
                return Err(UsageError(format!(
                    "--kafka-oauth-token-url is for OAUTHBEARER, and --kafka-sasl-mechanism is {mechanism}; leave it out"
                )));
            }
            (_, None) if self.kafka_oauth_scope.is_some() => {
                return Err(UsageError(format!(
                    "--kafka-oauth-scope is for OAUTHBEARER, and --kafka-sasl-mechanism is {mechanism}; leave it out"
                )));
            }
            (_, None) => {}
        }
        Ok(Some(sasl))
    }
}

/// The seal's keys, for the commands that seal copies (`run`, `dlq
/// replay`): from a file, or the broker's own key per queue.
#[derive(Debug, Clone, Args)]
pub struct SealArgs {
    /// File of the keys that seal courier's copies (a mounted Secret), instead of the random key
    /// the broker keeps per queue: a line per key, `<id> <in force from, RFC 3339> <secret as
    /// 32-128 hex digits>`. The newest key in force signs; a key whose time has not come is
    /// already accepted. Every replica of a queue needs the same file.
    #[arg(long, env = "COURIER_SEAL_KEYS_FILE")]
    pub seal_keys_file: Option<PathBuf>,
    /// How long a key of --seal-keys-file is still accepted after a newer one came into force:
    /// longer than the longest a retry waits, so that copies sealed before a rotation keep their
    /// attempt.
    #[arg(long, env = "COURIER_SEAL_KEY_WINDOW", default_value = "24h", value_parser = crate::duration::parse_flag)]
    pub seal_key_window: Duration,
}

impl SealArgs {
    /// The keys of `--seal-keys-file`, read and checked; none without it.
    pub fn load(&self) -> Result<Option<Arc<Seal>>, UsageError> {
        let Some(path) = &self.seal_keys_file else {
            return Ok(None);
        };
        Seal::from_keys_file(path, self.seal_key_window)
            .map(|seal| Some(Arc::new(seal)))
            .map_err(|e| UsageError(format!("--seal-keys-file {e}")))
    }
}

/// `4MiB`, `512KiB`, `1MB`, `1048576`.
pub fn parse_size(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: usize = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size; write it like 4MiB, 512KiB or 1048576"))?;
    let factor = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" | "kB" => 1000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => {
            return Err(format!(
                "{text:?} has an unknown unit; use B, KiB, MiB, GiB, KB, MB or GB"
            ));
        }
    };
    n.checked_mul(factor)
        .ok_or_else(|| format!("{text:?} is too large"))
}

pub fn parse_header(text: &str) -> Result<(String, String), String> {
    let (name, value) = text.split_once('=').ok_or_else(|| {
        format!("{text:?} is not K=V; write --header content-type=application/json")
    })?;
    if name.is_empty() {
        return Err(format!("{text:?} has an empty header name"));
    }
    if name.to_ascii_lowercase().starts_with("courier-") {
        return Err(format!(
            "{name:?}: courier-* names are courier's own bookkeeping and cannot be set by a producer"
        ));
    }
    Ok((name.to_string(), value.to_string()))
}

/// Checks the queue name, so that a typo fails at start and not on the
/// first broker call.
pub fn check_queue(queue: &str) -> Result<(), UsageError> {
    if queue.trim().is_empty() {
        return Err(UsageError(
            "--queue is empty or not given; name the stream or queue to consume (or set COURIER_QUEUE)".into(),
        ));
    }
    Ok(())
}

pub fn parse_source(text: &str) -> Result<SourceUrl, UsageError> {
    crate::source::parse_url(text).map_err(|e| UsageError(format!("--source: {e}")))
}

/// The app URL: `http://` only, because the app is on localhost and TLS
/// there would only cost time.
pub fn parse_app(text: &str) -> Result<Uri, UsageError> {
    let uri: Uri = text.parse().map_err(|e| {
        UsageError(format!(
            "--app {text:?} is not a URL ({e}); write it like http://127.0.0.1:8080/"
        ))
    })?;
    match uri.scheme_str() {
        Some("http") if uri.host().is_some() => Ok(uri),
        Some("http") => Err(UsageError(format!(
            "--app {text:?} has no host; write it like http://127.0.0.1:8080/"
        ))),
        Some(other) => Err(UsageError(format!(
            "--app {text:?}: scheme {other:?} is not supported; the app is reached over plain http:// on localhost"
        ))),
        None => Err(UsageError(format!(
            "--app {text:?} has no scheme; write it like http://127.0.0.1:8080/"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4MiB"), Ok(4 << 20));
        assert_eq!(parse_size("512KiB"), Ok(512 << 10));
        assert_eq!(parse_size("1MB"), Ok(1_000_000));
        assert_eq!(parse_size("100"), Ok(100));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("4TiB").is_err());
    }

    #[test]
    fn app_urls() {
        assert!(parse_app("http://127.0.0.1:8080/").is_ok());
        let err = parse_app("https://127.0.0.1:8443/").unwrap_err().0;
        assert!(err.contains("\"https\" is not supported"), "{err}");
        assert!(parse_app("127.0.0.1:8080").is_err());
    }

    #[test]
    fn headers() {
        assert_eq!(parse_header("a=b=c"), Ok(("a".into(), "b=c".into())));
        assert!(parse_header("novalue").is_err());
        assert!(parse_header("=x").is_err());
        assert!(parse_header("Courier-Attempt=9").is_err());
    }
}
