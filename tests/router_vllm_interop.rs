//! vLLM KV-event interop over real ZMQ sockets, against an independent Python encoder/decoder
//! (`tests/py/vllm_events.py`: msgspec structs written from vLLM's event schema, pyzmq, and the
//! `xxhash` package for Dynamo hashes). Needs `.venv` at the workspace root with `pyzmq msgspec
//! xxhash` (scripts/test installs them).
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvcached::export::zmq_export::VllmExporter;
use kvproto::TierKind;
use kvproto::events::KEY_SCHEME_DYNAMO_XXH3_1337;
use kvproto::vllm::{self, Encoding, stored_for_export};
use kvtests::router_harness::*;

/// The Python with pyzmq, msgspec and xxhash that `scripts/test` sets up (`KVCACHED_TEST_PYTHON`).
fn python() -> String {
    let p = std::env::var("KVCACHED_TEST_PYTHON").unwrap_or_else(|_| {
        let home = std::env::var("HOME").unwrap_or_default();
        format!("{home}/.cache/kvcached/venv-test/bin/python")
    });
    assert!(
        std::path::Path::new(&p).exists(),
        "{p} missing: run scripts/test (it creates it), or set KVCACHED_TEST_PYTHON to a Python with pyzmq, msgspec and xxhash"
    );
    p
}

