//! The walls between courier's modules, read from the source: every
//! `crate::<module>` and `courier_core::<module>` a file of `src/` or
//! `crates/` names must be an edge the architecture allows
//! (docs/architecture.md draws the picture). A forbidden edge fails with
//! the file, the edge and the text that made it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Who may name whom. A module is a top-level module of `src/` or of
/// `crates/core/src/`, and each broker crate `crates/<broker>` is the
/// module `source/<broker>`, so that
/// "inject never reaches a broker" and "brokers do not reach each other"
/// can be said. `cmd`, `lib` and `main` assemble everything and may name
/// anything.
fn allowed(from: &str) -> Option<&'static [&'static str]> {
    Some(match from {
        // The leaves: the shared vocabulary, durations, and metrics.
        "model" | "duration" | "telemetry" => &[],
        // The decision is pure: no source, no HTTP, no dispatcher.
        "policy" => &["model", "duration", "expr"],
        // The HTTP client knows messages, not brokers.
        "forward" => &["model"],
        // The subscriptions document: a form, checked by the injector and
        // by `courier run` alike (the `_` arm gives it no imports).
        // The dead-letter expressions: a letter in, a verdict out; the
        // CloudEvents binding says which headers are an event's.
        "expr" => &["model", "forward"],
        // The trait and the broker table, and the shared broker helpers.
        "source" => &["model", "source/*"],
        // A broker knows the trait and the model, no HTTP, no policy.
        b if b.starts_with("source/") => &["model", "source", "duration"],
        // The one join.
        "dispatch" => &[
            "model",
            "policy",
            "forward",
            "source",
            "telemetry",
            "duration",
        ],
        // Wires the pipeline for `courier run` and the demo.
        "sidecar" => &[
            "model",
            "policy",
            "forward",
            "source",
            "telemetry",
            "dispatch",
            "duration",
        ],
        // The webhook: its own settings; which URL schemes exist comes from
        // the broker table, never from a broker module.
        "inject" => &["duration", "telemetry", "source", "model", "subscriptions"],
        "cmd" | "lib" | "main" => return None,
        _ => return Some(&[]),
    })
}

fn permits(from: &str, to: &str) -> bool {
    if from == to {
        return true;
    }
    match allowed(from) {
        None => true,
        Some(list) => list
            .iter()
            .any(|a| *a == to || (a.ends_with("/*") && to.starts_with(&a[..a.len() - 1]))),
    }
}

/// Where a file sits: `src/dispatch/mod.rs` → `dispatch`,
/// `crates/core/crates/core/src/model/mod.rs` → `model`, `crates/redis/src/read.rs` →
/// `source/redis` (each broker is a crate of its own).
fn module_of(root: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(root).unwrap();
    let parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    match parts.as_slice() {
        [crates, krate, _src, rest @ ..] if crates == "crates" && krate == "core" => {
            rest.first().cloned().unwrap_or_default()
        }
        [crates, broker, ..] if crates == "crates" => format!("source/{broker}"),
        [_src, first, ..] => first.clone(),
        _ => unreachable!("{rel:?}"),
    }
}

/// The module a path names: `crate::source::redis::X` → `source/redis`,
/// `courier_core::source::Source` → `source`.
fn target_of(path: &str, brokers: &BTreeSet<String>) -> String {
    let path = path
        .strip_prefix("crate::")
        .or_else(|| path.strip_prefix("courier_core::"))
        .unwrap_or(path);
    let mut segments = path.split("::").map(str::trim);
    let first = segments.next().unwrap_or_default().to_string();
    if first == "source"
        && let Some(second) = segments.next()
        && brokers.contains(second)
    {
        return format!("source/{second}");
    }
    first
}

/// Every path into courier that `text` names outside comments: `crate::...`
/// (except in a broker crate, where `crate` is the broker itself) and
/// `courier_core::...`, with `use crate::{a, b::c}` groups expanded to
/// their top-level names.
fn crate_paths(from: &str, text: &str) -> Vec<String> {
    let mut paths = Vec::new();
    if !from.starts_with("source/") {
        paths.extend(paths_after("crate::", text));
    }
    paths.extend(paths_after("courier_core::", text));
    paths
}

