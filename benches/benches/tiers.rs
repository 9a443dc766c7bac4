//! G2 put/get and G3 write/read for 256 KiB, 2 MiB and 16 MiB blocks, each beside memcpy and
//! raw O_DIRECT on the same sizes in the same run; a G3 hit delivered into engine memory beside
//! a raw read plus one memcpy (`g3_hit`); write-through of dirty G2 blocks into G3 beside raw
//! batched writes (`g3_writethrough`).
//!
//! `cargo bench -p kvbench --bench tiers` (set `KVBENCH_DIR` to put the G3 files on a
//! particular disk, the default being the system temp dir; `KVBENCH_G3_BACKEND=psync` or
//! `io_uring` to force a G3 I/O backend, `KVBENCH_G3_INLINE_READ_MAX=0` /
//! `KVBENCH_G3_INLINE_WRITE_MAX=0` to send every read / write batch to the I/O threads (by
//! default batches of up to 32 MiB run on the caller), `KVBENCH_G3_IO_THREADS=0` to run G3 I/O on the
//! calling thread, `KVBENCH_G3_QUEUE_DEPTH=N` for the io_uring ops in flight per thread).
//!
//! Two memcpy baselines for G2: `memcpy` copies into one destination that stays in cache (the
//! limit for a get of a hot block into a reused buffer), `memcpy_pool` copies into a rotating
//! destination across a shared-memory region as large as the pool (the limit for a put, whose
//! destination is a free page that has usually left the cache).
#![allow(clippy::unwrap_used)]

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvbench::raw::RawDirectFile;
use kvproto::{BlockKey, NamespaceId};
use kvtiers::disk::io::IoBackend;
use kvtiers::{
    BlockBuf, BlockMeta, BlockRef, BlockStore, CudaRegister, DiskTier, DiskTierConfig, HostTier, HostTierConfig, Tier,
    TierExt, WriteThroughConfig,
};

const SIZES: [(usize, &str); 3] = [(256 << 10, "256KiB"), (2 << 20, "2MiB"), (16 << 20, "16MiB")];

static NEXT: AtomicU32 = AtomicU32::new(1);

fn fresh_key() -> BlockKey {
    let mut k = [0u8; 16];
    k[..4].copy_from_slice(&NEXT.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    k[15] = 0x77;
    BlockKey(k)
}

fn meta(len: usize) -> BlockMeta {
    BlockMeta { namespace: NamespaceId([1; 16]), parent: None, len: len as u64, owner: None }
}

fn filled(len: usize) -> BlockBuf {
    let mut b = BlockBuf::zeroed(len);
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i * 31 % 251) as u8;
    }
    b
}

/// Whether the filter given on the command line (criterion's, a regex) selects any of `ids`:
/// groups it leaves out skip their set-up (G3's writes hundreds of MiB per size).
fn wanted(ids: impl IntoIterator<Item = String>) -> bool {
    const WITH_VALUE: [&str; 12] = [
        "--warm-up-time",
        "--measurement-time",
        "--sample-size",
        "--save-baseline",
        "--baseline",
        "--load-baseline",
        "--noise-threshold",
        "--confidence-level",
        "--significance-level",
        "--nresamples",
        "--color",
        "--profile-time",
    ];
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut filter = None;
    let mut i = 0;
    while i < args.len() {
        if WITH_VALUE.contains(&args[i].as_str()) {
            i += 1;
        } else if !args[i].starts_with('-') {
            filter = Some(args[i].clone());
            break;
        }
        i += 1;
    }
    match filter.map(|f| regex::Regex::new(&f)) {
        Some(Ok(re)) => ids.into_iter().any(|id| re.is_match(&id)),
        _ => true,
    }
}

/// Every `group/name/size` id of `names` over `sizes`.
fn ids(group: &str, names: &[&str], sizes: &[(usize, &str)]) -> Vec<String> {
    names.iter().flat_map(|n| sizes.iter().map(move |(_, s)| format!("{group}/{n}/{s}"))).collect()
}

fn bench_dir() -> std::path::PathBuf {
    std::env::var_os("KVBENCH_DIR").map(Into::into).unwrap_or_else(std::env::temp_dir)
}

