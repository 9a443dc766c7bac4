//! The router's mutable state (one lock, never held across an `.await`): index, holders,
//! workers, publishers with their event-id tracking, health, counters, pending predictions.
//!
//! Event ids per publisher: the next applied event must be `last_id + 1`. A smaller id is a
//! duplicate (skipped); a larger one is a gap. With a recovery source the publisher is marked
//! `recovering` (later live events are dropped: they are in its log) and a replay / snapshot
//! task runs outside the lock; without one the gap is reported and the events are applied anyway.
//! A new epoch means the publisher restarted: everything it reported (its node's G2/G3, its
//! workers' G1) is dropped and ids restart.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvproto::events::{
    EVENTS_VERSION, EngineLoad, Event, EventBody, Holder, LoadReport, NamespaceInfo, NodeId, PublisherInfo,
    RouteOutcome, Snapshot, WorkerId,
};
use kvproto::{NamespaceId, TierKind};
use rand::rngs::StdRng;

use crate::approx::ApproxIndex;
use crate::config::{KeyScheme, RouterConfig};
use crate::health::{ConditionKind, Counters, Health, add, bump};
use crate::index::{BlockIndex, HolderTable, Slot};

/// The instant approximate-mode timestamps count from.
pub fn process_start() -> Instant {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// What the router knows about one worker.
#[derive(Debug, Clone)]
pub struct WorkerState {
    pub id: WorkerId,
    pub node: NodeId,
    pub address: String,
    pub role: Option<String>,
    pub publisher: String,
    pub holder: u32,
    pub node_holder: u32,
    pub load: Option<EngineLoad>,
    pub routed_since_report: u32,
    pub prediction: PredictionStats,
}

/// Predicted vs actual hits of one worker.
#[derive(Debug, Clone, Default)]
pub struct PredictionStats {
    pub samples: u64,
    pub predicted_blocks: u64,
    pub actual_blocks: u64,
    pub abs_error_blocks: u64,
    /// Moving average of |predicted - actual| / max(predicted, actual, 1).
    pub ewma_error: f64,
}

/// Where a publisher's events come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublisherKind {
    /// `POST /events` (kvcached daemons, simulators).
    Http,
    /// A vLLM engine over ZMQ (no heartbeat, no snapshot).
    Vllm,
}

/// Gap state of a publisher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GapState {
    None,
    /// A replay / snapshot task is running.
    Recovering,
    /// Recovery failed or is impossible; retry at the instant if a source exists.
    Unrecovered {
        retry_at: Option<Instant>,
    },
}

/// What the router knows about one publisher.
#[derive(Debug, Clone)]
pub struct PublisherState {
    pub name: String,
    pub kind: PublisherKind,
    pub epoch: u64,
    pub last_id: u64,
    pub node: NodeId,
    pub info: Option<PublisherInfo>,
    pub workers: BTreeSet<WorkerId>,
    pub last_seen: Instant,
    /// None: the publisher has no heartbeat (never stale, never dropped).
    pub report_interval: Option<Duration>,
    pub gap: GapState,
    pub gap_since: Option<Instant>,
    /// The links its daemon measured to peers (its latest load report).
    pub links: Vec<kvproto::events::LinkReport>,
}

impl PublisherState {
    /// Its daemon's peer channel (`host:port`), if it serves one.
    pub fn peer_url(&self) -> Option<&str> {
        self.info.as_ref().and_then(|i| i.peer_url.as_deref())
    }

    /// The namespaces it declared (empty: unknown, serves anything).
    pub fn namespaces(&self) -> &[NamespaceInfo] {
        self.info.as_ref().map_or(&[], |i| &i.namespaces)
    }
    /// Recovery URL, if declared.
    pub fn recovery_url(&self) -> Option<&str> {
        self.info.as_ref().and_then(|i| i.recovery_url.as_deref())
    }
}

/// A prediction awaiting its outcome.
#[derive(Debug, Clone)]
pub struct Prediction {
    pub worker: WorkerId,
    pub blocks: [u32; 4],
}

/// A recovery the caller must run (outside the lock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryTask {
    pub publisher: String,
    pub epoch: u64,
}

