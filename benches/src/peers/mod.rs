//! Peers in the same run as a replay (`kvbench replay --lmcache --redis`): the same blocks of
//! the same trace requests through kvcached, the LMCache multi-process server 0.5.6 (CPU mode,
//! through its own client), and Redis (SET / GET over loopback), one system at a time, each from
//! empty after the same warm-up; beside the physical limits measured in the same run (memcpy,
//! O_DIRECT read).
//!
//! The workload: a window of the trace (`requests`, each cut to its first `max_hash_blocks` hash
//! ids), in Llama-3-8B's KV shape (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB a token),
//! so a hash id's 512 tokens are 64 MiB: 32 pages of 16 tokens (2 MiB, kvcached's blocks and
//! Redis's values) or 2 chunks of 256 tokens (32 MiB, LMCache's). Per request, as an engine
//! would: look the prompt up, retrieve the cached prefix into the engine's KV memory, store the
//! rest from it. Store and retrieve throughput are bytes over the time inside those calls.

pub mod lmcache;
pub mod redis;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvclient::{Client, KvMemory};
use kvproto::{KvLayout, Namespace};
use serde::{Deserialize, Serialize};

use crate::replay::cluster::DaemonProcess;
use crate::replay::report::Dist;
use crate::replay::{TOKENS_PER_HASH, request_tokens};

/// Tokens of a page (vLLM's block; kvcached's block here; one Redis value).
pub const PAGE_TOKENS: u32 = 16;
/// Bytes of KV per token in Llama-3-8B's shape (32 layers x K/V x 8 heads x 128 x bf16).
pub const TOKEN_BYTES: u64 = 32 * 2 * 8 * 128 * 2;
/// Bytes of a page: 2 MiB.
pub const PAGE_BYTES: u64 = TOKEN_BYTES * PAGE_TOKENS as u64;
/// Pages a hash id stands for.
pub const PAGES_PER_HASH: u32 = TOKENS_PER_HASH / PAGE_TOKENS;
/// Hash ids of warm-up requests (far above any trace's).
const WARM_BASE: u64 = 1 << 48;

/// Llama-3-8B's KV layout in 16-token blocks.
pub fn layout() -> KvLayout {
    KvLayout::llama3_8b(PAGE_TOKENS)
}

/// Which peers, and how.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeerConfig {
    /// The requests' hash ids (already cut).
    pub requests: Vec<Vec<u64>>,
    /// kvcached's G2, LMCache's L1, Redis's `maxmemory`.
    pub capacity_bytes: u64,
    /// Stored (and retrieved) before the timed requests, by each system: memory written before
    /// is faster to write again on these VMs (docs/benchmarks.md, "Save and load").
    pub warmup_bytes: u64,
    pub lmcache: Option<lmcache::LmcacheSetup>,
    /// The `redis-server` binary.
    pub redis: Option<PathBuf>,
    pub kvcached_bin: PathBuf,
    /// Configurations, logs, and the O_DIRECT file (a disk, not tmpfs).
    pub dir: PathBuf,
    pub shm_dir: PathBuf,
}

impl PeerConfig {
    /// Pages of the longest request.
    pub fn max_pages(&self) -> u32 {
        self.requests.iter().map(Vec::len).max().unwrap_or(1).max(1) as u32 * PAGES_PER_HASH
    }

    /// Warm-up requests of one hash id each.
    pub fn warmup_requests(&self) -> u64 {
        self.warmup_bytes / (PAGE_BYTES * u64::from(PAGES_PER_HASH))
    }
}

/// Bytes moved by one kind of call.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Op {
    pub calls: u64,
    pub bytes: u64,
    pub seconds: f64,
    /// `bytes / seconds` (decimal GB/s).
    pub gbs: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// One system's figures on the workload.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SystemResult {
    pub name: String,
    pub version: String,
    /// What it ran with, so anyone can run it again.
    pub setup: String,
    pub lookup: Dist,
    pub store: Op,
    pub retrieve: Op,
    /// Pages found by the lookups, of all pages asked.
    pub hit_pages: u64,
    pub pages: u64,
    pub warmup_s: f64,
    pub errors: Vec<String>,
}

/// The physical limits, in the same run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Limits {
    /// One thread copying a 2 MiB buffer into another (both hot).
    pub memcpy_hot_gbs: f64,
    /// One thread copying 2 MiB into a rotating slot of a written 1 GiB region (what a store
    /// writes into).
    pub memcpy_pool_gbs: f64,
    /// O_DIRECT reads of 2 MiB from a file in `dir`, one at a time.
    pub odirect_read_gbs: f64,
    pub odirect_dir: String,
}

