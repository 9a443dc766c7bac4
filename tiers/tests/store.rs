//! The composed store: write-through, promotion, prefix lookup, restart, drops, metrics.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvproto::{BlockKey, TierKind};
use kvtiers::disk::io::IoBackend;
use kvtiers::{
    BlockBuf, BlockMeta, BlockRef, BlockStore, BlockStoreConfig, LeaseId, Tier, TierExt, TierStats, TierUsage,
    WriteThroughConfig,
};

fn store_in(dir: &std::path::Path, g2_bytes: u64, g3_bytes: u64) -> BlockStore {
    let cfg = BlockStoreConfig {
        g2: host_cfg(dir, g2_bytes),
        g3: Some(disk_cfg(&dir.join("g3"), g3_bytes)),
        write_through: WriteThroughConfig::default(),
        g4: None,
        g4_write_through: WriteThroughConfig::default(),
    };
    BlockStore::open(&cfg).unwrap()
}

fn put_chain(s: &BlockStore, chain: u32, n: u32, len: usize) -> Vec<BlockKey> {
    (0..n)
        .map(|i| {
            let k = key(chain, i);
            s.put(k, meta(chain, i, len), &content(&k, len)).unwrap();
            k
        })
        .collect()
}

/// [`put_chain`], then waits until the write-through has taken every block down to G3.
fn put_through(s: &BlockStore, chain: u32, n: u32, len: usize) -> Vec<BlockKey> {
    let keys = put_chain(s, chain, n, len);
    s.flush().unwrap();
    keys
}

#[test]
fn write_through_then_promotion_on_use() {
    let d = tempfile::tempdir().unwrap();
    let s = store_in(d.path(), 8 * PAGE as u64, 64 << 20);
    let chain = put_through(&s, 1, 4, 2 * PAGE);
    let g3 = &s.lower()[0];
    assert!(chain.iter().all(|k| g3.contains(k)), "written through");
    assert_eq!(s.stats().writethrough_written, 4);
    // Fill G2 with other blocks: the chain leaves G2 (it is clean, so nothing is lost).
    put_chain(&s, 2, 4, 2 * PAGE);
    s.flush().unwrap();
    assert!(!s.g2().contains(&chain[3]));
    let mut buf = BlockBuf::new();
    let hit = s.get(&chain[3], &mut buf).unwrap().expect("found in G3");
    assert_eq!(hit.tier, TierKind::G3Disk);
    assert_eq!(&buf[..], &content(&chain[3], 2 * PAGE)[..]);
    assert_eq!(s.stats().promotions, 1);
    assert!(s.g2().contains(&chain[3]), "promoted into G2");
    let hit = s.get(&chain[3], &mut buf).unwrap().unwrap();
    assert_eq!(hit.tier, TierKind::G2Host);
}

#[test]
fn promote_batch_reads_g3_straight_into_g2_pages_byte_exact() {
    let d = tempfile::tempdir().unwrap();
    let s = store_in(d.path(), 64 * PAGE as u64, 64 << 20);
    let g3 = Arc::clone(&s.lower()[0]);
    // Lengths of whole pages, of a partial last page, and not a multiple of 4 KiB; put into
    // G3 alone, so that only a promotion brings them into G2.
    let lens = [PAGE, 3 * PAGE + 4096, 2 * PAGE + 17, 5000];
    let keys: Vec<BlockKey> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let k = key(9, i as u32);
            assert!(g3.put(BlockRef { key: k, meta: meta(9, i as u32, len), data: &content(&k, len) }).unwrap());
            k
        })
        .collect();
    assert!(keys.iter().all(|k| !s.g2().contains(k)));
    let promoted = s.promote_batch(&keys).unwrap();
    assert_eq!(promoted.len(), keys.len(), "every block promoted");
    assert!(promoted.iter().all(|(_, t)| *t == TierKind::G3Disk));
    for (k, &len) in keys.iter().zip(&lens) {
        let bytes = s.g2().with_block(k, |m, pieces| (m.len, pieces.concat())).expect("in G2 now");
        assert_eq!(bytes.0, len as u64);
        assert!(bytes.1 == content(k, len), "block {k} differs after promotion");
    }
    // A block whose bytes on disk no longer match its checksum is a miss and never reaches
    // G2: no reservation is left behind either (a later put of the key succeeds).
    let k = key(9, 100);
    let len = 2 * PAGE;
    g3.put(BlockRef { key: k, meta: meta(9, 100, len), data: &content(&k, len) }).unwrap();
    s.flush().unwrap();
    let data_file = std::fs::read_dir(d.path().join("g3"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().is_some_and(|n| n == "blocks.dat"))
        .expect("G3 data file");
    let mut bytes = std::fs::read(&data_file).unwrap();
    let needle = content(&k, len)[..64].to_vec();
    let at = bytes.windows(64).position(|w| w == &needle[..]).expect("block on disk");
    bytes[at] ^= 0xff;
    std::fs::write(&data_file, &bytes).unwrap();
    assert!(s.promote_batch(&[k]).unwrap().is_empty(), "a corrupt block is not promoted");
    assert!(!s.g2().contains(&k));
    assert!(s.g2().put(BlockRef { key: k, meta: meta(9, 100, len), data: &content(&k, len) }).unwrap());
}

