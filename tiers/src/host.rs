//! G2: the host pool. A fixed-capacity shared-memory file, mapped once at start, carved into
//! pages; blocks are page lists (see [`crate::pages`]).
//!
//! The file lives in `/dev/shm` by default so that engines on the node can later map the same
//! memory. Its space is reserved with `posix_fallocate` at start, so a pool larger than the
//! shared-memory filesystem fails at start with a clear error instead of a SIGBUS later.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvproto::{BlockKey, TierKind};
use memmap2::{MmapOptions, MmapRaw};
use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::block::{BlockMeta, LeaseId};

/// Bytes one `MADV_POPULATE_WRITE` call maps. The call holds the process's `mmap_lock` for
/// reading while the kernel faults the range in, and a thread that maps or grows memory
/// meanwhile (an allocator growing its heap) waits for it, with the calls queued behind that
/// one: at the ~0.5 GB/s a fresh VM's pages fault in, 64 MiB steps stalled saves and loads for
/// up to 0.7 s, and 2 MiB steps still for 4-9 ms. 256 KiB holds it for about half a millisecond.
pub const POPULATE_STEP: usize = 256 << 10;
use crate::buf::BlockBuf;
use crate::cuda::HostRegistration;
use crate::error::{Result, TierError};
use crate::eviction::EvictionPolicy;
use crate::listener::{ListenerSlot, TierListener};
use crate::lru_policy::LruPolicy;
use crate::pages::{PagePool, Pages};
use crate::pieces::copy_pieces;
use crate::quota::Quotas;
use crate::residency::{Residency, SlotBytes};
use crate::room::{self, Room};
use crate::stats::{Count, TierCounters, TierStats, TierUsage};
use crate::tier::{BlockRef, Extensions, Reports, Tier};

const TIER: TierKind = TierKind::G2Host;

/// Whether to page-lock the pool for CUDA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaRegister {
    /// Register when a CUDA device is present; otherwise log and continue.
    Auto,
    /// Never.
    Off,
    /// Fail at start if registration is impossible.
    Required,
}

/// Configuration of the G2 host pool.
#[derive(Debug, Clone)]
pub struct HostTierConfig {
    /// Capacity in bytes (rounded down to whole pages).
    pub capacity_bytes: u64,
    /// Allocation unit; a multiple of 4096.
    pub page_size: usize,
    /// Directory of the shared-memory file (`/dev/shm` where it exists).
    pub shm_dir: PathBuf,
    /// `mlock` the pool so the kernel never swaps it.
    pub mlock: bool,
    /// Fault every page in at start (no page faults on the put path).
    pub populate: bool,
    pub cuda_register: CudaRegister,
    /// Eviction starts when used space would pass this fraction of capacity...
    pub high_watermark: f64,
    /// ...and frees down to this fraction.
    pub low_watermark: f64,
    /// How long a put may wait for write-through to free space before it drops the
    /// write-through of the coldest waiting block instead (the bound on a save's stall).
    pub dirty_wait: Duration,
    /// Owners' quotas in this tier, owner `i` having `quotas[i]` ([`crate::quota`]); empty:
    /// none.
    pub quotas: Vec<crate::quota::Quota>,
}

impl HostTierConfig {
    /// Defaults for a pool of `capacity_bytes`.
    pub fn with_capacity(capacity_bytes: u64) -> Self {
        let shm = Path::new("/dev/shm");
        Self {
            capacity_bytes,
            page_size: 64 * 1024,
            shm_dir: if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() },
            mlock: false,
            populate: true,
            cuda_register: CudaRegister::Auto,
            high_watermark: 0.98,
            low_watermark: 0.95,
            dirty_wait: Duration::from_millis(100),
            quotas: Vec::new(),
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        validate_space(self.page_size, self.capacity_bytes, self.high_watermark, self.low_watermark)
    }
}

