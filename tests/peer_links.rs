//! What an operator meets in a cluster's first hour, across real processes: a peer link that
//! sat idle past the serving side's timeout, and a serving daemon restarted (SIGTERM, kill -9),
//! still hand every block over; a dead peer leaves the other node ready (a warning on
//! `/healthz`, not a 503); a token taken out of `tokens_file` cuts its open connections off.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use kvclient::{Client, KvMemory, synthetic_block};
use kvproto::Namespace;
use kvtests::fixture::{small_block_len as block_len, small_layout as layout};
use kvtests::node::Node;
use kvtests::proc::free_port;

fn ns() -> Namespace {
    kvtests::fixture::small_namespace("links/model")
}

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    kvtests::fixture::prompt(seed.wrapping_mul(131), blocks)
}

const BLOCKS: u32 = 16;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_daemon"))
}

/// Saves prompt `seed` (BLOCKS blocks) on `node` from an engine that leaves afterwards.
async fn save_on(node: &Node, seed: u32) {
    let mut mem = KvMemory::anonymous(&layout(), BLOCKS).unwrap();
    for b in 0..BLOCKS {
        mem.write_block(b, &synthetic_block(u64::from(seed), b, block_len()));
    }
    let c = Client::connect(node.socket()).await.unwrap();
    c.register("prefill", &ns(), &mem).await.unwrap();
    let r = c.save(&prompt(seed, BLOCKS), 0, &(0..BLOCKS).collect::<Vec<_>>()).await.unwrap();
    assert_eq!(r.stored, BLOCKS, "{r:?}");
    c.unregister().await.unwrap();
}

/// Loads prompt `seed` on `node`, pulling from `peer`: (blocks loaded, blocks from the peer),
/// every loaded byte checked.
async fn pull_on(node: &Node, seed: u32, peer: &str) -> (u32, u32) {
    let mem = KvMemory::anonymous(&layout(), BLOCKS).unwrap();
    let c = Client::connect(node.socket()).await.unwrap();
    c.register("decode", &ns(), &mem).await.unwrap();
    let done =
        c.load_from(&prompt(seed, BLOCKS), 0, &(0..BLOCKS).collect::<Vec<_>>(), &[peer.to_string()]).await.unwrap();
    for b in 0..done.loaded_blocks {
        assert_eq!(mem.read_block(b), synthetic_block(u64::from(seed), b, block_len()), "block {b} differs");
    }
    c.unregister().await.unwrap();
    (done.loaded_blocks, done.from_peer)
}

/// Saves prompt `seed` on A and asserts that B, pulling from A at `addr`, loads every block of
/// it from there (`when`: what the failure message says happened before).
async fn hand_off(a: &Node, b: &Node, addr: &str, seed: u32, when: &str) {
    save_on(a, seed).await;
    assert_eq!(pull_on(b, seed, addr).await, (BLOCKS, BLOCKS), "{when}\nA: {}\nB: {}", a.d().log(), b.d().log());
}

/// Both nodes stop (cleanly: each must exit 0).
fn stop(a: Node, b: Node) {
    a.stop();
    b.stop();
}

/// A prefill node A serving peers on a free port (extra `[peer]` lines in `peer_extra`) and a
/// decode node B that lists it: the nodes and A's peer address.
fn pair(dir: &Path, peer_extra: &str, auth: &str, client: &str) -> (Node, Node, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let a = Node::start(
        bin(),
        &dir.join("a"),
        &format!("[metrics_auth]\nopen = true\n[peer]\nlisten = \"{addr}\"\n{peer_extra}\n{auth}"),
        &[],
    );
    let b = Node::start(
        bin(),
        &dir.join("b"),
        &format!("[metrics_auth]\nopen = true\n[peer]\npeers = [\"{addr}\"]\nprobe_idle_s = 0\n{client}"),
        &[],
    );
    (a, b, addr)
}

const OPEN: &str = "[peer.auth]\nopen = true\n";

/// The serving side closes a connection idle past `peer.idle_timeout_ms` (1 s here, 60 s by
/// default); the puller's kept connection is then closed under it, and the next hand-off still
/// gets every block from the peer, with no failure counted and nothing on `/healthz`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_after_the_link_idled_past_the_serving_sides_timeout_gets_every_block() {
    let d = tempfile::tempdir().unwrap();
    let (a, b, addr) = pair(d.path(), "idle_timeout_ms = 1000", OPEN, "");
    hand_off(&a, &b, &addr, 1, "").await;
    // Idle three times the serving side's timeout: it has closed the kept connection.
    tokio::time::sleep(Duration::from_secs(3)).await;
    hand_off(&a, &b, &addr, 2, "").await;
    assert_eq!(b.d().metric("kvcached_peer_failures_total"), 0.0, "{}", b.d().log());
    assert_eq!(b.healthz(), (200, "ok\n".to_string()));
    stop(a, b);
}

