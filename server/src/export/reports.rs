//! Hit reports to kvrouter (docs/router.md section 2): what each tier of this node gained and
//! lost, the G1 blocks engines report from their own GPU memory, load, and what routed
//! requests actually found.
//!
//! Events are numbered and logged by a `kvproto::publisher::MemoryPublisher` (a bounded log plus
//! the state it published, served at `/events/replay` and `/events/snapshot` on the daemon's
//! HTTP listener) and shipped by [`HttpPublisher`] to every configured router, or on the NATS
//! event plane.
//! Nothing here blocks: an event that finds the send queue full is left to the routers' replay.
//! With no router configured every call is a no-op.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvproto::events::{
    EVENTS_VERSION, EngineLoad, EventBody, Holder, KEY_SCHEME_KVCACHED, LinkReport, LoadReport, NamespaceInfo, NodeId,
    PublisherInfo, RouteOutcome, TierCapacity, WorkerId, WorkerInfo,
};
use kvproto::publisher::MemoryPublisher;
use kvproto::{BlockKey, TierKind};
use kvtiers::{BlockMeta, BlockStore, TierListener};
use parking_lot::Mutex;

use crate::config::RouterConfig;
use crate::engine::Engine;
use crate::error::ServerError;
use crate::peer::Peers;

/// Weight of an engine's newest prefill sample in its average rate.
const PREFILL_EWMA: f64 = 0.3;
use crate::export::publish::{HttpPublisher, PublishConfig};
use crate::export::vllm_export::VllmExport;

/// What the daemon knows of one attached engine, for `info` and load reports.
#[derive(Debug, Clone)]
struct Attached {
    worker: WorkerInfo,
    namespace: NamespaceInfo,
    block_bytes: u64,
    load: Option<EngineLoad>,
}

type Engines = Arc<Mutex<BTreeMap<u64, Attached>>>;

/// The daemon's publisher of hit reports.
#[derive(Debug)]
pub struct Reports {
    node: NodeId,
    publisher: Option<HttpPublisher>,
    base: PublisherInfo,
    engines: Engines,
    vllm: Option<Arc<VllmExport>>,
}

/// A change an engine reports about its GPU memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuChange {
    Stored,
    Removed,
    Cleared,
}

impl Reports {
    /// Reports that go nowhere (no router configured).
    pub fn disabled(node: &str) -> Self {
        Self {
            node: NodeId(node.to_string()),
            publisher: None,
            base: base_info(node, 1000, None),
            engines: Arc::default(),
            vllm: None,
        }
    }

    /// Starts publishing as `events` says: to `cfg.urls` (transports "http" and "both"), on the
    /// NATS stream ("nats" and "both"). Must run inside the tokio runtime. `recovery_url` is
    /// where routers reach [`Reports::log`]'s replay and snapshot routes. Fails when
    /// `router.auth`'s certificate, key or token files cannot be read.
    pub fn start(
        cfg: &RouterConfig,
        events: &crate::config::EventsConfig,
        recovery_url: Option<String>,
        peer_url: Option<String>,
        store: Arc<BlockStore>,
        peers: Option<Arc<Peers>>,
        vllm: Option<Arc<VllmExport>>,
    ) -> Result<Self, ServerError> {
        let nats = events.nats();
        let routers = if events.http() { cfg.urls.clone() } else { Vec::new() };
        if !events.http() && !cfg.urls.is_empty() {
            tracing::warn!(urls = ?cfg.urls, "events.transport is \"nats\": router.urls are not used (\"both\" posts to them too)");
        }
        if routers.is_empty() && nats.is_none() {
            return Ok(Self { vllm, ..Self::disabled(&cfg.node) });
        }
        let epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(1)
            .max(1);
        let log = Arc::new(MemoryPublisher::new(format!("kvcached@{}", cfg.node), epoch, cfg.event_log));
        let mut base = base_info(&cfg.node, cfg.report_interval_ms, recovery_url.clone());
        base.peer_url = peer_url;
        let engines: Engines = Arc::default();
        let for_load = Arc::clone(&engines);
        let store = Arc::downgrade(&store);
        let publisher = HttpPublisher::spawn(
            log,
            PublishConfig {
                routers: routers.clone(),
                auth: cfg.auth.clone(),
                nats: nats.cloned(),
                info: base.clone(),
                max_pending: cfg.max_pending,
                max_batch: 4096,
                timeout: Duration::from_millis(cfg.report_interval_ms.max(1000)),
            },
            // Weak: the store holds these reports as its listener, and a cycle would keep the
            // store (and G3's RocksDB) open past shutdown.
            move || {
                store.upgrade().map(|s| {
                    let mut r = load_report(&s, &for_load.lock());
                    r.links = peers.as_ref().map(|p| link_reports(p)).unwrap_or_default();
                    r
                })
            },
        )
        .map_err(|e| ServerError::Config {
            field: if nats.is_some() { "router.auth or events.nats.auth" } else { "router.auth" }.into(),
            reason: e.to_string(),
        })?;
        tracing::info!(?routers, nats = ?nats.map(|n| &n.servers), node = %cfg.node, epoch, recovery = ?recovery_url, "publishing hit reports");
        Ok(Self { node: NodeId(cfg.node.clone()), publisher: Some(publisher), base, engines, vllm })
    }

