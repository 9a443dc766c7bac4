//! Authentication on the TCP endpoints (docs/operations/security.md): the router's API (HTTP
//! and gRPC on one listener), a daemon's HTTP port (`metrics_auth`: `/metrics` and the event
//! recovery routes) and its TCP gRPC port (`tcp_auth`), with real sockets, real TLS and a
//! throw-away PKI ([`kvnet::testing::Ca`]). Every endpoint refuses a client with no
//! credentials, a certificate of a foreign CA, an expired certificate and a wrong token, and
//! one whose identity has no grant of what it asks for, each with a status that says why and
//! nothing served; a good token and a good certificate get in. End to end: a daemon (a process)
//! publishes to a router over TLS with a token, and the router, restarted, recovers the
//! daemon's blocks from its TLS recovery routes with its own token. And an endpoint on a
//! non-loopback address with nothing configured does not start: each binary says what to set.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvclient::{Client, KvMemory, synthetic_block};
use kvnet::http::{HttpClient, reqwest};
use kvnet::testing::{Ca, CertFiles};
use kvnet::{AuthConfig, ClientAuthConfig, Connector, Grant};
use kvproto::pb;
use kvproto::{KvLayout, Namespace};
use kvrouter::config::RouterConfig;
use kvrouter::grpc::{RouterClient, pb as rpb};
use kvtests::fixture::KillOnDrop;
use kvtests::router_harness::small_spec;
use serde_json::{Value, json};

/// Identity `router-a` (granted every namespace).
const TOKEN_A: &str = "router-a-token-0123456789abcdef";
/// Identity `tenant-b` (granted one namespace nobody here uses).
const TOKEN_B: &str = "tenant-b-token-0123456789abcdef";
/// A token no endpoint accepts.
const TOKEN_WRONG: &str = "nobody-token-0123456789abcdef";
const NS_OTHER: &str = "0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b";

struct Pki {
    dir: tempfile::TempDir,
    ca: Ca,
    server: CertFiles,
    /// Signed by the CA, named `router-a.kvcached` (granted every namespace).
    client: CertFiles,
    /// Signed by the CA, expired yesterday.
    expired: CertFiles,
    /// Signed by a CA no endpoint trusts.
    foreign: CertFiles,
    tokens: PathBuf,
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let server = ca.valid("server", &["localhost", "127.0.0.1"]);
    let client = ca.valid("router-a", &["router-a.kvcached"]);
    let expired = ca.expired("expired", &["router-a.kvcached"]);
    let foreign = Ca::new(dir.path(), "rogue").valid("foreign", &["router-a.kvcached"]);
    let tokens = write(dir.path(), "tokens", &format!("# identity token\nrouter-a {TOKEN_A}\ntenant-b {TOKEN_B}\n"));
    Pki { dir, ca, server, client, expired, foreign, tokens }
}

