//! The server side: a [`Guard`] per endpoint accepts connections (the TLS handshake, when the
//! endpoint speaks TLS) and turns what a client presented (a verified client certificate, a
//! bearer token) into an [`Identity`], or a [`Refusal`] that says what is missing.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use kvproto::NamespaceId;
use rustls::ServerConfig;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;

use crate::config::AuthConfig;
use crate::error::NetError;
use crate::reload::{Reloading, read_first};
use crate::tls::{self, Stream};

/// Shortest token accepted: a guessable token is no credential.
pub const MIN_TOKEN_CHARS: usize = 16;

/// The namespaces an identity may read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Namespaces {
    All,
    Only(HashSet<NamespaceId>),
}

/// Who a client is, once authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The token's identity, the certificate name that matched a grant, `client-certificate`
    /// (a trusted certificate no grant names), or `anonymous` on an endpoint without credentials.
    pub name: String,
    pub namespaces: Namespaces,
}

impl Identity {
    /// An endpoint that asks for no credentials: everyone, every namespace.
    pub fn anonymous() -> Self {
        Self { name: "anonymous".into(), namespaces: Namespaces::All }
    }

    /// A client of an endpoint that has no credentials configured and is not `open`, on one
    /// that is closed without them ([`Guard::closed_without_credentials`]): served what no
    /// namespace's blocks, keys or ids are in, refused the rest. Its name says what to do.
    pub fn unauthenticated() -> Self {
        Self {
            name: "a client without credentials (this endpoint has none configured: set tokens_file or \
                   tls_client_ca, or open = true where every user of the node may read every namespace)"
                .into(),
            namespaces: Namespaces::Only(HashSet::new()),
        }
    }

    /// Whether this identity may read `ns`.
    pub fn may_read(&self, ns: &NamespaceId) -> bool {
        match &self.namespaces {
            Namespaces::All => true,
            Namespaces::Only(set) => set.contains(ns),
        }
    }
}

/// Why a client was refused; the message names what to present, never a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    #[error("{0} requires credentials: a bearer token (authorization: Bearer ...) or a client certificate")]
    NoCredentials(String),
    #[error("{0}: the bearer token is not one this endpoint accepts")]
    BadToken(String),
    #[error("{0}: the client certificate no longer chains to the endpoint's client CA ({1})")]
    CertNoLongerTrusted(String, String),
    #[error("{endpoint}: {identity} may not read namespace {namespace}")]
    Namespace { endpoint: String, identity: String, namespace: String },
}

/// What a client presented in its TLS handshake: its first certificate, already verified
/// against the client CA by rustls (chain, validity period, client-auth usage), and the
/// intermediates it sent with it (to verify it again after the CA file changes).
#[derive(Debug, Clone, Default)]
pub struct PeerCert(pub Option<CertificateDer<'static>>, pub Vec<CertificateDer<'static>>);

impl PeerCert {
    /// The certificates a TLS handshake ended with (leaf first).
    pub fn of(chain: Option<&[CertificateDer<'_>]>) -> Self {
        let chain = chain.unwrap_or_default();
        Self(
            chain.first().map(|c| c.clone().into_owned()),
            chain.iter().skip(1).map(|c| c.clone().into_owned()).collect(),
        )
    }
}

#[derive(Debug)]
struct Tokens {
    /// (identity, token) pairs.
    entries: Vec<(String, String)>,
}

fn load_tokens(paths: &[PathBuf]) -> Result<Tokens, NetError> {
    let (path, text) = read_first("tokens file", paths)?;
    let mut entries = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut parts = line.split_whitespace();
        let (Some(id), Some(token), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(NetError::File {
                what: "tokens file",
                path: path.clone(),
                why: format!("line {}: want `<identity> <token>`", n + 1),
            });
        };
        if token.chars().count() < MIN_TOKEN_CHARS {
            return Err(NetError::File {
                what: "tokens file",
                path: path.clone(),
                why: format!("line {}: the token of {id} is shorter than {MIN_TOKEN_CHARS} characters", n + 1),
            });
        }
        entries.push((id.to_string(), token.to_string()));
    }
    Ok(Tokens { entries })
}

/// Compares without stopping at the first difference, so the time taken says nothing about how
/// much of a guess was right.
fn same(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        diff |= usize::from(a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0xff));
    }
    diff == 0
}

fn namespace_of(hex_id: &str) -> Option<NamespaceId> {
    let mut out = [0u8; 16];
    hex::decode_to_slice(hex_id, &mut out).ok()?;
    Some(NamespaceId(out))
}

