//! `kvbench replay`: a Mooncake-format trace (JSON lines: `timestamp`, `input_length`,
//! `output_length`, `hash_ids`) through real `kvcached` daemons (separate processes), engines
//! attached to them through the real client over each daemon's socket, and a real `kvrouter`
//! placing every request; beside it, the router's simulation ([`kvrouter::sim`], the fast model)
//! on the same trace and capacity.
//!
//! Every hash id of the trace stands for one 512-token block whose tokens are derived from the
//! id alone ([`block_tokens`]): a request's tokens are its ids' blocks in order, so the daemons'
//! chained keys reproduce the trace's prefix structure (two requests share a key exactly where
//! they share a run of leading hash ids). A block's KV bytes are derived from its id too
//! ([`block_kv`]), so every load can be checked byte for byte. As in the simulation, every hash
//! id counts as a full block (the trace's last block of a prompt is usually partial; its id is
//! then unique to the request and never hits, in either).
//!
//! Per request: `POST /route` (the router's placement, its prediction of the cached prefix per
//! tier, and every candidate's) -> the chosen engine looks the prompt up with the route id (so
//! the daemon reports the outcome to the router) -> loads what is cached into its slots and
//! checks it -> "prefills" the rest by writing synthetic KV into its slots -> saves it. Engines
//! report their load from the simulation's service model, in trace time (`prefill_ms_per_block`
//! per block not loaded, `decode_ms_per_token` per output token), so the router's load terms see
//! the queues the model's workers have.
//!
//! # Layout
//! - [`cluster`]: daemon processes, the router (a process, or in this process), SeaweedFS for G4.
//! - [`drive`]: the dispatcher (pacing, routing) and the engines.
//! - [`report`]: the measurements aggregated (hit rate per tier, saved prefill tokens, latency
//!   percentiles and CDFs, throughput, placement quality, the model beside them), as JSON and as
//!   Markdown (the whole document, with the peers' run, is [`crate::document`]).

pub mod cluster;
pub mod drive;
pub mod report;

use std::path::{Path, PathBuf};
use std::time::Instant;

use kvproto::{Dtype, KvLayout, LayoutKind};
use kvrouter::sim::{self, Policy, SimConfig, TraceRequest};
use serde::{Deserialize, Serialize};

pub use report::{ModelResult, ReplayResult, SweepPoint};

/// Tokens each hash id of a Mooncake trace stands for.
pub const TOKENS_PER_HASH: u32 = 512;
/// Token ids are drawn below this (a Llama-3-sized vocabulary).
const VOCAB: u32 = 128_000;
/// The model id of the replay's namespace (engines and router agree on it).
pub const MODEL_ID: &str = "kvbench/replay";
/// The router's name for that namespace.
pub const NAMESPACE: &str = "replay";

/// What to replay and on what.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReplayConfig {
    /// `kvcached` processes, one per "node".
    pub nodes: usize,
    /// Engines attached to each daemon (each a worker of the router).
    pub engines_per_node: usize,
    /// G2 capacity of each daemon, in blocks of `TOKENS_PER_HASH` tokens.
    pub g2_blocks: u64,
    /// G3 capacity of each daemon in blocks; 0: no G3.
    pub g3_blocks: u64,
    /// G4 on a SeaweedFS started for the run (shared by every daemon).
    pub g4: bool,
    /// The KV layout of a block (bf16, layer-separate, `TOKENS_PER_HASH` tokens): its size is
    /// `2 * layers * kv_heads * head_dim * 2 * 512` bytes.
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Trace time runs this many times faster than recorded; 0: as fast as possible.
    pub speed: f64,
    /// Requests in flight at once over the cluster (placed, not yet saved).
    pub concurrency: usize,
    /// How often each daemon reports to the router (events, load, outcomes).
    pub report_interval_ms: u64,
    /// The service model engines report load from (the simulation's).
    pub prefill_ms_per_block: f64,
    pub decode_ms_per_token: f64,
    /// The router's tie-breaking seed (and the model's).
    pub seed: u64,
    /// Check every loaded block byte for byte.
    pub verify: bool,
    /// Draw a progress bar with an ETA on stderr (only on a terminal).
    pub progress: bool,
    /// Stop after this many failed requests.
    pub max_errors: usize,
    /// The `kvcached` binary.
    pub kvcached_bin: PathBuf,
    /// The `kvrouter` binary; none: the router runs in this process (`kvrouter::serve_router`).
    pub kvrouter_bin: Option<PathBuf>,
    /// Where configurations, logs and G3 files go.
    pub dir: PathBuf,
    /// Where the G2 pools' shared-memory files go.
    pub shm_dir: PathBuf,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        Self {
            nodes: 8,
            engines_per_node: 1,
            g2_blocks: 2000,
            g3_blocks: 0,
            g4: false,
            layers: 1,
            kv_heads: 1,
            head_dim: 32,
            speed: 0.0,
            concurrency: 1,
            report_interval_ms: 20,
            prefill_ms_per_block: 50.0,
            decode_ms_per_token: 20.0,
            seed: 1,
            verify: true,
            progress: true,
            max_errors: 20,
            kvcached_bin: PathBuf::from("kvcached"),
            kvrouter_bin: None,
            dir: std::env::temp_dir(),
            shm_dir: default_shm_dir(),
        }
    }
}

