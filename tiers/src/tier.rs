//! The one abstraction every tier implements.

use std::time::Instant;

use kvproto::{BlockKey, TierKind};

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

/// A block [`Tier::read_into_foreign`] delivered: its metadata and the checksum its bytes
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
/// - A block is visible to `get`/`contains` only once all of its bytes are in the tier.
/// - `put` of a key that is already present (or being written) is a no-op success: keys name
///   their content, so the first writer wins.
/// - `get` returns exactly the bytes that were put, or `Ok(None)`. A block whose bytes fail
///   verification is removed, counted, and reported as a miss: never returned.
/// - Space is reclaimed by eviction (prefix-aware LRU, never a pinned block); `put` fails with
///   `TierError::Full` only when nothing can be evicted.
pub trait Tier: Send + Sync + std::fmt::Debug {
    fn kind(&self) -> TierKind;

    /// Stores one block. Returns `true` if it was stored now, `false` if it was already there.
    fn put(&self, block: BlockRef<'_>) -> Result<bool>;

    /// Stores several blocks; tiers that can amortise (one fsync, one index batch) override
    /// this. Returns, per block, what `put` would have.
    fn put_batch(&self, blocks: &[BlockRef<'_>]) -> Vec<Result<bool>> {
        blocks.iter().map(|b| self.put(*b)).collect()
    }

    /// [`Tier::put_batch`] of blocks given as pieces: write-through hands G2's pages over as
    /// they are. The default gathers each block into one buffer; G3 writes the pages to disk
    /// without a copy.
    fn put_batch_parts(&self, blocks: &[PartsRef<'_>]) -> Vec<Result<bool>> {
        let bufs: Vec<BlockBuf> = blocks.iter().map(|b| BlockBuf::from_parts(b.parts)).collect();
        let refs: Vec<BlockRef<'_>> =
            blocks.iter().zip(&bufs).map(|(b, buf)| BlockRef { key: b.key, meta: b.meta, data: &buf[..] }).collect();
        self.put_batch(&refs)
    }

    /// Reads a block into `out` (resized to the block's length).
    fn get(&self, key: &BlockKey, out: &mut BlockBuf) -> Result<Option<BlockMeta>>;

    /// Reads several blocks, `keys[i]` into `outs[i]` (`outs` at least as long as `keys`);
    /// returns, per key, what `get` would have. Tiers whose I/O has a fixed cost per call
    /// override it to read the whole batch at once.
    fn get_batch(&self, keys: &[BlockKey], outs: &mut [BlockBuf]) -> Vec<Result<Option<BlockMeta>>> {
        keys.iter().zip(outs.iter_mut()).map(|(k, o)| self.get(k, o)).collect()
    }

    /// Whether the block is visible. Touches no block data.
    /// The metadata of each block of `keys` this tier holds, without reading it (None where
    /// absent, or where the tier cannot tell without a read: the default). Lets G2 reserve
    /// pages for a block before [`Tier::get_batch_into`] reads it straight into them.
    fn peek_each(&self, keys: &[BlockKey]) -> Vec<Option<BlockMeta>> {
        vec![None; keys.len()]
    }

    /// Reads blocks straight into memory the caller names: for each key, (start, bytes) pieces
    /// in block order, adding up to the block's length (a block whose length differs is not
    /// read: a miss). Verified like [`Tier::get_batch`]. `None` when the tier cannot (the
    /// default): the caller reads through [`Tier::get_batch`] instead. Where the tier can tell
    /// early, `verified(i)` is called as soon as block `i` has arrived whole and passed its
    /// check, while later blocks may still be in flight (its result is then `Ok(Some(_))`): the
    /// caller may use its bytes from then on.
    ///
    /// # Safety
    /// Every piece must start 4 KiB-aligned, every piece but the last be a multiple of 4 KiB
    /// long, the last have room up to the next multiple of 4 KiB, and all of it be writable and
    /// untouched by anything else until this returns (G2 pages of a [`crate::Filling`] are).
    unsafe fn get_batch_into(
        &self,
        _keys: &[BlockKey],
        _dests: &[&[(*mut u8, usize)]],
        _verified: &mut dyn FnMut(usize),
    ) -> Option<Vec<Result<Option<BlockMeta>>>> {
        None
    }

    /// Reads blocks straight into memory another process can write (a CPU engine's mapped KV
    /// memory), as [`Tier::get_batch_into`] but for one difference: what goes wrong there (a
    /// read that fails, a sum that does not match) may be that process's doing, writing or
    /// truncating its memory under the read, so it is held against neither the tier nor the
    /// block. Such a key is simply not delivered (`None`), as is one whose destination is not
    /// whole 4 KiB pages, and the caller reads it the trusted way, which tells a bad block from
    /// a bad destination. A delivered block comes with the checksum its bytes matched, so that
    /// a later copy of them can be checked against it. `None` when the tier cannot (the
    /// default).
    ///
    /// # Safety
    /// Every piece must be valid for writes of its length until this returns (a page the other
    /// process truncates away must fail the read or be caught by the caller, not crash it).
    unsafe fn read_into_foreign(
        &self,
        _keys: &[BlockKey],
        _dests: &[&[(*mut u8, usize)]],
    ) -> Option<Vec<Option<Delivered>>> {
        None
    }

    fn contains(&self, key: &BlockKey) -> bool;

    /// [`Tier::contains`] of each key, in order (tiers override this to take their lock once).
    fn contains_each(&self, keys: &[BlockKey]) -> Vec<bool> {
        keys.iter().map(|k| self.contains(k)).collect()
    }

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

    /// Installs the listener told of every block this tier gains and loses (once; false if one
    /// is already installed or the tier reports nothing).
    fn set_listener(&self, _listener: std::sync::Arc<dyn TierListener>) -> bool {
        false
    }

    /// How many leading blocks of `keys` (a chain of `namespace`) this tier holds, asking its
    /// medium where the tier's own index cannot know (G4: other daemons' writes). The default
    /// counts what [`Tier::contains_each`] says.
    fn probe_prefix(&self, _namespace: kvproto::NamespaceId, keys: &[BlockKey]) -> usize {
        self.contains_each(keys).into_iter().take_while(|p| *p).count()
    }

    /// Why the tier is degraded now (its medium failing), if it is.
    fn degraded(&self) -> Option<String> {
        None
    }

    /// Tells the tier that most of its transfers start or end in `len` bytes at `base` (G2's
    /// pool), mapped while `owner` lives: G3 registers them with the kernel once instead of
    /// pinning pages on every read and write. The default ignores it.
    ///
    /// # Safety
    /// As [`crate::disk::io::FixedMemory::new`]: one readable, writable mapping that keeps its
    /// pages (never remapped, truncated or hole-punched) while `owner` is alive.
    unsafe fn adopt_host_memory(
        &self,
        _base: *const u8,
        _len: usize,
        _owner: std::sync::Arc<dyn std::any::Any + Send + Sync>,
    ) {
    }

    /// Makes every completed put durable (no-op for volatile tiers).
    fn flush(&self) -> Result<()> {
        Ok(())
    }
}
