//! [`serve`]: the daemon's life, phase by phase: open the store, start the hit reports, build
//! the daemon, serve the listeners, and on shutdown drain and flush.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvproto::pb::kvcached_server::KvcachedServer;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tonic::service::interceptor::InterceptedService;

use crate::config::Config;
use crate::daemon::Daemon;
use crate::edge::caller::BufferedLayer;
use crate::edge::lookup_wire::LookupWire;
use crate::edge::service::{KvcachedService, TcpAuth, TcpService};
use crate::edge::{http, listen};
use crate::engine::attach::Tickets;
use crate::error::ServerError;
use crate::export::{changes, reports, vllm_export};
use crate::peer::Peers;
use crate::policy::limits::Limits;
use crate::{Listeners, engine};

/// Runs the daemon until `shutdown` resolves, then stops accepting, drains in-flight requests
/// and loads, flushes the write-through queue, detaches engines and removes the socket.
pub async fn serve(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    serve_announcing(config, listeners, shutdown, |_| {}).await
}

/// [`serve`], calling `serving` with the HTTP port's bound address once every tier is open and
/// every listener served (the command line prints its banner there, not before a start that
/// may still fail).
pub async fn serve_announcing(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
    serving: impl FnOnce(Option<std::net::SocketAddr>),
) -> Result<(), ServerError> {
    http::prometheus();
    let (store, prefault, g1_faults) = open_store(&config).await?;
    let daemon = start_daemon(&config, &listeners, store, g1_faults).await?;
    let socket_path = listeners.unix.local_addr().ok().and_then(|a| a.as_pathname().map(Path::to_path_buf));
    // The socket file this daemon bound: at the end it is unlinked only if it is still that
    // file (a daemon started while this one flushed has bound a new one at the same path).
    let socket_file = socket_path.as_deref().and_then(file_id);

    let (stop_tx, stop_rx) = watch::channel(false);
    let lookups = config.engines.lookup_wire.then(|| LookupWire::new(Arc::clone(&daemon)));
    let on = ListenersOn::of(&listeners);
    crate::metrics_catalog::zero_series(&config);
    let mut tasks = serve_listeners(&config, listeners, &daemon, lookups.as_ref(), &stop_rx);
    on.log(&config, &daemon);
    tracing::info!(socket = ?socket_path, "kvcached serving");
    serving(on.http);

    let mut first_error = None;
    tokio::select! {
        _ = shutdown => {}
        Some(r) = tasks.join_next() => {
            if let Ok(Err(e)) = r { first_error = Some(e); }
        }
    }
    tracing::info!("kvcached shutting down: draining requests");
    let _ = stop_tx.send(true);
    if let Some(e) = drain(&config, tasks, &daemon, lookups.as_deref()).await {
        first_error.get_or_insert(e);
    }
    close(daemon).await?;
    if let Some(p) = socket_path.filter(|p| socket_file.is_some() && file_id(p) == socket_file) {
        let _ = std::fs::remove_file(p);
    }
    // The prefault stops with the pool (it holds it weakly) and logs how far it came: before
    // the last line, not after it.
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while prefault.as_ref().is_some_and(|t| !t.is_finished()) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tracing::info!("kvcached stopped");
    first_error.map_or(Ok(()), Err)
}

/// What is listening where, for the start lines.
struct ListenersOn {
    socket: Option<PathBuf>,
    tcp: Option<std::net::SocketAddr>,
    http: Option<std::net::SocketAddr>,
    peer: Option<std::net::SocketAddr>,
}

impl ListenersOn {
    fn of(l: &Listeners) -> Self {
        Self {
            socket: l.unix.local_addr().ok().and_then(|a| a.as_pathname().map(Path::to_path_buf)),
            tcp: l.tcp.as_ref().and_then(|t| t.local_addr().ok()),
            http: l.http.as_ref().and_then(|t| t.local_addr().ok()),
            peer: l.peer.as_ref().and_then(|t| t.local_addr().ok()),
        }
    }

