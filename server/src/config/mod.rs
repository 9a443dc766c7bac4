//! Configuration: embedded defaults, then a TOML file, then `KVCACHED_*` environment
//! variables, then command-line flags (later wins). `kvcached config` prints the result.
//! Every field is documented in `docs/configuration.md`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::ServerError;

mod peer;
mod tenants;

pub use peer::PeerConfig;
pub use tenants::{NamespaceRule, TenantConfig};

/// The daemon's effective configuration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Unix socket engines connect to.
    pub socket: PathBuf,
    /// Permission bits of the socket (octal in TOML as a string, e.g. "0660").
    pub socket_mode: String,
    /// TCP address of the gRPC API; empty: no TCP listener. It serves only Health (engines
    /// attach over the Unix socket).
    pub tcp: Option<SocketAddr>,
    /// Who may use `tcp`: TLS, client certificates, bearer tokens (docs/configuration.md). On a
    /// non-loopback address it needs credentials, or `open = true`.
    pub tcp_auth: kvnet::AuthConfig,
    /// HTTP address of /metrics, /healthz and the recovery routes (loopback by default).
    pub metrics_addr: SocketAddr,
    /// Who may use `metrics_addr` (`/metrics`, `/events/replay`, `/events/snapshot`; `/healthz`
    /// and `/livez` stay open for probes). The same rules as `tcp_auth`.
    pub metrics_auth: kvnet::AuthConfig,
    /// Bounds on `metrics_addr`'s listener: connections, header and idle timeouts, HTTP/2
    /// streams (`[http_limits]`).
    pub http_limits: kvnet::HttpLimits,
    pub g2: G2Config,
    pub g3: G3Config,
    pub g4: G4Config,
    pub engines: EngineConfig,
    pub limits: LimitsConfig,
    pub router: RouterConfig,
    /// How hit reports travel: each router's `POST /events` (`router.urls`), or the NATS
    /// JetStream event plane (`[events]`, docs/router.md "The event plane on NATS").
    pub events: EventsConfig,
    /// Peer transfer: blocks pulled from and served to other daemons.
    pub peer: PeerConfig,
    /// For the fault suites only, never in production: a file naming faults to inject into G3's
    /// I/O and G4's requests, read again whenever it changes (`server/src/faults.rs`). Unset
    /// (the default): nothing is wrapped.
    pub inject_faults: Option<PathBuf>,
    /// Tenants: who may name which tenant salt, and their G2/G3/G4 quotas (`[[tenants]]`,
    /// `tenants.rs`, `quota.rs`). None: every uid is a tenant of its own, without quotas.
    pub tenants: Vec<TenantConfig>,
    /// Who writes and who reads unsalted namespaces (`[[namespaces]]`, `tenants.rs`); a
    /// namespace no entry names is written by its first registrant's tenant only, and read by no
    /// other.
    pub namespaces: Vec<NamespaceRule>,
}

/// What one client (one uid on the Unix socket) and all of them together may hold, and how long
/// a connection may take (docs/operations/security-limits.md, "Limits").
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Connections open at once, over every listener (at most half the file descriptors the
    /// process may open).
    pub max_connections: usize,
    /// Connections one uid may hold open on the Unix socket.
    pub max_connections_per_uid: usize,
    /// Engines one uid may have attached (`engines.max_engines` bounds them all).
    pub max_engines_per_uid: usize,
    /// Bytes of shared-memory engine regions one uid's engines may have the daemon map (the
    /// extent of their block slots); 0: a quarter of the machine's memory.
    pub max_engine_memory_bytes_per_uid: u64,
    /// Loads one uid may have in flight, over all its engines.
    pub max_pending_loads_per_uid: usize,
    /// Largest gRPC message (prompts longer than a quarter of it go through the token area).
    pub max_message_bytes: usize,
    /// Requests in flight on one connection.
    pub max_concurrent_streams: u32,
    /// Bytes of requests still arriving that one uid may have the daemon hold.
    pub max_buffered_bytes_per_uid: u64,
    /// The longest a request may take, from its first byte to its answer (ms).
    pub request_timeout_ms: u64,
    /// A connection that sends nothing for this long is closed (ms).
    pub idle_timeout_ms: u64,
    /// A new connection must send its first bytes within this long (ms).
    pub handshake_timeout_ms: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_connections_per_uid: 64,
            max_engines_per_uid: 16,
            max_engine_memory_bytes_per_uid: 0,
            max_pending_loads_per_uid: 4096,
            max_message_bytes: kvproto::limits::DEFAULT_MAX_MESSAGE_BYTES,
            max_concurrent_streams: 64,
            max_buffered_bytes_per_uid: 256 << 20,
            request_timeout_ms: 60_000,
            idle_timeout_ms: 300_000,
            handshake_timeout_ms: 5_000,
        }
    }
}

