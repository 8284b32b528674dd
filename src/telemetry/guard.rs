//! What a peer of courier's own HTTP servers (the metrics endpoint, the
//! webhook) may hold: a connection that stops reading what it asked for,
//! or sends nothing, is cut after a bound; one peer may hold only a few of
//! the connections at once, so that it cannot use up the cap for the
//! kubelet's probes and the scraper.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// A stream whose writes may not wait longer than `write_stall` for the
/// peer to take bytes, and whose reads (with `read_idle`) may not wait
/// longer than that for bytes to come; past either it fails with
/// `TimedOut`, and the server drops the connection.
pub struct Guarded<S> {
    inner: S,
    read_idle: Option<Duration>,
    write_stall: Duration,
    read_timer: Pin<Box<Sleep>>,
    read_armed: bool,
    write_timer: Pin<Box<Sleep>>,
    write_armed: bool,
}

impl<S> Guarded<S> {
    pub fn new(inner: S, read_idle: Option<Duration>, write_stall: Duration) -> Self {
        Self {
            inner,
            read_idle,
            write_stall,
            read_timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
            read_armed: false,
            write_timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
            write_armed: false,
        }
    }
}

/// Pending with the timer armed (first time: from now), or the timeout.
fn waited(
    timer: &mut Pin<Box<Sleep>>,
    armed: &mut bool,
    bound: Duration,
    cx: &mut Context<'_>,
    what: &str,
) -> Poll<io::Error> {
    if !*armed {
        timer.as_mut().reset(Instant::now() + bound);
        *armed = true;
    }
    match timer.as_mut().poll(cx) {
        Poll::Ready(()) => Poll::Ready(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the peer {what} for {bound:?}"),
        )),
        Poll::Pending => Poll::Pending,
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Guarded<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                this.read_armed = false;
                Poll::Ready(r)
            }
            Poll::Pending => match this.read_idle {
                None => Poll::Pending,
                Some(idle) => waited(
                    &mut this.read_timer,
                    &mut this.read_armed,
                    idle,
                    cx,
                    "sent nothing",
                )
                .map(Err),
            },
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Guarded<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_write(cx, buf) {
            Poll::Ready(r) => {
                this.write_armed = false;
                Poll::Ready(r)
            }
            Poll::Pending => waited(
                &mut this.write_timer,
                &mut this.write_armed,
                this.write_stall,
                cx,
                "read nothing of the answer",
            )
            .map(Err),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_flush(cx) {
            Poll::Ready(r) => {
                this.write_armed = false;
                Poll::Ready(r)
            }
            Poll::Pending => waited(
                &mut this.write_timer,
                &mut this.write_armed,
                this.write_stall,
                cx,
                "read nothing of the answer",
            )
            .map(Err),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The connections a server holds: at most `total`, at most `per_peer`
/// from one address. The map holds an entry per address with a connection
/// open, so it is bounded by `total`.
#[derive(Clone)]
pub struct Admission {
    total: usize,
    per_peer: usize,
    open: Arc<Mutex<(usize, HashMap<IpAddr, usize>)>>,
}

/// One admitted connection; dropping it frees its place.
pub struct Admitted {
    peer: IpAddr,
    open: Arc<Mutex<(usize, HashMap<IpAddr, usize>)>>,
}

impl Admission {
    pub fn new(total: usize, per_peer: usize) -> Self {
        Self {
            total,
            per_peer: per_peer.max(1),
            open: Arc::default(),
        }
    }

    /// A place for a new connection from `peer`, or `None` at either cap.
    pub fn admit(&self, peer: IpAddr) -> Option<Admitted> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let (count, by_peer) = &mut *open;
        let of_peer = by_peer.get(&peer).copied().unwrap_or(0);
        if *count >= self.total || of_peer >= self.per_peer {
            return None;
        }
        *count += 1;
        by_peer.insert(peer, of_peer + 1);
        Some(Admitted {
            peer,
            open: self.open.clone(),
        })
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let (count, by_peer) = &mut *open;
        *count -= 1;
        if let Some(n) = by_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                by_peer.remove(&self.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_peer_cannot_take_every_place() {
        let admission = Admission::new(4, 2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let first = admission.admit(a).unwrap();
        let _second = admission.admit(a).unwrap();
        assert!(admission.admit(a).is_none(), "a third from one peer");
        let _b1 = admission.admit(b).unwrap();
        let _b2 = admission.admit(b).unwrap();
        let c: IpAddr = "10.0.0.3".parse().unwrap();
        assert!(admission.admit(c).is_none(), "over the total");
        drop(first);
        assert!(admission.admit(c).is_some(), "a freed place serves again");
        assert_eq!(
            admission.open.lock().unwrap().1.len(),
            2,
            "only peers with a connection are kept"
        );
    }
}