/// A store whose G3 holds blocks of `lens` (chain `chain`), flushed, with block `corrupt`'s
/// bytes on disk changed after its checksum was written and block `in_g2` also put into G2.
fn blocks_in_g3_one_corrupt_one_in_g2(
    dir: &std::path::Path,
    chain: u32,
    lens: &[usize],
    corrupt: usize,
    in_g2: usize,
) -> (BlockStore, Vec<BlockKey>) {
    let s = store_in(dir, 64 * PAGE as u64, 64 << 20);
    let g3 = Arc::clone(&s.lower()[0]);
    let keys: Vec<BlockKey> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let k = key(chain, i as u32);
            assert!(g3.put(BlockRef { key: k, meta: meta(chain, i as u32, len), data: &content(&k, len) }).unwrap());
            k
        })
        .collect();
    s.flush().unwrap();
    let data_file = dir.join("g3").join("blocks.dat");
    let mut bytes = std::fs::read(&data_file).unwrap();
    let needle = content(&keys[corrupt], lens[corrupt])[..64].to_vec();
    let at = bytes.windows(64).position(|w| w == &needle[..]).expect("block on disk");
    bytes[at + 10] ^= 0x5a;
    std::fs::write(&data_file, &bytes).unwrap();
    let (k, len) = (keys[in_g2], lens[in_g2]);
    assert!(s.g2().put(BlockRef { key: k, meta: meta(chain, in_g2 as u32, len), data: &content(&k, len) }).unwrap());
    (s, keys)
}

/// A load copies each block on as soon as it is in: `promote_batch_lossy_each` hands over every
/// block read from G3 that passed its check, byte-exact, and never one that failed it.
#[test]
fn promote_batch_each_hands_over_each_verified_block_and_no_corrupt_one() {
    let d = tempfile::tempdir().unwrap();
    let lens = [PAGE, 2 * PAGE + 17, 5000, 3 * PAGE, PAGE + 4096, 2 * PAGE];
    // Block 2's bytes on disk no longer match its checksum; block 4 is in G2 already.
    let (s, keys) = blocks_in_g3_one_corrupt_one_in_g2(d.path(), 11, &lens, 2, 4);

    let mut handed: Vec<(BlockKey, u64, TierKind, Vec<u8>)> = Vec::new();
    let p = s.promote_batch_lossy_each(&keys, &mut |k, m, tier, pieces| {
        assert!(!s.g2().contains(k), "handed over before it is published in G2");
        handed.push((*k, m.len, tier, pieces.concat()));
    });
    // In the order the reads completed: put in the keys' order to compare.
    handed.sort_by_key(|h| keys.iter().position(|k| *k == h.0));
    let expect: Vec<usize> = vec![0, 1, 3, 5];
    assert_eq!(handed.iter().map(|h| h.0).collect::<Vec<_>>(), expect.iter().map(|&i| keys[i]).collect::<Vec<_>>());
    for ((k, len, tier, data), &i) in handed.iter().zip(&expect) {
        assert_eq!(*len, lens[i] as u64);
        assert_eq!(*tier, TierKind::G3Disk);
        assert!(data[..] == content(k, lens[i])[..], "block {i} handed over with other bytes");
        assert!(s.g2().contains(k), "published in G2 after");
    }
    let promoted: Vec<BlockKey> = p.promoted.iter().map(|(k, _)| *k).collect();
    assert_eq!(promoted, expect.iter().map(|&i| keys[i]).collect::<Vec<_>>());
    assert!(p.error.is_none() && p.unplaced.is_empty());
    assert!(!s.g2().contains(&keys[2]), "the corrupt block is a miss");
}

