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
/// How often a message was sent back from the dead-letter queue: 1 on the
/// copy the first replay writes, +1 on each later replay's. Read only from
/// a sealed copy, like the rest of courier's state.
pub const F_REPLAY_COUNT: &str = "courier-replay-count";
/// What [`F_REPLAY_COUNT`] was called before it was renamed: read where it
/// is not there, from the copies and dead letters an earlier release wrote,
/// so an upgrade loses no count; never written.
pub const F_LEGACY_REPLAYS: &str = "courier-replays";
/// On a replayed message: the id, in its dead-letter queue, of the dead
/// letter it was replayed from (`DeadLetter::id`).
pub const F_REPLAYED_FROM: &str = "courier-replayed-from";
/// On a replayed message: its earlier dead letters, oldest first, as a
/// compact JSON array ([`super::History`]).
pub const F_HISTORY: &str = "courier-history";
/// On a message `courier dlq edit` replayed: the digest of the body and
/// headers of the dead letter it was edited from
/// ([`super::DeadLetter::digest`]), so its record says it is not what the
/// producer sent and which message it was. Kept like the lineage; a later
/// edit replaces it.
pub const F_EDITED_FROM_DIGEST: &str = "courier-edited-from-digest";
/// The proof that courier wrote the `courier-*` state of a stored copy:
/// an HMAC over them with a key kept in the broker. A copy without a valid
/// one is a new message whatever `courier-*` fields it carries.
pub const F_SEAL: &str = "courier-seal";

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

/// Bookkeeping that describes one stored copy and never outlives it.
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
