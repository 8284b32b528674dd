//! courier: a consumer sidecar that pulls messages from a broker, POSTs each
//! one to the application over localhost HTTP, and settles it from the answer.
//!
//! How the code is laid out, in the order a message travels:
//!
//! - [`source`]: one trait ([`source::Source`]) and one file per broker
//!   (Redis Streams, the embedded redb queue). Receive, ack, retry-at,
//!   dead-letter, depth.
//! - [`forward`]: the pooled HTTP client to the app. Builds the request and
//!   classifies the answer into an [`forward::Outcome`]; nothing else looks
//!   at raw HTTP answers.
//! - [`policy`]: the RetryPolicy document (also the CRD), its validation,
//!   the live policy (a file reloaded, or the cluster's object watched), and
//!   the pure decision `decide(policy, outcome, attempt)`.
//! - [`dispatch`]: concurrency, in-flight tracking, settling and the
//!   graceful drain.
//! - [`telemetry`]: Prometheus metrics, `/metrics`, `/healthz`, `/readyz`,
//!   logging set-up.
//! - [`config`] and [`cli`]: flags and `COURIER_*` variables, validated once.
//! - [`demo`]: everything on the embedded source with a sample app.
//! - [`inject`]: the admission webhook that adds the sidecar to pods.
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

pub mod cmd;
pub mod dispatch;
pub mod duration;
pub mod forward;
pub mod inject;
pub mod model;
pub mod policy;
pub mod sidecar;
pub mod source;
pub mod telemetry;
