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
            peek(session, &queue).await?.ok_or_else(|| {
                SourceError::broker(format!(
                    "the seal key published to {queue:?} is not there; is another program consuming that queue? It holds courier's key for proving which copies it stored"
                ))
            })?
        }
    };
    Seal::new(&secret).map_err(|e| {
        SourceError::broker(format!(
            "the first message in {queue:?} is not a seal key courier wrote ({e}); purge that queue and courier makes a new one"
        ))
    })
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
