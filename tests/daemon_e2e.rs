//! kvcached across the real socket: in-process `serve()` on temp sockets and the real binary in
//! separate processes, driven by the real client.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvcached::{Config, Listeners};
use kvclient::{Client, ClientError, KvMemory, synthetic_block};
use kvproto::{KvLayout, LayoutKind, Namespace};
use kvtests::fixture::{KillOnDrop, check, daemon_command, fill, prompt};
use kvtests::raw_grpc::raw_client;

fn layout(kind: LayoutKind) -> KvLayout {
    KvLayout { kind, ..kvtests::fixture::small_layout() }
}

fn ns(model: &str) -> Namespace {
    Namespace::new(model, layout(LayoutKind::LayerSeparate))
}

fn config(dir: &Path) -> Config {
    let mut c = Config {
        socket: dir.join("kvcached.sock"),
        metrics_addr: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    };
    c.g2.capacity_bytes = 64 << 20;
    c.g2.shm_dir = dir.to_path_buf();
    c.g3.dir = dir.join("g3");
    c.g3.capacity_bytes = 128 << 20;
    c.g3.fsync = false;
    c.engines.lease_ms = 2000;
    c.resolve().unwrap()
}

struct InProcess {
    socket: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), kvcached::ServerError>>,
}

/// A daemon ([`start`]) in a new temporary directory, and the directory.
async fn started() -> (tempfile::TempDir, InProcess) {
    let d = tempfile::tempdir().unwrap();
    let daemon = start(d.path()).await;
    (d, daemon)
}

async fn start(dir: &Path) -> InProcess {
    start_with(config(dir)).await
}

fn serve_on(c: Config, l: Listeners) -> InProcess {
    let socket = c.socket.clone();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(kvcached::serve(c, l, async move {
        let _ = rx.await;
    }));
    InProcess { socket, stop: Some(tx), task }
}

/// `serve()` in this process with configuration `c`.
async fn start_with(c: Config) -> InProcess {
    let l = Listeners::bind(&c).await.unwrap();
    serve_on(c, l)
}

impl InProcess {
    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().unwrap();
    }
}

fn kv(dir: &Path, name: &str, slots: u32) -> KvMemory {
    KvMemory::create_layer_separate(dir.join(name), &layout(LayoutKind::LayerSeparate), slots).unwrap()
}

/// An engine `name` registered in namespace `m` with 8 block slots, the first `blocks` of them
/// filled with KV of `seed`.
async fn attached(daemon: &InProcess, dir: &Path, name: &str, seed: u64, blocks: u32) -> (Client, KvMemory) {
    attached_to(&daemon.socket, dir, name, 8, seed, blocks).await
}

/// An engine `name` of the daemon at `socket`, registered in namespace `m` with `slots` block
/// slots (a file in `dir`), the first `blocks` of them filled with KV of `seed`.
async fn attached_to(socket: &Path, dir: &Path, name: &str, slots: u32, seed: u64, blocks: u32) -> (Client, KvMemory) {
    let mut mem = kv(dir, name, slots);
    fill(&mut mem, seed, blocks, 0);
    let c = Client::connect(socket).await.unwrap();
    c.register(name, &ns("m"), &mem).await.unwrap();
    (c, mem)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_hand_over_through_g2_byte_exact() {
    let (d, daemon) = started().await;
    let tokens = prompt(1, 40);
    let mut a_kv = kv(d.path(), "a", 64);
    fill(&mut a_kv, 11, 40, 0);
    let a = Client::connect(&daemon.socket).await.unwrap();
    a.register("prefill", &ns("m"), &a_kv).await.unwrap();
    let slots: Vec<u32> = (0..40).collect();
    let s = a.save(&tokens, 0, &slots).await.unwrap();
    assert_eq!((s.stored, s.already_present, s.failed), (40, 0, 0));
    assert_eq!(a.save(&tokens, 0, &slots).await.unwrap().already_present, 40);

    let b_kv = kv(d.path(), "b", 64);
    let b = Client::connect(&daemon.socket).await.unwrap();
    b.register("decode", &ns("m"), &b_kv).await.unwrap();
    // A longer prompt with the same prefix: 40 of its 45 blocks are cached.
    let mut longer = tokens.clone();
    longer.extend(prompt(2, 5));
    let hit = b.lookup(&longer).await.unwrap();
    assert_eq!((hit.matched_blocks, hit.matched_tokens, hit.g2_blocks), (40, 640, 40));
    let dst: Vec<u32> = (20..64).collect();
    let op = b.load(&longer, 0, &dst).await.unwrap();
    let done = b.wait(&op, Duration::from_secs(10)).await.unwrap();
    assert_eq!((done.loaded_blocks, done.from_g2), (40, 40));
    check(&b_kv, 11, 40, 20);
    let stats = b.stats().await.unwrap();
    assert_eq!(stats.engines, 2);
    daemon.stop().await;
}

/// Requests with key contexts (docs/block-keys.md section 6): an adapter's, a salted and a plain
/// request never hit each other's blocks; an image's request shares the blocks before the image
/// with the text alone; loads bring back exactly the saver's bytes; a context out of bounds is
/// refused before anything is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_with_key_contexts_hit_only_their_own_blocks() {
    use kvproto::{Adapter, KeyContext, MmInput};
    let (d, daemon) = started().await;
    let tokens = prompt(7, 6);
    let lora =
        KeyContext { adapter: Some(Adapter { name: "sql".into(), content_hash: vec![1; 32] }), ..Default::default() };
    let retrained =
        KeyContext { adapter: Some(Adapter { name: "sql".into(), content_hash: vec![2; 32] }), ..Default::default() };
    let salt = KeyContext { cache_salt: Some(b"tenant-a".to_vec()), ..Default::default() };
    // Placeholders at tokens 40..69 of 16-token blocks: blocks 2, 3 and 4.
    let image =
        |h: u8| KeyContext { mm: vec![MmInput { hash: vec![h; 32], offset: 40, length: 30 }], ..Default::default() };
    let (a, _a_kv) = attached(&daemon, d.path(), "a", 31, 6).await;
    let slots: Vec<u32> = (0..6).collect();
    let s = a.save_in(&tokens, Some(&lora), 0, &slots).await.unwrap();
    assert_eq!((s.stored, s.failed), (6, 0));
    let hits = |c: Option<&KeyContext>| {
        let (a, tokens) = (&a, &tokens);
        let c = c.cloned();
        async move { a.lookup_in(tokens, c.as_ref()).await.unwrap().matched_blocks }
    };
    assert_eq!(hits(Some(&lora)).await, 6);
    assert_eq!(hits(None).await, 0, "a plain request finds no adapter's block");
    assert_eq!(hits(Some(&salt)).await, 0);
    assert_eq!(hits(Some(&retrained)).await, 0, "other weights under the same name");
    assert_eq!(a.lookup_in(&tokens, Some(&KeyContext::default())).await.unwrap().matched_blocks, 0);
    // The cached run from a later block (a window group's window): its length and end.
    let run = a.lookup_run(&tokens, Some(&lora), 4).await.unwrap();
    assert_eq!((run.matched_blocks, run.matched_tokens), (2, 6 * 16));
    assert_eq!(a.lookup_run(&tokens, Some(&lora), 6).await.unwrap().matched_tokens, 0);
    assert_eq!(a.lookup_run(&tokens, None, 2).await.unwrap().matched_blocks, 0);

    // The image's request: saved under the image; the text alone finds the 2 blocks before it.
    a.save_in(&tokens, Some(&image(1)), 0, &slots).await.unwrap();
    assert_eq!(hits(Some(&image(1))).await, 6);
    assert_eq!(hits(Some(&image(2))).await, 2);
    assert_eq!(hits(None).await, 2);

    // Another engine loads the adapter's blocks byte for byte.
    let (b, b_kv) = attached(&daemon, d.path(), "b", 0, 0).await;
    let done = b.load_now_in(&tokens, Some(&lora), 0, &[2, 3, 4, 5, 6, 7]).await.unwrap();
    assert_eq!(done.loaded_blocks, 6);
    check(&b_kv, 31, 6, 2);
    let op = b.load_op_in(&tokens, Some(&salt), 0, &[0], &[]).await.unwrap();
    assert_eq!(b.wait(&op, Duration::from_secs(10)).await.unwrap().loaded_blocks, 0);

    // Out of bounds: refused, nothing stored.
    let overlapping = KeyContext {
        mm: vec![MmInput { hash: vec![1], offset: 0, length: 20 }, MmInput { hash: vec![2], offset: 10, length: 5 }],
        ..Default::default()
    };
    for e in [
        a.save_in(&tokens, Some(&overlapping), 0, &slots).await.map(|_| ()).unwrap_err(),
        a.lookup_in(&tokens, Some(&overlapping)).await.map(|_| ()).unwrap_err(),
        b.load_op_in(&tokens, Some(&overlapping), 0, &[0], &[]).await.map(|_| ()).unwrap_err(),
    ] {
        assert!(matches!(&e, ClientError::Rpc(s) if s.code() == tonic::Code::InvalidArgument), "{e}");
        assert!(e.to_string().contains("mm.offset"), "{e}");
    }
    daemon.stop().await;
}

