//! `kvrouter`: the cluster router. Consumes hit reports (per-tier block events and load) from
//! kvcached daemons and vLLM engines, indexes them, and places each request on the worker with
//! the lowest cost: prefill left after crediting cached blocks tier by tier, plus load.
//!
//! # Layout
//! - [`cli`]: the command line; `bin/kvrouter.rs` calls it.
//! - `kvrouter_core` (re-exported: [`config`], [`index`], [`keytable`], [`cost`], [`approx`],
//!   [`split`]): what the router decides, with no I/O.
//! - [`state`]: the locked state: workers, publishers, event-id tracking and gaps, loads,
//!   predictions, housekeeping.
//! - [`router`]: [`Router`]: route, ingest, recovery, health, metrics.
//! - [`query`]: prefix matches per medium and holder (for the indexer API), mismatch conditions.
//! - [`recovery`]: gap recovery from publishers (replay / snapshot) over HTTP or in process.
//! - [`health`]: degrading conditions, log-once transitions, the counters behind the metrics.
//! - [`metrics`]: the `kvrouter_*` Prometheus metrics (the `metrics` crate, one recorder per router).
//! - [`http`]: the HTTP API and [`serve`] (HTTP and gRPC on one listener).
//! - [`grpc`]: the gRPC `kvrouter.v1.Router/Route` (`router/proto/kvrouter.proto`).
//! - [`indexer_api`]: the Mooncake RFC #1403 indexer API (`/register`, `/query`, ...).
//! - [`vllm_ingest`]: vLLM engines' events into the router (translation, gaps, restarts); no I/O.
//! - [`nats`]: the NATS JetStream event plane: one ordered consumer per replica, from the
//!   stream's start, into the same ingest as `POST /events`.
//! - [`zmq`]: the ZMQ SUB sockets of vLLM sources (gaps replayed from their replay socket).
//! - [`sim`]: the simulation harness (LRU workers publishing real events to a real router).
//! - [`error`]: the crate's error enum.
//!
//! The protocol, every weight and every health signal are documented in `docs/router.md`.

pub mod cli;
pub mod error;
pub mod grpc;
pub mod health;
pub mod http;
pub mod indexer_api;
pub mod metrics;
pub mod nats;
pub mod query;
pub mod recovery;
pub mod router;
pub mod sim;
pub mod state;
pub mod vllm_ingest;
pub mod zmq;

pub use error::RouterError;
pub use http::{app, serve, serve_router};
pub use kvproto;
pub use kvproto::events::{Replay, Snapshot};
pub use kvrouter_core::config::{CostWeights, HealthConfig, NamespaceSpec, RouterConfig, RoutingMode};
pub use kvrouter_core::split::SplitDecision;
pub use kvrouter_core::{CoreError, approx, config, cost, index, keytable, split};
pub use router::{HealthReport, RouteRequest, RouteResponse, Router};
