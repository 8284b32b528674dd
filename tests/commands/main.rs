//! The command line, one module per concern (the module is the old file's
//! name: `cargo test --test commands -- cli::` runs one): the built binary
//! as a user meets it, every command of the docs, and the fuzz targets'
//! checks on stable.

#[path = "../common/mod.rs"]
mod common;

mod browser_smoke;
mod cli;
mod console;
mod doc_commands;
mod fuzz_smoke;