fn g2(c: &mut Criterion) {
    if !wanted(ids("g2", &["memcpy", "memcpy_pool", "put", "get"], &SIZES)) {
        return;
    }
    let shm = tempfile::tempdir().unwrap();
    let mut cfg = HostTierConfig::with_capacity(1 << 30);
    cfg.cuda_register = CudaRegister::Off;
    if !std::path::Path::new("/dev/shm").is_dir() {
        cfg.shm_dir = shm.path().to_path_buf();
    }
    let tier = HostTier::open(&cfg).unwrap();
    let mut g = c.benchmark_group("g2");
    for (len, name) in SIZES {
        g.throughput(Throughput::Bytes(len as u64));
        let src = filled(len);
        let mut dst = BlockBuf::zeroed(len);
        g.bench_function(BenchmarkId::new("memcpy", name), |b| {
            b.iter(|| {
                dst.copy_from_slice(black_box(&src));
                black_box(&dst);
            })
        });
        let mut pool_base = PoolBaseline::new(&cfg.shm_dir, 1 << 30, len);
        g.bench_function(BenchmarkId::new("memcpy_pool", name), |b| b.iter(|| pool_base.copy_next(black_box(&src))));
        drop(pool_base);
        g.bench_function(BenchmarkId::new("put", name), |b| {
            b.iter(|| tier.put(BlockRef { key: fresh_key(), meta: meta(len), data: black_box(&src) }).unwrap())
        });
        let k = fresh_key();
        tier.put(BlockRef { key: k, meta: meta(len), data: &src }).unwrap();
        let mut out = BlockBuf::zeroed(len);
        g.bench_function(BenchmarkId::new("get", name), |b| {
            b.iter(|| black_box(tier.get(&k, &mut out).unwrap().unwrap()))
        });
    }
    g.finish();
}

/// A populated shared-memory mapping the size of the G2 pool, written slot after slot.
struct PoolBaseline {
    map: memmap2::MmapMut,
    slot: usize,
    next: usize,
    _file: tempfile::NamedTempFile,
}

impl PoolBaseline {
    fn new(dir: &std::path::Path, len: usize, slot: usize) -> Self {
        let file = tempfile::NamedTempFile::new_in(dir).unwrap();
        file.as_file().set_len(len as u64).unwrap();
        // SAFETY: the file is private to this bench and outlives the mapping.
        let map = unsafe { memmap2::MmapOptions::new().len(len).populate().map_mut(file.as_file()).unwrap() };
        Self { map, slot, next: 0, _file: file }
    }

    fn copy_next(&mut self, src: &[u8]) {
        self.next_slot().copy_from_slice(src);
    }

    /// The next `n` slots, as [`PoolBaseline::next_slot`] would give them one by one.
    fn next_slots(&mut self, n: usize) -> Vec<&mut [u8]> {
        let slots = self.map.len() / self.slot;
        let first = self.next % slots;
        self.next += n;
        let mut all: Vec<Option<&mut [u8]>> = self.map.chunks_exact_mut(self.slot).map(Some).collect();
        (0..n).map(|k| all[(first + k) % slots].take().unwrap()).collect()
    }

    /// The next slot (rotating through the whole mapping, so it has usually left the cache).
    fn next_slot(&mut self) -> &mut [u8] {
        let slots = self.map.len() / self.slot;
        let at = (self.next % slots) * self.slot;
        self.next += 1;
        &mut self.map[at..at + self.slot]
    }
}

/// Copies `src` into `dst` (pieces of a block's memory, in order), as a save copies out of
/// engine memory into G2's pages.
fn copy_into_pieces(src: &[u8], dst: &mut [&mut [u8]]) {
    let mut at = 0;
    for d in dst.iter_mut() {
        let n = d.len();
        d.copy_from_slice(&src[at..at + n]);
        at += n;
    }
}

/// Copies `pieces` (a block's bytes in order) into `dst`, as a load copies into engine memory.
fn copy_pieces(dst: &mut [u8], pieces: &[&[u8]]) {
    let mut at = 0;
    for p in pieces {
        dst[at..at + p.len()].copy_from_slice(p);
        at += p.len();
    }
    black_box(&dst[0]);
}

