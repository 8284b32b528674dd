//! `courier crd`: print the RetryPolicy CustomResourceDefinition.

use std::process::ExitCode;

pub fn run() -> anyhow::Result<ExitCode> {
    print!("{}", crate::policy::crd::definition_yaml());
    Ok(ExitCode::SUCCESS)
}
