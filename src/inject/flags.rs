//! How a pod sets each `courier run` flag. Most flags have an annotation
//! (`settings::annotations`); the ones below [`PASSTHROUGH`] are passed to
//! the sidecar as the flag's own `COURIER_*` variable after a check, so that
//! a typo refuses the pod instead of crash-looping its sidecar. Every other
//! flag is listed in [`NOT_ANNOTATIONS`] with the reason, and a test fails
//! when a new `courier run` flag is in neither list (tests/kubernetes/helm_annotations.rs),
//! so the table in docs/kubernetes.md cannot fall behind.

use super::settings::annotations;
use crate::duration;
use crate::source::sasl::Mechanism;

/// What an annotation's value must look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `true` or `false`.
    Bool,
    /// A duration like `30s` or `10m`.
    Duration,
    /// A size like `4MiB`, `512KiB` or `1048576`, as `courier run` reads it.
    Size,
    /// An absolute URL path like `/healthz`.
    Path,
    /// One of these words.
    OneOf(&'static [&'static str]),
    /// An `http://` or `https://` URL with a host, as `courier run` reads
    /// `--kafka-oauth-token-url`.
    HttpUrl,
    /// Free text on one line: no control characters.
    Text,
    /// A whole number from 1 to this.
    Count(u64),
}

/// An annotation passed to the sidecar as the variable of its flag.
#[derive(Debug, Clone, Copy)]
pub struct Passthrough {
    pub annotation: &'static str,
    /// The `courier run` flag, without the dashes.
    pub flag: &'static str,
    pub env: &'static str,
    pub kind: Kind,
}

pub const PASSTHROUGH: &[Passthrough] = &[
    Passthrough {
        annotation: "courier.dev/create",
        flag: "create",
        env: "COURIER_CREATE",
        kind: Kind::Bool,
    },
    Passthrough {
        annotation: "courier.dev/queue-type",
        flag: "queue-type",
        env: "COURIER_QUEUE_TYPE",
        kind: Kind::OneOf(&crate::source::QueueType::NAMES),
    },
    Passthrough {
        annotation: "courier.dev/ordering",
        flag: "ordering",
        env: "COURIER_ORDERING",
        kind: Kind::OneOf(&crate::source::Ordering::NAMES),
    },
    Passthrough {
        annotation: "courier.dev/app-health-path",
        flag: "app-health-path",
        env: "COURIER_APP_HEALTH_PATH",
        kind: Kind::Path,
    },
    Passthrough {
        annotation: "courier.dev/dedup-window",
        flag: "dedup-window",
        env: "COURIER_DEDUP_WINDOW",
        kind: Kind::Duration,
    },
    Passthrough {
        annotation: "courier.dev/visibility-timeout",
        flag: "visibility-timeout",
        env: "COURIER_VISIBILITY_TIMEOUT",
        kind: Kind::Duration,
    },
    Passthrough {
        annotation: "courier.dev/seal-key-window",
        flag: "seal-key-window",
        env: "COURIER_SEAL_KEY_WINDOW",
        kind: Kind::Duration,
    },
    Passthrough {
        annotation: "courier.dev/max-body",
        flag: "max-body",
        env: "COURIER_MAX_BODY",
        kind: Kind::Size,
    },
    Passthrough {
        annotation: "courier.dev/batch-max-messages",
        flag: "batch-max-messages",
        env: "COURIER_BATCH_MAX_MESSAGES",
        // `dispatch::BatchSettings::MAX_MESSAGES`, which the injector does
        // not import; the flags test checks that the two agree.
        kind: Kind::Count(1000),
    },
    Passthrough {
        annotation: "courier.dev/batch-max-wait",
        flag: "batch-max-wait",
        env: "COURIER_BATCH_MAX_WAIT",
        kind: Kind::Duration,
    },
    Passthrough {
        annotation: "courier.dev/readiness",
        flag: "readiness",
        env: "COURIER_READINESS",
        // `telemetry::Readiness`, which the injector does not import.
        kind: Kind::OneOf(&["broker", "app", "none"]),
    },
    Passthrough {
        annotation: "courier.dev/cloudevents",
        flag: "cloudevents",
        env: "COURIER_CLOUDEVENTS",
        // `forward::cloudevents::Mode::NAMES`, which the injector does not
        // import; tests/dispatch/cloudevents.rs checks that the two agree.
        kind: Kind::OneOf(&["binary", "structured", "off"]),
    },
    Passthrough {
        annotation: annotations::KAFKA_SASL_MECHANISM,
        flag: "kafka-sasl-mechanism",
        env: "COURIER_KAFKA_SASL_MECHANISM",
        kind: Kind::OneOf(&Mechanism::NAMES),
    },
    Passthrough {
        annotation: annotations::KAFKA_OAUTH_TOKEN_URL,
        flag: "kafka-oauth-token-url",
        env: "COURIER_KAFKA_OAUTH_TOKEN_URL",
        kind: Kind::HttpUrl,
    },
    Passthrough {
        annotation: annotations::KAFKA_OAUTH_SCOPE,
        flag: "kafka-oauth-scope",
        env: "COURIER_KAFKA_OAUTH_SCOPE",
        kind: Kind::Text,
    },
];

