//! `kvcached`: the per-node daemon.
//!
//! # Layout
//! - [`config`]: defaults, TOML file, `KVCACHED_*` environment and flags; validation.
//! - [`serve`] (this file): binds nothing itself; serves gRPC on the given listeners, HTTP on
//!   the metrics listener, runs housekeeping, and drains on shutdown.
//! - [`service`]: the gRPC edge (tonic), errors mapped to `Status` here only.
//! - [`daemon`]: request logic: save (gather into G2), lookup, load (scatter from G2/G3).
//! - [`key_memo`]: key chains of recent prompts, reused by later requests for the same tokens.
//! - [`prefix_probe`]: thread `kv-probe`, probing a long prompt's keys while they are derived.
//! - [`engine`]: attached engines, their memory mappings and heartbeat leases.
//! - [`fault_guard`]: a SIGBUS in an engine's mapping (the engine truncated its file) becomes
//!   that engine's error instead of the daemon's death.
//! - [`token_area`]: an engine's shared-memory file of long prompts' tokens (read-only here).
//! - [`http`]: `/metrics`, `/healthz`, and the event replay / snapshot routes for routers.
//! - [`reports`]: hit reports to kvrouter (tier events, G1 from engines, load, outcomes).
//! - [`vllm_export`]: the tiers' events in vLLM's ZMQ wire format, for routers that read those.
//! - `vllm_origins`: the export's records of G3 blocks, kept in a file across restarts.
//! - [`error`]: the [`ServerError`] enum.
//! - [`demo`]: two engines handing blocks over through a running daemon.

pub mod config;
pub mod daemon;
pub mod demo;
pub mod engine;
pub mod error;
pub mod fault_guard;
pub mod http;
pub mod key_memo;
pub mod prefix_probe;
pub mod reports;
pub mod service;
pub mod token_area;
pub mod vllm_export;
mod vllm_origins;

use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvproto::pb::kvcached_server::KvcachedServer;
use tokio::net::{TcpListener, UnixListener};
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};

pub use config::Config;
pub use error::ServerError;

/// Listeners the daemon serves on (bound by the caller, so tests can use temp sockets and
/// port 0).
#[derive(Debug)]
pub struct Listeners {
    pub unix: UnixListener,
    pub tcp: Option<TcpListener>,
    pub http: Option<TcpListener>,
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
        Ok(Self { unix, tcp, http })
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

/// The gRPC server settings of both listeners. A 128k-token prompt is a 512 KiB request:
/// large HTTP/2 frames and windows let it arrive in a few frames without waiting for window
/// updates (the defaults are 16 KiB frames).
fn grpc_server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .max_frame_size(1 << 20)
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(16 << 20)
}