struct Py {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Py {
    fn spawn(args: &[&str]) -> Self {
        let mut child = Command::new(python())
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/py/vllm_events.py"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                if tx.send(l.unwrap_or_default()).is_err() {
                    return;
                }
            }
        });
        Self { child, stdin, lines }
    }

    async fn line(&self, secs: u64) -> String {
        let t0 = Instant::now();
        loop {
            if let Ok(l) = self.lines.try_recv() {
                return l;
            }
            assert!(t0.elapsed() < Duration::from_secs(secs), "python said nothing");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn cmd(&mut self, c: &str) {
        writeln!(self.stdin, "{c}").unwrap();
        self.stdin.flush().unwrap();
        assert_eq!(self.line(10).await, format!("sent {c}"));
    }
}

impl Drop for Py {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A router subscribed to one vLLM engine at `endpoint` (worker `v1` on node `N1`, namespace
/// `vllm` with 4-token blocks and Dynamo hashes), asking `replay` for missed batches; returns
/// once the first batch has arrived, with the publisher's metric label selector (without its
/// closing brace) for the tests' own series.
async fn subscribed(endpoint: &str, replay: Option<String>, idle_reconnect_s: f64) -> (Server, String) {
    let mut cfg = config();
    let mut ns = spec("vllm", "test/vllm", 4);
    ns.key_scheme = KEY_SCHEME_DYNAMO_XXH3_1337.into();
    cfg.namespaces.push(ns);
    cfg.vllm_sources.push(vllm_source(endpoint, replay, idle_reconnect_s));
    let srv = Server::start(cfg).await;
    let publisher = format!("{{publisher=\"vllm:{endpoint}\"");
    let batches = format!("kvrouter_vllm_batches_total{publisher}}}");
    srv.wait_for(20, "subscription", || async { srv.metric(&batches).await.unwrap_or(0.0) >= 1.0 }).await;
    (srv, publisher)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingests_vllm_events_in_both_encodings_and_recomputes_hashes() {
    let mut py = Py::spawn(&["publish"]);
    let port: u16 = py.line(20).await.trim().parse().unwrap();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let (srv, _) = subscribed(&endpoint, None, 2.0).await;
    let tokens: Vec<u32> = (1000..1012).collect();
    let body = serde_json::json!({"namespace": "vllm", "tokens": tokens, "explain": true});

    // Tuple-encoded GPU blocks 0-1 (vLLM's opaque hashes 111, 222) and a map-encoded CPU block 2
    // whose parent is 222: the router rebuilds the Dynamo chain across both.
    py.cmd("stored").await;
    srv.wait_for(10, "stored", || async { srv.router.index_stats().facts == 3 }).await;
    let r = srv.route(body.clone()).await;
    assert_eq!((r.worker.as_str(), r.address.as_str(), r.node.as_str()), ("v1", "http://v1.invalid", "N1"));
    assert_eq!(r.cached_blocks, [2, 1, 0, 0]);

    py.cmd("removed").await;
    srv.wait_for(10, "removed", || async { srv.router.index_stats().facts == 2 }).await;
    assert_eq!(srv.route(body.clone()).await.cached_blocks, [0; 4]);

    py.cmd("badsize").await;
    srv.wait_for(10, "mismatch", || async { srv.healthz().await["status"] == "degraded" }).await;
    let h = srv.healthz().await;
    assert_eq!(h["conditions"][0]["kind"], "block_size_mismatch", "{h}");
    assert!(h["conditions"][0]["reason"].as_str().unwrap().contains("16-token"), "{h}");

    py.cmd("cleared").await;
    srv.wait_for(10, "cleared", || async { srv.router.index_stats().facts == 1 }).await;
    assert_eq!(srv.metric(&format!("kvrouter_event_gaps_total{{publisher=\"vllm:{endpoint}\"}}")).await, None);
    writeln!(py.stdin, "quit").unwrap();
    srv.stop().await;
}

/// A batch the engine's PUB socket never delivered is asked for on its replay socket (vLLM's
/// `replay_endpoint`: a ROUTER written in Python from vLLM's publisher, in both answer forms),
/// applied in order and counted as a recovered gap; a batch the engine no longer buffers leaves
/// the gap loud.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_gap_is_filled_from_the_engines_replay_socket() {
    for args in [&["publish", "replay"][..], &["publish", "replay", "topic"][..]] {
        let mut py = Py::spawn(args);
        let ports: Vec<u16> = py.line(20).await.split_whitespace().map(|p| p.parse().unwrap()).collect();
        let endpoint = format!("tcp://127.0.0.1:{}", ports[0]);
        let (srv, publisher) = subscribed(&endpoint, Some(format!("tcp://127.0.0.1:{}", ports[1])), 5.0).await;

        // Blocks 0-1 stored in a batch that only the replay socket has.
        py.cmd("lost").await;
        srv.wait_for(10, "replayed", || async { srv.router.index_stats().facts == 2 }).await;
        let recovered = format!("kvrouter_gap_recoveries_total{publisher},method=\"replay\"}}");
        assert_eq!(srv.metric(&recovered).await, Some(1.0), "{args:?}");
        assert_eq!(srv.metric(&format!("kvrouter_event_gaps_total{publisher}}}")).await, Some(1.0));
        assert_eq!(srv.healthz().await["status"], "ok");
        let tokens: Vec<u32> = (1000..1012).collect();
        let r = srv.route(serde_json::json!({"namespace": "vllm", "tokens": tokens})).await;
        assert_eq!(r.cached_blocks, [2, 0, 0, 0]);

        // A sequence number the engine neither sent nor kept: the gap stays reported.
        py.cmd("unbuffered").await;
        srv.wait_for(10, "unrecovered gap", || async { srv.healthz().await["status"] == "degraded" }).await;
        let h = srv.healthz().await;
        assert_eq!(h["conditions"][0]["kind"], "unrecovered_gap", "{h}");
        assert!(h["conditions"][0]["reason"].as_str().unwrap().contains("replay could not fill"), "{h}");
        assert_eq!(srv.metric(&format!("kvrouter_recovery_failures_total{publisher}}}")).await, Some(1.0));
        assert_eq!(srv.metric(&recovered).await, Some(1.0));
        writeln!(py.stdin, "quit").unwrap();
        srv.stop().await;
    }
}

/// A router that subscribes after the engine has already sent batches asks the replay socket
/// for them from 0 and indexes what the engine still buffers; what it no longer buffers, or all
/// of it when the source has no replay socket, is a loud gap (the engine's cache is partly
/// unknown), not a silent one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_that_subscribes_late_replays_what_the_engine_still_buffers() {
    let tokens: Vec<u32> = (1000..1012).collect();
    struct Case {
        /// Publisher arguments.
        args: &'static [&'static str],
        /// Commands before the router subscribes.
        before: &'static [&'static str],
        /// Whether the source names the replay socket.
        replay: bool,
        /// The gap left reported, if any.
        gap: Option<&'static str>,
    }
    let cases = [
        Case { args: &["publish", "replay"], before: &["lost"], replay: true, gap: None },
        Case {
            args: &["publish", "replay"],
            before: &["unbuffered", "lost"],
            replay: true,
            gap: Some(
                "missed vLLM batches 0..0, sent before this router subscribed (the engine no longer buffers them)",
            ),
        },
        Case {
            args: &["publish"],
            before: &["lost"],
            replay: false,
            gap: Some("missed vLLM batches 0..0, sent before this router subscribed (no replay_endpoint"),
        },
    ];
    for Case { args, before, replay, gap } in cases {
        let mut py = Py::spawn(args);
        let ports: Vec<u16> = py.line(20).await.split_whitespace().map(|p| p.parse().unwrap()).collect();
        for cmd in before {
            py.cmd(cmd).await;
        }
        let endpoint = format!("tcp://127.0.0.1:{}", ports[0]);
        let replay_endpoint = replay.then(|| format!("tcp://127.0.0.1:{}", ports[1]));
        let (srv, _) = subscribed(&endpoint, replay_endpoint, 5.0).await;
        let want_facts = if replay { 2 } else { 0 };
        srv.wait_for(10, "replayed", || async { srv.router.index_stats().facts == want_facts }).await;
        let r = srv.route(serde_json::json!({"namespace": "vllm", "tokens": tokens})).await;
        assert_eq!(r.cached_blocks, [want_facts as u32, 0, 0, 0], "{args:?} {before:?}");
        let h = srv.healthz().await;
        match gap {
            None => assert_eq!(h["status"], "ok", "{h}"),
            Some(reason) => {
                assert_eq!(h["conditions"][0]["kind"], "unrecovered_gap", "{h}");
                assert!(h["conditions"][0]["reason"].as_str().unwrap().contains(reason), "{h}");
            }
        }
        writeln!(py.stdin, "quit").unwrap();
        srv.stop().await;
    }
}