    /// Whether any router is configured.
    pub fn enabled(&self) -> bool {
        self.publisher.is_some()
    }

    /// Whether tier changes are wanted at all (routers or a vLLM-format export).
    pub fn listening(&self) -> bool {
        self.publisher.is_some() || self.vllm.is_some()
    }

    /// The vLLM-format exporter, when configured.
    pub fn vllm(&self) -> Option<&Arc<VllmExport>> {
        self.vllm.as_ref()
    }

    /// The event log (for the recovery routes), when publishing.
    pub fn log(&self) -> Option<Arc<MemoryPublisher>> {
        self.publisher.as_ref().map(|p| Arc::clone(p.log()))
    }

    /// Targets (routers, the NATS stream) whose last report failed, with why.
    pub fn failing_targets(&self) -> Vec<(String, String)> {
        self.publisher.as_ref().map(HttpPublisher::failing_targets).unwrap_or_default()
    }

    /// Events and outcomes not sent because the queue was full (routers replay them).
    pub fn dropped(&self) -> u64 {
        self.publisher.as_ref().map_or(0, HttpPublisher::dropped)
    }

    fn publish(&self, body: EventBody) -> u64 {
        self.publisher.as_ref().map_or(0, |p| p.publish(body).id)
    }

    /// Announces every block the tiers below G2 kept across a restart (G2 starts empty).
    pub fn announce(&self, store: &BlockStore) -> usize {
        if !self.listening() {
            return 0;
        }
        let mut n = 0;
        for t in store.lower().iter() {
            for (key, meta) in t.keys() {
                self.stored(t.kind(), key, &meta);
                n += 1;
            }
        }
        n
    }

    /// The router-facing id of an engine: `<node>/<engine name>`.
    pub fn worker_id(&self, e: &Engine) -> WorkerId {
        let name = if e.name.is_empty() { format!("engine-{}", e.id) } else { e.name.clone() };
        WorkerId(format!("{}/{name}", self.node.0))
    }

    fn refresh_info(&self) {
        if let Some(p) = &self.publisher {
            let engines = self.engines.lock();
            let mut info = self.base.clone();
            for a in engines.values() {
                info.workers.push(a.worker.clone());
                if !info.namespaces.iter().any(|n| n.id == a.namespace.id) {
                    info.namespaces.push(a.namespace.clone());
                }
            }
            drop(engines);
            p.set_info(info);
        }
    }

    /// An engine attached: it becomes a worker of this node.
    pub fn attached(&self, e: &Engine) {
        if !self.enabled() {
            return;
        }
        let worker = WorkerInfo {
            id: self.worker_id(e),
            address: e.address.clone(),
            role: (!e.role.is_empty()).then(|| e.role.clone()),
        };
        let namespace = NamespaceInfo {
            id: e.namespace_id,
            model_id: e.namespace.model_id.clone(),
            tokens_per_block: e.namespace.layout.tokens_per_block,
            key_scheme: KEY_SCHEME_KVCACHED.to_string(),
        };
        self.engines.lock().insert(e.id, Attached { worker, namespace, block_bytes: e.block_bytes(), load: None });
        self.refresh_info();
    }

    /// An engine detached (or missed its heartbeats): its G1 blocks are gone with it.
    pub fn detached(&self, e: &Engine) {
        if !self.enabled() {
            return;
        }
        self.publish(EventBody::Cleared { tier: TierKind::G1Gpu, holder: Holder::Worker(self.worker_id(e)) });
        self.engines.lock().remove(&e.id);
        self.refresh_info();
    }

