//! [`Router`]: the public face of the state: route a request, ingest a publisher's message, run
//! gap recovery, housekeeping, health and metrics.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvnet::Identity;
use kvnet::http::HttpClient;
use kvproto::events::{PublisherMessage, RouteOutcome};
use kvproto::{BlockKey, NamespaceId, TierKind};
use parking_lot::Mutex;
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

use crate::config::{NamespaceSpec, ResolvedNamespace, RouterConfig, RoutingMode};
use crate::cost::{self, CandidateIn, CostBreakdown, TierMatch};
use crate::health::{ConditionKind, bump};
use crate::metrics::RouterMetrics;
use crate::recovery::{HttpRecovery, RecoverySource};
use crate::split::{self, PrefillCandidate, SplitDecision, SplitInput};
use crate::state::{GapState, Prediction, PublisherKind, RecoveryTask, State, WorkerState, process_start};
use crate::{Replay, RouterError};

/// The API's name in messages (refusals, configuration errors): the listener `[auth]` guards.
pub const API_ENDPOINT: &str = "kvrouter API ([auth])";

/// A namespace named in the config, or given inline.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NamespaceRef {
    Name(String),
    Spec(Box<NamespaceSpec>),
}

/// Body of `POST /route`. Give `namespace` + `tokens` (the router computes the keys), or
/// `namespace_id` + `keys` (a gateway that computes keys itself, e.g. to keep a tenant salt).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteRequest {
    #[serde(default)]
    pub namespace: Option<NamespaceRef>,
    #[serde(default)]
    pub tokens: Option<Vec<u32>>,
    #[serde(default)]
    pub namespace_id: Option<String>,
    #[serde(default)]
    pub keys: Option<Vec<String>>,
    /// Only these workers may be chosen.
    #[serde(default)]
    pub candidates: Option<Vec<String>>,
    /// Only workers with this role may be chosen (e.g. `decode`).
    #[serde(default)]
    pub role: Option<String>,
    /// Include every candidate's breakdown in the answer.
    #[serde(default)]
    pub explain: bool,
    /// `false`: never split this request into prefill + decode; absent: `[split]` decides.
    #[serde(default)]
    pub split: Option<bool>,
    /// Only these workers may take the prefill half of a split.
    #[serde(default)]
    pub prefill_candidates: Option<Vec<String>>,
    /// What the request's keys bind besides its tokens (adapter, cache salt, images), as its
    /// engine passes it to the daemon; with `namespace` + `tokens` only.
    #[serde(default)]
    pub context: Option<kvrouter_core::context::ContextSpec>,
}

/// One candidate's evaluation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CandidateReport {
    pub worker: String,
    pub cached_blocks: [u32; 4],
    pub cost: CostBreakdown,
}

/// Answer of `POST /route`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RouteResponse {
    /// Quote it in the outcome report (`RouteOutcome::route_id`).
    pub route_id: u64,
    pub worker: String,
    pub address: String,
    pub node: String,
    /// Full blocks of the prompt.
    pub blocks: usize,
    pub tokens_per_block: Option<u32>,
    /// Expected cached prefix blocks per tier `[g1, g2, g3, g4]` on the chosen worker.
    pub cached_blocks: [u32; 4],
    /// Expected cached prefix in tokens (when the block size is known).
    pub cached_tokens: Option<u64>,
    pub cost: CostBreakdown,
    pub mode: RoutingMode,
    /// Every candidate, when `explain` was set.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<CandidateReport>,
    /// The prefill/decode split decision, when prefill workers exist (or the request asked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<SplitDecision>,
    /// The prefetch hint sent to the chosen node's daemon, if one was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch: Option<PrefetchHint>,
}

/// What the router asked the chosen node's daemon to bring into G2 before the engine asks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefetchHint {
    /// Blocks of the prompt the hint names (the longest prefix held anywhere).
    pub blocks: usize,
    /// Of them, held by the node below G2 (G3, G4): promoted.
    pub promote_blocks: u32,
    /// Of them, held only by other nodes: pulled from `sources`.
    pub pull_blocks: u32,
    /// Peer channels of the nodes holding the most of the prompt.
    pub sources: Vec<String>,
}