/// A goal of issue 20 and where the run stands.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Goal {
    pub what: String,
    pub ratio: f64,
    pub goal: f64,
    pub met: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Workload {
    pub requests: usize,
    pub hash_blocks: u64,
    pub unique_hash_blocks: u64,
    pub pages: u64,
    pub page_bytes: u64,
    pub capacity_bytes: u64,
    pub warmup_bytes: u64,
    pub shape: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PeerReport {
    pub workload: Workload,
    pub limits: Limits,
    pub systems: Vec<SystemResult>,
    pub goals: Vec<Goal>,
    pub loadavg_start: Option<[f64; 3]>,
    pub loadavg_end: Option<[f64; 3]>,
}

/// What one system's run records, request by request.
#[derive(Debug, Default)]
pub(crate) struct Recorder {
    lookup_us: Vec<f64>,
    store: Vec<(u64, f64)>,
    retrieve: Vec<(u64, f64)>,
    hit_pages: u64,
    pages: u64,
    errors: Vec<String>,
}

impl Recorder {
    pub(crate) fn lookup(&mut self, d: Duration, hit_pages: u64, pages: u64) {
        self.lookup_us.push(d.as_secs_f64() * 1e6);
        self.hit_pages += hit_pages;
        self.pages += pages;
    }

    pub(crate) fn store(&mut self, bytes: u64, d: Duration) {
        self.store.push((bytes, d.as_secs_f64()));
    }

    pub(crate) fn retrieve(&mut self, bytes: u64, d: Duration) {
        self.retrieve.push((bytes, d.as_secs_f64()));
    }

    pub(crate) fn error(&mut self, e: String) {
        if self.errors.len() < 10 {
            self.errors.push(e);
        }
    }

    fn op(v: &[(u64, f64)]) -> Op {
        let bytes: u64 = v.iter().map(|x| x.0).sum();
        let seconds: f64 = v.iter().map(|x| x.1).sum();
        let d = Dist::of(v.iter().map(|x| x.1 * 1e6).collect());
        Op {
            calls: v.len() as u64,
            bytes,
            seconds,
            gbs: if seconds > 0.0 { bytes as f64 / seconds / 1e9 } else { 0.0 },
            p50_ms: d.p50_us / 1e3,
            p99_ms: d.p99_us / 1e3,
        }
    }

    pub(crate) fn finish(self, name: &str, version: String, setup: String, warmup_s: f64) -> SystemResult {
        SystemResult {
            name: name.into(),
            version,
            setup,
            lookup: Dist::of(self.lookup_us),
            store: Self::op(&self.store),
            retrieve: Self::op(&self.retrieve),
            hit_pages: self.hit_pages,
            pages: self.pages,
            warmup_s,
            errors: self.errors,
        }
    }
}

fn gbs(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9
}

/// memcpy and O_DIRECT read of 2 MiB, measured now.
pub fn limits(dir: &Path) -> Result<Limits, String> {
    let n = PAGE_BYTES as usize;
    let src = kvclient::synthetic_block(1, 0, n);
    let mut dst = vec![0u8; n];
    let rounds = 512;
    let t0 = Instant::now();
    for _ in 0..rounds {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
    }
    let hot = gbs(PAGE_BYTES * rounds, t0.elapsed());
    let mut pool = vec![0x5au8; 1 << 30];
    let slots = pool.len() / n;
    let t0 = Instant::now();
    for i in 0..rounds as usize {
        let at = (i % slots) * n;
        pool[at..at + n].copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&pool[at]);
    }
    let pooled = gbs(PAGE_BYTES * rounds, t0.elapsed());
    drop(pool);
    let path = dir.join("odirect-2MiB.dat");
    let slots = 64u64;
    let mut f = crate::raw::RawDirectFile::create(&path, n, slots).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut buf = kvtiers::BlockBuf::from_slice(&src);
    for _ in 0..slots {
        f.write_next(&buf).map_err(|e| format!("O_DIRECT write: {e}"))?;
    }
    let t0 = Instant::now();
    for _ in 0..slots * 2 {
        f.read_next(&mut buf).map_err(|e| format!("O_DIRECT read: {e}"))?;
    }
    let odirect = gbs(PAGE_BYTES * slots * 2, t0.elapsed());
    drop(f);
    let _ = std::fs::remove_file(&path);
    Ok(Limits {
        memcpy_hot_gbs: hot,
        memcpy_pool_gbs: pooled,
        odirect_read_gbs: odirect,
        odirect_dir: dir.display().to_string(),
    })
}

