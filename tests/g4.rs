//! G4 against a real S3-compatible server (SeaweedFS, `kvtests::s3`), with `kvcached` daemons as
//! processes (each its own credentials, from its environment): daemons sharing a bucket, tenants
//! sharing it, wrong credentials and a missing bucket, the server killed mid-write and
//! restarted, corrupted objects, a daemon restarted with nothing but the bucket, and the
//! router crediting G4 on every node.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvclient::{Client, KvMemory};
use kvproto::{KvLayout, Namespace};
use kvtests::fixture::{attach, check, filled_memory, worker};
use kvtests::proc::free_port;
use kvtests::s3::{ACCESS_KEY, SECRET_KEY, SeaweedFs};
use object_store::ObjectStoreExt;

fn layout() -> KvLayout {
    kvtests::fixture::small_layout()
}

fn ns() -> Namespace {
    Namespace::new("g4/model", layout())
}

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    kvtests::fixture::prompt(seed, blocks)
}

/// A daemon process with G4 on `s3://kvtest/<prefix>`.
struct Daemon {
    child: Option<Child>,
    dir: PathBuf,
    socket: PathBuf,
    http: String,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

struct Setup<'a> {
    s3: &'a SeaweedFs,
    prefix: &'a str,
    secret: &'a str,
    bucket: &'a str,
    g3: bool,
    extra: &'a str,
    /// `[router]` lines (before `[g3]`).
    router: String,
}

impl<'a> Setup<'a> {
    fn new(s3: &'a SeaweedFs, prefix: &'a str) -> Self {
        Self {
            s3,
            prefix,
            secret: SECRET_KEY,
            bucket: kvtests::s3::BUCKET,
            g3: false,
            extra: "",
            router: String::new(),
        }
    }
}

fn spawn(dir: &Path, s: &Setup<'_>) -> Daemon {
    // The port `free_port` found can be taken by another process before the daemon binds it:
    // then another port.
    for _ in 0..5 {
        if let Some(d) = spawn_on(dir, s, free_port()) {
            return d;
        }
    }
    panic!("the daemon found its metrics port taken five times");
}