/// Blocks keyed by an engine's own page hashes (docs/block-keys.md section 7): saved and found
/// by the hashes alone (over LOOKUP and gRPC), loaded byte for byte by another engine; SGLang's
/// hashes derived from tokens name the same blocks; never a token chain's block, never another
/// scheme's; a request mixing hashes with tokens or a context, or a scheme the daemon cannot
/// derive, is refused before anything is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_keyed_by_engine_hashes() {
    use kvproto::engine_hash::sglang_page_hashes_le;
    use kvproto::{EngineHashes, HashScheme, KeyContext, KeySource};
    let (d, daemon) = started().await;
    let tokens = prompt(9, 5);
    let sglang: Vec<Vec<u8>> =
        sglang_page_hashes_le(16, &kvproto::tokens_to_le(&tokens)).iter().map(|h| h.to_vec()).collect();
    let given = KeySource::Hashes(EngineHashes { scheme: HashScheme::Sglang, hashes: sglang.clone() });
    let derived = KeySource::Hashes(EngineHashes { scheme: HashScheme::Sglang, hashes: vec![] });
    let vllm = KeySource::Hashes(EngineHashes { scheme: HashScheme::Vllm, hashes: sglang.clone() });
    let (a, _a_kv) = attached(&daemon, d.path(), "a", 41, 5).await;
    let slots: Vec<u32> = (0..5).collect();
    let s = a.save_keyed(&[], &given, 0, &slots).await.unwrap();
    assert_eq!((s.stored, s.failed), (5, 0));
    assert_eq!(a.lookup_keyed(&[], &given, 0).await.unwrap().matched_blocks, 5);
    assert_eq!(a.lookup_keyed(&tokens, &derived, 0).await.unwrap().matched_blocks, 5, "derived from tokens");
    assert_eq!(a.lookup_keyed(&[], &vllm, 0).await.unwrap().matched_blocks, 0, "another scheme");
    assert_eq!(a.lookup(&tokens).await.unwrap().matched_blocks, 0, "the token chain's keys");
    let mut first_two = sglang.clone();
    first_two[2] = vec![7; 32];
    let gap = KeySource::Hashes(EngineHashes { scheme: HashScheme::Sglang, hashes: first_two });
    assert_eq!(a.lookup_keyed(&[], &gap, 0).await.unwrap().matched_blocks, 2);
    assert_eq!(a.lookup_keyed(&[], &given, 3).await.unwrap().matched_blocks, 2, "the run from block 3");

    // Another engine loads them by the hashes, byte for byte, stopping at the first it lacks.
    let (b, b_kv) = attached(&daemon, d.path(), "b", 0, 0).await;
    let done = b.load_now_keyed(&[], &given, 0, &[3, 4, 5, 6, 7]).await.unwrap();
    assert_eq!(done.loaded_blocks, 5);
    check(&b_kv, 41, 5, 3);
    assert_eq!(b.load_now_keyed(&[], &gap, 0, &[0, 1, 2]).await.unwrap().loaded_blocks, 2);

    // Refusals name the field; nothing is stored.
    let salted = KeyContext { cache_salt: Some(b"s".to_vec()), ..Default::default() };
    let cases = [
        (a.save_keyed(&tokens, &given, 0, &slots).await.map(|_| ()).unwrap_err(), "engine_hashes.hashes"),
        (
            a.lookup_keyed(&tokens, &KeySource::Hashes(EngineHashes { scheme: HashScheme::Vllm, hashes: vec![] }), 0)
                .await
                .map(|_| ())
                .unwrap_err(),
            "PYTHONHASHSEED",
        ),
        (
            b.load_op_keyed(
                &[],
                &KeySource::Hashes(EngineHashes { scheme: HashScheme::Sglang, hashes: vec![vec![]] }),
                0,
                &[0],
                &[],
            )
            .await
            .map(|_| ())
            .unwrap_err(),
            "engine_hashes.hashes",
        ),
        (
            // A scheme the daemon cannot derive, on a load: refused before the load starts.
            b.load_op_keyed(
                &tokens,
                &KeySource::Hashes(EngineHashes { scheme: HashScheme::Vllm, hashes: vec![] }),
                0,
                &[0],
                &[],
            )
            .await
            .map(|_| ())
            .unwrap_err(),
            "PYTHONHASHSEED",
        ),
    ];
    for (e, field) in cases {
        assert!(matches!(&e, ClientError::Rpc(s) if s.code() == tonic::Code::InvalidArgument), "{e}");
        assert!(e.to_string().contains(field), "{e}");
    }
    // A context beside hashes: refused at the daemon (raw request, as no client builds it).
    let mut raw = raw_client(&daemon.socket).await;
    let e = raw
        .lookup(kvproto::pb::LookupRequest {
            engine_id: a.engine_id_now().unwrap(),
            context: Some((&salted).into()),
            engine_hashes: Some(kvproto::pb::EngineHashes { scheme: "sglang".into(), hashes: sglang.clone() }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(e.message().contains("engine_hashes"), "{e}");
    daemon.stop().await;
}

/// Resident kB of each mapping of `path` in this process (`/proc/self/smaps`).
fn resident_kib_of(path: &Path) -> Vec<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let name = path.to_str().unwrap();
    let mut out = Vec::new();
    let mut in_map = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            // A mapping's header: "start-end perms offset dev inode path".
            in_map = line.ends_with(name);
        } else if in_map && let Some(kb) = line.strip_prefix("Rss:") {
            out.push(kb.trim().trim_end_matches("kB").trim().parse().unwrap());
        }
    }
    out
}

