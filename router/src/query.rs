//! Questions other adapters ask the router's state (the indexer API's `/query`), and the
//! conditions they raise.

use std::time::Instant;

use kvproto::events::{Holder, NodeId, WorkerId};
use kvproto::{BlockKey, NamespaceId, TierKind};

use crate::health::{ConditionKind, bump};
use crate::router::Router;
use crate::state::State;

/// Index of "any medium" in [`Router::prefix_by_medium`]'s arrays (after the four tiers).
pub const ANY: usize = 4;

impl Router {
    /// For each `(worker, node)`, the prefix of `keys` in blocks available from each tier alone
    /// (`[g1, g2, g3, g4]`) and from any tier (`[ANY]`). G1 counts the worker's own blocks,
    /// G2 / G3 its node's, G4 the cluster's.
    pub fn prefix_by_medium(
        &self,
        ns: NamespaceId,
        keys: &[BlockKey],
        holders: &[(WorkerId, NodeId)],
    ) -> Vec<[u64; 5]> {
        self.with_state(|st| {
            let holders: Vec<(Option<u32>, Option<u32>)> = holders
                .iter()
                .map(|(w, n)| (st.holders.get(&Holder::Worker(w.clone())), st.holders.get(&Holder::Node(n.clone()))))
                .collect();
            medium_prefixes(st, ns, keys, &holders)
        })
    }

    /// A request or query used a block size its model's publishers do not (the condition
    /// `block_size_mismatch` for `model`, counted).
    pub fn block_size_mismatch(&self, model: &str, reason: String) {
        self.with_state(|st| {
            bump(&mut st.counters.mismatches, ConditionKind::BlockSizeMismatch.label());
            st.health.set(ConditionKind::BlockSizeMismatch, model, reason, Instant::now());
        });
    }

    /// Forgets a publisher and everything it reported (`why` is logged).
    pub fn drop_publisher(&self, publisher: &str, why: &str) {
        self.with_state(|st| st.drop_publisher(publisher, why));
    }
}

fn medium_prefixes(
    st: &State,
    ns: NamespaceId,
    keys: &[BlockKey],
    holders: &[(Option<u32>, Option<u32>)],
) -> Vec<[u64; 5]> {
    let mut out = vec![[0u64; 5]; holders.len()];
    let mut alive = vec![[true; 5]; holders.len()];
    st.index.walk(ns, keys, |_, len, slots| {
        let mut any_alive = false;
        for ((wh, nh), (count, live)) in holders.iter().zip(out.iter_mut().zip(alive.iter_mut())) {
            let mut has = [false; 5];
            for s in slots.iter() {
                let h = Some(s.holder());
                let tier = s.tier();
                let mine = match tier {
                    TierKind::G1Gpu => h == *wh,
                    TierKind::G2Host | TierKind::G3Disk => h == *nh,
                    TierKind::G4Object => true,
                };
                if mine {
                    has[tier.index()] = true;
                    has[ANY] = true;
                }
            }
            for m in 0..5 {
                live[m] &= has[m];
                if live[m] {
                    count[m] += len as u64;
                }
            }
            any_alive |= live.iter().any(|l| *l);
        }
        any_alive
    });
    out
}
