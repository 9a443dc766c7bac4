//! G3: blocks on local NVMe. One preallocated data file written with O_DIRECT by the I/O
//! threads ([`io`]), carved into pages ([`crate::pages`]); the durable index in RocksDB
//! ([`index`]). Every read is verified against the block's checksum, computed while the I/O
//! runs (`verify`).
//!
//! Write protocol: reserve pages (invisible) -> write bytes -> fdatasync (when `fsync`) ->
//! index entry -> visible. Eviction deletes the index entry before the pages can be reused.

pub mod faults;
mod forget;
mod health;
pub mod index;
pub mod io;
pub mod op;
pub mod psync;
mod read;
pub mod uring;
mod verify;

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use kvproto::{BlockKey, TierKind};
use parking_lot::Mutex;

use self::index::{DiskIndex, IndexEntry};
use self::io::{EngineFactory, IoBackend, IoKind, IoOp, IoThreads, engine_factory};
use self::verify::WriteSums;
use crate::block::{BlockMeta, LeaseId, SumKind};
use crate::buf::{ALIGN, BlockBuf, align_up};
use crate::error::{Result, TierError};
use crate::host::validate_space;
use crate::listener::{ListenerSlot, TierListener};
use crate::lru_policy::LruPolicy;
use crate::pages::{PagePool, Pages};
use crate::residency::{Residency, SlotBytes};
use crate::room::{self, Room};
use crate::stats::{TierCounters, TierStats, TierUsage};
use crate::tier::{BlockRef, Delivered, DirectIo, Extensions, Medium, PartsRef, Reports, Tier};

const TIER: TierKind = TierKind::G3Disk;

/// Configuration of the G3 disk tier.
#[derive(Debug, Clone)]
pub struct DiskTierConfig {
    /// Directory for `blocks.dat` and the `index/` RocksDB.
    pub dir: PathBuf,
    /// Bytes of the data file (reserved with fallocate at start).
    pub capacity_bytes: u64,
    /// Allocation unit; a multiple of 4096. Fixed for the life of the directory.
    pub page_size: usize,
    pub io_threads: usize,
    /// With I/O threads, batches of reads of at most this many bytes in all run on the calling
    /// thread (no thread hop; [`io::INLINE_MAX`] by default, 0: never).
    pub inline_read_max: usize,
    /// The same for batches of writes.
    pub inline_write_max: usize,
    /// io_uring entries per thread.
    pub queue_depth: u32,
    pub backend: IoBackend,
    /// Open the data file with O_DIRECT (falls back, logged, where the filesystem refuses).
    pub direct_io: bool,
    /// fdatasync each written batch before indexing it (survives power loss, not just crashes).
    pub fsync: bool,
    pub high_watermark: f64,
    pub low_watermark: f64,
    /// Fault injection into the tier's I/O, for the fault suites only ([`faults`]); None (the
    /// default) opens the real engines unwrapped.
    pub faults: Option<Arc<faults::DiskFaults>>,
    /// Owners' quotas in this tier, owner `i` having `quotas[i]` ([`crate::quota`]); empty:
    /// none.
    pub quotas: Vec<crate::quota::Quota>,
}

impl DiskTierConfig {
    /// Defaults for a tier of `capacity_bytes` under `dir`.
    pub fn new(dir: impl Into<PathBuf>, capacity_bytes: u64) -> Self {
        Self {
            dir: dir.into(),
            capacity_bytes,
            page_size: 64 * 1024,
            io_threads: 2,
            inline_read_max: io::INLINE_MAX,
            inline_write_max: io::INLINE_MAX,
            queue_depth: 64,
            backend: IoBackend::Auto,
            direct_io: true,
            fsync: true,
            high_watermark: 0.98,
            low_watermark: 0.95,
            faults: None,
            quotas: Vec::new(),
        }
    }
}