/// One endpoint's authentication.
#[derive(Debug)]
pub struct Guard {
    endpoint: String,
    cfg: AuthConfig,
    tls: Option<Reloading<tls::ServerTls>>,
    /// Certificates verified again against the current client CA: leaf's hash -> the TLS
    /// value it was verified with (weak: held, its address is not reused by a later version).
    /// Bounded; cleared when full.
    reverified: parking_lot::Mutex<HashMap<u64, std::sync::Weak<tls::ServerTls>>>,
    tokens: Option<Reloading<Tokens>>,
    grants: Option<HashMap<String, Namespaces>>,
    /// See [`Guard::closed_without_credentials`].
    closed: bool,
}

fn parse_grants(cfg: &AuthConfig, endpoint: &str) -> Result<Option<HashMap<String, Namespaces>>, NetError> {
    if cfg.grants.is_empty() {
        return Ok(None);
    }
    let mut out: HashMap<String, Namespaces> = HashMap::new();
    for g in &cfg.grants {
        let entry = out.entry(g.identity.clone()).or_insert_with(|| Namespaces::Only(HashSet::new()));
        for ns in &g.namespaces {
            if ns == "*" {
                *entry = Namespaces::All;
                continue;
            }
            let id = namespace_of(ns).ok_or_else(|| {
                NetError::Config(format!(
                    "{endpoint}: grant of {}: {ns:?} is not a namespace id (32 hex digits) or \"*\"",
                    g.identity
                ))
            })?;
            if let Namespaces::Only(set) = entry {
                set.insert(id);
            }
        }
    }
    Ok(Some(out))
}

impl Guard {
    /// The guard of `endpoint` (a name for messages, e.g. `peer.auth`) listening on `addr`.
    /// `alpn`: the protocols the endpoint offers over TLS (`h2` for gRPC).
    pub fn new(endpoint: &str, cfg: &AuthConfig, addr: SocketAddr, alpn: &[&[u8]]) -> Result<Self, NetError> {
        let bad = |why: String| Err(NetError::Config(format!("{endpoint}: {why}")));
        if cfg.tls_key.is_some() != cfg.tls_cert.is_some() {
            return bad("tls_cert and tls_key go together".into());
        }
        if cfg.tls_client_ca.is_some() && cfg.tls_cert.is_none() {
            return bad("tls_client_ca (mutual TLS) needs tls_cert and tls_key: the endpoint must speak TLS".into());
        }
        if cfg.open && cfg.requires_credentials() {
            return bad("open = true and credentials (tokens_file, tls_client_ca) contradict each other".into());
        }
        if !cfg.open && !cfg.requires_credentials() && !addr.ip().is_loopback() {
            return bad(format!(
                "listens on {addr} with no credentials configured: set tokens_file or tls_client_ca, or open = true to \
                 serve without (a trusted network only)"
            ));
        }
        if cfg.tokens_file.is_some() && cfg.tls_cert.is_none() && !addr.ip().is_loopback() {
            tracing::warn!(endpoint, %addr, "bearer tokens over plain TCP: anyone on the path can read them; set tls_cert");
        }
        let tls = match (&cfg.tls_cert, &cfg.tls_key) {
            (Some(c), Some(k)) => {
                let mut paths = vec![c.clone(), k.clone()];
                paths.extend(cfg.tls_client_ca.clone());
                Some(Reloading::tls("TLS server certificate", paths, alpn, tls::server_tls)?)
            }
            _ => None,
        };
        let tokens = Reloading::file("tokens file", cfg.tokens_file.as_ref(), load_tokens)?;
        Ok(Self {
            endpoint: endpoint.to_string(),
            cfg: cfg.clone(),
            tls,
            reverified: parking_lot::Mutex::default(),
            tokens,
            grants: parse_grants(cfg, endpoint)?,
            closed: false,
        })
    }

    /// Without credentials configured and without `open = true`, clients are not anonymous
    /// readers of every namespace (as on loopback by default) but [`Identity::unauthenticated`]:
    /// for endpoints whose routes reveal or move blocks, keys or namespace ids, where loopback is
    /// no trust boundary (any local user can connect).
    pub fn closed_without_credentials(mut self) -> Self {
        self.closed = true;
        self
    }

    /// Whether clients are served without credentials (`open = true`, or none configured on
    /// an endpoint that is not closed without them).
    pub fn serves_anonymous(&self) -> bool {
        !self.requires_credentials() && (self.cfg.open || !self.closed)
    }

    /// The current TLS configuration, if the endpoint speaks TLS.
    pub(crate) fn server_config(&self) -> Option<Arc<ServerConfig>> {
        self.tls.as_ref().map(|t| Arc::clone(&t.get().config))
    }

    /// Whether connections are TLS.
    pub fn tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Whether clients must present credentials.
    pub fn requires_credentials(&self) -> bool {
        self.cfg.requires_credentials()
    }

