//! Attached engines: their namespace, layout and KV memory, and the leases that drop an engine
//! that stopped sending heartbeats.
//!
//! On a CPU-only node an engine's KV memory is a shared-memory file the daemon maps; a GPU
//! engine passes a CUDA IPC handle, which the daemon opens with the CUDA driver (loaded at run
//! time; a clear "no CUDA device" error where there is none) and copies to and from with DMA.
//! [`Engine::read_slot_into`] and [`Engine::write_slot_from`] hide which.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvproto::{KvLayout, LayoutKind, Namespace, NamespaceFingerprint, NamespaceId, pb};
use memmap2::{MmapOptions, MmapRaw};
use parking_lot::{Mutex, RwLock};

use crate::error::ServerError;
use crate::fault_guard::FaultGuard;
use crate::token_area::PromptTokens;

/// The KV memory of one engine, mapped into the daemon.
#[derive(Debug)]
enum EngineMemory {
    /// A shared-memory file; `guard` (dropped before `map`, fields drop in order) turns a
    /// SIGBUS from a file the engine truncated into an error (`fault_guard`).
    Shm {
        guard: FaultGuard,
        map: MmapRaw,
        path: String,
    },
    Cuda(kvtiers::cuda::DeviceRegion),
}

/// The error of a copy whose engine memory shrank under it.
fn shrank(path: &str) -> ServerError {
    ServerError::Attach(format!(
        "the engine's KV memory file {path} shrank under the daemon (truncated by the engine?): \
         its saves and loads fail until it registers again"
    ))
}

/// [`kvtiers::pieces::zip_pieces`] over a block's pieces and a slot's segments, which add up to
/// the same length (checked at attach).
fn zip_pieces(
    src: &[(usize, usize)],
    dst: &[(usize, usize)],
    f: impl FnMut(usize, usize, usize) -> Result<(), ServerError>,
) -> Result<(), ServerError> {
    if kvtiers::pieces::zip_pieces(src.iter().copied(), dst.iter().copied(), f)? {
        Ok(())
    } else {
        Err(ServerError::Invalid("block pieces and slot segments differ in length".into()))
    }
}

/// One attached engine.
#[derive(Debug)]
pub struct Engine {
    pub id: u64,
    pub name: String,
    pub namespace: Namespace,
    pub namespace_id: NamespaceId,
    pub(crate) fingerprint: NamespaceFingerprint,
    memory: EngineMemory,
    /// (offset of block 0, stride between blocks) per segment, in block byte order.
    segments: Vec<(u64, u64)>,
    segment_bytes: u64,
    pub num_blocks: u32,
    /// Where routers send this engine's requests, and its role (published with hit reports).
    pub address: String,
    pub role: String,
    /// Where the engine writes long prompts' tokens, when it registered one and the daemon could
    /// open it.
    pub(crate) token_area: Option<crate::token_area::TokenArea>,
    last_seen: Mutex<Instant>,
}

/// Opens a file an engine names (its KV memory, its token area) without ever blocking, and only
/// if it is a regular file: a FIFO's open would wait for a peer forever, a device file's could
/// have side effects. The error names the path.
pub(crate) fn open_client_file(path: &str, write: bool) -> Result<std::fs::File, String> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("cannot open {path}: {e}"))?;
    match file.metadata() {
        Ok(m) if m.is_file() => Ok(file),
        Ok(_) => Err(format!("{path} is not a regular file")),
        Err(e) => Err(format!("{path}: {e}")),
    }
}

/// Who may name a file as KV memory: the daemon maps it and both reads it (saves) and writes it
/// (loads), so a client must not name the daemon's own storage, nor a file it does not own.
#[derive(Debug, Clone, Default)]
pub(crate) struct KvFileRules {
    /// Canonical paths of the daemon's own storage (the G2 pool file, the G3 directory).
    pub forbidden: Vec<std::path::PathBuf>,
    /// (device, inode) of its files (the pool, the G3 data file): a hard link elsewhere is the
    /// same file.
    pub forbidden_files: Vec<(u64, u64)>,
    /// The registering process's uid, where the transport tells it (Unix socket peer
    /// credentials); a process running as root may name any file.
    pub peer_uid: Option<u32>,
}

