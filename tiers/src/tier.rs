//! The one abstraction every tier implements, kept small: [`Tier`], ten functions every tier
//! writes plus [`Tier::extensions`], through which a tier offers what only some tiers can do:
//! - [`DirectIo`]: reads and writes straight between the medium and memory the caller names
//!   (G2's pages, an engine's mapped KV memory), without a buffer between (G3);
//! - [`PrefixProbe`]: asks the medium itself how much of a chain it holds, beyond what the
//!   tier's own index knows (G4: other daemons' writes);
//! - [`Medium`]: a medium that can fail (degraded) or hold writes back (flush) (G3, G4);
//! - [`Reports`]: tells a [`TierListener`] of every block gained and lost (G2, G3, G4).
//!
//! [`TierExt`], implemented for every tier, gives the conveniences over these (one block at a
//! time, the extensions' defaults where a tier lacks one), so that callers never match on
//! extensions themselves. The conformance suite (`tiers/tests/conformance.rs`) runs the core
//! contract against every tier and each extension against every tier that offers it.

use std::sync::Arc;
use std::time::Instant;

use kvproto::{BlockKey, NamespaceId, TierKind};

use crate::block::{BlockMeta, LeaseId, SumKind};
use crate::buf::BlockBuf;
use crate::error::Result;
use crate::listener::TierListener;
use crate::stats::{TierStats, TierUsage};

/// One block to put.
#[derive(Debug, Clone, Copy)]
pub struct BlockRef<'a> {
    pub key: BlockKey,
    pub meta: BlockMeta,
    pub data: &'a [u8],
}

/// One block to put, given as pieces concatenated in order (a G2 block's page runs).
#[derive(Debug, Clone, Copy)]
pub struct PartsRef<'a> {
    pub key: BlockKey,
    pub meta: BlockMeta,
    pub parts: &'a [&'a [u8]],
}

/// A block [`DirectIo::read_into_foreign`] delivered: its metadata and the checksum its bytes
/// matched (of the kind the tier stored it with).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivered {
    pub meta: BlockMeta,
    pub sum_kind: SumKind,
    pub sum: u64,
}

/// A storage tier: G1 engine GPU memory, G2 host pool, G3 disk, G4 object storage.
///
/// Contract (checked by the conformance suite in `tiers/tests/conformance.rs`):
/// - A block is visible to `get_batch`/`contains_each` only once all of its bytes are in the
///   tier.
/// - A put of a key that is already present (or being written) is a no-op success: keys name
///   their content, so the first writer wins.
/// - A get returns exactly the bytes that were put, or `Ok(None)`. A block whose bytes fail
///   verification is removed, counted, and reported as a miss: never returned.
/// - Space is reclaimed by eviction (prefix-aware LRU, never a pinned block); a put fails with
///   `TierError::Full` only when nothing can be evicted.
pub trait Tier: Send + Sync + std::fmt::Debug {
    fn kind(&self) -> TierKind;

    /// Stores blocks; returns, per block, `true` if it was stored now, `false` if it was
    /// already there. Tiers amortise what they can over the batch (one fsync, one index write,
    /// PUTs in parallel).
    fn put_batch(&self, blocks: &[BlockRef<'_>]) -> Vec<Result<bool>>;

    /// Reads blocks, `keys[i]` into `outs[i]` (`outs` at least as long as `keys`, each resized
    /// to its block's length); per key, the block's metadata, `None` on a miss.
    fn get_batch(&self, keys: &[BlockKey], outs: &mut [BlockBuf]) -> Vec<Result<Option<BlockMeta>>>;

    /// Whether each key is visible, in order. Touches no block data.
    fn contains_each(&self, keys: &[BlockKey]) -> Vec<bool>;

    /// Removes a block; `true` if it was there.
    fn remove(&self, key: &BlockKey) -> Result<bool>;

    /// Pins the present blocks among `keys` until `deadline`; returns how many were pinned.
    fn pin(&self, lease: LeaseId, keys: &[BlockKey], deadline: Instant) -> usize;

    /// Drops the pins of `lease`.
    fn release(&self, lease: LeaseId);

    fn usage(&self) -> TierUsage;

    fn stats(&self) -> TierStats;

    /// Every visible block (for snapshots and tests).
    fn keys(&self) -> Vec<(BlockKey, BlockMeta)>;

    /// What this tier can do beyond the core (none by default).
    fn extensions(&self) -> Extensions<'_> {
        Extensions::default()
    }
}

/// The extension traits a tier implements, each `None` where it does not.
#[derive(Clone, Copy, Default)]
pub struct Extensions<'a> {
    pub direct: Option<&'a dyn DirectIo>,
    pub probe: Option<&'a dyn PrefixProbe>,
    pub medium: Option<&'a dyn Medium>,
    pub reports: Option<&'a dyn Reports>,
}