/// kvcached on the workload: a daemon process (G2 = `capacity_bytes`, no G3), one engine.
pub async fn run_ours(cfg: &PeerConfig) -> Result<SystemResult, String> {
    let dir = cfg.dir.join("kvcached");
    let mut c = kvcached::Config::default();
    c.g2.capacity_bytes = cfg.capacity_bytes;
    c.g2.shm_dir = cfg.shm_dir.clone();
    c.g3.enabled = false;
    let setup = format!(
        "kvcached (this tree), a process: g2.capacity_bytes = {}, g3 off, defaults otherwise; one engine, Llama-3-8B layout in 16-token blocks (vLLM's layer-separate tensors)",
        cfg.capacity_bytes
    );
    let (bin, d) = (cfg.kvcached_bin.clone(), dir.clone());
    let daemon = DaemonProcess::start_prefaulted(bin, d, c).await?;
    let r = drive_ours(cfg, &daemon.socket).await;
    let stopped = tokio::task::spawn_blocking(move || daemon.stop()).await.map_err(|e| e.to_string())?;
    let (rec, warm, over) = r?;
    stopped?;
    let setup = format!("{setup}; lookups over {over}");
    let version = format!("kvcached {}", env!("CARGO_PKG_VERSION"));
    Ok(rec.finish("kvcached", version, setup, warm))
}

