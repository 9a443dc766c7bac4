//! `kvbench soak`: a real `kvcached` (the release binary, G2 + G3 on a temp directory) and a
//! real `kvrouter` as processes, several engines under sustained mixed load for minutes, and
//! every few seconds a sample of what would show a leak: the daemon's and the router's RSS
//! (anonymous and shared), open descriptors, threads and memory mappings, the bytes under the
//! run's `/dev/shm` directory, and the p50/p99 of each operation over the interval. At the end
//! every series is fitted with a line over the second half of the run (after warm-up: G2 and G3
//! full, caches at their sizes) and the run fails when any grew more than its bound
//! ([`sample::BOUNDS`]), when a load served a wrong byte, when a process died, or when the daemon
//! did not stop cleanly or left files behind.
//!
//! What each engine does, in a loop (`engine`): picks a prompt (skewed popularity over
//! `--prompts`, prompts sharing leading blocks in families), asks the router where it goes (one
//! request in four, then a routed lookup) or looks it up directly, loads the cached prefix into
//! its slots and checks it, writes the rest and saves it. Now and then it unregisters and
//! registers again, or drops its connection (with or without unregistering first) and connects
//! again, sometimes with new KV memory.
//!
//! # Layout
//! - [`engine`]: the engines and the latency recorder.
//! - [`sample`]: reading `/proc`, the sample rows (CSV), the fits and bounds, the report.

pub mod engine;
pub mod sample;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvproto::KvLayout;

use self::engine::{Counters, Recorder};
use self::sample::{Row, Sampler};

/// The model id of the soak's namespace (engines and router agree on it).
pub const MODEL_ID: &str = "kvbench/soak";
/// The router's name for that namespace.
pub const NAMESPACE: &str = "soak";

