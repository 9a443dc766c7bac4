//! `kvrouter-core`: what the cluster router decides, with no I/O and no async runtime, so that
//! benchmarks (and other routers) can link it alone.
//!
//! # Layout
//! - [`config`]: the router's configuration (TOML): cost weights, health thresholds, namespace
//!   specs, vLLM sources, the split model's starting values.
//! - [`context`]: a route request's key context (adapter, cache salt, multimodal inputs).
//! - [`index`]: the block index (runs of blocks with one holder set, key -> holders per tier),
//!   holder interning; [`keytable`]: its key -> (run, offset) table.
//! - [`cost`]: the cost model: per-tier prefix matching, cost terms, choice (ties, temperature).
//! - [`approx`]: approximate mode (remembers its own decisions for a TTL).
//! - [`split`]: the prefill/decode split decision (only when the handoff pays).
//! - [`error`]: the crate's error enum, [`CoreError`].
//!
//! The adapters (HTTP, gRPC, ZMQ ingest, the indexer API) and the locked state live in
//! `kvrouter`.

pub mod approx;
pub mod config;
pub mod context;
pub mod cost;
pub mod error;
pub mod index;
pub mod keytable;
pub mod split;

pub use config::{CostWeights, HealthConfig, NamespaceSpec, RouterConfig, RoutingMode};
pub use error::CoreError;
pub use split::SplitDecision;
