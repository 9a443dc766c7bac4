//! The daemon's TCP listeners against floods of connections that hold a place and do nothing
//! useful (issue 35, findings 4 and 5): slow peer hellos on `peer.listen`, half-open connections
//! on the metrics port, HTTP/2 prefaces alone on the TCP gRPC port. Each flood is larger than
//! the listener's bound; the real client (a peer with the right token, a probe, a scrape, a gRPC
//! Health call) is still served at once, and the flood's connections are cut or displaced
//! (docs/operations/security.md, "Connection floods").
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvcached::peer::protocol as p;
use kvclient::{Client, KvMemory, synthetic_block};
use kvproto::{BlockKey, Namespace, NamespaceId, pb};
use kvtests::fixture::small_layout as layout;
use kvtests::inproc::InProcess;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn ns() -> Namespace {
    kvtests::fixture::small_namespace("floods")
}

fn prompt(blocks: u32) -> Vec<u32> {
    kvtests::fixture::prompt(0, blocks)
}

/// The sum of the `/metrics` lines of `name` whose labels include `label` (e.g. `why="busy"`).
async fn metric(d: &InProcess, name: &str, label: &str) -> f64 {
    let text = reqwest::get(format!("http://{}/metrics", d.http)).await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

const TOKEN: &str = "decode-b-token-0123456789";
const BLOCKS: u32 = 4;
/// Slow clients on `peer.listen`: more than the serving threads and their queue (4 + 4) and
/// than the unauthenticated budget (64).
const SLOW_PEERS: usize = 80;
const PEER_DEADLINE_MS: u64 = 2_000;

/// A client that sends a peer hello a byte every 500 ms; how long the daemon kept it open (at
/// most 20 s).
async fn slow_hello(addr: SocketAddr) -> Duration {
    let t = Instant::now();
    let Ok(mut s) = TcpStream::connect(addr).await else { return t.elapsed() };
    let mut hello = Vec::new();
    p::write_hello(&mut hello, Some("not-the-token-but-long-enough")).unwrap();
    let mut buf = [0u8; 256];
    for b in hello.iter().cycle().take(40) {
        if s.write_all(&[*b]).await.is_err() {
            return t.elapsed();
        }
        match tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await {
            Err(_) => {}
            // Closed, reset, or answered (a refusal, then closed): cut either way.
            Ok(_) => return t.elapsed(),
        }
    }
    t.elapsed()
}

/// A peer's pull with `token`: every block the daemon sent, its checksum verified.
fn pull(addr: SocketAddr, token: &str, ns: NamespaceId, keys: &[BlockKey]) -> std::io::Result<Vec<Vec<u8>>> {
    let fail = |why: String| std::io::Error::other(why);
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    p::write_hello(&mut s, Some(token))?;
    let status = p::read_u8(&mut s)?;
    let msg = p::read_text(&mut s)?;
    if status != 0 {
        return Err(fail(format!("hello refused: {msg}")));
    }
    p::write_pull(&mut s, &ns, keys)?;
    let mut blocks = Vec::new();
    loop {
        match p::read_u8(&mut s)? {
            p::TAG_BLOCK => {
                let h = p::BlockHeader::read(&mut s)?;
                let mut data = vec![0u8; h.len as usize];
                s.read_exact(&mut data)?;
                let sum = p::read_u64(&mut s)?;
                let mut d = p::block_sum();
                d.update(&data);
                if d.finalize() != sum {
                    return Err(fail(format!("block {} arrived with a wrong checksum", blocks.len())));
                }
                blocks.push(data);
            }
            p::TAG_END => {
                let n = p::read_u32(&mut s)?;
                if n as usize != blocks.len() {
                    return Err(fail(format!("END says {n} blocks, {} arrived", blocks.len())));
                }
                break;
            }
            other => return Err(fail(format!("tag {other}"))),
        }
    }
    s.write_all(&[p::OP_BYE])?;
    Ok(blocks)
}

/// Finding 4: 40 clients sending the peer hello a byte at a time held all 16 serving threads
/// and their queue, and the real peer was closed at once. The hello is now read on the runtime
/// within `peer.connect_timeout_ms` in all, at most 64 unauthenticated connections at once (one
/// more closes the oldest): the slow ones are cut at the deadline, and a real peer pulls every
/// block at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_peer_hellos_cannot_keep_the_authorised_peer_out() {
    let files = tempfile::tempdir().unwrap();
    let tokens = files.path().join("tokens");
    std::fs::write(&tokens, format!("decode-b {TOKEN}\n")).unwrap();
    let peer: SocketAddr = format!("127.0.0.1:{}", kvtests::proc::free_port()).parse().unwrap();
    let d = InProcess::start(|c| {
        c.peer.listen = Some(peer);
        c.peer.auth.tokens_file = Some(tokens.clone());
        c.peer.max_connections = 4;
        c.peer.connect_timeout_ms = PEER_DEADLINE_MS;
    })
    .await;
    let len = layout().block_bytes() as usize;
    let mut mem = KvMemory::anonymous(&layout(), BLOCKS).unwrap();
    for b in 0..BLOCKS {
        mem.write_block(b, &synthetic_block(7, b, len));
    }
    let engine = Client::connect(&d.socket).await.unwrap();
    engine.register("owner", &ns(), &mem).await.unwrap();
    let slots: Vec<u32> = (0..BLOCKS).collect();
    assert_eq!(engine.save(&prompt(BLOCKS), 0, &slots).await.unwrap().stored, BLOCKS);

    let slow: Vec<_> = (0..SLOW_PEERS).map(|_| tokio::spawn(slow_hello(peer))).collect();
    // Every slow client connected and a byte or two into its hello.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let keys = ns().block_keys(&prompt(BLOCKS));
    let t = Instant::now();
    let got = tokio::task::spawn_blocking(move || pull(peer, TOKEN, ns().id(), &keys)).await.unwrap();
    let took = t.elapsed();
    let got = got.unwrap_or_else(|e| panic!("the authorised peer was kept out by {SLOW_PEERS} slow hellos: {e}"));
    assert_eq!(got.len(), BLOCKS as usize);
    for (b, data) in got.iter().enumerate() {
        assert_eq!(*data, synthetic_block(7, b as u32, len), "block {b} differs");
    }
    assert!(took < Duration::from_secs(2), "the pull took {took:?}");

    let cut = Duration::from_millis(PEER_DEADLINE_MS + 1_500);
    for (i, h) in slow.into_iter().enumerate() {
        let lived = h.await.unwrap();
        assert!(lived < cut, "slow client {i} was kept {lived:?}, past the {PEER_DEADLINE_MS} ms deadline");
    }
    let past_deadline = metric(&d, "kvcached_peer_refused_total", r#"why="handshake_deadline""#).await;
    let evicted = metric(&d, "kvcached_peer_refused_total", r#"why="evicted""#).await;
    assert!(past_deadline >= 1.0, "no slow client was counted at the deadline");
    assert!(evicted >= (SLOW_PEERS - 64) as f64, "{evicted} evicted of {SLOW_PEERS} (64 fit)");
    drop(engine);
    d.stop().await;
}

/// Finding 5a: 1,100 half-open connections on the metrics port (cap 1024) took `/healthz` and
/// `/metrics` away, and a kubelet would restart the daemon. Past the cap, a new connection now
/// takes the place of the one idle longest: probes and scrapes are answered at once while the
/// flood is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_connections_cannot_take_healthz_and_metrics_away() {
    const CAP: usize = 64;
    let d = InProcess::start(|c| c.http_limits.max_connections = CAP).await;
    let mut held = Vec::new();
    for _ in 0..CAP + 100 {
        held.push(TcpStream::connect(d.http).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    for path in ["/healthz", "/metrics"] {
        let t = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(5), reqwest::get(format!("http://{}{path}", d.http)))
            .await
            .unwrap_or_else(|_| panic!("{path}: no answer in 5 s"))
            .unwrap_or_else(|e| panic!("{path} refused while {} half-open connections are held: {e}", held.len()));
        assert_eq!(answer.status().as_u16(), 200, "{path}");
        assert!(t.elapsed() < Duration::from_secs(2), "{path} took {:?}", t.elapsed());
    }
    let evicted = metric(&d, "kvnet_http_refusals_total", r#"reason="evicted_idle""#).await;
    assert!(evicted >= 100.0, "{evicted} idle connections evicted, want at least 100");
    drop(held);
    d.stop().await;
}

/// Finding 5b: 100 connections sending only the HTTP/2 preface to the TCP gRPC port took every
/// connection TCP clients may hold (they are one principal, `limits.max_connections_per_uid`
/// 64), and gRPC Health was refused. A new connection now takes the place of the one idle
/// longest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preface_only_connections_cannot_take_grpc_health_away() {
    const FLOOD: usize = 100;
    let d = InProcess::start(|c| c.tcp = Some("127.0.0.1:0".parse().unwrap())).await;
    let tcp = d.tcp.unwrap();
    let mut held = Vec::new();
    for _ in 0..FLOOD {
        let mut s = TcpStream::connect(tcp).await.unwrap();
        s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
        held.push(s);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    let health = tokio::time::timeout(Duration::from_secs(5), async {
        let mut c = pb::kvcached_client::KvcachedClient::connect(format!("http://{tcp}")).await?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(c.health(pb::Empty {}).await?.into_inner().ok)
    })
    .await
    .unwrap_or_else(|_| panic!("no Health answer in 5 s"))
    .unwrap_or_else(|e| panic!("Health refused while {FLOOD} preface-only connections are held: {e}"));
    assert!(health);
    assert!(t.elapsed() < Duration::from_secs(2), "Health took {:?}", t.elapsed());
    let evicted = metric(&d, "kvcached_limit_refusals_by_limit_total", r#"limit="tcp_idle_evicted""#).await;
    assert!(evicted >= (FLOOD - 64) as f64, "{evicted} idle TCP connections evicted");
    drop(held);
    d.stop().await;
}
