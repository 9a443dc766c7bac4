//! Placement over the real HTTP API: tier credits along the prefix, node- and cluster-shared
//! tiers, load terms, candidate restriction, approximate mode, errors.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use kvproto::TierKind;
use kvproto::events::{EngineLoad, EventBody, Holder, LoadReport, PublisherMessage, WorkerId};
use kvrouter::RoutingMode;
use kvrouter::recovery::MemoryPublisher;
use kvtests::router_harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credits_each_tier_along_the_prefix_and_knows_who_shares_what() {
    let (srv, ns) = Server::start_default().await;
    let p = prompt(1, 10);
    let keys = ns.keys(&p);
    assert_eq!(keys.len(), 10);

    // Node A runs w1 and w2; node B runs w3.
    let a = MemoryPublisher::new("daemon-a", 1, 100);
    let b = MemoryPublisher::new("daemon-b", 1, 100);
    let ev_a = vec![
        a.publish(stored(&ns, &keys[..4], TierKind::G1Gpu, worker("w1"))),
        a.publish(stored(&ns, &keys[..8], TierKind::G2Host, node("A"))),
        a.publish(stored(&ns, &keys[..10], TierKind::G3Disk, node("A"))),
    ];
    srv.publish(&a.message(Some(info("A", &["w1", "w2"], &ns, 1000, None)), ev_a)).await;
    let ev_b = vec![b.publish(stored(&ns, &keys[..6], TierKind::G4Object, Holder::Cluster))];
    srv.publish(&b.message(Some(info("B", &["w3"], &ns, 1000, None)), ev_b)).await;

    let r = srv.route(route_body(&p)).await;
    assert_eq!(r.worker, "w1");
    assert_eq!(r.node, "A");
    assert_eq!(r.address, "http://w1.invalid");
    assert_eq!(r.blocks, 10);
    assert_eq!(r.cached_blocks, [4, 4, 2, 0]);
    assert_eq!(r.cached_tokens, Some(40));
    // 10 - (4 * 1.0 + 4 * 0.75 + 2 * 0.25) = 2.5
    assert!((r.cost.prefill_blocks - 2.5).abs() < 1e-9, "{:?}", r.cost);
    let by = |w: &str| r.candidates.iter().find(|c| c.worker == w).unwrap().clone();
    assert_eq!(by("w2").cached_blocks, [0, 8, 2, 0]); // shares A's host memory and disk, not w1's GPU
    assert_eq!(by("w3").cached_blocks, [0, 0, 0, 6]); // only the cluster's object store

    // Restricting candidates, and an unknown candidate set.
    let mut body = route_body(&p);
    body["candidates"] = serde_json::json!(["w2", "w3"]);
    assert_eq!(srv.route(body).await.worker, "w2");
    let mut body = route_body(&p);
    body["candidates"] = serde_json::json!(["nobody"]);
    let (status, v) = srv.route_json(body).await;
    assert_eq!(status, 503, "{v}");

    // Removing w1's GPU copy of block 0 leaves only node tiers usable for w1.
    let ev = vec![a.publish(EventBody::Removed { keys: vec![keys[0]], tier: TierKind::G1Gpu, holder: worker("w1") })];
    srv.publish(&a.message(None, ev)).await;
    let r = srv.route(route_body(&p)).await;
    let w1 = r.candidates.iter().find(|c| c.worker == "w1").unwrap();
    assert_eq!(w1.cached_blocks, [3, 5, 2, 0]);

    // Cleared: node A's G2 is gone.
    let ev = vec![a.publish(EventBody::Cleared { tier: TierKind::G2Host, holder: node("A") })];
    srv.publish(&a.message(None, ev)).await;
    let r = srv.route(route_body(&p)).await;
    let w2 = r.candidates.iter().find(|c| c.worker == "w2").unwrap();
    assert_eq!(w2.cached_blocks, [0, 0, 10, 0]);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_terms_spread_requests_that_no_cache_distinguishes() {
    let (srv, ns, a) = Server::start_default_with("daemon-a").await;
    let mut msg = a.message(Some(info("A", &["w1", "w2", "w3"], &ns, 1000, None)), vec![]);
    let load = |w: &str, running, used| EngineLoad {
        worker: WorkerId(w.into()),
        running,
        waiting: 0,
        kv_used_blocks: used,
        kv_total_blocks: 100,
        prefill_tokens_per_s: None,
    };
    msg.load = Some(LoadReport {
        tiers: vec![],
        engines: vec![load("w1", 5, 90), load("w2", 0, 0), load("w3", 1, 0)],
        links: vec![],
    });
    srv.publish(&msg).await;
    // Cold prompts: w2 is idle, then routed-since-report counts push later requests elsewhere.
    let first = srv.route(route_body(&prompt(7, 3))).await;
    assert_eq!(first.worker, "w2");
    assert_eq!(first.cost.active_term, 0.0);
    let mut counts = std::collections::HashMap::new();
    for i in 0..6 {
        *counts.entry(srv.route(route_body(&prompt(10 + i, 3))).await.worker).or_insert(0) += 1;
    }
    assert!(counts.get("w3").copied().unwrap_or(0) >= 2, "{counts:?}");
    assert!(counts.get("w1").copied().unwrap_or(0) <= 1, "{counts:?}");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_rejected_with_a_reason() {
    let srv = Server::start(config()).await;
    let (s, v) = srv.route_json(serde_json::json!({"namespace": "nope", "tokens": [1, 2, 3, 4]})).await;
    assert_eq!(s, 400);
    assert!(v["error"].as_str().unwrap().contains("unknown namespace"), "{v}");
    let (s, _) = srv.route_json(serde_json::json!({"keys": ["00"]})).await;
    assert_eq!(s, 400);
    // No worker at all.
    let (s, v) = srv.route_json(route_body(&prompt(1, 2))).await;
    assert_eq!(s, 503, "{v}");
    // An event whose holder does not fit its tier is counted and ignored.
    let ns = resolved(&config());
    let p = MemoryPublisher::new("x", 1, 10);
    let ev = vec![p.publish(stored(&ns, &ns.keys(&prompt(1, 2)), TierKind::G1Gpu, node("A")))];
    srv.publish(&p.message(None, ev)).await;
    assert_eq!(srv.metric("kvrouter_invalid_events_total{publisher=\"x\"}").await, Some(1.0));
    assert_eq!(srv.router.index_stats().facts, 0);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approximate_mode_remembers_its_decisions_for_the_ttl() {
    let mut cfg = config();
    cfg.mode = RoutingMode::Approximate;
    cfg.approx_ttl_s = 0.3;
    cfg.weights.active = 0.5;
    let ns = resolved(&cfg);
    let srv = Server::start(cfg).await;
    let a = MemoryPublisher::new("daemon-a", 1, 10);
    srv.publish(&a.message(Some(info("A", &["w1", "w2", "w3", "w4"], &ns, 1000, None)), vec![])).await;
    let p = prompt(3, 8);
    let first = srv.route(route_body(&p)).await;
    assert_eq!(first.cached_blocks, [0; 4]);
    let second = srv.route(route_body(&p)).await;
    assert_eq!(second.worker, first.worker);
    assert_eq!(second.cached_blocks, [8, 0, 0, 0]);
    assert_eq!(second.mode, RoutingMode::Approximate);
    tokio::time::sleep(Duration::from_millis(450)).await;
    let third = srv.route(route_body(&p)).await;
    assert_eq!(third.cached_blocks, [0; 4], "forgotten after the TTL");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_the_api() {
    let dir = std::env::temp_dir().join(format!("kvrouter-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg_path = dir.join("router.toml");
    std::fs::write(
        &cfg_path,
        r#"
seed = 3
[weights]
g2 = 0.5
[[namespaces]]
name = "m"
model_id = "test/model"
num_layers = 2
kv_heads = 1
head_dim = 8
dtype = "bf16"
tokens_per_block = 4
"#,
    )
    .unwrap();
    // Pick a free port, then let the binary bind it.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_router"))
        .args(["--listen", &format!("127.0.0.1:{port}"), "--config"])
        .arg(&cfg_path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let mut ok = false;
    for _ in 0..200 {
        if let Ok(r) = http.get(format!("{base}/healthz")).send().await {
            ok = r.status() == 200;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(ok, "binary did not come up");
    let cfg = config();
    let ns = resolved(&cfg);
    let p = Arc::new(MemoryPublisher::new("d", 1, 10));
    let keys = ns.keys(&prompt(1, 4));
    let msg: PublisherMessage = p.message(
        Some(info("A", &["w1"], &ns, 1000, None)),
        vec![p.publish(stored(&ns, &keys, TierKind::G2Host, node("A")))],
    );
    assert_eq!(http.post(format!("{base}/events")).json(&msg).send().await.unwrap().status(), 204);
    let r: serde_json::Value =
        http.post(format!("{base}/route")).json(&route_body(&prompt(1, 4))).send().await.unwrap().json().await.unwrap();
    assert_eq!(r["worker"], "w1");
    assert_eq!(r["cached_blocks"], serde_json::json!([0, 4, 0, 0]));
    assert!((r["cost"]["prefill_blocks"].as_f64().unwrap() - 2.0).abs() < 1e-9, "g2 weight from the config file: {r}");
    let m = http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(m.contains("kvrouter_routes_total 1"), "{m}");
    // SIGTERM (what an orchestrator sends) stops it cleanly.
    let term = std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(term.success());
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(10) {
            child.kill().unwrap();
            panic!("kvrouter did not stop on SIGTERM");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A request with a key context (an adapter, a cache salt, an image) is placed by the keys its
/// engine saves under that context (docs/block-keys.md section 6): on the worker holding the
/// adapter's blocks, not on one holding the same tokens without it, and the reverse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_with_key_contexts_route_by_their_own_keys() {
    use kvproto::{Adapter, KeyContext};
    let (srv, ns) = Server::start_default().await;
    let p = prompt(3, 6);
    let lora =
        KeyContext { adapter: Some(Adapter { name: "sql".into(), content_hash: vec![1, 2] }), ..Default::default() };
    let a = MemoryPublisher::new("daemon-a", 1, 100);
    let ev = vec![
        a.publish(stored(&ns, &ns.keys_in(&p, Some(&lora)), TierKind::G1Gpu, worker("w1"))),
        a.publish(stored(&ns, &ns.keys(&p), TierKind::G1Gpu, worker("w2"))),
    ];
    srv.publish(&a.message(Some(info("A", &["w1", "w2"], &ns, 1000, None)), ev)).await;
    let route = |ctx: serde_json::Value| {
        let mut body = route_body(&p);
        body["context"] = ctx;
        body
    };
    let r = srv.route(route(serde_json::json!({"adapter_name": "sql", "adapter_hash_hex": "0102"}))).await;
    assert_eq!((r.worker.as_str(), r.cached_blocks[0]), ("w1", 6));
    let r = srv.route(route(serde_json::json!({}))).await;
    assert_eq!((r.worker.as_str(), r.cached_blocks[0]), ("w2", 6));
    // A salted request holds nothing anywhere; neither does one with other adapter weights.
    for ctx in [
        serde_json::json!({"cache_salt_hex": "74656e616e74"}),
        serde_json::json!({"adapter_name": "sql", "adapter_hash_hex": "0103"}),
    ] {
        assert_eq!(srv.route(route(ctx.clone())).await.cached_blocks[0], 0, "{ctx}");
    }
    // A context out of bounds is a clear 400.
    let (code, body) =
        srv.route_json(route(serde_json::json!({"mm": [{"hash_hex": "01", "offset": 0, "length": 0}]}))).await;
    assert_eq!(code, 400, "{body}");
    assert!(body.to_string().contains("mm.length"), "{body}");
    srv.stop().await;
}
