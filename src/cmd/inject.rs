//! `courier inject`: the flags of the admission webhook server, and
//! `--pod FILE` to print what the webhook would do to a pod or workload.
//! The webhook itself is [`crate::inject`]; this file turns flags into its
//! checked configuration.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::args::UsageError;
use crate::duration;
use crate::inject::{
    DEFAULT_CPU_REQUEST, DEFAULT_IMAGE, DEFAULT_MEMORY_LIMIT, DEFAULT_MEMORY_REQUEST, Decision,
    InjectConfig, Reach, Resources, SidecarDefaults, WebhookScope, apply_chart_values,
    inject_document, is_quantity, serve,
};
use crate::telemetry::LogFormat;

/// `courier inject`: the flags of the webhook server, and the defaults it
/// gives every sidecar.
#[derive(Debug, Clone, Args)]
pub struct InjectArgs {
    /// Address of the HTTPS server (/mutate, /healthz, /readyz).
    #[arg(long, env = "COURIER_LISTEN", default_value = "0.0.0.0:8443")]
    pub listen: String,
    /// PEM certificate chain of the server; reloaded when it changes.
    #[arg(
        long,
        env = "COURIER_TLS_CERT",
        default_value = "/etc/courier/tls/tls.crt"
    )]
    pub tls_cert: PathBuf,
    /// PEM private key of the server; reloaded when it changes.
    #[arg(
        long,
        env = "COURIER_TLS_KEY",
        default_value = "/etc/courier/tls/tls.key"
    )]
    pub tls_key: PathBuf,
    /// How often the certificate files are checked for changes.
    #[arg(long, env = "COURIER_TLS_RELOAD_INTERVAL", default_value = "10s", value_parser = duration::parse_flag)]
    pub tls_reload_interval: Duration,
    #[command(flatten)]
    pub sidecar: SidecarArgs,
    /// Instead of serving: read a Pod, or a workload with a pod template,
    /// from FILE (- for stdin) and print it as the webhook would leave it.
    #[arg(long, env = "COURIER_INJECT_POD", value_name = "FILE")]
    pub pod: Option<PathBuf>,
    /// With --pod: the chart's values file (as given to helm install -f);
    /// its image and sidecar.* settings replace the --sidecar-* flags, so
    /// the preview is what that install injects. Without it the defaults
    /// are the chart's defaults.
    #[arg(
        long,
        env = "COURIER_INJECT_VALUES",
        value_name = "FILE",
        requires = "pod"
    )]
    pub values: Option<PathBuf>,
    /// With --pod: the namespace the pod is created in [default: the
    /// file's metadata.namespace]; with --values, a namespace the chart's
    /// webhook is never called for is said so, and nothing is injected.
    #[arg(long, value_name = "NAME", requires = "pod")]
    pub namespace: Option<String>,
    /// With --values: the namespace the chart is installed in (helm
    /// install -n), which its webhook never injects.
    #[arg(long, value_name = "NAME", requires = "values")]
    pub release_namespace: Option<String>,
}

#[derive(Debug, Clone, Args)]
pub struct SidecarArgs {
    /// Image of the injected container.
    #[arg(long, env = "COURIER_SIDECAR_IMAGE", default_value = DEFAULT_IMAGE)]
    pub sidecar_image: String,
    /// Pull policy of the injected container.
    #[arg(long, env = "COURIER_SIDECAR_IMAGE_PULL_POLICY", default_value = "IfNotPresent",
          value_parser = ["Always", "IfNotPresent", "Never"])]
    pub sidecar_image_pull_policy: String,
    /// Inject a native sidecar (an init container with restartPolicy
    /// Always), which starts before and stops after the
    /// app. A pod can override this with courier.dev/native-sidecar.
    #[arg(long, env = "COURIER_NATIVE_SIDECARS", value_name = "BOOL",
          default_value_t = true, action = clap::ArgAction::Set)]
    pub native_sidecars: bool,
    /// CPU request of the sidecar, unless the pod says courier.dev/cpu-request.
    #[arg(long, env = "COURIER_SIDECAR_CPU_REQUEST", default_value = DEFAULT_CPU_REQUEST)]
    pub sidecar_cpu_request: String,
    /// Memory request of the sidecar, unless the pod says courier.dev/memory-request.
    #[arg(long, env = "COURIER_SIDECAR_MEMORY_REQUEST", default_value = DEFAULT_MEMORY_REQUEST)]
    pub sidecar_memory_request: String,
    /// CPU limit of the sidecar (none when empty), unless the pod says courier.dev/cpu-limit.
    #[arg(long, env = "COURIER_SIDECAR_CPU_LIMIT", default_value = "")]
    pub sidecar_cpu_limit: String,
    /// Memory limit of the sidecar (none when empty), unless the pod says courier.dev/memory-limit.
    #[arg(long, env = "COURIER_SIDECAR_MEMORY_LIMIT", default_value = DEFAULT_MEMORY_LIMIT)]
    pub sidecar_memory_limit: String,
    /// Log format of the sidecar.
    #[arg(
        long,
        env = "COURIER_SIDECAR_LOG_FORMAT",
        value_enum,
        default_value = "json"
    )]
    pub sidecar_log_format: LogFormat,
}

