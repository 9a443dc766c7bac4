//! `/metrics` (Prometheus text) and `/healthz` over HTTP.

use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::daemon::Daemon;

/// The process-wide Prometheus recorder (installed once; several daemons in one test process
/// share it).
pub fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!("a metrics recorder was already installed; /metrics shows only this handle's view");
        }
        handle
    })
}

#[derive(Clone)]
struct HttpState {
    daemon: Arc<Daemon>,
    queue_capacity: usize,
}

async fn metrics_text() -> String {
    prometheus().render()
}

async fn healthz(State(s): State<HttpState>) -> (StatusCode, String) {
    let h = s.daemon.health(s.queue_capacity);
    if h.ok {
        (StatusCode::OK, "ok\n".into())
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, format!("degraded: {}\n", h.reasons.join("; ")))
    }
}

/// The HTTP routes.
pub fn router(daemon: Arc<Daemon>, queue_capacity: usize) -> Router {
    let log = daemon.reports.log();
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(healthz))
        .with_state(HttpState { daemon, queue_capacity });
    // Routers that saw a gap in this daemon's event ids replay from here.
    match log {
        Some(log) => app.merge(kvrouter::recovery::recovery_routes(log)),
        None => app,
    }
}