#[derive(Debug)]
struct DiskSlot {
    pages: Pages,
    /// Set before the block becomes visible (computed while its write runs).
    checksum: AtomicU64,
    /// What `checksum` is (blocks of an older record version were summed with XXH3).
    sum_kind: SumKind,
    tick: AtomicU64,
}

impl SlotBytes for DiskSlot {
    fn slot_bytes(&self) -> u64 {
        self.pages.bytes()
    }
}

/// The G3 tier.
#[derive(Debug)]
pub struct DiskTier {
    file: File,
    index: DiskIndex,
    io: IoThreads,
    pool: Arc<PagePool>,
    state: Mutex<Residency<DiskSlot>>,
    counters: TierCounters,
    cfg: DiskTierConfig,
    next_tick: AtomicU64,
    /// Capacity and watermarks (`room.rs`).
    room: Room,
    logged_corruption: AtomicBool,
    /// Recent I/O failures, for `/healthz`.
    health: health::DiskHealth,
    listener: ListenerSlot,
    /// Recency ticks not yet in the index, written in one batch per `TOUCH_BATCH` reads (and at
    /// flush): a RocksDB write per read would cost more than the checksum.
    /// Weak: a block waiting here must stay evictable (eviction takes only blocks nobody holds),
    /// and its pages must be freed when it is removed; the weak reference also keeps the slot's
    /// address from being reused, so `ptr_eq` below cannot match a newer slot.
    touched: Mutex<Vec<(BlockKey, Weak<DiskSlot>, IndexEntry)>>,
    /// Blocks dropped whose index records could not be deleted yet; their pages stay taken
    /// (`forget.rs`).
    undeleted: Mutex<Vec<(BlockKey, Arc<DiskSlot>)>>,
}

/// Reads whose recency ticks are written to the index together.
const TOUCH_BATCH: usize = 256;

fn open_data_file(cfg: &DiskTierConfig, len: u64) -> Result<File> {
    let path = cfg.dir.join("blocks.dat");
    let open = |direct: bool| {
        let mut o = OpenOptions::new();
        o.read(true).write(true).create(true).truncate(false).mode(0o600);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(&path)
    };
    let file = match open(cfg.direct_io) {
        Ok(f) => f,
        Err(e) if cfg.direct_io && e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::warn!(path = %path.display(), "filesystem refuses O_DIRECT; G3 uses buffered I/O");
            open(false).map_err(|e| TierError::io(TIER, "open data file", e))?
        }
        Err(e) => return Err(TierError::io(TIER, "open data file", e)),
    };
    // A capacity other than the data file's: applied, and said (blocks past a smaller end are
    // dropped by the recovery that follows, as out of range).
    let was = file.metadata().map(|m| m.len()).unwrap_or(0);
    if was > 0 && was != len {
        tracing::info!(from_bytes = was, to_bytes = len, path = %path.display(), "G3 resized");
        if was > len {
            file.set_len(len).map_err(|e| TierError::io(TIER, "shrink data file", e))?;
        }
    }
    // SAFETY: plain syscall on an owned fd.
    let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
    if r != 0 {
        return Err(TierError::Config {
            field: "g3 capacity_bytes",
            reason: format!(
                "cannot reserve {len} bytes at {}: {} (lower the capacity or free space)",
                path.display(),
                std::io::Error::from_raw_os_error(r)
            ),
        });
    }
    Ok(file)
}

impl DiskTier {
    /// Opens the tier with the standard I/O engine.
    pub fn open(cfg: &DiskTierConfig) -> Result<Self> {
        let factory = engine_factory(cfg.backend, cfg.queue_depth);
        let factory = match &cfg.faults {
            Some(f) => faults::wrap(factory, f),
            None => factory,
        };
        Self::open_with_engine(cfg, factory)
    }

