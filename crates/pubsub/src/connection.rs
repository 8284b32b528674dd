//! Reaching Pub/Sub: the URL, the gRPC channel (an emulator's plain
//! HTTP/2, or TLS with a token), the names courier uses, what it creates
//! at start, and the seal key.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::{
    AcknowledgeRequest, DeadLetterPolicy, DeleteSubscriptionRequest, GetSubscriptionRequest,
    GetTopicRequest, ModifyAckDeadlineRequest, PublishRequest, PubsubMessage, PullRequest,
    ReceivedMessage, Subscription, Topic, UpdateTopicRequest, publisher_client::PublisherClient,
    subscriber_client::SubscriberClient,
};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request, Status};

use super::fields::{fits, to_message};
use courier_core::source::SourceError;
use courier_core::source::shared::Seal;

/// Pub/Sub's longest ack deadline: a copy is held at most this long.
pub const MAX_HOLD_SECS: u64 = 600;

/// The variable that lowers how long a copy is held at most
/// ([`MAX_HOLD_SECS`]) for tests and trials
/// ([`courier_core::duration::limit_from_env`]).
pub const MAX_ACK_DEADLINE_ENV: &str = "COURIER_PUBSUB_MAX_ACK_DEADLINE";

/// Pub/Sub's shortest ack deadline.
pub(super) const MIN_LEASE_SECS: u64 = 10;

/// `maxDeliveryAttempts` of the retry subscription's dead-letter policy,
/// Pub/Sub's highest: the policy is there so that Pub/Sub counts
/// `delivery_attempt` on copies; courier dead-letters long before.
pub const RETRY_MAX_DELIVERY_ATTEMPTS: i32 = 100;

/// The label of the retry topic that holds the seal key.
pub const SEAL_LABEL: &str = "courier-seal-key";

/// A seal key's length in hex digits: a label value holds at most 63.
const SEAL_KEY_HEX: usize = 62;

const SCOPE: &str = "https://www.googleapis.com/auth/pubsub";
const ENDPOINT: &str = "https://pubsub.googleapis.com";

/// A message may be 10 MB; tonic's default limit is 4 MiB.
const MAX_MESSAGE: usize = 32 << 20;

/// `pubsub://PROJECT`: nothing else (credentials come from application
/// default credentials, an emulator from `PUBSUB_EMULATOR_HOST`).
pub fn check_url(url: &str) -> Result<(), String> {
    project_of(url).map(drop)
}

pub(super) fn project_of(url: &str) -> Result<String, String> {
    let form = "write pubsub://PROJECT (like pubsub://my-project); credentials come from application default credentials and an emulator from PUBSUB_EMULATOR_HOST";
    let Some(project) = url.strip_prefix("pubsub://") else {
        return Err(format!("a Pub/Sub URL starts with pubsub://; {form}"));
    };
    let project = project.trim_end_matches('/');
    // Project ids are lowercase letters, digits and hyphens; a
    // domain-scoped one has `domain:` before it.
    let ok = !project.is_empty()
        && project
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-.:".contains(&b));
    if ok {
        Ok(project.to_string())
    } else {
        Err(format!("the Pub/Sub URL names no project; {form}"))
    }
}

/// A failed call, as what the operator should check.
pub(super) fn status_error(what: &str, status: &Status) -> SourceError {
    let text = format!("{what}: {} ({:?})", status.message(), status.code());
    match status.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled => {
            SourceError::unavailable(text)
        }
        Code::PermissionDenied | Code::Unauthenticated => SourceError::refused(format!(
            "{text}; check the service account's credentials and its Pub/Sub roles"
        )),
        Code::InvalidArgument | Code::NotFound => SourceError::invalid(text),
        _ => SourceError::broker(text),
    }
}

