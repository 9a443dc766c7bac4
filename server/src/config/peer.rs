//! `[peer]`: the peer channel's settings (used by [`crate::peer`]).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// `[peer]`: the peer channel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PeerConfig {
    /// Where other daemons pull from (`0.0.0.0:7471`); absent: this daemon serves no peer (it
    /// can still pull from others).
    pub listen: Option<SocketAddr>,
    /// The `host:port` other daemons dial to reach `listen` (reported to routers); empty: the
    /// listen address when it is not a wildcard.
    pub advertise: String,
    /// Who may pull, and which namespaces ([`kvnet::AuthConfig`]).
    pub auth: kvnet::AuthConfig,
    /// What this daemon presents when it pulls from others.
    pub client: kvnet::ClientAuthConfig,
    /// Connections served at once (one thread each); more wait, up to as many again, then are
    /// refused.
    pub max_connections: usize,
    /// Pulls running at once; a load beyond this reads G4 or misses.
    pub max_pulls: usize,
    /// A load waits at most this long for a pulled block; what has not arrived by then is a
    /// miss.
    pub pull_deadline_ms: u64,
    /// Connecting and the TLS handshake; on the serving side, the whole admission of a
    /// connection (TLS handshake, hello, authentication and its answer).
    pub connect_timeout_ms: u64,
    /// A peer silent this long mid-transfer has stalled.
    pub io_timeout_ms: u64,
    /// The longest a failed peer goes unasked. A peer that is unreachable or closes the
    /// connection is barred for 1 s after its first failure, twice as long after each further
    /// failure in a row, up to this; one success clears it. A peer that stalls or sends wrong
    /// bytes is barred this long at once.
    pub bad_peer_ms: u64,
    /// The serving side closes a connection idle between requests this long.
    pub idle_timeout_ms: u64,
    /// A link not measured by a real transfer for this long is measured with a probe of
    /// `probe_bytes`; 0: never probe.
    pub probe_idle_s: u64,
    pub probe_bytes: u32,
    /// Other daemons' peer addresses to measure links to before any transfer (`host:port`).
    /// Loads and hints may name them as sources.
    pub peers: Vec<String>,
    /// Further sources loads and hints may name: `host:port`, or networks (`10.0.0.0/8`, any
    /// port). Nothing else is dialed ([`crate::peer::sources`]).
    pub allowed_sources: Vec<String>,
}

impl Default for PeerConfig {
    fn default() -> Self {
        Self {
            listen: None,
            advertise: String::new(),
            auth: kvnet::AuthConfig::default(),
            client: kvnet::ClientAuthConfig::default(),
            max_connections: 16,
            max_pulls: 16,
            pull_deadline_ms: 10_000,
            connect_timeout_ms: 2_000,
            io_timeout_ms: 5_000,
            bad_peer_ms: 30_000,
            idle_timeout_ms: 60_000,
            probe_idle_s: 300,
            probe_bytes: 8 << 20,
            peers: Vec::new(),
            allowed_sources: Vec::new(),
        }
    }
}

impl PeerConfig {
    /// The advertised address, or why there is none.
    pub fn advertised(&self, bound: Option<SocketAddr>) -> Option<String> {
        if !self.advertise.is_empty() {
            return Some(self.advertise.clone());
        }
        bound.filter(|a| !a.ip().is_unspecified()).map(|a| a.to_string())
    }
}