    /// Opens the tier with a custom engine factory (fault injection in tests). Recovers every
    /// indexed block; drops records that are malformed, out of range or overlapping.
    pub fn open_with_engine(cfg: &DiskTierConfig, factory: EngineFactory) -> Result<Self> {
        validate_space(cfg.page_size, cfg.capacity_bytes, cfg.high_watermark, cfg.low_watermark)?;
        std::fs::create_dir_all(&cfg.dir).map_err(|e| TierError::io(TIER, "create directory", e))?;
        let total = (cfg.capacity_bytes / cfg.page_size as u64) as u32;
        let len = total as u64 * cfg.page_size as u64;
        let file = open_data_file(cfg, len)?;
        let index = DiskIndex::open(&cfg.dir.join("index"), cfg.page_size)?;
        let io =
            IoThreads::start(cfg.io_threads, cfg.io_threads * 4, (cfg.inline_read_max, cfg.inline_write_max), &factory)
                .map_err(|e| TierError::io(TIER, "start I/O threads", e))?;

        // Recovery: claim the pages of valid entries.
        let mut bad_raw = Vec::new();
        let mut bad_keys = Vec::new();
        let mut entries = Vec::new();
        for item in index.scan()? {
            match item {
                Ok(e) => entries.push(e),
                Err(raw) => bad_raw.push(raw),
            }
        }
        // Most recent first: where two records name one page, the later one was written over
        // the earlier one's data (an index entry is written only once its data is on disk), so
        // the earlier record is the stale one and is dropped.
        entries.sort_by_key(|(_, e)| std::cmp::Reverse(e.tick));
        let mut claimed = vec![false; total as usize];
        let mut good = Vec::new();
        for (key, e) in entries {
            let need = (e.meta.len.div_ceil(cfg.page_size as u64) as usize).max(1);
            // The runs are checked before they are expanded: a record read from disk may name
            // any run (up to 2^32 pages each), and its page list must not be allocated first.
            let in_range = e.runs.iter().all(|&(f, n)| u64::from(f) + u64::from(n) <= u64::from(total));
            let named: u64 = e.runs.iter().map(|&(_, n)| u64::from(n)).sum();
            if !in_range || named != need as u64 || named > u64::from(total) {
                bad_keys.push(key);
                continue;
            }
            let pages: Vec<u32> = e.runs.iter().flat_map(|&(f, n)| f..f + n).collect();
            // Claimed by a more recent block, or named twice in this record: invalid, and this
            // record's own claims are undone.
            let taken = pages.iter().position(|&p| std::mem::replace(&mut claimed[p as usize], true));
            if let Some(at) = taken {
                for &p in &pages[..at] {
                    claimed[p as usize] = false;
                }
                bad_keys.push(key);
                continue;
            }
            good.push((key, e, pages));
        }
        if !bad_raw.is_empty() || !bad_keys.is_empty() {
            tracing::warn!(
                malformed = bad_raw.len(),
                invalid = bad_keys.len(),
                "G3 index held unusable records; dropped them"
            );
            index.delete_raw(&bad_raw)?;
            index.write(&[], &bad_keys, false)?;
        }
        let used: Vec<u32> = good.iter().flat_map(|(_, _, p)| p.iter().copied()).collect();
        let pool = PagePool::with_used(cfg.page_size, total, &used);
        let mut st = Residency::new(Box::new(LruPolicy::new()));
        st.set_quotas(crate::quota::Quotas::new(TIER, &cfg.quotas));
        let mut max_tick = 0;
        let recovered = good.len();
        // Oldest first into the LRU order.
        for (key, e, pages) in good.into_iter().rev() {
            max_tick = max_tick.max(e.tick);
            let slot = Arc::new(DiskSlot {
                pages: pool.adopt(pages),
                checksum: AtomicU64::new(e.checksum),
                sum_kind: e.sum_kind,
                tick: AtomicU64::new(e.tick),
            });
            st.insert_ready(key, e.meta, slot);
        }
        st.recount_children();
        tracing::info!(blocks = recovered, dir = %cfg.dir.display(), backend = io.backend(), "G3 opened");
        let counters = TierCounters::new(TIER, len);
        counters.set_usage(pool.used_pages() as u64 * cfg.page_size as u64, st.len());
        Ok(Self {
            file,
            index,
            io,
            room: Room::of_pool(TIER, &pool, cfg.high_watermark, cfg.low_watermark),
            pool,
            state: Mutex::new(st),
            counters,
            cfg: cfg.clone(),
            next_tick: AtomicU64::new(max_tick + 1),
            logged_corruption: AtomicBool::new(false),
            undeleted: Mutex::new(Vec::new()),
            health: health::DiskHealth::default(),
            touched: Mutex::new(Vec::new()),
            listener: ListenerSlot::default(),
        })
    }

