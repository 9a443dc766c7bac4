//! The dashboards and alert rules of `deploy/` against the real thing: a real Prometheus (Debian's
//! `prometheus` package, on 127.0.0.1 only) scrapes a real kvcached (in process, G2 + G3 + G4 on a
//! shared directory), a second kvcached (the real binary, another node, G2 + G4 on the same
//! directory) and a real kvrouter, under traffic from engines through the real client; it loads
//! `deploy/prometheus/rules.yml`. Then every query of every panel of `deploy/grafana/*.json` and
//! every alert expression (each side of `and` / `or`, without its threshold) must return at least
//! one series, and every rule must evaluate without error: a metric renamed in the code leaves no
//! dead panel and no alert that can never fire.
//!
//! The traffic is chosen so that each tier serves loads: the in-process daemon's G2 is small, so
//! prompts saved a while ago come back from G3; prompts saved by the other node's engine come
//! from G4. Lookups miss, requests are routed and their outcomes reported, one engine is refused
//! at a limit, and a third publisher loses events and cannot be recovered (an event gap, failed
//! recoveries, a stale worker), so the router's failure series exist too.
//!
//! `KVCACHED_PLOT_DASHBOARD=1` also renders the dashboard's main panels from this Prometheus into
//! `docs/img/dashboard.png` (`scripts/plot_dashboard.py`, matplotlib from the cache's venv-plot).
//! `PROMETHEUS` names the binary (default: `prometheus` on PATH).
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvcached::{Config, Listeners};
use kvclient::{Client, KvMemory, synthetic_block};
use kvproto::publisher::MemoryPublisher;
use kvproto::{KvLayout, Namespace, TierKind};
use kvrouter::config::RouterConfig;
use kvtests::fixture::KillOnDrop;
use kvtests::proc::free_port;
use kvtests::router_harness::{self, Server};
use serde_json::{Value, json};

const MODEL: &str = "prom/model";
/// How long engines drive traffic (the dashboards' rates need a few scrapes of it).
const TRAFFIC: Duration = Duration::from_secs(15);

fn layout() -> KvLayout {
    kvtests::fixture::small_layout()
}

fn ns() -> Namespace {
    Namespace::new(MODEL, layout())
}

/// `blocks` full blocks of prompt number `seed`.
fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    kvtests::fixture::prompt(seed.wrapping_mul(40_503), blocks)
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn router_config() -> RouterConfig {
    let mut c =
        RouterConfig { namespaces: vec![router_harness::small_spec(MODEL)], seed: Some(1), ..RouterConfig::default() };
    c.health.default_report_interval_ms = 500;
    c
}

/// A child process and its log, killed (and waited for) when dropped: none outlives the test.
struct Proc {
    child: KillOnDrop,
    log: PathBuf,
}

impl Proc {
    fn log(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut start = text.len().saturating_sub(4000);
        while !text.is_char_boundary(start) {
            start += 1;
        }
        text[start..].to_string()
    }

    fn sigterm(mut self) {
        if let Some(mut c) = self.child.signal(libc::SIGTERM) {
            let _ = c.wait();
        }
    }
}

/// The daemon of node-a, serving in this process.
struct NodeA {
    http: std::net::SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), kvcached::ServerError>>,
}

/// Starts node-a's daemon: G2 of 128 blocks (so older prompts come from G3), G3, and G4 in `g4`
/// (a directory every node shares), publishing to `router`.
async fn start_node_a(dir: &Path, g4: &Path, router: &str) -> NodeA {
    let mut c = Config {
        socket: dir.join("kvcached.sock"),
        metrics_addr: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    };
    c.g2.capacity_bytes = 2 << 20;
    c.g2.page_size = 16 << 10;
    c.g2.shm_dir = dir.to_path_buf();
    c.g3.enabled = true;
    c.g3.dir = dir.join("g3");
    c.g3.capacity_bytes = 64 << 20;
    c.g3.page_size = 16 << 10;
    c.g3.fsync = false;
    c.g4.enabled = true;
    c.g4.url = format!("file://{}", g4.display());
    c.router.urls = vec![router.to_string()];
    // A single-user test node: the router replays from it without credentials.
    c.metrics_auth.open = true;
    c.router.node = "node-a".into();
    c.router.report_interval_ms = 200;
    c.limits.max_engines_per_uid = 2;
    c.engines.lease_ms = 3000;
    c.engines.drain_ms = 2000;
    let c = c.resolve().unwrap();
    let l = Listeners::bind(&c).await.unwrap();
    let http = l.http.as_ref().unwrap().local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(kvcached::serve(c, l, async move {
        let _ = rx.await;
    }));
    NodeA { http, stop: tx, task }
}

