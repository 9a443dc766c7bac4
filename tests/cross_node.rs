//! Two "nodes" as network namespaces joined by a veth pair shaped with `tc` (root only; CI runs
//! as root): the decode node's daemon measures the link to the prefill node's daemon, the
//! measured rate (within 15% of the shaping, or of a raw TCP copy loop through the same veth
//! where this machine cannot fill the shaped link) reaches the router in the hit reports, and the router's split decision flips
//! between 1 Gbit/s and 10 Gbit/s where the documented model (`split::decision_table`) says it
//! should; then the handoff runs across the link, byte for byte.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvclient::{KvMemory, synthetic_block};
use kvproto::{KvLayout, Namespace};
use kvtests::fixture::{check, filled_memory, worker};
use kvtests::netns::{self, NodePair};
use kvtests::proc::{DaemonProc, http_request};

fn layout() -> KvLayout {
    kvtests::fixture::small_layout()
}

/// 1 KiB of KV a token: 2 layers x K and V x 2 heads x 64 x 2 bytes.
const BYTES_PER_TOKEN: u64 = 1024;
/// What the engines report (tokens a second of prefill).
const PREFILL_RATE: f64 = 100_000.0;

fn ns() -> Namespace {
    Namespace::new("xnode/model", layout())
}

struct Router(Child);

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn route(pair: &NodePair, router: &str, tokens: &[u32]) -> serde_json::Value {
    route_as(pair, router, tokens, "decode")
}

