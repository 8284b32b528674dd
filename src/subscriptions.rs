//! The subscriptions document: several queues in one sidecar, each with its
//! own RetryPolicy, concurrency, dead-letter queue (its policy's), app path
//! and metrics label (its queue). `courier run --subscriptions-file` reads
//! it from a file, `COURIER_SUBSCRIPTIONS` (the injector's
//! `courier.dev/subscriptions` annotation) from the environment. Only the
//! document's form is checked here, so that the injector can refuse a bad
//! annotation at admission; `cmd::run` checks each subscription as it
//! checks the flags.

use std::path::PathBuf;

use serde::Deserialize;

/// At most this many subscriptions in one sidecar: each holds a broker
/// connection, a dispatcher and its metric series.
pub const MOST_SUBSCRIPTIONS: usize = 32;

/// The document as written.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SubscriptionsDocument {
    pub subscriptions: Vec<Subscription>,
}

/// One subscription; what it leaves out comes from the flags (or their
/// `COURIER_*` variables) of `courier run`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Subscription {
    /// The queue (stream, topic, subscription) to consume; required, and
    /// each subscription's own: it labels the subscription's metrics.
    pub queue: String,
    /// The broker URL [default: `--source`].
    #[serde(default)]
    pub source: Option<String>,
    /// The consumer group [default: `--group`].
    #[serde(default)]
    pub group: Option<String>,
    /// Where this queue's messages are posted [default: `--app`].
    #[serde(default)]
    pub app: Option<String>,
    /// A path that replaces `--app`'s path and query, e.g. `/orders`; instead
    /// of `app`.
    #[serde(default)]
    pub path: Option<String>,
    /// The RetryPolicy to follow, in the pod's namespace [default:
    /// `--policy`].
    #[serde(default)]
    pub policy: Option<String>,
    /// A RetryPolicy file to follow [default: `--policy-file`].
    #[serde(default)]
    pub policy_file: Option<PathBuf>,
    /// Deliveries with the app at once, at most [default: `--concurrency`].
    #[serde(default)]
    pub concurrency: Option<usize>,
    /// Create the queue when it is missing [default: `--create`].
    #[serde(default)]
    pub create: Option<bool>,
    /// Several messages in one POST [default: `--batch-max-messages`,
    /// `--batch-max-wait`].
    #[serde(default)]
    pub batch: Option<BatchSpec>,
}

/// `batch:` of a subscription (docs/batches.md).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BatchSpec {
    /// Up to this many messages in one POST; 1 is one message per POST.
    #[serde(default)]
    pub max_messages: Option<usize>,
    /// How long a batch that is not full waits for more, e.g. `50ms`.
    #[serde(default)]
    pub max_wait: Option<String>,
}

impl SubscriptionsDocument {
    /// Reads a document and checks its form: at least one subscription and
    /// at most [`MOST_SUBSCRIPTIONS`], each with a queue of its own, `app`
    /// and `path` not both, `policy` and `policyFile` not both. The error
    /// says what is wrong and where.
    pub fn parse(text: &str) -> Result<Self, String> {
        let document: Self = serde_saphyr::from_str(text).map_err(|e| {
            format!("not a subscriptions document ({e}); write `subscriptions:` and a list of entries with at least `queue:`")
        })?;
        let count = document.subscriptions.len();
        if count == 0 {
            return Err(
                "`subscriptions` is empty; list one entry per queue, each with `queue:`".into(),
            );
        }
        if count > MOST_SUBSCRIPTIONS {
            return Err(format!(
                "{count} subscriptions; one sidecar runs at most {MOST_SUBSCRIPTIONS} (each holds a broker connection): split them over several"
            ));
        }
        for (i, sub) in document.subscriptions.iter().enumerate() {
            let at = format!("subscriptions[{i}]");
            if sub.queue.trim().is_empty() {
                return Err(format!(
                    "{at}: `queue` is missing or empty; name the queue it consumes"
                ));
            }
            if let Some(first) = document.subscriptions[..i]
                .iter()
                .position(|other| other.queue == sub.queue)
            {
                return Err(format!(
                    "{at}: queue {:?} is already subscriptions[{first}]'s; the queue names a subscription's metrics, so each needs its own",
                    sub.queue
                ));
            }
            if sub.app.is_some() && sub.path.is_some() {
                return Err(format!(
                    "{at}: `app` and `path` are both set; keep one (`path` replaces --app's path)"
                ));
            }
            if let Some(path) = &sub.path
                && !path.starts_with('/')
            {
                return Err(format!(
                    "{at}: `path` {path:?} must start with /, such as /orders"
                ));
            }
            if sub.policy.is_some() && sub.policy_file.is_some() {
                return Err(format!(
                    "{at}: `policy` and `policyFile` are both set; keep one"
                ));
            }
            if sub.concurrency == Some(0) {
                return Err(format!("{at}: `concurrency` must be at least 1"));
            }
        }
        Ok(document)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_document_is_read_with_what_each_entry_leaves_out() {
        let document = SubscriptionsDocument::parse(
            "subscriptions:\n  - queue: orders\n    path: /orders\n    policy: orders\n    concurrency: 4\n    batch: {maxMessages: 100, maxWait: 20ms}\n  - queue: refunds\n    app: http://127.0.0.1:9000/r\n    policyFile: /etc/courier/refunds.yaml\n",
        )
        .unwrap();
        assert_eq!(document.subscriptions.len(), 2);
        assert_eq!(document.subscriptions[0].path.as_deref(), Some("/orders"));
        assert_eq!(document.subscriptions[0].concurrency, Some(4));
        assert_eq!(
            document.subscriptions[0].batch,
            Some(BatchSpec {
                max_messages: Some(100),
                max_wait: Some("20ms".into())
            })
        );
        assert_eq!(document.subscriptions[1].source, None);
        assert_eq!(
            document.subscriptions[1].policy_file,
            Some(PathBuf::from("/etc/courier/refunds.yaml"))
        );
    }

    #[test]
    fn a_bad_document_says_what_and_where() {
        let rows = [
            ("subscriptions: []", "`subscriptions` is empty"),
            ("queues: [a]", "not a subscriptions document"),
            (
                "subscriptions:\n  - queue: a\n    colour: red",
                "not a subscriptions document",
            ),
            (
                "subscriptions:\n  - path: /a",
                "not a subscriptions document",
            ),
            (
                "subscriptions:\n  - queue: ' '",
                "subscriptions[0]: `queue` is missing",
            ),
            (
                "subscriptions:\n  - queue: a\n  - queue: b\n  - queue: a",
                "subscriptions[2]: queue \"a\" is already subscriptions[0]'s",
            ),
            (
                "subscriptions:\n  - queue: a\n    app: http://x/\n    path: /y",
                "`app` and `path` are both set",
            ),
            (
                "subscriptions:\n  - queue: a\n    path: y",
                "must start with /",
            ),
            (
                "subscriptions:\n  - queue: a\n    policy: p\n    policyFile: f",
                "`policy` and `policyFile` are both set",
            ),
            (
                "subscriptions:\n  - queue: a\n    concurrency: 0",
                "at least 1",
            ),
        ];
        for (text, expected) in rows {
            let error = SubscriptionsDocument::parse(text).unwrap_err();
            assert!(error.contains(expected), "{text:?}: {error}");
        }
        let many: String = (0..=MOST_SUBSCRIPTIONS)
            .map(|i| format!("  - queue: q{i}\n"))
            .collect();
        let error = SubscriptionsDocument::parse(&format!("subscriptions:\n{many}")).unwrap_err();
        assert!(error.contains("at most 32"), "{error}");
    }
}
