//! `kvcached`: the per-node daemon.
//!
//! # Layout
//! - [`cli`]: the command line (`kvcached [run|config]`, flags, environment); `main.rs` calls it.
//! - [`config`]: defaults, TOML file, `KVCACHED_*` environment and flags; validation.
//! - [`Listeners`] (this file): what the daemon binds, bound by the caller (tests use temp
//!   sockets and port 0).
//! - [`serve`] (`serve.rs`): the daemon's life by phase: open the store, start the hit reports,
//!   serve the listeners, drain and flush on shutdown.
//! - [`listen`]: accept loops: connections counted per uid, idle ones closed, accept errors
//!   backed off; ATTACH and LOOKUP told from gRPC by their first bytes.
//! - [`attach`]: ATTACH, descriptors handed over the Unix socket, redeemed by Register.
//! - [`lookup_wire`]: LOOKUP, connections on the Unix socket that carry only lookups (no HTTP/2).
//! - [`limits`]: what each uid holds (connections, engines and their mapped memory, loads, bytes
//!   arriving), the limits, and the fair shares of the totals.
//! - [`edge`]: who sent a request (uid, TCP address and certificate), the bytes of requests
//!   still arriving per uid, and `blocking()` for request work off the async path.
//! - `rate_log`: a warning repeated at most every 10 s, with a count.
//! - [`sched`]: a save's copy offers its core every MiB to the threads answering requests.
//! - [`h2_authority`]: stock gRPC clients' header blocks made acceptable (grpcio sends the
//!   socket path as `:authority`).
//! - [`peer`]: peer transfer: the `peer.listen` endpoint and the puller (blocks from and to
//!   other daemons, verified on arrival).
//! - [`metrics_catalog`]: every `kvcached_*` metric's help, unit and buckets; per-RPC series.
//! - [`service`]: the gRPC service (tonic), each call's caller passed on; Health-only TCP,
//!   authenticated per request ([`service::TcpAuth`], `tcp_auth`).
//! - [`daemon`]: request logic: save (gather into G2), lookup, load (scatter from G2/G3).
//! - [`key_memo`]: key chains of recent prompts, reused by later requests for the same tokens.
//! - [`prefix_probe`]: thread `kv-probe`, probing a long prompt's keys while they are derived.
//! - [`engine`]: attached engines, their memory mappings and heartbeat leases.
//! - [`tenants`]: the trust model: who may name which tenant salt, who writes and who reads
//!   each namespace (bindings kept across restarts). Tenants' quotas are applied by the tiers
//!   themselves (`kvtiers::quota`), set from `[[tenants]]` by [`config`].
//! - [`fault_guard`]: a SIGBUS in an engine's mapping (the engine truncated its file) becomes
//!   that engine's error instead of the daemon's death.
//! - [`token_area`]: an engine's shared-memory file of long prompts' tokens (read-only here).
//! - [`http`]: `/metrics`, `/healthz`, and the event replay / snapshot routes for routers.
//! - [`prefetch`]: `POST /prefetch`, a router's hint to bring a chain into G2 early.
//! - [`reports`]: hit reports to kvrouter (tier events, G1 from engines, load, outcomes).
//! - [`publish`]: [`publish::HttpPublisher`], shipping them to every router (bounded, never
//!   blocks; routers replay what it could not send from the log served by [`http`]).
//! - [`vllm_export`]: the tiers' events in vLLM's ZMQ wire format, for routers that read those.
//! - `vllm_origins`: the export's records of G3 blocks, kept in a file across restarts.
//! - [`zmq_export`]: the ZMQ PUB socket (and replay socket) the export writes to.
//! - [`faults`]: fault injection into G3's I/O and G4's requests, for the fault suites only
//!   (`inject_faults`).
//! - [`error`]: the [`ServerError`] enum and the gRPC status and reason each variant becomes.

mod check;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod edge;
pub mod engine;
pub mod error;
pub mod export;
pub mod faults;
pub mod metrics_catalog;
pub mod peer;
pub mod policy;
mod rate_log;
pub mod sched;
mod serve;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use tokio::net::{TcpListener, UnixListener};

pub use config::Config;
pub use error::ServerError;
pub use serve::{serve, serve_announcing};

/// Listeners the daemon serves on (bound by the caller, so tests can use temp sockets and
/// port 0).
#[derive(Debug)]
pub struct Listeners {
    pub unix: UnixListener,
    pub tcp: Option<TcpListener>,
    pub http: Option<TcpListener>,
    /// The peer channel (`peer.listen`).
    pub peer: Option<TcpListener>,
}

impl Listeners {
    /// Binds what `config` names: the Unix socket (replacing a stale one, mode applied), the
    /// TCP listener if set, and the metrics address.
    pub async fn bind(config: &Config) -> Result<Self, ServerError> {
        let unix = bind_unix(&config.socket, config.socket_mode_bits()?)?;
        let tcp = match config.tcp {
            Some(a) => Some(TcpListener::bind(a).await?),
            None => None,
        };
        let http = Some(TcpListener::bind(config.metrics_addr).await.map_err(|e| ServerError::Config {
            field: "metrics_addr".into(),
            reason: format!("cannot listen on {}: {e}", config.metrics_addr),
        })?);
        let peer = match config.peer.listen {
            Some(a) => Some(TcpListener::bind(a).await.map_err(|e| ServerError::Config {
                field: "peer.listen".into(),
                reason: format!("cannot listen on {a}: {e}"),
            })?),
            None => None,
        };
        Ok(Self { unix, tcp, http, peer })
    }
}

/// Binds a Unix socket at `path` with permissions `mode`, removing a stale socket file.
pub fn bind_unix(path: &Path, mode: u32) -> Result<UnixListener, ServerError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(ServerError::Config {
                field: "socket".into(),
                reason: format!("{} is in use by a running daemon", path.display()),
            });
        }
        std::fs::remove_file(path)?;
    }
    let l = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(l)
}
