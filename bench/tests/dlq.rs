//! `courier-bench dlq` at a tiny size, against the shared Redis and a debug
//! build of courier (its `src/main.rs` built as this package's
//! `courier-bench-courier` binary, as the smoke test does): the table is
//! written, in place, with the lines each command printed equal to what
//! the fill made and the rows of each page `courier console` served, and
//! the run's stream is gone afterwards. It checks that the harness works,
//! never how fast anything is.

use std::path::PathBuf;
use std::process::Command;

const BEGIN: &str = "<!-- courier-bench dlq:start";
const END: &str = "<!-- courier-bench dlq:end -->";

/// Runs the harness on `report` and returns its stderr.
fn dlq_run(report: &std::path::Path) -> String {
    let harness = PathBuf::from(env!("CARGO_BIN_EXE_courier-bench"));
    // courier's main, built by the cargo that built this test (bench/Cargo.toml says why).
    let courier = PathBuf::from(env!("CARGO_BIN_EXE_courier-bench-courier"));
    let out = Command::new(&harness)
        .args([
            "dlq",
            "--letters",
            "2000",
            "--runs",
            "1",
            "--allow-dirty",
            "--courier",
        ])
        .arg(&courier)
        .arg("--out")
        .arg(report)
        .output()
        .expect("the harness runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    stderr.into_owned()
}

#[test]
fn dlq_run_writes_its_table_with_the_counts_and_deletes_its_stream() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let report = dir.path().join("BENCHMARKS.md");
    let before = "# Benchmarks\n\nintro\n\n<!-- courier-bench:begin -->\nall's table\n<!-- courier-bench:end -->\n\n## Reading\n\nprose\n";
    std::fs::write(&report, before).expect("written");
    dlq_run(&report);
    let stderr = dlq_run(&report);

    let text = std::fs::read_to_string(&report).expect("the report is written");
    // `all`'s part and the prose are kept; the section is there once.
    assert!(text.starts_with(before), "{text}");
    assert_eq!(text.matches(BEGIN).count(), 1, "{text}");
    assert_eq!(text.matches(END).count(), 1, "{text}");
    assert_eq!(
        text.matches("## Dead letters at scale (issue 29)").count(),
        1,
        "{text}"
    );

    // | command | wall ms | runs | CPU s | peak RSS MB | lines | expected |
    let row = |label: &str| -> Vec<String> {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("| `{label}")))
            .unwrap_or_else(|| panic!("no {label} row in:\n{text}"));
        line.split('|').map(|c| c.trim().to_string()).collect()
    };
    let number = |cells: &[String], at: usize| -> f64 {
        cells[at]
            .parse()
            .unwrap_or_else(|_| panic!("no number at {at} in {cells:?}"))
    };
    let list = row("dlq list --limit 50");
    assert_eq!(
        number(&list, 6),
        51.0,
        "the header and 50 letters: {list:?}"
    );
    let filter = row("dlq list --output json --filter");
    let dry_run = row("dlq replay --dry-run --filter");
    for cells in [&list, &filter, &dry_run] {
        assert_eq!(cells[6], cells[7], "lines against expected: {cells:?}");
        assert!(number(cells, 2) > 0.0, "wall time: {cells:?}");
        assert!(number(cells, 5) > 0.0, "peak RSS: {cells:?}");
    }
    let matching = number(&filter, 6);
    assert!(matching > 0.0, "{filter:?}");
    assert_eq!(number(&dry_run, 6), matching + 1.0, "{dry_run:?}");
    // The console's requests: a page of 50 letters, the overview's one
    // queue, a page of the filter's letters; the console's own peak RSS.
    let page = row("courier console`: `GET /q/0`");
    let overview = row("courier console`: `GET /`");
    let filtered = row("courier console`: `GET /q/0?filter=EXPR`");
    assert_eq!(number(&page, 6), 50.0, "{page:?}");
    assert_eq!(number(&overview, 6), 1.0, "{overview:?}");
    assert_eq!(number(&filtered, 6), matching.min(50.0), "{filtered:?}");
    for cells in [&page, &overview, &filtered] {
        assert_eq!(cells[6], cells[7], "rows against expected: {cells:?}");
        assert!(number(cells, 2) > 0.0, "wall time: {cells:?}");
        assert!(number(cells, 5) > 0.0, "peak RSS: {cells:?}");
    }
    for target in [
        "list --limit 50` answers",
        "a filter over all 2000",
        "the command's RSS <",
        "the console's first page (`GET /q/0`) renders in < 500 ms",
        "the console's RSS < 64 MB",
    ] {
        assert!(
            text.lines()
                .any(|l| l.contains(target)
                    && (l.ends_with("| met |") || l.ends_with("| **missed** |"))),
            "no verdict for {target:?} in:\n{text}"
        );
    }

    // The stream of the last run is gone.
    let stream = stderr
        .lines()
        .find_map(|l| {
            l.strip_prefix("writing 2000 dead letters to ")?
                .strip_suffix("...")
        })
        .unwrap_or_else(|| panic!("no stream named in:\n{stderr}"));
    let mut con = redis::Client::open("redis://127.0.0.1:6379/0")
        .and_then(|c| c.get_connection())
        .expect("Redis");
    let exists: u64 = redis::cmd("EXISTS")
        .arg(stream)
        .query(&mut con)
        .expect("EXISTS");
    assert_eq!(exists, 0, "{stream} is still there");
}
