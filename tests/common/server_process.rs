//! A server of the tests' own (moto, the Pub/Sub emulator), one per test
//! binary on a free port: started through a shell that ends it once this
//! process closes its stdin, which also happens when this process dies.

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Starts `command` (`{port}` in it is the free port chosen) with `env`,
/// and waits up to `limit` until the port answers; the shell and the port.
pub fn start_server(
    command: &str,
    env: &[(&str, &str)],
    what: &str,
    limit: Duration,
) -> (Child, u16) {
    let port = super::free_port();
    let command = command.replace("{port}", &port.to_string());
    // The shell ends the server (by its process id) once stdin closes.
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "{command} >&2 & server=$!; echo started; cat >/dev/null; kill $server"
        ))
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {what}: {e}"));
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap_or_else(|e| panic!("the wrapper of {what} starts: {e}"));
    let deadline = Instant::now() + limit;
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "{what} did not start answering on 127.0.0.1:{port}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    (child, port)
}
