//! The Mooncake RFC #1403 indexer API (as Mooncake Conductor and Dynamo's standalone indexer
//! speak it), over the router's own index:
//!
//! - `POST /register`: a publisher's ZMQ endpoint (vLLM / SGLang wire format) and who it is
//!   (`instance_id`, `dp_rank`, `tenant_id`, `modelname`, `block_size`, `lora_name`,
//!   `additionalsalt`). The router subscribes with the same ingestion as `[[vllm_sources]]`
//!   ([`crate::zmq::run_source_in`]): GPU blocks become G1 blocks of the worker
//!   `"{instance_id}/dp{dp_rank}"`, CPU / DISK / EXTERNAL blocks G2 / G3 of its node (`node`,
//!   default the `instance_id`) or G4 of the cluster.
//! - `POST /unregister`: stops the subscription(s) of `(instance_id, tenant_id[, dp_rank])` and
//!   drops what they reported.
//! - `POST /query` (`token_ids`) and `POST /query_by_hash` (`seq_hashes`, Dynamo XXH3-64 chain,
//!   seeded as Dynamo 1.6.1 seeds a request of the namespace's LoRA adapter, 1337 without one):
//!   per tenant and instance, `longest_matched` prefix tokens (any medium, best DP
//!   rank), the prefix tokens available from each medium alone (`GPU`, `CPU`, `DISK`,
//!   `EXTERNAL`) and per DP rank (`DP`).
//! - `GET /workers`: the registrations.
//!
//! Blocks live in a namespace derived from `(modelname, block_size, lora_name, salt)`: a
//! configured `[[namespaces]]` entry with `key_scheme = "dynamo-xxh3-1337"` and the same model,
//! block size and adapter (and no salt) when there is one, so `POST /route` with that name sees
//! registered instances too; otherwise a namespace of its own (its id is in the `/register`
//! answer, for `POST /route` by `namespace_id` + `keys`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router as AxumRouter};
use kvproto::TierKind;
use kvproto::events::{KEY_SCHEME_DYNAMO_XXH3_1337, NodeId, WorkerId, key_from_u64};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::RouterError;
use crate::config::{NamespaceSpec, ResolvedNamespace, VllmSource};
use crate::query::ANY;
use crate::router::Router;

/// How long an unregister / shutdown waits for a subscription task to end.
const STOP_WAIT: Duration = Duration::from_secs(5);
/// Marks namespaces made for registrations (so they never equal a kvcached namespace).
const INDEXER_EXTRA: &[u8] = b"kvrouter indexer namespace v1";

/// An instance id as sent: a string or a number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum InstanceId {
    Text(String),
    Number(u64),
}

impl std::fmt::Display for InstanceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Text(s) => f.write_str(s),
            Self::Number(n) => write!(f, "{n}"),
        }
    }
}

/// A sequence hash as sent: a number, or a decimal / `0x` hex string.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SeqHash {
    Number(u64),
    Signed(i64),
    Text(String),
}

impl SeqHash {
    fn value(&self) -> Result<u64, RouterError> {
        match self {
            Self::Number(n) => Ok(*n),
            // Publishers that hold hashes in a signed 64-bit integer send the same bits.
            Self::Signed(i) => Ok(*i as u64),
            Self::Text(s) => {
                let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
                    Some(h) => u64::from_str_radix(h, 16),
                    None => s.parse(),
                };
                parsed.map_err(|_| RouterError::Invalid(format!("seq hash {s:?}: not a u64")))
            }
        }
    }
}

