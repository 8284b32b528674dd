//! Every shell command of docs/runbook.md and docs/kubernetes.md, as an
//! operator would paste it. The fenced `sh` blocks are read from the docs;
//! each command is either run here, with the doc's placeholders filled in
//! (`NAMESPACE`, `APP`, `NAME`, `ID`), or listed in [`CLASSIFIED`] with the
//! reason it cannot run here (it needs a real cluster, a registry or a
//! kubelet). A command that is in neither place fails
//! `every_doc_command_is_classified`, so a new or changed command is looked
//! at before it ships.
//!
//! What runs, runs for real: `kubectl` (on PATH) against the stand-in API
//! server (`scripts/kube-stub`), `jq`, the built `courier`, and the local
//! brokers. A `kubectl` in front of the real one bridges two gaps of the
//! stand-in. It has no kubelet, so `kubectl exec POD -c courier -- CMD` runs
//! CMD here, in the environment the injector gives the sidecar
//! (`COURIER_SOURCE`, `COURIER_QUEUE`) and nothing of the operator's shell;
//! arguments are still expanded by the operator's shell first, as they are
//! through a real `kubectl exec`, so `--source "$SOURCE"` fails here as it
//! fails there. And it reads no protobuf, so `kubectl create secret|rolebinding`
//! has kubectl print the object it generates and creates that from JSON.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use serde_json::Value;

const DOCS: [&str; 2] = ["docs/kubernetes.md", "docs/runbook.md"];
const SETTLE: Duration = Duration::from_secs(60);

/// How the test treats a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    /// Run here, then checked by [`World::check`].
    Run,
    /// Cannot run here, for this reason.
    Skip(&'static str),
}

const NEEDS_CLUSTER: &str = "installs into a real cluster with Helm (scripts/test-chart renders, lints and validates the chart)";
const NEEDS_CONTROLLER: &str =
    "waits for the deployment controller, which the stand-in API server does not run";
const NEEDS_CHART: &str = "reads objects only a Helm install into a real cluster creates";
/// KEDA's own switch.
const NO_KEDA: &str = "KEDA's ScaledObject is not installed in the stand-in API server; tests/kubernetes/keda_examples.rs checks the examples' ScaledObjects";
/// The runbook's look at a paused RetryPolicy.
const PAUSED_BY_KUBECTL: &str = "pausing and resuming with kubectl, and a paused RetryPolicy's fields and Paused condition read with kubectl's own JSONPath, are checked by tests/kubernetes/policy_kubectl.rs (kubectl_edit_of_each_flow_control_field_steers_the_sidecar) against a running sidecar";
const NEEDS_KUBELET: &str =
    "reads container logs or pods, which need a kubelet and the webhook in a real cluster";

/// The runbook's cancel and resume of a job.
const JOB_ID: &str = "names a job a running or killed replay made; tests/conformance/jobs.rs cancels a running replay and resumes a killed one, on every broker, through the same commands";

