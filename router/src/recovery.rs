//! Gap recovery, the router's side: the publisher API a router calls when it missed events
//! ([`RecoverySource`]), its HTTP client ([`HttpRecovery`]), and its in-process form for
//! [`MemoryPublisher`]s (tests and simulations). A daemon serves the same API over HTTP.
//!
//! A publisher exposes two calls (docs/router.md, "What a daemon publishes"):
//! - `replay(after, limit)`: the events after id `after` from its bounded log, or `TooOld` when the
//!   log no longer reaches back;
//! - `snapshot()`: everything it holds now, as of its newest event id.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use kvnet::http::HttpClient;
use kvproto::events::{Replay, Snapshot};
pub use kvproto::publisher::MemoryPublisher;

use crate::RouterError;

/// A boxed future (the trait must be object-safe).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a router asks a publisher for after a gap.
pub trait RecoverySource: Send + Sync + fmt::Debug {
    /// Events with id > `after` (at most `limit`), or [`Replay::TooOld`].
    fn replay(&self, after: u64, limit: usize) -> BoxFuture<'_, Result<Replay, RouterError>>;
    /// The publisher's full state.
    fn snapshot(&self) -> BoxFuture<'_, Result<Snapshot, RouterError>>;
}

/// The recovery API of a publisher over HTTP: `GET {base}/events/replay?after=N&limit=M` and
/// `GET {base}/events/snapshot`, both JSON, with the router's credentials for daemons
/// (`[daemon_auth]`).
#[derive(Debug, Clone)]
pub struct HttpRecovery {
    base: String,
    client: Arc<HttpClient>,
}

impl HttpRecovery {
    /// A client of the publisher at `base` (e.g. `http://10.0.0.5:9100`, or `https://...` with
    /// `daemon_auth.tls_ca`).
    pub fn new(base: impl Into<String>, client: Arc<HttpClient>) -> Self {
        Self { base: base.into().trim_end_matches('/').to_string(), client }
    }

    async fn get<T: serde::de::DeserializeOwned>(&self, url: String) -> Result<T, RouterError> {
        self.client.get_json(&url).await.map_err(|e| RouterError::Http(e.to_string()))
    }
}

impl RecoverySource for HttpRecovery {
    fn replay(&self, after: u64, limit: usize) -> BoxFuture<'_, Result<Replay, RouterError>> {
        Box::pin(self.get(format!("{}/events/replay?after={after}&limit={limit}", self.base)))
    }
    fn snapshot(&self) -> BoxFuture<'_, Result<Snapshot, RouterError>> {
        Box::pin(self.get(format!("{}/events/snapshot", self.base)))
    }
}

impl RecoverySource for MemoryPublisher {
    fn replay(&self, after: u64, limit: usize) -> BoxFuture<'_, Result<Replay, RouterError>> {
        let r = self.replay_now(after, limit);
        Box::pin(async move { Ok(r) })
    }
    fn snapshot(&self) -> BoxFuture<'_, Result<Snapshot, RouterError>> {
        let s = self.snapshot_now();
        Box::pin(async move { Ok(s) })
    }
}
