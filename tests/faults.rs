//! Faults in G3 under a running `kvcached` process: EIO on reads and writes, ENOSPC, short and
//! torn writes, latency spikes (injected into its I/O engines through `inject_faults`, the only
//! mock here), and a disk that really fills up (a small tmpfs). For each: engines keep being
//! served from G2 with bounded latency, the fault is counted in the metrics and named by
//! `/healthz`, and every block served is byte for byte what was saved.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use kvtests::node::{Node, g3_toml};
use kvtests::oracle::{Engine, ns};

const G3_WRITTEN: &str = "kvcached_writethrough_blocks_total{tier=\"g3\"}";
const G3_WRITE_ERRORS: &str = "kvcached_writethrough_errors_total{tier=\"g3\"}";
const G3_CHECKSUM: &str = "kvcached_tier_checksum_failures_total{tier=\"g3\"}";
const INJECTED: &str = "kvcached_g3_injected_faults_total";
/// Bound on a call that must not wait on the failing tier (generous: the machine is shared).
const BOUNDED: Duration = Duration::from_secs(5);
const WAIT: Duration = Duration::from_secs(30);

fn node(dir: &Path) -> Node {
    Node::start(Path::new(env!("CARGO_BIN_EXE_daemon")), dir, &g3_toml(&dir.join("g3"), 64 << 20, false), &[])
}

/// A node in `dir` ([`node`]) and an engine `e` of 128 slots on it, in namespace `model`.
async fn node_and_engine(dir: &Path, model: &str) -> (Node, Engine) {
    let n = node(dir);
    let e = Engine::attach(&n.socket(), "e", &ns(model), 128).await.unwrap();
    (n, e)
}

/// The engine leaves, then the node stops (cleanly: it must exit 0).
fn stop(n: Node, e: Engine) {
    drop(e);
    n.stop();
}

/// EIO on every G3 read: blocks only G3 held are misses (dropped, counted), G2 serves the rest
/// at once, `/healthz` says so; with reads failing at random, whatever is served is right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g3_read_errors_are_counted_misses_while_g2_serves() {
    let d = tempfile::tempdir().unwrap();
    let (mut n, mut e) = node_and_engine(d.path(), "faults/read").await;
    e.save_within(1, 16, BOUNDED).await;
    e.save_within(2, 48, BOUNDED).await;
    n.d().wait_metric(G3_WRITTEN, 64.0, WAIT);
    // Restarted: G2 is empty, G3 holds both prompts. The engine re-registers by itself.
    n.restart();
    n.set_faults("[g3]\nread_eio = 1.0\n");
    e.save_within(3, 16, BOUNDED).await;

    let (loaded, st, took) = e.load_timed(1, 16).await;
    assert_eq!(loaded, 0, "{st:?}");
    assert!(took < BOUNDED, "a load took {took:?} while G3 failed");
    assert!(n.d().metric("kvcached_g3_io_errors_total{op=\"read\"}") >= 1.0);
    assert!(n.d().metric(G3_CHECKSUM) >= 1.0);
    assert!(n.d().metric(INJECTED) >= 1.0);
    let why = n.wait_degraded(&["G3 degraded", "block reads failed", "Input/output error"], BOUNDED);
    assert!(!why.contains("blocks failed verification"), "an I/O error is not a checksum mismatch: {why}");
    let (loaded, st, took) = e.load_timed(3, 16).await;
    assert_eq!((loaded, st.from_g2), (16, 16), "{st:?}");
    assert!(took < BOUNDED, "a G2 load took {took:?} while G3 failed");

    // Half of the reads fail: the load stops at the first block it lost (each lost block is
    // dropped, never guessed), and what it served is the prompt's. (A read straight into the
    // engine's memory that fails is read again into G2 before it counts as lost: a quarter of
    // the blocks are.)
    n.set_faults("[g3]\nread_eio = 0.5\n");
    let (loaded, st, _) = e.load_timed(2, 48).await;
    assert!(loaded < 48, "with half of the reads failing all 48 blocks came through: {st:?}");
    n.set_faults("");
    let (again, st, _) = e.load_timed(2, 48).await;
    assert!(again >= loaded, "{st:?}");
    stop(n, e);
}

