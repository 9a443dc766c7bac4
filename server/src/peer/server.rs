//! The `peer.listen` endpoint: other daemons pull blocks from this one. Connections are
//! accepted and authenticated on the runtime (TLS handshake, hello, credentials: [`admit`]),
//! within `peer.connect_timeout_ms` in all, at most [`MAX_UNAUTHENTICATED`] at once (one more
//! closes the oldest). Only authenticated peers reach the serving threads (`kv-peer-serve`,
//! `peer.max_connections` of them, fed by a bounded queue): each block goes from its G2 pages (or
//! a G3 read) to the socket without another copy, with its checksum computed on the way.
//!
//! So a flood of clients that connect and send their hello slowly, or nothing, holds neither a
//! serving thread nor the queue, and cannot keep a real peer out: it is cut at the deadline, and
//! a real peer, which authenticates in one round trip, is never the oldest unauthenticated
//! connection for long. Refusals are counted in `kvcached_peer_refused_total{why}`: `handshake`
//! (TLS), `hello` (not a peer's), `credentials`, `handshake_deadline` (not authenticated within
//! `peer.connect_timeout_ms`), `evicted` (the oldest unauthenticated, closed for a newcomer),
//! `busy` (authenticated, every serving thread and the queue taken), `namespace`, `revoked` (an
//! open connection whose token left `tokens_file`, or whose certificate no longer chains to
//! `tls_client_ca`: checked before each request and once a second between requests, so a
//! revocation cuts open connections off within about a second).

use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError, bounded};
use kvnet::slots::Slots;
use kvnet::{Guard, Identity, PeerCert, SyncStream};
use kvtiers::{BlockBuf, BlockStore};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::PeerConfig;
use super::protocol::{self as p, BlockHeader};

/// Connections not yet authenticated (TLS handshake, hello) at once; one more closes the oldest
/// of them (`kvcached_peer_refused_total{why="evicted"}`). Each is a task and a socket, not a
/// thread; the bound keeps a flood from taking every descriptor.
pub const MAX_UNAUTHENTICATED: usize = 64;

/// Every `why` of `kvcached_peer_refused_total`.
pub const REFUSALS: &[&str] =
    &["handshake", "hello", "credentials", "handshake_deadline", "evicted", "busy", "namespace", "revoked"];

fn refused(why: &'static str) {
    metrics::counter!("kvcached_peer_refused_total", "why" => why).increment(1);
}

/// An authenticated peer, for a serving thread, with what it presented (checked again while
/// the connection is open).
struct Admitted {
    c: SyncStream,
    who: Identity,
    cert: PeerCert,
    token: Option<String>,
    remote: SocketAddr,
}

