//! `/metrics` (Prometheus text), `/healthz` (readiness), `/livez` (liveness), and the event recovery routes routers call after a
//! gap in this daemon's hit reports: `GET /events/replay?after=N&limit=M` (the events after id N
//! from the bounded log, or "too old") and `GET /events/snapshot` (everything held now).
//!
//! Served through `metrics_auth` (`serve.rs`, [`kvnet::http::serve`]): with credentials
//! configured every route but `/healthz` (and `/livez`) needs a token or a client certificate,
//! and the recovery routes, which carry every namespace's events, an identity granted every
//! namespace.

use std::sync::{Arc, OnceLock};

use axum::Json;
use axum::Router;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::routing::get;
use kvproto::publisher::MemoryPublisher;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::daemon::Daemon;

/// The process-wide Prometheus recorder (installed once; several daemons in one test process
/// share it).
pub fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = crate::metrics_catalog::builder().build_recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!("a metrics recorder was already installed; /metrics shows only this handle's view");
        }
        crate::metrics_catalog::describe();
        handle
    })
}

/// The HTTP port's name in messages (refusals, configuration errors).
pub const ENDPOINT: &str = "kvcached HTTP ([metrics_auth])";

#[derive(Clone)]
struct HttpState {
    daemon: Arc<Daemon>,
    queue_capacity: usize,
}

async fn metrics_text() -> String {
    prometheus().render()
}

/// Readiness: 200 `ok` when this node can serve its engines, else 503 `not ready: ...`; then
/// a `warning: ...` line per degraded neighbour (they never make it 503).
async fn healthz(State(s): State<HttpState>) -> (StatusCode, String) {
    let h = s.daemon.health(s.queue_capacity);
    let (code, mut body) = if h.ok {
        (StatusCode::OK, "ok\n".to_string())
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {}\n", h.reasons.join("; ")))
    };
    for w in &h.warnings {
        body.push_str("warning: ");
        body.push_str(w);
        body.push('\n');
    }
    (code, body)
}

/// Liveness: the process answers.
async fn livez() -> &'static str {
    "alive\n"
}

/// The HTTP routes.
pub fn router(daemon: Arc<Daemon>, queue_capacity: usize) -> Router {
    let log = daemon.reports.log();
    let prefetch = crate::edge::prefetch::routes(Arc::clone(&daemon));
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(healthz))
        .route("/livez", get(livez))
        .with_state(HttpState { daemon, queue_capacity })
        .merge(prefetch);
    // Routers that saw a gap in this daemon's event ids replay from here.
    match log {
        Some(log) => app.merge(kvnet::http::require_all_namespaces(
            recovery_routes(log),
            ENDPOINT,
            "read the event replay or snapshot (they carry every namespace's events)",
        )),
        None => app,
    }
}

#[derive(Debug, serde::Deserialize)]
struct ReplayQuery {
    after: u64,
    #[serde(default = "default_limit")]
    limit: usize,
}

fn default_limit() -> usize {
    10_000
}

/// The replay and snapshot routes over `log`.
pub fn recovery_routes(log: Arc<MemoryPublisher>) -> Router {
    Router::new()
        .route(
            "/events/replay",
            get(|State(p): State<Arc<MemoryPublisher>>, Query(q): Query<ReplayQuery>| async move {
                Json(p.replay_now(q.after, q.limit.min(100_000)))
            }),
        )
        .route("/events/snapshot", get(|State(p): State<Arc<MemoryPublisher>>| async move { Json(p.snapshot_now()) }))
        .with_state(log)
}