/// `GET /healthz` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HealthReport {
    /// `ok` or `degraded`.
    pub status: String,
    pub conditions: Vec<HealthCondition>,
    pub workers: usize,
    pub publishers: usize,
    pub indexed_blocks: usize,
}

/// One reason the router is degraded.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HealthCondition {
    pub kind: String,
    pub subject: String,
    pub reason: String,
    pub since_s: f64,
}

/// Size of the index.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct IndexStats {
    pub blocks: usize,
    pub facts: u64,
    pub approx_bytes: usize,
    pub holders: usize,
}

/// The router.
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    named: HashMap<String, ResolvedNamespace>,
    state: Mutex<State>,
    sources: Mutex<HashMap<String, Arc<dyn RecoverySource>>>,
    /// Calls to daemons' recovery routes, with `[daemon_auth]`'s credentials.
    daemons: Arc<HttpClient>,
    metrics: RouterMetrics,
}

struct Resolved {
    id: NamespaceId,
    keys: Vec<BlockKey>,
    model: Option<String>,
    tokens_per_block: Option<u32>,
    scheme: Option<&'static str>,
    /// KV bytes of one block, when the layout is known.
    block_bytes: Option<u64>,
}

impl Router {
    /// A router with `config` (validated).
    pub fn new(config: RouterConfig) -> Result<Arc<Self>, RouterError> {
        config.validate()?;
        let mut named = HashMap::new();
        for n in &config.namespaces {
            if let Some(name) = &n.name {
                named.insert(name.clone(), n.resolve()?);
            }
        }
        let rng = match config.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        let daemons = HttpClient::new(&config.daemon_auth, Duration::from_millis(config.recovery_timeout_ms.max(1)))
            .map_err(|e| RouterError::Config(format!("daemon_auth: {e}")))?;
        let state = Mutex::new(State::new(&config, rng));
        process_start();
        Ok(Arc::new(Self {
            config,
            named,
            state,
            sources: Mutex::new(HashMap::new()),
            daemons: Arc::new(daemons),
            metrics: RouterMetrics::new(),
        }))
    }

    /// The configuration.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The HTTP client for calls to daemons, with `[daemon_auth]`'s credentials.
    pub fn daemon_client(&self) -> &Arc<HttpClient> {
        &self.daemons
    }

    /// A configured namespace by name.
    pub fn namespace(&self, name: &str) -> Option<&ResolvedNamespace> {
        self.named.get(name)
    }

    fn resolve(&self, req: &RouteRequest) -> Result<Resolved, RouterError> {
        if let Some(keys) = &req.keys {
            let id =
                req.namespace_id.as_ref().ok_or_else(|| RouterError::Invalid("`keys` needs `namespace_id`".into()))?;
            if req.context.is_some() {
                return Err(RouterError::Invalid("`context` goes with `namespace` + `tokens`, not with `keys`".into()));
            }
            let mut b = [0u8; 16];
            hex::decode_to_slice(id, &mut b).map_err(|_| RouterError::Invalid("namespace_id: 32 hex digits".into()))?;
            let keys = keys.iter().map(|k| k.parse::<BlockKey>()).collect::<Result<Vec<_>, _>>()?;
            let named = self.named.values().find(|n| n.id.0 == b);
            return Ok(Resolved {
                id: NamespaceId(b),
                keys,
                model: named.map(|n| n.namespace.model_id.clone()),
                tokens_per_block: named.map(|n| n.tokens_per_block()),
                scheme: named.map(|n| n.scheme.name()),
                block_bytes: named.map(|n| n.namespace.layout.block_bytes()),
            });
        }
        let ns = match &req.namespace {
            Some(NamespaceRef::Name(n)) => {
                self.named.get(n).cloned().ok_or_else(|| RouterError::Invalid(format!("unknown namespace {n:?}")))?
            }
            Some(NamespaceRef::Spec(s)) => s.resolve()?,
            None => return Err(RouterError::Invalid("give `namespace` + `tokens` or `namespace_id` + `keys`".into())),
        };
        let tokens = req.tokens.as_deref().ok_or_else(|| RouterError::Invalid("`namespace` needs `tokens`".into()))?;
        let ctx = req.context.as_ref().map(|c| c.resolve()).transpose()?.flatten();
        Ok(Resolved {
            id: ns.id,
            keys: ns.keys_in(tokens, ctx.as_ref()),
            model: Some(ns.namespace.model_id.clone()),
            tokens_per_block: Some(ns.tokens_per_block()),
            scheme: Some(ns.scheme.name()),
            block_bytes: Some(ns.namespace.layout.block_bytes()),
        })
    }

