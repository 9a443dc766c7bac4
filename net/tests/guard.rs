//! Guards and connectors over real TCP on loopback, with a throw-away PKI: which credentials
//! get in, which are refused and how, grants of namespaces, files rotated under a running guard.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::Path;

use kvnet::testing::Ca;
use kvnet::{AuthConfig, ClientAuthConfig, Connector, Grant, Guard, Identity, NetError, Refusal};
use kvproto::NamespaceId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const NS_A: &str = "0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a";
const NS_B: &str = "0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b";

fn ns(hex: &str) -> NamespaceId {
    let mut out = [0u8; 16];
    hex::decode_to_slice(hex, &mut out).unwrap();
    NamespaceId(out)
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

struct Pki {
    ca: Ca,
    server: kvnet::testing::CertFiles,
}

fn pki(dir: &Path) -> Pki {
    let ca = Ca::new(dir, "ca");
    let server = ca.valid("server", &["localhost", "127.0.0.1"]);
    Pki { ca, server }
}

fn tokens(dir: &Path, lines: &str) -> std::path::PathBuf {
    let p = dir.join("tokens");
    std::fs::write(&p, lines).unwrap();
    p
}

/// Runs one guarded accept on a fresh port: the client connects with `client` and writes a byte;
/// returns what the guard made of the connection (or the handshake error) and the client's
/// result.
async fn exchange(guard: std::sync::Arc<Guard>, client: Connector) -> (Result<Identity, String>, Result<(), String>) {
    let l = TcpListener::bind(loopback()).await.unwrap();
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        match guard.accept(tcp).await {
            Ok((mut s, cert)) => {
                let mut b = [0u8; 1];
                let _ = s.read_exact(&mut b).await;
                let _ = s.write_all(b"k").await;
                let _ = s.shutdown().await;
                guard.authenticate(&cert, None).map_err(|e| e.to_string())
            }
            Err(e) => Err(e.to_string()),
        }
    });
    let c = async {
        let mut s = client.connect(&format!("localhost:{}", addr.port())).await.map_err(|e| e.to_string())?;
        s.write_all(b"x").await.map_err(|e| e.to_string())?;
        s.flush().await.map_err(|e| e.to_string())?;
        // A TLS 1.3 client learns of a refused certificate on its first read.
        let mut b = [0u8; 1];
        s.read_exact(&mut b).await.map(|_| ()).map_err(|e| e.to_string())
    };
    let client_result = c.await;
    (server.await.unwrap(), client_result)
}

#[test]
fn nothing_is_open_on_the_network_by_accident() {
    let any: SocketAddr = "0.0.0.0:7000".parse().unwrap();
    let e = Guard::new("peer.auth", &AuthConfig::default(), any, &[]).unwrap_err().to_string();
    assert!(e.contains("peer.auth: listens on 0.0.0.0:7000 with no credentials configured"), "{e}");
    assert!(e.contains("open = true"), "{e}");
    // Said explicitly: open.
    let open = AuthConfig { open: true, ..AuthConfig::default() };
    let g = Guard::new("peer.auth", &open, any, &[]).unwrap();
    assert_eq!(g.authenticate(&Default::default(), None).unwrap(), Identity::anonymous());
    // Loopback without credentials: open to this machine only.
    assert!(Guard::new("peer.auth", &AuthConfig::default(), loopback(), &[]).is_ok());
    // Contradictions and halves.
    let d = tempfile::tempdir().unwrap();
    let t = tokens(d.path(), "a 0123456789abcdef0123\n");
    let both = AuthConfig { open: true, tokens_file: Some(t), ..AuthConfig::default() };
    assert!(Guard::new("x", &both, any, &[]).unwrap_err().to_string().contains("contradict"));
    let half = AuthConfig { tls_key: Some(d.path().join("k")), ..AuthConfig::default() };
    assert!(Guard::new("x", &half, any, &[]).unwrap_err().to_string().contains("go together"));
    let short = tokens(d.path(), "a short\n");
    let weak = AuthConfig { tokens_file: Some(short), ..AuthConfig::default() };
    let e = Guard::new("x", &weak, any, &[]).unwrap_err().to_string();
    assert!(e.contains("shorter than 16"), "{e}");
    let bad_grant = AuthConfig {
        open: true,
        grants: vec![Grant { identity: "a".into(), namespaces: vec!["nope".into()] }],
        ..AuthConfig::default()
    };
    assert!(matches!(Guard::new("x", &bad_grant, any, &[]), Err(NetError::Config(_))));
}

