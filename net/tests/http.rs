//! kvnet's HTTP serving and client over real TLS on loopback: probes open, refusals (HTTP and
//! gRPC-shaped), identities handed to handlers, and tokens and certificates rotated under a
//! running server and client.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Extension;
use axum::routing::get;
use kvnet::http::{HttpClient, reqwest};
use kvnet::testing::Ca;
use kvnet::{AuthConfig, ClientAuthConfig, Guard, Identity};

/// Rewrites `path` with a modification time the reloader cannot miss, and waits out its
/// once-a-second look.
fn rotate(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    let later = SystemTime::now() + Duration::from_secs(2);
    std::fs::File::options().write(true).open(path).unwrap().set_modified(later).unwrap();
    std::thread::sleep(Duration::from_millis(1100));
}

async fn status(c: &HttpClient, url: &str) -> Result<(u16, String), String> {
    let resp =
        c.request(reqwest::Method::GET, url).map_err(|e| e.to_string())?.send().await.map_err(|e| e.to_string())?;
    let s = resp.status().as_u16();
    Ok((s, resp.text().await.unwrap()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_authenticates_and_reloads_on_both_sides() {
    let d = tempfile::tempdir().unwrap();
    let ca = Ca::new(d.path(), "ca");
    let server = ca.valid("server", &["localhost"]);
    let tokens = d.path().join("tokens");
    std::fs::write(&tokens, "alice aaaaaaaaaaaaaaaaaaaaaaaa\n").unwrap();
    let cfg = AuthConfig {
        tls_cert: Some(server.cert.clone()),
        tls_key: Some(server.key.clone()),
        tokens_file: Some(tokens.clone()),
        ..AuthConfig::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let guard =
        Arc::new(Guard::new("test API", &cfg, listener.local_addr().unwrap(), kvnet::http::SERVER_ALPN).unwrap());
    let app = axum::Router::new()
        .route("/whoami", get(|Extension(who): Extension<Identity>| async move { who.name }))
        .route("/healthz", get(|| async { "ok" }));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(kvnet::http::serve(listener, guard, app, async move {
        let _ = rx.await;
    }));
    let base = format!("https://localhost:{port}");

    let token = d.path().join("token");
    std::fs::write(&token, "aaaaaaaaaaaaaaaaaaaaaaaa\n").unwrap();
    let client_cfg = ClientAuthConfig {
        tls_ca: Some(ca.cert.clone()),
        token_file: Some(token.clone()),
        ..ClientAuthConfig::default()
    };
    let client = HttpClient::new(&client_cfg, Duration::from_secs(5)).unwrap();
    assert_eq!(status(&client, &format!("{base}/whoami")).await.unwrap(), (200, "alice".into()));

    // Without a token: refused, with what to present; the probe still answers.
    let anonymous = HttpClient::new(
        &ClientAuthConfig { tls_ca: Some(ca.cert.clone()), ..ClientAuthConfig::default() },
        Duration::from_secs(5),
    )
    .unwrap();
    let (s, body) = status(&anonymous, &format!("{base}/whoami")).await.unwrap();
    assert_eq!(s, 401);
    assert!(body.contains("test API requires credentials"), "{body}");
    assert_eq!(status(&anonymous, &format!("{base}/healthz")).await.unwrap().0, 200);
    // gRPC-shaped: a trailers-only answer with grpc-status 16.
    let r = anonymous
        .request(reqwest::Method::POST, &format!("{base}/pkg.Svc/Call"))
        .unwrap()
        .header("content-type", "application/grpc")
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["grpc-status"], "16");
    assert!(r.headers()["grpc-message"].to_str().unwrap().contains("test API requires credentials"));

    // The client's token file changes: the next request carries the new token, which the server
    // does not know yet; then the server's tokens file learns it.
    rotate(&token, "bbbbbbbbbbbbbbbbbbbbbbbb\n");
    let (s, body) = status(&client, &format!("{base}/whoami")).await.unwrap();
    assert_eq!(s, 401, "{body}");
    assert!(body.contains("not one this endpoint accepts"), "{body}");
    rotate(&tokens, "bob bbbbbbbbbbbbbbbbbbbbbbbb\n");
    assert_eq!(status(&client, &format!("{base}/whoami")).await.unwrap(), (200, "bob".into()));

    // The server's certificate is replaced by one of another CA: a new connection of a client
    // trusting the first CA is refused; once the client's CA file holds the new CA, the same
    // client object connects again (its TLS configuration reloaded, its HTTP client rebuilt).
    let ca2 = Ca::new(d.path(), "ca2");
    let next = ca2.valid("next", &["localhost"]);
    std::fs::copy(&next.key, &server.key).unwrap();
    rotate(&server.cert, &std::fs::read_to_string(&next.cert).unwrap());
    let fresh = HttpClient::new(&client_cfg, Duration::from_secs(5)).unwrap();
    let e = status(&fresh, &format!("{base}/whoami")).await.unwrap_err();
    assert!(!e.is_empty());
    rotate(&ca.cert, &std::fs::read_to_string(&ca2.cert).unwrap());
    assert_eq!(status(&client, &format!("{base}/whoami")).await.unwrap(), (200, "bob".into()));

    // An https:// URL without a CA to check it against is refused before any connection.
    let plain = HttpClient::plain(Duration::from_secs(1)).unwrap();
    assert!(status(&plain, &format!("{base}/healthz")).await.unwrap_err().contains("needs tls_ca"));

    let _ = tx.send(());
    task.await.unwrap().unwrap();
}

/// A plain loopback server within `limits`; its port, its stop signal, its task.
async fn limited(
    limits: kvnet::HttpLimits,
) -> (u16, tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<std::io::Result<()>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let guard = Arc::new(Guard::new("limited API", &AuthConfig::default(), addr, kvnet::http::SERVER_ALPN).unwrap());
    let app = axum::Router::new().route("/healthz", get(|| async { "ok" })).route(
        "/slow",
        get(|| async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            "slow"
        }),
    );
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        kvnet::http::serve_with(listener, guard, app, &limits, async move {
            let _ = rx.await;
        })
        .await
    });
    (addr.port(), tx, task)
}