/// The engine restarts on the same endpoint (a new process, a new connection). The source
/// reconnects; the batch numbers starting again say the engine restarted, so everything it
/// reported before is dropped (its G1 blocks and its node's CPU block alike) and the new
/// engine's first batches, sent before the router reconnected, are replayed from 0. A third
/// engine sends ZMTP heartbeat commands between its messages, which the source reads past.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_source_follows_an_engine_restart_and_heartbeats() {
    let mut py = Py::spawn(&["publish", "replay"]);
    let ports: Vec<u16> = py.line(20).await.split_whitespace().map(|p| p.parse().unwrap()).collect();
    let (port, rport) = (ports[0].to_string(), ports[1].to_string());
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let (srv, publisher) = subscribed(&endpoint, Some(format!("tcp://127.0.0.1:{rport}")), 2.0).await;
    let batches = format!("kvrouter_vllm_batches_total{publisher}}}");
    py.cmd("stored").await; // 2 GPU blocks and 1 CPU block
    srv.wait_for(10, "stored", || async { srv.router.index_stats().facts == 3 }).await;
    py.cmd("setseq 100000").await;
    let before = srv.metric(&batches).await.unwrap_or(0.0);
    srv.wait_for(10, "high batch numbers", || async { srv.metric(&batches).await.unwrap_or(0.0) >= before + 3.0 })
        .await;
    drop(py); // killed: its connection drops

    // The new engine stores 2 GPU blocks before the router has reconnected to it.
    let mut py = Py::spawn(&["publish", "replay", "port", &port, "rport", &rport]);
    assert_eq!(py.line(20).await, format!("{port} {rport}"));
    py.cmd("lost").await;
    srv.wait_for(20, "restart seen and replayed", || async {
        srv.metric(&format!("kvrouter_gap_recoveries_total{publisher},method=\"replay\"}}")).await == Some(1.0)
    })
    .await;
    assert_eq!(srv.router.index_stats().facts, 2, "only what the new engine stored");
    assert_eq!(srv.healthz().await["status"], "ok");
    drop(py);

    let mut py = Py::spawn(&["publish", "heartbeat", "port", &port]);
    assert_eq!(py.line(20).await, port);
    let before = srv.metric(&batches).await.unwrap_or(0.0);
    srv.wait_for(20, "batches with heartbeats", || async {
        srv.metric(&batches).await.unwrap_or(0.0) >= before + 10.0
    })
    .await;
    writeln!(py.stdin, "quit").unwrap();
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_our_tiers_in_vllm_wire_format_that_python_decodes() {
    let mut exp = VllmExporter::bind("tcp://127.0.0.1:0", "kvcached", Encoding::Tuple).await.unwrap();
    let endpoint = exp.endpoint().to_string();
    let py = Py::spawn(&["subscribe", &endpoint]);
    assert_eq!(py.line(20).await, "READY");
    let tokens: Vec<u32> = (0..12).collect();
    let hashes = kvproto::dynamo::sequence_hashes(&tokens, 4, 1337);
    let mut reports = vec![];
    let t0 = Instant::now();
    while reports.len() < 2 {
        assert!(t0.elapsed() < Duration::from_secs(20), "python decoded nothing: {reports:?}");
        exp.set_encoding(Encoding::Tuple);
        exp.publish(vec![stored_for_export(None, &tokens[..8], 4, TierKind::G2Host)], Some(0)).await.unwrap();
        exp.set_encoding(Encoding::Map);
        exp.publish(vec![stored_for_export(Some(hashes[1]), &tokens[8..], 4, TierKind::G3Disk)], None).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        while let Ok(l) = py.lines.try_recv() {
            if l != "DONE" {
                reports.push(serde_json::from_str::<serde_json::Value>(&l).unwrap());
            }
        }
    }
    let by = |enc: &str| reports.iter().find(|r| r["encoding"] == enc).unwrap().clone();
    let t = by("tuple");
    assert_eq!(t["topic"], "kvcached");
    assert_eq!(t["events"][0]["medium"], "CPU_PINNED");
    assert_eq!(t["events"][0]["hashes"], serde_json::json!(&hashes[..2]));
    let m = by("map");
    assert_eq!(m["events"][0]["medium"], "DISK");
    assert_eq!(m["events"][0]["parent"], serde_json::json!(hashes[1]));
    assert_eq!(m["events"][0]["hashes"], serde_json::json!(&hashes[2..]));
}

