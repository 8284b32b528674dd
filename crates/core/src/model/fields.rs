//! The names of the fields a stored message is made of, the same on every
//! broker: `payload` is the body, `courier-*` fields are courier's
//! bookkeeping, every other field is a producer header.

/// Field that carries the body.
pub const PAYLOAD: &str = "payload";
/// The broker id of the original message; kept across retries and replays.
pub const F_MESSAGE_ID: &str = "courier-message-id";
/// The attempt number of the next delivery.
pub const F_ATTEMPT: &str = "courier-attempt";
pub const F_FIRST_ATTEMPT_AT: &str = "courier-first-attempt-at";
/// When the message first entered the queue, kept in the copies courier
/// stores (a retry, a give-back): a copy's own broker time is when it was
/// stored again, not when the message was.
pub const F_ENQUEUED_AT: &str = "courier-enqueued-at";
pub const F_LAST_ATTEMPT_AT: &str = "courier-last-attempt-at";
pub const F_REASON: &str = "courier-reason";
pub const F_STATUS: &str = "courier-status";
pub const F_ERROR: &str = "courier-error";
pub const F_ATTEMPTS: &str = "courier-attempts";
pub const F_QUEUE: &str = "courier-queue";
pub const F_EXCERPT: &str = "courier-response-excerpt";
pub const F_POLICY: &str = "courier-policy";
/// The app's header that decided a dead letter; only on those it decided.
pub const F_APP_DIRECTIVE: &str = "courier-app-directive";
/// Deliveries since the message was last stored, for sources that count
/// unsettled deliveries themselves (the embedded queue).
pub const F_DELIVERIES: &str = "courier-deliveries";
/// On a dead letter that did not fit the dead-letter queue whole: what
/// was left out of it (the body, the producer headers) and why.
pub const F_CUT: &str = "courier-cut";
/// How often a message was sent back from the dead-letter queue.
pub const F_REPLAYS: &str = "courier-replays";
/// The proof that courier wrote the `courier-*` state of a stored copy:
/// an HMAC over them with a key kept in the broker. A copy without a valid
/// one is a new message whatever `courier-*` fields it carries.
pub const F_SEAL: &str = "courier-seal";

/// Bookkeeping that describes one stored copy and never outlives it.
/// The age of a dead letter written at `dead_lettered_at` (its
/// `courier-last-attempt-at`), as `courier_dlq_oldest_age_seconds` reports it
/// on every broker: a clock that went backwards reads as zero.
pub fn dead_letter_age(
    dead_lettered_at: std::time::SystemTime,
    now: std::time::SystemTime,
) -> std::time::Duration {
    now.duration_since(dead_lettered_at).unwrap_or_default()
}

/// The dead-letter queue of `queue` when the policy names none:
/// `<queue>.dlq`. Everything else asks
/// `Policy::dead_letter_queue_for`, which falls back to this.
pub fn default_dead_letter_queue(queue: &str) -> String {
    format!("{queue}.dlq")
}

pub fn is_transient_bookkeeping(name: &[u8]) -> bool {
    matches!(
        name,
        b"courier-message-id"
            | b"courier-attempt"
            | b"courier-first-attempt-at"
            | b"courier-enqueued-at"
            | b"courier-deliveries"
            | b"courier-seal"
    )
}