/// With `engines.prefault_memory` (the default) the daemon fills the page tables of the pages
/// of an engine's region that the engine has made resident, at register, so saves and loads
/// take no page faults; pages the engine never touched stay unallocated (a sparse region costs
/// the daemon nothing, issue 35's finding 1); without it the region is mapped on first touch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_prefaults_the_engine_region_unless_told_not_to() {
    for (prefault, touched) in [(true, true), (true, false), (false, true)] {
        let d = tempfile::tempdir().unwrap();
        let mut c = config(d.path());
        c.engines.prefault_memory = prefault;
        let daemon = start_with(c).await;
        let mut mem = kv(d.path(), "e", 16);
        if touched {
            // The engine writes every slot: its pages are resident in the file.
            fill(&mut mem, 1, 16, 0);
        }
        let path = mem.path().unwrap().to_path_buf();
        let region_kib = std::fs::metadata(&path).unwrap().len() / 1024;
        let before = resident_kib_of(&path);
        let e = Client::connect(&daemon.socket).await.unwrap();
        e.register("e", &ns("m"), &mem).await.unwrap();
        let after = resident_kib_of(&path);
        assert_eq!(after.len(), before.len() + 1, "the daemon maps the region once");
        // The daemon's mapping is the one that was not there before.
        let daemon_rss: u64 = after.iter().sum::<u64>() - before.iter().sum::<u64>();
        match (prefault, touched) {
            (true, true) => assert_eq!(daemon_rss, region_kib, "the resident region is mapped at register"),
            (true, false) => assert_eq!(daemon_rss, 0, "untouched pages are not allocated for the engine"),
            _ => assert_eq!(daemon_rss, 0, "nothing is mapped before it is used"),
        }
        daemon.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_layout_namespace_and_requests_get_clear_errors() {
    let (d, daemon) = started().await;
    let mem = kv(d.path(), "a", 8);
    let c = Client::connect(&daemon.socket).await.unwrap();
    // The memory was laid out for 2 layers; claim 4.
    let mut wrong = ns("m");
    wrong.layout.num_layers = 4;
    let e = c.register("bad", &wrong, &mem).await.unwrap_err();
    let ClientError::Rpc(s) = e else { panic!("{e}") };
    assert_eq!(s.code(), tonic::Code::InvalidArgument);
    assert!(s.message().contains("segments"), "{}", s.message());
    let mut zero = ns("m");
    zero.layout.head_dim = 0;
    let ClientError::Rpc(s) = c.register("bad", &zero, &mem).await.unwrap_err() else { panic!() };
    assert!(s.message().contains("head_dim"), "{}", s.message());

    // GPU memory over CUDA IPC: a malformed handle, and (on a node without CUDA) a clear
    // "no CUDA device", both as FAILED_PRECONDITION naming the cause.
    let l = layout(LayoutKind::LayerSeparate);
    let gpu = kvclient::GpuKvMemory::layer_separate([7; 64], 0, &l, 8);
    let ClientError::Rpc(s) = c.register_gpu("gpu", &ns("m"), &gpu, "", "").await.unwrap_err() else { panic!() };
    assert_eq!(s.code(), tonic::Code::FailedPrecondition);
    if std::fs::metadata("/dev/nvidiactl").is_err() {
        assert!(s.message().contains("no CUDA device"), "{}", s.message());
    }

    c.register("ok", &ns("m"), &mem).await.unwrap();
    // Slots out of range, and blocks beyond the tokens' full blocks.
    let ClientError::Rpc(s) = c.save(&prompt(1, 2), 0, &[0, 99]).await.unwrap_err() else { panic!() };
    assert!(s.message().contains("out of range"), "{}", s.message());
    let ClientError::Rpc(s) = c.save(&prompt(1, 2), 0, &[0, 1, 2]).await.unwrap_err() else { panic!() };
    assert!(s.message().contains("full blocks"), "{}", s.message());

    // Isolation: another model or tenant never sees these blocks.
    let mut a_kv = kv(d.path(), "iso", 8);
    fill(&mut a_kv, 3, 4, 0);
    let a = Client::connect(&daemon.socket).await.unwrap();
    a.register("a", &ns("m"), &a_kv).await.unwrap();
    a.save(&prompt(5, 4), 0, &[0, 1, 2, 3]).await.unwrap();
    for other in [ns("other-model"), Namespace { tenant_salt: Some(b"tenant-b".to_vec()), ..ns("m") }] {
        let o_kv = kv(d.path(), "o", 8);
        let o = Client::connect(&daemon.socket).await.unwrap();
        o.register("o", &other, &o_kv).await.unwrap();
        assert_eq!(o.lookup(&prompt(5, 4)).await.unwrap().matched_blocks, 0);
        assert_eq!(o.load_now(&prompt(5, 4), 0, &[0, 1, 2, 3]).await.unwrap().loaded_blocks, 0);
        o.unregister().await.unwrap();
    }
    daemon.stop().await;
}

/// A lookup marks the matched G2 blocks used (after its reply, on `kv-g2-touch`): under
/// eviction, a prompt just looked up outlives an older one that was not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_keeps_its_prefix_in_g2_under_eviction() {
    let d = tempfile::tempdir().unwrap();
    let mut c = config(d.path());
    c.g3.enabled = false;
    c.g2.page_size = 16 << 10; // one page per block: the pool holds 256 blocks
    c.g2.capacity_bytes = 4 << 20;
    let daemon = start_with(c).await;
    let (e, _mem) = attached(&daemon, d.path(), "a", 3, 8).await;
    let save_all = |t: Vec<u32>| {
        let e = e.clone();
        async move {
            for first in (0..(t.len() / 16) as u32).step_by(8) {
                assert_eq!(e.save(&t, first, &(0..8).collect::<Vec<_>>()).await.unwrap().failed, 0);
            }
        }
    };
    let (a, b, fresh) = (prompt(31, 64), prompt(32, 64), prompt(33, 128));
    save_all(a.clone()).await; // oldest
    save_all(b.clone()).await;
    assert_eq!(e.lookup(&a).await.unwrap().matched_blocks, 64); // now the most recently used
    tokio::time::sleep(Duration::from_millis(300)).await;
    save_all(fresh.clone()).await; // 256 blocks in all: eviction takes the coldest
    let matched = |t: Vec<u32>| {
        let e = e.clone();
        async move { e.lookup(&t).await.unwrap().matched_blocks }
    };
    // Only the cold prompt loses blocks (from its tail), and it loses all that had to go.
    let b_left = matched(b).await;
    assert!(b_left < 64, "nothing of the cold prompt was evicted");
    assert_eq!(matched(a).await, 64, "the looked-up prompt lost blocks");
    assert_eq!(matched(fresh).await, 128, "the newest prompt lost blocks");
    daemon.stop().await;
}