/// Everything behind the router's lock.
#[derive(Debug)]
pub struct State {
    pub index: BlockIndex,
    pub holders: HolderTable,
    pub approx: ApproxIndex,
    pub workers: BTreeMap<WorkerId, WorkerState>,
    pub publishers: BTreeMap<String, PublisherState>,
    pub health: Health,
    pub counters: Counters,
    pub predictions: HashMap<u64, Prediction>,
    pub prediction_order: VecDeque<u64>,
    pub next_route_id: u64,
    pub rng: StdRng,
    pub scratch: crate::cost::MatchScratch,
    /// Recovery sources attached in-process (by publisher name).
    pub has_attached_source: BTreeSet<String>,
    /// Prefetch hints sent to daemons and how they ended (updated by the tasks sending them).
    pub prefetches: std::sync::Arc<PrefetchCounts>,
}

/// Prefetch hints: sent (the daemon took them) and failed (unreachable, refused).
#[derive(Debug, Default)]
pub struct PrefetchCounts {
    pub sent: std::sync::atomic::AtomicU64,
    pub failed: std::sync::atomic::AtomicU64,
}

impl State {
    pub fn new(config: &RouterConfig, rng: StdRng) -> Self {
        let mut index = BlockIndex::new();
        for ns in config.namespaces.iter().filter(|ns| ns.expected_blocks > 0) {
            if let Ok(r) = ns.resolve() {
                index.reserve(r.id, usize::try_from(ns.expected_blocks).unwrap_or(usize::MAX));
            }
        }
        Self {
            index,
            holders: HolderTable::default(),
            approx: ApproxIndex::new((config.approx_ttl_s * 1000.0) as u64, config.approx_max_blocks),
            workers: BTreeMap::new(),
            publishers: BTreeMap::new(),
            health: Health::default(),
            counters: Counters::default(),
            predictions: HashMap::new(),
            prediction_order: VecDeque::new(),
            next_route_id: 1,
            rng,
            scratch: crate::cost::MatchScratch::default(),
            has_attached_source: BTreeSet::new(),
            prefetches: std::sync::Arc::default(),
        }
    }

    fn intern(&mut self, h: &Holder) -> u32 {
        // 2^30 holders cannot be reached in practice: the index would need more memory than exists.
        self.holders.intern(h).unwrap_or(crate::index::MAX_HOLDERS)
    }

    /// Registers (or updates) a worker under a publisher.
    pub fn upsert_worker(
        &mut self,
        publisher: &str,
        node: &NodeId,
        id: &WorkerId,
        address: &str,
        role: Option<String>,
    ) {
        let holder = self.intern(&Holder::Worker(id.clone()));
        let node_holder = self.intern(&Holder::Node(node.clone()));
        let w = self.workers.entry(id.clone()).or_insert_with(|| WorkerState {
            id: id.clone(),
            node: node.clone(),
            address: String::new(),
            role: None,
            publisher: publisher.to_string(),
            holder,
            node_holder,
            load: None,
            routed_since_report: 0,
            prediction: PredictionStats::default(),
        });
        if w.node != *node {
            w.node = node.clone();
            w.node_holder = node_holder;
        }
        if !address.is_empty() {
            w.address = address.to_string();
        }
        if role.is_some() {
            w.role = role;
        }
        w.publisher = publisher.to_string();
        if let Some(p) = self.publishers.get_mut(publisher) {
            p.workers.insert(id.clone());
        }
    }

    /// Forgets a worker and its G1 blocks.
    pub fn drop_worker(&mut self, id: &WorkerId, why: &str) {
        let Some(w) = self.workers.remove(id) else { return };
        let n = self.index.remove_where(|s| s.holder() == w.holder);
        self.approx.drop_holder(w.holder);
        self.holders.release(&Holder::Worker(id.clone()));
        self.counters.dropped_holders += 1;
        self.counters.dropped_facts += n;
        if let Some(p) = self.publishers.get_mut(&w.publisher) {
            p.workers.remove(id);
        }
        for k in ConditionKind::ALL {
            self.health.clear(k, &id.0);
        }
        tracing::info!(worker = %id, blocks = n, why, "kvrouter dropped worker");
    }

    /// Drops everything a publisher reported in G1-G3 (its node's and its workers' blocks).
    fn drop_publisher_facts(&mut self, publisher: &str) -> u64 {
        let Some(p) = self.publishers.get(publisher) else { return 0 };
        let mut holders: Vec<u32> = p.workers.iter().filter_map(|w| self.workers.get(w).map(|w| w.holder)).collect();
        let node_shared = self.publishers.values().any(|o| o.name != publisher && o.node == p.node);
        if !node_shared && let Some(h) = self.holders.get(&Holder::Node(p.node.clone())) {
            holders.push(h);
        }
        self.index.remove_where(|s| s.tier() != TierKind::G4Object && holders.contains(&s.holder()))
    }

