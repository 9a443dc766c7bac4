//! G3 reads: one I/O batch for the blocks of a call, each verified as its pieces arrive, into
//! memory the caller names (its buffers, G2's reserved pages, or an engine's slots).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kvproto::BlockKey;

use super::index::IndexEntry;
use super::verify::{ReportMatches, VerifiedReads};
use super::{DiskSlot, DiskTier, TIER, TOUCH_BATCH};
use crate::block::BlockMeta;
use crate::error::{Result, TierError};
use crate::tier::Delivered;

impl DiskTier {
    /// Reads the blocks of `keys` in one I/O batch (one hand-off to the I/O threads, all reads
    /// in flight at once) into the memory `dest` names for each block found (by its index in
    /// `keys`; None: not read, a miss), then verifies each on its own: a block that fails is
    /// dropped and is a miss, the others are served.
    ///
    /// # Safety
    /// Each destination `dest` returns must meet [`VerifiedReads::add`]'s layout (aligned
    /// starts, whole pages but the last, room for the padded tail), cover the block's length,
    /// and be written by nothing else until this returns.
    /// `verified(i)` is called, before this returns, as soon as key `i`'s block has arrived
    /// whole and matched its checksum; its result is then `Ok(Some(_))`. With `trusted` false
    /// (destinations another process can write, see [`Tier::read_into_foreign`]) a block that
    /// fails is neither dropped nor counted, and the tier's health is not told: it is `Ok(None)`.
    pub(super) unsafe fn read_into(
        &self,
        keys: &[BlockKey],
        mut dest: impl FnMut(usize, &BlockMeta) -> Option<Vec<(*mut u8, usize)>>,
        mut verified: impl FnMut(usize),
        trusted: bool,
    ) -> Vec<Result<Option<Delivered>>> {
        let t0 = Instant::now();
        let mut found: Vec<Option<(Arc<DiskSlot>, BlockMeta)>> = {
            let mut st = self.state.lock();
            keys.iter().map(|k| st.get(k, true)).collect()
        };
        let ps = self.pool.page_size();
        let mut reads = VerifiedReads::default();
        let mut read_of = Vec::with_capacity(keys.len());
        // Per block read: the key's index and the checksum its bytes must have.
        let mut block_key = Vec::with_capacity(keys.len());
        let mut expected = Vec::with_capacity(keys.len());
        for (i, hit) in found.iter_mut().enumerate() {
            let Some(to) = hit.as_ref().and_then(|(_, meta)| dest(i, meta)) else {
                *hit = None;
                read_of.push(usize::MAX);
                continue;
            };
            let Some((slot, meta)) = hit else { continue };
            let runs = slot.pages.runs().into_iter().map(|(first, n)| (first as u64 * ps as u64, n as usize * ps));
            read_of.push(reads.add(&to, meta.len as usize, runs, slot.sum_kind));
            block_key.push(i);
            expected.push(slot.checksum.load(Ordering::Relaxed));
        }
        let ops = reads.take_ops();
        let mut progress =
            ReportMatches { reads: &mut reads, expected: &expected, on_match: |b: usize| verified(block_key[b]) };
        // SAFETY: every op writes into a destination the caller vouched for (see above).
        let io = unsafe { self.io.run(self.fd(), ops, &mut progress) };
        let mut results = Vec::with_capacity(keys.len());
        for ((key, hit), read) in keys.iter().zip(found).zip(read_of) {
            let Some((slot, meta)) = hit else {
                // Not read into foreign memory is not a miss: the caller reads it the other way.
                if trusted {
                    self.counters.misses.add(1);
                }
                results.push(Ok(None));
                continue;
            };
            // As reported while the batch ran (the slot's checksum as the read began).
            let expected = expected[read];
            let got = reads.checksum_of(read);
            if !trusted && got != Some(expected) {
                // The destination's owner may have written or truncated it under the read: the
                // caller reads the block the trusted way, which finds out whether it is bad.
                results.push(Ok(None));
                continue;
            }
            if got.is_none() && !reads.failed(read) {
                // The batch failed before this block's reads ran (no engine, threads stopped):
                // an error of this call, not of the block, which stays.
                let why = match &io {
                    Err(e) => e.to_string(),
                    Ok(()) => "its reads did not run".to_string(),
                };
                self.health.read_failed(true, &why);
                results.push(Err(TierError::io(TIER, "read", std::io::Error::other(why))));
                continue;
            }
            if got != Some(expected) {
                let why = match (&io, got) {
                    (Err(e), None) => format!("read failed: {e}"),
                    _ => "checksum mismatch".to_string(),
                };
                self.health.read_failed(got.is_none(), &why);
                self.corrupt(key, &slot, &why);
                self.counters.misses.add(1);
                results.push(Ok(None));
                continue;
            }
            let tick = self.tick();
            slot.tick.store(tick, Ordering::Relaxed);
            let entry = IndexEntry { meta, checksum: expected, sum_kind: slot.sum_kind, tick, runs: slot.pages.runs() };
            let batch = {
                let mut t = self.touched.lock();
                t.push((*key, Arc::downgrade(&slot), entry));
                (t.len() >= TOUCH_BATCH).then(|| std::mem::take(&mut *t))
            };
            if let Some(batch) = batch {
                self.write_touches(batch);
            }
            self.counters.hits.add(1);
            self.counters.bytes_read.add(meta.len);
            results.push(Ok(Some(Delivered { meta, sum_kind: slot.sum_kind, sum: expected })));
        }
        self.counters.get_took(t0.elapsed());
        self.health.took("read", t0.elapsed());
        results
    }
}