    /// One line per tier and listener, saying it is on (and where) or off (and which field
    /// turns it on).
    fn log(&self, config: &Config, daemon: &Daemon) {
        let g2 = daemon.store.g2();
        tracing::info!(
            capacity_bytes = config.g2.capacity_bytes,
            page_size = config.g2.page_size,
            pool = %g2.shm_path().display(),
            "G2 on"
        );
        if config.g3.enabled {
            tracing::info!(dir = %config.g3.dir.display(), capacity_bytes = config.g3.capacity_bytes, "G3 on");
        } else {
            tracing::info!("G3 off (g3.enabled = false)");
        }
        if config.g4.enabled {
            tracing::info!(url = %config.g4.url, endpoint = %config.g4.endpoint, "G4 on");
        } else {
            tracing::info!("G4 off (g4.enabled = false)");
        }
        tracing::info!(path = ?self.socket, "socket on");
        match self.tcp {
            Some(a) => tracing::info!(addr = %a, credentials = config.tcp_auth.requires_credentials(), "TCP gRPC on"),
            None => tracing::info!("TCP gRPC off (tcp unset)"),
        }
        if let Some(a) = self.http {
            tracing::info!(addr = %a, credentials = config.metrics_auth.requires_credentials(), "HTTP on");
        }
        match self.peer {
            Some(a) => tracing::info!(
                addr = %a,
                advertised = config.peer.advertised(Some(a)).unwrap_or_default(),
                "peer channel on"
            ),
            None => tracing::info!("peer channel off (peer.listen unset): this node serves no peer, and may pull"),
        }
    }
}

/// What [`open_store`] opened: the store, its G2 prefault thread, the G1 fault switches
/// (`inject_faults` only).
type Opened = (Arc<kvtiers::BlockStore>, Option<std::thread::JoinHandle<()>>, Option<Arc<crate::faults::G1Faults>>);

/// Opens G2 and G3 (RocksDB and the data file take a while: off the runtime), and prefaults
/// the G2 pool in the background when configured.
async fn open_store(config: &Config) -> Result<Opened, ServerError> {
    let mut store_cfg = config.store_config();
    let g1_faults = config.inject_faults.as_ref().map(|path| crate::faults::install(path, &mut store_cfg));
    let store = tokio::task::spawn_blocking(move || kvtiers::BlockStore::open(&store_cfg))
        .await
        .map_err(|e| ServerError::Io(std::io::Error::other(e)))??;
    let store = Arc::new(store);
    let mut prefault = None;
    if config.g2.prefault {
        let g2 = Arc::downgrade(store.g2());
        let spawned = std::thread::Builder::new().name("kv-g2-prefault".into()).spawn(move || {
            let t0 = std::time::Instant::now();
            let bytes = kvtiers::HostTier::prefault(&g2);
            tracing::info!(bytes, took_ms = t0.elapsed().as_millis() as u64, "G2 pool prefaulted");
        });
        match spawned {
            Ok(t) => prefault = Some(t),
            Err(e) => tracing::warn!("cannot start the G2 prefault thread: {e}"),
        }
    }
    Ok((store, prefault, g1_faults))
}

