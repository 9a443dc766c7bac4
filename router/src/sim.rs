//! The simulation harness: N simulated workers, each an LRU cache of C blocks that publishes real
//! events (and loads and outcomes) to a real router over HTTP, driven by a trace of requests whose
//! `hash_ids` are prefix-block ids (Mooncake's trace format).
//!
//! A worker holds blocks in G1 only (the setting of the reference numbers in BRIEF.md). Time is the
//! trace's: a request occupies its worker for `prefill_ms_per_block` per block it missed plus
//! `decode_ms_per_token` per output token, and the workers report how many requests they are
//! running, so the router's load terms see real queues.
//!
//! Policies: KV-aware (ask the router), round-robin, random. Bounds: the infinite cache (every block
//! seen before is a hit) and one pooled LRU of the cluster's total size.

use std::collections::{HashSet, VecDeque};
use std::num::NonZeroUsize;
use std::sync::Arc;

use kvproto::events::{
    EVENTS_VERSION, EngineLoad, EventBody, Holder, KEY_SCHEME_KVCACHED, LoadReport, NamespaceInfo, NodeId,
    PublisherInfo, PublisherMessage, RouteOutcome, WorkerId, WorkerInfo, key_from_u64,
};
use kvproto::{BlockKey, NamespaceId, TierKind};
use lru::LruCache;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::RouterError;
use crate::recovery::MemoryPublisher;
use crate::router::RouteResponse;

/// The namespace id the simulation's blocks live in.
pub const SIM_NAMESPACE: NamespaceId = NamespaceId(*b"kvrouter-sim-ns!");

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Arrival time (ms).
    pub timestamp: u64,
    #[serde(default)]
    pub input_length: u32,
    #[serde(default)]
    pub output_length: u32,
    /// Prefix-block ids: equal ids at equal positions mean equal prefixes.
    pub hash_ids: Vec<u64>,
}

/// Parses a JSON-lines trace (Mooncake format).
pub fn parse_trace(text: &str) -> Result<Vec<TraceRequest>, RouterError> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| RouterError::Invalid(format!("trace line {}: {e}", i + 1))))
        .collect()
}

/// A deterministic multi-turn chat trace: every request starts with `system_blocks` shared
/// blocks; `conversations` conversations of `turns` turns each append `blocks_per_turn` new
/// blocks to their history; conversations start at random times and turns follow every
/// `turn_gap_ms` (the trace's shape, small).
pub fn synthetic_trace(
    seed: u64,
    conversations: u32,
    turns: u32,
    system_blocks: u32,
    blocks_per_turn: u32,
) -> Vec<TraceRequest> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut next_id = u64::from(system_blocks);
    let mut out = vec![];
    for _ in 0..conversations {
        let start = rng.random_range(0..(u64::from(conversations) * 400));
        let mut history: Vec<u64> = (0..u64::from(system_blocks)).collect();
        for t in 0..turns {
            for _ in 0..blocks_per_turn {
                history.push(next_id);
                next_id += 1;
            }
            out.push(TraceRequest {
                timestamp: start + u64::from(t) * rng.random_range(2_000..20_000),
                input_length: history.len() as u32 * 512,
                output_length: rng.random_range(20..400),
                hash_ids: history.clone(),
            });
        }
    }
    out.sort_by_key(|r| r.timestamp);
    out
}

/// The public GPU write-up's scenario: `prefixes` distinct prompts of `blocks` blocks, each sent
/// `sends` times in shuffled order, one every `gap_ms`.
pub fn repeated_prefixes(seed: u64, prefixes: u64, blocks: u64, sends: u32, gap_ms: u64) -> Vec<TraceRequest> {
    let mut order: Vec<u64> = (0..prefixes).flat_map(|p| std::iter::repeat_n(p, sends as usize)).collect();
    order.shuffle(&mut StdRng::seed_from_u64(seed));
    order
        .into_iter()
        .enumerate()
        .map(|(i, p)| TraceRequest {
            timestamp: i as u64 * gap_ms,
            input_length: (blocks * 16) as u32,
            output_length: 1,
            hash_ids: (0..blocks).map(|b| p * 1_000_000 + b).collect(),
        })
        .collect()
}

