//! G3-specific behaviour: restart recovery (clean and after `kill -9`), corruption, a full
//! disk, and layout changes.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvtiers::disk::io::{EngineFactory, IoBackend, IoEngine, IoKind, IoOp, IoProgress};
use kvtiers::disk::psync::PsyncEngine;
use kvtiers::{BlockBuf, BlockRef, BlockStore, DiskTier, Tier, TierError, TierExt, WriteThroughConfig};

fn put(t: &dyn Tier, chain: u32, i: u32, len: usize) {
    let k = key(chain, i);
    let data = content(&k, len);
    t.put(BlockRef { key: k, meta: meta(chain, i, len), data: &data }).unwrap();
}

#[test]
fn clean_restart_serves_every_block() {
    let d = tempfile::tempdir().unwrap();
    let lens = [1usize, 5000, PAGE, 3 * PAGE + 9, 1 << 20];
    {
        let t = disk(d.path(), 16 << 20, IoBackend::Auto);
        for (i, &len) in lens.iter().enumerate() {
            put(&*t, 1, i as u32, len);
        }
        t.flush().unwrap();
    }
    let t = disk(d.path(), 16 << 20, IoBackend::Auto);
    assert_eq!(t.usage().blocks, lens.len());
    // New blocks must not land on recovered pages.
    for i in 0..20 {
        put(&*t, 2, i, PAGE + 1);
    }
    let mut buf = BlockBuf::new();
    for (i, &len) in lens.iter().enumerate() {
        let m = t.get(&key(1, i as u32), &mut buf).unwrap().expect("recovered");
        assert_eq!(m, meta(1, i as u32, len));
        assert_eq!(&buf[..], &content(&key(1, i as u32), len)[..]);
    }
    for i in 0..20 {
        assert!(t.get(&key(2, i), &mut buf).unwrap().is_some());
        assert_eq!(&buf[..], &content(&key(2, i), PAGE + 1)[..]);
    }
    assert_eq!(t.stats().checksum_failures, 0);
}

#[test]
fn restart_with_smaller_capacity_drops_out_of_range_blocks() {
    let d = tempfile::tempdir().unwrap();
    {
        let t = disk(d.path(), 8 * PAGE as u64, IoBackend::Psync);
        for i in 0..4 {
            put(&*t, 3, i, 2 * PAGE);
        }
    }
    let t = disk(d.path(), 4 * PAGE as u64, IoBackend::Psync);
    assert_eq!(t.usage().blocks, 2, "blocks beyond the new capacity are dropped");
    let mut buf = BlockBuf::new();
    assert!(t.get(&key(3, 0), &mut buf).unwrap().is_some());
    assert_eq!(&buf[..], &content(&key(3, 0), 2 * PAGE)[..]);
}

#[test]
fn page_size_change_is_a_clear_error() {
    let d = tempfile::tempdir().unwrap();
    drop(disk(d.path(), 4 << 20, IoBackend::Psync));
    let mut cfg = disk_cfg(d.path(), 4 << 20);
    cfg.page_size = 2 * PAGE;
    let err = DiskTier::open(&cfg).unwrap_err();
    assert!(matches!(err, TierError::Config { field: "g3 page_size", .. }), "{err}");
}

#[test]
fn flipped_bytes_are_a_counted_miss_never_data() {
    let d = tempfile::tempdir().unwrap();
    let t = disk(d.path(), 8 << 20, IoBackend::Auto);
    put(&*t, 4, 0, 100_000);
    put(&*t, 5, 0, 100_000);
    t.flush().unwrap();
    // Block (4,0) sits on the first pages: flip a byte in the middle of it.
    let f = std::fs::OpenOptions::new().read(true).write(true).open(d.path().join("blocks.dat")).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, 5000).unwrap();
    b[0] ^= 0x40;
    f.write_all_at(&b, 5000).unwrap();
    f.sync_all().unwrap();

    let mut buf = BlockBuf::new();
    assert!(t.get(&key(4, 0), &mut buf).unwrap().is_none(), "corrupt block must be a miss");
    assert_eq!(t.stats().checksum_failures, 1);
    assert!(!t.contains(&key(4, 0)), "corrupt block is dropped");
    assert!(t.get(&key(4, 0), &mut buf).unwrap().is_none());
    assert_eq!(t.stats().checksum_failures, 1, "counted once");
    // The neighbour is intact.
    assert!(t.get(&key(5, 0), &mut buf).unwrap().is_some());
    assert_eq!(&buf[..], &content(&key(5, 0), 100_000)[..]);
    // And the drop is durable: after a restart the block stays gone.
    drop(t);
    let t = disk(d.path(), 8 << 20, IoBackend::Auto);
    assert!(!t.contains(&key(4, 0)));
    assert!(t.contains(&key(5, 0)));
}

