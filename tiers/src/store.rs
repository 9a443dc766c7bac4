//! `BlockStore`: G2 on top, lower tiers (G3, G4) below, write-through down and promotion up.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvproto::{BlockKey, TierKind};

use crate::block::{BlockMeta, LeaseId};
use crate::buf::BlockBuf;
use crate::disk::{DiskTier, DiskTierConfig};
use crate::error::{Result, TierError};
use crate::host::{Filling, HeldBlock, HostTier, HostTierConfig};
use crate::object::{ObjectTier, ObjectTierConfig};
use crate::stats::{Count, TierStats};
use crate::tier::{BlockRef, Tier, TierExt};
use crate::writethrough::{WriteThrough, WriteThroughConfig, Writer};

/// Configuration of a whole store.
#[derive(Debug, Clone)]
pub struct BlockStoreConfig {
    pub g2: HostTierConfig,
    /// None: no disk tier.
    pub g3: Option<DiskTierConfig>,
    /// Write-through into G3.
    pub write_through: WriteThroughConfig,
    /// None: no object tier.
    pub g4: Option<ObjectTierConfig>,
    /// Write-through into G4.
    pub g4_write_through: WriteThroughConfig,
}

/// Where a `get` found its block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hit {
    pub meta: BlockMeta,
    pub tier: TierKind,
}

/// How much of a chain of keys is cached. Touches no block data.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Length of the longest prefix of the chain present in some tier.
    pub blocks: usize,
    /// Per tier (indexed by `TierKind::index`), blocks of that prefix whose fastest copy is
    /// there: sums to `blocks`.
    pub fastest: [usize; 4],
    /// Per tier, blocks of that prefix present there (a block can be in several tiers).
    pub resident: [usize; 4],
}

/// The fastest tier in a set of tiers (bit `TierKind::index`; not empty).
fn fastest_of(held: u8) -> TierKind {
    TierKind::ALL.into_iter().find(|t| held & (1 << t.index()) != 0).unwrap_or(TierKind::G4Object)
}

/// A snapshot of the store's counters.
#[derive(Debug, Clone, Default)]
pub struct StoreStats {
    pub tiers: Vec<(TierKind, TierStats)>,
    pub writethrough_written: u64,
    /// Write-throughs dropped because the queue was full.
    pub writethrough_dropped: u64,
    /// Blocks evicted from G2 before their write-through ran (after waiting `dirty_wait`).
    pub writethrough_evicted_before_write: u64,
    pub writethrough_errors: u64,
    pub writethrough_queued: u64,
    pub promotions: u64,
    /// Per lower tier: (tier, written, dropped, errors, queued).
    pub writethrough_by_tier: Vec<(TierKind, u64, u64, u64, u64)>,
}

/// What [`BlockStore::promote_batch_lossy_each`] hands each block as soon as it is in: its key,
/// metadata, the tier it came from, and its bytes (as pieces, in order).
pub type ReadyBlock<'a> = dyn FnMut(&BlockKey, &BlockMeta, TierKind, &[&[u8]]) + 'a;

/// What [`BlockStore::promote_batch_lossy`] did.
#[derive(Debug, Default)]
pub struct Promoted {
    /// Keys promoted into G2, and the tier each came from.
    pub promoted: Vec<(BlockKey, TierKind)>,
    /// Keys a tier failed to read and no later tier had.
    pub failed: Vec<BlockKey>,
    /// The first failure.
    pub error: Option<TierError>,
    /// Blocks read from a lower tier that G2 had no room for (every page pinned or waiting for
    /// write-through): the caller serves them from these buffers instead of reading them again.
    pub unplaced: Vec<(BlockKey, BlockMeta, TierKind, BlockBuf)>,
}

/// What became of one key in [`BlockStore::read_into_g2`].
enum Direct {
    /// Not read this way; read through a buffer instead.
    NotTried,
    /// Read and in G2 now (false: it was already there, put by someone else).
    Read(bool),
    /// Read, but G2 had no room: in [`Promoted::unplaced`].
    Unplaced,
    Miss,
    Failed(TierError),
}