/// Lookups of long prompts (past the daemon's key memo threshold and its lazy derivation chunk)
/// match exactly their cached prefix, whether the keys are derived, reused or partly both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_match_exactly_their_cached_prefix() {
    let (d, daemon) = started().await;
    let (c, _mem) = attached(&daemon, d.path(), "a", 4, 8).await;
    let tokens = prompt(21, 1000);
    for first in (0..600).step_by(8) {
        let r = c.save(&tokens, first, &(0..8).collect::<Vec<_>>()).await.unwrap();
        assert_eq!(r.failed, 0, "{}", r.error);
    }
    let matched = |t: Vec<u32>| {
        let c = c.clone();
        async move { c.lookup(&t).await.unwrap().matched_blocks }
    };
    assert_eq!(matched(tokens.clone()).await, 600);
    assert_eq!(matched(tokens.clone()).await, 600, "again, keys from the memo");
    assert_eq!(matched(tokens[..600 * 16].to_vec()).await, 600);
    assert_eq!(matched(tokens[..300 * 16 + 5].to_vec()).await, 300);
    for changed in [450usize, 0, 599, 600] {
        let mut t = tokens.clone();
        t[changed * 16 + 7] ^= 1;
        assert_eq!(matched(t).await, changed as u32, "block {changed} changed");
    }
    // A fresh engine of the same namespace (its own requests, the same memo) agrees.
    let (o, _other_mem) = attached(&daemon, d.path(), "b", 5, 8).await;
    assert_eq!(o.lookup(&tokens).await.unwrap().matched_blocks, 600);
    let got = o.load_now(&tokens, 596, &[0, 1, 2, 3, 4, 5, 6, 7]).await.unwrap();
    assert_eq!(got.loaded_blocks, 4, "a load stops at the first block not cached");
    daemon.stop().await;
}

/// Lookups go over LOOKUP (framed, no HTTP/2) when the daemon serves it and over gRPC when it
/// does not (`engines.lookup_wire = false`) or the client is told so: every way answers the
/// same, for prompts inline and through the token area, cached, partly cached or not at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookups_answer_the_same_over_lookup_and_grpc() {
    for served in [true, false] {
        let d = tempfile::tempdir().unwrap();
        let mut c = config(d.path());
        c.engines.lookup_wire = served;
        let daemon = start_with(c).await;
        assert_eq!(kvtests::lookup_raw::open(&daemon.socket).await.is_ok(), served);
        let (wire, _mem) = attached(&daemon, d.path(), "a", 4, 8).await;
        let (grpc, _other) = attached(&daemon, d.path(), "b", 5, 8).await;
        grpc.set_lookup_wire(false);
        // 1100 blocks: past the client's staging threshold, so the whole prompt goes through
        // the token area; its first 64 blocks cached.
        let tokens = prompt(41, 1100);
        for first in (0..64).step_by(8) {
            assert_eq!(wire.save(&tokens, first, &(0..8).collect::<Vec<_>>()).await.unwrap().failed, 0);
        }
        let mut changed = tokens.clone();
        changed[30 * 16 + 2] ^= 1;
        let asked =
            [tokens.clone(), tokens[..64 * 16].to_vec(), tokens[..10 * 16 + 3].to_vec(), changed, prompt(42, 4)];
        for (i, t) in asked.iter().enumerate() {
            let (a, b) = (wire.lookup(t).await.unwrap(), grpc.lookup(t).await.unwrap());
            assert_eq!(a, b, "prompt {i}, LOOKUP served: {served}");
        }
        let mut got = Vec::new();
        for t in &asked {
            got.push(wire.lookup(t).await.unwrap().matched_blocks);
        }
        assert_eq!(got, [64, 64, 10, 30, 0]);
        // From a thread of its own with blocking I/O: the same answers where LOOKUP is served;
        // `None` (ask through the runtime) where it is not, where the client was told not to use
        // it, and before the engine is registered.
        let unregistered = Client::connect(&daemon.socket).await.unwrap();
        for (i, t) in asked.iter().enumerate() {
            let want = wire.lookup(t).await.unwrap();
            let (w, g, u, t) = (wire.clone(), grpc.clone(), unregistered.clone(), t.clone());
            let (bw, bg, bu) = tokio::task::spawn_blocking(move || {
                (w.lookup_blocking(&t).map(Result::unwrap), g.lookup_blocking(&t), u.lookup_blocking(&t))
            })
            .await
            .unwrap();
            assert_eq!(bw, served.then_some(want), "prompt {i}, blocking, LOOKUP served: {served}");
            assert!(bg.is_none() && bu.is_none(), "prompt {i}");
        }
        // Which way they went: LOOKUP where served; the other client never asked.
        assert_eq!(wire.lookup_wire_served(), Some(served));
        assert_eq!(grpc.lookup_wire_served(), None);
        daemon.stop().await;
    }
}