/// Blocks only G3 holds are read straight into memory another process could write (an engine's
/// slots), byte-exact, and stay out of G2; a block in G2, a destination of part pages and a
/// block whose bytes fail their check there are not delivered, and the last is neither dropped
/// nor counted (the memory's owner may have written it): the usual promotion settles it. A
/// delivered block comes up into G2 only from a copy that matches its sum.
#[test]
fn g3_blocks_are_read_straight_into_foreign_memory_and_promoted_only_from_a_matching_copy() {
    let d = tempfile::tempdir().unwrap();
    let lens = [PAGE, 3 * 4096, 2 * PAGE, PAGE, PAGE, 5000];
    // Block 2 is corrupt on disk, block 3 in G2 already.
    let (s, keys) = blocks_in_g3_one_corrupt_one_in_g2(d.path(), 12, &lens, 2, 3);
    let g3 = Arc::clone(&s.lower()[0]);
    let failures = || g3.stats().checksum_failures;
    let before = failures();

    // Destinations as an engine's slots: two segments each, whole pages; block 4's second
    // segment starts off a page boundary, block 5 is no whole number of pages.
    let mut mem: Vec<BlockBuf> = lens.iter().map(|&l| BlockBuf::zeroed(l.next_multiple_of(4096) + 4096)).collect();
    let dests: Vec<Vec<(*mut u8, usize)>> = mem
        .iter_mut()
        .zip(&lens)
        .enumerate()
        .map(|(i, (m, &len))| {
            let p = m.full_mut().as_mut_ptr();
            let first = 4096.min(len);
            let second = if i == 4 { p.wrapping_add(first + 8) } else { p.wrapping_add(first) };
            vec![(p, first), (second, len - first)]
        })
        .collect();
    let mut asked = Vec::new();
    let got = s.read_into_foreign(&keys, |i, m| {
        asked.push((i, m.len));
        // SAFETY: every destination lies in `mem`, untouched until the call returns.
        Some(unsafe { kvtiers::Destination::new(dests[i].clone()) })
    });
    assert_eq!(asked.iter().map(|a| a.0).collect::<Vec<_>>(), vec![0, 1, 2, 4, 5], "a block in G2 is not asked for");
    for (i, g) in got.iter().enumerate() {
        match i {
            0 | 1 => {
                let (tier, dl) = g.expect("delivered");
                assert_eq!((tier, dl.meta.len), (TierKind::G3Disk, lens[i] as u64));
                assert!(mem[i][..lens[i]] == content(&keys[i], lens[i])[..], "block {i} delivered with other bytes");
                assert!(!s.g2().contains(&keys[i]), "a delivered block is not in G2 yet");
            }
            _ => assert!(g.is_none(), "block {i} was delivered"),
        }
    }
    assert!(g3.contains(&keys[2]), "a mismatch in foreign memory drops nothing");
    assert_eq!(failures(), before, "nor is it counted");
    let p = s.promote_batch_lossy(&keys[2..3]);
    assert!(p.promoted.is_empty() && !g3.contains(&keys[2]), "the usual read drops the corrupt block");
    assert_eq!(failures(), before + 1);

    // Promoted from a copy: a changed copy is refused, the block's own bytes are taken.
    let (tier, dl) = got[0].unwrap();
    let copy_from = |src: Vec<u8>| {
        move |dst: &mut [&mut [u8]]| {
            let mut at = 0;
            for d in dst.iter_mut() {
                let n = d.len();
                d.copy_from_slice(&src[at..at + n]);
                at += n;
            }
            true
        }
    };
    let mut changed = mem[0][..lens[0]].to_vec();
    changed[100] ^= 1;
    assert!(!s.promote_copy(&keys[0], tier, &dl, copy_from(changed)));
    assert!(!s.g2().contains(&keys[0]));
    assert!(!s.promote_copy(&keys[0], tier, &dl, |_| false), "a failed copy promotes nothing");
    assert!(s.promote_copy(&keys[0], tier, &dl, copy_from(mem[0][..lens[0]].to_vec())));
    let mut out = BlockBuf::new();
    assert!(s.g2().get(&keys[0], &mut out).unwrap().is_some());
    assert!(out[..] == content(&keys[0], lens[0])[..]);
}

