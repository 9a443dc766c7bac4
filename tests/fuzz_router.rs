//! The router's decoders of input from other processes, fed arbitrary input in process: every
//! HTTP route (`/route`, `/events` hit reports, the indexer API's JSON) through the real axum
//! app, gRPC `Route` with bodies that are not protobuf, and vLLM msgpack batches through the
//! ingest path. Nothing may panic, and no input is the router's fault (HTTP 500 or gRPC
//! INTERNAL/UNKNOWN): every refusal is the client's error.
//!
//! A short run is part of `cargo test`; a long one: `PROPTEST_CASES=20000 cargo test -p kvtests
//! --test fuzz_router --release` (docs/operations/security-limits.md, "Fuzzing").
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use axum::body::Body;
use kvproto::events::KEY_SCHEME_DYNAMO_XXH3_1337;
use kvproto::fuzzing::{cases, scalars};
use kvproto::vllm;
use kvrouter::vllm_ingest::VllmIngest;
use kvrouter::{Router, RouterConfig};
use kvtests::router_harness::{spec, vllm_source};
use proptest::prelude::*;
use serde_json::{Value, json};
use tower::ServiceExt;

fn router() -> Arc<Router> {
    let mut cfg = RouterConfig { namespaces: vec![spec("m", "test/model", 4)], seed: Some(1), ..Default::default() };
    let mut v = spec("vllm", "test/vllm", 4);
    v.key_scheme = KEY_SCHEME_DYNAMO_XXH3_1337.into();
    cfg.namespaces.push(v);
    cfg.indexer.enabled = true;
    Router::new(cfg).unwrap()
}

/// The words the routes' JSON uses, so arbitrary objects often hit real fields.
const WORDS: &[&str] = &[
    "namespace",
    "tokens",
    "namespace_id",
    "keys",
    "candidates",
    "role",
    "explain",
    "split",
    "publisher",
    "epoch",
    "info",
    "events",
    "last_event_id",
    "load",
    "outcomes",
    "id",
    "type",
    "stored",
    "removed",
    "cleared",
    "tier",
    "holder",
    "parent",
    "g1",
    "g2",
    "g3",
    "g4",
    "node",
    "worker",
    "instance_id",
    "endpoint",
    "tenant_id",
    "modelname",
    "block_size",
    "lora_name",
    "dp_rank",
    "model",
    "token_ids",
    "block_hashes",
    "m",
    "vllm",
    "00112233445566778899aabbccddeeff",
    "tcp://127.0.0.1:1",
    "name",
    "model_id",
    "route_id",
];

