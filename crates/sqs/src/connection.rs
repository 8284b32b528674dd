//! Reaching SQS: the URL, the SDK's configuration (credentials, endpoint,
//! an HTTPS client on rustls with ring), the work queue, its seal key and
//! its native redrive policy.

use std::collections::HashMap;
use std::fmt::Display;

use aws_config::stalled_stream_protection::StalledStreamProtectionConfig;
use aws_config::{BehaviorVersion, Region};
use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::{DisplayErrorContext, SdkError};
use aws_sdk_sqs::types::QueueAttributeName;
use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};

use courier_core::source::SourceError;
use courier_core::source::shared::Seal;

/// `sqs://REGION`: nothing else (no host, no credentials: those come from
/// the standard AWS chain, the endpoint from `AWS_ENDPOINT_URL`).
pub fn check_url(url: &str) -> Result<(), String> {
    region_of(url).map(drop)
}

pub(super) fn region_of(url: &str) -> Result<String, String> {
    let form = "write sqs://REGION (like sqs://eu-west-1); credentials come from the standard AWS chain and another endpoint from AWS_ENDPOINT_URL";
    let Some(region) = url.strip_prefix("sqs://") else {
        return Err(format!("an SQS URL starts with sqs://; {form}"));
    };
    let region = region.trim_end_matches('/');
    let ok = !region.is_empty()
        && region
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(region.to_string())
    } else {
        Err(format!("the SQS URL names no region; {form}"))
    }
}

/// A failed call, as what the operator should check: no answer is a
/// broker out of reach, an answer is the broker's refusal.
pub(super) fn sdk_error<E, R>(what: &str, e: SdkError<E, R>) -> SourceError
where
    E: std::error::Error + aws_sdk_sqs::error::ProvideErrorMetadata + 'static,
    R: std::fmt::Debug,
{
    let unreachable = matches!(
        e,
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) | SdkError::ResponseError(_)
    );
    let text = format!("{what}: {}", DisplayErrorContext(&e));
    if unreachable {
        SourceError::unavailable(text)
    } else if is_refusal(error_code(&e).as_deref()) {
        SourceError::refused(format!(
            "{text}; check the AWS credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, the profile or the service account's role) and that they may use this queue"
        ))
    } else {
        SourceError::broker(text)
    }
}

/// The SQS error code of a failed call (`AWS.SimpleQueueService.NonExistentQueue`).
pub(super) fn error_code<E, R>(e: &SdkError<E, R>) -> Option<String>
where
    E: aws_sdk_sqs::error::ProvideErrorMetadata,
{
    e.as_service_error()
        .and_then(|s| s.code())
        .map(str::to_string)
}

/// The codes of a call AWS turned down for who made it: the keys, the
/// signature, the role's permissions. No retry changes them.
fn is_refusal(code: Option<&str>) -> bool {
    matches!(
        code,
        Some(
            "InvalidClientTokenId"
                | "UnrecognizedClientException"
                | "SignatureDoesNotMatch"
                | "InvalidAccessKeyId"
                | "AccessDenied"
                | "AccessDeniedException"
                | "ExpiredToken"
                | "InvalidSecurity"
        )
    )
}

pub(super) fn is_missing_queue(code: Option<&str>) -> bool {
    code.is_some_and(|c| c.contains("NonExistentQueue") || c == "QueueDoesNotExist")
}

pub(super) fn broker(e: impl Display) -> SourceError {
    SourceError::broker(e.to_string())
}

/// The SDK's client for `region`: the standard credential chain
/// (environment, profile, web identity, container, instance metadata),
/// `AWS_ENDPOINT_URL`(`_SQS`), and an HTTPS client on rustls with ring.
///
/// Without the SDK's stalled-stream protection: it checks a request's
/// throughput on a timer every 100 ms for as long as the request lasts,
/// and a long poll is a request that sends nothing for seconds by design.
/// An idle courier woke 30 times a second for it and used 0.19 % of a
/// core. SQS's bodies are 256 KiB at most, so there is no stream for it to
/// guard.
pub(super) async fn client(region: &str) -> Client {
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
        .build_https();
    let config = aws_config::defaults(BehaviorVersion::latest())
        .region(Region::new(region.to_string()))
        .http_client(http)
        .stalled_stream_protection(StalledStreamProtectionConfig::disabled())
        .load()
        .await;
    Client::new(&config)
}

/// A queue's name from `--queue`, a name or a queue URL.
pub(super) fn queue_name(queue: &str) -> &str {
    if queue.starts_with("https://") || queue.starts_with("http://") {
        queue
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or(queue)
    } else {
        queue
    }
}

/// The URL of queue `name`, created when missing and `create` is set (a
/// FIFO queue when the name ends in `.fifo`); `None` when it is missing.
pub(super) async fn queue_url(
    client: &Client,
    name: &str,
    create: bool,
) -> Result<Option<String>, SourceError> {
    match client.get_queue_url().queue_name(name).send().await {
        Ok(out) => return Ok(out.queue_url().map(str::to_string)),
        Err(e) if is_missing_queue(error_code(&e).as_deref()) => {}
        Err(e) => return Err(sdk_error(&format!("looking up queue {name:?}"), e)),
    }
    if !create {
        return Ok(None);
    }
    let mut request = client.create_queue().queue_name(name);
    if name.ends_with(".fifo") {
        request = request.attributes(QueueAttributeName::FifoQueue, "true");
    }
    let out = request
        .send()
        .await
        .map_err(|e| sdk_error(&format!("creating queue {name:?}"), e))?;
    Ok(out.queue_url().map(str::to_string))
}