    /// The namespace a request names, without deriving its keys (for the grant check).
    fn namespace_of(&self, req: &RouteRequest) -> Result<NamespaceId, RouterError> {
        if req.keys.is_some() {
            let id =
                req.namespace_id.as_ref().ok_or_else(|| RouterError::Invalid("`keys` needs `namespace_id`".into()))?;
            let mut b = [0u8; 16];
            hex::decode_to_slice(id, &mut b).map_err(|_| RouterError::Invalid("namespace_id: 32 hex digits".into()))?;
            return Ok(NamespaceId(b));
        }
        match &req.namespace {
            Some(NamespaceRef::Name(n)) => self
                .named
                .get(n)
                .map(|ns| ns.id)
                .ok_or_else(|| RouterError::Invalid(format!("unknown namespace {n:?}"))),
            Some(NamespaceRef::Spec(s)) => Ok(s.resolve()?.id),
            None => Err(RouterError::Invalid("give `namespace` + `tokens` or `namespace_id` + `keys`".into())),
        }
    }

    /// Places one request for `who` (an authenticated caller: it must have a grant of the
    /// request's namespace; `None`: an API without authentication).
    pub fn route_as(&self, req: &RouteRequest, who: Option<&Identity>) -> Result<RouteResponse, RouterError> {
        // A request that names no valid namespace fails in `route` (and is counted there).
        if let Some(who) = who.filter(|w| w.namespaces != kvnet::Namespaces::All)
            && let Ok(ns) = self.namespace_of(req)
            && !who.may_read(&ns)
        {
            self.state.lock().counters.route_errors += 1;
            return Err(RouterError::Forbidden(format!(
                "{API_ENDPOINT}: {} may not route in namespace {ns}: no grant of it in [auth] grants",
                who.name
            )));
        }
        self.route(req)
    }

    /// Places one request.
    pub fn route(&self, req: &RouteRequest) -> Result<RouteResponse, RouterError> {
        let t0 = Instant::now();
        let r = self.resolve(req);
        let mut st = self.state.lock();
        let out = r.and_then(|r| self.route_locked(&mut st, req, r, t0));
        match &out {
            Ok(_) => st.counters.routes += 1,
            Err(_) => st.counters.route_errors += 1,
        }
        drop(st);
        self.metrics.route_took(t0.elapsed(), out.is_ok());
        out
    }

    fn check_mismatch(&self, st: &mut State, r: &Resolved, now: Instant) {
        let Some(model) = &r.model else { return };
        let declared = st.declared_for_model(model);
        if declared.iter().any(|(_, n)| n.id == r.id) {
            return;
        }
        let bs = r.tokens_per_block.unwrap_or(0);
        let scheme = r.scheme.unwrap_or("");
        let (kind, reason) = if let Some((p, n)) = declared.iter().find(|(_, n)| n.tokens_per_block != bs) {
            (
                ConditionKind::BlockSizeMismatch,
                format!(
                    "requests for {model} use {bs}-token blocks, publisher {p} stores {}-token blocks",
                    n.tokens_per_block
                ),
            )
        } else if let Some((p, n)) = declared.iter().find(|(_, n)| n.key_scheme != scheme) {
            (
                ConditionKind::KeySchemeMismatch,
                format!("requests for {model} use key scheme {scheme}, publisher {p} uses {}", n.key_scheme),
            )
        } else if let Some((p, n)) = declared.first() {
            (
                ConditionKind::NamespaceMismatch,
                format!(
                    "requests for {model} are in namespace {}, publisher {p} stores {model} in namespace {} \
                     (layout, dtype, salt or adapter differ)",
                    r.id, n.id
                ),
            )
        } else if st.publishers.values().any(|p| !p.namespaces().is_empty()) {
            (ConditionKind::NamespaceMismatch, format!("no publisher stores model {model} (namespace {})", r.id))
        } else {
            return;
        };
        bump(&mut st.counters.mismatches, kind.label());
        st.health.set(kind, model, reason, now);
    }