/// Hit reports to kvrouter (docs/router.md section 2).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// Base URLs of the routers (`http://host:port`); empty: no hit reports.
    pub urls: Vec<String>,
    /// This node's name in the cluster; empty: the host name.
    pub node: String,
    /// Report (and heartbeat) period.
    pub report_interval_ms: u64,
    /// Events kept for routers to replay after a gap.
    pub event_log: usize,
    /// Events waiting to be sent; beyond this they are left to replay.
    pub max_pending: usize,
    /// The URL routers use to reach this daemon's HTTP listener for replay and snapshots;
    /// empty: `http://<metrics_addr>` (`https://` with `metrics_auth.tls_cert`) when that is not
    /// a wildcard address.
    pub advertise_url: String,
    /// What this daemon presents to the routers: the CA their certificates chain to (needed for
    /// `https://` URLs), a client certificate, a token.
    pub auth: kvnet::ClientAuthConfig,
    /// ZMQ endpoint to publish this node's G2/G3 events on in vLLM's wire format (e.g.
    /// `tcp://0.0.0.0:5557`); empty: off.
    pub vllm_export: String,
    /// Topic of those messages.
    pub vllm_export_topic: String,
    /// ZMQ endpoint of the export's replay socket (as vLLM's `replay_endpoint`: subscribers
    /// that missed batches ask for them there); empty: none.
    pub vllm_export_replay: String,
    /// Bytes of recent export batches kept for replay.
    pub vllm_export_replay_bytes: u64,
}

/// How hit reports travel.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct EventsConfig {
    /// "http": POST to each of `router.urls` (none: no reports). "nats": publish on
    /// `nats`'s stream only (`router.urls` unused). "both": the stream and `router.urls`, for a
    /// cluster migrating from one to the other.
    pub transport: String,
    /// The NATS JetStream event plane (`[events.nats]`).
    pub nats: kvnet::bus::NatsConfig,
}

impl Default for EventsConfig {
    fn default() -> Self {
        Self { transport: "http".into(), nats: kvnet::bus::NatsConfig::default() }
    }
}

impl EventsConfig {
    /// The NATS event plane, when the transport is "nats" or "both".
    pub fn nats(&self) -> Option<&kvnet::bus::NatsConfig> {
        matches!(self.transport.as_str(), "nats" | "both").then_some(&self.nats)
    }

    /// Whether reports are POSTed to `router.urls` ("http" or "both").
    pub fn http(&self) -> bool {
        self.transport != "nats"
    }
}

/// G2, the host pool.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct G2Config {
    /// Bytes; 0 = a quarter of the machine's memory, at most 64 GiB.
    pub capacity_bytes: u64,
    pub page_size: usize,
    pub shm_dir: PathBuf,
    pub mlock: bool,
    /// "auto", "off" or "required".
    pub cuda_register: String,
    /// How long a save may wait for write-through to free G2 space (ms).
    pub dirty_wait_ms: u64,
    /// Map the whole pool in a background thread at start, so saves take no page faults.
    pub prefault: bool,
    /// Eviction starts when a save would take usage above this fraction of the capacity...
    pub high_watermark: f64,
    /// ...and frees blocks until usage is at this fraction.
    pub low_watermark: f64,
}