    /// A publisher restarted without an epoch to say so (a vLLM engine whose batch numbers
    /// started again): drops what it reported and its gap state, keeps the publisher.
    pub(crate) fn publisher_restarted(&mut self, publisher: &str) {
        let n = self.drop_publisher_facts(publisher);
        self.counters.dropped_facts += n;
        self.health.clear(ConditionKind::UnrecoveredGap, publisher);
        if let Some(p) = self.publishers.get_mut(publisher) {
            p.gap = GapState::None;
            p.gap_since = None;
        }
        tracing::info!(publisher, blocks = n, "kvrouter: publisher restarted, its blocks dropped");
    }

    /// Forgets a publisher, its workers and its node's blocks.
    pub fn drop_publisher(&mut self, publisher: &str, why: &str) {
        let n = self.drop_publisher_facts(publisher);
        let Some(p) = self.publishers.remove(publisher) else { return };
        for w in p.workers.iter() {
            self.drop_worker(w, why);
        }
        if !self.publishers.values().any(|o| o.node == p.node) {
            self.holders.release(&Holder::Node(p.node.clone()));
        }
        self.counters.dropped_facts += n;
        self.health.clear(ConditionKind::UnrecoveredGap, publisher);
        self.health.clear(ConditionKind::KeySchemeMismatch, publisher);
        tracing::info!(publisher, blocks = n, why, "kvrouter dropped publisher");
    }

    /// Creates the publisher state if new; resets it on a new epoch.
    pub fn touch_publisher(
        &mut self,
        name: &str,
        kind: PublisherKind,
        epoch: u64,
        node: Option<&NodeId>,
        interval: Option<Duration>,
        now: Instant,
    ) {
        let restarted = self.publishers.get(name).is_some_and(|p| p.epoch != epoch);
        if restarted {
            let n = self.drop_publisher_facts(name);
            self.counters.dropped_facts += n;
            self.health.clear(ConditionKind::UnrecoveredGap, name);
            tracing::info!(publisher = name, epoch, blocks = n, "kvrouter: publisher restarted, its blocks dropped");
        }
        let p = self.publishers.entry(name.to_string()).or_insert_with(|| PublisherState {
            name: name.to_string(),
            kind,
            epoch,
            last_id: 0,
            node: node.cloned().unwrap_or_else(|| NodeId(name.to_string())),
            info: None,
            workers: BTreeSet::new(),
            last_seen: now,
            report_interval: interval,
            gap: GapState::None,
            gap_since: None,
            links: Vec::new(),
        });
        if restarted {
            p.epoch = epoch;
            p.last_id = 0;
            p.gap = GapState::None;
            p.gap_since = None;
        }
        if let Some(n) = node {
            p.node = n.clone();
        }
        p.last_seen = now;
        let workers: Vec<WorkerId> = p.workers.iter().cloned().collect();
        for w in workers {
            self.health.clear(ConditionKind::StaleWorker, &w.0);
        }
    }

    /// Applies a publisher's self-description.
    pub fn apply_info(&mut self, publisher: &str, info: &PublisherInfo) {
        if info.events_version != EVENTS_VERSION {
            bump(&mut self.counters.mismatches, ConditionKind::KeySchemeMismatch.label());
            self.health.set(
                ConditionKind::KeySchemeMismatch,
                publisher,
                format!("publisher speaks events version {}, router {EVENTS_VERSION}", info.events_version),
                Instant::now(),
            );
        } else if let Some(ns) = info.namespaces.iter().find(|n| KeyScheme::parse(&n.key_scheme).is_none()) {
            bump(&mut self.counters.mismatches, ConditionKind::KeySchemeMismatch.label());
            self.health.set(
                ConditionKind::KeySchemeMismatch,
                publisher,
                format!("publisher uses unknown key scheme {:?} for model {}", ns.key_scheme, ns.model_id),
                Instant::now(),
            );
        } else {
            self.health.clear(ConditionKind::KeySchemeMismatch, publisher);
        }
        let old: BTreeSet<WorkerId> = self.publishers.get(publisher).map(|p| p.workers.clone()).unwrap_or_default();
        if let Some(p) = self.publishers.get_mut(publisher) {
            p.node = info.node.clone();
            p.report_interval = Some(Duration::from_millis(info.report_interval_ms.max(1)));
            p.info = Some(info.clone());
        }
        for w in &info.workers {
            self.upsert_worker(publisher, &info.node, &w.id, &w.address, w.role.clone());
        }
        for gone in old.iter().filter(|w| !info.workers.iter().any(|i| &i.id == *w)) {
            self.drop_worker(gone, "no longer listed by its publisher");
        }
    }