/// The tiered block store.
#[derive(Debug)]
pub struct BlockStore {
    // Field order: the writers drain before the tiers drop.
    pub(crate) writers: Vec<WriteThrough>,
    pub(crate) g2: Arc<HostTier>,
    pub(crate) lower: Arc<Vec<Arc<dyn Tier>>>,
    next_lease: AtomicU64,
    pub(crate) promotions: Count,
}

impl BlockStore {
    /// Opens G2 and, if configured, G3 (recovering what it holds) and G4.
    pub fn open(cfg: &BlockStoreConfig) -> Result<Self> {
        let g2 = Arc::new(HostTier::open(&cfg.g2)?);
        let mut lower: Vec<(Arc<dyn Tier>, WriteThroughConfig)> = Vec::new();
        if let Some(g3) = &cfg.g3 {
            lower.push((Arc::new(DiskTier::open(g3)?), cfg.write_through));
        }
        if let Some(g4) = &cfg.g4 {
            lower.push((Arc::new(ObjectTier::open(g4)?), cfg.g4_write_through));
        }
        Self::with_tiers_each(g2, lower)
    }

    /// A store over given tiers (lower ones fastest first), each written through with `wt`.
    pub fn with_tiers(g2: Arc<HostTier>, lower: Vec<Arc<dyn Tier>>, wt: WriteThroughConfig) -> Result<Self> {
        Self::with_tiers_each(g2, lower.into_iter().map(|t| (t, wt)).collect())
    }

    /// A store over given tiers (fastest first) and their write-through settings.
    pub fn with_tiers_each(g2: Arc<HostTier>, lower: Vec<(Arc<dyn Tier>, WriteThroughConfig)>) -> Result<Self> {
        let tiers: Vec<Arc<dyn Tier>> = lower.iter().map(|(t, _)| Arc::clone(t)).collect();
        let (base, len) = g2.region();
        for d in tiers.iter().filter_map(|t| t.extensions().direct) {
            let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::clone(&g2) as _;
            // SAFETY: G2's pool is one shared mapping, read and written, that keeps its pages
            // for the tier's life (nothing remaps, truncates or punches it), and `owner` is
            // that tier.
            unsafe { d.adopt_host_memory(base, len, owner) };
        }
        let mut writers = Vec::new();
        for (i, (target, wt)) in lower.into_iter().enumerate() {
            let w = Writer { g2: Arc::clone(&g2), target, above: tiers[..i].to_vec(), marks_clean: i == 0 };
            writers.push(
                WriteThrough::start(wt, w)
                    .map_err(|e| TierError::io(TierKind::G2Host, "start write-through thread", e))?,
            );
        }
        Ok(Self {
            writers,
            g2,
            lower: Arc::new(tiers),
            next_lease: AtomicU64::new(1),
            promotions: Count::labelled("kvcached_promotions_total", &[]),
        })
    }

    /// Installs `listener` on every tier (G2 and below): it hears of each block a tier gains
    /// or loses. Returns false if a tier already had one.
    pub fn set_listener(&self, listener: std::sync::Arc<dyn crate::listener::TierListener>) -> bool {
        let mut ok = self.g2.set_listener(std::sync::Arc::clone(&listener));
        for t in self.lower.iter() {
            ok &= t.set_listener(std::sync::Arc::clone(&listener));
        }
        ok
    }

    /// The G2 tier (for zero-copy access by the daemon).
    pub fn g2(&self) -> &Arc<HostTier> {
        &self.g2
    }

    /// The tiers below G2.
    pub fn lower(&self) -> &[Arc<dyn Tier>] {
        &self.lower
    }

    /// Puts a block in G2 (visible on return) and queues it for the tiers below. Returns
    /// `false` if the key was already present.
    pub fn put(&self, key: BlockKey, meta: BlockMeta, data: &[u8]) -> Result<bool> {
        self.put_parts(key, meta, &[data])
    }

    /// Puts a block given as pieces concatenated in order (gathered from engine memory in one
    /// copy). Same semantics as [`BlockStore::put`].
    pub fn put_parts(&self, key: BlockKey, meta: BlockMeta, parts: &[&[u8]]) -> Result<bool> {
        let dirty = !self.writers.is_empty();
        let stored = self.g2.put_parts(key, meta, parts, dirty)?;
        self.after_put(key, stored)
    }

