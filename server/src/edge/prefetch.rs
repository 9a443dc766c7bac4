//! `POST /prefetch` on the daemon's HTTP port: a router that has just placed a request on one
//! of this node's engines tells the daemon which chain the request will ask for and where else
//! it is held, and the daemon starts bringing it into G2 (from G3 / G4, or pulled from the
//! peers named) before the engine asks.
//!
//! ```json
//! {"namespace": "<32 hex>", "keys": ["<32 hex>", ...], "sources": ["10.0.0.7:7471"]}
//! ```
//! Answers at once with what it started: `{"local": N, "pulling": M}` (`pulling` 0 when no
//! engine of the namespace is attached here: nothing would load the blocks).

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use kvproto::{BlockKey, NamespaceId};
use serde::Deserialize;

use crate::daemon::{Daemon, PrefetchStarted};

/// Keys one prefetch may name.
const MAX_KEYS: usize = crate::peer::protocol::MAX_KEYS as usize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefetchRequest {
    pub namespace: String,
    pub keys: Vec<String>,
    #[serde(default)]
    pub sources: Vec<String>,
}

fn hex16(s: &str) -> Option<[u8; 16]> {
    let mut out = [0u8; 16];
    if s.len() != 32 {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

async fn prefetch(
    State(d): State<Arc<Daemon>>,
    who: Option<axum::Extension<kvnet::Identity>>,
    Json(req): Json<PrefetchRequest>,
) -> Result<Json<PrefetchStarted>, (StatusCode, String)> {
    let bad = |why: String| (StatusCode::BAD_REQUEST, why);
    if req.keys.len() > MAX_KEYS {
        return Err(bad(format!("{} keys (at most {MAX_KEYS})", req.keys.len())));
    }
    let ns = hex16(&req.namespace).map(NamespaceId).ok_or_else(|| bad("namespace: want 32 hex digits".into()))?;
    // With grants (`metrics_auth.grants`), a caller may prefetch only namespaces it may read.
    if let Some(axum::Extension(id)) = &who
        && !id.may_read(&ns)
    {
        return Err((StatusCode::FORBIDDEN, format!("{} may not read namespace {ns}", id.name)));
    }
    let keys: Vec<BlockKey> = req
        .keys
        .iter()
        .map(|k| hex16(k).map(BlockKey))
        .collect::<Option<_>>()
        .ok_or_else(|| bad("keys: want 32 hex digits each".into()))?;
    let sources: Vec<String> =
        req.sources.into_iter().take(8).map(|s| kvproto::limits::clip(&s, 256).into_owned()).collect();
    let started = tokio::task::spawn_blocking(move || d.prefetch(ns, keys, &sources))
        .await
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok(Json(started))
}

/// The prefetch route.
pub fn routes(daemon: Arc<Daemon>) -> Router {
    Router::new().route("/prefetch", post(prefetch)).with_state(daemon)
}
