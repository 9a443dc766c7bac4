//! Room in a tier: when an insert must evict, how much, and what an eviction reports. One piece
//! for G2 (pool pages), G3 (disk pages) and G4 (bytes under a budget), so that the rules are the
//! same in each: eviction starts when an insert would take usage above the high watermark (or
//! the free space cannot take it) and frees down to the low watermark; a block larger than the
//! whole tier is refused at once; evicted blocks are counted and reported to the listener. An
//! owner's quota ([`crate::quota`]) makes its room first, among the owner's own blocks.

use std::time::Instant;

use kvproto::BlockKey;

use crate::block::BlockMeta;
use crate::error::{Result, TierError};
use crate::listener::ListenerSlot;
use crate::pages::PagePool;
use crate::residency::{Residency, Resident, SlotBytes};
use crate::stats::{TierCounters, TierUsage};
use kvproto::TierKind;

/// A tier's capacity in bytes and its watermarks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Room {
    tier: TierKind,
    capacity: u64,
    high: u64,
    low: u64,
}

impl Room {
    /// A pool of `pool`'s pages with watermarks given as fractions of it (whole pages).
    pub fn of_pool(tier: TierKind, pool: &PagePool, high_fraction: f64, low_fraction: f64) -> Self {
        let (pages, page) = (u64::from(pool.total_pages()), pool.page_size() as u64);
        let at = |f: f64| ((pages as f64 * f) as u64).min(pages) * page;
        Self { tier, capacity: pages * page, high: at(high_fraction), low: at(low_fraction) }
    }

    /// A budget of `capacity` bytes, all of it usable (no watermarks).
    pub fn budget(tier: TierKind, capacity: u64) -> Self {
        Self { tier, capacity, high: capacity, low: capacity }
    }

    /// The error for `want` bytes that do not fit in `free`.
    pub fn full(&self, want: u64, free: u64) -> TierError {
        TierError::Full { tier: self.tier, needed: want, free }
    }

    /// Bytes to evict so that `want` more fit with `used` in use and `free` left: none while
    /// usage stays within the high watermark and the bytes are free; otherwise enough to end
    /// at the low watermark with them in. `Err` when `want` exceeds the whole tier.
    pub fn bytes_to_evict(self, used: u64, free: u64, want: u64) -> Result<u64> {
        if want > self.capacity {
            return Err(self.full(want, free));
        }
        if used + want <= self.high && free >= want {
            return Ok(0);
        }
        Ok((used + want).saturating_sub(self.low))
    }
}

/// What every tier does with the blocks it evicted: counts them and tells the listener (the
/// store's index of who holds what).
pub(crate) fn evicted(tier: TierKind, counters: &TierCounters, listener: &ListenerSlot, keys: &[BlockKey]) {
    counters.evictions.add(keys.len() as u64);
    listener.removed(tier, keys);
}

/// Makes room within the quota of the block's owner ([`crate::quota`]) before a put: the
/// owner's own blocks it removes are counted and reported as evictions, and handed back for the
/// caller to release. `Err` (nothing removed) when the block cannot fit the quota.
pub(crate) fn quota_room<S: SlotBytes>(
    tier: TierKind,
    counters: &TierCounters,
    listener: &ListenerSlot,
    st: &mut Residency<S>,
    meta: &BlockMeta,
) -> Result<Vec<(BlockKey, Resident<S>)>> {
    let victims = st.quota_room(meta, Instant::now()).map_err(|why| TierError::OverQuota { tier, why })?;
    if !victims.is_empty() {
        let keys: Vec<BlockKey> = victims.iter().map(|(k, _)| *k).collect();
        evicted(tier, counters, listener, &keys);
    }
    Ok(victims)
}

/// A page pool's usage, as a tier of `blocks` blocks reports it.
pub(crate) fn pool_usage(pool: &PagePool, blocks: usize) -> TierUsage {
    let page = pool.page_size() as u64;
    TierUsage {
        used_bytes: pool.used_pages() as u64 * page,
        capacity_bytes: u64::from(pool.total_pages()) * page,
        blocks,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn eviction_starts_above_high_and_ends_at_low() {
        let pool = PagePool::new(4096, 100);
        let r = Room::of_pool(TierKind::G2Host, &pool, 0.98, 0.95);
        let page = 4096;
        // 90 pages used, 8 more: at the high watermark exactly, nothing goes.
        assert_eq!(r.bytes_to_evict(90 * page, 10 * page, 8 * page).unwrap(), 0);
        // 9 more: above it; enough goes to end at 95 pages with them in.
        assert_eq!(r.bytes_to_evict(90 * page, 10 * page, 9 * page).unwrap(), 4 * page);
        assert!(matches!(r.bytes_to_evict(0, 100 * page, 101 * page), Err(TierError::Full { .. })));
    }

    #[test]
    fn a_budget_evicts_down_to_itself() {
        let r = Room::budget(TierKind::G4Object, 1000);
        assert_eq!(r.bytes_to_evict(600, 400, 400).unwrap(), 0);
        assert_eq!(r.bytes_to_evict(600, 400, 500).unwrap(), 100);
        assert!(r.bytes_to_evict(0, 1000, 1001).is_err());
    }
}