    /// True when the publisher's events can be trusted (known events version).
    fn version_ok(&self, publisher: &str) -> bool {
        self.publishers.get(publisher).and_then(|p| p.info.as_ref()).is_none_or(|i| i.events_version == EVENTS_VERSION)
    }

    /// Applies one event body (already in order). Returns false if it was invalid.
    pub fn apply_body(&mut self, publisher: &str, body: &EventBody) -> bool {
        let (tier, holder) = match body {
            EventBody::Stored { tier, holder, .. }
            | EventBody::Removed { tier, holder, .. }
            | EventBody::Cleared { tier, holder } => (*tier, holder),
        };
        if !holder.fits(tier) {
            bump(&mut self.counters.invalid_events, publisher.to_string());
            return false;
        }
        if let Holder::Worker(w) = holder
            && !self.workers.contains_key(w)
        {
            let node = self.publishers.get(publisher).map(|p| p.node.clone()).unwrap_or(NodeId(publisher.into()));
            self.upsert_worker(publisher, &node, w, "", None);
        }
        let h = self.intern(holder);
        let slot = Slot::new(h, tier);
        match body {
            EventBody::Stored { namespace, parent, keys, .. } => {
                self.index.store(*namespace, parent.as_ref(), keys, slot)
            }
            EventBody::Removed { keys, .. } => self.index.remove(None, keys, slot),
            EventBody::Cleared { .. } => {
                self.index.remove_where(|s| s == slot);
            }
        }
        true
    }

    /// Records what [`Self::apply_events`] did for `publisher`: its last applied id, events
    /// applied and duplicates skipped.
    fn note_applied(&mut self, publisher: &str, last: u64, applied: u64, duplicates: u64) {
        if let Some(p) = self.publishers.get_mut(publisher) {
            p.last_id = last;
        }
        add(&mut self.counters.events, publisher, applied);
        add(&mut self.counters.duplicate_events, publisher, duplicates);
    }

    /// Applies events in id order. Returns a recovery task if a gap needs one.
    pub fn apply_events(
        &mut self,
        publisher: &str,
        events: &[Event],
        announced: Option<u64>,
        can_recover: bool,
    ) -> Option<RecoveryTask> {
        if !self.version_ok(publisher) {
            return None;
        }
        let p = self.publishers.get(publisher)?;
        if p.gap == GapState::Recovering {
            return None; // the recovery replays them from the publisher's log
        }
        let epoch = p.epoch;
        // The last applied id, and what was applied or skipped, kept here and written back once
        // (a report carries hundreds of events: no map lookups or name copies per event).
        let mut last = p.last_id;
        let (mut applied, mut duplicates) = (0u64, 0u64);
        for ev in events {
            if ev.id <= last {
                duplicates += 1;
                continue;
            }
            if ev.id > last + 1 {
                bump(&mut self.counters.gaps, publisher.to_string());
                let now = Instant::now();
                if can_recover {
                    self.note_applied(publisher, last, applied, duplicates);
                    if let Some(p) = self.publishers.get_mut(publisher) {
                        p.gap = GapState::Recovering;
                        p.gap_since.get_or_insert(now);
                    }
                    tracing::debug!(publisher, expected = last + 1, got = ev.id, "event gap: recovering");
                    return Some(RecoveryTask { publisher: publisher.to_string(), epoch });
                }
                self.health.set(
                    ConditionKind::UnrecoveredGap,
                    publisher,
                    format!("missed events {}..{} and the publisher has no recovery API", last + 1, ev.id - 1),
                    now,
                );
                if let Some(p) = self.publishers.get_mut(publisher) {
                    p.gap = GapState::Unrecovered { retry_at: None };
                    p.gap_since.get_or_insert(now);
                }
            }
            self.apply_body(publisher, &ev.body);
            applied += 1;
            last = ev.id;
        }
        self.note_applied(publisher, last, applied, duplicates);
        // Events lost with nothing after them show only in the announced newest id.
        let last = self.publishers.get(publisher).map_or(0, |p| p.last_id);
        if let Some(a) = announced
            && a > last
            && can_recover
        {
            bump(&mut self.counters.gaps, publisher.to_string());
            if let Some(p) = self.publishers.get_mut(publisher) {
                p.gap = GapState::Recovering;
                p.gap_since.get_or_insert(Instant::now());
            }
            return Some(RecoveryTask { publisher: publisher.to_string(), epoch });
        }
        if let Some(a) = announced
            && a > last
            && !self.health.is_set(ConditionKind::UnrecoveredGap, publisher)
        {
            bump(&mut self.counters.gaps, publisher.to_string());
            self.health.set(
                ConditionKind::UnrecoveredGap,
                publisher,
                format!("missed events {}..{a} and the publisher has no recovery API", last + 1),
                Instant::now(),
            );
            if let Some(p) = self.publishers.get_mut(publisher) {
                p.gap = GapState::Unrecovered { retry_at: None };
                p.gap_since.get_or_insert(Instant::now());
            }
        }
        None
    }

