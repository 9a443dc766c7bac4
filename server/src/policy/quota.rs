//! Tenant quotas: how many bytes of the blocks a tenant saved may stay in G2, G3 and G4
//! (`[[tenants]] g2_quota_bytes` / `g3_quota_bytes` / `g4_quota_bytes`), so that one tenant
//! cannot evict all others (docs/operations/security-clients.md, "Tenants").
//!
//! A block is charged to the tenant whose save stored it, in each tier it is in, for as long as
//! it is there:
//! - **G2 at the save.** A save that would pass the tenant's G2 quota first removes blocks of
//!   the tenant's own; a block larger than the quota, or one whose room only its own prefix
//!   could make, is not saved.
//! - **G3 and G4 when the write-through lands** (the tiers' listener). Past the quota, thread
//!   `kv-quota` removes blocks of the tenant's own in that tier. Charging at landing, not at
//!   the save, is what keeps the count true: a victim chosen while it was still queued for
//!   write-through would otherwise land afterwards, uncharged.
//! - **Uncharged** when the tier reports the block gone (its own eviction, a removal, a corrupt
//!   block dropped), so global pressure never leaves a tenant paying for blocks it lost.
//!
//! Victims are the ends of the tenant's chains (blocks no block of its own in that tier
//! continues), oldest first: an old prompt goes from its last block back, and a kept block
//! keeps its prefix, so what a tenant keeps stays reachable by a lookup. A prompt longer than
//! the quota keeps its first blocks.
//!
//! Who saved a block is known while the block is in G2 (write-through reads it from there) and,
//! for a write that was reading it as it left, for the last [`RECENT`] blocks after. Blocks no
//! save of this daemon stored (recovered from G3 at start, promoted from G4, or written to G4 by
//! other daemons) are charged to no one: a daemon's G4 quota counts what it wrote.
//!
//! Cost: per charged block and tier, a map entry, a chain-end entry and a child count (about
//! 100 bytes), for tenants with quotas only.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Weak};
use std::time::Duration;

use kvproto::{BlockKey, TierKind};
use kvtiers::{BlockMeta, BlockStore, Tier, TierListener};
use parking_lot::Mutex;

use crate::policy::tenants::TenantConfig;

/// Blocks remembered after they left G2, for a write-through that was reading them.
pub const RECENT: usize = 4096;
/// Batches of victims waiting for `kv-quota`; past it, victims stay charged until the next
/// landing chooses them again.
const VICTIM_BATCHES: usize = 1024;

const TIERS: [TierKind; 3] = [TierKind::G2Host, TierKind::G3Disk, TierKind::G4Object];

fn book_of(tier: TierKind) -> Option<usize> {
    TIERS.iter().position(|t| *t == tier)
}

/// A block charged in one tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Charge {
    tenant: usize,
    bytes: u64,
    parent: Option<BlockKey>,
    /// Order of charging (the victims' order among chain ends).
    seq: u64,
}

/// One tenant's quota in one tier: its bytes, and the ends of its chains there (blocks no block
/// of its own in the tier continues), oldest first: the order victims are taken in. Taking ends
/// only keeps every block's prefix before the block: a kept block stays reachable by a lookup.
#[derive(Debug, Default)]
struct Account {
    quota: u64,
    bytes: u64,
    ends: BTreeMap<u64, BlockKey>,
}

/// Why a block cannot be charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Full {
    /// The block alone is larger than the quota.
    TooLarge,
    /// Only the block's own prefix is left to remove: storing it would cut its chain.
    OwnPrefix,
}

/// Who is charged for what in one tier.
#[derive(Debug, Default)]
struct Book {
    charged: HashMap<BlockKey, Charge>,
    /// Charged blocks of each tenant that continue a key (charged or not: in G4 a child may
    /// land before its parent).
    children: HashMap<(BlockKey, usize), u32>,
    accounts: Vec<Account>,
    next_seq: u64,
}

impl Book {
    fn has_quota(&self, t: usize) -> bool {
        self.accounts.get(t).is_some_and(|a| a.quota > 0)
    }

    /// Charges `key` (continuing `parent`) to `t`; false (and nothing changed) if it is charged
    /// already or `t` has no quota here.
    fn charge(&mut self, t: usize, key: BlockKey, bytes: u64, parent: Option<BlockKey>) -> bool {
        self.next_seq += 1;
        let seq = self.next_seq;
        self.insert(key, Charge { tenant: t, bytes, parent, seq })
    }

