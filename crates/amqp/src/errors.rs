//! RabbitMQ errors as courier's, and the time limit on every broker call.

use std::future::Future;
use std::time::Duration;

use lapin::ErrorKind;
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::ShortString;

use courier_core::source::SourceError;

pub(super) fn is_soft(e: &lapin::Error, which: AMQPSoftError) -> bool {
    matches!(e.kind(), ErrorKind::ProtocolError(p) if p.kind() == &AMQPErrorKind::Soft(which))
}

pub(super) fn broker_error(e: lapin::Error) -> SourceError {
    match e.kind() {
        ErrorKind::ProtocolError(p) => SourceError::broker(format!("RabbitMQ: {p}")),
        _ => SourceError::unavailable(e.to_string()),
    }
}

/// How long one broker operation may take before the connection is given
/// up: an answer lost with a connection must not stall deliveries forever.
pub(super) const OPERATION_TIMEOUT: Duration = Duration::from_secs(30);

pub(super) enum Timed {
    Broker(lapin::Error),
    TimedOut,
}

impl From<Timed> for SourceError {
    fn from(e: Timed) -> Self {
        match e {
            Timed::Broker(e) => broker_error(e),
            Timed::TimedOut => SourceError::unavailable(format!(
                "RabbitMQ did not answer within {OPERATION_TIMEOUT:?}"
            )),
        }
    }
}

pub(super) async fn timed<T>(op: impl Future<Output = lapin::Result<T>>) -> Result<T, Timed> {
    match tokio::time::timeout(OPERATION_TIMEOUT, op).await {
        Ok(result) => result.map_err(Timed::Broker),
        Err(_) => Err(Timed::TimedOut),
    }
}

pub(super) fn short(text: &str) -> Result<ShortString, SourceError> {
    ShortString::try_new(text).map_err(|_| {
        SourceError::invalid(format!(
            "{text:?} is longer than the 255 bytes AMQP allows for a name"
        ))
    })
}

pub(super) fn lost() -> SourceError {
    SourceError::unavailable(
        "the connection this delivery came on was lost; RabbitMQ hands the message out again",
    )
}
