//! The conformance suite every `Tier` implementation runs: the core contract on every tier,
//! and each extension trait (`DirectIo`, `PrefixProbe`, `Medium`, `Reports`) on every tier
//! that offers it; which tier offers which is itself checked, so none goes untested.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvtiers::disk::io::IoBackend;
use kvtiers::{BlockBuf, BlockRef, LeaseId, OverQuota, Quota, Tier, TierError, TierExt};

/// Builds a fresh tier of `capacity` bytes in a temp dir (kept alive by the returned guard),
/// with owners' quotas (owner `i` having `quotas[i]`).
type QuotaFactory = fn(u64, Vec<Quota>) -> (Arc<dyn Tier>, tempfile::TempDir);

/// The same with no quotas: what most cases use.
struct Factory(QuotaFactory);

impl Factory {
    fn call(&self, capacity: u64) -> (Arc<dyn Tier>, tempfile::TempDir) {
        (self.0)(capacity, Vec::new())
    }
}

fn g2(capacity: u64, quotas: Vec<Quota>) -> (Arc<dyn Tier>, tempfile::TempDir) {
    let d = tempfile::tempdir().unwrap();
    let mut cfg = host_cfg(d.path(), capacity);
    cfg.quotas = quotas;
    (Arc::new(kvtiers::HostTier::open(&cfg).unwrap()), d)
}
fn g3_with(
    capacity: u64,
    quotas: Vec<Quota>,
    threads: usize,
    backend: IoBackend,
) -> (Arc<dyn Tier>, tempfile::TempDir) {
    let d = tempfile::tempdir().unwrap();
    let mut cfg = disk_cfg(d.path(), capacity);
    cfg.io_threads = threads;
    cfg.quotas = quotas;
    let t = kvtiers::DiskTier::open_with_engine(&cfg, kvtiers::disk::io::engine_factory(backend, 32)).unwrap();
    (as_tier(Arc::new(t)), d)
}
fn g3_uring(capacity: u64, quotas: Vec<Quota>) -> (Arc<dyn Tier>, tempfile::TempDir) {
    g3_with(capacity, quotas, 2, IoBackend::Auto)
}
fn g3_psync(capacity: u64, quotas: Vec<Quota>) -> (Arc<dyn Tier>, tempfile::TempDir) {
    g3_with(capacity, quotas, 2, IoBackend::Psync)
}
fn g3_inline(capacity: u64, quotas: Vec<Quota>) -> (Arc<dyn Tier>, tempfile::TempDir) {
    g3_with(capacity, quotas, 0, IoBackend::Auto) // I/O on the calling thread
}

/// G4 over `object_store`'s in-memory store and over its local filesystem (a shared mount),
/// with a byte budget of `capacity` (its LRU deletion is what the eviction cases check).
fn g4_memory(capacity: u64, quotas: Vec<Quota>) -> (Arc<dyn Tier>, tempfile::TempDir) {
    let d = tempfile::tempdir().unwrap();
    let mut cfg = kvtiers::ObjectTierConfig::new("memory://");
    cfg.capacity_bytes = capacity;
    cfg.quotas = quotas;
    (Arc::new(kvtiers::ObjectTier::open(&cfg).unwrap()), d)
}
fn g4_file(capacity: u64, quotas: Vec<Quota>) -> (Arc<dyn Tier>, tempfile::TempDir) {
    let d = tempfile::tempdir().unwrap();
    let mut cfg = kvtiers::ObjectTierConfig::new(format!("file://{}", d.path().join("bucket").display()));
    cfg.capacity_bytes = capacity;
    cfg.quotas = quotas;
    (Arc::new(kvtiers::ObjectTier::open(&cfg).unwrap()), d)
}

fn put(t: &dyn Tier, chain: u32, i: u32, len: usize) -> Result<bool, TierError> {
    let k = key(chain, i);
    let data = content(&k, len);
    t.put(BlockRef { key: k, meta: meta(chain, i, len), data: &data })
}

fn get_bytes(t: &dyn Tier, chain: u32, i: u32) -> Option<Vec<u8>> {
    let mut buf = BlockBuf::new();
    t.get(&key(chain, i), &mut buf).unwrap().map(|m| {
        assert_eq!(m.len as usize, buf.len());
        buf.to_vec()
    })
}