/// What a test client presents.
#[derive(Debug, Clone, Copy)]
enum Who<'a> {
    Nothing,
    Token(&'a str),
    Cert(&'a CertFiles),
}

impl Pki {
    /// An endpoint with TLS, client certificates of the CA, the tokens file, and grants:
    /// `router-a` (its token and its certificate's name) every namespace, `tenant-b` one other.
    fn endpoint(&self) -> AuthConfig {
        AuthConfig {
            tls_cert: Some(self.server.cert.clone()),
            tls_key: Some(self.server.key.clone()),
            tls_client_ca: Some(self.ca.cert.clone()),
            tokens_file: Some(self.tokens.clone()),
            grants: vec![
                Grant { identity: "router-a".into(), namespaces: vec!["*".into()] },
                Grant { identity: "router-a.kvcached".into(), namespaces: vec!["*".into()] },
                Grant { identity: "tenant-b".into(), namespaces: vec![NS_OTHER.into()] },
            ],
            ..AuthConfig::default()
        }
    }

    /// A client that trusts the CA and presents `who`.
    fn client(&self, who: Who<'_>) -> ClientAuthConfig {
        let mut c = ClientAuthConfig { tls_ca: Some(self.ca.cert.clone()), ..ClientAuthConfig::default() };
        match who {
            Who::Nothing => {}
            Who::Token(t) => c.token_file = Some(write(self.dir.path(), &format!("token-{}", &t[..8]), t)),
            Who::Cert(f) => (c.tls_cert, c.tls_key) = (Some(f.cert.clone()), Some(f.key.clone())),
        }
        c
    }

    fn http(&self, who: Who<'_>) -> HttpClient {
        HttpClient::new(&self.client(who), Duration::from_secs(10)).unwrap()
    }
}

/// `method url` with `body` (JSON) as `client` sends it: the status and body, or why no answer.
async fn call(
    client: &HttpClient,
    method: reqwest::Method,
    url: &str,
    body: Option<&Value>,
) -> Result<(u16, String), String> {
    let mut rb = client.request(method, url).map_err(|e| e.to_string())?;
    if let Some(b) = body {
        rb = rb.header("content-type", "application/json").body(serde_json::to_vec(b).unwrap());
    }
    let resp = rb.send().await.map_err(|e| error_chain(&e))?;
    let status = resp.status().as_u16();
    Ok((status, resp.text().await.unwrap_or_default()))
}

async fn get(client: &HttpClient, url: &str) -> Result<(u16, String), String> {
    call(client, reqwest::Method::GET, url, None).await
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        out = format!("{out}: {s}");
        next = s.source();
    }
    out
}

/// A refused TLS handshake: no answer at all. (In TLS 1.3 the client has finished its side of
/// the handshake when the server checks its certificate: it learns of the refusal from the
/// server's alert, or only from the connection closing under its request, whichever it reads
/// first. The server logs why.)
fn assert_handshake_refused(what: &str, r: &Result<(u16, String), String>) {
    match r {
        Ok(answer) => panic!("{what}: served {answer:?}"),
        Err(e) => assert!(!e.contains("Connection refused"), "{what}: the endpoint was not even there: {e}"),
    }
}

fn layout() -> KvLayout {
    kvtests::fixture::small_layout()
}

fn prompt(blocks: u32) -> Vec<u32> {
    kvtests::fixture::prompt(0, blocks)
}

fn router_config(auth: AuthConfig, daemon_auth: ClientAuthConfig) -> RouterConfig {
    let mut c = RouterConfig {
        namespaces: vec![small_spec("auth/model")],
        seed: Some(1),
        auth,
        daemon_auth,
        ..RouterConfig::default()
    };
    c.health.default_report_interval_ms = 200;
    c
}

/// A router serving on `addr` in this process.
struct RouterTask {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), kvrouter::RouterError>>,
}

async fn start_router(addr: &str, config: RouterConfig) -> RouterTask {
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(kvrouter::serve(listener, config, async move {
        let _ = rx.await;
    }));
    RouterTask { addr, stop: Some(tx), task }
}

impl RouterTask {
    /// `https://localhost:<port>` (the server certificate names `localhost`).
    fn base(&self) -> String {
        format!("https://localhost:{}", self.addr.port())
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(10), self.task).await.unwrap().unwrap().unwrap();
    }
}

/// A gRPC channel over `cfg`'s TLS (ALPN h2) to `addr`.
async fn grpc_channel(cfg: &ClientAuthConfig, addr: SocketAddr) -> Result<tonic::transport::Channel, String> {
    let connector = Arc::new(Connector::new(cfg, &[b"h2"]).map_err(|e| e.to_string())?);
    let target = format!("localhost:{}", addr.port());
    tonic::transport::Endpoint::try_from(format!("http://localhost:{}", addr.port()))
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_| {
            let (c, t) = (Arc::clone(&connector), target.clone());
            async move {
                c.connect(&t).await.map(hyper_util::rt::TokioIo::new).map_err(|e| std::io::Error::other(e.to_string()))
            }
        }))
        .await
        .map_err(|e| error_chain(&e))
}