/// Fault injection: every write fails with ENOSPC, as on a full filesystem.
#[derive(Debug)]
struct NoSpace(PsyncEngine);

impl IoEngine for NoSpace {
    fn name(&self) -> &'static str {
        "nospace"
    }
    unsafe fn run(&mut self, fd: i32, ops: &[IoOp], progress: &mut dyn IoProgress) -> std::io::Result<()> {
        if ops.iter().any(|o| o.kind == IoKind::Write) {
            return Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
        }
        // SAFETY: the caller of `run` vouches for the ops' memory.
        unsafe { self.0.run(fd, ops, progress) }
    }
}

#[test]
fn full_disk_keeps_g2_serving_and_is_counted() {
    let d = tempfile::tempdir().unwrap();
    let factory: EngineFactory = Arc::new(|| Ok(Box::new(NoSpace(PsyncEngine)) as Box<dyn IoEngine>));
    let g3 = Arc::new(DiskTier::open_with_engine(&disk_cfg(&d.path().join("g3"), 8 << 20), factory).unwrap());
    let g2 = host(d.path(), 8 << 20);
    let store = BlockStore::with_tiers(g2, vec![as_tier(Arc::clone(&g3))], WriteThroughConfig::default()).unwrap();
    for i in 0..10 {
        let k = key(6, i);
        store.put(k, meta(6, i, 70_000), &content(&k, 70_000)).unwrap();
    }
    store.flush().unwrap();
    let s = store.stats();
    assert_eq!(s.writethrough_errors, 10);
    assert_eq!(g3.stats().put_errors, 10);
    assert_eq!(g3.usage().blocks, 0);
    assert_eq!(g3.usage().used_bytes, 0, "failed writes release their space");
    let mut buf = BlockBuf::new();
    for i in 0..10 {
        let hit = store.get(&key(6, i), &mut buf).unwrap().expect("G2 still serves");
        assert_eq!(hit.tier, kvproto::TierKind::G2Host);
        assert_eq!(&buf[..], &content(&key(6, i), 70_000)[..]);
    }
}

#[test]
fn capacity_beyond_free_space_fails_at_open() {
    let d = tempfile::tempdir().unwrap();
    let cfg = disk_cfg(d.path(), 1 << 60);
    let err = DiskTier::open(&cfg).unwrap_err();
    assert!(matches!(err, TierError::Config { .. }), "{err}");
}

const CHILD_ENV: &str = "KVTIERS_CHILD_DIR";