impl KvFileRules {
    fn check(&self, file: &std::fs::File, path: &str) -> Result<(), ServerError> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::MetadataExt;
        // The opened file's own path (no race with a symlink swapped after the open).
        let real = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .or_else(|_| std::fs::canonicalize(path))
            .map_err(|e| ServerError::Attach(format!("{path}: {e}")))?;
        let meta = file.metadata().map_err(|e| ServerError::Attach(format!("{path}: {e}")))?;
        let own = self.forbidden.iter().find(|f| real.starts_with(f)).map(|f| f.display().to_string()).or_else(|| {
            self.forbidden_files.contains(&(meta.dev(), meta.ino())).then(|| "a link to one of its files".to_string())
        });
        if let Some(own) = own {
            return Err(ServerError::Attach(format!(
                "{path} is kvcached's own storage ({own}): an engine registers its own KV memory"
            )));
        }
        if let Some(uid) = self.peer_uid.filter(|&u| u != 0) {
            let owner = meta.uid();
            if owner != uid {
                return Err(ServerError::Attach(format!(
                    "{path} belongs to uid {owner}, not to the registering process (uid {uid})"
                )));
            }
        }
        Ok(())
    }
}

fn invalid(msg: impl Into<String>) -> ServerError {
    ServerError::Invalid(msg.into())
}

impl Engine {
    /// Validates a registration and maps the engine's memory.
    fn attach(id: u64, req: &pb::RegisterRequest, prefault: bool, rules: &KvFileRules) -> Result<Self, ServerError> {
        let spec = req.namespace.as_ref().ok_or_else(|| invalid("namespace is missing"))?;
        let namespace = Namespace::try_from(spec)?;
        let layout: KvLayout = namespace.layout;
        let want_segments = match layout.kind {
            LayoutKind::LayerSeparate => layout.num_layers as usize * 2,
            LayoutKind::Contiguous => 1,
        };
        if req.segments.len() != want_segments {
            return Err(invalid(format!(
                "layout {} with {} layers needs {want_segments} segments, got {}",
                layout.kind.name(),
                layout.num_layers,
                req.segments.len()
            )));
        }
        let block_bytes = layout.block_bytes();
        if req.segment_bytes.checked_mul(want_segments as u64) != Some(block_bytes) {
            return Err(invalid(format!(
                "segment_bytes {} x {want_segments} segments != {block_bytes} bytes per block for this layout \
                 ({} layers, {} KV heads, head dim {}, {}, {} tokens per block)",
                req.segment_bytes,
                layout.num_layers,
                layout.kv_heads,
                layout.head_dim,
                layout.dtype.name(),
                layout.tokens_per_block
            )));
        }
        if req.num_blocks == 0 {
            return Err(invalid("num_blocks must be at least 1"));
        }
        let region = req.region.as_ref().ok_or_else(|| invalid("region is missing"))?;
        let size = region.size_bytes;
        let last = u64::from(req.num_blocks - 1);
        for (i, s) in req.segments.iter().enumerate() {
            let end = last
                .checked_mul(s.block_stride)
                .and_then(|x| x.checked_add(s.offset))
                .and_then(|x| x.checked_add(req.segment_bytes));
            if end.is_none_or(|e| e > size) {
                return Err(invalid(format!(
                    "segment {i} (offset {}, stride {}) of block {last} ends past the region's {size} bytes",
                    s.offset, s.block_stride
                )));
            }
        }
        let memory = match &region.kind {
            Some(pb::memory_region::Kind::ShmPath(path)) => {
                let file = open_client_file(path, true).map_err(ServerError::Attach)?;
                rules.check(&file, path)?;
                let len = file.metadata().map_err(|e| ServerError::Attach(format!("{path}: {e}")))?.len();
                if len < size {
                    return Err(ServerError::Attach(format!("{path} has {len} bytes, the registration says {size}")));
                }
                let mut options = MmapOptions::new();
                options.len(size as usize);
                if prefault {
                    // Page tables filled now, in one pass: faulting the region in 64 KiB at a
                    // time during the first saves cost ~80 ms per 32 MiB here.
                    options.populate();
                }
                let map = options.map_raw(&file).map_err(|e| ServerError::Attach(format!("cannot map {path}: {e}")))?;
                let guard = FaultGuard::watch(map.as_ptr() as usize, map.len()).map_err(ServerError::Attach)?;
                EngineMemory::Shm { guard, map, path: path.clone() }
            }
            Some(pb::memory_region::Kind::CudaIpcHandle(handle)) => {
                let len = usize::try_from(size).map_err(|_| invalid("region size exceeds the address space"))?;
                let region = kvtiers::cuda::DeviceRegion::open_ipc(handle, region.cuda_device, len)
                    .map_err(|e| ServerError::Attach(e.to_string()))?;
                tracing::info!(
                    device = region.cuda_device_ordinal(),
                    bytes = len,
                    "engine KV memory opened over CUDA IPC"
                );
                EngineMemory::Cuda(region)
            }
            None => return Err(invalid("region has neither shm_path nor cuda_ipc_handle")),
        };
        // A token area that cannot be opened costs speed, not the registration: the engine is
        // told (`token_area_accepted`) and sends its tokens inline.
        let token_area = req.token_area.as_ref().and_then(|a| {
            crate::token_area::TokenArea::open(a)
                .inspect_err(|why| tracing::warn!(engine = id, "{why}; its requests carry their tokens inline"))
                .ok()
        });
        Ok(Self {
            id,
            name: req.engine_name.clone(),
            namespace_id: namespace.id(),
            fingerprint: namespace.fingerprint(),
            namespace,
            memory,
            segments: req.segments.iter().map(|s| (s.offset, s.block_stride)).collect(),
            segment_bytes: req.segment_bytes,
            num_blocks: req.num_blocks,
            address: req.worker_address.clone(),
            role: req.role.clone(),
            token_area,
            last_seen: Mutex::new(Instant::now()),
        })
    }