    fn route_locked(
        &self,
        st: &mut State,
        req: &RouteRequest,
        r: Resolved,
        t0: Instant,
    ) -> Result<RouteResponse, RouterError> {
        self.check_mismatch(st, &r, t0);
        let mode = self.config.mode;
        let now_ms = t0.saturating_duration_since(process_start()).as_millis() as u64;
        if mode == RoutingMode::Approximate {
            st.approx.expire(now_ms);
        }
        let (workers, cands) = collect_candidates(st, &r, |w| {
            req.candidates.as_ref().is_none_or(|c| c.contains(&w.id.0)) && has_role(req, w)
        });
        if cands.is_empty() {
            return Err(RouterError::NoWorker(no_worker_reason(st, &r, req)));
        }
        let matches = match_all(st, mode, &r, &cands);
        let costs = cost::costs(&self.config.weights, r.keys.len(), &cands, &matches);
        let pick = cost::choose(&costs, self.config.weights.temperature, r.keys.len(), &mut st.rng)
            .ok_or_else(|| RouterError::NoWorker("no finite cost".into()))?;
        let route_id = st.next_route_id;
        st.next_route_id += 1;
        let chosen = workers[pick].clone();
        let m = matches[pick];
        let split = self.split_decision(st, req, &r, &chosen, m);
        let prefetch = self.prefetch(st, &r, &chosen, m);
        // A split sends the prefill to another worker: count it there too, so a burst spreads.
        if let Some(p) = split.as_ref().filter(|s| s.split).and_then(|s| s.prefill_worker.as_ref())
            && let Some(w) = st.workers.get_mut(&kvproto::events::WorkerId(p.clone()))
        {
            w.routed_since_report += 1;
        }
        if mode == RoutingMode::Approximate {
            st.approx.record(r.id, &r.keys, cands[pick].worker_holder, now_ms);
        }
        st.remember_prediction(
            route_id,
            Prediction { worker: chosen.clone(), blocks: m.blocks },
            self.config.max_pending_predictions,
        );
        let Some(w) = st.workers.get_mut(&chosen) else {
            return Err(RouterError::NoWorker("chosen worker vanished".into()));
        };
        w.routed_since_report += 1;
        let candidates = if req.explain {
            workers
                .iter()
                .zip(matches.iter().zip(&costs))
                .map(|(w, (m, c))| CandidateReport { worker: w.0.clone(), cached_blocks: m.blocks, cost: *c })
                .collect()
        } else {
            Vec::new()
        };
        Ok(RouteResponse {
            route_id,
            worker: chosen.0.clone(),
            address: w.address.clone(),
            node: w.node.0.clone(),
            blocks: r.keys.len(),
            tokens_per_block: r.tokens_per_block,
            cached_blocks: m.blocks,
            cached_tokens: r.tokens_per_block.map(|b| u64::from(m.prefix()) * u64::from(b)),
            cost: costs[pick],
            mode,
            candidates,
            split,
            prefetch,
        })
    }

