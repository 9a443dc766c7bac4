//! Peer transfer: the pull of 2 MiB blocks from one daemon's G2 into another's, beside the
//! physical limit between the same two endpoints in the same run (a raw TCP copy loop: one
//! side writes a buffer, the other reads into one) and beside HTTP/2 streaming of the same
//! bytes with the frame and window sizes the daemon's gRPC server uses (what a gRPC stream of
//! the blocks would ride on, before protobuf's own copies). On loopback, or across two network
//! namespaces joined by a veth pair shaped with `tc` (`--netns-mbit`).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvcached::peer::{PeerConfig, Peers};
use kvproto::{BlockKey, NamespaceId};
use kvtiers::{BlockMeta, BlockStore, BlockStoreConfig, HostTierConfig, WriteThroughConfig};

/// One row: what, MB/s.
#[derive(Debug, Clone)]
pub struct Row {
    pub what: String,
    pub mbs: f64,
}

/// Everything measured.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub link: String,
    pub rows: Vec<Row>,
    /// (what, ms until a 64-block prompt is loadable once its engine asks)
    pub ready: Vec<(String, f64)>,
}

fn store(dir: &std::path::Path, bytes: u64) -> Result<Arc<BlockStore>, String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let cfg = BlockStoreConfig {
        g2: HostTierConfig { shm_dir: dir.to_path_buf(), ..HostTierConfig::with_capacity(bytes) },
        g3: None,
        write_through: WriteThroughConfig::default(),
        g4: None,
        g4_write_through: WriteThroughConfig::default(),
    };
    BlockStore::open(&cfg).map(Arc::new).map_err(|e| e.to_string())
}

fn key(i: u32) -> BlockKey {
    let mut k = [0u8; 16];
    k[..4].copy_from_slice(&i.to_le_bytes());
    k[15] = 0x9e;
    BlockKey(k)
}

const NS: NamespaceId = NamespaceId([0x5e; 16]);

fn mbs(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e6
}

/// Runs `f` on a thread in network namespace `ns` (or here when `None`).
fn in_ns<R: Send + 'static>(ns: Option<&str>, f: impl FnOnce() -> R + Send + 'static) -> R {
    match ns {
        Some(ns) => kvtests::netns::run_in(ns, f),
        None => f(),
    }
}

/// Where a measurement's two ends run: the serving side at `addr_a` in network namespace
/// `ns_a`, the receiving side in `ns_b` (`None`: in this process's own).
#[derive(Debug, Clone)]
struct Ends {
    addr_a: String,
    ns_a: Option<String>,
    ns_b: Option<String>,
}

impl Ends {
    /// A listener of the serving side, on a free port.
    fn listen(&self) -> Result<TcpListener, String> {
        let bind = format!("{}:0", self.addr_a);
        in_ns(self.ns_a.as_deref(), move || TcpListener::bind(bind)).map_err(|e| e.to_string())
    }

    /// Runs `f` on the receiving side.
    fn at_b<R: Send + 'static>(&self, f: impl FnOnce() -> R + Send + 'static) -> R {
        in_ns(self.ns_b.as_deref(), f)
    }
}

/// A raw TCP copy loop of `total` bytes in `chunk`-byte writes, server to reader.
fn raw_tcp(ends: &Ends, total: u64, chunk: usize, region: bool) -> Result<f64, String> {
    let l = ends.listen()?;
    let addr = l.local_addr().map_err(|e| e.to_string())?.to_string();
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let buf = vec![0x5au8; if region { total as usize } else { chunk }];
        let (mut s, _) = l.accept()?;
        let _ = s.set_nodelay(true);
        let mut left = total;
        let mut at = 0usize;
        while left > 0 {
            let n = left.min(chunk as u64) as usize;
            s.write_all(&buf[at..at + n])?;
            left -= n as u64;
            if region {
                at += n;
            }
        }
        Ok(())
    });
    let took = ends
        .at_b(move || -> std::io::Result<Duration> {
            // Written once, so that the loop measures the copy, not the first touch of fresh pages.
            let mut buf = vec![1u8; if region { total as usize } else { chunk }];
            let mut s = TcpStream::connect(&addr)?;
            let t0 = Instant::now();
            let mut left = total;
            let mut at = 0usize;
            while left > 0 {
                let n = left.min(chunk as u64) as usize;
                s.read_exact(&mut buf[at..at + n])?;
                left -= n as u64;
                if region {
                    at += n;
                }
            }
            Ok(t0.elapsed())
        })
        .map_err(|e| e.to_string())?;
    server.join().map_err(|_| "raw server panicked".to_string())?.map_err(|e| e.to_string())?;
    Ok(mbs(total, took))
}

