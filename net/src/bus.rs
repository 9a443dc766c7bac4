//! The event plane's configuration on a NATS JetStream bus (`[events.nats]` in kvcached,
//! `[nats]` in kvrouter): servers, the stream and its limits, the subjects, and the credentials
//! (from files only, so no secret is ever in a configuration dump or a log line).
//!
//! Subjects are `{subject_prefix}.{cluster}.{node}`: a router replica that serves one deployment
//! reads `{subject_prefix}.{cluster}.>`, one node's messages are `{subject_prefix}.{cluster}.{node}`,
//! and NATS permissions can confine each daemon to its own subject. The client side is
//! [`crate::nats`] (feature `nats`); these types build without it.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A JetStream event plane.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsConfig {
    /// Server URLs (`nats://host:4222`, or `tls://host:4222` to require TLS); empty: no bus.
    pub servers: Vec<String>,
    /// The stream holding every daemon's reports.
    pub stream: String,
    /// First tokens of every subject.
    pub subject_prefix: String,
    /// The deployment's name, the subject token after the prefix: routers of one deployment
    /// read only its nodes.
    pub cluster: String,
    /// Stream limits, applied by whichever process creates the stream first (a daemon or a
    /// router); an existing stream keeps its own. Oldest messages go first past any of them.
    /// Age of the oldest message kept (s); 0: no limit.
    pub max_age_s: u64,
    /// Bytes the stream keeps; -1: no limit.
    pub max_bytes: i64,
    /// Messages the stream keeps; -1: no limit.
    pub max_messages: i64,
    /// How long JetStream remembers a message id to drop a retried publish of it (s).
    pub duplicate_window_s: u64,
    /// Copies of the stream in a NATS cluster (1 on a single server).
    pub replicas: usize,
    /// "file" (survives a server restart) or "memory".
    pub storage: String,
    /// Bound on connecting (the whole handshake) and on every JetStream request (ms).
    pub connect_timeout_ms: u64,
    pub request_timeout_ms: u64,
    /// How a daemon writes its reports on the stream: "binary" (keys as bytes,
    /// `kvnet::bus_codec`) or "json" (as `POST /events`). A router reads both.
    pub encoding: String,
    pub auth: NatsAuth,
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            servers: Vec::new(),
            stream: "KVCACHED_EVENTS".into(),
            subject_prefix: "kvcached.events".into(),
            cluster: "default".into(),
            max_age_s: 3600,
            max_bytes: 1 << 30,
            max_messages: 10_000_000,
            duplicate_window_s: 120,
            replicas: 1,
            storage: "file".into(),
            connect_timeout_ms: 5000,
            request_timeout_ms: 5000,
            encoding: "binary".into(),
            auth: NatsAuth::default(),
        }
    }
}

/// How to authenticate to NATS. At most one of user/password, token, NKey seed or credentials
/// file; TLS (server verification against `tls_ca`, a client certificate) with any of them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsAuth {
    /// User name, with `password_file`.
    pub user: Option<String>,
    /// A file holding the password (its first non-empty line).
    pub password_file: Option<PathBuf>,
    /// A file holding the token (its first non-empty line).
    pub token_file: Option<PathBuf>,
    /// A file holding an NKey seed (`SU...`).
    pub nkey_seed_file: Option<PathBuf>,
    /// A `.creds` file (a user JWT and its NKey seed, as `nsc` writes them).
    pub credentials_file: Option<PathBuf>,
    /// PEM CA certificates the server's certificate must chain to; set: TLS is required.
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate and key (servers that verify clients).
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
}

impl NatsConfig {
    /// Whether a bus is configured.
    pub fn enabled(&self) -> bool {
        !self.servers.is_empty()
    }

