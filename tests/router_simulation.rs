//! The simulation harness against a real router over HTTP, on small deterministic traces (the
//! Mooncake trace runs from `examples/mooncake_sim.rs`; see docs/router.md).
#![allow(clippy::unwrap_used)]

use kvrouter::RouterConfig;
use kvrouter::sim::{self, Policy, SimConfig};
use kvtests::router_harness::Server;

async fn run(trace: &[sim::TraceRequest], cfg: &SimConfig, router: RouterConfig) -> (sim::SimResult, Server) {
    let srv = Server::start(router).await;
    let r = sim::run(&srv.base, trace, cfg).await.unwrap();
    (r, srv)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_aware_routing_beats_round_robin_and_random_on_multi_turn_chat() {
    let trace = sim::synthetic_trace(11, 120, 5, 1, 4);
    let base = SimConfig { workers: 4, capacity_blocks: 150, ..SimConfig::default() };
    let router = RouterConfig { seed: Some(5), ..RouterConfig::default() };
    let (kv, srv) = run(&trace, &base, router.clone()).await;
    let (rr, _) = run(&trace, &SimConfig { policy: Policy::RoundRobin, ..base.clone() }, router.clone()).await;
    let (rnd, _) = run(&trace, &SimConfig { policy: Policy::Random, ..base.clone() }, router).await;
    let inf = sim::infinite_hit_rate(&trace);
    let pooled = sim::pooled_hit_rate(&trace, 4 * 150);
    println!(
        "kv {:.3} rr {:.3} random {:.3} pooled {:.3} infinite {:.3}",
        kv.hit_rate, rr.hit_rate, rnd.hit_rate, pooled, inf
    );
    assert_eq!(kv.requests, 600);
    assert!(kv.hit_rate > rr.hit_rate + 0.15, "kv {} rr {}", kv.hit_rate, rr.hit_rate);
    assert!(kv.hit_rate > rnd.hit_rate + 0.15, "kv {} random {}", kv.hit_rate, rnd.hit_rate);
    assert!(kv.hit_rate <= inf + 1e-9);
    // Load terms keep every worker busy.
    assert!(kv.per_worker.iter().all(|n| *n > 60), "{:?}", kv.per_worker);
    // The router's predictions matched what the workers found.
    let m = srv.metrics().await;
    assert!(m.contains("kvrouter_outcomes_total 600"), "{m}");
    assert_eq!(srv.healthz().await["status"], "ok", "{}", srv.healthz().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_twelve_prefixes_resends_hit_with_kv_aware_routing() {
    // 12 prompts of ~2000 tokens (125 blocks of 16), each sent 6 times in mixed order; each
    // worker holds 14,816 tokens (926 blocks).
    let trace = sim::repeated_prefixes(4, 12, 125, 6, 2_000);
    let base = SimConfig {
        workers: 2,
        capacity_blocks: 926,
        prefill_ms_per_block: 1.0,
        decode_ms_per_token: 1.0,
        ..SimConfig::default()
    };
    let router = RouterConfig { seed: Some(2), ..RouterConfig::default() };
    let (kv, _srv) = run(&trace, &base, router.clone()).await;
    let (rr, _) = run(&trace, &SimConfig { policy: Policy::RoundRobin, ..base.clone() }, router).await;
    let kv_resend = kv.resend_full_hits as f64 / kv.resends as f64;
    let rr_resend = rr.resend_full_hits as f64 / rr.resends as f64;
    println!(
        "resend full-hit rate: kv {kv_resend:.3} rr {rr_resend:.3}; block hit rate kv {:.3} rr {:.3}",
        kv.hit_rate, rr.hit_rate
    );
    assert_eq!(kv.resends, 60);
    assert!(kv_resend > 0.95, "{kv_resend}");
    assert!(rr_resend < 0.7, "{rr_resend}");
}
