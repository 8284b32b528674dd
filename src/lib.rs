//! courier: a consumer sidecar that pulls messages from a broker, POSTs each
//! one to the application over localhost HTTP, and settles it from the answer.
//!
//! How the code is laid out, in the order a message travels
//! (docs/architecture.md draws it and says who may import whom):
//!
//! - [`model`]: the words every layer shares: [`model::Message`],
//!   [`model::Delivery`], [`model::Outcome`], [`model::Class`],
//!   [`model::DeadLetterReason`], the stored field names. A leaf; it and
//!   [`duration`] are the crate `courier-core`'s, re-exported.
//! - [`source`]: the traits ([`source::Source`]), from `courier-core`, the
//!   broker table ([`source::BROKERS`]) and one crate per broker
//!   (`crates/<broker>`, re-exported as `source::<broker>`, each a cargo
//!   feature). Receive, ack, retry-at, dead-letter, depth.
//! - [`forward`]: the pooled HTTP client to the app. Builds the request (a
//!   CloudEvent in the HTTP binding's mode, [`forward::cloudevents`]) and
//!   turns the answer into an [`model::Outcome`]; nothing else looks at raw
//!   HTTP answers.
//! - [`policy`]: the RetryPolicy document (also the CRD), its validation,
//!   the live policy (a file reloaded, or the cluster's object watched), and
//!   the pure decision [`policy::decide`].
//! - [`dispatch`]: the one join: concurrency, the app-health gate, settling
//!   and the graceful drain.
//! - [`expr`]: the dead-letter expressions (CEL): which dead letters an
//!   operator means, for `courier dlq --filter`, and which messages a
//!   route takes.
//! - [`telemetry`]: Prometheus metrics, `/metrics`, `/healthz`, `/readyz`,
//!   logging set-up, OpenTelemetry traces ([`telemetry::traces`]). A leaf:
//!   it takes labels, not courier's types.
//! - [`sidecar`]: wires one run of the pipeline together, one per
//!   subscription when there are several.
//! - [`subscriptions`]: the document that lists several queues for one
//!   sidecar, read by `courier run` and checked by the injector.
//! - [`inject`]: the admission webhook that adds the sidecar to pods.
//! - [`cmd`]: the commands (`run`, `send`, `demo`, `dlq`, `inject`, `crd`),
//!   their flags and exit codes; `main.rs` only calls [`cmd::main`].
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod cmd;
pub mod dispatch;
pub use courier_core::duration;
pub mod expr;
pub mod forward;
pub mod inject;
pub use courier_core::model;
pub mod policy;
pub mod sidecar;
pub mod source;
pub mod subscriptions;
pub mod telemetry;