#[test]
fn g3_reads_into_and_writes_from_g2_through_the_registered_pool() {
    let d = tempfile::tempdir().unwrap();
    // G2 in shared memory, as the daemon runs it: the kernel does not pin pages of a file on
    // disk for good (registering a pool mapped from /tmp fails, and G3 pins per op there).
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    let g2 = Arc::new(kvtiers::HostTier::open(&host_cfg(shm.path(), 32 * PAGE as u64)).unwrap());
    let disk = Arc::new(kvtiers::DiskTier::open(&disk_cfg(&d.path().join("g3"), 64 << 20)).unwrap());
    let lower: Vec<Arc<dyn Tier>> = vec![Arc::clone(&disk) as Arc<dyn Tier>];
    let s = BlockStore::with_tiers(Arc::clone(&g2), lower, WriteThroughConfig::default()).unwrap();
    if disk.backend() != "io_uring" {
        eprintln!("skipped: G3 runs on {} here, which registers nothing", disk.backend());
        return;
    }
    // The pool is registered on a thread of its own; each ring shares it from its next batch.
    let t0 = Instant::now();
    while disk.fixed_ops().is_none() {
        if let Some(why) = disk.fixed_refused() {
            eprintln!("skipped: {why}");
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "the G2 pool was neither registered nor refused");
        std::thread::sleep(Duration::from_millis(5));
    }
    let len = 2 * PAGE + 4096;
    let chain = put_through(&s, 3, 8, len);
    let written = disk.fixed_ops().unwrap();
    assert!(written >= 8, "write-through wrote G2's pages through the registered pool ({written} ops)");
    for k in &chain {
        assert!(s.g2().remove(k).unwrap());
    }
    assert_eq!(s.promote_batch(&chain).unwrap().len(), chain.len(), "every block promoted");
    assert!(disk.fixed_ops().unwrap() >= written + 8, "promotion read into G2's pages through the registered pool");
    for k in &chain {
        let bytes = s.g2().with_block(k, |_, pieces| pieces.concat()).expect("in G2 again");
        assert!(bytes == content(k, len), "block {k} differs after a round trip through G3");
    }
}

#[test]
fn a_block_g2_has_no_room_for_is_handed_back_not_read_twice() {
    let d = tempfile::tempdir().unwrap();
    let s = store_in(d.path(), 4 * PAGE as u64, 64 << 20);
    // G2 full of pinned blocks: nothing can be evicted to make room.
    let held = put_through(&s, 10, 2, 2 * PAGE);
    let lease = s.pin(&held, Duration::from_secs(30));
    let k = key(11, 0);
    let len = 2 * PAGE;
    s.lower()[0].put(BlockRef { key: k, meta: meta(11, 0, len), data: &content(&k, len) }).unwrap();
    let reads_before = s.lower()[0].stats().hits;
    let p = s.promote_batch_lossy(&[k]);
    assert!(p.promoted.is_empty() && p.failed.is_empty() && p.error.is_none());
    assert_eq!(p.unplaced.len(), 1, "read once and handed back");
    let (got_key, got_meta, tier, buf) = &p.unplaced[0];
    assert_eq!((*got_key, got_meta.len, *tier), (k, len as u64, TierKind::G3Disk));
    assert!(buf[..] == content(&k, len)[..]);
    assert_eq!(s.lower()[0].stats().hits, reads_before + 1);
    assert!(!s.g2().contains(&k));
    s.release(lease);
}

