//! A short `kvbench many` as a smoke test: engines saving and loading at once against a real
//! daemon process, then looking up from threads of their own, alone and beside one engine's
//! bulk save. It checks that every phase ran and counted what it should; no timing is asserted
//! (docs/benchmarks.md, "Lookups beside a bulk save").
#![allow(clippy::unwrap_used)]

use clap::Parser;
use kvbench::cli::{ManyArgs, many};

#[derive(Debug, Parser)]
struct Cmd {
    #[command(flatten)]
    args: ManyArgs,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_engines_then_lookups_beside_a_bulk_save_all_report() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let argv = [
        "many",
        "--engines",
        "2",
        "--call-blocks",
        "2",
        "--seconds",
        "0.5",
        "--g2-gib",
        "1",
        "--idle-samples",
        "20",
        "--save-mib",
        "64",
        "--save-rounds",
        "2",
        "--kvcached",
        env!("CARGO_BIN_EXE_daemon"),
        "--dir",
        dir.path().to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    let cmd = Cmd::parse_from(argv);
    let md = many(&cmd.args).await.unwrap();
    println!("{md}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("many.json")).unwrap()).unwrap();
    assert!(json["all"]["calls"].as_u64().unwrap() > 0, "{}", json["all"]);
    assert_eq!(json["lookup_idle"]["n"], 20);
    // 2 engines every 2 ms for most of a second: hundreds of lookups with nothing else running.
    let alone = json["lookups_alone"]["n"].as_u64().unwrap();
    assert!(alone >= 100, "{alone} lookups alone");
    assert!(json["lookups_beside_save"]["n"].as_u64().unwrap() > 0, "{}", json["lookups_beside_save"]);
    assert_eq!(json["save_seconds"].as_array().unwrap().len(), 2);
    assert!(md.contains("while one engine saves"), "{md}");
}
