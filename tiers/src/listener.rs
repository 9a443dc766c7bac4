//! Notifications of what a tier gained and lost: the daemon turns them into the hit reports it
//! publishes to routers (`Stored` / `Removed` events per tier).
//!
//! Tiers call the listener while holding their state lock, so that the order of notifications
//! for one key is the order of the changes (a store is never reported after the removal that
//! followed it). A listener must therefore return quickly, never block, and never call back
//! into the store.

use std::sync::{Arc, OnceLock};

use kvproto::{BlockKey, TierKind};

use crate::block::BlockMeta;

/// Receives a tier's changes.
pub trait TierListener: Send + Sync + std::fmt::Debug {
    /// `key` (described by `meta`) is now readable from `tier`.
    fn stored(&self, tier: TierKind, key: BlockKey, meta: &BlockMeta);
    /// `keys` are no longer in `tier` (evicted, removed, or dropped as corrupt).
    fn removed(&self, tier: TierKind, keys: &[BlockKey]);
}

/// The listener of one tier, installed once after the tier is open.
#[derive(Debug, Default)]
pub(crate) struct ListenerSlot(OnceLock<Arc<dyn TierListener>>);

impl ListenerSlot {
    /// Installs `l`; false if a listener was already installed.
    pub fn set(&self, l: Arc<dyn TierListener>) -> bool {
        self.0.set(l).is_ok()
    }

    pub fn stored(&self, tier: TierKind, key: BlockKey, meta: &BlockMeta) {
        if let Some(l) = self.0.get() {
            l.stored(tier, key, meta);
        }
    }

    pub fn removed(&self, tier: TierKind, keys: &[BlockKey]) {
        if let Some(l) = self.0.get()
            && !keys.is_empty()
        {
            l.removed(tier, keys);
        }
    }
}
