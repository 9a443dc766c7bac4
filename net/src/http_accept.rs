//! The accept side of an HTTP endpoint: [`GuardedListener`] runs each TLS handshake in a task
//! of its own, bounded in time and in number (the oldest closed for a newcomer), so a slow or
//! hostile client never holds the accept loop; the verified client certificate travels with
//! the connection ([`PeerInfo`]). Below [`crate::http`] and [`crate::http_serve`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::serve::Listener;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::guard::{Guard, PeerCert};
use crate::slots::Slots;
use crate::tls::Stream;

/// TLS handshakes in flight at once (each costs a task and TLS buffers, and a flood of silent
/// ones must not pile up): one more closes the oldest, so that a flood of slow handshakes cannot
/// keep a real client out (`kvnet_http_refusals_total{reason="handshake_evicted"}`).
const MAX_HANDSHAKES: usize = 1024;

/// Accepted connections waiting for the server to take them.
const HANDOFF: usize = 64;

/// The connection a request came on: the client's address and the certificate it presented
/// (verified in the handshake). Handlers see it as `ConnectInfo<PeerInfo>`.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    pub remote: SocketAddr,
    pub cert: PeerCert,
}

/// A warning at most every 10 s, with how many happened since the last one: a flood of bad
/// handshakes must not flood the log.
#[derive(Debug, Default)]
pub(crate) struct Quiet {
    since: u64,
    last: Option<Instant>,
}

impl Quiet {
    pub(crate) fn note(&mut self, endpoint: &str, what: &str) {
        self.since += 1;
        if self.last.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
            tracing::warn!(endpoint, refused = self.since, "connection refused: {what}");
            self.since = 0;
            self.last = Some(Instant::now());
        }
    }
}

type Accepted = (Stream<TcpStream>, PeerInfo);

/// A TCP listener whose connections have passed the guard's handshake (TLS when the endpoint
/// speaks it), for `axum::serve`. Each TLS handshake runs in a task of its own; the listening
/// socket itself stays here, so it closes when this is dropped (a restarted server can bind the
/// same port at once).
#[derive(Debug)]
pub struct GuardedListener {
    listener: TcpListener,
    guard: Arc<Guard>,
    timeout: Duration,
    /// The handshakes in flight.
    handshakes: Slots<()>,
    refused: Arc<parking_lot::Mutex<Quiet>>,
    tx: mpsc::Sender<Accepted>,
    rx: mpsc::Receiver<Accepted>,
}

impl GuardedListener {
    /// Accepts on `listener` through `guard`; a client that has not finished its handshake
    /// after `handshake_timeout` is dropped.
    pub fn new(listener: TcpListener, guard: Arc<Guard>, handshake_timeout: Duration) -> Self {
        let (tx, rx) = mpsc::channel(HANDOFF);
        Self { listener, guard, timeout: handshake_timeout, handshakes: Slots::new(), refused: Arc::default(), tx, rx }
    }

    /// Starts the handshake of a new TLS connection in a task of its own; it hands the
    /// connection back through the channel when done.
    fn handshake(&self, tcp: TcpStream, remote: SocketAddr) {
        if self.handshakes.len() >= MAX_HANDSHAKES && self.handshakes.evict_idle().is_some() {
            metrics::counter!(
                "kvnet_http_refusals_total",
                "endpoint" => self.guard.endpoint().to_string(),
                "reason" => "handshake_evicted"
            )
            .increment(1);
            self.refused.lock().note(
                self.guard.endpoint(),
                &format!("{MAX_HANDSHAKES} TLS handshakes in flight: the oldest closed for {remote}"),
            );
        }
        let slot = self.handshakes.insert(());
        let (guard, tx, refused, timeout) =
            (Arc::clone(&self.guard), self.tx.clone(), Arc::clone(&self.refused), self.timeout);
        tokio::spawn(async move {
            let done = tokio::select! {
                done = tokio::time::timeout(timeout, guard.accept(tcp)) => done,
                // Evicted for a newer handshake (counted there).
                () = slot.closed() => return,
            };
            drop(slot);
            let why = match done {
                Ok(Ok((io, cert))) => {
                    let _ = tx.send((io, PeerInfo { remote, cert })).await;
                    return;
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no TLS handshake within {} s", timeout.as_secs_f64()),
            };
            refused.lock().note(guard.endpoint(), &format!("{remote}: {why}"));
        });
    }
}

/// Errors of one connection (reset before it was accepted) are nothing; others (out of file
/// descriptors) back off a second, as axum's own listener does, and are logged.
async fn accept_failed(endpoint: &str, e: &std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(e.kind(), ConnectionAborted | ConnectionRefused | ConnectionReset) {
        return;
    }
    tracing::error!(endpoint, "cannot accept connections: {e}; backing off 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

impl Listener for GuardedListener {
    type Io = Stream<TcpStream>;
    type Addr = PeerInfo;

    // Cancel-safe (axum drops it at shutdown): both branches are, and nothing between an
    // accept and its hand-off awaits.
    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            tokio::select! {
                Some(done) = self.rx.recv() => return done,
                accepted = self.listener.accept() => match accepted {
                    Ok((tcp, remote)) => {
                        let _ = tcp.set_nodelay(true);
                        if !self.guard.tls() {
                            return (Stream::Plain(tcp), PeerInfo { remote, cert: PeerCert::default() });
                        }
                        self.handshake(tcp, remote);
                    }
                    Err(e) => accept_failed(self.guard.endpoint(), &e).await,
                },
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(PeerInfo { remote: self.listener.local_addr()?, cert: PeerCert::default() })
    }
}

impl GuardedListener {
    /// The endpoint's name, for logs and metrics.
    pub fn endpoint(&self) -> &str {
        self.guard.endpoint()
    }
}
