//! A cluster across real processes: one kvrouter (`serve_router` on port 0) and two kvcached
//! daemons (the real binary, each its own process and node) with engines attached through the
//! real client. The daemons publish their tiers' hit reports; the router places requests on
//! them; restarts of a daemon and of the router both end with the right index.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use kvproto::events::KEY_SCHEME_DYNAMO_XXH3_1337;
use kvrouter::config::{DEFAULT_IDLE_RECONNECT_S, NamespaceSpec, RouterConfig, VllmSource};
use kvtests::cluster_harness::*;
use kvtests::fixture::{KillOnDrop, prompt};
use kvtests::proc::free_port;
use kvtests::router_harness::{small_spec, vllm_source};
use serde_json::{Value, json};

/// Starts `kvcached` for `node` in `dir`, publishing to `router` every 200 ms.
fn spawn_daemon(dir: &Path, node: &str, router: &str) -> KillOnDrop {
    spawn_daemon_with(dir, &format!("urls = [\"{router}\"]\nnode = \"{node}\"\nreport_interval_ms = 200\n"))
}

/// Starts `kvcached` in `dir` with `router_section` as its `[router]` settings.
fn spawn_daemon_with(dir: &Path, router_section: &str) -> KillOnDrop {
    spawn_daemon_bin(env!("CARGO_BIN_EXE_daemon"), dir, router_section)
}