/// Not a test by itself: the child process of `kill_9_mid_write_through_loses_no_integrity`.
#[test]
#[ignore = "run as a child process by kill_9_mid_write_through_loses_no_integrity"]
fn child_writer() {
    let Ok(dir) = std::env::var(CHILD_ENV) else { return };
    let dir = std::path::PathBuf::from(dir);
    let g2 = host(&dir, 64 << 20);
    let g3 = disk(&dir.join("g3"), 256 << 20, IoBackend::Auto);
    let store = BlockStore::with_tiers(g2, vec![as_tier(g3)], WriteThroughConfig { queue: 64, batch: 8 }).unwrap();
    for i in 0..20_000u32 {
        let k = key(1000 + i, 0);
        let len = 50_000 + (i as usize % 7) * 30_000;
        store.put(k, meta(1000 + i, 0, len), &content(&k, len)).unwrap();
        println!("put {i}");
        if i % 50 == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

#[test]
fn kill_9_mid_write_through_loses_no_integrity() {
    let d = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args(["--ignored", "--exact", "child_writer", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, d.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut puts = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    for line in BufReader::new(stdout).lines() {
        if line.unwrap().starts_with("put ") {
            puts += 1;
        }
        if puts >= 600 || Instant::now() > deadline {
            break;
        }
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(puts >= 600, "child made only {puts} puts");

    let g3 = disk(&d.path().join("g3"), 256 << 20, IoBackend::Auto);
    let keys = g3.keys();
    assert!(!keys.is_empty(), "some write-through completed before the kill");
    let mut buf = BlockBuf::new();
    for (k, m) in &keys {
        let got = g3.get(k, &mut buf).unwrap().expect("an indexed block is complete");
        assert_eq!(got, *m);
        assert_eq!(&buf[..], &content(k, m.len as usize)[..], "block {k} has wrong bytes");
    }
    assert_eq!(g3.stats().checksum_failures, 0);
}

/// Fault injection: while armed for a kind, op 1 of every batch of that kind fails (EIO) and
/// the others run for real.
#[derive(Debug)]
struct FailSecondOp {
    inner: Box<dyn IoEngine>,
    armed: Arc<std::sync::Mutex<Option<IoKind>>>,
}

impl IoEngine for FailSecondOp {
    fn name(&self) -> &'static str {
        "fail-second-op"
    }
    unsafe fn run(&mut self, fd: i32, ops: &[IoOp], progress: &mut dyn IoProgress) -> std::io::Result<()> {
        let armed = *self.armed.lock().unwrap();
        if ops.len() < 2 || armed != Some(ops[1].kind) {
            // SAFETY: as above.
            return unsafe { self.inner.run(fd, ops, progress) };
        }
        struct Skip<'a>(&'a mut dyn IoProgress);
        impl IoProgress for Skip<'_> {
            fn started(&mut self) {
                self.0.started()
            }
            fn completed(&mut self, i: usize, ok: bool) {
                self.0.completed(if i >= 1 { i + 1 } else { i }, ok)
            }
        }
        let rest: Vec<IoOp> = ops.iter().enumerate().filter(|(i, _)| *i != 1).map(|(_, o)| *o).collect();
        // SAFETY: `rest` is a subset of the caller's ops.
        let r = unsafe { self.inner.run(fd, &rest, &mut Skip(progress)) };
        progress.completed(1, false);
        r.and(Err(std::io::Error::from_raw_os_error(libc::EIO)))
    }
}

/// An engine factory whose engines fail op 1 of every batch of the kind `armed` holds.
fn fail_second_op(armed: &Arc<std::sync::Mutex<Option<IoKind>>>) -> EngineFactory {
    let armed = Arc::clone(armed);
    Arc::new(move || {
        let inner = kvtiers::disk::io::engine_factory(IoBackend::Auto, 32)()?;
        Ok(Box::new(FailSecondOp { inner, armed: Arc::clone(&armed) }) as Box<dyn IoEngine>)
    })
}

/// Block bytes of `len` (`content(k, len)`) that do not start on a 4 KiB boundary, which a plain
/// Vec sometimes does: under 128 KiB, such a block is one write op (an aligned block's tail
/// would go through a bounce buffer, a second op). The block is `buf[1..]`.
fn unaligned(k: &kvproto::BlockKey, len: usize) -> Vec<u8> {
    [vec![0u8], content(k, len)].concat()
}

/// One block of a batch failing its I/O fails only that block, written or read, with the
/// I/O on dedicated threads, on the caller's, and with threads except for small batches.
#[test]
fn a_failed_op_fails_only_its_block() {
    for (io_threads, inline_max) in [(2, 0), (0, 0), (2, kvtiers::disk::io::INLINE_MAX)] {
        let d = tempfile::tempdir().unwrap();
        let armed = Arc::new(std::sync::Mutex::new(None));
        let factory = fail_second_op(&armed);
        let mut cfg = disk_cfg(d.path(), 8 << 20);
        cfg.io_threads = io_threads;
        cfg.inline_read_max = inline_max;
        cfg.inline_write_max = inline_max;
        let t = DiskTier::open_with_engine(&cfg, factory).unwrap();
        let len = PAGE + 1000;
        let (ka, kb) = (key(9, 0), key(9, 1));
        let (da_buf, db_buf) = (unaligned(&ka, len), unaligned(&kb, len));
        let (da, db) = (&da_buf[1..], &db_buf[1..]);
        let both = [
            BlockRef { key: ka, meta: meta(9, 0, len), data: da },
            BlockRef { key: kb, meta: meta(9, 1, len), data: db },
        ];
        *armed.lock().unwrap() = Some(IoKind::Write);
        let r = t.put_batch(&both);
        assert!(matches!(r[0], Ok(true)), "io_threads {io_threads}: {r:?}");
        assert!(r[1].is_err(), "io_threads {io_threads}: {r:?}");
        assert!(t.contains(&ka) && !t.contains(&kb));
        *armed.lock().unwrap() = None;
        assert!(matches!(t.put_batch(&both)[1], Ok(true)));

        *armed.lock().unwrap() = Some(IoKind::Read);
        let mut outs = [BlockBuf::new(), BlockBuf::new()];
        let got = t.get_batch(&[ka, kb], &mut outs);
        assert!(matches!(got[0], Ok(Some(_))), "io_threads {io_threads}: {got:?}");
        assert_eq!(&outs[0][..], da);
        assert!(matches!(got[1], Ok(None)), "a block that could not be read is a miss");
        assert!(!t.contains(&kb), "and is dropped");
        assert_eq!(t.stats().checksum_failures, 1);
        *armed.lock().unwrap() = None;
        let mut out = BlockBuf::new();
        assert!(t.get(&ka, &mut out).unwrap().is_some());
        assert_eq!(&out[..], da);
    }
}

/// A small batch runs on the calling thread with an engine made for it; where none can be made
/// (the factory fails, e.g. no memory for another io_uring ring) the batch goes to the I/O
/// threads and still succeeds (the write tries first, and its failure turns running on the
/// caller off for the read too).
#[test]
fn a_small_batch_goes_to_the_threads_when_no_engine_can_be_made_for_the_caller() {
    let d = tempfile::tempdir().unwrap();
    let made = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let m = Arc::clone(&made);
    let factory: EngineFactory = Arc::new(move || {
        // The two I/O threads get theirs; every engine asked for after that cannot be made.
        if m.fetch_add(1, std::sync::atomic::Ordering::SeqCst) >= 2 {
            return Err(std::io::Error::other("no memory for another ring"));
        }
        kvtiers::disk::io::engine_factory(IoBackend::Auto, 32)()
    });
    let mut cfg = disk_cfg(d.path(), 8 << 20);
    cfg.io_threads = 2;
    let t = DiskTier::open_with_engine(&cfg, factory).unwrap();
    let k = key(7, 0);
    let data = content(&k, 64 << 10);
    assert!(matches!(t.put_batch(&[BlockRef { key: k, meta: meta(7, 0, data.len()), data: &data }])[0], Ok(true)));
    let mut out = BlockBuf::new();
    assert!(t.get(&k, &mut out).unwrap().is_some());
    assert_eq!(&out[..], &data[..]);
    assert!(made.load(std::sync::atomic::Ordering::SeqCst) > 2, "the write tried to run on the caller first");
}

#[derive(Default)]
struct Record(Vec<(usize, bool)>, bool);

impl IoProgress for Record {
    fn started(&mut self) {
        assert!(self.0.is_empty(), "started after a completion");
        self.1 = true;
    }
    fn completed(&mut self, index: usize, ok: bool) {
        assert!(self.1, "completed before started");
        self.0.push((index, ok));
    }
}

/// A batch in which one block's write fails: a restart, with or without fsync, finds the block
/// that was written, byte-exact, and no record of the one that failed, whose pages are free.
#[test]
fn a_failed_write_leaves_no_record_for_a_restart() {
    for fsync in [false, true] {
        let d = tempfile::tempdir().unwrap();
        let mut cfg = disk_cfg(d.path(), 8 << 20);
        cfg.fsync = fsync;
        let len = PAGE + 1000;
        let used = (len.div_ceil(PAGE) * PAGE) as u64;
        let (ka, kb) = (key(12, 0), key(12, 1));
        let (da_buf, db_buf) = (unaligned(&ka, len), unaligned(&kb, len));
        let (da, db) = (&da_buf[1..], &db_buf[1..]);
        {
            let armed = Arc::new(std::sync::Mutex::new(Some(IoKind::Write)));
            let t = DiskTier::open_with_engine(&cfg, fail_second_op(&armed)).unwrap();
            let both = [
                BlockRef { key: ka, meta: meta(12, 0, len), data: da },
                BlockRef { key: kb, meta: meta(12, 1, len), data: db },
            ];
            let r = t.put_batch(&both);
            assert!(matches!(r[0], Ok(true)) && r[1].is_err(), "fsync {fsync}: {r:?}");
            assert_eq!(t.usage().used_bytes, used, "fsync {fsync}: the failed block's pages are free");
            t.flush().unwrap();
        }
        let t = disk(d.path(), 8 << 20, IoBackend::Auto);
        let mut out = BlockBuf::new();
        assert!(t.get(&ka, &mut out).unwrap().is_some(), "fsync {fsync}");
        assert_eq!(&out[..], da);
        assert!(!t.contains(&kb), "fsync {fsync}: no record of the failed write");
        assert_eq!(t.usage().blocks, 1);
        assert_eq!(t.usage().used_bytes, used);
        assert_eq!(t.stats().checksum_failures, 0);
    }
}

/// An op that fails (here: a read past the end of the file) fails alone: every other op of the
/// batch still runs, also those beyond the ring's depth, with each engine.
#[test]
fn engines_run_every_op_of_a_batch_past_a_failed_one() {
    use std::os::fd::AsRawFd;
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("f");
    let data: Vec<u8> = (0..5 * 4096).map(|i| (i % 251) as u8).collect();
    std::fs::write(&path, &data).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let mut engines: Vec<Box<dyn IoEngine>> = vec![Box::new(PsyncEngine)];
    match kvtiers::disk::uring::UringEngine::new(2) {
        Ok(u) => engines.push(Box::new(u)),
        Err(e) => eprintln!("io_uring unavailable here ({e}); pread/pwrite only"),
    }
    for mut engine in engines {
        let mut bufs: Vec<BlockBuf> = (0..6).map(|_| BlockBuf::zeroed(4096)).collect();
        let ops: Vec<IoOp> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| IoOp {
                kind: IoKind::Read,
                // Op 1 starts past the end of the file.
                offset: if i == 1 { 1 << 20 } else { (i.min(5) as u64 % 5) * 4096 },
                addr: b.full_mut().as_mut_ptr() as usize,
                len: 4096,
            })
            .collect();
        let mut seen = Record::default();
        // SAFETY: every op reads into one of `bufs`, alive and untouched until `run` returns.
        let r = unsafe { engine.run(file.as_raw_fd(), &ops, &mut seen) };
        assert!(r.is_err(), "{}: the failure is returned", engine.name());
        seen.0.sort();
        let want: Vec<(usize, bool)> = (0..6).map(|i| (i, i != 1)).collect();
        assert_eq!(seen.0, want, "{}", engine.name());
        for (i, b) in bufs.iter().enumerate().filter(|(i, _)| *i != 1) {
            let at = (i % 5) * 4096;
            assert_eq!(&b[..], &data[at..at + 4096], "{}: op {i}", engine.name());
        }
    }
}

/// Blocks read lately wait for their recency tick to be written in a batch; waiting there must
/// not keep them from eviction (a full G3 of such blocks refused every put).
#[test]
fn blocks_read_lately_stay_evictable() {
    let d = tempfile::tempdir().unwrap();
    let t = disk(d.path(), 4 * PAGE as u64, IoBackend::Psync);
    for c in 1..=4 {
        put(&*t, c, 0, PAGE);
    }
    let mut out = BlockBuf::new();
    for c in 1..=4 {
        assert!(t.get(&key(c, 0), &mut out).unwrap().is_some());
    }
    // Full, nothing pinned: the least recently used block goes.
    put(&*t, 5, 0, PAGE);
    assert!(t.get(&key(1, 0), &mut out).unwrap().is_none(), "block 1 was the least recently used");
    assert!(t.get(&key(5, 0), &mut out).unwrap().is_some());
    assert_eq!(&out[..], &content(&key(5, 0), PAGE)[..]);
}

/// Index records a restart must not trust: one naming ~2^32 pages (dropped before its page
/// list is built), one naming a page twice, and a stale record naming the pages of a block
/// written after it (the later write wins: it overwrote the earlier block's data).
#[test]
fn restart_drops_huge_duplicated_and_stale_records_and_keeps_the_newer_block() {
    use kvtiers::disk::index::{DiskIndex, IndexEntry};
    let d = tempfile::tempdir().unwrap();
    {
        let t = disk(d.path(), 16 * PAGE as u64, IoBackend::Psync);
        put(&*t, 1, 0, PAGE); // page 0
        put(&*t, 1, 1, 2 * PAGE); // pages 1-2
        t.flush().unwrap();
    }
    {
        let index = DiskIndex::open(&d.path().join("index"), PAGE).unwrap();
        let record = |len: u64, runs: Vec<(u32, u32)>| IndexEntry {
            meta: kvtiers::BlockMeta { namespace: NS, parent: None, len, owner: None },
            checksum: 1,
            sum_kind: kvtiers::SumKind::Crc64,
            tick: 0, // older than every block put above
            runs,
        };
        let puts = [
            (key(8, 0), record(u64::from(u32::MAX) * PAGE as u64, vec![(0, u32::MAX)])),
            (key(8, 1), record(2 * PAGE as u64, vec![(5, 1), (5, 1)])),
            (key(9, 0), record(2 * PAGE as u64, vec![(0, 2)])),
        ];
        index.write(&puts, &[], true).unwrap();
    }
    let t = disk(d.path(), 16 * PAGE as u64, IoBackend::Psync);
    assert_eq!(t.usage().blocks, 2, "only the two real blocks come back");
    let mut out = BlockBuf::new();
    for (i, len) in [(0, PAGE), (1, 2 * PAGE)] {
        assert!(t.get(&key(1, i), &mut out).unwrap().is_some(), "block {i} was dropped");
        assert_eq!(&out[..], &content(&key(1, i), len)[..]);
    }
    for k in [key(8, 0), key(8, 1), key(9, 0)] {
        assert!(t.get(&k, &mut out).unwrap().is_none());
    }
    // Pages of dropped records are free again: 13 more pages fit.
    for i in 0..13 {
        put(&*t, 2, i, PAGE);
    }
    assert_eq!(t.usage().blocks, 15);
    assert_eq!(t.stats().checksum_failures, 0);
}

/// Blocks indexed before G3 summed with CRC-64 (records of version 1, XXH3-64) are still
/// served after an upgrade, verified with XXH3; one whose XXH3 does not match is a miss.
#[test]
fn blocks_of_the_xxh3_record_version_are_still_served() {
    use kvtiers::disk::index::DiskIndex;
    let d = tempfile::tempdir().unwrap();
    {
        let t = disk(d.path(), 16 * PAGE as u64, IoBackend::Psync);
        put(&*t, 1, 0, PAGE);
        put(&*t, 1, 1, PAGE);
        t.flush().unwrap();
    }
    {
        // Rewrite both records as the older version wrote them: XXH3 sums, version 1; the
        // second with a sum that does not match its bytes.
        let index = DiskIndex::open(&d.path().join("index"), PAGE).unwrap();
        let mut puts = Vec::new();
        for rec in index.scan().unwrap() {
            let (k, mut e) = rec.unwrap();
            e.sum_kind = kvtiers::SumKind::Xxh3;
            e.checksum = kvtiers::checksum_of(kvtiers::SumKind::Xxh3, &content(&k, PAGE));
            if k == key(1, 1) {
                e.checksum ^= 1;
            }
            puts.push((k, e));
        }
        assert_eq!(puts.len(), 2);
        index.write(&puts, &[], true).unwrap();
    }
    let t = disk(d.path(), 16 * PAGE as u64, IoBackend::Psync);
    let mut out = BlockBuf::new();
    assert!(t.get(&key(1, 0), &mut out).unwrap().is_some(), "an XXH3-era block is served");
    assert_eq!(&out[..], &content(&key(1, 0), PAGE)[..]);
    assert!(t.get(&key(1, 1), &mut out).unwrap().is_none(), "a wrong XXH3 sum is a miss");
    assert_eq!(t.stats().checksum_failures, 1);
}

/// What [`hooked`] calls with each batch before running it.
type Hook = Arc<dyn Fn(&[IoOp]) -> std::io::Result<()> + Send + Sync>;

/// A psync engine that calls a hook with each batch before running it: an error from the hook
/// fails the batch before any op runs.
struct Hooked {
    name: &'static str,
    before: Hook,
}

impl std::fmt::Debug for Hooked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooked").field("name", &self.name).finish_non_exhaustive()
    }
}