/// Checks page size, capacity and watermarks shared by G2 and G3.
pub(crate) fn validate_space(page_size: usize, capacity: u64, high: f64, low: f64) -> Result<()> {
    if page_size == 0 || !page_size.is_multiple_of(4096) {
        return Err(TierError::Config {
            field: "page_size",
            reason: format!("{page_size} is not a positive multiple of 4096"),
        });
    }
    if capacity < page_size as u64 {
        return Err(TierError::Config {
            field: "capacity_bytes",
            reason: format!("{capacity} is smaller than one page ({page_size})"),
        });
    }
    if capacity / page_size as u64 > u64::from(u32::MAX) {
        return Err(TierError::Config {
            field: "page_size",
            reason: "more than 2^32 pages: raise the page size".into(),
        });
    }
    if !(0.0 < low && low <= high && high <= 1.0) {
        return Err(TierError::Config {
            field: "watermarks",
            reason: format!("need 0 < low ({low}) <= high ({high}) <= 1"),
        });
    }
    Ok(())
}

/// The mapped shared-memory file.
#[derive(Debug)]
struct SharedRegion {
    // Field order matters: unregister from CUDA before unmapping.
    _cuda: Option<HostRegistration>,
    map: MmapRaw,
    path: PathBuf,
    _file: File,
}

/// Pool files are `kvcached-g2-<pid>-<nanos>` in the pool directory.
const POOL_PREFIX: &str = "kvcached-g2-";