/// Token ids travel as little-endian u32 bytes: a length that is not whole tokens is
/// INVALID_ARGUMENT on every RPC that carries tokens, and the daemon keeps serving. Sent with the
/// raw generated client (the client crate cannot produce it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_bytes_that_are_not_whole_tokens_are_rejected() {
    use kvproto::pb;
    let (d, daemon) = started().await;

    let (engine, _mem) = attached(&daemon, d.path(), "a", 9, 2).await;
    engine.save(&prompt(9, 2), 0, &[0, 1]).await.unwrap();
    let engine_id = engine.engine_id_now().unwrap();

    let mut raw = raw_client(&daemon.socket).await;
    let odd = bytes::Bytes::from(vec![1u8; 4 * 16 + 3]);
    let bad = [
        raw.lookup(pb::LookupRequest { engine_id, tokens: odd.clone(), ..Default::default() }).await.map(|_| ()),
        raw.save(pb::SaveRequest { engine_id, tokens: odd.clone(), block_ids: vec![0], ..Default::default() })
            .await
            .map(|_| ()),
        raw.load(pb::LoadRequest {
            engine_id,
            tokens: odd.clone(),
            block_ids: vec![2],
            wait: true,
            ..Default::default()
        })
        .await
        .map(|_| ()),
    ];
    for r in bad {
        let s = r.unwrap_err();
        assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
        assert!(s.message().contains("67 bytes"), "{}", s.message());
    }
    // The same prompt in whole tokens still hits.
    let good = raw
        .lookup(pb::LookupRequest { engine_id, tokens: kvproto::tokens_to_le(&prompt(9, 2)), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(good.matched_blocks, 2);
    engine.unregister().await.unwrap();
    daemon.stop().await;
}

/// An engine that truncates its KV memory file under the daemon gets errors for its own saves
/// and loads; the daemon survives (a SIGBUS would have killed it), stores nothing the faulted
/// copy read, and keeps serving the other engines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_truncates_its_memory_fails_alone() {
    let (d, daemon) = started().await;
    let (bad, _bad_mem) = attached(&daemon, d.path(), "bad", 3, 8).await;
    let (good, good_mem) = attached(&daemon, d.path(), "good", 4, 8).await;
    let (t3, t4) = (prompt(3, 8), prompt(4, 8));
    assert_eq!(bad.save(&t3, 0, &[0, 1]).await.unwrap().stored, 2);

    std::fs::OpenOptions::new().write(true).open(d.path().join("bad")).unwrap().set_len(0).unwrap();
    let r = bad.save(&t3, 2, &[2, 3]).await.unwrap();
    assert_eq!((r.stored, r.failed), (0, 2), "{r:?}");
    assert!(r.error.contains("shrank under the daemon"), "{}", r.error);
    let e = bad.load_now(&t3, 0, &[4, 5]).await;
    assert!(format!("{e:?}").contains("shrank under the daemon"), "{e:?}");
    assert_eq!(bad.lookup(&t3).await.unwrap().matched_blocks, 2, "only the blocks saved before");

    assert_eq!(good.save(&t4, 0, &(0..8).collect::<Vec<_>>()).await.unwrap().stored, 8);
    let got = good.load_now(&t3, 0, &[6, 7]).await.unwrap();
    assert_eq!(got.loaded_blocks, 2);
    check(&good_mem, 3, 2, 6);
    daemon.stop().await;
}

