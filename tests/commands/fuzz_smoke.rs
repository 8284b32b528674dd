//! The fuzz targets on stable, without libFuzzer: every target's checks
//! (`fuzz/src/lib.rs`) run over its seeds (`fuzz/seeds/<target>/`), every
//! input a fuzzer found and we fixed (`fuzz/regressions/<target>/`, named
//! after the bug), and a few thousand seeded random mutations of them. Fast
//! enough for every `cargo test`; `scripts/fuzz` runs the real fuzzer.

#[path = "../../fuzz/src/lib.rs"]
mod targets;

use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Mutations per target on each run.
const MUTATIONS: usize = 3000;

fn files_in(dir: &Path) -> Vec<Vec<u8>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<_> = entries.filter_map(|e| Some(e.ok()?.path())).collect();
    paths.sort();
    paths
        .iter()
        .filter(|p| p.is_file())
        .map(|p| std::fs::read(p).expect("read a fuzz input"))
        .collect()
}

/// One libFuzzer-style mutation: flip, insert, delete, duplicate a range,
/// splice another seed in, or set an interesting byte.
fn mutate(rng: &mut StdRng, input: &[u8], seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..rng.random_range(1..=4) {
        let at = if out.is_empty() {
            0
        } else {
            rng.random_range(0..out.len())
        };
        match rng.random_range(0..6) {
            0 if !out.is_empty() => out[at] ^= 1 << rng.random_range(0..8),
            1 => out.insert(at, rng.random()),
            2 if !out.is_empty() => {
                out.remove(at);
            }
            3 if !out.is_empty() => {
                let end = rng.random_range(at..=out.len());
                let copy = out[at..end].to_vec();
                out.splice(at..at, copy);
            }
            4 => {
                let other = &seeds[rng.random_range(0..seeds.len())];
                let from = rng.random_range(0..=other.len());
                out.splice(at..at, other[from..].iter().copied());
            }
            _ => {
                let interesting = [0x00, 0xff, 0x7f, 0x80, 0xdd, 0xdb, 0xc6, b'\n', b'9', b':'];
                let byte = interesting[rng.random_range(0..interesting.len())];
                if out.is_empty() {
                    out.push(byte);
                } else {
                    out[at] = byte;
                }
            }
        }
    }
    out
}

fn smoke(name: &str) {
    let (_, check) = targets::TARGETS
        .iter()
        .find(|(n, _)| *n == name)
        .expect("a known target");
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let seeds = files_in(&fuzz.join("seeds").join(name));
    assert!(!seeds.is_empty(), "fuzz/seeds/{name}/ has no seeds");
    for input in seeds
        .iter()
        .chain(&files_in(&fuzz.join("regressions").join(name)))
    {
        check(input);
    }
    let mut rng = StdRng::seed_from_u64(0x00c0_0e1e);
    for _ in 0..MUTATIONS {
        let seed = &seeds[rng.random_range(0..seeds.len())];
        let input = mutate(&mut rng, seed, &seeds);
        check(&input);
    }
}

#[test]
fn retry_after() {
    smoke("retry_after");
}

#[test]
fn policy_document() {
    smoke("policy_document");
}

#[test]
fn code_match() {
    smoke("code_match");
}

#[test]
fn redis_entry() {
    smoke("redis_entry");
}

#[test]
fn embedded_record() {
    smoke("embedded_record");
}

#[test]
fn cloudevent() {
    smoke("cloudevent");
}
