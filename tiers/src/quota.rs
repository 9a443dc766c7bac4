//! Quotas: how many bytes of one tier the blocks of one owner may take (an owner is a number the
//! caller gives in [`BlockMeta::owner`]; kvcached gives each `[[tenants]]` entry with a quota
//! its place in that list). A policy the tier applies itself, beside its own eviction and under
//! the same lock, so that there is one authority over what leaves a tier and no charge can
//! race the change it counts.
//!
//! - **Charged when the tier reserves the block**, to the owner its metadata names, if that
//!   owner has a quota in this tier; **uncharged when the block leaves** (any reason).
//! - **A put past the owner's quota** first takes the ends of the owner's own chains in this
//!   tier (blocks no block of its own continues), oldest first, that may go now (visible, not
//!   pinned, not being read: what the tier's eviction would take). Taking ends only keeps a
//!   kept block's prefix before it, so what an owner keeps stays reachable by a lookup.
//! - **Refused** ([`OverQuota`]) when the block alone is larger than the quota, when the next
//!   end to take is the block's own parent (a prompt longer than the quota keeps its first
//!   blocks), or when not enough of the owner's blocks may go now. Nothing is taken then.
//!
//! Blocks with no owner, or whose owner has no quota here, are charged to no one (in kvcached:
//! blocks promoted from a lower tier, pulled from a peer, or found in G3/G4 at start).
//!
//! Cost: per charged block a map entry, a chain-end entry and a child count (about 100 bytes),
//! for owners with a quota only.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, HashSet};

use kvproto::{BlockKey, TierKind};

/// One owner's quota in one tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quota {
    /// The owner's name, as metrics label it (`tenant`).
    pub name: String,
    /// Bytes of this tier its blocks may take; 0: no quota.
    pub bytes: u64,
}

/// Why a block was not stored ([`crate::TierError::OverQuota`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverQuota {
    /// The block alone is larger than the quota.
    TooLarge,
    /// Only the block's own prefix is left to remove: storing it would cut its chain.
    OwnPrefix,
    /// The owner's blocks that would have to go are in use now (being written, read or loaded).
    Busy,
    /// The block's parent is not in this tier (gone, or not landed yet): the block could not be
    /// reached, and taking the owner's blocks for it would cut a chain that can.
    Unreachable,
}

impl std::fmt::Display for OverQuota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::TooLarge => "the block is larger than the quota",
            Self::OwnPrefix => "only the prompt's own prefix is left to remove",
            Self::Busy => "the blocks that would make room are in use",
            Self::Unreachable => "its parent is not in this tier",
        })
    }
}

/// A block charged to an owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Charge {
    owner: usize,
    bytes: u64,
    parent: Option<BlockKey>,
    /// Order of charging (the victims' order among chain ends).
    seq: u64,
}

/// One owner's account: its quota, its bytes, and the ends of its chains (oldest first).
#[derive(Debug)]
struct Account {
    quota: u64,
    bytes: u64,
    ends: BTreeMap<u64, BlockKey>,
    charged_bytes: metrics::Gauge,
    evictions: metrics::Counter,
    refused: metrics::Counter,
}

/// The quotas of one tier and what each owner is charged.
#[derive(Debug, Default)]
pub(crate) struct Quotas {
    charged: HashMap<BlockKey, Charge, kvproto::key::BlockKeyBuildHasher>,
    /// Charged blocks of each owner that continue a key (charged or not: in G4 a child may land
    /// before its parent).
    children: HashMap<(BlockKey, usize), u32>,
    accounts: Vec<Account>,
    next_seq: u64,
}

impl Quotas {
    /// The quotas of tier `tier`, owner `i` having `quotas[i]`.
    pub fn new(tier: TierKind, quotas: &[Quota]) -> Self {
        let accounts = quotas
            .iter()
            .map(|q| {
                let labels = [("tenant", q.name.clone()), ("tier", tier.label().to_string())];
                let charged_bytes = metrics::gauge!("kvcached_tenant_charged_bytes", &labels);
                if q.bytes > 0 {
                    charged_bytes.set(0.0);
                }
                Account {
                    quota: q.bytes,
                    bytes: 0,
                    ends: BTreeMap::new(),
                    charged_bytes,
                    evictions: metrics::counter!("kvcached_tenant_quota_evictions_total", &labels),
                    refused: metrics::counter!("kvcached_tenant_quota_refused_total", &labels),
                }
            })
            .collect();
        Self { accounts, ..Self::default() }
    }

    /// The owner of `owner` number if it has a quota here.
    fn account_of(&self, owner: Option<u32>) -> Option<usize> {
        let o = owner? as usize;
        self.accounts.get(o).filter(|a| a.quota > 0).map(|_| o)
    }

    /// Bytes charged to `owner`.
    #[cfg(test)]
    pub fn charged(&self, owner: u32) -> u64 {
        self.accounts.get(owner as usize).map_or(0, |a| a.bytes)
    }