fn roundtrip_sizes(f: Factory) {
    let (t, _d) = f.call(64 << 20);
    let sizes = [0usize, 1, 4095, 4096, 4097, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 17, 1 << 20, (2 << 20) + 5];
    for (i, &len) in sizes.iter().enumerate() {
        assert!(put(&*t, 1, i as u32, len).unwrap(), "size {len}");
    }
    for (i, &len) in sizes.iter().enumerate() {
        let got = get_bytes(&*t, 1, i as u32).unwrap_or_else(|| panic!("size {len} missing"));
        assert_eq!(got, content(&key(1, i as u32), len), "size {len} differs");
    }
    assert_eq!(t.usage().blocks, sizes.len());
    assert_eq!(t.keys().len(), sizes.len());
    assert_eq!(t.stats().hits, sizes.len() as u64);
}

fn miss_and_visibility(f: Factory) {
    let (t, _d) = f.call(4 << 20);
    assert!(!t.contains(&key(9, 0)));
    assert!(get_bytes(&*t, 9, 0).is_none());
    assert_eq!(t.stats().misses, 1);
    put(&*t, 9, 0, 1000).unwrap();
    assert!(t.contains(&key(9, 0)));
}

fn put_is_idempotent(f: Factory) {
    let (t, _d) = f.call(4 << 20);
    assert!(put(&*t, 2, 0, 5000).unwrap());
    assert!(!put(&*t, 2, 0, 5000).unwrap());
    assert_eq!(t.usage().blocks, 1);
}

fn length_mismatch_is_rejected(f: Factory) {
    let (t, _d) = f.call(4 << 20);
    let k = key(3, 0);
    let r = t.put(BlockRef { key: k, meta: meta(3, 0, 10), data: &[1, 2, 3] });
    assert!(matches!(r, Err(TierError::LengthMismatch { .. })), "{r:?}");
    assert!(!t.contains(&k));
}

fn remove_frees_space(f: Factory) {
    let (t, _d) = f.call(4 << 20);
    put(&*t, 4, 0, 3 * PAGE).unwrap();
    let used = t.usage().used_bytes;
    assert!(used >= 3 * PAGE as u64);
    assert!(t.remove(&key(4, 0)).unwrap());
    assert!(!t.remove(&key(4, 0)).unwrap());
    assert_eq!(t.usage().used_bytes, 0);
    assert!(get_bytes(&*t, 4, 0).is_none());
}

fn evicts_lru_when_full(f: Factory) {
    // 8 pages; each block takes 2 pages; independent chains (no parents).
    let (t, _d) = f.call(8 * PAGE as u64);
    for c in 0..4 {
        put(&*t, 100 + c, 0, 2 * PAGE).unwrap();
    }
    // Touch chain 100 so chain 101 is the coldest.
    assert!(get_bytes(&*t, 100, 0).is_some());
    put(&*t, 200, 0, 2 * PAGE).unwrap();
    assert!(t.contains(&key(100, 0)));
    assert!(!t.contains(&key(101, 0)), "the least recently used block goes first");
    assert!(t.contains(&key(200, 0)));
    assert!(t.stats().evictions >= 1);
    assert!(t.usage().used_bytes <= t.usage().capacity_bytes);
}

fn evicts_descendants_before_ancestors(f: Factory) {
    let (t, _d) = f.call(8 * PAGE as u64);
    // One chain of 4 blocks, put root first (root is the coldest by recency).
    for i in 0..4 {
        put(&*t, 7, i, 2 * PAGE).unwrap();
    }
    put(&*t, 8, 0, 2 * PAGE).unwrap();
    // The tail of the chain went, not its root.
    assert!(t.contains(&key(7, 0)) && t.contains(&key(7, 1)) && t.contains(&key(7, 2)));
    assert!(!t.contains(&key(7, 3)));
}

/// Room for a big block behind one long chain comes from the chain's tail, deepest first, in
/// one put (the parents of evicted blocks become leaves as they go).
fn a_long_chain_is_evicted_from_its_tail(f: Factory) {
    let (t, _d) = f.call(64 * PAGE as u64);
    for i in 0..64 {
        put(&*t, 30, i, PAGE).unwrap();
    }
    // A block of 20 pages needs 20 of the chain's 64 to go.
    put(&*t, 31, 0, 20 * PAGE).unwrap();
    let left: Vec<u32> = (0..64).filter(|&i| t.contains(&key(30, i))).collect();
    assert_eq!(left, (0..44).collect::<Vec<_>>(), "the chain lost its tail, not its middle");
}