/// Reads until the server closes `s` (or resets it); what it sent. Fails after 10 s.
async fn closed_by_server(s: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the server kept the connection open; it sent {:?}", String::from_utf8_lossy(&got));
    String::from_utf8_lossy(&got).into_owned()
}

/// Shutdown closes idle connections at once: the server stops well before its 10 s drain.
async fn stopped_promptly(task: tokio::task::JoinHandle<std::io::Result<()>>) {
    let done = tokio::time::timeout(Duration::from_secs(5), task).await;
    assert!(done.is_ok(), "the server waited out its drain deadline with nothing in flight");
    done.unwrap().unwrap().unwrap();
}

async fn get_healthz(port: u16) -> Result<String, String> {
    let c = HttpClient::plain(Duration::from_secs(5)).unwrap();
    let url = format!("http://127.0.0.1:{port}/healthz");
    status(&c, &url).await.map(|(_, body)| body)
}

/// At the cap, a new connection takes the place of the one idle longest (issue 35, finding 5: a
/// flood of half-open connections kept `/healthz` out); only when every connection has a request
/// in flight is the newcomer closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_cap_the_idle_longest_makes_room_and_requests_in_flight_are_kept() {
    use tokio::io::AsyncWriteExt;
    let limits = kvnet::HttpLimits { max_connections: 2, ..kvnet::HttpLimits::default() };
    let (port, stop, task) = limited(limits).await;
    let mut first = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let _second = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    // Give the loop time to take both before the third arrives.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _third = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    assert_eq!(closed_by_server(&mut first).await, "", "the idle longest was not the one closed");
    assert_eq!(get_healthz(port).await.unwrap(), "ok", "a probe was kept out by idle connections");

    // Two requests in flight: neither is closed for a newcomer, which is refused instead.
    let mut busy = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        s.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
        busy.push(s);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut late = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    assert_eq!(closed_by_server(&mut late).await, "");
    for mut s in busy {
        let said = closed_by_server(&mut s).await;
        assert!(said.starts_with("HTTP/1.1 200 OK") && said.ends_with("slow"), "{said}");
    }
    let _ = stop.send(());
    stopped_promptly(task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_slow_and_idle_clients_are_disconnected() {
    use tokio::io::AsyncWriteExt;
    let limits = kvnet::HttpLimits { max_connections: 4, header_timeout_ms: 300, ..kvnet::HttpLimits::default() };
    let (port, stop, task) = limited(limits).await;

    // Sends nothing.
    let mut silent = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    assert_eq!(closed_by_server(&mut silent).await, "");

    // Starts a request and never finishes its headers.
    let mut slow = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    let said = closed_by_server(&mut slow).await;
    assert!(!said.contains("200 OK"), "{said}");

    // A whole request is answered; then the idle keep-alive connection is closed.
    let mut idle = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let said = closed_by_server(&mut idle).await;
    assert!(said.starts_with("HTTP/1.1 200 OK") && said.ends_with("ok"), "{said}");

    // Three connections closed, so a fourth and fifth fit under the cap of 4 with room to spare.
    assert_eq!(get_healthz(port).await.unwrap(), "ok");
    let _ = stop.send(());
    stopped_promptly(task).await;
}
