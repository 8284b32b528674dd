//! The brokers beyond the conformance suite, one module per broker concern
//! (the module is the old file's name: `cargo test --test brokers --
//! redis_settle::` runs one): what is one broker's own, its clustering,
//! Sentinel and TLS, several replicas on one queue, and the chaos suite.
//! Private brokers of a module's own live on ports of its own; the shared
//! moto, Pub/Sub emulator and Kafka mock start once for this binary
//! (`tests/common/`).

#[path = "../common/mod.rs"]
mod common;

mod amqp_quorum;
mod amqp_settle;
mod brokers;
mod chaos;
mod dlq_pages;
mod embedded;
mod embedded_dead_letters;
mod embedded_durability;
mod embedded_leases;
mod idle;
mod kafka_security;
mod kafka_settle;
mod keep_alive;
mod long_delays;
mod nats_cluster;
mod nats_settling;
mod pubsub;
mod rabbitmq_cluster;
mod redis_arrivals;
mod redis_cluster;
mod redis_depth;
mod redis_sentinel;
mod redis_settle;
mod replicas;
mod sqs;
mod tls;