/// The daemon with its metrics on `port`; None when that port was taken meanwhile.
fn spawn_on(dir: &Path, s: &Setup<'_>, port: u16) -> Option<Daemon> {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = dir.join("kvcached.toml");
    std::fs::write(
        &cfg,
        format!(
            "metrics_addr = \"127.0.0.1:{port}\"\n[metrics_auth]\nopen = true\n{}[g3]\nenabled = {}\ndir = \"{}\"\ncapacity_bytes = 134217728\nfsync = false\n\
             [g4]\nenabled = true\nurl = \"s3://{}/{}\"\nendpoint = \"{}\"\nallow_http = true\nrequest_timeout_ms = 2000\n\
             retry_deadline_ms = 3000\n{}",
            s.router,
            s.g3,
            dir.join("g3").display(),
            s.bucket,
            s.prefix,
            s.s3.endpoint,
            s.extra
        ),
    )
    .unwrap();
    let socket = dir.join("kvcached.sock");
    let _ = std::fs::remove_file(&socket);
    let log = std::fs::File::create(dir.join("daemon.log")).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_daemon"))
        .args(["--config", cfg.to_str().unwrap(), "--socket", socket.to_str().unwrap()])
        .args(["--g2-capacity-bytes", "67108864", "--g2-shm-dir", dir.to_str().unwrap(), "--engine-lease-ms", "3000"])
        .args(["--peer-allowed-sources", "127.0.0.0/8"])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", s.secret)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap();
    let d = Daemon {
        child: Some(child),
        dir: dir.to_path_buf(),
        socket: socket.clone(),
        http: format!("http://127.0.0.1:{port}"),
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        let log = d.log();
        if log.contains("Address already in use") {
            return None;
        }
        assert!(Instant::now() < deadline, "daemon did not start: {log}");
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(d)
}

impl Daemon {
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }

    async fn healthz(&self) -> (u16, String) {
        let r = reqwest::get(format!("{}/healthz", self.http)).await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    async fn metric(&self, series: &str) -> f64 {
        let text = reqwest::get(format!("{}/metrics", self.http)).await.unwrap().text().await.unwrap();
        text.lines().filter(|l| l.starts_with(series)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
    }

    async fn wait_metric(&self, series: &str, at_least: f64, secs: u64) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let v = self.metric(series).await;
            if v >= at_least {
                return;
            }
            assert!(Instant::now() < deadline, "{series} = {v}, waited for {at_least}\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn stop(mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: plain kill(2) on our child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let status = c.wait().unwrap();
            assert!(status.success(), "daemon exited with {status}: {}", self.log());
        }
    }
}

/// An engine with 64 slots on `d`, the first `filled` holding synthetic KV of `seed`.
async fn engine(d: &Daemon, namespace: &Namespace, seed: u64, filled: u32) -> (Client, KvMemory) {
    let mem = filled_memory(&layout(), 64, seed, filled);
    (attach(&d.socket, namespace, &mem).await, mem)
}

const G4_WRITTEN: &str = "kvcached_writethrough_blocks_total{tier=\"g4\"}";

/// The engines leave, then each daemon stops (cleanly: each must exit 0).
fn stop_all<E>(engines: E, daemons: impl IntoIterator<Item = Daemon>) {
    drop(engines);
    for d in daemons {
        d.stop();
    }
}

/// A test's directory and an S3 server (SeaweedFS) in it.
fn bucket() -> (tempfile::TempDir, SeaweedFs) {
    let d = tempfile::tempdir().unwrap();
    let s3 = SeaweedFs::start(&d.path().join("s3"));
    (d, s3)
}

/// Daemon A in `dir/a` (`setup`) with an engine that has saved prompt `seed`'s `blocks` blocks
/// and seen them written through to G4 (its first save): the daemon, the engine, its memory,
/// the prompt.
async fn saved_to_g4(dir: &Path, setup: &Setup<'_>, seed: u32, blocks: u32) -> (Daemon, Client, KvMemory, Vec<u32>) {
    let a = spawn(&dir.join("a"), setup);
    let (ea, ma) = engine(&a, &ns(), u64::from(seed), blocks).await;
    let tokens = prompt(seed, blocks);
    assert_eq!(ea.save(&tokens, 0, &(0..blocks).collect::<Vec<_>>()).await.unwrap().stored, blocks);
    a.wait_metric(G4_WRITTEN, f64::from(blocks), 30).await;
    (a, ea, ma, tokens)
}

/// Daemon B, on another "node" with nothing of its own, finds and loads byte for byte what
/// daemon A saved; another tenant and another model sharing the bucket see none of it; a
/// restarted daemon with no G3 serves what the bucket holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemons_share_a_bucket_tenants_do_not_and_a_restart_keeps_it() {
    let (d, s3) = bucket();
    let (a, ea, _ma, tokens) = saved_to_g4(d.path(), &Setup::new(&s3, "shared"), 11, 32).await;

    let b = spawn(&d.path().join("b"), &Setup::new(&s3, "shared"));
    let (eb, mb) = engine(&b, &ns(), 0, 0).await;
    let hit = eb.lookup(&tokens).await.unwrap();
    assert_eq!((hit.matched_blocks, hit.g4_blocks), (32, 32), "{hit:?}");
    let done = eb.load_now(&tokens, 0, &(32..64).collect::<Vec<_>>()).await.unwrap();
    assert_eq!((done.loaded_blocks, done.from_g4), (32, 32), "{done:?}");
    check(&mb, 11, 32, 32);
    // Promoted: the next lookup finds them in G2.
    let again = eb.lookup(&tokens).await.unwrap();
    assert_eq!((again.matched_blocks, again.g2_blocks), (32, 32), "{again:?}");

    // Another tenant (its salt) and another model share the bucket and see nothing.
    for other in
        [Namespace { tenant_salt: Some(b"tenant-b".to_vec()), ..ns() }, Namespace::new("other/model", layout())]
    {
        let (eo, _mo) = engine(&b, &other, 0, 0).await;
        assert_eq!(eo.lookup(&tokens).await.unwrap().matched_blocks, 0);
        assert_eq!(eo.load_now(&tokens, 0, &[0, 1]).await.unwrap().loaded_blocks, 0);
        eo.unregister().await.unwrap();
    }
    drop((eb, mb));
    b.stop();

    // A restarted daemon (G2 empty, no G3) serves what the bucket holds.
    let b = spawn(&d.path().join("b"), &Setup::new(&s3, "shared"));
    let (eb, mb) = engine(&b, &ns(), 0, 0).await;
    assert_eq!(eb.lookup(&tokens).await.unwrap().g4_blocks, 32);
    let done = eb.load_now(&tokens, 0, &(0..32).collect::<Vec<_>>()).await.unwrap();
    assert_eq!(done.loaded_blocks, 32);
    check(&mb, 11, 32, 0);
    stop_all((ea, eb), [a, b]);
}

