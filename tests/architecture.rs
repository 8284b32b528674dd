//! The walls between courier's modules, read from the source: every
//! `crate::<module>` a file names must be an edge the architecture allows
//! (docs/architecture.md draws the picture). A forbidden edge fails with
//! the file, the edge and the text that made it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Who may name whom. A module is a top-level module of `src/`, except that
/// each broker folder `source/<broker>` is a module of its own, so that
/// "inject never reaches a broker" and "brokers do not reach each other"
/// can be said. `cmd`, `lib` and `main` assemble everything and may name
/// anything.
fn allowed(from: &str) -> Option<&'static [&'static str]> {
    Some(match from {
        // The leaves: the shared vocabulary, durations, and metrics.
        "model" | "duration" | "telemetry" => &[],
        // The decision is pure: no source, no HTTP, no dispatcher.
        "policy" => &["model", "duration"],
        // The HTTP client knows messages, not brokers.
        "forward" => &["model"],
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
        "inject" => &["duration", "telemetry", "source", "model"],
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

/// The module a file belongs to: `src/source/redis/read.rs` → `source/redis`.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    match parts.as_slice() {
        [source, broker, ..] if source == "source" && parts.len() > 2 => {
            format!("source/{broker}")
        }
        [first, ..] => first.clone(),
        [] => unreachable!(),
    }
}

/// The module a `crate::` path names: `source::redis::X` → `source/redis`,
/// `source::Source` → `source`.
fn target_of(path: &str, brokers: &BTreeSet<String>) -> String {
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

/// Every `crate::...` path named in `text`, outside comments, with
/// `use crate::{a, b::c}` groups expanded to their top-level names.
fn crate_paths(text: &str) -> Vec<String> {
    let code: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut paths = Vec::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().last();
        rest = &rest[at + "crate::".len()..];
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
                            paths.push(item.trim().to_string());
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
            paths.push(path);
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

fn broker_folders(src: &Path) -> BTreeSet<String> {
    std::fs::read_dir(src.join("source"))
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            e.path()
                .is_dir()
                .then(|| e.file_name().to_string_lossy().into_owned())
        })
        .collect()
}

/// Every forbidden edge in `text`, a file of module `from`.
fn violations(from: &str, text: &str, brokers: &BTreeSet<String>) -> Vec<String> {
    crate_paths(text)
        .into_iter()
        .filter_map(|path| {
            let to = target_of(&path, brokers);
            (!permits(from, &to)).then(|| format!("{from} → {to} (crate::{path})"))
        })
        .collect()
}

#[test]
fn the_walls_hold() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let brokers = broker_folders(&src);
    assert!(
        brokers.contains("redis") && brokers.contains("embedded"),
        "{brokers:?}"
    );
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut found = Vec::new();
    for file in &files {
        let from = module_of(&src, file);
        let text = std::fs::read_to_string(file).unwrap();
        for v in violations(&from, &text, &brokers) {
            found.push(format!(
                "{}: {v}",
                file.strip_prefix(&src).unwrap().display()
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
    let redis = "use crate::source::amqp::X;\nuse super::shared::RECEIVE_WAIT;\n";
    assert_eq!(
        violations("source/redis", redis, &brokers),
        ["source/redis → source/amqp (crate::source::amqp::X)"]
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
    if with("pub const BROKER: Broker") != ["mod.rs"] {
        problems.push(format!("{broker}: no `pub const BROKER: Broker` in mod.rs"));
    }
    problems
}

#[test]
fn every_broker_folder_has_the_same_skeleton() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut problems = Vec::new();
    for broker in broker_folders(&src) {
        let mut paths = Vec::new();
        rust_files(&src.join("source").join(&broker), &mut paths);
        let files: Vec<(String, String)> = paths
            .iter()
            .map(|p| {
                let name = p
                    .strip_prefix(src.join("source").join(&broker))
                    .unwrap()
                    .display()
                    .to_string();
                (name, std::fs::read_to_string(p).unwrap())
            })
            .collect();
        problems.extend(skeleton_problems(&broker, &files));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn a_delegating_consumer_breaks_the_skeleton() {
    let files = vec![
        (
            "mod.rs".to_string(),
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
            "x: `impl DeadLetterStore` is in [\"mod.rs\", \"dead_letters.rs\"], not only in dead_letters.rs"
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
            "x: `impl DeadLetterStore` is in [\"mod.rs\", \"dead_letters.rs\"], not only in dead_letters.rs",
            "x: `impl SettleParts` is in [], not only in settle.rs",
            "x: a match over `Settlement` in [\"mod.rs\"]; settle with `settle_by_parts`",
        ]
    );
}
