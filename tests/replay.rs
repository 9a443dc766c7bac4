//! A short `kvbench replay` as a smoke test: a Mooncake-format trace (a small multi-turn chat,
//! written here as JSON lines) through two real daemon processes with G2 and G3, engines over
//! their sockets, and a real `kvrouter` process, with the router's simulation beside it. It
//! checks the results are sensible (hits from both tiers, every loaded block byte-exact, the
//! router's predictions matching what the engines found) and that the JSON report has its
//! fields; no timing is asserted. The full trace runs from `kvbench replay`
//! (docs/benchmarks.md, "Trace replay").
#![allow(clippy::unwrap_used)]

use clap::Parser;
use kvbench::cli::{ReplayArgs, replay};
use kvrouter::sim;
use kvtests::fixture::kvbench_argv;

#[derive(Debug, Parser)]
struct Cmd {
    #[command(flatten)]
    args: ReplayArgs,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_replay_through_daemons_and_router_hits_and_reports() {
    let dir = tempfile::tempdir().unwrap();
    // 60 conversations of 5 turns: 300 requests of 5 to 17 blocks (a shared 2-block system
    // prompt, 3 blocks a turn).
    let trace = sim::synthetic_trace(20, 60, 5, 2, 3);
    let path = dir.path().join("trace.jsonl");
    let text: String = trace.iter().map(|r| serde_json::to_string(r).unwrap() + "\n").collect();
    std::fs::write(&path, text).unwrap();
    let out = dir.path().join("out");
    let cmd = Cmd::parse_from(kvbench_argv(
        &[
            "replay",
            "--trace",
            path.to_str().unwrap(),
            "--nodes",
            "2",
            // Small enough that G2 evicts to G3 and later requests find their history there.
            "--g2-blocks",
            "64",
            "--g3-blocks",
            "2048",
            "--no-progress",
        ],
        env!("CARGO_BIN_EXE_daemon"),
        env!("CARGO_BIN_EXE_router"),
        dir.path(),
        &out,
    ));
    let md = replay(&cmd.args).await.unwrap();
    println!("{md}");

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("replay.json")).unwrap()).unwrap();
    assert!(out.join("replay.md").is_file());
    let r = &json["replay"];
    for field in [
        "hit_rate",
        "saved_prefill_tokens",
        "latency",
        "throughput",
        "placement",
        "series",
        "nodes",
        "lookup_hit_rate",
        "blocks_checked",
    ] {
        assert!(!r[field].is_null(), "replay.{field} missing: {r}");
    }
    for op in ["route", "lookup", "load", "save"] {
        for q in ["p50_us", "p90_us", "p99_us", "cdf"] {
            assert!(!r["latency"][op][q].is_null(), "latency.{op}.{q} missing");
        }
    }
    assert!(!json["model"]["kv_aware_hit_rate"].is_null(), "{}", json["model"]);
    assert_eq!(r["requests"], 300);
    assert!(r["router_process"].as_bool().unwrap());

    // Nothing failed, nothing wrong was loaded.
    assert_eq!(r["errors"], 0, "{}", r["first_errors"]);
    assert_eq!(r["mismatches"], 0);
    let checked = r["blocks_checked"].as_u64().unwrap();
    assert!(checked > 0);

    // Hits, from both tiers, and tokens saved by them.
    let hit = &r["hit_rate"];
    let (g2, g3, total) = (hit["g2"].as_f64().unwrap(), hit["g3"].as_f64().unwrap(), hit["total"].as_f64().unwrap());
    assert!(g2 > 0.0 && g3 > 0.0, "{hit}");
    assert!(total > 0.3, "{hit}");
    let infinite = json["model"]["infinite_hit_rate"].as_f64().unwrap();
    assert!(total <= infinite + 1e-9, "{total} > {infinite}");
    let saved = r["saved_prefill_tokens"]["total"].as_f64().unwrap();
    assert_eq!(saved, checked as f64 * 512.0);

    // The router placed almost every request where it expected the prefix it found.
    let p = &r["placement"];
    let exact = p["exact"].as_u64().unwrap();
    assert!(exact >= 270, "{p}");
    assert_eq!(p["router_outcomes"].as_f64().unwrap(), 300.0, "{p}");
    assert!(p["per_worker"].as_array().unwrap().iter().all(|n| n.as_u64().unwrap() > 0), "{p}");

    // The daemons' own tiers agree: G3 holds blocks.
    let g3_blocks: u64 = r["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|n| n["tiers"].as_array().unwrap().iter())
        .filter(|t| t["tier"] == "g3")
        .map(|t| t["blocks"].as_u64().unwrap())
        .sum();
    assert!(g3_blocks > 0, "{}", r["nodes"]);
}
