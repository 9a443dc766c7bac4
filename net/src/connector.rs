//! The client side: what a daemon (pulling from a peer, reporting to a router) or a router
//! (asking a daemon for a replay) presents to an authenticated endpoint.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;

use crate::config::ClientAuthConfig;
use crate::error::NetError;
use crate::reload::{Reloading, read_first};
use crate::tls::{self, Stream};

fn load_token(paths: &[PathBuf]) -> Result<String, NetError> {
    let (path, text) = read_first("token file", paths)?;
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .ok_or_else(|| NetError::File { what: "token file", path: path.clone(), why: "holds no token".into() })
}

/// A client's credentials, reloaded when their files change.
#[derive(Debug)]
pub struct Connector {
    cfg: ClientAuthConfig,
    tls: Option<Reloading<Arc<ClientConfig>>>,
    token: Option<Reloading<String>>,
}

impl Connector {
    /// `alpn`: what to offer over TLS (`h2` for gRPC and HTTP/2).
    pub fn new(cfg: &ClientAuthConfig, alpn: &[&[u8]]) -> Result<Self, NetError> {
        if cfg.tls_cert.is_some() != cfg.tls_key.is_some() {
            return Err(NetError::Config("a client's tls_cert and tls_key go together".into()));
        }
        if cfg.tls_cert.is_some() && cfg.tls_ca.is_none() {
            return Err(NetError::Config("a client certificate needs tls_ca: it is sent only over TLS".into()));
        }
        let tls = match &cfg.tls_ca {
            Some(ca) => {
                let mut paths = vec![ca.clone()];
                if let (Some(c), Some(k)) = (&cfg.tls_cert, &cfg.tls_key) {
                    paths.push(c.clone());
                    paths.push(k.clone());
                }
                Some(Reloading::tls("TLS client configuration", paths, alpn, tls::client_config)?)
            }
            None => None,
        };
        let token = Reloading::file("token file", cfg.token_file.as_ref(), load_token)?;
        Ok(Self { cfg: cfg.clone(), tls, token })
    }

    /// No credentials, plain TCP.
    pub fn plain() -> Self {
        Self { cfg: ClientAuthConfig::default(), tls: None, token: None }
    }

    /// Whether connections use TLS.
    pub fn tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The bearer token to send, if any.
    pub fn bearer(&self) -> Option<Arc<String>> {
        self.token.as_ref().map(Reloading::get)
    }

    /// The `authorization` header value, if a token is configured.
    pub fn authorization(&self) -> Option<String> {
        self.bearer().map(|t| format!("Bearer {t}"))
    }

    /// The current TLS client configuration (for HTTP clients that take one).
    pub fn client_config(&self) -> Option<Arc<ClientConfig>> {
        self.tls.as_ref().map(|t| Arc::clone(&*t.get()))
    }

    /// The name the server's certificate must carry, when configured.
    pub(crate) fn server_name(&self) -> Option<String> {
        self.cfg.tls_server_name.clone()
    }

    /// Connects to `host:port`, with TLS when configured (the server's certificate must carry
    /// `tls_server_name`, else `host`).
    pub async fn connect(&self, addr: &str) -> Result<Stream<TcpStream>, NetError> {
        let tcp = TcpStream::connect(addr).await?;
        let _ = tcp.set_nodelay(true);
        let Some(tls) = &self.tls else { return Ok(Stream::Plain(tcp)) };
        let host = match &self.cfg.tls_server_name {
            Some(n) => n.clone(),
            None => host_of(addr).to_string(),
        };
        let name = ServerName::try_from(host.clone())
            .map_err(|_| NetError::Config(format!("{host:?} is not a name a TLS certificate can carry")))?;
        let connector = tokio_rustls::TlsConnector::from(Arc::clone(&*tls.get()));
        let s = connector.connect(name, tcp).await.map_err(|e| NetError::Tls(e.to_string()))?;
        Ok(Stream::Tls(Box::new(tokio_rustls::TlsStream::Client(s))))
    }
}

/// The host part of `host:port` or `[v6]:port`.
pub fn host_of(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    addr.rsplit_once(':').map_or(addr, |(h, _)| h)
}
