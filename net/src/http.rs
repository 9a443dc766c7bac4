//! HTTP endpoints and clients through kvnet (feature `http`).
//!
//! Serving: [`serve`] runs an axum app behind a [`Guard`], within [`HttpLimits`] (connection
//! cap, header and idle timeouts, HTTP/2 stream cap: `http_serve.rs`). Connections are accepted by a
//! [`GuardedListener`], which runs each TLS handshake in a task of its own, bounded in time and
//! in number (the oldest closed for a newcomer), so a slow or hostile client never holds the
//! accept loop; the verified client certificate travels with the connection ([`PeerInfo`]).
//! [`protect`] then authenticates every request (a bearer token from `authorization`, else the
//! certificate) and hands the [`Identity`] to handlers as a request extension; probe paths
//! ([`PROBE_PATHS`]) stay open. A refused HTTP request gets 401 and a text body saying what to
//! present; a refused gRPC request (same listener, `content-type: application/grpc`) gets
//! `grpc-status` 16 (UNAUTHENTICATED).
//!
//! Clients: [`HttpClient`] presents a [`Connector`]'s credentials (its TLS configuration, its
//! token as `authorization: Bearer ...`), both reloaded when their files change.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::connect_info::ConnectInfo;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rustls::ClientConfig;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::net::TcpListener;

use crate::config::{ClientAuthConfig, HttpLimits};
use crate::connector::Connector;
use crate::error::NetError;
use crate::guard::{Guard, Identity, Namespaces, bearer_of};

/// The HTTP client library [`HttpClient`] builds on (for callers that need its types).
pub use reqwest;

/// Paths served without credentials: liveness and readiness probes (a kubelet sends none).
pub const PROBE_PATHS: &[&str] = &["/healthz", "/livez"];

/// What an HTTP endpoint offers over TLS: HTTP/2 (gRPC) and HTTP/1.1.
pub const SERVER_ALPN: &[&[u8]] = &[b"h2", b"http/1.1"];

/// How long a client may take over its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long an [`HttpClient`] keeps an idle connection for its next request.
const POOL_IDLE: Duration = Duration::from_secs(20);

/// What an [`HttpClient`] offers over TLS: it is built without HTTP/2.
const CLIENT_ALPN: &[&[u8]] = &[b"http/1.1"];

pub use crate::http_accept::{GuardedListener, PeerInfo};
pub use crate::http_serve::describe_metrics;

/// Serves `app` on `listener` through `guard` until `shutdown`, within the default
/// [`HttpLimits`]: see [`serve_with`].
pub async fn serve(
    listener: TcpListener,
    guard: Arc<Guard>,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, guard, app, &HttpLimits::default(), shutdown).await
}

/// Serves `app` on `listener` through `guard` until `shutdown`: handshakes by
/// [`GuardedListener`] (at most [`HANDSHAKE_TIMEOUT`] each), every request but
/// [`PROBE_PATHS`] authenticated by [`protect`], connections and slow clients bounded by
/// `limits` (`http_serve.rs`).
pub async fn serve_with(
    listener: TcpListener,
    guard: Arc<Guard>,
    app: axum::Router,
    limits: &HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = GuardedListener::new(listener, Arc::clone(&guard), HANDSHAKE_TIMEOUT);
    let app = protect(app, guard, PROBE_PATHS);
    crate::http_serve::serve_connections(listener, app, limits, shutdown).await
}

#[derive(Clone)]
struct Protect {
    guard: Arc<Guard>,
    open: &'static [&'static str],
}

/// `app` with every request authenticated by `guard`: the [`Identity`] goes into the request's
/// extensions; a request without acceptable credentials is refused ([`refuse`], 401), except
/// on the `open` paths, which are served to anyone (without an identity). The certificate is
/// the connection's ([`PeerInfo`], when served through a [`GuardedListener`]).
pub fn protect(app: axum::Router, guard: Arc<Guard>, open: &'static [&'static str]) -> axum::Router {
    app.layer(axum::middleware::from_fn_with_state(Protect { guard, open }, authenticate))
}

async fn authenticate(State(p): State<Protect>, mut req: Request, next: Next) -> Response {
    let cert = req.extensions().get::<ConnectInfo<PeerInfo>>().map(|c| c.0.cert.clone()).unwrap_or_default();
    let bearer = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer_of);
    match p.guard.authenticate(&cert, bearer) {
        Ok(who) => {
            req.extensions_mut().insert(who);
            next.run(req).await
        }
        Err(_) if p.open.contains(&req.uri().path()) => next.run(req).await,
        Err(refusal) => refuse(req.headers(), StatusCode::UNAUTHORIZED, &refusal.to_string()),
    }
}