fn g3(c: &mut Criterion) {
    let names = [
        "raw_odirect_write",
        "raw_odirect_read",
        "raw_odirect_read_verify",
        "write",
        "read",
        "raw_odirect_write_batch16",
        "write_batch16",
        "raw_odirect_read_batch16",
        "read_batch16",
    ];
    if !wanted(ids("g3", &names, &SIZES)) {
        return;
    }
    let dir = tempfile::tempdir_in(bench_dir()).unwrap();
    let mut cfg = DiskTierConfig::new(dir.path().join("g3"), 1 << 30);
    cfg.backend = match std::env::var("KVBENCH_G3_BACKEND").as_deref() {
        Ok("psync") => IoBackend::Psync,
        Ok("io_uring") => IoBackend::IoUring,
        _ => IoBackend::Auto,
    };
    if let Some(n) = std::env::var("KVBENCH_G3_IO_THREADS").ok().and_then(|v| v.parse().ok()) {
        cfg.io_threads = n;
    }
    if let Some(n) = std::env::var("KVBENCH_G3_QUEUE_DEPTH").ok().and_then(|v| v.parse().ok()) {
        cfg.queue_depth = n;
    }
    if let Some(n) = std::env::var("KVBENCH_G3_INLINE_READ_MAX").ok().and_then(|v| v.parse().ok()) {
        cfg.inline_read_max = n;
    }
    if let Some(n) = std::env::var("KVBENCH_G3_INLINE_WRITE_MAX").ok().and_then(|v| v.parse().ok()) {
        cfg.inline_write_max = n;
    }
    cfg.fsync = false; // the raw baseline does not fsync either
    let tier = DiskTier::open(&cfg).unwrap();
    let mut g = c.benchmark_group("g3");
    g.sample_size(20);
    for (len, name) in SIZES {
        g.throughput(Throughput::Bytes(len as u64));
        let src = filled(len);
        let mut raw =
            RawDirectFile::create(&dir.path().join(format!("raw-{name}")), len, ((512 << 20) / len) as u64).unwrap();
        // Every slot written once, so that the raw reads read data (an unwritten extent of the
        // preallocated file reads as zeros without touching the disk) whatever the filter.
        for _ in 0..(512 << 20) / len {
            raw.write_next(&src).unwrap();
        }
        g.bench_function(BenchmarkId::new("raw_odirect_write", name), |b| b.iter(|| raw.write_next(&src).unwrap()));
        let mut out = BlockBuf::zeroed(len);
        g.bench_function(BenchmarkId::new("raw_odirect_read", name), |b| b.iter(|| raw.read_next(&mut out).unwrap()));
        // The limit of a read that must verify (every G3 read checks the block's checksum):
        // the same raw read, then the CRC-64 of what arrived. The block has just arrived by
        // DMA and its first reading by the CPU, not the hash's arithmetic, is what this adds.
        g.bench_function(BenchmarkId::new("raw_odirect_read_verify", name), |b| {
            b.iter(|| {
                raw.read_next(&mut out).unwrap();
                black_box(kvtiers::checksum(&out))
            })
        });
        g.bench_function(BenchmarkId::new("write", name), |b| {
            b.iter(|| tier.put(BlockRef { key: fresh_key(), meta: meta(len), data: black_box(&src) }).unwrap())
        });
        // Read back a rotating set of distinct blocks (like the raw read).
        let keys: Vec<BlockKey> = (0..((256 << 20) / len).max(32))
            .map(|_| {
                let k = fresh_key();
                tier.put(BlockRef { key: k, meta: meta(len), data: &src }).unwrap();
                k
            })
            .collect();
        let mut i = 0;
        g.bench_function(BenchmarkId::new("read", name), |b| {
            b.iter(|| {
                i = (i + 1) % keys.len();
                black_box(tier.get(&keys[i], &mut out).unwrap().unwrap())
            })
        });
        // A load of a chain: 16 blocks per call in one batch (one I/O hand-off, 16 reads in
        // flight), beside the same raw single-stream read.
        let mut outs: Vec<BlockBuf> = (0..16).map(|_| BlockBuf::zeroed(len)).collect();
        let mut at = 0;
        g.throughput(Throughput::Bytes(16 * len as u64));
        // Its limit: 16 raw O_DIRECT reads in flight at once through one ring (the raw file
        // still holds what `raw_odirect_write` wrote).
        match io_uring::IoUring::new(16) {
            Ok(mut ring) => {
                g.bench_function(BenchmarkId::new("raw_odirect_read_batch16", name), |b| {
                    b.iter(|| raw.read_batch(&mut ring, &mut outs).unwrap())
                });
            }
            Err(e) => eprintln!("g3/raw_odirect_read_batch16 skipped: io_uring unavailable here ({e})"),
        }
        g.bench_function(BenchmarkId::new("read_batch16", name), |b| {
            b.iter(|| {
                at = (at + 16) % (keys.len() - 15);
                let got = tier.get_batch(&keys[at..at + 16], &mut outs);
                // Every block is there: a bench of misses would measure nothing.
                assert_eq!(got.iter().filter(|r| matches!(r, Ok(Some(_)))).count(), 16);
            })
        });
        // Batched writes last: they evict the blocks the reads above read.
        let srcs: Vec<BlockBuf> = (0..16).map(|_| filled(len)).collect();
        if let Ok(mut ring) = io_uring::IoUring::new(16) {
            g.bench_function(BenchmarkId::new("raw_odirect_write_batch16", name), |b| {
                b.iter(|| raw.write_batch(&mut ring, &srcs).unwrap())
            });
        }
        g.bench_function(BenchmarkId::new("write_batch16", name), |b| {
            b.iter(|| {
                let blocks: Vec<BlockRef<'_>> =
                    srcs.iter().map(|s| BlockRef { key: fresh_key(), meta: meta(len), data: &s[..] }).collect();
                black_box(tier.put_batch(&blocks).iter().filter(|r| matches!(r, Ok(true))).count())
            })
        });
        drop(raw);
        let _ = std::fs::remove_file(dir.path().join(format!("raw-{name}")));
    }
    g.finish();
}