/// G2 pool files in a daemon's pool directory.
fn pool_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("kvcached-g2-"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_places_requests_on_two_real_daemons_through_restarts() {
    // No pooled connections: the router restarts under this client.
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let router = start_router("127.0.0.1:0").await;
    let base = router.base.clone();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let daemon_a = spawn_daemon(da.path(), "node-a", &base);
    let daemon_b = spawn_daemon(db.path(), "node-b", &base);
    let (ca, _ma) = engine(da.path(), "http://a:8000").await;
    let (cb, _mb) = engine(db.path(), "http://b:8000").await;

    // 1. Engine A saves a prompt: node A's G2 report steers the prompt to A's worker.
    let p = prompt(1, 24);
    assert_eq!(ca.save(&p, 0, &(0..24).collect::<Vec<_>>()).await.unwrap().stored, 24);
    let v = wait_route(&http, &base, &p, "G2 blocks of node-a", |v| v["worker"] == "node-a/gpu0" && cached(v)[1] == 24)
        .await;
    assert_eq!(v["address"], "http://a:8000");

    // 2. Engine B reports blocks in its own GPU memory: G1 of worker node-b/gpu0.
    let q = prompt(2, 10);
    let keys = cb.gpu_stored(&q, 0).await.unwrap();
    assert_eq!(keys.len(), 10);
    wait_route(&http, &base, &q, "G1 blocks of node-b/gpu0", |v| v["worker"] == "node-b/gpu0" && cached(v)[0] == 10)
        .await;
    cb.gpu_removed_keys(&keys[5..]).await.unwrap();
    wait_route(&http, &base, &q, "G1 removal", |v| cached(v)[0] == 5).await;

    // 3. The daemon reports what a routed request found; the router counts the outcome.
    let v = route(&http, &base, &p).await;
    let route_id = v["route_id"].as_u64().unwrap();
    let found = ca.lookup_routed(&p, route_id, 0).await.unwrap();
    assert_eq!(found.matched_blocks, 24);
    let t0 = Instant::now();
    while metric(&http, &base, "kvrouter_outcomes_total").await < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "no outcome reached the router");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(metric(&http, &base, "kvrouter_outcomes_unknown_total").await, 0.0);

    // 4. Daemon A restarts: a new epoch; its G3 survived and is announced again.
    signal_and_wait(daemon_a, libc::SIGTERM);
    let daemon_a = spawn_daemon(da.path(), "node-a", &base);
    assert_eq!(ca.lookup(&p).await.unwrap().g3_blocks, 24, "the client re-registers with the new daemon");
    wait_route(&http, &base, &p, "G3 blocks of node-a after its restart", |v| {
        v["worker"] == "node-a/gpu0" && cached(v) == [0, 0, 24, 0]
    })
    .await;

    // 5. The router restarts on the same port: it learns everything back from the daemons'
    //    next reports plus their replay / snapshot API.
    let addr = base.trim_start_matches("http://").to_string();
    router.stop().await;
    let router = start_router(&addr).await;
    wait_route(&http, &base, &p, "node-a's G3 after a router restart", |v| {
        v["worker"] == "node-a/gpu0" && cached(v)[2] == 24
    })
    .await;
    wait_route(&http, &base, &q, "node-b's G1 after a router restart", |v| {
        v["worker"] == "node-b/gpu0" && cached(v)[0] == 5
    })
    .await;

    // 6. Daemon B dies without a word: the router says so instead of routing blind.
    signal_and_wait(daemon_b, libc::SIGKILL);
    let t0 = Instant::now();
    loop {
        let h: Value = http.get(format!("{base}/healthz")).send().await.unwrap().json().await.unwrap();
        if h["status"] == "degraded" && h.to_string().contains("node-b") {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "a silent daemon went unnoticed: {h}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The killed daemon never unlinked its G2 pool file; its successor removes it at start.
    let dead = pool_files(db.path());
    assert_eq!(dead.len(), 1);
    let daemon_b = spawn_daemon(db.path(), "node-b", &base);
    let t0 = Instant::now();
    loop {
        let now = pool_files(db.path());
        if now.len() == 1 && now != dead {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "pool files {now:?} (the dead daemon's: {dead:?})");
        std::thread::sleep(Duration::from_millis(20));
    }
    signal_and_wait(daemon_b, libc::SIGTERM);
    assert_eq!(pool_files(db.path()), Vec::<String>::new());

    drop((ca, cb));
    signal_and_wait(daemon_a, libc::SIGTERM);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_replicas_fed_by_the_same_daemons_answer_alike() {
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let (r1, r2) = (start_router("127.0.0.1:0").await, start_router("127.0.0.1:0").await);
    let urls = format!("urls = [\"{}\", \"{}\"]\nreport_interval_ms = 200\n", r1.base, r2.base);
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let daemon_a = spawn_daemon_with(da.path(), &format!("{urls}node = \"node-a\"\n"));
    let daemon_b = spawn_daemon_with(db.path(), &format!("{urls}node = \"node-b\"\n"));
    let (ca, _ma) = engine(da.path(), "http://a:8000").await;
    let (cb, _mb) = engine(db.path(), "http://b:8000").await;
    let (p, q, g) = (prompt(1, 16), prompt(2, 12), prompt(3, 6));
    ca.save(&p, 0, &(0..16).collect::<Vec<_>>()).await.unwrap();
    cb.save(&q, 0, &(0..12).collect::<Vec<_>>()).await.unwrap();
    cb.gpu_stored(&g, 0).await.unwrap();
    let expect =
        [(&p, "node-a/gpu0", [0, 16, 0, 0]), (&q, "node-b/gpu0", [0, 12, 0, 0]), (&g, "node-b/gpu0", [6, 0, 0, 0])];
    // Restart one replica on its port half-way: it catches up from the daemons' next reports
    // and their replay / snapshot API.
    let addr2 = r2.base.trim_start_matches("http://").to_string();
    r2.stop().await;
    let r2 = start_router(&addr2).await;
    for base in [&r1.base, &r2.base] {
        for (tokens, worker, blocks) in expect {
            wait_route(&http, base, tokens, "the same answer from every replica", |v| {
                v["worker"] == worker && cached(v) == blocks
            })
            .await;
        }
    }
    drop((ca, cb));
    signal_and_wait(daemon_a, libc::SIGTERM);
    signal_and_wait(daemon_b, libc::SIGTERM);
    r1.stop().await;
    r2.stop().await;
}

/// A router that knows node `node-v` only as a vLLM event source at `endpoint` (as Dynamo or
/// llm-d would): Dynamo XXH3-64 hashes of 16-token blocks, `medium` naming the tier.
fn vllm_source_router(endpoint: &str) -> RouterConfig {
    let mut c = RouterConfig {
        namespaces: vec![NamespaceSpec {
            name: Some("m-vllm".into()),
            key_scheme: KEY_SCHEME_DYNAMO_XXH3_1337.into(),
            ..small_spec("cluster/model")
        }],
        vllm_sources: vec![VllmSource {
            worker: "node-v/gpu0".into(),
            node: "node-v".into(),
            namespace: "m-vllm".into(),
            address: "http://v:8000".into(),
            ..vllm_source(endpoint, None, DEFAULT_IDLE_RECONNECT_S)
        }],
        seed: Some(1),
        ..RouterConfig::default()
    };
    c.health.default_report_interval_ms = 200;
    c
}

/// Asks `router` to place `tokens` until it answers with cached blocks `want` per tier (20 s, as
/// every wait of the cluster harness).
async fn wait_until_cached(router: &RouterProc, dir: &Path, tokens: &[u32], want: [u64; 4], what: &str) -> Value {
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let t0 = Instant::now();
    loop {
        let r = http
            .post(format!("{}/route", router.base))
            .json(&json!({"namespace": "m-vllm", "tokens": tokens}))
            .send()
            .await
            .unwrap();
        let v = r.json::<Value>().await.unwrap_or(Value::Null);
        if cached(&v) == want {
            return v;
        }
        if t0.elapsed() >= Duration::from_secs(20) {
            panic!("{what}: {v}\n{}", export_trail(&http, router, dir).await);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the daemon said of its export (its stderr's export lines: the blocks announced, the
/// snapshots sent) and the router's vLLM counters (batches, gaps, orphans): the trail of a
/// failed wait.
async fn export_trail(http: &reqwest::Client, router: &RouterProc, dir: &Path) -> String {
    let log = std::fs::read_to_string(dir.join("kvcached.stderr")).unwrap_or_default();
    let daemon: Vec<&str> = log
        .lines()
        .filter(|l| {
            ["export", "announced", "subscriber", "write-through", "WARN", "ERROR"].iter().any(|w| l.contains(w))
        })
        .collect();
    let metrics = match http.get(format!("{}/metrics", router.base)).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(e) => e.to_string(),
    };
    let router: Vec<&str> =
        metrics.lines().filter(|l| !l.starts_with('#') && (l.contains("vllm") || l.contains("gap"))).collect();
    format!("daemon:\n{}\nrouter:\n{}", daemon.join("\n"), router.join("\n"))
}

/// A router that subscribes to the export after blocks were stored (started late, or
/// reconnecting) is sent what the daemon holds: a PUB socket alone would never send it those.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_subscribing_late_to_the_vllm_export_is_sent_what_the_daemon_holds() {
    let d = tempfile::tempdir().unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", free_port());
    let replay = format!("tcp://127.0.0.1:{}", free_port());
    let daemon =
        spawn_daemon_with(d.path(), &format!("vllm_export = \"{endpoint}\"\nvllm_export_replay = \"{replay}\"\n"));
    let (c, _mem) = engine(d.path(), "http://v:8000").await;
    let p = prompt(9, 24);
    assert_eq!(c.save(&p, 0, &(0..24).collect::<Vec<_>>()).await.unwrap().stored, 24);
    // The save's events have gone out (to nobody) well before a router subscribes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // They are also kept on the replay socket, for subscribers that missed them.
    let batches = kvrouter::zmq::replay_from(&replay, 0, Duration::from_secs(5)).await.unwrap();
    let stored: usize = batches
        .iter()
        .flat_map(|(_, payload)| kvproto::vllm::decode_batch(payload).unwrap().events)
        .map(|e| match e {
            kvproto::vllm::VllmEvent::BlockStored { block_hashes, medium, .. }
                if medium.as_deref() == Some("CPU_PINNED") =>
            {
                block_hashes.len()
            }
            _ => 0,
        })
        .sum();
    assert_eq!(stored, 24, "G2 blocks in {} replayed batches", batches.len());
    let config = vllm_source_router(&endpoint);
    let router = start_router_with("127.0.0.1:0", config).await;
    wait_until_cached(&router, d.path(), &p, [0, 24, 0, 0], "the late subscriber never saw the held blocks").await;
    drop(c);
    signal_and_wait(daemon, libc::SIGTERM);
    router.stop().await;
}

/// The export's records of G3 blocks survive a daemon restart: a router subscribing to the
/// restarted daemon is sent the blocks G3 kept, as the node's G3 (`DISK`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_vllm_export_still_exports_what_g3_kept_across_a_restart() {
    let d = tempfile::tempdir().unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", free_port());
    let section = format!("vllm_export = \"{endpoint}\"\n");
    let daemon = spawn_daemon_with(d.path(), &section);
    let (c, _mem) = engine(d.path(), "http://v:8000").await;
    let p = prompt(11, 24);
    assert_eq!(c.save(&p, 0, &(0..24).collect::<Vec<_>>()).await.unwrap().stored, 24);
    drop(c);
    // SIGTERM drains the write-through to G3; G2 starts empty after the restart.
    signal_and_wait(daemon, libc::SIGTERM);
    assert!(d.path().join("g3/vllm-origins.log").is_file());
    let daemon = spawn_daemon_with(d.path(), &section);
    let config = vllm_source_router(&endpoint);
    let router = start_router_with("127.0.0.1:0", config).await;
    wait_until_cached(&router, d.path(), &p, [0, 0, 24, 0], "G3's blocks were not exported after the restart").await;
    signal_and_wait(daemon, libc::SIGTERM);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_reading_vllm_events_sees_the_daemons_g2_through_its_export() {
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let d = tempfile::tempdir().unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", free_port());
    let daemon = spawn_daemon_with(d.path(), &format!("vllm_export = \"{endpoint}\"\n"));
    // A router that knows this node only as a vLLM event source (as Dynamo or llm-d would):
    // Dynamo XXH3-64 hashes of 16-token blocks, medium CPU_PINNED = the node's G2.
    let config = vllm_source_router(&endpoint);
    let router = start_router_with("127.0.0.1:0", config).await;
    let (c, _mem) = engine(d.path(), "http://v:8000").await;
    let ask = |tokens: Vec<u32>| {
        let http = http.clone();
        let base = router.base.clone();
        async move {
            let r = http
                .post(format!("{base}/route"))
                .json(&json!({"namespace": "m-vllm", "tokens": tokens}))
                .send()
                .await
                .unwrap();
            r.json::<Value>().await.unwrap_or(Value::Null)
        }
    };
    // A subscriber misses what is sent before it connects: save fresh prompts until one shows.
    let t0 = Instant::now();
    let mut n = 0;
    loop {
        n += 1;
        let p = prompt(100 + n, 4);
        c.save(&p, 0, &[0, 1, 2, 3]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        if cached(&ask(p).await)[1] == 4 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "no exported event reached the router");
    }
    // Connected: a longer prompt shows up whole, on the node's G2, with the worker's address.
    let p = prompt(7, 24);
    assert_eq!(c.save(&p, 0, &(0..24).collect::<Vec<_>>()).await.unwrap().stored, 24);
    let t0 = Instant::now();
    loop {
        let v = ask(p.clone()).await;
        if cached(&v) == [0, 24, 0, 0] {
            assert_eq!(v["worker"], "node-v/gpu0");
            assert_eq!(v["address"], "http://v:8000");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "exported blocks not indexed: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(c);
    signal_and_wait(daemon, libc::SIGTERM);
    router.stop().await;
}

/// Blocks an SGLang engine saves through kvcached's HiCache backend are keyed by SGLang's page
/// hashes (the engine computes them; the daemon never sees the tokens). They reach the router
/// in the daemon's reports like any other, and a namespace of the `sglang-pages-v1` scheme
/// routes a request by its tokens to them: the router derives the same page hashes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_saved_by_sglang_page_hashes_are_routed_by_tokens() {
    use kvproto::{EngineHashes, HashScheme, KeySource};

    let http = reqwest::Client::new();
    let mut cfg = router_config();
    cfg.namespaces[0].key_scheme = kvproto::events::KEY_SCHEME_SGLANG_PAGES.into();
    let router = start_router_with("127.0.0.1:0", cfg).await;
    let dir = tempfile::tempdir().unwrap();
    let daemon = spawn_daemon(dir.path(), "node-s", &router.base);
    let (c, _mem) = engine(dir.path(), "http://s:8000").await;

    let p = prompt(5, 12);
    let bs = layout().tokens_per_block as usize;
    let hashes = kvproto::engine_hash::sglang_page_hashes_le(bs, &kvproto::tokens_to_le(&p));
    let keys = KeySource::Hashes(EngineHashes {
        scheme: HashScheme::Sglang,
        hashes: hashes.iter().map(|h| h.to_vec()).collect(),
    });
    assert_eq!(c.save_keyed(&[], &keys, 0, &(0..12).collect::<Vec<_>>()).await.unwrap().stored, 12);
    wait_route(&http, &router.base, &p, "node-s's SGLang-keyed G2 blocks", |v| {
        v["worker"] == "node-s/gpu0" && cached(v) == [0, 12, 0, 0]
    })
    .await;
    // Another prompt sharing the first 4 pages: those, and nothing after.
    let mut q = p[..4 * bs].to_vec();
    q.extend(prompt(6, 4));
    wait_route(&http, &router.base, &q, "the shared pages", |v| cached(v) == [0, 4, 0, 0]).await;

    drop(c);
    signal_and_wait(daemon, libc::SIGTERM);
    router.stop().await;
}