    /// Checks what can be checked without connecting.
    pub fn validate(&self) -> Result<(), String> {
        if self.servers.iter().any(|s| s.trim().is_empty()) {
            return Err("servers holds an empty URL".into());
        }
        if self.stream.is_empty() || !self.stream.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
            return Err(format!("stream {:?} must be letters, digits, '_' or '-'", self.stream));
        }
        if self.subject_prefix.is_empty()
            || self.subject_prefix.split('.').any(|t| t.is_empty() || t.contains(['*', '>', ' ']))
        {
            return Err(format!(
                "subject_prefix {:?} must be dot-separated tokens without wildcards",
                self.subject_prefix
            ));
        }
        if self.cluster.is_empty() || token(&self.cluster) != self.cluster {
            return Err(format!("cluster {:?} must be one subject token (letters, digits, '_' or '-')", self.cluster));
        }
        if !matches!(self.storage.as_str(), "file" | "memory") {
            return Err(format!("storage {:?} must be \"file\" or \"memory\"", self.storage));
        }
        if !matches!(self.encoding.as_str(), "binary" | "json") {
            return Err(format!("encoding {:?} must be \"binary\" or \"json\"", self.encoding));
        }
        if self.max_bytes == 0 || self.max_messages == 0 {
            return Err("max_bytes and max_messages must be positive, or -1 for no limit".into());
        }
        let a = &self.auth;
        let methods = [
            a.user.is_some() || a.password_file.is_some(),
            a.token_file.is_some(),
            a.nkey_seed_file.is_some(),
            a.credentials_file.is_some(),
        ];
        if methods.iter().filter(|m| **m).count() > 1 {
            return Err("auth: give one of user/password_file, token_file, nkey_seed_file, credentials_file".into());
        }
        if a.user.is_some() != a.password_file.is_some() {
            return Err("auth: user and password_file go together".into());
        }
        if a.tls_cert.is_some() != a.tls_key.is_some() {
            return Err("auth: tls_cert and tls_key go together".into());
        }
        if a.tls_cert.is_some() && a.tls_ca.is_none() {
            return Err("auth: a client certificate needs tls_ca".into());
        }
        Ok(())
    }

    /// The subject a node publishes on.
    pub fn subject(&self, node: &str) -> String {
        format!("{}.{}.{}", self.subject_prefix, self.cluster, token(node))
    }

    /// The subjects of this deployment (what a router replica reads).
    pub fn filter(&self) -> String {
        format!("{}.{}.>", self.subject_prefix, self.cluster)
    }

    /// The node token of a subject of this deployment, or `None` for another subject.
    pub fn node_token<'a>(&self, subject: &'a str) -> Option<&'a str> {
        let rest = subject.strip_prefix(self.subject_prefix.as_str())?.strip_prefix('.')?;
        let rest = rest.strip_prefix(self.cluster.as_str())?.strip_prefix('.')?;
        (!rest.is_empty() && !rest.contains('.')).then_some(rest)
    }
}

/// `name` as one subject token: every character but letters, digits, '-' and '_' becomes '_'
/// (a host name `a.b` is the token `a_b`).
pub fn token(name: &str) -> String {
    let t: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect();
    if t.is_empty() { "_".into() } else { t }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_confine_a_node_to_one_token() {
        let c = NatsConfig { cluster: "prod".into(), ..NatsConfig::default() };
        assert_eq!(c.subject("gpu-1.rack.example"), "kvcached.events.prod.gpu-1_rack_example");
        assert_eq!(c.subject("a*>b c"), "kvcached.events.prod.a__b_c");
        assert_eq!(c.filter(), "kvcached.events.prod.>");
        assert_eq!(c.node_token("kvcached.events.prod.n1"), Some("n1"));
        assert_eq!(c.node_token("kvcached.events.dev.n1"), None);
        assert_eq!(c.node_token("kvcached.events.prod.n1.x"), None);
        assert_eq!(c.node_token("kvcached.events.prod."), None);
        assert_eq!(c.node_token("kvcached.eventsX.prod.n1"), None);
    }

    #[test]
    fn validation_names_the_setting() {
        let ok = NatsConfig { servers: vec!["nats://127.0.0.1:4222".into()], ..NatsConfig::default() };
        assert_eq!(ok.validate(), Ok(()));
        let bad = |f: fn(&mut NatsConfig)| {
            let mut c = ok.clone();
            f(&mut c);
            c.validate().expect_err("must be refused")
        };
        assert!(bad(|c| c.cluster = "a.b".into()).contains("cluster"));
        assert!(bad(|c| c.stream = "a.b".into()).contains("stream"));
        assert!(bad(|c| c.subject_prefix = "a.>".into()).contains("subject_prefix"));
        assert!(bad(|c| c.storage = "disk".into()).contains("storage"));
        assert!(bad(|c| c.auth.user = Some("u".into())).contains("password_file"));
        assert!(
            bad(|c| {
                c.auth.token_file = Some("t".into());
                c.auth.nkey_seed_file = Some("n".into());
            })
            .contains("one of")
        );
        assert!(bad(|c| c.auth.tls_cert = Some("c".into())).contains("tls_key"));
    }
}
