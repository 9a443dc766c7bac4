//! The one configuration check: [`Config::resolve`] fills the automatic sizes and checks every
//! field, the same way for `kvcached config` and `kvcached run`, before anything is bound or
//! announced. It lives above the subsystems it asks (the listeners' guards, the peer sources,
//! the tenants), so that [`crate::config`] itself imports none of them.

use std::path::Path;

use crate::config::{Config, bad, host_name};
use crate::edge::http;
use crate::engine::fault_guard::MAX_ENGINES;
use crate::error::ServerError;
use crate::peer::sources::SourcePolicy;
use crate::policy::tenants::Tenants;
use crate::serve;

/// An error naming the first of `fields` whose value is below `min`.
fn at_least<T: PartialOrd + std::fmt::Display + Copy>(min: T, fields: &[(&str, T)]) -> Result<(), ServerError> {
    match fields.iter().find(|(_, v)| *v < min) {
        Some((field, _)) => Err(bad(field, format!("must be at least {min}"))),
        None => Ok(()),
    }
}

/// Physical memory of the machine.
fn machine_memory() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let (pages, size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    (pages.max(0) as u64).saturating_mul(size.max(0) as u64)
}

/// Free bytes of the filesystem holding `dir` (or its nearest existing ancestor).
fn free_space(dir: &Path) -> u64 {
    let mut p = dir.to_path_buf();
    while !p.exists() {
        if !p.pop() {
            return 0;
        }
    }
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else { return 0 };
    // SAFETY: statvfs writes into the zeroed struct we pass.
    unsafe {
        let mut s: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut s) != 0 {
            return 0;
        }
        (s.f_bavail as u64).saturating_mul(s.f_frsize as u64)
    }
}

impl Config {
    /// `[peer]`: an endpoint the guard accepts (certificates readable, not open on the network
    /// by accident), client credentials that load, bounds that work.
    fn check_peer(&self) -> Result<(), ServerError> {
        let p = &self.peer;
        if let Some(a) = p.listen {
            kvnet::Guard::new("peer channel", &p.auth, a, &[]).map_err(|e| {
                let msg = e.to_string();
                bad("peer.auth", msg.strip_prefix("peer channel: ").unwrap_or(&msg))
            })?;
            // The peer channel moves blocks: loopback is no exception (any local user can
            // connect to it).
            if !p.auth.open && !p.auth.requires_credentials() {
                return Err(bad(
                    "peer.auth",
                    format!(
                        "peer.listen ({a}) serves blocks, so it needs credentials on every address, loopback too: set \
                         tokens_file or tls_client_ca, or open = true on a node whose users may all read every \
                         namespace"
                    ),
                ));
            }
        }
        if p.listen.is_none() {
            if !p.advertise.is_empty() {
                return Err(bad("peer.listen", "peer.advertise is set but peer.listen is not: set both or neither"));
            }
            if p.auth.requires_credentials() || p.auth.tls_cert.is_some() || p.auth.open {
                return Err(bad("peer.listen", "[peer.auth] is set but peer.listen is not: it would guard nothing"));
            }
        }
        kvnet::Connector::new(&p.client, &[]).map_err(|e| bad("peer.client", e.to_string()))?;
        SourcePolicy::new(&p.peers, &p.allowed_sources).map_err(|e| bad("peer.allowed_sources", e))?;
        at_least(
            1,
            &[
                ("peer.max_connections", p.max_connections as u64),
                ("peer.max_pulls", p.max_pulls as u64),
                ("peer.pull_deadline_ms", p.pull_deadline_ms),
                ("peer.connect_timeout_ms", p.connect_timeout_ms),
                ("peer.io_timeout_ms", p.io_timeout_ms),
                ("peer.idle_timeout_ms", p.idle_timeout_ms),
            ],
        )?;
        Ok(())
    }

    /// The TCP gRPC port and the HTTP port: each address with credentials its guard accepts
    /// (on a non-loopback address: credentials or `open = true`; readable certificate and token
    /// files); `[tcp_auth]` only with `tcp`. The same checks the listeners make when they start,
    /// so that `config` and `run` refuse alike, before anything is bound or announced.
    fn check_endpoints(&self) -> Result<(), ServerError> {
        let mut endpoints = vec![("metrics_auth", http::ENDPOINT, &self.metrics_auth, self.metrics_addr)];
        match self.tcp {
            Some(a) => endpoints.push(("tcp_auth", serve::TCP_ENDPOINT, &self.tcp_auth, a)),
            None if self.tcp_auth != kvnet::AuthConfig::default() => {
                return Err(bad("tcp_auth", "[tcp_auth] is set but tcp is not: it would guard nothing"));
            }
            None => {}
        }
        for (field, endpoint, auth, addr) in endpoints {
            kvnet::Guard::new(endpoint, auth, addr, &[]).map_err(|e| {
                let msg = e.to_string();
                bad(field, msg.strip_prefix(&format!("{endpoint}: ")).unwrap_or(&msg))
            })?;
        }
        Ok(())
    }

