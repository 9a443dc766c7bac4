//! A short `kvbench soak` as a smoke test: the daemon and router binaries of this package as
//! processes, six engines for 15 s with every kind of churn, samples every second. It checks
//! what a short run can: every loaded block's stamps right, under 1% failed calls, both
//! processes alive and stopping cleanly, nothing left in the run's `/dev/shm` directory, the
//! CSV and JSON written. The growth bounds are loosened 10 times: 15 s is warm-up (RocksDB's
//! memtable, the allocator), which the 10-minute run (`scripts/soak`, docs/operations/soak.md)
//! leaves behind before it fits its lines.
#![allow(clippy::unwrap_used)]

use clap::Parser;
use kvbench::soak::{SoakArgs, run};
use kvtests::fixture::kvbench_argv;

#[derive(Debug, Parser)]
struct Cmd {
    #[command(flatten)]
    args: SoakArgs,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_soak_serves_right_bytes_and_stops_clean() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let cmd = Cmd::parse_from(kvbench_argv(
        &["soak", "--minutes", "0.25", "--interval-s", "1", "--g2-mib", "64", "--g3-mib", "256", "--bound-scale", "10"],
        env!("CARGO_BIN_EXE_daemon"),
        env!("CARGO_BIN_EXE_router"),
        dir.path(),
        &out,
    ));
    let (md, passed) = run(&cmd.args).await.unwrap();
    println!("{md}");
    assert!(passed, "{md}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("soak.json")).unwrap()).unwrap();
    let counts = &json["counts"];
    assert!(counts["requests"].as_u64().unwrap() > 100, "{counts}");
    assert!(counts["checked_blocks"].as_u64().unwrap() > 0, "{counts}");
    assert_eq!(counts["wrong_blocks"], 0);
    assert!(json["samples"].as_u64().unwrap() >= 10);
    let csv = std::fs::read_to_string(out.join("samples.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let (daemon_rss, router_rss) = (col("daemon_rss_mib"), col("router_rss_mib"));
    // Every sample saw both processes (zero RSS: one was gone).
    for line in lines {
        let f: Vec<f64> = line.split(',').map(|v| v.parse().unwrap()).collect();
        assert!(f[daemon_rss] > 0.0 && f[router_rss] > 0.0, "{line}");
    }
}