fn the_least_recently_used_chain_goes_first(f: Factory) {
    let (t, _d) = f.call(64 * PAGE as u64);
    for i in 0..32 {
        put(&*t, 40, i, PAGE).unwrap();
    }
    for i in 0..32 {
        put(&*t, 41, i, PAGE).unwrap();
    }
    // Chain 40 is read again (the older chain becomes the more recently used one).
    let mut buf = BlockBuf::new();
    for i in (0..32).rev() {
        assert!(t.get(&key(40, i), &mut buf).unwrap().is_some());
    }
    // 10 pages must go: all from chain 41's tail, none from chain 40.
    put(&*t, 42, 0, 10 * PAGE).unwrap();
    let left = |c: u32| (0..32).filter(|&i| t.contains(&key(c, i))).count();
    assert_eq!((left(40), left(41)), (32, 22), "eviction spread over both chains or took the wrong one");
}

fn pinned_blocks_stay_and_leases_expire(f: Factory) {
    let (t, _d) = f.call(4 * PAGE as u64);
    put(&*t, 10, 0, 2 * PAGE).unwrap();
    put(&*t, 11, 0, 2 * PAGE).unwrap();
    let lease = LeaseId(1);
    assert_eq!(t.pin(lease, &[key(10, 0), key(11, 0), key(99, 0)], Instant::now() + Duration::from_secs(60)), 2);
    let r = put(&*t, 12, 0, 2 * PAGE);
    assert!(matches!(r, Err(TierError::Full { .. })), "all pinned: {r:?}");
    assert!(t.stats().put_errors >= 1);
    t.release(lease);
    put(&*t, 12, 0, 2 * PAGE).unwrap();
    // A lease that expires frees its blocks without a release.
    let l2 = LeaseId(2);
    let pinned = [key(12, 0)];
    t.pin(l2, &pinned, Instant::now() + Duration::from_millis(50));
    let other = if t.contains(&key(10, 0)) { key(10, 0) } else { key(11, 0) };
    t.pin(LeaseId(3), &[other], Instant::now() + Duration::from_secs(60));
    assert!(put(&*t, 13, 0, 2 * PAGE).is_err());
    std::thread::sleep(Duration::from_millis(80));
    put(&*t, 13, 0, 2 * PAGE).unwrap();
    assert!(!t.contains(&key(12, 0)), "expired lease no longer protects");
}

fn too_large_block_is_full_error(f: Factory) {
    let (t, _d) = f.call(4 * PAGE as u64);
    let r = put(&*t, 20, 0, 5 * PAGE);
    assert!(matches!(r, Err(TierError::Full { .. })), "{r:?}");
}

fn concurrent_same_keys(f: Factory) {
    let (t, _d) = f.call(32 << 20);
    let threads: Vec<_> = (0..8)
        .map(|th| {
            let t = Arc::clone(&t);
            std::thread::spawn(move || {
                let mut buf = BlockBuf::new();
                for round in 0..40u32 {
                    let i = (round * 7 + th) % 16;
                    let k = key(30, i);
                    let len = 40_000 + i as usize * 1000;
                    let data = content(&k, len);
                    let _ = t.put(BlockRef { key: k, meta: meta(30, i, len), data: &data }).unwrap();
                    if let Some(m) = t.get(&k, &mut buf).unwrap() {
                        assert_eq!(m.len as usize, len);
                        assert_eq!(&buf[..], &data[..], "wrong bytes for block {i}");
                    }
                }
            })
        })
        .collect();
    for th in threads {
        th.join().unwrap();
    }
    for i in 0..16 {
        let got = get_bytes(&*t, 30, i).expect("every block present");
        assert_eq!(got, content(&key(30, i), 40_000 + i as usize * 1000));
    }
}