    /// G3 ops that went through the registered G2 memory so far (None: not registered, yet
    /// or for good).
    pub fn fixed_ops(&self) -> Option<u64> {
        self.io.fixed_ops()
    }

    /// Why the G2 memory offered to G3 could not be registered, once that is known.
    pub fn fixed_refused(&self) -> Option<String> {
        self.io.fixed_refused()
    }

    /// The I/O backend in use (`io_uring` or `psync`).
    pub fn backend(&self) -> &'static str {
        self.io.backend()
    }

    fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    fn tick(&self) -> u64 {
        self.next_tick.fetch_add(1, Ordering::Relaxed)
    }

    /// Evicts (index first, then space) so that `pages` more pages fit.
    fn make_room(&self, st: &mut Residency<DiskSlot>, pages: usize) -> Result<()> {
        // Pages of blocks dropped while the index refused their deletes come back first; while
        // it still refuses, nothing more is evicted (each put would take more blocks out).
        self.forget(st, Vec::new())?;
        let page = self.pool.page_size() as u64;
        let want = pages as u64 * page;
        let need = self.room.bytes_to_evict(
            self.pool.used_pages() as u64 * page,
            self.pool.free_pages() as u64 * page,
            want,
        )?;
        if need == 0 {
            return Ok(());
        }
        let (victims, _) = st.evict(need, Instant::now(), true);
        if !victims.is_empty() {
            let keys: Vec<BlockKey> = victims.iter().map(|(k, _)| *k).collect();
            // Out of the tier either way; their pages are reused only once the deletions are
            // in the index.
            room::evicted(TIER, &self.counters, &self.listener, &keys);
        }
        self.forget(st, forget::slots(victims))?;
        if self.pool.free_pages() >= pages {
            Ok(())
        } else {
            Err(self.room.full(want, self.pool.free_pages() as u64 * page))
        }
    }

    /// Builds the write ops of one block. Full pages are written straight from `data` when it
    /// is aligned; the rest goes through `bounce`.
    /// The write ops of a block given as `parts` (each starting on a 4 KiB boundary and all but
    /// the last whole 4 KiB units, or a single part of any kind) into `pages`: straight from the
    /// caller's memory where it is aligned, through a padded bounce buffer for the rest.
    fn write_ops(&self, parts: &[&[u8]], pages: &Pages, bounce: &mut Vec<BlockBuf>, ops: &mut Vec<IoOp>) {
        let ps = self.pool.page_size();
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let (mut seg, mut seg_off) = (0usize, 0usize);
        let mut off = 0usize;
        for (first, n) in pages.runs() {
            let run_bytes = (len - off).min(n as usize * ps);
            let mut file_off = first as u64 * ps as u64;
            if run_bytes == 0 {
                // An empty block still writes one (zero) page, like any other.
                let b = BlockBuf::zeroed(ALIGN);
                ops.push(IoOp { kind: IoKind::Write, offset: file_off, addr: b.as_ptr() as usize, len: ALIGN });
                bounce.push(b);
            }
            let mut left = run_bytes;
            while left > 0 {
                while seg_off >= parts[seg].len() {
                    seg += 1;
                    seg_off = 0;
                }
                let take = left.min(parts[seg].len() - seg_off);
                let src = &parts[seg][seg_off..seg_off + take];
                let direct = if (src.as_ptr() as usize).is_multiple_of(ALIGN) { take / ALIGN * ALIGN } else { 0 };
                if direct > 0 {
                    ops.push(IoOp { kind: IoKind::Write, offset: file_off, addr: src.as_ptr() as usize, len: direct });
                }
                let rest = take - direct;
                if rest > 0 {
                    let mut b = BlockBuf::from_slice(&src[direct..]);
                    let padded = align_up(rest);
                    b.resize(padded);
                    b[rest..].fill(0);
                    ops.push(IoOp {
                        kind: IoKind::Write,
                        offset: file_off + direct as u64,
                        addr: b.as_ptr() as usize,
                        len: padded,
                    });
                    bounce.push(b);
                }
                file_off += take as u64;
                seg_off += take;
                left -= take;
            }
            off += run_bytes;
        }
    }

    /// Writes recency ticks of blocks that are still resident. Runs under the state lock, like
    /// eviction's index deletes, so that a tick never resurrects an entry evicted meanwhile.
    fn write_touches(&self, batch: Vec<(BlockKey, Weak<DiskSlot>, IndexEntry)>) {
        let mut st = self.state.lock();
        let live: Vec<(BlockKey, IndexEntry)> = batch
            .into_iter()
            .filter(|(k, slot, _)| st.get(k, false).is_some_and(|(s, _)| std::ptr::eq(Arc::as_ptr(&s), slot.as_ptr())))
            .map(|(k, _, e)| (k, e))
            .collect();
        if let Err(e) = self.index.touch(&live) {
            tracing::debug!("G3 recency update failed: {e}");
        }
        drop(st);
    }

    fn corrupt(&self, key: &BlockKey, slot: &Arc<DiskSlot>, why: &str) {
        self.counters.checksum_failures.add(1);
        if !self.logged_corruption.swap(true, Ordering::Relaxed) {
            tracing::error!(%key, why, "G3 block failed verification; dropped and served as a miss (further failures are only counted in kvcached_tier_checksum_failures_total)");
        }
        let mut st = self.state.lock();
        let same = st.get(key, false).is_some_and(|(s, _)| Arc::ptr_eq(&s, slot));
        if same && let Some(e) = st.remove(key) {
            self.listener.removed(TIER, &[*key]);
            if let Err(e) = self.forget(&st, forget::slots([(*key, e)])) {
                tracing::warn!("G3 index delete failed: {e}");
            }
        }
    }
}