fn with_token<T>(msg: T, token: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(t) = token {
        r.metadata_mut().insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    r
}

/// gRPC `Route` of `tokens` in namespace `m` as `who`.
async fn grpc_route(pki: &Pki, addr: SocketAddr, who: Who<'_>) -> Result<rpb::RouteResponse, tonic::Status> {
    let token = match who {
        Who::Token(t) => Some(t),
        _ => None,
    };
    let cfg = pki.client(match who {
        Who::Token(_) => Who::Nothing,
        w => w,
    });
    let channel = grpc_channel(&cfg, addr).await.map_err(tonic::Status::unavailable)?;
    let req = rpb::RouteRequest {
        namespace: Some(rpb::route_request::Namespace::NamespaceName("m".into())),
        tokens: prompt(2),
        ..Default::default()
    };
    RouterClient::new(channel).route(with_token(req, token)).await.map(tonic::Response::into_inner)
}

/// The router's API: every refusal says why and serves nothing; a good token and a good
/// certificate get in, over HTTP and gRPC alike; probes stay open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_api_admits_tokens_and_certificates_only() {
    let pki = pki();
    let router = start_router("127.0.0.1:0", router_config(pki.endpoint(), ClientAuthConfig::default())).await;
    let base = router.base();
    let route_body = json!({"namespace": "m", "tokens": prompt(2)});
    let post_route = |c: HttpClient| {
        let (url, body) = (format!("{base}/route"), route_body.clone());
        async move { call(&c, reqwest::Method::POST, &url, Some(&body)).await }
    };

    // No credentials: 401 with what to present, on every route but the probes.
    let none = pki.http(Who::Nothing);
    for path in ["/metrics", "/no-such-route"] {
        let (status, body) = get(&none, &format!("{base}{path}")).await.unwrap();
        assert_eq!(status, 401, "{path}: {body}");
        assert!(body.contains("kvrouter API ([auth]) requires credentials: a bearer token"), "{path}: {body}");
    }
    let (status, body) = post_route(pki.http(Who::Nothing)).await.unwrap();
    assert_eq!(status, 401, "{body}");
    let (status, body) = get(&none, &format!("{base}/healthz")).await.unwrap();
    assert_eq!(status, 200, "probes need no credentials: {body}");
    let e = grpc_route(&pki, router.addr, Who::Nothing).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    assert!(e.message().contains("requires credentials"), "{e:?}");

    // A wrong token: 401 saying the token is not accepted.
    let (status, body) = post_route(pki.http(Who::Token(TOKEN_WRONG))).await.unwrap();
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("the bearer token is not one this endpoint accepts"), "{body}");
    assert!(!body.contains(TOKEN_WRONG), "a refusal never echoes a secret: {body}");
    let e = grpc_route(&pki, router.addr, Who::Token(TOKEN_WRONG)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");

    // A certificate of a foreign CA, or an expired one: the handshake fails, nothing is served.
    for (what, cert) in [("foreign CA", &pki.foreign), ("expired", &pki.expired)] {
        assert_handshake_refused(what, &post_route(pki.http(Who::Cert(cert))).await);
        let e = grpc_route(&pki, router.addr, Who::Cert(cert)).await.unwrap_err();
        assert_ne!(e.code(), tonic::Code::Ok, "{what}");
    }

    // Another tenant's token: authenticated, but no grant of namespace `m`.
    let (status, body) = post_route(pki.http(Who::Token(TOKEN_B))).await.unwrap();
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("tenant-b may not route in namespace"), "{body}");
    let e = grpc_route(&pki, router.addr, Who::Token(TOKEN_B)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    // ... and it may not publish: events span namespaces.
    let msg = kvproto::events::PublisherMessage::new("intruder", 1);
    let (status, body) =
        call(&pki.http(Who::Token(TOKEN_B)), reqwest::Method::POST, &format!("{base}/events"), Some(&json!(msg)))
            .await
            .unwrap();
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("tenant-b may not publish events"), "{body}");

    // A good token, a good certificate: in (no worker yet: 503 is the router's own answer).
    for who in [Who::Token(TOKEN_A), Who::Cert(&pki.client)] {
        let (status, body) = post_route(pki.http(who)).await.unwrap();
        assert_eq!(status, 503, "{who:?}: {body}");
        assert!(body.contains("no worker"), "{who:?}: {body}");
        let (status, body) = get(&pki.http(who), &format!("{base}/metrics")).await.unwrap();
        assert_eq!(status, 200, "{who:?}");
        assert!(body.contains("kvrouter_route_errors_total"), "{who:?}");
        let e = grpc_route(&pki, router.addr, who).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{who:?}: {e:?}");
    }
    // A client that does not trust the router's CA does not talk to it.
    let distrust = ClientAuthConfig { tls_ca: Some(pki.foreign.cert.clone()), ..pki.client(Who::Token(TOKEN_A)) };
    let r = get(&HttpClient::new(&distrust, Duration::from_secs(5)).unwrap(), &format!("{base}/metrics")).await;
    assert!(r.is_err(), "{r:?}");
    router.stop().await;
}