    /// Replaces a publisher's G1-G3 state by a snapshot.
    pub fn apply_snapshot(&mut self, publisher: &str, snap: &Snapshot) {
        let n = self.drop_publisher_facts(publisher);
        self.counters.dropped_facts += n;
        // A snapshot lists keys in no particular order and without their parents: each is
        // stored on its own (a run head of its own), so lookups find every key of a chain.
        // Stored as one list, a key placed after an unrelated one would sit inside that one's
        // run, where a lookup walking the chain never looks.
        for e in &snap.entries {
            for k in &e.keys {
                let body = EventBody::Stored {
                    namespace: e.namespace,
                    parent: None,
                    keys: vec![*k],
                    tier: e.tier,
                    holder: e.holder.clone(),
                };
                self.apply_body(publisher, &body);
            }
        }
        if let Some(p) = self.publishers.get_mut(publisher) {
            p.last_id = snap.last_event_id;
        }
    }

    /// Applies a load report.
    pub fn apply_load(&mut self, publisher: &str, load: &LoadReport) {
        if let Some(p) = self.publishers.get_mut(publisher) {
            p.links.clone_from(&load.links);
        }
        for e in &load.engines {
            if !self.workers.contains_key(&e.worker) {
                let node = self.publishers.get(publisher).map(|p| p.node.clone()).unwrap_or(NodeId(publisher.into()));
                self.upsert_worker(publisher, &node, &e.worker, "", None);
            }
            if let Some(w) = self.workers.get_mut(&e.worker) {
                w.load = Some(e.clone());
                w.routed_since_report = 0;
            }
        }
    }

    /// The peer channel of `node`'s daemon, if one of its publishers reports one.
    pub fn node_peer(&self, node: &NodeId) -> Option<String> {
        self.publishers.values().filter(|p| &p.node == node).find_map(|p| p.peer_url().map(str::to_string))
    }

    /// The link rate (bytes a second) `to`'s daemon measured pulling from `from`'s peer channel.
    pub fn link_rate(&self, from: &NodeId, to: &NodeId) -> Option<f64> {
        let peer = self.node_peer(from)?;
        self.publishers
            .values()
            .filter(|p| &p.node == to)
            .flat_map(|p| p.links.iter())
            .find(|l| l.peer == peer)
            .map(|l| l.bytes_per_s)
    }

    /// Remembers a prediction (bounded).
    pub fn remember_prediction(&mut self, route_id: u64, p: Prediction, max: usize) {
        self.predictions.insert(route_id, p);
        self.prediction_order.push_back(route_id);
        while self.prediction_order.len() > max.max(1) {
            if let Some(old) = self.prediction_order.pop_front() {
                self.predictions.remove(&old);
            }
        }
    }

