//! G2 put/get and G3 write/read for 256 KiB, 2 MiB and 16 MiB blocks, each beside memcpy and
//! raw O_DIRECT on the same sizes in the same run.
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
use std::sync::atomic::{AtomicU32, Ordering};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvbench::raw::RawDirectFile;
use kvproto::{BlockKey, NamespaceId};
use kvtiers::disk::io::IoBackend;
use kvtiers::{BlockBuf, BlockMeta, BlockRef, CudaRegister, DiskTier, DiskTierConfig, HostTier, HostTierConfig, Tier};

const SIZES: [(usize, &str); 3] = [(256 << 10, "256KiB"), (2 << 20, "2MiB"), (16 << 20, "16MiB")];

static NEXT: AtomicU32 = AtomicU32::new(1);

fn fresh_key() -> BlockKey {
    let mut k = [0u8; 16];
    k[..4].copy_from_slice(&NEXT.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    k[15] = 0x77;
    BlockKey(k)
}

fn meta(len: usize) -> BlockMeta {
    BlockMeta { namespace: NamespaceId([1; 16]), parent: None, len: len as u64 }
}

fn filled(len: usize) -> BlockBuf {
    let mut b = BlockBuf::zeroed(len);
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i * 31 % 251) as u8;
    }
    b
}

fn bench_dir() -> std::path::PathBuf {
    std::env::var_os("KVBENCH_DIR").map(Into::into).unwrap_or_else(std::env::temp_dir)
}

fn g2(c: &mut Criterion) {
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
        let slots = self.map.len() / self.slot;
        let at = (self.next % slots) * self.slot;
        self.next += 1;
        self.map[at..at + self.slot].copy_from_slice(src);
        black_box(&self.map[at]);
    }
}

fn g3(c: &mut Criterion) {
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
        g.bench_function(BenchmarkId::new("raw_odirect_write", name), |b| b.iter(|| raw.write_next(&src).unwrap()));
        let mut out = BlockBuf::zeroed(len);
        g.bench_function(BenchmarkId::new("raw_odirect_read", name), |b| b.iter(|| raw.read_next(&mut out).unwrap()));
        // The limit of a read that must verify (every G3 read checks the block's checksum):
        // the same raw read, then the XXH3-64 of what arrived. The block has just arrived by
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
                black_box(got.iter().filter(|r| matches!(r, Ok(Some(_)))).count())
            })
        });
        drop(raw);
        let _ = std::fs::remove_file(dir.path().join(format!("raw-{name}")));
    }
    g.finish();
}

criterion_group!(benches, g2, g3);
criterion_main!(benches);