/// G3, the disk tier.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct G3Config {
    pub enabled: bool,
    pub dir: PathBuf,
    /// Bytes; 0 = a quarter of the free space of `dir`'s filesystem, at most 256 GiB.
    pub capacity_bytes: u64,
    pub page_size: usize,
    /// "auto", "io_uring" or "psync".
    pub io_backend: String,
    pub io_threads: usize,
    /// With I/O threads, G3 read (write) batches of at most this many bytes run on the calling
    /// thread.
    pub inline_read_max: usize,
    pub inline_write_max: usize,
    pub fsync: bool,
    pub writethrough_queue: usize,
    pub writethrough_batch: usize,
    /// As for G2: eviction above `high_watermark` of the capacity, down to `low_watermark`.
    pub high_watermark: f64,
    pub low_watermark: f64,
}

/// G4, object storage shared by the cluster (docs/configuration.md, "G4"). Credentials come
/// from the environment only (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`
/// or the rest of the usual chain), never from this file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct G4Config {
    pub enabled: bool,
    /// `s3://BUCKET/PREFIX` or `file:///PATH` (a mount every node shares).
    pub url: String,
    /// An S3-compatible endpoint (`https://host:port`); empty: AWS.
    pub endpoint: String,
    pub region: String,
    /// Allow an `http://` endpoint.
    pub allow_http: bool,
    /// `bucket.host` addressing instead of path style.
    pub virtual_hosted_style: bool,
    /// Bytes of objects this daemon keeps before deleting the least recently used; 0: none
    /// (bound the prefix with a bucket lifecycle rule).
    pub capacity_bytes: u64,
    /// Requests in flight at once per batch.
    pub concurrency: usize,
    pub request_timeout_ms: u64,
    /// How long a failing request is retried (with backoff) before it fails.
    pub retry_deadline_ms: u64,
    /// Keys asked per round trip when a lookup probes G4.
    pub probe_fanout: usize,
    /// A key found absent is not asked again for this long (ms).
    pub absent_ttl_ms: u64,
    /// Lookups ask G4 past what this daemon knows it holds (a few round trips when the local
    /// tiers end before the prompt does); off: G4 is used only as far as this daemon's index
    /// knows.
    pub lookup_probe: bool,
    /// Blocks waiting to be written to G4; beyond this a write is dropped and counted.
    pub writethrough_queue: usize,
    /// Blocks written per batch (requests in flight).
    pub writethrough_batch: usize,
    /// Latency added to every G4 request, for tests and benchmarks (a distant store); 0: none.
    pub inject_latency_ms: u64,
}

impl Default for G4Config {
    fn default() -> Self {
        Self {
            enabled: false,
            url: String::new(),
            endpoint: String::new(),
            region: "us-east-1".into(),
            allow_http: false,
            virtual_hosted_style: false,
            capacity_bytes: 0,
            concurrency: 16,
            request_timeout_ms: 10_000,
            retry_deadline_ms: 10_000,
            probe_fanout: 16,
            absent_ttl_ms: 2_000,
            lookup_probe: true,
            writethrough_queue: 65_536,
            writethrough_batch: 16,
            inject_latency_ms: 0,
        }
    }
}

/// Attached engines.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    pub max_engines: usize,
    /// An engine that sends no heartbeat for this long is dropped and its memory unmapped.
    pub lease_ms: u64,
    /// Pending load operations per engine.
    pub max_pending_loads: usize,
    /// How long a finished load's status stays available to `Wait` (ms).
    pub op_retention_ms: u64,
    /// Bytes of recent long prompts (tokens and keys) whose keys later requests for the same
    /// tokens reuse instead of deriving them again; 0: off.
    pub key_memo_bytes: u64,
    /// Map a shared-memory engine region with its page tables filled at register
    /// (`MAP_POPULATE`), so that its first saves and loads take no page faults.
    pub prefault_memory: bool,
    /// At shutdown, the longest the daemon waits for open requests and connections to finish
    /// (ms) before it closes them and flushes anyway.
    pub drain_ms: u64,
    /// Serve LOOKUP: Unix-socket connections that carry only lookups, framed without HTTP/2
    /// (proto/kvcached.proto). Off, clients look up over gRPC.
    pub lookup_wire: bool,
}

