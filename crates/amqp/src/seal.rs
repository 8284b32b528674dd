//! The key of the seal on the copies courier stores (`shared::Seal`): one
//! message in the durable queue `<queue>.courier-key`, read without
//! taking it.

use lapin::BasicProperties;
use lapin::options::BasicGetOptions;
use lapin::types::FieldTable;

use super::errors::{broker_error, short};
use super::session::Session;
use courier_core::source::SourceError;
use courier_core::source::shared::Seal;

/// The seal key of `work_queue`, made on first use (a consumer's start, or
/// the first replay of an admin handle, which writes anyway). Replicas
/// starting together may each publish one; every replica reads after it
/// published, and takes the first in the queue, so they agree.
pub(super) async fn read_seal(session: &Session, work_queue: &str) -> Result<Seal, SourceError> {
    let queue = format!("{work_queue}.courier-key");
    session.declare(&queue, FieldTable::default()).await?;
    let secret = match peek(session, &queue).await? {
        Some(secret) => secret,
        None => {
            let secret = Seal::new_secret();
            let persistent = BasicProperties::default().with_delivery_mode(2);
            session
                .publish(&queue, secret.as_bytes(), persistent)
                .await?;
            peek_again(session, &queue).await?
        }
    };
    Seal::new(&secret).map_err(|e| {
        SourceError::broker(format!(
            "the first message in {queue:?} is not a seal key courier wrote ({e}); purge that queue and courier makes a new one"
        ))
    })
}

/// How often the key just published is looked for, [`PEEK_PAUSE`] apart.
const PEEK_TRIES: u32 = 20;
const PEEK_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);

/// The first message of `queue` after this process published one: looked
/// for a few times, since another replica's peek holds it unacked for a
/// moment (the queue then looks empty), and a publish on one channel may
/// reach the queue after a get on another (a fresh-clone CI run failed
/// conformance `amqp::a_struggling_subscription_does_not_slow_the_others`,
/// where the sidecar and the test open one queue's source at once, so).
async fn peek_again(session: &Session, queue: &str) -> Result<Vec<u8>, SourceError> {
    for tried in 1..=PEEK_TRIES {
        if let Some(secret) = peek(session, queue).await? {
            return Ok(secret);
        }
        if tried < PEEK_TRIES {
            tokio::time::sleep(PEEK_PAUSE).await;
        }
    }
    Err(SourceError::broker(format!(
        "the seal key published to {queue:?} is not there; is another program consuming that queue? It holds courier's key for proving which copies it stored"
    )))
}

/// The first message of `queue`, left where it is: it is got without ack
/// on a channel of its own, and closing the channel puts it back.
async fn peek(session: &Session, queue: &str) -> Result<Option<Vec<u8>>, SourceError> {
    let channel = session
        .connection
        .create_channel()
        .await
        .map_err(broker_error)?;
    let got = channel
        .basic_get(short(queue)?, BasicGetOptions { no_ack: false })
        .await
        .map_err(broker_error);
    let _ = channel.close(200, "read".into()).await;
    Ok(got?.map(|message| message.delivery.data))
}
