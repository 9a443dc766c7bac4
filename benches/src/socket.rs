//! The daemon through its real socket: save and load throughput per block size beside memcpy in
//! the same run, lookup latency for a 128k-token prompt, and p50/p99 of small batches beside a
//! raw Unix-socket round trip of a 4-block lookup's message sizes, measured between them.
//!
//! Everything goes through `kvclient::Client` over the Unix socket of a `kvcached::serve`
//! started in this process (or an already running daemon given with `--socket`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvclient::{Client, KvMemory, synthetic_block};
use kvproto::{KvLayout, Namespace};

/// Bytes moved by one save or load call in the throughput runs.
const CALL_BYTES: u64 = 32 << 20;

/// What to run.
#[derive(Debug, Clone)]
pub struct SocketBench {
    /// A running daemon's socket; `None` starts one in this process.
    pub socket: Option<PathBuf>,
    /// Directory for the engine's shared-memory KV (and the in-process daemon's files).
    pub dir: PathBuf,
    /// Throughput calls per block size (each moves [`CALL_BYTES`]).
    pub calls: usize,
    /// Untimed calls per block size before those (saves of other prompts, loads).
    pub warmup: usize,
    /// Latency samples per operation.
    pub samples: usize,
    /// The in-process daemon writes through to G3 too.
    pub g3: bool,
    /// The in-process daemon's `engines.key_memo_bytes` (`None`: its default). With 0 every
    /// request derives its keys, which is what the first request for a prompt costs.
    pub key_memo_bytes: Option<u64>,
    /// The clients' token area in bytes (`None`: the client's default); 0 sends every prompt's
    /// tokens inline in the request.
    pub token_area_bytes: Option<usize>,
}

/// One row of the throughput table.
#[derive(Debug, Clone)]
pub struct Throughput {
    pub block: &'static str,
    pub memcpy_hot_gibs: f64,
    pub memcpy_pool_gibs: f64,
    pub save_gibs: f64,
    pub load_gibs: f64,
}

/// p50 / p99 of one operation.
#[derive(Debug, Clone)]
pub struct Latency {
    pub what: String,
    pub p50_us: f64,
    pub p99_us: f64,
}

/// Everything measured.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub throughput: Vec<Throughput>,
    pub latency: Vec<Latency>,
    /// A request and its answer of a 4-block lookup's sizes over a Unix stream socket, blocking
    /// I/O, between two threads, back to back: the floor under every row of `latency`.
    pub raw: Option<Latency>,
}

/// The raw exchange the lookups are measured against: a thread answering each `req`-byte
/// request with `ans` bytes over a Unix stream socket, both ends blocking.
struct RawPeer {
    sock: std::os::unix::net::UnixStream,
    req: Vec<u8>,
    ans: Vec<u8>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RawPeer {
    fn start(req: usize, ans: usize) -> std::io::Result<Self> {
        Self::start_with(req, ans, || {})
    }

    /// [`RawPeer::start`], the answering thread calling `first` before it answers anything.
    fn start_with(req: usize, ans: usize, first: impl FnOnce() + Send + 'static) -> std::io::Result<Self> {
        let (sock, peer) = std::os::unix::net::UnixStream::pair()?;
        let thread = answering_thread(peer, req, ans, first)?;
        Ok(Self { sock, req: vec![1u8; req], ans: vec![0u8; ans], thread: Some(thread) })
    }

    /// One request and its answer.
    fn round_trip(&mut self) -> std::io::Result<Duration> {
        use std::io::{Read, Write};
        let t0 = Instant::now();
        self.sock.write_all(&self.req)?;
        self.sock.read_exact(&mut self.ans)?;
        Ok(t0.elapsed())
    }
}

/// A thread that calls `first`, then answers each `req`-byte request on `peer` with `ans` bytes
/// (blocking I/O) until the other end closes.
fn answering_thread(
    mut peer: std::os::unix::net::UnixStream,
    req: usize,
    ans: usize,
    first: impl FnOnce() + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    use std::io::{Read, Write};
    std::thread::Builder::new().name("raw-peer".into()).spawn(move || {
        first();
        let (mut got, answer) = (vec![0u8; req], vec![7u8; ans]);
        while peer.read_exact(&mut got).is_ok() && peer.write_all(&answer).is_ok() {}
    })
}

/// The same exchange through tokio, on the runtime the client and (in process) the daemon run
/// on: what the async runtime's wake-ups add to the raw round trip. The answering end is a tokio
/// task, or (`blocking_peer`) a thread with blocking I/O.
struct AsyncPeer {
    sock: tokio::net::UnixStream,
    req: Vec<u8>,
    ans: Vec<u8>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl AsyncPeer {
    fn start(req: usize, ans: usize, blocking_peer: bool) -> std::io::Result<Self> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        if blocking_peer {
            let (sock, peer) = std::os::unix::net::UnixStream::pair()?;
            // Ends when this end closes (its read fails).
            answering_thread(peer, req, ans, || {})?;
            sock.set_nonblocking(true)?;
            let sock = tokio::net::UnixStream::from_std(sock)?;
            return Ok(Self { sock, req: vec![1u8; req], ans: vec![0u8; ans], task: None });
        }
        let (sock, mut peer) = tokio::net::UnixStream::pair()?;
        let task = tokio::spawn(async move {
            let (mut got, answer) = (vec![0u8; req], vec![7u8; ans]);
            while peer.read_exact(&mut got).await.is_ok() && peer.write_all(&answer).await.is_ok() {}
        });
        Ok(Self { sock, req: vec![1u8; req], ans: vec![0u8; ans], task: Some(task) })
    }

