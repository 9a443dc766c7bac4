//! rustls configurations from PEM files, and the stream an endpoint hands on: plain TCP or TLS.
//! Every configuration names its crypto provider (aws-lc-rs, which object_store's client
//! already links) rather than relying on a process-wide default.

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::error::NetError;

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

fn file_err(what: &'static str, path: &Path, why: impl std::fmt::Display) -> NetError {
    NetError::File { what, path: path.to_path_buf(), why: why.to_string() }
}

/// Every certificate in a PEM file (at least one).
pub fn load_certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, NetError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_err(what, path, e))?
        .collect::<Result<_, _>>()
        .map_err(|e| file_err(what, path, e))?;
    if certs.is_empty() {
        return Err(file_err(what, path, "holds no PEM certificate"));
    }
    Ok(certs)
}

/// The private key in a PEM file.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, NetError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| file_err("TLS key", path, e))
}

fn roots(what: &'static str, path: &Path) -> Result<RootCertStore, NetError> {
    let mut roots = RootCertStore::empty();
    for c in load_certs(what, path)? {
        roots.add(c).map_err(|e| file_err(what, path, e))?;
    }
    Ok(roots)
}

/// A server configuration: `paths` = [cert, key] or [cert, key, client CA]. With a client CA,
/// a client may present a certificate, which must chain to it and be valid now (an expired or
/// foreign one fails the handshake); one that presents none must bring a token instead.
pub fn server_config(paths: &[PathBuf], alpn: &[&[u8]]) -> Result<Arc<ServerConfig>, NetError> {
    server_tls(paths, alpn).map(|t| t.config)
}

/// An endpoint's TLS: its rustls configuration and, with a client CA, the verifier of client
/// certificates, kept to check an open connection's certificate again after the CA file
/// changed (revocation).
#[derive(Debug)]
pub struct ServerTls {
    pub config: Arc<ServerConfig>,
    pub client_verifier: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
}

/// [`server_config`] with its client verifier.
pub fn server_tls(paths: &[PathBuf], alpn: &[&[u8]]) -> Result<ServerTls, NetError> {
    let (cert, key) = match paths {
        [c, k, ..] => (c, k),
        _ => return Err(NetError::Config("a TLS endpoint needs tls_cert and tls_key".into())),
    };
    let chain = load_certs("TLS certificate", cert)?;
    let key = load_key(key)?;
    let p = provider();
    let builder = ServerConfig::builder_with_provider(Arc::clone(&p))
        .with_safe_default_protocol_versions()
        .map_err(|e| NetError::Tls(e.to_string()))?;
    let mut client_verifier = None;
    let builder = match paths.get(2) {
        Some(ca) => {
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots("TLS client CA", ca)?), p)
                .allow_unauthenticated()
                .build()
                .map_err(|e| file_err("TLS client CA", ca, e))?;
            client_verifier = Some(Arc::clone(&verifier));
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut cfg = builder.with_single_cert(chain, key).map_err(|e| file_err("TLS certificate and key", cert, e))?;
    cfg.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
    Ok(ServerTls { config: Arc::new(cfg), client_verifier })
}

/// A client configuration: `paths` = [CA] or [CA, cert, key] (mutual TLS).
pub fn client_config(paths: &[PathBuf], alpn: &[&[u8]]) -> Result<Arc<ClientConfig>, NetError> {
    let Some(ca) = paths.first() else {
        return Err(NetError::Config("a TLS client needs tls_ca".into()));
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| NetError::Tls(e.to_string()))?
        .with_root_certificates(roots("TLS CA", ca)?);
    let mut cfg = match (paths.get(1), paths.get(2)) {
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(load_certs("TLS client certificate", cert)?, load_key(key)?)
            .map_err(|e| file_err("TLS client certificate and key", cert, e))?,
        _ => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
    Ok(Arc::new(cfg))
}

/// A connection as an endpoint or a client sees it: plain TCP, or TLS over it.
#[derive(Debug)]
pub enum Stream<IO> {
    Plain(IO),
    Tls(Box<tokio_rustls::TlsStream<IO>>),
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncRead for Stream<IO> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Stream<IO> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }
    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }
}