/// Body of `POST /register`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RegisterRequest {
    /// The publisher's ZMQ PUB endpoint (`tcp://host:port`).
    pub endpoint: String,
    /// The engine's replay socket: batches missed on `endpoint` are asked for there.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// `vLLM` or `SGLang` (both publish vLLM's wire format). Default `vLLM`.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    #[serde(alias = "model", alias = "model_name")]
    pub modelname: String,
    #[serde(default)]
    pub lora_name: Option<String>,
    #[serde(default)]
    pub tenant_id: Option<String>,
    pub instance_id: InstanceId,
    pub block_size: u32,
    #[serde(default)]
    pub dp_rank: u32,
    #[serde(default, alias = "additional_salt")]
    pub additionalsalt: Option<String>,
    /// Extension: the node the instance runs on (holder of its CPU / disk blocks). Default: the
    /// instance id.
    #[serde(default)]
    pub node: Option<String>,
    /// Extension: where `POST /route` sends requests for this instance.
    #[serde(default)]
    pub address: Option<String>,
    /// Extension: the instance's role (`prefill`, `decode`, `both`).
    #[serde(default)]
    pub role: Option<String>,
    /// Extension: ZMQ topic prefix to subscribe to (default: all).
    #[serde(default)]
    pub topic: Option<String>,
}

/// Body of `POST /unregister`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UnregisterRequest {
    pub instance_id: InstanceId,
    #[serde(default)]
    pub tenant_id: Option<String>,
    /// Absent: every DP rank of the instance.
    #[serde(default)]
    pub dp_rank: Option<u32>,
}

/// Body of `POST /query` and `POST /query_by_hash`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QueryRequest {
    #[serde(alias = "modelname", alias = "model_name")]
    pub model: String,
    #[serde(default)]
    pub lora_name: Option<String>,
    /// `/query`: the prompt's tokens (only full blocks count).
    #[serde(default)]
    pub token_ids: Option<Vec<u32>>,
    /// `/query_by_hash`: rolling sequence hashes (Dynamo XXH3-64; seeded by `lora_name`'s
    /// adapter as Dynamo seeds its requests, 1337 without one).
    #[serde(default, alias = "block_hash", alias = "block_hashes")]
    pub seq_hashes: Option<Vec<SeqHash>>,
    #[serde(default)]
    pub tenant_id: Option<String>,
    #[serde(default)]
    pub instance_id: Option<InstanceId>,
    pub block_size: u32,
    #[serde(default, alias = "additionalsalt", alias = "additional_salt")]
    pub cache_salt: Option<String>,
}

/// One registered publisher.
#[derive(Debug, Clone, Serialize)]
pub struct Registration {
    pub instance_id: String,
    pub tenant_id: String,
    pub dp_rank: u32,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    #[serde(rename = "type")]
    pub kind: String,
    pub model: String,
    pub block_size: u32,
    pub lora_name: Option<String>,
    pub salt: Option<String>,
    /// The router's worker (G1 holder) for this instance and rank.
    pub worker: String,
    pub node: String,
    pub namespace_id: String,
    /// The router's publisher name (`vllm:{endpoint}`): metrics and health subjects use it.
    pub publisher: String,
}

type Key = (String, String, u32);

#[derive(Debug)]
struct Entry {
    reg: Registration,
    ns_id: kvproto::NamespaceId,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

/// The registrations and their subscription tasks. The lock is never held across an await.
#[derive(Debug)]
pub struct IndexerApi {
    router: Arc<Router>,
    entries: Mutex<BTreeMap<Key, Entry>>,
}

fn json_error(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, Json(json!({ "error": msg.into() }))).into_response()
}

fn tenant(t: &Option<String>) -> String {
    t.as_deref().filter(|t| !t.is_empty()).unwrap_or("default").to_string()
}

fn non_empty(s: &Option<String>) -> Option<&str> {
    s.as_deref().filter(|s| !s.is_empty())
}