fn paths_after(prefix: &str, text: &str) -> Vec<String> {
    let code: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut paths = Vec::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find(prefix) {
        let before = rest[..at].chars().last();
        rest = &rest[at + prefix.len()..];
        // `courier::...` or `my_crate::...` are not this crate's paths.
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut end = 0;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if depth == 0 {
                    end = i;
                    break;
                }
            }
            let inner = &group[..end];
            let mut depth = 0;
            let mut item = String::new();
            for c in inner.chars().chain(std::iter::once(',')) {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        if !item.trim().is_empty() {
                            paths.push(format!("{prefix}{}", item.trim()));
                        }
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
        } else {
            let path: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            paths.push(format!("{prefix}{path}"));
        }
    }
    paths
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The broker crates: every crate of `crates/` but `core`.
fn broker_crates(root: &Path) -> BTreeSet<String> {
    std::fs::read_dir(root.join("crates"))
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            (e.path().is_dir() && name != "core").then_some(name)
        })
        .collect()
}

/// The source files of courier: the main crate's and every crate's of
/// `crates/`.
fn courier_files(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    for krate in std::fs::read_dir(root.join("crates")).unwrap() {
        rust_files(&krate.unwrap().path().join("src"), &mut files);
    }
    files
}

/// Every forbidden edge in `text`, a file of module `from`.
fn violations(from: &str, text: &str, brokers: &BTreeSet<String>) -> Vec<String> {
    crate_paths(from, text)
        .into_iter()
        .filter_map(|path| {
            let to = target_of(&path, brokers);
            (!permits(from, &to)).then(|| format!("{from} → {to} ({path})"))
        })
        .collect()
}

#[test]
fn the_walls_hold() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let brokers = broker_crates(root);
    assert!(
        brokers.contains("redis") && brokers.contains("embedded"),
        "{brokers:?}"
    );
    let mut found = Vec::new();
    for file in &courier_files(root) {
        let from = module_of(root, file);
        let text = std::fs::read_to_string(file).unwrap();
        for v in violations(&from, &text, &brokers) {
            found.push(format!(
                "{}: {v}",
                file.strip_prefix(root).unwrap().display()
            ));
        }
    }
    assert!(
        found.is_empty(),
        "forbidden edges (docs/architecture.md says who may import whom):\n{}",
        found.join("\n")
    );
}

#[test]
fn a_forbidden_edge_is_found_and_named() {
    let brokers: BTreeSet<String> = ["redis".to_string(), "amqp".to_string()].into();
    let policy = "use crate::model::Outcome;\nuse crate::forward::Forwarder;\n";
    assert_eq!(
        violations("policy", policy, &brokers),
        ["policy → forward (crate::forward::Forwarder)"]
    );
    let inject = "use crate::{duration, source::amqp::check_url};\n";
    assert_eq!(
        violations("inject", inject, &brokers),
        ["inject → source/amqp (crate::source::amqp::check_url)"]
    );
    let telemetry = "fn f(c: crate::model::Class) {}\n// crate::policy::Class in a comment\n";
    assert_eq!(
        violations("telemetry", telemetry, &brokers),
        ["telemetry → model (crate::model::Class)"]
    );
    // In a broker crate `crate::` is the broker itself; courier_core is
    // the shared part.
    let redis = "use crate::read::Reader;\nuse courier_core::source::shared::RECEIVE_WAIT;\n";
    assert!(violations("source/redis", redis, &brokers).is_empty());
    let core_model = "use courier_core::source::Source;\nfn f(_: crate::source::Depth) {}\n";
    assert_eq!(
        violations("model", core_model, &brokers),
        [
            "model → source (crate::source::Depth)",
            "model → source (courier_core::source::Source)"
        ]
    );
    let cmd_user = "use crate::cmd::args::UsageError;\n";
    assert_eq!(
        violations("sidecar", cmd_user, &brokers),
        ["sidecar → cmd (crate::cmd::args::UsageError)"]
    );
    assert!(violations("cmd", "use crate::source::redis::BROKER;", &brokers).is_empty());
    assert!(violations("dispatch", "use courier::cmd::Cli;", &brokers).is_empty());
}

/// `docs/architecture.md` documents the same rule: each module the table
/// knows is named there, so the picture and the test do not drift apart.
#[test]
fn the_rule_is_written_down() {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/architecture.md"))
            .unwrap();
    for module in [
        "model",
        "policy",
        "forward",
        "expr",
        "source",
        "dispatch",
        "telemetry",
        "sidecar",
        "inject",
        "cmd",
    ] {
        assert!(
            doc.contains(&format!("`{module}`")),
            "docs/architecture.md does not mention `{module}`"
        );
    }
}