    /// Sends the chosen node's daemon a prefetch hint when the node holds part of the prompt
    /// below G2 or another node holds more of it (docs/router.md section 4, "Prefetch"). The
    /// POST runs in the background; its result is counted, never waited for.
    fn prefetch(
        &self,
        st: &mut State,
        r: &Resolved,
        chosen: &kvproto::events::WorkerId,
        m: TierMatch,
    ) -> Option<PrefetchHint> {
        let cfg = &self.config.prefetch;
        if !cfg.enabled || r.scheme != Some(kvproto::events::KEY_SCHEME_KVCACHED) {
            return None;
        }
        let node = st.workers.get(chosen)?.node.clone();
        let url = st.publishers.values().filter(|p| p.node == node).find_map(|p| p.recovery_url())?.to_string();
        let have = m.prefix();
        let promote = m.blocks[TierKind::G3Disk.index()] + m.blocks[TierKind::G4Object.index()];
        let mut sources: Vec<(u32, String)> = Vec::new();
        if (have as usize) < r.keys.len() {
            let (ids, cands) = collect_candidates(st, r, |w| w.node != node);
            let matches = match_all(st, self.config.mode, r, &cands);
            for (id, mm) in ids.iter().zip(&matches) {
                let Some(n) = st.workers.get(id).map(|w| w.node.clone()) else { continue };
                if mm.prefix() > have
                    && let Some(peer) = st.node_peer(&n)
                    && !sources.iter().any(|(_, p)| p == &peer)
                {
                    sources.push((mm.prefix(), peer));
                }
            }
            sources.sort_by_key(|s| std::cmp::Reverse(s.0));
            sources.truncate(cfg.max_sources);
        }
        let upto = sources.first().map_or(have, |(p, _)| *p).max(have);
        let pull = upto - have;
        if promote < cfg.min_blocks && pull < cfg.min_blocks {
            return None;
        }
        let hint = PrefetchHint {
            blocks: upto as usize,
            promote_blocks: promote,
            pull_blocks: pull,
            sources: sources.into_iter().map(|(_, p)| p).collect(),
        };
        let body = serde_json::json!({
            "namespace": r.id.to_string(),
            "keys": r.keys[..upto as usize].iter().map(|k| k.to_string()).collect::<Vec<_>>(),
            "sources": hint.sources,
        });
        let client = Arc::clone(&self.daemons);
        let counts = Arc::clone(&st.prefetches);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                use std::sync::atomic::Ordering::Relaxed;
                match client.post_json(&format!("{url}/prefetch"), &body).await {
                    Ok(()) => counts.sent.fetch_add(1, Relaxed),
                    Err(e) => {
                        tracing::debug!(url, "prefetch hint failed: {e}");
                        counts.failed.fetch_add(1, Relaxed)
                    }
                };
            });
        }
        Some(hint)
    }

    /// The prefill/decode split decision for a request routed to `decode` (see [`crate::split`]);
    /// `None` when splits are off, the request opted out, or no prefill worker exists and the
    /// request did not ask.
    fn split_decision(
        &self,
        st: &mut State,
        req: &RouteRequest,
        r: &Resolved,
        decode: &kvproto::events::WorkerId,
        m: TierMatch,
    ) -> Option<SplitDecision> {
        let cfg = &self.config.split;
        if !cfg.enabled || req.split == Some(false) {
            return None;
        }
        let decode_worker = st.workers.get(decode)?;
        let decode_node_id = decode_worker.node.clone();
        let decode_rate = decode_worker.load.as_ref().and_then(|l| l.prefill_tokens_per_s);
        let decode_node = decode_node_id.0.clone();
        let (ids, cands) = collect_candidates(st, r, |w| {
            &w.id != decode
                && w.role.as_ref().is_some_and(|role| cfg.prefill_roles.contains(role))
                && req.prefill_candidates.as_ref().is_none_or(|c| c.contains(&w.id.0))
        });
        if cands.is_empty() && req.split != Some(true) {
            return None;
        }
        let matches = match_all(st, self.config.mode, r, &cands);
        let costs = cost::costs(&self.config.weights, r.keys.len(), &cands, &matches);
        let prefill: Vec<PrefillCandidate> = ids
            .iter()
            .zip(matches.iter().zip(&costs))
            .filter_map(|(id, (m, c))| {
                let w = st.workers.get(id)?;
                Some(PrefillCandidate {
                    worker: id.0.clone(),
                    address: w.address.clone(),
                    node: w.node.0.clone(),
                    cached: *m,
                    cost: *c,
                    prefill_tokens_per_s: w.load.as_ref().and_then(|l| l.prefill_tokens_per_s),
                    link_bytes_per_s: st.link_rate(&w.node, &decode_node_id),
                    peer: st.node_peer(&w.node),
                })
            })
            .collect();
        let input = SplitInput {
            blocks: r.keys.len(),
            decode_prefix: m.prefix(),
            decode_node: &decode_node,
            tokens_per_block: r.tokens_per_block,
            block_bytes: r.block_bytes.or(cfg.default_block_bytes),
            decode_prefill_tokens_per_s: decode_rate,
        };
        Some(split::decide(cfg, &input, &prefill))
    }

    /// Attaches an in-process recovery source for `publisher` (tests, embedded publishers). It
    /// takes precedence over the publisher's `recovery_url`.
    pub fn attach_recovery(&self, publisher: &str, src: Arc<dyn RecoverySource>) {
        self.sources.lock().insert(publisher.to_string(), src);
        self.state.lock().has_attached_source.insert(publisher.to_string());
    }

    fn source(&self, publisher: &str, st: &State) -> Option<Arc<dyn RecoverySource>> {
        if let Some(s) = self.sources.lock().get(publisher) {
            return Some(s.clone());
        }
        let url = st.publishers.get(publisher)?.recovery_url()?.to_string();
        Some(Arc::new(HttpRecovery::new(url, Arc::clone(&self.daemons))))
    }

    /// Applies one publisher message. Returns the recovery to run if a gap was found (see
    /// [`Router::ingest_and_recover`], which runs it).
    pub fn ingest(&self, msg: &PublisherMessage) -> Option<RecoveryTask> {
        let now = Instant::now();
        let mut st = self.state.lock();
        let interval = msg
            .info
            .as_ref()
            .map(|i| i.report_interval_ms)
            .or_else(|| st.publishers.get(&msg.publisher).and_then(|p| p.report_interval.map(|d| d.as_millis() as u64)))
            .unwrap_or(self.config.health.default_report_interval_ms);
        st.touch_publisher(
            &msg.publisher,
            PublisherKind::Http,
            msg.epoch,
            msg.info.as_ref().map(|i| &i.node),
            Some(Duration::from_millis(interval.max(1))),
            now,
        );
        if let Some(info) = &msg.info {
            st.apply_info(&msg.publisher, info);
        }
        let can_recover = self.sources.lock().contains_key(&msg.publisher)
            || st.publishers.get(&msg.publisher).is_some_and(|p| p.recovery_url().is_some());
        let task = st.apply_events(&msg.publisher, &msg.events, msg.last_event_id, can_recover);
        if let Some(load) = &msg.load {
            st.apply_load(&msg.publisher, load);
        }
        for o in &msg.outcomes {
            st.apply_outcome(o, &self.config.health);
        }
        task
    }

    /// Applies a message and, if it revealed a gap, recovers before returning.
    pub async fn ingest_and_recover(self: &Arc<Self>, msg: &PublisherMessage) {
        if let Some(task) = self.ingest(msg) {
            self.recover(task).await;
        }
    }

    /// Reports outcomes (what routed requests actually found).
    pub fn report_outcomes(&self, outcomes: &[RouteOutcome]) {
        let mut st = self.state.lock();
        for o in outcomes {
            st.apply_outcome(o, &self.config.health);
        }
    }

    /// Runs one recovery: replay from the publisher's log, or a snapshot (then a replay) when
    /// the log no longer reaches back. Never holds the lock across an await.
    pub async fn recover(self: &Arc<Self>, task: RecoveryTask) {
        let src = {
            let st = self.state.lock();
            self.source(&task.publisher, &st)
        };
        let result = match src {
            Some(src) => self.recover_from(&task, src.as_ref()).await,
            None => {
                Err(RouterError::Recovery { publisher: task.publisher.clone(), reason: "no recovery source".into() })
            }
        };
        let mut st = self.state.lock();
        let now = Instant::now();
        let Some(p) = st.publishers.get_mut(&task.publisher) else { return };
        if p.epoch != task.epoch {
            return;
        }
        match result {
            Ok(kind) => {
                p.gap = GapState::None;
                p.gap_since = None;
                bump(&mut st.counters.recoveries, (task.publisher.clone(), kind));
                st.health.clear(ConditionKind::UnrecoveredGap, &task.publisher);
            }
            Err(e) => {
                p.gap = GapState::Unrecovered { retry_at: Some(now + Duration::from_secs(1)) };
                bump(&mut st.counters.recovery_failures, task.publisher.clone());
                st.health.set(ConditionKind::UnrecoveredGap, &task.publisher, format!("missed events: {e}"), now);
            }
        }
    }

    async fn recover_from(&self, task: &RecoveryTask, src: &dyn RecoverySource) -> Result<&'static str, RouterError> {
        let timeout = Duration::from_millis(self.config.recovery_timeout_ms.max(1));
        let fail = |reason: String| RouterError::Recovery { publisher: task.publisher.clone(), reason };
        let mut kind = "replay";
        // Each round makes progress (events applied, or a snapshot); the bound stops a publisher
        // that produces events faster than they can be replayed from monopolising a task.
        for _ in 0..64 {
            let after = {
                let st = self.state.lock();
                match st.publishers.get(&task.publisher) {
                    Some(p) if p.epoch == task.epoch => p.last_id,
                    _ => return Ok(kind),
                }
            };
            let limit = self.config.replay_batch.max(1);
            let replay = tokio::time::timeout(timeout, src.replay(after, limit))
                .await
                .map_err(|_| fail("replay timed out".into()))??;
            match replay {
                Replay::Events { epoch, events } => {
                    if epoch != task.epoch {
                        return Err(fail(format!("publisher is in epoch {epoch}, expected {}", task.epoch)));
                    }
                    let mut st = self.state.lock();
                    if let Some(p) = st.publishers.get_mut(&task.publisher) {
                        p.gap = GapState::None; // let apply_events run
                    }
                    let again = st.apply_events(&task.publisher, &events, None, false);
                    debug_assert!(again.is_none());
                    if let Some(p) = st.publishers.get_mut(&task.publisher) {
                        p.gap = GapState::Recovering;
                    }
                    if events.len() < limit {
                        return Ok(kind);
                    }
                }
                Replay::TooOld { epoch, .. } => {
                    if epoch != task.epoch {
                        return Err(fail(format!("publisher is in epoch {epoch}, expected {}", task.epoch)));
                    }
                    let snap = tokio::time::timeout(timeout, src.snapshot())
                        .await
                        .map_err(|_| fail("snapshot timed out".into()))??;
                    if snap.epoch != task.epoch {
                        return Err(fail(format!("snapshot of epoch {}, expected {}", snap.epoch, task.epoch)));
                    }
                    self.state.lock().apply_snapshot(&task.publisher, &snap);
                    kind = "snapshot";
                }
            }
        }
        Err(fail("publisher outpaces replay".into()))
    }

    /// Periodic work (stale / dead holders, expiring conditions, recovery retries). Spawns the
    /// retries on the current tokio runtime.
    pub fn housekeeping(self: &Arc<Self>) {
        let tasks = self.state.lock().housekeeping(&self.config, Instant::now());
        for t in tasks {
            let me = self.clone();
            tokio::spawn(async move { me.recover(t).await });
        }
    }

    /// Records how long a stream message took from its publication to being applied.
    pub fn bus_lag(&self, seconds: f64) {
        self.metrics.bus_lag(seconds);
    }

    /// Runs `f` on the state (vLLM ingest and tests).
    pub(crate) fn with_state<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.state.lock())
    }

    /// Health report.
    pub fn health(&self) -> HealthReport {
        let st = self.state.lock();
        let conditions: Vec<HealthCondition> = st
            .health
            .conditions()
            .into_iter()
            .map(|c| HealthCondition {
                kind: c.kind.label().to_string(),
                subject: c.subject,
                reason: c.reason,
                since_s: c.since.elapsed().as_secs_f64(),
            })
            .collect();
        HealthReport {
            status: if conditions.is_empty() { "ok" } else { "degraded" }.to_string(),
            conditions,
            workers: st.workers.len(),
            publishers: st.publishers.len(),
            indexed_blocks: st.index.blocks(),
        }
    }

    /// Index size.
    pub fn index_stats(&self) -> IndexStats {
        let st = self.state.lock();
        IndexStats {
            blocks: st.index.blocks(),
            facts: st.index.facts(),
            approx_bytes: st.index.approx_bytes(),
            holders: st.holders.len(),
        }
    }

    /// Prometheus text of every `kvrouter_*` metric.
    pub fn metrics_text(&self) -> String {
        let st = self.state.lock();
        self.metrics.render(&st)
    }
}