    /// Puts a block whose bytes `fill` writes straight into its G2 pages (see
    /// [`HostTier::put_with`]), then queues it for the tiers below.
    pub fn put_with(
        &self,
        key: BlockKey,
        meta: BlockMeta,
        fill: impl FnOnce(&mut [&mut [u8]]) -> Result<()>,
    ) -> Result<bool> {
        let stored = self.g2.put_with(key, meta, !self.writers.is_empty(), fill)?;
        self.after_put(key, stored)
    }

    /// Reserves G2 pages for a block the caller fills itself, asynchronously (DMA from an
    /// engine's GPU memory, many blocks in flight): `Ok(None)` when the key is present already.
    /// Nothing is visible until [`BlockStore::finish_put`], which also queues the block for the
    /// tiers below; [`BlockStore::fail_put`] drops it.
    pub fn begin_put(&self, key: BlockKey, meta: BlockMeta) -> Result<Option<Filling>> {
        self.g2.begin_fill(key, meta, !self.writers.is_empty())
    }

    /// Makes a block begun with [`BlockStore::begin_put`] and filled visible; `false` if it
    /// was removed meanwhile.
    pub fn finish_put(&self, filling: Filling) -> Result<bool> {
        let key = *filling.key();
        let stored = self.g2.finish_fill(filling);
        self.after_put(key, stored)
    }

    /// Drops a block begun with [`BlockStore::begin_put`] whose filling failed: never visible.
    pub fn fail_put(&self, filling: Filling) {
        self.g2.fail_fill(filling);
    }

    /// Holds a G2 block for reading outside any lock (an asynchronous copy into an engine's
    /// GPU memory) without counting a hit (the read that found it counted one): its pages
    /// stay allocated and unchanged while the hold lives. None: not in G2.
    pub fn hold(&self, key: &BlockKey) -> Option<HeldBlock> {
        self.g2.hold_uncounted(key, false)
    }

    fn after_put(&self, key: BlockKey, stored: bool) -> Result<bool> {
        if stored {
            self.write_through(&key, None);
        }
        Ok(stored)
    }

    /// Queues `key` for the writers of the tiers faster than `faster_than` (every lower tier
    /// when None: a save). G2 keeps the block dirty for the first writer only; if that writer
    /// cannot queue it, the block is clean now.
    pub(crate) fn write_through(&self, key: &BlockKey, faster_than: Option<TierKind>) {
        for (i, w) in self.writers.iter().enumerate() {
            if faster_than.is_some_and(|t| w.tier.index() >= t.index()) {
                continue;
            }
            if !w.enqueue(*key) && i == 0 {
                self.g2.mark_clean(key);
            }
        }
    }

    /// Hands the block's bytes to `f` as pieces in order: straight from G2 without a copy when
    /// it is there, else read into `buf` from the tier below (and promoted into G2).
    pub fn read_with<R>(
        &self,
        key: &BlockKey,
        buf: &mut BlockBuf,
        f: impl FnOnce(&BlockMeta, &[&[u8]]) -> R,
    ) -> Result<Option<(TierKind, R)>> {
        let mut f = Some(f);
        let from_g2 = self.g2.with_block(key, |meta, pieces| f.take().map(|f| f(meta, pieces)));
        if let Some(Some(r)) = from_g2 {
            return Ok(Some((TierKind::G2Host, r)));
        }
        match self.get(key, buf)? {
            Some(hit) => match f.take() {
                Some(f) => Ok(Some((hit.tier, f(&hit.meta, &[&buf[..]])))),
                None => Ok(None),
            },
            None => Ok(None),
        }
    }

    /// Reads a block into `out` from the fastest tier holding it; a block found below G2 is
    /// promoted into G2.
    pub fn get(&self, key: &BlockKey, out: &mut BlockBuf) -> Result<Option<Hit>> {
        if let Some(meta) = self.g2.get(key, out)? {
            return Ok(Some(Hit { meta, tier: TierKind::G2Host }));
        }
        for tier in self.lower.iter() {
            if let Some(meta) = tier.get(key, out)? {
                self.promote(key, meta, out, tier.kind());
                return Ok(Some(Hit { meta, tier: tier.kind() }));
            }
        }
        Ok(None)
    }