/// Every command of the docs, by its first line, and how it is treated.
const CLASSIFIED: &[(&str, How)] = &[
    // docs/kubernetes.md
    (
        "docker build -t REGISTRY/courier:0.1.0 .",
        How::Skip(
            "needs a container engine, which these machines lack: .ci/run never builds the image; scripts/build-image does, where docker or podman is installed",
        ),
    ),
    (
        "docker push REGISTRY/courier:0.1.0",
        How::Skip("needs a registry to push to"),
    ),
    (
        "helm install courier charts/courier \\",
        How::Skip(NEEDS_CLUSTER),
    ),
    (
        "kubectl -n courier-system get deploy,pods",
        How::Skip(NEEDS_CHART),
    ),
    (
        "kubectl get mutatingwebhookconfiguration courier",
        How::Skip(NEEDS_CHART),
    ),
    ("kubectl get crd retrypolicies.courier.dev", How::Run),
    (
        "kubectl -n shop create secret generic orders-broker \\",
        How::Run,
    ),
    ("kubectl -n shop apply -f - <<'EOF'", How::Run),
    (
        "kubectl -n shop patch deployment orders --type merge -p '{",
        How::Run,
    ),
    (
        "kubectl -n shop rollout restart deployment orders   # only if the template was unchanged",
        How::Run,
    ),
    (
        "kubectl -n shop rollout status deployment orders",
        How::Skip(NEEDS_CONTROLLER),
    ),
    (
        "kubectl -n shop get pods -l app=orders \\",
        How::Skip(NEEDS_KUBELET),
    ),
    (
        "kubectl -n shop logs deploy/orders -c courier",
        How::Skip(NEEDS_KUBELET),
    ),
    (
        "courier inject --pod deployment.yaml --values my-values.yaml",
        How::Run,
    ),
    (
        "printf 'k1 2026-12-01T00:00:00Z %s\\n' \"$(openssl rand -hex 32)\" > keys",
        How::Run,
    ),
    (
        "kubectl -n shop create secret generic orders-seal --from-file=keys",
        How::Run,
    ),
    (
        "kubectl -n shop patch deployment orders --type merge -p \\",
        How::Run,
    ),
    ("kubectl -n shop get rp", How::Run),
    ("kubectl -n shop edit rp orders", How::Run),
    (
        "helm upgrade courier charts/courier --namespace courier-system --reuse-values \\",
        How::Skip(NEEDS_CLUSTER),
    ),
    (
        "kubectl -n shop exec deploy/orders -c courier -- courier dlq list",
        How::Run,
    ),
    (
        "kubectl label namespace shop courier.dev/injection=enabled",
        How::Skip("the stand-in API server (kmock 0.8) cannot serve Namespace objects by name"),
    ),
    (
        "kubectl -n shop create rolebinding courier-sidecar \\",
        How::Run,
    ),
    (
        "kubectl apply -f charts/courier/crds/retrypolicy.yaml   # first: Helm never upgrades a CRD",
        How::Run,
    ),
    (
        "kubectl -n courier-system rollout status deployment courier-injector",
        How::Skip(NEEDS_CONTROLLER),
    ),
    ("kubectl get deploy -A -o json | jq -r '.items[]", How::Run),
    (
        "kubectl -n shop create secret docker-registry courier-pull \\",
        How::Run,
    ),
    (
        "kubectl -n shop patch serviceaccount default -p '{\"imagePullSecrets\": [{\"name\": \"courier-pull\"}]}'",
        How::Run,
    ),
    (
        "helm uninstall courier --namespace courier-system",
        How::Skip(NEEDS_CLUSTER),
    ),
    // docs/runbook.md
    (
        "kubectl -n NAMESPACE exec deploy/APP -c courier -- courier dlq list",
        How::Run,
    ),
    (
        "kubectl -n NAMESPACE exec deploy/APP -c courier -- courier dlq show ID",
        How::Run,
    ),
    (
        "kubectl -n NAMESPACE exec deploy/APP -c courier -- courier dlq list --filter 'status == 422 && age < duration(\"24h\") && headers[\"x-tenant\"] == \"acme\"'",
        How::Run,
    ),
    (
        "kubectl -n NAMESPACE exec deploy/APP -c courier -- courier dlq replay --all --rate 50",
        How::Run,
    ),
    (
        "kubectl -n NAMESPACE exec deploy/APP -c courier -- courier dlq replay --filter 'status == 422 && headers[\"x-tenant\"] == \"acme\"' --rate 50",
        How::Run,
    ),
    (
        "kubectl -n NAMESPACE exec deploy/APP -c courier -- courier dlq purge --all --yes --why 'INC-123: test orders'",
        How::Run,
    ),
    (
        "echo '[]' | kubectl -n NAMESPACE exec -i deploy/APP -c courier -- courier dlq edit ID --patch - --dry-run",
        How::Run,
    ),
    (
        "kubectl -n NAMESPACE exec -i deploy/APP -c courier -- courier dlq edit ID --patch - --why 'INC-123: tenant header' <<'EOF'",
        How::Run,
    ),
    (
        "kubectl -n NAMESPACE exec deploy/APP -c courier -- courier dlq jobs",
        How::Run,
    ),
    (
        "kubectl -n NAMESPACE exec deploy/APP -c courier -- courier dlq jobs cancel replay-3f9a0c1d --why 'INC-123: wrong filter'",
        How::Skip(JOB_ID),
    ),
    (
        "kubectl -n NAMESPACE exec deploy/APP -c courier -- courier dlq jobs resume replay-3f9a0c1d",
        How::Skip(JOB_ID),
    ),
    (
        "kubectl -n NAMESPACE get events --sort-by=.lastTimestamp | grep -i policy",
        How::Skip(
            "the stand-in serves Events only as events.k8s.io/v1, without the core/v1 view and the server-side columns (REASON, MESSAGE) `kubectl get events` prints; tests/kubernetes/policy_kubectl.rs checks the Event a refused policy records",
        ),
    ),
    (
        "kubectl -n NAMESPACE get events --field-selector involvedObject.kind=RetryPolicy",
        How::Skip(
            "the stand-in serves Events only as events.k8s.io/v1, without the core/v1 view `kubectl get events` reads; tests/kubernetes/policy_kubectl.rs checks the Event a purge records on the RetryPolicy",
        ),
    ),
    (
        "kubectl -n NAMESPACE logs POD -c courier | grep -i policy",
        How::Skip(NEEDS_KUBELET),
    ),
    (
        "kubectl -n NAMESPACE get retrypolicy NAME -o yaml",
        How::Run,
    ),
    (
        "kubectl -n NAMESPACE get deployment APP -o jsonpath='{.spec.template.metadata.annotations.courier\\.dev/policy}'",
        How::Skip(
            "reads the annotation of the user's own Deployment, which the stand-in API server does not have; tests/kubernetes/inject.rs reads courier.dev/policy from pod templates",
        ),
    ),
    (
        "kubectl -n NAMESPACE patch retrypolicy NAME --type merge -p '{\"spec\":{\"paused\":false}}'",
        How::Skip(PAUSED_BY_KUBECTL),
    ),
    (
        "kubectl -n NAMESPACE annotate scaledobject NAME autoscaling.keda.sh/paused=\"true\"",
        How::Skip(NO_KEDA),
    ),
    (
        "kubectl -n NAMESPACE annotate scaledobject NAME autoscaling.keda.sh/paused-",
        How::Skip(NO_KEDA),
    ),
    (
        "kubectl -n NAMESPACE get retrypolicy NAME -o jsonpath='{.spec.pausedReason}'",
        How::Skip(PAUSED_BY_KUBECTL),
    ),
    (
        "kubectl -n NAMESPACE get retrypolicy NAME -o jsonpath='{.spec.pausedUntil}'",
        How::Skip(PAUSED_BY_KUBECTL),
    ),
    (
        "kubectl -n NAMESPACE get retrypolicy NAME -o jsonpath='{.status.conditions[?(@.type==\"Paused\")]}'",
        How::Skip(PAUSED_BY_KUBECTL),
    ),
    (
        "kubectl -n NAMESPACE port-forward POD 9464:9464 &",
        How::Skip(NEEDS_KUBELET),
    ),
    (
        "curl -s localhost:9464/readyz",
        How::Skip(
            "reads through the port-forward above; tests/kubernetes/policy_kubectl.rs and tests/kubernetes/policy_watch.rs check the /readyz reason of a policy the sidecar may not read",
        ),
    ),
    (
        "kubectl -n NAMESPACE logs POD -c courier | grep 'cannot read the RetryPolicy'",
        How::Skip(NEEDS_KUBELET),
    ),
    (
        "kubectl auth can-i list retrypolicies.courier.dev -n NAMESPACE --as system:serviceaccount:NAMESPACE:ACCOUNT",
        How::Skip(
            "needs the API server's authorizer (SubjectAccessReview), which the stand-in does not implement",
        ),
    ),
    (
        "kubectl -n NAMESPACE create rolebinding courier-sidecar --clusterrole courier-sidecar \\",
        How::Skip(
            "ACCOUNT is the pod's service account, known only in a cluster; the same binding from docs/kubernetes.md runs here, and tests/kubernetes/policy_kubectl.rs shows it makes a forbidden policy readable",
        ),
    ),
];

