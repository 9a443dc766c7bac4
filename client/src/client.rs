//! The async client.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use kvproto::pb::{self, kvcached_client::KvcachedClient};
use kvproto::{KeyContext, KeySource, Namespace};
use parking_lot::Mutex;
use tonic::transport::{Channel, Endpoint};

use crate::error::ClientError;
use crate::lookup_wire::LookupConns;
use crate::memory::KvMemory;
use crate::token_area::{Staged, TokenArea};

/// A load started with [`Client::load`]; wait for it with [`Client::wait`] or [`Client::poll`].
///
/// It keeps what the load asked for: when the daemon restarts (or drops the engine) before the
/// load is waited for, the load is gone with that daemon, and `wait` starts it again on the
/// daemon the client is registered with now. That is safe because a load is idempotent and the
/// engine does not use the slots before the load is done.
#[derive(Debug, Clone)]
pub struct LoadOp {
    /// (daemon op id, engine id it was started under): replaced when the load is started again.
    current: Arc<Mutex<(u64, u64)>>,
    /// Held while the load is started again, so that clones waiting at once start it once.
    restarting: Arc<tokio::sync::Mutex<()>>,
    tokens: bytes::Bytes,
    first_block: u32,
    slots: Arc<[u32]>,
    sources: Arc<[String]>,
    keys: WireKeys,
}

impl LoadOp {
    /// The daemon's id of this load (changes if the load had to be started again).
    pub fn id(&self) -> u64 {
        self.current.lock().0
    }
}

#[derive(Debug)]
struct Registration {
    /// The request without its descriptors' tickets (each registration hands them over anew).
    request: pb::RegisterRequest,
    /// The KV memory's descriptor (none for GPU memory) and the token area's.
    memory: Option<Arc<std::fs::File>>,
    area: Option<Arc<std::fs::File>>,
    engine_id: u64,
    /// Whether the daemon opened the token area (`RegisterResponse::token_area_accepted`).
    area_accepted: bool,
}

#[derive(Debug)]
struct Inner {
    socket: PathBuf,
    rpc: Mutex<KvcachedClient<Channel>>,
    reg: Mutex<Option<Registration>>,
    /// How long a call keeps retrying while the daemon is away (restart).
    reconnect_for: Duration,
    /// Bytes of the token area created at the first registration (0: none).
    token_area_bytes: usize,
    token_area: Mutex<Option<Arc<TokenArea>>>,
    lookups: LookupConns,
}

/// A connection to the node's kvcached. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<Inner>,
    heartbeat: Arc<Mutex<Option<tokio::task::JoinHandle<()>>>>,
}

async fn channel(socket: &Path) -> Result<KvcachedClient<Channel>, ClientError> {
    let path = socket.to_path_buf();
    let unreachable = |reason: String| ClientError::Unreachable { socket: socket.display().to_string(), reason };
    // The URI is required by the API but unused: the connector dials the socket.
    let ch = Endpoint::try_from("http://kvcached.local")
        .map_err(|e| unreachable(e.to_string()))?
        .connect_timeout(Duration::from_secs(2))
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { tokio::net::UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|e| {
            unreachable(format!("{e}: {}", std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default()))
        })?;
    Ok(KvcachedClient::new(ch).max_decoding_message_size(64 << 20).max_encoding_message_size(64 << 20))
}

/// Whether a call failed because the daemon went away or forgot us (restart).
fn needs_reconnect(s: &tonic::Status) -> bool {
    matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Unknown)
        || (s.code() == tonic::Code::Cancelled && transport_closed(s))
        || crate::error::reason_of(s) == Some(kvproto::reason::Reason::UnknownEngine)
}

/// Whether a status is the transport's (a connection that closed under a call in flight: the
/// daemon killed between two calls on a channel that still held its connection), not the
/// daemon's answer.
fn transport_closed(s: &tonic::Status) -> bool {
    std::error::Error::source(s).is_some_and(|e| e.is::<tonic::transport::Error>())
}