fn data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_DATA_HOME") {
        return PathBuf::from(d).join("kvcached");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".local/share/kvcached"),
        None => std::env::temp_dir().join("kvcached-data"),
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            socket: kvproto::paths::default_socket(),
            socket_mode: "0660".into(),
            tcp: None,
            tcp_auth: kvnet::AuthConfig::default(),
            metrics_addr: SocketAddr::from(([127, 0, 0, 1], 9464)),
            metrics_auth: kvnet::AuthConfig::default(),
            http_limits: kvnet::HttpLimits::default(),
            g2: G2Config::default(),
            g3: G3Config::default(),
            g4: G4Config::default(),
            engines: EngineConfig::default(),
            limits: LimitsConfig::default(),
            router: RouterConfig::default(),
            events: EventsConfig::default(),
            peer: PeerConfig::default(),
            inject_faults: None,
            tenants: Vec::new(),
            namespaces: Vec::new(),
        }
    }
}

impl Default for G2Config {
    fn default() -> Self {
        let shm = Path::new("/dev/shm");
        Self {
            capacity_bytes: 0,
            page_size: 64 * 1024,
            shm_dir: if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() },
            mlock: false,
            cuda_register: "auto".into(),
            dirty_wait_ms: 100,
            prefault: true,
            high_watermark: 0.98,
            low_watermark: 0.95,
        }
    }
}

impl Default for G3Config {
    fn default() -> Self {
        Self {
            enabled: true,
            dir: data_dir().join("g3"),
            capacity_bytes: 0,
            page_size: 64 * 1024,
            io_backend: "auto".into(),
            io_threads: 2,
            inline_read_max: kvtiers::disk::io::INLINE_MAX,
            inline_write_max: kvtiers::disk::io::INLINE_MAX,
            fsync: true,
            writethrough_queue: 4096,
            writethrough_batch: 32,
            high_watermark: 0.98,
            low_watermark: 0.95,
        }
    }
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            urls: Vec::new(),
            node: String::new(),
            report_interval_ms: 1000,
            event_log: 65_536,
            max_pending: 16_384,
            advertise_url: String::new(),
            auth: kvnet::ClientAuthConfig::default(),
            vllm_export: String::new(),
            vllm_export_topic: String::new(),
            vllm_export_replay: String::new(),
            vllm_export_replay_bytes: 64 << 20,
        }
    }
}

/// The machine's host name ("localhost" if it cannot be read).
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match (r, std::str::from_utf8(&buf[..end])) {
        (0, Ok(s)) if !s.is_empty() => s.to_string(),
        _ => "localhost".into(),
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_engines: 64,
            lease_ms: 15_000,
            max_pending_loads: 1024,
            op_retention_ms: 60_000,
            key_memo_bytes: 32 << 20,
            prefault_memory: true,
            drain_ms: 20_000,
            lookup_wire: true,
        }
    }
}

pub(crate) fn bad(field: &str, reason: impl Into<String>) -> ServerError {
    ServerError::Config { field: field.to_string(), reason: reason.into() }
}