fn concurrent_with_eviction(f: Factory) {
    // Small tier: puts evict while others read; a read returns the exact bytes or a miss.
    let (t, _d) = f.call(16 * PAGE as u64);
    let threads: Vec<_> = (0..6)
        .map(|th| {
            let t = Arc::clone(&t);
            std::thread::spawn(move || {
                let mut buf = BlockBuf::new();
                for round in 0..60u32 {
                    let c = 40 + (round + th) % 24;
                    let k = key(c, 0);
                    let len = PAGE + 123;
                    let data = content(&k, len);
                    let _ = t.put(BlockRef { key: k, meta: meta(c, 0, len), data: &data });
                    if let Some(_m) = t.get(&k, &mut buf).unwrap() {
                        assert_eq!(&buf[..], &data[..]);
                    }
                }
            })
        })
        .collect();
    for th in threads {
        th.join().unwrap();
    }
    assert!(t.usage().used_bytes <= t.usage().capacity_bytes);
}

/// A batch read returns exactly what one read per key would, misses included.
fn get_batch_matches_get(f: Factory) {
    let (t, _d) = f.call(16 << 20);
    let sizes = [1usize, 4096, PAGE + 3, 3 * PAGE];
    for (i, &len) in sizes.iter().enumerate() {
        put(&*t, 5, i as u32, len).unwrap();
    }
    // Present, missing, present again, present.
    let keys = [key(5, 0), key(6, 0), key(5, 2), key(5, 3), key(5, 1)];
    let mut outs: Vec<BlockBuf> = keys.iter().map(|_| BlockBuf::new()).collect();
    let got = t.get_batch(&keys, &mut outs);
    assert_eq!(got.len(), keys.len());
    for ((k, r), out) in keys.iter().zip(got).zip(&outs) {
        let mut one = BlockBuf::new();
        let single = t.get(k, &mut one).unwrap();
        assert_eq!(r.unwrap(), single, "{k}");
        if single.is_some() {
            assert_eq!(&out[..], &one[..], "{k}");
        }
    }
}

/// Records what a tier reports, in order.
#[derive(Debug, Default)]
struct Recorder(parking_lot::Mutex<Vec<(bool, kvproto::BlockKey)>>);

impl kvtiers::TierListener for Recorder {
    fn stored(&self, _tier: kvproto::TierKind, key: kvproto::BlockKey, _meta: &kvtiers::BlockMeta) {
        self.0.lock().push((true, key));
    }
    fn removed(&self, _tier: kvproto::TierKind, keys: &[kvproto::BlockKey]) {
        self.0.lock().extend(keys.iter().map(|k| (false, *k)));
    }
}

/// The listener hears every store and every loss, and replaying what it heard gives exactly
/// the tier's contents (what the daemon's hit reports rely on).
fn listener_mirrors_contents(f: Factory) {
    let (t, _d) = f.call(8 * PAGE as u64);
    let rec = Arc::new(Recorder::default());
    assert!(t.set_listener(rec.clone()));
    assert!(!t.set_listener(rec.clone()), "a second listener is refused");
    for i in 0..20 {
        put(&*t, 3, i, PAGE).unwrap(); // 8 fit: the rest evict
    }
    assert!(!put(&*t, 3, 19, PAGE).unwrap(), "an idempotent put reports nothing");
    t.remove(&key(3, 19)).unwrap();
    let mut mirror = std::collections::HashSet::new();
    for (stored, k) in rec.0.lock().iter() {
        if *stored {
            assert!(mirror.insert(*k), "stored twice without a removal");
        } else {
            assert!(mirror.remove(k), "removal of a key never stored");
        }
    }
    let now: std::collections::HashSet<_> = t.keys().into_iter().map(|(k, _)| k).collect();
    assert_eq!(mirror, now);
    assert!(!now.contains(&key(3, 19)));
}

/// What each tier is expected to offer beyond the core: (direct, probe, medium, reports).
type Offers = (bool, bool, bool, bool);

/// A tier offers exactly the extensions it is meant to (so that the extension cases below,
/// which run on every tier offering one, skip none by mistake).
fn offers_its_extensions(f: Factory, want: Offers) {
    let (t, _d) = f.call(16 << 20);
    let e = t.extensions();
    let got = (e.direct.is_some(), e.probe.is_some(), e.medium.is_some(), e.reports.is_some());
    assert_eq!(got, want, "{:?}: {e:?}", t.kind());
}

