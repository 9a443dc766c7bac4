//! `kvnet`: authentication for every TCP endpoint of kvcached and kvrouter.
//!
//! An endpoint (a daemon's peer channel, its TCP gRPC port, its HTTP port; the router's API)
//! has an [`AuthConfig`]: TLS from PEM files, client certificates verified against a CA (mutual
//! TLS), bearer tokens from a file, and grants of namespaces to identities. A [`Guard`] applies
//! it: the handshake when a connection is accepted, then [`Guard::authenticate`] per request
//! (or per connection) into an [`Identity`]. Clients present theirs through a [`Connector`].
//! Certificates, keys and tokens are reloaded when their files change.
//!
//! No endpoint is open by accident: one bound to a non-loopback address with no credentials
//! configured refuses to start unless its configuration says `open = true`.
//!
//! # Layout
//!
//! - [`config`]: [`AuthConfig`] (an endpoint), [`ClientAuthConfig`] (a client), [`Grant`],
//!   [`HttpLimits`] (an HTTP listener's bounds).
//! - [`guard`]: [`Guard`], [`Identity`], [`Refusal`]: the server side.
//! - [`connector`]: [`Connector`]: the client side.
//! - [`blocking`]: the same on blocking sockets ([`blocking::SyncStream`]), for data paths that
//!   copy between a socket and memory lent to a synchronous closure.
//! - [`tls`]: rustls configurations from PEM files; [`Stream`], plain or TLS.
//! - [`process`]: what the daemons do alike as processes: logging on stderr, SIGTERM / SIGINT,
//!   tasks aborted on drop.
//! - [`reload`]: [`reload::Reloading`], a value rebuilt when its files change.
//! - [`slots`]: [`slots::Slots`], a listener's connections; when it is full, a newcomer takes
//!   the place of the one idle longest with no request in flight (a flood of silent or slow
//!   connections cannot keep a real client out).
//! - [`http`] (feature `http`): axum serving through a [`Guard`] (TLS accepted in tasks of their
//!   own, every request authenticated, probes left open) and an HTTP client presenting a
//!   [`Connector`]'s credentials; `http_accept.rs`, its TLS accept loop; `http_serve.rs`, its
//!   connection loop within [`HttpLimits`].
//! - [`bus`]: [`bus::NatsConfig`], the NATS JetStream event plane's settings and subjects.
//! - `bus_codec` (feature `nats`): a report in binary on the stream (keys as bytes).
//! - [`nats`] (feature `nats`): connecting to it (credentials, TLS, reconnects) and its stream.
//! - [`error`]: the [`NetError`] enum.
//!
//! # Features
//!
//! `runtime` (default): everything but the configuration types and the error enum, which build
//! without it (no tokio, no rustls) for crates with no I/O such as kvrouter-core; a new module
//! that needs tokio or rustls goes behind it. `http`: the [`http`] module. `testing`: a
//! throw-away PKI.

#[cfg(feature = "runtime")]
pub mod blocking;
pub mod bus;
#[cfg(feature = "nats")]
pub mod bus_codec;
pub mod config;
#[cfg(feature = "runtime")]
pub mod connector;
pub mod error;
#[cfg(feature = "runtime")]
pub mod guard;
#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "http")]
mod http_accept;
#[cfg(feature = "http")]
mod http_serve;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "runtime")]
pub mod process;
#[cfg(feature = "runtime")]
pub mod reload;
#[cfg(feature = "runtime")]
pub mod slots;
#[cfg(feature = "testing")]
pub mod testing;
#[cfg(feature = "runtime")]
pub mod tls;

#[cfg(feature = "runtime")]
pub use blocking::SyncStream;
pub use config::{AuthConfig, ClientAuthConfig, Grant, HttpLimits};
#[cfg(feature = "runtime")]
pub use connector::Connector;
pub use error::NetError;
#[cfg(feature = "runtime")]
pub use guard::{Guard, Identity, Namespaces, PeerCert, Refusal, bearer_of};
#[cfg(feature = "runtime")]
pub use tls::Stream;