/// A daemon in this process with `metrics_auth` and `tcp_auth` set from `pki`, publishing to a
/// router that is not there (so that the recovery routes are served).
struct InProcessDaemon {
    _dir: tempfile::TempDir,
    http: SocketAddr,
    tcp: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), kvcached::ServerError>>,
}

async fn start_daemon(pki: &Pki) -> InProcessDaemon {
    let dir = tempfile::tempdir().unwrap();
    let mut c = kvcached::Config {
        socket: dir.path().join("kvcached.sock"),
        metrics_addr: "127.0.0.1:0".parse().unwrap(),
        tcp: Some("127.0.0.1:0".parse().unwrap()),
        metrics_auth: pki.endpoint(),
        tcp_auth: pki.endpoint(),
        ..Default::default()
    };
    c.g2.capacity_bytes = 64 << 20;
    c.g2.shm_dir = dir.path().to_path_buf();
    c.g3.enabled = false;
    c.router.urls = vec!["http://127.0.0.1:9".into()];
    let c = c.resolve().unwrap();
    let l = kvcached::Listeners::bind(&c).await.unwrap();
    let http = l.http.as_ref().unwrap().local_addr().unwrap();
    let tcp = l.tcp.as_ref().unwrap().local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(kvcached::serve(c, l, async move {
        let _ = rx.await;
    }));
    InProcessDaemon { _dir: dir, http, tcp, stop: Some(tx), task }
}

impl InProcessDaemon {
    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().unwrap();
    }
}

/// The daemon's HTTP port (`metrics_auth`): `/metrics` and the recovery routes need
/// credentials, the recovery routes an identity granted every namespace; `/healthz` is open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_http_port_admits_tokens_and_certificates_only() {
    let pki = pki();
    let d = start_daemon(&pki).await;
    // The server certificate names 127.0.0.1 too: the address the daemon advertises.
    let base = format!("https://127.0.0.1:{}", d.http.port());
    let snapshot = format!("{base}/events/snapshot");
    let replay = format!("{base}/events/replay?after=0");

    let none = pki.http(Who::Nothing);
    for url in [format!("{base}/metrics"), snapshot.clone(), replay.clone()] {
        let (status, body) = get(&none, &url).await.unwrap();
        assert_eq!(status, 401, "{url}: {body}");
        assert!(body.contains("kvcached HTTP ([metrics_auth]) requires credentials"), "{url}: {body}");
    }
    let (status, _) = get(&none, &format!("{base}/healthz")).await.unwrap();
    assert_eq!(status, 200, "probes need no credentials");

    let (status, body) = get(&pki.http(Who::Token(TOKEN_WRONG)), &snapshot).await.unwrap();
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("not one this endpoint accepts"), "{body}");
    for (what, cert) in [("foreign CA", &pki.foreign), ("expired", &pki.expired)] {
        assert_handshake_refused(what, &get(&pki.http(Who::Cert(cert)), &snapshot).await);
    }

    // Another tenant: it may scrape, but not read every namespace's events.
    let b = pki.http(Who::Token(TOKEN_B));
    assert_eq!(get(&b, &format!("{base}/metrics")).await.unwrap().0, 200);
    for url in [&snapshot, &replay] {
        let (status, body) = get(&b, url).await.unwrap();
        assert_eq!(status, 403, "{url}: {body}");
        assert!(body.contains("tenant-b may not read the event replay or snapshot"), "{url}: {body}");
    }

    for who in [Who::Token(TOKEN_A), Who::Cert(&pki.client)] {
        let c = pki.http(who);
        let (status, body) = get(&c, &snapshot).await.unwrap();
        assert_eq!(status, 200, "{who:?}: {body}");
        assert!(serde_json::from_str::<Value>(&body).is_ok(), "{body}");
        assert_eq!(get(&c, &replay).await.unwrap().0, 200, "{who:?}");
        let (status, body) = get(&c, &format!("{base}/metrics")).await.unwrap();
        assert_eq!(status, 200, "{who:?}");
        assert!(body.contains("kvcached_"), "{who:?}");
    }
    d.stop().await;
}