/// The two gRPC services on one channel, and the token for each call.
#[derive(Clone)]
pub(super) struct Client {
    pub subscriber: SubscriberClient<Channel>,
    pub publisher: PublisherClient<Channel>,
    auth: Option<Arc<dyn gcp_auth::TokenProvider>>,
    /// `PUBSUB_EMULATOR_HOST` named the server: an emulator, whose pull
    /// costs differ from Pub/Sub's (`read::EMULATOR_SETTLE_WAIT`).
    pub emulator: bool,
}

impl Client {
    pub async fn connect() -> Result<Self, SourceError> {
        let emulator = std::env::var("PUBSUB_EMULATOR_HOST")
            .ok()
            .filter(|h| !h.is_empty());
        let on_emulator = emulator.is_some();
        let (channel, auth) = match emulator {
            Some(host) => {
                let channel = Endpoint::from_shared(format!("http://{host}"))
                    .map_err(|e| {
                        SourceError::invalid(format!("PUBSUB_EMULATOR_HOST {host:?}: {e}"))
                    })?
                    .connect()
                    .await
                    .map_err(|e| {
                        SourceError::unavailable(format!(
                            "cannot reach the Pub/Sub emulator at {host}: {e}"
                        ))
                    })?;
                (channel, None)
            }
            None => {
                let auth = gcp_auth::provider().await.map_err(|e| {
                    SourceError::invalid(format!(
                        "no Google credentials for Pub/Sub (application default credentials: GOOGLE_APPLICATION_CREDENTIALS, gcloud, or the metadata server): {e}"
                    ))
                })?;
                let tls = ClientTlsConfig::new()
                    .with_native_roots()
                    .domain_name("pubsub.googleapis.com");
                let channel = Endpoint::from_static(ENDPOINT)
                    .tls_config(tls)
                    .map_err(|e| SourceError::invalid(format!("TLS to Pub/Sub: {e}")))?
                    .connect()
                    .await
                    .map_err(|e| {
                        SourceError::unavailable(format!("cannot reach {ENDPOINT}: {e}"))
                    })?;
                (channel, Some(auth))
            }
        };
        Ok(Self {
            subscriber: SubscriberClient::new(channel.clone())
                .max_decoding_message_size(MAX_MESSAGE),
            publisher: PublisherClient::new(channel).max_decoding_message_size(MAX_MESSAGE),
            auth,
            emulator: on_emulator,
        })
    }

    /// A request with the token, when there is one.
    pub async fn request<T>(&self, message: T) -> Result<Request<T>, SourceError> {
        let mut request = Request::new(message);
        if let Some(auth) = &self.auth {
            let token = auth.token(&[SCOPE]).await.map_err(|e| {
                SourceError::unavailable(format!("getting a token for Pub/Sub: {e}"))
            })?;
            let value = format!("Bearer {}", token.as_str())
                .parse()
                .map_err(|_| SourceError::broker("the token is not a header value"))?;
            request.metadata_mut().insert("authorization", value);
        }
        Ok(request)
    }

    /// One unary pull of up to `max` (at most 1000) from `subscription`,
    /// answered at once.
    pub async fn pull(
        &self,
        subscription: &str,
        max: usize,
    ) -> Result<Vec<ReceivedMessage>, SourceError> {
        self.pull_with(subscription, max, None).await
    }

    /// One unary pull the server holds until a message comes or its
    /// `deadline` nears. The server is told the deadline (`grpc-timeout`,
    /// which the channel also keeps) and answers before it, empty if need
    /// be (the emulator a second before, whatever the deadline). Only a
    /// server later than its deadline has the pull cut short, which leaves
    /// what it took for it leased to nobody until its ack deadline: a
    /// delivery Pub/Sub counts.
    pub async fn pull_held(
        &self,
        subscription: &str,
        max: usize,
        deadline: Duration,
    ) -> Result<Vec<ReceivedMessage>, SourceError> {
        self.pull_with(subscription, max, Some(deadline)).await
    }