impl IoEngine for Hooked {
    fn name(&self) -> &'static str {
        self.name
    }
    unsafe fn run(
        &mut self,
        fd: std::os::fd::RawFd,
        ops: &[IoOp],
        progress: &mut dyn IoProgress,
    ) -> std::io::Result<()> {
        (self.before)(ops)?;
        // SAFETY: the caller of `run` vouches for the ops' memory.
        unsafe { PsyncEngine.run(fd, ops, progress) }
    }
}

/// Engines named `name` that call `before` with each batch before running it (psync).
fn hooked(
    name: &'static str,
    before: impl Fn(&[IoOp]) -> std::io::Result<()> + Send + Sync + 'static,
) -> EngineFactory {
    let before: Hook = Arc::new(before);
    Arc::new(move || Ok(Box::new(Hooked { name, before: Arc::clone(&before) }) as Box<dyn IoEngine>))
}

/// A read whose batch fails before any op runs is an error of the call: the block stays and is
/// served once reads run again (it used to be dropped as corrupt).
#[test]
fn a_read_that_never_ran_keeps_the_block() {
    let d = tempfile::tempdir().unwrap();
    let broken = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let b = Arc::clone(&broken);
    // Whole batches fail before any op runs while `broken` is set.
    let factory = hooked("breakable", move |_| {
        if b.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(std::io::Error::other("engine unavailable"));
        }
        Ok(())
    });
    let mut cfg = disk_cfg(d.path(), 8 << 20);
    cfg.io_threads = 0;
    let t = DiskTier::open_with_engine(&cfg, factory).unwrap();
    put(&t, 3, 0, PAGE + 5);
    broken.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut out = BlockBuf::new();
    assert!(t.get(&key(3, 0), &mut out).is_err(), "a read that did not run is an error, not a miss");
    broken.store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(t.get(&key(3, 0), &mut out).unwrap().is_some(), "the block was dropped");
    assert_eq!(&out[..], &content(&key(3, 0), PAGE + 5)[..]);
    assert_eq!(t.stats().checksum_failures, 0);
}

