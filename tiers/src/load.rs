//! One load: the blocks of a chain, each from the fastest tier holding it, into a sink.
//!
//! [`crate::BlockStore::load_into`] is the store's one load operation. It goes chunk by chunk;
//! in each chunk, the blocks G2 lacks come up from the lower tiers in one batch read per tier,
//! each handed to the sink as soon as it is in and verified (while the chunk's later reads are
//! in flight), and the rest are copied out of G2. A load stops at the first block no tier
//! holds, a tier fails to read, or the sink does not take: what is before it is served.
//!
//! A sink that offers memory of its own ([`LoadSink::direct`], a CPU engine's slots) has the
//! blocks below G2 read straight into it with [`LoadOptions::direct`]: one read and one check,
//! no copy through G2. Those come up into G2 afterwards, when the caller calls
//! [`crate::BlockStore::settle`], copied back out of the sink and checked again.

use std::marker::PhantomData;

use kvproto::{BlockKey, TierKind};

use crate::block::{BlockMeta, StreamingChecksum};
use crate::buf::BlockBuf;
use crate::error::TierError;
use crate::store::{BlockStore, Promoted};
use crate::tier::{Delivered, Tier};

/// Memory a lower tier may read one block straight into: pieces in block order, writable for
/// `'a`. Made only by [`Destination::new`], whose caller vouches for the memory, so that the
/// store's functions that write into it are safe.
#[derive(Debug)]
pub struct Destination<'a> {
    pieces: Vec<(*mut u8, usize)>,
    _memory: PhantomData<&'a mut [u8]>,
}

impl<'a> Destination<'a> {
    /// # Safety
    /// Every piece must be valid for writes of its length for all of `'a`. The memory may be
    /// shared with another process that writes it too (an engine's mapped KV memory): what is
    /// read there is verified where it lands, and copied out again only against its checksum;
    /// a page the other process truncates away must fail the read or be caught by the sink's
    /// [`LoadSink::check`], not crash the caller.
    pub unsafe fn new(pieces: Vec<(*mut u8, usize)>) -> Self {
        Self { pieces, _memory: PhantomData }
    }

    pub(crate) fn pieces(&self) -> &[(*mut u8, usize)] {
        &self.pieces
    }
}

/// Where a load puts the blocks it finds: an engine's slots, a buffer, a test's vectors. Block
/// indices are positions in the key chain given to [`crate::BlockStore::load_into`].
pub trait LoadSink {
    /// Why the sink could not take a block (a failed copy into its memory): fails the load.
    type Error;

    /// Whether block `i`, as its metadata says, is one this sink takes (its namespace and
    /// length); false ends the load there ([`LoadEnd::Mismatch`]).
    fn accepts(&self, i: usize, meta: &BlockMeta) -> bool;

    /// Copies block `i`'s verified bytes (pieces in block order) into place.
    fn fill(&mut self, i: usize, pieces: &[&[u8]]) -> Result<(), Self::Error>;

    /// Whether a block coming up from a lower tier is handed over as soon as it is read, while
    /// its pages are still G2's reservation (true), or once G2 holds it (false: it is then
    /// handed over from G2, whose committed pages a sink may keep while its copy runs, as a
    /// GPU engine's queued copies do).
    fn streams(&self) -> bool {
        true
    }

    /// Block `i` is in the sink; `from` is the tier it was in before the load.
    fn done(&mut self, _i: usize, _from: TierKind) {}

    /// A chunk of blocks is in (for progress reports).
    fn chunk_done(&mut self) {}

