//! Which blocks a tier holds, in which state, and which of them may be evicted.
//!
//! Shared by every tier implementation: a block is first *reserved* (invisible), its bytes are
//! written with no lock held, then it is *committed* and becomes visible. Eviction walks the
//! [`EvictionPolicy`] from coldest and skips a block that is pinned by an unexpired lease, has
//! a cached child in this tier (a child without its parent is useless, so descendants go
//! first), is being read, or (in the first pass) has not yet been written to the tiers below.
//! A block passed for its children goes as soon as its last child is picked: strict LRU among
//! the blocks that may leave.
//!
//! The owners' quotas ([`crate::quota`]) are kept here too: a block is charged when reserved
//! and uncharged when removed, under the same lock as every other change of the tier.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use kvproto::{BlockKey, key::BlockKeyBuildHasher};

use crate::block::{BlockMeta, LeaseId};
use crate::eviction::EvictionPolicy;
use crate::quota::{OverQuota, Quotas};

/// Size of a slot, in the tier's allocation unit (bytes of pages held).
pub(crate) trait SlotBytes {
    fn slot_bytes(&self) -> u64;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Writing,
    Ready,
}

#[derive(Debug)]
pub(crate) struct Resident<S> {
    pub slot: Arc<S>,
    pub meta: BlockMeta,
    state: State,
    children: u32,
    leases: Vec<(LeaseId, Instant)>,
    /// Not yet written to the tiers below (G2 only).
    pub dirty: bool,
}

impl<S> Resident<S> {
    fn pinned(&self, now: Instant) -> bool {
        self.leases.iter().any(|&(_, deadline)| deadline > now)
    }

    /// Whether the block may leave now: visible, not pinned, and not being read (no one else
    /// holds its slot).
    fn may_leave(&self, now: Instant) -> bool {
        self.state == State::Ready && !self.pinned(now) && Arc::strong_count(&self.slot) == 1
    }
}

/// The residency map of one tier.
#[derive(Debug)]
pub(crate) struct Residency<S> {
    entries: HashMap<BlockKey, Resident<S>, BlockKeyBuildHasher>,
    policy: Box<dyn EvictionPolicy>,
    leases: HashMap<LeaseId, Vec<BlockKey>>,
    ready: usize,
    dirty: usize,
    quotas: Quotas,
}

impl<S: SlotBytes> Residency<S> {
    pub fn new(policy: Box<dyn EvictionPolicy>) -> Self {
        Self {
            entries: HashMap::default(),
            policy,
            leases: HashMap::new(),
            ready: 0,
            dirty: 0,
            quotas: Quotas::default(),
        }
    }

    /// Sets the owners' quotas (at open, before any block is reserved).
    pub fn set_quotas(&mut self, quotas: Quotas) {
        self.quotas = quotas;
    }

    /// Makes room within the quota of `meta.owner` (if it has one here) for a block of
    /// `meta.len` bytes continuing `meta.parent`: removes ends of the owner's own chains that
    /// may go now (as [`Residency::evict`] would take them, write-through or not) and returns
    /// them, for the caller to release and report like evictions. `Err` (nothing removed) when
    /// the block cannot fit; see [`crate::quota`].
    pub fn quota_room(&mut self, meta: &BlockMeta, now: Instant) -> Result<Vec<(BlockKey, Resident<S>)>, OverQuota> {
        let entries = &self.entries;
        let may_go = |k: &BlockKey| entries.get(k).is_some_and(|e| e.may_leave(now));
        let reachable = meta.parent.is_none_or(|p| entries.contains_key(&p));
        let keys = self.quotas.victims(meta.owner, meta.len, meta.parent, reachable, may_go).inspect_err(|_| {
            self.quotas.refused(meta.owner);
        })?;
        self.quotas.evicted(meta.owner, keys.len());
        Ok(keys.into_iter().filter_map(|k| self.remove(&k).map(|e| (k, e))).collect())
    }

    /// Visible blocks.
    pub fn len(&self) -> usize {
        self.ready
    }

    /// Whether `key` has an entry in any state (visible or being written).
    pub fn has_entry(&self, key: &BlockKey) -> bool {
        self.entries.contains_key(key)
    }

