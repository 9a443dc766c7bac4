//! Approximate mode: for clusters that emit no events, the router remembers its own decisions
//! ("the blocks of this prompt are now on worker w's GPU") for a TTL and routes on them.
//!
//! Bounded: at most `max` (block, worker) facts; beyond that the oldest are forgotten first.

use std::collections::{HashMap, VecDeque};

use kvproto::{BlockKey, NamespaceId};

/// Remembered decisions.
#[derive(Debug)]
pub struct ApproxIndex {
    ttl_ms: u64,
    max: usize,
    /// (namespace, key) -> [(worker holder, expiry ms)].
    facts: HashMap<(NamespaceId, BlockKey), Vec<(u32, u64)>>,
    /// Expiry order: (expiry ms, namespace, key, worker holder).
    queue: VecDeque<(u64, NamespaceId, BlockKey, u32)>,
    len: usize,
}

impl ApproxIndex {
    /// Decisions live `ttl_ms`; at most `max` facts are kept.
    pub fn new(ttl_ms: u64, max: usize) -> Self {
        Self { ttl_ms, max: max.max(1), facts: HashMap::new(), queue: VecDeque::new(), len: 0 }
    }

    fn forget(&mut self, ns: NamespaceId, key: BlockKey, holder: u32, only_if_expired_at: Option<u64>) {
        if let Some(v) = self.facts.get_mut(&(ns, key)) {
            let before = v.len();
            v.retain(|(h, exp)| !(*h == holder && only_if_expired_at.is_none_or(|now| *exp <= now)));
            self.len -= before - v.len();
            if v.is_empty() {
                self.facts.remove(&(ns, key));
            }
        }
    }

    /// Drops every fact whose TTL ran out by `now_ms`.
    pub fn expire(&mut self, now_ms: u64) {
        while let Some(&(exp, ns, key, h)) = self.queue.front() {
            if exp > now_ms {
                break;
            }
            self.queue.pop_front();
            // A refreshed fact has a later expiry and a later queue entry: keep it.
            self.forget(ns, key, h, Some(now_ms));
        }
    }

    /// Remembers that `holder` (a worker's G1 holder) now holds `keys`.
    pub fn record(&mut self, ns: NamespaceId, keys: &[BlockKey], holder: u32, now_ms: u64) {
        let exp = now_ms + self.ttl_ms;
        for k in keys {
            let v = self.facts.entry((ns, *k)).or_default();
            match v.iter_mut().find(|(h, _)| *h == holder) {
                Some(f) => f.1 = exp,
                None => {
                    v.push((holder, exp));
                    self.len += 1;
                }
            }
            self.queue.push_back((exp, ns, *k, holder));
        }
        // Bound both the facts and the queue (a refreshed fact leaves an older queue entry).
        while self.len > self.max || self.queue.len() > self.max.saturating_mul(2) {
            let Some((_, ns, key, h)) = self.queue.pop_front() else { break };
            if self.len > self.max {
                self.forget(ns, key, h, None);
            } else {
                self.forget(ns, key, h, Some(now_ms));
            }
        }
    }

    /// Forgets everything about `holder`.
    pub fn drop_holder(&mut self, holder: u32) {
        let keys: Vec<(NamespaceId, BlockKey)> =
            self.facts.iter().filter(|(_, v)| v.iter().any(|(h, _)| *h == holder)).map(|(k, _)| *k).collect();
        for (ns, k) in keys {
            self.forget(ns, k, holder, None);
        }
    }

    /// The worker holders remembered for each key, in order, stopping at the first key with none.
    pub fn walk(&self, ns: NamespaceId, keys: &[BlockKey], mut f: impl FnMut(usize, &[(u32, u64)]) -> bool) {
        for (i, k) in keys.iter().enumerate() {
            match self.facts.get(&(ns, *k)) {
                Some(v) if !v.is_empty() => {
                    if !f(i, v) {
                        return;
                    }
                }
                _ => return,
            }
        }
    }

    /// Remembered (block, worker) facts.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u8) -> BlockKey {
        BlockKey([i; 16])
    }
    const NS: NamespaceId = NamespaceId([0; 16]);

    fn holders(a: &ApproxIndex, keys: &[BlockKey]) -> Vec<Vec<u32>> {
        let mut out = vec![];
        a.walk(NS, keys, |_, v| {
            out.push(v.iter().map(|x| x.0).collect());
            true
        });
        out
    }

    #[test]
    fn decisions_expire_after_the_ttl_unless_refreshed() {
        let mut a = ApproxIndex::new(100, 1000);
        a.record(NS, &[k(1), k(2)], 7, 0);
        a.record(NS, &[k(1)], 8, 50);
        assert_eq!(holders(&a, &[k(1), k(2)]), [vec![7, 8], vec![7]]);
        a.record(NS, &[k(1)], 7, 90); // refresh
        a.expire(100);
        assert_eq!(holders(&a, &[k(1), k(2)]), [vec![7, 8]]);
        a.expire(150);
        assert_eq!(holders(&a, &[k(1)]), [vec![7]]);
        a.expire(190);
        assert!(a.is_empty());
    }

    #[test]
    fn memory_is_bounded_oldest_first() {
        let mut a = ApproxIndex::new(1_000_000, 10);
        for i in 0..50u8 {
            a.record(NS, &[k(i)], 1, u64::from(i));
        }
        assert_eq!(a.len(), 10);
        assert_eq!(holders(&a, &[k(45)]).len(), 1);
        assert!(holders(&a, &[k(5)]).is_empty());
        a.drop_holder(1);
        assert!(a.is_empty());
    }
}