/// Removes the pool files that no live daemon holds: those of a daemon that was killed
/// (`kill -9`, OOM) and so never unlinked its pool, which would otherwise keep its memory in
/// `/dev/shm` until someone deletes it. A file goes only when both say its daemon is gone: no
/// process holds its lock (a live daemon holds an exclusive `flock` on its pool file) and the
/// pid in its name does not run (a daemon of a build older than the lock holds none). Also
/// sweeps the hidden name a pool has before it is locked, left by a crash at start.
fn remove_stale_pools(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(pool_pid) else { continue };
        // SAFETY: kill with signal 0 only checks whether the process exists.
        let alive =
            unsafe { libc::kill(pid, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        if alive {
            continue;
        }
        let path = entry.path();
        let Ok(file) = File::open(&path) else { continue };
        if file.try_lock().is_err() {
            continue; // a live daemon's pool (in another pid namespace)
        }
        let bytes = file.metadata().map(|m| m.len()).unwrap_or(0);
        match std::fs::remove_file(&path) {
            Ok(()) => tracing::warn!(
                path = %path.display(),
                bytes,
                "removed the G2 pool file of a daemon that did not shut down cleanly"
            ),
            Err(e) => tracing::warn!(path = %path.display(), "cannot remove a stale G2 pool file: {e}"),
        }
    }
}

/// The pid in a pool file's name (`kvcached-g2-<pid>-<nanos>`, or the same behind a dot).
fn pool_pid(name: &str) -> Option<i32> {
    let rest = name.strip_prefix('.').unwrap_or(name).strip_prefix(POOL_PREFIX)?;
    let (pid, nanos) = rest.split_once('-')?;
    nanos.bytes().all(|b| b.is_ascii_digit()).then_some(())?;
    pid.parse().ok().filter(|&p: &i32| p > 0)
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        // Unlink; processes that still map it keep their mapping.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Pages reserved for one block that the caller is filling ([`HostTier::begin_fill`]).
#[derive(Debug)]
pub struct Filling {
    key: BlockKey,
    meta: BlockMeta,
    slot: Arc<HostSlot>,
    pieces: Vec<(*mut u8, usize)>,
    t0: Instant,
}

impl Filling {
    /// Where the block's bytes go, in order: (start, bytes of the block there). Every piece
    /// starts on a page boundary (aligned for O_DIRECT), and a piece's pages extend at least
    /// to the next multiple of the page size, so a read padded to 4 KiB stays inside them.
    pub fn pieces(&self) -> &[(*mut u8, usize)] {
        &self.pieces
    }

    /// The same pieces as slices this reservation alone may write: what a caller fills safely.
    pub fn pieces_mut(&mut self) -> Vec<&mut [u8]> {
        // SAFETY: each piece is a run of pool pages reserved for this block alone (no reader
        // sees them before `finish_fill`, no other writer is handed them), the pieces do not
        // overlap, and the slices borrow `self` mutably, so they end before the reservation is
        // finished, aborted or handed out again.
        self.pieces.iter().map(|&(p, n)| unsafe { std::slice::from_raw_parts_mut(p, n) }).collect()
    }

    pub fn key(&self) -> &BlockKey {
        &self.key
    }

    pub fn meta(&self) -> &BlockMeta {
        &self.meta
    }
}

// SAFETY: the pointers name pages of the shared pool that this reservation alone may write
// until it is finished or aborted; moving the reservation to another thread moves that right.
unsafe impl Send for Filling {}

/// A G2 block held for reading outside the tier's lock ([`crate::BlockStore::hold`]): its
/// pages stay allocated and unchanged while the hold lives.
#[derive(Debug)]
pub struct HeldBlock {
    _slot: Arc<HostSlot>,
    pub meta: BlockMeta,
    pieces: Vec<(*const u8, usize)>,
}

impl HeldBlock {
    /// The block's bytes, in order, where they lie in the pool.
    pub fn parts(&self) -> Vec<&[u8]> {
        // SAFETY: each piece lies inside the pool's mapping, in pages the held slot keeps
        // allocated; a committed block is never written again, so the bytes do not change.
        self.pieces.iter().map(|&(p, n)| unsafe { std::slice::from_raw_parts(p, n) }).collect()
    }

    /// Where the block's bytes lie, as (address, bytes) in order: what a DMA engine reads.
    pub fn ranges(&self) -> Vec<(usize, usize)> {
        self.pieces.iter().map(|&(p, n)| (p as usize, n)).collect()
    }
}

// SAFETY: the pieces are pages of the shared pool that the held slot keeps allocated and that
// no one writes while it is held (a committed block is immutable).
unsafe impl Send for HeldBlock {}

#[derive(Debug)]
struct HostSlot {
    pages: Pages,
}

impl SlotBytes for HostSlot {
    fn slot_bytes(&self) -> u64 {
        self.pages.bytes()
    }
}

/// The G2 tier.
#[derive(Debug)]
pub struct HostTier {
    region: SharedRegion,
    pool: Arc<PagePool>,
    state: Mutex<Residency<HostSlot>>,
    counters: TierCounters,
    /// Blocks evicted before the write-through reached them.
    evicted_dirty: Count,
    /// Signalled when write-through cleans a block (a put may be waiting for space).
    cleaned: Condvar,
    /// Signalled when a put commits (a put of the same key may be waiting for it).
    committed: Condvar,
    dirty_wait: Duration,
    listener: ListenerSlot,
    /// Capacity and watermarks (`room.rs`).
    room: Room,
}

impl HostTier {
    /// Creates and maps the pool file.
    pub fn open(cfg: &HostTierConfig) -> Result<Self> {
        cfg.validate()?;
        let pages = (cfg.capacity_bytes / cfg.page_size as u64) as u32;
        let len = pages as usize * cfg.page_size;
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        remove_stale_pools(&cfg.shm_dir);
        let name = format!("{POOL_PREFIX}{}-{nanos:09}", std::process::id());
        let io = |op, e| TierError::io(TIER, op, e);
        // Created under a hidden name and locked before it gets its real name, so that another
        // daemon's stale-pool sweep never sees it unlocked.
        let hidden = cfg.shm_dir.join(format!(".{name}"));
        let path = cfg.shm_dir.join(&name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&hidden)
            .map_err(|e| io("create pool file", e))?;
        // Held for the daemon's life; the kernel drops it when the process dies, however.
        let named = match file.try_lock() {
            Ok(()) => std::fs::rename(&hidden, &path),
            Err(e) => Err(std::io::Error::other(e.to_string())),
        };
        if let Err(e) = named {
            let _ = std::fs::remove_file(&hidden);
            return Err(io("lock and name pool file", e));
        }
        // SAFETY: plain syscall on an owned fd.
        let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
        if r != 0 {
            let _ = std::fs::remove_file(&path);
            return Err(TierError::Config {
                field: "g2 capacity_bytes",
                reason: format!(
                    "cannot reserve {len} bytes in {}: {} (lower the capacity or enlarge the filesystem)",
                    cfg.shm_dir.display(),
                    std::io::Error::from_raw_os_error(r)
                ),
            });
        }
        let mut opts = MmapOptions::new();
        opts.len(len);
        if cfg.populate {
            opts.populate();
        }
        let map = opts.map_raw(&file).map_err(|e| {
            let _ = std::fs::remove_file(&path);
            io("mmap pool file", e)
        })?;
        advise_huge_pages(&cfg.shm_dir, map.as_mut_ptr(), len);
        if cfg.mlock {
            // SAFETY: the range is our live mapping.
            if unsafe { libc::mlock(map.as_ptr().cast(), len) } != 0 {
                let e = std::io::Error::last_os_error();
                let _ = std::fs::remove_file(&path);
                return Err(TierError::Config {
                    field: "g2 mlock",
                    reason: format!("mlock of {len} bytes failed: {e} (raise RLIMIT_MEMLOCK or disable mlock)"),
                });
            }
        }
        let cuda = match cfg.cuda_register {
            CudaRegister::Off => None,
            // SAFETY: the mapping outlives the registration (field order in SharedRegion).
            mode => match unsafe { HostRegistration::register(map.as_mut_ptr(), len) } {
                Ok(r) => {
                    tracing::info!(bytes = len, "G2 pool page-locked for CUDA");
                    Some(r)
                }
                Err(e) if mode == CudaRegister::Auto => {
                    tracing::info!("G2 pool not registered with CUDA: {e}");
                    None
                }
                Err(e) => {
                    let _ = std::fs::remove_file(&path);
                    return Err(e);
                }
            },
        };
        let pool = PagePool::new(cfg.page_size, pages);
        Ok(Self {
            region: SharedRegion { _cuda: cuda, map, path, _file: file },
            room: Room::of_pool(TIER, &pool, cfg.high_watermark, cfg.low_watermark),
            pool,
            state: Mutex::new({
                let mut st = Residency::new(Box::new(LruPolicy::new()) as Box<dyn EvictionPolicy>);
                st.set_quotas(Quotas::new(TIER, &cfg.quotas));
                st
            }),
            counters: TierCounters::new(TIER, len as u64),
            cleaned: Condvar::new(),
            committed: Condvar::new(),
            dirty_wait: cfg.dirty_wait,
            listener: ListenerSlot::default(),
            evicted_dirty: Count::labelled(
                "kvcached_writethrough_dropped_total",
                &[("reason", "evicted_before_write")],
            ),
        })
    }

    /// Maps every page of the pool in advance (`MADV_POPULATE_WRITE`, [`POPULATE_STEP`] at a
    /// time), so that saves do not take a page fault per fresh page (a quarter of a save's CPU
    /// time in a profile of a cold pool). Meant for a background thread: it holds only a weak
    /// reference between chunks and stops when the tier is dropped. Returns the bytes populated.
    /// Progress is exported as `kvcached_g2_prefaulted_bytes` and, once finished (or stopped),
    /// `kvcached_g2_prefault_done` = 1.
    pub fn prefault(tier: &std::sync::Weak<HostTier>) -> u64 {
        const CHUNK: usize = POPULATE_STEP;
        let progress = metrics::gauge!("kvcached_g2_prefaulted_bytes");
        let finished = metrics::gauge!("kvcached_g2_prefault_done");
        finished.set(0.0);
        let mut done = 0usize;
        loop {
            progress.set(done as f64);
            let Some(t) = tier.upgrade() else {
                finished.set(1.0);
                return done as u64;
            };
            let (base, len) = (t.region.map.as_mut_ptr(), t.region.map.len());
            if done >= len {
                finished.set(1.0);
                return done as u64;
            }
            let n = CHUNK.min(len - done);
            // SAFETY: the range lies inside our live mapping; populating changes no contents.
            let r = unsafe { libc::madvise(base.wrapping_add(done).cast(), n, libc::MADV_POPULATE_WRITE) };
            if r != 0 {
                let e = std::io::Error::last_os_error();
                tracing::info!("G2 pool not prefaulted past {done} bytes: {e} (pages are mapped on first use)");
                finished.set(1.0);
                return done as u64;
            }
            done += n;
        }
    }

    /// Path of the shared-memory file (engines map it by this path).
    pub fn shm_path(&self) -> &Path {
        &self.region.path
    }

    /// Base address and length of the mapping.
    pub fn region(&self) -> (*const u8, usize) {
        (self.region.map.as_ptr(), self.region.map.len())
    }

    fn page_ptr(&self, page: u32) -> *mut u8 {
        // Page ids are < total pages, so the offset is inside the mapping.
        self.region.map.as_mut_ptr().wrapping_add(page as usize * self.pool.page_size())
    }

    /// Calls `f` with each contiguous piece of a block's bytes, in order, without copying.
    /// Returns `None` on a miss. The block cannot be reused while `f` runs.
    pub fn with_block<R>(&self, key: &BlockKey, f: impl FnOnce(&BlockMeta, &[&[u8]]) -> R) -> Option<R> {
        let r = self.with_block_uncounted(key, f);
        if r.is_some() {
            self.counters.hits.add(1);
        }
        r
    }

    /// Holds a block for reading outside the tier's lock, without counting a hit (the
    /// write-through's own reads): its pages stay allocated and unchanged while the hold lives.
    /// `read`: count its bytes as read (false where the read that found it counted them).
    pub(crate) fn hold_uncounted(&self, key: &BlockKey, read: bool) -> Option<HeldBlock> {
        let (slot, meta) = self.state.lock().get(key, true)?;
        let pieces = self.runs_of(&slot, meta.len).collect();
        if read {
            self.counters.bytes_read.add(meta.len);
        }
        Some(HeldBlock { _slot: slot, meta, pieces })
    }

    /// [`HostTier::with_block`] without counting a hit.
    pub(crate) fn with_block_uncounted<R>(
        &self,
        key: &BlockKey,
        f: impl FnOnce(&BlockMeta, &[&[u8]]) -> R,
    ) -> Option<R> {
        let (slot, meta) = self.state.lock().get(key, true)?;
        let pieces: Vec<&[u8]> = self
            .runs_of(&slot, meta.len)
            // SAFETY: the run lies inside the mapping and is not written while `slot` is held
            // (a committed block is immutable; its pages are freed only when the Arc drops).
            .map(|(p, n)| unsafe { std::slice::from_raw_parts(p, n) })
            .collect();
        self.counters.bytes_read.add(meta.len);
        Some(f(&meta, &pieces))
    }

    /// Where the `len` bytes of a block in `slot` lie in the pool: one piece per run of pages.
    fn runs_of<'a>(&'a self, slot: &'a HostSlot, len: u64) -> impl Iterator<Item = (*const u8, usize)> + 'a {
        let ps = self.pool.page_size();
        slot.pages.runs().into_iter().scan(len as usize, move |left, (first, n)| {
            let take = (*left).min(n as usize * ps);
            *left -= take;
            Some((self.page_ptr(first).cast_const(), take))
        })
    }

    /// Makes room for `pages` more pages, evicting down to the low watermark when needed.
    /// Clean blocks go first; if only blocks still waiting for write-through could go, waits
    /// up to `dirty_wait` for the writer to clean some before dropping their write-through.
    fn make_room(&self, st: &mut MutexGuard<'_, Residency<HostSlot>>, pages: usize) -> Result<()> {
        let page = self.pool.page_size() as u64;
        let want = pages as u64 * page;
        let deadline = Instant::now() + self.dirty_wait;
        loop {
            let free = self.pool.free_pages() as u64 * page;
            let need = self.room.bytes_to_evict(self.pool.used_pages() as u64 * page, free, want)?;
            if need == 0 {
                return Ok(());
            }
            let now = Instant::now();
            let allow_dirty = now >= deadline || st.dirty() == 0;
            let (victims, _) = st.evict(need, now, allow_dirty);
            let dropped = victims.iter().filter(|(_, e)| e.dirty).count() as u64;
            if dropped > 0 {
                self.evicted_dirty.add(dropped);
            }
            let keys: Vec<BlockKey> = victims.iter().map(|(k, _)| *k).collect();
            room::evicted(TIER, &self.counters, &self.listener, &keys);
            drop(victims); // frees the pages (no reader holds them: evict skips blocks in use)
            if self.pool.free_pages() >= pages {
                return Ok(());
            }
            if allow_dirty {
                return Err(self.room.full(want, self.pool.free_pages() as u64 * page));
            }
            self.cleaned.wait_until(st, deadline);
        }
    }

    /// Puts a block, marking it dirty (to be written to the tiers below) when `dirty`.
    pub(crate) fn put_marked(&self, block: BlockRef<'_>, dirty: bool) -> Result<bool> {
        if block.meta.len != block.data.len() as u64 {
            return Err(TierError::LengthMismatch { expected: block.meta.len, actual: block.data.len() as u64 });
        }
        self.put_parts(block.key, block.meta, &[block.data], dirty)
    }

    /// Puts a block given as pieces that are concatenated in order (the daemon gathers an
    /// engine's per-layer segments straight into the pool with this: one copy).
    pub fn put_parts(&self, key: BlockKey, meta: BlockMeta, parts: &[&[u8]], dirty: bool) -> Result<bool> {
        let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
        if meta.len != total {
            return Err(TierError::LengthMismatch { expected: meta.len, actual: total });
        }
        self.put_with(key, meta, dirty, |dst| {
            let dst = dst.iter_mut().map(|d| (d.as_mut_ptr(), d.len()));
            // SAFETY: destinations are this reservation's own slices, sources the caller's;
            // they do not overlap and the total lengths are equal.
            unsafe { copy_pieces(parts.iter().map(|p| (p.as_ptr(), p.len())), dst) };
            Ok(())
        })
    }

    /// Puts a block whose `meta.len` bytes `fill` writes into the given destination pieces (in
    /// block order, no lock held; the pieces are this reservation's alone). Used to copy from
    /// memory the CPU cannot read directly (GPU memory, with DMA into the pool). If `fill` fails
    /// the reservation is dropped and nothing becomes visible.
    pub fn put_with(
        &self,
        key: BlockKey,
        meta: BlockMeta,
        dirty: bool,
        fill: impl FnOnce(&mut [&mut [u8]]) -> Result<()>,
    ) -> Result<bool> {
        let Some(mut filling) = self.begin_fill(key, meta, dirty)? else { return Ok(false) };
        match fill(&mut filling.pieces_mut()) {
            Ok(()) => Ok(self.finish_fill(filling)),
            Err(e) => {
                self.fail_fill(filling);
                Err(e)
            }
        }
    }

    /// Reserves pages for a block that the caller then fills through [`Filling::pieces`] (no
    /// lock held; invisible until [`HostTier::finish_fill`], dropped by
    /// [`HostTier::abort_fill`]). `Ok(None)` when the key is already present. G3 reads blocks
    /// straight into these pages.
    pub fn begin_fill(&self, key: BlockKey, meta: BlockMeta, dirty: bool) -> Result<Option<Filling>> {
        let t0 = Instant::now();
        let n = self.pool.pages_for(meta.len);
        let slot = {
            let mut st = self.state.lock();
            // A key being written by another put: wait until it is visible, so that a caller
            // told "already present" can load it right away.
            let deadline = Instant::now() + Duration::from_secs(5);
            while st.has_entry(&key) && !st.contains(&key) && Instant::now() < deadline {
                self.committed.wait_until(&mut st, deadline);
            }
            if st.has_entry(&key) {
                return Ok(None);
            }
            // The owner's quota makes its room among its own blocks first (pages freed here).
            let own = room::quota_room(TIER, &self.counters, &self.listener, &mut st, &meta)?;
            self.evicted_dirty.add(own.iter().filter(|(_, e)| e.dirty).count() as u64);
            drop(own);
            if let Err(e) = self.make_room(&mut st, n) {
                self.counters.put_errors.add(1);
                return Err(e);
            }
            let Some(pages) = self.pool.alloc(n) else {
                self.counters.put_errors.add(1);
                return Err(TierError::Full { tier: TIER, needed: meta.len, free: 0 });
            };
            let slot = Arc::new(HostSlot { pages });
            if !st.reserve(key, meta, Arc::clone(&slot), dirty) {
                // Another writer reserved the key while this one waited for space.
                return Ok(None);
            }
            slot
        };
        let ps = self.pool.page_size();
        let mut pieces: Vec<(*mut u8, usize)> = Vec::new();
        let mut left = meta.len as usize;
        for (first, count) in slot.pages.runs() {
            let take = left.min(count as usize * ps);
            pieces.push((self.page_ptr(first), take));
            left -= take;
        }
        Ok(Some(Filling { key, meta, slot, pieces, t0 }))
    }

    /// Makes a filled block visible. False if it was removed meanwhile.
    pub fn finish_fill(&self, filling: Filling) -> bool {
        let Filling { key, meta, slot, t0, .. } = filling;
        let ps = self.pool.page_size();
        let committed = {
            let mut st = self.state.lock();
            let ok = st.commit(&key, &slot);
            if ok {
                self.listener.stored(TIER, key, &meta);
            }
            self.counters.set_usage(self.pool.used_pages() as u64 * ps as u64, st.len());
            ok
        };
        self.committed.notify_all();
        self.counters.bytes_written.add(meta.len);
        self.counters.put_took(t0.elapsed());
        committed
    }

    /// Drops a reservation whose filling failed or found nothing: nothing becomes visible.
    pub fn abort_fill(&self, filling: Filling) {
        self.state.lock().abort(&filling.key, &filling.slot);
        self.committed.notify_all();
    }

    /// Drops a reservation whose filling failed (a copy from an engine's memory): as
    /// [`HostTier::abort_fill`], counted as a failed put.
    pub fn fail_fill(&self, filling: Filling) {
        self.abort_fill(filling);
        self.counters.put_errors.add(1);
    }

    /// Blocks evicted from G2 before write-through reached them (their lower copy was lost).
    pub fn evicted_before_write(&self) -> u64 {
        self.evicted_dirty.get()
    }

    pub(crate) fn mark_clean(&self, key: &BlockKey) {
        self.state.lock().mark_clean(key);
        self.cleaned.notify_all();
    }

    /// Touches the keys in reverse order so that ancestors end up more recent than their
    /// descendants (a chain is then evicted from its tail).
    pub fn touch_chain(&self, keys: &[BlockKey]) {
        let mut st = self.state.lock();
        for k in keys.iter().rev() {
            st.touch(k);
        }
    }
}

impl Tier for HostTier {
    fn kind(&self) -> TierKind {
        TIER
    }

    fn put_batch(&self, blocks: &[BlockRef<'_>]) -> Vec<Result<bool>> {
        blocks.iter().map(|b| self.put_marked(*b, false)).collect()
    }

    fn get_batch(&self, keys: &[BlockKey], outs: &mut [BlockBuf]) -> Vec<Result<Option<BlockMeta>>> {
        keys.iter().zip(outs.iter_mut()).map(|(k, o)| Ok(self.read_one(k, o))).collect()
    }

    fn contains_each(&self, keys: &[BlockKey]) -> Vec<bool> {
        let st = self.state.lock();
        keys.iter().map(|k| st.contains(k)).collect()
    }

    fn remove(&self, key: &BlockKey) -> Result<bool> {
        let mut st = self.state.lock();
        let removed = st.remove(key).is_some();
        if removed {
            self.listener.removed(TIER, &[*key]);
        }
        self.counters.set_usage(self.pool.used_pages() as u64 * self.pool.page_size() as u64, st.len());
        Ok(removed)
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
        Extensions { reports: Some(self), ..Extensions::default() }
    }
}

impl Reports for HostTier {
    fn set_listener(&self, listener: Arc<dyn TierListener>) -> bool {
        self.listener.set(listener)
    }
}

impl HostTier {
    /// Copies one block out of the pool into `out` (resized to its length); counted as a hit
    /// or a miss. ([`Tier::get_batch`] of one key, without a `Vec`.)
    pub fn get(&self, key: &BlockKey, out: &mut BlockBuf) -> Result<Option<BlockMeta>> {
        Ok(self.read_one(key, out))
    }

    fn read_one(&self, key: &BlockKey, out: &mut BlockBuf) -> Option<BlockMeta> {
        let t0 = Instant::now();
        let hit = self.with_block(key, |meta, pieces| {
            out.resize(meta.len as usize);
            let mut off = 0;
            for p in pieces {
                out[off..off + p.len()].copy_from_slice(p);
                off += p.len();
            }
            *meta
        });
        if hit.is_none() {
            self.counters.misses.add(1);
        }
        self.counters.get_took(t0.elapsed());
        hit
    }

    /// Whether the block is visible ([`Tier::contains_each`] of one key, without a `Vec`).
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.state.lock().contains(key)
    }
}

/// Asks for huge pages for the pool (taken where the mount leaves it to the mapping,
/// `huge=advise`: khugepaged collapses the pool over time) and logs whether its filesystem is
/// set to give them.
fn advise_huge_pages(dir: &Path, base: *mut u8, len: usize) {
    // SAFETY: advice on our own live mapping; it changes no contents.
    let advised = match unsafe { libc::madvise(base.cast(), len, libc::MADV_HUGEPAGE) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    };
    let Some(m) = crate::shm_pages::ShmMount::of(dir) else {
        tracing::debug!("G2 pool: mount of {} not found in /proc/self/mountinfo", dir.display());
        return;
    };
    let at = m.mount_point.display();
    if m.huge_at_start() {
        tracing::info!(fs = %m.fs_type, huge = %m.huge_option, "G2 pool's filesystem gives it huge pages ({at})");
    } else if m.fs_type == "tmpfs" && m.huge_option == "advise" && m.kernel_override.is_none() {
        match advised {
            Ok(()) => tracing::info!("G2 pool asks for huge pages (tmpfs huge=advise, {at}): collapsed over time"),
            Err(e) => tracing::info!("G2 pool on 4 KiB pages: madvise(MADV_HUGEPAGE) failed on {at}: {e}"),
        }
    } else {
        tracing::info!(
            fs = %m.fs_type,
            huge = %m.huge_option,
            "G2 pool's filesystem gives it 4 KiB pages ({at}); {HUGE_ADVICE}"
        );
    }
}

/// What the log suggests to an operator whose pool is on 4 KiB pages.
const HUGE_ADVICE: &str = "a tmpfs mounted with huge=within_size as g2.shm_dir gives 2 MiB pages, \
    which write through to G3 in fewer, larger requests (docs/operations/capacity.md)";