/// `len` bytes at the start of a 4 KiB-aligned buffer with room up to the next 4 KiB.
fn aligned(len: usize) -> BlockBuf {
    let mut b = BlockBuf::new();
    b.resize(len);
    b
}

/// `DirectIo`: pieces put as they are read back whole; `peek_each` knows present blocks
/// without a read; reads straight into named memory deliver exactly the bytes, report each
/// verified block, and refuse a destination of the wrong length (a miss that keeps the block).
fn direct_io_moves_bytes_without_a_buffer(f: Factory) {
    let (t, _d) = f.call(16 << 20);
    let Some(d) = t.extensions().direct else { return };
    let lens = [3 * 4096 + 100, 4096, 2 * PAGE];
    let keys: Vec<_> = (0..3).map(|i| key(21, i)).collect();
    let bodies: Vec<Vec<u8>> = keys.iter().zip(lens).map(|(k, n)| content(k, n)).collect();
    // Each body as two pieces: whole 4 KiB pages, then the rest (G2's page runs look so).
    let held: Vec<(BlockBuf, BlockBuf)> = bodies
        .iter()
        .map(|b| {
            let cut = (b.len() / 2) & !4095;
            (BlockBuf::from_slice(&b[..cut]), BlockBuf::from_slice(&b[cut..]))
        })
        .collect();
    // (A body under two pages goes as one piece.)
    let parts: Vec<Vec<&[u8]>> =
        held.iter().map(|(a, b)| if a.is_empty() { vec![&b[..]] } else { vec![&a[..], &b[..]] }).collect();
    let refs: Vec<kvtiers::PartsRef<'_>> = (0..3)
        .map(|i| kvtiers::PartsRef { key: keys[i], meta: meta(21, i as u32, lens[i]), parts: &parts[i] })
        .collect();
    assert!(d.put_pieces(&refs).into_iter().all(|r| r.unwrap()));
    assert!(!t.put_batch_parts(&refs[..1])[0].as_ref().unwrap(), "a second put of pieces is a no-op");
    for (i, b) in bodies.iter().enumerate() {
        assert_eq!(get_bytes(&*t, 21, i as u32).as_deref(), Some(&b[..]), "block {i} read back whole");
    }
    let absent = key(22, 0);
    let peeked = d.peek_each(&[keys[0], absent, keys[2]]);
    assert_eq!(peeked, vec![Some(meta(21, 0, lens[0])), None, Some(meta(21, 2, lens[2]))]);

    // Block 1 gets a destination one byte short: not read, a miss, still held.
    let mut outs: Vec<BlockBuf> = lens.iter().map(|&n| aligned(n)).collect();
    let mut short = aligned(lens[1] - 1);
    let dests: Vec<Vec<(*mut u8, usize)>> = outs
        .iter_mut()
        .enumerate()
        .map(|(i, o)| match i {
            1 => vec![(short.full_mut().as_mut_ptr(), lens[1] - 1)],
            _ => vec![(o.full_mut().as_mut_ptr(), lens[i])],
        })
        .collect();
    let views: Vec<&[(*mut u8, usize)]> = dests.iter().map(Vec::as_slice).collect();
    let mut seen = Vec::new();
    // SAFETY: each destination is a live 4 KiB-aligned BlockBuf with room up to the next
    // 4 KiB, touched by nothing else until the call returns.
    let got = unsafe { d.get_batch_into(&keys, &views, &mut |i| seen.push(i)) };
    let got: Vec<_> = got.into_iter().map(Result::unwrap).collect();
    assert_eq!(got, vec![Some(meta(21, 0, lens[0])), None, Some(meta(21, 2, lens[2]))]);
    seen.sort_unstable();
    assert!(seen.iter().all(|i| *i != 1), "only delivered blocks are reported verified: {seen:?}");
    assert_eq!(&outs[0][..], &bodies[0][..]);
    assert_eq!(&outs[2][..], &bodies[2][..]);
    assert!(t.contains(&keys[1]), "a refused destination costs the block nothing");

    // Into memory another process could write: whole pages delivered with their checksum;
    // a destination that is not whole 4 KiB pages is not delivered.
    let whole = 4096 * 3;
    let k = key(23, 0);
    let body = content(&k, whole);
    t.put(BlockRef { key: k, meta: meta(23, 0, whole), data: &body }).unwrap();
    let mut out = aligned(whole);
    let mut odd = aligned(lens[0]);
    let dests = [vec![(out.full_mut().as_mut_ptr(), whole)], vec![(odd.full_mut().as_mut_ptr(), lens[0])]];
    let views: Vec<&[(*mut u8, usize)]> = dests.iter().map(Vec::as_slice).collect();
    // SAFETY: as above: live aligned buffers, writable for their lengths until this returns.
    let got = unsafe { d.read_into_foreign(&[k, keys[0]], &views) };
    let delivered = got[0].expect("whole pages are delivered");
    assert_eq!(delivered.meta, meta(23, 0, whole));
    assert_eq!(delivered.sum, kvtiers::checksum_of(delivered.sum_kind, &body));
    assert_eq!(&out[..], &body[..]);
    assert!(got[1].is_none(), "a destination of part pages is not delivered");
}

