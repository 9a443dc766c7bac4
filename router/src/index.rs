//! The block index: for every indexed block key, which holders hold it in which tier.
//!
//! State per block is one hash-map slot: the 16-byte key and a [`Slots`] value of 16 bytes that
//! keeps up to three `(holder, tier)` pairs inline (packed in a `u32` each) and spills to the heap
//! only for blocks held by more than three holders. Keys are chained (a key names its whole
//! prefix), so no parent/child structure is needed: a request's keys are looked up in order and
//! the walk stops at the first key nobody holds.
//!
//! Holders are interned to 30-bit indices ([`HolderTable`]); a dropped holder's index is reused
//! only after every slot naming it has been removed.

use std::collections::HashMap;

use kvproto::events::Holder;
use kvproto::{BlockKey, BlockKeyBuildHasher, NamespaceId, TierKind};

/// Largest holder index (30 bits; the top 2 bits of a [`Slot`] carry the tier).
pub const MAX_HOLDERS: u32 = (1 << 30) - 1;

/// A `(holder, tier)` pair packed in 32 bits: tier in the top 2 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot(u32);

impl Slot {
    /// Packs a holder index (< 2^30) and a tier.
    pub fn new(holder: u32, tier: TierKind) -> Self {
        Self(((tier.index() as u32) << 30) | (holder & MAX_HOLDERS))
    }
    /// The holder index.
    pub fn holder(self) -> u32 {
        self.0 & MAX_HOLDERS
    }
    /// The tier.
    pub fn tier(self) -> TierKind {
        TierKind::ALL[(self.0 >> 30) as usize]
    }
}

const EMPTY: u32 = u32::MAX;

/// The holders of one block: up to three inline, more on the heap.
#[derive(Debug, Clone)]
pub enum Slots {
    Inline([u32; 3]),
    Heap(Box<Vec<u32>>),
}

impl Default for Slots {
    fn default() -> Self {
        Slots::Inline([EMPTY; 3])
    }
}

impl Slots {
    /// Adds a slot; false when it was already there.
    fn insert(&mut self, s: Slot) -> bool {
        match self {
            Slots::Inline(a) => {
                if a.contains(&s.0) {
                    return false;
                }
                if let Some(free) = a.iter_mut().find(|x| **x == EMPTY) {
                    *free = s.0;
                } else {
                    let mut v = a.to_vec();
                    v.push(s.0);
                    *self = Slots::Heap(Box::new(v));
                }
                true
            }
            Slots::Heap(v) => {
                if v.contains(&s.0) {
                    return false;
                }
                v.push(s.0);
                true
            }
        }
    }

    /// Removes every slot matching `pred`; returns how many were removed.
    fn remove_where(&mut self, mut pred: impl FnMut(Slot) -> bool) -> usize {
        match self {
            Slots::Inline(a) => {
                let mut n = 0;
                for x in a.iter_mut() {
                    if *x != EMPTY && pred(Slot(*x)) {
                        *x = EMPTY;
                        n += 1;
                    }
                }
                n
            }
            Slots::Heap(v) => {
                let before = v.len();
                v.retain(|x| !pred(Slot(*x)));
                let n = before - v.len();
                if v.len() <= 3 {
                    let mut a = [EMPTY; 3];
                    a[..v.len()].copy_from_slice(v);
                    *self = Slots::Inline(a);
                }
                n
            }
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Slots::Inline(a) => a.iter().all(|x| *x == EMPTY),
            Slots::Heap(v) => v.is_empty(),
        }
    }

    /// Iterates the slots.
    pub fn iter(&self) -> impl Iterator<Item = Slot> + '_ {
        let s: &[u32] = match self {
            Slots::Inline(a) => a,
            Slots::Heap(v) => v,
        };
        s.iter().filter(|x| **x != EMPTY).map(|x| Slot(*x))
    }

    fn heap_bytes(&self) -> usize {
        match self {
            Slots::Inline(_) => 0,
            Slots::Heap(v) => std::mem::size_of::<Vec<u32>>() + v.capacity() * 4,
        }
    }
}

type KeyMap = HashMap<BlockKey, Slots, BlockKeyBuildHasher>;

/// The index of every namespace.
#[derive(Debug, Default)]
pub struct BlockIndex {
    spaces: HashMap<NamespaceId, KeyMap>,
    /// Number of `(block, holder, tier)` facts per holder index.
    per_holder: Vec<u64>,
    facts: u64,
}

impl BlockIndex {
    pub fn new() -> Self {
        Self::default()
    }