    /// The tokens of a request: inline, or a span of the engine's token area (copied in as used).
    pub fn request_tokens<'a>(
        &'a self,
        inline: &'a [u8],
        at: Option<&pb::TokenSpan>,
    ) -> Result<PromptTokens<'a>, ServerError> {
        match (at, &self.token_area) {
            (None, _) => Ok(PromptTokens::inline(inline)),
            (Some(_), _) if !inline.is_empty() => {
                Err(invalid("a request carries either tokens or tokens_at, not both"))
            }
            (Some(span), Some(area)) => area.tokens(span),
            (Some(_), None) => Err(invalid(
                "tokens_at names a token area, but this engine has none open (see the daemon's log at its registration)",
            )),
        }
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> u64 {
        self.namespace.layout.block_bytes()
    }

    /// Checks engine block slots.
    pub fn check_slots(&self, ids: &[u32]) -> Result<(), ServerError> {
        match ids.iter().find(|&&b| b >= self.num_blocks) {
            Some(b) => Err(invalid(format!("block id {b} is out of range (engine has {} blocks)", self.num_blocks))),
            None => Ok(()),
        }
    }

    /// The segments of engine block `block` as (offset in the region, length), in block byte
    /// order. In range: checked against the region size at attach.
    fn segment_ranges(&self, block: u32) -> Vec<(usize, usize)> {
        self.segments
            .iter()
            .map(|&(off, stride)| ((off + u64::from(block) * stride) as usize, self.segment_bytes as usize))
            .collect()
    }

    /// Copies engine block `block` into `dst` (pieces of the block's bytes in order: its G2
    /// pages). `block` must have passed [`Engine::check_slots`].
    pub fn read_slot_into(&self, block: u32, dst: &[(*mut u8, usize)]) -> Result<(), ServerError> {
        let dst: Vec<(usize, usize)> = dst.iter().map(|&(p, n)| (p as usize, n)).collect();
        match &self.memory {
            EngineMemory::Shm { guard, map, path } => {
                if guard.faulted() {
                    return Err(shrank(path));
                }
                let base = map.as_ptr();
                let src = self.segment_ranges(block).into_iter().map(|(o, n)| (base.wrapping_add(o), n));
                // SAFETY: sources are this engine's mapped segments (range-checked at attach; the
                // engine does not write a slot it asked to save until the call returns; a page
                // the engine truncated away reads as zeros, see `fault_guard`), destinations the
                // caller's pieces; both add up to one block.
                unsafe { kvtiers::pieces::copy_pieces(src, dst.iter().map(|&(p, n)| (p as *mut u8, n))) };
                // What a faulted copy read is not the block: fail, so it is never stored.
                if guard.faulted() { Err(shrank(path)) } else { Ok(()) }
            }
            EngineMemory::Cuda(region) => zip_pieces(&self.segment_ranges(block), &dst, |off, d, n| {
                // SAFETY: `d` is inside the caller's piece for `n` bytes.
                unsafe { region.to_host(off, d as *mut u8, n) }.map_err(|e| ServerError::Attach(e.to_string()))
            }),
        }
    }

    /// Copies a block given as pieces (in order) into engine block `block`.
    pub fn write_slot_from(&self, block: u32, pieces: &[&[u8]]) -> Result<(), ServerError> {
        match &self.memory {
            EngineMemory::Shm { guard, map, path } => {
                if guard.faulted() {
                    return Err(shrank(path));
                }
                let total: usize = pieces.iter().map(|p| p.len()).sum();
                if total != self.segments.len() * self.segment_bytes as usize {
                    return Err(ServerError::Invalid("block pieces and slot segments differ in length".into()));
                }
                let base = map.as_mut_ptr();
                // Non-temporal stores, as for saves: the daemon never reads the engine's slots
                // again, and the engine reads them later (often by DMA to its GPU), so pulling
                // each destination line into the cache first would only cost bandwidth.
                let dst = self.segment_ranges(block).into_iter().map(|(o, n)| (base.wrapping_add(o), n));
                // SAFETY: destinations are this engine's mapped segments (checked against the
                // region at attach), sources the caller's pieces; they do not overlap.
                unsafe { kvtiers::pieces::copy_pieces(pieces.iter().map(|p| (p.as_ptr(), p.len())), dst) };
                if guard.faulted() { Err(shrank(path)) } else { Ok(()) }
            }
            EngineMemory::Cuda(region) => {
                let src: Vec<(usize, usize)> = pieces.iter().map(|p| (p.as_ptr() as usize, p.len())).collect();
                zip_pieces(&src, &self.segment_ranges(block), |s, off, n| {
                    // SAFETY: `s` is inside the caller's piece for `n` bytes.
                    unsafe { region.from_host(off, s as *const u8, n) }.map_err(|e| ServerError::Attach(e.to_string()))
                })
            }
        }
    }

    pub fn touch(&self) {
        *self.last_seen.lock() = Instant::now();
    }

    fn expired(&self, lease: Duration, now: Instant) -> bool {
        now.duration_since(*self.last_seen.lock()) > lease
    }
}

