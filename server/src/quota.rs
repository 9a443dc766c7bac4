//! Tenant quotas: how many bytes of the blocks a tenant saved may stay in G2, G3 and G4
//! (`[[tenants]] g2_quota_bytes` / `g3_quota_bytes` / `g4_quota_bytes`), so that one tenant
//! cannot evict all others (docs/operations.md, "Tenants").
//!
//! A block is charged to the tenant whose save stored it, in each tier it is in, for as long as
//! it is there:
//! - **G2 at the save.** A save that would pass the tenant's G2 quota first removes the tenant's
//!   own oldest G2 blocks; a block larger than the quota is not saved.
//! - **G3 and G4 when the write-through lands** (the tiers' listener). Past the quota, thread
//!   `kv-quota` removes the tenant's own oldest blocks of that tier. Charging at landing, not at
//!   the save, is what keeps the count true: a victim chosen while it was still queued for
//!   write-through would otherwise land afterwards, uncharged.
//! - **Uncharged** when the tier reports the block gone (its own eviction, a removal, a corrupt
//!   block dropped), so global pressure never leaves a tenant paying for blocks it lost.
//!
//! Who saved a block is known while the block is in G2 (write-through reads it from there) and,
//! for a write that was reading it as it left, for the last [`RECENT`] blocks after. Blocks no
//! save of this daemon stored (recovered from G3 at start, promoted from G4, or written to G4 by
//! other daemons) are charged to no one: a daemon's G4 quota counts what it wrote.
//!
//! Cost: a map entry per charged block and tier (about 64 bytes), for tenants with quotas only.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Weak};
use std::time::Duration;

use kvproto::{BlockKey, TierKind};
use kvtiers::{BlockMeta, BlockStore, Tier, TierListener};
use parking_lot::Mutex;

use crate::tenants::TenantConfig;

/// Blocks remembered after they left G2, for a write-through that was reading them.
pub const RECENT: usize = 4096;
/// Batches of victims waiting for `kv-quota`; past it, victims stay charged until the next
/// landing chooses them again.
const VICTIM_BATCHES: usize = 1024;

const TIERS: [TierKind; 3] = [TierKind::G2Host, TierKind::G3Disk, TierKind::G4Object];

fn book_of(tier: TierKind) -> Option<usize> {
    TIERS.iter().position(|t| *t == tier)
}

/// One tenant's blocks in one tier: oldest first (with stale entries, skipped), and bytes.
#[derive(Debug, Default)]
struct Account {
    quota: u64,
    bytes: u64,
    live: usize,
    order: VecDeque<BlockKey>,
}

/// Who is charged for what in one tier.
#[derive(Debug, Default)]
struct Book {
    charged: HashMap<BlockKey, (usize, u64)>,
    accounts: Vec<Account>,
}

impl Book {
    fn has_quota(&self, t: usize) -> bool {
        self.accounts.get(t).is_some_and(|a| a.quota > 0)
    }

    /// Charges `key` to `t`; false (and nothing changed) if it is charged already.
    fn charge(&mut self, t: usize, key: BlockKey, n: u64) -> bool {
        if !self.has_quota(t) || self.charged.contains_key(&key) {
            return false;
        }
        self.charged.insert(key, (t, n));
        let a = &mut self.accounts[t];
        a.bytes += n;
        a.live += 1;
        a.order.push_back(key);
        true
    }

    fn uncharge(&mut self, key: &BlockKey) {
        let Some((t, n)) = self.charged.remove(key) else { return };
        let a = &mut self.accounts[t];
        a.bytes -= n;
        a.live -= 1;
        // Stale entries are skipped when popped; drop them when they outnumber the live ones.
        if a.order.len() > 2 * a.live + 64 {
            let charged = &self.charged;
            let mut seen = HashSet::with_capacity(a.live);
            a.order.retain(|k| charged.get(k).is_some_and(|(o, _)| *o == t) && seen.insert(*k));
        }
    }