#[test]
fn lookup_reports_longest_prefix_per_tier() {
    let d = tempfile::tempdir().unwrap();
    let s = store_in(d.path(), 32 << 20, 64 << 20);
    let mut chain = put_through(&s, 3, 6, 10_000);
    s.g2().remove(&chain[4]).unwrap();
    s.g2().remove(&chain[5]).unwrap();
    chain.push(key(3, 6)); // not stored
    chain.push(key(3, 7));
    let m = s.lookup(&chain);
    assert_eq!(m.blocks, 6);
    assert_eq!(m.fastest[TierKind::G2Host.index()], 4);
    assert_eq!(m.fastest[TierKind::G3Disk.index()], 2);
    assert_eq!(m.resident[TierKind::G2Host.index()], 4);
    assert_eq!(m.resident[TierKind::G3Disk.index()], 6);
    // A gap ends the prefix even if later blocks exist.
    s.remove(&chain[1]).unwrap();
    assert_eq!(s.lookup(&chain).blocks, 1);
    assert_eq!(s.lookup(&[]).blocks, 0);
}

#[test]
fn restart_brings_blocks_back_from_g3() {
    let d = tempfile::tempdir().unwrap();
    let chain = {
        let s = store_in(d.path(), 16 << 20, 64 << 20);
        put_chain(&s, 4, 8, 300_000)
        // Dropping the store drains the write-through queue.
    };
    let s = store_in(d.path(), 16 << 20, 64 << 20);
    let m = s.lookup(&chain);
    assert_eq!(m.blocks, 8);
    assert_eq!(m.fastest[TierKind::G3Disk.index()], 8);
    let mut buf = BlockBuf::new();
    for k in &chain {
        assert_eq!(s.get(k, &mut buf).unwrap().unwrap().tier, TierKind::G3Disk);
        assert_eq!(&buf[..], &content(k, 300_000)[..]);
    }
}

/// A lower tier that is slow: the write-through queue backs up.
#[derive(Debug)]
struct Slow(Arc<dyn Tier>);

