#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    courier::cli::main()
}
