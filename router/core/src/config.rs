//! Router configuration (a TOML file; every field has a default) and namespace specs.
//!
//! Every weight of the cost model and every health threshold is here; `docs/router.md` explains
//! each one.

use kvproto::events::{KEY_SCHEME_DYNAMO_XXH3_1337, KEY_SCHEME_KVCACHED, KEY_SCHEME_SGLANG_PAGES, key_from_u64};
use kvproto::{BlockKey, KvLayout, Namespace, NamespaceId, TierKind};
use serde::{Deserialize, Serialize};

use crate::CoreError;

/// How the router learns what is cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RoutingMode {
    /// From publishers' events (`POST /events`, vLLM ZMQ sources).
    #[default]
    Events,
    /// From its own decisions, remembered for `approx_ttl_s` (for clusters that emit no events).
    Approximate,
}

/// The weights of the cost model (docs/router.md, "Cost model").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CostWeights {
    /// Credit of a prompt block found in the worker's own GPU memory.
    pub g1: f64,
    /// Credit of a block found in the worker's node's host memory.
    pub g2: f64,
    /// Credit of a block found on the worker's node's disk.
    pub g3: f64,
    /// Credit of a block found in the cluster's object store.
    pub g4: f64,
    /// Multiplies the blocks still to prefill.
    pub prefill: f64,
    /// Multiplies the worker's KV utilisation (0..1, its decode load): a full engine costs this
    /// many blocks of prefill.
    pub decode: f64,
    /// Multiplies the worker's active requests (running + waiting as last reported, plus requests
    /// routed to it since that report).
    pub active: f64,
    /// Multiplies the fraction of the worker's GPU KV capacity (`kv_total_blocks` of its load
    /// report) that its indexed G1 blocks fill: new prompts go where they evict the least.
    pub fill: f64,
    /// 0: lowest cost wins (ties at random). > 0: sample a worker with probability
    /// proportional to `exp(-(cost - min_cost) / (temperature * blocks))`.
    pub temperature: f64,
}

impl Default for CostWeights {
    fn default() -> Self {
        Self {
            g1: 1.0,
            g2: 0.75,
            g3: 0.25,
            g4: 0.1,
            prefill: 1.0,
            decode: 8.0,
            active: 2.0,
            fill: 1.0,
            temperature: 0.0,
        }
    }
}

impl CostWeights {
    /// Credit weight of `tier`.
    pub fn tier(&self, tier: TierKind) -> f64 {
        match tier {
            TierKind::G1Gpu => self.g1,
            TierKind::G2Host => self.g2,
            TierKind::G3Disk => self.g3,
            TierKind::G4Object => self.g4,
        }
    }

    fn validate(&self) -> Result<(), CoreError> {
        let all =
            [self.g1, self.g2, self.g3, self.g4, self.prefill, self.decode, self.active, self.fill, self.temperature];
        if all.iter().any(|w| !w.is_finite() || *w < 0.0) {
            return Err(CoreError::Config("every weight must be finite and >= 0".into()));
        }
        Ok(())
    }
}

/// Thresholds of the health signals (docs/router.md, "Never fail silently").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    /// A worker is stale when its publisher has been silent this many report intervals.
    pub stale_after_reports: f64,
    /// Report interval assumed for publishers that do not state one (ms).
    pub default_report_interval_ms: u64,
    /// A holder silent this long is dropped from the index (s).
    pub drop_after_s: f64,
    /// A namespace / block size / key-scheme mismatch stays reported this long after the last
    /// request or event that showed it (s).
    pub mismatch_hold_s: f64,
    /// An unrecovered gap of a source that cannot replay (vLLM ZMQ) is reported this long (s).
    pub gap_hold_s: f64,
    /// Prediction error: samples needed before a worker can be flagged.
    pub prediction_min_samples: u64,
    /// Prediction error: flag a worker whose mean |predicted - actual| / predicted-blocks exceeds this.
    pub prediction_max_error: f64,
    /// Weight of a new sample in the exponential moving average of the prediction error.
    pub prediction_ewma_alpha: f64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            stale_after_reports: 3.0,
            default_report_interval_ms: 1000,
            drop_after_s: 60.0,
            mismatch_hold_s: 60.0,
            gap_hold_s: 300.0,
            prediction_min_samples: 20,
            prediction_max_error: 0.25,
            prediction_ewma_alpha: 0.1,
        }
    }
}