// === Reading the docs ===

/// One command of a fenced `sh` block: continued lines, a quoted string
/// over several lines and a here-document are part of it.
#[derive(Debug, Clone)]
struct DocCommand {
    doc: &'static str,
    line: usize,
    text: String,
}

impl DocCommand {
    fn first_line(&self) -> &str {
        self.text.lines().next().unwrap_or_default()
    }

    fn how(&self) -> Option<How> {
        CLASSIFIED
            .iter()
            .find(|(first, _)| *first == self.first_line())
            .map(|(_, how)| *how)
    }
}

/// The commands of the fenced `sh` (or `bash`, `shell`) blocks of `doc`.
fn doc_commands(doc: &'static str) -> Vec<DocCommand> {
    let text = std::fs::read_to_string(root().join(doc)).unwrap();
    let mut commands = Vec::new();
    let mut fence: Option<(String, bool)> = None;
    let mut current: Option<DocCommand> = None;
    let mut heredoc: Option<String> = None;
    for (n, raw) in text.lines().enumerate() {
        let trimmed = raw.trim_start();
        if let Some(rest) = trimmed.strip_prefix("```") {
            fence = match fence {
                Some(_) => None,
                None => {
                    let indent = raw.len() - trimmed.len();
                    let shell = matches!(rest.trim(), "sh" | "bash" | "shell");
                    Some((" ".repeat(indent), shell))
                }
            };
            continue;
        }
        let Some((indent, true)) = &fence else {
            continue;
        };
        let line = raw.strip_prefix(indent.as_str()).unwrap_or(raw);
        if let Some(command) = current.as_mut() {
            command.text.push('\n');
            command.text.push_str(line);
        } else {
            if line.trim().is_empty() || line.trim_start().starts_with('#') {
                continue;
            }
            current = Some(DocCommand {
                doc,
                line: n + 1,
                text: line.to_string(),
            });
            if let Some((_, word)) = line.split_once("<<") {
                heredoc = Some(word.trim().trim_matches('\'').trim_matches('"').to_string());
            }
        }
        let open = match &heredoc {
            Some(end) => line.trim() != end || current.as_ref().unwrap().text == line,
            None => {
                let text = &current.as_ref().unwrap().text;
                line.ends_with('\\') || line.trim_end().ends_with('|') || quotes_open(text)
            }
        };
        if !open {
            heredoc = None;
            commands.push(current.take().unwrap());
        }
    }
    assert!(
        current.is_none(),
        "{doc}: a shell block ends inside a command"
    );
    commands
}