/// The prefill daemon restarts, cleanly (SIGTERM) and not (kill -9): the decode node's kept
/// connections died with it, and the next hand-off reconnects at once and gets every block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_after_the_serving_daemon_restarts_gets_every_block() {
    let d = tempfile::tempdir().unwrap();
    let (mut a, b, addr) = pair(d.path(), "", OPEN, "");
    hand_off(&a, &b, &addr, 1, "").await;
    a.restart();
    hand_off(&a, &b, &addr, 2, "after SIGTERM").await;
    a.kill9();
    a.start_again();
    hand_off(&a, &b, &addr, 3, "after kill -9").await;
    assert_eq!(b.d().metric("kvcached_peer_failures_total"), 0.0, "{}", b.d().log());
    stop(a, b);
}

/// A dead peer is the neighbour's trouble: the node that pulls from it stays ready (200), names
/// it in a `warning:` line and in `kvcached_degraded_neighbours{kind="peer"}`, keeps
/// `kvcached_ready` at 1, and pulls from it again once it is back (a first failure bars it for
/// a second, not 30).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_peer_leaves_the_other_node_ready_and_is_named() {
    let d = tempfile::tempdir().unwrap();
    let (mut a, b, addr) = pair(d.path(), "", OPEN, "");
    save_on(&a, 1).await;
    a.halt();
    // Each pull that finds the peer down bars it (1 s, then 2, 4, ...): seen barred within a
    // few rounds however slow this machine is, and never unready meanwhile.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (loaded, _) = pull_on(&b, 1, &addr).await;
        assert_eq!(loaded, 0, "nothing to load: the only holder is down");
        let (status, body) = b.healthz();
        assert_eq!(status, 200, "a dead peer made this node unready: {body}");
        let (ready, named) =
            (b.d().metric("kvcached_ready"), b.d().metric("kvcached_degraded_neighbours{kind=\"peer\"}"));
        assert_eq!(ready, 1.0, "{body}");
        let warned = body
            .lines()
            .any(|l| l.starts_with("warning: peer ") && l.contains(&addr) && l.contains("not asked for now"));
        if warned && named == 1.0 {
            assert!(body.starts_with("ok\n"), "{body}");
            break;
        }
        assert!(Instant::now() < deadline, "the dead peer was never named: {body}\n{}", b.d().log());
    }
    a.start_again();
    save_on(&a, 2).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if pull_on(&b, 2, &addr).await == (BLOCKS, BLOCKS) {
            break;
        }
        assert!(Instant::now() < deadline, "the peer was not asked again once back\n{}", b.d().log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(b.healthz(), (200, "ok\n".to_string()), "a success clears the peer's bar");
    assert_eq!(b.d().metric("kvcached_degraded_neighbours{kind=\"peer\"}"), 0.0);
    stop(a, b);
}

/// A token taken out of `tokens_file` cuts off the connections it opened: the serving side
/// closes them within about a second (`kvcached_peer_refused_total{why="revoked"}`), and the
/// puller's next pull is refused; put back, it pulls again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_removed_from_tokens_file_is_cut_off_open_connections_included() {
    let d = tempfile::tempdir().unwrap();
    let tokens = d.path().join("tokens");
    let b_line = "decode-b bbbbbbbbbbbbbbbbbbbbbbbbbbbb\n";
    std::fs::write(&tokens, format!("other oooooooooooooooooooooooo\n{b_line}")).unwrap();
    let token = d.path().join("token");
    std::fs::write(&token, "bbbbbbbbbbbbbbbbbbbbbbbbbbbb\n").unwrap();
    let (a, b, addr) = pair(
        d.path(),
        "",
        &format!("[peer.auth]\ntokens_file = \"{}\"\n", tokens.display()),
        &format!("[peer.client]\ntoken_file = \"{}\"\n", token.display()),
    );
    hand_off(&a, &b, &addr, 1, "").await;
    // B keeps that connection open; its token goes.
    std::fs::write(&tokens, "other oooooooooooooooooooooooo\n").unwrap();
    let t0 = Instant::now();
    a.d().wait_metric("kvcached_peer_refused_total{why=\"revoked\"}", 1.0, Duration::from_secs(10));
    let took = t0.elapsed();
    save_on(&a, 2).await;
    assert_eq!(pull_on(&b, 2, &addr).await, (0, 0), "a revoked token pulled\n{}", a.d().log());
    assert!(a.d().metric("kvcached_peer_refused_total{why=\"credentials\"}") >= 1.0, "{}", a.d().log());
    println!("open connection closed {} ms after the token left the file", took.as_millis());
    // Back in the file: B pulls again once its bar (a second after a first failure) is over.
    std::fs::write(&tokens, format!("other oooooooooooooooooooooooo\n{b_line}")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pull_on(&b, 2, &addr).await != (BLOCKS, BLOCKS) {
        assert!(Instant::now() < deadline, "the restored token does not pull\n{}", a.d().log());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    stop(a, b);
}

/// A router that does not answer is a neighbour's trouble too: `/healthz` stays 200 and names
/// it, `kvcached_degraded_neighbours{kind="router"}` counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_that_is_down_is_a_warning_not_unreadiness() {
    let d = tempfile::tempdir().unwrap();
    let router = format!("http://127.0.0.1:{}", free_port());
    let n = Node::start(
        bin(),
        &d.path().join("n"),
        &format!("[metrics_auth]\nopen = true\n[router]\nurls = [\"{router}\"]\nreport_interval_ms = 100\n"),
        &[],
    );
    let body = n.wait_warning(&["router", &router, "not taking this node's reports"], Duration::from_secs(20));
    assert!(body.starts_with("ok\n"), "{body}");
    assert_eq!(n.d().metric("kvcached_ready"), 1.0);
    assert_eq!(n.d().metric("kvcached_degraded_neighbours{kind=\"router\"}"), 1.0);
    n.stop();
}