impl Tier for DiskTier {
    fn kind(&self) -> TierKind {
        TIER
    }

    fn put_batch(&self, blocks: &[BlockRef<'_>]) -> Vec<Result<bool>> {
        let parts: Vec<[&[u8]; 1]> = blocks.iter().map(|b| [b.data]).collect();
        let refs: Vec<PartsRef<'_>> =
            blocks.iter().zip(&parts).map(|(b, p)| PartsRef { key: b.key, meta: b.meta, parts: p }).collect();
        self.put_pieces(&refs)
    }

    /// Reads every block in one I/O batch (one hand-off to the I/O threads, all reads in flight
    /// at once), then verifies each on its own: a block that fails is dropped and is a miss,
    /// the others are served.
    fn get_batch(&self, keys: &[BlockKey], outs: &mut [BlockBuf]) -> Vec<Result<Option<BlockMeta>>> {
        // SAFETY: every destination is one of `outs`' aligned buffers, sized to the block here
        // (capacity covering the padded tail), which nothing else touches until this returns.
        unsafe {
            self.read_into(
                keys,
                |i, meta| {
                    let out = &mut outs[i];
                    out.resize(meta.len as usize);
                    Some(vec![(out.full_mut().as_mut_ptr(), meta.len as usize)])
                },
                |_| {},
                true,
            )
        }
        .into_iter()
        .map(|r| r.map(|d| d.map(|d| d.meta)))
        .collect()
    }

    fn contains_each(&self, keys: &[BlockKey]) -> Vec<bool> {
        let st = self.state.lock();
        keys.iter().map(|k| st.contains(k)).collect()
    }

    fn remove(&self, key: &BlockKey) -> Result<bool> {
        let mut st = self.state.lock();
        let Some(e) = st.remove(key) else { return Ok(false) };
        self.listener.removed(TIER, &[*key]);
        self.forget(&st, forget::slots([(*key, e)]))?;
        self.counters.set_usage(self.pool.used_pages() as u64 * self.pool.page_size() as u64, st.len());
        Ok(true)
    }

    fn pin(&self, lease: LeaseId, keys: &[BlockKey], deadline: Instant) -> usize {
        self.state.lock().pin(lease, keys, deadline)
    }

    fn release(&self, lease: LeaseId) {
        self.state.lock().release(lease);
    }

    fn usage(&self) -> TierUsage {
        let blocks = self.state.lock().len();
        room::pool_usage(&self.pool, blocks)
    }

    fn stats(&self) -> TierStats {
        self.counters.snapshot(self.usage())
    }

    fn keys(&self) -> Vec<(BlockKey, BlockMeta)> {
        self.state.lock().ready_keys()
    }

    fn extensions(&self) -> Extensions<'_> {
        Extensions { direct: Some(self), medium: Some(self), reports: Some(self), ..Extensions::default() }
    }
}

