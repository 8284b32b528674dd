//! `courier send`: enqueue one message into any source.

use std::io::Read;
use std::process::ExitCode;

use anyhow::Context;
use bytes::Bytes;
use clap::Args;

use super::args::{SourceArgs, parse_header};
use crate::source::{self, SourceOptions};

#[derive(Debug, Clone, Args)]
pub struct SendArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// A message header, K=V; repeatable.
    #[arg(long = "header", env = "COURIER_HEADER", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
    /// The body, or - to read it from stdin.
    pub body: String,
}

pub async fn run(args: SendArgs) -> anyhow::Result<ExitCode> {
    let (url, tls) = args.source.parse()?;
    let body = if args.body == "-" {
        let mut buf = Vec::new();
        std::io::stdin()
            .read_to_end(&mut buf)
            .context("cannot read the body from stdin")?;
        Bytes::from(buf)
    } else {
        Bytes::from(args.body.into_bytes())
    };
    let mut options = SourceOptions::new(&args.source.queue);
    options.tls = tls;
    let source = source::open(&url, options)
        .await
        .with_context(|| format!("cannot open --source {url}"))?;
    let id = source.send(body, &args.headers).await?;
    source.close().await;
    println!("{id}");
    Ok(ExitCode::SUCCESS)
}