    async fn pull_with(
        &self,
        subscription: &str,
        max: usize,
        hold: Option<Duration>,
    ) -> Result<Vec<ReceivedMessage>, SourceError> {
        #[allow(deprecated)]
        let request = PullRequest {
            subscription: subscription.to_string(),
            return_immediately: hold.is_none(),
            max_messages: max.clamp(1, 1000) as i32,
        };
        let mut request = self.request(request).await?;
        if let Some(hold) = hold {
            request.set_timeout(hold);
        }
        match self.subscriber.clone().pull(request).await {
            Ok(out) => Ok(out.into_inner().received_messages),
            // A held pull whose deadline came first found nothing.
            Err(status) if hold.is_some() && status.code() == Code::DeadlineExceeded => {
                tracing::debug!(
                    subscription,
                    "a held pull reached its deadline before the server answered"
                );
                Ok(Vec::new())
            }
            Err(status) => Err(status_error(
                &format!("pulling from {subscription}"),
                &status,
            )),
        }
    }

    pub async fn acknowledge(
        &self,
        subscription: &str,
        ack_ids: Vec<String>,
    ) -> Result<(), SourceError> {
        let request = self
            .request(AcknowledgeRequest {
                subscription: subscription.to_string(),
                ack_ids,
            })
            .await?;
        self.subscriber
            .clone()
            .acknowledge(request)
            .await
            .map(drop)
            .map_err(|s| status_error(&format!("acknowledging in {subscription}"), &s))
    }

    /// Sets the ack deadline of these messages of `subscription`.
    pub async fn modify_deadline(
        &self,
        subscription: &str,
        ack_ids: Vec<String>,
        secs: u64,
    ) -> Result<(), SourceError> {
        if ack_ids.is_empty() {
            return Ok(());
        }
        let request = self
            .request(ModifyAckDeadlineRequest {
                subscription: subscription.to_string(),
                ack_ids,
                ack_deadline_seconds: secs.min(MAX_HOLD_SECS) as i32,
            })
            .await?;
        self.subscriber
            .clone()
            .modify_ack_deadline(request)
            .await
            .map(drop)
            .map_err(|s| status_error("changing an ack deadline", &s))
    }

    /// Publishes fields as one message to `topic`; Pub/Sub's id of it.
    pub async fn publish(
        &self,
        topic: &str,
        fields: &[(Bytes, Bytes)],
    ) -> Result<String, SourceError> {
        self.publish_message(topic, to_message(fields)).await
    }

    /// Publishes one message as it is to `topic`; Pub/Sub's id of it.
    pub async fn publish_message(
        &self,
        topic: &str,
        message: PubsubMessage,
    ) -> Result<String, SourceError> {
        fits(topic, &message)?;
        let request = self
            .request(PublishRequest {
                topic: topic.to_string(),
                messages: vec![message],
            })
            .await?;
        let out = self
            .publisher
            .clone()
            .publish(request)
            .await
            .map_err(|s| status_error(&format!("publishing to {topic}"), &s))?;
        Ok(out
            .into_inner()
            .message_ids
            .into_iter()
            .next()
            .unwrap_or_default())
    }

    pub async fn get_subscription(&self, name: &str) -> Result<Option<Subscription>, SourceError> {
        let request = self
            .request(GetSubscriptionRequest {
                subscription: name.to_string(),
            })
            .await?;
        match self.subscriber.clone().get_subscription(request).await {
            Ok(out) => Ok(Some(out.into_inner())),
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(status_error(&format!("reading subscription {name}"), &s)),
        }
    }

    pub async fn get_topic(&self, name: &str) -> Result<Option<Topic>, SourceError> {
        let request = self
            .request(GetTopicRequest {
                topic: name.to_string(),
            })
            .await?;
        match self.publisher.clone().get_topic(request).await {
            Ok(out) => Ok(Some(out.into_inner())),
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(status_error(&format!("reading topic {name}"), &s)),
        }
    }