/// `[prefetch]`: when a request goes to a node that holds part of the prompt below G2 (G3, G4)
/// or lacks a prefix another node holds, the router tells that node's daemon
/// (`POST {recovery_url}/prefetch`, with `[daemon_auth]`) to bring the blocks into G2 (pulling
/// from the other node's peer channel) before the engine asks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefetchConfig {
    pub enabled: bool,
    /// Send a hint only for at least this many blocks to bring up or pull.
    pub min_blocks: u32,
    /// Other nodes named as sources at most.
    pub max_sources: usize,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        Self { enabled: true, min_blocks: 4, max_sources: 2 }
    }
}

/// When the router splits a request into a prefill worker and a decode worker (docs/router.md,
/// "Prefill/decode split"): only when the handoff costs less than the prefill it saves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SplitConfig {
    /// Consider splits at all (a request can still opt out with `"split": false`).
    pub enabled: bool,
    /// Roles of workers that can take the prefill half of a split.
    pub prefill_roles: Vec<String>,
    /// Prefill time of one token (ms) of a worker that has not reported its prefill rate; a
    /// block costs `tokens_per_block` times this.
    pub prefill_ms_per_token: f64,
    /// Prefill time of one block (ms); overrides `prefill_ms_per_token` when set.
    pub prefill_ms_per_block: Option<f64>,
    /// KV throughput of a same-node handoff through the node's G2 (GB/s).
    pub same_node_gbytes_per_s: f64,
    /// Fixed cost of a same-node handoff (ms).
    pub same_node_latency_ms: f64,
    /// KV throughput between nodes (GB/s) the split decision assumes for a cross-node handoff
    /// until the decode node's daemon has measured the link (a pull or a probe).
    pub cross_node_gbytes_per_s: f64,
    /// Fixed cost of a cross-node handoff (ms).
    pub cross_node_latency_ms: f64,
    /// Split only when the saving exceeds the handoff by more than this (ms).
    pub min_gain_ms: f64,
    /// KV bytes of one block for requests whose namespace layout is unknown (given by
    /// `namespace_id` only); none: such requests are never split.
    pub default_block_bytes: Option<u64>,
}

impl Default for SplitConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            prefill_roles: vec!["prefill".into(), "both".into()],
            prefill_ms_per_token: 0.05,
            prefill_ms_per_block: None,
            same_node_gbytes_per_s: 20.0,
            same_node_latency_ms: 0.2,
            cross_node_gbytes_per_s: 5.0,
            cross_node_latency_ms: 1.0,
            min_gain_ms: 0.0,
            default_block_bytes: None,
        }
    }
}

impl SplitConfig {
    fn validate(&self) -> Result<(), CoreError> {
        let finite =
            [self.prefill_ms_per_token, self.same_node_latency_ms, self.cross_node_latency_ms, self.min_gain_ms];
        let positive = [self.same_node_gbytes_per_s, self.cross_node_gbytes_per_s];
        if finite.iter().any(|w| !w.is_finite() || *w < 0.0)
            || positive.iter().any(|w| !w.is_finite() || *w <= 0.0)
            || self.prefill_ms_per_block.is_some_and(|b| !b.is_finite() || b < 0.0)
        {
            return Err(CoreError::Config("split: times must be finite and >= 0, throughputs finite and > 0".into()));
        }
        Ok(())
    }
}

/// The Mooncake RFC #1403 indexer API (`/register`, `/query`; docs/router.md section 7).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IndexerConfig {
    /// Serve the indexer API (`/register` makes the router subscribe to any endpoint it is
    /// given: turn it off where the HTTP port is reachable by untrusted clients).
    pub enabled: bool,
    /// Most publishers registered at once through `POST /register`.
    pub max_registrations: usize,
}

impl Default for IndexerConfig {
    fn default() -> Self {
        Self { enabled: true, max_registrations: 1024 }
    }
}