    /// Copies a block read from lower tier `from` into G2, and queues it for the tiers between
    /// (a G4 hit lands in G3 too). A full G2 only skips the promotion.
    fn promote(&self, key: &BlockKey, meta: BlockMeta, data: &[u8], from: TierKind) -> bool {
        let dirty = self.writers.first().is_some_and(|w| w.tier.index() < from.index());
        // A promoted block is no one's: a reader's load never spends its saver's quota.
        let meta = BlockMeta { owner: None, ..meta };
        match self.g2.put_marked(BlockRef { key: *key, meta, data }, dirty) {
            Ok(stored) => {
                self.promotions.add(1);
                if stored && dirty {
                    self.write_through(key, Some(from));
                }
                true
            }
            Err(e) => {
                tracing::debug!(%key, "promotion into G2 skipped: {e}");
                false
            }
        }
    }

    /// Brings the blocks of `keys` that are not in G2 up from the tiers below, each tier's share
    /// read in one batch (one I/O hand-off, all reads in flight together, instead of one round
    /// trip per block). Returns the keys promoted and the tier each came from; fails on the
    /// first read a tier fails ([`BlockStore::promote_batch_lossy`] takes those as misses).
    pub fn promote_batch(&self, keys: &[BlockKey]) -> Result<Vec<(BlockKey, TierKind)>> {
        let p = self.promote_batch_lossy(keys);
        match p.error {
            Some(e) => Err(e),
            None => Ok(p.promoted),
        }
    }

    /// [`BlockStore::promote_batch`] with a tier's failed reads (an I/O error, a store that is
    /// down or does not answer in time) taken as misses of that tier: those keys are asked of
    /// the next tier, and the ones no tier gave are returned as `failed`, so that the caller
    /// does not ask the failing tier again for them. Each failed read is counted in
    /// `kvcached_tier_read_errors_total`. Loads of chains from G3 or G4 call it per chunk, as
    /// [`BlockStore::promote_batch_lossy_each`].
    pub fn promote_batch_lossy(&self, keys: &[BlockKey]) -> Promoted {
        self.promote_batch_lossy_each(keys, &mut |_, _, _, _| {})
    }

    /// [`BlockStore::promote_batch_lossy`] that hands each block read straight into G2 to
    /// `ready` (its key, metadata, tier and bytes) as soon as it has arrived whole and passed
    /// its check, while later reads of the batch are still in flight: a load copies it on into
    /// the engine while it is in cache, instead of once the whole batch is in. `ready` runs on
    /// this thread, before the block is published in G2; a block not handed to it comes as
    /// [`BlockStore::promote_batch_lossy`] says (in G2, unplaced, failed or missing).
    pub fn promote_batch_lossy_each(&self, keys: &[BlockKey], ready: &mut ReadyBlock<'_>) -> Promoted {
        let present = self.g2.contains_each(keys);
        let mut left: Vec<BlockKey> = keys.iter().zip(present).filter(|(_, p)| !p).map(|(k, _)| *k).collect();
        let mut out = Promoted::default();
        if left.is_empty() || self.lower.is_empty() {
            return out;
        }
        let mut failed: Vec<BlockKey> = Vec::new();
        for tier in self.lower.iter() {
            if left.is_empty() {
                break;
            }
            let kind = tier.kind();
            // Straight into G2's pages where the tier can; the rest through buffers.
            let direct = self.read_into_g2(tier.as_ref(), &left, ready);
            let through: Vec<BlockKey> =
                left.iter().zip(&direct).filter(|(_, d)| matches!(d, Direct::NotTried)).map(|(k, _)| *k).collect();
            let mut bufs: Vec<BlockBuf> = through.iter().map(|_| BlockBuf::new()).collect();
            let results = tier.get_batch(&through, &mut bufs);
            let mut got = results.into_iter().zip(bufs);
            let mut still = Vec::new();
            let mut errors = 0u64;
            for (key, d) in left.iter().zip(direct) {
                let outcome = match d {
                    Direct::NotTried => match got.next() {
                        Some((Ok(Some(meta)), buf)) => {
                            if self.promote(key, meta, &buf, kind) {
                                Direct::Read(true)
                            } else {
                                out.unplaced.push((*key, meta, kind, buf));
                                Direct::Unplaced
                            }
                        }
                        Some((Ok(None), _)) | None => Direct::Miss,
                        Some((Err(e), _)) => Direct::Failed(e),
                    },
                    d => d,
                };
                match outcome {
                    Direct::Read(promoted) => {
                        if promoted {
                            out.promoted.push((*key, kind));
                        }
                        failed.retain(|k| k != key);
                    }
                    Direct::Unplaced => failed.retain(|k| k != key),
                    Direct::Miss | Direct::NotTried => still.push(*key),
                    Direct::Failed(e) => {
                        errors += 1;
                        if !failed.contains(key) {
                            failed.push(*key);
                        }
                        still.push(*key);
                        out.error.get_or_insert(e);
                    }
                }
            }
            if errors > 0 {
                metrics::counter!("kvcached_tier_read_errors_total", "tier" => kind.label()).increment(errors);
                if let Some(e) = &out.error {
                    tracing::warn!("{errors} block reads of {} failed, served as misses: {e}", kind.label());
                }
            }
            left = still;
        }
        failed.retain(|k| left.contains(k));
        out.failed = failed;
        out
    }

