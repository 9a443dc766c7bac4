//! The GPU engines' path without a GPU: a `kvcached` process with `inject_faults` `[g1]
//! emulate` serves its engines' shared memory as an emulated device's
//! (`kvtiers::copy::fake::FakeDevice`: worker threads standing for CUDA streams), so a save's
//! copies are queued many blocks deep and a load's copies read held G2 blocks, exactly as for
//! a CUDA engine; failures are injected into those copies. Every block served is checked byte
//! for byte.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use kvtests::node::Node;
use kvtests::oracle::{Engine, ns};

const EMULATED: &str = "[g1]\nemulate = true\ndelay_us = 300\n";
const SAVE_FAILED: &str = "kvcached_g1_copy_failures_total{op=\"save\"}";
const LOAD_FAILED: &str = "kvcached_g1_copy_failures_total{op=\"load\"}";
const BOUNDED: Duration = Duration::from_secs(30);

/// A node in `dir` with its faults file saying `faults` before the engine registers (the
/// emulation is chosen at registration), and an engine of 128 slots on it.
async fn emulated(dir: &Path, faults: &str, model: &str) -> (Node, Engine) {
    let n = Node::start(Path::new(env!("CARGO_BIN_EXE_daemon")), dir, "", &[]);
    n.set_faults(faults);
    let e = Engine::attach(&n.socket(), "gpu-emulated", &ns(model), 128).await.unwrap();
    assert!(n.d().log().contains("emulated GPU"), "the engine is not on the emulated device:\n{}", n.d().log());
    (n, e)
}

/// Many blocks' copies in flight at once, each save's blocks visible only once copied, and
/// every byte of a load right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_copies_save_and_load_every_byte() {
    let d = tempfile::tempdir().unwrap();
    let (n, mut e) = emulated(d.path(), EMULATED, "g1/queued").await;
    e.save_within(1, 48, BOUNDED).await;
    let (loaded, st, _) = e.load_timed(1, 48).await;
    assert_eq!((loaded, st.from_g2), (48, 48), "{st:?}");
    // The same blocks again: already present, nothing copied twice.
    let again = e.save(1, 48, 0).await.unwrap();
    assert_eq!((again.stored, again.already_present), (0, 48), "{again:?}");
    assert_eq!(n.d().metric(SAVE_FAILED) + n.d().metric(LOAD_FAILED), 0.0);
    drop(e);
    n.stop();
    // The device's own account, at the engine's detach: its copies overlapped.
    let log = std::fs::read_to_string(d.path().join("daemon.log")).unwrap_or_default();
    let line = log.lines().find(|l| l.contains("fake device closed")).unwrap_or_else(|| panic!("{log}"));
    let most: usize = field(line, "max_in_flight").parse().unwrap();
    assert!(most > 1, "the copies never overlapped: {line}");
}

/// A copy that fails during a save drops that block (the save says so, the block is never
/// served); during a load it fails the load with the reason. Both are counted, and no wrong
/// byte reaches the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_copy_is_a_counted_miss_never_wrong_kv() {
    let d = tempfile::tempdir().unwrap();
    let (n, mut e) = emulated(d.path(), EMULATED, "g1/fails").await;
    e.save_within(1, 32, BOUNDED).await;

    // Every 7th copy of the save fails: those blocks are dropped, the rest stored.
    n.set_faults("[g1]\nemulate = true\nfail_every = 7\n");
    let r = e.save(2, 32, 0).await.unwrap();
    assert!(r.failed >= 1 && r.stored + r.failed == 32, "{r:?}");
    assert!(r.error.contains("GPU memory"), "{r:?}");
    assert!(n.d().metric(SAVE_FAILED) >= 1.0);
    // The chain is served up to its first dropped block, every byte of it right.
    n.set_faults(EMULATED);
    let (loaded, st, _) = e.load_timed(2, 32).await;
    assert!(loaded < 32, "a block whose copy failed was served: {st:?}");

    // Every 5th copy of a load fails: the load fails, naming why; what it claimed is right.
    n.set_faults("[g1]\nemulate = true\nfail_every = 5\n");
    let slots: Vec<u32> = (64..96).collect();
    let failed = e.client.load_now(&kvtests::oracle::prompt(1, 32), 0, &slots).await;
    let err = failed.expect_err("a load whose copy failed was reported whole").to_string();
    assert!(err.contains("GPU memory"), "{err}");
    assert!(n.d().metric(LOAD_FAILED) >= 1.0);

    // Healthy again: the whole prompt, every byte.
    n.set_faults(EMULATED);
    let (loaded, st, _) = e.load_timed(1, 32).await;
    assert_eq!(loaded, 32, "{st:?}");
    drop(e);
    n.stop();
}