/// The workers that may take a request in namespace `r` (declared it, or serve its model under
/// another namespace: the mismatch is flagged, the request still routed) and pass `keep`, with
/// their cost-model inputs.
/// Whether `w` has the role `req` asks for (any, when it asks for none).
fn has_role(req: &RouteRequest, w: &WorkerState) -> bool {
    req.role.as_ref().is_none_or(|role| w.role.as_ref() == Some(role))
}

/// Why no worker is a candidate for `req`: none live serves the namespace, or some do but
/// none has the role asked for, or none is among the candidates the request named.
fn no_worker_reason(st: &State, r: &Resolved, req: &RouteRequest) -> String {
    let (serving, _) = collect_candidates(st, r, |_| true);
    if serving.is_empty() {
        return format!("no live worker serves namespace {}", r.id);
    }
    let n = serving.len();
    let (of_role, _) = collect_candidates(st, r, |w| has_role(req, w));
    match &req.role {
        Some(role) if of_role.is_empty() => format!(
            "no live worker with role {role} serves namespace {} ({n} live worker{} serve{} it in other roles)",
            r.id,
            if n == 1 { "" } else { "s" },
            if n == 1 { "s" } else { "" }
        ),
        _ => format!(
            "none of the candidates the request named is a live worker{} serving namespace {} ({} such worker{})",
            req.role.as_ref().map(|role| format!(" with role {role}")).unwrap_or_default(),
            r.id,
            of_role.len(),
            if of_role.len() == 1 { "" } else { "s" }
        ),
    }
}

