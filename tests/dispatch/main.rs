//! The dispatcher and the app end to end, one module per concern (the
//! module is the old file's name: `cargo test --test dispatch -- drain::`
//! runs one): the app's directives, an app still starting, CloudEvents, the
//! gate, live policy edits, readiness, `/drain`, the FastAPI example and
//! OpenTelemetry traces.

#[path = "../common/mod.rs"]
mod common;

mod app_directives;
mod app_starting;
mod cloudevents;
mod dispatch_gate;
mod dispatch_live_policy;
mod dispatch_readiness;
mod drain;
mod fastapi_orders;
mod otel;