/// A namespace by value: the fields of [`kvproto::Namespace`] plus the key scheme. Used in the
/// config (`[[namespaces]]`, with a `name`) and inline in `POST /route`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceSpec {
    #[serde(default)]
    pub name: Option<String>,
    pub model_id: String,
    pub num_layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype: String,
    pub tokens_per_block: u32,
    #[serde(default = "default_layout_kind")]
    pub layout_kind: String,
    #[serde(default)]
    pub tenant_salt_hex: Option<String>,
    #[serde(default)]
    pub adapter_id: Option<String>,
    #[serde(default)]
    pub extra_hex: Option<String>,
    /// `kvcached-blake3-v2` (default) or `dynamo-xxh3-1337` (vLLM engines ingested over ZMQ).
    #[serde(default = "default_scheme")]
    pub key_scheme: String,
    /// Blocks the router's index is sized for at start (0: grow as blocks come): about the
    /// blocks the cluster's engines and nodes can hold in this namespace. Costs ~30 bytes per
    /// expected block up front; saves the index's growth while it fills.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub expected_blocks: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Largest `expected_blocks` (2^31: ~64 GB of key table).
pub const MAX_EXPECTED_BLOCKS: u64 = 1 << 31;

fn default_layout_kind() -> String {
    "layer_separate".into()
}
fn default_scheme() -> String {
    KEY_SCHEME_KVCACHED.into()
}

/// How keys of a namespace are computed from tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyScheme {
    /// kvcached's 128-bit keyed BLAKE3 chain.
    Kvcached,
    /// Dynamo's XXH3-64 chain, seed 1337.
    DynamoXxh3,
    /// SGLang's page hashes of the tokens, keyed in the namespace (`docs/block-keys.md` section
    /// 7): SGLang engines with kvcached's HiCache backend, vLLM engines with `kvcached.key_scheme:
    /// "sglang"`. A request with a key context is keyed by kvcached's chain, as those engines key it.
    SglangPages,
}

impl KeyScheme {
    /// Parses a scheme name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            KEY_SCHEME_KVCACHED => Some(Self::Kvcached),
            KEY_SCHEME_DYNAMO_XXH3_1337 => Some(Self::DynamoXxh3),
            KEY_SCHEME_SGLANG_PAGES => Some(Self::SglangPages),
            _ => None,
        }
    }
    /// The scheme's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kvcached => KEY_SCHEME_KVCACHED,
            Self::DynamoXxh3 => KEY_SCHEME_DYNAMO_XXH3_1337,
            Self::SglangPages => KEY_SCHEME_SGLANG_PAGES,
        }
    }
}

/// A validated namespace ready to compute keys.
#[derive(Debug, Clone)]
pub struct ResolvedNamespace {
    pub id: NamespaceId,
    pub namespace: Namespace,
    pub scheme: KeyScheme,
}

const DYNAMO_SPACE_CONTEXT: &str = "kvrouter 2026-11-30 dynamo key space v1";

impl ResolvedNamespace {
    /// The seed of the Dynamo local hashes of this namespace's requests, as Dynamo 1.6.1 seeds a
    /// request's (`kvproto::dynamo::request_seed`): from the request's adapter (a LoRA name),
    /// else the namespace's `adapter_id`, and from the request's cache salt (Dynamo's
    /// `cache_namespace`). The namespace's tenant salt is kvcached's isolation secret, not a
    /// Dynamo cache namespace: it never seeds the public hashes. 1337 for neither.
    pub fn dynamo_seed(&self, adapter: Option<&[u8]>, salt: Option<&[u8]>) -> u64 {
        kvproto::dynamo::request_seed(adapter.or(self.namespace.adapter_id.as_deref().map(str::as_bytes)), salt)
    }

    /// The keys of every full block of `tokens`.
    pub fn keys(&self, tokens: &[u32]) -> Vec<BlockKey> {
        let bs = self.namespace.layout.tokens_per_block as usize;
        match self.scheme {
            KeyScheme::Kvcached => self.namespace.block_keys(tokens),
            KeyScheme::DynamoXxh3 => kvproto::dynamo::request_sequence_hashes(tokens, bs, self.dynamo_seed(None, None))
                .into_iter()
                .map(key_from_u64)
                .collect(),
            KeyScheme::SglangPages => {
                let hashes = kvproto::engine_hash::sglang_page_hashes_le(bs, &kvproto::tokens_to_le(tokens));
                kvproto::engine_hash::engine_hash_keys(
                    &self.namespace.fingerprint(),
                    kvproto::HashScheme::Sglang,
                    &hashes,
                )
            }
        }
    }