/// The hit reports (routers, the vLLM-format export) and the daemon around the store.
async fn start_daemon(
    config: &Config,
    listeners: &Listeners,
    store: Arc<kvtiers::BlockStore>,
    g1_faults: Option<Arc<crate::faults::G1Faults>>,
) -> Result<Arc<Daemon>, ServerError> {
    let fd_limit = crate::policy::limits::raise_fd_limit();
    let limits = Limits::new(config.limits.clone(), fd_limit, config.engines.max_engines);
    tracing::info!(
        fd_limit,
        max_connections = limits.max_connections,
        max_engine_memory_bytes_per_uid = limits.max_engine_bytes,
        "connection and engine limits"
    );
    let own: Vec<PathBuf> = std::iter::once(store.g2().shm_path().to_path_buf())
        .chain(config.g3.enabled.then(|| config.g3.dir.clone()))
        .collect();
    let tickets = Arc::new(Tickets::new(own));
    let mut tenants = crate::policy::tenants::Tenants::new(&config.tenants, &config.namespaces)?;
    if config.g3.enabled {
        // G3's blocks outlive the process: so must the record of which tenant wrote them.
        tenants = tenants.persist_to(config.g3.dir.join("bindings.toml"))?;
    }
    let engines = engine::Registry::new(Duration::from_millis(config.engines.lease_ms), tickets, Arc::clone(&limits))
        .prefault_memory(config.engines.prefault_memory)
        .with_tenants(Arc::new(tenants))
        .with_g1_faults(g1_faults);
    let http_addr = listeners.http.as_ref().and_then(|l| l.local_addr().ok());
    let recovery_url = if config.router.advertise_url.is_empty() {
        let scheme = if config.metrics_auth.tls() { "https" } else { "http" };
        http_addr.filter(|a| !a.ip().is_unspecified()).map(|a| format!("{scheme}://{a}"))
    } else {
        Some(config.router.advertise_url.clone())
    };
    let vllm = if config.router.vllm_export.is_empty() {
        None
    } else {
        // ZMQ, as vLLM speaks it, has no authentication: turning the export on is the
        // operator's explicit word that whoever reaches it may read every namespace's keys and
        // tokens.
        tracing::warn!(
            endpoint = %config.router.vllm_export,
            "router.vllm_export is on: served without credentials (vLLM's ZMQ format has none); every local user, and \
             anyone who can reach it, reads every namespace's block keys and token ids there"
        );
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
    let peers = Arc::new(Peers::new(&config.peer, Arc::clone(&store))?);
    peers.start_probing();
    let peer_addr = listeners.peer.as_ref().and_then(|l| l.local_addr().ok());
    let peer_url = if listeners.peer.is_some() { config.peer.advertised(peer_addr) } else { None };
    if listeners.peer.is_some() && peer_url.is_none() {
        tracing::warn!(
            "peer.listen is a wildcard address and peer.advertise is empty: routers cannot tell other daemons \
             where to pull this node's blocks"
        );
    }
    let reports = Arc::new(reports::Reports::start(
        &config.router,
        &config.events,
        recovery_url,
        peer_url,
        Arc::clone(&store),
        Some(Arc::clone(&peers)),
        vllm,
    )?);
    // Hit reports and the vLLM export hear the tiers through a queue and thread of their own
    // (`export/changes.rs`): the tiers' locks and the saves wait for neither.
    let changes = match reports.listening() {
        true => Some(changes::Changes::start(Arc::clone(&reports), changes::CAPACITY).map_err(ServerError::Io)?),
        false => None,
    };
    if let Some(c) = &changes {
        store.set_listener(Arc::clone(c) as Arc<dyn kvtiers::TierListener>);
    }
    if reports.listening() {
        let n = reports.announce(&store);
        tracing::info!(blocks = n, "announced the blocks kept across the restart");
    }
    if let Some(v) = reports.vllm() {
        v.announced();
    }
    let mut daemon = Daemon::new(
        store,
        engines,
        reports,
        limits,
        config.engines.max_pending_loads,
        Duration::from_millis(config.engines.op_retention_ms),
        config.engines.key_memo_bytes as usize,
    );
    daemon.peers = Some(peers);
    daemon.changes = changes;
    daemon.g4_lookup_probe = config.g4.lookup_probe;
    daemon.g4_queue = if config.g4.enabled { config.g4.writethrough_queue } else { 0 };
    Ok(Arc::new(daemon))
}

/// The gRPC server settings of both listeners. A 128k-token prompt is a 512 KiB request:
/// large HTTP/2 frames and windows let it arrive in a few frames without waiting for window
/// updates (the defaults are 16 KiB frames). Every request is bounded in time and in the
/// bytes its principal may have arriving at once.
/// The answer of a request body without a whole message: INVALID_ARGUMENT, not tonic's INTERNAL
/// ([`kvproto::codec::truncated_request_is_invalid`]).
type Answer = ::http::Response<tonic::body::Body>;
type TruncatedIsInvalid = tower::util::MapResponseLayer<fn(Answer) -> Answer>;

fn truncated_is_invalid(mut r: Answer) -> Answer {
    kvproto::codec::truncated_request_is_invalid(r.headers_mut());
    r
}

fn grpc_server(
    config: &Config,
    limits: &Arc<Limits>,
) -> tonic::transport::Server<
    tower::layer::util::Stack<
        TruncatedIsInvalid,
        tower::layer::util::Stack<BufferedLayer, tower::layer::util::Identity>,
    >,
> {
    let l = &config.limits;
    tonic::transport::Server::builder()
        .max_frame_size(1 << 20)
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(16 << 20)
        .max_concurrent_streams(l.max_concurrent_streams)
        .http2_max_header_list_size(64 << 10)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .timeout(Duration::from_millis(l.request_timeout_ms))
        .layer(BufferedLayer { limits: Arc::clone(limits) })
        .layer(tower::util::MapResponseLayer::new(truncated_is_invalid as fn(Answer) -> Answer))
}

/// Runs a gRPC server's `serving` future in `tasks`, its error an I/O one.
fn spawn_grpc<E>(
    tasks: &mut JoinSet<Result<(), ServerError>>,
    serving: impl Future<Output = Result<(), E>> + Send + 'static,
) where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    tasks.spawn(async move { serving.await.map_err(|e| ServerError::Io(std::io::Error::other(e))) });
}

