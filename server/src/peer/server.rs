//! The `peer.listen` endpoint: other daemons pull blocks from this one. Connections are
//! accepted on the runtime and served on threads (`kv-peer-serve`, `peer.max_connections` of
//! them, fed by a bounded queue): each block goes from its G2 pages (or a G3 read) to the
//! socket without another copy, with its checksum computed on the way.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, TrySendError, bounded};
use kvnet::{Guard, Identity, SyncStream};
use kvtiers::{BlockBuf, BlockStore};
use tokio::net::TcpListener;

use super::PeerConfig;
use super::protocol::{self as p, BlockHeader};

/// A client between requests may stay this long.
const IDLE: Duration = Duration::from_secs(60);

/// Serves peers on `listener` until `stop` turns true. Returns when the accept loop and every
/// serving thread have finished.
pub async fn serve(
    listener: TcpListener,
    guard: Arc<Guard>,
    store: Arc<BlockStore>,
    cfg: PeerConfig,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let stopping = Arc::new(AtomicBool::new(false));
    let (tx, rx) = bounded::<std::net::TcpStream>(cfg.max_connections.max(1));
    let mut threads = Vec::new();
    for i in 0..cfg.max_connections.max(1) {
        let rx: Receiver<std::net::TcpStream> = rx.clone();
        let (guard, store, stopping) = (Arc::clone(&guard), Arc::clone(&store), Arc::clone(&stopping));
        let io = Duration::from_millis(cfg.io_timeout_ms);
        let handshake = Duration::from_millis(cfg.connect_timeout_ms);
        let t = std::thread::Builder::new().name(format!("kv-peer-serve-{i}")).spawn(move || {
            let mut buf = BlockBuf::new();
            while let Ok(tcp) = rx.recv() {
                let peer = tcp.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                if let Err(e) = serve_one(tcp, &guard, &store, &stopping, io, handshake, &mut buf) {
                    tracing::debug!(peer, "peer connection ended: {e}");
                }
            }
        });
        match t {
            Ok(t) => threads.push(t),
            Err(e) => tracing::error!("cannot start a peer serving thread: {e}"),
        }
    }
    drop(rx);
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((tcp, addr)) => {
                    let _ = tcp.set_nodelay(true);
                    let std_tcp = match tcp.into_std().and_then(|s| s.set_nonblocking(false).map(|()| s)) {
                        Ok(s) => s,
                        Err(e) => { tracing::warn!(%addr, "peer connection: {e}"); continue; }
                    };
                    if let Err(TrySendError::Full(s)) = tx.try_send(std_tcp) {
                        metrics::counter!("kvcached_peer_refused_total", "why" => "busy").increment(1);
                        drop(s);
                    }
                }
                Err(e) => {
                    tracing::warn!("peer accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
    stopping.store(true, Ordering::Release);
    drop(tx);
    let _ = tokio::task::spawn_blocking(move || {
        for t in threads {
            let _ = t.join();
        }
    })
    .await;
}

fn serve_one(
    tcp: std::net::TcpStream,
    guard: &Guard,
    store: &BlockStore,
    stopping: &AtomicBool,
    io: Duration,
    handshake: Duration,
    buf: &mut BlockBuf,
) -> std::io::Result<()> {
    let (mut c, cert) = guard.accept_blocking(tcp, handshake).map_err(|e| {
        metrics::counter!("kvcached_peer_refused_total", "why" => "handshake").increment(1);
        std::io::Error::other(e.to_string())
    })?;
    c.tcp().set_read_timeout(Some(handshake))?;
    c.tcp().set_write_timeout(Some(io))?;
    let token = p::read_hello(&mut c)?;
    let who = match guard.authenticate(&cert, token.as_deref()) {
        Ok(id) => {
            c.write_all(&[0])?;
            p::write_text(&mut c, None, "")?;
            c.flush()?;
            id
        }
        Err(r) => {
            metrics::counter!("kvcached_peer_refused_total", "why" => "credentials").increment(1);
            c.write_all(&[1])?;
            p::write_text(&mut c, None, &r.to_string())?;
            c.flush()?;
            return Ok(());
        }
    };
    loop {
        // Between requests: wake each second to notice a shutdown.
        c.tcp().set_read_timeout(Some(Duration::from_secs(1)))?;
        let idle_since = Instant::now();
        let op = loop {
            match p::read_u8(&mut c) {
                Ok(op) => break op,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    if stopping.load(Ordering::Acquire) || idle_since.elapsed() > IDLE {
                        return Ok(());
                    }
                }
                Err(e) => return Err(e),
            }
        };
        c.tcp().set_read_timeout(Some(io))?;
        match op {
            p::OP_PULL => {
                let (ns, keys) = p::read_pull(&mut c)?;
                send_blocks(&mut c, guard, &who, store, ns, &keys, buf)?;
            }
            p::OP_PROBE => {
                let n = p::read_u32(&mut c)?.min(p::MAX_PROBE);
                let zeros = vec![0u8; 1 << 20];
                let mut left = n as usize;
                while left > 0 {
                    let k = left.min(zeros.len());
                    c.write_all(&zeros[..k])?;
                    left -= k;
                }
                p::write_end(&mut c, 0)?;
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