    fn count(&mut self, holder: u32, delta: i64) {
        let h = holder as usize;
        if self.per_holder.len() <= h {
            self.per_holder.resize(h + 1, 0);
        }
        self.per_holder[h] = self.per_holder[h].saturating_add_signed(delta);
        self.facts = self.facts.saturating_add_signed(delta);
    }

    /// Records that `slot` holds every key of `keys` in `ns`.
    pub fn store(&mut self, ns: NamespaceId, keys: &[BlockKey], slot: Slot) {
        let map = self.spaces.entry(ns).or_default();
        let mut added = 0i64;
        map.reserve(keys.len());
        for k in keys {
            if map.entry(*k).or_default().insert(slot) {
                added += 1;
            }
        }
        self.count(slot.holder(), added);
    }

    /// Records that `slot` no longer holds `keys` in `ns` (unknown keys are ignored).
    pub fn remove(&mut self, ns: Option<NamespaceId>, keys: &[BlockKey], slot: Slot) {
        let mut removed = 0i64;
        let spaces: Vec<NamespaceId> = match ns {
            Some(ns) => vec![ns],
            None => self.spaces.keys().copied().collect(),
        };
        for ns in spaces {
            let Some(map) = self.spaces.get_mut(&ns) else { continue };
            for k in keys {
                if let Some(e) = map.get_mut(k) {
                    removed += e.remove_where(|s| s == slot) as i64;
                    if e.is_empty() {
                        map.remove(k);
                    }
                }
            }
        }
        self.count(slot.holder(), -removed);
    }

    /// Removes every fact matching `pred` (a full scan; used for `Cleared`, a publisher restart
    /// and dead holders). Returns how many facts were removed.
    pub fn remove_where(&mut self, mut pred: impl FnMut(Slot) -> bool) -> u64 {
        let mut removed_per: HashMap<u32, i64> = HashMap::new();
        for map in self.spaces.values_mut() {
            map.retain(|_, e| {
                e.remove_where(|s| {
                    let hit = pred(s);
                    if hit {
                        *removed_per.entry(s.holder()).or_default() += 1;
                    }
                    hit
                });
                !e.is_empty()
            });
        }
        let mut total = 0;
        for (h, n) in removed_per {
            self.count(h, -n);
            total += n as u64;
        }
        total
    }

    /// Facts (block x holder x tier) the holder has in the index.
    pub fn holder_facts(&self, holder: u32) -> u64 {
        self.per_holder.get(holder as usize).copied().unwrap_or(0)
    }

    /// The holders of each key of `keys`, in order, stopping before the first key nobody holds.
    /// `f(position, slots)` returns false to stop early.
    pub fn walk(&self, ns: NamespaceId, keys: &[BlockKey], mut f: impl FnMut(usize, &Slots) -> bool) {
        let Some(map) = self.spaces.get(&ns) else { return };
        // Probe a chunk of keys before looking at any result: the probes do not depend on each
        // other, so their cache misses overlap (a lookup is memory-latency bound).
        const CHUNK: usize = 16;
        let mut found: [Option<&Slots>; CHUNK] = [None; CHUNK];
        for (c, chunk) in keys.chunks(CHUNK).enumerate() {
            for (slot, k) in found.iter_mut().zip(chunk) {
                *slot = map.get(k);
            }
            for (j, e) in found.iter().take(chunk.len()).enumerate() {
                match e {
                    Some(e) => {
                        if !f(c * CHUNK + j, e) {
                            return;
                        }
                    }
                    None => return,
                }
            }
        }
    }

    /// Number of distinct indexed blocks (over all namespaces).
    pub fn blocks(&self) -> usize {
        self.spaces.values().map(|m| m.len()).sum()
    }

    /// Number of `(block, holder, tier)` facts.
    pub fn facts(&self) -> u64 {
        self.facts
    }

    /// Estimated heap bytes of the index: hash-table buckets (key, value, one control byte) at
    /// their allocated capacity plus spilled holder lists. Measured against a counting allocator
    /// in `benches/index.rs`.
    pub fn approx_bytes(&self) -> usize {
        let bucket = std::mem::size_of::<(BlockKey, Slots)>() + 1;
        self.spaces
            .values()
            .map(|m| {
                // hashbrown keeps a power-of-two bucket count >= capacity * 8 / 7.
                let buckets = if m.capacity() == 0 { 0 } else { (m.capacity() * 8 / 7).next_power_of_two() };
                buckets * bucket + m.values().map(Slots::heap_bytes).sum::<usize>()
            })
            .sum()
    }
}

/// Interns holders to dense indices. Index 0 is always [`Holder::Cluster`].
#[derive(Debug)]
pub struct HolderTable {
    by_holder: HashMap<Holder, u32>,
    names: Vec<Option<Holder>>,
    free: Vec<u32>,
}