/// A block store of a 1 GiB G2 (in `KVBENCH_G2_SHM_DIR`, else `/dev/shm` where there is one)
/// over a 1 GiB G3 under `KVBENCH_DIR`, without fdatasync (as the raw baselines).
struct G2G3 {
    dir: tempfile::TempDir,
    _shm: tempfile::TempDir,
    shm_dir: std::path::PathBuf,
    g2: Arc<HostTier>,
    disk: Arc<dyn Tier>,
    store: BlockStore,
}

impl G2G3 {
    fn open() -> Self {
        let dir = tempfile::tempdir_in(bench_dir()).unwrap();
        let mut dcfg = DiskTierConfig::new(dir.path().join("g3"), 1 << 30);
        dcfg.fsync = false;
        let g3 = Arc::new(DiskTier::open(&dcfg).unwrap());
        let disk: Arc<dyn Tier> = Arc::clone(&g3) as _;
        let mut hcfg = HostTierConfig::with_capacity(1 << 30);
        hcfg.cuda_register = CudaRegister::Off;
        let shm = tempfile::tempdir().unwrap();
        if let Some(d) = std::env::var_os("KVBENCH_G2_SHM_DIR") {
            hcfg.shm_dir = d.into();
        } else if !std::path::Path::new("/dev/shm").is_dir() {
            hcfg.shm_dir = shm.path().to_path_buf();
        }
        let g2 = Arc::new(HostTier::open(&hcfg).unwrap());
        let store =
            BlockStore::with_tiers(Arc::clone(&g2), vec![Arc::clone(&disk)], WriteThroughConfig::default()).unwrap();
        // As a daemon does once started: G3's rings use the G2 pool as registered buffers.
        let t0 = std::time::Instant::now();
        while g3.fixed_ops().is_none() && t0.elapsed() < std::time::Duration::from_secs(30) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        if g3.fixed_ops().is_none() {
            eprintln!("G2 pool not registered with io_uring: G3 pins pages per op in this run");
        }
        Self { dir, _shm: shm, shm_dir: hcfg.shm_dir, g2, disk, store }
    }
}

