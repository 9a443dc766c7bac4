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
