//! The stand-in Kubernetes API server (`scripts/kube-stub`: kmock plus
//! what kubectl and the watcher need) and `kubectl` against it, for the
//! tests that run real `kubectl` commands (`tests/kubernetes/policy_kubectl.rs`,
//! `tests/commands/doc_commands.rs`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use serde_json::Value;

use super::root;

/// `scripts/kube-stub` on a free port, and a kubeconfig pointing at it.
/// Stopped (by its process id) when dropped.
pub struct KubeStub {
    child: Option<Child>,
    port: u16,
    pub dir: tempfile::TempDir,
    /// Started with `--rbac`: the sidecar is the service account
    /// `NAMESPACE:default` and reads policies only where a RoleBinding lets it.
    rbac: bool,
}

/// Starts the server on `port` (0: any free one) and returns it with the
/// port it listens on.
fn spawn_stub(port: u16, rbac: bool) -> (Child, u16) {
    let mut child = Command::new(root().join("scripts/kube-stub"))
        .args(["--port", &port.to_string()])
        .args(rbac.then_some("--rbac"))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start scripts/kube-stub");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .expect("read the stub's first line");
    let port: u16 = line
        .strip_prefix("READY ")
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("scripts/kube-stub did not start: {line:?}"));
    (child, port)
}

impl KubeStub {
    /// Starts it with `namespace` as the kubeconfig's default namespace.
    pub fn start(namespace: &str) -> Self {
        let stub = Self::start_bare(namespace, false);
        stub.install_crd();
        stub
    }

    /// Without the CRD, and with `--rbac` when asked.
    pub fn start_bare(namespace: &str, rbac: bool) -> Self {
        let (child, port) = spawn_stub(0, rbac);
        let dir = tempfile::tempdir().unwrap();
        let config = |user: &str| {
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: stub\n  cluster:\n    server: http://127.0.0.1:{port}\ncontexts:\n- name: stub\n  context:\n    cluster: stub\n    namespace: {namespace}\n{user}current-context: stub\n"
            )
        };
        std::fs::write(dir.path().join("kubeconfig"), config("") + "users: []\n").unwrap();
        // The token the stub's --rbac reads as the service account NAMESPACE:default.
        let sidecar = config("    user: sidecar\n")
            + &format!("users:\n- name: sidecar\n  user:\n    token: sa:{namespace}:default\n");
        std::fs::write(dir.path().join("sidecar-kubeconfig"), sidecar).unwrap();
        Self {
            child: Some(child),
            port,
            dir,
            rbac,
        }
    }

    pub fn install_crd(&self) {
        self.kubectl_ok(&[
            "apply",
            "-f",
            root().join("crds/retrypolicy.yaml").to_str().unwrap(),
        ]);
    }

    /// An API outage: the server stops, by its process id.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The server comes back on the same address, empty, as after a
    /// restore; the CRD is installed again.
    pub fn restart(&mut self) {
        self.stop();
        self.child = Some(spawn_stub(self.port, self.rbac).0);
        self.install_crd();
    }

    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    /// What the sidecar connects with: as the service account under
    /// `--rbac`, else as the admin kubectl is.
    pub fn sidecar_kubeconfig(&self) -> PathBuf {
        match self.rbac {
            true => self.dir.path().join("sidecar-kubeconfig"),
            false => self.kubeconfig(),
        }
    }

    pub fn kubectl(&self, args: &[&str], editor: Option<&Path>) -> Output {
        let mut command = Command::new("kubectl");
        command.args(args).env("KUBECONFIG", self.kubeconfig());
        if let Some(editor) = editor {
            command.env("EDITOR", editor).env("KUBE_EDITOR", editor);
        }
        command.output().expect("run kubectl (is it on PATH?)")
    }

    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args, None);
        assert!(
            out.status.success(),
            "kubectl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// `kubectl apply` of a document given as text.
    pub fn apply(&self, yaml: &str) {
        let path = self.dir.path().join("apply.yaml");
        std::fs::write(&path, yaml).unwrap();
        self.kubectl_ok(&["apply", "-f", path.to_str().unwrap()]);
    }

    /// `kubectl edit rp NAME` with an editor script that runs `sed
    /// expression` on the file kubectl opens.
    pub fn edit(&self, name: &str, expression: &str) {
        let editor = self.dir.path().join("editor.sh");
        std::fs::write(
            &editor,
            format!("#!/bin/sh\nexec sed -i '{expression}' \"$1\"\n"),
        )
        .unwrap();
        std::fs::set_permissions(&editor, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let out = self.kubectl(&["edit", "retrypolicy", name], Some(&editor));
        assert!(
            out.status.success(),
            "kubectl edit failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn json(&self, args: &[&str]) -> Value {
        let mut args = args.to_vec();
        args.extend(["-o", "json"]);
        serde_json::from_str(&self.kubectl_ok(&args)).unwrap()
    }
}

impl Drop for KubeStub {
    fn drop(&mut self) {
        self.stop();
    }
}