/// How requests are placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Ask the router (`POST /route`).
    KvAware,
    RoundRobin,
    Random,
}

/// Simulation parameters.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub workers: usize,
    /// Blocks each worker's LRU holds.
    pub capacity_blocks: usize,
    pub policy: Policy,
    pub prefill_ms_per_block: f64,
    pub decode_ms_per_token: f64,
    pub seed: u64,
    /// Report what each request actually found (predicted-vs-actual loop).
    pub report_outcomes: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            workers: 8,
            capacity_blocks: 2000,
            policy: Policy::KvAware,
            prefill_ms_per_block: 50.0,
            decode_ms_per_token: 20.0,
            seed: 1,
            report_outcomes: true,
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SimResult {
    pub requests: u64,
    pub blocks: u64,
    pub hit_blocks: u64,
    /// `hit_blocks / blocks`.
    pub hit_rate: f64,
    /// Requests whose prefix was seen before (by the whole cluster) that found all of it.
    pub resends: u64,
    pub resend_full_hits: u64,
    /// Requests per worker.
    pub per_worker: Vec<u64>,
    /// Events published to the router.
    pub events: u64,
}

struct SimWorker {
    lru: LruCache<u64, ()>,
    publisher: Arc<MemoryPublisher>,
    /// Finish times (ms) of requests in flight.
    inflight: VecDeque<f64>,
    /// Blocks of each request in flight (same order as `inflight`).
    inflight_blocks: VecDeque<u64>,
    dirty: bool,
}

fn key(id: u64) -> BlockKey {
    key_from_u64(id)
}

/// Sends requests through a worker's LRU: returns (hit prefix blocks, stored ids, evicted ids).
fn serve_blocks(lru: &mut LruCache<u64, ()>, ids: &[u64]) -> (usize, Vec<u64>, Vec<u64>) {
    let hit = ids.iter().take_while(|id| lru.contains(id)).count();
    let mut stored = vec![];
    let mut evicted = vec![];
    // Leaf first, root last: ancestors end up hotter than descendants.
    for id in ids.iter().rev() {
        if lru.get(id).is_none() {
            if let Some((old, ())) = lru.push(*id, ())
                && old != *id
            {
                evicted.push(old);
            }
            stored.push(*id);
        }
    }
    stored.reverse();
    // An id evicted and stored within one request is held: drop it from `evicted`.
    evicted.retain(|e| !lru.contains(e));
    (hit, stored, evicted)
}

fn worker_name(i: usize) -> String {
    format!("sim-w{i}")
}

fn publisher_info(i: usize, interval_ms: u64) -> PublisherInfo {
    PublisherInfo {
        node: NodeId(format!("sim-node{i}")),
        workers: vec![WorkerInfo { id: WorkerId(worker_name(i)), address: format!("sim://{i}"), role: None }],
        namespaces: vec![NamespaceInfo {
            id: SIM_NAMESPACE,
            model_id: "sim".into(),
            tokens_per_block: 512,
            key_scheme: KEY_SCHEME_KVCACHED.into(),
        }],
        events_version: EVENTS_VERSION,
        report_interval_ms: interval_ms,
        recovery_url: None,
        peer_url: None,
    }
}

/// POSTs `body` as JSON to `{base}{path}`: the answer, or an error unless it is a success.
async fn post_json(
    http: &reqwest::Client,
    base: &str,
    path: &str,
    body: &impl Serialize,
) -> Result<reqwest::Response, RouterError> {
    let r = http.post(format!("{base}{path}")).json(body).send().await.map_err(|e| RouterError::Http(e.to_string()))?;
    if !r.status().is_success() {
        return Err(RouterError::Http(format!("POST {path}: {}", r.status())));
    }
    Ok(r)
}

