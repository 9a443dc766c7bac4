//! [`MemoryPublisher`]: a publisher of hit reports in memory. It numbers events, keeps a bounded
//! log of them and the state they describe, and answers the two recovery calls a router makes
//! after a gap (docs/router.md, "Gaps and recovery"):
//! - `replay(after, limit)`: the events after id `after` from its bounded log, or `TooOld` when
//!   the log no longer reaches back;
//! - `snapshot()`: everything it holds now, as of its newest event id.
//!
//! A daemon embeds one as the source of what it ships and serves; routers' tests and
//! simulations use it as an in-process publisher. No I/O.

use std::collections::HashMap;

use parking_lot::Mutex;

use crate::events::{
    Event, EventBody, EventLog, Holder, PublisherInfo, PublisherMessage, Replay, Snapshot, SnapshotEntry,
};
use crate::{BlockKey, NamespaceId, TierKind};

#[derive(Debug)]
struct Inner {
    log: EventLog,
    /// (tier, holder) -> key -> namespace.
    held: HashMap<(TierKind, Holder), HashMap<BlockKey, NamespaceId>>,
}

/// An in-process publisher: numbers events, keeps a bounded log and the state it published, and
/// answers replay / snapshot. A daemon can embed it as its event publisher.
#[derive(Debug)]
pub struct MemoryPublisher {
    name: String,
    inner: Mutex<Inner>,
}

impl MemoryPublisher {
    /// A publisher called `name` in incarnation `epoch`, logging its last `log_capacity` events.
    pub fn new(name: impl Into<String>, epoch: u64, log_capacity: usize) -> Self {
        Self {
            name: name.into(),
            inner: Mutex::new(Inner { log: EventLog::new(epoch, log_capacity), held: HashMap::new() }),
        }
    }

    /// The publisher's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its epoch.
    pub fn epoch(&self) -> u64 {
        self.inner.lock().log.epoch()
    }

    /// Id of the newest event (0 before the first).
    pub fn last_id(&self) -> u64 {
        self.inner.lock().log.last_id()
    }

    /// Records and logs one event; returns it with its id.
    pub fn publish(&self, body: EventBody) -> Event {
        let mut g = self.inner.lock();
        match &body {
            EventBody::Stored { namespace, keys, tier, holder, .. } => {
                let m = g.held.entry((*tier, holder.clone())).or_default();
                for k in keys {
                    m.insert(*k, *namespace);
                }
            }
            EventBody::Removed { keys, tier, holder } => {
                if let Some(m) = g.held.get_mut(&(*tier, holder.clone())) {
                    for k in keys {
                        m.remove(k);
                    }
                }
            }
            EventBody::Cleared { tier, holder } => {
                g.held.remove(&(*tier, holder.clone()));
            }
        }
        g.log.push(body)
    }

    /// A message carrying `events` (and `info` when given).
    pub fn message(&self, info: Option<PublisherInfo>, events: Vec<Event>) -> PublisherMessage {
        let mut m = PublisherMessage::new(self.name.clone(), self.epoch());
        m.info = info;
        m.last_event_id = Some(self.inner.lock().log.last_id());
        m.events = events;
        m
    }

    /// Log replay after `after`.
    pub fn replay_now(&self, after: u64, limit: usize) -> Replay {
        self.inner.lock().log.replay(after, limit)
    }

    /// Full state as of the newest event.
    pub fn snapshot_now(&self) -> Snapshot {
        let g = self.inner.lock();
        let mut groups: HashMap<(NamespaceId, TierKind, Holder), Vec<BlockKey>> = HashMap::new();
        for ((tier, holder), keys) in &g.held {
            for (k, ns) in keys {
                groups.entry((*ns, *tier, holder.clone())).or_default().push(*k);
            }
        }
        Snapshot {
            epoch: g.log.epoch(),
            last_event_id: g.log.last_id(),
            entries: groups
                .into_iter()
                .map(|((namespace, tier, holder), keys)| SnapshotEntry { namespace, tier, holder, keys })
                .collect(),
        }
    }

    /// Blocks held now, over all tiers and holders.
    pub fn held_facts(&self) -> usize {
        self.inner.lock().held.values().map(HashMap::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_reflects_what_was_published() {
        let p = MemoryPublisher::new("p", 3, 2);
        let ns = NamespaceId([1; 16]);
        let h = Holder::Node(crate::events::NodeId("n".into()));
        let keys: Vec<BlockKey> = (0..4u8).map(|i| BlockKey([i; 16])).collect();
        p.publish(EventBody::Stored {
            namespace: ns,
            parent: None,
            keys: keys.clone(),
            tier: TierKind::G2Host,
            holder: h.clone(),
        });
        p.publish(EventBody::Removed { keys: vec![keys[0]], tier: TierKind::G2Host, holder: h.clone() });
        p.publish(EventBody::Stored {
            namespace: ns,
            parent: None,
            keys: vec![keys[0]],
            tier: TierKind::G3Disk,
            holder: h.clone(),
        });
        let s = p.snapshot_now();
        assert_eq!((s.epoch, s.last_event_id, s.entries.len()), (3, 3, 2));
        assert_eq!(p.held_facts(), 4);
        assert!(matches!(p.replay_now(0, 10), Replay::TooOld { oldest: 2, .. }));
        p.publish(EventBody::Cleared { tier: TierKind::G2Host, holder: h });
        assert_eq!(p.held_facts(), 1);
    }
}