/// A G3 hit delivered into engine memory (issues 20 and 23): blocks held only in G3 are loaded
/// as the daemon loads them into a CPU engine (`load`: read straight into the engine's memory, a
/// shared-memory region larger than the cache, and checked there; brought up into G2 afterwards,
/// outside the timing, as the daemon does after its reply; `load_segmented`: the same into slots
/// cut into 32 KiB segments, as a per-layer K/V layout cuts them) and as it loads them for a CUDA
/// engine (`load_through_g2`: into G2, each block copied on as it arrives), beside a raw
/// O_DIRECT read of the same size followed by one memcpy into the same region. After each load
/// the blocks are dropped from G2 again, outside the timing.
fn g3_hit(c: &mut Criterion) {
    let names = [
        "raw_read_memcpy",
        "promote",
        "load",
        "load_segmented",
        "load_through_g2",
        "raw_read_memcpy_batch16",
        "promote_batch16",
        "load_batch16",
        "load_segmented_batch16",
        "load_through_g2_batch16",
    ];
    if !wanted(ids("g3_hit", &names, &SIZES[..2])) {
        return;
    }
    let G2G3 { dir, _shm, shm_dir, g2, disk, store } = G2G3::open();
    let mut g = c.benchmark_group("g3_hit");
    g.sample_size(20);
    for (len, name) in &SIZES[..2] {
        let (len, name) = (*len, *name);
        let src = filled(len);
        let mut engine = PoolBaseline::new(&shm_dir, 512 << 20, len);
        let mut raw =
            RawDirectFile::create(&dir.path().join(format!("raw-{name}")), len, ((512 << 20) / len) as u64).unwrap();
        for _ in 0..(512 << 20) / len {
            raw.write_next(&src).unwrap();
        }
        let keys: Vec<BlockKey> = (0..((512 << 20) / len))
            .map(|_| {
                let k = fresh_key();
                disk.put(BlockRef { key: k, meta: meta(len), data: &src }).unwrap();
                k
            })
            .collect();
        let mut out = BlockBuf::zeroed(len);
        let mut at = 0;
        for n in [1usize, 16] {
            g.throughput(Throughput::Bytes((n * len) as u64));
            let suffix = if n == 1 { String::new() } else { format!("_batch{n}") };
            let mut outs: Vec<BlockBuf> = (0..n).map(|_| BlockBuf::zeroed(len)).collect();
            match io_uring::IoUring::new(16) {
                Ok(mut ring) => {
                    g.bench_function(BenchmarkId::new(format!("raw_read_memcpy{suffix}"), name), |b| {
                        b.iter(|| {
                            if n == 1 {
                                raw.read_next(&mut outs[0]).unwrap();
                            } else {
                                raw.read_batch(&mut ring, &mut outs).unwrap();
                            }
                            for o in &outs {
                                engine.copy_next(o);
                            }
                        })
                    });
                }
                Err(e) => eprintln!("g3_hit/raw_read_memcpy skipped: io_uring unavailable here ({e})"),
            }
            // The promotion alone (G3 into G2, verified), to split a load's time.
            g.bench_function(BenchmarkId::new(format!("promote{suffix}"), name), |b| {
                b.iter_custom(|iters| {
                    time_loads(iters, &mut at, &keys, n, &g2, |batch| {
                        let t0 = std::time::Instant::now();
                        store.promote_batch(batch).unwrap();
                        t0.elapsed()
                    })
                })
            });
            // As the daemon loads into a CPU engine: read straight into the engine's slots and
            // checked there; brought up into G2 after the engine is told (outside the timing, as
            // the daemon does it after its reply), copied back and checked again. `load_segmented`:
            // the same into an engine whose layout cuts each block into 32 KiB segments (one per
            // layer and K or V, as a Llama-3-8B-shaped block of 2 MiB is): a read op per segment.
            for (row, segment) in [("load", len), ("load_segmented", 32 << 10)] {
                g.bench_function(BenchmarkId::new(format!("{row}{suffix}"), name), |b| {
                    b.iter_custom(|iters| {
                        time_loads(iters, &mut at, &keys, n, &g2, |batch| {
                            let mut dsts = engine.next_slots(n);
                            let segments: Vec<Vec<(*mut u8, usize)>> = dsts
                                .iter_mut()
                                .map(|d| d.chunks_mut(segment).map(|c| (c.as_mut_ptr(), c.len())).collect())
                                .collect();
                            let t0 = std::time::Instant::now();
                            let got = store.read_into_foreign(batch, |i, _| {
                                // SAFETY: each slot is this bench's mapping, untouched until the
                                // call returns.
                                Some(unsafe { kvtiers::Destination::new(segments[i].clone()) })
                            });
                            let took = t0.elapsed();
                            for ((k, d), slot) in batch.iter().zip(got).zip(&dsts) {
                                let (tier, d) = d.expect("a G3 block was not delivered");
                                assert!(store.promote_copy(k, tier, &d, |dst| {
                                    copy_into_pieces(slot, dst);
                                    true
                                }));
                            }
                            took
                        })
                    })
                });
            }
            // As the daemon loads into a CUDA engine, up to its copy to the GPU: into G2, each
            // block copied on as soon as it is in, while the batch's later reads are in flight.
            g.bench_function(BenchmarkId::new(format!("load_through_g2{suffix}"), name), |b| {
                b.iter_custom(|iters| {
                    time_loads(iters, &mut at, &keys, n, &g2, |batch| {
                        let mut dsts = engine.next_slots(n);
                        let mut copied = vec![false; n];
                        // As the daemon's load does: each block copied on as soon as it is in,
                        // while the batch's later reads are in flight; the rest out of G2.
                        let t0 = std::time::Instant::now();
                        let p = store.promote_batch_lossy_each(batch, &mut |k, _, _, pieces| {
                            if let Some(i) = batch.iter().position(|b| b == k) {
                                copy_pieces(dsts[i], pieces);
                                copied[i] = true;
                            }
                        });
                        assert!(p.error.is_none(), "{:?}", p.error);
                        for (i, k) in batch.iter().enumerate() {
                            if !copied[i] {
                                let dst = &mut *dsts[i];
                                store.read_with(k, &mut out, |_, pieces| copy_pieces(dst, pieces)).unwrap().unwrap();
                            }
                        }
                        t0.elapsed()
                    })
                })
            });
        }
        drop(raw);
        let _ = std::fs::remove_file(dir.path().join(format!("raw-{name}")));
        for k in &keys {
            disk.remove(k).unwrap();
        }
    }
    g.finish();
}

