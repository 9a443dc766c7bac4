//! The daemon's accept loops. Each connection is counted against its principal ([`Limits`]) and
//! closed when it sends nothing for `limits.idle_timeout_ms`; accept errors (out of descriptors)
//! back off and are logged loudly instead of spinning. A Unix-socket connection whose first bytes
//! are ATTACH's magic is an ATTACH exchange ([`crate::engine::attach`]); any other is handed to gRPC.
//! A TCP connection passes its endpoint's guard first (`tcp_auth`: the TLS handshake, in a task
//! of its own and within `limits.handshake_timeout_ms`); what the client presented travels with
//! it ([`TcpPeer`]) to the per-request check ([`crate::edge::service::TcpAuth`]). TCP clients are one
//! principal: when they hold all its connections, a new one takes the place of the one idle
//! longest ([`kvnet::slots`]), so that silent connections cannot keep a Health probe out.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, Interest, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::edge::caller::TcpPeer;
use crate::edge::h2_authority::HeaderFix;
use crate::edge::lookup_wire::LookupWire;
use crate::edge::passthrough::{Passthrough, ReadSide, SameConnection};
use crate::engine::attach::Tickets;
use crate::policy::limits::{Held, Limits, Principal};
use crate::rate_log::RateLog;

/// Connections accepted and waiting for gRPC to take them.
const HANDOFF: usize = 64;

/// What an accepted connection holds: its count ([`Limits::connect`]), or on TCP its count in
/// the listener's slots, from which a newcomer may evict it ([`kvnet::slots`]).
#[derive(Debug)]
enum Hold {
    Counted { _held: Held },
    Slot(kvnet::slots::Slot<Held>),
}

/// An accepted connection: counted until dropped, closed after `idle` without a byte read, or
/// at once when evicted from its listener's slots (TCP) for a newcomer. A read only notes its
/// time; the timer is moved when it fires early (not on every read, which would cost a
/// timer-wheel update per request).
pub type Conn<IO> = Passthrough<IO, Idle>;

/// What a [`Conn`] keeps beside its stream: its count, and when it last read a byte.
#[derive(Debug)]
pub struct Idle {
    hold: Hold,
    idle: Duration,
    last_read: tokio::time::Instant,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl<IO> Conn<IO> {
    fn new(io: IO, held: Held, idle: Duration) -> Self {
        Self::holding(io, Hold::Counted { _held: held }, idle)
    }

    fn holding(io: IO, hold: Hold, idle: Duration) -> Self {
        let now = tokio::time::Instant::now();
        let side = Idle { hold, idle, last_read: now, deadline: Box::pin(tokio::time::sleep_until(now + idle)) };
        Self { io, side }
    }
}

impl SameConnection for Idle {}

impl<IO: AsyncRead + Unpin> ReadSide<IO> for Idle {
    fn poll_read(&mut self, io: &mut IO, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if let Hold::Slot(slot) = &self.hold
            && slot.poll_closed(cx).is_ready()
        {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed, idle longest, for a new connection (limits.max_connections_per_uid)",
            )));
        }
        let before = buf.filled().len();
        match Pin::new(io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    self.last_read = tokio::time::Instant::now();
                    if let Hold::Slot(slot) = &self.hold {
                        slot.touch();
                    }
                }
                Poll::Ready(r)
            }
            Poll::Pending => loop {
                if self.deadline.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                let due = self.last_read + self.idle;
                if due <= tokio::time::Instant::now() {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "idle connection closed (limits.idle_timeout_ms)",
                    )));
                }
                // Bytes came since the timer was set: it moves to their time plus `idle`.
                self.deadline.as_mut().reset(due);
            },
        }
    }
}

/// Backs off after accept errors (out of descriptors, memory) and logs them: the first at once,
/// then at most every 10 s with the count since.
#[derive(Debug)]
struct AcceptErrors {
    what: &'static str,
    delay: Duration,
    unlogged: u64,
    last_log: Option<Instant>,
}

impl AcceptErrors {
    fn new(what: &'static str) -> Self {
        Self { what, delay: Duration::ZERO, unlogged: 0, last_log: None }
    }

    async fn failed(&mut self, e: &io::Error) {
        metrics::counter!("kvcached_accept_errors_total", "listener" => self.what).increment(1);
        self.unlogged += 1;
        if self.last_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
            tracing::error!(
                listener = self.what,
                errors = self.unlogged,
                "cannot accept connections: {e} (out of file descriptors? see limits.max_connections); backing off"
            );
            self.unlogged = 0;
            self.last_log = Some(Instant::now());
        }
        self.delay = (self.delay * 2).clamp(Duration::from_millis(5), Duration::from_secs(1));
        tokio::time::sleep(self.delay).await;
    }

    fn ok(&mut self) {
        self.delay = Duration::ZERO;
    }
}

