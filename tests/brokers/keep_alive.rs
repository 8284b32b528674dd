//! Keep-alives on SQS and Pub/Sub, end to end: the app holds a message
//! longer than the broker's claim on it, and the dispatcher's keep-alives
//! keep it from being handed out again.
//!
//! With courier's own settings no single attempt outlasts the claim made at
//! receipt: the visibility timeout in force is always longer than the
//! policy's timeout (`dispatch::live::visibility_for`, and `courier run`
//! refuses a shorter `--visibility-timeout`), and a Pub/Sub lease at receipt
//! is that timeout. The keep-alive carries a delivery only where the broker
//! caps a claim below it: Pub/Sub's 600 s (`Consumer::longest_claim`), too
//! long for a test. So the broker here is real, but its claim is capped
//! short: [`ShortClaim`] wraps the real source, and right after each receive
//! cuts the message's claim on the broker to [`CLAIM`] with the broker's own
//! client (`ChangeMessageVisibility`, `ModifyAckDeadline`), and says so
//! through `longest_claim`, as Pub/Sub says 600 s. The app then holds the
//! message 2.5 claims; without keep-alives three times per claim, the
//! broker hands it out again and the app receives it twice.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use courier::dispatch::{AppSettings, DeliverySettings, Dispatcher};
use courier::model::Delivery;
use courier::policy::LivePolicy;
use courier::source::{
    self, Capabilities, Consumer, Settlement, Source, SourceError, SourceOptions,
};
use courier::telemetry::{Health, Metrics, Readiness};
use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::ModifyAckDeadlineRequest;
use tokio_util::sync::CancellationToken;

use crate::common::*;

/// The claim the broker grants in these tests: SQS's and Pub/Sub's
/// shortest useful one is a second or two (both take whole seconds).
const CLAIM: Duration = Duration::from_secs(2);
/// How long the app holds the message: 2.5 claims.
const HOLD: &str = "script:sleep5000\nheld past its claim";
const SETTLE: Duration = Duration::from_secs(60);

/// Cuts what the broker granted at receipt down to [`CLAIM`].
#[async_trait]
trait CutClaim: Send + Sync + 'static {
    async fn cut(&self, receipts: Vec<String>);
}

struct SqsCut {
    client: aws_sdk_sqs::Client,
    url: String,
}

#[async_trait]
impl CutClaim for SqsCut {
    async fn cut(&self, receipts: Vec<String>) {
        for receipt in receipts {
            self.client
                .change_message_visibility()
                .queue_url(&self.url)
                .receipt_handle(receipt)
                .visibility_timeout(CLAIM.as_secs() as i32)
                .send()
                .await
                .expect("cut the visibility timeout");
        }
    }
}

struct PubSubCut {
    subscription: String,
}

#[async_trait]
impl CutClaim for PubSubCut {
    async fn cut(&self, receipts: Vec<String>) {
        if receipts.is_empty() {
            return;
        }
        let (_, mut subscriber) = pubsub_clients().await;
        subscriber
            .modify_ack_deadline(ModifyAckDeadlineRequest {
                subscription: self.subscription.clone(),
                ack_ids: receipts,
                ack_deadline_seconds: CLAIM.as_secs() as i32,
            })
            .await
            .expect("cut the ack deadline");
    }
}

/// The real source, with a broker whose claims are [`CLAIM`] long.
struct ShortClaim {
    inner: Arc<dyn Source>,
    cut: Box<dyn CutClaim>,
}

#[async_trait]
impl Consumer for ShortClaim {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        let got = self.inner.receive(max).await?;
        self.cut
            .cut(got.iter().map(|d| d.receipt.clone()).collect())
            .await;
        Ok(got)
    }

    async fn settle(
        &self,
        delivery: &Delivery,
        settlement: Settlement<'_>,
    ) -> Result<(), SourceError> {
        self.inner.settle(delivery, settlement).await
    }

    async fn keep_alive(&self, in_flight: &[Delivery]) -> Result<(), SourceError> {
        self.inner.keep_alive(in_flight).await
    }

    async fn interrupt(&self) {
        self.inner.interrupt().await
    }

    fn longest_claim(&self) -> Option<Duration> {
        Some(CLAIM)
    }

    async fn close(&self) {
        self.inner.close().await
    }
}

/// Runs the dispatcher on `fixture` through [`ShortClaim`] until the held
/// message is acked; the app must have received it once.
async fn held_past_its_claim(fixture: Fixture, cut: Box<dyn CutClaim>) {
    let app = TestApp::start().await;
    let inspector = fixture.open().await;
    let id = fixture.send(&inspector, HOLD).await;
    let policy = courier::policy::Policy {
        timeout: Duration::from_secs(10),
        ..fast_policy()
    };
    let mut options = SourceOptions::new(&fixture.queue);
    options.consumer = unique("consumer");
    options.live.dead_letter_queue = fixture.dlq();
    options.live.visibility_timeout = policy.timeout + Duration::from_secs(2);
    options.concurrency = 8;
    options.max_body = 1 << 20;
    let inner = source::open(&fixture.url, options.clone())
        .await
        .expect("open the source");
    inner.apply(&courier::dispatch::live::settings_for(&options, &policy));
    let source: Arc<dyn Consumer> = Arc::new(ShortClaim { inner, cut });
    let metrics = Arc::new(Metrics::new());
    let app_settings = AppSettings {
        failure_run: 0,
        ..AppSettings::new(app.url().parse().unwrap())
    };
    let delivery = DeliverySettings {
        drain_timeout: Duration::from_secs(5),
        dedup_window: None,
        batch: None,
    };
    let dispatcher = Dispatcher::new(
        source,
        LivePolicy::fixed(policy),
        &options,
        &app_settings,
        &delivery,
        metrics.clone(),
        Arc::new(Health::new(Readiness::default())),
    );
    let stop = CancellationToken::new();
    let running = tokio::spawn(dispatcher.run(stop.clone()));
    let count = |name: &str| metric(&metrics.encode(), name, &fixture.queue);
    wait_for("the held message acked", SETTLE, async || {
        count("courier_acks_total") >= 1.0
    })
    .await;
    wait_settled(&inspector, SETTLE).await;
    stop.cancel();
    running.await.expect("the dispatcher ends");
    let received = app.received_body(HOLD.as_bytes());
    assert_eq!(
        received.len(),
        1,
        "message {id} was handed out again while the app held it"
    );
    assert_eq!(
        count("courier_deliveries_total"),
        1.0,
        "one delivery in all"
    );
    assert!(fixture.dead_letters(&inspector).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_a_delivery_past_its_visibility_timeout_is_kept_invisible() {
    let fixture = Fixture::sqs();
    // The queue exists once the fixture's inspector opened it.
    drop(fixture.open().await);
    let client = sqs_client().await;
    let url = sqs_queue_url(&client, &fixture.queue).await.unwrap();
    held_past_its_claim(fixture, Box::new(SqsCut { client, url })).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pubsub_a_delivery_past_its_ack_deadline_is_kept_leased() {
    let fixture = Fixture::pubsub();
    let subscription = pubsub_subscription(&fixture.queue);
    held_past_its_claim(fixture, Box::new(PubSubCut { subscription })).await;
}