    /// Creates the topic (with `labels`) unless it exists; the topic as
    /// Pub/Sub has it.
    pub async fn ensure_topic(
        &self,
        name: &str,
        labels: HashMap<String, String>,
    ) -> Result<Topic, SourceError> {
        let request = self
            .request(Topic {
                name: name.to_string(),
                labels,
                ..Topic::default()
            })
            .await?;
        match self.publisher.clone().create_topic(request).await {
            Ok(out) => return Ok(out.into_inner()),
            Err(s) if s.code() == Code::AlreadyExists => {}
            Err(s) => return Err(status_error(&format!("creating topic {name}"), &s)),
        }
        self.get_topic(name)
            .await?
            .ok_or_else(|| SourceError::broker(format!("topic {name} is gone again")))
    }

    /// Creates the subscription unless one of that name exists.
    /// Makes courier's shadow `shadow` of `subscription` again, on the
    /// topic `subscription` reads now: a topic deleted and made again
    /// leaves the old shadow bound to `_deleted-topic_`, where seeking it
    /// to a snapshot of `subscription` is refused.
    pub async fn remake_shadow(&self, subscription: &str, shadow: &str) -> Result<(), SourceError> {
        let topic = self
            .get_subscription(subscription)
            .await?
            .map(|s| s.topic)
            .ok_or_else(|| {
                SourceError::gone(format!("the subscription {subscription} is not there"))
            })?;
        let request = self
            .request(DeleteSubscriptionRequest {
                subscription: shadow.to_string(),
            })
            .await?;
        match self.subscriber.clone().delete_subscription(request).await {
            Ok(_) => {}
            Err(s) if s.code() == Code::NotFound => {}
            Err(s) => return Err(status_error(&format!("deleting subscription {shadow}"), &s)),
        }
        tracing::info!(%shadow, %topic, "the depth shadow was bound to a deleted topic; made again on the subscription's topic");
        self.ensure_subscription(subscription_of(shadow, &topic, MIN_LEASE_SECS))
            .await
    }

    pub async fn ensure_subscription(&self, subscription: Subscription) -> Result<(), SourceError> {
        let name = subscription.name.clone();
        let request = self.request(subscription).await?;
        match self.subscriber.clone().create_subscription(request).await {
            Ok(_) => Ok(()),
            Err(s) if s.code() == Code::AlreadyExists => Ok(()),
            Err(s) => Err(status_error(&format!("creating subscription {name}"), &s)),
        }
    }
}

/// The full names of what courier reads and writes.
#[derive(Debug, Clone)]
pub(super) struct Names {
    pub project: String,
    /// `projects/P/subscriptions/<queue>`.
    pub work: String,
    /// The work subscription's topic (read from the subscription).
    pub work_topic: String,
    /// `projects/P/topics/<queue>.retry` and its subscription of the same
    /// name.
    pub retry_topic: String,
    pub retry: String,
}

impl Names {
    pub fn new(project: &str, queue: &str) -> Self {
        Self {
            project: project.to_string(),
            work: format!("projects/{project}/subscriptions/{queue}"),
            work_topic: format!("projects/{project}/topics/{queue}"),
            retry_topic: format!("projects/{project}/topics/{queue}.retry"),
            retry: format!("projects/{project}/subscriptions/{queue}.retry"),
        }
    }

    /// The topic dead letters go to: the policy's dead-letter queue when it
    /// names one of its own, else the work subscription's dead-letter topic
    /// when it has one, else `<queue>.dlq`.
    pub fn dead_letter_topic(
        &self,
        dead_letter_queue: &str,
        subscriptions: Option<&str>,
    ) -> String {
        let queue = self.work.rsplit('/').next().unwrap_or_default();
        let default = courier_core::model::default_dead_letter_queue(queue);
        match subscriptions {
            Some(topic) if dead_letter_queue == default => topic.to_string(),
            _ => self.topic(dead_letter_queue),
        }
    }

    /// The full name of topic `name` (a full name stays as it is).
    pub fn topic(&self, name: &str) -> String {
        if name.starts_with("projects/") {
            name.to_string()
        } else {
            format!("projects/{}/topics/{name}", self.project)
        }
    }