/// Hands the registration's descriptors to the daemon at `socket` (ATTACH) and fills their
/// tickets into `request`.
async fn with_tickets(
    socket: &Path,
    mut request: pb::RegisterRequest,
    memory: Option<Arc<std::fs::File>>,
    area: Option<Arc<std::fs::File>>,
) -> Result<pb::RegisterRequest, ClientError> {
    let files: Vec<Arc<std::fs::File>> = memory.iter().chain(area.iter()).cloned().collect();
    if files.is_empty() {
        return Ok(request);
    }
    let socket = socket.to_path_buf();
    let tickets = tokio::task::spawn_blocking(move || {
        let refs: Vec<&std::fs::File> = files.iter().map(|f| f.as_ref()).collect();
        crate::attach::attach(&socket, &refs)
    })
    .await
    .map_err(|e| ClientError::Attach(e.to_string()))??;
    let mut tickets = tickets.into_iter();
    if memory.is_some()
        && let (Some(r), Some(t)) = (request.region.as_mut(), tickets.next())
    {
        r.kind = Some(pb::memory_region::Kind::FdTicket(t.to_vec()));
    }
    if area.is_some()
        && let (Some(a), Some(t)) = (request.token_area.as_mut(), tickets.next())
    {
        a.fd_ticket = t.to_vec();
    }
    Ok(request)
}

impl Client {
    /// Connects to the daemon's Unix socket.
    pub async fn connect(socket: impl AsRef<Path>) -> Result<Self, ClientError> {
        let socket = socket.as_ref().to_path_buf();
        let rpc = channel(&socket).await?;
        Ok(Self {
            inner: Arc::new(Inner {
                socket,
                rpc: Mutex::new(rpc),
                reg: Mutex::new(None),
                reconnect_for: Duration::from_secs(30),
                token_area_bytes: crate::token_area::DEFAULT_BYTES,
                token_area: Mutex::new(None),
                lookups: LookupConns::new(),
            }),
            heartbeat: Arc::new(Mutex::new(None)),
        })
    }

    /// Whether lookups go over LOOKUP connections when the daemon serves them (the default), or
    /// always over gRPC. Either way the answer is the same; LOOKUP takes HTTP/2 off the path.
    pub fn set_lookup_wire(&self, on: bool) {
        self.inner.lookups.set_wanted(on);
    }

    /// Whether the daemon serves LOOKUP, as the last lookup that tried it found: None until one
    /// has (and again after a reconnect).
    pub fn lookup_wire_served(&self) -> Option<bool> {
        self.inner.lookups.served()
    }