impl std::fmt::Debug for Extensions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extensions")
            .field("direct", &self.direct.is_some())
            .field("probe", &self.probe.is_some())
            .field("medium", &self.medium.is_some())
            .field("reports", &self.reports.is_some())
            .finish()
    }
}

/// A tier that moves bytes straight between its medium and memory the caller names (G3: the
/// G2 pool's pages, an engine's mapped KV memory), with no buffer between.
pub trait DirectIo: Send + Sync {
    /// The metadata of each block of `keys` this tier holds, without reading it (None where
    /// absent). Lets G2 reserve pages for a block before [`DirectIo::get_batch_into`] reads it
    /// straight into them.
    fn peek_each(&self, keys: &[BlockKey]) -> Vec<Option<BlockMeta>>;

    /// Stores blocks given as pieces (G2's pages, as they are) without gathering them first;
    /// returns, per block, what [`Tier::put_batch`] would have.
    fn put_pieces(&self, blocks: &[PartsRef<'_>]) -> Vec<Result<bool>>;

    /// Reads blocks straight into memory the caller names: for each key, (start, bytes) pieces
    /// in block order, adding up to the block's length (a block whose length differs is not
    /// read: a miss). Verified like [`Tier::get_batch`]. Where the tier can tell early,
    /// `verified(i)` is called as soon as block `i` has arrived whole and passed its check,
    /// while later blocks may still be in flight (its result is then `Ok(Some(_))`): the caller
    /// may use its bytes from then on.
    ///
    /// # Safety
    /// Every piece must start 4 KiB-aligned, every piece but the last be a multiple of 4 KiB
    /// long, the last have room up to the next multiple of 4 KiB, and all of it be writable and
    /// untouched by anything else until this returns (G2 pages of a [`crate::Filling`] are).
    unsafe fn get_batch_into(
        &self,
        keys: &[BlockKey],
        dests: &[&[(*mut u8, usize)]],
        verified: &mut dyn FnMut(usize),
    ) -> Vec<Result<Option<BlockMeta>>>;

    /// Reads blocks straight into memory another process can write (a CPU engine's mapped KV
    /// memory), as [`DirectIo::get_batch_into`] but for one difference: what goes wrong there
    /// (a read that fails, a sum that does not match) may be that process's doing, writing or
    /// truncating its memory under the read, so it is held against neither the tier nor the
    /// block. Such a key is simply not delivered (`None`), as is one whose destination is not
    /// whole 4 KiB pages, and the caller reads it the trusted way, which tells a bad block from
    /// a bad destination. A delivered block comes with the checksum its bytes matched, so that
    /// a later copy of them can be checked against it.
    ///
    /// # Safety
    /// Every piece must be valid for writes of its length until this returns (a page the other
    /// process truncates away must fail the read or be caught by the caller, not crash it).
    unsafe fn read_into_foreign(&self, keys: &[BlockKey], dests: &[&[(*mut u8, usize)]]) -> Vec<Option<Delivered>>;

    /// Tells the tier that most of its transfers start or end in `len` bytes at `base` (G2's
    /// pool), mapped while `owner` lives: G3 registers them with the kernel once instead of
    /// pinning pages on every read and write.
    ///
    /// # Safety
    /// As [`crate::disk::io::FixedMemory::new`]: one readable, writable mapping that keeps its
    /// pages (never remapped, truncated or hole-punched) while `owner` is alive.
    unsafe fn adopt_host_memory(&self, base: *const u8, len: usize, owner: Arc<dyn std::any::Any + Send + Sync>);
}

/// A tier whose index cannot know everything its medium holds (G4: other daemons write to the
/// same bucket), so a lookup may ask the medium.
pub trait PrefixProbe: Send + Sync {
    /// How many leading blocks of `keys` (a chain of `namespace`) the medium holds, learning
    /// the ones found into the tier's index.
    fn probe_prefix(&self, namespace: NamespaceId, keys: &[BlockKey]) -> usize;
}

/// A tier on a medium that can fail or holds writes back (G3's disk, G4's store).
pub trait Medium: Send + Sync {
    /// Why the tier is degraded now (its medium failing), if it is.
    fn degraded(&self) -> Option<String>;

    /// Makes every completed put durable.
    fn flush(&self) -> Result<()>;
}

/// A tier that tells a listener of every block it gains and loses, evictions included (which
/// happen inside the tier, under its lock: no wrapper could see them).
pub trait Reports: Send + Sync {
    /// Installs the listener (once; false if one is already installed).
    fn set_listener(&self, listener: Arc<dyn TierListener>) -> bool;
}

/// What every tier can be asked, over [`Tier`] and its extensions: one block at a time, and
/// each extension's operation with its plain fallback where the tier lacks it.
pub trait TierExt: Tier {
    /// Stores one block (see [`Tier::put_batch`]).
    fn put(&self, block: BlockRef<'_>) -> Result<bool> {
        self.put_batch(&[block]).pop().unwrap_or(Ok(false))
    }

    /// Reads one block into `out` (resized to the block's length).
    fn get(&self, key: &BlockKey, out: &mut BlockBuf) -> Result<Option<BlockMeta>> {
        self.get_batch(std::slice::from_ref(key), std::slice::from_mut(out)).pop().unwrap_or(Ok(None))
    }

    /// Whether the block is visible.
    fn contains(&self, key: &BlockKey) -> bool {
        self.contains_each(std::slice::from_ref(key)).first().copied().unwrap_or(false)
    }

    /// Blocks given as pieces: written as they are by a [`DirectIo`] tier, gathered into one
    /// buffer each for the others.
    fn put_batch_parts(&self, blocks: &[PartsRef<'_>]) -> Vec<Result<bool>> {
        if let Some(d) = self.extensions().direct {
            return d.put_pieces(blocks);
        }
        let bufs: Vec<BlockBuf> = blocks.iter().map(|b| BlockBuf::from_parts(b.parts)).collect();
        let refs: Vec<BlockRef<'_>> =
            blocks.iter().zip(&bufs).map(|(b, buf)| BlockRef { key: b.key, meta: b.meta, data: &buf[..] }).collect();
        self.put_batch(&refs)
    }

    /// How many leading blocks of `keys` the tier holds: its medium asked where it is a
    /// [`PrefixProbe`], its index otherwise.
    fn probe_prefix(&self, namespace: NamespaceId, keys: &[BlockKey]) -> usize {
        match self.extensions().probe {
            Some(p) => p.probe_prefix(namespace, keys),
            None => self.contains_each(keys).into_iter().take_while(|p| *p).count(),
        }
    }

    /// Why the tier's medium is degraded now (never, for a tier that is no [`Medium`]).
    fn degraded(&self) -> Option<String> {
        self.extensions().medium.and_then(|m| m.degraded())
    }

    /// Makes every completed put durable (nothing to do for a tier that is no [`Medium`]).
    fn flush(&self) -> Result<()> {
        self.extensions().medium.map_or(Ok(()), |m| m.flush())
    }

    /// Installs the listener of a [`Reports`] tier; false if it reports nothing or already had
    /// one.
    fn set_listener(&self, listener: Arc<dyn TierListener>) -> bool {
        self.extensions().reports.is_some_and(|r| r.set_listener(listener))
    }
}

impl<T: Tier + ?Sized> TierExt for T {}