/// Runs `trace` against the router at `base` (`http://host:port`). The router must be empty;
/// round-robin and random runs do not call it.
pub async fn run(base: &str, trace: &[TraceRequest], cfg: &SimConfig) -> Result<SimResult, RouterError> {
    let http = reqwest::Client::new();
    let cap = NonZeroUsize::new(cfg.capacity_blocks.max(1)).unwrap_or(NonZeroUsize::MIN);
    let mut workers: Vec<SimWorker> = (0..cfg.workers)
        .map(|i| SimWorker {
            lru: LruCache::new(cap),
            publisher: Arc::new(MemoryPublisher::new(format!("sim-d{i}"), 1, 1024)),
            inflight: VecDeque::new(),
            inflight_blocks: VecDeque::new(),
            dirty: true,
        })
        .collect();
    let kv = cfg.policy == Policy::KvAware;
    if kv {
        for (i, w) in workers.iter().enumerate() {
            post_json(&http, base, "/events", &w.publisher.message(Some(publisher_info(i, 3_600_000)), vec![])).await?;
        }
    }
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let mut res = SimResult { per_worker: vec![0; cfg.workers], ..SimResult::default() };
    let mut seen: HashSet<u64> = HashSet::new();
    for (n, req) in trace.iter().enumerate() {
        let now = req.timestamp as f64;
        for w in workers.iter_mut() {
            let before = w.inflight.len();
            let mut keep = w.inflight.iter().map(|f| *f > now);
            w.inflight_blocks.retain(|_| keep.next().unwrap_or(false));
            w.inflight.retain(|f| *f > now);
            w.dirty |= w.inflight.len() != before;
        }
        let keys: Vec<String> = req.hash_ids.iter().map(|id| key(*id).to_string()).collect();
        let (chosen, route_id) = match cfg.policy {
            Policy::RoundRobin => (n % cfg.workers, None),
            Policy::Random => (rng.random_range(0..cfg.workers), None),
            Policy::KvAware => {
                for (i, w) in workers.iter_mut().enumerate().filter(|(_, w)| w.dirty) {
                    let mut m = PublisherMessage::new(w.publisher.name().to_string(), 1);
                    m.load = Some(LoadReport {
                        links: vec![],
                        tiers: vec![],
                        engines: vec![EngineLoad {
                            worker: WorkerId(worker_name(i)),
                            running: w.inflight.len() as u32,
                            waiting: 0,
                            kv_used_blocks: w.inflight_blocks.iter().sum::<u64>().min(cfg.capacity_blocks as u64),
                            kv_total_blocks: cfg.capacity_blocks as u64,
                            prefill_tokens_per_s: None,
                        }],
                    });
                    w.dirty = false;
                    post_json(&http, base, "/events", &m).await?;
                }
                let body = serde_json::json!({"namespace_id": SIM_NAMESPACE.to_string(), "keys": keys});
                let r: RouteResponse = post_json(&http, base, "/route", &body)
                    .await?
                    .json()
                    .await
                    .map_err(|e| RouterError::Http(e.to_string()))?;
                let i = r
                    .worker
                    .strip_prefix("sim-w")
                    .and_then(|s| s.parse::<usize>().ok())
                    .filter(|i| *i < cfg.workers)
                    .ok_or_else(|| RouterError::Invalid(format!("router chose unknown worker {}", r.worker)))?;
                (i, Some(r.route_id))
            }
        };
        let w = &mut workers[chosen];
        let (hit, stored, evicted) = serve_blocks(&mut w.lru, &req.hash_ids);
        let prefix_seen = req.hash_ids.iter().all(|id| seen.contains(id));
        if prefix_seen && !req.hash_ids.is_empty() {
            res.resends += 1;
            if hit == req.hash_ids.len() {
                res.resend_full_hits += 1;
            }
        }
        seen.extend(req.hash_ids.iter().copied());
        res.requests += 1;
        res.blocks += req.hash_ids.len() as u64;
        res.hit_blocks += hit as u64;
        res.per_worker[chosen] += 1;
        let service = cfg.prefill_ms_per_block * (req.hash_ids.len() - hit) as f64
            + cfg.decode_ms_per_token * f64::from(req.output_length);
        w.inflight.push_back(now + service.max(1.0));
        w.inflight_blocks.push_back(req.hash_ids.len() as u64);
        w.dirty = true;
        if kv {
            let holder = Holder::Worker(WorkerId(worker_name(chosen)));
            let mut events = vec![];
            if !evicted.is_empty() {
                let keys = evicted.iter().map(|id| key(*id)).collect();
                events.push(w.publisher.publish(EventBody::Removed {
                    keys,
                    tier: TierKind::G1Gpu,
                    holder: holder.clone(),
                }));
            }
            if !stored.is_empty() {
                let keys = stored.iter().map(|id| key(*id)).collect();
                events.push(w.publisher.publish(EventBody::Stored {
                    namespace: SIM_NAMESPACE,
                    parent: None,
                    keys,
                    tier: TierKind::G1Gpu,
                    holder,
                }));
            }
            res.events += events.len() as u64;
            let mut m = w.publisher.message(None, events);
            if cfg.report_outcomes
                && let Some(route_id) = route_id
            {
                m.outcomes = vec![RouteOutcome {
                    route_id,
                    worker: WorkerId(worker_name(chosen)),
                    found_blocks: [hit as u32, 0, 0, 0],
                }];
            }
            post_json(&http, base, "/events", &m).await?;
        }
    }
    res.hit_rate = if res.blocks == 0 { 0.0 } else { res.hit_blocks as f64 / res.blocks as f64 };
    Ok(res)
}