/// gRPC `Health` on the daemon's TCP port as `who`.
async fn tcp_health(pki: &Pki, addr: SocketAddr, who: Who<'_>) -> Result<pb::HealthResponse, tonic::Status> {
    let (cfg, token) = match who {
        Who::Token(t) => (pki.client(Who::Nothing), Some(t)),
        w => (pki.client(w), None),
    };
    let channel = grpc_channel(&cfg, addr).await.map_err(tonic::Status::unavailable)?;
    pb::kvcached_client::KvcachedClient::new(channel)
        .health(with_token(pb::Empty {}, token))
        .await
        .map(tonic::Response::into_inner)
}

/// The daemon's TCP gRPC port (`tcp_auth`): TLS in the accept loop, then a token or a
/// certificate per request. (It serves only Health, which names no namespace: grants have
/// nothing to restrict there.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_tcp_port_admits_tokens_and_certificates_only() {
    let pki = pki();
    let d = start_daemon(&pki).await;
    let e = tcp_health(&pki, d.tcp, Who::Nothing).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    assert!(e.message().contains("kvcached TCP gRPC ([tcp_auth]) requires credentials"), "{e:?}");
    let e = tcp_health(&pki, d.tcp, Who::Token(TOKEN_WRONG)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    assert!(e.message().contains("not one this endpoint accepts"), "{e:?}");
    for (what, cert) in [("foreign CA", &pki.foreign), ("expired", &pki.expired)] {
        let e = tcp_health(&pki, d.tcp, Who::Cert(cert)).await.unwrap_err();
        assert_ne!(e.code(), tonic::Code::Ok, "{what}");
    }
    // Plain gRPC to a TLS port: nothing is served either.
    let plain = pb::kvcached_client::KvcachedClient::connect(format!("http://{}", d.tcp)).await;
    if let Ok(mut c) = plain {
        assert!(c.health(pb::Empty {}).await.is_err());
    }
    for who in [Who::Token(TOKEN_A), Who::Token(TOKEN_B), Who::Cert(&pki.client)] {
        assert!(tcp_health(&pki, d.tcp, who).await.unwrap().ok, "{who:?}");
    }
    d.stop().await;
}

fn toml_path(p: &Path) -> String {
    format!("{:?}", p.display().to_string())
}

async fn route(client: &HttpClient, base: &str, tokens: &[u32]) -> Value {
    let body = json!({"namespace": "m", "tokens": tokens});
    match call(client, reqwest::Method::POST, &format!("{base}/route"), Some(&body)).await {
        Ok((200, text)) => serde_json::from_str(&text).unwrap_or(Value::Null),
        Ok((status, text)) => json!({"status": status, "body": text}),
        Err(e) => json!({"error": e}),
    }
}

