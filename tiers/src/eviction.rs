//! Eviction policy: the recency order of one tier, behind a small trait.
//!
//! The policy only orders keys. What may leave (not pinned, no cached descendant, not in use)
//! is decided by [`crate::residency`], which walks [`EvictionPolicy::coldest_first`] and
//! skips what must stay.

use kvproto::BlockKey;

/// Orders a tier's blocks from coldest to hottest.
pub trait EvictionPolicy: Send + std::fmt::Debug {
    /// A block became visible in the tier.
    fn insert(&mut self, key: BlockKey);
    /// A block was used.
    fn touch(&mut self, key: &BlockKey);
    /// A block left the tier.
    fn remove(&mut self, key: &BlockKey);
    /// Keys from the next victim onwards.
    fn coldest_first(&self) -> Box<dyn Iterator<Item = BlockKey> + '_>;
}