/// A placement of `tokens` for a worker of `role`.
fn route_as(pair: &NodePair, router: &str, tokens: &[u32], role: &str) -> serde_json::Value {
    let body = serde_json::json!({"namespace": "x", "tokens": tokens, "role": role}).to_string();
    let router = router.to_string();
    let (status, text) = netns::run_in(&pair.a, move || http_request(&router, "POST", "/route", Some(&body), &[]));
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

/// The link rate B's daemon has measured to A's peer channel (bytes a second).
fn measured(b: &DaemonProc) -> f64 {
    b.metric("kvcached_peer_link_bytes_per_second")
}

/// Waits until B's measured link is within 15% of one of `links` (the shaping, and what a raw
/// TCP copy loop carried through the same veth).
fn wait_rate_near(b: &DaemonProc, links: &[f64]) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = measured(b);
        if links.iter().any(|want| (r - want).abs() <= 0.15 * want) {
            return r;
        }
        assert!(Instant::now() < deadline, "link measured at {r:.0} B/s, against {links:.0?}\n{}", b.log());
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_are_measured_and_the_split_flips_where_the_model_says() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        // As the other root-only tests (tests/security.rs): CI runs as root.
        eprintln!("skipped: needs root to make network namespaces");
        return;
    }
    assert!(netns::available(), "this test makes network namespaces: it needs iproute2 (`ip netns`)");
    let d = tempfile::tempdir().unwrap();
    let pair = NodePair::new("x");
    pair.shape(1000);
    let router_addr = format!("{}:8090", pair.addr_a);
    let peer_a = format!("{}:7471", pair.addr_a);
    let cfg = d.path().join("router.toml");
    std::fs::write(
        &cfg,
        "[auth]\nopen = true\n[[namespaces]]\nname = \"x\"\nmodel_id = \"xnode/model\"\nnum_layers = 2\nkv_heads = 2\n\
         head_dim = 64\ndtype = \"bf16\"\ntokens_per_block = 16\n",
    )
    .unwrap();
    let log = std::fs::File::create(d.path().join("router.log")).unwrap();
    let _router = Router(
        Command::new("ip")
            .args(["netns", "exec", &pair.a, env!("CARGO_BIN_EXE_router"), "--listen", &router_addr])
            .arg("--config")
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap(),
    );
    let reports = |node: &str| {
        format!(
            "[metrics_auth]\nopen = true\n[router]\nurls = [\"http://{router_addr}\"]\nnode = \"{node}\"\n\
             report_interval_ms = 200\n"
        )
    };
    let spawn = |name: &str, addr: &str, netns: &str, peer: &str| {
        DaemonProc::spawn(
            Path::new(env!("CARGO_BIN_EXE_daemon")),
            &d.path().join(name),
            &format!("{addr}:9464"),
            &format!("{}[peer]\n{peer}", reports(&format!("node-{name}"))),
            Some(netns),
            &[],
        )
    };
    let a = spawn("a", &pair.addr_a, &pair.a, &format!("listen = \"{peer_a}\"\n[peer.auth]\nopen = true\n"));
    let b = spawn(
        "b",
        &pair.addr_b,
        &pair.b,
        &format!("peers = [\"{peer_a}\"]\nprobe_idle_s = 1\nprobe_bytes = 33554432\n"),
    );
    // Engines: a prefill worker on A, a decode worker on B, each reporting its prefill rate.
    let mem_a = filled_memory(&layout(), 64, 41, 64);
    let ea = worker(&a.socket, "prefill-a", &ns(), &mem_a, "http://prefill-a", "prefill").await;
    let mem_b = KvMemory::anonymous(&layout(), 64).unwrap();
    let eb = worker(&b.socket, "decode-b", &ns(), &mem_b, "http://decode-b", "decode").await;
    for e in [&ea, &eb] {
        e.report_load_and_prefill(0, 0, 0, 1000, 100_000, Duration::from_secs(1)).await.unwrap();
    }

    let tokens: Vec<u32> = (0..256).map(|i| (i * 7919 + 13) % 150_000).collect();
    let table = |rate_bytes: f64| {
        let gbit = rate_bytes * 8.0 / 1e9;
        let cfg = kvrouter::config::SplitConfig::default();
        kvrouter::split::decision_table(&cfg, BYTES_PER_TOKEN, 16, PREFILL_RATE, &[256], &[gbit])[0]
    };
    for (mbit, want_split) in [(1000u64, false), (10_000, true)] {
        pair.shape(mbit);
        // The link is the shaping, or less where this machine cannot fill it: a raw TCP copy
        // loop through the same veth, a second's worth at the shaped rate, says what it
        // carries.
        let shaped = mbit as f64 * 1e6 / 8.0;
        let raw = pair.raw_tcp_rate((shaped as usize).max(32 << 20));
        let rate = wait_rate_near(&b, &[shaped, raw]);
        // The router has the rate once B's next report arrives.
        let deadline = Instant::now() + Duration::from_secs(10);
        let s = loop {
            let r = route(&pair, &router_addr, &tokens);
            let s = r["split"].clone();
            if s["link_measured"] == true
                && ((s["link_gbytes_per_s"].as_f64().unwrap() * 1e9 - rate).abs() < 0.2 * rate)
            {
                break s;
            }
            assert!(Instant::now() < deadline, "the router has no measured link: {r}");
            std::thread::sleep(Duration::from_millis(200));
        };
        let model = table(s["link_gbytes_per_s"].as_f64().unwrap() * 1e9);
        assert_eq!(s["split"].as_bool().unwrap(), model.split, "router {s} against the model {model:?}");
        assert_eq!(model.split, want_split, "at {mbit} Mbit/s: {model:?}");
        assert!((s["handoff_ms"].as_f64().unwrap() - model.handoff_ms).abs() < 1e-6, "{s} / {model:?}");
        if want_split {
            assert_eq!(s["prefill_peer"], peer_a.as_str(), "{s}");
        }
    }

    // The handoff itself, across the link: A's engine prefills (saves), B's engine loads from
    // the peer the router named.
    let slots: Vec<u32> = (0..16).collect();
    assert_eq!(ea.save(&tokens, 0, &slots).await.unwrap().stored, 16);
    let done = eb.load_from(&tokens, 0, &slots, std::slice::from_ref(&peer_a)).await.unwrap();
    assert_eq!((done.loaded_blocks, done.from_peer), (16, 16), "{done:?}\n{}", b.log());
    check(&mem_b, 41, 16, 0);

    // Prefetch: a second prompt prefilled on A; the router places its decode on B and tells
    // B's daemon, which pulls it into G2 before B's engine asks.
    let tokens2: Vec<u32> = (0..512).map(|i| (i * 104_729 + 7) % 150_000).collect();
    let slots2: Vec<u32> = (16..48).collect();
    assert_eq!(ea.save(&tokens2, 0, &slots2).await.unwrap().stored, 32);
    // A's report of the 32 blocks may reach the router in more than one piece. A decode
    // placement made between them would hint only the part known then (and B would prefetch
    // that part), so wait until the router knows all 32, asking as a prefill placement (A's
    // own blocks: nothing to prefetch).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = route_as(&pair, &router_addr, &tokens2, "prefill");
        let known: u64 = r["cached_blocks"].as_array().map_or(0, |t| t.iter().filter_map(|n| n.as_u64()).sum());
        if known == 32 {
            break;
        }
        assert!(Instant::now() < deadline, "the router never learned A's 32 blocks: {r}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let hint = loop {
        // The router learns of A's blocks from A's next report.
        let r = route(&pair, &router_addr, &tokens2);
        if r["prefetch"]["pull_blocks"] == 32 {
            break r["prefetch"].clone();
        }
        assert!(Instant::now() < deadline, "no prefetch hint: {r}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(hint["sources"][0], peer_a.as_str(), "{hint}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while eb.lookup(&tokens2).await.unwrap().g2_blocks < 32 {
        assert!(Instant::now() < deadline, "the prefetch did not land on B\n{}", b.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let done = eb.load_now(&tokens2, 0, &(0..32).collect::<Vec<_>>()).await.unwrap();
    assert_eq!((done.loaded_blocks, done.from_g2), (32, 32), "{done:?}");
    // Blocks 16.. of A's memory, in B's slots 0..
    let len = layout().block_bytes() as usize;
    for i in 0..32 {
        assert_eq!(mem_b.read_block(i), synthetic_block(41, 16 + i, len));
    }
    drop((ea, eb));
    a.stop();
    b.stop();
}