impl DirectIo for DiskTier {
    fn peek_each(&self, keys: &[BlockKey]) -> Vec<Option<BlockMeta>> {
        let mut st = self.state.lock();
        keys.iter().map(|k| st.get(k, false).map(|(_, meta)| meta)).collect()
    }

    unsafe fn get_batch_into(
        &self,
        keys: &[BlockKey],
        dests: &[&[(*mut u8, usize)]],
        verified: &mut dyn FnMut(usize),
    ) -> Vec<Result<Option<BlockMeta>>> {
        // SAFETY: the caller's contract (see `DirectIo::get_batch_into`) is `read_into`'s; a
        // destination that does not add up to the block's length is not read into.
        unsafe {
            self.read_into(keys, |i, meta| fitting(dests.get(i)?, meta), verified, true)
                .into_iter()
                .map(|r| r.map(|d| d.map(|d| d.meta)))
                .collect()
        }
    }

    unsafe fn read_into_foreign(&self, keys: &[BlockKey], dests: &[&[(*mut u8, usize)]]) -> Vec<Option<Delivered>> {
        // Whole pages only: a read is padded to whole pages, and a padded tail would write
        // past the destination into memory the caller did not name.
        let whole = |d: &[(*mut u8, usize)]| {
            d.iter().all(|&(p, n)| (p as usize).is_multiple_of(ALIGN) && n.is_multiple_of(ALIGN))
        };
        // SAFETY: destinations are whole aligned pages (checked here) adding up to the block's
        // length, which the caller vouches are writable until this returns; what another
        // process does to them can fail only the read or its sum, which is not trusted.
        let read =
            unsafe { self.read_into(keys, |i, meta| fitting(dests.get(i).filter(|d| whole(d))?, meta), |_| {}, false) };
        read.into_iter().map(|r| r.ok().flatten()).collect()
    }

