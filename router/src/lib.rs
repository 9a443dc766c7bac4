//! `kvrouter`: the cluster router. Consumes hit reports (per-tier block events and load) from
//! kvcached daemons and vLLM engines, indexes them, and places each request on the worker with
//! the lowest cost: prefill left after crediting cached blocks tier by tier, plus load.
//!
//! # Layout
//! - [`config`]: configuration (TOML), cost weights, health thresholds, namespace specs, vLLM sources.
//! - [`index`]: the block index (runs of blocks with one holder set, key -> holders per tier),
//!   holder interning; [`keytable`]: its key -> (run, offset) table.
//! - [`cost`]: the cost model: per-tier prefix matching, cost terms, choice (ties, temperature).
//! - [`approx`]: approximate mode (remembers its own decisions for a TTL).
//! - [`state`]: the locked state: workers, publishers, event-id tracking and gaps, loads,
//!   predictions, housekeeping.
//! - [`router`]: [`Router`]: route, ingest, recovery, health, metrics.
//! - [`recovery`]: the publisher-side recovery API (replay / snapshot), its HTTP client, and
//!   [`recovery::MemoryPublisher`], an in-process publisher.
//! - [`publish`]: [`publish::HttpPublisher`], the shipping side a daemon embeds (bounded,
//!   never blocks; routers replay what it could not send).
//! - [`health`]: degrading conditions, log-once transitions, Prometheus text.
//! - [`http`]: the HTTP API and [`serve`] (HTTP and gRPC on one listener).
//! - [`grpc`]: the gRPC `kvrouter.v1.Router/Route` (`router/proto/kvrouter.proto`).
//! - [`split`]: the prefill/decode split decision (only when the handoff pays).
//! - [`indexer_api`]: the Mooncake RFC #1403 indexer API (`/register`, `/query`, ...).
//! - [`vllm`]: vLLM's KV-event wire format (msgpack, tuple and map encodings), both directions.
//! - [`zmq`]: ZMQ SUB ingest of vLLM engines (gaps replayed from their replay socket).
//! - [`zmq_export`]: ZMQ PUB export of our events in vLLM's format, with a replay socket.
//! - [`sim`]: the simulation harness (LRU workers publishing real events to a real router).
//! - [`signals`]: SIGTERM / SIGINT handling shared by the binaries.
//! - [`error`]: the crate's error enum.
//!
//! The protocol, every weight and every health signal are documented in `docs/router.md`.

pub mod approx;
pub mod config;
pub mod cost;
pub mod error;
pub mod grpc;
pub mod health;
pub mod http;
pub mod index;
pub mod indexer_api;
pub mod keytable;
pub mod publish;
pub mod recovery;
pub mod router;
pub mod signals;
pub mod sim;
pub mod split;
pub mod state;
pub mod vllm;
pub mod zmq;
pub mod zmq_export;

pub use config::{CostWeights, HealthConfig, NamespaceSpec, RouterConfig, RoutingMode};
pub use error::RouterError;
pub use http::{app, serve, serve_router};
pub use kvproto;
pub use kvproto::events::{Replay, Snapshot};
pub use router::{HealthReport, RouteRequest, RouteResponse, Router};
pub use split::SplitDecision;