impl ReplayConfig {
    /// The engines' KV layout.
    pub fn layout(&self) -> KvLayout {
        KvLayout {
            num_layers: self.layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            dtype: Dtype::Bf16,
            tokens_per_block: TOKENS_PER_HASH,
            kind: LayoutKind::LayerSeparate,
        }
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> u64 {
        self.layout().block_bytes()
    }

    /// Checks what the daemons would refuse, before any is started.
    pub fn validate(&self) -> Result<(), String> {
        if self.nodes == 0 || self.engines_per_node == 0 {
            return Err("at least one node and one engine per node".into());
        }
        if self.g2_blocks == 0 {
            return Err("G2 needs at least one block".into());
        }
        if self.layers == 0 || self.kv_heads == 0 || self.head_dim == 0 {
            return Err("layers, kv_heads and head_dim must be positive".into());
        }
        // G2 and G3 allocate whole pages of at least 4 KiB: a block that is not a multiple of
        // 4 KiB would leave part of every page unused and the capacity in blocks would lie.
        if !self.block_bytes().is_multiple_of(4096) {
            return Err(format!("a block of {} bytes is not a multiple of 4 KiB", self.block_bytes()));
        }
        if !(self.speed >= 0.0 && self.speed.is_finite()) {
            return Err("--speed must be 0 (as fast as possible) or positive".into());
        }
        Ok(())
    }

    /// The page size of the daemons' tiers: the largest power of two from 4 KiB to 64 KiB (the
    /// daemon's default) that divides a block, so that a block fills its pages exactly.
    pub fn page_size(&self) -> u64 {
        let mut p = 65_536;
        while p > 4096 && !self.block_bytes().is_multiple_of(p) {
            p /= 2;
        }
        p
    }
}

/// `/dev/shm` where it exists (G2 pools are shared memory), else the temp dir.
pub fn default_shm_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() }
}

/// The tokens hash id `h` stands for, appended to `out`: `tokens` ids from a SplitMix64 stream
/// seeded with `h` (`scripts`-independent: `peers/lmcache_driver.py` derives the same ones).
pub fn block_tokens(h: u64, tokens: u32, out: &mut Vec<u32>) {
    let mut s = h;
    for _ in 0..tokens {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        out.push(((z >> 32) as u32) % VOCAB);
    }
}

/// The tokens of a request: its hash ids' blocks in order.
pub fn request_tokens(ids: &[u64]) -> Vec<u32> {
    let mut t = Vec::with_capacity(ids.len() * TOKENS_PER_HASH as usize);
    for &h in ids {
        block_tokens(h, TOKENS_PER_HASH, &mut t);
    }
    t
}

/// The KV bytes of the block of hash id `h` (any process can regenerate and check them).
pub fn block_kv(h: u64, len: usize) -> Vec<u8> {
    kvclient::synthetic_block(h, 0, len)
}

/// Reads a Mooncake-format trace; `limit` keeps its first requests.
pub fn load_trace(path: &Path, limit: Option<usize>) -> Result<Vec<TraceRequest>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut t = sim::parse_trace(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    if let Some(n) = limit {
        t.truncate(n);
    }
    if t.is_empty() {
        return Err(format!("{}: no requests", path.display()));
    }
    Ok(t)
}

/// Replays `trace` once: starts the cluster, drives it, stops it.
pub async fn run(cfg: &ReplayConfig, trace: &[TraceRequest]) -> Result<ReplayResult, String> {
    cfg.validate()?;
    std::fs::create_dir_all(&cfg.dir).map_err(|e| format!("{}: {e}", cfg.dir.display()))?;
    let work = tempfile::tempdir_in(&cfg.dir).map_err(|e| format!("{}: {e}", cfg.dir.display()))?;
    let cluster = cluster::Cluster::start(cfg, work.path()).await?;
    let driven = drive::drive(cfg, &cluster, trace).await;
    // The daemons' own view (tier stats), then the router's counters, before anything stops.
    let result = match driven {
        Ok(d) => {
            let nodes = cluster.node_stats(cfg).await;
            let router_metrics = cluster.router.metrics().await;
            Ok(report::aggregate(cfg, trace, &d, nodes, router_metrics))
        }
        Err(e) => Err(format!("{e}{}", cluster.logs_tail())),
    };
    let stopped = cluster.stop().await;
    let r = result?;
    stopped?;
    Ok(r)
}

