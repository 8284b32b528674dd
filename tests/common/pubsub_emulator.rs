//! The Pub/Sub the tests use: Google's emulator, one per test binary on a
//! port of its own, started on first use. courier and the plain gRPC
//! client reach it through `PUBSUB_EMULATOR_HOST`, set for this process
//! (and so for every courier it starts) before the first client is made.

use std::collections::HashMap;
use std::process::Child;
use std::sync::OnceLock;
use std::time::Duration;

use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::{
    DeadLetterPolicy, Subscription, Topic, publisher_client::PublisherClient,
    subscriber_client::SubscriberClient,
};
use tonic::transport::Channel;

/// The project of every test subscription.
pub const PUBSUB_PROJECT: &str = "courier-test";

/// The emulator's launcher, as the Cloud SDK installs it.
const EMULATOR: &str =
    "/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator";

/// A running emulator; it ends with this process
/// ([`super::server_process::start_server`]).
pub struct PubSubEmulator {
    _child: Child,
    pub port: u16,
}

impl PubSubEmulator {
    pub fn start() -> Self {
        // The launcher execs java, so the shell's kill reaches the JVM.
        let (child, port) = super::server_process::start_server(
            &format!("'{EMULATOR}' --host=127.0.0.1 --port={{port}}"),
            &[("JAVA_OPTS", "-Xmx384m -XX:TieredStopAtLevel=1")],
            &format!("the Pub/Sub emulator ({EMULATOR})"),
            Duration::from_secs(120),
        );
        Self {
            _child: child,
            port,
        }
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

/// The emulator this test binary shares, with `PUBSUB_EMULATOR_HOST`
/// pointing at it.
pub fn shared_pubsub() -> &'static PubSubEmulator {
    static SHARED: OnceLock<PubSubEmulator> = OnceLock::new();
    SHARED.get_or_init(|| {
        let emulator = PubSubEmulator::start();
        // SAFETY: set once, before any client of this process reads it;
        // the test binary's other threads read it only after they have the
        // shared emulator, which this initialiser returns.
        unsafe {
            std::env::set_var("PUBSUB_EMULATOR_HOST", emulator.host());
        }
        emulator
    })
}

/// The `--source` URL of the shared emulator.
pub fn pubsub_url() -> String {
    shared_pubsub();
    format!("pubsub://{PUBSUB_PROJECT}")
}

/// The plain gRPC clients on the shared emulator, as an application would
/// make them.
pub async fn pubsub_clients() -> (PublisherClient<Channel>, SubscriberClient<Channel>) {
    let emulator = shared_pubsub();
    let channel = Channel::from_shared(format!("http://{}", emulator.host()))
        .unwrap()
        .connect()
        .await
        .expect("connect to the Pub/Sub emulator");
    (
        PublisherClient::new(channel.clone()),
        SubscriberClient::new(channel),
    )
}

pub fn pubsub_topic(name: &str) -> String {
    format!("projects/{PUBSUB_PROJECT}/topics/{name}")
}

pub fn pubsub_subscription(name: &str) -> String {
    format!("projects/{PUBSUB_PROJECT}/subscriptions/{name}")
}

/// Creates the topic `name` and the subscription `name` on it with the
/// plain client, as an operator would; with a dead-letter policy to the
/// topic `<name>.dlq` (created too) allowing `max_delivery_attempts`, or
/// without one.
pub async fn create_pubsub_subscription(name: &str, max_delivery_attempts: Option<i32>) {
    let (mut publisher, mut subscriber) = pubsub_clients().await;
    let mut topics = vec![name.to_string()];
    if max_delivery_attempts.is_some() {
        topics.push(format!("{name}.dlq"));
    }
    for topic in topics {
        let _ = publisher
            .create_topic(Topic {
                name: pubsub_topic(&topic),
                labels: HashMap::new(),
                ..Topic::default()
            })
            .await;
    }
    subscriber
        .create_subscription(Subscription {
            name: pubsub_subscription(name),
            topic: pubsub_topic(name),
            ack_deadline_seconds: 30,
            dead_letter_policy: max_delivery_attempts.map(|max| DeadLetterPolicy {
                dead_letter_topic: pubsub_topic(&format!("{name}.dlq")),
                max_delivery_attempts: max,
            }),
            ..Subscription::default()
        })
        .await
        .expect("create the subscription");
}