/// Every series `docs/operations/metrics.md` lists with a fixed set of labels is on `/metrics`
/// from the start, before any traffic (dashboards and alerts see 0, not nothing). Series keyed
/// by what comes later (a KV namespace, a peer, a tenant, a gRPC method), histograms (they
/// appear with their first sample) and the vLLM export's (off here) are not asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_fixed_series_is_exported_from_start() {
    let d = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let g3 = d.path().join("g3");
    let n = Node::start(
        bin(),
        &d.path().join("n"),
        &format!(
            "[metrics_auth]\nopen = true\n[g2]\npage_size = 65536\n[g3]\nenabled = true\ndir = \"{}\"\ncapacity_bytes = 67108864\n[peer]\nlisten = \"{addr}\"\n{OPEN}",
            g3.display()
        ),
        &[],
    );
    let metrics =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations/metrics.md")).unwrap();
    let (_, text) = n.d().get("/metrics");
    let exported: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    let mut asked = 0;
    let mut missing = Vec::new();
    for row in metrics.lines().filter(|l| l.starts_with("| `kvcached_")) {
        let cols: Vec<&str> = row.split('|').map(str::trim).collect();
        let (names, kind, labels) = (cols[1], cols[2], cols[3]);
        let later =
            ["`kv_namespace`", "`rpc`", "`tenant`", "`model`"].iter().any(|l| labels.contains(l)) || labels == "`peer`";
        if kind == "histogram" || later || names.contains("vllm_export") || names.starts_with("`kvcached_g4") {
            continue;
        }
        for name in names.split(',').map(|s| s.trim().trim_matches('`')) {
            asked += 1;
            if !exported.iter().any(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{'])) {
                missing.push(name.to_string());
            }
        }
    }
    assert!(asked >= 30, "only {asked} series read from the docs: has docs/operations/metrics.md moved?");
    assert!(missing.is_empty(), "documented but not exported at start: {missing:?}\n{text}");
    n.stop();
}

/// A client certificate whose CA leaves `tls_client_ca` is cut off the same way: the open
/// connection it authenticated is closed (`why="revoked"`), and the next pull is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_whose_ca_left_tls_client_ca_is_cut_off() {
    let d = tempfile::tempdir().unwrap();
    let pki = kvnet::testing::Ca::new(d.path(), "ca");
    let other = kvnet::testing::Ca::new(d.path(), "other-ca");
    let server = pki.valid("a", &["localhost", "127.0.0.1"]);
    let client = pki.valid("b", &["decode-b.kvcached"]);
    let client_ca = d.path().join("client-ca.pem");
    std::fs::copy(&pki.cert, &client_ca).unwrap();
    let (a, b, addr) = pair(
        d.path(),
        "",
        &format!(
            "[peer.auth]\ntls_cert = \"{}\"\ntls_key = \"{}\"\ntls_client_ca = \"{}\"\n",
            server.cert.display(),
            server.key.display(),
            client_ca.display()
        ),
        &format!(
            "[peer.client]\ntls_ca = \"{}\"\ntls_cert = \"{}\"\ntls_key = \"{}\"\n",
            pki.cert.display(),
            client.cert.display(),
            client.key.display()
        ),
    );
    hand_off(&a, &b, &addr, 1, "").await;
    // The operator trusts another CA now: B's certificate, and its open connection, are out.
    std::fs::copy(&other.cert, &client_ca).unwrap();
    a.d().wait_metric("kvcached_peer_refused_total{why=\"revoked\"}", 1.0, Duration::from_secs(10));
    save_on(&a, 2).await;
    assert_eq!(pull_on(&b, 2, &addr).await, (0, 0), "a revoked certificate pulled\n{}", a.d().log());
    stop(a, b);
}