    /// Waits until every block `fill` accepted is in place: a sink whose `fill` only queues
    /// its copy (DMA into an engine's GPU memory, many blocks in flight) finishes them here.
    /// Called before each [`LoadSink::chunk_done`] and before the load returns; an error (a
    /// copy failed) fails the load, so no block is reported in place that is not.
    fn flush(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Memory where a lower tier may read block `i` straight in, skipping G2 (asked only with
    /// [`LoadOptions::direct`]); `None`: not offered.
    fn direct(&self, _i: usize) -> Option<Destination<'_>> {
        None
    }

    /// After blocks were read straight into the sink's memory: fails when that memory was
    /// disturbed meanwhile (its owner truncated it), so what was read there is not the blocks.
    fn check(&self) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Copies block `i` back out of the sink's memory into `dst` (G2's pages for it), for
    /// [`crate::BlockStore::settle`]; false: it could not.
    fn copy_back(&self, _i: usize, _dst: &mut [&mut [u8]]) -> bool {
        false
    }
}

/// How a load goes.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Blocks brought up from below in one batch per tier.
    pub chunk: usize,
    /// Read blocks below G2 straight into the sink's own memory ([`LoadSink::direct`]); they
    /// come up into G2 on [`crate::BlockStore::settle`].
    pub direct: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self { chunk: 16, direct: false }
    }
}

/// Why a load ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadEnd {
    /// Every block asked for is in the sink.
    #[default]
    Whole,
    /// No tier holds the next block.
    Miss,
    /// A tier failed to read the next block (counted and logged by the store): a miss too,
    /// and no other tier had it.
    Failed,
    /// The next block is not one the sink takes (another namespace or length).
    Mismatch,
}

/// A block read straight into a sink's memory, to be brought up into G2 by
/// [`crate::BlockStore::settle`].
#[derive(Debug, Clone, Copy)]
pub struct DirectRead {
    pub index: usize,
    pub tier: TierKind,
    pub delivered: Delivered,
}

/// What a load did.
#[derive(Debug, Default)]
pub struct LoadReport {
    /// Blocks in the sink, from the first asked for, in order.
    pub loaded: usize,
    pub end: LoadEnd,
    /// Blocks read straight into the sink's memory (not in G2 yet).
    pub direct: Vec<DirectRead>,
}

/// A block of a chunk already handed to the sink: from which tier, and how the copy went.
type Early<E> = Option<(TierKind, Result<(), E>)>;

/// A load that failed as a whole.
#[derive(Debug)]
pub enum LoadError<E> {
    /// The sink could not take a block.
    Sink(E),
    /// G2 failed to serve a block it holds.
    Tier(TierError),
}

impl BlockStore {
    /// Loads `keys[from..]` into `sink`, each block from the fastest tier holding it, chunk by
    /// chunk (see the module's introduction), until the end of the chain or the first block
    /// that no tier holds, that a tier fails to read, or that the sink does not take. Blocks
    /// brought up from below land in G2 as well (but those read straight into the sink with
    /// [`LoadOptions::direct`]: [`BlockStore::settle`] brings them up after). Fails only when
    /// the sink fails to take a block or G2 fails to serve one it holds.
    pub fn load_into<S: LoadSink>(
        &self,
        keys: &[BlockKey],
        from: usize,
        sink: &mut S,
        opts: &LoadOptions,
    ) -> Result<LoadReport, LoadError<S::Error>> {
        let loaded = self.load_chunks(keys, from, sink, opts);
        // Copies the sink still has in flight finish before the load is reported, whatever
        // ended it.
        let flushed = sink.flush();
        match (loaded, flushed) {
            (Err(e), _) => Err(e),
            (Ok(_), Err(e)) => Err(LoadError::Sink(e)),
            (Ok(report), Ok(())) => Ok(report),
        }
    }