/// EIO and ENOSPC on G3 writes, and writes cut short: saves return at once and are served from
/// G2, the failures are counted and named by `/healthz`; once the disk works again new blocks
/// reach G3, and after a restart G3 serves exactly those (none of the failed ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g3_write_errors_keep_saves_in_g2() {
    let d = tempfile::tempdir().unwrap();
    let (mut n, mut e) = node_and_engine(d.path(), "faults/write").await;
    let faults =
        [("write_eio", "Input/output error"), ("enospc", "No space left on device"), ("short_write", "short write")];
    for (i, (fault, says)) in faults.iter().enumerate() {
        n.set_faults(&format!("[g3]\n{fault} = 1.0\n"));
        let seed = 10 + i as u64;
        e.save_within(seed, 8, BOUNDED).await;
        n.d().wait_metric(G3_WRITE_ERRORS, 8.0 * (i + 1) as f64, WAIT);
        n.wait_degraded(&["G3 degraded", "block writes failed", says], BOUNDED);
        let hit = e.client.lookup(&kvtests::oracle::prompt(seed, 8)).await.unwrap();
        assert_eq!((hit.matched_blocks, hit.g2_blocks), (8, 8), "{fault}: {hit:?}");
        let (loaded, st, took) = e.load_timed(seed, 8).await;
        assert_eq!((loaded, st.from_g2), (8, 8), "{fault}: {st:?}");
        assert!(took < BOUNDED, "{fault}: a G2 load took {took:?}");
    }
    assert!(n.d().metric("kvcached_g3_io_errors_total{op=\"write\"}") >= 24.0);
    assert_eq!(n.d().metric(G3_WRITTEN), 0.0, "a failed write was counted as written");
    n.set_faults("");
    e.save_within(20, 8, BOUNDED).await;
    n.d().wait_metric(G3_WRITTEN, 8.0, WAIT);
    n.restart();
    for (i, _) in faults.iter().enumerate() {
        let (loaded, st, _) = e.load_timed(10 + i as u64, 8).await;
        assert_eq!(loaded, 0, "a block whose write failed was indexed: {st:?}");
    }
    let (loaded, st, _) = e.load_timed(20, 8).await;
    assert_eq!((loaded, st.from_g3), (8, 8), "{st:?}");
    stop(n, e);
}

/// Torn writes (half a block reaches the disk, the write reports success): the block is indexed
/// but its checksum catches it when read; it is a miss, counted, never served. G2 serves the
/// prompt meanwhile, and once the torn copies are dropped a new save writes them whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torn_writes_are_caught_by_checksums() {
    let d = tempfile::tempdir().unwrap();
    let (mut n, mut e) = node_and_engine(d.path(), "faults/torn").await;
    // A prompt written whole first, so that the torn ones land on pages that held other bytes.
    e.save_within(29, 8, BOUNDED).await;
    n.d().wait_metric(G3_WRITTEN, 8.0, WAIT);
    n.set_faults("[g3]\ntorn_write = 1.0\n");
    e.save_within(30, 8, BOUNDED).await;
    n.d().wait_metric(G3_WRITTEN, 16.0, WAIT);
    assert!(n.d().metric(INJECTED) >= 8.0);
    // G2 holds the prompt whole: served from there, right, at once.
    let (loaded, st, took) = e.load_timed(30, 8).await;
    assert_eq!((loaded, st.from_g2), (8, 8), "{st:?}");
    assert!(took < BOUNDED, "{took:?}");
    n.set_faults("");
    n.restart();
    // Only G3 holds it now: every torn block fails its checksum and is dropped.
    let (loaded, st, _) = e.load_timed(30, 8).await;
    assert_eq!(loaded, 0, "{st:?}");
    assert!(n.d().metric(G3_CHECKSUM) >= 1.0);
    n.wait_degraded(&["G3 degraded", "blocks failed verification", "checksum mismatch"], BOUNDED);
    assert!(n.d().log().contains("G3 block failed verification"), "{}", n.d().log());
    let (loaded, st, _) = e.load_timed(29, 8).await;
    assert_eq!((loaded, st.from_g3), (8, 8), "the intact prompt is served: {st:?}");
    // Saved again: the blocks the read dropped are written anew, whole this time.
    let dropped = n.d().metric(G3_CHECKSUM);
    e.save_within(30, 8, BOUNDED).await;
    n.d().wait_metric(G3_WRITTEN, dropped, WAIT);
    n.restart();
    let (loaded, st, _) = e.load_timed(30, 8).await;
    assert_eq!((loaded, st.from_g3), (8, 8), "{st:?}");
    assert_eq!(n.d().metric(G3_CHECKSUM), 0.0);
    stop(n, e);
}

