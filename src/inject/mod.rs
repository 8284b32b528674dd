//! The sidecar injector: a mutating admission webhook that adds the courier
//! container to pods that opt in.
//!
//! A pod opts in with the label `courier.dev/inject: "true"` (the webhook
//! configuration selects on it, so other pods never reach us) and says where
//! to consume from with `courier.dev/*` annotations. [`decide_with_token`]
//! is a pure function from the pod (and its new `/drain` secret) to a
//! [`Decision`]: inject (with a JSON Patch), skip
//! (with the reason), or deny (with a message naming what is missing). The
//! HTTPS server around it reloads its certificate when the files change, so
//! a rotated Secret needs no restart.
//!
//! - [`settings`]: names, annotations, the defaults every sidecar gets, and
//!   the checked settings of one pod (its own scheme check of the broker
//!   URL: the injector loads no broker code).
//! - [`decision`]: which pods, and what is added to them.
//! - [`flags`]: which annotation sets which `courier run` flag.
//! - [`review`]: the AdmissionReview exchange with the API server.
//! - [`tls`]: the certificate, reloaded when its files change.
//! - [`server`]: the HTTPS accept loop and the answers.
//! - [`values`]: the chart's values as sidecar defaults, for the preview.
//!
//! The command line (`courier inject`, and `--pod FILE` to preview what the
//! webhook would do) is in `cmd::inject`; nothing here reads flags.

pub mod decision;
pub mod flags;
pub mod review;
pub mod server;
pub mod settings;
pub mod tls;
pub mod values;

pub use decision::{
    Decision, Skip, decide, decide_with_token, inject_document, mask_drain_tokens, new_drain_token,
};
pub use review::review;
pub use server::{InjectConfig, WebhookLimits, serve, serve_within};
pub use settings::{
    CONTAINER_NAME, DEFAULT_CPU_REQUEST, DEFAULT_IMAGE, DEFAULT_MEMORY_LIMIT,
    DEFAULT_MEMORY_REQUEST, DEFAULT_METRICS_PORT, INJECT_LABEL, METRICS_PORT_NAME, Resources,
    SidecarDefaults, annotations, is_quantity,
};
pub use tls::{ReloadingCert, TlsError, server_config};
pub use values::{Reach, WebhookScope, apply_chart_values};
