//! The command lines of `kvbench replay` and `kvbench many` (their arguments and what runs),
//! so that `src/bin/kvbench.rs` only dispatches.

use std::path::{Path, PathBuf};

use clap::Args;

use crate::document::{Report, markdown};
use crate::peers::{self, PeerConfig, lmcache::LmcacheSetup};
use crate::replay::report::{Machine, TraceInfo};
use crate::replay::{ReplayConfig, default_shm_dir, load_trace};

/// A binary next to this one (`cargo build --release -p kvbench -p kvcached -p kvrouter` puts
/// them side by side).
fn sibling(name: &str) -> Option<PathBuf> {
    let p = std::env::current_exe().ok()?.with_file_name(name);
    p.is_file().then_some(p)
}

fn parse_layout(s: &str) -> Result<(u32, u32, u32), String> {
    let v: Vec<u32> = s
        .split(',')
        .map(|x| x.trim().parse::<u32>().map_err(|e| format!("--layout {s}: {e}")))
        .collect::<Result<_, _>>()?;
    match v[..] {
        [l, h, d] => Ok((l, h, d)),
        _ => Err(format!("--layout {s}: expected LAYERS,KV_HEADS,HEAD_DIM")),
    }
}

/// `kvbench replay`.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// Mooncake-format trace (JSON lines: timestamp, input_length, output_length, hash_ids).
    #[arg(long)]
    pub trace: PathBuf,
    /// Replay only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// kvcached daemons (processes), one per node.
    #[arg(long, default_value_t = 8)]
    pub nodes: usize,
    #[arg(long, default_value_t = 1)]
    pub engines_per_node: usize,
    /// G2 capacity per daemon in blocks (512 tokens each).
    #[arg(long, default_value_t = 2000)]
    pub g2_blocks: u64,
    /// G3 capacity per daemon in blocks; 0: no G3.
    #[arg(long, default_value_t = 0)]
    pub g3_blocks: u64,
    /// G4 on a SeaweedFS started for the run (`KVCACHED_WEED`, else scripts/test's install).
    #[arg(long)]
    pub g4: bool,
    /// KV layout of a 512-token block: LAYERS,KV_HEADS,HEAD_DIM (bf16). The default is 64 KiB
    /// a block, so that the brief's 8 x 2000 blocks fit this machine's memory.
    #[arg(long, default_value = "1,1,32")]
    pub layout: String,
    /// Trace time runs this many times faster than recorded; 0: as fast as possible.
    #[arg(long, default_value_t = 0.0)]
    pub speed: f64,
    /// Requests in flight at once (1: each request is saved before the next is placed, as in
    /// the model).
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Each daemon's report interval to the router (ms).
    #[arg(long, default_value_t = 20)]
    pub report_interval_ms: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Skip the byte-for-byte check of loaded blocks.
    #[arg(long)]
    pub no_verify: bool,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// G2 capacities (blocks per node, comma-separated): a replay and a model run each, for the
    /// hit rate against capacity.
    #[arg(long, value_delimiter = ',')]
    pub sweep: Vec<u64>,
    /// Skip the model (`kvrouter::sim`) beside the replay.
    #[arg(long)]
    pub no_model: bool,
    /// Skip the cluster replay (peers only).
    #[arg(long)]
    pub no_replay: bool,
    /// The kvcached binary (default: next to this one).
    #[arg(long)]
    pub kvcached: Option<PathBuf>,
    /// The kvrouter binary (default: next to this one, else the router runs in this process).
    #[arg(long)]
    pub kvrouter: Option<PathBuf>,
    /// Run the router in this process even when a binary is there.
    #[arg(long)]
    pub router_in_process: bool,
    /// Directory for configurations, logs, G3 files (a disk) (default: the temp dir).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Directory of the G2 pools (default: /dev/shm).
    #[arg(long)]
    pub shm_dir: Option<PathBuf>,
    /// Write DIR/replay.json (read by scripts/plot_replay.py) and DIR/replay.md.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Also run the same blocks through LMCache's multi-process server 0.5.6 (CPU).
    #[arg(long)]
    pub lmcache: bool,
    /// Also run them through Redis (Debian's redis-server).
    #[arg(long)]
    pub redis: bool,
    /// Peers' workload: trace requests from this index...
    #[arg(long, default_value_t = 0)]
    pub peer_start: usize,
    /// ...this many...
    #[arg(long, default_value_t = 32)]
    pub peer_requests: usize,
    /// ...each cut to its first N hash ids (64 MiB each in Llama-3-8B's shape).
    #[arg(long, default_value_t = 4)]
    pub peer_hash_blocks: usize,
    /// kvcached's G2, LMCache's L1 and Redis's maxmemory (GiB).
    #[arg(long, default_value_t = 4)]
    pub peer_capacity_gib: u64,
    /// Bytes each system stores and retrieves before the timed requests (GiB).
    #[arg(long, default_value_t = 4)]
    pub peer_warmup_gib: u64,
    /// Python with torch for LMCache (default ~/.cache/kvcached/venv-vllm/bin/python).
    #[arg(long)]
    pub lmcache_python: Option<PathBuf>,
    /// Directory holding the lmcache package (default ~/.cache/kvcached/lmcache-0.5.6; "" for
    /// the environment's own).
    #[arg(long)]
    pub lmcache_path: Option<PathBuf>,
    /// The redis-server binary.
    #[arg(long, default_value = "redis-server")]
    pub redis_server: PathBuf,
}