/// Latency spikes of 8 s on every G3 batch: a load of blocks only G3 holds waits for them and is
/// right; meanwhile other engines' loads from G2, saves and lookups do not wait; the slow batch
/// is counted and named by `/healthz`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g3_latency_spikes_hold_only_the_loads_that_need_g3() {
    let d = tempfile::tempdir().unwrap();
    let mut n = node(d.path());
    let namespace = ns("faults/slow");
    let mut a = Engine::attach(&n.socket(), "a", &namespace, 128).await.unwrap();
    a.save_within(40, 16, BOUNDED).await;
    n.d().wait_metric(G3_WRITTEN, 16.0, WAIT);
    n.restart();
    let mut b = Engine::attach(&n.socket(), "b", &namespace, 128).await.unwrap();
    b.save_within(41, 16, BOUNDED).await;
    n.set_faults("[g3]\nlatency_ms = 8000\nlatency = 1.0\n");

    let slow = tokio::spawn(async move {
        let r = a.load_timed(40, 16).await;
        (a, r)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    let (loaded, st, took) = b.load_timed(41, 16).await;
    assert_eq!((loaded, st.from_g2), (16, 16), "{st:?}");
    assert!(took < BOUNDED, "a G2 load waited {took:?} on a slow G3");
    b.save_within(42, 16, BOUNDED).await;
    let hit = b.client.lookup(&kvtests::oracle::prompt(40, 16)).await.unwrap();
    assert_eq!(hit.matched_blocks, 16, "{hit:?}");
    assert!(t0.elapsed() < BOUNDED * 2, "G2 work waited {:?} on a slow G3", t0.elapsed());

    let (a, (loaded, st, took)) = slow.await.unwrap();
    assert_eq!((loaded, st.from_g3), (16, 16), "{st:?}");
    assert!(took >= Duration::from_secs(7), "the injected latency did not apply: {took:?}");
    assert!(took < Duration::from_secs(8) + WAIT, "{took:?}");
    assert!(n.d().metric("kvcached_g3_slow_batches_total") >= 1.0);
    n.wait_degraded(&["G3 degraded", "batches slower than 5 s"], BOUNDED);
    n.set_faults("");
    drop((a, b));
    n.stop();
}

/// A mount of `size` for G3 at `at`, unmounted when dropped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Option<Self> {
        std::fs::create_dir_all(at).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .output()
            .ok()?;
        out.status.success().then(|| Self(at.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).output();
    }
}

/// Fills the filesystem under `dir` with a file of its own but for `leave` bytes.
fn fill(dir: &Path, leave: u64) {
    use std::io::Write;
    let mut f = std::fs::File::create(dir.join("filler")).unwrap();
    let chunk = vec![0x5Au8; 64 << 10];
    let mut n = 0u64;
    while f.write_all(&chunk).is_ok() {
        n += chunk.len() as u64;
    }
    assert!(n > leave, "the filesystem had only {n} bytes free");
    f.set_len(n - leave).unwrap();
}