/// The `courier run` flags set by the annotations of `settings` (not
/// passed through), flag → annotation.
pub const ANNOTATED: &[(&str, &str)] = &[
    ("source", "courier.dev/source, courier.dev/source-secret"),
    ("queue", "courier.dev/queue"),
    ("subscriptions", "courier.dev/subscriptions"),
    ("group", "courier.dev/group"),
    ("app", "courier.dev/app-port, courier.dev/app-url"),
    ("policy", "courier.dev/policy"),
    ("concurrency", "courier.dev/concurrency"),
    ("drain-timeout", "courier.dev/drain-timeout"),
    ("listen", "courier.dev/metrics-port"),
    ("log-level", "courier.dev/log-level"),
    ("tls-ca-file", "courier.dev/tls-secret"),
    ("seal-keys-file", "courier.dev/seal-keys-secret"),
    (
        "tls-cert-file",
        "courier.dev/tls-secret, courier.dev/tls-client-cert",
    ),
    (
        "tls-key-file",
        "courier.dev/tls-secret, courier.dev/tls-client-cert",
    ),
    ("kafka-sasl-username", "courier.dev/kafka-sasl-secret"),
];

/// The `courier run` flags a pod does not set by annotation, and why.
pub const NOT_ANNOTATIONS: &[(&str, &str)] = &[
    (
        "consumer",
        "the injector sets it to the pod's name (POD_NAME), unique in the group",
    ),
    (
        "policy-file",
        "a file in the sidecar's image; in a cluster the policy is a RetryPolicy (courier.dev/policy)",
    ),
    (
        "subscriptions-file",
        "a file in the sidecar's image; in a pod, courier.dev/subscriptions carries the same document",
    ),
    (
        "depth-interval",
        "how often the queue depth is read for metrics; the default suits every pod",
    ),
    (
        "app-failure-run",
        "an app-protection tuning knob; the default (5) suits every pod",
    ),
    (
        "threads",
        "one thread (the default) keeps the sidecar on one core beside its app; scale replicas for more",
    ),
    (
        "log-format",
        "the same for every sidecar of a cluster: the chart's sidecar.logFormat",
    ),
    (
        "drain-token",
        "the injector makes a secret for each pod and puts it in the preStop hook too",
    ),
    (
        "drain-token-file",
        "the injector gives each pod its own secret (COURIER_DRAIN_TOKEN)",
    ),
    (
        "drain-resume-after",
        "the injector sets it from the pod's grace period, after which a pod being deleted has had its SIGTERM",
    ),
    (
        "kafka-sasl-password-file",
        "courier.dev/kafka-sasl-secret gives the sidecar the Secret's password as COURIER_KAFKA_SASL_PASSWORD (a secretKeyRef), never as a file path or a flag's value",
    ),
];

/// Checks one annotation's value; the message says what to write.
pub fn check(kind: Kind, value: &str) -> Result<(), String> {
    match kind {
        Kind::Bool if value == "true" || value == "false" => Ok(()),
        Kind::Bool => Err(format!("{value:?} is not true or false")),
        Kind::Duration => duration::parse(value)
            .map(|_| ())
            .map_err(|e| format!("{value:?}: {e}")),
        Kind::Size => check_size(value),
        Kind::Path if value.starts_with('/') && !value.contains(char::is_whitespace) => Ok(()),
        Kind::Path => Err(format!(
            "{value:?} is not a URL path; write it like /healthz"
        )),
        Kind::OneOf(words) if words.contains(&value) => Ok(()),
        Kind::OneOf(words) => Err(format!("{value:?} is not one of {}", words.join(", "))),
        Kind::HttpUrl => check_http_url(value),
        Kind::Text if !value.contains(char::is_control) => Ok(()),
        Kind::Text => Err(format!(
            "{value:?} holds a control character; write it on one line, without tabs"
        )),
        Kind::Count(most) => match value.parse::<u64>() {
            Ok(n) if (1..=most).contains(&n) => Ok(()),
            _ => Err(format!("{value:?} is not a whole number from 1 to {most}")),
        },
    }
}