#[derive(Clone)]
struct AllNamespaces {
    endpoint: Arc<str>,
    what: &'static str,
}

/// `app`'s routes served only to identities granted every namespace (`"*"`, or an endpoint
/// with no grants): for routes whose answers or effects span namespaces (an event stream, a
/// snapshot, a registry). Others get 403 saying so; `what` completes "<identity> may not ...".
pub fn require_all_namespaces(app: axum::Router, endpoint: &str, what: &'static str) -> axum::Router {
    app.route_layer(axum::middleware::from_fn_with_state(
        AllNamespaces { endpoint: endpoint.into(), what },
        all_namespaces,
    ))
}

async fn all_namespaces(State(a): State<AllNamespaces>, req: Request, next: Next) -> Response {
    match req.extensions().get::<Identity>() {
        Some(who) if who.namespaces != Namespaces::All => refuse(
            req.headers(),
            StatusCode::FORBIDDEN,
            &format!("{}: {} may not {}: that needs a grant of every namespace (\"*\")", a.endpoint, who.name, a.what),
        ),
        // No identity: served without `protect`, i.e. without authentication.
        _ => next.run(req).await,
    }
}

/// Whether a request is gRPC (answered with a gRPC status rather than an HTTP one).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|c| c.starts_with("application/grpc"))
}

/// A refusal: to gRPC requests a trailers-only answer with `grpc-status` 16 (UNAUTHENTICATED,
/// for `status` 401) or 7 (PERMISSION_DENIED, otherwise) and `why` as `grpc-message`; to
/// others `status` with `why` as a text body (and `www-authenticate: Bearer` with 401).
pub fn refuse(headers: &HeaderMap, status: StatusCode, why: &str) -> Response {
    if is_grpc(headers) {
        let code = if status == StatusCode::UNAUTHORIZED { "16" } else { "7" };
        let mut r = Response::new(axum::body::Body::empty());
        let h = r.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        h.insert("grpc-status", HeaderValue::from_static(code));
        if let Ok(v) = HeaderValue::from_str(&grpc_message(why)) {
            h.insert("grpc-message", v);
        }
        return r;
    }
    let mut r = (status, format!("{why}\n")).into_response();
    if status == StatusCode::UNAUTHORIZED {
        r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    r
}

/// `grpc-message` encoding: printable ASCII but `%` as is, every other byte as `%XX`.
fn grpc_message(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

struct Built {
    tls: Option<Arc<ClientConfig>>,
    client: reqwest::Client,
}

/// An HTTP client presenting a [`Connector`]'s credentials: its TLS configuration for
/// `https://` URLs (the server's certificate must carry the URL's host) and its token as
/// `authorization: Bearer ...` on every request. Both are reloaded when their files change: the
/// client is rebuilt when the TLS configuration is.
pub struct HttpClient {
    connector: Connector,
    timeout: Duration,
    built: parking_lot::Mutex<Built>,
}

impl fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpClient").field("connector", &self.connector).field("timeout", &self.timeout).finish()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// TLS that trusts nothing: what a client without `tls_ca` has, so that an `https://` URL
/// never reaches a server through some default trust store.
fn trusts_nothing() -> Result<ClientConfig, NetError> {
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| NetError::Tls(e.to_string()))?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth())
}

/// An error with its sources (reqwest's own message is only "error sending request").
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        out.push_str(": ");
        out.push_str(&s.to_string());
        next = s.source();
    }
    out
}

/// The start of a body, for an error message.
fn snippet(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    match text.char_indices().nth(300) {
        Some((i, _)) => format!("{}...", &text[..i]),
        None => text.to_string(),
    }
}

impl HttpClient {
    /// A client with the credentials of `cfg`; each request is bounded by `timeout`.
    /// `tls_server_name` is refused: the HTTP client checks the URL's host.
    pub fn new(cfg: &ClientAuthConfig, timeout: Duration) -> Result<Self, NetError> {
        if let Some(n) = &cfg.tls_server_name {
            return Err(NetError::Config(format!(
                "tls_server_name = {n:?}: an HTTP client checks the server's certificate against the host of the \
                 URL it calls; put that name in the URL (or the certificate) instead"
            )));
        }
        Self::with_connector(Connector::new(cfg, CLIENT_ALPN)?, timeout)
    }

