//! The queues a console shows: `--queue SOURCE#QUEUE` flags, and a
//! `--queues-file` whose broker URLs may come from environment variables
//! (a Secret's key in the chart), so that no password sits in a ConfigMap.

use std::path::Path;

use serde::Deserialize;

use crate::model::default_dead_letter_queue;
use crate::source::{self, SourceUrl};

/// One queue the console shows.
#[derive(Debug, Clone)]
pub struct QueueSpec {
    /// What the overview calls it.
    pub name: String,
    pub url: SourceUrl,
    pub queue: String,
    pub dlq: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    queues: Vec<Entry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Entry {
    name: Option<String>,
    queue: String,
    dlq: Option<String>,
    source: Option<String>,
    source_env: Option<String>,
}

/// `SOURCE#QUEUE`: the broker URL and the queue after its last `#` (a
/// broker URL has no fragment of its own).
pub fn parse_flag(text: &str) -> Result<QueueSpec, String> {
    let (url, queue) = text
        .rsplit_once('#')
        .filter(|(url, queue)| !url.is_empty() && !queue.is_empty())
        .ok_or_else(|| {
            format!(
                "--queue {:?}: write SOURCE#QUEUE, e.g. redis://127.0.0.1:6379/0#orders",
                source::redact(text)
            )
        })?;
    spec(None, url, queue, None).map_err(|e| format!("--queue: {e}"))
}

fn spec(
    name: Option<String>,
    url: &str,
    queue: &str,
    dlq: Option<String>,
) -> Result<QueueSpec, String> {
    let url = source::parse_url(url)?;
    Ok(QueueSpec {
        name: name.unwrap_or_else(|| queue.to_string()),
        url,
        queue: queue.to_string(),
        dlq: dlq.unwrap_or_else(|| default_dead_letter_queue(queue)),
    })
}

/// The queues of a `--queues-file`, each URL read from the file or from
/// the environment variable it names.
pub fn load(path: &Path) -> Result<Vec<QueueSpec>, String> {
    load_with(path, |var| std::env::var(var).ok())
}

fn load_with(path: &Path, env: impl Fn(&str) -> Option<String>) -> Result<Vec<QueueSpec>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--queues-file {}: {e}", path.display()))?;
    let file: File = serde_saphyr::from_str(&text)
        .map_err(|e| format!("--queues-file {}: {e}", path.display()))?;
    file.queues
        .into_iter()
        .enumerate()
        .map(|(i, entry)| {
            let at = format!("--queues-file {}: queues[{i}]", path.display());
            let url = match (&entry.source, &entry.source_env) {
                (Some(url), None) => url.clone(),
                (None, Some(var)) => env(var).ok_or_else(|| {
                    format!("{at}: sourceEnv {var:?} is not set in the environment")
                })?,
                _ => return Err(format!("{at}: give one of source and sourceEnv")),
            };
            if entry.queue.is_empty() {
                return Err(format!("{at}: queue is empty"));
            }
            spec(entry.name, url.trim(), &entry.queue, entry.dlq).map_err(|e| format!("{at}: {e}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flag_is_the_url_and_the_queue_after_its_last_hash() {
        let spec = parse_flag("redis://:secret@127.0.0.1:6379/0#orders").unwrap();
        assert_eq!(spec.queue, "orders");
        assert_eq!(spec.dlq, "orders.dlq");
        assert_eq!(spec.url.as_str(), "redis://:secret@127.0.0.1:6379/0");
        for bad in [
            "redis://127.0.0.1:6379/0",
            "#orders",
            "redis://h:1/0#",
            "nope://x#q",
        ] {
            assert!(parse_flag(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_file_takes_urls_from_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("queues.yaml");
        let env = |var: &str| {
            (var == "COURIER_CONSOLE_TEST_URL").then(|| "nats://127.0.0.1:4222".to_string())
        };
        std::fs::write(
            &path,
            "queues:\n  - queue: orders\n    source: redis://127.0.0.1:6379/0\n  - name: Billing\n    queue: billing\n    dlq: billing.failed\n    sourceEnv: COURIER_CONSOLE_TEST_URL\n",
        )
        .unwrap();
        let specs = load_with(&path, env).unwrap();
        assert_eq!(
            specs
                .iter()
                .map(|s| (
                    s.name.as_str(),
                    s.queue.as_str(),
                    s.dlq.as_str(),
                    s.url.as_str()
                ))
                .collect::<Vec<_>>(),
            vec![
                ("orders", "orders", "orders.dlq", "redis://127.0.0.1:6379/0"),
                (
                    "Billing",
                    "billing",
                    "billing.failed",
                    "nats://127.0.0.1:4222"
                ),
            ]
        );
        std::fs::write(
            &path,
            "queues:\n  - queue: orders\n    sourceEnv: COURIER_CONSOLE_UNSET\n",
        )
        .unwrap();
        let err = load_with(&path, env).unwrap_err();
        assert!(
            err.contains("queues[0]") && err.contains("COURIER_CONSOLE_UNSET"),
            "{err}"
        );
        std::fs::write(&path, "queues:\n  - queue: orders\n").unwrap();
        assert!(
            load_with(&path, env)
                .unwrap_err()
                .contains("one of source and sourceEnv")
        );
    }
}