/// `kvbench soak`'s command line.
#[derive(Debug, Clone, clap::Args)]
pub struct SoakArgs {
    /// Minutes of load (the samples of the second half are fitted).
    #[arg(long, default_value_t = 10.0)]
    pub minutes: f64,
    /// Seconds between two samples.
    #[arg(long, default_value_t = 5.0)]
    pub interval_s: f64,
    /// Engines attached at once.
    #[arg(long, default_value_t = 6)]
    pub engines: usize,
    /// Distinct prompts: 2-12 blocks of 128 KiB each, 1-3 of them shared within families of about
    /// 8 prompts (3000: about 16 000 distinct blocks, twice what the default G3 holds).
    #[arg(long, default_value_t = 3000)]
    pub prompts: u32,
    /// The daemon's G2 pool in MiB.
    #[arg(long, default_value_t = 256)]
    pub g2_mib: u64,
    /// The daemon's G3 capacity in MiB.
    #[arg(long, default_value_t = 1024)]
    pub g3_mib: u64,
    /// Pause of each engine between two requests, in ms.
    #[arg(long, default_value_t = 40)]
    pub think_ms: u64,
    /// Where samples.csv and soak.json are written.
    #[arg(long, default_value = "soak-out")]
    pub out: PathBuf,
    /// The `kvcached` binary (default: beside this kvbench).
    #[arg(long)]
    pub kvcached: Option<PathBuf>,
    /// The `kvrouter` binary (default: beside this kvbench).
    #[arg(long)]
    pub kvrouter: Option<PathBuf>,
    /// Directory for G3 and the logs (default: a temp directory under $TMPDIR).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Where the run's shared-memory directory is made (G2 pool, engines' KV files).
    #[arg(long, default_value = "/dev/shm")]
    pub shm: PathBuf,
    /// Multiplies every growth bound (a short run, still warming up, needs looser ones).
    #[arg(long, default_value_t = 1.0)]
    pub bound_scale: f64,
    /// Seed of the engines' choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// The KV layout: 2 layers x 8 KV heads x 128 dims, bf16, 16-token blocks: 128 KiB a block.
pub fn layout() -> KvLayout {
    KvLayout::bf16_8x128(2, 16)
}

use crate::child::{Managed as Proc, tail as tail_n};

/// The last 2000 bytes of a log.
fn tail(path: &Path) -> String {
    tail_n(path, 2000)
}

/// A binary beside this kvbench (the same `cargo build --release`), or `given`.
fn binary(given: &Option<PathBuf>, name: &str) -> Result<PathBuf, String> {
    if let Some(p) = given {
        return Ok(p.clone());
    }
    let me = std::env::current_exe().map_err(|e| format!("where is kvbench: {e}"))?;
    let p = me.with_file_name(name);
    if p.exists() {
        Ok(p)
    } else {
        Err(format!("{} missing: build it (cargo build --release -p {name}) or pass --{name}", p.display()))
    }
}

fn router_config() -> kvrouter::RouterConfig {
    let l = layout();
    let mut c = kvrouter::RouterConfig {
        seed: Some(1),
        namespaces: vec![crate::child::router_namespace(NAMESPACE, MODEL_ID, &l)],
        ..kvrouter::RouterConfig::default()
    };
    c.health.default_report_interval_ms = 200;
    c
}

fn daemon_config(a: &SoakArgs, dir: &Path, shm: &Path, router: &str, http: &str) -> Result<kvcached::Config, String> {
    let mut c = kvcached::Config {
        socket: dir.join("kvcached.sock"),
        metrics_addr: http.parse().map_err(|e| format!("{http}: {e}"))?,
        ..Default::default()
    };
    c.g2.capacity_bytes = a.g2_mib << 20;
    c.g2.shm_dir = shm.to_path_buf();
    c.g3.enabled = true;
    c.g3.dir = dir.join("g3");
    c.g3.capacity_bytes = a.g3_mib << 20;
    c.g3.fsync = false;
    // Engines that drop their connection without unregistering are detached within 3 s.
    c.engines.lease_ms = 3_000;
    c.router.urls = vec![router.to_string()];
    // One user's node: the router replays from it without credentials.
    c.metrics_auth.open = true;
    c.router.node = "soak".into();
    c.router.report_interval_ms = 200;
    Ok(c)
}

/// The router and the daemon, started and answering.
struct Cluster {
    router: Proc,
    router_base: String,
    daemon: Proc,
    daemon_http: String,
    socket: PathBuf,
}

async fn start(a: &SoakArgs, dir: &Path, shm: &Path) -> Result<Cluster, String> {
    let (kvcached_bin, kvrouter_bin) = (binary(&a.kvcached, "kvcached")?, binary(&a.kvrouter, "kvrouter")?);
    let rport = crate::replay::cluster::free_port()?;
    let rcfg = dir.join("kvrouter.toml");
    let text = toml::to_string(&router_config()).map_err(|e| format!("router configuration: {e}"))?;
    std::fs::write(&rcfg, text).map_err(|e| format!("{}: {e}", rcfg.display()))?;
    let mut cmd = Command::new(&kvrouter_bin);
    cmd.arg("--listen").arg(format!("127.0.0.1:{rport}")).arg("--config").arg(&rcfg).env("RUST_LOG", "warn");
    let router = Proc::spawn("kvrouter", &mut cmd, dir.join("router.log"))?;
    let router_base = format!("http://127.0.0.1:{rport}");

    let daemon_http = format!("127.0.0.1:{}", crate::replay::cluster::free_port()?);
    let c = daemon_config(a, dir, shm, &router_base, &daemon_http)?;
    let socket = c.socket.clone();
    let dcfg = dir.join("kvcached.toml");
    let text = toml::to_string(&c).map_err(|e| format!("daemon configuration: {e}"))?;
    std::fs::write(&dcfg, text).map_err(|e| format!("{}: {e}", dcfg.display()))?;
    let mut cmd = Command::new(&kvcached_bin);
    cmd.arg("--config").arg(&dcfg).env("RUST_LOG", "warn");
    let mut daemon = Proc::spawn("kvcached", &mut cmd, dir.join("daemon.log"))?;

    let http = reqwest::Client::new();
    let t0 = Instant::now();
    loop {
        let up = http.get(format!("{router_base}/healthz")).send().await.is_ok();
        let prefaulted = engine::metric(
            &sample::get_text(&http, &format!("http://{daemon_http}/metrics")).await,
            "kvcached_g2_prefault_done",
        ) >= 1.0;
        if up && prefaulted && std::os::unix::net::UnixStream::connect(&socket).is_ok() {
            break;
        }
        if let Some(s) = daemon.exited() {
            return Err(format!("kvcached exited at start ({s}): {}", tail(&daemon.log)));
        }
        if t0.elapsed() > Duration::from_secs(120) {
            return Err(format!("the daemon or the router did not come up in 120 s: {}", tail(&daemon.log)));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(Cluster { router, router_base, daemon, daemon_http, socket })
}

/// Runs the soak; the report (Markdown) and whether every bound held.
pub async fn run(a: &SoakArgs) -> Result<(String, bool), String> {
    std::fs::create_dir_all(&a.out).map_err(|e| format!("{}: {e}", a.out.display()))?;
    let tmp = match &a.dir {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
            tempfile::tempdir_in(d)
        }
        None => tempfile::tempdir(),
    }
    .map_err(|e| format!("temp directory: {e}"))?;
    let shm = tempfile::Builder::new()
        .prefix("kvsoak-")
        .tempdir_in(&a.shm)
        .map_err(|e| format!("a directory in {}: {e}", a.shm.display()))?;
    let mut cluster = start(a, tmp.path(), shm.path()).await?;
    eprintln!(
        "kvbench soak: kvcached pid {} (G2 {} MiB in {}, G3 {} MiB in {}), kvrouter pid {}; {} engines for {} min",
        cluster.daemon.pid,
        a.g2_mib,
        shm.path().display(),
        a.g3_mib,
        tmp.path().join("g3").display(),
        cluster.router.pid,
        a.engines,
        a.minutes
    );

    let rec = Arc::new(Recorder::default());
    let counters = Arc::new(Counters::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..a.engines {
        let e = engine::Engine {
            index: i,
            socket: cluster.socket.clone(),
            shm: shm.path().to_path_buf(),
            route_url: format!("{}/route", cluster.router_base),
            prompts: a.prompts.max(16),
            think: Duration::from_millis(a.think_ms),
            seed: a.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(i as u64),
        };
        let (rec, counters, stop) = (Arc::clone(&rec), Arc::clone(&counters), Arc::clone(&stop));
        tasks.push(tokio::spawn(async move { e.run(&rec, &counters, &stop).await }));
    }

    let mut sampler = Sampler::new(
        &a.out,
        cluster.daemon.pid,
        cluster.router.pid,
        shm.path(),
        &tmp.path().join("g3").join("index"),
        &cluster.daemon_http,
        &cluster.router_base,
    )?;
    let total = Duration::from_secs_f64(a.minutes.max(0.05) * 60.0);
    let every = Duration::from_secs_f64(a.interval_s.max(0.5));
    let t0 = Instant::now();
    let mut next = t0;
    let mut died = None;
    let mut rows: Vec<Row> = Vec::new();
    while t0.elapsed() < total {
        next += every;
        tokio::time::sleep_until(next.into()).await;
        let row = sampler.sample(t0.elapsed(), &rec, &counters).await?;
        eprintln!("{}", row.progress());
        rows.push(row);
        for p in [&mut cluster.daemon, &mut cluster.router] {
            if let Some(s) = p.exited() {
                died = Some(format!("{} exited during the run ({s}): {}", p.name, tail(&p.log)));
            }
        }
        if died.is_some() {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        if let Err(e) = t.await {
            died.get_or_insert(format!("engine task: {e}"));
        }
    }
    let run_s = t0.elapsed().as_secs_f64();
    let Cluster { router, daemon, .. } = cluster;
    let daemon_stop =
        tokio::task::spawn_blocking(move || daemon.stop(Duration::from_secs(60))).await.map_err(|e| e.to_string())?;
    let router_stop =
        tokio::task::spawn_blocking(move || router.stop(Duration::from_secs(30))).await.map_err(|e| e.to_string())?;
    let leftover = sample::files_in(shm.path());
    let report = sample::Report::new(
        a,
        &rows,
        &rec,
        &counters,
        run_s,
        sample::Ending {
            died,
            daemon_stop: daemon_stop.err(),
            router_stop: router_stop.err(),
            leftover_shm_files: leftover,
        },
    );
    report.write_json(&a.out.join("soak.json"))?;
    Ok((report.markdown(), report.passed()))
}

/// `kvbench soak`: runs it on a 2-thread runtime, prints the report; exit status 1 when a bound
/// did not hold or the run failed.
pub fn main(a: &SoakArgs) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvbench: cannot start a runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(a)) {
        Ok((md, passed)) => {
            print!("{md}");
            if passed {
                ExitCode::SUCCESS
            } else {
                eprintln!("kvbench soak: FAILED (see the table above)");
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("kvbench soak: {e}");
            ExitCode::FAILURE
        }
    }
}