    /// An engine's report about its GPU memory; `keys` are the blocks named (for `Stored`, a
    /// chain whose first block's parent is `parent`). Returns the event id (0: not published).
    pub fn gpu_blocks(&self, e: &Engine, change: GpuChange, parent: Option<BlockKey>, keys: Vec<BlockKey>) -> u64 {
        let holder = Holder::Worker(self.worker_id(e));
        let tier = TierKind::G1Gpu;
        match change {
            GpuChange::Stored if !keys.is_empty() => {
                self.publish(EventBody::Stored { namespace: e.namespace_id, parent, keys, tier, holder })
            }
            GpuChange::Removed if !keys.is_empty() => self.publish(EventBody::Removed { keys, tier, holder }),
            GpuChange::Cleared => self.publish(EventBody::Cleared { tier, holder }),
            _ => 0,
        }
    }

    /// The engine's latest load, sent with the next report. `prefill` (tokens, microseconds)
    /// is what the engine computed since its last report; it moves the engine's prefill rate.
    pub fn engine_load(&self, e: &Engine, r: &kvproto::pb::EngineLoadRequest) {
        let worker = self.worker_id(e);
        if let Some(a) = self.engines.lock().get_mut(&e.id) {
            let mut rate = a.load.as_ref().and_then(|l| l.prefill_tokens_per_s);
            if r.prefill_tokens > 0 && r.prefill_us > 0 {
                let sample = r.prefill_tokens as f64 / (r.prefill_us as f64 / 1e6);
                rate = Some(rate.map_or(sample, |old| PREFILL_EWMA * sample + (1.0 - PREFILL_EWMA) * old));
            }
            a.load = Some(EngineLoad {
                worker,
                running: r.running,
                waiting: r.waiting,
                kv_used_blocks: r.kv_used_blocks,
                kv_total_blocks: r.kv_total_blocks,
                prefill_tokens_per_s: rate,
            });
        }
    }

    /// What a request placed by a router (`route_id`) found: prefix blocks per tier, G1 first.
    pub fn outcome(&self, e: &Engine, route_id: u64, found_blocks: [u32; 4]) {
        if let Some(p) = &self.publisher {
            p.outcome(RouteOutcome { route_id, worker: self.worker_id(e), found_blocks });
        }
    }
}

impl TierListener for Reports {
    fn stored(&self, tier: TierKind, key: BlockKey, meta: &BlockMeta) {
        if let Some(v) = &self.vllm {
            v.stored(tier, &key);
        }
        if !self.enabled() {
            return;
        }
        let Some(holder) = self.holder(tier) else { return };
        self.publish(EventBody::Stored {
            namespace: meta.namespace,
            parent: meta.parent,
            keys: vec![key],
            tier,
            holder,
        });
    }

    fn removed(&self, tier: TierKind, keys: &[BlockKey]) {
        if let Some(v) = &self.vllm {
            v.removed(tier, keys);
        }
        if !self.enabled() {
            return;
        }
        let Some(holder) = self.holder(tier) else { return };
        self.publish(EventBody::Removed { keys: keys.to_vec(), tier, holder });
    }
}

impl Reports {
    /// Who holds a block of `tier` stored by this daemon (G1 comes only from engines).
    fn holder(&self, tier: TierKind) -> Option<Holder> {
        match tier {
            TierKind::G2Host | TierKind::G3Disk => Some(Holder::Node(self.node.clone())),
            TierKind::G4Object => Some(Holder::Cluster),
            TierKind::G1Gpu => None,
        }
    }
}

fn base_info(node: &str, report_interval_ms: u64, recovery_url: Option<String>) -> PublisherInfo {
    PublisherInfo {
        node: NodeId(node.to_string()),
        workers: Vec::new(),
        namespaces: Vec::new(),
        events_version: EVENTS_VERSION,
        report_interval_ms,
        recovery_url,
        peer_url: None,
    }
}

/// Free and total capacity per tier, in blocks of the first attached engine's block size (a
/// page when none is attached), and each engine's latest load.
fn load_report(store: &BlockStore, engines: &BTreeMap<u64, Attached>) -> LoadReport {
    let unit = engines.values().map(|a| a.block_bytes).find(|b| *b > 0).unwrap_or(64 << 10);
    let tiers = store
        .stats()
        .tiers
        .iter()
        .map(|(tier, s)| TierCapacity {
            tier: *tier,
            free_blocks: s.usage.capacity_bytes.saturating_sub(s.usage.used_bytes) / unit,
            total_blocks: s.usage.capacity_bytes / unit,
        })
        .collect();
    LoadReport { tiers, engines: engines.values().filter_map(|a| a.load.clone()).collect(), links: Vec::new() }
}

/// The links this daemon has measured, for the routers' split decisions.
fn link_reports(peers: &Peers) -> Vec<LinkReport> {
    peers
        .book
        .links()
        .into_iter()
        .map(|(peer, l)| LinkReport { peer, bytes_per_s: l.bytes_per_s, samples: l.samples })
        .collect()
}