/// The daemon of node-b: the real binary, G2 and the shared G4, no G3.
fn spawn_node_b(dir: &Path, g4: &Path, router: &str, port: u16) -> Proc {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = dir.join("kvcached.toml");
    std::fs::write(
        &cfg,
        format!(
            "metrics_addr = \"127.0.0.1:{port}\"\n[metrics_auth]\nopen = true\n[g2]\ncapacity_bytes = 67108864\nshm_dir = \"{}\"\n[g3]\nenabled = false\n\
             [g4]\nenabled = true\nurl = \"file://{}\"\n[engines]\nlease_ms = 3000\ndrain_ms = 2000\n\
             [router]\nurls = [\"{router}\"]\nnode = \"node-b\"\nreport_interval_ms = 200\n",
            dir.display(),
            g4.display()
        ),
    )
    .unwrap();
    let socket = dir.join("kvcached.sock");
    let log = dir.join("daemon.log");
    let child = Command::new(env!("CARGO_BIN_EXE_daemon"))
        .args(["--config", cfg.to_str().unwrap(), "--socket", socket.to_str().unwrap(), "--log-format", "json"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
        .spawn()
        .unwrap();
    let p = Proc { child: KillOnDrop::new(child), log };
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(Instant::now() < deadline, "node-b's daemon did not start:\n{}", p.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    p
}

/// A real Prometheus on 127.0.0.1:`port`, scraping every second, with deploy/prometheus/rules.yml.
fn start_prometheus(dir: &Path, port: u16, node_a: &str, node_b: &str, router: &str) -> Proc {
    let rules = repo().join("deploy/prometheus/rules.yml");
    let cfg = dir.join("prometheus.yml");
    // Job names and labels as the ServiceMonitors of deploy/k8s/components/monitoring give them.
    std::fs::write(
        &cfg,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {}\n\
             scrape_configs:\n\
             \x20 - job_name: kvcached-metrics\n    static_configs:\n\
             \x20     - targets: ['{node_a}']\n        labels: {{namespace: kvcached, node: node-a}}\n\
             \x20     - targets: ['{node_b}']\n        labels: {{namespace: kvcached, node: node-b}}\n\
             \x20 - job_name: kvrouter\n    static_configs:\n\
             \x20     - targets: ['{router}']\n        labels: {{namespace: kvcached}}\n",
            rules.display()
        ),
    )
    .unwrap();
    let bin = std::env::var("PROMETHEUS").unwrap_or_else(|_| "prometheus".into());
    let log = dir.join("prometheus.log");
    let out = std::fs::File::create(&log).unwrap();
    let child = Command::new(&bin)
        .arg(format!("--config.file={}", cfg.display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(Stdio::from(out.try_clone().unwrap()))
        .stderr(Stdio::from(out))
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start {bin:?} ({e}): this test needs a real Prometheus. Install Debian's: \
                 sudo apt-get install -y --no-install-recommends prometheus (scripts/test does), \
                 or set PROMETHEUS to the binary"
            )
        });
    Proc { child: KillOnDrop::new(child), log }
}

/// An engine with 64 block slots of synthetic KV, registered as worker `<node>/<name>`.
async fn engine(socket: &Path, dir: &Path, name: &str, seed: u64) -> Result<(Client, KvMemory), kvclient::ClientError> {
    let mut mem = KvMemory::create_layer_separate(dir.join(format!("{name}-{seed}.kv")), &layout(), 64).unwrap();
    let len = layout().block_bytes() as usize;
    for b in 0..64 {
        mem.write_block(b, &synthetic_block(seed, b, len));
    }
    let c = Client::connect(socket).await?;
    c.register_worker(name, &ns(), &mem, &format!("http://{name}.invalid:8000"), "both").await?;
    Ok((c, mem))
}

/// `/api/v1/query` of `expr`: the series it returns, or Prometheus's error.
async fn query(http: &reqwest::Client, prom: &str, expr: &str) -> Result<Vec<Value>, String> {
    let r =
        http.get(format!("{prom}/api/v1/query")).query(&[("query", expr)]).send().await.map_err(|e| e.to_string())?;
    let status = r.status();
    let v: Value = r.json().await.map_err(|e| e.to_string())?;
    if !status.is_success() || v["status"] != "success" {
        return Err(format!("HTTP {status}: {}", v["error"].as_str().unwrap_or(&v.to_string())));
    }
    Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
}

/// A dashboard query as Prometheus gets it from Grafana with every variable on "All": label
/// variables become `.*` (the dashboards use them only in `=~` matchers), Grafana's interval
/// variables (`$__rate_interval`, `$__interval`, `$__range`) a minute.
fn substitute(expr: &str) -> String {
    let mut out = String::new();
    let mut rest = expr;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        let (name, len) = match after.strip_prefix('{') {
            Some(inner) => {
                let end = inner.find('}').unwrap_or(inner.len());
                (&inner[..end], end + 2)
            }
            None => {
                let end = after.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(after.len());
                (&after[..end], end)
            }
        };
        out.push_str(if name.starts_with("__") { "1m" } else { ".*" });
        rest = &after[len.min(after.len())..];
    }
    out.push_str(rest);
    out
}

