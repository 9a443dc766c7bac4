//! Prefill/decode split decisions over the real HTTP API: split when the decode worker lacks
//! the prefix and a prefill worker shares its node; no split when the handoff costs more than
//! it saves (slow link, short prompt) or the decode worker already holds the prefix.
#![allow(clippy::unwrap_used)]

use kvproto::TierKind;
use kvproto::events::{WorkerId, WorkerInfo};
use kvrouter::config::{ResolvedNamespace, SplitConfig};
use kvrouter::recovery::MemoryPublisher;
use kvrouter::{RouterConfig, SplitDecision};
use kvtests::router_harness::*;
use serde_json::json;

/// Node A: decode worker d1, prefill worker p1. Node B: prefill worker p2.
async fn cluster(cfg: RouterConfig) -> (Server, ResolvedNamespace, MemoryPublisher) {
    let ns = resolved(&cfg);
    let srv = Server::start(cfg).await;
    let role = |w: &str, r: &str| WorkerInfo {
        id: WorkerId(w.into()),
        address: format!("http://{w}.invalid"),
        role: Some(r.into()),
    };
    let a = MemoryPublisher::new("daemon-a", 1, 100);
    let mut ia = info("A", &[], &ns, 1000, None);
    ia.workers = vec![role("d1", "decode"), role("p1", "prefill")];
    srv.publish(&a.message(Some(ia), vec![])).await;
    let b = MemoryPublisher::new("daemon-b", 1, 100);
    let mut ib = info("B", &[], &ns, 1000, None);
    ib.workers = vec![role("p2", "prefill")];
    srv.publish(&b.message(Some(ib), vec![])).await;
    (srv, ns, a)
}

async fn decide(srv: &Server, blocks: u32, prefill_candidates: Option<&[&str]>) -> SplitDecision {
    let mut body = json!({"namespace": "m", "tokens": prompt(1, blocks), "role": "decode"});
    if let Some(c) = prefill_candidates {
        body["prefill_candidates"] = json!(c);
    }
    let r = srv.route(body).await;
    assert_eq!(r.worker, "d1");
    r.split.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn splits_to_a_same_node_prefill_worker_when_the_decode_worker_lacks_the_prefix() {
    let (srv, _, _) = cluster(config()).await;
    let s = decide(&srv, 40, None).await;
    assert!(s.split, "{s:?}");
    assert_eq!(s.prefill_worker.as_deref(), Some("p1"));
    assert_eq!(s.prefill_address.as_deref(), Some("http://p1.invalid"));
    assert_eq!(s.prefill_node.as_deref(), Some("A"));
    assert!(s.same_node);
    // 40 blocks of 4 tokens; the test layout is 2 layers x 2 x 1 head x 8 dims x bf16 = 64 bytes
    // per token, 256 per block.
    assert_eq!((s.handoff_blocks, s.handoff_bytes), (40, 40 * 256));
    assert!((s.prefill_saving_ms - 40.0 * 4.0 * 0.05).abs() < 1e-9, "{s:?}");
    assert!(s.handoff_ms < s.prefill_saving_ms);
    assert!(s.reason.contains("same node"), "{s:?}");
    // The JSON carries it as `split`.
    let (_, v) = srv.route_json(json!({"namespace": "m", "tokens": prompt(1, 40), "role": "decode"})).await;
    assert_eq!(v["split"]["split"], true, "{v}");
    assert_eq!(v["split"]["prefill_worker"], "p1", "{v}");
    // A split counts as routed to the prefill worker too: its active term grows.
    let s = decide(&srv, 40, None).await;
    assert_eq!(s.prefill_cost.unwrap().active_term, 2.0 * 2.0, "{s:?}");
    // A request can opt out.
    let (_, v) = srv.route_json(json!({"namespace": "m", "tokens": prompt(1, 40), "split": false})).await;
    assert!(v.get("split").is_none(), "{v}");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_split_when_the_handoff_costs_more_than_it_saves() {
    // A slow link between nodes: 256 bytes per block at 10 KB/s take 25.6 ms, the prefill 0.2 ms.
    let mut cfg = config();
    cfg.split = SplitConfig { cross_node_gbytes_per_s: 1e-5, ..SplitConfig::default() };
    let (srv, _, _) = cluster(cfg).await;
    let s = decide(&srv, 40, Some(&["p2"])).await;
    assert!(!s.split, "{s:?}");
    assert_eq!(s.prefill_worker.as_deref(), Some("p2"));
    assert!(!s.same_node);
    assert!(s.handoff_ms > s.prefill_saving_ms, "{s:?}");
    assert!(s.reason.contains("does not pay"), "{s:?}");
    // Given both, the same-node worker is still worth it.
    assert!(decide(&srv, 40, None).await.split);
    srv.stop().await;

    // A short prompt on a fast link: one block saves 0.2 ms, a cross-node handoff costs 1 ms.
    let (srv, _, _) = cluster(config()).await;
    let s = decide(&srv, 1, Some(&["p2"])).await;
    assert!(!s.split, "{s:?}");
    assert!(s.handoff_ms > s.prefill_saving_ms, "{s:?}");
    // The same prompt 40 blocks long pays even across nodes (8 ms saved, ~1 ms handoff).
    assert!(decide(&srv, 40, Some(&["p2"])).await.split);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_split_when_the_decode_worker_already_holds_the_prefix() {
    let (srv, ns, a) = cluster(config()).await;
    let keys = ns.keys(&prompt(1, 40));
    let ev = vec![a.publish(stored(&ns, &keys, TierKind::G1Gpu, worker("d1")))];
    srv.publish(&a.message(None, ev)).await;
    let s = decide(&srv, 40, None).await;
    assert!(!s.split, "{s:?}");
    assert!(s.reason.contains("already holds"), "{s:?}");
    assert_eq!(s.handoff_blocks, 0);
    // Half of it: only the missing half would move, and it pays.
    let ev = vec![a.publish(kvproto::events::EventBody::Removed {
        keys: keys[20..].to_vec(),
        tier: TierKind::G1Gpu,
        holder: worker("d1"),
    })];
    srv.publish(&a.message(None, ev)).await;
    let s = decide(&srv, 40, None).await;
    assert!(s.split, "{s:?}");
    assert_eq!(s.handoff_blocks, 20);
    srv.stop().await;
}

/// A role no live worker has is refused with that reason, naming how many workers serve the
/// namespace in other roles; an unknown namespace's refusal says no worker serves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_names_the_missing_role_not_a_missing_worker() {
    let (srv, _, _) = cluster(config()).await;
    let (status, v) = srv.route_json(json!({"namespace": "m", "tokens": prompt(1, 8), "role": "embed"})).await;
    let text = v.to_string();
    assert_ne!(status, 200, "{text}");
    assert!(text.contains("no live worker with role embed serves namespace"), "{text}");
    assert!(text.contains("3 live workers serve it in other roles"), "{text}");
    let (status, v) = srv.route_json(json!({"namespace": "m", "tokens": prompt(1, 8), "candidates": ["nobody"]})).await;
    assert_ne!(status, 200, "{v}");
    assert!(v.to_string().contains("none of the candidates the request named"), "{v}");
    srv.stop().await;
}