impl SidecarArgs {
    /// Checks the flags; a bad quantity fails here, not in every pod.
    pub fn defaults(&self) -> Result<SidecarDefaults, UsageError> {
        let quantity = |flag: &str, value: &str| -> Result<Option<String>, UsageError> {
            let value = value.trim();
            if value.is_empty() {
                return Ok(None);
            }
            if !is_quantity(value) {
                return Err(UsageError(format!(
                    "--{flag} {value:?} is not a Kubernetes quantity; write it like 100m, 64Mi or 1"
                )));
            }
            Ok(Some(value.to_string()))
        };
        if self.sidecar_image.trim().is_empty() {
            return Err(UsageError(
                "--sidecar-image is empty; name the courier image to inject".into(),
            ));
        }
        Ok(SidecarDefaults {
            image: self.sidecar_image.trim().to_string(),
            image_pull_policy: self.sidecar_image_pull_policy.clone(),
            native_sidecars: self.native_sidecars,
            resources: Resources {
                cpu_request: quantity("sidecar-cpu-request", &self.sidecar_cpu_request)?,
                memory_request: quantity("sidecar-memory-request", &self.sidecar_memory_request)?,
                cpu_limit: quantity("sidecar-cpu-limit", &self.sidecar_cpu_limit)?,
                memory_limit: quantity("sidecar-memory-limit", &self.sidecar_memory_limit)?,
            },
            log_format: self
                .sidecar_log_format
                .to_possible_value()
                .map(|v| v.get_name().to_string())
                .unwrap_or_else(|| "json".into()),
        })
    }
}

/// Checks the flags of the server.
pub fn config(args: &InjectArgs) -> Result<InjectConfig, UsageError> {
    let listen = args.listen.parse().map_err(|_| {
        UsageError(format!(
            "--listen {:?} is not an address; write it like 0.0.0.0:8443",
            args.listen
        ))
    })?;
    if args.tls_reload_interval.is_zero() {
        return Err(UsageError(
            "--tls-reload-interval must be more than 0s".into(),
        ));
    }
    Ok(InjectConfig {
        listen,
        tls_cert: args.tls_cert.clone(),
        tls_key: args.tls_key.clone(),
        tls_reload_interval: args.tls_reload_interval,
        defaults: args.sidecar.defaults()?,
    })
}

/// `courier inject`: serve the webhook until SIGTERM, or render one file
/// with `--pod`.
pub async fn run(args: InjectArgs) -> anyhow::Result<ExitCode> {
    if let Some(path) = &args.pod {
        let mut defaults = args.sidecar.defaults()?;
        let scope = match &args.values {
            Some(values) => Some(WebhookScope::of(
                &read_chart_values(values, &mut defaults)?,
                args.release_namespace.as_deref(),
            )),
            None => None,
        };
        return render(path, &defaults, scope.as_ref(), args.namespace.as_deref());
    }
    let config = config(&args)?;
    let shutdown = CancellationToken::new();
    let (addr, server) = serve(config, shutdown.clone()).await?;
    tracing::info!(%addr, "serving the admission webhook on https://{addr}/mutate");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot listen for SIGTERM")?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: stopping"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: stopping"),
    }
    shutdown.cancel();
    server.await.context("the webhook server task failed")?;
    Ok(ExitCode::SUCCESS)
}