    /// Pops `t`'s oldest blocks (uncharged) until `need` more bytes fit; `None` (nothing
    /// popped) when `need` alone is over the quota.
    fn make_room(&mut self, t: usize, need: u64) -> Option<Vec<(BlockKey, u64)>> {
        let quota = self.accounts[t].quota;
        if need > quota {
            return None;
        }
        let mut out = Vec::new();
        while self.accounts[t].bytes + need > quota {
            let Some(k) = self.accounts[t].order.pop_front() else { break };
            if let Some(&(o, n)) = self.charged.get(&k)
                && o == t
            {
                self.uncharge(&k);
                out.push((k, n));
            }
        }
        Some(out)
    }

    /// Charges victims again (oldest first), when they could not be handed on for removal.
    fn put_back(&mut self, t: usize, victims: &[(BlockKey, u64)]) {
        for &(k, n) in victims.iter().rev() {
            if self.charged.insert(k, (t, n)).is_none() {
                let a = &mut self.accounts[t];
                a.bytes += n;
                a.live += 1;
                a.order.push_front(k);
            }
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

    /// Makes room in G2 for a block `key` of `bytes` that tenant `t` is saving (removing `t`'s
    /// own oldest G2 blocks) and charges it; `None` when the block is larger than `t`'s G2
    /// quota (it is not to be saved).
    pub fn reserve(&self, store: &BlockStore, t: usize, key: BlockKey, bytes: u64) -> Option<Reserved> {
        let (victims, reserved) = {
            let mut s = self.state.lock();
            let g2 = &mut s.books[0];
            let victims = if g2.has_quota(t) { g2.make_room(t, bytes)? } else { Vec::new() };
            let charged = g2.charge(t, key, bytes);
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
        if !book.charge(t, key, meta.len) {
            return;
        }
        let quota = book.accounts[t].quota;
        if book.accounts[t].bytes <= quota {
            return;
        }
        let Some(victims) = book.make_room(t, 0) else { return };
        if victims.is_empty() {
            return;
        }
        let keys = victims.iter().map(|(k, _)| *k).collect();
        // Never blocks: tiers call this while holding their state lock.
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) =
            self.victims.try_send(Victims { tier, tenant: t, keys })
        {
            book.put_back(t, &victims);
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

    #[test]
    fn charges_evict_the_oldest_first_and_refuse_what_cannot_fit() {
        let mut b = book(300);
        for i in 0..3 {
            assert!(b.make_room(0, 100).unwrap().is_empty());
            assert!(b.charge(0, key(i), 100));
        }
        assert!(!b.charge(0, key(2), 100), "charged once");
        assert!(!b.charge(1, key(9), 100), "tenant 1 has no quota here");
        assert_eq!(b.make_room(0, 150).unwrap(), vec![(key(0), 100), (key(1), 100)]);
        assert_eq!(b.accounts[0].bytes, 100);
        assert!(b.make_room(0, 301).is_none());
    }

    #[test]
    fn blocks_gone_are_uncharged_and_skipped_and_stale_entries_do_not_pile_up() {
        let mut b = book(1 << 40);
        for round in 0..100u32 {
            for i in 0..10u8 {
                b.charge(0, key(i), 10);
            }
            for i in 0..10u8 {
                b.uncharge(&key(i));
            }
            assert_eq!((b.accounts[0].bytes, b.accounts[0].live), (0, 0), "round {round}");
        }
        assert!(b.accounts[0].order.len() <= 64 + 10, "{}", b.accounts[0].order.len());
        b.accounts[0].quota = 20;
        for i in 0..3u8 {
            b.charge(0, key(i), 10);
        }
        b.uncharge(&key(0));
        // key 0 left by itself: the room comes from key 1, the oldest still charged.
        assert_eq!(b.make_room(0, 10).unwrap(), vec![(key(1), 10)]);
    }

    #[test]
    fn victims_put_back_are_the_first_chosen_again() {
        let mut b = book(20);
        for i in 0..3u8 {
            b.charge(0, key(i), 10);
        }
        let v = b.make_room(0, 0).unwrap();
        assert_eq!(v, vec![(key(0), 10)]);
        b.put_back(0, &v);
        assert_eq!(b.accounts[0].bytes, 30);
        assert_eq!(b.make_room(0, 0).unwrap(), vec![(key(0), 10)]);
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