    /// Reads what `tier` holds of `keys` straight into pages reserved in G2 (no buffer between,
    /// no copy: the block is verified where it will stay). Keys the tier cannot read this way
    /// (it cannot tell their length without a read, G2 has no room, an empty block) are
    /// `NotTried`.
    fn read_into_g2(&self, tier: &dyn Tier, keys: &[BlockKey], ready: &mut ReadyBlock<'_>) -> Vec<Direct> {
        let mut outcome: Vec<Direct> = keys.iter().map(|_| Direct::NotTried).collect();
        let Some(direct) = tier.extensions().direct else { return outcome };
        let metas = direct.peek_each(keys);
        if metas.iter().all(Option::is_none) {
            return outcome;
        }
        let dirty = self.writers.first().is_some_and(|w| w.tier.index() < tier.kind().index());
        let mut fills = Vec::new();
        for (i, (key, meta)) in keys.iter().zip(metas).enumerate() {
            let Some(meta) = meta.filter(|m| m.len > 0) else { continue };
            match self.g2.begin_fill(*key, BlockMeta { owner: None, ..meta }, dirty) {
                Ok(Some(f)) => fills.push((i, f)),
                // Put there meanwhile by someone else: served from G2, not promoted by us.
                Ok(None) => outcome[i] = Direct::Read(false),
                Err(_) => {}
            }
        }
        if fills.is_empty() {
            return outcome;
        }
        let fill_keys: Vec<BlockKey> = fills.iter().map(|(_, f)| *f.key()).collect();
        let dests: Vec<&[(*mut u8, usize)]> = fills.iter().map(|(_, f)| f.pieces()).collect();
        let kind = tier.kind();
        // A panic in `ready` runs inside the tier's I/O loop, which aborts the process on an
        // unwind (its buffers may still be in flight): caught here, raised again once the batch
        // is over.
        let mut panicked = None;
        let mut verified = |j: usize| {
            let Some((_, f)) = fills.get(j).filter(|_| panicked.is_none()) else { return };
            // SAFETY: the tier reports a block only once every read into its pages has
            // completed, and nothing else writes a reservation's pages until it is finished or
            // aborted, which happens after this call: the bytes stand still while borrowed here.
            let parts: Vec<&[u8]> =
                f.pieces().iter().map(|&(p, n)| unsafe { std::slice::from_raw_parts(p.cast_const(), n) }).collect();
            let handed =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ready(f.key(), f.meta(), kind, &parts)));
            if let Err(p) = handed {
                panicked = Some(p);
            }
        };
        // SAFETY: each destination is the pages of a G2 reservation (`Filling`): aligned to
        // G2's page size (a multiple of 4 KiB), each piece whole pages but the last, whose pages
        // extend to the next page boundary; nothing else writes them until finished or aborted.
        let read = unsafe { direct.get_batch_into(&fill_keys, &dests, &mut verified) };
        drop(dests);
        for ((i, f), r) in fills.into_iter().zip(read) {
            let key = *f.key();
            outcome[i] = match r {
                Ok(Some(_)) => {
                    let stored = self.g2.finish_fill(f);
                    if stored {
                        self.promotions.add(1);
                        if dirty {
                            self.write_through(&key, Some(tier.kind()));
                        }
                    }
                    Direct::Read(stored)
                }
                Ok(None) => {
                    self.g2.abort_fill(f);
                    Direct::Miss
                }
                Err(e) => {
                    self.g2.abort_fill(f);
                    Direct::Failed(e)
                }
            };
        }
        if let Some(p) = panicked {
            std::panic::resume_unwind(p);
        }
        outcome
    }

    /// The fastest tier holding each block of the longest cached prefix of `keys` (as long as
    /// that prefix). Touches nothing: for accounting, not for use.
    pub fn fastest_tiers(&self, keys: &[BlockKey]) -> Vec<TierKind> {
        self.held_prefix(keys).into_iter().map(fastest_of).collect()
    }

    /// For each block of the longest prefix of `keys` held in some tier, the tiers holding it
    /// (bit `TierKind::index`). One lock per tier per chunk of keys, not one per key (a
    /// 128k-token prompt has 8192), and chunks short enough that no tier's lock is held long.
    pub fn held_prefix(&self, keys: &[BlockKey]) -> Vec<u8> {
        const CHUNK: usize = 512;
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(CHUNK) {
            let mut held: Vec<u8> =
                self.g2.contains_each(chunk).into_iter().map(|p| u8::from(p) << TierKind::G2Host.index()).collect();
            for t in self.lower.iter() {
                for (h, p) in held.iter_mut().zip(t.contains_each(chunk)) {
                    *h |= u8::from(p) << t.kind().index();
                }
            }
            let end = held.iter().position(|&h| h == 0);
            out.extend_from_slice(&held[..end.unwrap_or(held.len())]);
            if end.is_some() {
                break;
            }
        }
        out
    }

    /// Longest cached prefix of `keys` and where its blocks are. Marks the matched G2 blocks
    /// used, ancestors last so that they outlive their descendants.
    pub fn lookup(&self, keys: &[BlockKey]) -> PrefixMatch {
        let held = self.held_prefix(keys);
        self.mark_prefix(keys, &held)
    }

    /// The [`PrefixMatch`] of the leading blocks of `keys` whose tier bits
    /// [`BlockStore::held_prefix`] gave as `held` (gathered chunk by chunk, e.g. while the keys
    /// are still being derived), marking the G2 ones used, ancestors last.
    pub fn mark_prefix(&self, keys: &[BlockKey], held: &[u8]) -> PrefixMatch {
        let m = Self::count_prefix(held);
        self.touch_prefix(&keys[..m.blocks.min(keys.len())]);
        m
    }

    /// The [`PrefixMatch`] of tier bits from [`BlockStore::held_prefix`], touching nothing.
    pub fn count_prefix(held: &[u8]) -> PrefixMatch {
        let mut m = PrefixMatch::default();
        for &h in held {
            if h == 0 {
                break;
            }
            for t in TierKind::ALL.iter().filter(|t| h & (1 << t.index()) != 0) {
                m.resident[t.index()] += 1;
            }
            m.fastest[fastest_of(h).index()] += 1;
            m.blocks += 1;
        }
        m
    }

    /// Marks the G2 blocks among a matched prefix used, ancestors last (so that a chain is
    /// evicted from its tail).
    pub fn touch_prefix(&self, keys: &[BlockKey]) {
        self.g2.touch_chain(keys);
    }

    /// Pins the present blocks among `keys` in every tier for `ttl`.
    pub fn pin(&self, keys: &[BlockKey], ttl: Duration) -> LeaseId {
        let lease = LeaseId(self.next_lease.fetch_add(1, Ordering::Relaxed));
        let deadline = Instant::now() + ttl;
        self.g2.pin(lease, keys, deadline);
        for t in self.lower.iter() {
            t.pin(lease, keys, deadline);
        }
        lease
    }

    /// Releases a lease early.
    pub fn release(&self, lease: LeaseId) {
        self.g2.release(lease);
        for t in self.lower.iter() {
            t.release(lease);
        }
    }

    /// Removes a block from every tier.
    pub fn remove(&self, key: &BlockKey) -> Result<bool> {
        let mut any = self.g2.remove(key)?;
        for t in self.lower.iter() {
            any |= t.remove(key)?;
        }
        Ok(any)
    }

    /// Waits until every queued write-through has been written (or has failed), without
    /// making the lower tiers durable (that is [`Self::flush`]).
    pub fn wait_writethrough(&self) {
        for w in &self.writers {
            w.wait_idle();
        }
    }

    /// Holds every write-through thread before its next batch until the guard drops: blocks put
    /// meanwhile stay dirty in G2 and queued (up to each queue's bound). Benches use it to time
    /// how fast a G2 full of dirty blocks drains. Waiting for write-through while holding the guard
    /// would wait for ever.
    pub fn pause_writethrough(&self) -> WriteThroughPause<'_> {
        for w in &self.writers {
            w.pause(true);
        }
        WriteThroughPause { store: self }
    }

    /// Waits for queued write-through and makes the lower tiers durable.
    pub fn flush(&self) -> Result<()> {
        self.wait_writethrough();
        for t in self.lower.iter() {
            t.flush()?;
        }
        Ok(())
    }

    pub fn stats(&self) -> StoreStats {
        let mut tiers = vec![(TierKind::G2Host, self.g2.stats())];
        tiers.extend(self.lower.iter().map(|t| (t.kind(), t.stats())));
        let by_tier: Vec<(TierKind, u64, u64, u64, u64)> = self
            .writers
            .iter()
            .map(|w| {
                let c = &w.counters;
                (w.tier, c.written.get(), c.dropped.get() + c.vanished.get(), c.errors.get(), w.queued())
            })
            .collect();
        // The first writer's figures are the store's (what `/healthz` and Stats reported before
        // G4); every tier's are in `writethrough_by_tier`.
        let (written, dropped, errors, queued) = by_tier.first().map_or((0, 0, 0, 0), |&(_, w, d, e, q)| (w, d, e, q));
        StoreStats {
            writethrough_by_tier: by_tier,
            tiers,
            writethrough_written: written,
            writethrough_dropped: dropped,
            writethrough_evicted_before_write: self.g2.evicted_before_write(),
            writethrough_errors: errors,
            writethrough_queued: queued,
            promotions: self.promotions.get(),
        }
    }
}