/// Hit rate of an infinite cache (every block seen before, in prefix order, is a hit).
pub fn infinite_hit_rate(trace: &[TraceRequest]) -> f64 {
    let mut seen = HashSet::new();
    let (mut hit, mut total) = (0u64, 0u64);
    for r in trace {
        hit += r.hash_ids.iter().take_while(|id| seen.contains(*id)).count() as u64;
        total += r.hash_ids.len() as u64;
        seen.extend(r.hash_ids.iter().copied());
    }
    if total == 0 { 0.0 } else { hit as f64 / total as f64 }
}

/// Hit rate of one LRU of `capacity` blocks serving every request.
pub fn pooled_hit_rate(trace: &[TraceRequest], capacity: usize) -> f64 {
    let mut lru = LruCache::new(NonZeroUsize::new(capacity.max(1)).unwrap_or(NonZeroUsize::MIN));
    let (mut hit, mut total) = (0u64, 0u64);
    for r in trace {
        hit += serve_blocks(&mut lru, &r.hash_ids).0 as u64;
        total += r.hash_ids.len() as u64;
    }
    if total == 0 { 0.0 } else { hit as f64 / total as f64 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_reports_hits_stores_and_evictions() {
        let mut lru = LruCache::new(NonZeroUsize::new(4).unwrap_or(NonZeroUsize::MIN));
        assert_eq!(serve_blocks(&mut lru, &[1, 2, 3]), (0, vec![1, 2, 3], vec![]));
        assert_eq!(serve_blocks(&mut lru, &[1, 2, 5]), (2, vec![5], vec![]));
        // 6 and 7 push out the two coldest blocks, never the hot root.
        let (hit, stored, evicted) = serve_blocks(&mut lru, &[1, 6, 7]);
        assert_eq!((hit, stored), (1, vec![6, 7]));
        assert_eq!(evicted.len(), 2);
        assert!(!evicted.contains(&1));
    }

    #[test]
    fn synthetic_trace_bounds_are_consistent() {
        let t = synthetic_trace(3, 40, 4, 1, 3);
        assert_eq!(t.len(), 160);
        assert!(t.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        let inf = infinite_hit_rate(&t);
        let pooled = pooled_hit_rate(&t, 100);
        assert!(inf > 0.3 && pooled <= inf, "{inf} {pooled}");
        assert!((pooled_hit_rate(&t, 1_000_000) - inf).abs() < 1e-12);
        let r = repeated_prefixes(1, 12, 125, 6, 1000);
        assert_eq!(r.len(), 72);
        assert!((infinite_hit_rate(&r) - 5.0 / 6.0).abs() < 1e-12);
    }
}