fn kvcached_bin(given: &Option<PathBuf>) -> Result<PathBuf, String> {
    given.clone().or_else(|| sibling("kvcached")).ok_or_else(|| {
        "no kvcached binary next to kvbench: `cargo build --release -p kvbench -p kvcached -p kvrouter`, or --kvcached PATH"
            .to_string()
    })
}

/// Runs `kvbench replay`; the Markdown summary.
pub async fn replay(a: &ReplayArgs) -> Result<String, String> {
    let (layers, kv_heads, head_dim) = parse_layout(&a.layout)?;
    let limit = a.limit.or(if a.no_replay { Some(a.peer_start + a.peer_requests) } else { None });
    let trace = load_trace(&a.trace, limit)?;
    let dir = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    let cfg = ReplayConfig {
        nodes: a.nodes,
        engines_per_node: a.engines_per_node,
        g2_blocks: a.g2_blocks,
        g3_blocks: a.g3_blocks,
        g4: a.g4,
        layers,
        kv_heads,
        head_dim,
        speed: a.speed,
        concurrency: a.concurrency.max(1),
        report_interval_ms: a.report_interval_ms,
        seed: a.seed,
        verify: !a.no_verify,
        progress: !a.no_progress,
        kvcached_bin: kvcached_bin(&a.kvcached)?,
        kvrouter_bin: if a.router_in_process { None } else { a.kvrouter.clone().or_else(|| sibling("kvrouter")) },
        dir: dir.clone(),
        shm_dir: a.shm_dir.clone().unwrap_or_else(default_shm_dir),
        ..ReplayConfig::default()
    };
    cfg.validate()?;
    let mut report = Report {
        trace: TraceInfo {
            path: a.trace.display().to_string(),
            requests: trace.len(),
            blocks: trace.iter().map(|r| r.hash_ids.len() as u64).sum(),
            duration_s: trace.last().map_or(0, |r| r.timestamp).saturating_sub(trace.first().map_or(0, |r| r.timestamp))
                as f64
                / 1e3,
        },
        machine: Machine {
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            loadavg_start: crate::replay::loadavg(),
            loadavg_end: None,
            kvbench_version: env!("CARGO_PKG_VERSION").into(),
            started_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        },
        config: Some(cfg.clone()),
        ..Report::default()
    };
    if !a.no_replay {
        report.replay = Some(crate::replay::run(&cfg, &trace).await?);
        if !a.no_model {
            report.model = Some(crate::replay::model(&cfg, &trace).await?);
        }
        if !a.sweep.is_empty() {
            report.sweep = crate::replay::sweep(&cfg, &trace, &a.sweep).await?;
        }
    }
    if a.lmcache || a.redis {
        let requests: Vec<Vec<u64>> = trace
            .iter()
            .skip(a.peer_start)
            .take(a.peer_requests)
            .map(|r| r.hash_ids.iter().copied().take(a.peer_hash_blocks.max(1)).collect())
            .collect();
        if requests.is_empty() {
            return Err(format!("no trace requests from {} for the peers", a.peer_start));
        }
        let lmcache = a.lmcache.then(|| {
            let d = LmcacheSetup::default();
            LmcacheSetup {
                python: a.lmcache_python.clone().unwrap_or(d.python),
                path: a.lmcache_path.clone().unwrap_or(d.path),
            }
        });
        if let Some(l) = &lmcache
            && !peers::lmcache::package_present(&l.path)
        {
            return Err(format!(
                "{}: no lmcache package there (scripts/test installs it: pip install --no-deps --target {} lmcache==0.5.6 sortedcontainers)",
                l.path.display(),
                l.path.display()
            ));
        }
        let work = tempfile::tempdir_in(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let pc = PeerConfig {
            requests,
            capacity_bytes: a.peer_capacity_gib << 30,
            warmup_bytes: a.peer_warmup_gib << 30,
            lmcache,
            redis: a.redis.then(|| a.redis_server.clone()),
            kvcached_bin: cfg.kvcached_bin.clone(),
            dir: work.path().to_path_buf(),
            shm_dir: cfg.shm_dir.clone(),
        };
        report.peers = Some(peers::run(&pc).await?);
    }
    report.machine.loadavg_end = crate::replay::loadavg();
    let md = markdown(&report);
    if let Some(out) = &a.out {
        write_out(out, "replay", &report, &md)?;
    }
    Ok(md)
}

fn write_out<T: serde::Serialize>(out: &Path, name: &str, report: &T, md: &str) -> Result<(), String> {
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let json = serde_json::to_string_pretty(report).map_err(|e| e.to_string())?;
    let path = out.join(format!("{name}.json"));
    std::fs::write(&path, json).map_err(|e| format!("{}: {e}", path.display()))?;
    let path = out.join(format!("{name}.md"));
    std::fs::write(&path, md).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(())
}

/// `kvbench many`.
#[derive(Debug, Clone, Args)]
pub struct ManyArgs {
    /// Engines saving and loading at once.
    #[arg(long, default_value_t = 8)]
    pub engines: usize,
    /// Blocks of 2 MiB per save or load call.
    #[arg(long, default_value_t = 16)]
    pub call_blocks: u32,
    /// Seconds of the concurrent phase (the single-engine and memcpy phases take half).
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// The daemon's G2 (GiB).
    #[arg(long, default_value_t = 4)]
    pub g2_gib: u64,
    /// A lookup every this many ms while the engines run.
    #[arg(long, default_value_t = 5)]
    pub probe_interval_ms: u64,
    /// Lookups on the idle daemon.
    #[arg(long, default_value_t = 200)]
    pub idle_samples: usize,
    /// MiB one engine saves in each round while the others look up.
    #[arg(long, default_value_t = 2048)]
    pub save_mib: u64,
    /// Rounds of that save.
    #[arg(long, default_value_t = 3)]
    pub save_rounds: usize,
    /// Each engine looks up this often meanwhile (ms).
    #[arg(long, default_value_t = 2)]
    pub lookup_interval_ms: u64,
    /// The kvcached binary (default: next to this one).
    #[arg(long)]
    pub kvcached: Option<PathBuf>,
    #[arg(long)]
    pub dir: Option<PathBuf>,
    #[arg(long)]
    pub shm_dir: Option<PathBuf>,
    /// Write DIR/many.json and DIR/many.md.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Runs `kvbench many`; the Markdown summary.
pub async fn many(a: &ManyArgs) -> Result<String, String> {
    let cfg = crate::many::ManyConfig {
        engines: a.engines.max(1),
        call_blocks: a.call_blocks.max(1),
        seconds: a.seconds,
        g2_bytes: a.g2_gib << 30,
        probe_interval_ms: a.probe_interval_ms,
        idle_samples: a.idle_samples,
        save_bytes: a.save_mib << 20,
        save_rounds: a.save_rounds,
        lookup_interval_ms: a.lookup_interval_ms,
        kvcached_bin: kvcached_bin(&a.kvcached)?,
        dir: a.dir.clone().unwrap_or_else(std::env::temp_dir),
        shm_dir: a.shm_dir.clone().unwrap_or_else(default_shm_dir),
    };
    let r = crate::many::run(&cfg).await?;
    let md = crate::many::markdown(&r);
    if let Some(out) = &a.out {
        write_out(out, "many", &r, &md)?;
    }
    Ok(md)
}
