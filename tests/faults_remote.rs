//! Faults beyond the node, under a running `kvcached` process: the S3 server holding G4 down
//! (killed), hung (SIGSTOP: connections accepted, never answered) and slow (latency injected
//! into G4's requests through `inject_faults`), against a real S3-compatible server (SeaweedFS,
//! `kvtests::s3`: `scripts/test` installs it; without it these tests fail and say so, as
//! `g4.rs` does); and a peer that stalls mid-stream. For each: engines keep being served from G2
//! with bounded latency, the fault is counted in the metrics and named by `/healthz`, and every
//! block served is byte for byte what was saved.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use kvtests::fake_peer::{Fake, fake_peer};
use kvtests::node::Node;
use kvtests::oracle::{Engine, block_len, ns, prompt};
use kvtests::s3::{ACCESS_KEY, SECRET_KEY, SeaweedFs};

const G4_WRITTEN: &str = "kvcached_writethrough_blocks_total{tier=\"g4\"}";
const G4_WRITE_ERRORS: &str = "kvcached_writethrough_errors_total{tier=\"g4\"}";
const G4_READ_ERRORS: &str = "kvcached_tier_read_errors_total{tier=\"g4\"}";
/// Bound on a call that must not wait on the failing store (generous: the machine is shared).
const BOUNDED: Duration = Duration::from_secs(5);
/// G4's own bounds in these daemons: one request, and its retries.
const REQUEST_TIMEOUT_MS: u64 = 1000;
const RETRY_DEADLINE_MS: u64 = 2000;
/// A call that waits on G4 waits at most its retry deadline and one more request, plus slack.
const G4_BOUND: Duration = Duration::from_millis(RETRY_DEADLINE_MS + REQUEST_TIMEOUT_MS + 5000);
const WAIT: Duration = Duration::from_secs(30);

/// A daemon with G2 and G4 on `s3://kvtest/<prefix>`, no G3.
fn node(dir: &Path, s3: &SeaweedFs, prefix: &str) -> Node {
    let toml = format!(
        "[g2]\npage_size = 8192\n[g4]\nenabled = true\nurl = \"s3://{}/{prefix}\"\nendpoint = \"{}\"\nallow_http = true\n\
         request_timeout_ms = {REQUEST_TIMEOUT_MS}\nretry_deadline_ms = {RETRY_DEADLINE_MS}\n",
        kvtests::s3::BUCKET,
        s3.endpoint
    );
    let env = [("AWS_ACCESS_KEY_ID", ACCESS_KEY), ("AWS_SECRET_ACCESS_KEY", SECRET_KEY)];
    Node::start(Path::new(env!("CARGO_BIN_EXE_daemon")), dir, &toml, &env)
}

/// A daemon whose G4 holds prompt 1 (16 blocks) and whose G2 holds prompt 2 (16 blocks) only:
/// restarted after prompt 1 reached the bucket, so G2 starts empty.
async fn with_g4_and_g2(n: &mut Node, e: &mut Engine) {
    e.save_within(1, 16, BOUNDED).await;
    n.d().wait_metric(G4_WRITTEN, 16.0, WAIT);
    n.restart();
    e.save_within(2, 16, BOUNDED).await;
    n.d().wait_metric(G4_WRITTEN, 16.0, WAIT);
    let (loaded, st, _) = e.load_timed(1, 16).await;
    assert_eq!((loaded, st.from_g4), (16, 16), "{st:?}");
    // Restarted again: prompt 1 is in G4 only, prompt 2 is saved anew into G2 (and G4 has it).
    n.restart();
    e.save_within(2, 16, BOUNDED).await;
}

/// A fresh S3 server (under a temporary directory, returned first), a daemon on it (G4 prefix
/// `name`) and its engine `engine` in namespace `remote/<name>`, brought to [`with_g4_and_g2`].
async fn s3_node_engine(name: &str, engine: &str) -> (tempfile::TempDir, SeaweedFs, Node, Engine) {
    let d = tempfile::tempdir().unwrap();
    let s3 = SeaweedFs::start(&d.path().join("s3"));
    let mut n = node(&d.path().join("node"), &s3, name);
    let mut e = Engine::attach(&n.socket(), engine, &ns(&format!("remote/{name}")), 128).await.unwrap();
    with_g4_and_g2(&mut n, &mut e).await;
    (d, s3, n, e)
}