/// Whether a single- or double-quoted string is still open at the end of
/// `text` (the shell's rule, without escapes inside single quotes).
fn quotes_open(text: &str) -> bool {
    let mut quote = None;
    let mut escaped = false;
    for c in text.chars() {
        match (quote, c) {
            (_, _) if escaped => escaped = false,
            (None | Some('"'), '\\') => escaped = true,
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            _ => {}
        }
    }
    quote.is_some()
}

fn all_commands() -> Vec<DocCommand> {
    DOCS.into_iter().flat_map(doc_commands).collect()
}

#[test]
fn every_doc_command_is_classified() {
    let commands = all_commands();
    assert!(commands.len() >= 30, "the docs' commands: {commands:#?}");
    let unclassified: Vec<String> = commands
        .iter()
        .filter(|c| c.how().is_none())
        .map(|c| format!("{}:{}: {}", c.doc, c.line, c.first_line()))
        .collect();
    assert!(
        unclassified.is_empty(),
        "these doc commands are neither run nor skipped with a reason: add each \
         (by its first line) to CLASSIFIED in tests/commands/doc_commands.rs, as How::Run \
         with a check in World::check, or as How::Skip with why it cannot run here:\n{}",
        unclassified.join("\n")
    );
    let firsts: BTreeSet<&str> = commands.iter().map(DocCommand::first_line).collect();
    let stale: Vec<&str> = CLASSIFIED
        .iter()
        .map(|(first, _)| *first)
        .filter(|first| !firsts.contains(first))
        .collect();
    assert!(
        stale.is_empty(),
        "CLASSIFIED names commands no doc has any more; remove them: {stale:#?}"
    );
}

#[test]
fn commands_are_read_whole() {
    let commands = all_commands();
    let find = |first: &str| {
        commands
            .iter()
            .find(|c| c.first_line() == first)
            .unwrap_or_else(|| panic!("no command {first:?}"))
    };
    let heredoc = find("kubectl -n shop apply -f - <<'EOF'");
    assert!(heredoc.text.ends_with("\nEOF"), "{}", heredoc.text);
    assert!(heredoc.text.contains("maxAttempts: 5"));
    let quoted = find("kubectl -n shop patch deployment orders --type merge -p '{");
    assert!(quoted.text.ends_with("}}}}}'"), "{}", quoted.text);
    let piped = find("kubectl get deploy -A -o json | jq -r '.items[]");
    assert!(piped.text.ends_with("done"), "{}", piped.text);
    let indented = find("kubectl -n shop create rolebinding courier-sidecar \\");
    assert!(
        indented.text.contains("\n  --clusterrole"),
        "{}",
        indented.text
    );
}

// === The world the commands run in ===

/// The stand-in API server with the cluster the walkthrough assumes: the
/// namespace `shop` with its `default` service account, the CRD the chart
/// installs, and the app's Deployment before it opted in (plus one in
/// another namespace that never does); a directory with the files the
/// walkthrough names; and a `kubectl` in front of the real one
/// ([`World::sidecar_is`]).
struct World {
    stub: KubeStub,
    dir: tempfile::TempDir,
    kubectl: String,
}

impl World {
    fn start() -> Self {
        // A real cluster's default namespace: a command that forgets its
        // `-n` does not land in shop here either.
        let stub = KubeStub::start("default");
        let dir = tempfile::tempdir().unwrap();
        let kubectl = String::from_utf8(
            Command::new("sh")
                .args(["-c", "command -v kubectl"])
                .output()
                .unwrap()
                .stdout,
        )
        .unwrap()
        .trim()
        .to_string();
        assert!(!kubectl.is_empty(), "kubectl is not on PATH");
        std::fs::create_dir(dir.path().join("bin")).unwrap();
        // The walkthrough's files, and the repository's charts/ where the
        // upgrade section expects them.
        std::fs::copy(
            root().join("tests/fixtures/inject/deployment.yaml"),
            dir.path().join("deployment.yaml"),
        )
        .unwrap();
        std::fs::copy(
            root().join("tests/fixtures/helm/walkthrough-values.yaml"),
            dir.path().join("my-values.yaml"),
        )
        .unwrap();
        std::os::unix::fs::symlink(root().join("charts"), dir.path().join("charts")).unwrap();
        let world = Self { stub, dir, kubectl };
        world.stub.apply(
            "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: default\n  namespace: shop\n",
        );
        // The app before it opted in: the fixture without courier's label
        // and annotations.
        let before: String = std::fs::read_to_string(world.path("deployment.yaml"))
            .unwrap()
            .lines()
            .filter(|l| !l.contains("courier.dev/"))
            .map(|l| format!("{l}\n"))
            .collect();
        world.stub.apply(&before);
        world.stub.apply(
            &before
                .replace("name: orders", "name: ledger")
                .replace("namespace: shop", "namespace: billing"),
        );
        world
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The `kubectl` the commands find first on PATH: `exec` into the
    /// courier container runs the command here, in the environment the
    /// injector gives that container for `fixture`; anything else is the
    /// real kubectl.
    fn sidecar_is(&self, fixture: &Fixture) {
        let courier_dir = Path::new(COURIER_BIN).parent().unwrap();
        let script = format!(
            r#"#!/bin/sh
# kubectl in front of the real one (tests/commands/doc_commands.rs): the stand-in
# API server has no kubelet.
case " $* " in
*" exec "*)
  case " $* " in *" -c courier "*) ;; *) echo "kubectl exec without -c courier: $*" >&2; exit 1 ;; esac
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do shift; done
  shift
  exec env -i PATH='{courier_dir}:/usr/bin:/bin' NO_COLOR=1 COURIER_SOURCE='{source}' COURIER_QUEUE='{queue}' {aws} "$@" ;;
# kubectl's generators send protobuf, which the stand-in does not read:
# the same object, generated by kubectl, is sent as JSON.
*" create secret "*|*" create rolebinding "*)
  '{kubectl}' "$@" --dry-run=client -o json | '{kubectl}' create -f -
  exit ;;
