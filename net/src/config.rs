//! Typed configuration of one endpoint's authentication (`[*.auth]` sections of kvcached's and
//! kvrouter's TOML) and of a client's credentials.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// How a TCP endpoint authenticates its clients. Credentials are a bearer token (a line of the
/// tokens file) or a client certificate signed by `tls_client_ca` (mutual TLS); either gives the
/// client an identity, and `grants` say which namespaces each identity may read.
///
/// Nothing is open by accident: an endpoint bound to a non-loopback address with neither tokens
/// nor client certificates configured does not start unless `open` says it may.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Serve without credentials (a trusted network only). Off: an endpoint on a non-loopback
    /// address needs `tokens_file` or `tls_client_ca`.
    pub open: bool,
    /// PEM certificate chain the endpoint presents; with `tls_key`, the endpoint speaks TLS only.
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificates client certificates must chain to (mutual TLS). Needs `tls_cert`.
    pub tls_client_ca: Option<PathBuf>,
    /// Bearer tokens, one per line: `<identity> <token>` (`#` starts a comment). Reloaded when
    /// the file changes.
    pub tokens_file: Option<PathBuf>,
    /// Which namespaces each identity may read. An identity with no grant is authenticated but
    /// may read nothing namespaced; an endpoint with no grants at all lets every authenticated
    /// identity read every namespace.
    pub grants: Vec<Grant>,
}

/// One identity's namespaces.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    /// A token's identity, or a DNS name in a client certificate's subject alternative names.
    pub identity: String,
    /// Namespace ids (32 hex digits, as `kvcached` logs and exports them), or `"*"` for all.
    pub namespaces: Vec<String>,
}

impl AuthConfig {
    /// Whether clients must present credentials.
    pub fn requires_credentials(&self) -> bool {
        self.tokens_file.is_some() || self.tls_client_ca.is_some()
    }

    /// Whether the endpoint speaks TLS.
    pub fn tls(&self) -> bool {
        self.tls_cert.is_some()
    }
}

/// The credentials a client presents to an authenticated endpoint.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientAuthConfig {
    /// PEM CA certificates the server's certificate must chain to; set: connect with TLS.
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate chain (mutual TLS), with `tls_key`.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// The name the server's certificate must carry; empty: the host of the address dialled.
    pub tls_server_name: Option<String>,
    /// A file holding the bearer token (its first non-empty line). Reloaded when it changes.
    pub token_file: Option<PathBuf>,
}

impl ClientAuthConfig {
    /// Whether any credential or TLS is configured.
    pub fn is_set(&self) -> bool {
        self.tls_ca.is_some() || self.tls_cert.is_some() || self.token_file.is_some()
    }
}

/// Bounds on an HTTP listener (`[http_limits]` in kvcached's and kvrouter's TOML): how many
/// connections it holds, how long a client may take to send a request's headers, how many
/// requests one HTTP/2 connection may have in flight. A client past a bound is disconnected and
/// counted (`kvnet_http_refusals_total{endpoint,reason}`), and the others are still served.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpLimits {
    /// Connections open at once; one more takes the place of the one idle longest with no
    /// request in flight, and is closed only when every one has a request in flight.
    pub max_connections: usize,
    /// A connection must send its first bytes, and each HTTP/1.1 request its complete headers,
    /// within this long (ms). Between HTTP/1.1 requests it is also how long an idle keep-alive
    /// connection stays open.
    pub header_timeout_ms: u64,
    /// Requests in flight at once on one HTTP/2 connection.
    pub max_concurrent_streams: u32,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self { max_connections: 1024, header_timeout_ms: 30_000, max_concurrent_streams: 256 }
    }
}

impl HttpLimits {
    /// Why these limits cannot be served with: the key at fault and what it must be.
    pub fn validate(&self) -> Result<(), (&'static str, &'static str)> {
        if self.max_connections == 0 {
            return Err(("max_connections", "must be at least 1"));
        }
        if self.header_timeout_ms < 100 {
            return Err(("header_timeout_ms", "must be at least 100 (ms)"));
        }
        if self.max_concurrent_streams == 0 {
            return Err(("max_concurrent_streams", "must be at least 1"));
        }
        Ok(())
    }
}