impl Default for HolderTable {
    fn default() -> Self {
        let mut t = Self { by_holder: HashMap::new(), names: Vec::new(), free: Vec::new() };
        t.intern(&Holder::Cluster);
        t
    }
}

impl HolderTable {
    /// The index of `h`, assigning one if needed (`None` when 2^30 holders exist).
    pub fn intern(&mut self, h: &Holder) -> Option<u32> {
        if let Some(i) = self.by_holder.get(h) {
            return Some(*i);
        }
        let i = match self.free.pop() {
            Some(i) => {
                self.names[i as usize] = Some(h.clone());
                i
            }
            None => {
                let i = u32::try_from(self.names.len()).ok().filter(|i| *i <= MAX_HOLDERS)?;
                self.names.push(Some(h.clone()));
                i
            }
        };
        self.by_holder.insert(h.clone(), i);
        Some(i)
    }

    /// The index of `h` if known.
    pub fn get(&self, h: &Holder) -> Option<u32> {
        self.by_holder.get(h).copied()
    }

    /// The holder at index `i`.
    pub fn name(&self, i: u32) -> Option<&Holder> {
        self.names.get(i as usize).and_then(Option::as_ref)
    }

    /// Forgets `h` (call only after its facts were removed from the index).
    pub fn release(&mut self, h: &Holder) {
        if matches!(h, Holder::Cluster) {
            return;
        }
        if let Some(i) = self.by_holder.remove(h) {
            self.names[i as usize] = None;
            self.free.push(i);
        }
    }

    /// Live holders.
    pub fn len(&self) -> usize {
        self.by_holder.len()
    }

    /// Never true (the cluster holder always exists).
    pub fn is_empty(&self) -> bool {
        self.by_holder.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u8) -> BlockKey {
        BlockKey([i; 16])
    }

    #[test]
    fn slots_spill_and_shrink() {
        let mut s = Slots::default();
        for h in 0..5 {
            assert!(s.insert(Slot::new(h, TierKind::G2Host)));
        }
        assert!(!s.insert(Slot::new(3, TierKind::G2Host)));
        assert!(matches!(s, Slots::Heap(_)));
        assert_eq!(s.remove_where(|x| x.holder() >= 2), 3);
        assert!(matches!(s, Slots::Inline(_)));
        assert_eq!(s.iter().count(), 2);
        assert_eq!(std::mem::size_of::<Slots>(), 16);
    }

    #[test]
    fn slot_packs_holder_and_tier() {
        for t in TierKind::ALL {
            let s = Slot::new(MAX_HOLDERS, t);
            assert_eq!((s.holder(), s.tier()), (MAX_HOLDERS, t));
        }
    }

    #[test]
    fn store_remove_walk_and_counts() {
        let ns = NamespaceId([1; 16]);
        let mut ix = BlockIndex::new();
        let a = Slot::new(1, TierKind::G1Gpu);
        let b = Slot::new(2, TierKind::G2Host);
        ix.store(ns, &[k(1), k(2), k(3)], a);
        ix.store(ns, &[k(1), k(2)], b);
        ix.store(ns, &[k(1)], a); // duplicate: no new fact
        assert_eq!((ix.blocks(), ix.facts(), ix.holder_facts(1), ix.holder_facts(2)), (3, 5, 3, 2));
        let mut seen = vec![];
        ix.walk(ns, &[k(1), k(2), k(9), k(3)], |i, s| {
            seen.push((i, s.iter().count()));
            true
        });
        assert_eq!(seen, [(0, 2), (1, 2)]);
        ix.remove(Some(ns), &[k(2), k(7)], a);
        assert_eq!((ix.facts(), ix.holder_facts(1)), (4, 2));
        assert_eq!(ix.remove_where(|s| s.holder() == 2), 2);
        assert_eq!((ix.blocks(), ix.facts()), (2, 2));
        ix.remove(None, &[k(1), k(3)], a);
        assert_eq!((ix.blocks(), ix.facts()), (0, 0));
    }

    #[test]
    fn holder_indices_are_reused_after_release() {
        let mut t = HolderTable::default();
        assert_eq!(t.get(&Holder::Cluster), Some(0));
        let w = Holder::Worker(kvproto::events::WorkerId("w".into()));
        let i = t.intern(&w).unwrap_or(0);
        assert_eq!(i, 1);
        t.release(&w);
        assert_eq!(t.get(&w), None);
        let n = Holder::Node(kvproto::events::NodeId("n".into()));
        assert_eq!(t.intern(&n), Some(1));
        assert_eq!(t.len(), 2);
    }
}