/// The workload through one engine: what it recorded, the warm-up's seconds, and what its
/// lookups went over (LOOKUP or gRPC).
async fn drive_ours(cfg: &PeerConfig, socket: &Path) -> Result<(Recorder, f64, &'static str), String> {
    let layout = layout();
    let slots = cfg.max_pages();
    let mut mem = KvMemory::anonymous(&layout, slots).map_err(|e| format!("engine memory: {e}"))?;
    for b in 0..slots {
        mem.write_block(b, &kvclient::synthetic_block(u64::from(b), b, PAGE_BYTES as usize));
    }
    let client = Client::connect(socket).await.map_err(|e| e.to_string())?;
    client.register("peers", &Namespace::new("kvbench/peers", layout), &mem).await.map_err(|e| e.to_string())?;
    let all: Vec<u32> = (0..slots).collect();
    let t0 = Instant::now();
    for i in 0..cfg.warmup_requests() {
        let tokens = request_tokens(&[WARM_BASE + i]);
        client.save(&tokens, 0, &all[..PAGES_PER_HASH as usize]).await.map_err(|e| format!("warm-up save: {e}"))?;
        client.load_now(&tokens, 0, &all[..PAGES_PER_HASH as usize]).await.map_err(|e| format!("warm-up load: {e}"))?;
    }
    let warm = t0.elapsed().as_secs_f64();
    let mut rec = Recorder::default();
    for (i, ids) in cfg.requests.iter().enumerate() {
        let tokens = request_tokens(ids);
        let n = ids.len() as u32 * PAGES_PER_HASH;
        let t0 = Instant::now();
        let hit = client.lookup(&tokens).await.map_err(|e| format!("request {i}: lookup: {e}"))?;
        rec.lookup(t0.elapsed(), u64::from(hit.matched_blocks.min(n)), u64::from(n));
        let mut have = 0;
        if hit.matched_blocks > 0 {
            let m = hit.matched_blocks.min(n) as usize;
            let t0 = Instant::now();
            match client.load_now(&tokens, 0, &all[..m]).await {
                Ok(s) => {
                    rec.retrieve(u64::from(s.loaded_blocks) * PAGE_BYTES, t0.elapsed());
                    have = s.loaded_blocks;
                }
                Err(e) => rec.error(format!("request {i}: load: {e}")),
            }
        }
        if have < n {
            let t0 = Instant::now();
            match client.save(&tokens, have, &all[have as usize..n as usize]).await {
                Ok(r) if r.failed == 0 => rec.store(u64::from(r.stored + r.already_present) * PAGE_BYTES, t0.elapsed()),
                Ok(r) => rec.error(format!("request {i}: save: {} failed: {}", r.failed, r.error)),
                Err(e) => rec.error(format!("request {i}: save: {e}")),
            }
        }
    }
    let over = if client.lookup_wire_served() == Some(true) { "LOOKUP" } else { "gRPC" };
    let _ = client.unregister().await;
    Ok((rec, warm, over))
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

/// The goals of issue 20 item 2 from the systems measured.
pub fn goals(systems: &[SystemResult]) -> Vec<Goal> {
    let find = |n: &str| systems.iter().find(|s| s.name == n);
    let mut g = Vec::new();
    let mut push = |what: &str, ratio: f64, goal: f64, higher_is_better: bool| {
        let met = if higher_is_better { ratio >= goal } else { ratio <= goal && ratio > 0.0 };
        g.push(Goal { what: what.into(), ratio, goal, met });
    };
    let Some(ours) = find("kvcached") else { return Vec::new() };
    if let Some(l) = find("lmcache") {
        push("store throughput, kvcached / LMCache (>= 5x)", ratio(ours.store.gbs, l.store.gbs), 5.0, true);
        push("retrieve throughput, kvcached / LMCache (>= 1.5x)", ratio(ours.retrieve.gbs, l.retrieve.gbs), 1.5, true);
        push("lookup p50, kvcached / LMCache (<= 0.25x)", ratio(ours.lookup.p50_us, l.lookup.p50_us), 0.25, false);
    }
    if let Some(r) = find("redis") {
        push("store throughput at 2 MiB, kvcached / Redis SET (>= 4x)", ratio(ours.store.gbs, r.store.gbs), 4.0, true);
        push(
            "retrieve throughput at 2 MiB, kvcached / Redis GET (>= 4x)",
            ratio(ours.retrieve.gbs, r.retrieve.gbs),
            4.0,
            true,
        );
    }
    g
}

/// Runs the limits, kvcached, then each peer asked for, one at a time.
pub async fn run(cfg: &PeerConfig) -> Result<PeerReport, String> {
    std::fs::create_dir_all(&cfg.dir).map_err(|e| format!("{}: {e}", cfg.dir.display()))?;
    let loadavg_start = crate::replay::loadavg();
    let mut unique = std::collections::HashSet::new();
    for r in &cfg.requests {
        unique.extend(r.iter().copied());
    }
    let hash_blocks: u64 = cfg.requests.iter().map(|r| r.len() as u64).sum();
    let workload = Workload {
        requests: cfg.requests.len(),
        hash_blocks,
        unique_hash_blocks: unique.len() as u64,
        pages: hash_blocks * u64::from(PAGES_PER_HASH),
        page_bytes: PAGE_BYTES,
        capacity_bytes: cfg.capacity_bytes,
        warmup_bytes: cfg.warmup_requests() * PAGE_BYTES * u64::from(PAGES_PER_HASH),
        shape: "Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16 (128 KiB a token); 16-token pages of 2 MiB, LMCache chunks of 256 tokens (32 MiB)".into(),
    };
    let dir = cfg.dir.clone();
    let limits = tokio::task::spawn_blocking(move || limits(&dir)).await.map_err(|e| e.to_string())??;
    let mut systems = vec![run_ours(cfg).await?];
    if let Some(bin) = &cfg.redis {
        let (c, bin) = (cfg.clone(), bin.clone());
        systems.push(tokio::task::spawn_blocking(move || redis::run(&c, &bin)).await.map_err(|e| e.to_string())??);
    }
    if let Some(l) = &cfg.lmcache {
        systems.push(lmcache::run(cfg, l).await?);
    }
    let goals = goals(&systems);
    Ok(PeerReport { workload, limits, systems, goals, loadavg_start, loadavg_end: crate::replay::loadavg() })
}

/// The report as Markdown.
pub fn markdown(r: &PeerReport) -> String {
    let w = &r.workload;
    let l = &r.limits;
    let mut s = format!(
        "peers: {} requests, {} hash blocks ({} distinct), {} pages of {} MiB; capacity {} GiB each, warm-up {} GiB; load average {:?} -> {:?}\n\n",
        w.requests,
        w.hash_blocks,
        w.unique_hash_blocks,
        w.pages,
        w.page_bytes >> 20,
        w.capacity_bytes >> 30,
        w.warmup_bytes >> 30,
        r.loadavg_start,
        r.loadavg_end
    );
    s += &format!(
        "limits (same run): memcpy 2 MiB hot {:.2} GB/s, into a 1 GiB region {:.2} GB/s; O_DIRECT read 2 MiB {:.2} GB/s ({})\n\n",
        l.memcpy_hot_gbs, l.memcpy_pool_gbs, l.odirect_read_gbs, l.odirect_dir
    );
    s += "| system | store GB/s | / memcpy into region | retrieve GB/s | / memcpy hot | lookup p50 / p99 (us) | pages hit | errors |\n|---|---|---|---|---|---|---|---|\n";
    for x in &r.systems {
        s += &format!(
            "| {} | {:.2} | {:.2}x | {:.2} | {:.2}x | {:.0} / {:.0} | {} / {} | {} |\n",
            x.name,
            x.store.gbs,
            ratio(x.store.gbs, l.memcpy_pool_gbs),
            x.retrieve.gbs,
            ratio(x.retrieve.gbs, l.memcpy_hot_gbs),
            x.lookup.p50_us,
            x.lookup.p99_us,
            x.hit_pages,
            x.pages,
            x.errors.len()
        );
    }
    s += "\n| goal | ratio | met |\n|---|---|---|\n";
    for g in &r.goals {
        s += &format!("| {} | {:.2}x | {} |\n", g.what, g.ratio, if g.met { "yes" } else { "**no**" });
    }
    s += "\n";
    for x in &r.systems {
        s += &format!("- {} ({}): {}\n", x.name, x.version, x.setup);
        for e in &x.errors {
            s += &format!("  - error: {e}\n");
        }
    }
    s
}