/// Runs the daemon until `shutdown` resolves, then stops accepting, drains in-flight requests
/// and loads, flushes the write-through queue, detaches engines and removes the socket.
pub async fn serve(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    http::prometheus();
    let store_cfg = config.store_config();
    let store = tokio::task::spawn_blocking(move || kvtiers::BlockStore::open(&store_cfg))
        .await
        .map_err(|e| ServerError::Io(std::io::Error::other(e)))??;
    let store = Arc::new(store);
    if config.g2.prefault {
        let g2 = Arc::downgrade(store.g2());
        let spawned = std::thread::Builder::new().name("kv-g2-prefault".into()).spawn(move || {
            let t0 = std::time::Instant::now();
            let bytes = kvtiers::HostTier::prefault(&g2);
            tracing::info!(bytes, took_ms = t0.elapsed().as_millis() as u64, "G2 pool prefaulted");
        });
        if let Err(e) = spawned {
            tracing::warn!("cannot start the G2 prefault thread: {e}");
        }
    }
    let engines = engine::Registry::new(config.engines.max_engines, Duration::from_millis(config.engines.lease_ms))
        .prefault_memory(config.engines.prefault_memory)
        .forbid(
            std::iter::once(store.g2().shm_path().to_path_buf())
                .chain(config.g3.enabled.then(|| config.g3.dir.clone())),
        );
    let http_addr = listeners.http.as_ref().and_then(|l| l.local_addr().ok());
    let recovery_url = if config.router.advertise_url.is_empty() {
        http_addr.filter(|a| !a.ip().is_unspecified()).map(|a| format!("http://{a}"))
    } else {
        Some(config.router.advertise_url.clone())
    };
    let vllm = if config.router.vllm_export.is_empty() {
        None
    } else {
        Some(Arc::new(
            vllm_export::VllmExport::start(
                &config.router.vllm_export,
                &config.router.vllm_export_topic,
                (!config.router.vllm_export_replay.is_empty())
                    .then_some((config.router.vllm_export_replay.as_str(), config.router.vllm_export_replay_bytes)),
                config.g3.enabled.then(|| config.g3.dir.join("vllm-origins.log")),
            )
            .await?,
        ))
    };
    let reports = Arc::new(reports::Reports::start(&config.router, recovery_url, Arc::clone(&store), vllm));
    if reports.listening() {
        store.set_listener(Arc::clone(&reports) as Arc<dyn kvtiers::TierListener>);
        let n = reports.announce(&store);
        tracing::info!(blocks = n, "announced the blocks kept across the restart");
    }
    if let Some(v) = reports.vllm() {
        v.start_log();
    }
    let daemon = Arc::new(daemon::Daemon::new(
        Arc::clone(&store),
        engines,
        reports,
        config.engines.max_pending_loads,
        Duration::from_millis(config.engines.op_retention_ms),
        config.engines.key_memo_bytes as usize,
    ));
    let queue = if config.g3.enabled { config.g3.writethrough_queue } else { 0 };
    let svc = service::KvcachedService { daemon: Arc::clone(&daemon), queue_capacity: queue };
    let socket_path = listeners.unix.local_addr().ok().and_then(|a| a.as_pathname().map(Path::to_path_buf));
    // The socket file this daemon bound: at the end it is unlinked only if it is still that
    // file (a daemon started while this one flushed has bound a new one at the same path).
    let socket_file = socket_path.as_deref().and_then(file_id);

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn({
        let svc = svc.clone();
        let rx = stop_rx.clone();
        let incoming = UnixListenerStream::new(listeners.unix);
        async move {
            grpc_server()
                .add_service(KvcachedServer::new(svc).max_decoding_message_size(64 << 20))
                .serve_with_incoming_shutdown(incoming, stopped(rx))
                .await
                .map_err(|e| ServerError::Io(std::io::Error::other(e)))
        }
    });
    if let Some(tcp) = listeners.tcp {
        let svc = svc.clone();
        let rx = stop_rx.clone();
        tasks.spawn(async move {
            grpc_server()
                .add_service(KvcachedServer::new(svc).max_decoding_message_size(64 << 20))
                .serve_with_incoming_shutdown(TcpListenerStream::new(tcp), stopped(rx))
                .await
                .map_err(|e| ServerError::Io(std::io::Error::other(e)))
        });
    }
    if let Some(http) = listeners.http {
        let app = http::router(Arc::clone(&daemon), queue);
        let rx = stop_rx.clone();
        tasks.spawn(async move {
            axum::serve(http, app).with_graceful_shutdown(stopped(rx)).await.map_err(ServerError::Io)
        });
    }
    {
        let d = Arc::clone(&daemon);
        let mut rx = stop_rx.clone();
        let period = Duration::from_millis((config.engines.lease_ms / 3).max(100));
        tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(period) => d.housekeeping(),
                    _ = rx.wait_for(|s| *s) => return Ok(()),
                }
            }
        });
    }
    tracing::info!(socket = ?socket_path, "kvcached serving");

    let mut first_error = None;
    tokio::select! {
        _ = shutdown => {}
        Some(r) = tasks.join_next() => {
            if let Ok(Err(e)) = r { first_error = Some(e); }
        }
    }
    tracing::info!("kvcached shutting down: draining requests");
    let _ = stop_tx.send(true);
    // Bounded: a client that keeps a request open (stopped mid-request, wedged) must not keep
    // the daemon from flushing its write-through queue and releasing its memory.
    let deadline = tokio::time::Instant::now() + Duration::from_millis(config.engines.drain_ms);
    loop {
        match tokio::time::timeout_at(deadline, tasks.join_next()).await {
            Ok(Some(r)) => {
                if let Ok(Err(e)) = r {
                    first_error.get_or_insert(e);
                }
            }
            Ok(None) => break,
            Err(_) => {
                tracing::warn!(
                    drain_ms = config.engines.drain_ms,
                    "requests still open at the drain deadline (engines.drain_ms); closing them"
                );
                tasks.abort_all();
                while tasks.join_next().await.is_some() {}
                break;
            }
        }
    }
    // Loads already handed to blocking threads finish before the store closes (they copy
    // between memory the daemon holds; the same deadline bounds the wait).
    while daemon.pending_loads() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let d = Arc::clone(&daemon);
    tokio::task::spawn_blocking(move || {
        d.engines.clear();
        if let Err(e) = d.store.flush() {
            tracing::warn!("flush at shutdown failed: {e}");
        }
        // The write-through just stored blocks in G3: their export records go to the log too.
        if let Some(v) = d.reports.vllm() {
            v.flush_log(Duration::from_secs(5));
        }
        // Unlink the pool now: a background thread (the prefault) may still hold the tier when
        // the process exits, and then its drop, which unlinks it too, never runs.
        let _ = std::fs::remove_file(d.store.g2().shm_path());
    })
    .await
    .map_err(|e| ServerError::Io(std::io::Error::other(e)))?;
    if let Some(p) = socket_path.filter(|p| socket_file.is_some() && file_id(p) == socket_file) {
        let _ = std::fs::remove_file(p);
    }
    tracing::info!("kvcached stopped");
    first_error.map_or(Ok(()), Err)
}

/// A file's identity (device, inode), to tell it from a file later created at the same path.
fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}
