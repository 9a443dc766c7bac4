//! A cluster across real processes for the tests: a kvrouter in this process (`serve_router`
//! on a port of the caller's), kvcached daemons as processes of their own publishing to it,
//! engines attached through the real client, and a JSON client of the router's API.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use kvclient::{Client, KvMemory, synthetic_block};
use kvproto::KvLayout;
use kvproto::Namespace;
use kvrouter::config::RouterConfig;
use serde_json::{Value, json};

use crate::fixture::{KillOnDrop, daemon_command, daemon_stderr};
use crate::router_harness::small_spec;

/// The layout of the engines here.
pub fn layout() -> KvLayout {
    crate::fixture::small_layout()
}

/// A router with namespace `m` (model `cluster/model`), seeded, expecting reports every 200 ms.
pub fn router_config() -> RouterConfig {
    let mut c =
        RouterConfig { namespaces: vec![small_spec("cluster/model")], seed: Some(1), ..RouterConfig::default() };
    c.health.default_report_interval_ms = 200;
    // Off: these steps check which tier the index says holds each block, and a prefetch hint
    // would bring node-a's G3 blocks into its G2 (tests/cross_node.rs covers prefetch).
    c.prefetch.enabled = false;
    c
}

#[derive(Debug)]
pub struct RouterProc {
    pub base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

pub async fn start_router(addr: &str) -> RouterProc {
    start_router_with(addr, router_config()).await
}

pub async fn start_router_with(addr: &str, config: RouterConfig) -> RouterProc {
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let router = kvrouter::Router::new(config).unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        kvrouter::serve_router(listener, router, async move {
            let _ = rx.await;
        })
        .await
        .unwrap();
    });
    RouterProc { base, stop: Some(tx), task }
}

impl RouterProc {
    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(10), self.task).await.unwrap().unwrap();
    }
}

/// Starts the `kvcached` binary `bin` in `dir` with `router_section` as its `[router]` settings
/// (and anything after them), its HTTP listener on a free loopback port.
pub fn spawn_daemon_bin(bin: &str, dir: &Path, router_section: &str) -> KillOnDrop {
    spawn_daemon_at(bin, dir, "127.0.0.1:0", router_section)
}

/// [`spawn_daemon_bin`] with its HTTP listener (open: no credentials) on `http`.
pub fn spawn_daemon_at(bin: &str, dir: &Path, http: &str, router_section: &str) -> KillOnDrop {
    let cfg = dir.join("kvcached.toml");
    std::fs::write(&cfg, format!("metrics_addr = \"{http}\"\n[metrics_auth]\nopen = true\n[router]\n{router_section}"))
        .unwrap();
    let sock = dir.join("kvcached.sock");
    let _ = std::fs::remove_file(&sock);
    let mut cmd = daemon_command(bin, dir);
    cmd.args(["--config", cfg.to_str().unwrap()]);
    daemon_stderr(&mut cmd, dir);
    KillOnDrop::spawn_serving(&mut cmd, &sock)
}

pub fn signal_and_wait(mut daemon: KillOnDrop, sig: i32) {
    let Some(mut child) = daemon.signal(sig) else { return };
    let status = child.wait().unwrap();
    if sig == libc::SIGTERM {
        assert!(status.success(), "daemon exited with {status}");
    }
}

/// An engine attached to one daemon as worker `<node>/gpu0`.
pub async fn engine(dir: &Path, address: &str) -> (Client, KvMemory) {
    let mut mem = KvMemory::create_layer_separate(dir.join("engine-kv"), &layout(), 64).unwrap();
    let len = layout().block_bytes() as usize;
    for b in 0..64 {
        mem.write_block(b, &synthetic_block(7, b, len));
    }
    let c = Client::connect(dir.join("kvcached.sock")).await.unwrap();
    c.register_worker("gpu0", &Namespace::new("cluster/model", layout()), &mem, address, "both").await.unwrap();
    (c, mem)
}

pub async fn route(http: &reqwest::Client, base: &str, tokens: &[u32]) -> Value {
    let r = match http.post(format!("{base}/route")).json(&json!({"namespace": "m", "tokens": tokens})).send().await {
        Ok(r) => r,
        // The router is restarting: callers retry.
        Err(e) => return json!({"error": e.to_string()}),
    };
    let status = r.status();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    if status.is_success() { v } else { json!({"status": status.as_u16(), "body": v}) }
}

/// Polls the route of `tokens` until `ok` accepts it.
pub async fn wait_route(
    http: &reqwest::Client,
    base: &str,
    tokens: &[u32],
    what: &str,
    ok: impl Fn(&Value) -> bool,
) -> Value {
    let t0 = Instant::now();
    loop {
        let v = route(http, base, tokens).await;
        if ok(&v) {
            return v;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "timed out waiting for {what}; last answer {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn cached(v: &Value) -> [u64; 4] {
    let c = v["cached_blocks"].as_array().cloned().unwrap_or_default();
    let g = |i: usize| c.get(i).and_then(Value::as_u64).unwrap_or(0);
    [g(0), g(1), g(2), g(3)]
}

pub async fn metric(http: &reqwest::Client, base: &str, series: &str) -> f64 {
    let text = http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')).and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}
