//! A `redis-server` of a test's own, for tests that stop or kill a broker
//! (the shared one on 6379 is never touched).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{free_port, wait_for};

/// A `redis-server` of the test's own on a free port, persisting to an
/// append-only file in a temporary directory.
///
/// Why the AOF with `appendfsync always`: "zero lost" means every write
/// Redis acknowledged (an XADD, an XACK, a retry moved into the sorted set)
/// is still there after the restart. RDB snapshots (`--save`) keep only what
/// was written before the last snapshot, so a kill between snapshots loses
/// messages; the AOF replays every acknowledged command, and `always`
/// makes Redis write it before it answers.
pub struct PrivateRedis {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl PrivateRedis {
    pub async fn start() -> Self {
        let port = free_port();
        let mut redis = Self {
            port,
            dir: tempfile::tempdir().unwrap(),
            child: None,
        };
        redis.spawn().await;
        redis
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    pub async fn spawn(&mut self) {
        let dir = self.dir.path();
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "yes"])
            .args(["--appendfsync", "always"])
            .args(["--dir", &dir.display().to_string()])
            .args(["--logfile", &dir.join("redis.log").display().to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server (is it installed?)");
        self.child = Some(child);
        let port = self.port;
        wait_for(
            "the private Redis to answer",
            Duration::from_secs(30),
            async || ping(port).await,
        )
        .await;
    }

    /// `kill -9`: no shutdown, no final write.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("SIGKILL redis-server");
            child.wait().expect("reap redis-server");
        }
    }

    /// SIGTERM: Redis's own orderly shutdown.
    pub async fn terminate(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = child.id().to_string();
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .expect("kill -TERM redis-server");
            let deadline = Instant::now() + Duration::from_secs(30);
            while child.try_wait().expect("wait for redis-server").is_none() {
                assert!(Instant::now() < deadline, "redis-server did not stop");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill9();
    }
}

async fn ping(port: u16) -> bool {
    let Ok(mut stream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    if stream.write_all(b"PING\r\n").await.is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    // A Redis still loading its AOF answers -LOADING.
    matches!(stream.read(&mut buf).await, Ok(n) if buf[..n].starts_with(b"+PONG"))
}