/// Serves gRPC (and LOOKUP, when given) on the Unix socket, Health-only gRPC on TCP, HTTP on the
/// metrics listener, and housekeeping, until `stop` flips.
fn serve_listeners(
    config: &Config,
    listeners: Listeners,
    daemon: &Arc<Daemon>,
    lookups: Option<&Arc<LookupWire>>,
    stop: &watch::Receiver<bool>,
) -> JoinSet<Result<(), ServerError>> {
    let queue = if config.g3.enabled { config.g3.writethrough_queue } else { 0 };
    let svc = KvcachedService { daemon: Arc::clone(daemon), queue_capacity: queue };
    let max_msg = config.limits.max_message_bytes;
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let limits = Arc::clone(&daemon.limits);
    // Readiness and neighbours as gauges before any listener answers: `/metrics` shows them
    // from its first request (the housekeeping task below refreshes them every period).
    daemon.health(queue);
    let mut tasks = JoinSet::new();
    {
        let lookups = lookups.cloned();
        let tickets = Arc::clone(&daemon.engines.tickets);
        let incoming = listen::unix(listeners.unix, Arc::clone(&limits), tickets, lookups, stop.clone());
        let server = grpc_server(config, &limits).add_service(
            KvcachedServer::new(svc.clone()).max_decoding_message_size(max_msg).max_encoding_message_size(max_msg),
        );
        spawn_grpc(&mut tasks, server.serve_with_incoming_shutdown(incoming, stopped(stop.clone())));
    }
    if let Some(tcp) = listeners.tcp {
        match endpoint_guard("tcp_auth", TCP_ENDPOINT, &config.tcp_auth, &tcp, &[b"h2"]) {
            Ok(guard) => {
                let incoming = listen::tcp(tcp, Arc::clone(&limits), Arc::clone(&guard), stop.clone());
                let service =
                    KvcachedServer::new(TcpService { inner: svc.clone() }).max_decoding_message_size(64 << 10);
                let server =
                    grpc_server(config, &limits).add_service(InterceptedService::new(service, TcpAuth { guard }));
                spawn_grpc(&mut tasks, server.serve_with_incoming_shutdown(incoming, stopped(stop.clone())));
            }
            Err(e) => {
                tasks.spawn(async move { Err(e) });
            }
        }
    }
    if let Some(peer) = listeners.peer {
        match peer_guard(config, &peer) {
            Ok(guard) => {
                let store = Arc::clone(&daemon.store);
                let cfg = config.peer.clone();
                let rx = stop.clone();
                tasks.spawn(async move {
                    crate::peer::server::serve(peer, guard, store, cfg, rx).await;
                    Ok(())
                });
            }
            Err(e) => {
                tasks.spawn(async move { Err(e) });
            }
        }
    }
    if let Some(l) = listeners.http {
        match endpoint_guard("metrics_auth", http::ENDPOINT, &config.metrics_auth, &l, kvnet::http::SERVER_ALPN) {
            Ok(guard) => {
                let app = http::router(Arc::clone(daemon), queue);
                let (rx, limits) = (stop.clone(), config.http_limits.clone());
                tasks.spawn(async move {
                    kvnet::http::serve_with(l, guard, app, &limits, stopped(rx)).await.map_err(ServerError::Io)
                });
            }
            Err(e) => {
                tasks.spawn(async move { Err(e) });
            }
        }
    }
    {
        let d = Arc::clone(daemon);
        let mut rx = stop.clone();
        let period = Duration::from_millis((config.engines.lease_ms / 3).max(100));
        tasks.spawn(async move {
            // Readiness and neighbours as gauges, every period.
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(period) => {
                        d.housekeeping();
                        d.health(queue);
                    }
                    _ = rx.wait_for(|s| *s) => return Ok(()),
                }
            }
        });
    }
    tasks
}