async fn wait_for_blocks(client: &HttpClient, base: &str, tokens: &[u32], blocks: u64, what: &str) {
    let t0 = Instant::now();
    loop {
        let v = route(client, base, tokens).await;
        let g2 = v["cached_blocks"].as_array().and_then(|c| c.get(1)).and_then(Value::as_u64);
        if v["worker"] == "node-a/gpu0" && g2 == Some(blocks) {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "{what}: last answer {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn metric(client: &HttpClient, base: &str, prefix: &str) -> f64 {
    let Ok((200, text)) = get(client, &format!("{base}/metrics")).await else { return 0.0 };
    text.lines().filter(|l| l.starts_with(prefix)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

/// End to end over TLS with tokens: a daemon (a process) publishes to a router that accepts
/// only its token; a router restarted with the wrong token for daemons cannot recover the
/// daemon's events (the daemon refuses it), one with the right token recovers them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_publishes_to_a_token_protected_router_over_tls() {
    let pki = pki();
    let dir = pki.dir.path();
    const DAEMON_TOKEN: &str = "node-a-daemon-token-0123456789";
    const ROUTER_TOKEN: &str = "router-0-token-for-daemons-0123";
    const CLIENT_TOKEN: &str = "gateway-token-0123456789abcdef";
    let router_tokens = write(dir, "router-tokens", &format!("node-a {DAEMON_TOKEN}\ngateway {CLIENT_TOKEN}\n"));
    let daemon_tokens = write(dir, "daemon-tokens", &format!("router-0 {ROUTER_TOKEN}\n"));
    let api = AuthConfig {
        tls_cert: Some(pki.server.cert.clone()),
        tls_key: Some(pki.server.key.clone()),
        tokens_file: Some(router_tokens),
        ..AuthConfig::default()
    };
    let to_daemons = |token: &str| ClientAuthConfig {
        tls_ca: Some(pki.ca.cert.clone()),
        token_file: Some(write(dir, &format!("to-daemons-{}", &token[..6]), token)),
        ..ClientAuthConfig::default()
    };
    let router = start_router("127.0.0.1:0", router_config(api.clone(), to_daemons(ROUTER_TOKEN))).await;
    let (base, addr) = (router.base(), router.addr);

    let ddir = tempfile::tempdir().unwrap();
    let sock = ddir.path().join("kvcached.sock");
    let cfg = write(
        ddir.path(),
        "kvcached.toml",
        &format!(
            "metrics_addr = \"127.0.0.1:0\"\n\
             [metrics_auth]\ntls_cert = {}\ntls_key = {}\ntokens_file = {}\n\
             [router]\nurls = [\"{base}\"]\nnode = \"node-a\"\nreport_interval_ms = 200\n\
             [router.auth]\ntls_ca = {}\ntoken_file = {}\n",
            toml_path(&pki.server.cert),
            toml_path(&pki.server.key),
            toml_path(&daemon_tokens),
            toml_path(&pki.ca.cert),
            toml_path(&write(dir, "daemon-token", DAEMON_TOKEN)),
        ),
    );
    let d = ddir.path().to_str().unwrap();
    let _daemon = KillOnDrop(Some(
        Command::new(env!("CARGO_BIN_EXE_daemon"))
            .args(["--config", cfg.to_str().unwrap(), "--socket", sock.to_str().unwrap()])
            .args(["--g2-capacity-bytes", "67108864", "--g2-shm-dir", d, "--g3-enabled", "false"])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    ));
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(Instant::now() < deadline, "the daemon did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut mem = KvMemory::create_layer_separate(ddir.path().join("engine-kv"), &layout(), 32).unwrap();
    for b in 0..32 {
        mem.write_block(b, &synthetic_block(7, b, layout().block_bytes() as usize));
    }
    let engine = Client::connect(&sock).await.unwrap();
    engine
        .register_worker("gpu0", &Namespace::new("auth/model", layout()), &mem, "http://a:8000", "both")
        .await
        .unwrap();
    let p = prompt(24);
    assert_eq!(engine.save(&p, 0, &(0..24).collect::<Vec<_>>()).await.unwrap().stored, 24);

    // The router indexed the daemon's G2 blocks: its reports got in over TLS with its token.
    let gateway = HttpClient::new(
        &ClientAuthConfig {
            tls_ca: Some(pki.ca.cert.clone()),
            token_file: Some(write(dir, "gateway-token", CLIENT_TOKEN)),
            ..ClientAuthConfig::default()
        },
        Duration::from_secs(5),
    )
    .unwrap();
    wait_for_blocks(&gateway, &base, &p, 24, "the daemon's blocks, published over TLS").await;

    // The router restarts with a token the daemon does not accept: the daemon's next report
    // shows events this router never saw, and the replay it asks for is refused.
    router.stop().await;
    let wrong = start_router(&addr.to_string(), router_config(api.clone(), to_daemons(TOKEN_WRONG))).await;
    let t0 = Instant::now();
    while metric(&gateway, &base, "kvrouter_recovery_failures_total").await < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "no recovery was refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let v = route(&gateway, &base, &p).await;
    assert_eq!(v["cached_blocks"][1].as_u64().unwrap_or(0), 0, "nothing recovered without the daemon's consent: {v}");
    // The router's health says why, in the daemon's words.
    let (_, health) = get(&gateway, &format!("{base}/healthz")).await.unwrap();
    assert!(health.contains("401") && health.contains("the bearer token is not one this endpoint accepts"), "{health}");
    wrong.stop().await;

    // With the right token the restarted router recovers the daemon's blocks.
    let right = start_router(&addr.to_string(), router_config(api, to_daemons(ROUTER_TOKEN))).await;
    wait_for_blocks(&gateway, &base, &p, 24, "the daemon's blocks, recovered over TLS").await;
    assert!(metric(&gateway, &base, "kvrouter_gap_recoveries_total").await >= 1.0);
    right.stop().await;
}

/// Runs `bin args` until it exits (at most 60 s): its status and stderr.
fn run_to_exit(bin: &str, args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(bin).args(args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            return (status, err);
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("{bin} {args:?} is still running");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn free_port(ip: &str) -> u16 {
    std::net::TcpListener::bind((ip, 0)).unwrap().local_addr().unwrap().port()
}

/// Nothing is open on the network by accident: a router and a daemon asked to listen on every
/// interface with no credentials configured do not start, and say which section to set;
/// `open = true` says it may be open, and then it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_on_the_network_need_credentials_or_open() {
    let dir = tempfile::tempdir().unwrap();
    let (status, err) = run_to_exit(env!("CARGO_BIN_EXE_router"), &["--listen", "0.0.0.0:0"]);
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("kvrouter API ([auth]): listens on 0.0.0.0:") && err.contains("with no credentials configured"),
        "{err}"
    );
    assert!(err.contains("set tokens_file or tls_client_ca, or open = true"), "{err}");

    let port = free_port("0.0.0.0");
    let open = write(dir.path(), "open.toml", "[auth]\nopen = true\n");
    let mut router = KillOnDrop(Some(
        Command::new(env!("CARGO_BIN_EXE_router"))
            .args(["--listen", &format!("0.0.0.0:{port}"), "--config", open.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    ));
    let plain = HttpClient::plain(Duration::from_secs(2)).unwrap();
    let t0 = Instant::now();
    loop {
        if let Ok((status, _)) = get(&plain, &format!("http://127.0.0.1:{port}/metrics")).await {
            assert_eq!(status, 200, "open = true: served without credentials");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "the open router did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if let Some(mut c) = router.signal(libc::SIGTERM) {
        assert!(c.wait().unwrap().success());
    }

    let d = dir.path().to_str().unwrap();
    let sock = dir.path().join("kvcached.sock");
    let daemon_args = |metrics: &str| -> Vec<String> {
        ["--socket", sock.to_str().unwrap(), "--metrics-addr", metrics]
            .iter()
            .map(|s| s.to_string())
            .chain(["--g2-capacity-bytes", "67108864", "--g2-shm-dir", d, "--g3-enabled", "false"].map(String::from))
            .collect()
    };
    let args = daemon_args("0.0.0.0:0");
    let (status, err) = run_to_exit(env!("CARGO_BIN_EXE_daemon"), &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!status.success(), "{err}");
    assert!(err.contains("metrics_auth: listens on 0.0.0.0:"), "{err}");
    assert!(err.contains("open = true"), "{err}");
}