    /// The keys of every full block of `tokens` for a request with the key context `ctx`
    /// (`docs/block-keys.md` section 6). In the Dynamo scheme the adapter (the request's, else
    /// the namespace's) and the request's cache salt seed the local hashes as Dynamo 1.6.1 does
    /// ([`Self::dynamo_seed`]); blocks
    /// from the first one that binds a multimodal input or a per-block extra have no Dynamo
    /// hash (a daemon's export leaves them out), so the keys stop before it.
    pub fn keys_in(&self, tokens: &[u32], ctx: Option<&kvproto::KeyContext>) -> Vec<BlockKey> {
        let Some(ctx) = ctx else { return self.keys(tokens) };
        let bs = self.namespace.layout.tokens_per_block as usize;
        match self.scheme {
            KeyScheme::Kvcached | KeyScheme::SglangPages => {
                kvproto::context_keys(&self.namespace.fingerprint(), bs, tokens, ctx)
            }
            KeyScheme::DynamoXxh3 => {
                let blocks = tokens.len() / bs.max(1);
                let upto = ctx.first_per_block_extra(bs, blocks).unwrap_or(blocks);
                let adapter = ctx.adapter.as_ref().map(|a| a.name.as_bytes());
                let seed = self.dynamo_seed(adapter, ctx.cache_salt.as_deref());
                kvproto::dynamo::request_sequence_hashes(&tokens[..upto * bs], bs, seed)
                    .into_iter()
                    .map(key_from_u64)
                    .collect()
            }
        }
    }

    /// Block size in tokens.
    pub fn tokens_per_block(&self) -> u32 {
        self.namespace.layout.tokens_per_block
    }
}

impl NamespaceSpec {
    /// Validates and computes the namespace id (for the Dynamo scheme, an id derived from the
    /// namespace fingerprint with a different context, so the two key spaces never mix).
    pub fn resolve(&self) -> Result<ResolvedNamespace, CoreError> {
        let hex_opt = |s: &Option<String>, what: &str| -> Result<Option<Vec<u8>>, CoreError> {
            s.as_ref().map(|h| hex::decode(h).map_err(|_| CoreError::Invalid(format!("{what}: not hex")))).transpose()
        };
        let layout = KvLayout::from_names(
            self.num_layers,
            self.kv_heads,
            self.head_dim,
            &self.dtype,
            self.tokens_per_block,
            &self.layout_kind,
        )?;
        let namespace = Namespace {
            model_id: self.model_id.clone(),
            layout,
            tenant_salt: hex_opt(&self.tenant_salt_hex, "tenant_salt_hex")?,
            adapter_id: self.adapter_id.clone(),
            extra: hex_opt(&self.extra_hex, "extra_hex")?,
        };
        namespace.validate()?;
        let scheme = KeyScheme::parse(&self.key_scheme)
            .ok_or_else(|| CoreError::Invalid(format!("unknown key scheme {:?}", self.key_scheme)))?;
        let id = match scheme {
            // The daemon's own namespace: its blocks' keys are of either kind.
            KeyScheme::Kvcached | KeyScheme::SglangPages => namespace.id(),
            KeyScheme::DynamoXxh3 => {
                let full = blake3::derive_key(DYNAMO_SPACE_CONTEXT, &namespace.fingerprint().0);
                let mut id = [0u8; 16];
                id.copy_from_slice(&full[..16]);
                NamespaceId(id)
            }
        };
        Ok(ResolvedNamespace { id, namespace, scheme })
    }
}

/// A vLLM engine whose KV events the router subscribes to (ZMQ SUB).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VllmSource {
    /// The engine's ZMQ PUB endpoint, e.g. `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// Topic prefix to subscribe to (vLLM's default topic is empty).
    #[serde(default)]
    pub topic: String,
    /// The worker the engine is (its G1 blocks' holder).
    pub worker: String,
    /// The node it runs on (holder of blocks it reports with a CPU / disk medium).
    pub node: String,
    /// Name of a `[[namespaces]]` entry with `key_scheme = "dynamo-xxh3-1337"` and the engine's
    /// block size.
    pub namespace: String,
    /// Where requests for this worker go.
    #[serde(default)]
    pub address: String,
    #[serde(default)]
    pub role: Option<String>,
    /// The engine's replay endpoint (`replay_endpoint` of its `--kv-events-config`, e.g.
    /// `tcp://10.0.0.5:5558`): batches missed on the PUB socket are asked for there. Without
    /// one a gap is only reported.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Seconds without a message after which the router connects afresh (a dropped connection
    /// is otherwise not noticed: see `kvrouter::zmq::run_source_in`).
    #[serde(default = "default_idle_reconnect_s")]
    pub idle_reconnect_s: f64,
}