    /// Whether `key` is visible.
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.entries.get(key).is_some_and(|e| e.state == State::Ready)
    }

    /// Reserves `key` for writing. False if the key already has an entry (first writer wins).
    pub fn reserve(&mut self, key: BlockKey, meta: BlockMeta, slot: Arc<S>, dirty: bool) -> bool {
        if self.entries.contains_key(&key) {
            return false;
        }
        self.dirty += usize::from(dirty);
        self.quotas.charge(meta.owner, key, meta.len, meta.parent);
        self.entries
            .insert(key, Resident { slot, meta, state: State::Writing, children: 0, leases: Vec::new(), dirty });
        true
    }

    /// Whether `slot`'s reservation of `key` is still in place (not removed, not committed).
    pub fn is_writing(&self, key: &BlockKey, slot: &Arc<S>) -> bool {
        self.entries.get(key).is_some_and(|e| e.state == State::Writing && Arc::ptr_eq(&e.slot, slot))
    }

    /// Makes a reserved block visible. False if the reservation is gone (removed meanwhile).
    pub fn commit(&mut self, key: &BlockKey, slot: &Arc<S>) -> bool {
        let parent = match self.entries.get_mut(key) {
            Some(e) if e.state == State::Writing && Arc::ptr_eq(&e.slot, slot) => {
                e.state = State::Ready;
                e.meta.parent
            }
            _ => return false,
        };
        self.ready += 1;
        if let Some(p) = parent.and_then(|p| self.entries.get_mut(&p)) {
            p.children += 1;
        }
        self.policy.insert(*key);
        true
    }

    /// Inserts a block that is already complete (recovery at start).
    pub fn insert_ready(&mut self, key: BlockKey, meta: BlockMeta, slot: Arc<S>) {
        if self.reserve(key, meta, Arc::clone(&slot), false) {
            self.commit(&key, &slot);
        }
    }

    /// Recomputes child counts after a bulk [`Residency::insert_ready`] in arbitrary order.
    pub fn recount_children(&mut self) {
        let parents: Vec<BlockKey> = self.entries.values().filter_map(|e| e.meta.parent).collect();
        for e in self.entries.values_mut() {
            e.children = 0;
        }
        for p in parents {
            if let Some(e) = self.entries.get_mut(&p) {
                e.children += 1;
            }
        }
    }

    /// A visible block's slot and metadata; `touch` marks it used.
    pub fn get(&mut self, key: &BlockKey, touch: bool) -> Option<(Arc<S>, BlockMeta)> {
        let e = self.entries.get(key)?;
        if e.state != State::Ready {
            return None;
        }
        let out = (Arc::clone(&e.slot), e.meta);
        if touch {
            self.policy.touch(key);
        }
        Some(out)
    }

    /// Marks a visible block used (one recency-order update; no entry lookup). A key that is
    /// not visible is ignored: the policy only orders visible blocks.
    pub fn touch(&mut self, key: &BlockKey) {
        self.policy.touch(key);
    }

    /// Marks a block as written to the tiers below.
    pub fn mark_clean(&mut self, key: &BlockKey) {
        if let Some(e) = self.entries.get_mut(key)
            && e.dirty
        {
            e.dirty = false;
            self.dirty -= 1;
        }
    }

    /// Removes a block in any state; returns it so the caller can release its space.
    pub fn remove(&mut self, key: &BlockKey) -> Option<Resident<S>> {
        let e = self.entries.remove(key)?;
        self.dirty -= usize::from(e.dirty);
        self.quotas.uncharge(key);
        if e.state == State::Ready {
            self.ready -= 1;
            self.policy.remove(key);
            if let Some(p) = e.meta.parent.and_then(|p| self.entries.get_mut(&p)) {
                p.children = p.children.saturating_sub(1);
            }
        }
        Some(e)
    }

    /// Removes a reservation only if it is still `slot`'s.
    pub fn abort(&mut self, key: &BlockKey, slot: &Arc<S>) {
        if self.entries.get(key).is_some_and(|e| e.state == State::Writing && Arc::ptr_eq(&e.slot, slot)) {
            self.remove(key);
        }
    }

    /// Blocks still waiting for write-through.
    pub fn dirty(&self) -> usize {
        self.dirty
    }

    /// Chooses and removes victims until at least `need_bytes` of slots are freed, or nothing
    /// more may go. Blocks waiting for write-through go only when `allow_dirty`, after every
    /// clean candidate. Returns the removed blocks and whether they freed enough.
    pub fn evict(&mut self, need_bytes: u64, now: Instant, allow_dirty: bool) -> (Vec<(BlockKey, Resident<S>)>, bool) {
        self.reap_expired(now);
        let mut freed = 0u64;
        let mut out = Vec::new();
        // Pass 0 keeps dirty blocks; pass 1 (if allowed) accepts them (counted by the caller
        // as dropped write-through). Each pass repeats while it makes progress: removing a
        // leaf can turn its parent into a leaf.
        let passes: &[bool] = if allow_dirty { &[false, true] } else { &[false] };
        for &allow_dirty in passes {
            loop {
                let mut picked = Vec::new();
                let mut picked_bytes = 0u64;
                let free_now = |e: &Resident<S>| e.may_leave(now) && (allow_dirty || !e.dirty);
                // Least recently used first, a block only after its cached children. The scan
                // passes a block whose children are still cached; once the last of them is
                // picked, that block is colder than anything the scan has not reached yet, so
                // it goes next (then its own parent, and so on up the chain). A block the scan
                // has not reached yet is picked when reached, if its children went by then.
                let mut gone_children: HashMap<BlockKey, u32, BlockKeyBuildHasher> = HashMap::default();
                let mut passed: HashSet<BlockKey, BlockKeyBuildHasher> = HashSet::default();
                for key in self.policy.coldest_first() {
                    if freed + picked_bytes >= need_bytes {
                        break;
                    }
                    let Some(e) = self.entries.get(&key) else { continue };
                    if !free_now(e) {
                        continue;
                    }
                    if e.children > gone_children.get(&key).copied().unwrap_or(0) {
                        passed.insert(key);
                        continue;
                    }
                    let mut next = Some(key);
                    while let Some(k) = next.take() {
                        let Some(e) = self.entries.get(&k) else { break };
                        picked_bytes += e.slot.slot_bytes();
                        picked.push(k);
                        if freed + picked_bytes >= need_bytes {
                            break;
                        }
                        let Some(p) = e.meta.parent else { break };
                        let gone = gone_children.entry(p).or_insert(0);
                        *gone += 1;
                        let gone = *gone;
                        if passed.contains(&p) && self.entries.get(&p).is_some_and(|pe| pe.children == gone) {
                            passed.remove(&p);
                            next = Some(p);
                        }
                    }
                }
                if picked.is_empty() {
                    break;
                }
                for key in picked {
                    if let Some(e) = self.remove(&key) {
                        freed += e.slot.slot_bytes();
                        out.push((key, e));
                    }
                }
                if freed >= need_bytes {
                    return (out, true);
                }
            }
        }
        let enough = freed >= need_bytes;
        (out, enough)
    }

    /// Pins the visible blocks among `keys` until `deadline` under `lease`; returns how many.
    pub fn pin(&mut self, lease: LeaseId, keys: &[BlockKey], deadline: Instant) -> usize {
        let mut pinned = Vec::new();
        for k in keys {
            if let Some(e) = self.entries.get_mut(k)
                && e.state == State::Ready
            {
                e.leases.push((lease, deadline));
                pinned.push(*k);
            }
        }
        let n = pinned.len();
        if n > 0 {
            self.leases.entry(lease).or_default().extend(pinned);
        }
        n
    }

    /// Drops every pin of `lease`.
    pub fn release(&mut self, lease: LeaseId) {
        if let Some(keys) = self.leases.remove(&lease) {
            for k in keys {
                if let Some(e) = self.entries.get_mut(&k) {
                    e.leases.retain(|&(l, _)| l != lease);
                }
            }
        }
    }

    /// Forgets expired leases (a crashed reader cannot hold a block forever).
    pub fn reap_expired(&mut self, now: Instant) {
        let expired: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(l, keys)| {
                keys.iter()
                    .all(|k| self.entries.get(k).is_none_or(|e| e.leases.iter().all(|&(id, d)| id != **l || d <= now)))
            })
            .map(|(l, _)| *l)
            .collect();
        for l in expired {
            self.release(l);
        }
    }

    /// All visible keys with their metadata.
    pub fn ready_keys(&self) -> Vec<(BlockKey, BlockMeta)> {
        self.entries.iter().filter(|(_, e)| e.state == State::Ready).map(|(k, e)| (*k, e.meta)).collect()
    }
}
