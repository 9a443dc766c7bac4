//! LMCache 0.5.6 as a peer: its multi-process server (`lmcache server`, CPU mode: L1 in host
//! memory, the flags of ../shared/ENVIRONMENT.md's recipe) driven by its own client
//! (`lmcache_driver.py`, the client of `lmcache bench server --mode cpu --transfer-mode
//! engine_driven`), in Llama-3-8B's KV shape with 256-token chunks (32 MiB).
//!
//! Python and the package: `--lmcache-python` (default the vLLM environment the Python package's
//! tests use, `~/.cache/kvcached/venv-vllm`, which has torch) and `--lmcache-path` (a directory
//! holding the `lmcache` package, default `~/.cache/kvcached/lmcache-0.5.6`, which `scripts/test`
//! installs there without dependencies; empty: the environment's own install).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{PAGE_TOKENS, PAGES_PER_HASH, PeerConfig, Recorder, SystemResult, TOKEN_BYTES, WARM_BASE};
use crate::replay::TOKENS_PER_HASH;
use crate::replay::cluster::{free_port, tail};

/// The driver, written next to the run's files.
const DRIVER: &str = include_str!("lmcache_driver.py");
/// LMCache's chunk (the recipe's): 16 pages, 32 MiB in this shape.
const CHUNK_TOKENS: u32 = 256;

/// Where LMCache comes from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LmcacheSetup {
    pub python: PathBuf,
    /// A directory holding the `lmcache` package (put first on `PYTHONPATH`); empty: none.
    pub path: PathBuf,
}

impl Default for LmcacheSetup {
    fn default() -> Self {
        let cache = PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/kvcached");
        Self { python: cache.join("venv-vllm/bin/python"), path: cache.join("lmcache-0.5.6") }
    }
}

/// A child process stopped with SIGINT (LMCache's server shuts down cleanly on it), then
/// killed if it lingers or if dropped.
struct Proc(Option<Child>);

