//! The Mooncake RFC #1403 indexer API over real HTTP, fed by real ZMQ publishers in vLLM's wire
//! format (`VllmExporter`): `/register`, `/query`, `/query_by_hash`, `/workers`, `/unregister`.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvcached::export::zmq_export::VllmExporter;
use kvproto::TierKind;
use kvproto::events::KEY_SCHEME_DYNAMO_XXH3_1337;
use kvproto::vllm::{Encoding, VllmEvent, stored_for_export};
use kvtests::router_harness::*;
use serde_json::{Value, json};

fn register_body(endpoint: &str, instance: &str, dp_rank: u32) -> Value {
    json!({
        "endpoint": endpoint,
        "type": "vLLM",
        "modelname": "test/vllm",
        "tenant_id": "default",
        "instance_id": instance,
        "block_size": 4,
        "dp_rank": dp_rank,
        "address": format!("http://{instance}.invalid"),
    })
}

/// Publishes `events` until the router's index holds `facts` facts (a ZMQ subscriber misses
/// what was sent before it connected).
async fn publish_until(srv: &Server, exp: &mut VllmExporter, events: &[VllmEvent], facts: u64) {
    let t0 = std::time::Instant::now();
    while srv.router.index_stats().facts < facts {
        assert!(t0.elapsed() < Duration::from_secs(20), "router saw {:?}", srv.router.index_stats());
        exp.publish(events.to_vec(), Some(0)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_query_and_unregister_over_real_zmq_publishers() {
    let mut cfg = config();
    let mut ns = spec("vllm", "test/vllm", 4);
    ns.key_scheme = KEY_SCHEME_DYNAMO_XXH3_1337.into();
    cfg.namespaces.push(ns);
    let ns = cfg.namespaces[1].resolve().unwrap();
    let srv = Server::start(cfg).await;
    let mut rank0 = VllmExporter::bind("tcp://127.0.0.1:0", "", Encoding::Tuple).await.unwrap();
    let mut rank1 = VllmExporter::bind("tcp://127.0.0.1:0", "", Encoding::Map).await.unwrap();

    // Register both DP ranks of instance inst-a; the answer names the router's worker and the
    // namespace (the configured Dynamo-scheme one for this model and block size).
    let (s, v) = srv.post("/register", register_body(rank0.endpoint(), "inst-a", 0)).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["status"], "registered successfully");
    assert_eq!(v["worker"], "inst-a/dp0");
    assert_eq!(v["namespace_id"], ns.id.to_string());
    let (s, v) = srv.post("/register", register_body(rank1.endpoint(), "inst-a", 1)).await;
    assert_eq!(s, 200, "{v}");

    // Rank 0 holds blocks 0-3 on its GPU and 0-2 in the node's CPU memory; rank 1 blocks 0-1.
    let tokens: Vec<u32> = (500..516).collect();
    publish_until(
        &srv,
        &mut rank0,
        &[
            stored_for_export(None, &tokens, 4, TierKind::G1Gpu),
            stored_for_export(None, &tokens[..12], 4, TierKind::G2Host),
        ],
        7,
    )
    .await;
    publish_until(&srv, &mut rank1, &[stored_for_export(None, &tokens[..8], 4, TierKind::G1Gpu)], 9).await;

    let want = json!({"default": {"inst-a": {
        "longest_matched": 16, "GPU": 16, "CPU": 12, "DISK": 0, "EXTERNAL": 0,
        "DP": {"0": 16, "1": 12},
    }}});
    let q = json!({"model": "test/vllm", "block_size": 4, "token_ids": tokens, "tenant_id": "default"});
    let (s, v) = srv.post("/query", q.clone()).await;
    assert_eq!((s, &v), (200, &want));
    // By rolling sequence hashes (numbers, or 0x-hex / decimal strings), and a longer prompt
    // whose tail nobody holds.
    let mut h: Vec<Value> = kvproto::dynamo::sequence_hashes(&tokens, 4, 1337).into_iter().map(|h| json!(h)).collect();
    h[1] = json!(format!("0x{:x}", h[1].as_u64().unwrap()));
    h[2] = json!(h[2].as_u64().unwrap().to_string());
    h.push(json!(12345));
    let (s, v) = srv.post("/query_by_hash", json!({"model": "test/vllm", "block_size": 4, "seq_hashes": h})).await;
    assert_eq!((s, &v), (200, &want));

    // Filters: another instance, another tenant, another LoRA.
    let (_, v) = srv
        .post("/query", json!({"model": "test/vllm", "block_size": 4, "token_ids": tokens, "instance_id": "x"}))
        .await;
    assert_eq!(v, json!({"default": {}}));
    let (_, v) = srv
        .post("/query", json!({"model": "test/vllm", "block_size": 4, "token_ids": tokens, "tenant_id": "t2"}))
        .await;
    assert_eq!(v, json!({"t2": {}}));
    let (_, v) = srv
        .post("/query", json!({"model": "test/vllm", "block_size": 4, "token_ids": tokens, "lora_name": "sql"}))
        .await;
    assert_eq!(v, json!({"default": {}}));

    // The same index answers POST /route for the configured namespace.
    let r = srv.route(json!({"namespace": "vllm", "tokens": tokens})).await;
    assert_eq!(
        (r.worker.as_str(), r.address.as_str(), r.cached_blocks),
        ("inst-a/dp0", "http://inst-a.invalid", [4, 0, 0, 0])
    );

    // A query with another block size than the publishers register is loud, not silently zero.
    let (_, v) = srv.post("/query", json!({"model": "test/vllm", "block_size": 8, "token_ids": tokens})).await;
    assert_eq!(v, json!({"default": {}}));
    // (Other conditions may stand beside it: a publisher's first batches can go out before the
    // router subscribed, which /healthz reports as an unrecovered gap.)
    let c = srv.condition("block_size_mismatch").await;
    assert!(c["reason"].as_str().unwrap().contains("8-token blocks"), "{c}");

    let (_, v) = srv
        .http
        .get(format!("{}/workers", srv.base))
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .map(|v| (0, v))
        .unwrap();
    assert_eq!(v.as_array().unwrap().len(), 2, "{v}");
    assert_eq!(v[1]["dp_rank"], 1);
    assert_eq!(v[1]["endpoint"], rank1.endpoint());

    // Unregister rank 1: its GPU blocks go, the node's CPU blocks stay (rank 0 still reports them).
    let (s, v) = srv.post("/unregister", json!({"instance_id": "inst-a", "dp_rank": 1})).await;
    assert_eq!((s, &v["removed_instances"]), (200, &json!(["inst-a|default|1"])), "{v}");
    assert_eq!(srv.router.index_stats().facts, 7);
    let (_, v) = srv.post("/query", q.clone()).await;
    assert_eq!(v["default"]["inst-a"]["DP"], json!({"0": 16}));
    // Unregister the rest: everything it reported is gone; a second unregister is a 404.
    let (s, _) = srv.post("/unregister", json!({"instance_id": "inst-a"})).await;
    assert_eq!(s, 200);
    assert_eq!(srv.router.index_stats().facts, 0);
    let (s, _) = srv.post("/unregister", json!({"instance_id": "inst-a"})).await;
    assert_eq!(s, 404);
    let (_, v) = srv.post("/query", q).await;
    assert_eq!(v, json!({"default": {}}));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_are_validated_and_salted_namespaces_kept_apart() {
    let srv = Server::start(config()).await;
    let mut exp = VllmExporter::bind("tcp://127.0.0.1:0", "", Encoding::Tuple).await.unwrap();
    let ep = exp.endpoint().to_string();
    let mut b = register_body(&ep, "i1", 0);
    b["type"] = json!("Mooncake");
    assert_eq!(srv.post("/register", b).await.0, 400);
    let mut b = register_body(&ep, "i1", 0);
    b["endpoint"] = json!("ipc:///tmp/x");
    assert_eq!(srv.post("/register", b).await.0, 400);
    let mut b = register_body(&ep, "i1", 0);
    b["block_size"] = json!(0);
    assert_eq!(srv.post("/register", b).await.0, 400);

    // A numeric instance id, a salt, no configured namespace: a namespace of its own.
    let mut b = register_body(&ep, "i1", 0);
    b["instance_id"] = json!(7);
    b["additionalsalt"] = json!("w8a8");
    let (s, v) = srv.post("/register", b).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["instance_id"], "7");
    // The same endpoint for another instance is a conflict.
    assert_eq!(srv.post("/register", register_body(&ep, "other", 0)).await.0, 409);

    let tokens: Vec<u32> = (0..8).collect();
    publish_until(&srv, &mut exp, &[stored_for_export(None, &tokens, 4, TierKind::G1Gpu)], 2).await;
    let q = |salt: Option<&str>| {
        let mut q = json!({"model": "test/vllm", "block_size": 4, "token_ids": tokens});
        if let Some(s) = salt {
            q["cache_salt"] = json!(s);
        }
        q
    };
    let (_, v) = srv.post("/query", q(Some("w8a8"))).await;
    assert_eq!(v["default"]["7"]["longest_matched"], 8, "{v}");
    assert_eq!(v["default"]["7"]["GPU"], 8, "{v}");
    let (_, v) = srv.post("/query", q(None)).await;
    assert_eq!(v, json!({"default": {}}));
    let (s, v) = srv.post("/query_by_hash", q(None)).await;
    assert_eq!(s, 400, "{v}");
    srv.stop().await;

    // Turned off, the API is not served.
    let mut cfg = config();
    cfg.indexer.enabled = false;
    let srv = Server::start(cfg).await;
    assert_eq!(srv.post("/register", register_body(&ep, "i1", 0)).await.0, 404);
    srv.stop().await;
}

/// A publisher registered for a LoRA adapter is indexed under the hashes Dynamo 1.6.1 gives
/// that adapter's requests (`docs/block-keys.md` section 9): its events' blocks are seeded by
/// the registration's adapter where they name none, and by the adapter they name otherwise;
/// `/query` seeds the prompt's hashes the same way, and `/query_by_hash` finds Dynamo's seeded
/// hashes, not the base model's. (A registration's salt selects its namespace only: the salted
/// test above finds the base hashes there.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_registrations_use_dynamos_seeded_hashes() {
    use kvproto::dynamo::{request_seed, request_sequence_hashes, sequence_hashes};

    let srv = Server::start(config()).await;
    let mut lora = VllmExporter::bind("tcp://127.0.0.1:0", "", Encoding::Tuple).await.unwrap();
    let mut plain = VllmExporter::bind("tcp://127.0.0.1:0", "", Encoding::Tuple).await.unwrap();
    let mut b = register_body(lora.endpoint(), "with-lora", 0);
    b["lora_name"] = json!("sql");
    assert_eq!(srv.post("/register", b).await.0, 200);
    assert_eq!(srv.post("/register", register_body(plain.endpoint(), "base", 0)).await.0, 200);

    // The adapter's engine names no adapter in its events; the base engine sends a block of an
    // adapter's request (named in the event) beside its own.
    let tokens: Vec<u32> = (900..912).collect();
    publish_until(&srv, &mut lora, &[stored_for_export(None, &tokens, 4, TierKind::G1Gpu)], 3).await;
    let mut named = stored_for_export(None, &tokens[..4], 4, TierKind::G1Gpu);
    if let VllmEvent::BlockStored { lora_name, .. } = &mut named {
        *lora_name = Some("sql".into());
    }
    let base_tokens: Vec<u32> = (2000..2008).collect();
    publish_until(&srv, &mut plain, &[stored_for_export(None, &base_tokens, 4, TierKind::G1Gpu), named], 6).await;

    let seeded: Vec<Value> =
        request_sequence_hashes(&tokens, 4, request_seed(Some(b"sql"), None)).into_iter().map(|h| json!(h)).collect();
    let q = |body: Value| async { srv.post("/query", body).await.1 };
    let v = q(json!({"model": "test/vllm", "block_size": 4, "token_ids": tokens, "lora_name": "sql"})).await;
    assert_eq!(v["default"]["with-lora"]["longest_matched"], 12, "{v}");
    let (_, v) = srv
        .post(
            "/query_by_hash",
            json!({"model": "test/vllm", "block_size": 4, "seq_hashes": seeded, "lora_name": "sql"}),
        )
        .await;
    assert_eq!(v["default"]["with-lora"]["longest_matched"], 12, "{v}");
    // The base model's hashes of the same tokens are not the adapter's blocks.
    let unseeded: Vec<Value> = sequence_hashes(&tokens, 4, 1337).into_iter().map(|h| json!(h)).collect();
    let (_, v) = srv
        .post(
            "/query_by_hash",
            json!({"model": "test/vllm", "block_size": 4, "seq_hashes": unseeded, "lora_name": "sql"}),
        )
        .await;
    assert_eq!(v["default"]["with-lora"]["longest_matched"], 0, "{v}");
    // The base engine: its own blocks under the base hashes; the adapter's block it sent is
    // indexed under the adapter's hashes, so a base query of those tokens finds nothing there.
    let v = q(json!({"model": "test/vllm", "block_size": 4, "token_ids": base_tokens})).await;
    assert_eq!(v["default"]["base"]["longest_matched"], 8, "{v}");
    let v = q(json!({"model": "test/vllm", "block_size": 4, "token_ids": tokens})).await;
    assert_eq!(v["default"]["base"]["longest_matched"], 0, "{v}");
    srv.stop().await;
}
