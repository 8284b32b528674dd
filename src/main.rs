#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

/// A message's trip allocates small, short-lived buffers on many threads
/// (reply parsing, request building, task state); glibc's malloc spent about
/// a seventh of courier's CPU on them (BENCHMARKS.md, the profile).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    courier::cmd::main()
}