/// HTTP/2 streaming of `total` bytes in `chunk`-byte DATA frames of at most 1 MiB (the daemon's
/// gRPC settings: 1 MiB frames, 8 MiB stream and 16 MiB connection windows), received into a
/// buffer.
fn http2(ends: &Ends, total: u64, chunk: usize) -> Result<f64, String> {
    use http_body_util::{BodyExt, StreamBody};
    use hyper::body::Frame;
    let l = ends.listen()?;
    l.set_nonblocking(true).map_err(|e| e.to_string())?;
    let addr = l.local_addr().map_err(|e| e.to_string())?.to_string();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let server = rt.spawn(async move {
        let l = tokio::net::TcpListener::from_std(l)?;
        let (s, _) = l.accept().await?;
        let _ = s.set_nodelay(true);
        let svc = hyper::service::service_fn(move |_req| async move {
            let data = bytes::Bytes::from(vec![0x5au8; chunk]);
            let n = total.div_ceil(chunk as u64);
            let frames = futures_util::stream::iter(
                (0..n).map(move |_| Ok::<_, std::convert::Infallible>(Frame::data(data.clone()))),
            );
            Ok::<_, std::convert::Infallible>(hyper::Response::new(StreamBody::new(frames)))
        });
        hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .max_frame_size(1 << 20)
            .initial_stream_window_size(8 << 20)
            .initial_connection_window_size(16 << 20)
            .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
            .await
            .map_err(std::io::Error::other)
    });
    let took = ends.at_b(move || -> Result<Duration, String> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
        rt.block_on(async move {
            let s = tokio::net::TcpStream::connect(&addr).await.map_err(|e| e.to_string())?;
            let _ = s.set_nodelay(true);
            let (mut send, conn) = hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .max_frame_size(1 << 20)
                .initial_stream_window_size(8 << 20)
                .initial_connection_window_size(16 << 20)
                .handshake(hyper_util::rt::TokioIo::new(s))
                .await
                .map_err(|e| e.to_string())?;
            tokio::spawn(conn);
            let t0 = Instant::now();
            let req = hyper::Request::get("/")
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .map_err(|e| e.to_string())?;
            let mut body = send.send_request(req).await.map_err(|e| e.to_string())?.into_body();
            let mut buf = vec![0u8; chunk];
            let mut at = 0usize;
            let mut got = 0u64;
            while let Some(f) = body.frame().await {
                let f = f.map_err(|e| e.to_string())?;
                if let Ok(d) = f.into_data() {
                    // Into a block buffer, as a receiver must (gRPC would decode into a message).
                    let mut rest = &d[..];
                    while !rest.is_empty() {
                        let n = rest.len().min(chunk - at);
                        buf[at..at + n].copy_from_slice(&rest[..n]);
                        at = (at + n) % chunk;
                        rest = &rest[n..];
                    }
                    got += d.len() as u64;
                }
            }
            if got != total {
                return Err(format!("HTTP/2 stream ended at {got} of {total} bytes"));
            }
            Ok(t0.elapsed())
        })
    })?;
    rt.block_on(server).map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    Ok(mbs(total, took))
}

/// The pull of `blocks` blocks of `len` bytes from a peer server (the serving end) into another
/// store (the receiving end), verified and into G2: MB/s.
fn pull(ends: &Ends, blocks: u32, len: usize) -> Result<f64, String> {
    let took = pull_timed(ends, blocks, len, None)?;
    Ok(mbs(u64::from(blocks) * len as u64, took))
}