    fn insert(&mut self, key: BlockKey, c: Charge) -> bool {
        if !self.has_quota(c.tenant) || self.charged.contains_key(&key) {
            return false;
        }
        self.charged.insert(key, c);
        let t = c.tenant;
        self.accounts[t].bytes += c.bytes;
        if !self.children.contains_key(&(key, t)) {
            self.accounts[t].ends.insert(c.seq, key);
        }
        if let Some(p) = c.parent {
            let n = self.children.entry((p, t)).or_insert(0);
            *n += 1;
            if *n == 1
                && let Some(pc) = self.charged.get(&p)
                && pc.tenant == t
            {
                self.accounts[t].ends.remove(&pc.seq);
            }
        }
        true
    }

    fn uncharge(&mut self, key: &BlockKey) -> Option<Charge> {
        let c = self.charged.remove(key)?;
        let t = c.tenant;
        let a = &mut self.accounts[t];
        a.bytes -= c.bytes;
        a.ends.remove(&c.seq);
        if let Some(p) = c.parent
            && let Entry::Occupied(mut e) = self.children.entry((p, t))
        {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
                if let Some(pc) = self.charged.get(&p)
                    && pc.tenant == t
                {
                    self.accounts[t].ends.insert(pc.seq, p);
                }
            }
        }
        Some(c)
    }

    /// Takes `t`'s chain ends, oldest first (uncharged), until `need` more bytes fit. Refused
    /// (nothing taken) when `need` alone is over the quota, or when the next end to take is
    /// `keep`, the parent of the block that needs the room.
    fn make_room(&mut self, t: usize, need: u64, keep: Option<BlockKey>) -> Result<Vec<(BlockKey, Charge)>, Full> {
        let quota = self.accounts[t].quota;
        if need > quota {
            return Err(Full::TooLarge);
        }
        let mut out = Vec::new();
        while self.accounts[t].bytes + need > quota {
            let Some((_, &k)) = self.accounts[t].ends.first_key_value() else { break };
            if Some(k) == keep {
                self.put_back(&out);
                return Err(Full::OwnPrefix);
            }
            if let Some(c) = self.uncharge(&k) {
                out.push((k, c));
            }
        }
        Ok(out)
    }

    /// Charges a block of `t` that landed here (G3, G4) and returns the victims past the quota.
    /// A block whose parent is not here (gone, or still to land) cannot be reached: it goes
    /// first. Otherwise chain ends go, oldest first; the block itself is the newest end.
    fn landed(&mut self, t: usize, key: BlockKey, bytes: u64, parent: Option<BlockKey>) -> Vec<(BlockKey, Charge)> {
        if !self.charge(t, key, bytes, parent) || self.accounts[t].bytes <= self.accounts[t].quota {
            return Vec::new();
        }
        let orphan = parent.is_some_and(|p| self.charged.get(&p).is_none_or(|c| c.tenant != t));
        if orphan {
            return self.uncharge(&key).map(|c| vec![(key, c)]).unwrap_or_default();
        }
        self.make_room(t, 0, None).unwrap_or_default()
    }

    /// Charges victims again, as they were, when they could not be removed after all.
    fn put_back(&mut self, victims: &[(BlockKey, Charge)]) {
        for &(k, c) in victims.iter().rev() {
            self.insert(k, c);
        }
    }
}

#[derive(Debug, Default)]
struct State {
    books: [Book; 3],
    /// Blocks in G2 that a tenant with a G3 or G4 quota saved.
    saved_by: HashMap<BlockKey, usize>,
    /// The last blocks of `saved_by` that left G2, and their order (oldest first).
    recent: HashMap<BlockKey, usize>,
    recent_order: VecDeque<BlockKey>,
}

impl State {
    fn saver(&self, key: &BlockKey) -> Option<usize> {
        self.saved_by.get(key).or_else(|| self.recent.get(key)).copied()
    }

    fn left_g2(&mut self, key: BlockKey) {
        let Some(t) = self.saved_by.remove(&key) else { return };
        if self.recent_order.len() >= RECENT
            && let Some(old) = self.recent_order.pop_front()
        {
            self.recent.remove(&old);
        }
        self.recent.insert(key, t);
        self.recent_order.push_back(key);
    }
}

