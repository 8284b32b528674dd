//! `courier inject`: the admission webhook server, or `--pod` to preview.

pub use crate::inject::{InjectArgs, run};
