//! The simulated publishers of `kvbench bus`: each a node's daemon whose G2 holds `capacity`
//! blocks, reporting once a second the chains it stored and those it evicted, as the daemons of
//! the Mooncake replay do, in the same `PublisherMessage` JSON they publish.

use std::collections::VecDeque;

use kvproto::events::{
    EVENTS_VERSION, Event, EventBody, Holder, KEY_SCHEME_KVCACHED, NamespaceInfo, NodeId, PublisherInfo,
    PublisherMessage, WorkerId, WorkerInfo, key_from_u64,
};
use kvproto::{BlockKey, NamespaceId, TierKind};

/// The namespace every simulated block lives in.
pub const NAMESPACE: NamespaceId = NamespaceId(*b"kvbench-bus-ns!!");
/// Blocks in a probe chain (see [`Publisher::second`]).
pub const PROBE_BLOCKS: usize = 4;

/// What each publisher sends.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Block events (stored and removed keys) a second.
    pub events_per_s: usize,
    /// Keys in a stored chain and in a removal.
    pub chain: usize,
    /// Blocks held; removals keep the publisher there.
    pub capacity: usize,
}

/// One simulated daemon.
#[derive(Debug)]
pub struct Publisher {
    idx: usize,
    epoch: u64,
    next_id: u64,
    next_key: u64,
    held: VecDeque<Vec<BlockKey>>,
    held_blocks: usize,
    sent_info: bool,
}

/// One second of a publisher's reports.
#[derive(Debug)]
pub struct Second {
    pub message: PublisherMessage,
    /// Block keys its events name.
    pub keys: u64,
    /// The probe chain it stored, if asked for one.
    pub probe: Option<Vec<BlockKey>>,
}

/// The node name of publisher `i`.
pub fn node(i: usize) -> String {
    format!("bench-n{i}")
}

/// The worker of publisher `i` (the engine on its node).
pub fn worker(i: usize) -> String {
    format!("bench-n{i}/gpu0")
}

/// The index's holder of publisher `i`'s G2 blocks.
pub fn holder(i: usize) -> Holder {
    Holder::Node(NodeId(node(i)))
}

impl Publisher {
    pub fn new(idx: usize, epoch: u64) -> Self {
        Self { idx, epoch, next_id: 1, next_key: 0, held: VecDeque::new(), held_blocks: 0, sent_info: false }
    }

    /// Its publisher name, as a daemon's (`kvcached@<node>`).
    pub fn name(&self) -> String {
        format!("kvcached@{}", node(self.idx))
    }

    fn fresh_chain(&mut self, n: usize) -> Vec<BlockKey> {
        let base = (self.idx as u64) << 40;
        let keys = (0..n as u64).map(|j| key_from_u64(base | (self.next_key + j))).collect();
        self.next_key += n as u64;
        keys
    }

    fn event(&mut self, body: EventBody) -> Event {
        let e = Event { id: self.next_id, body };
        self.next_id += 1;
        e
    }

    fn store(&mut self, chain: Vec<BlockKey>, events: &mut Vec<Event>, keys: &mut u64) {
        *keys += chain.len() as u64;
        self.held_blocks += chain.len();
        self.held.push_back(chain.clone());
        let body = EventBody::Stored {
            namespace: NAMESPACE,
            parent: None,
            keys: chain,
            tier: TierKind::G2Host,
            holder: holder(self.idx),
        };
        events.push(self.event(body));
    }

    /// The next second's message: chains of `shape.chain` new blocks stored, the oldest chains
    /// removed past `shape.capacity`, about `shape.events_per_s` keys in all; with `probe`, one
    /// more chain of [`PROBE_BLOCKS`] new blocks that a prober looks for in the routers.
    pub fn second(&mut self, shape: Shape, probe: bool) -> Second {
        let mut events = vec![];
        let mut keys = 0u64;
        let mut budget = shape.events_per_s as i64;
        let probe_chain = probe.then(|| self.fresh_chain(PROBE_BLOCKS));
        if let Some(c) = &probe_chain {
            budget -= c.len() as i64;
            self.store(c.clone(), &mut events, &mut keys);
        }
        while budget > 0 {
            let chain = self.fresh_chain(shape.chain.max(1));
            budget -= chain.len() as i64;
            self.store(chain, &mut events, &mut keys);
            while self.held_blocks > shape.capacity {
                let Some(old) = self.held.pop_front() else { break };
                self.held_blocks -= old.len();
                budget -= old.len() as i64;
                keys += old.len() as u64;
                let body = EventBody::Removed { keys: old, tier: TierKind::G2Host, holder: holder(self.idx) };
                events.push(self.event(body));
            }
        }
        let mut message = PublisherMessage::new(self.name(), self.epoch);
        if !self.sent_info {
            message.info = Some(info(self.idx));
            self.sent_info = true;
        }
        message.last_event_id = Some(self.next_id - 1);
        message.events = events;
        Second { message, keys, probe: probe_chain }
    }
}

fn info(i: usize) -> PublisherInfo {
    PublisherInfo {
        node: NodeId(node(i)),
        workers: vec![WorkerInfo { id: WorkerId(worker(i)), address: format!("http://bench-n{i}:8000"), role: None }],
        namespaces: vec![NamespaceInfo {
            id: NAMESPACE,
            model_id: "bench".into(),
            tokens_per_block: 512,
            key_scheme: KEY_SCHEME_KVCACHED.into(),
        }],
        events_version: EVENTS_VERSION,
        report_interval_ms: 1000,
        recovery_url: None,
        peer_url: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_publisher_keeps_its_capacity_and_its_rate() {
        let shape = Shape { events_per_s: 825, chain: 18, capacity: 2000 };
        let mut p = Publisher::new(3, 1);
        let mut held = std::collections::HashSet::new();
        let mut last_id = 0;
        for s in 0..20 {
            let sec = p.second(shape, s % 2 == 0);
            assert!(sec.keys >= 825 && sec.keys < 825 + 2 * 18 + 4, "second {s}: {} keys", sec.keys);
            assert_eq!(sec.message.info.is_some(), s == 0);
            assert_eq!(sec.probe.is_some(), s % 2 == 0);
            for e in &sec.message.events {
                assert_eq!(e.id, last_id + 1);
                last_id = e.id;
                match &e.body {
                    EventBody::Stored { keys, .. } => keys.iter().for_each(|k| assert!(held.insert(*k))),
                    EventBody::Removed { keys, .. } => keys.iter().for_each(|k| assert!(held.remove(k))),
                    EventBody::Cleared { .. } => unreachable!(),
                }
            }
            assert_eq!(sec.message.last_event_id, Some(last_id));
            assert!(held.len() <= 2000, "second {s}: {} held", held.len());
        }
        assert!(held.len() > 2000 - 18 - 4);
    }
}