/// The simulation on the same trace: as many workers as the replay has engines, each an LRU of
/// its share of a node's capacity (G2, or G3 when larger), with the same service model and
/// seed, against a router in this process; with the pooled-cache and infinite-cache bounds.
pub async fn model(cfg: &ReplayConfig, trace: &[TraceRequest]) -> Result<ModelResult, String> {
    let workers = cfg.nodes * cfg.engines_per_node;
    // With G3, every saved block is written through to it: a node holds what the larger of its
    // tiers holds (G2 is a subset of G3 once write-through has caught up).
    let capacity = (cfg.g2_blocks.max(cfg.g3_blocks) as usize / cfg.engines_per_node).max(1);
    let sim_cfg = SimConfig {
        workers,
        capacity_blocks: capacity,
        policy: Policy::KvAware,
        prefill_ms_per_block: cfg.prefill_ms_per_block,
        decode_ms_per_token: cfg.decode_ms_per_token,
        seed: cfg.seed,
        report_outcomes: true,
    };
    let router = kvrouter::RouterConfig { seed: Some(cfg.seed), ..kvrouter::RouterConfig::default() };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| format!("model router: {e}"))?;
    let base = format!("http://{}", listener.local_addr().map_err(|e| format!("model router: {e}"))?);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(kvrouter::serve(listener, router, async move {
        let _ = rx.await;
    }));
    let t0 = Instant::now();
    let r = sim::run(&base, trace, &sim_cfg).await.map_err(|e| format!("model: {e}"));
    let seconds = t0.elapsed().as_secs_f64();
    let _ = tx.send(());
    match server.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(format!("model router: {e}")),
        Err(e) => return Err(format!("model router task: {e}")),
    }
    let r = r?;
    Ok(ModelResult {
        workers,
        capacity_blocks: capacity as u64,
        kv_aware_hit_rate: r.hit_rate,
        pooled_hit_rate: sim::pooled_hit_rate(trace, workers * capacity),
        infinite_hit_rate: sim::infinite_hit_rate(trace),
        per_worker: r.per_worker,
        seconds,
    })
}

/// One replay and one model run per G2 capacity (blocks per node), each on a fresh cluster.
pub async fn sweep(cfg: &ReplayConfig, trace: &[TraceRequest], capacities: &[u64]) -> Result<Vec<SweepPoint>, String> {
    let mut out = Vec::with_capacity(capacities.len());
    for &c in capacities {
        let cfg = ReplayConfig { g2_blocks: c, ..cfg.clone() };
        let r = run(&cfg, trace).await?;
        let m = model(&cfg, trace).await?;
        out.push(SweepPoint {
            g2_blocks: c,
            replay_hit_rate: r.hit_rate.clone(),
            model_hit_rate: m.kv_aware_hit_rate,
            pooled_hit_rate: m.pooled_hit_rate,
            infinite_hit_rate: m.infinite_hit_rate,
            errors: r.errors,
        });
    }
    Ok(out)
}

/// The load averages of `/proc/loadavg` (1, 5, 15 minutes), to record how busy the machine was.
pub fn loadavg() -> Option<[f64; 3]> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut it = s.split_whitespace().filter_map(|x| x.parse::<f64>().ok());
    Some([it.next()?, it.next()?, it.next()?])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_follow_the_hash_ids_prefix() {
        let a = request_tokens(&[0, 1, 2]);
        let b = request_tokens(&[0, 1, 3]);
        assert_eq!(a.len(), 3 * TOKENS_PER_HASH as usize);
        let block = TOKENS_PER_HASH as usize;
        assert_eq!(a[..2 * block], b[..2 * block]);
        assert_ne!(a[2 * block..], b[2 * block..]);
        // The SplitMix64 stream the LMCache driver reproduces: the first token of id 0.
        let mut t = Vec::new();
        block_tokens(0, 1, &mut t);
        assert_eq!(t, vec![((0xE220_A839_7B1D_CDAFu64 >> 32) as u32) % VOCAB]);
    }

    #[test]
    fn page_size_divides_the_block() {
        let mut c = ReplayConfig::default();
        assert_eq!(c.block_bytes(), 64 << 10);
        assert_eq!(c.page_size(), 64 << 10);
        c.head_dim = 8;
        assert_eq!(c.block_bytes(), 16 << 10);
        assert_eq!(c.page_size(), 16 << 10);
        c.head_dim = 3;
        assert!(c.validate().is_err());
    }
}
