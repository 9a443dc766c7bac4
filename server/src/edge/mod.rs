//! The daemon's doors: everything a request crosses before it reaches [`crate::daemon`].
//!
//! - [`listen`]: accept loops: connections counted per uid, idle ones closed, accept errors
//!   backed off; ATTACH and LOOKUP told from gRPC by their first bytes.
//! - [`caller`]: who sent a request (uid, TCP address and certificate), the bytes of requests
//!   still arriving per uid, and `blocking()` for request work off the async path.
//! - [`h2_authority`]: stock gRPC clients' header blocks made acceptable (grpcio sends the
//!   socket path as `:authority`).
//! - [`lookup_wire`]: LOOKUP, connections on the Unix socket that carry only lookups.
//! - [`service`]: the gRPC service (tonic), each call's caller passed on; Health-only TCP,
//!   authenticated per request ([`service::TcpAuth`], `tcp_auth`).
//! - [`http`]: `/metrics`, `/healthz`, `/livez`, and the event replay / snapshot routes.
//! - [`prefetch`]: `POST /prefetch`, a router's hint to bring a chain into G2 early.

pub mod caller;
pub mod h2_authority;
pub mod http;
pub mod listen;
pub mod lookup_wire;
pub mod passthrough;
pub mod prefetch;
pub mod service;