    fn put_pieces(&self, blocks: &[PartsRef<'_>]) -> Vec<Result<bool>> {
        let t0 = Instant::now();
        let mut results: Vec<Option<Result<bool>>> = Vec::with_capacity(blocks.len());
        let mut reserved: Vec<(usize, Arc<DiskSlot>)> = Vec::new();
        {
            let mut st = self.state.lock();
            for (i, b) in blocks.iter().enumerate() {
                let len: u64 = b.parts.iter().map(|p| p.len() as u64).sum();
                if b.meta.len != len {
                    results.push(Some(Err(TierError::LengthMismatch { expected: b.meta.len, actual: len })));
                    continue;
                }
                if st.has_entry(&b.key) {
                    results.push(Some(Ok(false)));
                    continue;
                }
                // The owner's quota makes its room among its own blocks first.
                let own = room::quota_room(TIER, &self.counters, &self.listener, &mut st, &b.meta)
                    .and_then(|own| self.forget(&st, forget::slots(own)));
                if let Err(e) = own {
                    results.push(Some(Err(e)));
                    continue;
                }
                let n = self.pool.pages_for(b.meta.len);
                let pages = match self.make_room(&mut st, n).map(|_| self.pool.alloc(n)) {
                    Ok(Some(p)) => p,
                    Ok(None) => {
                        results.push(Some(Err(TierError::Full { tier: TIER, needed: b.meta.len, free: 0 })));
                        continue;
                    }
                    Err(e) => {
                        results.push(Some(Err(e)));
                        continue;
                    }
                };
                let slot = Arc::new(DiskSlot {
                    pages,
                    checksum: AtomicU64::new(0),
                    sum_kind: SumKind::Crc64,
                    tick: AtomicU64::new(self.tick()),
                });
                st.reserve(b.key, b.meta, Arc::clone(&slot), false);
                reserved.push((i, slot));
                results.push(None);
            }
        }
        // Bytes out with no lock held; checksums computed while the writes run.
        // Pieces go to disk as they are when each starts on a 4 KiB boundary and all but the
        // last are whole 4 KiB units (G2's pages are); other pieced blocks are gathered first.
        let gathered: Vec<Option<BlockBuf>> =
            reserved.iter().map(|(i, _)| gather_unless_direct(blocks[*i].parts)).collect();
        let views: Vec<Vec<&[u8]>> = reserved
            .iter()
            .zip(&gathered)
            .map(|((i, _), g)| match g {
                Some(b) => vec![&b[..]],
                None => blocks[*i].parts.to_vec(),
            })
            .collect();
        let mut ops = Vec::new();
        let mut bounce = Vec::new();
        let mut sums = WriteSums::new();
        for ((_, slot), parts) in reserved.iter().zip(&views) {
            let before = ops.len();
            self.write_ops(parts, &slot.pages, &mut bounce, &mut ops);
            sums.add(parts.clone(), ops.len() - before);
        }
        // SAFETY: every op reads a block's caller-owned bytes or a bounce buffer in `bounce`,
        // both alive and unmodified until `run` returns.
        let written = unsafe { self.io.run(self.fd(), ops, &mut sums) }.map_err(|e| TierError::io(TIER, "write", e));
        let mut synced = Ok(());
        if self.cfg.fsync && !reserved.is_empty() {
            // SAFETY: plain syscall on our fd.
            if unsafe { libc::fdatasync(self.fd()) } != 0 {
                synced = Err(TierError::io(TIER, "fdatasync", std::io::Error::last_os_error()));
            }
        }
        drop(bounce);
        // Blocks whose own writes all completed are indexed even when another block of the
        // batch failed; an fdatasync failure fails them all.
        let mut good = vec![false; reserved.len()];
        let mut puts: Vec<(BlockKey, IndexEntry)> = Vec::with_capacity(reserved.len());
        // The index is written under the state lock, and only for reservations still in place:
        // a block removed while its bytes went out must not reach the index after the removal's
        // delete did, or a restart would find a record naming pages that another block may own
        // by then (every index write happens under this lock, so the two are ordered).
        let mut st = self.state.lock();
        for (n, (i, slot)) in reserved.iter().enumerate() {
            let Some(sum) = sums.result(n).filter(|_| synced.is_ok()) else { continue };
            slot.checksum.store(sum, Ordering::Relaxed);
            good[n] = true;
            let b = &blocks[*i];
            if !st.is_writing(&b.key, slot) {
                continue;
            }
            puts.push((
                b.key,
                IndexEntry {
                    meta: b.meta,
                    checksum: sum,
                    sum_kind: slot.sum_kind,
                    tick: slot.tick.load(Ordering::Relaxed),
                    runs: slot.pages.runs(),
                },
            ));
        }
        let indexed = self.index.write(&puts, &[], false);
        let failure = match (&indexed, &synced, &written) {
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => e.to_string(),
            _ => "write failed".to_string(),
        };
        for (n, (i, slot)) in reserved.iter().enumerate() {
            let b = &blocks[*i];
            if good[n] && indexed.is_ok() {
                let ok = st.commit(&b.key, slot);
                if ok {
                    self.listener.stored(TIER, b.key, &b.meta);
                }
                self.counters.bytes_written.add(b.meta.len);
                results[*i] = Some(Ok(ok));
            } else {
                st.abort(&b.key, slot);
                results[*i] = Some(Err(TierError::io(TIER, "write batch", std::io::Error::other(failure.clone()))));
            }
        }
        self.counters.set_usage(self.pool.used_pages() as u64 * self.pool.page_size() as u64, st.len());
        drop(st);
        let out: Vec<Result<bool>> = results.into_iter().map(|r| r.unwrap_or(Ok(false))).collect();
        self.counters.put_errors.add(out.iter().filter(|r| r.is_err()).count() as u64);
        // Failures of the disk or the index, not a full tier or a caller's mistake.
        let mut io_errors = out
            .iter()
            .filter_map(|r| r.as_ref().err())
            .filter(|e| !matches!(e, TierError::Full { .. } | TierError::LengthMismatch { .. }));
        // Logged here rather than per written block, so that a put refused before any byte
        // went out (no room G3 could free: the index refusing the deletes of an eviction) is
        // logged as well as one whose write or index record failed.
        if let Some(first) = io_errors.next() {
            let n = 1 + io_errors.count();
            tracing::warn!("G3 write failed for {n} of {} blocks: {first}", blocks.len());
            self.health.write_failed(n, &first.to_string());
        }
        self.counters.put_took(t0.elapsed());
        self.health.took("write", t0.elapsed());
        out
    }

    unsafe fn adopt_host_memory(&self, base: *const u8, len: usize, owner: Arc<dyn std::any::Any + Send + Sync>) {
        // SAFETY: the caller's contract is `FixedMemory::new`'s.
        self.io.offer_fixed(Arc::new(unsafe { io::FixedMemory::new(base, len, owner) }));
    }
}

impl Medium for DiskTier {
    fn degraded(&self) -> Option<String> {
        self.health.degraded()
    }