// SAFETY: the mapping is shared memory accessed through raw pointers only; the engine protocol
// gives the daemon exclusive use of the block slots named in a request while it runs.
unsafe impl Send for Engine {}
// SAFETY: as above.
unsafe impl Sync for Engine {}

/// Every attached engine.
#[derive(Debug)]
pub struct Registry {
    engines: RwLock<HashMap<u64, Arc<Engine>>>,
    /// Keys the random engine ids (an id is what every later request presents, so another
    /// client must not be able to guess it).
    ids: std::collections::hash_map::RandomState,
    next_id: AtomicU64,
    /// The daemon's own storage, which no engine may register (the rules every registration
    /// starts from; its peer's uid is added per registration).
    own_storage: KvFileRules,
    max: usize,
    pub lease: Duration,
    prefault: bool,
}

/// A first id for a counter that must not repeat the ids of a previous daemon process: the
/// start time in microseconds, times 256 (a daemon would have to hand out more than 256 ids per
/// microsecond of its life to reach the next start's range).
pub(crate) fn time_seeded_id() -> u64 {
    let micros =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(1);
    micros << 8
}

impl Registry {
    pub fn new(max: usize, lease: Duration) -> Self {
        // Ids start from a time-derived value so a restarted daemon does not reuse the ids of
        // its previous life (a stale client then gets "not registered", not another engine).
        Self {
            engines: RwLock::new(HashMap::new()),
            ids: std::collections::hash_map::RandomState::new(),
            next_id: AtomicU64::new(time_seeded_id()),
            own_storage: KvFileRules::default(),
            max,
            lease,
            prefault: false,
        }
    }

    /// Whether shared-memory regions are mapped with their page tables filled at register
    /// (`engines.prefault_memory`).
    pub fn prefault_memory(mut self, on: bool) -> Self {
        self.prefault = on;
        self
    }

    /// Files no engine may register as KV memory (the daemon's own storage; made canonical
    /// here, those that do not exist are skipped).
    pub fn forbid(mut self, paths: impl IntoIterator<Item = std::path::PathBuf>) -> Self {
        use std::os::unix::fs::MetadataExt;
        for p in paths.into_iter().filter_map(|p| std::fs::canonicalize(p).ok()) {
            // The files themselves too, by identity: the pool, and the files directly in a
            // directory (G3's data file).
            let files: Vec<std::path::PathBuf> = if p.is_dir() {
                std::fs::read_dir(&p).into_iter().flatten().flatten().map(|e| e.path()).collect()
            } else {
                vec![p.clone()]
            };
            for f in files {
                if let Some(m) = std::fs::metadata(&f).ok().filter(|m| m.is_file()) {
                    self.own_storage.forbidden_files.push((m.dev(), m.ino()));
                }
            }
            self.own_storage.forbidden.push(p);
        }
        self
    }

    fn full(&self) -> ServerError {
        ServerError::Exhausted(format!("{} engines attached (engines.max_engines)", self.max))
    }

