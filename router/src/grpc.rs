//! The gRPC API (`kvrouter.v1.Router/Route`, `router/proto/kvrouter.proto`): the same placement
//! as `POST /route`, served on the HTTP listener (requests are told apart by path, and HTTP/2
//! prior-knowledge connections are accepted next to HTTP/1.1). Errors become a `tonic::Status`
//! only here: a bad request is `INVALID_ARGUMENT`, a namespace the caller has no grant of
//! `PERMISSION_DENIED`, no worker `UNAVAILABLE`. (A caller without credentials never gets here:
//! kvnet's middleware answers `UNAUTHENTICATED`.)

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::RouterError;
use crate::config::{NamespaceSpec, RoutingMode};
use crate::cost::CostBreakdown;
use crate::router::{NamespaceRef, RouteRequest, RouteResponse, Router};
use crate::split::SplitDecision;

/// Generated messages and services of `router/proto/kvrouter.proto` (package `kvrouter.v1`).
#[allow(missing_debug_implementations, clippy::all, rust_2018_idioms)]
pub mod pb {
    tonic::include_proto!("kvrouter.v1");
}

pub use pb::router_client::RouterClient;
pub use pb::router_server::RouterServer;

/// The gRPC service over a [`Router`].
#[derive(Debug, Clone)]
pub struct RouterService {
    router: Arc<Router>,
}

impl RouterService {
    pub fn new(router: Arc<Router>) -> Self {
        Self { router }
    }

    /// The tonic server of this service (largest message: the config's `max_body_bytes`).
    pub fn server(router: Arc<Router>) -> RouterServer<Self> {
        let limit = router.config().max_body_bytes;
        RouterServer::new(Self::new(router)).max_decoding_message_size(limit)
    }
}

/// Maps a router error to a gRPC status (the only place that does).
pub fn status(e: RouterError) -> Status {
    match &e {
        RouterError::Invalid(_) | RouterError::Decode(_) => Status::invalid_argument(e.to_string()),
        RouterError::Forbidden(_) => Status::permission_denied(e.to_string()),
        RouterError::NoWorker(_) => Status::unavailable(e.to_string()),
        _ => Status::internal(e.to_string()),
    }
}

fn non_empty(v: Vec<String>) -> Option<Vec<String>> {
    if v.is_empty() { None } else { Some(v) }
}

/// The router's request for a gRPC request.
pub fn from_proto(req: pb::RouteRequest) -> RouteRequest {
    let namespace = req.namespace.map(|n| match n {
        pb::route_request::Namespace::NamespaceName(name) => NamespaceRef::Name(name),
        pb::route_request::Namespace::NamespaceSpec(s) => NamespaceRef::Spec(Box::new(NamespaceSpec {
            name: None,
            model_id: s.model_id,
            num_layers: s.num_layers,
            kv_heads: s.kv_heads,
            head_dim: s.head_dim,
            dtype: s.dtype,
            tokens_per_block: s.tokens_per_block,
            layout_kind: s.layout_kind.unwrap_or_else(|| "layer_separate".into()),
            tenant_salt_hex: s.tenant_salt_hex,
            adapter_id: s.adapter_id,
            extra_hex: s.extra_hex,
            key_scheme: s.key_scheme.unwrap_or_else(|| kvproto::events::KEY_SCHEME_KVCACHED.into()),
            expected_blocks: 0,
        })),
    });
    let by_keys = req.namespace_id.is_some() || !req.keys.is_empty();
    RouteRequest {
        tokens: namespace.is_some().then_some(req.tokens),
        namespace,
        namespace_id: req.namespace_id,
        keys: by_keys.then_some(req.keys),
        candidates: non_empty(req.candidates),
        role: req.role,
        explain: req.explain,
        split: req.split,
        prefill_candidates: non_empty(req.prefill_candidates),
        context: req.context.map(|c| kvrouter_core::context::ContextSpec {
            adapter_name: c.adapter_name,
            adapter_hash_hex: (!c.adapter_hash.is_empty()).then(|| hex::encode(&c.adapter_hash)),
            cache_salt_hex: c.cache_salt.map(hex::encode),
            mm: c
                .mm
                .into_iter()
                .map(|m| kvrouter_core::context::MmSpec {
                    hash_hex: hex::encode(m.hash),
                    offset: m.offset,
                    length: m.length,
                })
                .collect(),
            block_extras: c
                .block_extras
                .into_iter()
                .map(|b| kvrouter_core::context::BlockExtraSpec { block: b.block, data_hex: hex::encode(b.data) })
                .collect(),
        }),
    }
}

fn tiers(b: [u32; 4]) -> pb::TierBlocks {
    pb::TierBlocks { g1: b[0], g2: b[1], g3: b[2], g4: b[3] }
}

fn cost(c: CostBreakdown) -> pb::CostBreakdown {
    pb::CostBreakdown {
        total: c.total,
        prefill_blocks: c.prefill_blocks,
        prefill_term: c.prefill_term,
        decode_term: c.decode_term,
        active_term: c.active_term,
        fill_term: c.fill_term,
    }
}

fn split(s: SplitDecision) -> pb::SplitDecision {
    pb::SplitDecision {
        split: s.split,
        reason: s.reason,
        prefill_worker: s.prefill_worker,
        prefill_address: s.prefill_address,
        prefill_node: s.prefill_node,
        same_node: s.same_node,
        handoff_blocks: s.handoff_blocks,
        handoff_bytes: s.handoff_bytes,
        handoff_ms: s.handoff_ms,
        prefill_saving_ms: s.prefill_saving_ms,
        prefill_cached_blocks: Some(tiers(s.prefill_cached_blocks)),
        prefill_cost: s.prefill_cost.map(cost),
    }
}

/// The gRPC answer for a route answer.
pub fn to_proto(r: RouteResponse) -> pb::RouteResponse {
    pb::RouteResponse {
        route_id: r.route_id,
        worker: r.worker,
        address: r.address,
        node: r.node,
        blocks: r.blocks as u64,
        tokens_per_block: r.tokens_per_block,
        cached_blocks: Some(tiers(r.cached_blocks)),
        cached_tokens: r.cached_tokens,
        cost: Some(cost(r.cost)),
        mode: match r.mode {
            RoutingMode::Events => "events",
            RoutingMode::Approximate => "approximate",
        }
        .into(),
        candidates: r
            .candidates
            .into_iter()
            .map(|c| pb::Candidate {
                worker: c.worker,
                cached_blocks: Some(tiers(c.cached_blocks)),
                cost: Some(cost(c.cost)),
            })
            .collect(),
        split: r.split.map(split),
    }
}

#[tonic::async_trait]
impl pb::router_server::Router for RouterService {
    async fn route(&self, request: Request<pb::RouteRequest>) -> Result<Response<pb::RouteResponse>, Status> {
        // The caller's identity, when the API authenticates (put there by kvnet's middleware).
        let who = request.extensions().get::<kvnet::Identity>().cloned();
        let req = from_proto(request.into_inner());
        self.router.route_as(&req, who.as_ref()).map(|r| Response::new(to_proto(r))).map_err(status)
    }
}
