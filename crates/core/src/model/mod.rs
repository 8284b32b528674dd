//! The types every layer shares: a message and its delivery, what happened
//! when it was offered to the app, why it was dead-lettered, and the names
//! of the stored fields. A leaf: it imports nothing else of courier, so
//! sources, the HTTP client, the policy and the dispatcher can all speak
//! of the same things without knowing each other.

mod fields;
mod lineage;
mod message;
mod outcome;
mod time;

pub use fields::*;
pub use lineage::{HISTORY_BYTES, HISTORY_ENTRIES, History, HistoryEntry};
pub use message::{DeadLetter, Delivery, Failure, Message};
pub use outcome::{Class, DeadLetterReason, Directives, EXCERPT_LIMIT, Outcome};
pub use time::{parse_time, rfc3339};