fn collect_candidates(
    st: &State,
    r: &Resolved,
    keep: impl Fn(&WorkerState) -> bool,
) -> (Vec<kvproto::events::WorkerId>, Vec<CandidateIn>) {
    let mut workers = Vec::new();
    let mut cands = Vec::new();
    for w in st.workers.values() {
        if !keep(w) {
            continue;
        }
        let same_model = r.model.as_ref().is_some_and(|m| {
            st.publishers.get(&w.publisher).is_some_and(|p| p.namespaces().iter().any(|n| &n.model_id == m))
        });
        if !st.serves(w, r.id) && !same_model {
            continue;
        }
        let (util, reported) =
            w.load.as_ref().map_or((0.0, 0.0), |l| (l.kv_utilisation(), f64::from(l.running + l.waiting)));
        let fill = match w.load.as_ref().map(|l| l.kv_total_blocks) {
            Some(total) if total > 0 => st.index.holder_facts(w.holder) as f64 / total as f64,
            _ => 0.0,
        };
        cands.push(CandidateIn {
            worker_holder: w.holder,
            node_holder: w.node_holder,
            kv_utilisation: util,
            active: reported + f64::from(w.routed_since_report),
            fill,
        });
        workers.push(w.id.clone());
    }
    (workers, cands)
}