    fn load_chunks<S: LoadSink>(
        &self,
        keys: &[BlockKey],
        from: usize,
        sink: &mut S,
        opts: &LoadOptions,
    ) -> Result<LoadReport, LoadError<S::Error>> {
        let mut report = LoadReport::default();
        let mut buf = BlockBuf::new();
        let mut start = from;
        while start < keys.len() {
            let end = (start + opts.chunk.max(1)).min(keys.len());
            let chunk = &keys[start..end];
            // Per block of the chunk: handed to the sink already, from which tier, how it went.
            let mut early: Vec<Early<S::Error>> = chunk.iter().map(|_| None).collect();
            if opts.direct {
                let s: &S = sink;
                let read = self.read_into_foreign(chunk, |i, meta| {
                    s.accepts(start + i, meta).then(|| s.direct(start + i)).flatten()
                });
                sink.check().map_err(LoadError::Sink)?;
                for (i, got) in read.into_iter().enumerate() {
                    if let Some((tier, delivered)) = got {
                        early[i] = Some((tier, Ok(())));
                        report.direct.push(DirectRead { index: start + i, tier, delivered });
                    }
                }
            }
            // What G2 lacks comes up from below, each block handed on as soon as it is in. A
            // lower tier failing (a disk error, a store down or hung) is a miss from the first
            // block it failed on: counted and logged by the store, never a failed load.
            let rest: Vec<BlockKey> = chunk.iter().zip(&early).filter(|(_, e)| e.is_none()).map(|(k, _)| *k).collect();
            let streams = sink.streams();
            let Promoted { promoted, failed, unplaced, .. } =
                self.promote_batch_lossy_each(&rest, &mut |key, meta, tier, pieces| {
                    let Some(i) = chunk.iter().position(|k| k == key) else { return };
                    // A block the sink does not take (or takes only from G2) is left to the
                    // loop below, which ends there (or reads it from G2).
                    if early[i].is_none() && streams && sink.accepts(start + i, meta) {
                        early[i] = Some((tier, sink.fill(start + i, pieces)));
                    }
                });
            for (i, key) in chunk.iter().enumerate() {
                let j = start + i;
                if failed.contains(key) {
                    report.end = LoadEnd::Failed;
                    return Ok(report);
                }
                let mut copy = |meta: &BlockMeta, pieces: &[&[u8]]| {
                    if !sink.accepts(j, meta) {
                        return Ok(false);
                    }
                    sink.fill(j, pieces).map(|()| true)
                };
                // A block read from below that G2 had no room for is served from its buffer,
                // not read a second time.
                let got = match (early[i].take(), unplaced.iter().find(|(k, ..)| k == key)) {
                    (Some((tier, filled)), _) => Some((tier, filled.map(|()| true))),
                    (None, Some((_, meta, tier, b))) => Some((*tier, copy(meta, &[&b[..]]))),
                    (None, None) => self.read_with(key, &mut buf, copy).map_err(LoadError::Tier)?,
                };
                match got {
                    Some((_, Err(e))) => return Err(LoadError::Sink(e)),
                    Some((tier, Ok(true))) => {
                        report.loaded += 1;
                        // Where the block was before this load: promoted ones count for the
                        // tier they came up from.
                        sink.done(j, promoted.iter().find(|(k, _)| k == key).map_or(tier, |(_, t)| *t));
                    }
                    Some((_, Ok(false))) => {
                        report.end = LoadEnd::Mismatch;
                        return Ok(report);
                    }
                    None => {
                        report.end = LoadEnd::Miss;
                        return Ok(report);
                    }
                }
            }
            sink.flush().map_err(LoadError::Sink)?;
            sink.chunk_done();
            start = end;
        }
        Ok(report)
    }

    /// Brings the blocks a load read straight into `sink`'s memory up into G2, each copied back
    /// out of the sink and checked against the sum it was read with ([`BlockStore::promote_copy`]).
    /// Called once whoever waited for the load was told.
    pub fn settle<S: LoadSink>(&self, keys: &[BlockKey], direct: &[DirectRead], sink: &S) {
        for d in direct {
            if let Some(key) = keys.get(d.index) {
                self.promote_copy(key, d.tier, &d.delivered, |dst| sink.copy_back(d.index, dst));
            }
        }
    }

