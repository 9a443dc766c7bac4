//! "Never fail silently": each condition is a metric, a degraded `/healthz` with the reason, and
//! clears when the cause goes away.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvproto::TierKind;
use kvproto::events::{KEY_SCHEME_DYNAMO_XXH3_1337, PublisherInfo, PublisherMessage, RouteOutcome, WorkerId};
use kvrouter::RouterConfig;
use kvrouter::config::ResolvedNamespace;
use kvrouter::recovery::MemoryPublisher;
use kvtests::router_harness::*;

/// The harness's configuration and, beside its `m`, the namespaces a gateway gets wrong: `m8`
/// (the same model in 8-token blocks) and `mdyn` (the same in Dynamo's key scheme).
fn with_mismatches() -> RouterConfig {
    let mut cfg = config();
    cfg.namespaces.push(spec("m8", "test/model", 8));
    let mut dyn_spec = spec("mdyn", "test/model", 4);
    dyn_spec.key_scheme = KEY_SCHEME_DYNAMO_XXH3_1337.into();
    cfg.namespaces.push(dyn_spec);
    cfg
}

/// A router of `cfg` that knows one worker, `w1` of publisher `daemon-a` on node A (reports
/// once a minute), and the namespace of `cfg`'s first entry.
async fn serving_w1(cfg: RouterConfig) -> (Server, ResolvedNamespace) {
    let ns = resolved(&cfg);
    let srv = Server::start(cfg).await;
    let p = MemoryPublisher::new("daemon-a", 1, 100);
    srv.publish(&p.message(Some(info("A", &["w1"], &ns, 60_000, None)), vec![])).await;
    (srv, ns)
}

/// Publisher `daemon-b` announces worker `w2` in a key scheme nobody knows: its announcement.
async fn unknown_scheme(srv: &Server, ns: &ResolvedNamespace) -> (MemoryPublisher, PublisherInfo) {
    let q = MemoryPublisher::new("daemon-b", 1, 100);
    let mut inf = info("B", &["w2"], ns, 60_000, None);
    inf.namespaces[0].key_scheme = "sha256-v9".into();
    srv.publish(&q.message(Some(inf.clone()), vec![])).await;
    (q, inf)
}