    /// Compares an outcome with its prediction.
    pub fn apply_outcome(&mut self, o: &RouteOutcome, cfg: &crate::config::HealthConfig) {
        self.counters.outcomes += 1;
        let Some(p) = self.predictions.remove(&o.route_id) else {
            self.counters.outcomes_unknown += 1;
            return;
        };
        let Some(w) = self.workers.get_mut(&p.worker) else { return };
        let predicted: u64 = p.blocks.iter().map(|b| u64::from(*b)).sum();
        let actual: u64 = o.found_blocks.iter().map(|b| u64::from(*b)).sum();
        let err = predicted.abs_diff(actual);
        let s = &mut w.prediction;
        s.samples += 1;
        s.predicted_blocks += predicted;
        s.actual_blocks += actual;
        s.abs_error_blocks += err;
        let ratio = err as f64 / (predicted.max(actual).max(1) as f64);
        let a = cfg.prediction_ewma_alpha.clamp(0.0, 1.0);
        s.ewma_error = if s.samples == 1 { ratio } else { a * ratio + (1.0 - a) * s.ewma_error };
        let (samples, ewma, id) = (s.samples, s.ewma_error, w.id.0.clone());
        if samples >= cfg.prediction_min_samples && ewma > cfg.prediction_max_error {
            self.health.set(
                ConditionKind::PredictionError,
                &id,
                format!(
                    "predicted vs actual cached blocks differ by {:.0}% on average over recent requests",
                    ewma * 100.0
                ),
                Instant::now(),
            );
        } else if ewma <= cfg.prediction_max_error {
            self.health.clear(ConditionKind::PredictionError, &id);
        }
    }

    /// Periodic work: stale and dead workers / publishers, expiring conditions, recovery retries.
    pub fn housekeeping(&mut self, cfg: &RouterConfig, now: Instant) -> Vec<RecoveryTask> {
        let h = &cfg.health;
        let mut to_drop = vec![];
        let mut retries = vec![];
        for p in self.publishers.values_mut() {
            let Some(interval) = p.report_interval else { continue };
            let silent = now.saturating_duration_since(p.last_seen);
            // Never drop before a publisher is well overdue by its own schedule.
            let stale_after = h.stale_after_reports * interval.as_secs_f64();
            if silent.as_secs_f64() > h.drop_after_s.max(2.0 * stale_after) {
                to_drop.push(p.name.clone());
                continue;
            }
            if silent.as_secs_f64() > stale_after {
                for w in &p.workers {
                    self.health.set(
                        ConditionKind::StaleWorker,
                        &w.0,
                        format!(
                            "publisher {} silent for {:.1}s (reports every {:.1}s)",
                            p.name,
                            silent.as_secs_f64(),
                            interval.as_secs_f64()
                        ),
                        now,
                    );
                }
            }
            if let GapState::Unrecovered { retry_at: Some(at) } = p.gap
                && at <= now
            {
                p.gap = GapState::Recovering;
                retries.push(RecoveryTask { publisher: p.name.clone(), epoch: p.epoch });
            }
        }
        for p in to_drop {
            self.drop_publisher(&p, "silent longer than drop_after_s");
        }
        let hold = |s: f64| Duration::from_secs_f64(s.max(0.0));
        for k in [ConditionKind::NamespaceMismatch, ConditionKind::BlockSizeMismatch] {
            self.health.expire(k, hold(h.mismatch_hold_s), now);
        }
        // A key-scheme mismatch raised by requests (subject: a model) expires like the others;
        // one raised by a publisher's info (subject: the publisher) lasts until its next good info.
        let publishers = &self.publishers;
        self.health.expire_if(ConditionKind::KeySchemeMismatch, hold(h.mismatch_hold_s), now, |subject| {
            !publishers.contains_key(subject)
        });
        // Gaps with no way to recover are reported for gap_hold_s after the last one.
        let expired: Vec<String> = self
            .publishers
            .values()
            .filter(|p| matches!(p.gap, GapState::Unrecovered { retry_at: None }))
            .filter(|p| p.gap_since.is_some_and(|t| now.saturating_duration_since(t) >= hold(h.gap_hold_s)))
            .map(|p| p.name.clone())
            .collect();
        for name in expired {
            if let Some(p) = self.publishers.get_mut(&name) {
                p.gap = GapState::None;
                p.gap_since = None;
            }
            self.health.clear(ConditionKind::UnrecoveredGap, &name);
        }
        self.approx.expire(now.saturating_duration_since(process_start()).as_millis() as u64);
        retries
    }

    /// Namespaces declared by some publisher with the request's model, for mismatch checks.
    pub fn declared_for_model(&self, model: &str) -> Vec<(String, NamespaceInfo)> {
        let mut out = vec![];
        for p in self.publishers.values() {
            for n in p.namespaces() {
                if n.model_id == model {
                    out.push((p.name.clone(), n.clone()));
                }
            }
        }
        out
    }

    /// Whether a worker's publisher declared `ns` or declared nothing.
    pub fn serves(&self, w: &WorkerState, ns: NamespaceId) -> bool {
        self.publishers
            .get(&w.publisher)
            .is_none_or(|p| p.namespaces().is_empty() || p.namespaces().iter().any(|n| n.id == ns))
    }
}