/// Loads prompt 1 (16 blocks) until all of it is served again (within [`WAIT`]): its status.
async fn served_again(n: &Node, e: &mut Engine) -> kvproto::pb::LoadStatus {
    let deadline = Instant::now() + WAIT;
    loop {
        let (loaded, st, _) = e.load_timed(1, 16).await;
        if loaded == 16 {
            return st;
        }
        assert!(Instant::now() < deadline, "G4 did not serve again: {st:?}\n{}", n.d().log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The S3 server is killed: saves and G2 loads go on at once; a load reaching blocks only G4
/// holds serves what G2 has and ends at the first of them within G4's retry deadline; the failed writes are counted and `/healthz` warns of G4 (still ready: G4 is shared, not this node's);
/// restarted, the server serves again what it held, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_server_that_is_down() {
    let (_d, mut s3, n, mut e) = s3_node_engine("down", "e").await;
    // Prompt 1's first 4 blocks come up into G2; the other 12 stay in G4 only.
    let (loaded, st, _) = e.load_timed(1, 4).await;
    assert_eq!((loaded, st.from_g4), (4, 4), "{st:?}");

    s3.kill();
    e.save_within(3, 16, BOUNDED).await;
    n.d().wait_metric(G4_WRITE_ERRORS, 1.0, WAIT);
    let why = n.wait_warning(&["G4 degraded"], WAIT);
    for seed in [2, 3] {
        let (loaded, st, took) = e.load_timed(seed, 16).await;
        assert_eq!((loaded, st.from_g2), (16, 16), "{st:?}");
        assert!(took < BOUNDED, "a G2 load took {took:?} with G4 down");
    }
    // The blocks G2 holds are served; the first one only G4 holds is a miss: the load ends
    // there (it does not fail).
    let (loaded, st, took) = e.load_timed(1, 16).await;
    assert_eq!((loaded, st.from_g2), (4, 4), "{st:?}");
    assert!(took < G4_BOUND, "a load waited {took:?} on a dead G4 ({why})");
    assert!(n.d().metric(G4_READ_ERRORS) >= 1.0, "{}", n.d().log());
    assert!(n.d().log().contains("served as misses"), "{}", n.d().log());

    s3.restart();
    let st = served_again(&n, &mut e).await;
    assert_eq!((st.from_g2, st.from_g4), (4, 12), "{st:?}");
    drop(e);
    n.stop();
}

/// The S3 server hangs (SIGSTOP): G2 loads, saves and lookups of what G2 holds do not wait on
/// it; a load of blocks only G4 holds gives up within G4's request timeout and retry deadline
/// and serves nothing wrong; the timeouts are counted and `/healthz` names G4; resumed, G4
/// serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_server_that_hangs() {
    let (_d, s3, n, mut e) = s3_node_engine("hung", "e").await;

    s3.pause();
    let t0 = Instant::now();
    e.save_within(3, 16, BOUNDED).await;
    let hit = e.client.lookup(&prompt(2, 16)).await.unwrap();
    assert_eq!((hit.matched_blocks, hit.g2_blocks), (16, 16), "{hit:?}");
    for seed in [2, 3] {
        let (loaded, st, _) = e.load_timed(seed, 16).await;
        assert_eq!((loaded, st.from_g2), (16, 16), "{st:?}");
    }
    assert!(t0.elapsed() < BOUNDED, "G2 work waited {:?} on a hung G4", t0.elapsed());
    let (loaded, st, took) = e.load_timed(1, 16).await;
    assert_eq!(loaded, 0, "{st:?}");
    assert!(took < G4_BOUND, "a load waited {took:?} on a hung G4");
    assert!(n.d().metric(G4_READ_ERRORS) >= 1.0, "{}", n.d().log());
    n.d().wait_metric(G4_WRITE_ERRORS, 1.0, WAIT);
    n.wait_warning(&["G4 degraded"], WAIT);

    s3.resume();
    served_again(&n, &mut e).await;
    drop(e);
    n.stop();
}

/// A slow S3 server (800 ms added to every G4 request, injected): a load from G4 waits for it
/// and is right; a G2 load made meanwhile by another engine finishes first; the slowness shows
/// in G4's request durations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_s3_server() {
    let (_d, _s3, n, mut a) = s3_node_engine("slow", "a").await;
    let mut b = Engine::attach(&n.socket(), "b", &ns("remote/slow"), 128).await.unwrap();
    n.set_faults("[g4]\nlatency_ms = 800\n");

    let slow = tokio::spawn(async move {
        let r = a.load_timed(1, 16).await;
        (a, r, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (loaded, st, took) = b.load_timed(2, 16).await;
    let g2_done = Instant::now();
    assert_eq!((loaded, st.from_g2), (16, 16), "{st:?}");
    assert!(took < BOUNDED, "{took:?}");
    let (a, (loaded, st, took), g4_done) = slow.await.unwrap();
    assert_eq!((loaded, st.from_g4), (16, 16), "{st:?}");
    assert!(took >= Duration::from_millis(800), "the injected latency did not apply: {took:?}");
    assert!(took < G4_BOUND, "{took:?}");
    assert!(g2_done < g4_done, "the G2 load waited for the slow G4 load");
    let (_, metrics) = n.d().get("/metrics");
    let slow_ops = metrics
        .lines()
        .filter(|l| l.starts_with("kvcached_tier_op_duration_seconds_sum") && l.contains("g4"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    assert!(slow_ops >= 0.8, "G4's op durations do not show the slow store: {slow_ops}");
    n.set_faults("");
    drop((a, b));
    n.stop();
}

/// A peer that stalls mid-stream: the load keeps the blocks that arrived (right), gives up within
/// the pull deadline, the peer is counted as failed, named by `/healthz` and not asked again;
/// G2 keeps serving meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stalls_mid_stream() {
    let d = tempfile::tempdir().unwrap();
    let n = Node::start(
        Path::new(env!("CARGO_BIN_EXE_daemon")),
        d.path(),
        "[g2]\npage_size = 8192\n[peer]\npull_deadline_ms = 1500\nio_timeout_ms = 1000\n",
        &[],
    );
    let mut e = Engine::attach(&n.socket(), "e", &ns("remote/peer"), 128).await.unwrap();
    e.save_within(5, 16, BOUNDED).await;
    // The fake peer sends blocks of prompt 7 (the oracle's KV for seed 7), then stalls.
    let (stalls, conns) = fake_peer(Fake::StallsAfter(12), 7, block_len());
    let slots: Vec<u32> = (64..96).collect();
    for s in &slots {
        e.mem.write_block(*s, &vec![0xA5; block_len()]);
    }
    let t0 = Instant::now();
    let done = e.client.load_from(&prompt(7, 32), 0, &slots, std::slice::from_ref(&stalls)).await.unwrap();
    let took = t0.elapsed();
    assert_eq!((done.loaded_blocks, done.from_peer), (12, 12), "{done:?}");
    let c = e.check(7, done.loaded_blocks, 64);
    assert_eq!(c.wrong, 0, "wrong bytes from the peer: {done:?}");
    assert!(took < BOUNDED, "a stalled peer held the load {took:?}");
    // Meanwhile and after, G2 serves at once.
    let (loaded, st, took) = e.load_timed(5, 16).await;
    assert_eq!((loaded, st.from_g2), (16, 16), "{st:?}");
    assert!(took < BOUNDED, "{took:?}");

    assert!(n.d().metric("kvcached_peer_failures_total") >= 1.0);
    let why = n.wait_warning(&["peer", &stalls, "not asked for now"], WAIT);
    assert!(n.d().log().contains("peer failed"), "{}", n.d().log());
    // Marked bad: the next load does not connect to it; the 12 blocks that arrived are in G2.
    let before = conns.load(std::sync::atomic::Ordering::SeqCst);
    let again = e.client.load_from(&prompt(7, 32), 0, &slots, std::slice::from_ref(&stalls)).await.unwrap();
    assert_eq!((again.loaded_blocks, again.from_g2), (12, 12), "{again:?} ({why})");
    assert_eq!(e.check(7, 12, 64).wrong, 0);
    assert_eq!(conns.load(std::sync::atomic::Ordering::SeqCst), before, "a peer marked bad was asked again");
    drop(e);
    n.stop();
}
