//! `courier send`: enqueue one message into any source, optionally as a
//! CloudEvent.

use std::io::Read;
use std::process::ExitCode;

use anyhow::Context;
use bytes::Bytes;
use clap::Args;

use super::args::{SourceArgs, UsageError, parse_header};
use crate::forward::cloudevents;
use crate::model::rfc3339;
use crate::source::{self, SourceOptions};

/// `--ce-type` when none is given.
pub const DEFAULT_CE_TYPE: &str = "dev.courier.send";
/// `--ce-source` when none is given.
pub const DEFAULT_CE_SOURCE: &str = "/courier/send";

#[derive(Debug, Clone, Args)]
pub struct SendArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// A message header, K=V; repeatable.
    #[arg(long = "header", env = "COURIER_HEADER", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
    /// Send a CloudEvent: the body is its data (its content type the
    /// content-type header), the attributes are ce-* headers on the message
    /// (specversion 1.0, --ce-id, --ce-source, --ce-type, time now; more with
    /// --header ce-NAME=VALUE).
    #[arg(long, env = "COURIER_CLOUDEVENT")]
    pub cloudevent: bool,
    /// With --cloudevent: the event's id [default: a random UUID].
    #[arg(long, env = "COURIER_CE_ID", requires = "cloudevent")]
    pub ce_id: Option<String>,
    /// With --cloudevent: the event's source, a URI-reference [default: /courier/send].
    #[arg(long, env = "COURIER_CE_SOURCE", requires = "cloudevent")]
    pub ce_source: Option<String>,
    /// With --cloudevent: the event's type [default: dev.courier.send].
    #[arg(long, env = "COURIER_CE_TYPE", requires = "cloudevent")]
    pub ce_type: Option<String>,
    /// The body, or - to read it from stdin.
    pub body: String,
}

/// The message headers of `args`, with the event's attributes first when
/// it is a CloudEvent.
pub fn headers(args: &SendArgs) -> Result<Vec<(String, String)>, UsageError> {
    if !args.cloudevent {
        return Ok(args.headers.clone());
    }
    let given = |name: &str| {
        args.headers.iter().find(|(header, _)| {
            cloudevents::attribute_of(header).is_some_and(|a| a.eq_ignore_ascii_case(name))
        })
    };
    for (attribute, flag) in [
        ("specversion", "it is always 1.0"),
        ("id", "use --ce-id"),
        ("source", "use --ce-source"),
        ("type", "use --ce-type"),
    ] {
        if let Some((header, _)) = given(attribute) {
            return Err(UsageError(format!(
                "--header {header} with --cloudevent: {flag}"
            )));
        }
    }
    let id = args.ce_id.clone().unwrap_or_else(random_uuid);
    let source = args
        .ce_source
        .clone()
        .unwrap_or_else(|| DEFAULT_CE_SOURCE.into());
    let kind = args
        .ce_type
        .clone()
        .unwrap_or_else(|| DEFAULT_CE_TYPE.into());
    for (flag, value) in [
        ("--ce-id", &id),
        ("--ce-source", &source),
        ("--ce-type", &kind),
    ] {
        if value.is_empty() {
            return Err(UsageError(format!(
                "{flag} is empty; CloudEvents 1.0 requires a non-empty id, source and type"
            )));
        }
    }
    let mut headers = vec![
        ("ce-specversion".to_string(), "1.0".to_string()),
        ("ce-id".into(), id),
        ("ce-source".into(), source),
        ("ce-type".into(), kind),
    ];
    if given("time").is_none() {
        headers.push(("ce-time".into(), rfc3339(std::time::SystemTime::now())));
    }
    headers.extend(args.headers.iter().cloned());
    Ok(headers)
}

/// A version 4 UUID, for an event id that is unique without coordination.
fn random_uuid() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|byte| format!("{byte:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

pub async fn run(args: SendArgs) -> anyhow::Result<ExitCode> {
    let (url, tls, sasl) = args.source.parse()?;
    let headers = headers(&args)?;
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
    options.sasl = sasl;
    let source = source::open_admin(&url, options)
        .await
        .with_context(|| format!("cannot open --source {url}"))?;
    let id = source.send(body, &headers).await?;
    source.flush().await;
    println!("{id}");
    Ok(ExitCode::SUCCESS)
}