/// Victims of one tenant in one tier, for `kv-quota` to remove.
#[derive(Debug)]
struct Victims {
    tier: TierKind,
    tenant: usize,
    keys: Vec<BlockKey>,
}

/// Why a save did not store a block ([`Ledger::reserve`]).
pub const OVER_G2_QUOTA: &str =
    "over the tenant's G2 quota (the block is larger than it, or only the prompt's own prefix is left to remove)";

/// What a save reserved for one block ([`Ledger::reserve`]); handed back to
/// [`Ledger::not_stored`] when the block was not stored after all.
#[derive(Debug, Clone, Copy, Default)]
pub struct Reserved {
    charged: bool,
    remembered: bool,
}

/// The quotas of a daemon's tenants, and what each is charged ([`TierListener`] of the store).
#[derive(Debug)]
pub struct Ledger {
    names: Vec<String>,
    /// Whether the tenant has a G3 or G4 quota (its saves are remembered).
    lower: Vec<bool>,
    state: Mutex<State>,
    victims: SyncSender<Victims>,
}

impl Ledger {
    /// The ledger of `tenants` over `store`'s tiers, and its thread `kv-quota`; `None` when no
    /// tenant has a quota. Install it as (one of) the store's listeners.
    pub fn start(tenants: &[TenantConfig], store: &Arc<BlockStore>) -> std::io::Result<Option<Arc<Self>>> {
        let quotas: Vec<[u64; 3]> =
            tenants.iter().map(|c| [c.g2_quota_bytes, c.g3_quota_bytes, c.g4_quota_bytes]).collect();
        if quotas.iter().flatten().all(|q| *q == 0) {
            return Ok(None);
        }
        let mut state = State::default();
        for (i, book) in state.books.iter_mut().enumerate() {
            book.accounts = quotas.iter().map(|q| Account { quota: q[i], ..Default::default() }).collect();
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(VICTIM_BATCHES);
        let ledger = Arc::new(Self {
            names: tenants.iter().map(|c| c.name.clone()).collect(),
            lower: quotas.iter().map(|q| q[1] > 0 || q[2] > 0).collect(),
            state: Mutex::new(state),
            victims: tx,
        });
        let tiers: Vec<(TierKind, Weak<dyn Tier>)> =
            store.lower().iter().map(|t| (t.kind(), Arc::downgrade(t))).collect();
        let me = Arc::downgrade(&ledger);
        std::thread::Builder::new().name("kv-quota".into()).spawn(move || remove_victims(&rx, &tiers, &me))?;
        Ok(Some(ledger))
    }

    /// Makes room in G2 for a block `key` of `bytes` continuing `parent`, that tenant `t` is
    /// saving (removing the ends of `t`'s own oldest chains) and charges it; `None` when it
    /// cannot fit without cutting its own prefix, or is larger than the quota: it is not to be
    /// saved ([`OVER_G2_QUOTA`]).
    pub fn reserve(
        &self,
        store: &BlockStore,
        t: usize,
        key: BlockKey,
        parent: Option<BlockKey>,
        bytes: u64,
    ) -> Option<Reserved> {
        let (victims, reserved) = {
            let mut s = self.state.lock();
            let g2 = &mut s.books[0];
            let victims = if g2.has_quota(t) { g2.make_room(t, bytes, parent).ok()? } else { Vec::new() };
            let charged = g2.charge(t, key, bytes, parent);
            let remembered = self.lower.get(t).copied().unwrap_or(false) && !s.saved_by.contains_key(&key);
            if remembered {
                s.saved_by.insert(key, t);
            }
            (victims, Reserved { charged, remembered })
        };
        // Outside the lock: G2 tells its listener (this ledger) while removing.
        for (k, _) in &victims {
            if store.g2().remove(k).unwrap_or(false) {
                self.evicted(t, TierKind::G2Host, 1);
            }
        }
        Some(reserved)
    }

    /// Undoes [`Ledger::reserve`] for a block that was not stored (present already, or failed).
    pub fn not_stored(&self, key: &BlockKey, r: Reserved) {
        let mut s = self.state.lock();
        if r.charged {
            s.books[0].uncharge(key);
        }
        if r.remembered {
            s.saved_by.remove(key);
        }
    }

    /// Bytes charged to tenant `t` in G2, G3 and G4.
    pub fn charged(&self, t: usize) -> [u64; 3] {
        let s = self.state.lock();
        [0, 1, 2].map(|i| s.books[i].accounts.get(t).map_or(0, |a| a.bytes))
    }

    fn evicted(&self, t: usize, tier: TierKind, n: u64) {
        let tenant = self.names.get(t).cloned().unwrap_or_default();
        metrics::counter!("kvcached_tenant_quota_evictions_total", "tenant" => tenant, "tier" => tier.label())
            .increment(n);
    }

    /// Sets `kvcached_tenant_charged_bytes` for every tenant and tier with a quota.
    fn export(&self) {
        let s = self.state.lock();
        for (tier, book) in TIERS.iter().zip(&s.books) {
            for (name, a) in self.names.iter().zip(&book.accounts) {
                if a.quota > 0 {
                    metrics::gauge!("kvcached_tenant_charged_bytes", "tenant" => name.clone(), "tier" => tier.label())
                        .set(a.bytes as f64);
                }
            }
        }
    }
}

impl TierListener for Ledger {
    fn stored(&self, tier: TierKind, key: BlockKey, meta: &BlockMeta) {
        // G2 is charged at the save; a block promoted into G2 is no one's.
        let Some(b) = book_of(tier).filter(|b| *b > 0) else { return };
        let mut s = self.state.lock();
        let Some(t) = s.saver(&key) else { return };
        let book = &mut s.books[b];
        let victims = book.landed(t, key, meta.len, meta.parent);
        if victims.is_empty() {
            return;
        }
        let keys = victims.iter().map(|(k, _)| *k).collect();
        // Never blocks: tiers call this while holding their state lock.
        if self.victims.try_send(Victims { tier, tenant: t, keys }).is_err() {
            book.put_back(&victims);
        }
    }