    fn flush(&self) -> Result<()> {
        // Deletes still pending go now, or a restart would bring those blocks back.
        self.forget(&self.state.lock(), Vec::new())?;
        let touched = std::mem::take(&mut *self.touched.lock());
        self.write_touches(touched);
        // SAFETY: plain syscall on our fd.
        if unsafe { libc::fdatasync(self.fd()) } != 0 {
            return Err(TierError::io(TIER, "fdatasync", std::io::Error::last_os_error()));
        }
        self.index.flush()
    }
}

impl Reports for DiskTier {
    fn set_listener(&self, listener: Arc<dyn TierListener>) -> bool {
        self.listener.set(listener)
    }
}

/// A destination's pieces, if they add up to the (non-empty) block `meta` describes: what a
/// read into the caller's memory may write.
fn fitting(d: &[(*mut u8, usize)], meta: &BlockMeta) -> Option<Vec<(*mut u8, usize)>> {
    (d.iter().map(|(_, n)| *n as u64).sum::<u64>() == meta.len && meta.len > 0).then(|| d.to_vec())
}

/// `parts` gathered into one buffer, unless they can be written as they are: a single part, or
/// parts each starting on a 4 KiB boundary and all but the last whole 4 KiB units.
fn gather_unless_direct(parts: &[&[u8]]) -> Option<BlockBuf> {
    let direct = parts.len() <= 1
        || parts.iter().enumerate().all(|(i, p)| {
            (p.as_ptr() as usize).is_multiple_of(ALIGN) && (i + 1 == parts.len() || p.len().is_multiple_of(ALIGN))
        });
    if direct {
        return None;
    }
    Some(BlockBuf::from_parts(parts))
}