/// A block removed while its bytes are on their way to disk never reaches the index: the
/// index is written only for reservations still in place, under the lock the removal's delete
/// takes (a record written after the delete would name pages another block may own later).
#[test]
fn a_block_removed_mid_write_is_not_indexed() {
    let d = tempfile::tempdir().unwrap();
    let (arrived_tx, arrived_rx) = std::sync::mpsc::channel();
    let (through_tx, through_rx) = std::sync::mpsc::channel();
    let gate = Arc::new(std::sync::Mutex::new(Some((arrived_tx, through_rx))));
    let g = Arc::clone(&gate);
    // The first write batch waits at the gate: it says it arrived, then waits to be let through.
    let factory = hooked("gated", move |ops| {
        let gate = if ops.first().is_some_and(|o| o.kind == IoKind::Write) { g.lock().unwrap().take() } else { None };
        if let Some((arrived, through)) = gate {
            arrived.send(()).unwrap();
            through.recv().unwrap();
        }
        Ok(())
    });
    let mut cfg = disk_cfg(d.path(), 8 * PAGE as u64);
    cfg.io_threads = 0;
    let t = Arc::new(DiskTier::open_with_engine(&cfg, factory).unwrap());
    let writer = {
        let t = Arc::clone(&t);
        std::thread::spawn(move || {
            let k = key(4, 0);
            let data = content(&k, PAGE);
            t.put(BlockRef { key: k, meta: meta(4, 0, PAGE), data: &data })
        })
    };
    arrived_rx.recv().unwrap();
    assert!(t.remove(&key(4, 0)).unwrap(), "the reservation was there to remove");
    through_tx.send(()).unwrap();
    assert!(!writer.join().unwrap().unwrap(), "the put reports that it stored nothing");
    let mut out = BlockBuf::new();
    assert!(t.get(&key(4, 0), &mut out).unwrap().is_none());
    put(&*t, 5, 0, PAGE);
    t.flush().unwrap();
    drop(t);
    let index = kvtiers::disk::index::DiskIndex::open(&d.path().join("index"), PAGE).unwrap();
    let keys: Vec<kvproto::BlockKey> =
        index.scan().unwrap().into_iter().filter_map(|r| r.ok().map(|(k, _)| k)).collect();
    assert_eq!(keys, vec![key(5, 0)], "only the block that stayed is indexed");
}