impl Tier for Slow {
    fn kind(&self) -> TierKind {
        self.0.kind()
    }
    fn put_batch(&self, b: &[BlockRef<'_>]) -> Vec<kvtiers::Result<bool>> {
        std::thread::sleep(Duration::from_millis(20) * b.len() as u32);
        self.0.put_batch(b)
    }
    fn get_batch(&self, k: &[BlockKey], out: &mut [BlockBuf]) -> Vec<kvtiers::Result<Option<BlockMeta>>> {
        self.0.get_batch(k, out)
    }
    fn contains_each(&self, k: &[BlockKey]) -> Vec<bool> {
        self.0.contains_each(k)
    }
    fn remove(&self, k: &BlockKey) -> kvtiers::Result<bool> {
        self.0.remove(k)
    }
    fn pin(&self, l: LeaseId, k: &[BlockKey], d: Instant) -> usize {
        self.0.pin(l, k, d)
    }
    fn release(&self, l: LeaseId) {
        self.0.release(l)
    }
    fn usage(&self) -> TierUsage {
        self.0.usage()
    }
    fn stats(&self) -> TierStats {
        self.0.stats()
    }
    fn keys(&self) -> Vec<(BlockKey, BlockMeta)> {
        self.0.keys()
    }
}

#[test]
fn paused_write_through_keeps_blocks_dirty_in_g2_until_the_guard_drops() {
    let d = tempfile::tempdir().unwrap();
    let s = store_in(d.path(), 64 * PAGE as u64, 64 << 20);
    let pause = s.pause_writethrough();
    let keys = put_chain(&s, 9, 8, 2 * PAGE);
    // Long enough for an unpaused writer to have written them all many times over.
    std::thread::sleep(Duration::from_millis(300));
    let g3 = &s.lower()[0];
    assert!(keys.iter().all(|k| !g3.contains(k)), "nothing written while paused");
    assert_eq!(s.writethrough_queued(), vec![(TierKind::G3Disk, 8)]);
    drop(pause);
    s.flush().unwrap();
    assert!(keys.iter().all(|k| g3.contains(k)), "all written once the guard dropped");
    assert_eq!(s.stats().writethrough_written, 8);
    let mut buf = BlockBuf::new();
    let k = keys[5];
    assert_eq!(g3.get(&k, &mut buf).unwrap().map(|m| m.len), Some(2 * PAGE as u64));
    assert_eq!(&buf[..], &content(&k, 2 * PAGE)[..]);
}

#[test]
fn full_write_through_queue_drops_are_counted_and_puts_still_succeed() {
    let d = tempfile::tempdir().unwrap();
    let g3 = disk(&d.path().join("g3"), 64 << 20, IoBackend::Psync);
    let slow: Arc<dyn Tier> = Arc::new(Slow(as_tier(g3)));
    let s = BlockStore::with_tiers(host(d.path(), 32 << 20), vec![slow], WriteThroughConfig { queue: 2, batch: 1 })
        .unwrap();
    let keys = put_through(&s, 5, 40, 20_000);
    let st = s.stats();
    assert!(st.writethrough_dropped > 0, "{st:?}");
    assert_eq!(st.writethrough_dropped + st.writethrough_written, 40);
    assert!(keys.iter().all(|k| s.g2().contains(k)), "every put is served from G2");
}

#[test]
fn full_g2_waits_for_write_through_instead_of_dropping() {
    let d = tempfile::tempdir().unwrap();
    let g3 = disk(&d.path().join("g3"), 64 << 20, IoBackend::Psync);
    let slow: Arc<dyn Tier> = Arc::new(Slow(as_tier(g3)));
    // G2 holds two blocks; every block is still waiting for the slow G3 when the next arrives.
    let s =
        BlockStore::with_tiers(host(d.path(), 4 * PAGE as u64), vec![slow], WriteThroughConfig { queue: 64, batch: 1 })
            .unwrap();
    let keys = put_through(&s, 11, 6, 2 * PAGE);
    let st = s.stats();
    assert_eq!(st.writethrough_evicted_before_write, 0, "{st:?}");
    assert_eq!(st.writethrough_written, 6);
    assert!(keys.iter().all(|k| s.lower()[0].contains(k)));
}

#[test]
fn pins_cover_every_tier() {
    let d = tempfile::tempdir().unwrap();
    let s = store_in(d.path(), 4 * PAGE as u64, 4 * PAGE as u64);
    let a = put_through(&s, 6, 1, 2 * PAGE);
    let lease = s.pin(&a, Duration::from_secs(30));
    put_chain(&s, 7, 1, 2 * PAGE);
    s.flush().unwrap();
    // Both tiers are now full; a third block cannot evict the pinned one anywhere.
    assert!(s.put(key(8, 0), meta(8, 0, 2 * PAGE), &content(&key(8, 0), 2 * PAGE)).is_ok());
    s.flush().unwrap();
    assert!(s.g2().contains(&a[0]));
    assert!(s.lower()[0].contains(&a[0]));
    s.release(lease);
}

#[test]
fn metrics_are_exported_under_kvcached_names() {
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let d = tempfile::tempdir().unwrap();
    metrics::with_local_recorder(&recorder, || {
        let s = store_in(d.path(), 8 << 20, 8 << 20);
        let k = put_through(&s, 9, 3, 10_000);
        let mut buf = BlockBuf::new();
        s.get(&k[0], &mut buf).unwrap();
        s.get(&key(9, 99), &mut buf).unwrap();
    });
    let names: Vec<(String, Vec<String>)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(ck, _, _, _)| {
            let k = ck.key();
            (k.name().to_string(), k.labels().map(|l| format!("{}={}", l.key(), l.value())).collect())
        })
        .collect();
    for want in [
        "kvcached_tier_hits_total",
        "kvcached_tier_misses_total",
        "kvcached_tier_bytes_written_total",
        "kvcached_tier_used_bytes",
        "kvcached_tier_capacity_bytes",
        "kvcached_tier_evictions_total",
        "kvcached_tier_checksum_failures_total",
        "kvcached_tier_op_duration_seconds",
        "kvcached_writethrough_queue_depth",
        "kvcached_writethrough_blocks_total",
    ] {
        assert!(names.iter().any(|(n, _)| n == want), "missing {want}: {names:?}");
    }
    assert!(names.iter().any(|(n, l)| n == "kvcached_tier_hits_total" && l.contains(&"tier=g3".to_string())));
}