    /// G3's automatic size: the size of the data file an earlier start made (kept, so that
    /// the capacity does not move with the free space between restarts), else a quarter of the
    /// free space, at most 256 GiB.
    fn automatic_g3_capacity(&self) -> u64 {
        match std::fs::metadata(self.g3.dir.join("blocks.dat")) {
            Ok(m) if m.len() >= self.g3.page_size as u64 => {
                tracing::info!(bytes = m.len(), "G3 capacity kept from the data file (g3.capacity_bytes = 0)");
                m.len()
            }
            _ => (free_space(&self.g3.dir) / 4).min(256 << 30),
        }
    }

    /// Fills automatic sizes (0) and checks every field: the one check `config` and `run`
    /// both make before anything starts.
    pub fn resolve(mut self) -> Result<Self, ServerError> {
        if self.g2.capacity_bytes == 0 {
            self.g2.capacity_bytes = (machine_memory() / 4).clamp(64 << 20, 64 << 30);
        }
        if self.g3.enabled && self.g3.capacity_bytes == 0 {
            self.g3.capacity_bytes = self.automatic_g3_capacity();
            if self.g3.capacity_bytes < self.g3.page_size as u64 {
                return Err(bad(
                    "g3.capacity_bytes",
                    format!("no free space under {}: set g3.dir or disable g3", self.g3.dir.display()),
                ));
            }
        }
        self.socket_mode_bits()?;
        self.check_endpoints()?;
        self.check_peer()?;
        Tenants::new(&self.tenants, &self.namespaces)?;
        for (f, v) in [("g2.page_size", self.g2.page_size), ("g3.page_size", self.g3.page_size)] {
            if v == 0 || !v.is_multiple_of(4096) {
                return Err(bad(f, format!("{v} is not a positive multiple of 4096")));
            }
        }
        if !matches!(self.g2.cuda_register.as_str(), "auto" | "off" | "required") {
            return Err(bad("g2.cuda_register", format!("{:?}: use auto, off or required", self.g2.cuda_register)));
        }
        if !matches!(self.g3.io_backend.as_str(), "auto" | "io_uring" | "psync") {
            return Err(bad("g3.io_backend", format!("{:?}: use auto, io_uring or psync", self.g3.io_backend)));
        }
        if self.engines.max_engines == 0 || self.engines.max_engines > MAX_ENGINES {
            return Err(bad(
                "engines.max_engines",
                format!(
                    "must be in 1..={} (each engine's KV memory and token area are mappings the daemon guards)",
                    MAX_ENGINES
                ),
            ));
        }
        let l = &self.limits;
        at_least(
            1,
            &[
                ("limits.max_connections", l.max_connections),
                ("limits.max_connections_per_uid", l.max_connections_per_uid),
                ("limits.max_engines_per_uid", l.max_engines_per_uid),
                ("limits.max_pending_loads_per_uid", l.max_pending_loads_per_uid),
                ("limits.max_concurrent_streams", l.max_concurrent_streams as usize),
            ],
        )?;
        if !(64 << 10..=1 << 30).contains(&l.max_message_bytes) {
            return Err(bad("limits.max_message_bytes", "must be in 65536..=1073741824"));
        }
        if l.max_buffered_bytes_per_uid < l.max_message_bytes as u64 {
            return Err(bad("limits.max_buffered_bytes_per_uid", "must be at least limits.max_message_bytes"));
        }
        at_least(
            100,
            &[
                ("limits.request_timeout_ms", l.request_timeout_ms),
                ("limits.idle_timeout_ms", l.idle_timeout_ms),
                ("limits.handshake_timeout_ms", l.handshake_timeout_ms),
            ],
        )?;
        // A client waiting for an answer sends nothing: a shorter idle timeout would close
        // connections under requests still within their time.
        if l.idle_timeout_ms < l.request_timeout_ms {
            return Err(bad("limits.idle_timeout_ms", "must be at least limits.request_timeout_ms"));
        }
        if let Err((key, reason)) = self.http_limits.validate() {
            return Err(bad(&format!("http_limits.{key}"), reason));
        }
        if self.engines.lease_ms < 1000 {
            return Err(bad("engines.lease_ms", "must be at least 1000 (heartbeats are sent every third of it)"));
        }
        if self.router.node.is_empty() {
            self.router.node = host_name();
        }
        for u in &self.router.urls {
            if !(u.starts_with("http://") || u.starts_with("https://")) {
                return Err(bad("router.urls", format!("{u:?} is not an http:// or https:// URL")));
            }
            // The client trusts no certificate but those of router.auth.tls_ca, and with one it
            // would send its token and certificate to a plain URL by mistake.
            if u.starts_with("https://") && self.router.auth.tls_ca.is_none() {
                return Err(bad(
                    "router.auth.tls_ca",
                    format!("{u:?} is https://: set router.auth.tls_ca to the CA the router's certificate chains to"),
                ));
            }
            if u.starts_with("http://") && self.router.auth.tls_ca.is_some() {
                return Err(bad("router.urls", format!("{u:?}: router.auth.tls_ca is set: use https://")));
            }
        }
        if self.router.auth.tls_server_name.is_some() {
            return Err(bad(
                "router.auth.tls_server_name",
                "not used for HTTP: the router's certificate must carry the host of its URL in router.urls",
            ));
        }
        if self.router.report_interval_ms == 0 || self.router.event_log == 0 || self.router.max_pending == 0 {
            return Err(bad(
                "router.report_interval_ms",
                "report_interval_ms, event_log and max_pending must be at least 1",
            ));
        }
        // The ZMQ library is built with TCP only (it panics on other transports).
        for (field, ep) in [
            ("router.vllm_export", &self.router.vllm_export),
            ("router.vllm_export_replay", &self.router.vllm_export_replay),
        ] {
            if !ep.is_empty() && !ep.starts_with("tcp://") {
                return Err(bad(field, format!("{ep:?} must be tcp://host:port (e.g. tcp://0.0.0.0:5557)")));
            }
        }
        if !self.router.vllm_export_replay.is_empty() && self.router.vllm_export.is_empty() {
            return Err(bad("router.vllm_export_replay", "needs router.vllm_export (the stream it replays)"));
        }
        if !self.router.vllm_export_replay.is_empty() && self.router.vllm_export_replay_bytes == 0 {
            return Err(bad("router.vllm_export_replay_bytes", "must be at least 1 with a replay socket"));
        }
        match self.events.transport.as_str() {
            "http" => {}
            "nats" | "both" => {
                if !self.events.nats.enabled() {
                    return Err(bad(
                        "events.nats.servers",
                        "transports \"nats\" and \"both\" need at least one server URL",
                    ));
                }
                self.events.nats.validate().map_err(|e| bad("events.nats", e))?;
            }
            other => return Err(bad("events.transport", format!("{other:?} must be \"http\", \"nats\" or \"both\""))),
        }
        let g4_set = !self.g4.url.is_empty() || !self.g4.endpoint.is_empty();
        if g4_set && !self.g4.enabled {
            return Err(bad(
                "g4.enabled",
                "g4.url or g4.endpoint is set but g4.enabled is false: set g4.enabled = true to use G4, or remove them",
            ));
        }
        if self.g4.enabled {
            let g = &self.g4;
            if !(g.url.starts_with("s3://") || g.url.starts_with("file:///")) {
                return Err(bad("g4.url", format!("{:?}: use s3://BUCKET/PREFIX or file:///PATH", g.url)));
            }
            if !(g.endpoint.is_empty() || g.endpoint.starts_with("http://") || g.endpoint.starts_with("https://")) {
                return Err(bad("g4.endpoint", format!("{:?} is not an http(s):// URL", g.endpoint)));
            }
            if g.endpoint.starts_with("http://") && !g.allow_http {
                return Err(bad("g4.allow_http", "the endpoint is http://: set g4.allow_http = true to allow it"));
            }
            at_least(
                1,
                &[
                    ("g4.concurrency", g.concurrency),
                    ("g4.probe_fanout", g.probe_fanout),
                    ("g4.writethrough_queue", g.writethrough_queue),
                    ("g4.writethrough_batch", g.writethrough_batch),
                ],
            )?;
            if g.request_timeout_ms < 100 || g.retry_deadline_ms < g.request_timeout_ms {
                return Err(bad("g4.retry_deadline_ms", "request_timeout_ms >= 100 and retry_deadline_ms >= it"));
            }
        }
        if self.g3.writethrough_queue == 0 || self.g3.writethrough_batch == 0 {
            return Err(bad("g3.writethrough_queue", "queue and batch must be at least 1"));
        }
        for (tier, high, low) in [
            ("g2", self.g2.high_watermark, self.g2.low_watermark),
            ("g3", self.g3.high_watermark, self.g3.low_watermark),
        ] {
            if !(0.0 < low && low <= high && high <= 1.0) {
                return Err(bad(
                    if tier == "g2" { "g2.low_watermark" } else { "g3.low_watermark" },
                    format!("{tier}.low_watermark {low} and {tier}.high_watermark {high}: need 0 < low <= high <= 1"),
                ));
            }
        }
        Ok(self)
    }
}