/// For each byte of `expr`: its offset, and whether it is at the top level (outside quotes and
/// brackets, and not a bracket or quote itself).
fn top_level(expr: &str) -> Vec<(usize, bool)> {
    let b = expr.as_bytes();
    let (mut depth, mut quote, mut i) = (0i32, None::<u8>, 0);
    let mut out = Vec::with_capacity(b.len());
    while i < b.len() {
        let c = b[i];
        match quote {
            Some(q) => {
                if c == b'\\' {
                    out.push((i, false));
                    i += 1;
                } else if c == q {
                    quote = None;
                }
                out.push((i, false));
            }
            None => {
                match c {
                    b'"' | b'\'' | b'`' => quote = Some(c),
                    b'(' | b'{' | b'[' => depth += 1,
                    b')' | b'}' | b']' => depth -= 1,
                    _ => {}
                }
                out.push((
                    i,
                    depth == 0 && !matches!(c, b'"' | b'\'' | b'`' | b'(' | b'{' | b'[' | b')' | b'}' | b']'),
                ));
            }
        }
        i += 1;
    }
    out
}

/// The operands of the top-level `and` / `or` / `unless` of an alert expression.
fn set_operands(expr: &str) -> Vec<String> {
    let top = top_level(expr);
    let is_top = |i: usize| top.get(i).is_some_and(|&(_, t)| t);
    let mut parts = Vec::new();
    let (mut start, mut i) = (0, 0);
    while i < expr.len() {
        let word = ["and", "or", "unless"].into_iter().find(|w| {
            expr.as_bytes()[i..].starts_with(format!(" {w} ").as_bytes()) && (i..i + w.len() + 2).all(is_top)
        });
        match word {
            Some(w) => {
                parts.push(expr[start..i].trim().to_string());
                i += w.len() + 2;
                start = i;
            }
            None => i += 1,
        }
    }
    parts.push(expr[start..].trim().to_string());
    parts
}

/// An operand without its threshold: the left side of its top-level comparison.
fn without_threshold(expr: &str) -> String {
    let top = top_level(expr);
    for &(i, t) in &top {
        if !t {
            continue;
        }
        let s = &expr.as_bytes()[i..];
        if s.starts_with(b"==") || s.starts_with(b"!=") || s.starts_with(b"<") || s.starts_with(b">") {
            return expr[..i].trim().to_string();
        }
    }
    expr.trim().to_string()
}