/// A daemon killed with `kill -9` never unlinks its G2 pool file; the next pool opened in the
/// same directory removes it, and never a pool some live process holds.
#[test]
fn a_pool_file_left_by_a_killed_daemon_is_removed_and_a_live_one_is_kept() {
    let d = tempfile::tempdir().unwrap();
    // pid 4194304 is never a live process (it equals Linux's largest pid_max).
    let stale = d.path().join("kvcached-g2-4194304-000000001");
    std::fs::write(&stale, vec![0u8; 4096]).unwrap();
    let stale_hidden = d.path().join(".kvcached-g2-4194304-000000002");
    std::fs::write(&stale_hidden, b"").unwrap();
    // Unlocked but its pid runs (this test process): a daemon of an older build; it stays.
    let unlocked_live = d.path().join(format!("kvcached-g2-{}-000000003", std::process::id()));
    std::fs::write(&unlocked_live, vec![0u8; 4096]).unwrap();
    let unrelated = d.path().join("engine-kv");
    std::fs::write(&unrelated, b"x").unwrap();
    let live = common::host(d.path(), 1 << 20);
    assert!(!stale.exists(), "the stale pool file is still there");
    assert!(!stale_hidden.exists(), "the hidden stale pool file is still there");
    assert!(unlocked_live.exists(), "the pool of a live process was removed");
    std::fs::remove_file(&unlocked_live).unwrap();
    assert!(unrelated.exists());
    let pools = |dir: &std::path::Path| {
        std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with("kvcached-g2-"))
            .count()
    };
    assert_eq!(pools(d.path()), 1);
    let second = common::host(d.path(), 1 << 20);
    assert_eq!(pools(d.path()), 2, "a live pool was removed");
    drop((live, second));
    assert_eq!(pools(d.path()), 0, "a clean shutdown unlinks its pool");
}

/// A load's destination in these tests: one buffer per block (`lens` its expected length), what
/// it was told, and memory it offers for reads straight in when `direct`.
struct VecSink {
    lens: Vec<usize>,
    got: Vec<Option<Vec<u8>>>,
    from: Vec<(usize, TierKind)>,
    chunks: usize,
    refuse: Option<usize>,
    mem: Vec<BlockBuf>,
    /// `mem`'s buffers, taken once: what `direct` hands out.
    at: Vec<*mut u8>,
    direct: bool,
}

impl VecSink {
    fn new(lens: &[usize], direct: bool) -> Self {
        let mut mem: Vec<BlockBuf> = lens.iter().map(|&l| BlockBuf::zeroed(l.next_multiple_of(4096))).collect();
        let at = mem.iter_mut().map(|m| m.as_mut_ptr()).collect();
        Self {
            lens: lens.to_vec(),
            got: lens.iter().map(|_| None).collect(),
            from: Vec::new(),
            chunks: 0,
            refuse: None,
            mem,
            at,
            direct,
        }
    }
}

impl kvtiers::LoadSink for VecSink {
    type Error = String;
    fn accepts(&self, i: usize, meta: &BlockMeta) -> bool {
        meta.len as usize == self.lens[i] && self.refuse != Some(i)
    }
    fn fill(&mut self, i: usize, pieces: &[&[u8]]) -> Result<(), String> {
        self.got[i] = Some(pieces.concat());
        Ok(())
    }
    fn done(&mut self, i: usize, from: TierKind) {
        self.from.push((i, from));
    }
    fn chunk_done(&mut self) {
        self.chunks += 1;
    }
    fn direct(&self, i: usize) -> Option<kvtiers::Destination<'_>> {
        let p = *self.at.get(i).filter(|_| self.direct)?;
        // SAFETY: `mem[i]`'s heap buffer (at least `lens[i]` bytes), not read or written by
        // anything else while a load borrows the sink.
        Some(unsafe { kvtiers::Destination::new(vec![(p, self.lens[i])]) })
    }
    fn copy_back(&self, i: usize, dst: &mut [&mut [u8]]) -> bool {
        let mut at = 0;
        for d in dst.iter_mut() {
            let n = d.len();
            d.copy_from_slice(&self.mem[i][at..at + n]);
            at += n;
        }
        true
    }
}

