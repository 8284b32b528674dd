//! The Kafka the tests use: librdkafka's mock cluster, run by the
//! `kafka-mock` binary as a process of its own so that `courier run`
//! (another process) reaches it over TCP like any Kafka. One cluster is
//! shared by a test binary (started on first use); a test that fails a
//! broker starts a private one.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Mutex, OnceLock};

/// The `kafka-mock` binary cargo built for these tests.
pub const KAFKA_MOCK_BIN: &str = env!("CARGO_BIN_EXE_kafka-mock");

/// A running mock cluster; dropping it ends the process.
pub struct KafkaMock {
    child: Child,
    commands: Mutex<(ChildStdin, BufReader<ChildStdout>)>,
    /// `host:port,...`, as printed.
    pub bootstrap: String,
}

impl KafkaMock {
    /// Starts a mock cluster of `brokers` brokers. It ends when this
    /// process closes its stdin, which also happens when this process dies.
    pub fn start(brokers: u32) -> Self {
        Self::start_with(brokers, &[])
    }

    /// [`KafkaMock::start`] with more of kafka-mock's flags: a front that
    /// speaks TLS (`--tls-cert`, `--tls-key`, `--tls-client-ca`) or takes
    /// a SASL login (`--sasl MECHANISM:user:password`, `--sasl
    /// OAUTHBEARER:token`) before it lets requests through to the broker.
    pub fn start_with(brokers: u32, flags: &[String]) -> Self {
        let mut child = Command::new(KAFKA_MOCK_BIN)
            .args(["--brokers", &brokers.to_string(), "--exit-on-eof"])
            .args(flags)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start kafka-mock");
        let stdin = child.stdin.take().expect("piped stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut bootstrap = String::new();
        stdout
            .read_line(&mut bootstrap)
            .expect("kafka-mock prints its bootstrap servers");
        let bootstrap = bootstrap.trim().to_string();
        assert!(
            !bootstrap.is_empty(),
            "kafka-mock printed no bootstrap servers"
        );
        Self {
            child,
            commands: Mutex::new((stdin, stdout)),
            bootstrap,
        }
    }

    /// The `--source` URL of this cluster.
    pub fn url(&self) -> String {
        format!("kafka://{}", self.bootstrap)
    }

    /// The process id, to stop (SIGSTOP) and continue the whole cluster.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a command (`down 2`, `up 2`) and checks it was done.
    pub fn command(&self, command: &str) {
        let mut guard = self.commands.lock().unwrap();
        let (stdin, stdout) = &mut *guard;
        writeln!(stdin, "{command}").expect("write to kafka-mock");
        stdin.flush().unwrap();
        let mut answer = String::new();
        stdout.read_line(&mut answer).expect("kafka-mock answers");
        assert_eq!(answer.trim(), "ok", "kafka-mock {command}");
    }
}

impl Drop for KafkaMock {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The cluster this test binary shares, started on first use: three
/// brokers, so that every topic is replicated as on a real cluster.
pub fn shared_kafka() -> &'static KafkaMock {
    static SHARED: OnceLock<KafkaMock> = OnceLock::new();
    SHARED.get_or_init(|| KafkaMock::start(3))
}