/// Blocks of the prompt each candidate can get, per tier (from the index, or in approximate mode
/// from the router's remembered decisions).
fn match_all(st: &mut State, mode: RoutingMode, r: &Resolved, cands: &[CandidateIn]) -> Vec<TierMatch> {
    let mut scratch = std::mem::take(&mut st.scratch);
    let matches = match mode {
        RoutingMode::Events => {
            let index = &st.index;
            cost::match_candidates(cands, &mut scratch, |visit| {
                index.walk(r.id, &r.keys, |_, len, slots| visit(len as u32, slots));
            })
        }
        RoutingMode::Approximate => {
            let approx = &st.approx;
            let mut slots = crate::index::Slots::default();
            cost::match_candidates(cands, &mut scratch, |visit| {
                approx.walk(r.id, &r.keys, |_, v| {
                    // A block's remembered workers are distinct.
                    slots.refill(v.iter().map(|(h, _)| crate::index::Slot::new(*h, TierKind::G1Gpu)));
                    visit(1, &slots)
                });
            })
        }
    };
    st.scratch = scratch;
    matches
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A namespace's `expected_blocks` sizes its index at start: its bytes are there before any
    /// block.
    #[test]
    fn expected_blocks_size_the_index_at_start() {
        let toml = r#"
[[namespaces]]
name = "v"
model_id = "m"
num_layers = 2
kv_heads = 2
head_dim = 64
dtype = "bf16"
tokens_per_block = 16
expected_blocks = 100000
"#;
        let router = RouterConfig::from_toml(toml)
            .map_err(|e| e.to_string())
            .and_then(|c| Router::new(c).map_err(|e| e.to_string()));
        let stats = router.as_ref().map(|r| r.index_stats());
        assert!(stats.as_ref().is_ok_and(|s| s.blocks == 0 && s.approx_bytes >= 100_000 * 12), "{stats:?}");
    }
}