#[test]
fn expression_helpers() {
    assert_eq!(
        substitute(r#"rate(x{node=~"$node", i=~"${instance}"}[$__rate_interval])"#),
        r#"rate(x{node=~".*", i=~".*"}[1m])"#
    );
    let e = r#"sum by (a) (increase(x{tier="g4",r=~"a or b"}[10m])) > 0 or max(y{k!="v"}) >= 20 and z == 0"#;
    let parts = set_operands(e);
    assert_eq!(parts.len(), 3, "{parts:?}");
    assert_eq!(without_threshold(&parts[0]), r#"sum by (a) (increase(x{tier="g4",r=~"a or b"}[10m]))"#);
    assert_eq!(without_threshold(&parts[1]), r#"max(y{k!="v"})"#);
    assert_eq!(without_threshold(&parts[2]), "z");
    assert_eq!(without_threshold("up{job=\"kvrouter\"} == 0"), "up{job=\"kvrouter\"}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_dashboard_panel_and_alert_finds_its_series_in_a_real_prometheus() {
    let t_start = Instant::now();
    let root = repo();
    let tmp = tempfile::tempdir().unwrap();
    let (dir_a, dir_b, g4, engines_dir, prom_dir) = (
        tmp.path().join("node-a"),
        tmp.path().join("node-b"),
        tmp.path().join("g4"),
        tmp.path().join("engines"),
        tmp.path().join("prometheus"),
    );
    for d in [&dir_a, &dir_b, &g4, &engines_dir, &prom_dir] {
        std::fs::create_dir_all(d).unwrap();
    }
    let http = reqwest::Client::new();

    // The router, the two daemons, Prometheus.
    let cfg = router_config();
    let spec = router_harness::resolved(&cfg);
    let router = Server::start(cfg).await;
    let node_a = start_node_a(&dir_a, &g4, &router.base).await;
    let b_port = free_port();
    let node_b = spawn_node_b(&dir_b, &g4, &router.base, b_port);
    let prom_port = free_port();
    let prom = format!("http://127.0.0.1:{prom_port}");
    let router_addr = router.base.trim_start_matches("http://").to_string();
    let prometheus =
        start_prometheus(&prom_dir, prom_port, &node_a.http.to_string(), &format!("127.0.0.1:{b_port}"), &router_addr);

    // Engines: two on node-a, one on node-b; a third on node-a is refused (limits.max_engines_per_uid = 2).
    let sock_a = dir_a.join("kvcached.sock");
    let (a0, _m_a0) = engine(&sock_a, &engines_dir, "gpu0", 1).await.unwrap();
    let (a1, _m_a1) = engine(&sock_a, &engines_dir, "gpu1", 2).await.unwrap();
    let (b0, _m_b0) = engine(&dir_b.join("kvcached.sock"), &engines_dir, "gpu0", 3).await.unwrap();
    let refused = engine(&sock_a, &engines_dir, "gpu2", 4).await;
    assert!(refused.is_err(), "a third engine of one uid was not refused at limits.max_engines_per_uid");

    // A publisher whose events were lost and whose recovery API does not answer: an event gap
    // the router cannot recover (it retries every second), and, once silent, a stale worker.
    let dead_url = format!("http://127.0.0.1:{}", free_port());
    let lost = MemoryPublisher::new("node-lost", 1, 16);
    let evs: Vec<_> = (0..3)
        .map(|i| {
            lost.publish(router_harness::stored(
                &spec,
                &spec.keys(&prompt(900 + i, 2)),
                TierKind::G2Host,
                router_harness::node("node-lost"),
            ))
        })
        .collect();
    let info = router_harness::info("node-lost", &["node-lost/gpu0"], &spec, 1000, Some(dead_url));
    router.publish(&lost.message(Some(info), vec![evs[0].clone(), evs[2].clone()])).await;

    // Prometheus up, every target scraped.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let up = match http.get(format!("{prom}/api/v1/targets")).send().await {
            Ok(r) => r.json::<Value>().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        };
        let targets = up["data"]["activeTargets"].as_array().cloned().unwrap_or_default();
        if targets.len() == 3 && targets.iter().all(|t| t["health"] == "up") {
            break;
        }
        assert!(Instant::now() < deadline, "Prometheus targets not all up after 30 s: {up}\n{}", prometheus.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let traffic_start = std::time::SystemTime::now();

    // The routed path works once a daemon's first report arrived.
    let route = |tokens: Vec<u32>| {
        let (http, base) = (http.clone(), router.base.clone());
        async move {
            // Not node-lost's worker: the router knows it too (stale), but no engine serves it.
            let body = json!({"namespace": "m", "tokens": tokens, "candidates": ["node-a/gpu0", "node-a/gpu1", "node-b/gpu0"]});
            let r = http.post(format!("{base}/route")).json(&body).send().await.ok()?;
            if !r.status().is_success() {
                return None;
            }
            r.json::<Value>().await.ok()
        }
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while route(prompt(1, 4)).await.is_none() {
        assert!(Instant::now() < deadline, "the router never placed a request (no daemon report arrived)");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Traffic: node-a's engine saves prompt S_i and node-b's C_i; node-a's other engine loads
    // S_i (G2), S_{i-20} (long evicted from its G2 of 128 blocks: G3) and C_{i-8} (only ever on
    // node-b: found by the lookup's G4 probe, loaded from G4), looks up a prompt nobody saved (a
    // miss, and a G4 probe), and a routed request's lookup reports its outcome to the router.
    let slots: Vec<u32> = (0..8).collect();
    let (mut from, mut loads, mut i) = ([0u64; 3], 0u64, 0u32);
    let t0 = Instant::now();
    while t0.elapsed() < TRAFFIC {
        let s = a0.save(&prompt(i, 8), 0, &slots).await.unwrap();
        assert_eq!(s.failed, 0, "save S_{i} on node-a: {}", s.error);
        let s = b0.save(&prompt(100_000 + i, 8), 0, &slots).await.unwrap();
        assert_eq!(s.failed, 0, "save C_{i} on node-b: {}", s.error);
        // (prompt, whether all of it must be found): the blocks just saved must be; older ones
        // and node-b's (its write into G4 is asynchronous) are only counted, by tier.
        let mut wanted = vec![(prompt(i, 8), true)];
        if i >= 20 {
            wanted.push((prompt(i - 20, 8), false));
        }
        if i >= 8 {
            let c = prompt(100_000 + i - 8, 8);
            a1.lookup(&c).await.unwrap();
            wanted.push((c, false));
        }
        for (p, all) in &wanted {
            let st = a1.load_now(p, 0, &slots).await.unwrap();
            assert!(!all || st.loaded_blocks == 8, "a load found fewer blocks than saved: {st:?}");
            from[0] += u64::from(st.from_g2);
            from[1] += u64::from(st.from_g3);
            from[2] += u64::from(st.from_g4);
            loads += 1;
        }
        assert_eq!(
            a1.lookup(&prompt(500_000 + i, 4)).await.unwrap().matched_blocks,
            0,
            "a prompt nobody saved matched"
        );
        if let Some(r) = route(prompt(i, 8)).await {
            let by = match r["worker"].as_str().unwrap_or("") {
                "node-a/gpu0" => &a0,
                "node-a/gpu1" => &a1,
                _ => &b0,
            };
            by.lookup_routed(&prompt(i, 8), r["route_id"].as_u64().unwrap(), 0).await.unwrap();
        }
        // node-lost's heartbeats (no events): the router keeps it until the traffic ends, then
        // it falls silent and its worker goes stale (3 report intervals, 3 s), long before the
        // router would drop it (60 s).
        if i % 10 == 0 {
            router.publish(&lost.message(None, Vec::new())).await;
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "traffic: {i} rounds, {loads} loads of 8 blocks; blocks from G2 {}, G3 {}, G4 {}",
        from[0], from[1], from[2]
    );
    assert!(from.iter().all(|&n| n > 0), "every tier should have served loads (G2, G3, G4): {from:?}");

    // node-lost stale, the last samples scraped and every rule evaluated on them.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut failures = Vec::new();
    let rules: Value = http.get(format!("{prom}/api/v1/rules")).send().await.unwrap().json().await.unwrap();
    let mut alerts = Vec::new();
    for g in rules["data"]["groups"].as_array().cloned().unwrap_or_default() {
        for r in g["rules"].as_array().cloned().unwrap_or_default() {
            let name = r["name"].as_str().unwrap_or("?").to_string();
            if r["health"] != "ok" {
                failures.push(format!("rule {name}: health {} {}", r["health"], r["lastError"]));
            }
            if r["type"] == "alerting" {
                alerts.push((name, r["query"].as_str().unwrap_or("").to_string()));
            }
        }
    }
    let in_file = std::fs::read_to_string(root.join("deploy/prometheus/rules.yml"))
        .unwrap()
        .lines()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count();
    assert_eq!(
        alerts.len(),
        in_file,
        "Prometheus loaded {} alerts, rules.yml has {in_file}:\n{}",
        alerts.len(),
        prometheus.log()
    );

    // Every alert expression, each operand of and / or without its threshold.
    let mut checked = 0;
    for (name, expr) in &alerts {
        for operand in set_operands(expr) {
            let q = without_threshold(&operand);
            checked += 1;
            match query(&http, &prom, &q).await {
                Ok(series) if !series.is_empty() => {}
                Ok(_) => failures.push(format!("alert {name}: no series for {q}")),
                Err(e) => failures.push(format!("alert {name}: {q}: {e}")),
            }
        }
    }
    // Every query of every panel of both dashboards, variables on "All".
    for file in ["kvcached.json", "kvrouter.json"] {
        let dash: Value =
            serde_json::from_str(&std::fs::read_to_string(root.join("deploy/grafana").join(file)).unwrap()).unwrap();
        let mut panels: Vec<Value> = dash["panels"].as_array().cloned().unwrap_or_default();
        // Panels of collapsed rows sit inside the row.
        let nested: Vec<Value> =
            panels.iter().flat_map(|p| p["panels"].as_array().cloned().unwrap_or_default()).collect();
        panels.extend(nested);
        for p in panels.iter().filter(|p| p["type"] != "row") {
            let title = p["title"].as_str().unwrap_or("?");
            let targets = p["targets"].as_array().cloned().unwrap_or_default();
            if targets.is_empty() {
                failures.push(format!("{file} / {title}: no targets"));
            }
            for t in targets {
                let Some(expr) = t["expr"].as_str() else {
                    failures.push(format!("{file} / {title} / {}: no expr", t["refId"]));
                    continue;
                };
                let q = substitute(expr);
                checked += 1;
                match query(&http, &prom, &q).await {
                    Ok(series) if !series.is_empty() => {}
                    Ok(_) => failures.push(format!("{file} / {title} / {}: no series for {q}", t["refId"])),
                    Err(e) => failures.push(format!("{file} / {title} / {}: {q}: {e}", t["refId"])),
                }
            }
        }
    }
    println!("{checked} queries checked against Prometheus in {:.1} s since start", t_start.elapsed().as_secs_f64());
    assert!(
        failures.is_empty(),
        "{} of {checked} queries are dead or failing:\n  {}",
        failures.len(),
        failures.join("\n  ")
    );

    if std::env::var("KVCACHED_PLOT_DASHBOARD").as_deref() == Ok("1") {
        let venv = Command::new("bash")
            .args(["-c", ". scripts/lib.sh && venv venv-plot matplotlib==3.9.4"])
            .current_dir(&root)
            .stderr(Stdio::inherit())
            .output()
            .unwrap();
        assert!(venv.status.success(), "cannot make the plotting venv (scripts/lib.sh venv venv-plot matplotlib)");
        let python = String::from_utf8_lossy(&venv.stdout).lines().last().unwrap_or("python3").trim().to_string();
        let since = traffic_start.elapsed().unwrap_or_default().as_secs_f64() + 2.0;
        let status = Command::new(&python)
            .arg(root.join("scripts/plot_dashboard.py"))
            .arg(&prom)
            .arg("--since")
            .arg(format!("{since:.0}"))
            .args(["--rate-interval", "5s"])
            .arg("--out")
            .arg(root.join("docs/img/dashboard.png"))
            .status()
            .unwrap();
        assert!(status.success(), "scripts/plot_dashboard.py failed");
    }

    // node-b's own page: a HELP line for every family it exports.
    let page = http.get(format!("http://127.0.0.1:{b_port}/metrics")).send().await.unwrap().text().await.unwrap();
    let families: Vec<&str> = page.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next()).collect();
    assert!(families.len() > 20, "node-b exports only {} metric families", families.len());
    let bare: Vec<&&str> = families.iter().filter(|f| !page.contains(&format!("# HELP {f} "))).collect();
    assert!(bare.is_empty(), "metric families without a HELP line: {bare:?}");

    drop(prometheus);
    for c in [a0, a1, b0] {
        let _ = c.unregister().await;
    }
    // node-b logged into a file with --log-format json: one JSON object per line, no colour codes.
    let log = std::fs::read_to_string(&node_b.log).unwrap();
    assert!(log.lines().count() >= 2, "node-b logged nothing:\n{log}");
    assert!(!log.contains('\u{1b}'), "colour codes in a log written to a file");
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        assert!(v["level"].is_string() && v["fields"].is_object(), "{line}");
    }
    node_b.sigterm();
    let _ = node_a.stop.send(());
    tokio::time::timeout(Duration::from_secs(30), node_a.task).await.unwrap().unwrap().unwrap();
    router.stop().await;
}