    /// How long calls keep retrying (with backoff) while the daemon is unreachable.
    pub fn set_reconnect_for(&mut self, d: Duration) {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.reconnect_for = d;
        }
    }

    /// Size of the shared-memory token area the first registration creates (default 4 MiB:
    /// four concurrent prompts of up to 256k tokens); 0 sends every prompt inline. Returns false
    /// (and changes nothing) once the client has been cloned or has registered.
    pub fn set_token_area_bytes(&mut self, bytes: usize) -> bool {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) if inner.reg.lock().is_none() => {
                inner.token_area_bytes = bytes;
                true
            }
            _ => false,
        }
    }

    /// The token area, created on first use; None when disabled or when it cannot be created
    /// (prompts then go inline).
    fn token_area(&self) -> Option<Arc<TokenArea>> {
        if self.inner.token_area_bytes == 0 {
            return None;
        }
        let mut area = self.inner.token_area.lock();
        if area.is_none() {
            match TokenArea::create(self.inner.token_area_bytes) {
                Ok(a) => *area = Some(Arc::new(a)),
                Err(e) => tracing::warn!("cannot create a token area ({e}); long prompts go inline"),
            }
        }
        area.clone()
    }

    /// `tokens` written into the token area, when the daemon opened it and they are worth it.
    fn stage(&self, tokens: &[u32]) -> Option<Staged> {
        if !self.token_area_active() {
            return None;
        }
        self.inner.token_area.lock().clone()?.stage(tokens)
    }

    /// Whether long prompts' tokens go through the shared-memory token area (the daemon the
    /// engine is registered with now has it open) rather than inline in requests.
    pub fn token_area_active(&self) -> bool {
        self.inner.reg.lock().as_ref().is_some_and(|r| r.area_accepted)
    }

    fn rpc(&self) -> KvcachedClient<Channel> {
        self.inner.rpc.lock().clone()
    }

    fn engine_id(&self) -> Result<u64, ClientError> {
        self.inner.reg.lock().as_ref().map(|r| r.engine_id).ok_or(ClientError::NotRegistered)
    }

    /// Reconnects with exponential backoff and re-registers the engine.
    async fn recover(&self) -> Result<(), ClientError> {
        let deadline = tokio::time::Instant::now() + self.inner.reconnect_for;
        let mut backoff = Duration::from_millis(50);
        loop {
            let attempt = async {
                let mut rpc = channel(&self.inner.socket).await?;
                let reg = self.inner.reg.lock().as_ref().map(|r| (r.request.clone(), r.memory.clone(), r.area.clone()));
                if let Some((req, memory, area)) = reg {
                    let req = with_tickets(&self.inner.socket, req, memory, area).await?;
                    let resp = rpc.register(req).await?.into_inner();
                    if let Some(r) = self.inner.reg.lock().as_mut() {
                        r.engine_id = resp.engine_id;
                        r.area_accepted = resp.token_area_accepted;
                    }
                    tracing::info!(engine = resp.engine_id, "re-registered with kvcached");
                }
                *self.inner.rpc.lock() = rpc;
                self.inner.lookups.reset();
                Ok::<(), ClientError>(())
            };
            match attempt.await {
                Ok(()) => return Ok(()),
                Err(e) if tokio::time::Instant::now() + backoff > deadline => return Err(e),
                Err(e) => {
                    tracing::debug!("kvcached not reachable yet ({e}); retrying in {backoff:?}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
    }

    /// Runs `call`, recovering once from a daemon restart.
    async fn with_retry<T, F, Fut>(&self, call: F) -> Result<T, ClientError>
    where
        F: Fn(KvcachedClient<Channel>, u64) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        self.with_retry_as(call).await.map(|(r, _)| r)
    }

    /// [`Client::with_retry`], also returning the engine id the answered call was made under
    /// (a heartbeat may re-register the engine right after it).
    async fn with_retry_as<T, F, Fut>(&self, call: F) -> Result<(T, u64), ClientError>
    where
        F: Fn(KvcachedClient<Channel>, u64) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let id = self.engine_id()?;
        match call(self.rpc(), id).await {
            Ok(r) => Ok((r.into_inner(), id)),
            Err(s) if needs_reconnect(&s) => {
                self.recover().await?;
                let id = self.engine_id()?;
                Ok((call(self.rpc(), id).await?.into_inner(), id))
            }
            Err(s) => Err(s.into()),
        }
    }

    /// Registers the engine's KV memory, namespace and layout; starts heartbeats.
    pub async fn register(
        &self,
        engine_name: &str,
        ns: &Namespace,
        memory: &KvMemory,
    ) -> Result<pb::RegisterResponse, ClientError> {
        self.register_worker(engine_name, ns, memory, "", "").await
    }

    /// [`Client::register`] for an engine a cluster router places requests on: `address` is
    /// where the router sends them, `role` its role (`prefill`, `decode`, `both`); the daemon
    /// publishes both with this worker's hit reports.
    pub async fn register_worker(
        &self,
        engine_name: &str,
        ns: &Namespace,
        memory: &KvMemory,
        address: &str,
        role: &str,
    ) -> Result<pb::RegisterResponse, ClientError> {
        self.register_request(memory.to_request(engine_name, ns), Some(Arc::clone(memory.file())), address, role).await
    }

    /// Registers KV memory that lives in the engine's GPU (shared through a CUDA IPC handle),
    /// with the worker's address and role as in [`Client::register_worker`] (empty when no
    /// router is involved).
    pub async fn register_gpu(
        &self,
        engine_name: &str,
        ns: &Namespace,
        memory: &crate::memory::GpuKvMemory,
        address: &str,
        role: &str,
    ) -> Result<pb::RegisterResponse, ClientError> {
        self.register_request(memory.to_request(engine_name, ns), None, address, role).await
    }

    async fn register_request(
        &self,
        mut request: pb::RegisterRequest,
        memory: Option<Arc<std::fs::File>>,
        address: &str,
        role: &str,
    ) -> Result<pb::RegisterResponse, ClientError> {
        request.worker_address = address.to_string();
        request.role = role.to_string();
        let area = self.token_area();
        request.token_area = area.as_ref().map(|a| a.request());
        let area = area.map(|a| Arc::clone(a.file()));
        let sent = with_tickets(&self.inner.socket, request.clone(), memory.clone(), area.clone()).await?;
        let resp = self.rpc().register(sent).await?.into_inner();
        let heartbeat = Duration::from_millis(u64::from(resp.heartbeat_ms.max(100)));
        if request.token_area.is_some() && !resp.token_area_accepted {
            tracing::warn!(
                "kvcached did not take the token area ({}); long prompts go inline",
                kvproto::limits::clip(&resp.token_area_error, 200)
            );
        }
        let area_accepted = resp.token_area_accepted;
        *self.inner.reg.lock() = Some(Registration { request, memory, area, engine_id: resp.engine_id, area_accepted });
        self.start_heartbeat(heartbeat);
        Ok(resp)
    }

    fn start_heartbeat(&self, every: Duration) {
        // The task holds the client weakly: a client dropped without unregistering stops its
        // heartbeats (the daemon then detaches it when the lease runs out) and frees its token
        // area, instead of living on inside this task.
        let inner = Arc::downgrade(&self.inner);
        let heartbeat = Arc::clone(&self.heartbeat);
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(inner) = inner.upgrade() else { return };
                let me = Client { inner, heartbeat: Arc::clone(&heartbeat) };
                let Ok(id) = me.engine_id() else { return };
                if let Err(s) = me.rpc().heartbeat(pb::EngineRef { engine_id: id }).await
                    && needs_reconnect(&s)
                    && let Err(e) = me.recover().await
                {
                    tracing::warn!("kvcached heartbeat failed: {e}");
                }
            }
        });
        if let Some(old) = self.heartbeat.lock().replace(task) {
            old.abort();
        }
    }

    /// The engine id the daemon gave this client (changes after a daemon restart).
    pub fn engine_id_now(&self) -> Option<u64> {
        self.engine_id().ok()
    }

    /// Saves blocks `[first_block, first_block + slots.len())` of `tokens` from engine slots.
    pub async fn save(&self, tokens: &[u32], first_block: u32, slots: &[u32]) -> Result<pb::SaveResponse, ClientError> {
        self.save_in(tokens, None, first_block, slots).await
    }

    /// [`Client::save`] of a request whose keys bind a [`KeyContext`] (adapter, cache salt,
    /// multimodal inputs: `docs/block-keys.md` section 6); `None` or an empty one is the plain
    /// chain. Its lookups and loads must carry the same context.
    pub async fn save_in(
        &self,
        tokens: &[u32],
        context: Option<&KeyContext>,
        first_block: u32,
        slots: &[u32],
    ) -> Result<pb::SaveResponse, ClientError> {
        self.save_as(tokens, wire_context(context), first_block, slots).await
    }

    /// [`Client::save`] of blocks keyed by `keys` (a key context, or the engine's own page
    /// hashes: `docs/block-keys.md` section 7; with given hashes `tokens` is empty). Its
    /// lookups and loads must be keyed the same way.
    pub async fn save_keyed(
        &self,
        tokens: &[u32],
        keys: &KeySource,
        first_block: u32,
        slots: &[u32],
    ) -> Result<pb::SaveResponse, ClientError> {
        self.save_as(tokens, wire_keys(keys), first_block, slots).await
    }

    async fn save_as(
        &self,
        tokens: &[u32],
        keys: WireKeys,
        first_block: u32,
        slots: &[u32],
    ) -> Result<pb::SaveResponse, ClientError> {
        let le = kvproto::tokens_to_le(tokens);
        self.with_retry(|mut rpc, engine_id| {
            let req = pb::SaveRequest {
                engine_id,
                tokens: le.clone(),
                first_block,
                block_ids: slots.to_vec(),
                context: keys.context.clone(),
                engine_hashes: keys.hashes.clone(),
            };
            async move { rpc.save(req).await }
        })
        .await
    }

    /// How many leading blocks of `tokens` are cached, and in which tier.
    pub async fn lookup(&self, tokens: &[u32]) -> Result<pb::LookupResponse, ClientError> {
        self.lookup_as(tokens, WireKeys::default(), None, 0, 0).await
    }

    /// [`Client::lookup`] of a request whose keys bind a [`KeyContext`] (see
    /// [`Client::save_in`]). With a non-empty context it goes over gRPC, not LOOKUP.
    pub async fn lookup_in(
        &self,
        tokens: &[u32],
        context: Option<&KeyContext>,
    ) -> Result<pb::LookupResponse, ClientError> {
        self.lookup_as(tokens, wire_context(context), None, 0, 0).await
    }

    /// The cached run of `tokens`' blocks that starts at block `first_block` (not at the first
    /// block: what a sliding-window attention group needs before a point is only its window).
    /// `matched_blocks` is the run's length, `matched_tokens` the tokens through its end (0 when
    /// the run is empty). Over gRPC.
    pub async fn lookup_run(
        &self,
        tokens: &[u32],
        context: Option<&KeyContext>,
        first_block: u32,
    ) -> Result<pb::LookupResponse, ClientError> {
        self.lookup_as(tokens, wire_context(context), None, 0, first_block).await
    }

    /// [`Client::lookup_run`] of blocks keyed by `keys` (see [`Client::save_keyed`]); 0 for
    /// `first_block` is the cached prefix. Over LOOKUP from the first block without a key
    /// context, else over gRPC.
    pub async fn lookup_keyed(
        &self,
        tokens: &[u32],
        keys: &KeySource,
        first_block: u32,
    ) -> Result<pb::LookupResponse, ClientError> {
        self.lookup_as(tokens, wire_keys(keys), None, 0, first_block).await
    }

    /// [`Client::lookup`] with blocking I/O on the calling thread, for callers on threads of
    /// their own (never a runtime's worker, which it would stall): the daemon's answer wakes this
    /// thread itself rather than a worker that then wakes it. Over LOOKUP only: `None` when that
    /// cannot serve it now (not registered, LOOKUP off or not served, the daemon away, or a
    /// daemon that no longer knows the engine); then call [`Client::lookup`], which also
    /// recovers a lost registration.
    pub fn lookup_blocking(&self, tokens: &[u32]) -> Option<Result<pb::LookupResponse, ClientError>> {
        self.lookup_blocking_keyed(tokens, &KeySource::Plain)
    }

    /// [`Client::lookup_blocking`] of blocks keyed by `keys` (see [`Client::save_keyed`]): the
    /// plain chain or engine hashes, which LOOKUP carries; `None` for a key context (gRPC only)
    /// and wherever [`Client::lookup_blocking`] answers `None`.
    pub fn lookup_blocking_keyed(
        &self,
        tokens: &[u32],
        keys: &KeySource,
    ) -> Option<Result<pb::LookupResponse, ClientError>> {
        let keys = wire_keys(keys);
        if keys.context.is_some() {
            return None;
        }
        let engine_id = self.engine_id().ok()?;
        let staged = self.stage(tokens);
        let (tokens, tokens_at) = self.carried(staged.as_ref(), || kvproto::tokens_to_le(tokens));
        let req = pb::LookupRequest {
            engine_id,
            tokens,
            route_id: None,
            g1_blocks: 0,
            tokens_at,
            context: None,
            first_block: 0,
            engine_hashes: keys.hashes,
        };
        match self.inner.lookups.lookup_blocking(&self.inner.socket, &req)? {
            Ok(r) => Some(Ok(r)),
            Err(s) if needs_reconnect(&s) => None,
            Err(s) => Some(Err(s.into())),
        }
    }

    /// A request's tokens as it carries them: the span of the token area they were staged in
    /// while the daemon has the area open, else `inline()`.
    fn carried(
        &self,
        staged: Option<&Staged>,
        inline: impl FnOnce() -> bytes::Bytes,
    ) -> (bytes::Bytes, Option<pb::TokenSpan>) {
        match staged {
            Some(s) if self.token_area_active() => (bytes::Bytes::new(), Some(s.span)),
            _ => (inline(), None),
        }
    }

    /// A lookup whose tokens go through the token area when they can (see [`TokenArea`]).
    async fn lookup_as(
        &self,
        tokens: &[u32],
        keys: WireKeys,
        route_id: Option<u64>,
        g1_blocks: u32,
        first_block: u32,
    ) -> Result<pb::LookupResponse, ClientError> {
        let staged = self.stage(tokens);
        let inline = std::sync::OnceLock::new();
        self.with_retry(|mut rpc, engine_id| {
            // A retry after a daemon restart goes inline if the new daemon did not map the area.
            let (le, tokens_at) =
                self.carried(staged.as_ref(), || inline.get_or_init(|| kvproto::tokens_to_le(tokens)).clone());
            let req = pb::LookupRequest {
                engine_id,
                tokens: le,
                route_id,
                g1_blocks,
                tokens_at,
                context: keys.context.clone(),
                first_block,
                engine_hashes: keys.hashes.clone(),
            };
            async move {
                // Lookups with a key context or from a later block go over gRPC; plain ones and
                // engine hashes' (SGLang's and vLLM's offloading tier's hit queries) over LOOKUP.
                let fast = if req.context.is_none() && req.first_block == 0 {
                    self.inner.lookups.lookup(&self.inner.socket, &req).await
                } else {
                    None
                };
                match fast {
                    Some(r) => r.map(tonic::Response::new),
                    None => rpc.lookup(req).await,
                }
            }
        })
        .await
    }

    /// [`Client::lookup`] for a request a router placed (`route_id` from its answer), with the
    /// leading blocks the engine already holds on its GPU: the daemon reports what was found so
    /// the router can check its prediction.
    pub async fn lookup_routed(
        &self,
        tokens: &[u32],
        route_id: u64,
        g1_blocks: u32,
    ) -> Result<pb::LookupResponse, ClientError> {
        self.lookup_as(tokens, WireKeys::default(), Some(route_id), g1_blocks, 0).await
    }

    /// Reports that blocks `[first_block, ..)` of `tokens` are now in the engine's GPU memory
    /// (published to routers as G1 blocks of this worker). Returns their keys.
    pub async fn gpu_stored(&self, tokens: &[u32], first_block: u32) -> Result<Vec<kvproto::BlockKey>, ClientError> {
        self.gpu_report(pb::gpu_blocks_request::Change::Stored, tokens, first_block, Vec::new()).await
    }

    /// Reports that blocks `[first_block, ..)` of `tokens` left the engine's GPU memory.
    pub async fn gpu_removed(&self, tokens: &[u32], first_block: u32) -> Result<Vec<kvproto::BlockKey>, ClientError> {
        self.gpu_report(pb::gpu_blocks_request::Change::Removed, tokens, first_block, Vec::new()).await
    }

    /// Reports that the blocks with these keys (as returned by [`Client::gpu_stored`]) left the
    /// engine's GPU memory.
    pub async fn gpu_removed_keys(&self, keys: &[kvproto::BlockKey]) -> Result<(), ClientError> {
        let keys = keys.iter().map(|k| k.0.to_vec()).collect();
        self.gpu_report(pb::gpu_blocks_request::Change::Removed, &[], 0, keys).await.map(|_| ())
    }

    /// Reports that the engine's GPU memory holds no cached block any more.
    pub async fn gpu_cleared(&self) -> Result<(), ClientError> {
        self.gpu_report(pb::gpu_blocks_request::Change::Cleared, &[], 0, Vec::new()).await.map(|_| ())
    }

    async fn gpu_report(
        &self,
        change: pb::gpu_blocks_request::Change,
        tokens: &[u32],
        first_block: u32,
        keys: Vec<Vec<u8>>,
    ) -> Result<Vec<kvproto::BlockKey>, ClientError> {
        let le = kvproto::tokens_to_le(tokens);
        let resp = self
            .with_retry(|mut rpc, engine_id| {
                let req = pb::GpuBlocksRequest {
                    engine_id,
                    change: change as i32,
                    tokens: le.clone(),
                    first_block,
                    keys: keys.clone(),
                    context: None,
                };
                async move { rpc.report_gpu_blocks(req).await }
            })
            .await?;
        Ok(resp.keys.iter().filter_map(|k| <[u8; 16]>::try_from(k.as_slice()).ok()).map(kvproto::BlockKey).collect())
    }

    /// Reports the engine's load (requests running and waiting, GPU KV blocks used of total);
    /// the daemon forwards the latest one with its next load report to routers.
    pub async fn report_load(
        &self,
        running: u32,
        waiting: u32,
        kv_used_blocks: u64,
        kv_total_blocks: u64,
    ) -> Result<(), ClientError> {
        self.report_load_and_prefill(running, waiting, kv_used_blocks, kv_total_blocks, 0, Duration::ZERO).await
    }

    /// [`Client::report_load`] with the prefill the engine computed since its last report
    /// (`prefill_tokens` tokens in `prefill_time` of compute): the daemon averages them into the
    /// engine's prefill rate, which routers weigh against link rates to decide splits.
    pub async fn report_load_and_prefill(
        &self,
        running: u32,
        waiting: u32,
        kv_used_blocks: u64,
        kv_total_blocks: u64,
        prefill_tokens: u64,
        prefill_time: Duration,
    ) -> Result<(), ClientError> {
        let prefill_us = prefill_time.as_micros().min(u128::from(u64::MAX)) as u64;
        let load = pb::EngineLoadRequest {
            running,
            waiting,
            kv_used_blocks,
            kv_total_blocks,
            prefill_tokens,
            prefill_us,
            engine_id: 0,
        };
        self.with_retry(|mut rpc, engine_id| {
            let req = pb::EngineLoadRequest { engine_id, ..load };
            async move { rpc.report_load(req).await }
        })
        .await
        .map(|_: pb::Empty| ())
    }

    /// Starts loading blocks `[first_block, first_block + slots.len())` of `tokens` into engine
    /// slots; returns at once. The load stops at the first block that is not cached.
    pub async fn load(&self, tokens: &[u32], first_block: u32, slots: &[u32]) -> Result<LoadOp, ClientError> {
        self.load_op(tokens, first_block, slots, &[]).await
    }

    /// [`Client::load`] with `sources`, the peer daemons that may hold blocks this node lacks
    /// (a router's `prefill_peer`): returns at once; [`Client::wait_for_blocks`] tells when
    /// the first blocks are in the engine's slots while later ones still arrive.
    pub async fn load_op(
        &self,
        tokens: &[u32],
        first_block: u32,
        slots: &[u32],
        sources: &[String],
    ) -> Result<LoadOp, ClientError> {
        self.load_op_in(tokens, None, first_block, slots, sources).await
    }

    /// [`Client::load_op`] of a request whose keys bind a [`KeyContext`] (see
    /// [`Client::save_in`]).
    pub async fn load_op_in(
        &self,
        tokens: &[u32],
        context: Option<&KeyContext>,
        first_block: u32,
        slots: &[u32],
        sources: &[String],
    ) -> Result<LoadOp, ClientError> {
        self.load_op_as(tokens, wire_context(context), first_block, slots, sources).await
    }

    /// [`Client::load_op`] of blocks keyed by `keys` (see [`Client::save_keyed`]).
    pub async fn load_op_keyed(
        &self,
        tokens: &[u32],
        keys: &KeySource,
        first_block: u32,
        slots: &[u32],
        sources: &[String],
    ) -> Result<LoadOp, ClientError> {
        self.load_op_as(tokens, wire_keys(keys), first_block, slots, sources).await
    }

    async fn load_op_as(
        &self,
        tokens: &[u32],
        keys: WireKeys,
        first_block: u32,
        slots: &[u32],
        sources: &[String],
    ) -> Result<LoadOp, ClientError> {
        let le = kvproto::tokens_to_le(tokens);
        // The engine id the load was made under (a heartbeat may re-register right after it).
        let (s, engine_id) = self.load_rpc_le(&le, &keys, first_block, slots, false, sources).await?;
        Ok(LoadOp {
            current: Arc::new(Mutex::new((s.op_id, engine_id))),
            restarting: Arc::new(tokio::sync::Mutex::new(())),
            tokens: le,
            first_block,
            slots: slots.into(),
            sources: sources.into(),
            keys,
        })
    }

    /// Loads and waits for completion in one call.
    pub async fn load_now(
        &self,
        tokens: &[u32],
        first_block: u32,
        slots: &[u32],
    ) -> Result<pb::LoadStatus, ClientError> {
        finished(self.load_rpc(tokens, first_block, slots, true).await?)
    }

    /// [`Client::load_now`] of a request whose keys bind a [`KeyContext`] (see
    /// [`Client::save_in`]).
    pub async fn load_now_in(
        &self,
        tokens: &[u32],
        context: Option<&KeyContext>,
        first_block: u32,
        slots: &[u32],
    ) -> Result<pb::LoadStatus, ClientError> {
        let le = kvproto::tokens_to_le(tokens);
        finished(self.load_rpc_le(&le, &wire_context(context), first_block, slots, true, &[]).await?.0)
    }

    /// [`Client::load_now`] of blocks keyed by `keys` (see [`Client::save_keyed`]).
    pub async fn load_now_keyed(
        &self,
        tokens: &[u32],
        keys: &KeySource,
        first_block: u32,
        slots: &[u32],
    ) -> Result<pb::LoadStatus, ClientError> {
        let le = kvproto::tokens_to_le(tokens);
        finished(self.load_rpc_le(&le, &wire_keys(keys), first_block, slots, true, &[]).await?.0)
    }

    /// [`Client::load_now`] that may pull the blocks this node lacks from peer daemons:
    /// `sources` are their peer channels (`host:port`), as a router's split answer or route
    /// answer names them. Blocks arrive verified into the node's G2, then into the slots, the
    /// first ones while later ones are still in flight; what does not arrive within the
    /// daemon's `peer.pull_deadline_ms` is a miss (`loaded_blocks` stops there).
    pub async fn load_from(
        &self,
        tokens: &[u32],
        first_block: u32,
        slots: &[u32],
        sources: &[String],
    ) -> Result<pb::LoadStatus, ClientError> {
        let le = kvproto::tokens_to_le(tokens);
        finished(self.load_rpc_le(&le, &WireKeys::default(), first_block, slots, true, sources).await?.0)
    }

    async fn load_rpc(
        &self,
        tokens: &[u32],
        first_block: u32,
        slots: &[u32],
        wait: bool,
    ) -> Result<pb::LoadStatus, ClientError> {
        self.load_rpc_le(&kvproto::tokens_to_le(tokens), &WireKeys::default(), first_block, slots, wait, &[])
            .await
            .map(|(s, _)| s)
    }

    async fn load_rpc_le(
        &self,
        le: &bytes::Bytes,
        keys: &WireKeys,
        first_block: u32,
        slots: &[u32],
        wait: bool,
        sources: &[String],
    ) -> Result<(pb::LoadStatus, u64), ClientError> {
        self.with_retry_as(|mut rpc, engine_id| {
            let req = pb::LoadRequest {
                engine_id,
                tokens: le.clone(),
                first_block,
                block_ids: slots.to_vec(),
                wait,
                sources: sources.to_vec(),
                context: keys.context.clone(),
                engine_hashes: keys.hashes.clone(),
            };
            async move { rpc.load(req).await }
        })
        .await
    }

    /// Waits up to `timeout` for a load; returns its status (state PENDING if still running).
    /// A load lost with a restarted daemon is started again (see [`LoadOp`]).
    pub async fn wait(&self, op: &LoadOp, timeout: Duration) -> Result<pb::LoadStatus, ClientError> {
        self.wait_for_blocks(op, 0, timeout).await
    }

    /// Waits up to `timeout` until `blocks` blocks of the load are in the engine's slots (from
    /// the first, in order) or the load ended; the status says which (`PENDING` with
    /// `loaded_blocks`, or finished). `blocks` 0: [`Client::wait`].
    pub async fn wait_for_blocks(
        &self,
        op: &LoadOp,
        blocks: u32,
        timeout: Duration,
    ) -> Result<pb::LoadStatus, ClientError> {
        let timeout_ms = timeout.as_millis().min(u128::from(u32::MAX)) as u32;
        let (op_id, started_under) = *op.current.lock();
        if self.engine_id_now() == Some(started_under) {
            match self.wait_rpc(op_id, timeout_ms, blocks).await {
                Ok(s) => return finished(s),
                // Registered again during the call: the load died with the old daemon.
                Err(ClientError::Rpc(s))
                    if s.code() == tonic::Code::NotFound && self.engine_id_now() != Some(started_under) => {}
                Err(e) => return Err(e),
            }
        }
        let _one = op.restarting.lock().await;
        let now = *op.current.lock();
        if now != (op_id, started_under) && self.engine_id_now() == Some(now.1) {
            // Another waiter on this load started it again meanwhile.
            return finished(self.wait_rpc(now.0, timeout_ms, blocks).await?);
        }
        let (s, engine_id) =
            self.load_rpc_le(&op.tokens, &op.keys, op.first_block, &op.slots, false, &op.sources).await?;
        *op.current.lock() = (s.op_id, engine_id);
        finished(self.wait_rpc(s.op_id, timeout_ms, blocks).await?)
    }

    async fn wait_rpc(&self, op_id: u64, timeout_ms: u32, until_blocks: u32) -> Result<pb::LoadStatus, ClientError> {
        self.with_retry(|mut rpc, engine_id| {
            let req = pb::WaitRequest { engine_id, op_id, timeout_ms, until_blocks };
            async move { rpc.wait(req).await }
        })
        .await
    }

    /// Polls a load without waiting.
    pub async fn poll(&self, op: &LoadOp) -> Result<pb::LoadStatus, ClientError> {
        self.wait(op, Duration::ZERO).await
    }

    pub async fn stats(&self) -> Result<pb::StatsResponse, ClientError> {
        Ok(self.rpc().stats(pb::Empty {}).await?.into_inner())
    }

    pub async fn health(&self) -> Result<pb::HealthResponse, ClientError> {
        Ok(self.rpc().health(pb::Empty {}).await?.into_inner())
    }

    /// Detaches the engine (the daemon unmaps its memory).
    pub async fn unregister(&self) -> Result<(), ClientError> {
        if let Some(t) = self.heartbeat.lock().take() {
            t.abort();
        }
        let id = self.engine_id()?;
        self.rpc().unregister(pb::EngineRef { engine_id: id }).await?;
        *self.inner.reg.lock() = None;
        Ok(())
    }
}

fn finished(s: pb::LoadStatus) -> Result<pb::LoadStatus, ClientError> {
    if s.state == pb::load_status::State::Failed as i32 {
        return Err(ClientError::LoadFailed { op: s.op_id, error: s.error });
    }
    Ok(s)
}

/// A request's key source as it travels.
#[derive(Clone, Debug, Default)]
struct WireKeys {
    context: Option<pb::KeyContext>,
    hashes: Option<pb::EngineHashes>,
}

/// A key context as it travels: none when absent or empty (the plain chain).
fn wire_context(context: Option<&KeyContext>) -> WireKeys {
    WireKeys { context: context.filter(|c| !c.is_empty()).map(pb::KeyContext::from), hashes: None }
}

/// A key source as it travels.
fn wire_keys(keys: &KeySource) -> WireKeys {
    match keys {
        KeySource::Plain => WireKeys::default(),
        KeySource::Context(c) => wire_context(Some(c)),
        KeySource::Hashes(h) => WireKeys { context: None, hashes: Some(pb::EngineHashes::from(h)) },
    }
}