impl Config {
    /// Reads a TOML file; unknown fields and bad values name the field.
    pub fn from_file(path: &Path) -> Result<Self, ServerError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad("--config", format!("cannot read {}: {e}", path.display())))?;
        toml::from_str(&text).map_err(|e| bad("--config", format!("{}: {e}", path.display())))
    }

    /// The socket permission bits.
    pub fn socket_mode_bits(&self) -> Result<u32, ServerError> {
        u32::from_str_radix(self.socket_mode.trim_start_matches("0o"), 8)
            .ok()
            .filter(|m| *m <= 0o777)
            .ok_or_else(|| bad("socket_mode", format!("{:?} is not an octal mode like \"0660\"", self.socket_mode)))
    }

    /// The block store configuration these settings describe.
    pub fn store_config(&self) -> kvtiers::BlockStoreConfig {
        // Tenant `i` of `[[tenants]]` is owner `i` of the blocks its saves store.
        let quotas = |bytes: fn(&TenantConfig) -> u64| -> Vec<kvtiers::Quota> {
            self.tenants.iter().map(|t| kvtiers::Quota { name: t.name.clone(), bytes: bytes(t) }).collect()
        };
        let mut g2 = kvtiers::HostTierConfig::with_capacity(self.g2.capacity_bytes);
        g2.quotas = quotas(|t| t.g2_quota_bytes);
        g2.page_size = self.g2.page_size;
        g2.shm_dir = self.g2.shm_dir.clone();
        g2.mlock = self.g2.mlock;
        g2.populate = false;
        g2.dirty_wait = std::time::Duration::from_millis(self.g2.dirty_wait_ms);
        g2.high_watermark = self.g2.high_watermark;
        g2.low_watermark = self.g2.low_watermark;
        g2.cuda_register = match self.g2.cuda_register.as_str() {
            "off" => kvtiers::CudaRegister::Off,
            "required" => kvtiers::CudaRegister::Required,
            _ => kvtiers::CudaRegister::Auto,
        };
        let g3 = self.g3.enabled.then(|| {
            let mut c = kvtiers::DiskTierConfig::new(&self.g3.dir, self.g3.capacity_bytes);
            c.page_size = self.g3.page_size;
            c.io_threads = self.g3.io_threads;
            c.inline_read_max = self.g3.inline_read_max;
            c.inline_write_max = self.g3.inline_write_max;
            c.fsync = self.g3.fsync;
            c.high_watermark = self.g3.high_watermark;
            c.low_watermark = self.g3.low_watermark;
            c.quotas = quotas(|t| t.g3_quota_bytes);
            c.backend = match self.g3.io_backend.as_str() {
                "io_uring" => kvtiers::disk::io::IoBackend::IoUring,
                "psync" => kvtiers::disk::io::IoBackend::Psync,
                _ => kvtiers::disk::io::IoBackend::Auto,
            };
            c
        });
        let g4 = self.g4.enabled.then(|| {
            let g = &self.g4;
            let mut c = kvtiers::ObjectTierConfig::new(&g.url);
            c.endpoint = (!g.endpoint.is_empty()).then(|| g.endpoint.clone());
            c.region = g.region.clone();
            c.allow_http = g.allow_http;
            c.virtual_hosted_style = g.virtual_hosted_style;
            c.capacity_bytes = g.capacity_bytes;
            c.concurrency = g.concurrency;
            c.request_timeout = std::time::Duration::from_millis(g.request_timeout_ms);
            c.retry_deadline = std::time::Duration::from_millis(g.retry_deadline_ms);
            c.probe_fanout = g.probe_fanout;
            c.absent_ttl = std::time::Duration::from_millis(g.absent_ttl_ms);
            c.inject_latency = (g.inject_latency_ms > 0).then(|| std::time::Duration::from_millis(g.inject_latency_ms));
            c.quotas = quotas(|t| t.g4_quota_bytes);
            c
        });
        kvtiers::BlockStoreConfig {
            g2,
            g3,
            write_through: kvtiers::WriteThroughConfig {
                queue: self.g3.writethrough_queue,
                batch: self.g3.writethrough_batch,
            },
            g4,
            g4_write_through: kvtiers::WriteThroughConfig {
                queue: self.g4.writethrough_queue,
                batch: self.g4.writethrough_batch,
            },
        }
    }

    /// The configuration as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render configuration: {e}\n"))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn defaults_resolve_and_roundtrip() {
        let c = Config::default().resolve().unwrap();
        assert!(c.g2.capacity_bytes >= 64 << 20);
        let back: Config = toml::from_str(&c.to_toml()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn bad_values_name_the_field() {
        let mut c = Config::default();
        c.g2.page_size = 1000;
        assert!(c.resolve().unwrap_err().to_string().contains("g2.page_size"));
        let e = toml::from_str::<Config>("[g3]\nio_backend = 3\n").unwrap_err().to_string();
        assert!(e.contains("io_backend"), "{e}");
        let e = toml::from_str::<Config>("sockett = \"x\"\n").unwrap_err().to_string();
        assert!(e.contains("sockett"), "{e}");
        let c = Config { socket_mode: "rw".into(), ..Default::default() };
        assert!(c.resolve().unwrap_err().to_string().contains("socket_mode"));
        let mut c = Config::default();
        c.g3.enabled = false;
        c.g2.capacity_bytes = 64 << 20;
        c.g2.low_watermark = 0.99;
        let e = c.resolve().unwrap_err().to_string();
        assert!(e.contains("g2.low_watermark") && e.contains("0 < low <= high <= 1"), "{e}");
        for n in [0, crate::engine::fault_guard::MAX_ENGINES + 1] {
            let mut c = Config::default();
            c.engines.max_engines = n;
            let e = c.resolve().unwrap_err().to_string();
            assert!(e.contains("engines.max_engines") && e.contains("1..=1024"), "{e}");
        }
        let mut c = Config::default();
        c.http_limits.header_timeout_ms = 10;
        assert!(c.resolve().unwrap_err().to_string().contains("http_limits.header_timeout_ms"));
        let mut c = Config::default();
        c.http_limits.max_connections = 0;
        assert!(c.resolve().unwrap_err().to_string().contains("http_limits.max_connections"));
        // A client waiting for its answer sends nothing: the idle timeout may not be shorter.
        let mut c = Config::default();
        c.limits.idle_timeout_ms = 1000;
        c.limits.request_timeout_ms = 2000;
        let e = c.resolve().unwrap_err().to_string();
        assert!(e.contains("limits.idle_timeout_ms") && e.contains("request_timeout_ms"), "{e}");
    }

    /// The daemon's client of the routers trusts only `router.auth.tls_ca`: an https:// URL needs
    /// it, and with it an http:// URL is a mistake (the token would go out in the clear).
    #[test]
    fn router_auth_matches_the_urls_scheme() {
        let mut c = Config::default();
        c.router.urls = vec!["https://router:8090".into()];
        let e = c.clone().resolve().unwrap_err().to_string();
        assert!(e.contains("router.auth.tls_ca"), "{e}");
        c.router.auth.tls_ca = Some("/etc/kvcached/ca.crt".into());
        assert!(c.clone().resolve().is_ok());
        c.router.urls = vec!["http://router:8090".into()];
        let e = c.clone().resolve().unwrap_err().to_string();
        assert!(e.contains("router.urls") && e.contains("use https://"), "{e}");
        let e = toml::from_str::<Config>("[metrics_auth]\ntoken_file = \"x\"\n").unwrap_err().to_string();
        assert!(e.contains("token_file"), "unknown fields of an auth section are refused: {e}");
    }

    #[test]
    fn the_export_replay_needs_the_export() {
        let mut c = Config::default();
        c.router.vllm_export_replay = "tcp://127.0.0.1:0".into();
        assert!(c.clone().resolve().unwrap_err().to_string().contains("router.vllm_export_replay"));
        c.router.vllm_export = "tcp://127.0.0.1:0".into();
        c.router.vllm_export_replay_bytes = 0;
        assert!(c.clone().resolve().unwrap_err().to_string().contains("router.vllm_export_replay_bytes"));
        c.router.vllm_export_replay_bytes = 1 << 20;
        assert!(c.clone().resolve().is_ok());
        c.router.vllm_export_replay = "ipc:///tmp/kvcached-replay".into();
        assert!(c.resolve().unwrap_err().to_string().contains("tcp://"));
    }

    #[test]
    fn watermarks_and_inline_io_bounds_reach_the_tiers() {
        let mut c = Config::default();
        c.g3.dir = std::env::temp_dir().join("kvcached-watermark-test");
        c.g3.capacity_bytes = 1 << 30;
        c.g2.capacity_bytes = 64 << 20;
        (c.g2.high_watermark, c.g2.low_watermark) = (0.9, 0.8);
        (c.g3.high_watermark, c.g3.low_watermark) = (0.7, 0.6);
        (c.g3.inline_read_max, c.g3.inline_write_max) = (1 << 20, 0);
        let s = c.resolve().unwrap().store_config();
        assert_eq!((s.g2.high_watermark, s.g2.low_watermark), (0.9, 0.8));
        let g3 = s.g3.unwrap();
        assert_eq!((g3.high_watermark, g3.low_watermark), (0.7, 0.6));
        assert_eq!((g3.inline_read_max, g3.inline_write_max), (1 << 20, 0));
    }
}