fn word() -> impl Strategy<Value = String> {
    prop_oneof![4 => proptest::sample::select(WORDS).prop_map(str::to_string), 1 => ".{0,12}"]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        1 => Just(Value::Null),
        3 => scalars(),
        1 => (0u64..100).prop_map(Value::from),
        1 => any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        1 => word().prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::vec((word(), inner), 0..6).prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Valid bodies of each route, for mutation.
fn valid_bodies() -> Vec<(&'static str, Value)> {
    vec![
        ("/route", json!({"namespace": "m", "tokens": [1, 2, 3, 4, 5, 6, 7, 8], "explain": true})),
        (
            "/events",
            json!({"publisher": "n", "epoch": 1, "last_event_id": 1, "events": [
            {"id": 1, "type": "stored", "namespace": "00112233445566778899aabbccddeeff", "parent": null,
             "keys": ["00112233445566778899aabbccddeeff"], "tier": "g2", "holder": {"node": "n"}}]}),
        ),
        ("/query", json!({"model": "test/vllm", "block_size": 4, "token_ids": [1, 2, 3, 4]})),
        ("/query_by_hash", json!({"model": "test/vllm", "block_size": 4, "block_hashes": [1, 2]})),
        ("/unregister", json!({"instance_id": "i", "tenant_id": "t"})),
    ]
}

/// Replaces a random node of `v` (depth-first index `at`) with `with`.
fn mutate(v: &mut Value, at: &mut usize, with: &Value) -> bool {
    if *at == 0 {
        *v = with.clone();
        return true;
    }
    *at -= 1;
    match v {
        Value::Array(a) => a.iter_mut().any(|c| mutate(c, at, with)),
        Value::Object(o) => o.values_mut().any(|c| mutate(c, at, with)),
        _ => false,
    }
}

const PATHS: &[&str] = &["/route", "/events", "/register", "/unregister", "/query", "/query_by_hash", "/workers"];

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

async fn post(app: &axum::Router, path: &str, body: Vec<u8>, content_type: &str) -> http::Response<Body> {
    let req = http::Request::post(path).header("content-type", content_type).body(Body::from(body)).unwrap();
    app.clone().oneshot(req).await.unwrap()
}

fn grpc_status(r: &http::Response<Body>) -> Option<String> {
    r.headers().get("grpc-status").and_then(|v| v.to_str().ok()).map(str::to_string)
}

proptest! {
    #![proptest_config(cases(128))]

    /// Arbitrary JSON, valid bodies with a node replaced, and raw bytes, to every route.
    #[test]
    fn http_routes(path in proptest::sample::select(PATHS), v in json_value(), raw in proptest::collection::vec(any::<u8>(), 0..200),
                   which in 0usize..5, at in 0usize..40, pick in 0u8..3) {
        let rt = runtime();
        let r = router();
        let app = kvrouter::app(r.clone());
        rt.block_on(async {
            let (path, body) = match pick {
                0 => (path, serde_json::to_vec(&v).unwrap()),
                1 => {
                    let (p, mut b) = valid_bodies().swap_remove(which);
                    let mut at = at;
                    mutate(&mut b, &mut at, &v);
                    (p, serde_json::to_vec(&b).unwrap())
                }
                _ => (path, raw),
            };
            let resp = post(&app, path, body, "application/json").await;
            // 503 is `/route`'s answer when no worker can take the request (none here).
            assert!(resp.status() != http::StatusCode::INTERNAL_SERVER_ERROR, "{path}: {}", resp.status());
        });
        rt.block_on(async {
            r.housekeeping();
        });
    }

    /// gRPC `Route` with bodies that are not the message (raw bytes, lengths that lie).
    #[test]
    fn grpc_route_bodies(raw in proptest::collection::vec(any::<u8>(), 0..200), prefix in any::<bool>(), len in any::<u32>()) {
        let rt = runtime();
        let app = kvrouter::app(router());
        rt.block_on(async {
            let mut body = Vec::new();
            if prefix {
                body.push(0);
                body.extend_from_slice(&(len % 4096).to_be_bytes());
            }
            body.extend_from_slice(&raw);
            let req = http::Request::post("/kvrouter.v1.Router/Route")
                .version(http::Version::HTTP_2)
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(Body::from(body))
                .unwrap();
            let resp = app.clone().oneshot(req).await.unwrap();
            assert!(!resp.status().is_server_error(), "{}", resp.status());
            if let Some(s) = grpc_status(&resp) {
                let m = resp.headers().get("grpc-message").map(|m| m.to_str().unwrap_or("?").to_string());
                // INTERNAL only where gRPC's specification says so (a compressed flag without an
                // encoding).
                let spec = m.as_deref().is_some_and(|m| m.contains("compress"));
                assert!(s != "2" && (s != "13" || spec), "grpc-status {s}: {m:?}");
            }
            // Drain the body (a stream's trailers carry the status when it is not in the head).
            let _ = axum::body::to_bytes(resp.into_body(), 1 << 20).await;
        });
    }

    /// vLLM batches through ingest: structured events with arbitrary fields (hashes that repeat,
    /// token counts that disagree with the block size, unknown media, parents never seen), and
    /// arbitrary JSON-shaped msgpack through the decoder.
    #[test]
    fn vllm_batches_ingested(events in proptest::collection::vec(vllm_event(), 0..6), v in json_value(),
                             seqs in proptest::collection::vec(prop_oneof![0u64..4, any::<u64>()], 1..4)) {
        let r = router();
        let src = vllm_source("tcp://127.0.0.1:1", None, 30.0);
        let ns = r.namespace("vllm").unwrap().clone();
        let mut ingest = VllmIngest::new(ns, kvproto::events::WorkerId("v1".into()), kvproto::events::NodeId("N1".into()));
        let mut last = None;
        let batch = vllm::VllmBatch { ts: 1.0, events, dp_rank: None };
        let mut payloads = vec![vllm::encode_batch(&batch, vllm::Encoding::Tuple)];
        let mut raw = Vec::new();
        rmpv::encode::write_value(&mut raw, &rmpv::Value::Array(vec![1.5.into(), to_msgpack(&v)])).unwrap();
        payloads.push(raw);
        for (i, payload) in payloads.iter().enumerate() {
            if let Ok(batch) = vllm::decode_batch(payload) {
                r.ingest_vllm_batch(&src, &mut ingest, seqs[i % seqs.len()], &batch, &mut last);
            }
        }
        let q = serde_json::json!({"model": "test/vllm", "block_size": 4, "token_ids": [1, 2, 3, 4, 5, 6, 7, 8]});
        let resp = runtime().block_on(post(&kvrouter::app(r), "/query", serde_json::to_vec(&q).unwrap(), "application/json"));
        prop_assert!(resp.status() != http::StatusCode::INTERNAL_SERVER_ERROR);
    }
}

fn ext_hash() -> impl Strategy<Value = vllm::ExtHash> {
    prop_oneof![
        (0i128..4).prop_map(vllm::ExtHash::Int),
        any::<i64>().prop_map(|i| vllm::ExtHash::Int(i.into())),
        proptest::collection::vec(any::<u8>(), 0..33).prop_map(vllm::ExtHash::Bytes),
    ]
}

fn vllm_event() -> impl Strategy<Value = vllm::VllmEvent> {
    prop_oneof![
        (
            proptest::collection::vec(ext_hash(), 0..5),
            proptest::option::of(ext_hash()),
            proptest::collection::vec(prop_oneof![0u32..8, any::<u32>()], 0..24),
            prop_oneof![Just(4u32), 0u32..3, any::<u32>()],
            proptest::option::of(any::<i64>()),
            proptest::option::of(prop_oneof![Just("GPU".to_string()), Just("CPU".to_string()), ".{0,6}"]),
        )
            .prop_map(|(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)| {
                vllm::VllmEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    lora_name: None,
                    extra_keys: Vec::new(),
                }
            }),
        (proptest::collection::vec(ext_hash(), 0..5), proptest::option::of(".{0,6}"))
            .prop_map(|(block_hashes, medium)| vllm::VllmEvent::BlockRemoved { block_hashes, medium }),
        Just(vllm::VllmEvent::AllBlocksCleared),
    ]
}

fn to_msgpack(v: &Value) -> rmpv::Value {
    match v {
        Value::Null => rmpv::Value::Nil,
        Value::Bool(b) => (*b).into(),
        Value::Number(n) => n
            .as_u64()
            .map(rmpv::Value::from)
            .or(n.as_i64().map(rmpv::Value::from))
            .unwrap_or_else(|| n.as_f64().unwrap_or(0.0).into()),
        Value::String(s) => s.as_str().into(),
        Value::Array(a) => rmpv::Value::Array(a.iter().map(to_msgpack).collect()),
        Value::Object(o) => rmpv::Value::Map(o.iter().map(|(k, v)| (k.as_str().into(), to_msgpack(v))).collect()),
    }
}