/// A save whose engine hashes name one chunk twice (a vLLM offloading job may) stores it once
/// and answers at once: the second reservation waits for the first block's copy instead of for
/// a commit only the same save could make.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_named_twice_in_one_save_is_stored_once() {
    use kvproto::{EngineHashes, HashScheme, KeySource};
    let d = tempfile::tempdir().unwrap();
    let (n, mut e) = emulated(d.path(), EMULATED, "g1/twice").await;
    for b in 0..4 {
        e.mem.write_block(b, &kvtests::oracle::block(7, b));
    }
    e.mem.write_block(4, &kvtests::oracle::block(7, 1));
    let hashes: Vec<Vec<u8>> = [1u8, 2, 3, 4, 2].iter().map(|&h| vec![h; 32]).collect();
    let src = KeySource::Hashes(EngineHashes { scheme: HashScheme::Vllm, hashes });
    let t0 = std::time::Instant::now();
    let r = e.client.save_keyed(&[], &src, 0, &[0, 1, 2, 3, 4]).await.unwrap();
    assert_eq!((r.stored, r.already_present, r.failed), (4, 1, 0), "{r:?}");
    // Not a timing assertion of speed: the stall this guards against is the 5 s a reservation
    // waits for a key being written.
    assert!(t0.elapsed() < Duration::from_secs(4), "the save waited on itself: {:?}", t0.elapsed());
    let st = e.client.load_now_keyed(&[], &src, 0, &[64, 65, 66, 67, 68]).await.unwrap();
    assert_eq!(st.loaded_blocks, 5, "{st:?}");
    for (slot, b) in [(64, 0), (65, 1), (66, 2), (67, 3), (68, 1)] {
        assert!(e.mem.read_block(slot) == kvtests::oracle::block(7, b), "slot {slot}");
    }
    drop(e);
    n.stop();
}

/// Blocks only G3 holds (the daemon restarted: its G2 is empty) come up into G2 and are copied
/// into the engine's memory queued on the device, from the G2 blocks they landed in, like G2
/// hits: every byte right, many copies in flight (not one synchronous copy per block).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_only_g3_holds_are_queued_on_the_device_too() {
    let d = tempfile::tempdir().unwrap();
    let toml = kvtests::node::g3_toml(&d.path().join("g3"), 64 << 20, false);
    let mut n = kvtests::node::Node::start(Path::new(env!("CARGO_BIN_EXE_daemon")), d.path(), &toml, &[]);
    n.set_faults(EMULATED);
    let mut e = Engine::attach(&n.socket(), "gpu-emulated", &ns("g1/g3"), 128).await.unwrap();
    e.save_within(3, 40, BOUNDED).await;
    n.restart();
    let (loaded, st, _) = e.load_timed(3, 40).await;
    assert_eq!((loaded, st.from_g3), (40, 40), "{st:?}");
    assert_eq!(n.d().metric(LOAD_FAILED), 0.0);
    drop(e);
    n.stop();
    // The restarted daemon's device served this load alone: its copies were queued, many in
    // flight (a block copied past the queue is one synchronous copy, one at a time).
    let log = std::fs::read_to_string(d.path().join("daemon.log")).unwrap_or_default();
    let line = log.lines().rfind(|l| l.contains("fake device closed")).unwrap_or_else(|| panic!("{log}"));
    let (submitted, most): (u64, usize) =
        (field(line, "submissions").parse().unwrap(), field(line, "max_in_flight").parse().unwrap());
    assert!(submitted >= 40 && most > 1, "G3 blocks were copied one at a time: {line}");
}

/// `key=value` of a log line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    let at = line.find(&format!("{key}=")).unwrap_or_else(|| panic!("no {key} in {line}")) + key.len() + 1;
    line[at..].split_whitespace().next().unwrap_or("")
}