    fn removed(&self, tier: TierKind, keys: &[BlockKey]) {
        let Some(b) = book_of(tier) else { return };
        let mut s = self.state.lock();
        for k in keys {
            s.books[b].uncharge(k);
        }
        if b == 0 {
            for k in keys {
                s.left_g2(*k);
            }
        }
    }
}

/// Thread `kv-quota`: removes the victims the listener chose (it cannot: tiers call it with
/// their lock held), and exports the charges every second. Ends with the ledger.
fn remove_victims(rx: &Receiver<Victims>, tiers: &[(TierKind, Weak<dyn Tier>)], ledger: &Weak<Ledger>) {
    loop {
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(v) => {
                let Some(tier) = tiers.iter().find(|(k, _)| *k == v.tier).and_then(|(_, t)| t.upgrade()) else {
                    continue;
                };
                let mut n = 0;
                for k in &v.keys {
                    match tier.remove(k) {
                        Ok(true) => n += 1,
                        Ok(false) => {}
                        Err(e) => {
                            tracing::warn!(tier = %v.tier, "removing a block past its tenant's quota failed: {e}")
                        }
                    }
                }
                drop(tier);
                if let Some(l) = ledger.upgrade() {
                    l.evicted(v.tenant, v.tier, n);
                }
            }
            Err(RecvTimeoutError::Timeout) => match ledger.upgrade() {
                Some(l) => l.export(),
                None => return,
            },
            Err(RecvTimeoutError::Disconnected) => return,
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

    fn book(quota: u64) -> Book {
        Book { accounts: vec![Account { quota, ..Default::default() }, Account::default()], ..Default::default() }
    }

    /// Charges a chain `first..first+n` (each block continuing the previous), 10 bytes each.
    fn chain(b: &mut Book, first: u8, n: u8) {
        for i in first..first + n {
            let parent = (i > first).then(|| key(i - 1));
            assert!(b.charge(0, key(i), 10, parent));
        }
    }

    fn victims(v: Result<Vec<(BlockKey, Charge)>, Full>) -> Vec<BlockKey> {
        v.unwrap().into_iter().map(|(k, _)| k).collect()
    }

    #[test]
    fn old_chains_go_from_their_end_and_kept_blocks_keep_their_prefix() {
        let mut b = book(60);
        chain(&mut b, 0, 3); // old prompt 0-1-2
        chain(&mut b, 10, 3); // newer prompt 10-11-12
        assert!(!b.charge(0, key(12), 10, None), "charged once");
        assert!(!b.charge(1, key(9), 10, None), "tenant 1 has no quota here");
        // Room for 20 more: the old prompt's last two blocks, its first stays.
        assert_eq!(victims(b.make_room(0, 20, None)), vec![key(2), key(1)]);
        assert_eq!(b.accounts[0].bytes, 40);
        // Then the old prompt's first, then the newer one's end.
        assert_eq!(victims(b.make_room(0, 40, None)), vec![key(0), key(12)]);
        assert_eq!(b.make_room(0, 61, None).unwrap_err(), Full::TooLarge);
    }

    #[test]
    fn a_prompt_longer_than_the_quota_keeps_its_first_blocks() {
        let mut b = book(30);
        chain(&mut b, 0, 3);
        // Block 3 would need block 2, its own parent, to go: refused, nothing taken.
        assert_eq!(b.make_room(0, 10, Some(key(2))).unwrap_err(), Full::OwnPrefix);
        assert_eq!((b.accounts[0].bytes, b.charged.len()), (30, 3));
        // Landed past the quota (G3/G4), the newest end is the block itself.
        assert!(b.charge(0, key(3), 10, Some(key(2))));
        assert_eq!(victims(b.make_room(0, 0, None)), vec![key(3)]);
    }

    #[test]
    fn blocks_landing_in_order_past_the_quota_leave_the_prompts_first_blocks() {
        let mut b = book(40);
        let mut gone = Vec::new();
        for i in 0..10u8 {
            let parent = (i > 0).then(|| key(i - 1));
            gone.extend(b.landed(0, key(i), 10, parent).into_iter().map(|(k, _)| k));
        }
        assert_eq!(gone, (4..10).map(key).collect::<Vec<_>>(), "each block past the quota goes itself");
        let mut kept: Vec<BlockKey> = b.charged.keys().copied().collect();
        kept.sort_by_key(|k| k.0);
        assert_eq!(kept, (0..4).map(key).collect::<Vec<_>>());
    }

    #[test]
    fn a_child_landing_before_its_parent_keeps_the_parent_off_the_ends() {
        let mut b = book(100);
        assert!(b.charge(0, key(5), 10, Some(key(4))));
        assert!(b.charge(0, key(4), 10, Some(key(3))));
        assert_eq!(b.accounts[0].ends.values().copied().collect::<Vec<_>>(), vec![key(5)]);
        // Gone by itself (a tier's own eviction): its parent is an end again.
        b.uncharge(&key(5));
        assert_eq!(b.accounts[0].ends.values().copied().collect::<Vec<_>>(), vec![key(4)]);
        b.uncharge(&key(4));
        assert!(b.children.is_empty() && b.accounts[0].ends.is_empty() && b.accounts[0].bytes == 0);
    }

    #[test]
    fn victims_put_back_are_the_first_chosen_again() {
        let mut b = book(20);
        chain(&mut b, 0, 1);
        chain(&mut b, 10, 2);
        let v = b.make_room(0, 0, None).unwrap();
        assert_eq!(v.iter().map(|(k, _)| *k).collect::<Vec<_>>(), vec![key(0)]);
        b.put_back(&v);
        assert_eq!(b.accounts[0].bytes, 30);
        assert_eq!(victims(b.make_room(0, 0, None)), vec![key(0)]);
    }

    #[test]
    fn the_saver_is_known_in_g2_and_for_a_while_after() {
        let mut s = State::default();
        s.saved_by.insert(key(1), 3);
        assert_eq!(s.saver(&key(1)), Some(3));
        s.left_g2(key(1));
        assert_eq!((s.saver(&key(1)), s.saver(&key(5))), (Some(3), None));
        for i in 0..RECENT {
            let k = BlockKey((i as u128 + 1000).to_le_bytes());
            s.saved_by.insert(k, 1);
            s.left_g2(k);
        }
        assert_eq!(s.saver(&key(1)), None, "forgotten after RECENT others");
        assert_eq!((s.recent.len(), s.recent_order.len()), (RECENT, RECENT));
    }
}