/// How long an engine that asks for the blocks waits until all are loadable (in G2): the pull
/// starts when it asks, or (`head_start`) that long before, as a router's prefetch hint starts
/// it when it places the request.
fn pull_timed(ends: &Ends, blocks: u32, len: usize, head_start: Option<Duration>) -> Result<Duration, String> {
    // The pools in shared memory (/dev/shm where it exists), as a daemon's are by default: a
    // pool file on a disk's filesystem would add page-cache writeback to the transfer.
    let shm = HostTierConfig::with_capacity(0).shm_dir;
    let dir = tempfile::tempdir_in(&shm).map_err(|e| format!("{}: {e}", shm.display()))?;
    let cap = u64::from(blocks) * len as u64 * 2 + (64 << 20);
    let sender = store(&dir.path().join("a"), cap)?;
    let receiver = store(&dir.path().join("b"), cap)?;
    // As a daemon's pool is after `g2.prefault`: mapped, so the pull measures the transfer, not
    // the first touch of fresh pages.
    kvtiers::HostTier::prefault(&Arc::downgrade(receiver.g2()));
    let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    let keys: Vec<BlockKey> = (0..blocks).map(key).collect();
    for (i, k) in keys.iter().enumerate() {
        let meta = BlockMeta { namespace: NS, parent: i.checked_sub(1).map(|p| keys[p]), len: len as u64, owner: None };
        sender.put(*k, meta, &data).map_err(|e| e.to_string())?;
    }
    let l = ends.listen()?;
    l.set_nonblocking(true).map_err(|e| e.to_string())?;
    let addr = l.local_addr().map_err(|e| e.to_string())?;
    // Open: the bench measures the transfer; the namespaces it makes are its own.
    let mut cfg = PeerConfig::default();
    cfg.auth.open = true;
    cfg.peers = vec![addr.to_string()];
    let guard = Arc::new(kvnet::Guard::new("peer.auth", &cfg.auth, addr, &[]).map_err(|e| e.to_string())?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let server = {
        let (cfg, sender) = (cfg.clone(), Arc::clone(&sender));
        rt.spawn(async move {
            if let Ok(l) = tokio::net::TcpListener::from_std(l) {
                kvcached::peer::server::serve(l, guard, sender, cfg, stop_rx).await;
            }
        })
    };
    let peers = Arc::new(Peers::new(&cfg, Arc::clone(&receiver)).map_err(|e| e.to_string())?);
    let src = addr.to_string();
    let took = ends.at_b(move || -> Result<Duration, String> {
        let hinted = match head_start {
            Some(h) => {
                let p = peers.start(NS, keys.clone(), len as u64, std::slice::from_ref(&src));
                std::thread::sleep(h);
                p
            }
            None => None,
        };
        let t0 = Instant::now();
        let p = match hinted {
            Some(p) => p,
            None => peers.start(NS, keys, len as u64, &[src]).ok_or("the pull did not start")?,
        };
        let deadline = Instant::now() + Duration::from_secs(600);
        let last = p.keys.len() - 1;
        p.wait_for(last, deadline);
        let took = t0.elapsed();
        match p.progress() {
            (n, _) if n == p.keys.len() => Ok(took),
            (n, end) => Err(format!("pulled {n} blocks: {end:?}")),
        }
    })?;
    let _ = stop_tx.send(true);
    let _ = rt.block_on(server);
    Ok(took)
}

/// Runs every measurement: `blocks` blocks of 2 MiB; across a shaped veth pair when
/// `netns_mbit` is given.
pub fn run(blocks: u32, netns_mbit: Option<u64>) -> Result<Report, String> {
    let len = 2usize << 20;
    let total = u64::from(blocks) * len as u64;
    let pair = netns_mbit.map(|m| {
        let p = kvtests::netns::NodePair::new("pb");
        p.shape(m);
        p
    });
    let (ends, link) = match (&pair, netns_mbit) {
        (Some(p), Some(m)) => (
            Ends { addr_a: p.addr_a.clone(), ns_a: Some(p.a.clone()), ns_b: Some(p.b.clone()) },
            format!("veth shaped to {m} Mbit/s"),
        ),
        _ => (Ends { addr_a: "127.0.0.1".to_string(), ns_a: None, ns_b: None }, "loopback".to_string()),
    };
    let mut report = Report { link, rows: Vec::new(), ready: Vec::new() };
    // Alternate: raw, ours, HTTP/2, three rounds; report each one's median.
    let (mut raw, mut raw_region, mut ours, mut h2) = (vec![], vec![], vec![], vec![]);
    for _ in 0..3 {
        raw.push(raw_tcp(&ends, total, len, false)?);
        raw_region.push(raw_tcp(&ends, total, len, true)?);
        ours.push(pull(&ends, blocks, len)?);
        h2.push(http2(&ends, total, len)?);
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    report.rows.push(Row { what: "raw TCP copy loop (2 MiB writes / reads)".into(), mbs: median(raw) });
    report.rows.push(Row { what: "raw TCP from a region into a region".into(), mbs: median(raw_region) });
    report.rows.push(Row { what: "peer pull: 2 MiB blocks, G2 to G2, verified".into(), mbs: median(ours) });
    report.rows.push(Row { what: "HTTP/2 stream, gRPC's frame and window sizes".into(), mbs: median(h2) });
    if let Some(m) = netns_mbit {
        report.rows.push(Row { what: "link rate (tc)".into(), mbs: m as f64 / 8.0 });
    }
    // A 64-block prompt (128 MiB) the engine asks for 50 ms after the router placed it.
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut without = vec![];
    let mut with = vec![];
    for _ in 0..3 {
        without.push(ms(pull_timed(&ends, 64, len, None)?));
        with.push(ms(pull_timed(&ends, 64, len, Some(Duration::from_millis(50)))?));
    }
    report.ready.push(("no hint: the pull starts when the engine asks".into(), median(without)));
    report.ready.push(("prefetch hint at placement, engine asks 50 ms later".into(), median(with)));
    drop(pair);
    Ok(report)
}

/// The report as Markdown.
pub fn markdown(r: &Report) -> String {
    let base = r.rows.first().map_or(1.0, |x| x.mbs);
    let mut out = format!("| {} | MB/s | / raw TCP |\n|---|---|---|\n", r.link);
    for row in &r.rows {
        out += &format!("| {} | {:.0} | {:.2}x |\n", row.what, row.mbs, row.mbs / base);
    }
    out += "\n| 64 blocks of 2 MiB, loadable after the engine asks | ms |\n|---|---|\n";
    for (what, ms) in &r.ready {
        out += &format!("| {what} | {ms:.1} |\n");
    }
    out
}