    /// Reads the blocks of `keys` that G2 lacks and a lower tier holds straight into memory
    /// another process can write (a CPU engine's KV memory), skipping G2: one read per block,
    /// checked where it lands, instead of a read into G2 and a copy on. `dest(i, meta)` names
    /// key `i`'s destination (None: not wanted, e.g. of another length). Returns, per key, the
    /// tier and what was delivered; a key not delivered (in G2, not held, not readable this way,
    /// or failed there) is `None`, for the caller to load the usual way, which tells a bad
    /// block from a bad destination. Delivered blocks are not in G2:
    /// [`BlockStore::promote_copy`] brings them up afterwards, checked again.
    pub fn read_into_foreign<'d>(
        &self,
        keys: &[BlockKey],
        mut dest: impl FnMut(usize, &BlockMeta) -> Option<Destination<'d>>,
    ) -> Vec<Option<(TierKind, Delivered)>> {
        let mut out: Vec<Option<(TierKind, Delivered)>> = keys.iter().map(|_| None).collect();
        let present = self.g2.contains_each(keys);
        let mut asked: Vec<bool> = present;
        for tier in self.lower.iter() {
            let Some(direct) = tier.extensions().direct else { continue };
            let metas = direct.peek_each(keys);
            let mut idx = Vec::new();
            let mut dests = Vec::new();
            for (i, meta) in metas.iter().enumerate() {
                let Some(meta) = meta.filter(|_| !asked[i]) else { continue };
                // Asked of its first tier only: a block that tier holds but could not deliver
                // is the usual load's to settle.
                asked[i] = true;
                if let Some(d) = dest(i, &meta) {
                    idx.push(i);
                    dests.push(d);
                }
            }
            if idx.is_empty() {
                continue;
            }
            let picked: Vec<BlockKey> = idx.iter().map(|&i| keys[i]).collect();
            let slices: Vec<&[(*mut u8, usize)]> = dests.iter().map(Destination::pieces).collect();
            // SAFETY: each destination is writable for its length until 'd, which outlasts
            // this call ([`Destination::new`]'s contract).
            let got = unsafe { direct.read_into_foreign(&picked, &slices) };
            for (i, d) in idx.into_iter().zip(got) {
                out[i] = d.map(|d| (tier.kind(), d));
            }
        }
        out
    }

    /// Brings a block that [`BlockStore::read_into_foreign`] delivered up into G2 afterwards,
    /// copied back out of where it was delivered by `copy` (into G2's pages, given as pieces in
    /// block order; false: the copy failed) and checked against the sum it was delivered with:
    /// the other process may have written its memory since, and G2 must hold only the block.
    /// Returns whether it is in G2 now. A full G2, or a copy that differs, only skips the
    /// promotion; a copy that differs is counted in `kvcached_promotions_skipped_total`.
    pub fn promote_copy(
        &self,
        key: &BlockKey,
        from: TierKind,
        delivered: &Delivered,
        copy: impl FnOnce(&mut [&mut [u8]]) -> bool,
    ) -> bool {
        let dirty = self.writers.first().is_some_and(|w| w.tier.index() < from.index());
        // A promoted block is no one's: a reader's load never spends its saver's quota.
        let mut fill = match self.g2.begin_fill(*key, BlockMeta { owner: None, ..delivered.meta }, dirty) {
            Ok(Some(f)) => f,
            Ok(None) => return true,
            Err(e) => {
                tracing::debug!(%key, "promotion into G2 skipped: {e}");
                return false;
            }
        };
        let mut pieces = fill.pieces_mut();
        let same = copy(&mut pieces) && {
            let mut sum = StreamingChecksum::new(delivered.sum_kind);
            for piece in &pieces {
                sum.update(piece);
            }
            sum.digest() == delivered.sum
        };
        drop(pieces);
        if !same {
            self.g2.abort_fill(fill);
            metrics::counter!("kvcached_promotions_skipped_total").increment(1);
            return false;
        }
        let stored = self.g2.finish_fill(fill);
        if stored {
            self.promotions.add(1);
            if dirty {
                self.write_through(key, Some(from));
            }
        }
        stored
    }
}
