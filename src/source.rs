//! Sources: the traits and shared parts (`courier_core::source`, all
//! re-exported here), one crate per broker (`crates/<broker>`, each a cargo
//! feature, re-exported as `source::<broker>`), and the table of the brokers
//! this build has.

pub use courier_core::source::*;

#[cfg(feature = "amqp")]
pub use courier_amqp as amqp;
#[cfg(feature = "embedded")]
pub use courier_embedded as embedded;
#[cfg(feature = "kafka")]
pub use courier_kafka as kafka;
#[cfg(feature = "nats")]
pub use courier_nats as nats;
#[cfg(feature = "pubsub")]
pub use courier_pubsub as pubsub;
#[cfg(feature = "redis")]
pub use courier_redis as redis;
#[cfg(feature = "sqs")]
pub use courier_sqs as sqs;

use std::sync::Arc;

/// The brokers compiled into this build.
pub const BROKERS: &[&Broker] = &[
    #[cfg(feature = "redis")]
    &courier_redis::BROKER,
    #[cfg(feature = "amqp")]
    &courier_amqp::BROKER,
    #[cfg(feature = "nats")]
    &courier_nats::BROKER,
    #[cfg(feature = "embedded")]
    &courier_embedded::BROKER,
    #[cfg(feature = "kafka")]
    &courier_kafka::BROKER,
    #[cfg(feature = "sqs")]
    &courier_sqs::BROKER,
    #[cfg(feature = "pubsub")]
    &courier_pubsub::BROKER,
];

/// The URL forms of every broker in this build, for help and errors.
pub fn url_forms() -> String {
    url_forms_of(BROKERS)
}

/// A `--source` URL whose scheme names a broker of this build, checked by
/// that broker.
pub fn parse_url(text: &str) -> Result<SourceUrl, String> {
    SourceUrl::parse_among(text, BROKERS)
}

/// Opens the source a `--source` URL names. A failed certificate check
/// ends the start with what to fix ([`Tls::explain`]).
pub async fn open(url: &SourceUrl, options: SourceOptions) -> Result<Arc<dyn Source>, SourceError> {
    let tls = options.tls.clone();
    (url.broker().open)(url.clone(), options)
        .await
        .map_err(|e| tls.explain(e))
}

/// Opens the admin handle of a `--source` URL, for the operator commands:
/// it creates nothing on the broker and moves nothing ([`DeadLetterStore`]).
pub async fn open_admin(
    url: &SourceUrl,
    options: SourceOptions,
) -> Result<Arc<dyn DeadLetterStore>, SourceError> {
    let tls = options.tls.clone();
    (url.broker().admin)(url.clone(), options)
        .await
        .map_err(|e| tls.explain(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn broker_of(text: &str) -> Result<&'static str, String> {
        parse_url(text).map(|url| url.broker().name)
    }

    #[test]
    fn source_urls() {
        assert_eq!(broker_of("redis://127.0.0.1:6379/0"), Ok("redis"));
        assert_eq!(broker_of("embedded:/tmp/q"), Ok("embedded"));
        assert_eq!(
            broker_of("amqp://guest:guest@127.0.0.1:5672/%2f"),
            Ok("amqp")
        );
        assert_eq!(broker_of("nats://127.0.0.1:4222"), Ok("nats"));
        let err = broker_of("mqtt://broker:1883").unwrap_err();
        assert!(err.contains("unknown scheme \"mqtt\""), "{err}");
        assert!(err.contains("redis://host:port/db"), "{err}");
        assert!(broker_of("embedded:").is_err());
        assert!(broker_of("localhost").is_err());
        assert!(broker_of("amqp://host:notaport/").is_err());
    }

    /// The redaction knows every scheme of the table as a scheme, also
    /// without a `//` after it (`embedded:/dir`).
    #[test]
    fn the_redaction_knows_every_scheme_of_the_table() {
        for scheme in BROKERS.iter().flat_map(|b| b.schemes.iter()) {
            assert!(redact::KNOWN_SCHEMES.contains(scheme), "{scheme}");
        }
    }

    #[test]
    fn an_unknown_scheme_does_not_echo_the_password() {
        let err = broker_of("mqtt://user:hunter2@broker:1883").unwrap_err();
        assert!(!err.contains("hunter2"), "{err}");
    }

    /// Odd shapes of a URL on every scheme of this build: whether it is
    /// refused or taken, what the user sees never holds the password.
    #[test]
    fn no_url_error_of_any_scheme_echoes_the_password() {
        for scheme in BROKERS.iter().flat_map(|b| b.schemes.iter()) {
            for form in [
                "{s}://user:hunter2@host:1/v",
                "{s}:user:hunter2@host",
                "{s}:/user:hunter2@host",
                "{s}://user:hunter2",
                "{s}:user:hunter2",
                "{s}://user:hunter2/v",
                "{s}://user:hun@ter2@host",
                "{s}://user:hunter2@host:port/",
                "{s}://host:1/?password=hunter2",
                "{s}://hunter2@host:notaport",
            ] {
                let url = form.replace("{s}", scheme);
                let shown = match parse_url(&url) {
                    Ok(parsed) => format!("{parsed} {parsed:?} {}", parsed.redacted()),
                    Err(e) => e,
                };
                for secret in ["hunter2", "hun", "ter2"] {
                    assert!(!shown.contains(secret), "{url}: {shown}");
                }
            }
        }
    }

    #[test]
    fn a_token_where_the_scheme_should_be_is_not_echoed() {
        let err = broker_of("hunter2@broker:9092").unwrap_err();
        assert!(!err.contains("hunter2"), "{err}");
        assert!(err.contains("has no scheme"), "{err}");
    }

    #[test]
    fn url_errors_show_only_the_redacted_url() {
        for url in [
            "mqtt://user:hunter2@broker:9092",
            "mqtt://:hun@ter2@broker:9092",
            "user:hunter2@broker:9092",
        ] {
            let err = broker_of(url).unwrap_err();
            assert!(!err.contains("hunter2") && !err.contains("ter2"), "{err}");
            assert!(err.contains("***@broker:9092"), "{err}");
        }
    }
}