    /// A client without credentials (plain `http://` only).
    pub fn plain(timeout: Duration) -> Result<Self, NetError> {
        Self::with_connector(Connector::plain(), timeout)
    }

    fn with_connector(connector: Connector, timeout: Duration) -> Result<Self, NetError> {
        let tls = connector.client_config();
        let client = Self::build(tls.as_ref(), timeout)?;
        Ok(Self { connector, timeout, built: parking_lot::Mutex::new(Built { tls, client }) })
    }

    fn build(tls: Option<&Arc<ClientConfig>>, timeout: Duration) -> Result<reqwest::Client, NetError> {
        let tls = match tls {
            Some(c) => (**c).clone(),
            None => trusts_nothing()?,
        };
        reqwest::Client::builder()
            .timeout(timeout)
            // Below the servers' header timeout (30 s by default), which closes keep-alive
            // connections idle that long: the client lets go of them first.
            .pool_idle_timeout(POOL_IDLE)
            .tls_backend_preconfigured(tls)
            .build()
            .map_err(|e| NetError::Http(format!("cannot build an HTTP client: {}", chain(&e))))
    }

    /// Whether `https://` URLs can be called (`tls_ca` is configured).
    pub fn tls(&self) -> bool {
        self.connector.tls()
    }

    /// The client for the current TLS configuration (rebuilt when its files changed).
    fn client(&self) -> Result<reqwest::Client, NetError> {
        let tls = self.connector.client_config();
        let mut b = self.built.lock();
        let same = match (&b.tls, &tls) {
            (Some(a), Some(c)) => Arc::ptr_eq(a, c),
            (None, None) => true,
            _ => false,
        };
        if !same {
            // Built under the lock: rare, and concurrent callers must not build it twice.
            b.client = Self::build(tls.as_ref(), self.timeout)?;
            b.tls = tls;
        }
        Ok(b.client.clone())
    }

    /// A request to `url` carrying the credentials.
    pub fn request(&self, method: reqwest::Method, url: &str) -> Result<reqwest::RequestBuilder, NetError> {
        if url.starts_with("https://") && !self.connector.tls() {
            return Err(NetError::Config(format!(
                "{url}: an https:// URL needs tls_ca (the CA the server's certificate chains to)"
            )));
        }
        let mut rb = self.client()?.request(method, url);
        if let Some(a) = self.connector.authorization() {
            rb = rb.header(reqwest::header::AUTHORIZATION, a);
        }
        Ok(rb)
    }

    /// Sends `rb`; the body of a success, or an error naming `url`, the status and the start of
    /// the body (which says why a request was refused).
    async fn send(url: &str, rb: reqwest::RequestBuilder) -> Result<Vec<u8>, NetError> {
        let resp = rb.send().await.map_err(|e| NetError::Http(format!("{url}: {}", chain(&e))))?;
        let status = resp.status();
        let body = resp.bytes().await.map_err(|e| NetError::Http(format!("{url}: {}", chain(&e))))?;
        if !status.is_success() {
            return Err(NetError::Http(format!("{url}: status {status}: {}", snippet(&body))));
        }
        Ok(body.to_vec())
    }

    /// `GET url`, its JSON answer.
    pub async fn get_json<T: DeserializeOwned>(&self, url: &str) -> Result<T, NetError> {
        let body = Self::send(url, self.request(reqwest::Method::GET, url)?).await?;
        serde_json::from_slice(&body)
            .map_err(|e| NetError::Http(format!("{url}: the answer is not the JSON expected: {e}")))
    }

    /// `POST url` with `body` as JSON; success or why not.
    pub async fn post_json<B: Serialize + ?Sized>(&self, url: &str, body: &B) -> Result<(), NetError> {
        let bytes =
            serde_json::to_vec(body).map_err(|e| NetError::Http(format!("{url}: cannot encode the body: {e}")))?;
        let rb = self.request(reqwest::Method::POST, url)?.header(reqwest::header::CONTENT_TYPE, "application/json");
        Self::send(url, rb.body(bytes)).await.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_messages_are_percent_encoded() {
        assert_eq!(grpc_message("a b%c\né"), "a b%25c%0A%C3%A9");
    }
}