/// `DirectIo::adopt_host_memory`: once a region is adopted, transfers into and out of it (and
/// out of anywhere else) still move exactly the bytes.
fn direct_io_with_adopted_memory(f: Factory) {
    let (t, _d) = f.call(16 << 20);
    let Some(d) = t.extensions().direct else { return };
    let region = Arc::new(parking_lot::Mutex::new(aligned(4 * PAGE)));
    let (base, len) = {
        let mut r = region.lock();
        (r.full_mut().as_mut_ptr().cast_const(), 4 * PAGE)
    };
    let owner: Arc<dyn std::any::Any + Send + Sync> = region.clone();
    // SAFETY: the buffer is one live allocation, never moved or freed while `owner` (a clone
    // of `region`, kept below) lives.
    unsafe { d.adopt_host_memory(base, len, owner) };
    let k = key(24, 0);
    let body = content(&k, 2 * PAGE);
    {
        let mut r = region.lock();
        r[..2 * PAGE].copy_from_slice(&body);
        let r = &*r;
        t.put(BlockRef { key: k, meta: meta(24, 0, 2 * PAGE), data: &r[..2 * PAGE] }).unwrap();
    }
    let mut r = region.lock();
    r.full_mut()[2 * PAGE..].fill(0);
    let dest = [(r.full_mut()[2 * PAGE..].as_mut_ptr(), 2 * PAGE)];
    // SAFETY: the second half of the adopted region, aligned, locked here until this returns.
    let got = unsafe { d.get_batch_into(&[k], &[&dest], &mut |_| {}) };
    assert_eq!(got[0].as_ref().unwrap(), &Some(meta(24, 0, 2 * PAGE)));
    assert_eq!(&r[2 * PAGE..4 * PAGE], &body[..]);
    assert_eq!(get_bytes(&*t, 24, 0).as_deref(), Some(&body[..]));
}

/// `PrefixProbe`: the probe counts the leading blocks the medium holds, stopping at the first
/// gap, whatever order they were written in.
fn prefix_probe_counts_the_held_prefix(f: Factory) {
    let (t, _d) = f.call(16 << 20);
    let Some(p) = t.extensions().probe else { return };
    for i in [0u32, 2, 1, 4] {
        put(&*t, 25, i, 4096).unwrap();
    }
    t.flush().unwrap();
    let keys: Vec<_> = (0..6).map(|i| key(25, i)).collect();
    assert_eq!(p.probe_prefix(NS, &keys), 3);
    assert_eq!(t.probe_prefix(NS, &keys), 3, "TierExt goes through the extension");
    assert_eq!(p.probe_prefix(NS, &[key(26, 0)]), 0);
    assert_eq!(p.probe_prefix(NS, &[]), 0);
}

/// `Medium`: a healthy medium says so, and a flush keeps every block readable.
fn medium_flushes_and_reports_health(f: Factory) {
    let (t, _d) = f.call(16 << 20);
    let Some(m) = t.extensions().medium else {
        assert_eq!(t.degraded(), None, "a tier with no medium is never degraded");
        t.flush().unwrap();
        return;
    };
    assert_eq!(m.degraded(), None);
    for i in 0..4 {
        put(&*t, 27, i, PAGE + 17).unwrap();
    }
    m.flush().unwrap();
    m.flush().unwrap();
    for i in 0..4 {
        assert_eq!(get_bytes(&*t, 27, i).map(|b| b.len()), Some(PAGE + 17));
    }
    assert_eq!(t.degraded(), None);
}