esac
exec '{kubectl}' "$@"
"#,
            courier_dir = courier_dir.display(),
            // SQS credentials and endpoint, the Pub/Sub emulator: a pod's
            // come from its own environment (IRSA, Workload Identity, a
            // Secret), here from the test's moto and emulator.
            aws = std::env::vars()
                .filter(|(name, _)| name.starts_with("AWS_") || name == "PUBSUB_EMULATOR_HOST")
                .map(|(name, value)| format!("{name}='{value}'"))
                .collect::<Vec<_>>()
                .join(" "),
            source = fixture.source_arg(),
            queue = fixture.queue,
            kubectl = self.kubectl,
        );
        let shim = self.path("bin/kubectl");
        std::fs::write(&shim, script).unwrap();
        std::fs::set_permissions(&shim, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
    }

    /// Runs `command` as the operator's shell would, placeholders filled.
    fn run(&self, command: &DocCommand, id: &str) -> Output {
        let text = fill(
            &command.text,
            &[
                ("NAMESPACE", "shop"),
                ("APP", "orders"),
                ("NAME", "orders"),
                ("ID", id),
            ],
        );
        let courier_dir = Path::new(COURIER_BIN).parent().unwrap();
        let path = format!(
            "{}:{}:{}",
            self.path("bin").display(),
            courier_dir.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let editor = self.path("editor.sh");
        std::fs::write(
            &editor,
            "#!/bin/sh\nexec sed -i 's/maxAttempts: 5/maxAttempts: 6/' \"$1\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&editor, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let mut shell = Command::new("bash");
        shell
            .args(["-e", "-o", "pipefail", "-c", &text])
            .current_dir(self.dir.path())
            .env("PATH", path)
            .env("KUBECONFIG", self.stub.kubeconfig())
            .env("KUBE_EDITOR", &editor)
            .env("NO_COLOR", "1");
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("COURIER_") {
                shell.env_remove(name);
            }
        }
        let out = shell.output().expect("run bash");
        assert!(
            out.status.success(),
            "{}:{} fails as written (exit {:?}):\n{text}\nstdout: {}\nstderr: {}",
            command.doc,
            command.line,
            out.status.code(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }
}

/// `text` with each placeholder replaced where it stands as a word of its
/// own (`NAMESPACE`, not the `NAMESPACE` of `MONITORING_NAMESPACE`).
fn fill(text: &str, values: &[(&str, &str)]) -> String {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::new();
    let mut rest = text;
    'scan: while !rest.is_empty() {
        let before = out.chars().last();
        if before.is_none_or(|c| !word(c)) {
            for (name, value) in values {
                if let Some(after) = rest.strip_prefix(name)
                    && after.chars().next().is_none_or(|c| !word(c))
                {
                    out.push_str(value);
                    rest = after;
                    continue 'scan;
                }
            }
        }
        let c = rest.chars().next().unwrap();
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

#[test]
fn placeholders_are_filled_as_words() {
    assert_eq!(
        fill(
            "kubectl -n NAMESPACE exec deploy/APP -- show ID # MONITORING_NAMESPACE NAMES",
            &[("NAMESPACE", "shop"), ("APP", "orders"), ("ID", "1-0")]
        ),
        "kubectl -n shop exec deploy/orders -- show 1-0 # MONITORING_NAMESPACE NAMES"
    );
}

// === Running them ===

/// The dead letters of `fixture`'s queue, ids oldest first.
async fn dead_letter_ids(fixture: &Fixture) -> Vec<String> {
    let source = fixture.open().await;
    let ids = fixture
        .dead_letters(&source)
        .await
        .into_iter()
        .map(|l| l.id)
        .collect();
    release(fixture, source).await;
    ids
}

/// At least `n` dead letters on `fixture`'s queue, made the way they are
/// made in production: a sidecar delivers messages the app refuses (400).
/// Messages a replay put back are refused again meanwhile.
async fn dead_letters_at_least(fixture: &Fixture, n: usize) -> Vec<String> {
    let have = dead_letter_ids(fixture).await;
    if have.len() >= n {
        return have;
    }
    let producer = fixture.producer().await;
    for _ in have.len()..n {
        producer
            .send(Bytes::from(format!("script:400\n{}", unique("doc"))), &[])
            .await;
    }
    producer.release(fixture).await;
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let running = Running::start(run_config(fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    release(fixture, source).await;
    let ids = dead_letter_ids(fixture).await;
    assert!(ids.len() >= n, "{ids:?}");
    ids
}

/// The kinds of dead letter the runbook's `--filter` commands tell apart:
/// the one they select (the app answered 422 for the tenant acme) and two
/// that differ from it by the status or by the header.
const FILTER_KINDS: [(&str, &str); 3] = [("422", "acme"), ("422", "globex"), ("400", "acme")];

/// The ids of `fixture`'s dead letters of each of [`FILTER_KINDS`].
async fn ids_by_filter_kind(fixture: &Fixture) -> [Vec<String>; 3] {
    let source = fixture.open().await;
    let letters = fixture.dead_letters(&source).await;
    release(fixture, source).await;
    FILTER_KINDS.map(|(status, tenant)| {
        letters
            .iter()
            .filter(|l| l.field("courier-status") == Some(status))
            .filter(|l| l.field("x-tenant") == Some(tenant))
            .map(|l| l.id.clone())
            .collect()
    })
}

/// At least one dead letter of each of [`FILTER_KINDS`], made by a sidecar
/// as [`dead_letters_at_least`] makes them.
async fn dead_letters_of_each_filter_kind(fixture: &Fixture) {
    let have = ids_by_filter_kind(fixture).await;
    if have.iter().all(|ids| !ids.is_empty()) {
        return;
    }
    let producer = fixture.producer().await;
    for ((status, tenant), _) in FILTER_KINDS
        .iter()
        .zip(&have)
        .filter(|(_, ids)| ids.is_empty())
    {
        producer
            .send(
                Bytes::from(format!("script:{status}\n{}", unique("doc"))),
                &[("x-tenant".to_string(), tenant.to_string())],
            )
            .await;
    }
    producer.release(fixture).await;
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let running = Running::start(run_config(fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    release(fixture, source).await;
    let have = ids_by_filter_kind(fixture).await;
    assert!(have.iter().all(|ids| !ids.is_empty()), "{have:?}");
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

impl World {
    /// Prepares what `command` works on; returns the dead letter id for `ID`.
    async fn before(&self, command: &DocCommand, fixture: &Fixture) -> String {
        let text = &command.text;
        if text.contains("courier dlq") && text.contains("--filter") {
            dead_letters_of_each_filter_kind(fixture).await;
        } else if text.contains("courier dlq list") {
            dead_letters_at_least(fixture, 2).await;
        } else if text.contains("courier dlq") {
            return dead_letters_at_least(fixture, 1).await.remove(0);
        } else if text.contains("rollout restart deployment \"$name\"") {
            // Restarted earlier in the walkthrough: start from no mark.
            self.stub.kubectl_ok(&[
                "-n",
                "shop",
                "patch",
                "deployment",
                "orders",
                "--type",
                "json",
                "-p",
                r#"[{"op": "remove", "path": "/spec/template/metadata/annotations/kubectl.kubernetes.io~1restartedAt"}]"#,
            ]);
        }
        String::new()
    }

    /// What the operator should now see, checked.
    async fn check(&self, command: &DocCommand, fixture: &Fixture, out: &Output, id: &str) {
        let stdout = text(&out.stdout);
        let text = command.text.as_str();
        let restarted = |ns: &str, name: &str| {
            self.stub.json(&["-n", ns, "get", "deployment", name])["spec"]["template"]["metadata"]
                ["annotations"]["kubectl.kubernetes.io/restartedAt"]
                .is_string()
        };
        if text.contains("courier dlq list") && text.contains("--filter") {
            let [selected, ..] = ids_by_filter_kind(fixture).await;
            let listed: Vec<&str> = stdout
                .lines()
                .skip(1)
                .filter_map(|l| l.split_whitespace().next())
                .collect();
            assert_eq!(listed, selected, "{stdout}");
        } else if text.contains("courier dlq replay") && text.contains("--filter") {
            let [selected, other_tenant, other_status] = ids_by_filter_kind(fixture).await;
            assert!(selected.is_empty(), "{selected:?} left: {stdout}");
            assert!(
                !other_tenant.is_empty() && !other_status.is_empty(),
                "the filter replayed only what it says: {stdout}"
            );
        } else if text.contains("courier dlq list") {
            let letters = dead_letter_ids(fixture).await;
            assert_eq!(stdout.lines().count(), letters.len() + 1, "{stdout}");
            assert!(
                stdout.lines().next().unwrap().contains("REASON"),
                "{stdout}"
            );
            assert!(stdout.contains(&letters[0]), "{stdout}");
        } else if text.contains("courier dlq show") {
            assert!(
                stdout.contains(id) && stdout.contains("permanent-status"),
                "{stdout}"
            );
        } else if text.contains("courier dlq edit") && text.contains("--dry-run") {
            let document: Value = serde_json::from_str(&stdout).expect("the document is JSON");
            assert!(
                document["headers"].is_object() && document.get("body").is_some(),
                "{stdout}"
            );
            assert!(
                dead_letter_ids(fixture).await.iter().any(|l| l == id),
                "a dry run leaves the letter: {stdout}"
            );
        } else if text.contains("courier dlq edit") {
            assert!(
                stdout.contains(&format!("replayed {id} edited")),
                "{stdout}"
            );
            assert!(
                !dead_letter_ids(fixture).await.iter().any(|l| l == id),
                "the edited letter was replayed: {stdout}"
            );
        } else if text.ends_with("courier dlq jobs") {
            // The runbook's replays and purge ran before, each a job.
            assert!(
                stdout.lines().next().is_some_and(|l| l.contains("STATE")),
                "{stdout}"
            );
            assert!(
                stdout
                    .lines()
                    .skip(1)
                    .any(|l| l.starts_with("purge-") && l.contains(" done ")),
                "{stdout}"
            );
        } else if text.contains("courier dlq replay") || text.contains("courier dlq purge") {
            assert_eq!(
                dead_letter_ids(fixture).await,
                Vec::<String>::new(),
                "{stdout}"
            );
        } else if text.starts_with("kubectl get crd") || text.starts_with("kubectl apply -f charts")
        {
            assert!(stdout.contains("retrypolicies.courier.dev"), "{stdout}");
        } else if text.ends_with("> keys") {
            let keys = self.path("keys");
            courier::source::Seal::from_keys_file(&keys, Duration::from_secs(3600))
                .unwrap_or_else(|e| panic!("the doc's keys file is refused: {e}"));
        } else if text.contains("create secret generic orders-seal") {
            let secret = self
                .stub
                .json(&["-n", "shop", "get", "secret", "orders-seal"]);
            let keys = base64::Engine::decode(
                &base64::engine::general_purpose::STANDARD,
                secret["data"]["keys"].as_str().unwrap(),
            )
            .unwrap();
            assert_eq!(
                text_of(&keys),
                std::fs::read_to_string(self.path("keys")).unwrap()
            );
        } else if text.contains("courier.dev/seal-keys-secret") {
            let deployment = self
                .stub
                .json(&["-n", "shop", "get", "deployment", "orders"]);
            assert_eq!(
                deployment["spec"]["template"]["metadata"]["annotations"]["courier.dev/seal-keys-secret"],
                "orders-seal"
            );
        } else if text.contains("create secret generic orders-broker") {
            let secret = self
                .stub
                .json(&["-n", "shop", "get", "secret", "orders-broker"]);
            let url = base64::Engine::decode(
                &base64::engine::general_purpose::STANDARD,
                secret["data"]["url"].as_str().unwrap(),
            )
            .unwrap();
            assert_eq!(text_of(&url), "redis://:PASSWORD@redis.shop.svc:6379/0");
        } else if text.contains("apply -f - <<'EOF'") {
            let policy = self
                .stub
                .json(&["-n", "shop", "get", "retrypolicy", "orders"]);
            assert_eq!(policy["spec"]["maxAttempts"], 5);
            assert_eq!(policy["spec"]["backoff"]["jitter"], "full");
        } else if text.contains("patch deployment orders") {
            let template = &self
                .stub
                .json(&["-n", "shop", "get", "deployment", "orders"])["spec"]["template"]["metadata"];
            assert_eq!(template["labels"]["courier.dev/inject"], "true");
            assert_eq!(template["labels"]["app"], "orders");
            assert_eq!(template["annotations"]["courier.dev/queue"], "{orders}");
            assert_eq!(template["annotations"]["courier.dev/policy"], "orders");
        } else if text.contains("rollout restart deployment \"$name\"") {
            assert!(
                restarted("shop", "orders"),
                "the labelled Deployment restarted"
            );
            assert!(
                !restarted("billing", "ledger"),
                "an unlabelled one left alone"
            );
        } else if text.contains("rollout restart deployment orders") {
            assert!(restarted("shop", "orders"));
        } else if text.starts_with("courier inject --pod") {
            let pod: Value = serde_saphyr::from_str(&stdout).expect("the preview is YAML");
            let spec = &pod["spec"]["template"]["spec"];
            assert_eq!(spec["initContainers"][0]["name"], "courier", "{stdout}");
            assert_eq!(spec["initContainers"][0]["restartPolicy"], "Always");
            assert!(
                spec["initContainers"][0]["image"]
                    .as_str()
                    .unwrap()
                    .starts_with("registry.example/platform/courier:"),
                "the image of my-values.yaml: {stdout}"
            );
        } else if text == "kubectl -n shop get rp" {
            assert!(stdout.contains("orders"), "{stdout}");
        } else if text.contains("edit rp orders") {
            let policy = self
                .stub
                .json(&["-n", "shop", "get", "retrypolicy", "orders"]);
            assert_eq!(policy["spec"]["maxAttempts"], 6, "the edit was saved");
        } else if text.contains("create rolebinding courier-sidecar") {
            let binding = self
                .stub
                .json(&["-n", "shop", "get", "rolebinding", "courier-sidecar"]);
            assert_eq!(binding["roleRef"]["kind"], "ClusterRole");
            assert_eq!(binding["roleRef"]["name"], "courier-sidecar");
            assert_eq!(binding["subjects"][0]["kind"], "ServiceAccount");
            assert_eq!(binding["subjects"][0]["name"], "default");
            assert_eq!(binding["subjects"][0]["namespace"], "shop");
        } else if text.contains("create secret docker-registry courier-pull") {
            let secret = self
                .stub
                .json(&["-n", "shop", "get", "secret", "courier-pull"]);
            assert_eq!(secret["type"], "kubernetes.io/dockerconfigjson");
        } else if text.contains("patch serviceaccount default") {
            let account = self
                .stub
                .json(&["-n", "shop", "get", "serviceaccount", "default"]);
            assert_eq!(account["imagePullSecrets"][0]["name"], "courier-pull");
        } else if text.contains("get retrypolicy NAME -o yaml") {
            assert!(
                stdout.contains("kind: RetryPolicy") && stdout.contains("name: orders"),
                "{stdout}"
            );
        } else {
            panic!(
                "{}:{}: no check for this command; add one to World::check",
                command.doc, command.line
            );
        }
    }
}

fn text_of(bytes: &[u8]) -> String {
    text(bytes)
}

fn runnable() -> Vec<DocCommand> {
    all_commands()
        .into_iter()
        .filter(|c| c.how() == Some(How::Run))
        .collect()
}

/// The walkthrough, upgrade, pull-secret and runbook commands in the order
/// the docs give them, on Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_docs_commands_run_as_written() {
    let world = World::start();
    let fixture = Fixture::redis();
    world.sidecar_is(&fixture);
    let commands = runnable();
    assert!(commands.len() >= 15, "{commands:#?}");
    for command in &commands {
        let id = world.before(command, &fixture).await;
        let out = world.run(command, &id);
        world.check(command, &fixture, &out, &id).await;
    }
}

/// The dead-letter commands, run in the sidecar, on every other broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letter_commands_run_on_every_broker() {
    let world = World::start();
    for kind in BrokerKind::ALL {
        if kind == BrokerKind::Redis {
            continue;
        }
        let fixture = kind.fixture();
        world.sidecar_is(&fixture);
        for command in runnable().iter().filter(|c| c.text.contains(" exec ")) {
            let id = world.before(command, &fixture).await;
            let out = world.run(command, &id);
            world.check(command, &fixture, &out, &id).await;
        }
    }
}

/// One minimum Kubernetes version: the chart's `kubeVersion`, the API
/// client's `k8s-openapi` feature and every doc that names it.
#[test]
fn one_minimum_kubernetes_version() {
    let read = |p: &str| std::fs::read_to_string(root().join(p)).unwrap();
    let chart = read("charts/courier/Chart.yaml");
    let minimum = chart
        .lines()
        .find_map(|l| l.strip_prefix("kubeVersion: \">="))
        .and_then(|v| v.strip_suffix(".0-0\""))
        .expect("Chart.yaml has kubeVersion: \">=1.NN.0-0\"");
    let feature = format!("\"v{}\"", minimum.replace('.', "_"));
    assert!(
        read("Cargo.toml")
            .lines()
            .any(|l| l.starts_with("k8s-openapi") && l.contains(&feature)),
        "Cargo.toml's k8s-openapi feature is not {feature}"
    );
    for (doc, says) in [
        (
            "docs/kubernetes.md",
            format!("You need Kubernetes {minimum} or newer"),
        ),
        (
            "docs/policy.md",
            format!("the oldest Kubernetes supported is {minimum}"),
        ),
    ] {
        assert!(read(doc).contains(&says), "{doc} does not say {says:?}");
    }
    for doc in ["docs/kubernetes.md", "docs/policy.md", "README.md"] {
        let text = read(doc);
        for (at, _) in text.match_indices("Kubernetes 1.") {
            let version: String = text[at + "Kubernetes ".len()..]
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            assert_eq!(
                version.trim_end_matches('.'),
                minimum,
                "{doc} names another Kubernetes version"
            );
        }
    }
}
