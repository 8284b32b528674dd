//! What runs in or for Kubernetes, one module per concern (the module is the
//! old file's name: `cargo test --test kubernetes -- inject::` runs one):
//! the injector and its Helm preview and annotations, the chart's copied
//! files, the KEDA examples, the RetryPolicy CRD, its watcher and kubectl,
//! and the monitoring assets against a real Prometheus.

#[path = "../common/mod.rs"]
mod common;

mod chart_files;
mod helm_annotations;
mod helm_preview;
mod inject;
mod keda_examples;
mod monitoring;
mod policy_crd;
mod policy_kubectl;
mod policy_watch;