/// Puts block `i` of `chain` (2 pages) as `owner`'s.
fn put_owned(t: &dyn Tier, owner: u32, chain: u32, i: u32) -> Result<bool, TierError> {
    let k = key(chain, i);
    let data = content(&k, 2 * PAGE);
    t.put(BlockRef { key: k, meta: kvtiers::BlockMeta { owner: Some(owner), ..meta(chain, i, 2 * PAGE) }, data: &data })
}

/// Owner 0 may take `blocks` blocks of 2 pages; owner 1 has no quota. The tier is large.
fn quota_tier(f: QuotaFactory, blocks: u64) -> (Arc<dyn Tier>, tempfile::TempDir) {
    let q = |bytes| Quota { name: "conformance".into(), bytes };
    f(64 << 20, vec![q(blocks * 2 * PAGE as u64), q(0)])
}

fn held(t: &dyn Tier, chain: u32, n: u32) -> Vec<bool> {
    (0..n).map(|i| t.contains(&key(chain, i))).collect()
}

fn an_owner_at_its_quota_removes_its_own_chain_ends(f: QuotaFactory) {
    let (t, _d) = quota_tier(f, 3);
    for i in 0..3 {
        assert!(put_owned(&*t, 1, 50, i).unwrap(), "no quota for owner 1");
    }
    for i in 0..3 {
        assert!(put_owned(&*t, 0, 60, i).unwrap());
    }
    // A new prompt of owner 0: the old prompt goes from its end, its first block stays.
    assert!(put_owned(&*t, 0, 61, 0).unwrap());
    assert!(put_owned(&*t, 0, 61, 1).unwrap());
    assert_eq!(held(&*t, 60, 3), [true, false, false]);
    assert_eq!(held(&*t, 61, 2), [true, true]);
    assert_eq!(held(&*t, 50, 3), [true, true, true], "another owner's blocks all stay");
    assert!(t.stats().evictions >= 2);
    // Blocks with no owner are no one's: they fit whatever owner 0 holds.
    put(&*t, 62, 0, 2 * PAGE).unwrap();
    assert_eq!(held(&*t, 61, 2), [true, true]);
}

fn a_block_that_needs_its_own_prefix_removed_is_refused(f: QuotaFactory) {
    let (t, _d) = quota_tier(f, 2);
    assert!(put_owned(&*t, 0, 70, 0).unwrap());
    assert!(put_owned(&*t, 0, 70, 1).unwrap());
    let r = put_owned(&*t, 0, 70, 2);
    assert!(matches!(r, Err(TierError::OverQuota { why: OverQuota::OwnPrefix, .. })), "{r:?}");
    assert!(r.unwrap_err().to_string().contains("over the tenant's"));
    assert_eq!(held(&*t, 70, 3), [true, true, false], "nothing taken");
    let k = key(71, 0);
    let big = content(&k, 5 * PAGE);
    let meta = kvtiers::BlockMeta { owner: Some(0), ..meta(71, 0, 5 * PAGE) };
    let r = t.put(BlockRef { key: k, meta, data: &big });
    assert!(matches!(r, Err(TierError::OverQuota { why: OverQuota::TooLarge, .. })), "{r:?}");
    // A removal uncharges: the room is there again.
    assert!(t.remove(&key(70, 1)).unwrap());
    assert!(put_owned(&*t, 0, 72, 0).unwrap());
    assert_eq!(held(&*t, 70, 1), [true]);
}

fn an_owners_blocks_in_use_are_not_taken(f: QuotaFactory) {
    let (t, _d) = quota_tier(f, 2);
    assert!(put_owned(&*t, 0, 80, 0).unwrap());
    assert!(put_owned(&*t, 0, 81, 0).unwrap());
    let far = Instant::now() + Duration::from_secs(60);
    assert_eq!(t.pin(LeaseId(7), &[key(80, 0)], far), 1);
    // The oldest end is pinned (being loaded): the next one goes.
    assert!(put_owned(&*t, 0, 82, 0).unwrap());
    assert!(t.contains(&key(80, 0)) && !t.contains(&key(81, 0)));
    assert_eq!(t.pin(LeaseId(8), &[key(82, 0)], far), 1);
    let r = put_owned(&*t, 0, 83, 0);
    assert!(matches!(r, Err(TierError::OverQuota { why: OverQuota::Busy, .. })), "{r:?}");
    t.release(LeaseId(7));
    assert!(put_owned(&*t, 0, 83, 0).unwrap());
    assert!(!t.contains(&key(80, 0)) && t.contains(&key(82, 0)));
}

