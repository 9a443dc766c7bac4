//! What the daemon tells others about its blocks: hit reports for kvrouter and the vLLM-format
//! event stream.
//!
//! - [`changes`]: the tiers' changes, queued off their locks for one thread to pass on to the
//!   reports and the export.
//! - [`reports`]: hit reports to kvrouter (tier events, G1 from engines, load, outcomes).
//! - [`publish`]: [`publish::HttpPublisher`], shipping them through its sinks (bounded, never
//!   blocks; routers replay what it could not send from the log served by
//!   [`crate::edge::http`]): every router's `POST /events`, and
//! - [`bus`]: the NATS JetStream event plane (message ids for de-duplication, retries, parts
//!   that fit the server's payload limit).
//! - [`sink`]: [`sink::Sink`], where messages go, and the health of each target.
//! - [`vllm_export`]: the tiers' events in vLLM's ZMQ wire format, for routers that read those.
//! - `vllm_origins`: the export's records of G3 blocks, kept in a file across restarts.
//! - [`zmq_export`]: the ZMQ PUB socket (and replay socket) the export writes to.

pub mod bus;
pub mod changes;
pub mod publish;
pub mod reports;
pub mod sink;
pub mod vllm_export;
mod vllm_origins;
pub mod zmq_export;
