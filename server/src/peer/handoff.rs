//! What a load (or a prefetch) does with peers: find where the node's own tiers end, and pull
//! the rest of the chain from the sources a router named, or join a pull already bringing it.

use std::sync::Arc;
use std::time::Instant;

use kvproto::{BlockKey, NamespaceId};
use kvtiers::BlockStore;

use super::{Peers, Pull};

/// Blocks of a load that come (or may come) from a peer.
#[derive(Debug)]
pub struct Incoming {
    pull: Arc<Pull>,
    /// Index in the load's keys of the first pulled block.
    pub offset: usize,
    /// Index of that block in the pull's own keys (a prefetch's pull may start earlier).
    first_in_pull: usize,
    deadline: Instant,
    /// The pull came up short once: the rest was asked of G4.
    pub fell_back: bool,
}

/// How many of `keys` (from the first) the node's own tiers (G2, G3) hold.
pub fn local_end(store: &BlockStore, keys: &[BlockKey]) -> usize {
    let local = (1u8 << kvproto::TierKind::G2Host.index()) | (1u8 << kvproto::TierKind::G3Disk.index());
    let held = store.held_prefix(keys);
    held.iter().position(|h| h & local == 0).unwrap_or(held.len())
}

impl Incoming {
    /// Plans the peer part of loading `keys`, of which the node's own tiers (G2, G3) hold the
    /// first `offset` ([`local_end`]): none when they hold the whole chain or no source is
    /// usable; else a pull (joined or started) of the keys from `offset` on. Blocks G4 holds
    /// are pulled too when a source is named: a peer's G2 is usually the faster copy, and G4 is
    /// where the load turns if the pull comes up short.
    pub fn plan(
        peers: &Arc<Peers>,
        namespace: NamespaceId,
        keys: &[BlockKey],
        offset: usize,
        block_len: u64,
        sources: &[String],
        deadline: Instant,
    ) -> Option<Self> {
        if offset >= keys.len() {
            return None;
        }
        if let Some((pull, at)) = peers.inflight(&keys[offset])
            && pull.namespace == namespace
            && pull.keys[at..].iter().zip(&keys[offset..]).all(|(a, b)| a == b)
        {
            return Some(Self { pull, offset, first_in_pull: at, deadline, fell_back: false });
        }
        if sources.is_empty() {
            return None;
        }
        let pull = peers.start(namespace, keys[offset..].to_vec(), block_len, sources)?;
        Some(Self { pull, offset, first_in_pull: 0, deadline, fell_back: false })
    }

    /// Waits until block `j` of the load (`j >= offset`) has arrived from the peer: false when
    /// the pull ended short of it, does not cover it, or the deadline passed.
    pub fn wait(&self, j: usize) -> bool {
        let i = self.first_in_pull + (j - self.offset);
        i < self.pull.keys.len() && self.pull.wait_for(i, self.deadline)
    }
}