macro_rules! suite {
    ($modname:ident, $factory:expr, $offers:expr) => {
        mod $modname {
            use super::*;
            #[test]
            fn an_owner_at_its_quota_removes_its_own_chain_ends() {
                super::an_owner_at_its_quota_removes_its_own_chain_ends($factory)
            }
            #[test]
            fn a_block_that_needs_its_own_prefix_removed_is_refused() {
                super::a_block_that_needs_its_own_prefix_removed_is_refused($factory)
            }
            #[test]
            fn an_owners_blocks_in_use_are_not_taken() {
                super::an_owners_blocks_in_use_are_not_taken($factory)
            }
            #[test]
            fn offers_its_extensions() {
                super::offers_its_extensions(Factory($factory), $offers)
            }
            #[test]
            fn direct_io_moves_bytes_without_a_buffer() {
                super::direct_io_moves_bytes_without_a_buffer(Factory($factory))
            }
            #[test]
            fn direct_io_with_adopted_memory() {
                super::direct_io_with_adopted_memory(Factory($factory))
            }
            #[test]
            fn prefix_probe_counts_the_held_prefix() {
                super::prefix_probe_counts_the_held_prefix(Factory($factory))
            }
            #[test]
            fn medium_flushes_and_reports_health() {
                super::medium_flushes_and_reports_health(Factory($factory))
            }
            #[test]
            fn roundtrip_sizes() {
                super::roundtrip_sizes(Factory($factory))
            }
            #[test]
            fn miss_and_visibility() {
                super::miss_and_visibility(Factory($factory))
            }
            #[test]
            fn put_is_idempotent() {
                super::put_is_idempotent(Factory($factory))
            }
            #[test]
            fn length_mismatch_is_rejected() {
                super::length_mismatch_is_rejected(Factory($factory))
            }
            #[test]
            fn remove_frees_space() {
                super::remove_frees_space(Factory($factory))
            }
            #[test]
            fn evicts_lru_when_full() {
                super::evicts_lru_when_full(Factory($factory))
            }
            #[test]
            fn a_long_chain_is_evicted_from_its_tail() {
                super::a_long_chain_is_evicted_from_its_tail(Factory($factory))
            }
            #[test]
            fn the_least_recently_used_chain_goes_first() {
                super::the_least_recently_used_chain_goes_first(Factory($factory))
            }
            #[test]
            fn evicts_descendants_before_ancestors() {
                super::evicts_descendants_before_ancestors(Factory($factory))
            }
            #[test]
            fn pinned_blocks_stay_and_leases_expire() {
                super::pinned_blocks_stay_and_leases_expire(Factory($factory))
            }
            #[test]
            fn too_large_block_is_full_error() {
                super::too_large_block_is_full_error(Factory($factory))
            }
            #[test]
            fn concurrent_same_keys() {
                super::concurrent_same_keys(Factory($factory))
            }
            #[test]
            fn get_batch_matches_get() {
                super::get_batch_matches_get(Factory($factory))
            }
            #[test]
            fn listener_mirrors_contents() {
                super::listener_mirrors_contents(Factory($factory))
            }
            #[test]
            fn concurrent_with_eviction() {
                super::concurrent_with_eviction(Factory($factory))
            }
        }
    };
}

// (direct, probe, medium, reports)
suite!(g2_host, g2, (false, false, false, true));
suite!(g3_disk_uring, g3_uring, (true, false, true, true));
suite!(g3_disk_psync, g3_psync, (true, false, true, true));
suite!(g3_disk_inline, g3_inline, (true, false, true, true));
suite!(g4_object_memory, g4_memory, (false, true, true, true));
suite!(g4_object_file, g4_file, (false, true, true, true));