/// Serves peers on `listener` until `stop` turns true. Returns when the accept loop, the
/// authentications under way and every serving thread have finished.
pub async fn serve(
    listener: TcpListener,
    guard: Arc<Guard>,
    store: Arc<BlockStore>,
    cfg: PeerConfig,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let stopping = Arc::new(AtomicBool::new(false));
    let serving = cfg.max_connections.max(1);
    let (tx, rx) = bounded::<Admitted>(serving);
    let mut threads = Vec::new();
    for i in 0..serving {
        let rx: Receiver<Admitted> = rx.clone();
        let (guard, store, stopping) = (Arc::clone(&guard), Arc::clone(&store), Arc::clone(&stopping));
        let times = Times {
            io: Duration::from_millis(cfg.io_timeout_ms),
            idle: Duration::from_millis(cfg.idle_timeout_ms.max(1)),
        };
        let t = std::thread::Builder::new().name(format!("kv-peer-serve-{i}")).spawn(move || {
            let mut buf = BlockBuf::new();
            while let Ok(a) = rx.recv() {
                let remote = a.remote;
                if let Err(e) = serve_one(a, &guard, &store, &stopping, times, &mut buf) {
                    tracing::debug!(%remote, "peer connection ended: {e}");
                }
            }
        });
        match t {
            Ok(t) => threads.push(t),
            Err(e) => tracing::error!("cannot start a peer serving thread: {e}"),
        }
    }
    drop(rx);
    let deadline = Duration::from_millis(cfg.connect_timeout_ms);
    let unauthenticated: Slots<()> = Slots::new();
    let mut admitting = tokio::task::JoinSet::new();
    loop {
        while admitting.try_join_next().is_some() {}
        tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((tcp, remote)) => {
                    let _ = tcp.set_nodelay(true);
                    // Never touched: the one idle longest is the oldest.
                    if unauthenticated.len() >= MAX_UNAUTHENTICATED && unauthenticated.evict_idle().is_some() {
                        refused("evicted");
                    }
                    let slot = unauthenticated.insert(());
                    let (guard, tx) = (Arc::clone(&guard), tx.clone());
                    admitting.spawn(async move {
                        let admitted = tokio::select! {
                            a = tokio::time::timeout(deadline, admit(tcp, &guard, &tx)) => a,
                            () = slot.closed() => return,
                        };
                        drop(slot);
                        let (c, who, cert, token) = match admitted {
                            Ok(Ok(a)) => a,
                            Ok(Err(e)) => {
                                tracing::debug!(%remote, "peer connection refused: {e}");
                                return;
                            }
                            Err(_) => {
                                refused("handshake_deadline");
                                tracing::debug!(%remote, "peer connection not authenticated within peer.connect_timeout_ms");
                                return;
                            }
                        };
                        if let Err(TrySendError::Full(_)) = tx.try_send(Admitted { c, who, cert, token, remote }) {
                            refused("busy");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!("peer accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
    // Authentications under way end here (their clients see the connection close), so that no
    // sender outlives the queue's.
    admitting.shutdown().await;
    stopping.store(true, Ordering::Release);
    drop(tx);
    let _ = tokio::task::spawn_blocking(move || {
        for t in threads {
            let _ = t.join();
        }
    })
    .await;
}

/// The hello's bytes, read exactly (nothing of what follows), then parsed.
async fn read_hello(r: &mut (impl AsyncRead + Unpin)) -> std::io::Result<Option<String>> {
    let mut hello = vec![0u8; p::MAGIC.len() + 2];
    r.read_exact(&mut hello).await?;
    if hello[..p::MAGIC.len()] != p::MAGIC {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "not a kvcached peer (hello magic)"));
    }
    let n = usize::from(u16::from_le_bytes([hello[4], hello[5]]));
    if n > p::MAX_TOKEN {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "token longer than 4096 bytes"));
    }
    hello.resize(hello.len() + n, 0);
    r.read_exact(&mut hello[p::MAGIC.len() + 2..]).await?;
    p::read_hello(&mut &hello[..])
}

/// Authenticates a connection on the runtime: the TLS handshake, the hello, the credentials, the
/// answer to the hello; the connection, on a blocking socket, and who it is. The caller bounds
/// it in time. An authenticated peer is told no (`busy`) when the serving threads and their
/// queue are full.
async fn admit(
    tcp: TcpStream,
    guard: &Guard,
    queue: &Sender<Admitted>,
) -> Result<(SyncStream, Identity, PeerCert, Option<String>), String> {
    let (mut s, cert) = guard.accept(tcp).await.map_err(|e| {
        refused("handshake");
        e.to_string()
    })?;
    let token = read_hello(&mut s).await.map_err(|e| {
        refused("hello");
        e.to_string()
    })?;
    let verdict = match guard.authenticate(&cert, token.as_deref()) {
        Ok(_) if queue.is_full() => Err((
            "busy",
            format!(
                "{}: every serving thread is taken (peer.max_connections {}); try again",
                guard.endpoint(),
                queue.capacity().unwrap_or(0)
            ),
        )),
        Ok(who) => Ok(who),
        Err(r) => Err(("credentials", r.to_string())),
    };
    let mut answer = Vec::new();
    let text = verdict.as_ref().err().map_or("", |(_, why)| why.as_str());
    answer.push(u8::from(verdict.is_err()));
    p::write_text(&mut answer, None, text).map_err(|e| e.to_string())?;
    s.write_all(&answer).await.map_err(|e| e.to_string())?;
    s.flush().await.map_err(|e| e.to_string())?;
    match verdict {
        Ok(who) => Ok((s.into_blocking().map_err(|e| e.to_string())?, who, cert, token)),
        Err((why, text)) => {
            refused(why);
            Err(text)
        }
    }
}

/// A serving thread's timeouts: a peer silent mid-request (`peer.io_timeout_ms`), a
/// connection idle between requests (`peer.idle_timeout_ms`).
#[derive(Debug, Clone, Copy)]
struct Times {
    io: Duration,
    idle: Duration,
}

/// Whether what `a` presented at its hello is still accepted (the files may have changed):
/// its identity now, or the connection is closed and counted.
fn still_admitted(a: &Admitted, guard: &Guard) -> std::io::Result<Identity> {
    guard.authenticate(&a.cert, a.token.as_deref()).map_err(|r| {
        refused("revoked");
        tracing::info!(remote = %a.remote, "peer connection closed: {r}");
        std::io::Error::new(std::io::ErrorKind::PermissionDenied, r.to_string())
    })
}

/// Serves an authenticated peer's requests until it says BYE, is idle past `peer.idle_timeout_ms`,
/// fails, is no longer admitted, or the daemon stops.
fn serve_one(
    mut a: Admitted,
    guard: &Guard,
    store: &BlockStore,
    stopping: &AtomicBool,
    t: Times,
    buf: &mut BlockBuf,
) -> std::io::Result<()> {
    a.c.tcp().set_write_timeout(Some(t.io))?;
    loop {
        // Between requests: wake each second to notice a shutdown or a revocation.
        a.c.tcp().set_read_timeout(Some(Duration::from_secs(1).min(t.idle)))?;
        let idle_since = Instant::now();
        let op = loop {
            match p::read_u8(&mut a.c) {
                Ok(op) => break op,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    if stopping.load(Ordering::Acquire) || idle_since.elapsed() >= t.idle {
                        return Ok(());
                    }
                    still_admitted(&a, guard)?;
                }
                Err(e) => return Err(e),
            }
        };
        a.who = still_admitted(&a, guard)?;
        let c = &mut a.c;
        c.tcp().set_read_timeout(Some(t.io))?;
        match op {
            p::OP_PULL => {
                let (ns, keys) = p::read_pull(c)?;
                send_blocks(c, guard, &a.who, store, ns, &keys, buf)?;
            }
            p::OP_PROBE => {
                let n = p::read_u32(c)?.min(p::MAX_PROBE);
                let zeros = vec![0u8; 1 << 20];
                let mut left = n as usize;
                while left > 0 {
                    let k = left.min(zeros.len());
                    c.write_all(&zeros[..k])?;
                    left -= k;
                }
                p::write_end(c, 0)?;
            }
            p::OP_BYE => return Ok(()),
            other => {
                return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("unknown op {other}")));
            }
        }
    }
}