/// The namespace of `(model, block_size, lora, salt)`: a configured Dynamo-scheme namespace
/// with the same model, block size and adapter (and no salt), or one of its own.
pub fn indexer_namespace(
    router: &Router,
    model: &str,
    block_size: u32,
    lora: Option<&str>,
    salt: Option<&str>,
) -> Result<ResolvedNamespace, RouterError> {
    if block_size == 0 {
        return Err(RouterError::Invalid("block_size must be > 0".into()));
    }
    if salt.is_none()
        && let Some(spec) = router.config().namespaces.iter().find(|n| {
            n.key_scheme == KEY_SCHEME_DYNAMO_XXH3_1337
                && n.model_id == model
                && n.tokens_per_block == block_size
                && n.adapter_id.as_deref() == lora
                && n.tenant_salt_hex.is_none()
        })
    {
        return Ok(spec.resolve()?);
    }
    Ok(NamespaceSpec {
        name: None,
        model_id: model.to_string(),
        num_layers: 1,
        kv_heads: 1,
        head_dim: 1,
        dtype: "bf16".into(),
        tokens_per_block: block_size,
        layout_kind: "layer_separate".into(),
        tenant_salt_hex: salt.map(|s| hex::encode(s.as_bytes())),
        adapter_id: lora.map(str::to_string),
        extra_hex: Some(hex::encode(INDEXER_EXTRA)),
        key_scheme: KEY_SCHEME_DYNAMO_XXH3_1337.into(),
        expected_blocks: 0,
    }
    .resolve()?)
}

impl IndexerApi {
    pub fn new(router: Arc<Router>) -> Arc<Self> {
        Arc::new(Self { router, entries: Mutex::new(BTreeMap::new()) })
    }

    /// The registrations.
    pub fn registrations(&self) -> Vec<Registration> {
        self.entries.lock().values().map(|e| e.reg.clone()).collect()
    }

    /// Registers a publisher and starts its subscription (replacing a registration with the same
    /// `(instance_id, tenant_id, dp_rank)`). Needs a tokio runtime.
    pub async fn register(&self, req: RegisterRequest) -> Result<Registration, (StatusCode, String)> {
        let bad = |m: String| (StatusCode::BAD_REQUEST, m);
        let kind = req.kind.clone().unwrap_or_else(|| "vLLM".into());
        if !["vllm", "sglang"].contains(&kind.to_ascii_lowercase().as_str()) {
            return Err(bad(format!(
                "publisher type {kind:?} is not supported: vLLM and SGLang (vLLM's KV-event wire format) are"
            )));
        }
        if !req.endpoint.starts_with("tcp://") {
            return Err(bad(format!("endpoint {:?}: expected tcp://host:port", req.endpoint)));
        }
        if let Some(r) = req.replay_endpoint.as_ref().filter(|r| !r.is_empty() && !r.starts_with("tcp://")) {
            return Err(bad(format!("replay_endpoint {r:?}: expected tcp://host:port")));
        }
        let lora = non_empty(&req.lora_name);
        let salt = non_empty(&req.additionalsalt);
        let ns = indexer_namespace(&self.router, &req.modelname, req.block_size, lora, salt)
            .map_err(|e| bad(e.to_string()))?;
        let instance = req.instance_id.to_string();
        if instance.is_empty() {
            return Err(bad("instance_id must not be empty".into()));
        }
        let key: Key = (instance.clone(), tenant(&req.tenant_id), req.dp_rank);
        let worker = format!("{instance}/dp{}", req.dp_rank);
        let src = VllmSource {
            endpoint: req.endpoint.clone(),
            topic: req.topic.clone().unwrap_or_default(),
            worker: worker.clone(),
            node: non_empty(&req.node).unwrap_or(&instance).to_string(),
            namespace: format!("indexer:{}:{}", req.modelname, req.block_size),
            address: req.address.clone().unwrap_or_default(),
            role: req.role.clone(),
            replay_endpoint: req.replay_endpoint.clone().filter(|r| !r.is_empty()),
            idle_reconnect_s: crate::config::DEFAULT_IDLE_RECONNECT_S,
        };
        let reg = Registration {
            instance_id: instance,
            tenant_id: key.1.clone(),
            dp_rank: req.dp_rank,
            endpoint: req.endpoint.clone(),
            replay_endpoint: req.replay_endpoint.clone(),
            kind,
            model: req.modelname.clone(),
            block_size: req.block_size,
            lora_name: lora.map(str::to_string),
            salt: salt.map(str::to_string),
            worker,
            node: src.node.clone(),
            namespace_id: ns.id.to_string(),
            publisher: crate::zmq::source_name(&src),
        };
        let replaced = {
            let mut entries = self.entries.lock();
            if let Some((k, _)) = entries.iter().find(|(k, e)| **k != key && e.reg.endpoint == req.endpoint) {
                return Err((
                    StatusCode::CONFLICT,
                    format!("endpoint {} is already registered for {}|{}|{}", req.endpoint, k.0, k.1, k.2),
                ));
            }
            let max = self.router.config().indexer.max_registrations;
            if !entries.contains_key(&key) && entries.len() >= max {
                return Err((
                    StatusCode::TOO_MANY_REQUESTS,
                    format!("at most {max} registrations (indexer.max_registrations)"),
                ));
            }
            let (stop, stop_rx) = tokio::sync::watch::channel(false);
            let task = tokio::spawn(crate::zmq::run_source_in(self.router.clone(), src, ns.clone(), stop_rx));
            entries.insert(key, Entry { reg: reg.clone(), ns_id: ns.id, stop, task })
        };
        if let Some(old) = replaced {
            self.finish(old).await;
        }
        tracing::info!(instance = %reg.instance_id, tenant = %reg.tenant_id, dp_rank = reg.dp_rank,
            endpoint = %reg.endpoint, "kvrouter indexer: registered publisher");
        Ok(reg)
    }

