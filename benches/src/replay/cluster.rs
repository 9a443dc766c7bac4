//! The parts a replay runs on: `kvcached` daemons as processes (the real binary, configured
//! with its own TOML), a `kvrouter` (the real binary as a process, or `kvrouter::serve_router`
//! on a loopback port of this process), and for G4 a SeaweedFS on loopback shared by every
//! daemon. `peers` and `many` start their daemons with [`DaemonProcess`] too.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::ReplayConfig;
use super::report::NodeStats;

/// A free TCP port on loopback for a child to listen on, from below the ephemeral range
/// ([`kvtests::proc::free_ports`]: no connection takes it before the child binds it).
pub fn free_port() -> Result<u16, String> {
    Ok(kvtests::proc::free_port())
}

use crate::child::Managed;
pub use crate::child::tail;

/// A `kvcached` process; killed if dropped without [`DaemonProcess::stop`].
#[derive(Debug)]
pub struct DaemonProcess {
    proc: Managed,
    pub name: String,
    pub socket: PathBuf,
    /// `host:port` of its HTTP listener (metrics, health, the routers' recovery routes).
    pub http: String,
    pub log: PathBuf,
}

impl DaemonProcess {
    /// Starts `bin` with `config` (its socket and HTTP address are set here, under `dir`) and
    /// `env`; waits until its socket accepts connections.
    pub fn spawn(
        bin: &Path,
        dir: &Path,
        name: &str,
        mut config: kvcached::Config,
        env: &[(&str, &str)],
    ) -> Result<Self, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let port = free_port()?;
        config.socket = dir.join("kvcached.sock");
        config.metrics_addr = format!("127.0.0.1:{port}").parse().map_err(|e| format!("{e}"))?;
        let text = toml::to_string(&config).map_err(|e| format!("{name}: configuration: {e}"))?;
        let cfg_path = dir.join("kvcached.toml");
        std::fs::write(&cfg_path, text).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
        let _ = std::fs::remove_file(&config.socket);
        let log = dir.join("daemon.log");
        let mut cmd = Command::new(bin);
        cmd.arg("--config").arg(&cfg_path);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut d = Self {
            proc: Managed::spawn(name, &mut cmd, log.clone())?,
            name: name.to_string(),
            socket: config.socket.clone(),
            http: format!("127.0.0.1:{port}"),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::os::unix::net::UnixStream::connect(&d.socket).is_err() {
            if let Some(status) = d.proc.exited() {
                return Err(format!("{name} exited at start ({status}): {}", tail(&d.log, 2000)));
            }
            if Instant::now() > deadline {
                return Err(format!("{name} did not open its socket in 60 s: {}", tail(&d.log, 2000)));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(d)
    }

    /// [`DaemonProcess::spawn`] named `kvcached`, on a blocking thread, then
    /// [`DaemonProcess::wait_prefault`] (up to 5 minutes): a daemon ready to be measured.
    pub async fn start_prefaulted(bin: PathBuf, dir: PathBuf, config: kvcached::Config) -> Result<Self, String> {
        tokio::task::spawn_blocking(move || {
            let p = Self::spawn(&bin, &dir, "kvcached", config, &[])?;
            p.wait_prefault(Duration::from_secs(300))?;
            Ok(p)
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// Text of its `/metrics`.
    pub fn metrics_text(&self) -> String {
        kvtests::proc::http_get(&self.http, "/metrics").1
    }

    /// Waits until its G2 pool is mapped (a daemon that has been up a while): saves that race
    /// the background prefault would measure the prefault.
    pub fn wait_prefault(&self, within: Duration) -> Result<(), String> {
        let t0 = Instant::now();
        while !self.metrics_text().lines().any(|l| l == "kvcached_g2_prefault_done 1") {
            if t0.elapsed() > within {
                return Err(format!("{}: the G2 prefault did not finish in {within:?}", self.name));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// SIGTERM, then waits (the daemon drains and flushes; killed after 30 s).
    pub fn stop(self) -> Result<(), String> {
        self.proc.stop(Duration::from_secs(30))
    }
}

/// The router: a `kvrouter` process, or one serving in this process.
#[derive(Debug)]
pub enum RouterHandle {
    Process {
        child: Option<Child>,
        base: String,
        log: PathBuf,
    },
    InProcess {
        base: String,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        task: Option<tokio::task::JoinHandle<Result<(), String>>>,
    },
}

impl RouterHandle {
    /// Starts a router with `config`: `bin` as a process (listening on a free loopback port),
    /// or in this process when `bin` is none. Waits until it answers.
    pub async fn start(bin: Option<&Path>, dir: &Path, config: kvrouter::RouterConfig) -> Result<Self, String> {
        let h = match bin {
            Some(bin) => {
                let port = free_port()?;
                let path = dir.join("kvrouter.toml");
                let text = toml::to_string(&config).map_err(|e| format!("router configuration: {e}"))?;
                std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
                let log = dir.join("router.log");
                let f = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
                let child = Command::new(bin)
                    .arg("--listen")
                    .arg(format!("127.0.0.1:{port}"))
                    .arg("--config")
                    .arg(&path)
                    .env("RUST_LOG", "warn")
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::from(f))
                    .spawn()
                    .map_err(|e| format!("starting {}: {e}", bin.display()))?;
                Self::Process { child: Some(child), base: format!("http://127.0.0.1:{port}"), log }
            }
            None => {
                let listener =
                    tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| format!("router: {e}"))?;
                let base = format!("http://{}", listener.local_addr().map_err(|e| format!("router: {e}"))?);
                let (tx, rx) = tokio::sync::oneshot::channel::<()>();
                let task = tokio::spawn(async move {
                    kvrouter::serve(listener, config, async move {
                        let _ = rx.await;
                    })
                    .await
                    .map_err(|e| e.to_string())
                });
                Self::InProcess { base, stop: Some(tx), task: Some(task) }
            }
        };
        let http = reqwest::Client::new();
        let t0 = Instant::now();
        while http.get(format!("{}/healthz", h.base())).send().await.is_err() {
            if t0.elapsed() > Duration::from_secs(30) {
                let log = match &h {
                    Self::Process { log, .. } => tail(log, 2000),
                    Self::InProcess { .. } => String::new(),
                };
                return Err(format!("the router did not answer in 30 s: {log}"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(h)
    }

    pub fn base(&self) -> &str {
        match self {
            Self::Process { base, .. } | Self::InProcess { base, .. } => base,
        }
    }

    /// Its process id, when it is a process of its own that runs.
    pub fn pid(&self) -> Option<u32> {
        match self {
            Self::Process { child, .. } => child.as_ref().map(Child::id),
            Self::InProcess { .. } => None,
        }
    }

    /// Whether it is a process of its own.
    pub fn is_process(&self) -> bool {
        matches!(self, Self::Process { .. })
    }

    /// Its `/metrics` text (empty when it does not answer).
    pub async fn metrics(&self) -> String {
        let http = reqwest::Client::new();
        match http.get(format!("{}/metrics", self.base())).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// Waits until the router knows `n` workers (each daemon's first report names its engines).
    pub async fn wait_workers(&self, n: usize, within: Duration) -> Result<(), String> {
        let http = reqwest::Client::new();
        let t0 = Instant::now();
        loop {
            let known = match http.get(format!("{}/healthz", self.base())).send().await {
                Ok(r) => r.json::<serde_json::Value>().await.ok().and_then(|v| v["workers"].as_u64()).unwrap_or(0),
                Err(_) => 0,
            };
            if known as usize >= n {
                return Ok(());
            }
            if t0.elapsed() > within {
                return Err(format!("the router knows {known} of {n} workers after {within:?}"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn stop(mut self) -> Result<(), String> {
        match &mut self {
            Self::Process { child, log, .. } => {
                let Some(mut c) = child.take() else { return Ok(()) };
                // SAFETY: kill(2) on our own child's pid.
                unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
                let s = tokio::task::spawn_blocking(move || c.wait()).await.map_err(|e| e.to_string())?;
                match s {
                    Ok(s) if s.success() => Ok(()),
                    Ok(s) => Err(format!("the router exited with {s}: {}", tail(log, 2000))),
                    Err(e) => Err(format!("the router: {e}")),
                }
            }
            Self::InProcess { stop, task, .. } => {
                if let Some(tx) = stop.take() {
                    let _ = tx.send(());
                }
                match task.take() {
                    Some(t) => t.await.map_err(|e| format!("router task: {e}"))?,
                    None => Ok(()),
                }
            }
        }
    }
}

impl Drop for RouterHandle {
    fn drop(&mut self) {
        if let Self::Process { child, .. } = self
            && let Some(mut c) = child.take()
        {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The router's configuration for a replay: the replay's namespace (so `POST /route` takes
/// tokens, as from a gateway), the daemons' report interval, the seed.
pub fn router_config(cfg: &ReplayConfig) -> kvrouter::RouterConfig {
    let l = cfg.layout();
    let mut c = kvrouter::RouterConfig {
        seed: Some(cfg.seed),
        namespaces: vec![crate::child::router_namespace(super::NAMESPACE, super::MODEL_ID, &l)],
        ..kvrouter::RouterConfig::default()
    };
    c.health.default_report_interval_ms = cfg.report_interval_ms;
    c
}

/// One daemon's configuration: G2 of `g2_blocks` blocks evicting exactly at capacity (the
/// model's LRU holds exactly its capacity; the daemon's default watermarks would keep 95-98% of
/// it), G3 and G4 as configured, hit reports to `router` as node `node-<i>`.
pub fn daemon_config(
    cfg: &ReplayConfig,
    i: usize,
    dir: &Path,
    router: &str,
    g4: Option<(&str, &str)>,
) -> kvcached::Config {
    let mut c = kvcached::Config::default();
    let (block, page) = (cfg.block_bytes(), cfg.page_size());
    c.g2.capacity_bytes = cfg.g2_blocks * block;
    c.g2.page_size = page as usize;
    c.g2.shm_dir = cfg.shm_dir.clone();
    c.g2.high_watermark = 1.0;
    c.g2.low_watermark = 1.0;
    c.g3.enabled = cfg.g3_blocks > 0;
    c.g3.dir = dir.join("g3");
    c.g3.capacity_bytes = cfg.g3_blocks.max(1) * block;
    c.g3.page_size = page as usize;
    c.g3.fsync = false;
    c.g3.high_watermark = 1.0;
    c.g3.low_watermark = 1.0;
    if let Some((endpoint, url)) = g4 {
        c.g4.enabled = true;
        c.g4.url = url.to_string();
        c.g4.endpoint = endpoint.to_string();
        c.g4.allow_http = true;
    }
    c.router.urls = vec![router.to_string()];
    // The replay's nodes are one user's: the router replays from them without credentials.
    c.metrics_auth.open = true;
    c.router.node = format!("node-{i}");
    c.router.report_interval_ms = cfg.report_interval_ms.max(1);
    c
}

/// Daemons, router and object store of one replay.
#[derive(Debug)]
pub struct Cluster {
    pub daemons: Vec<DaemonProcess>,
    pub router: RouterHandle,
    pub s3: Option<kvtests::s3::SeaweedFs>,
}

impl Cluster {
    /// Starts everything under `dir` and waits until the daemons' pools are mapped.
    pub async fn start(cfg: &ReplayConfig, dir: &Path) -> Result<Self, String> {
        let router = RouterHandle::start(cfg.kvrouter_bin.as_deref(), dir, router_config(cfg)).await?;
        let s3 = if cfg.g4 {
            let weed = kvtests::s3::weed();
            if !weed.exists() {
                return Err(format!(
                    "{} missing: G4 runs on SeaweedFS (scripts/test installs it; or set KVCACHED_WEED)",
                    weed.display()
                ));
            }
            let s3_dir = dir.join("s3");
            // It blocks until the bucket is writable.
            let s = tokio::task::spawn_blocking(move || kvtests::s3::SeaweedFs::start(&s3_dir))
                .await
                .map_err(|e| format!("SeaweedFS: {e}"))?;
            Some(s)
        } else {
            None
        };
        let g4_url = format!("s3://{}/replay-{}", kvtests::s3::BUCKET, std::process::id());
        let env = [("AWS_ACCESS_KEY_ID", kvtests::s3::ACCESS_KEY), ("AWS_SECRET_ACCESS_KEY", kvtests::s3::SECRET_KEY)];
        let mut daemons = Vec::with_capacity(cfg.nodes);
        for i in 0..cfg.nodes {
            let d = dir.join(format!("node-{i}"));
            let g4 = s3.as_ref().map(|s| (s.endpoint.as_str(), g4_url.as_str()));
            let c = daemon_config(cfg, i, &d, router.base(), g4);
            let bin = cfg.kvcached_bin.clone();
            let name = format!("node-{i}");
            let env = env.map(|(k, v)| (k.to_string(), v.to_string()));
            let p = tokio::task::spawn_blocking(move || {
                let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                let p = DaemonProcess::spawn(&bin, &d, &name, c, &env)?;
                p.wait_prefault(Duration::from_secs(300))?;
                Ok::<_, String>(p)
            })
            .await
            .map_err(|e| format!("daemon start: {e}"))??;
            daemons.push(p);
        }
        Ok(Self { daemons, router, s3 })
    }

    /// Each daemon's tier statistics (through an engine connection of its own).
    pub async fn node_stats(&self, cfg: &ReplayConfig) -> Vec<NodeStats> {
        let mut out = Vec::with_capacity(self.daemons.len());
        for d in &self.daemons {
            let mut n = NodeStats { name: d.name.clone(), ..NodeStats::default() };
            if let Ok(c) = kvclient::Client::connect(&d.socket).await
                && let Ok(s) = c.stats().await
            {
                n.writethrough_dropped = s.writethrough_dropped;
                n.tiers = s
                    .tiers
                    .iter()
                    .map(|t| super::report::TierStat {
                        tier: t.tier.clone(),
                        blocks: t.blocks,
                        used_bytes: t.used_bytes,
                        capacity_bytes: t.capacity_bytes,
                        hits: t.hits,
                        misses: t.misses,
                        evictions: t.evictions,
                        checksum_failures: t.checksum_failures,
                    })
                    .collect();
            }
            n.block_bytes = cfg.block_bytes();
            out.push(n);
        }
        out
    }

    /// The last lines of every log, for an error message.
    pub fn logs_tail(&self) -> String {
        let mut s = String::new();
        for d in &self.daemons {
            let t = tail(&d.log, 600);
            if !t.trim().is_empty() {
                s += &format!("\n--- {} log (tail):\n{t}", d.name);
            }
        }
        if let RouterHandle::Process { log, .. } = &self.router {
            let t = tail(log, 600);
            if !t.trim().is_empty() {
                s += &format!("\n--- router log (tail):\n{t}");
            }
        }
        s
    }

    /// Stops the daemons (clean exits checked), then the router and the object store.
    pub async fn stop(self) -> Result<(), String> {
        let mut errors = Vec::new();
        for d in self.daemons {
            if let Err(e) =
                tokio::task::spawn_blocking(move || d.stop()).await.map_err(|e| e.to_string()).and_then(|r| r)
            {
                errors.push(e);
            }
        }
        if let Err(e) = self.router.stop().await {
            errors.push(e);
        }
        drop(self.s3);
        if errors.is_empty() { Ok(()) } else { Err(errors.join("; ")) }
    }
}