/// Sets TCP_CORK: while it is on, the kernel sends only full segments. A block goes out corked
/// from its header to its trailer, so that neither the small header nor the end of each step
/// leaves as a segment of its own; uncorking after the trailer sends the block's last bytes at
/// once, so a receiver can use each block as soon as it is complete. Best effort: where the
/// option fails, the block still goes out, in more segments.
fn cork(tcp: &std::net::TcpStream, on: bool) {
    use std::os::fd::AsRawFd;
    let v = libc::c_int::from(on);
    // SAFETY: setsockopt on the fd of a socket this connection owns, with a c_int of its size.
    unsafe {
        libc::setsockopt(
            tcp.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_CORK,
            (&raw const v).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// Sends the blocks of `keys` in order until the first this daemon lacks, then END.
fn send_blocks(
    c: &mut SyncStream,
    guard: &Guard,
    who: &Identity,
    store: &BlockStore,
    ns: kvproto::NamespaceId,
    keys: &[kvproto::BlockKey],
    buf: &mut BlockBuf,
) -> std::io::Result<()> {
    if let Err(r) = guard.check_namespace(who, &ns) {
        metrics::counter!("kvcached_peer_refused_total", "why" => "namespace").increment(1);
        return p::write_text(c, Some(p::TAG_REFUSED), &r.to_string()).and_then(|()| c.flush());
    }
    let mut sent = 0u32;
    for key in keys {
        let wrote = store.read_with(key, buf, |meta, pieces| -> std::io::Result<bool> {
            // Keys bind their namespace; a block of another namespace is not this one.
            if meta.namespace != ns {
                return Ok(false);
            }
            let head = BlockHeader { key: *key, parent: meta.parent, len: meta.len }.encode();
            cork(c.tcp(), true);
            c.write_all(&head)?;
            let mut h = p::block_sum();
            for piece in pieces {
                for step in piece.chunks(p::HASH_STEP) {
                    // Summed after the kernel's copy has brought the step into cache: summed
                    // first, the sum was the pass that read it from memory, and on loopback that
                    // cost 20-25% of the pull's throughput (docs/benchmarks.md, "Peer transfer").
                    c.write_all(step)?;
                    h.update(step);
                }
            }
            c.write_all(&h.finalize().to_le_bytes())?;
            c.flush()?;
            cork(c.tcp(), false);
            Ok(true)
        });
        match wrote {
            Ok(Some((_, Ok(true)))) => sent += 1,
            Ok(Some((_, Err(e)))) => return Err(e),
            Ok(Some((_, Ok(false)))) | Ok(None) => break,
            Err(e) => {
                tracing::warn!(%key, "a peer asked for a block this daemon cannot read: {e}");
                break;
            }
        }
    }
    metrics::counter!("kvcached_peer_served_blocks_total").increment(u64::from(sent));
    p::write_end(c, sent)
}