    /// Attaches an engine; `peer_uid` is the registering process's uid where the transport
    /// tells it.
    pub fn register(&self, req: &pb::RegisterRequest, peer_uid: Option<u32>) -> Result<Arc<Engine>, ServerError> {
        if self.engines.read().len() >= self.max {
            return Err(self.full());
        }
        let rules = KvFileRules { peer_uid, ..self.own_storage.clone() };
        // Random, unguessable (an id is what every later request presents) and never 0; not
        // derived from the time, so a restarted daemon does not hand out its previous life's
        // ids either. Distinct counters give distinct ids but for a 2^-64 hash collision.
        let id = loop {
            let id = std::hash::BuildHasher::hash_one(&self.ids, self.next_id.fetch_add(1, Ordering::Relaxed));
            if id != 0 && !self.engines.read().contains_key(&id) {
                break id;
            }
        };
        let e = Arc::new(Engine::attach(id, req, self.prefault, &rules)?);
        let mut engines = self.engines.write();
        // Checked again where the engine is added: registrations attaching at the same time
        // all passed the first check (the mapping is released when `e` drops).
        if engines.len() >= self.max {
            return Err(self.full());
        }
        engines.insert(id, Arc::clone(&e));
        drop(engines);
        tracing::info!(engine = id, name = %e.name, namespace = %e.namespace_id, "engine attached");
        Ok(e)
    }

    pub fn get(&self, id: u64) -> Result<Arc<Engine>, ServerError> {
        let e = self.engines.read().get(&id).cloned().ok_or(ServerError::UnknownEngine(id))?;
        e.touch();
        Ok(e)
    }

    pub fn unregister(&self, id: u64) -> Result<Arc<Engine>, ServerError> {
        match self.engines.write().remove(&id) {
            Some(e) => {
                tracing::info!(engine = id, name = %e.name, "engine detached");
                Ok(e)
            }
            None => Err(ServerError::UnknownEngine(id)),
        }
    }

    /// Every attached engine.
    pub fn all(&self) -> Vec<Arc<Engine>> {
        self.engines.read().values().cloned().collect()
    }

    /// Drops engines whose lease ran out; returns them.
    pub fn reap(&self) -> Vec<Arc<Engine>> {
        let now = Instant::now();
        let mut map = self.engines.write();
        let dead: Vec<u64> = map.iter().filter(|(_, e)| e.expired(self.lease, now)).map(|(id, _)| *id).collect();
        let mut out = Vec::new();
        for id in &dead {
            if let Some(e) = map.remove(id) {
                tracing::warn!(engine = id, name = %e.name, "engine missed its heartbeats; detached");
                out.push(e);
            }
        }
        out
    }

    pub fn len(&self) -> usize {
        self.engines.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn clear(&self) {
        self.engines.write().clear();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A KV memory file must belong to the uid that registers it (root may name any), and may
    /// not lie in the daemon's own storage.
    #[test]
    fn a_kv_file_must_be_the_registering_uids_and_not_the_daemons() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("kv");
        std::fs::write(&p, [0u8; 64]).unwrap();
        let f = std::fs::File::open(&p).unwrap();
        let path = p.display().to_string();
        let owner = f.metadata().unwrap().uid();
        let rules = |peer_uid: Option<u32>| KvFileRules { peer_uid, ..Default::default() };
        assert!(rules(Some(owner)).check(&f, &path).is_ok());
        assert!(rules(None).check(&f, &path).is_ok(), "no peer credentials (TCP): not checked");
        assert!(rules(Some(0)).check(&f, &path).is_ok(), "root may name any file");
        let other = if owner == 1 { 2 } else { 1 };
        let e = rules(Some(other)).check(&f, &path).unwrap_err().to_string();
        assert!(e.contains(&format!("belongs to uid {owner}")), "{e}");
        let own = KvFileRules { forbidden: vec![std::fs::canonicalize(d.path()).unwrap()], ..Default::default() };
        let e = own.check(&f, &path).unwrap_err().to_string();
        assert!(e.contains("kvcached's own storage"), "{e}");
        // A hard link elsewhere to a file of the daemon's is that file.
        let elsewhere = tempfile::tempdir_in(d.path().parent().unwrap()).unwrap();
        let link = elsewhere.path().join("innocent");
        std::fs::hard_link(&p, &link).unwrap();
        let by_id = Registry::new(1, std::time::Duration::from_secs(1)).forbid([p.clone()]);
        let rules = KvFileRules { forbidden_files: by_id.own_storage.forbidden_files.clone(), ..Default::default() };
        let linked = std::fs::File::open(&link).unwrap();
        let e = rules.check(&linked, &link.display().to_string()).unwrap_err().to_string();
        assert!(e.contains("a link to one of its files"), "{e}");
    }
}