    /// The browsing subscription of a dead-letter topic: the topic's name
    /// in the topic's project.
    pub fn browsing(topic: &str) -> String {
        topic.replacen("/topics/", "/subscriptions/", 1)
    }

    /// The shadow subscription that counts `subscription`'s backlog.
    pub fn shadow(subscription: &str) -> String {
        format!("{subscription}.courier-depth")
    }
}

/// A subscription of courier's on `topic`.
pub(super) fn subscription_of(name: &str, topic: &str, lease_secs: u64) -> Subscription {
    Subscription {
        name: name.to_string(),
        topic: topic.to_string(),
        ack_deadline_seconds: lease_secs as i32,
        ..Subscription::default()
    }
}

/// The work subscription is not there, and courier was not asked to make it.
pub(super) fn missing_subscription(name: &str) -> SourceError {
    SourceError::invalid(format!(
        "the Pub/Sub subscription {name} does not exist; create it (with a dead-letter policy, so that Pub/Sub counts deliveries), or start courier run with --create"
    ))
}

/// The work subscription; with `create`, made when missing, on a topic of
/// the same name (made too), with a dead-letter policy to `<queue>.dlq` so
/// that Pub/Sub counts deliveries, and the lease courier needs as its ack
/// deadline: a pull then leases what it takes for as long as courier
/// would, with no `ModifyAckDeadline` after it, and a courier killed
/// before it could send one leaves the messages for the visibility
/// timeout, not for a longer deadline (a minute, once: a torture run's
/// settle period ended before a message came back).
pub(super) async fn work_subscription(
    client: &Client,
    names: &Names,
    create: bool,
    lease_secs: u64,
) -> Result<Subscription, SourceError> {
    if let Some(found) = client.get_subscription(&names.work).await? {
        return Ok(found);
    }
    if !create {
        return Err(missing_subscription(&names.work));
    }
    let queue = names.work.rsplit('/').next().unwrap_or_default();
    let dead_letters = names.topic(&courier_core::model::default_dead_letter_queue(queue));
    client
        .ensure_topic(&names.work_topic, HashMap::new())
        .await?;
    client.ensure_topic(&dead_letters, HashMap::new()).await?;
    let mut subscription = subscription_of(&names.work, &names.work_topic, lease_secs);
    subscription.dead_letter_policy = Some(DeadLetterPolicy {
        dead_letter_topic: dead_letters,
        max_delivery_attempts: RETRY_MAX_DELIVERY_ATTEMPTS,
    });
    client.ensure_subscription(subscription).await?;
    client
        .get_subscription(&names.work)
        .await?
        .ok_or_else(|| SourceError::broker(format!("subscription {} is gone again", names.work)))
}

/// What courier reads and writes besides the work subscription, made when
/// missing: the retry topic (holding the seal key) and its subscription
/// with a dead-letter policy, the dead-letter topic and its browsing
/// subscription, and the shadows that count them. The shadows exist before
/// the messages they count: the emulator's seek brings back only messages
/// published after a subscription was made.
/// With `given` keys (`--seal-keys-file`) the retry topic is made without
/// a key of its own.
pub(super) async fn prepare(
    client: &Client,
    names: &Names,
    dead_letter_topic: &str,
    given: Option<&Arc<Seal>>,
) -> Result<Arc<Seal>, SourceError> {
    let seal = match given {
        Some(seal) => {
            client
                .ensure_topic(&names.retry_topic, HashMap::new())
                .await?;
            seal.clone()
        }
        None => Arc::new(seal_of(client, &names.retry_topic).await?),
    };
    client
        .ensure_topic(dead_letter_topic, HashMap::new())
        .await?;
    let mut retry = subscription_of(&names.retry, &names.retry_topic, MIN_LEASE_SECS);
    retry.dead_letter_policy = Some(DeadLetterPolicy {
        dead_letter_topic: dead_letter_topic.to_string(),
        max_delivery_attempts: RETRY_MAX_DELIVERY_ATTEMPTS,
    });
    client.ensure_subscription(retry).await?;
    ensure_browsing(client, dead_letter_topic).await?;
    for (subscription, topic) in [
        (&names.work, &names.work_topic),
        (&names.retry, &names.retry_topic),
    ] {
        client
            .ensure_subscription(subscription_of(
                &Names::shadow(subscription),
                topic,
                MIN_LEASE_SECS,
            ))
            .await?;
    }
    Ok(seal)
}