/// Default of [`VllmSource::idle_reconnect_s`] (also for sources registered through the
/// indexer API).
pub const DEFAULT_IDLE_RECONNECT_S: f64 = 5.0;

/// Shortest accepted [`VllmSource::idle_reconnect_s`].
pub const MIN_IDLE_RECONNECT_S: f64 = 2.0;

/// Longest accepted [`VllmSource::idle_reconnect_s`].
pub const MAX_IDLE_RECONNECT_S: f64 = 3600.0;

fn default_idle_reconnect_s() -> f64 {
    DEFAULT_IDLE_RECONNECT_S
}

/// Everything the router is configured with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    pub mode: RoutingMode,
    pub weights: CostWeights,
    pub health: HealthConfig,
    pub split: SplitConfig,
    pub indexer: IndexerConfig,
    /// Prefetch hints to the chosen node's daemon (docs/router.md section 4, "Prefetch").
    pub prefetch: PrefetchConfig,
    /// Approximate mode: how long a routing decision is remembered (s).
    pub approx_ttl_s: f64,
    /// Approximate mode: most (block, worker) decisions remembered; the oldest go first.
    pub approx_max_blocks: usize,
    /// Predictions awaiting an outcome report; the oldest are forgotten beyond this.
    pub max_pending_predictions: usize,
    /// Events asked for per replay call.
    pub replay_batch: usize,
    /// Bound on one replay or snapshot call to a publisher (ms).
    pub recovery_timeout_ms: u64,
    /// Largest accepted `POST /events` or `POST /route` body (bytes).
    pub max_body_bytes: usize,
    /// Seed of the tie-breaking RNG (none: from the OS).
    pub seed: Option<u64>,
    pub namespaces: Vec<NamespaceSpec>,
    pub vllm_sources: Vec<VllmSource>,
    /// Who may use the API (HTTP and gRPC, one listener): TLS, client certificates, bearer
    /// tokens, grants of namespaces (docs/router.md section 8). A listener on a non-loopback
    /// address needs credentials here, or `open = true`.
    pub auth: kvnet::AuthConfig,
    /// Bounds on the API's listener: connections, header and idle timeouts, HTTP/2 streams.
    pub http_limits: kvnet::HttpLimits,
    /// What the router presents to daemons' recovery routes (`/events/replay`,
    /// `/events/snapshot`): the CA their certificates chain to, a client certificate, a token.
    pub daemon_auth: kvnet::ClientAuthConfig,
    /// The NATS JetStream event plane to read daemons' reports from (`[nats]`; no servers: only
    /// `POST /events`, which stays open beside it).
    pub nats: kvnet::bus::NatsConfig,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            mode: RoutingMode::Events,
            weights: CostWeights::default(),
            health: HealthConfig::default(),
            split: SplitConfig::default(),
            prefetch: PrefetchConfig::default(),
            indexer: IndexerConfig::default(),
            approx_ttl_s: 120.0,
            approx_max_blocks: 1 << 20,
            max_pending_predictions: 100_000,
            replay_batch: 10_000,
            recovery_timeout_ms: 2_000,
            max_body_bytes: 64 << 20,
            seed: None,
            namespaces: Vec::new(),
            vllm_sources: Vec::new(),
            auth: kvnet::AuthConfig::default(),
            http_limits: kvnet::HttpLimits::default(),
            daemon_auth: kvnet::ClientAuthConfig::default(),
            nats: kvnet::bus::NatsConfig::default(),
        }
    }
}

impl RouterConfig {
    /// Parses a TOML configuration.
    pub fn from_toml(text: &str) -> Result<Self, CoreError> {
        let c: Self = toml::from_str(text).map_err(|e| CoreError::Config(e.to_string()))?;
        c.validate()?;
        Ok(c)
    }

