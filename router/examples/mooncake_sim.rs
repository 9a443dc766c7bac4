//! Replays a Mooncake-format trace (JSON lines with `timestamp`, `output_length`, `hash_ids`)
//! through simulated LRU workers and a real `kvrouter` on a loopback port, and prints the hit
//! rate of KV-aware routing (default weights, and pure longest-prefix with no load terms),
//! round-robin and random, against the pooled-cache and infinite-cache bounds.
//!
//! ```text
//! cargo run --release -p kvrouter --example mooncake_sim -- \
//!     --trace ../shared/traces/mooncake_conversation_trace.jsonl --workers 8 --capacity 2000
//! cargo run --release -p kvrouter --example mooncake_sim -- --scenario two-workers
//! cargo run --release -p kvrouter --example mooncake_sim -- \
//!     --trace ../shared/traces/mooncake_conversation_trace.jsonl --sweep 250,500,1000,2000,4000,8000
//! ```
//! `--sweep` replays the trace once per capacity and policy and prints CSV
//! (`capacity,policy,hit_rate`); `scripts/plot_hit_rate.py` draws it
//! (`docs/img/mooncake-hit-rate.png`).
#![allow(clippy::unwrap_used)]

use std::time::Instant;

use clap::Parser;
use kvrouter::sim::{self, Policy, SimConfig, TraceRequest};
use kvrouter::{CostWeights, RouterConfig};

#[derive(Debug, Parser)]
struct Args {
    /// Trace file (JSON lines). Not needed for `--scenario two-workers`.
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// `trace` or `two-workers` (12 prefixes x 125 blocks x 6 sends, 926-block workers).
    #[arg(long, default_value = "trace")]
    scenario: String,
    #[arg(long, default_value_t = 8)]
    workers: usize,
    #[arg(long, default_value_t = 2000)]
    capacity: usize,
    /// Replay only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
    #[arg(long, default_value_t = 50.0)]
    prefill_ms_per_block: f64,
    #[arg(long, default_value_t = 20.0)]
    decode_ms_per_token: f64,
    /// Override the router's `active` weight.
    #[arg(long)]
    active: Option<f64>,
    /// Override the router's `fill` weight.
    #[arg(long)]
    fill: Option<f64>,
    /// Override the router's `decode` weight.
    #[arg(long)]
    decode: Option<f64>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Per-worker capacities (blocks, comma-separated): one replay per capacity and policy,
    /// printed as CSV `capacity,policy,hit_rate` instead of the table.
    #[arg(long, value_delimiter = ',')]
    sweep: Vec<usize>,
}

async fn run_one(trace: &[TraceRequest], cfg: &SimConfig, weights: CostWeights, seed: u64) -> (sim::SimResult, f64) {
    let router = RouterConfig { weights, seed: Some(seed), ..RouterConfig::default() };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(kvrouter::serve(listener, router, async move {
        let _ = rx.await;
    }));
    let t0 = Instant::now();
    let r = sim::run(&base, trace, cfg).await.unwrap();
    let secs = t0.elapsed().as_secs_f64();
    let _ = tx.send(());
    server.await.unwrap().unwrap();
    (r, secs)
}

/// The policies compared, each with its CSV name and its table name: KV-aware routing with the
/// given weights, the same with no load terms (pure longest prefix), round-robin and random.
fn policies(cfg: &SimConfig, weights: &CostWeights) -> [(&'static str, &'static str, SimConfig, CostWeights); 4] {
    let prefix_only = CostWeights { decode: 0.0, active: 0.0, fill: 0.0, ..weights.clone() };
    let with = |policy| SimConfig { policy, ..cfg.clone() };
    [
        ("kv-aware", "kv-aware (cost model, load terms)", cfg.clone(), weights.clone()),
        ("kv-aware pure prefix", "kv-aware, pure longest prefix", cfg.clone(), prefix_only),
        ("round-robin", "round-robin", with(Policy::RoundRobin), weights.clone()),
        ("random", "random", with(Policy::Random), weights.clone()),
    ]
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let (mut trace, mut cfg) = match args.scenario.as_str() {
        "two-workers" => (
            sim::repeated_prefixes(args.seed, 12, 125, 6, 2_000),
            SimConfig {
                workers: 2,
                capacity_blocks: 926,
                prefill_ms_per_block: 1.0,
                decode_ms_per_token: 1.0,
                ..SimConfig::default()
            },
        ),
        _ => {
            let path = args.trace.as_ref().expect("--trace is required for --scenario trace");
            let text = std::fs::read_to_string(path).unwrap();
            (
                sim::parse_trace(&text).unwrap(),
                SimConfig {
                    workers: args.workers,
                    capacity_blocks: args.capacity,
                    prefill_ms_per_block: args.prefill_ms_per_block,
                    decode_ms_per_token: args.decode_ms_per_token,
                    ..SimConfig::default()
                },
            )
        }
    };
    if let Some(n) = args.limit {
        trace.truncate(n);
    }
    cfg.seed = args.seed;
    let mut weights = CostWeights::default();
    if let Some(a) = args.active {
        weights.active = a;
    }
    if let Some(f) = args.fill {
        weights.fill = f;
    }
    if let Some(d) = args.decode {
        weights.decode = d;
    }
    if !args.sweep.is_empty() {
        println!("capacity,policy,hit_rate");
        for &capacity in &args.sweep {
            let cfg = SimConfig { capacity_blocks: capacity, ..cfg.clone() };
            for (name, _, c, w) in policies(&cfg, &weights) {
                let (r, _) = run_one(&trace, &c, w, args.seed).await;
                println!("{capacity},{name},{:.4}", r.hit_rate);
            }
            println!("{capacity},pooled LRU,{:.4}", sim::pooled_hit_rate(&trace, cfg.workers * capacity));
            println!("{capacity},infinite cache,{:.4}", sim::infinite_hit_rate(&trace));
        }
        return;
    }
    println!(
        "scenario {} | {} requests | {} workers x {} blocks | weights {:?}",
        args.scenario,
        trace.len(),
        cfg.workers,
        cfg.capacity_blocks,
        weights
    );
    println!("{:<34} {:>9} {:>14} {:>10}", "policy", "hit rate", "resend hits", "seconds");
    let show = |name: &str, r: &sim::SimResult, s: f64| {
        let resend = if r.resends == 0 { 0.0 } else { r.resend_full_hits as f64 / r.resends as f64 };
        println!("{name:<34} {:>9.3} {:>14.3} {s:>10.1}   per worker {:?}", r.hit_rate, resend, r.per_worker);
    };
    for (_, name, c, w) in policies(&cfg, &weights) {
        let (r, s) = run_one(&trace, &c, w, args.seed).await;
        show(name, &r, s);
    }
    println!(
        "{:<34} {:>9.3}",
        "pooled LRU (workers x capacity)",
        sim::pooled_hit_rate(&trace, cfg.workers * cfg.capacity_blocks)
    );
    println!("{:<34} {:>9.3}", "infinite cache", sim::infinite_hit_rate(&trace));
}
