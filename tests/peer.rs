//! Daemons pulling blocks from each other (processes, loopback): the decode node loads what the
//! prefill node saved, byte for byte, and a router's prefetch brings it before the engine asks;
//! a peer sending wrong bytes, one that dies or stalls mid-transfer, and credentials refused
//! (a wrong token, another tenant's namespace, an expired certificate).
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvclient::{Client, KvMemory};
use kvproto::{Namespace, pb};
use kvtests::fake_peer::{Fake, fake_peer};
use kvtests::fixture::{attach, check, filled_memory};
use kvtests::fixture::{small_block_len as block_len, small_layout as layout};
use kvtests::proc::{DaemonProc, free_port, http_request};

fn ns() -> Namespace {
    kvtests::fixture::small_namespace("peer/model")
}

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    kvtests::fixture::prompt(seed.wrapping_mul(97), blocks)
}

/// A daemon of a single-user test node: its HTTP port (prefetch hints) open without
/// credentials.
fn daemon(dir: &Path, toml: &str) -> DaemonProc {
    DaemonProc::spawn(
        Path::new(env!("CARGO_BIN_EXE_daemon")),
        dir,
        &format!("127.0.0.1:{}", free_port()),
        &format!("[metrics_auth]\nopen = true\n{toml}"),
        None,
        &[],
    )
}

fn peer_listen() -> (String, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    (format!("[peer]\nlisten = \"{addr}\"\n[peer.auth]\nopen = true\n"), addr)
}

/// An engine with `slots` slots on `d`, the first `filled` holding synthetic KV of `seed`.
async fn engine(d: &DaemonProc, namespace: &Namespace, seed: u64, filled: u32, slots: u32) -> (Client, KvMemory) {
    let mem = filled_memory(&layout(), slots, seed, filled);
    (attach(&d.socket, namespace, &mem).await, mem)
}

/// Daemon B alone in a temporary directory (`toml` added to its configuration) and an empty
/// engine of `slots` slots on it: the decode side of a test whose prefill side is a fake peer.
async fn decode_side(toml: &str, slots: u32) -> (tempfile::TempDir, DaemonProc, Client, KvMemory) {
    let d = tempfile::tempdir().unwrap();
    let b = daemon(&d.path().join("b"), toml);
    let (eb, mb) = engine(&b, &ns(), 0, 0, slots).await;
    (d, b, eb, mb)
}