    /// Checks weights, thresholds and namespaces.
    pub fn validate(&self) -> Result<(), CoreError> {
        self.weights.validate()?;
        self.split.validate()?;
        if let Err((key, reason)) = self.http_limits.validate() {
            return Err(CoreError::Config(format!("http_limits.{key} {reason}")));
        }
        if self.nats.enabled() {
            self.nats.validate().map_err(|e| CoreError::Config(format!("nats: {e}")))?;
        }
        if !(self.approx_ttl_s.is_finite() && self.approx_ttl_s > 0.0) {
            return Err(CoreError::Config("approx_ttl_s must be > 0".into()));
        }
        for ns in &self.namespaces {
            if ns.name.is_none() {
                return Err(CoreError::Config(format!("namespace for model {:?} has no name", ns.model_id)));
            }
            ns.resolve().map_err(|e| CoreError::Config(e.to_string()))?;
            if ns.expected_blocks > MAX_EXPECTED_BLOCKS {
                return Err(CoreError::Config(format!(
                    "namespaces.expected_blocks of {:?}: {} is above {MAX_EXPECTED_BLOCKS}",
                    ns.name.as_deref().unwrap_or(""),
                    ns.expected_blocks
                )));
            }
        }
        for s in &self.vllm_sources {
            // The `zeromq` crate is built with TCP only (it panics on other transports).
            for (field, ep) in [("endpoint", Some(&s.endpoint)), ("replay_endpoint", s.replay_endpoint.as_ref())] {
                if let Some(ep) = ep
                    && !ep.starts_with("tcp://")
                {
                    return Err(CoreError::Config(format!(
                        "vllm source {}: {field} {ep:?} must be tcp://host:port",
                        s.endpoint
                    )));
                }
            }
            // Above 1 s: kvcached's export sends an empty batch after 1 s of quiet.
            if !(MIN_IDLE_RECONNECT_S..=MAX_IDLE_RECONNECT_S).contains(&s.idle_reconnect_s) {
                return Err(CoreError::Config(format!(
                    "vllm source {}: idle_reconnect_s must be between {MIN_IDLE_RECONNECT_S} and {} seconds, got {}",
                    s.endpoint, MAX_IDLE_RECONNECT_S, s.idle_reconnect_s
                )));
            }
            let ns = self.namespaces.iter().find(|n| n.name.as_deref() == Some(&s.namespace));
            match ns {
                Some(n) if n.key_scheme == KEY_SCHEME_DYNAMO_XXH3_1337 => {}
                Some(_) => {
                    return Err(CoreError::Config(format!(
                        "vllm source {}: namespace {} must use key_scheme = \"{KEY_SCHEME_DYNAMO_XXH3_1337}\"",
                        s.endpoint, s.namespace
                    )));
                }
                None => {
                    return Err(CoreError::Config(format!(
                        "vllm source {}: unknown namespace {}",
                        s.endpoint, s.namespace
                    )));
                }
            }
        }
        Ok(())
    }

