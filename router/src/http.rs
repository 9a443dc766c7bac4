//! The HTTP API and [`serve`]: `POST /route`, `POST /events`, `GET /healthz`, `GET /metrics`,
//! the Mooncake RFC #1403 indexer API ([`crate::indexer_api`]), and on the same listener the gRPC
//! `kvrouter.v1.Router/Route` ([`crate::grpc`]; the server speaks HTTP/1.1 and HTTP/2 with prior
//! knowledge, and gRPC requests are told apart by their `/kvrouter.v1.Router/...` path).
//!
//! Errors are JSON `{"error": "..."}` with 400 (bad request), 403 (a namespace the caller has
//! no grant of) or 503 (no worker). `/healthz` answers 200 with `status` `ok` or `degraded` and
//! the reasons; `/healthz?strict=true` answers 503 when degraded (for probes that should fail
//! on a degraded router).
//!
//! Authentication (`[auth]`, [`kvnet`]): [`serve_router`] accepts through a guard (TLS when
//! configured, offering HTTP/2 for gRPC and HTTP/1.1) and authenticates every request but
//! `/healthz` and `/livez`; a refused request gets 401 (gRPC: UNAUTHENTICATED) saying what to
//! present. With grants, `/route` and `Route` need a grant of the request's namespace, and
//! `/events` and the indexer API, which span namespaces, a grant of every one.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Extension;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router as AxumRouter};
use kvnet::{Guard, Identity};
use kvproto::events::PublisherMessage;
use serde::Deserialize;
use tokio::net::TcpListener;

use crate::RouterError;
use crate::config::RouterConfig;
use crate::grpc::RouterService;
use crate::indexer_api::{self, IndexerApi};
use crate::router::{API_ENDPOINT, RouteRequest, Router};

/// How often housekeeping runs (stale / dead holders, expiring conditions, recovery retries).
pub const HOUSEKEEPING_PERIOD: Duration = Duration::from_millis(250);

impl IntoResponse for RouterError {
    fn into_response(self) -> Response {
        let status = match &self {
            RouterError::Invalid(_) | RouterError::Decode(_) => StatusCode::BAD_REQUEST,
            RouterError::Forbidden(_) => StatusCode::FORBIDDEN,
            RouterError::NoWorker(_) => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        (status, Json(serde_json::json!({ "error": self.to_string() }))).into_response()
    }
}

async fn route(
    State(r): State<Arc<Router>>,
    who: Option<Extension<Identity>>,
    Json(req): Json<RouteRequest>,
) -> Response {
    match r.route_as(&req, who.as_ref().map(|w| &w.0)) {
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

/// A gRPC body without a whole message is the caller's error (INVALID_ARGUMENT), not tonic's
/// INTERNAL ([`kvproto::codec::truncated_request_is_invalid`]).
async fn no_message_is_invalid(mut r: Response) -> Response {
    kvproto::codec::truncated_request_is_invalid(r.headers_mut());
    r
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
    let grpc = tonic::service::Routes::new(RouterService::server(router.clone()))
        .into_axum_router()
        .layer(axum::middleware::map_response(no_message_is_invalid));
    // Publishing and the indexer API span namespaces: with grants, only for identities granted
    // every one (a tenant must not rewrite what the index says of another's blocks).
    let indexer = if router.config().indexer.enabled {
        kvnet::http::require_all_namespaces(indexer_api::routes(indexer), API_ENDPOINT, "use the indexer API")
    } else {
        AxumRouter::new()
    };
    let publish = kvnet::http::require_all_namespaces(
        AxumRouter::new().route("/events", post(events)).with_state(router.clone()),
        API_ENDPOINT,
        "publish events (POST /events)",
    );
    AxumRouter::new()
        .route("/route", post(route))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .with_state(router)
        .merge(publish)
        .merge(indexer)
        .layer(DefaultBodyLimit::max(limit))
        .merge(grpc)
        .fallback(not_found)
}

/// Runs a router on `listener` until `shutdown` resolves: the HTTP API, housekeeping, and one
/// subscriber task per configured vLLM source. `config.auth` says who may call the API: a
/// listener on a non-loopback address with no credentials configured is refused (unless
/// `auth.open`).
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
    // Before anything starts: a configuration that cannot be served stops here.
    let addr = listener.local_addr()?;
    let guard = Guard::new(API_ENDPOINT, &router.config().auth, addr, kvnet::http::SERVER_ALPN)
        .map_err(|e| RouterError::Config(e.to_string()))?;
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
    if router.config().nats.enabled() {
        let r = router.clone();
        let cfg = router.config().nats.clone();
        let stop = stop_rx.clone();
        background.spawn(async move { crate::nats::run(r, cfg, stop).await });
    }
    for (i, src) in router.config().vllm_sources.iter().enumerate() {
        let r = router.clone();
        let src = src.clone();
        let stop = stop_rx.clone();
        background.spawn(async move { crate::zmq::run_source(r, i, src, stop).await });
    }
    tracing::info!(
        %addr,
        tls = guard.tls(),
        credentials = guard.requires_credentials(),
        "kvrouter listening (HTTP and gRPC)"
    );
    let indexer = IndexerApi::new(router.clone());
    let limits = router.config().http_limits.clone();
    let app = app_with(router, indexer.clone());
    let result = kvnet::http::serve_with(listener, Arc::new(guard), app, &limits, shutdown).await;
    let _ = stop_tx.send(true);
    indexer.shutdown().await;
    while background.join_next().await.is_some() {}
    result.map_err(RouterError::Io)
}