/// `--values FILE`: the chart's values over the flags' defaults; the
/// values, for what else they say.
fn read_chart_values(path: &Path, defaults: &mut SidecarDefaults) -> Result<Value, UsageError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| UsageError(format!("--values {}: {e}", path.display())))?;
    let values: Value = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_saphyr::from_str(&text)
            .map_err(|e| UsageError(format!("--values {}: not YAML: {e}", path.display())))?
    };
    apply_chart_values(defaults, &values).map_err(|e| {
        UsageError(format!(
            "--values {}: {e}; fix the values (the chart's values.schema.json refuses them too)",
            path.display()
        ))
    })?;
    check_default_policy(&values).map_err(|e| {
        UsageError(format!(
            "--values {}: defaultPolicy.{e}; the API server would refuse the RetryPolicy the chart creates",
            path.display()
        ))
    })?;
    Ok(values)
}

/// The RetryPolicy the chart creates from `defaultPolicy.spec`, read as a
/// sidecar reads it: an unknown field, a bad rate limit, pause or maximum
/// age is named.
fn check_default_policy(values: &Value) -> Result<(), String> {
    let Some(spec) = values
        .pointer("/defaultPolicy/spec")
        .filter(|v| !v.is_null())
    else {
        return Ok(());
    };
    let spec: crate::policy::RetryPolicySpec =
        serde_json::from_value(spec.clone()).map_err(|e| format!("spec: {e}"))?;
    crate::policy::Policy::from_spec("default", &spec)
        .map(drop)
        .map_err(|e| e.to_string())
}

fn render(
    path: &Path,
    defaults: &SidecarDefaults,
    scope: Option<&WebhookScope>,
    namespace: Option<&str>,
) -> anyhow::Result<ExitCode> {
    let text = if path == Path::new("-") {
        std::io::read_to_string(std::io::stdin()).context("cannot read the pod from stdin")?
    } else {
        std::fs::read_to_string(path)
            .map_err(|e| UsageError(format!("--pod {}: {e}", path.display())))?
    };
    let doc: Value = serde_saphyr::from_str(&text)
        .map_err(|e| UsageError(format!("--pod {}: not YAML or JSON: {e}", path.display())))?;
    // The chart's webhook is not called for every namespace: a preview
    // that injects where the install would not would mislead.
    if let Some(scope) = scope {
        let namespace = namespace.map(str::to_string).or_else(|| {
            doc.pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .map(str::to_string)
        });
        match namespace.as_deref().map(|ns| scope.reach(ns)) {
            Some(Reach::Never(why)) => {
                eprintln!(
                    "courier: not injected: the chart's webhook is not called for this pod: {why}"
                );
                print!(
                    "{}",
                    serde_saphyr::to_string(&doc).context("cannot write the pod as YAML")?
                );
                return Ok(ExitCode::SUCCESS);
            }
            Some(Reach::IfLabelled(note)) => eprintln!("warning: courier: {note}"),
            Some(Reach::Called) => {}
            None => eprintln!(
                "warning: courier: the file names no namespace (give --namespace); {}",
                match scope.namespaces.is_empty() {
                    true => format!(
                        "the webhook is called only in namespaces labelled {}=enabled",
                        scope.opt_in_label
                    ),
                    false => format!(
                        "the webhook is called only in {}",
                        scope.namespaces.join(", ")
                    ),
                }
            ),
        }
    }
    let (doc, decision) = inject_document(doc, defaults)
        .map_err(|e| UsageError(format!("--pod {}: {e}", path.display())))?;
    eprintln!("{}", decision.message());
    // The same warnings the API server shows kubectl on admission.
    if let Decision::Inject { warnings, .. } = &decision {
        for warning in warnings {
            eprintln!("warning: {warning}");
        }
    }
    if let Decision::Deny(_) = decision {
        return Ok(ExitCode::from(1));
    }
    print!(
        "{}",
        serde_saphyr::to_string(&doc).context("cannot write the pod as YAML")?
    );
    Ok(ExitCode::SUCCESS)
}