/// The first bytes of a connection, waiting at most until `deadline` for `want` of them.
async fn peek(stream: &UnixStream, want: usize, deadline: tokio::time::Instant) -> io::Result<Vec<u8>> {
    use std::os::fd::AsRawFd;
    let mut buf = vec![0u8; want];
    loop {
        tokio::time::timeout_at(deadline, stream.readable())
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no handshake"))??;
        let n = match stream.try_io(Interest::READABLE, || {
            // SAFETY: recv into our buffer; MSG_PEEK leaves the bytes for whoever reads next.
            let r = unsafe { libc::recv(stream.as_raw_fd(), buf.as_mut_ptr().cast(), want, libc::MSG_PEEK) };
            if r < 0 { Err(io::Error::last_os_error()) } else { Ok(r as usize) }
        }) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        if n == 0 || n >= want {
            buf.truncate(n);
            return Ok(buf);
        }
        // Part of it is there: the socket stays readable, so wait a little instead of spinning.
        if tokio::time::Instant::now() >= deadline {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "no handshake"));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Accepts on the Unix socket until `stop`; returns the gRPC connections. LOOKUP connections are
/// served here when `lookups` is given (`engines.lookup_wire`); otherwise their hello goes to
/// gRPC like any other bytes, which closes the connection, and the client looks up over gRPC.
pub fn unix(
    listener: UnixListener,
    limits: Arc<Limits>,
    tickets: Arc<Tickets>,
    lookups: Option<Arc<LookupWire>>,
    mut stop: watch::Receiver<bool>,
) -> ReceiverStream<io::Result<Conn<HeaderFix<UnixStream>>>> {
    let (tx, rx) = mpsc::channel(HANDOFF);
    tokio::spawn(async move {
        let mut errors = AcceptErrors::new("unix");
        let mut refused_log = RateLog::default();
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = stop.wait_for(|s| *s) => return,
            };
            let stream = match accepted {
                Ok((s, _)) => {
                    errors.ok();
                    s
                }
                Err(e) => {
                    errors.failed(&e).await;
                    continue;
                }
            };
            let Ok(cred) = stream.peer_cred() else {
                tracing::warn!("a Unix-socket peer without credentials was refused");
                continue;
            };
            let who = Principal::Uid(cred.uid());
            let held = match limits.connect(who) {
                Ok(h) => h,
                Err(e) => {
                    // Counted in kvcached_limit_refusals_total; logged once a while, not per
                    // connection (a flood would flood the log).
                    refused_log.note(&e.to_string());
                    continue;
                }
            };
            let (tx, limits, tickets) = (tx.clone(), Arc::clone(&limits), Arc::clone(&tickets));
            let (lookups, stop) = (lookups.clone(), stop.clone());
            tokio::spawn(async move {
                let handshake = Duration::from_millis(limits.cfg.handshake_timeout_ms);
                let deadline = tokio::time::Instant::now() + handshake;
                match peek(&stream, kvproto::attach::MAGIC.len(), deadline).await {
                    Ok(first) if first == kvproto::attach::MAGIC => {
                        crate::engine::attach::serve(stream, &tickets, handshake).await;
                        drop(held);
                    }
                    Ok(first) if first == kvproto::lookup_wire::MAGIC && lookups.is_some() => {
                        if let Some(l) = lookups {
                            l.serve(stream, who, held, deadline, stop).await;
                        }
                    }
                    Ok(first) if !first.is_empty() => {
                        let idle = Duration::from_millis(limits.cfg.idle_timeout_ms);
                        let _ = tx.send(Ok(Conn::new(HeaderFix::new(stream), held, idle))).await;
                    }
                    _ => {} // closed, or silent past the handshake timeout
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// A TCP connection that passed its guard's handshake: plain, or TLS; what the client
/// presented beside it.
pub type GuardedTcp = Passthrough<kvnet::Stream<TcpStream>, TcpPeer>;

/// What the client presented travels beside the stream; reads pass straight through.
impl<IO: AsyncRead + Unpin> ReadSide<IO> for TcpPeer {}

impl tonic::transport::server::Connected for GuardedTcp {
    type ConnectInfo = TcpPeer;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.side.clone()
    }
}

/// The label of `kvcached_limit_refusals_by_limit_total` that counts TCP connections closed, idle
/// longest, to make room for a new one ([`tcp`]).
pub const TCP_EVICTED: &str = "tcp_idle_evicted";

/// A slot for a new TCP connection: a count from `limits`, or, when TCP clients hold all theirs
/// (`limits.max_connections_per_uid`: they are one principal) or the daemon all its
/// connections, the count of the TCP connection idle longest, which is closed. TCP serves only
/// Health, a unary call answered at once: the connection idle longest has no request in flight.
/// A flood of silent connections can then only displace itself, never keep a probe out.
fn tcp_slot(
    limits: &Arc<Limits>,
    slots: &kvnet::slots::Slots<Held>,
    refused_log: &mut RateLog,
) -> Option<kvnet::slots::Slot<Held>> {
    let evict = || {
        let held = slots.evict_idle()?;
        limits.count_refusal(TCP_EVICTED);
        Some(held)
    };
    let full = slots.len() >= limits.cfg.max_connections_per_uid;
    let held = match full.then(evict).flatten() {
        Some(h) => h,
        None => match limits.connect(Principal::Tcp) {
            Ok(h) => h,
            Err(e) => match evict() {
                Some(h) => h,
                None => {
                    refused_log.note(&e.to_string());
                    return None;
                }
            },
        },
    };
    Some(slots.insert(held))
}

/// Accepts on a TCP listener until `stop`, each connection through `guard`; returns the
/// connections. A TLS handshake runs in a task of its own (a slow client holds its connection
/// slot, never the accept loop) and is dropped after `limits.handshake_timeout_ms`. At the
/// limit, a new connection takes the place of the one idle longest ([`tcp_slot`]).
pub fn tcp(
    listener: TcpListener,
    limits: Arc<Limits>,
    guard: Arc<kvnet::Guard>,
    mut stop: watch::Receiver<bool>,
) -> ReceiverStream<io::Result<Conn<GuardedTcp>>> {
    let (tx, rx) = mpsc::channel(HANDOFF);
    tokio::spawn(async move {
        let mut errors = AcceptErrors::new("tcp");
        let mut refused_log = RateLog::default();
        let handshakes = Arc::new(parking_lot::Mutex::new(RateLog::default()));
        let slots = kvnet::slots::Slots::new();
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = stop.wait_for(|s| *s) => return,
            };
            let (stream, remote) = match accepted {
                Ok(a) => {
                    errors.ok();
                    a
                }
                Err(e) => {
                    errors.failed(&e).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            // Counted from the start: a handshake holds a connection slot while it runs (and
            // may lose it to a newcomer, as an idle connection would).
            let Some(slot) = tcp_slot(&limits, &slots, &mut refused_log) else { continue };
            let idle = Duration::from_millis(limits.cfg.idle_timeout_ms);
            let plain = |io| GuardedTcp { io, side: TcpPeer { remote, cert: kvnet::PeerCert::default() } };
            if !guard.tls() {
                let conn = Conn::holding(plain(kvnet::Stream::Plain(stream)), Hold::Slot(slot), idle);
                if tx.send(Ok(conn)).await.is_err() {
                    return;
                }
                continue;
            }
            let (tx, guard, handshakes) = (tx.clone(), Arc::clone(&guard), Arc::clone(&handshakes));
            let timeout = Duration::from_millis(limits.cfg.handshake_timeout_ms);
            tokio::spawn(async move {
                let done = tokio::select! {
                    done = tokio::time::timeout(timeout, guard.accept(stream)) => done,
                    // Evicted for a newer connection (counted there).
                    () = slot.closed() => return,
                };
                let why = match done {
                    Ok(Ok((io, cert))) => {
                        let conn = GuardedTcp { io, side: TcpPeer { remote, cert } };
                        let _ = tx.send(Ok(Conn::holding(conn, Hold::Slot(slot), idle))).await;
                        return;
                    }
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => "no TLS handshake within limits.handshake_timeout_ms".to_string(),
                };
                handshakes
                    .lock()
                    .note_as("TLS handshakes refused", &format!("{} from {remote}: {why}", guard.endpoint()));
            });
        }
    });
    ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Finding 4 of issue 14: out of descriptors, the accept loop spun at 100% CPU. Each error
    /// now waits, from 5 ms doubling to at most 1 s, and a success starts over.
    #[tokio::test(start_paused = true)]
    async fn accept_errors_back_off_doubling_to_a_second_and_reset_on_success() {
        let mut errors = AcceptErrors::new("unix");
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        let mut waited = Vec::new();
        for _ in 0..10 {
            let t = tokio::time::Instant::now();
            errors.failed(&emfile).await;
            waited.push(t.elapsed().as_millis());
        }
        assert_eq!(waited, [5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        // Ten errors in under 3.3 s of waiting: a loop of them cannot spin.
        errors.ok();
        let t = tokio::time::Instant::now();
        errors.failed(&emfile).await;
        assert_eq!(t.elapsed().as_millis(), 5);
        assert_eq!(errors.unlogged, 10, "one log line for the first error, none since (at most every 10 s)");
    }
}