/// Runs `load` `iters` times, each on the next `n` of `keys` (rotating through them from `at`),
/// and drops each batch from G2 again after it, outside the timing; the sum of the times `load`
/// returns.
fn time_loads(
    iters: u64,
    at: &mut usize,
    keys: &[BlockKey],
    n: usize,
    g2: &HostTier,
    mut load: impl FnMut(&[BlockKey]) -> std::time::Duration,
) -> std::time::Duration {
    let mut took = std::time::Duration::ZERO;
    for _ in 0..iters {
        *at = (*at + n) % (keys.len() - n + 1);
        let batch = &keys[*at..*at + n];
        took += load(batch);
        for k in batch {
            g2.remove(k).unwrap();
        }
    }
    took
}

/// Write-through of dirty G2 blocks into G3 (issue 23), beside 64 raw O_DIRECT writes of the same
/// size, 16 in flight at a time: `drain_dirty_g2` saves 64 blocks into G2 with write-through
/// paused and times from its resumption until the last of them is on disk and indexed
/// (`BlockStore::wait_writethrough`; no fdatasync, as the raw side); `save_and_write_through`
/// times from the first save, the saves racing the writer.
fn g3_writethrough(c: &mut Criterion) {
    const N: usize = 64;
    if !wanted(ids(
        "g3_writethrough",
        &["raw_odirect_write_batch16", "drain_dirty_g2", "save_and_write_through"],
        &SIZES[..2],
    )) {
        return;
    }
    let G2G3 { dir, _shm, store, .. } = G2G3::open();
    let mut g = c.benchmark_group("g3_writethrough");
    g.sample_size(10);
    for (len, name) in &SIZES[..2] {
        let (len, name) = (*len, *name);
        g.throughput(Throughput::Bytes((N * len) as u64));
        let srcs: Vec<BlockBuf> = (0..16).map(|_| filled(len)).collect();
        let mut raw =
            RawDirectFile::create(&dir.path().join(format!("raw-{name}")), len, ((512 << 20) / len) as u64).unwrap();
        if let Ok(mut ring) = io_uring::IoUring::new(16) {
            g.bench_function(BenchmarkId::new("raw_odirect_write_batch16", name), |b| {
                b.iter(|| {
                    for _ in 0..N / 16 {
                        raw.write_batch(&mut ring, &srcs).unwrap();
                    }
                })
            });
        }
        // The drain is timed from the writers' release, with the 64 already saved; the other row
        // from the first save.
        for (row, drain_only) in [("drain_dirty_g2", true), ("save_and_write_through", false)] {
            g.bench_function(BenchmarkId::new(row, name), |b| {
                b.iter_custom(|iters| {
                    let mut took = std::time::Duration::ZERO;
                    for _ in 0..iters {
                        let keys: Vec<BlockKey> = (0..N).map(|_| fresh_key()).collect();
                        let pause = drain_only.then(|| store.pause_writethrough());
                        let mut t0 = std::time::Instant::now();
                        for (i, k) in keys.iter().enumerate() {
                            store.put(*k, meta(len), &srcs[i % 16]).unwrap();
                        }
                        if let Some(pause) = pause {
                            t0 = std::time::Instant::now();
                            drop(pause);
                        }
                        store.wait_writethrough();
                        took += t0.elapsed();
                        for k in &keys {
                            store.remove(k).unwrap();
                        }
                    }
                    took
                })
            });
        }
        drop(raw);
        let _ = std::fs::remove_file(dir.path().join(format!("raw-{name}")));
    }
    g.finish();
}

criterion_group!(benches, g2, g3, g3_hit, g3_writethrough);
criterion_main!(benches);