    /// Stops a subscription and forgets what it reported (unless the same endpoint was
    /// registered again meanwhile).
    async fn finish(&self, e: Entry) {
        let _ = e.stop.send(true);
        let mut task = e.task;
        if tokio::time::timeout(STOP_WAIT, &mut task).await.is_err() {
            task.abort();
        }
        let reused = self.entries.lock().values().any(|o| o.reg.publisher == e.reg.publisher);
        if !reused {
            self.router.drop_publisher(&e.reg.publisher, "unregistered");
        }
    }

    /// Removes the registrations of `(instance_id, tenant_id)` (one DP rank, or all).
    pub async fn unregister(&self, req: &UnregisterRequest) -> Vec<Registration> {
        let instance = req.instance_id.to_string();
        let t = tenant(&req.tenant_id);
        let removed: Vec<Entry> = {
            let mut entries = self.entries.lock();
            let keys: Vec<Key> = entries
                .keys()
                .filter(|k| k.0 == instance && k.1 == t && req.dp_rank.is_none_or(|r| r == k.2))
                .cloned()
                .collect();
            keys.iter().filter_map(|k| entries.remove(k)).collect()
        };
        let mut out = vec![];
        for e in removed {
            out.push(e.reg.clone());
            self.finish(e).await;
        }
        out
    }

    /// Stops every subscription (router shutdown).
    pub async fn shutdown(&self) {
        let all: Vec<Entry> = std::mem::take(&mut *self.entries.lock()).into_values().collect();
        for e in all {
            let _ = e.stop.send(true);
            let mut task = e.task;
            if tokio::time::timeout(STOP_WAIT, &mut task).await.is_err() {
                task.abort();
            }
        }
    }

