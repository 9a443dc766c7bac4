//! Least-recently-used order (the `lru` crate).

use kvproto::{BlockKey, key::BlockKeyBuildHasher};
use lru::LruCache;

use crate::eviction::EvictionPolicy;

/// Plain LRU: the block used longest ago goes first.
#[derive(Debug)]
pub struct LruPolicy {
    order: LruCache<BlockKey, (), BlockKeyBuildHasher>,
}

impl LruPolicy {
    pub fn new() -> Self {
        Self { order: LruCache::unbounded_with_hasher(BlockKeyBuildHasher::default()) }
    }
}

impl Default for LruPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl EvictionPolicy for LruPolicy {
    fn insert(&mut self, key: BlockKey) {
        self.order.put(key, ());
    }
    fn touch(&mut self, key: &BlockKey) {
        self.order.promote(key);
    }
    fn remove(&mut self, key: &BlockKey) {
        self.order.pop(key);
    }
    fn coldest_first(&self) -> Box<dyn Iterator<Item = BlockKey> + '_> {
        // `iter()` runs most- to least-recent.
        Box::new(self.order.iter().rev().map(|(k, _)| *k))
    }
}