/// Where each broker's part of the interface lives, as docs/architecture.md
/// lists it for adding a broker: the dead-letter store in its
/// `dead_letters.rs` (and nowhere else, so no consumer delegates to one),
/// the consumer's `Consumer` and `Observed` once each, its three ways of
/// settling in `settle.rs` (`impl SettleParts`, so that no broker writes
/// its own match over `Settlement`), and its `BROKER`.
fn skeleton_problems(broker: &str, files: &[(String, String)]) -> Vec<String> {
    let mut problems = Vec::new();
    let with = |needle: &str| -> Vec<&str> {
        files
            .iter()
            .filter(|(_, text)| text.contains(needle))
            .map(|(name, _)| name.as_str())
            .collect()
    };
    let stores = with("impl DeadLetterStore for ");
    if stores != ["dead_letters.rs"] {
        problems.push(format!(
            "{broker}: `impl DeadLetterStore` is in {stores:?}, not only in dead_letters.rs"
        ));
    }
    let settles = with("impl SettleParts for ");
    if settles != ["settle.rs"] {
        problems.push(format!(
            "{broker}: `impl SettleParts` is in {settles:?}, not only in settle.rs"
        ));
    }
    let matches = with("Settlement::Ack");
    if !matches.is_empty() {
        problems.push(format!(
            "{broker}: a match over `Settlement` in {matches:?}; settle with `settle_by_parts`"
        ));
    }
    for part in ["impl Consumer for ", "impl Observed for "] {
        let count: usize = files.iter().map(|(_, t)| t.matches(part).count()).sum();
        if count != 1 {
            problems.push(format!("{broker}: `{}` {count} times", part.trim()));
        }
    }
    if with("pub const BROKER: Broker") != ["lib.rs"] {
        problems.push(format!("{broker}: no `pub const BROKER: Broker` in lib.rs"));
    }
    problems
}

#[test]
fn every_broker_crate_has_the_same_skeleton() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut problems = Vec::new();
    for broker in broker_crates(root) {
        let src = root.join("crates").join(&broker).join("src");
        let mut paths = Vec::new();
        rust_files(&src, &mut paths);
        let files: Vec<(String, String)> = paths
            .iter()
            .map(|p| {
                let name = p.strip_prefix(&src).unwrap().display().to_string();
                (name, std::fs::read_to_string(p).unwrap())
            })
            .collect();
        problems.extend(skeleton_problems(&broker, &files));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The courier crates each broker crate depends on, read from its
/// manifest: only `courier-core`, so brokers cannot reach each other or
/// the rest of courier (cargo refuses the path), and core depends on no
/// courier crate at all.
fn courier_dependencies(manifest: &str) -> Vec<String> {
    manifest
        .lines()
        .filter_map(|l| l.split_once('=').map(|(name, _)| name.trim()))
        .filter(|name| name.starts_with("courier"))
        .map(str::to_string)
        .collect()
}

#[test]
fn a_broker_crate_depends_on_core_alone() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let read = |krate: &str| {
        std::fs::read_to_string(root.join("crates").join(krate).join("Cargo.toml")).unwrap()
    };
    let core = read("core");
    assert_eq!(courier_dependencies(&core), Vec::<String>::new(), "core");
    for broker in broker_crates(root) {
        let manifest = read(&broker);
        assert!(
            manifest.contains(&format!("name = \"courier-{broker}\"")),
            "crates/{broker} is not the package courier-{broker}"
        );
        assert_eq!(
            courier_dependencies(&manifest),
            ["courier-core"],
            "{broker}"
        );
    }
    assert_eq!(
        courier_dependencies("courier-core = { path = \"../core\" }\ncourier-amqp = \"1\"\n"),
        ["courier-core", "courier-amqp"]
    );
}

#[test]
fn a_delegating_consumer_breaks_the_skeleton() {
    let files = vec![
        (
            "lib.rs".to_string(),
            "pub const BROKER: Broker = x;\nimpl Consumer for S {}\nimpl Observed for S {}\nimpl DeadLetterStore for S {}\n".to_string(),
        ),
        (
            "dead_letters.rs".to_string(),
            "impl DeadLetterStore for Store {}\n".to_string(),
        ),
        (
            "settle.rs".to_string(),
            "impl SettleParts for S {}\n".to_string(),
        ),
    ];
    assert_eq!(
        skeleton_problems("x", &files),
        [
            "x: `impl DeadLetterStore` is in [\"lib.rs\", \"dead_letters.rs\"], not only in dead_letters.rs"
        ]
    );
    let mut own_match = files.clone();
    own_match[0]
        .1
        .push_str("match s { Settlement::Ack => self.ack(d).await }\n");
    own_match[2].1 = String::new();
    assert_eq!(
        skeleton_problems("x", &own_match),
        [
            "x: `impl DeadLetterStore` is in [\"lib.rs\", \"dead_letters.rs\"], not only in dead_letters.rs",
            "x: `impl SettleParts` is in [], not only in settle.rs",
            "x: a match over `Settlement` in [\"lib.rs\"]; settle with `settle_by_parts`",
        ]
    );
}