    async fn round_trip(&mut self) -> std::io::Result<Duration> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let t0 = Instant::now();
        self.sock.write_all(&self.req).await?;
        self.sock.read_exact(&mut self.ans).await?;
        Ok(t0.elapsed())
    }
}

impl Drop for AsyncPeer {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

/// Pins the calling thread to CPU `cpu` (false if the kernel refuses).
fn pin_to(cpu: usize) -> bool {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it; the call only
    // reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// `samples` raw round trips of `req` / `ans` bytes between two threads pinned to CPUs
/// `asking` and `answering` (on one CPU, each wake-up is a switch on it; on two, a wake-up of
/// the other CPU). `None` where the CPUs cannot be pinned.
fn pinned_round_trips(
    samples: usize,
    req: usize,
    ans: usize,
    asking: usize,
    answering: usize,
) -> Option<Vec<Duration>> {
    std::thread::scope(|s| {
        s.spawn(|| {
            if !pin_to(asking) {
                return None;
            }
            let (tx, rx) = std::sync::mpsc::channel();
            let mut peer = RawPeer::start_with(req, ans, move || {
                let _ = tx.send(pin_to(answering));
            })
            .ok()?;
            if !rx.recv().ok()? {
                return None;
            }
            (0..samples + 20).map(|_| peer.round_trip().ok()).skip(20).collect()
        })
        .join()
        .ok()
        .flatten()
    })
}

impl Drop for RawPeer {
    fn drop(&mut self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn layout(layers: u32, tokens_per_block: u32) -> KvLayout {
    KvLayout::bf16_8x128(layers, tokens_per_block)
}

fn gibs(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / (1u64 << 30) as f64
}

fn percentiles(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize].as_secs_f64() * 1e6;
    (at(0.5), at(0.99))
}

/// Tokens of prompt number `p` with `blocks` blocks of `tpb` tokens (distinct per `p`).
fn prompt(p: u32, blocks: u32, tpb: u32) -> Vec<u32> {
    (0..blocks * tpb).map(|i| (p.wrapping_mul(1_000_003) ^ i.wrapping_mul(2_654_435_761)) % 150_000).collect()
}

/// The memcpy baselines of one call's bytes: between two engine-sized buffers (hot: a load's
/// source, G2, is hot too when the same prompt is loaded again and again), and into a rotating
/// destination across 1 GiB of shared memory prepared like the G2 pool (fallocated, every page
/// mapped for writing, and written once, as the warm-up calls write the pool), which is what a
/// save writes into.
struct Baselines {
    src: Vec<u8>,
    dst: Vec<u8>,
    pool: memmap2::MmapMut,
    next: usize,
    _file: std::fs::File,
}

impl Baselines {
    fn new(dir: &Path, bytes: usize) -> std::io::Result<Self> {
        let src: Vec<u8> = (0..bytes).map(|i| (i * 31 % 251) as u8).collect();
        let dst = src.clone();
        let pool_len = 1usize << 30;
        let file = tempfile::tempfile_in(dir)?;
        // SAFETY: plain syscall on an owned fd.
        let r = unsafe { libc::posix_fallocate(std::os::fd::AsRawFd::as_raw_fd(&file), 0, pool_len as libc::off_t) };
        if r != 0 {
            return Err(std::io::Error::from_raw_os_error(r));
        }
        // SAFETY: a private temp file that outlives the mapping.
        let mut pool = unsafe { memmap2::MmapOptions::new().len(pool_len).map_mut(&file)? };
        // SAFETY: the range is our live mapping; populating changes no contents.
        if unsafe { libc::madvise(pool.as_mut_ptr().cast(), pool_len, libc::MADV_POPULATE_WRITE) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Written once, as the daemon's pool is by the warm-up calls: both sides are then
        // measured on memory that has been written before (docs/benchmarks.md).
        pool.fill(0x5a);
        Ok(Self { src, dst, pool, next: 0, _file: file })
    }

    /// One hot copy; its duration.
    fn hot(&mut self) -> Duration {
        let t0 = Instant::now();
        self.dst.copy_from_slice(std::hint::black_box(&self.src));
        std::hint::black_box(&self.dst);
        t0.elapsed()
    }

    /// One copy into the next slot of the pool; its duration.
    fn pool(&mut self) -> Duration {
        let n = self.src.len();
        let at = (self.next % (self.pool.len() / n)) * n;
        self.next += 1;
        let t0 = Instant::now();
        self.pool[at..at + n].copy_from_slice(std::hint::black_box(&self.src));
        std::hint::black_box(&self.pool[at]);
        t0.elapsed()
    }
}

/// An engine attached with `layout` and `slots` block slots, filled with synthetic KV.
async fn engine(
    cfg: &SocketBench,
    socket: &Path,
    name: &str,
    layout: &KvLayout,
    slots: u32,
) -> Result<(Client, KvMemory), String> {
    let mut mem = KvMemory::create_layer_separate(cfg.dir.join(name), layout, slots).map_err(|e| e.to_string())?;
    let len = layout.block_bytes() as usize;
    for b in 0..slots {
        mem.write_block(b, &synthetic_block(u64::from(b), b, len));
    }
    let mut c = Client::connect(socket).await.map_err(|e| e.to_string())?;
    if let Some(b) = cfg.token_area_bytes {
        c.set_token_area_bytes(b);
    }
    c.register(name, &Namespace::new(format!("kvbench/{name}"), *layout), &mem).await.map_err(|e| e.to_string())?;
    Ok((c, mem))
}

async fn throughput(
    cfg: &SocketBench,
    socket: &Path,
    name: &'static str,
    layout: KvLayout,
) -> Result<Throughput, String> {
    let bytes = layout.block_bytes();
    let per_call = (CALL_BYTES / bytes).max(1) as u32;
    let (c, _mem) = engine(cfg, socket, name, &layout, per_call * 2).await?;
    let tpb = layout.tokens_per_block;
    let save_slots: Vec<u32> = (0..per_call).collect();
    let load_slots: Vec<u32> = (per_call..per_call * 2).collect();
    let call_bytes = bytes * u64::from(per_call) * cfg.calls as u64;
    let mut base = Baselines::new(&cfg.dir, (bytes * u64::from(per_call)) as usize).map_err(|e| e.to_string())?;
    // Each call alternates with its baseline copy, so that the machine's drifting memory
    // bandwidth weighs on both alike.
    // Saves: a fresh prompt per call (fresh keys; at steady state the pool evicts).
    for i in 0..cfg.warmup {
        let p = prompt(u32::MAX - 1 - i as u32, per_call, tpb);
        c.save(&p, 0, &save_slots).await.map_err(|e| e.to_string())?;
    }
    let (mut pool_t, mut save_t) = (Duration::ZERO, Duration::ZERO);
    for i in 0..cfg.calls {
        pool_t += base.pool();
        let p = prompt(i as u32 + 1, per_call, tpb);
        let t0 = Instant::now();
        let r = c.save(&p, 0, &save_slots).await.map_err(|e| e.to_string())?;
        save_t += t0.elapsed();
        if r.failed > 0 {
            return Err(format!("save failed: {}", r.error));
        }
    }
    // Loads: one cached prompt into other slots, again and again.
    let p = prompt(u32::MAX, per_call, tpb);
    c.save(&p, 0, &save_slots).await.map_err(|e| e.to_string())?;
    for _ in 0..cfg.warmup {
        c.load_now(&p, 0, &load_slots).await.map_err(|e| e.to_string())?;
    }
    let (mut hot_t, mut load_t) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..cfg.calls {
        hot_t += base.hot();
        let t0 = Instant::now();
        let s = c.load_now(&p, 0, &load_slots).await.map_err(|e| e.to_string())?;
        load_t += t0.elapsed();
        if s.loaded_blocks != per_call {
            return Err(format!("loaded {} of {per_call} blocks", s.loaded_blocks));
        }
    }
    let (hot, pool) = (gibs(call_bytes, hot_t), gibs(call_bytes, pool_t));
    let (save, load) = (gibs(call_bytes, save_t), gibs(call_bytes, load_t));
    c.unregister().await.map_err(|e| e.to_string())?;
    Ok(Throughput { block: name, memcpy_hot_gibs: hot, memcpy_pool_gibs: pool, save_gibs: save, load_gibs: load })
}

async fn latencies(cfg: &SocketBench, socket: &Path, report: &mut Report) -> Result<(), String> {
    // A 128k-token prompt: 8192 blocks of 16 tokens (blocks of one layer, 64 KiB).
    let big = layout(1, 16);
    let (c, _mem) = engine(cfg, socket, "lookup128k", &big, 512).await?;
    let p = prompt(7, 8192, 16);
    let slots: Vec<u32> = (0..512).collect();
    for chunk in 0..16u32 {
        let r =
            c.save(&p[..((chunk + 1) * 512 * 16) as usize], chunk * 512, &slots).await.map_err(|e| e.to_string())?;
        if r.failed > 0 {
            return Err(format!("save failed: {}", r.error));
        }
    }
    let what = "lookup, 128k-token prompt (8192 blocks of 16 tokens)";
    report.latency.push(time_lookups(&c, cfg.samples, what, 8192, |_| p.clone()).await?);
    // A prompt the daemon has never seen, nothing of it cached (each sample another prompt).
    let what = "lookup, 128k-token prompt never seen (nothing cached)";
    report.latency.push(time_lookups(&c, cfg.samples, what, 0, |i| prompt(50_000 + i as u32, 8192, 16)).await?);
    c.unregister().await.map_err(|e| e.to_string())?;

    // A small batch: 4 blocks of 2 MiB (16 tokens, 32 layers x 8 KV heads x 128 dims, bf16).
    let small = layout(32, 16);
    let (c, _mem) = engine(cfg, socket, "small", &small, 8).await?;
    // The same lookups over gRPC, from an engine told not to use LOOKUP; which of the two asks
    // first after each save alternates.
    let (g, _gmem) = engine(cfg, socket, "small-grpc", &small, 8).await?;
    g.set_lookup_wire(false);
    let (mut save, mut lookup, mut lookup_grpc, mut load) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // The raw exchange has a lookup's sizes: the request with its tokens inline (the larger
    // form; with the token area the daemon reads them from shared memory) and the answer.
    let sizes = {
        let p = prompt(999, 4, 16);
        c.save(&p, 0, &[0, 1, 2, 3]).await.map_err(|e| e.to_string())?;
        let answer = c.lookup(&p).await.map_err(|e| e.to_string())?;
        let req = kvproto::pb::LookupRequest { engine_id: 1, tokens: kvproto::tokens_to_le(&p), ..Default::default() };
        (4 + prost::Message::encoded_len(&req), 4 + prost::Message::encoded_len(&answer))
    };
    let mut raw_peer = RawPeer::start(sizes.0, sizes.1).map_err(|e| format!("raw socket pair: {e}"))?;
    let mut raw = Vec::new();
    for i in 0..cfg.samples {
        let p = prompt(1_000 + i as u32, 4, 16);
        raw.push(raw_peer.round_trip().map_err(|e| format!("raw round trip: {e}"))?);
        let t0 = Instant::now();
        c.save(&p, 0, &[0, 1, 2, 3]).await.map_err(|e| e.to_string())?;
        save.push(t0.elapsed());
        for (client, v) in if i % 2 == 0 {
            [(&c, &mut lookup), (&g, &mut lookup_grpc)]
        } else {
            [(&g, &mut lookup_grpc), (&c, &mut lookup)]
        } {
            let t0 = Instant::now();
            client.lookup(&p).await.map_err(|e| e.to_string())?;
            v.push(t0.elapsed());
        }
        let t0 = Instant::now();
        c.load_now(&p, 0, &[4, 5, 6, 7]).await.map_err(|e| e.to_string())?;
        load.push(t0.elapsed());
    }
    for (what, v) in [("save", save), ("lookup", lookup), ("lookup over gRPC", lookup_grpc), ("load (wait)", load)] {
        let (p50, p99) = percentiles(v);
        report.latency.push(Latency { what: format!("{what}, 4 blocks of 2 MiB"), p50_us: p50, p99_us: p99 });
    }
    // Back to back, in turns of 20: the same cached lookup, and the raw exchange (both ends
    // awake, as on a busy engine's scheduler path).
    let p = prompt(999, 4, 16);
    let mut async_peer = AsyncPeer::start(sizes.0, sizes.1, false).map_err(|e| format!("async socket pair: {e}"))?;
    let mut half_peer = AsyncPeer::start(sizes.0, sizes.1, true).map_err(|e| format!("async socket pair: {e}"))?;
    let (mut hot_lookup, mut hot_raw, mut hot_async, mut hot_half) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut hot_blocking = Vec::new();
    while hot_raw.len() < cfg.samples {
        for _ in 0..20 {
            hot_raw.push(raw_peer.round_trip().map_err(|e| format!("raw round trip: {e}"))?);
        }
        for _ in 0..20 {
            hot_async.push(async_peer.round_trip().await.map_err(|e| format!("async round trip: {e}"))?);
        }
        for _ in 0..20 {
            hot_half.push(half_peer.round_trip().await.map_err(|e| format!("async round trip: {e}"))?);
        }
        for _ in 0..20 {
            let t0 = Instant::now();
            c.lookup(&p).await.map_err(|e| e.to_string())?;
            hot_lookup.push(t0.elapsed());
        }
        // The same lookups from a thread of their own, with blocking I/O on it (what the
        // blocking client and the Python package do).
        let (client, tokens) = (c.clone(), p.clone());
        let turn = tokio::task::spawn_blocking(move || -> Result<Vec<Duration>, String> {
            (0..20)
                .map(|_| {
                    let t0 = Instant::now();
                    match client.lookup_blocking(&tokens) {
                        Some(Ok(_)) => Ok(t0.elapsed()),
                        Some(Err(e)) => Err(e.to_string()),
                        None => Err("a blocking lookup could not go over LOOKUP".into()),
                    }
                })
                .collect()
        })
        .await
        .map_err(|e| e.to_string())??;
        hot_blocking.extend(turn);
    }
    drop(raw_peer);
    let exchange = format!("{}-byte request, {}-byte answer", sizes.0, sizes.1);
    let (p50_us, p99_us) = percentiles(hot_lookup);
    report.latency.push(Latency { what: "lookup, 4 blocks, back to back".into(), p50_us, p99_us });
    let (p50_us, p99_us) = percentiles(hot_blocking);
    let what = "lookup, 4 blocks, back to back, blocking on a thread of its own (`Client::lookup_blocking`)";
    report.latency.push(Latency { what: what.into(), p50_us, p99_us });
    let (p50_us, p99_us) = percentiles(raw);
    let what = format!("raw Unix-socket round trip between the operations above ({exchange})");
    report.latency.push(Latency { what, p50_us, p99_us });
    drop((async_peer, half_peer));
    let (p50_us, p99_us) = percentiles(hot_async);
    let what =
        format!("tokio Unix-socket round trip, both ends tasks on the client's runtime, back to back ({exchange})");
    report.latency.push(Latency { what, p50_us, p99_us });
    let (p50_us, p99_us) = percentiles(hot_half);
    let what = format!("tokio Unix-socket round trip to a blocking thread, back to back ({exchange})");
    report.latency.push(Latency { what, p50_us, p99_us });
    // Where the wake-ups land: both threads on one CPU, and on two.
    for (what, cpus) in [("both threads on CPU 0", (0, 0)), ("threads on CPUs 0 and 1", (0, 1))] {
        if let Some(v) = pinned_round_trips(cfg.samples, sizes.0, sizes.1, cpus.0, cpus.1) {
            let (p50_us, p99_us) = percentiles(v);
            let what = format!("raw Unix-socket round trip, {what}, back to back ({exchange})");
            report.latency.push(Latency { what, p50_us, p99_us });
        }
    }
    let (p50_us, p99_us) = percentiles(hot_raw);
    let what = format!("raw Unix-socket round trip, back to back ({exchange})");
    report.raw = Some(Latency { what, p50_us, p99_us });
    c.unregister().await.map_err(|e| e.to_string())?;
    g.unregister().await.map_err(|e| e.to_string())?;
    Ok(())
}

/// p50/p99 of `samples` lookups of `prompt_of(sample)`, each expected to match `expect` blocks.
async fn time_lookups(
    c: &Client,
    samples: usize,
    what: &str,
    expect: u32,
    prompt_of: impl Fn(usize) -> Vec<u32>,
) -> Result<Latency, String> {
    let mut v = Vec::with_capacity(samples);
    for i in 0..samples {
        let p = prompt_of(i);
        let t0 = Instant::now();
        let hit = c.lookup(&p).await.map_err(|e| e.to_string())?;
        v.push(t0.elapsed());
        if hit.matched_blocks != expect {
            return Err(format!("{what}: matched {} blocks, not {expect} (is G2 too small?)", hit.matched_blocks));
        }
    }
    let (p50_us, p99_us) = percentiles(v);
    Ok(Latency { what: what.into(), p50_us, p99_us })
}

/// Runs every measurement against `socket`.
pub async fn run_against(cfg: &SocketBench, socket: &Path) -> Result<Report, String> {
    let mut report = Report::default();
    for (name, l) in [("256KiB", layout(4, 16)), ("2MiB", layout(32, 16)), ("16MiB", layout(32, 128))] {
        report.throughput.push(throughput(cfg, socket, name, l).await?);
    }
    latencies(cfg, socket, &mut report).await?;
    Ok(report)
}

/// Runs the benchmark, starting a daemon in this process unless `cfg.socket` names one.
pub async fn run(cfg: &SocketBench) -> Result<Report, String> {
    if let Some(s) = &cfg.socket {
        return run_against(cfg, s).await;
    }
    let mut c = kvcached::Config {
        socket: cfg.dir.join("kvcached.sock"),
        metrics_addr: "127.0.0.1:0".parse().map_err(|e| format!("{e}"))?,
        ..Default::default()
    };
    c.g2.capacity_bytes = 2 << 30;
    c.g3.enabled = cfg.g3;
    c.g3.dir = cfg.dir.join("g3");
    c.g3.capacity_bytes = 4 << 30;
    c.g3.fsync = false;
    if let Some(b) = cfg.key_memo_bytes {
        c.engines.key_memo_bytes = b;
    }
    let c = c.resolve().map_err(|e| e.to_string())?;
    let socket = c.socket.clone();
    let listeners = kvcached::Listeners::bind(&c).await.map_err(|e| e.to_string())?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let daemon = tokio::spawn(kvcached::serve(c, listeners, async move {
        let _ = rx.await;
    }));
    // Let the daemon's background prefault map the 2 GiB pool first, as it has on a daemon
    // that has been up for a while (it zeroes and maps every page: seconds, and competing with
    // it for the two cores and the memory bandwidth would measure the prefault, not saves).
    let t0 = Instant::now();
    while !kvcached::edge::http::prometheus().render().lines().any(|l| l == "kvcached_g2_prefault_done 1") {
        if t0.elapsed() > Duration::from_secs(300) {
            return Err("the daemon's G2 prefault did not finish in 300 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = run_against(cfg, &socket).await;
    let _ = tx.send(());
    match daemon.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(format!("daemon: {e}")),
        Err(e) => return Err(format!("daemon task: {e}")),
    }
    r
}

/// The report as Markdown tables.
pub fn markdown(r: &Report) -> String {
    let mut s = String::from(
        "| block | memcpy (hot) | memcpy into a 1 GiB pool | save | save / pool memcpy | load | load / hot memcpy |\n|---|---|---|---|---|---|---|\n",
    );
    for t in &r.throughput {
        s.push_str(&format!(
            "| {} | {:.2} | {:.2} | {:.2} | {:.2}x | {:.2} | {:.2}x |\n",
            t.block,
            t.memcpy_hot_gibs,
            t.memcpy_pool_gibs,
            t.save_gibs,
            t.save_gibs / t.memcpy_pool_gibs,
            t.load_gibs,
            t.load_gibs / t.memcpy_hot_gibs
        ));
    }
    s.push_str("\n| operation | p50 (us) | p99 (us) | p50 / raw | p99 / raw |\n|---|---|---|---|---|\n");
    let ratio = |x: f64, raw: Option<f64>| raw.map_or("-".to_string(), |r| format!("{:.1}x", x / r));
    for l in r.latency.iter().chain(&r.raw) {
        s.push_str(&format!(
            "| {} | {:.0} | {:.0} | {} | {} |\n",
            l.what,
            l.p50_us,
            l.p99_us,
            ratio(l.p50_us, r.raw.as_ref().map(|w| w.p50_us)),
            ratio(l.p99_us, r.raw.as_ref().map(|w| w.p99_us)),
        ));
    }
    s
}