fn kinds(h: &serde_json::Value) -> Vec<String> {
    h["conditions"].as_array().unwrap().iter().map(|c| c["kind"].as_str().unwrap().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_worker_becomes_stale_then_is_dropped_with_its_blocks() {
    let mut cfg = config();
    cfg.health.drop_after_s = 1.2;
    let ns = resolved(&cfg);
    let srv = Server::start(cfg).await;
    let p = MemoryPublisher::new("daemon-a", 1, 100);
    let q = MemoryPublisher::new("daemon-b", 1, 100);
    let keys = ns.keys(&prompt(1, 4));
    let ev = vec![p.publish(stored(&ns, &keys, TierKind::G1Gpu, worker("w1")))];
    // daemon-a promises a report every 100 ms.
    srv.publish(&p.message(Some(info("A", &["w1"], &ns, 100, None)), ev)).await;
    srv.publish(&q.message(Some(info("B", &["w2"], &ns, 60_000, None)), vec![])).await;
    assert_eq!(srv.healthz().await["status"], "ok");
    srv.wait_for(5, "stale", || async { srv.metric("kvrouter_worker_stale{worker=\"w1\"}").await == Some(1.0) }).await;
    let h = srv.healthz().await;
    assert_eq!(kinds(&h), ["stale_worker"], "{h}");
    assert_eq!(h["conditions"][0]["subject"], "w1");
    assert!(h["conditions"][0]["reason"].as_str().unwrap().contains("silent"), "{h}");
    assert_eq!(srv.metric("kvrouter_worker_stale{worker=\"w2\"}").await, Some(0.0));
    // A heartbeat clears it.
    srv.publish(&PublisherMessage::new("daemon-a", 1)).await;
    assert_eq!(srv.healthz().await["status"], "ok");
    // Silence past drop_after_s drops the worker and its blocks: the index stays bounded.
    srv.wait_for(5, "drop", || async { srv.router.index_stats().facts == 0 }).await;
    assert_eq!(srv.metric("kvrouter_dropped_holders_total").await, Some(1.0));
    let r = srv.route(route_body(&prompt(1, 4))).await;
    assert_eq!(r.worker, "w2");
    assert_eq!(srv.healthz().await["status"], "ok");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_size_scheme_and_namespace_mismatches_are_reported() {
    // The gateway asks with 8-token blocks; the daemon stores 4-token blocks of the same model.
    let mut cfg = with_mismatches();
    let mut salted = spec("msalt", "test/model", 4);
    salted.tenant_salt_hex = Some("0102".into());
    cfg.namespaces.push(salted);
    cfg.namespaces.push(spec("other", "other/model", 4));
    let (srv, ns) = serving_w1(cfg).await;
    let body = |n: &str| serde_json::json!({"namespace": n, "tokens": prompt(1, 4)});

    srv.route(body("m")).await;
    assert_eq!(srv.healthz().await["status"], "ok");

    // Still routed (the cache is an optimisation), but loud.
    let r = srv.route(body("m8")).await;
    assert_eq!(r.worker, "w1");
    let h = srv.healthz().await;
    assert_eq!(kinds(&h), ["block_size_mismatch"], "{h}");
    assert!(h["conditions"][0]["reason"].as_str().unwrap().contains("8-token blocks"), "{h}");
    srv.route(body("mdyn")).await;
    srv.route(body("msalt")).await;
    let h = srv.healthz().await;
    assert_eq!(kinds(&h), ["namespace_mismatch", "block_size_mismatch", "key_scheme_mismatch"], "{h}");
    for (kind, n) in [("block_size_mismatch", 1.0), ("key_scheme_mismatch", 1.0), ("namespace_mismatch", 1.0)] {
        assert_eq!(srv.metric(&format!("kvrouter_mismatch_total{{kind=\"{kind}\"}}")).await, Some(n), "{kind}");
    }
    // A model nobody serves: no worker, and a namespace mismatch.
    let (s, _) = srv.route_json(body("other")).await;
    assert_eq!(s, 503);
    assert!(kinds(&srv.healthz().await).contains(&"namespace_mismatch".to_string()));

    // A publisher speaking an unknown key scheme.
    unknown_scheme(&srv, &ns).await;
    let h = srv.healthz().await;
    assert!(
        h["conditions"].as_array().unwrap().iter().any(|c| c["kind"] == "key_scheme_mismatch"
            && c["subject"] == "daemon-b"
            && c["reason"].as_str().unwrap().contains("sha256-v9")),
        "{h}"
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatch_conditions_expire_when_no_longer_seen() {
    let mut cfg = with_mismatches();
    cfg.health.mismatch_hold_s = 0.3;
    let (srv, ns) = serving_w1(cfg).await;
    for n in ["m8", "mdyn"] {
        srv.route(serde_json::json!({"namespace": n, "tokens": prompt(1, 4)})).await;
    }
    assert_eq!(kinds(&srv.healthz().await), ["block_size_mismatch", "key_scheme_mismatch"]);
    srv.wait_for(5, "expiry", || async { srv.healthz().await["status"] == "ok" }).await;

    // A publisher's own unknown key scheme is not a passing request: it stays until fixed.
    let (q, mut inf) = unknown_scheme(&srv, &ns).await;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert_eq!(kinds(&srv.healthz().await), ["key_scheme_mismatch"]);
    inf.namespaces[0].key_scheme = kvproto::events::KEY_SCHEME_KVCACHED.into();
    srv.publish(&q.message(Some(inf), vec![])).await;
    assert_eq!(srv.healthz().await["status"], "ok");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predicted_versus_actual_hits_are_exported_per_worker() {
    let mut cfg = config();
    cfg.health.prediction_min_samples = 5;
    cfg.health.prediction_ewma_alpha = 0.5;
    let ns = resolved(&cfg);
    let srv = Server::start(cfg).await;
    let p = MemoryPublisher::new("daemon-a", 1, 100);
    let keys = ns.keys(&prompt(1, 8));
    let ev = vec![p.publish(stored(&ns, &keys, TierKind::G2Host, node("A")))];
    srv.publish(&p.message(Some(info("A", &["w1"], &ns, 60_000, None)), ev)).await;
    // Accurate outcomes first: healthy.
    for _ in 0..6 {
        let r = srv.route(route_body(&prompt(1, 8))).await;
        assert_eq!(r.cached_blocks, [0, 8, 0, 0]);
        let mut m = PublisherMessage::new("daemon-a", 1);
        m.outcomes =
            vec![RouteOutcome { route_id: r.route_id, worker: WorkerId("w1".into()), found_blocks: [0, 8, 0, 0] }];
        srv.publish(&m).await;
    }
    assert_eq!(srv.healthz().await["status"], "ok");
    assert_eq!(srv.metric("kvrouter_prediction_error_ratio{worker=\"w1\"}").await, Some(0.0));
    // The daemon finds nothing (e.g. its blocks were lost without events): the error shows.
    for _ in 0..6 {
        let r = srv.route(route_body(&prompt(1, 8))).await;
        let mut m = PublisherMessage::new("daemon-a", 1);
        m.outcomes = vec![RouteOutcome { route_id: r.route_id, worker: WorkerId("w1".into()), found_blocks: [0; 4] }];
        srv.publish(&m).await;
    }
    let h = srv.healthz().await;
    assert_eq!(kinds(&h), ["prediction_error"], "{h}");
    assert_eq!(srv.metric("kvrouter_predicted_blocks_total{worker=\"w1\"}").await, Some(96.0));
    assert_eq!(srv.metric("kvrouter_actual_blocks_total{worker=\"w1\"}").await, Some(48.0));
    assert!(srv.metric("kvrouter_prediction_error_ratio{worker=\"w1\"}").await.unwrap() > 0.9);
    // An outcome nobody predicted is counted, not trusted.
    let mut m = PublisherMessage::new("daemon-a", 1);
    m.outcomes = vec![RouteOutcome { route_id: 999_999, worker: WorkerId("w1".into()), found_blocks: [1; 4] }];
    srv.publish(&m).await;
    assert_eq!(srv.metric("kvrouter_outcomes_unknown_total").await, Some(1.0));
    tokio::time::sleep(Duration::from_millis(1)).await;
    srv.stop().await;
}