/// What `courier run` accepts as `--kafka-oauth-token-url`.
fn check_http_url(value: &str) -> Result<(), String> {
    let example = "write it like https://idp.example.com/oauth2/token";
    match value.parse::<http::Uri>() {
        Ok(uri) if matches!(uri.scheme_str(), Some("https" | "http")) && uri.host().is_some() => {
            Ok(())
        }
        Ok(_) => Err(format!(
            "{value:?} is not an http(s) URL with a host; {example}"
        )),
        Err(e) => Err(format!("{value:?} is not a URL ({e}); {example}")),
    }
}

/// The sizes `courier run --max-body` reads (`cmd::args::parse_size`, which
/// the injector does not import).
fn check_size(value: &str) -> Result<(), String> {
    let split = value
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(value.len());
    let (number, unit) = value.split_at(split);
    let known = ["", "B", "KiB", "MiB", "GiB", "KB", "kB", "MB", "GB"];
    if number.parse::<u64>().is_ok_and(|n| n > 0) && known.contains(&unit) {
        Ok(())
    } else {
        Err(format!(
            "{value:?} is not a size; write it like 4MiB, 512KiB or 1048576"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values() {
        assert!(check(Kind::Bool, "true").is_ok());
        assert!(check(Kind::Bool, "yes").is_err());
        assert!(check(Kind::Duration, "10m").is_ok());
        assert!(check(Kind::Duration, "ten").is_err());
        for good in ["4MiB", "512KiB", "1048576", "1MB"] {
            assert!(check(Kind::Size, good).is_ok(), "{good}");
        }
        for bad in ["4 MiB", "lots", "4Mi", "0", ""] {
            assert!(check(Kind::Size, bad).is_err(), "{bad}");
        }
        assert!(check(Kind::Path, "/healthz").is_ok());
        assert!(check(Kind::Path, "healthz").is_err());
        let readiness = Kind::OneOf(&["broker", "app", "none"]);
        assert!(check(readiness, "app").is_ok());
        assert_eq!(
            check(readiness, "App"),
            Err("\"App\" is not one of broker, app, none".into())
        );
        for good in [
            "https://idp.example.com/oauth2/token",
            "http://keycloak.auth.svc:8080/realms/kafka/protocol/openid-connect/token",
        ] {
            assert_eq!(check(Kind::HttpUrl, good), Ok(()), "{good}");
        }
        for bad in [
            "idp.example.com/token",
            "ftp://idp.example.com/token",
            "https:///token",
            "/oauth2/token",
            "https://idp example.com/token",
        ] {
            let err = check(Kind::HttpUrl, bad).unwrap_err();
            assert!(
                err.contains("https://idp.example.com/oauth2/token"),
                "says what to write: {err}"
            );
        }
        assert!(check(Kind::Text, "api://kafka/.default openid").is_ok());
        for bad in ["kafka\nadmin", "kafka\tadmin", "kafka\u{7f}"] {
            assert!(check(Kind::Text, bad).is_err(), "{bad:?}");
        }
    }

    /// The mechanisms are the names `courier run` takes, and every entry's
    /// flag and variable are the ones of the same flag.
    #[test]
    fn entries_are_named_after_their_flag() {
        let mechanism = PASSTHROUGH
            .iter()
            .find(|p| p.flag == "kafka-sasl-mechanism")
            .unwrap();
        for name in Mechanism::NAMES {
            assert!(check(mechanism.kind, name).is_ok(), "{name}");
        }
        assert!(check(mechanism.kind, "GSSAPI").is_err());
        for p in PASSTHROUGH {
            assert_eq!(
                p.env,
                format!("COURIER_{}", p.flag.to_uppercase().replace('-', "_")),
                "{}",
                p.annotation
            );
            assert_eq!(p.annotation, format!("courier.dev/{}", p.flag));
        }
    }
}