    /// The configured namespace called `name`.
    pub fn namespace(&self, name: &str) -> Option<&NamespaceSpec> {
        self.namespaces.iter().find(|n| n.name.as_deref() == Some(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = r#"
[[namespaces]]
name = "v"
model_id = "m"
num_layers = 2
kv_heads = 2
head_dim = 64
dtype = "bf16"
tokens_per_block = 16
key_scheme = "dynamo-xxh3-1337"
[[vllm_sources]]
endpoint = "tcp://127.0.0.1:5557"
worker = "w"
node = "n"
namespace = "v"
"#;

    #[test]
    fn vllm_source_defaults_and_checks() {
        let c = RouterConfig::from_toml(SOURCE).map_err(|e| e.to_string());
        let s = c.as_ref().map(|c| c.vllm_sources[0].clone());
        assert_eq!(s.as_ref().map(|s| s.idle_reconnect_s), Ok(DEFAULT_IDLE_RECONNECT_S));
        assert_eq!(s.as_ref().map(|s| s.replay_endpoint.clone()), Ok(None));
        let with = |extra: &str| RouterConfig::from_toml(&format!("{SOURCE}{extra}\n")).map_err(|e| e.to_string());
        let replay = with("replay_endpoint = \"tcp://127.0.0.1:5558\"");
        assert_eq!(replay.map(|c| c.vllm_sources[0].replay_endpoint.clone()), Ok(Some("tcp://127.0.0.1:5558".into())));
        for bad in
            ["idle_reconnect_s = 0.0", "idle_reconnect_s = 1.0", "idle_reconnect_s = nan", "idle_reconnect_s = 1e300"]
        {
            let e = with(bad).err().unwrap_or_default();
            assert!(e.contains("idle_reconnect_s"), "{bad}: {e}");
        }
        let e = with("replay_endpoint = \"ipc:///tmp/x\"").err().unwrap_or_default();
        assert!(e.contains("replay_endpoint") && e.contains("tcp://"), "{e}");
        let e = RouterConfig::from_toml(&SOURCE.replace("tcp://127.0.0.1:5557", "ipc:///tmp/y")).err();
        assert!(e.map(|e| e.to_string()).unwrap_or_default().contains("tcp://"));
        let other_scheme = SOURCE.replace("key_scheme = \"dynamo-xxh3-1337\"", "");
        let e = RouterConfig::from_toml(&other_scheme).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("key_scheme"), "{e}");
    }

    /// A namespace in SGLang's page scheme keys requests as SGLang's backend and vLLM's
    /// connector with `kvcached.key_scheme: "sglang"` save them, under the daemon's own id.
    #[test]
    #[allow(clippy::unwrap_used)]
    fn sglang_pages_scheme_keys_as_the_engines_save() {
        let c = RouterConfig::from_toml(&SOURCE.replace("dynamo-xxh3-1337", KEY_SCHEME_SGLANG_PAGES).replace(
            "[[vllm_sources]]\nendpoint = \"tcp://127.0.0.1:5557\"\nworker = \"w\"\nnode = \"n\"\nnamespace = \"v\"\n",
            "",
        ))
        .unwrap();
        let ns = c.namespaces[0].resolve().unwrap();
        assert_eq!(ns.scheme, KeyScheme::SglangPages);
        assert_eq!(ns.id, ns.namespace.id());
        let tokens: Vec<u32> = (0..40).collect();
        let derived = kvproto::EngineHashes { scheme: kvproto::HashScheme::Sglang, hashes: vec![] };
        let want = derived.keys_le(&ns.namespace.fingerprint(), 16, &kvproto::tokens_to_le(&tokens)).unwrap();
        assert_eq!(ns.keys(&tokens), want);
        assert_eq!(want.len(), 2);
        // With a key context the engines key by kvcached's chain.
        let ctx = kvproto::KeyContext { cache_salt: Some(b"s".to_vec()), ..Default::default() };
        assert_eq!(
            ns.keys_in(&tokens, Some(&ctx)),
            kvproto::context_keys(&ns.namespace.fingerprint(), 16, &tokens, &ctx)
        );
    }

    /// `expected_blocks` is read, and an impossible size is refused with the field's name.
    #[test]
    fn expected_blocks_is_read_and_bounded() {
        let with =
            |n: u64| SOURCE.replace("tokens_per_block = 16", &format!("tokens_per_block = 16\nexpected_blocks = {n}"));
        let c = RouterConfig::from_toml(&with(100_000)).map_err(|e| e.to_string());
        assert_eq!(c.as_ref().map(|c| c.namespaces[0].expected_blocks), Ok(100_000));
        // (That a router sizes the namespace's index from it: kvrouter's `router.rs` tests.)
        let e =
            RouterConfig::from_toml(&with(MAX_EXPECTED_BLOCKS + 1)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("expected_blocks"), "{e}");
        assert!(RouterConfig::from_toml(SOURCE).is_ok_and(|c| c.namespaces[0].expected_blocks == 0));
    }

    /// `[http_limits]` is read, and a bound that cannot serve is refused with its key.
    #[test]
    fn http_limits_are_read_and_checked() {
        let c = RouterConfig::from_toml("[http_limits]\nmax_connections = 8\n").map_err(|e| e.to_string());
        assert_eq!(c.map(|c| (c.http_limits.max_connections, c.http_limits.header_timeout_ms)), Ok((8, 30_000)));
        for (bad, key) in [
            ("max_connections = 0", "http_limits.max_connections"),
            ("header_timeout_ms = 5", "http_limits.header_timeout_ms"),
            ("max_concurrent_streams = 0", "http_limits.max_concurrent_streams"),
        ] {
            let e = RouterConfig::from_toml(&format!("[http_limits]\n{bad}\n")).err().map(|e| e.to_string());
            assert!(e.as_deref().unwrap_or_default().contains(key), "{bad}: {e:?}");
        }
    }
}