#[test]
fn blocks_put_as_pieces_read_back_whole_after_a_restart() {
    let d = tempfile::tempdir().unwrap();
    let cfg = disk_cfg(d.path(), 64 << 20);
    // A pool of aligned 64 KiB pages to cut blocks from, as G2's page runs are.
    let mut pool = BlockBuf::zeroed(64 * PAGE);
    // (block, length, where its pieces lie in the pool: (start, bytes))
    type Case = (u32, usize, Vec<(usize, usize)>);
    let cases: Vec<Case> = vec![
        // Whole pages out of order, the last partly used: written as they are.
        (0, 3 * PAGE + 100, vec![(5 * PAGE, PAGE), (PAGE, PAGE), (9 * PAGE, PAGE), (2 * PAGE, 100)]),
        // Pieces that are not 4 KiB units: gathered before writing.
        (1, 3000 + 5000 + 70_000, vec![(20 * PAGE + 8, 3000), (30 * PAGE, 5000), (40 * PAGE + 3, 70_000)]),
        // An empty block.
        (2, 0, vec![(50 * PAGE, 0)]),
    ];
    {
        let tier = DiskTier::open(&cfg).unwrap();
        for (i, len, layout) in &cases {
            let k = key(12, *i);
            let want = content(&k, *len);
            let mut at = 0;
            for &(start, n) in layout {
                pool[start..start + n].copy_from_slice(&want[at..at + n]);
                at += n;
            }
            let parts: Vec<&[u8]> = layout.iter().map(|&(start, n)| &pool[start..start + n]).collect();
            let r = tier.put_batch_parts(&[kvtiers::PartsRef { key: k, meta: meta(12, *i, *len), parts: &parts }]);
            assert!(matches!(r[..], [Ok(true)]), "block {i}: {r:?}");
            let mut out = BlockBuf::new();
            tier.get(&k, &mut out).unwrap().expect("readable at once");
            assert!(out[..] == want[..], "block {i} differs");
        }
        // Pieces that do not add up to the block's length are refused, nothing stored.
        let k = key(12, 9);
        let parts: Vec<&[u8]> = vec![&pool[..PAGE]];
        let r = tier.put_batch_parts(&[kvtiers::PartsRef { key: k, meta: meta(12, 9, 2 * PAGE), parts: &parts }]);
        assert!(matches!(r[..], [Err(TierError::LengthMismatch { .. })]), "{r:?}");
        assert!(!tier.contains(&k));
        tier.flush().unwrap();
    }
    let tier = DiskTier::open(&cfg).unwrap();
    for (i, len, _) in &cases {
        let k = key(12, *i);
        let mut out = BlockBuf::new();
        tier.get(&k, &mut out).unwrap().expect("after a restart");
        assert!(out[..] == content(&k, *len)[..], "block {i} differs after a restart");
    }
}