/// The disk under G3 really fills up: a 40 MiB tmpfs holds G3 (its 16 MiB data file reserved at
/// start, and its index). G3 first fills its own space and evicts (no error). Then another file
/// takes all but 1 MiB of the disk and the daemon restarts, so that RocksDB cannot reserve
/// space ahead for the index's log: its writes soon fail. Saves keep working from G2 and are
/// served from there, right; the failures are counted and named by `/healthz`; once space is
/// freed G3 writes again by itself (RocksDB retries every 5 s once its 8 MiB reserve is free),
/// and what it wrote then is there after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_that_fills_up() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: mounting a tmpfs needs root (CI runs as root)");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let disk = d.path().join("disk");
    let _mount = Tmpfs::mount(&disk, "40m").expect("mount -t tmpfs (as root)");
    let mut n = Node::start(
        Path::new(env!("CARGO_BIN_EXE_daemon")),
        &d.path().join("node"),
        &g3_toml(&disk.join("g3"), 16 << 20, true),
        &[],
    );
    let mut e = Engine::attach(&n.socket(), "e", &ns("faults/full"), 128).await.unwrap();
    // More than G3 holds (2048 pages of 8 KiB): it evicts and keeps taking blocks.
    for seed in 0..40 {
        e.save_within(100 + seed, 64, BOUNDED).await;
    }
    n.d().wait_metric(G3_WRITTEN, 2560.0, WAIT);
    assert!(n.d().metric("kvcached_tier_evictions_total{tier=\"g3\"}") > 0.0);
    assert_eq!(n.d().metric(G3_WRITE_ERRORS), 0.0, "G3's own space filling up is eviction, not an error");
    assert_eq!(n.healthz().0, 200, "{:?}", n.healthz());

    n.halt();
    fill(&disk, 1 << 20);
    n.start_again();
    let mut seed = 40;
    while n.d().metric(G3_WRITE_ERRORS) < 1.0 {
        assert!(seed < 400, "G3 never ran out of space\n{}", n.d().log());
        e.save_within(100 + seed, 64, BOUNDED).await;
        seed += 1;
    }
    let full = seed;
    for s in full..full + 8 {
        e.save_within(100 + s, 64, BOUNDED).await;
    }
    n.wait_degraded(&["G3 degraded", "block writes failed", "No space left on device"], BOUNDED);
    assert!(n.d().metric("kvcached_g3_io_errors_total{op=\"write\"}") >= 1.0);
    assert!(n.d().log().contains("G3 write failed"), "{}", n.d().log());
    for s in full..full + 8 {
        let (loaded, st, took) = e.load_timed(100 + s, 64).await;
        assert_eq!((loaded, st.from_g2), (64, 64), "seed {s}: {st:?}");
        assert!(took < BOUNDED, "a G2 load took {took:?} with the disk full");
    }

    // Space freed: G3 takes blocks again within RocksDB's retry interval (5 s), with no
    // restart; saves go on meanwhile.
    std::fs::remove_file(disk.join("filler")).unwrap();
    let written = n.d().metric(G3_WRITTEN);
    let deadline = Instant::now() + WAIT;
    let mut seed = full + 8;
    while n.d().metric(G3_WRITTEN) <= written {
        assert!(
            Instant::now() < deadline,
            "G3 did not write again once space was freed\n{}",
            std::fs::read_to_string(disk.join("g3/index/LOG")).unwrap_or_default()
        );
        e.save_within(100 + seed, 64, BOUNDED).await;
        seed += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let recovered = seed;
    for s in recovered..recovered + 4 {
        e.save_within(100 + s, 64, BOUNDED).await;
    }
    n.d().wait_metric(G3_WRITTEN, written + 4.0 * 64.0, WAIT);
    n.restart();
    assert!(!n.d().log().contains("unusable records"), "G3 needed repair\n{}", n.d().log());
    for s in recovered..recovered + 4 {
        let (loaded, st, _) = e.load_timed(100 + s, 64).await;
        assert_eq!((loaded, st.from_g3), (64, 64), "seed {s} after the restart: {st:?}");
    }
    stop(n, e);
}
