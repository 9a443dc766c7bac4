//! A short `kvbench bus` (docs/benchmarks.md, "The event plane at scale") through a real
//! nats-server and by HTTP push. A test binary of its own: its publishers and replicas keep both
//! vCPUs busy, and beside `tests/bus.rs` (run in parallel within one binary) they starved those
//! tests' replicas of the reports that keep their workers live.
#![allow(clippy::unwrap_used)]

/// A short `kvbench bus` (the scale measurement of docs/benchmarks.md, "The event plane at
/// scale") through a real nats-server and by HTTP push: every replica applies every event of
/// both transports, every probe chain is seen, every send completes. No timing is asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_kvbench_bus_applies_every_event_through_both_transports() {
    use clap::Parser;
    #[derive(Debug, Parser)]
    struct Cmd {
        #[command(flatten)]
        args: kvbench::bus::BusArgs,
    }
    let d = tempfile::tempdir().unwrap();
    let cmd = Cmd::parse_from([
        "bus",
        "--publishers",
        "40",
        "--events-per-s",
        "120",
        "--capacity",
        "200",
        "--seconds",
        "3",
        "--backlog-s",
        "3",
        "--probes",
        "4",
        "--connections",
        "4",
        "--kvrouter",
        env!("CARGO_BIN_EXE_router"),
        "--dir",
        d.path().to_str().unwrap(),
    ]);
    let r = kvbench::bus::run(&cmd.args).await.unwrap();
    println!("{}", kvbench::bus::markdown(&r, &cmd.args));
    assert!(r.backlog_keys >= 40 * 3 * 120, "{}", r.backlog_keys);
    assert!(r.index_keys_per_s > 0.0 && r.router_keys_per_s > 0.0);
    assert_eq!(r.transports.len(), 2);
    for t in &r.transports {
        assert!(t.complete, "{}: a replica did not apply every event", t.name);
        assert!(t.backlog_keys_per_s > 0.0, "{}", t.name);
        // 4 probe publishers x 3 seconds x 2 replicas.
        assert_eq!((t.lag.n, t.lag.missing), (24, 0), "{}: probes", t.name);
        assert_eq!((t.send.n, t.send.missing), (40 * 3, 0), "{}: sends", t.name);
        assert_eq!(t.cpu_s_per_m.len(), 2);
        assert!(t.cpu_s_per_m.iter().all(|c| c.is_finite()), "{:?}", t.cpu_s_per_m);
        // The replicas index the same blocks as the in-process index, at its size per block.
        assert!((t.bytes_per_block - r.index_bytes_per_block).abs() < 0.5 * r.index_bytes_per_block, "{t:?} {r:?}");
    }
}