/// Write-through held by [`BlockStore::pause_writethrough`]; dropping it lets the writers go.
#[derive(Debug)]
#[must_use = "write-through resumes when the guard drops"]
pub struct WriteThroughPause<'a> {
    store: &'a BlockStore,
}

impl Drop for WriteThroughPause<'_> {
    fn drop(&mut self) {
        for w in &self.store.writers {
            w.pause(false);
        }
    }
}

impl BlockStore {
    /// How many leading blocks of `keys` (a chain of `namespace` none of whose blocks the
    /// tiers' indexes know) a lower tier holds after asking its medium: G4 finds what other
    /// daemons wrote, in a few round trips.
    pub fn probe_lower(&self, namespace: kvproto::NamespaceId, keys: &[BlockKey]) -> usize {
        self.lower
            .iter()
            .filter_map(|t| t.extensions().probe)
            .map(|p| p.probe_prefix(namespace, keys))
            .max()
            .unwrap_or(0)
    }

    /// Whether any lower tier must be asked beyond its index (a [`crate::PrefixProbe`]: G4).
    pub fn has_remote_tier(&self) -> bool {
        self.lower.iter().any(|t| t.extensions().probe.is_some())
    }

    /// Why lower tiers are degraded now, one line each.
    pub fn degraded(&self) -> Vec<(TierKind, String)> {
        self.lower
            .iter()
            .filter_map(|t| {
                t.degraded().map(|why| (t.kind(), format!("{} degraded: {why}", t.kind().label().to_uppercase())))
            })
            .collect()
    }

    /// The queue depth and capacity of each lower tier's write-through: (tier, queued).
    pub fn writethrough_queued(&self) -> Vec<(TierKind, u64)> {
        self.writers.iter().map(|w| (w.tier, w.queued())).collect()
    }
}

impl Drop for BlockStore {
    fn drop(&mut self) {
        // Drain the write-through queue so a clean shutdown loses nothing.
        if let Err(e) = self.flush() {
            tracing::warn!("flush at shutdown failed: {e}");
        }
    }
}