impl Proc {
    fn stop(&mut self) {
        if let Some(mut c) = self.0.take() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
            let deadline = Instant::now() + Duration::from_secs(20);
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

#[derive(Debug, Deserialize)]
struct DriverResult {
    lmcache: String,
    torch: String,
    python: String,
    warmup_s: f64,
    requests: Vec<DriverRequest>,
}

#[derive(Debug, Deserialize)]
struct DriverRequest {
    chunks: u64,
    chunk_tokens: u64,
    lookup_s: f64,
    hit_chunks: u64,
    error: Option<String>,
    #[serde(default)]
    retrieve_s: Option<f64>,
    #[serde(default)]
    retrieve_tokens: u64,
    #[serde(default)]
    store_s: Option<f64>,
    #[serde(default)]
    store_tokens: u64,
}

fn env(l: &LmcacheSetup) -> Vec<(&'static str, String)> {
    let mut v = vec![
        // It sends usage telemetry otherwise.
        ("LMCACHE_TRACK_USAGE", "false".to_string()),
        ("DO_NOT_TRACK", "1".to_string()),
        ("LMCACHE_DISABLE_BANNER", "1".to_string()),
    ];
    if !l.path.as_os_str().is_empty() {
        v.push(("PYTHONPATH", l.path.display().to_string()));
    }
    v
}

/// Runs the workload on a fresh LMCache server.
pub async fn run(cfg: &PeerConfig, l: &LmcacheSetup) -> Result<SystemResult, String> {
    let (cfg, l) = (cfg.clone(), l.clone());
    tokio::task::spawn_blocking(move || run_blocking(&cfg, &l)).await.map_err(|e| e.to_string())?
}

fn run_blocking(cfg: &PeerConfig, l: &LmcacheSetup) -> Result<SystemResult, String> {
    if !l.python.exists() {
        return Err(format!(
            "{} missing: LMCache runs in the vLLM environment scripts/test makes (or pass --lmcache-python)",
            l.python.display()
        ));
    }
    let dir = cfg.dir.join("lmcache");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (port, http) = (free_port()?, free_port()?);
    let l1_gb = cfg.capacity_bytes as f64 / f64::from(1u32 << 30);
    let server_args: Vec<String> = [
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--chunk-size",
        &CHUNK_TOKENS.to_string(),
        "--l1-size-gb",
        &format!("{l1_gb}"),
        "--eviction-policy",
        "LRU",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        &http.to_string(),
        // Without it the metrics port opens on 0.0.0.0.
        "--disable-metrics",
        "--supported-transfer-mode",
        "auto",
        "--shm-name",
        &format!("kvbench-lmcache-{}", std::process::id()),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let launcher = "import sys; sys.argv=['lmcache']+sys.argv[1:]\nfrom lmcache.cli.main import main; main()";
    let log = dir.join("server.log");
    let f = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let mut cmd = Command::new(&l.python);
    cmd.arg("-c").arg(launcher).args(&server_args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::from(f));
    for (k, v) in env(l) {
        cmd.env(k, v);
    }
    let mut server = Proc(Some(cmd.spawn().map_err(|e| format!("starting LMCache: {e}"))?));
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", http)).is_err() {
        let exited = server.0.as_mut().and_then(|c| c.try_wait().ok().flatten());
        if exited.is_some() || t0.elapsed() > Duration::from_secs(180) {
            return Err(format!("the LMCache server did not start: {}", tail(&log, 2000)));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let setup = format!(
        "PYTHONPATH={} LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 {} -m lmcache.cli.main {}; client: its ServerBenchClient (mode cpu, transfer mode engine_driven), shape (2,{},{PAGE_TOKENS},8,128):bfloat16:32",
        l.path.display(),
        l.python.display(),
        server_args.join(" "),
        cfg.max_pages()
    );

    let plan = serde_json::json!({
        "rpc_url": format!("tcp://127.0.0.1:{port}"),
        "http_url": format!("http://127.0.0.1:{http}"),
        "shape_spec": format!("(2,{},{PAGE_TOKENS},8,128):bfloat16:32", cfg.max_pages()),
        "num_pages": cfg.max_pages(),
        "page_tokens": PAGE_TOKENS,
        "tokens_per_hash": TOKENS_PER_HASH,
        "warm_ids": (0..cfg.warmup_requests()).map(|i| WARM_BASE + i).collect::<Vec<_>>(),
        "requests": cfg.requests,
    });
    let (plan_path, result_path, driver_path) =
        (dir.join("plan.json"), dir.join("result.json"), dir.join("lmcache_driver.py"));
    std::fs::write(&plan_path, plan.to_string()).map_err(|e| format!("{}: {e}", plan_path.display()))?;
    std::fs::write(&driver_path, DRIVER).map_err(|e| format!("{}: {e}", driver_path.display()))?;
    let driver_log = dir.join("driver.log");
    let f = std::fs::File::create(&driver_log).map_err(|e| format!("{}: {e}", driver_log.display()))?;
    let mut cmd = Command::new(&l.python);
    cmd.arg(&driver_path).arg(&plan_path).arg(&result_path).stdin(Stdio::null()).stdout(Stdio::null());
    cmd.stderr(Stdio::from(f));
    for (k, v) in env(l) {
        cmd.env(k, v);
    }
    let status = cmd.status().map_err(|e| format!("running the LMCache driver: {e}"))?;
    server.stop();
    if !status.success() {
        return Err(format!("the LMCache driver failed ({status}): {}", tail(&driver_log, 3000)));
    }
    let text = std::fs::read_to_string(&result_path).map_err(|e| format!("{}: {e}", result_path.display()))?;
    let r: DriverResult = serde_json::from_str(&text).map_err(|e| format!("LMCache driver result: {e}"))?;
    let mut rec = Recorder::default();
    let pages = |tokens: u64| tokens / u64::from(PAGE_TOKENS);
    for (i, q) in r.requests.iter().enumerate() {
        if let Some(e) = &q.error {
            rec.error(format!("request {i}: lookup: {e}"));
        }
        rec.lookup(
            Duration::from_secs_f64(q.lookup_s),
            pages(q.hit_chunks * q.chunk_tokens),
            pages(q.chunks * q.chunk_tokens),
        );
        if let Some(s) = q.retrieve_s {
            rec.retrieve(q.retrieve_tokens * TOKEN_BYTES, Duration::from_secs_f64(s));
            if q.retrieve_tokens == 0 {
                rec.error(format!("request {i}: retrieve failed"));
            }
        }
        if let Some(s) = q.store_s {
            rec.store(q.store_tokens * TOKEN_BYTES, Duration::from_secs_f64(s));
            if q.store_tokens == 0 {
                rec.error(format!("request {i}: store failed"));
            }
        }
    }
    // A request's pages in this shape: hash ids x PAGES_PER_HASH (the chunks cover them all).
    debug_assert_eq!(u64::from(PAGES_PER_HASH) * u64::from(PAGE_TOKENS), u64::from(TOKENS_PER_HASH));
    let version = format!("lmcache {} (torch {}, Python {})", r.lmcache, r.torch, r.python);
    Ok(rec.finish("lmcache", version, setup, r.warmup_s))
}

/// Whether `path` looks like a directory holding the package (for a clear error up front).
pub fn package_present(path: &Path) -> bool {
    path.as_os_str().is_empty() || path.join("lmcache").is_dir()
}