/// Long prompts' tokens go through the engine's shared-memory token area: the same answers as
/// inline, and requests that name a span badly are refused with a clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_travel_through_the_token_area() {
    use kvclient::token_area::TokenArea;
    use kvproto::pb;
    let (d, daemon) = started().await;
    let (staged, mem) = attached(&daemon, d.path(), "a", 4, 8).await;
    assert!(staged.token_area_active());
    let mut inline = Client::connect(&daemon.socket).await.unwrap();
    assert!(inline.set_token_area_bytes(0));
    let other_mem = kv(d.path(), "b", 8);
    inline.register("b", &ns("m"), &other_mem).await.unwrap();
    assert!(!inline.token_area_active());
    // 1100 blocks: 70,400 bytes of tokens, past the client's 64 KiB staging threshold.
    let tokens = prompt(31, 1100);
    for first in (0..600).step_by(8) {
        assert_eq!(staged.save(&tokens, first, &(0..8).collect::<Vec<_>>()).await.unwrap().failed, 0);
    }
    for changed in [None, Some(450usize), Some(0), Some(599)] {
        let mut t = tokens.clone();
        if let Some(b) = changed {
            t[b * 16 + 3] ^= 1;
        }
        let want = changed.unwrap_or(600) as u32;
        assert_eq!(staged.lookup(&t).await.unwrap().matched_blocks, want, "staged, block {changed:?} changed");
        assert_eq!(inline.lookup(&t).await.unwrap().matched_blocks, want, "inline, block {changed:?} changed");
    }

    // The daemon's side, driven by hand: an area registered by a raw client (its descriptors
    // handed over with ATTACH).
    let mut raw = raw_client(&daemon.socket).await;
    let area = std::sync::Arc::new(TokenArea::create(1 << 20).unwrap());
    let seg = layout(LayoutKind::LayerSeparate).segment_bytes();
    let ticketed = |mem_file: &std::fs::File, area_file: Option<&std::fs::File>| {
        let files: Vec<&std::fs::File> = std::iter::once(mem_file).chain(area_file).collect();
        let t = kvclient::attach::attach(&daemon.socket, &files).unwrap();
        (t[0].to_vec(), t.get(1).map(|t| t.to_vec()))
    };
    let (kv_ticket, area_ticket) = ticketed(mem.file(), Some(area.file()));
    let mut reg = pb::RegisterRequest {
        engine_name: "raw".into(),
        namespace: Some(pb::NamespaceSpec::from(&ns("m"))),
        region: Some(pb::MemoryRegion {
            kind: Some(pb::memory_region::Kind::FdTicket(kv_ticket)),
            size_bytes: mem.bytes().len() as u64,
            cuda_device: 0,
        }),
        segments: (0..4).map(|i| pb::Segment { offset: i * 8 * seg, block_stride: seg }).collect(),
        segment_bytes: seg,
        num_blocks: 8,
        token_area: Some(pb::TokenArea { fd_ticket: area_ticket.unwrap(), ..area.request() }),
        ..Default::default()
    };
    let r = raw.register(reg.clone()).await.unwrap().into_inner();
    assert!(r.token_area_accepted, "{}", r.token_area_error);
    let s = area.stage(&tokens).unwrap();
    let lookup = |tokens: bytes::Bytes, tokens_at: Option<pb::TokenSpan>, engine_id: u64| pb::LookupRequest {
        engine_id,
        tokens,
        tokens_at,
        ..Default::default()
    };
    let hit = raw.lookup(lookup(bytes::Bytes::new(), Some(s.span), r.engine_id)).await.unwrap().into_inner();
    assert_eq!(hit.matched_blocks, 600);
    let bad = [
        (
            lookup(bytes::Bytes::new(), Some(pb::TokenSpan { offset: (1 << 20) - 4, len: 8 }), r.engine_id),
            "does not lie inside",
        ),
        (lookup(bytes::Bytes::new(), Some(pb::TokenSpan { offset: 0, len: 6 }), r.engine_id), "not a whole number"),
        (lookup(kvproto::tokens_to_le(&tokens), Some(s.span), r.engine_id), "either tokens or tokens_at"),
    ];
    for (req, why) in bad {
        let e = raw.lookup(req).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(why), "{}", e.message());
    }
    // An engine that truncates its area gets a clear error, and the daemon (SIGBUS caught)
    // goes on serving the others.
    area.file().set_len(0).unwrap();
    for _ in 0..2 {
        let e = raw.lookup(lookup(bytes::Bytes::new(), Some(s.span), r.engine_id)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("shrank under the daemon"), "{}", e.message());
    }
    assert_eq!(staged.lookup(&tokens).await.unwrap().matched_blocks, 600);
    // An area the daemon cannot use costs speed, not the registration, and the answer says why.
    let (kv_ticket, _) = ticketed(mem.file(), None);
    reg.region.as_mut().unwrap().kind = Some(pb::memory_region::Kind::FdTicket(kv_ticket));
    reg.token_area = Some(pb::TokenArea { size_bytes: 4096, fd_ticket: vec![9; 16], ..Default::default() });
    let unmapped = raw.register(reg).await.unwrap().into_inner();
    assert!(!unmapped.token_area_accepted);
    assert!(unmapped.token_area_error.contains("fd ticket"), "{}", unmapped.token_area_error);
    let e = raw.lookup(lookup(bytes::Bytes::new(), Some(s.span), unmapped.engine_id)).await.unwrap_err();
    assert!(e.message().contains("has none open"), "{}", e.message());
    drop(s);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_engines_share_overlapping_prefixes_and_see_only_correct_bytes() {
    let (d, daemon) = started().await;
    let shared = prompt(77, 8);
    let mut tasks = Vec::new();
    for e in 0..8u32 {
        let socket = daemon.socket.clone();
        let dir = d.path().to_path_buf();
        let shared = shared.clone();
        tasks.push(tokio::spawn(async move {
            // Each engine's prompt: the shared 8-block prefix + its own 4 blocks. KV content
            // depends only on (prompt, block), so overlapping saves agree.
            let mut tokens = shared.clone();
            tokens.extend(prompt(1000 + e, 4));
            let len = layout(LayoutKind::LayerSeparate).block_bytes() as usize;
            let expect =
                |b: u32| if b < 8 { synthetic_block(77, b, len) } else { synthetic_block(1000 + u64::from(e), b, len) };
            let mut mem = kv(&dir, &format!("e{e}"), 32);
            for b in 0..12 {
                mem.write_block(b, &expect(b));
            }
            let c = Client::connect(&socket).await.unwrap();
            c.register(&format!("engine-{e}"), &ns("m"), &mem).await.unwrap();
            for round in 0..5 {
                c.save(&tokens, 0, &(0..12).collect::<Vec<_>>()).await.unwrap();
                let got = c.load_now(&tokens, 0, &(16..28).collect::<Vec<_>>()).await.unwrap();
                assert_eq!(got.loaded_blocks, 12, "engine {e} round {round}");
                for b in 0..12 {
                    assert_eq!(mem.read_block(16 + b), expect(b), "engine {e} block {b}");
                }
            }
            c.unregister().await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    daemon.stop().await;
}

fn spawn_daemon(dir: &Path) -> KillOnDrop {
    let mut cmd = daemon_command(env!("CARGO_BIN_EXE_daemon"), dir);
    cmd.args(["--metrics-addr", "127.0.0.1:0"]).stderr(Stdio::piped());
    KillOnDrop::spawn_serving(&mut cmd, &dir.join("kvcached.sock"))
}

fn sigterm_and_wait(mut daemon: KillOnDrop) {
    let Some(mut child) = daemon.signal(libc::SIGTERM) else { return };
    let status = child.wait().unwrap();
    let mut err = String::new();
    if let Some(e) = child.stderr.take() {
        for l in BufReader::new(e).lines() {
            err.push_str(&l.unwrap());
            err.push('\n');
        }
    }
    assert!(status.success(), "daemon exited with {status}: {err}");
    assert!(err.contains("kvcached stopped"), "no graceful shutdown in log:\n{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_restart_brings_blocks_back_from_g3_and_clients_reconnect() {
    let d = tempfile::tempdir().unwrap();
    let daemon = spawn_daemon(d.path());
    let tokens = prompt(9, 24);
    let (c, mut mem) = attached_to(&d.path().join("kvcached.sock"), d.path(), "engine", 64, 9, 24).await;
    assert_eq!(c.save(&tokens, 0, &(0..24).collect::<Vec<_>>()).await.unwrap().stored, 24);
    let first_id = c.engine_id_now();
    // A load started before the restart and waited for after it.
    let op = c.load(&tokens, 0, &(40..64).collect::<Vec<_>>()).await.unwrap();
    let before = op.id();
    assert_eq!(c.wait(&op, Duration::from_secs(10)).await.unwrap().loaded_blocks, 24);
    let op = c.load(&tokens, 0, &(40..64).collect::<Vec<_>>()).await.unwrap();
    assert_ne!(op.id(), before);
    sigterm_and_wait(daemon); // drains write-through to G3
    for b in 40..64 {
        mem.write_block(b, &vec![0u8; layout(LayoutKind::LayerSeparate).block_bytes() as usize]);
    }

    let daemon = spawn_daemon(d.path());
    // The load died with the old daemon; waiting for it runs it again on the new one, from G3.
    let done = c.wait(&op, Duration::from_secs(10)).await.unwrap();
    assert_eq!((done.loaded_blocks, done.from_g3), (24, 24), "{done:?}");
    check(&mem, 9, 24, 40);
    assert_ne!(c.engine_id_now(), first_id, "re-registered under a new id");
    assert_eq!(c.poll(&op).await.unwrap().loaded_blocks, 24, "the new load's status");
    // That load read the blocks from G3 straight into the engine's slots (its segments are whole
    // pages), then, once it had answered, brought them up into G2, where the next ones find them.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let hit = c.lookup(&tokens).await.unwrap();
        if (hit.matched_blocks, hit.g2_blocks, hit.g3_blocks) == (24, 24, 0) {
            break;
        }
        assert!(Instant::now() < deadline, "not brought up into G2: {hit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let got = c.load_now(&tokens, 0, &(32..56).collect::<Vec<_>>()).await.unwrap();
    assert_eq!((got.loaded_blocks, got.from_g2), (24, 24));
    check(&mem, 9, 24, 32);
    sigterm_and_wait(daemon);
}

/// A G3 hit is read straight into a CPU engine's memory. An engine that truncates that memory
/// gets a clear error for its load, and cannot make the daemon take its failed read for a bad
/// block or a bad disk: nothing is dropped, and another engine loads the blocks right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_truncates_its_memory_cannot_make_g3_drop_blocks_it_reads() {
    let d = tempfile::tempdir().unwrap();
    let daemon = spawn_daemon(d.path());
    let tokens = prompt(12, 8);
    let (c, _mem) = attached_to(&d.path().join("kvcached.sock"), d.path(), "saver", 8, 12, 8).await;
    assert_eq!(c.save(&tokens, 0, &(0..8).collect::<Vec<_>>()).await.unwrap().stored, 8);
    drop(c);
    sigterm_and_wait(daemon); // drains write-through to G3

    let daemon = spawn_daemon(d.path());
    let bad_mem = kv(d.path(), "bad", 8);
    let bad = Client::connect(d.path().join("kvcached.sock")).await.unwrap();
    bad.register("bad", &ns("m"), &bad_mem).await.unwrap();
    std::fs::OpenOptions::new().write(true).open(d.path().join("bad")).unwrap().set_len(0).unwrap();
    let e = bad.load_now(&tokens, 0, &(0..8).collect::<Vec<_>>()).await;
    assert!(format!("{e:?}").contains("shrank under the daemon"), "{e:?}");

    // Read again the usual way after the failed read (into G2, from where the copy into the
    // truncated memory failed): nothing dropped.
    let hit = bad.lookup(&tokens).await.unwrap();
    assert_eq!(hit.matched_blocks, 8, "blocks lost to a bad destination: {hit:?}");
    let good_mem = kv(d.path(), "good", 8);
    let good = Client::connect(d.path().join("kvcached.sock")).await.unwrap();
    good.register("good", &ns("m"), &good_mem).await.unwrap();
    let got = good.load_now(&tokens, 0, &(0..8).collect::<Vec<_>>()).await.unwrap();
    assert_eq!((got.loaded_blocks, got.from_g2 + got.from_g3), (8, 8), "{got:?}");
    check(&good_mem, 12, 8, 0);
    drop((bad, good));
    sigterm_and_wait(daemon);
}

#[test]
fn example_engines_in_two_processes_hand_a_prompt_over() {
    let d = tempfile::tempdir().unwrap();
    let daemon = spawn_daemon(d.path());
    let run = |mode: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_engine"))
            .args([mode, "11", "24"])
            .env("KVCACHED_SOCKET", d.path().join("kvcached.sock"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "engine {mode} failed: {text}");
        text
    };
    assert!(run("save").contains("saved 24 blocks"));
    let load = run("load");
    assert!(load.contains("lookup: 24 of 24 blocks cached (G2 24"), "{load}");
    assert!(load.contains("24 byte-exact"), "{load}");
    sigterm_and_wait(daemon);
}

const CHILD_SOCKET: &str = "KVCACHED_TEST_CHILD_SOCKET";

/// The engine process of `kill_9_of_a_client_mid_save_leaves_no_partial_block`.
#[test]
#[ignore = "run as a child process"]
fn child_engine_saving_forever() {
    let Ok(socket) = std::env::var(CHILD_SOCKET) else { return };
    let dir = PathBuf::from(std::env::var("KVCACHED_TEST_CHILD_DIR").unwrap());
    let mut mem = kv(&dir, "child", 256);
    let c = kvclient::BlockingClient::connect(&socket).unwrap();
    c.register("child", &ns("m"), &mem).unwrap();
    for round in 0..2000u32 {
        let tokens = prompt(round, 8);
        for b in 0..8 {
            let len = layout(LayoutKind::LayerSeparate).block_bytes() as usize;
            mem.write_block(b, &synthetic_block(u64::from(round), b, len));
        }
        c.save(&tokens, 0, &(0..8).collect::<Vec<_>>()).unwrap();
        println!("saved {round}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_a_client_mid_save_leaves_no_partial_block() {
    let (d, daemon) = started().await;
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_engine_saving_forever", "--nocapture", "--test-threads=1"])
        .env(CHILD_SOCKET, &daemon.socket)
        .env("KVCACHED_TEST_CHILD_DIR", d.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let rounds = tokio::task::spawn_blocking(move || {
        let mut n = 0u32;
        for l in BufReader::new(out).lines() {
            if l.unwrap().starts_with("saved ") {
                n += 1;
                if n == 30 {
                    break;
                }
            }
        }
        n
    })
    .await
    .unwrap();
    assert_eq!(rounds, 30);
    child.kill().unwrap(); // SIGKILL, most likely mid-save
    child.wait().unwrap();

    // Every visible block of every round is complete and exact.
    let mut mem = kv(d.path(), "checker", 16);
    let c = Client::connect(&daemon.socket).await.unwrap();
    c.register("checker", &ns("m"), &mem).await.unwrap();
    for round in 0..40u32 {
        let tokens = prompt(round, 8);
        let got = c.load_now(&tokens, 0, &(0..8).collect::<Vec<_>>()).await.unwrap();
        if round < 30 {
            assert_eq!(got.loaded_blocks, 8, "round {round} was acknowledged");
        }
        let len = layout(LayoutKind::LayerSeparate).block_bytes() as usize;
        for b in 0..got.loaded_blocks {
            assert_eq!(mem.read_block(b), synthetic_block(u64::from(round), b, len), "round {round} block {b}");
        }
        mem.write_block(0, &vec![0; len]);
    }
    // The dead engine is detached once its lease runs out.
    tokio::time::sleep(Duration::from_millis(3000)).await;
    assert_eq!(c.stats().await.unwrap().engines, 1);
    daemon.stop().await;
}

/// The daemon maps an engine's KV memory and writes into it on every load: handing it the
/// daemon's own G2 pool or G3 data file as one's KV memory (to corrupt other engines' blocks or
/// read them) is refused, however the client came by the descriptor (here: root opened them,
/// through a symlink too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_cannot_register_the_daemons_own_storage() {
    let (d, daemon) = started().await;
    // Registered first: the daemon is serving, so its pool file exists.
    let (a, _ma) = attached(&daemon, d.path(), "a", 1, 2).await;
    let pool = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("kvcached-g2-"))
        .expect("the G2 pool file");
    let blocks = d.path().join("g3").join("blocks.dat");
    let link = d.path().join("innocent");
    std::os::unix::fs::symlink(&pool, &link).unwrap();
    for path in [&pool, &blocks, &link] {
        let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
        let e = kvclient::attach::attach(&daemon.socket, &[&f]).unwrap_err().to_string();
        assert!(e.contains("kvcached's own storage"), "{}: {e}", path.display());
    }
    // An engine's own file still registers, and two engines get ids nobody can count on.
    let (b, _mb) = attached(&daemon, d.path(), "b", 2, 2).await;
    let (ia, ib) = (a.engine_id_now().unwrap(), b.engine_id_now().unwrap());
    assert!(ia.abs_diff(ib) > 1 << 20, "ids {ia} and {ib} follow one another");
    daemon.stop().await;
}

/// A client that opens a request and never finishes it (stopped, wedged) cannot hold shutdown
/// forever: after `engines.drain_ms` its connection is closed, the store is flushed, and the
/// socket file, still the daemon's own, is removed; a socket file that another daemon bound at
/// the same path meanwhile is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_within_its_deadline_and_leaves_a_newer_socket() {
    use tokio::io::AsyncWriteExt;
    let d = tempfile::tempdir().unwrap();
    let mut c = config(d.path());
    c.engines.drain_ms = 300;
    let daemon = start_with(c).await;
    let (_a, _m) = attached(&daemon, d.path(), "a", 1, 2).await;
    // HTTP/2 by hand: the preface, empty SETTINGS, then the HEADERS of a Save request that
    // never ends (no END_STREAM, no body).
    let mut stalled = tokio::net::UnixStream::connect(&daemon.socket).await.unwrap();
    let mut block = Vec::new();
    block.extend_from_slice(&[0x83, 0x86]); // :method POST, :scheme http
    let path = b"/kvcached.v1.Kvcached/Save";
    block.push(0x44); // :path, literal value
    block.push(path.len() as u8);
    block.extend_from_slice(path);
    block.push(0x41); // :authority, literal value
    block.push(9);
    block.extend_from_slice(b"localhost");
    block.push(0x5f); // content-type, literal value
    block.push(16);
    block.extend_from_slice(b"application/grpc");
    let mut frames = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    frames.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]); // SETTINGS, empty
    let len = block.len();
    frames.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, 1, 0x4, 0, 0, 0, 1]);
    frames.extend_from_slice(&block);
    stalled.write_all(&frames).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sock = daemon.socket.clone();
    tokio::time::timeout(Duration::from_secs(10), daemon.stop())
        .await
        .expect("shutdown waited for the stalled request past its deadline");
    assert!(!sock.exists(), "the daemon's own socket is removed");

    // A socket file bound by someone else at the path while the daemon ran stays.
    let d2 = tempfile::tempdir().unwrap();
    let daemon = start(d2.path()).await;
    let (_b, _m) = attached(&daemon, d2.path(), "b", 2, 2).await;
    std::fs::remove_file(&daemon.socket).unwrap();
    let newer = std::os::unix::net::UnixListener::bind(&daemon.socket).unwrap();
    let sock = daemon.socket.clone();
    daemon.stop().await;
    assert!(sock.exists(), "the newer daemon's socket was removed");
    drop(newer);
}

/// The stock Python gRPC client (grpcio, stubs generated from the .proto) works over the Unix
/// socket with no channel options: grpcio sends the socket's path as `:authority`, which the
/// daemon's HTTP/2 stack would refuse. The script also hands its KV memory over with
/// `socket.send_fds` (ATTACH) and checks a save / lookup / load byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stock_grpcio_engine_over_the_socket() {
    let python = std::env::var("KVCACHED_TEST_PYTHON").unwrap_or_else(|_| {
        format!("{}/.cache/kvcached/venv-test/bin/python", std::env::var("HOME").unwrap_or_default())
    });
    assert!(Path::new(&python).exists(), "{python} missing: run scripts/test (it creates it)");
    let (d, daemon) = started().await;
    let stubs = d.path().join("stubs");
    std::fs::create_dir(&stubs).unwrap();
    let proto = concat!(env!("CARGO_MANIFEST_DIR"), "/../proto/proto");
    let stubs_made = tokio::process::Command::new(&python)
        .args(["-m", "grpc_tools.protoc", "-I", proto, "--python_out"])
        .arg(&stubs)
        .arg("--grpc_python_out")
        .arg(&stubs)
        .arg(format!("{proto}/kvcached.proto"))
        .output()
        .await
        .unwrap();
    assert!(stubs_made.status.success(), "{}", String::from_utf8_lossy(&stubs_made.stderr));
    let out = tokio::process::Command::new(&python)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/py/grpcio_engine.py"))
        .arg(&daemon.socket)
        .arg(&stubs)
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && said.trim() == "ok 2", "{said}\n{}", String::from_utf8_lossy(&out.stderr));
    daemon.stop().await;
}