    /// The endpoint's name, for messages.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Completes a TCP connection: the TLS handshake on a TLS endpoint (a client whose
    /// certificate is untrusted or expired fails here), else the plain stream.
    pub async fn accept(&self, tcp: TcpStream) -> Result<(Stream<TcpStream>, PeerCert), NetError> {
        let Some(tls) = &self.tls else {
            return Ok((Stream::Plain(tcp), PeerCert::default()));
        };
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::clone(&tls.get().config));
        let s = acceptor.accept(tcp).await.map_err(|e| NetError::Tls(e.to_string()))?;
        let cert = PeerCert::of(s.get_ref().1.peer_certificates());
        Ok((Stream::Tls(Box::new(tokio_rustls::TlsStream::Server(s))), cert))
    }

    /// Who the client is: by bearer token (the value after `Bearer `), else by its verified
    /// certificate; anonymous where the endpoint asks for no credentials.
    pub fn authenticate(&self, cert: &PeerCert, bearer: Option<&str>) -> Result<Identity, Refusal> {
        if !self.requires_credentials() {
            return Ok(if self.serves_anonymous() { Identity::anonymous() } else { Identity::unauthenticated() });
        }
        if let (Some(token), Some(tokens)) = (bearer, &self.tokens) {
            let table = tokens.get();
            let mut found = None;
            for (id, t) in &table.entries {
                if same(t.as_bytes(), token.trim().as_bytes()) && found.is_none() {
                    found = Some(id.clone());
                }
            }
            return match found {
                Some(id) => Ok(self.identity(id)),
                None => Err(Refusal::BadToken(self.endpoint.clone())),
            };
        }
        if let Some(der) = &cert.0
            && self.cfg.tls_client_ca.is_some()
        {
            self.still_trusted(cert)?;
            return Ok(self.identity(self.cert_name(der)));
        }
        Err(Refusal::NoCredentials(self.endpoint.clone()))
    }

    /// Whether `cert` (verified by the handshake) still chains to the client CA of the current
    /// files: a CA file rewritten without the CA that signed it revokes it, open connections
    /// included. Verified once per certificate and CA file version.
    fn still_trusted(&self, cert: &PeerCert) -> Result<(), Refusal> {
        use std::hash::{BuildHasher, BuildHasherDefault};
        let (Some(leaf), Some(tls)) = (&cert.0, &self.tls) else { return Ok(()) };
        let current = tls.get();
        let Some(verifier) = &current.client_verifier else { return Ok(()) };
        let key = BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default().hash_one(leaf.as_ref());
        if self.reverified.lock().get(&key).is_some_and(|v| std::ptr::eq(v.as_ptr(), Arc::as_ptr(&current))) {
            return Ok(());
        }
        verifier
            .verify_client_cert(leaf, &cert.1, rustls_pki_types::UnixTime::now())
            .map_err(|e| Refusal::CertNoLongerTrusted(self.endpoint.clone(), e.to_string()))?;
        let mut seen = self.reverified.lock();
        if seen.len() >= 4096 {
            seen.clear();
        }
        seen.insert(key, Arc::downgrade(&current));
        Ok(())
    }

    /// The grant name a certificate carries (a DNS name among its subject alternative names).
    fn cert_name(&self, der: &CertificateDer<'static>) -> String {
        let Ok(cert) = webpki::EndEntityCert::try_from(der) else { return "client-certificate".into() };
        let names = self.grants.iter().flat_map(|g| g.keys());
        for n in names {
            if let Ok(sn) = ServerName::try_from(n.as_str())
                && cert.verify_is_valid_for_subject_name(&sn).is_ok()
            {
                return n.clone();
            }
        }
        "client-certificate".into()
    }

    fn identity(&self, name: String) -> Identity {
        let namespaces = match &self.grants {
            None => Namespaces::All,
            Some(g) => g.get(&name).cloned().unwrap_or_else(|| Namespaces::Only(HashSet::new())),
        };
        Identity { name, namespaces }
    }

    /// `identity` may read `ns`, or the refusal that says it may not.
    pub fn check_namespace(&self, identity: &Identity, ns: &NamespaceId) -> Result<(), Refusal> {
        if identity.may_read(ns) {
            return Ok(());
        }
        Err(Refusal::Namespace {
            endpoint: self.endpoint.clone(),
            identity: identity.name.clone(),
            namespace: ns.to_string(),
        })
    }
}

/// The token of an `authorization` header value (`Bearer <token>`, case-insensitive scheme).
pub fn bearer_of(header: &str) -> Option<&str> {
    let (scheme, token) = header.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token.trim())
}