/// Wrong credentials and a missing bucket: the daemon starts (G2/G3 serve), says why at start
/// in its log, and `/healthz` warns that G4 is degraded (the node stays ready).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_and_a_missing_bucket_are_clear_errors() {
    let (d, s3) = bucket();
    for (name, setup) in [
        ("secret", Setup { secret: "not-the-secret", ..Setup::new(&s3, "p") }),
        ("bucket", Setup { bucket: "no-such-bucket", ..Setup::new(&s3, "p") }),
    ] {
        let dd = spawn(&d.path().join(name), &setup);
        // The store is opened once the daemon listens: its verdict follows.
        let deadline = Instant::now() + Duration::from_secs(15);
        while !dd.log().contains("does not answer") {
            assert!(Instant::now() < deadline, "{name}: {}", dd.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // A shared bucket's trouble is a neighbour's: this node stays ready and says so.
        let (status, body) = dd.healthz().await;
        assert_eq!(status, 200, "{name}: {body}");
        assert!(body.starts_with("ok\n") && body.contains("warning: G4 degraded"), "{name}: {body}");
        assert_eq!(dd.metric("kvcached_degraded_neighbours{kind=\"g4\"}").await, 1.0, "{name}");
        // The engine is served from G2 meanwhile.
        let (e, _m) = engine(&dd, &ns(), 5, 4).await;
        assert_eq!(e.save(&prompt(5, 4), 0, &[0, 1, 2, 3]).await.unwrap().stored, 4);
        assert_eq!(e.lookup(&prompt(5, 4)).await.unwrap().matched_blocks, 4);
        drop(e);
        dd.stop();
    }
}

/// The S3 server dies while blocks are being written through and comes back: saves and loads
/// never wait on it for long, `/healthz` says G4 is degraded meanwhile, and afterwards every
/// object another daemon reads is whole (no partial object is ever served).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_object_store_killed_mid_write_and_restarted() {
    let (d, mut s3) = bucket();
    let a = spawn(&d.path().join("a"), &Setup { g3: true, ..Setup::new(&s3, "faults") });
    let (ea, _ma) = engine(&a, &ns(), 21, 64).await;
    let len = layout().block_bytes();
    let mut slowest = Duration::ZERO;
    for round in 0..8u32 {
        if round == 3 {
            s3.kill();
        }
        let t = prompt(100 + round, 8);
        let t0 = Instant::now();
        assert!(ea.save(&t, 0, &(round * 8..round * 8 + 8).collect::<Vec<_>>()).await.unwrap().failed == 0);
        assert_eq!(ea.lookup(&t).await.unwrap().matched_blocks, 8);
        slowest = slowest.max(t0.elapsed());
    }
    assert!(slowest < Duration::from_secs(2), "a save or lookup waited {slowest:?} on the dead store");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = a.healthz().await;
        if status == 200 && body.contains("warning: G4 degraded") {
            break;
        }
        assert!(Instant::now() < deadline, "G4 never reported degraded: {status} {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s3.restart();
    // New writes go through again.
    let t = prompt(999, 8);
    ea.save(&t, 0, &(0..8).collect::<Vec<_>>()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while a.healthz().await.1.contains("G4 degraded") {
        assert!(Instant::now() < deadline, "G4 did not recover: {:?}", a.healthz().await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Blocks saved once G4 is back reach the bucket (written through in the background: the
    // blocks saved while it was down or just before were dropped, and how many of the first
    // rounds got there before the kill depends on how busy the machine is).
    let store = s3.store("faults");
    let t = prompt(1000, 8);
    ea.save(&t, 0, &(8..16).collect::<Vec<_>>()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = futures_util::StreamExt::collect::<Vec<_>>(store.list(None)).await.len();
        if n >= 8 {
            break;
        }
        assert!(Instant::now() < deadline, "only {n} objects reached the bucket after G4 recovered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Whatever reached the bucket is whole: every object verifies.
    let mut listed = store.list(None);
    let mut checked = 0;
    while let Some(meta) = futures_util::StreamExt::next(&mut listed).await {
        let meta = meta.unwrap();
        let bytes = store.get(&meta.location).await.unwrap().bytes().await.unwrap();
        let key: kvproto::BlockKey = meta.location.filename().unwrap().parse().unwrap();
        let (m, _) = kvtiers::object::format::verify(&key, &bytes).unwrap_or_else(|e| panic!("{}: {e}", meta.location));
        assert_eq!(m.len, len);
        checked += 1;
    }
    assert!(checked >= 8, "only {checked} objects reached the bucket");
    stop_all(ea, [a]);
}

/// A handoff whose prefill node dies mid-transfer: the decode node keeps the blocks that
/// arrived whole from the peer and reads the rest of the chain from G4, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_cut_short_finishes_from_g4() {
    let (d, s3) = bucket();
    let (a, ea, _ma, tokens) = saved_to_g4(d.path(), &Setup::new(&s3, "handoff"), 11, 32).await;
    // The "prefill node" B pulls from: it sends the first 10 blocks (the same bytes A saved)
    // and dies.
    let len = layout().block_bytes() as usize;
    let (dying, _) = kvtests::fake_peer::fake_peer(kvtests::fake_peer::Fake::DiesAfter(10), 11, len);
    let b = spawn(&d.path().join("b"), &Setup::new(&s3, "handoff"));
    let (eb, mb) = engine(&b, &ns(), 0, 0).await;
    let slots: Vec<u32> = (32..64).collect();
    let done = eb.load_from(&tokens, 0, &slots, &[dying]).await.unwrap();
    assert_eq!((done.loaded_blocks, done.from_peer, done.from_g4), (32, 10, 22), "{done:?}\n{}", b.log());
    check(&mb, 11, 32, 32);
    stop_all((ea, eb), [a, b]);
}

/// A router's prefetch hint to `d`: the chain of `tokens`, pulled from `sources` where this node
/// lacks it. The daemon's answer (`{"local": N, "pulling": M}`).
async fn prefetch(d: &Daemon, tokens: &[u32], sources: &[String]) -> serde_json::Value {
    let keys: Vec<String> = ns().block_keys(tokens).iter().map(|k| hex(&k.0)).collect();
    let body = serde_json::json!({"namespace": hex(&ns().id().0), "keys": keys, "sources": sources});
    let r = reqwest::Client::new().post(format!("{}/prefetch", d.http)).json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    r.json().await.unwrap()
}

/// Prefetch from the tiers below G2: a hint brings a restarted node's G3 blocks, and blocks
/// another daemon wrote to G4 after this one started, into G2 before the engine asks, and the
/// load is then served from G2. A prefill daemon killed outright (SIGKILL) before the decode
/// node pulls from it: the decode node reads the whole chain from G4, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_lifts_g3_and_g4_and_a_killed_peer_is_replaced_by_g4() {
    let (d, s3) = bucket();
    let setup_b = Setup { g3: true, ..Setup::new(&s3, "prefetch") };
    let b = spawn(&d.path().join("b"), &setup_b);
    let (eb, _mb) = engine(&b, &ns(), 12, 32).await;
    let q = prompt(12, 32);
    assert_eq!(eb.save(&q, 0, &(0..32).collect::<Vec<_>>()).await.unwrap().stored, 32);
    b.wait_metric("kvcached_writethrough_blocks_total{tier=\"g3\"}", 32.0, 30).await;
    drop(eb);
    b.stop();

    // Restarted: G2 is empty, G3 kept the prompt.
    let b = spawn(&d.path().join("b"), &setup_b);
    let (eb, mb) = engine(&b, &ns(), 0, 0).await;
    let seen = eb.lookup(&q).await.unwrap();
    assert_eq!((seen.g2_blocks, seen.g3_blocks), (0, 32), "{seen:?}");
    let answer = prefetch(&b, &q, &[]).await;
    assert_eq!(answer["local"], 32, "{answer}");
    let seen = eb.lookup(&q).await.unwrap();
    assert_eq!(seen.g2_blocks, 32, "the hint left blocks below G2: {seen:?}");
    let done = eb.load_now(&q, 0, &(0..32).collect::<Vec<_>>()).await.unwrap();
    assert_eq!((done.loaded_blocks, done.from_g2), (32, 32), "{done:?}");
    check(&mb, 12, 32, 0);

    // A (the prefill node, started after B) saves three prompts; B's index has never heard of
    // them.
    let peer = format!("127.0.0.1:{}", free_port());
    let listen = format!("[peer]\nlisten = \"{peer}\"\n[peer.auth]\nopen = true\n");
    let a = spawn(&d.path().join("a"), &Setup { extra: &listen, ..Setup::new(&s3, "prefetch") });
    let (ea, _ma) = engine(&a, &ns(), 11, 32).await;
    let (ea2, _ma2) = engine(&a, &ns(), 13, 32).await;
    let (ea3, _ma3) = engine(&a, &ns(), 17, 32).await;
    let (p, r, t) = (prompt(11, 32), prompt(13, 32), prompt(17, 32));
    assert_eq!(ea.save(&p, 0, &(0..32).collect::<Vec<_>>()).await.unwrap().stored, 32);
    assert_eq!(ea2.save(&r, 0, &(0..32).collect::<Vec<_>>()).await.unwrap().stored, 32);
    assert_eq!(ea3.save(&t, 0, &(0..32).collect::<Vec<_>>()).await.unwrap().stored, 32);
    a.wait_metric(G4_WRITTEN, 96.0, 30).await;
    let answer = prefetch(&b, &p, &[]).await;
    assert_eq!(answer["local"], 32, "the hint did not find A's blocks in G4: {answer}\n{}", b.log());
    let seen = eb.lookup(&p).await.unwrap();
    assert_eq!(seen.g2_blocks, 32, "{seen:?}");
    let done = eb.load_now(&p, 0, &(32..64).collect::<Vec<_>>()).await.unwrap();
    assert_eq!((done.loaded_blocks, done.from_g2), (32, 32), "{done:?}");
    check(&mb, 11, 32, 32);

    // A dies; B's engine asks for R naming A as the source: all of it from G4.
    drop((ea, ea2, ea3));
    drop(a); // SIGKILL
    let done = eb.load_from(&r, 0, &(0..32).collect::<Vec<_>>(), std::slice::from_ref(&peer)).await.unwrap();
    assert_eq!((done.loaded_blocks, done.from_peer, done.from_g4), (32, 0, 32), "{done:?}\n{}", b.log());
    check(&mb, 13, 32, 0);
    // A is marked bad now, so no pull starts for T: G4 still serves all of it.
    let done = eb.load_from(&t, 0, &(32..64).collect::<Vec<_>>(), std::slice::from_ref(&peer)).await.unwrap();
    assert_eq!((done.loaded_blocks, done.from_peer, done.from_g4), (32, 0, 32), "{done:?}\n{}", b.log());
    check(&mb, 17, 32, 32);
    stop_all(eb, [b]);
}

/// Flipped bytes in an object: a miss, counted, and the object deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_object_is_a_counted_miss_and_deleted() {
    let (d, s3) = bucket();
    let (a, ea, _ma, tokens) = saved_to_g4(d.path(), &Setup::new(&s3, "corrupt"), 31, 4).await;
    // Flip a byte in the third block's object.
    let keys = kvproto::block_keys(&ns().fingerprint(), 16, &tokens);
    let store = s3.store("corrupt");
    let path = object_store::path::Path::from(format!("{}/{}", hex(&ns().id().0), keys[2]));
    let mut bytes = store.get(&path).await.unwrap().bytes().await.unwrap().to_vec();
    let at = bytes.len() - 10;
    bytes[at] ^= 0x01;
    store.put(&path, bytes.into()).await.unwrap();

    let b = spawn(&d.path().join("b"), &Setup::new(&s3, "corrupt"));
    let (eb, mb) = engine(&b, &ns(), 0, 0).await;
    assert_eq!(eb.lookup(&tokens).await.unwrap().g4_blocks, 4);
    let done = eb.load_now(&tokens, 0, &[10, 11, 12, 13]).await.unwrap();
    assert_eq!(done.loaded_blocks, 2, "the load stops at the corrupt block: {done:?}");
    check(&mb, 31, 2, 10);
    b.wait_metric("kvcached_tier_checksum_failures_total{tier=\"g4\"}", 1.0, 5).await;
    assert!(matches!(store.head(&path).await, Err(object_store::Error::NotFound { .. })), "the object is deleted");
    stop_all((ea, eb), [a, b]);
}

/// What one daemon writes to G4 reaches the router as blocks of the cluster holder: a prompt
/// only G4 holds is credited, with G4's weight, on a worker of a node that never saw it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_credits_g4_blocks_on_every_node() {
    let (d, s3) = bucket();
    let mut spec = kvtests::router_harness::spec("m", "g4/model", 16);
    (spec.num_layers, spec.kv_heads, spec.head_dim) = (2, 2, 64);
    let cfg = kvrouter::RouterConfig { namespaces: vec![spec], seed: Some(1), ..kvrouter::RouterConfig::default() };
    let router = kvtests::router_harness::Server::start(cfg).await;
    let section =
        |node: &str| format!("[router]\nurls = [\"{}\"]\nnode = \"{node}\"\nreport_interval_ms = 200\n", router.base);
    let a = spawn(&d.path().join("a"), &Setup { router: section("node-a"), ..Setup::new(&s3, "routed") });
    let b = spawn(&d.path().join("b"), &Setup { router: section("node-b"), ..Setup::new(&s3, "routed") });
    let mem = filled_memory(&layout(), 64, 41, 32);
    let ea = worker(&a.socket, "gpu0", &ns(), &mem, "http://a:8000", "both").await;
    let mb = KvMemory::anonymous(&layout(), 64).unwrap();
    let eb = worker(&b.socket, "gpu0", &ns(), &mb, "http://b:8000", "both").await;
    let tokens = prompt(41, 32);
    ea.save(&tokens, 0, &(0..32).collect::<Vec<_>>()).await.unwrap();
    a.wait_metric(G4_WRITTEN, 32.0, 30).await;
    // Node b never saw the prompt: its worker is credited the G4 copy.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, v) =
            router.route_json(serde_json::json!({"namespace": "m", "tokens": tokens, "explain": true})).await;
        let b_g4 = v["candidates"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["worker"] == "node-b/gpu0"))
            .and_then(|c| c["cached_blocks"][3].as_u64());
        if status == 200 && b_g4 == Some(32) {
            break;
        }
        assert!(Instant::now() < deadline, "node-b is not credited G4: {status} {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop((ea, eb));
    a.stop();
    b.stop();
    router.stop().await;
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