/// The TCP gRPC port's name in messages (refusals, configuration errors).
pub(crate) const TCP_ENDPOINT: &str = "kvcached TCP gRPC ([tcp_auth])";

/// The guard of the listener `l` (`field`: its `*_auth` section); a configuration that cannot
/// work (no credentials on a non-loopback address without `open = true`, unreadable files)
/// stops the daemon with a message naming the section.
fn endpoint_guard(
    field: &str,
    endpoint: &str,
    auth: &kvnet::AuthConfig,
    l: &tokio::net::TcpListener,
    alpn: &[&[u8]],
) -> Result<Arc<kvnet::Guard>, ServerError> {
    let addr = l.local_addr()?;
    let guard = kvnet::Guard::new(endpoint, auth, addr, alpn)
        .map_err(|e| {
            let msg = e.to_string();
            let reason = msg.strip_prefix(&format!("{endpoint}: ")).unwrap_or(&msg).to_string();
            ServerError::Config { field: field.into(), reason }
        })?
        // Loopback is no trust boundary on a shared node: without credentials, what reveals or
        // moves blocks, keys or namespace ids is refused unless the operator opened it.
        .closed_without_credentials();
    if auth.open {
        tracing::warn!(
            endpoint,
            %addr,
            "{field}.open = true: served without credentials; every local user (and anyone who can reach {addr}) \
             may read every namespace's events, keys and blocks there"
        );
    }
    Ok(Arc::new(guard))
}

/// The peer channel's authentication; a configuration that cannot work (an open endpoint on
/// the network nobody said may be open, unreadable certificates) stops the daemon.
fn peer_guard(config: &Config, l: &tokio::net::TcpListener) -> Result<Arc<kvnet::Guard>, ServerError> {
    endpoint_guard("peer.auth", "peer channel ([peer.auth])", &config.peer.auth, l, &[])
}

/// Waits for the listeners' tasks (open requests), the loads handed to blocking threads and the
/// LOOKUP requests running, at most `engines.drain_ms`: a client that keeps a request open
/// (stopped mid-request, wedged) must not keep the daemon from flushing its write-through queue
/// and releasing its memory. Returns the first error a task ended with.
async fn drain(
    config: &Config,
    mut tasks: JoinSet<Result<(), ServerError>>,
    daemon: &Daemon,
    lookups: Option<&LookupWire>,
) -> Option<ServerError> {
    let mut first_error = None;
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
    // Loads already on blocking threads copy between memory the daemon holds, and lookups read
    // the store: they finish before the store closes (within the same deadline).
    let running = || daemon.pending_loads() + lookups.map_or(0, LookupWire::running);
    while running() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first_error
}

/// Detaches the engines, flushes the store and unlinks the G2 pool.
async fn close(daemon: Arc<Daemon>) -> Result<(), ServerError> {
    tokio::task::spawn_blocking(move || {
        daemon.engines.clear();
        if let Err(e) = daemon.store.flush() {
            tracing::warn!("flush at shutdown failed: {e}");
        }
        // The write-through just stored blocks in G3: their changes are passed on, and their
        // export records go to the log too.
        if let Some(c) = &daemon.changes
            && !c.settle(Duration::from_secs(5))
        {
            tracing::warn!("tier changes not all passed on to reports within 5 s of shutdown");
        }
        if let Some(v) = daemon.reports.vllm() {
            v.flush_log(Duration::from_secs(5));
        }
        // Unlink the pool now: a background thread (the prefault) may still hold the tier when
        // the process exits, and then its drop, which unlinks it too, never runs.
        let _ = std::fs::remove_file(daemon.store.g2().shm_path());
    })
    .await
    .map_err(|e| ServerError::Io(std::io::Error::other(e)))
}

/// A file's identity (device, inode), to tell it from a file later created at the same path.
fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}