    /// Answers `/query` (`by_hash` false) or `/query_by_hash`.
    pub fn query(&self, q: &QueryRequest, by_hash: bool) -> Result<Value, RouterError> {
        let lora = non_empty(&q.lora_name);
        let salt = non_empty(&q.cache_salt);
        let ns = indexer_namespace(&self.router, &q.model, q.block_size, lora, salt)?;
        let keys = if by_hash {
            let h = q.seq_hashes.as_ref().ok_or_else(|| RouterError::Invalid("`seq_hashes` missing".into()))?;
            h.iter().map(|h| h.value().map(key_from_u64)).collect::<Result<Vec<_>, _>>()?
        } else {
            let t = q.token_ids.as_ref().ok_or_else(|| RouterError::Invalid("`token_ids` missing".into()))?;
            ns.keys(t)
        };
        let t = tenant(&q.tenant_id);
        let instance = q.instance_id.as_ref().map(InstanceId::to_string);
        // instance -> [(dp_rank, worker, node)]
        let mut targets: BTreeMap<String, Vec<(u32, String, String)>> = BTreeMap::new();
        let mut other_block_size = None;
        for e in self.entries.lock().values() {
            let r = &e.reg;
            if r.tenant_id != t || instance.as_ref().is_some_and(|i| *i != r.instance_id) {
                continue;
            }
            if e.ns_id == ns.id {
                targets.entry(r.instance_id.clone()).or_default().push((r.dp_rank, r.worker.clone(), r.node.clone()));
            } else if r.model == q.model && r.block_size != q.block_size {
                other_block_size = Some(r.block_size);
            }
        }
        let bs = u64::from(q.block_size);
        if let Some(other) = other_block_size.filter(|_| targets.is_empty()) {
            self.router.block_size_mismatch(
                &q.model,
                format!(
                    "indexer query for {} uses {}-token blocks, its publishers register {other}-token blocks",
                    q.model, q.block_size
                ),
            );
        }
        let mut out = Map::new();
        for (inst, ranks) in &targets {
            let holders: Vec<(WorkerId, NodeId)> =
                ranks.iter().map(|(_, w, n)| (WorkerId(w.clone()), NodeId(n.clone()))).collect();
            let prefixes = self.router.prefix_by_medium(ns.id, &keys, &holders);
            let max = |m: usize| prefixes.iter().map(|p| p[m]).max().unwrap_or(0) * bs;
            let dp: Map<String, Value> =
                ranks.iter().zip(&prefixes).map(|((r, _, _), p)| (r.to_string(), json!(p[ANY] * bs))).collect();
            out.insert(
                inst.clone(),
                json!({
                    "longest_matched": max(ANY),
                    "GPU": max(TierKind::G1Gpu.index()),
                    "CPU": max(TierKind::G2Host.index()),
                    "DISK": max(TierKind::G3Disk.index()),
                    "EXTERNAL": max(TierKind::G4Object.index()),
                    "DP": dp,
                }),
            );
        }
        let mut top = Map::new();
        top.insert(t, Value::Object(out));
        Ok(Value::Object(top))
    }
}

async fn register(State(api): State<Arc<IndexerApi>>, Json(req): Json<RegisterRequest>) -> Response {
    match api.register(req).await {
        Ok(reg) => Json(json!({
            "status": "registered successfully",
            "instance_id": reg.instance_id,
            "worker": reg.worker,
            "namespace_id": reg.namespace_id,
        }))
        .into_response(),
        Err((status, msg)) => json_error(status, msg),
    }
}

async fn unregister(State(api): State<Arc<IndexerApi>>, Json(req): Json<UnregisterRequest>) -> Response {
    let removed = api.unregister(&req).await;
    if removed.is_empty() {
        return json_error(StatusCode::NOT_FOUND, format!("no registration for instance {}", req.instance_id));
    }
    let names: Vec<String> =
        removed.iter().map(|r| format!("{}|{}|{}", r.instance_id, r.tenant_id, r.dp_rank)).collect();
    Json(json!({ "status": "unregistered successfully", "removed_instances": names })).into_response()
}

async fn query(State(api): State<Arc<IndexerApi>>, Json(q): Json<QueryRequest>) -> Response {
    match api.query(&q, false) {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn query_by_hash(State(api): State<Arc<IndexerApi>>, Json(q): Json<QueryRequest>) -> Response {
    match api.query(&q, true) {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn workers(State(api): State<Arc<IndexerApi>>) -> Json<Vec<Registration>> {
    Json(api.registrations())
}

/// The indexer API's HTTP routes.
pub fn routes(api: Arc<IndexerApi>) -> AxumRouter {
    AxumRouter::new()
        .route("/register", post(register))
        .route("/unregister", post(unregister))
        .route("/query", post(query))
        .route("/query_by_hash", post(query_by_hash))
        .route("/workers", get(workers))
        .with_state(api)
}