/// The one load: each block of the chain from the tier holding it, in order, its tier told,
/// a progress call per chunk; it ends at the first block no tier serves (here one corrupt on
/// disk), and a later load from past it serves G2's block and the rest. A block the sink does
/// not take ends the load there.
#[test]
fn load_into_serves_a_chain_in_order_and_ends_at_the_first_gap() {
    let d = tempfile::tempdir().unwrap();
    let lens = [PAGE, 3 * 4096, 2 * PAGE, PAGE, PAGE, 5000];
    let (s, keys) = blocks_in_g3_one_corrupt_one_in_g2(d.path(), 13, &lens, 2, 3);
    let opts = kvtiers::LoadOptions { chunk: 2, direct: false };
    let mut sink = VecSink::new(&lens, false);
    let r = s.load_into(&keys, 0, &mut sink, &opts).unwrap();
    assert_eq!((r.loaded, r.end), (2, kvtiers::LoadEnd::Miss), "the corrupt block ends the load");
    assert_eq!(sink.from, vec![(0, TierKind::G3Disk), (1, TierKind::G3Disk)]);
    assert_eq!(sink.chunks, 1);
    for i in 0..2 {
        assert!(sink.got[i].as_deref() == Some(&content(&keys[i], lens[i])[..]), "block {i} byte-exact");
        assert!(s.g2().contains(&keys[i]), "block {i} came up into G2");
    }
    let r = s.load_into(&keys, 3, &mut sink, &opts).unwrap();
    assert_eq!((r.loaded, r.end), (3, kvtiers::LoadEnd::Whole));
    assert_eq!(&sink.from[2..], &[(3, TierKind::G2Host), (4, TierKind::G3Disk), (5, TierKind::G3Disk)]);
    assert!(sink.got[5].as_deref() == Some(&content(&keys[5], lens[5])[..]));

    let mut picky = VecSink::new(&lens, false);
    picky.refuse = Some(1);
    let r = s.load_into(&keys, 0, &mut picky, &opts).unwrap();
    assert_eq!((r.loaded, r.end), (1, kvtiers::LoadEnd::Mismatch));
    assert!(picky.got[1].is_none(), "a block the sink does not take is not copied");
}

/// With `direct`, blocks only G3 holds are read straight into the sink's memory (not G2), and
/// `settle` brings them up into G2 afterwards, copied back out of the sink.
#[test]
fn a_direct_load_reads_into_the_sink_and_settles_into_g2_after() {
    let d = tempfile::tempdir().unwrap();
    let lens = [PAGE, 2 * PAGE, PAGE, PAGE];
    let (s, keys) = blocks_in_g3_one_corrupt_one_in_g2(d.path(), 14, &lens, 3, 1);
    let mut sink = VecSink::new(&lens, true);
    let opts = kvtiers::LoadOptions { chunk: 16, direct: true };
    let r = s.load_into(&keys, 0, &mut sink, &opts).unwrap();
    assert_eq!((r.loaded, r.end), (3, kvtiers::LoadEnd::Miss));
    let direct: Vec<usize> = r.direct.iter().map(|d| d.index).collect();
    assert_eq!(direct, vec![0, 2], "G3's blocks read straight in; G2's copied");
    for &i in &direct {
        assert!(sink.mem[i][..lens[i]] == content(&keys[i], lens[i])[..], "block {i} byte-exact in the sink");
        assert!(!s.g2().contains(&keys[i]), "block {i} is not in G2 before settle");
    }
    assert!(sink.got[1].as_deref() == Some(&content(&keys[1], lens[1])[..]));
    s.settle(&keys, &r.direct, &sink);
    for &i in &direct {
        assert!(s.g2().contains(&keys[i]), "block {i} settled into G2");
    }
}