/// The export's replay socket answers vLLM's replay protocol: a Python DEALER (written from
/// vLLM's publisher, not our code) asks for the batches from a sequence number on, decodes
/// them and checks their hashes; the socket keeps only the newest batches within its byte
/// bound, and our own `replay_from` reads the same answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_export_serves_vllms_replay_protocol() {
    let mut exp = VllmExporter::bind("tcp://127.0.0.1:0", "", Encoding::Tuple).await.unwrap();
    let tokens: Vec<u32> = (0..12).collect();
    let one = |t: &[u32]| {
        vllm::encode_batch(
            &vllm::VllmBatch { ts: 0.0, events: vec![stored_for_export(None, t, 4, TierKind::G2Host)], dp_rank: None },
            Encoding::Tuple,
        )
        .len()
    };
    // Room for the two newest of three batches (holding 1, 2 and 3 blocks), each kept batch
    // also counting its bookkeeping.
    let bound = one(&tokens[..8]) + one(&tokens) + 2 * kvcached::export::zmq_export::REPLAY_ENTRY_OVERHEAD + 8;
    let replay = exp.serve_replay("tcp://127.0.0.1:0", bound).await.unwrap();
    for n in [4, 8, 12] {
        exp.publish(vec![stored_for_export(None, &tokens[..n], 4, TierKind::G2Host)], None).await.unwrap();
    }
    let py = Py::spawn(&["replay", &replay, "1"]);
    let r: serde_json::Value = serde_json::from_str(&py.line(20).await).unwrap();
    assert_eq!(r, serde_json::json!({"seqs": [1, 2], "stored": [2, 3]}));
    let py = Py::spawn(&["replay", &replay, "0"]);
    let r: serde_json::Value = serde_json::from_str(&py.line(20).await).unwrap();
    assert_eq!(r["seqs"], serde_json::json!([1, 2]), "batch 0 left the bounded buffer");
    let ours = kvrouter::zmq::replay_from(&replay, 2, Duration::from_secs(5)).await.unwrap();
    assert_eq!(ours.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![2]);
}