/// The work queue is not there, and courier was not asked to create it.
pub(super) fn missing_queue(name: &str, region: &str) -> SourceError {
    SourceError::invalid(format!(
        "SQS queue {name:?} does not exist in {region}; create it, or start courier run with --create"
    ))
}

pub(super) async fn queue_attributes(
    client: &Client,
    url: &str,
) -> Result<HashMap<QueueAttributeName, String>, SourceError> {
    let out = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::All)
        .send()
        .await
        .map_err(|e| sdk_error("reading the queue's attributes", e))?;
    Ok(out.attributes().cloned().unwrap_or_default())
}

/// The queue tag that holds the key of the seal on the copies courier
/// stores in this queue.
pub const SEAL_TAG: &str = "courier-seal-key";

/// The queue's seal key, made on first use. Tags have no create-if-absent:
/// two replicas starting together may both write one, so the key is read
/// back after writing and the one there is used (the last writer's; a
/// copy sealed in that moment with the other reads as a new message).
pub(super) async fn seal_of(client: &Client, url: &str) -> Result<Seal, SourceError> {
    let read = async || -> Result<Option<String>, SourceError> {
        let out = client
            .list_queue_tags()
            .queue_url(url)
            .send()
            .await
            .map_err(|e| sdk_error("reading the queue's tags (courier keeps its seal key in one; let courier's identity call sqs:ListQueueTags and sqs:TagQueue)", e))?;
        Ok(out.tags().and_then(|t| t.get(SEAL_TAG)).cloned())
    };
    let secret = match read().await? {
        Some(secret) => secret,
        None => {
            client
                .tag_queue()
                .queue_url(url)
                .tags(SEAL_TAG, Seal::new_secret())
                .send()
                .await
                .map_err(|e| sdk_error("tagging the queue with courier's seal key", e))?;
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            read()
                .await?
                .ok_or_else(|| broker("the queue's seal key tag did not stay"))?
        }
    };
    Seal::new(secret.as_bytes()).map_err(|e| {
        SourceError::broker(format!(
            "the queue tag {SEAL_TAG:?} is not a key courier wrote ({e}); remove it and courier makes a new one"
        ))
    })
}

/// The warning a native `RedrivePolicy` earns when SQS would move a
/// message to its own dead-letter queue before courier used up the
/// policy's attempts: SQS counts every receive, so courier never writes the
/// `attempts-exhausted` dead letter with its record.
pub fn redrive_warning(redrive_policy: &str, max_attempts: u32) -> Option<String> {
    let policy: serde_json::Value = serde_json::from_str(redrive_policy).ok()?;
    let count = match &policy["maxReceiveCount"] {
        serde_json::Value::Number(n) => n.as_u64()?,
        serde_json::Value::String(s) => s.parse().ok()?,
        _ => return None,
    };
    (count < u64::from(max_attempts)).then(|| {
        format!(
            "the queue's RedrivePolicy moves a message to {} after {count} receives, fewer than the policy's maxAttempts {max_attempts}: SQS dead-letters it before courier retries it to the end, without courier's record; raise maxReceiveCount to at least {} (maxAttempts + 2 leaves room for crashes) or remove the RedrivePolicy",
            policy["deadLetterTargetArn"].as_str().unwrap_or("its dead-letter queue"),
            u64::from(max_attempts) + 2,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_rows() {
        assert_eq!(region_of("sqs://eu-west-1"), Ok("eu-west-1".into()));
        assert_eq!(region_of("sqs://us-east-1/"), Ok("us-east-1".into()));
        for bad in [
            "sqs://",
            "sqs://user:hunter2@host",
            "sqs://host:4566",
            "sqs:eu-west-1",
        ] {
            let err = region_of(bad).unwrap_err();
            assert!(!err.contains("hunter2"), "{err}");
            assert!(err.contains("sqs://REGION"), "{err}");
        }
    }

    #[test]
    fn queue_names_from_urls() {
        assert_eq!(queue_name("orders"), "orders");
        assert_eq!(
            queue_name("https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo"),
            "orders.fifo"
        );
        assert_eq!(queue_name("http://127.0.0.1:4566/000000000000/q/"), "q");
    }

    #[test]
    fn redrive_rows() {
        let policy = |n: &str| {
            format!(
                r#"{{"deadLetterTargetArn":"arn:aws:sqs:eu-west-1:1:orders-native","maxReceiveCount":{n}}}"#
            )
        };
        let warning = redrive_warning(&policy("3"), 5).unwrap();
        assert!(warning.contains("after 3 receives"), "{warning}");
        assert!(warning.contains("maxAttempts 5"), "{warning}");
        assert!(warning.contains("orders-native"), "{warning}");
        assert!(redrive_warning(&policy("\"2\""), 5).is_some());
        assert_eq!(redrive_warning(&policy("5"), 5), None);
        assert_eq!(redrive_warning(&policy("10"), 5), None);
        assert_eq!(redrive_warning("not json", 5), None);
    }
}
