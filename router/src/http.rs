//! The HTTP API and [`serve`]: `POST /route`, `POST /events`, `GET /healthz`, `GET /metrics`,
//! the Mooncake RFC #1403 indexer API ([`crate::indexer_api`]), and on the same listener the gRPC
//! `kvrouter.v1.Router/Route` ([`crate::grpc`]; the server speaks HTTP/1.1 and HTTP/2 with prior
//! knowledge, and gRPC requests are told apart by their `/kvrouter.v1.Router/...` path).
//!
//! Errors are JSON `{"error": "..."}` with 400 (bad request) or 503 (no worker). `/healthz`
//! answers 200 with `status` `ok` or `degraded` and the reasons; `/healthz?strict=true` answers
//! 503 when degraded (for probes that should fail on a degraded router).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router as AxumRouter};
use kvproto::events::PublisherMessage;
use serde::Deserialize;
use tokio::net::TcpListener;

use crate::RouterError;
use crate::config::RouterConfig;
use crate::grpc::RouterService;
use crate::indexer_api::{self, IndexerApi};
use crate::router::{RouteRequest, Router};

/// How often housekeeping runs (stale / dead holders, expiring conditions, recovery retries).
pub const HOUSEKEEPING_PERIOD: Duration = Duration::from_millis(250);

impl IntoResponse for RouterError {
    fn into_response(self) -> Response {
        let status = match &self {
            RouterError::Invalid(_) | RouterError::Decode(_) => StatusCode::BAD_REQUEST,
            RouterError::NoWorker(_) => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        (status, Json(serde_json::json!({ "error": self.to_string() }))).into_response()
    }
}

async fn route(State(r): State<Arc<Router>>, Json(req): Json<RouteRequest>) -> Response {
    match r.route(&req) {
        Ok(resp) => Json(resp).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn events(State(r): State<Arc<Router>>, Json(msg): Json<PublisherMessage>) -> StatusCode {
    // Recovery (if the message shows a gap) runs in the background so a publisher's POST never
    // waits on its own recovery API.
    if let Some(task) = r.ingest(&msg) {
        let r2 = r.clone();
        tokio::spawn(async move { r2.recover(task).await });
    }
    StatusCode::NO_CONTENT
}

#[derive(Debug, Deserialize)]
struct HealthQuery {
    #[serde(default)]
    strict: bool,
}

async fn healthz(State(r): State<Arc<Router>>, Query(q): Query<HealthQuery>) -> Response {
    let rep = r.health();
    let status = if q.strict && rep.status != "ok" { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
    (status, Json(rep)).into_response()
}

async fn metrics(State(r): State<Arc<Router>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], r.metrics_text()).into_response()
}

async fn not_found() -> Response {
    (StatusCode::NOT_FOUND, Json(serde_json::json!({ "error": "no such endpoint" }))).into_response()
}

/// The routes of a router (HTTP, indexer API and gRPC) with a fresh indexer registry; [`serve`]
/// uses [`app_with`] to stop the registry's subscriptions at shutdown.
pub fn app(router: Arc<Router>) -> AxumRouter {
    app_with(router.clone(), IndexerApi::new(router))
}

/// The routes of a router with the given indexer registry.
pub fn app_with(router: Arc<Router>, indexer: Arc<IndexerApi>) -> AxumRouter {
    let limit = router.config().max_body_bytes;
    let grpc = tonic::service::Routes::new(RouterService::server(router.clone())).into_axum_router();
    let indexer = if router.config().indexer.enabled { indexer_api::routes(indexer) } else { AxumRouter::new() };
    AxumRouter::new()
        .route("/route", post(route))
        .route("/events", post(events))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .with_state(router)
        .merge(indexer)
        .layer(DefaultBodyLimit::max(limit))
        .merge(grpc)
        .fallback(not_found)
}

/// Runs a router on `listener` until `shutdown` resolves: the HTTP API, housekeeping, and one
/// subscriber task per configured vLLM source.
pub async fn serve(
    listener: TcpListener,
    config: RouterConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    let router = Router::new(config)?;
    serve_router(listener, router, shutdown).await
}

/// [`serve`] with a router built by the caller (to attach in-process recovery sources first).
pub async fn serve_router(
    listener: TcpListener,
    router: Arc<Router>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut background = tokio::task::JoinSet::new();
    {
        let r = router.clone();
        let mut stop = stop_rx.clone();
        background.spawn(async move {
            let mut tick = tokio::time::interval(HOUSEKEEPING_PERIOD);
            loop {
                tokio::select! {
                    _ = tick.tick() => r.housekeeping(),
                    _ = stop.changed() => return,
                }
            }
        });
    }
    for (i, src) in router.config().vllm_sources.iter().enumerate() {
        let r = router.clone();
        let src = src.clone();
        let stop = stop_rx.clone();
        background.spawn(async move { crate::zmq::run_source(r, i, src, stop).await });
    }
    tracing::info!(addr = ?listener.local_addr().ok(), "kvrouter listening (HTTP and gRPC)");
    let indexer = IndexerApi::new(router.clone());
    let result = axum::serve(listener, app_with(router, indexer.clone()))
        .with_graceful_shutdown(async move {
            shutdown.await;
        })
        .await;
    let _ = stop_tx.send(true);
    indexer.shutdown().await;
    while background.join_next().await.is_some() {}
    result.map_err(RouterError::Io)
}