/// The browsing subscription of a dead-letter topic, and its shadow; it
/// must exist before the first letter, as Pub/Sub keeps a message only
/// for the subscriptions there when it is published.
pub(super) async fn ensure_browsing(client: &Client, topic: &str) -> Result<(), SourceError> {
    let browsing = Names::browsing(topic);
    client
        .ensure_subscription(subscription_of(&browsing, topic, MIN_LEASE_SECS))
        .await?;
    client
        .ensure_subscription(subscription_of(
            &Names::shadow(&browsing),
            topic,
            MIN_LEASE_SECS,
        ))
        .await
}

/// The seal key: the label [`SEAL_LABEL`] of the retry topic. Creating the
/// topic with the label is atomic, so replicas that start together agree;
/// a retry topic made by someone else gets the label added.
pub(super) async fn seal_of(client: &Client, retry_topic: &str) -> Result<Seal, SourceError> {
    let fresh: String = Seal::new_secret().chars().take(SEAL_KEY_HEX).collect();
    let labels = HashMap::from([(SEAL_LABEL.to_string(), fresh.clone())]);
    let mut topic = client.ensure_topic(retry_topic, labels).await?;
    if !topic.labels.contains_key(SEAL_LABEL) {
        topic.labels.insert(SEAL_LABEL.to_string(), fresh);
        let request = client
            .request(UpdateTopicRequest {
                topic: Some(topic),
                update_mask: Some(prost_types_mask("labels")),
            })
            .await?;
        client
            .publisher
            .clone()
            .update_topic(request)
            .await
            .map_err(|s| status_error("labelling the retry topic with courier's seal key", &s))?;
        topic = client
            .get_topic(retry_topic)
            .await?
            .ok_or_else(|| SourceError::broker(format!("topic {retry_topic} is gone again")))?;
    }
    seal_in(&topic)
}

/// The seal key when the retry topic has one; reads only.
pub(super) async fn read_seal(
    client: &Client,
    retry_topic: &str,
) -> Result<Option<Seal>, SourceError> {
    match client.get_topic(retry_topic).await? {
        Some(topic) if topic.labels.contains_key(SEAL_LABEL) => seal_in(&topic).map(Some),
        _ => Ok(None),
    }
}

fn seal_in(topic: &Topic) -> Result<Seal, SourceError> {
    let secret = topic.labels.get(SEAL_LABEL).cloned().unwrap_or_default();
    Seal::new(secret.as_bytes()).map_err(|e| {
        SourceError::broker(format!(
            "the label {SEAL_LABEL:?} of {} is not a key courier wrote ({e}); remove it and courier makes a new one",
            topic.name
        ))
    })
}

fn prost_types_mask(path: &str) -> prost_types::FieldMask {
    prost_types::FieldMask {
        paths: vec![path.to_string()],
    }
}

/// Refuses a dead-letter queue Pub/Sub cannot name, or the work
/// subscription's own name.
pub(super) fn check_dead_letter_queue(dead_letter_queue: &str, work: &str) -> Result<(), String> {
    let name = dead_letter_queue
        .rsplit_once("/topics/")
        .map_or(dead_letter_queue, |(_, n)| n);
    let ok = (3..=255).contains(&name.len())
        && name.as_bytes()[0].is_ascii_alphabetic()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.~+%".contains(&b))
        && !name.to_ascii_lowercase().starts_with("goog");
    if !ok {
        return Err(format!(
            "the dead-letter queue {dead_letter_queue:?} is not a Pub/Sub topic name: 3 to 255 letters, digits and - _ . ~ + %, starting with a letter, not with goog"
        ));
    }
    if name == work {
        return Err(format!(
            "the dead-letter queue {dead_letter_queue:?} is the work subscription's name; name another deadLetterQueue in the policy"
        ));
    }
    Ok(())
}