#[test]
fn tokens_grants_and_refusals() {
    let d = tempfile::tempdir().unwrap();
    let t = tokens(d.path(), "# tenants\ndecode-a aaaaaaaaaaaaaaaaaaaaaaaa\ndecode-b bbbbbbbbbbbbbbbbbbbbbbbb\n");
    let cfg = AuthConfig {
        tokens_file: Some(t.clone()),
        grants: vec![
            Grant { identity: "decode-a".into(), namespaces: vec![NS_A.into()] },
            Grant { identity: "decode-b".into(), namespaces: vec![NS_B.into()] },
        ],
        ..AuthConfig::default()
    };
    let g = Guard::new("peer.auth", &cfg, "0.0.0.0:1".parse().unwrap(), &[]).unwrap();
    let none = Default::default();
    assert!(matches!(g.authenticate(&none, None), Err(Refusal::NoCredentials(_))));
    assert!(matches!(g.authenticate(&none, Some("aaaaaaaaaaaaaaaaaaaaaaab")), Err(Refusal::BadToken(_))));
    let a = g.authenticate(&none, Some("aaaaaaaaaaaaaaaaaaaaaaaa")).unwrap();
    assert_eq!(a.name, "decode-a");
    assert!(g.check_namespace(&a, &ns(NS_A)).is_ok());
    // Another tenant's namespace: refused, and the refusal names who and what.
    let e = g.check_namespace(&a, &ns(NS_B)).unwrap_err().to_string();
    assert!(e.contains("decode-a may not read namespace 0b0b"), "{e}");
    // The file changes: the old token stops working, the new one works.
    std::fs::write(&t, "decode-a cccccccccccccccccccccccc\n").unwrap();
    // mtime granularity: make sure the stamp moves.
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(2);
    std::fs::File::options().write(true).open(&t).unwrap().set_modified(later).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1100));
    assert!(g.authenticate(&none, Some("aaaaaaaaaaaaaaaaaaaaaaaa")).is_err());
    assert_eq!(g.authenticate(&none, Some("cccccccccccccccccccccccc")).unwrap().name, "decode-a");
    assert_eq!(kvnet::bearer_of("Bearer  xyz "), Some("xyz"));
    assert_eq!(kvnet::bearer_of("bearer xyz"), Some("xyz"));
    assert_eq!(kvnet::bearer_of("Basic xyz"), None);
}

fn mtls(p: &Pki) -> AuthConfig {
    AuthConfig {
        tls_cert: Some(p.server.cert.clone()),
        tls_key: Some(p.server.key.clone()),
        tls_client_ca: Some(p.ca.cert.clone()),
        grants: vec![Grant { identity: "decode-a.kvcached".into(), namespaces: vec![NS_A.into()] }],
        ..AuthConfig::default()
    }
}

fn client(ca: &Path, cert: Option<&kvnet::testing::CertFiles>) -> Connector {
    Connector::new(
        &ClientAuthConfig {
            tls_ca: Some(ca.to_path_buf()),
            tls_cert: cert.map(|c| c.cert.clone()),
            tls_key: cert.map(|c| c.key.clone()),
            ..ClientAuthConfig::default()
        },
        &[],
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_admits_trusted_certificates_only() {
    let d = tempfile::tempdir().unwrap();
    let p = pki(d.path());
    let good = p.ca.valid("decode-a", &["decode-a.kvcached"]);
    let unnamed = p.ca.valid("other", &["other.kvcached"]);
    let expired = p.ca.expired("old", &["decode-a.kvcached"]);
    let rogue_ca = Ca::new(d.path(), "rogue");
    let rogue = rogue_ca.valid("rogue", &["decode-a.kvcached"]);
    let guard = || std::sync::Arc::new(Guard::new("peer.auth", &mtls(&p), loopback(), &[]).unwrap());

    let (who, c) = exchange(guard(), client(&p.ca.cert, Some(&good))).await;
    assert!(c.is_ok(), "{c:?}");
    let who = who.unwrap();
    assert_eq!(who.name, "decode-a.kvcached");
    assert!(who.may_read(&ns(NS_A)) && !who.may_read(&ns(NS_B)));

    // A trusted certificate no grant names: authenticated, but reads nothing.
    let (who, _) = exchange(guard(), client(&p.ca.cert, Some(&unnamed))).await;
    let who = who.unwrap();
    assert_eq!(who.name, "client-certificate");
    assert!(!who.may_read(&ns(NS_A)));

    // No certificate (and no token): the handshake passes, the request is refused.
    let (who, _) = exchange(guard(), client(&p.ca.cert, None)).await;
    assert!(who.unwrap_err().contains("requires credentials"));

    // Expired, or signed by a CA nobody trusts: the handshake fails on both sides.
    for (what, cert, why) in [("expired", &expired, "certificate expired"), ("foreign", &rogue, "UnknownIssuer")] {
        let (who, c) = exchange(guard(), client(&p.ca.cert, Some(cert))).await;
        let e = who.unwrap_err();
        assert!(e.contains(why), "{what}: server says {e}");
        assert!(c.is_err(), "{what}: the client was not told");
    }

    // A client that does not trust the server's CA does not connect.
    let (_, c) = exchange(guard(), client(&rogue_ca.cert, Some(&good))).await;
    assert!(c.unwrap_err().contains("UnknownIssuer"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_server_certificate_is_used_without_a_restart() {
    let d = tempfile::tempdir().unwrap();
    let p = pki(d.path());
    let cfg = AuthConfig {
        tls_cert: Some(p.server.cert.clone()),
        tls_key: Some(p.server.key.clone()),
        open: true,
        ..AuthConfig::default()
    };
    let guard = std::sync::Arc::new(Guard::new("x", &cfg, loopback(), &[]).unwrap());
    let ca2 = Ca::new(d.path(), "ca2");
    let next = ca2.valid("next", &["localhost"]);
    // Before: only clients trusting the first CA connect.
    assert!(exchange(guard.clone(), client(&ca2.cert, None)).await.1.is_err());
    assert!(exchange(guard.clone(), client(&p.ca.cert, None)).await.1.is_ok());
    // Rotate the files in place (as a cert-manager secret update does).
    std::fs::copy(&next.cert, &p.server.cert).unwrap();
    std::fs::copy(&next.key, &p.server.key).unwrap();
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(2);
    for f in [&p.server.cert, &p.server.key] {
        std::fs::File::options().write(true).open(f).unwrap().set_modified(later).unwrap();
    }
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let g = guard;
    let (who, c) = exchange(g, client(&ca2.cert, None)).await;
    assert!(c.is_ok() && who.is_ok(), "{c:?} {who:?}");
}