    /// Charges `key` (continuing `parent`) to `owner`; false (nothing changed) if it is charged
    /// already or `owner` has no quota here.
    pub fn charge(&mut self, owner: Option<u32>, key: BlockKey, bytes: u64, parent: Option<BlockKey>) -> bool {
        let Some(o) = self.account_of(owner) else { return false };
        self.next_seq += 1;
        let seq = self.next_seq;
        self.insert(key, Charge { owner: o, bytes, parent, seq })
    }

    fn insert(&mut self, key: BlockKey, c: Charge) -> bool {
        if self.charged.contains_key(&key) {
            return false;
        }
        self.charged.insert(key, c);
        let o = c.owner;
        self.accounts[o].bytes += c.bytes;
        if !self.children.contains_key(&(key, o)) {
            self.accounts[o].ends.insert(c.seq, key);
        }
        if let Some(p) = c.parent {
            let n = self.children.entry((p, o)).or_insert(0);
            *n += 1;
            if *n == 1
                && let Some(pc) = self.charged.get(&p)
                && pc.owner == o
            {
                self.accounts[o].ends.remove(&pc.seq);
            }
        }
        self.export(o);
        true
    }

    /// Uncharges `key` (it left the tier); nothing if it was not charged.
    pub fn uncharge(&mut self, key: &BlockKey) {
        let Some(c) = self.charged.remove(key) else { return };
        let o = c.owner;
        let a = &mut self.accounts[o];
        a.bytes -= c.bytes;
        a.ends.remove(&c.seq);
        if let Some(p) = c.parent
            && let Entry::Occupied(mut e) = self.children.entry((p, o))
        {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
                if let Some(pc) = self.charged.get(&p)
                    && pc.owner == o
                {
                    self.accounts[o].ends.insert(pc.seq, p);
                }
            }
        }
        self.export(o);
    }

    fn export(&self, o: usize) {
        let a = &self.accounts[o];
        a.charged_bytes.set(a.bytes as f64);
    }

    /// The blocks of `owner` to remove so that `bytes` more fit its quota: ends of its chains,
    /// oldest first, skipping those `may_go` refuses; never `keep` (the parent of the block
    /// that needs the room). Nothing is uncharged here: the tier removes the victims, which
    /// uncharges them. Empty when the owner has no quota here or the block fits. A block whose
    /// parent is not in the tier (`reachable` false) takes nothing: refused.
    pub fn victims(
        &self,
        owner: Option<u32>,
        bytes: u64,
        keep: Option<BlockKey>,
        reachable: bool,
        may_go: impl Fn(&BlockKey) -> bool,
    ) -> Result<Vec<BlockKey>, OverQuota> {
        let Some(o) = self.account_of(owner) else { return Ok(Vec::new()) };
        let a = &self.accounts[o];
        if bytes > a.quota {
            return Err(OverQuota::TooLarge);
        }
        if a.bytes + bytes <= a.quota {
            return Ok(Vec::new());
        }
        if !reachable {
            return Err(OverQuota::Unreachable);
        }
        // Walk the ends as they would be after each removal: a removed end's parent becomes an
        // end once its last charged child of this owner is gone (it is older, so it is next).
        let mut out = Vec::new();
        let mut taken: HashSet<BlockKey, kvproto::key::BlockKeyBuildHasher> = HashSet::default();
        let mut gone_children: HashMap<BlockKey, u32, kvproto::key::BlockKeyBuildHasher> = HashMap::default();
        let mut extra: BTreeMap<u64, BlockKey> = BTreeMap::new();
        let mut skipped: HashSet<BlockKey, kvproto::key::BlockKeyBuildHasher> = HashSet::default();
        let mut freed = 0u64;
        while a.bytes - freed + bytes > a.quota {
            // Both maps are in charging order: the first open entry of each, the older of them.
            let open = |(seq, k): (&u64, &BlockKey)| (!taken.contains(k) && !skipped.contains(k)).then_some((*seq, *k));
            let next = match (a.ends.iter().find_map(open), extra.iter().find_map(open)) {
                (Some(x), Some(y)) => Some(if x.0 < y.0 { x } else { y }),
                (x, y) => x.or(y),
            };
            let Some((seq, k)) = next else {
                return Err(if skipped.is_empty() { OverQuota::OwnPrefix } else { OverQuota::Busy });
            };
            if Some(k) == keep {
                return Err(OverQuota::OwnPrefix);
            }
            if !may_go(&k) {
                skipped.insert(k);
                continue;
            }
            extra.remove(&seq);
            taken.insert(k);
            out.push(k);
            let Some(c) = self.charged.get(&k) else { continue };
            freed += c.bytes;
            if let Some(p) = c.parent
                && let Some(pc) = self.charged.get(&p).filter(|pc| pc.owner == o)
            {
                let n = gone_children.entry(p).or_insert(0);
                *n += 1;
                if self.children.get(&(p, o)).copied() == Some(*n) {
                    extra.insert(pc.seq, p);
                }
            }
        }
        Ok(out)
    }

    /// Counts `n` blocks of `owner` removed to keep it within its quota.
    pub fn evicted(&self, owner: Option<u32>, n: usize) {
        if let Some(o) = self.account_of(owner) {
            self.accounts[o].evictions.increment(n as u64);
        }
    }

    /// Counts a block of `owner` refused for its quota.
    pub fn refused(&self, owner: Option<u32>) {
        if let Some(o) = self.account_of(owner) {
            self.accounts[o].refused.increment(1);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn key(i: u8) -> BlockKey {
        BlockKey([i; 16])
    }

    fn quotas(bytes: u64) -> Quotas {
        let q = |bytes| Quota { name: "t".into(), bytes };
        Quotas::new(TierKind::G2Host, &[q(bytes), q(0)])
    }

    /// Charges a chain `first..first+n` (each block continuing the previous), 10 bytes each.
    fn chain(q: &mut Quotas, first: u8, n: u8) {
        for i in first..first + n {
            let parent = (i > first).then(|| key(i - 1));
            assert!(q.charge(Some(0), key(i), 10, parent));
        }
    }

    /// Takes the victims for `bytes` more, as the tier would (removing uncharges them).
    fn take(q: &mut Quotas, bytes: u64, keep: Option<BlockKey>) -> Result<Vec<BlockKey>, OverQuota> {
        let v = q.victims(Some(0), bytes, keep, true, |_| true)?;
        for k in &v {
            q.uncharge(k);
        }
        Ok(v)
    }

    #[test]
    fn old_chains_go_from_their_end_and_kept_blocks_keep_their_prefix() {
        let mut q = quotas(60);
        chain(&mut q, 0, 3); // old prompt 0-1-2
        chain(&mut q, 10, 3); // newer prompt 10-11-12
        assert!(!q.charge(Some(0), key(12), 10, None), "charged once");
        assert!(!q.charge(Some(1), key(9), 10, None), "owner 1 has no quota here");
        assert!(!q.charge(None, key(9), 10, None), "no owner");
        assert!(!q.charge(Some(7), key(9), 10, None), "an owner not configured");
        // Room for 20 more: the old prompt's last two blocks, its first stays.
        assert_eq!(take(&mut q, 20, None).unwrap(), vec![key(2), key(1)]);
        assert_eq!(q.charged(0), 40);
        // Then the old prompt's first, then the newer one's end.
        assert_eq!(take(&mut q, 40, None).unwrap(), vec![key(0), key(12)]);
        assert_eq!(take(&mut q, 61, None).unwrap_err(), OverQuota::TooLarge);
        assert_eq!(take(&mut q, 0, None).unwrap(), Vec::<BlockKey>::new(), "within the quota: nothing");
    }

    #[test]
    fn a_prompt_longer_than_the_quota_keeps_its_first_blocks() {
        let mut q = quotas(30);
        chain(&mut q, 0, 3);
        // Block 3 would need block 2, its own parent, to go: refused, nothing taken.
        assert_eq!(take(&mut q, 10, Some(key(2))).unwrap_err(), OverQuota::OwnPrefix);
        assert_eq!((q.charged(0), q.charged.len()), (30, 3));
    }

    #[test]
    fn blocks_in_use_are_passed_and_refuse_when_nothing_else_may_go() {
        let mut q = quotas(30);
        chain(&mut q, 0, 1);
        chain(&mut q, 10, 2);
        // Block 0 (the oldest end) is being read: block 11 goes instead.
        assert_eq!(q.victims(Some(0), 10, None, true, |k| *k != key(0)).unwrap(), vec![key(11)]);
        // Nothing may go: refused as busy, nothing taken.
        assert_eq!(q.victims(Some(0), 10, None, true, |_| false).unwrap_err(), OverQuota::Busy);
        // A block whose parent is not here takes nothing.
        assert_eq!(q.victims(Some(0), 10, Some(key(99)), false, |_| true).unwrap_err(), OverQuota::Unreachable);
        assert_eq!(q.charged(0), 30);
    }

    #[test]
    fn a_chain_is_taken_back_to_front_in_one_call() {
        let mut q = quotas(50);
        chain(&mut q, 0, 5);
        // 30 bytes more: blocks 4, 3, 2 (each parent becomes the oldest end once its child goes).
        assert_eq!(take(&mut q, 30, None).unwrap(), vec![key(4), key(3), key(2)]);
        assert_eq!(q.charged(0), 20);
    }

    #[test]
    fn a_child_charged_before_its_parent_keeps_the_parent_off_the_ends() {
        let mut q = quotas(100);
        assert!(q.charge(Some(0), key(5), 10, Some(key(4))));
        assert!(q.charge(Some(0), key(4), 10, Some(key(3))));
        assert_eq!(q.accounts[0].ends.values().copied().collect::<Vec<_>>(), vec![key(5)]);
        // Gone by itself (the tier's own eviction): its parent is an end again.
        q.uncharge(&key(5));
        assert_eq!(q.accounts[0].ends.values().copied().collect::<Vec<_>>(), vec![key(4)]);
        q.uncharge(&key(4));
        assert!(q.children.is_empty() && q.accounts[0].ends.is_empty() && q.charged(0) == 0);
    }
}