/// The engine leaves, then its daemon stops (cleanly: it must exit 0).
fn stop(d: DaemonProc, engine: Client) {
    drop(engine);
    d.stop();
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_node_pulls_what_the_prefill_node_saved_and_prefetch_brings_it_early() {
    let d = tempfile::tempdir().unwrap();
    let (listen, a_peer) = peer_listen();
    let a = daemon(&d.path().join("a"), &listen);
    let b = daemon(&d.path().join("b"), "");
    let (ea, _ma) = engine(&a, &ns(), 11, 64, 128).await;
    let tokens = prompt(11, 64);
    let slots: Vec<u32> = (0..64).collect();
    assert_eq!(ea.save(&tokens, 0, &slots).await.unwrap().stored, 64);

    let (eb, mb) = engine(&b, &ns(), 0, 0, 128).await;
    assert_eq!(eb.lookup(&tokens).await.unwrap().matched_blocks, 0, "B holds nothing of it");
    let done = eb.load_from(&tokens, 0, &(64..128).collect::<Vec<_>>(), std::slice::from_ref(&a_peer)).await.unwrap();
    assert_eq!((done.loaded_blocks, done.from_peer), (64, 64), "{done:?}\n{}", b.log());
    check(&mb, 11, 64, 64);
    // In B's G2 now: the next load needs no peer.
    let again = eb.load_now(&tokens, 0, &slots).await.unwrap();
    assert_eq!((again.loaded_blocks, again.from_g2), (64, 64), "{again:?}");
    assert!(b.metric("kvcached_peer_pulled_blocks_total") >= 64.0);
    assert!(a.metric("kvcached_peer_served_blocks_total") >= 64.0);

    // A router's hint: B brings a second prompt into G2 before its engine asks.
    let (ea2, _m2) = engine(&a, &ns(), 12, 32, 32).await;
    let tokens2 = prompt(12, 32);
    assert_eq!(ea2.save(&tokens2, 0, &(0..32).collect::<Vec<_>>()).await.unwrap().stored, 32);
    let keys: Vec<String> = ns().block_keys(&tokens2).iter().map(|k| hex(&k.0)).collect();
    let body = serde_json::json!({"namespace": hex(&ns().id().0), "keys": keys, "sources": [a_peer]}).to_string();
    let (status, answer) = http_request(&b.http, "POST", "/prefetch", Some(&body), &[]);
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains("\"pulling\":32"), "{answer}");
    let t0 = Instant::now();
    loop {
        let hit = eb.lookup(&tokens2).await.unwrap();
        if hit.g2_blocks == 32 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "prefetch did not land: {hit:?}\n{}", b.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let done = eb.load_now(&tokens2, 0, &(0..32).collect::<Vec<_>>()).await.unwrap();
    assert_eq!((done.loaded_blocks, done.from_g2), (32, 32));
    check(&mb, 12, 32, 0);
    // Malformed hints are refused, not guessed at.
    let (status, _) = http_request(&b.http, "POST", "/prefetch", Some("{\"namespace\":\"zz\",\"keys\":[]}"), &[]);
    assert_eq!(status, 400);
    drop((ea, ea2, eb));
    a.stop();
    b.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_sending_wrong_bytes_is_a_counted_miss_and_not_asked_again() {
    let (bad, conns) = fake_peer(Fake::WrongChecksum, 21, block_len());
    let (_d, b, eb, mb) = decode_side("", 16).await;
    let tokens = prompt(21, 16);
    let done = eb.load_from(&tokens, 0, &(0..16).collect::<Vec<_>>(), std::slice::from_ref(&bad)).await.unwrap();
    assert_eq!(done.loaded_blocks, 0, "{done:?}");
    assert!(mb.read_block(0).iter().all(|&x| x == 0), "nothing was written into the engine");
    assert!(b.metric("kvcached_peer_corrupt_blocks_total") >= 1.0);
    assert!(b.log().contains("failed its checksum"), "{}", b.log());
    assert_eq!(eb.lookup(&tokens).await.unwrap().matched_blocks, 0, "no wrong block became visible");
    // Marked bad: the next load does not ask it.
    let before = conns.load(Ordering::SeqCst);
    let again = eb.load_from(&tokens, 0, &(0..16).collect::<Vec<_>>(), std::slice::from_ref(&bad)).await.unwrap();
    assert_eq!(again.loaded_blocks, 0);
    assert_eq!(conns.load(Ordering::SeqCst), before, "a peer marked bad was asked again");
    stop(b, eb);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_dying_or_stalling_mid_transfer_leaves_the_intact_prefix() {
    let (dies, _) = fake_peer(Fake::DiesAfter(10), 21, block_len());
    let (_d, b, eb, mb) = decode_side("[peer]\npull_deadline_ms = 1500\nio_timeout_ms = 1000\n", 32).await;
    let tokens = prompt(21, 32);
    let slots: Vec<u32> = (0..32).collect();
    let done = eb.load_from(&tokens, 0, &slots, &[dies]).await.unwrap();
    assert_eq!((done.loaded_blocks, done.from_peer), (10, 10), "{done:?}");
    check(&mb, 21, 10, 0);

    // A stalled peer costs at most the deadline; what arrived before is kept (another prompt:
    // the first one's ten blocks are in G2 now).
    let tokens = prompt(22, 32);
    let (stalls, _) = fake_peer(Fake::StallsAfter(12), 21, block_len());
    let t0 = Instant::now();
    let done = eb.load_from(&tokens, 0, &slots, &[stalls]).await.unwrap();
    let took = t0.elapsed();
    assert_eq!(done.loaded_blocks, 12, "{done:?}");
    assert!(took < Duration::from_secs(5), "a stalled peer held the load {took:?}");
    check(&mb, 21, 12, 0);
    stop(b, eb);
}

/// The decode engine uses the first blocks while later ones are still on the wire: a load
/// from a peer that sends 12 blocks and then stalls reports those 12 in the engine's slots
/// (byte-exact) while it is still PENDING, and ends with them once the peer is given up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_uses_the_first_blocks_while_later_ones_are_in_flight() {
    let (_d, b, eb, mb) = decode_side("[peer]\npull_deadline_ms = 8000\nio_timeout_ms = 6000\n", 32).await;
    let tokens = prompt(23, 32);
    let slots: Vec<u32> = (0..32).collect();
    let (stalls, _) = fake_peer(Fake::StallsAfter(12), 23, block_len());
    let op = eb.load_op(&tokens, 0, &slots, &[stalls]).await.unwrap();
    let early = eb.wait_for_blocks(&op, 12, Duration::from_secs(30)).await.unwrap();
    assert_eq!(
        early.state,
        pb::load_status::State::Pending as i32,
        "the load ended before the peer stalled: {early:?}"
    );
    assert_eq!((early.loaded_blocks, early.from_peer), (12, 12), "{early:?}");
    check(&mb, 23, 12, 0);
    let more = eb.wait_for_blocks(&op, 13, Duration::from_millis(200)).await.unwrap();
    assert_eq!((more.state, more.loaded_blocks), (early.state, 12), "nothing past the stall: {more:?}");
    let done = eb.wait(&op, Duration::from_secs(30)).await.unwrap();
    assert_eq!((done.state, done.loaded_blocks, done.from_peer), (pb::load_status::State::Done as i32, 12, 12));
    stop(b, eb);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_decide_who_pulls_which_namespace() {
    let d = tempfile::tempdir().unwrap();
    let pki = kvnet::testing::Ca::new(d.path(), "ca");
    let server = pki.valid("a", &["localhost", "127.0.0.1"]);
    let good = pki.valid("b", &["decode-b.kvcached"]);
    let expired = pki.expired("old", &["decode-b.kvcached"]);
    let tokens_file = d.path().join("tokens");
    std::fs::write(&tokens_file, "tenant-a aaaaaaaaaaaaaaaaaaaaaaaa\n").unwrap();
    let other = Namespace { tenant_salt: Some(b"tenant-b".to_vec()), ..ns() };
    let addr = format!("127.0.0.1:{}", free_port());
    let a = daemon(
        &d.path().join("a"),
        &format!(
            "[peer]\nlisten = \"{addr}\"\n[peer.auth]\ntls_cert = \"{}\"\ntls_key = \"{}\"\ntls_client_ca = \"{}\"\n\
             tokens_file = \"{}\"\n[[peer.auth.grants]]\nidentity = \"tenant-a\"\nnamespaces = [\"{}\"]\n\
             [[peer.auth.grants]]\nidentity = \"decode-b.kvcached\"\nnamespaces = [\"*\"]\n",
            server.cert.display(),
            server.key.display(),
            pki.cert.display(),
            tokens_file.display(),
            hex(&ns().id().0),
        ),
    );
    let tokens = prompt(31, 8);
    let slots: Vec<u32> = (0..8).collect();
    for n in [ns(), other.clone()] {
        let (e, _m) = engine(&a, &n, 31, 8, 8).await;
        assert_eq!(e.save(&tokens, 0, &slots).await.unwrap().stored, 8);
        e.unregister().await.unwrap();
    }
    let ca = pki.cert.display().to_string();
    let token = d.path().join("token");
    std::fs::write(&token, "aaaaaaaaaaaaaaaaaaaaaaaa\n").unwrap();
    let wrong = d.path().join("wrong");
    std::fs::write(&wrong, "bbbbbbbbbbbbbbbbbbbbbbbb\n").unwrap();
    let client = |extra: String| format!("[peer.client]\ntls_ca = \"{ca}\"\n{extra}");
    // (case, client section, namespace, blocks expected)
    let cases = [
        ("no credentials", client(String::new()), ns(), 0),
        ("wrong token", client(format!("token_file = \"{}\"\n", wrong.display())), ns(), 0),
        ("tenant-a's token, its namespace", client(format!("token_file = \"{}\"\n", token.display())), ns(), 8),
        (
            "tenant-a's token, tenant-b's namespace",
            client(format!("token_file = \"{}\"\n", token.display())),
            other.clone(),
            0,
        ),
        (
            "a valid certificate",
            client(format!("tls_cert = \"{}\"\ntls_key = \"{}\"\n", good.cert.display(), good.key.display())),
            other.clone(),
            8,
        ),
        (
            "an expired certificate",
            client(format!("tls_cert = \"{}\"\ntls_key = \"{}\"\n", expired.cert.display(), expired.key.display())),
            ns(),
            0,
        ),
    ];
    for (i, (case, section, namespace, want)) in cases.into_iter().enumerate() {
        let b = daemon(&d.path().join(format!("b{i}")), &section);
        let (eb, mb) = engine(&b, &namespace, 0, 0, 8).await;
        let done = eb.load_from(&tokens, 0, &slots, std::slice::from_ref(&addr)).await.unwrap();
        assert_eq!(done.loaded_blocks, want, "{case}: {done:?}\n{}", b.log());
        if want > 0 {
            check(&mb, 31, want, 0);
        } else {
            assert!(b.log().contains("peer failed"), "{case}: the refusal is not in the log\n{}", b.log());
        }
        drop(eb);
        b.stop();
    }
    a.stop();
}