/// The warning a dead-letter policy earns when Pub/Sub would forward a
/// message to its dead-letter topic before courier used up the policy's
/// attempts: Pub/Sub counts every delivery, and its forward carries none of
/// courier's record.
pub fn delivery_cap_warning(
    max_delivery_attempts: i32,
    topic: &str,
    max_attempts: u32,
) -> Option<String> {
    // Pub/Sub reads 0 as its default, 5.
    let cap = if max_delivery_attempts <= 0 {
        5
    } else {
        max_delivery_attempts as u64
    };
    (cap < u64::from(max_attempts)).then(|| {
        format!(
            "the subscription's dead-letter policy forwards a message to {topic} after {cap} delivery attempts, fewer than the policy's maxAttempts {max_attempts}: Pub/Sub dead-letters it before courier retries it to the end, without courier's record; raise maxDeliveryAttempts to at least {} (maxAttempts + 2 leaves room for crashes; Pub/Sub allows 5 to 100)",
            (u64::from(max_attempts) + 2).min(100),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_rows() {
        assert_eq!(project_of("pubsub://my-project"), Ok("my-project".into()));
        assert_eq!(project_of("pubsub://p1/"), Ok("p1".into()));
        assert_eq!(
            project_of("pubsub://example.com:shop"),
            Ok("example.com:shop".into())
        );
        for bad in [
            "pubsub://",
            "pubsub://user:hunter2@host",
            "pubsub://Host",
            "pubsub:proj",
        ] {
            let err = project_of(bad).unwrap_err();
            assert!(!err.contains("hunter2"), "{err}");
            assert!(err.contains("pubsub://PROJECT"), "{err}");
        }
    }

    #[test]
    fn names() {
        let names = Names::new("p", "orders");
        assert_eq!(names.work, "projects/p/subscriptions/orders");
        assert_eq!(names.retry_topic, "projects/p/topics/orders.retry");
        assert_eq!(names.retry, "projects/p/subscriptions/orders.retry");
        assert_eq!(
            names.dead_letter_topic("orders.dlq", None),
            "projects/p/topics/orders.dlq"
        );
        assert_eq!(
            names.dead_letter_topic("orders.dlq", Some("projects/q/topics/dead")),
            "projects/q/topics/dead"
        );
        assert_eq!(
            names.dead_letter_topic("failed", Some("projects/q/topics/dead")),
            "projects/p/topics/failed"
        );
        assert_eq!(
            Names::browsing("projects/q/topics/dead"),
            "projects/q/subscriptions/dead"
        );
        assert!(check_dead_letter_queue("orders.dlq", "orders").is_ok());
        assert!(check_dead_letter_queue("orders", "orders").is_err());
        assert!(check_dead_letter_queue("goog-x", "orders").is_err());
        assert!(check_dead_letter_queue("a b", "orders").is_err());
    }

    #[test]
    fn delivery_cap_rows() {
        let warning = delivery_cap_warning(5, "projects/p/topics/dead", 7).unwrap();
        assert!(warning.contains("after 5 delivery attempts"), "{warning}");
        assert!(warning.contains("maxAttempts 7"), "{warning}");
        assert!(warning.contains("projects/p/topics/dead"), "{warning}");
        assert!(delivery_cap_warning(0, "t", 6).is_some());
        assert_eq!(delivery_cap_warning(7, "t", 7), None);
        assert_eq!(delivery_cap_warning(100, "t", 5), None);
    }
}
