//! What courier's brokers and the rest of courier share: the message
//! model, durations, and the source traits with the parts every broker
//! uses (the seal, TLS files, redaction, the field encoding). Each broker
//! is a crate of its own that depends on this one and on nothing else of
//! courier's, so the brokers compile side by side and before the rest of
//! courier (docs/architecture.md). The `courier` crate re-exports all of it
//! under the same paths (`courier::model`, `courier::source`).
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod duration;
pub mod model;
pub mod source;
