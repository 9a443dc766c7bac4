//! Attached engines: their namespace, layout and KV memory, and the leases that drop an engine
//! that stopped sending heartbeats.
//!
//! On a CPU-only node an engine's KV memory is a shared-memory file the daemon maps; a GPU
//! engine passes a CUDA IPC handle, which the daemon opens with the CUDA driver (loaded at run
//! time; a clear "no CUDA device" error where there is none) and copies to and from with DMA.
//! [`Engine::read_slot_into`] and [`Engine::write_slot_from`] hide which. Registrations of the
//! same memory by the same owner share it, mapped and counted once ([`memory`]).

pub mod attach;
pub mod fault_guard;
pub mod key_memo;
pub mod memory;
pub mod prefix_probe;
pub mod token_area;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvproto::slots::{Segment, SlotLayout};
use kvproto::{Namespace, NamespaceFingerprint, NamespaceId, pb};
use kvtiers::copy::{Copy, CopyEngine, Direction};
use parking_lot::{Mutex, RwLock};

use crate::engine::attach::Tickets;
use crate::engine::memory::{EngineMemory, MAX_SHARERS, MemoryIdentity, Region, SharedMemory, SharedUse};
use crate::engine::token_area::PromptTokens;
use crate::error::ServerError;
use crate::policy::limits::{Limits, Principal};

/// A copy between an engine's device memory and G2 that failed: the block is not saved (a
/// save) or the load fails (a load), never served; counted by `op` ("save", "load").
pub(crate) fn copy_failed(op: &'static str, engine: u64, e: &kvtiers::TierError) -> kvtiers::TierError {
    metrics::counter!("kvcached_g1_copy_failures_total", "op" => op).increment(1);
    tracing::warn!(engine, op, "a copy between the engine's GPU memory and G2 failed: {e}");
    let why = match e {
        kvtiers::TierError::Device(m) => m.clone(),
        e => e.to_string(),
    };
    kvtiers::TierError::Device(format!("{op}: a copy between the engine's GPU memory and G2 failed: {why}"))
}

/// The refusal of a path where a descriptor is wanted.
fn path_refused(field: &str) -> ServerError {
    invalid(format!(
        "{field}: paths are not accepted (the daemon would open them with its own rights); pass the file \
         descriptor over the Unix socket (ATTACH) and register its fd_ticket"
    ))
}

/// The error of a copy whose engine memory shrank under it.
fn shrank(path: &str) -> ServerError {
    ServerError::Attach(format!(
        "the engine's {path} shrank under the daemon (truncated by the engine?): its saves and loads fail \
         until it registers again"
    ))
}

/// One attached engine.
#[derive(Debug)]
pub struct Engine {
    pub id: u64,
    pub name: String,
    pub namespace: Namespace,
    pub namespace_id: NamespaceId,
    pub(crate) fingerprint: NamespaceFingerprint,
    /// The `kv_namespace` label of this engine's per-namespace series (`metrics_catalog.rs`).
    pub kv_label: String,
    /// Its KV memory, shared with the owner's other registrations of the same memory (which
    /// hold it counted against the owner's limits).
    memory: SharedUse,
    /// A registration sharing another's memory: counted against `engines.max_engines` while
    /// it lives (its token area and registration are its own).
    _sharer: Option<crate::policy::limits::Held>,
    /// Where each block slot lies in the memory.
    slots: SlotLayout,
    pub num_blocks: u32,
    /// Who registered it: only they may use it (to anyone else it does not exist).
    pub owner: Principal,
    /// Whether its tenant may write its namespace (`tenants.rs`: the trust model); its saves
    /// are refused otherwise.
    pub may_write: bool,
    /// Where routers send this engine's requests, and its role (published with hit reports).
    pub address: String,
    pub role: String,
    /// Where the engine writes long prompts' tokens, when it registered one and the daemon could
    /// use it; else why not.
    pub(crate) token_area: Option<crate::engine::token_area::TokenArea>,
    pub(crate) token_area_error: String,
    last_seen: Mutex<Instant>,
}

fn invalid(msg: impl Into<String>) -> ServerError {
    ServerError::Invalid(msg.into())
}

/// Refuses user-supplied text past `max` bytes, quoting at most a little of it.
fn bounded(field: &str, s: &str, max: usize) -> Result<(), ServerError> {
    if s.len() > max {
        return Err(invalid(format!(
            "{field} is {} bytes, more than {max}: {}",
            s.len(),
            kvproto::limits::clip(s, 64)
        )));
    }
    Ok(())
}

/// What a registration names besides its memory: the engine's names, checked and bounded.
fn check_names(req: &pb::RegisterRequest) -> Result<(), ServerError> {
    bounded("engine_name", &req.engine_name, kvproto::limits::ENGINE_NAME_MAX_BYTES)?;
    if req.engine_name.chars().any(char::is_control) {
        return Err(invalid("engine_name has control characters"));
    }
    bounded("worker_address", &req.worker_address, kvproto::limits::WORKER_ADDRESS_MAX_BYTES)?;
    if !matches!(req.role.as_str(), "" | "prefill" | "decode" | "both") {
        return Err(invalid(format!("role {:?}: use prefill, decode or both", kvproto::limits::clip(&req.role, 32))));
    }
    Ok(())
}

/// A registration's parts, as the registry hands them to [`Engine::attach`].
#[derive(Debug)]
pub(crate) struct Attaching<'a> {
    pub id: u64,
    pub req: &'a pb::RegisterRequest,
    pub owner: Principal,
    /// The owner's uid (engines attach over the Unix socket only: `owner` is that uid).
    pub uid: u32,
    /// The registering process (its descriptors' tickets must be its own).
    pub pid: Option<i32>,
    /// Its KV memory, mapped (or shared with the owner's registration of the same memory).
    pub memory: SharedUse,
    /// For a registration sharing memory: its count against `engines.max_engines`.
    pub sharer: Option<crate::policy::limits::Held>,
}

/// A registration's request checked, before anything is mapped, bound or counted.
#[derive(Debug)]
pub(crate) struct Checked {
    pub namespace: Namespace,
    slots: SlotLayout,
    /// The size the registration gives its region.
    size: u64,
    /// Bytes of the region the daemon maps into its address space: from its start to the end
    /// of its last block slot, in whole pages (none of a GPU's memory).
    pub map_bytes: u64,
}

impl Checked {
    /// Checks the names, namespace, region and block slots a registration gives.
    pub fn new(req: &pb::RegisterRequest) -> Result<Self, ServerError> {
        check_names(req)?;
        let spec = req.namespace.as_ref().ok_or_else(|| invalid("namespace is missing"))?;
        bounded("namespace.model_id", &spec.model_id, kvproto::limits::MODEL_ID_MAX_BYTES)?;
        let namespace = Namespace::try_from(spec)?;
        let region = req.region.as_ref().ok_or_else(|| invalid("region is missing"))?;
        #[allow(deprecated)]
        if let Some(pb::memory_region::Kind::ShmPath(_)) = &region.kind {
            return Err(path_refused("region.shm_path"));
        }
        let size = region.size_bytes;
        let slots = SlotLayout {
            segments: req.segments.iter().map(|s| Segment { offset: s.offset, stride: s.block_stride }).collect(),
            segment_bytes: req.segment_bytes,
            num_blocks: req.num_blocks,
        };
        slots.check(&namespace.layout, size).map_err(|e| invalid(e.to_string()))?;
        #[allow(deprecated)]
        let map_bytes = match &region.kind {
            Some(pb::memory_region::Kind::ShmPath(_)) => return Err(path_refused("region.shm_path")),
            Some(pb::memory_region::Kind::FdTicket(_)) => {
                // Only what the slots use is mapped: a region declared larger than its slots
                // costs the daemon nothing past them (finding 1 of issue 35).
                let extent = slots.extent().ok_or_else(|| invalid("block slots overflow"))?;
                extent.div_ceil(PAGE).saturating_mul(PAGE).min(size)
            }
            Some(pb::memory_region::Kind::CudaIpcHandle(_)) => 0,
            None => return Err(invalid("region has neither fd_ticket nor cuda_ipc_handle")),
        };
        Ok(Self { namespace, slots, size, map_bytes })
    }
}

/// The page size regions are mapped in.
const PAGE: u64 = 4096;

/// How long a registration may spend filling the page tables of its region
/// (`engines.prefault_memory`); what is left faults in on first use.
pub const PREFAULT_BUDGET: Duration = Duration::from_secs(2);

/// Bytes of the region prefaulted per step (between steps the budget is checked).
const PREFAULT_STEP: usize = 64 << 20;

/// Pages one `MADV_POPULATE_WRITE` call maps (see [`kvtiers::POPULATE_STEP`]).
const STEP_PAGES: usize = kvtiers::POPULATE_STEP / PAGE as usize;

impl Engine {
    /// Attaches an engine over its memory (mapped or shared already), for a registration
    /// [`Checked`] already.
    fn attach(a: Attaching<'_>, checked: Checked, tickets: &Tickets) -> Result<Self, ServerError> {
        let Attaching { id, req, owner, uid, pid, memory, sharer } = a;
        let Checked { namespace, slots, .. } = checked;
        // A token area that cannot be used costs speed, not the registration: the engine is
        // told why (`token_area_error`) and sends its tokens inline.
        let (token_area, token_area_error) = match req.token_area.as_ref() {
            None => (None, String::new()),
            Some(a) => match crate::engine::token_area::TokenArea::open(a, tickets, uid, pid) {
                Ok(t) => (Some(t), String::new()),
                Err(why) => {
                    tracing::info!(engine = id, "token area refused: {why}; its requests carry their tokens inline");
                    (None, why)
                }
            },
        };
        Ok(Self {
            id,
            name: req.engine_name.clone(),
            kv_label: crate::metrics_catalog::kv_namespace_label(
                namespace.id(),
                &namespace.model_id,
                namespace.tenant_salt.is_some(),
            ),
            namespace_id: namespace.id(),
            fingerprint: namespace.fingerprint(),
            namespace,
            memory,
            _sharer: sharer,
            num_blocks: req.num_blocks,
            slots,
            owner,
            may_write: false,
            address: req.worker_address.clone(),
            role: req.role.clone(),
            token_area,
            token_area_error,
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

    /// A load writes every slot it names: one named twice would hold only one of the two
    /// blocks counted as loaded into it.
    pub fn check_distinct_slots(ids: &[u32]) -> Result<(), ServerError> {
        let mut seen = std::collections::HashSet::with_capacity(ids.len());
        match ids.iter().find(|&&b| !seen.insert(b)) {
            Some(b) => Err(invalid(format!("block id {b} is named twice: a load needs a slot per block"))),
            None => Ok(()),
        }
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
    pub(crate) fn segment_ranges(&self, block: u32) -> Vec<(usize, usize)> {
        self.slots.ranges(block).collect()
    }

    /// Engine block `block`'s segments as memory a G3 read can land in straight
    /// ([`kvtiers::BlockStore::read_into_foreign`]), in block byte order: CPU engines only
    /// (None for a CUDA engine, or one whose memory shrank). `block` must have passed
    /// [`Engine::check_slots`]; the tier reads only into segments of whole 4 KiB pages.
    pub fn slot_memory(&self, block: u32) -> Option<Vec<(*mut u8, usize)>> {
        match &self.memory.memory {
            EngineMemory::Shm { guard, map, .. } if !guard.faulted() => {
                let base = map.as_mut_ptr();
                Some(self.segment_ranges(block).into_iter().map(|(o, n)| (base.wrapping_add(o), n)).collect())
            }
            _ => None,
        }
    }

    /// Fails if the engine's memory shrank under the daemon since it was mapped: what was read
    /// into it since is not the block (see `fault_guard`).
    pub fn check_memory(&self) -> Result<(), ServerError> {
        match &self.memory.memory {
            EngineMemory::Shm { guard, path, .. } if guard.faulted() => Err(shrank(path)),
            _ => Ok(()),
        }
    }

    /// Fills the page tables of the pages of a shared-memory region that the engine has
    /// already made resident, in steps, until `budget` runs out: the first saves and loads then
    /// take no page faults. Pages the engine never touched are left alone (filling them would
    /// allocate memory in the daemon's name for a region that may be sparse), and so is a GPU's
    /// memory. Returns the bytes filled.
    pub fn prefault(&self, budget: Duration) -> u64 {
        let EngineMemory::Shm { map, .. } = &self.memory.memory else { return 0 };
        let start = Instant::now();
        let (base, len) = (map.as_mut_ptr(), map.len());
        let mut filled = 0u64;
        let mut resident = Vec::new();
        let mut at = 0usize;
        while at < len && start.elapsed() < budget {
            let n = PREFAULT_STEP.min(len - at);
            resident.clear();
            resident.resize(n.div_ceil(PAGE as usize), 0u8);
            // SAFETY: mincore reads the mapping's page-cache state into a vector of one byte per
            // page of the range, which is inside this engine's mapping.
            if unsafe { libc::mincore(base.wrapping_add(at).cast(), n, resident.as_mut_ptr()) } != 0 {
                break;
            }
            let mut page = 0usize;
            while page < resident.len() {
                if resident[page] & 1 == 0 {
                    page += 1;
                    continue;
                }
                // At most `POPULATE_STEP` per call: it holds the mmap lock meanwhile.
                let run = resident[page..].iter().take(STEP_PAGES).take_while(|r| *r & 1 == 1).count();
                let (off, bytes) =
                    (at + page * PAGE as usize, (run * PAGE as usize).min(len - at - page * PAGE as usize));
                // SAFETY: MADV_POPULATE_WRITE only faults in (writable) pages of this range of
                // the engine's mapping, which are resident already; it writes no byte.
                if unsafe { libc::madvise(base.wrapping_add(off).cast(), bytes, libc::MADV_POPULATE_WRITE) } != 0 {
                    // An older kernel, or a page gone meanwhile: the rest faults in on use.
                    return filled;
                }
                filled += bytes as u64;
                page += run;
            }
            at += n;
        }
        filled
    }

    /// The engine's device memory, copied to and from by queued DMA; None for an engine whose
    /// memory the daemon maps (a CPU engine).
    pub fn device(&self) -> Option<&dyn CopyEngine> {
        match &self.memory.memory {
            EngineMemory::Device(d) => Some(d.as_ref()),
            EngineMemory::Shm { .. } => None,
        }
    }

    /// Bytes of the region mapped into the daemon (none of a GPU's memory).
    pub fn mapped_bytes(&self) -> u64 {
        self.memory.mapped_bytes()
    }

    /// Copies engine block `block` into `dst` (pieces of the block's bytes in order: its G2
    /// pages). `block` must have passed [`Engine::check_slots`].
    pub fn read_slot_into(&self, block: u32, dst: &mut [&mut [u8]]) -> Result<(), ServerError> {
        let total: usize = dst.iter().map(|d| d.len()).sum();
        if total as u64 != self.block_bytes() {
            return Err(ServerError::Invalid("block pieces and slot segments differ in length".into()));
        }
        let dst: Vec<(usize, usize)> = dst.iter_mut().map(|d| (d.as_mut_ptr() as usize, d.len())).collect();
        match &self.memory.memory {
            EngineMemory::Shm { guard, map, path } => {
                if guard.faulted() {
                    return Err(shrank(path));
                }
                let base = map.as_ptr();
                let src = self.segment_ranges(block).into_iter().map(|(o, n)| (base.wrapping_add(o), n));
                // SAFETY: sources are this engine's mapped segments (range-checked at attach; the
                // engine does not write a slot it asked to save until the call returns; a page
                // the engine truncated away reads as zeros, see `fault_guard`), destinations the
                // caller's slices, borrowed mutably for this call; both add up to one block.
                unsafe { kvtiers::pieces::copy_pieces(src, dst.iter().map(|&(p, n)| (p as *mut u8, n))) };
                // What a faulted copy read is not the block: fail, so it is never stored.
                if guard.faulted() { Err(shrank(path)) } else { Ok(()) }
            }
            EngineMemory::Device(dev) => {
                let copies = Copy::zip(Direction::ToHost, &self.segment_ranges(block), &dst)
                    .map_err(|e| ServerError::Invalid(e.to_string()))?;
                // SAFETY: the host ranges are the caller's pieces, borrowed mutably for this
                // call, which waits for the copies.
                unsafe { dev.copy_now(&copies) }.map_err(|e| copy_failed("save", self.id, &e).into())
            }
        }
    }

    /// Copies a block given as pieces (in order) into engine block `block`.
    pub fn write_slot_from(&self, block: u32, pieces: &[&[u8]]) -> Result<(), ServerError> {
        match &self.memory.memory {
            EngineMemory::Shm { guard, map, path } => {
                if guard.faulted() {
                    return Err(shrank(path));
                }
                let total: usize = pieces.iter().map(|p| p.len()).sum();
                if total as u64 != self.block_bytes() {
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
            EngineMemory::Device(dev) => {
                let src: Vec<(usize, usize)> = pieces.iter().map(|p| (p.as_ptr() as usize, p.len())).collect();
                let copies = Copy::zip(Direction::ToDevice, &self.segment_ranges(block), &src)
                    .map_err(|e| ServerError::Invalid(e.to_string()))?;
                // SAFETY: the host ranges are the caller's pieces, borrowed for this call,
                // which waits for the copies; the device only reads them.
                unsafe { dev.copy_now(&copies) }.map_err(|e| copy_failed("load", self.id, &e).into())
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
    /// Descriptors engines handed over (ATTACH), until their registrations redeem them.
    pub tickets: Arc<Tickets>,
    limits: Arc<Limits>,
    pub lease: Duration,
    prefault: bool,
    /// Who may name which tenant salt.
    tenants: Arc<crate::policy::tenants::Tenants>,
    /// The G1 fault switches (`inject_faults` only).
    g1_faults: Option<Arc<crate::faults::G1Faults>>,
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
    pub fn new(lease: Duration, tickets: Arc<Tickets>, limits: Arc<Limits>) -> Self {
        Self {
            engines: RwLock::new(HashMap::new()),
            ids: std::collections::hash_map::RandomState::new(),
            next_id: AtomicU64::new(time_seeded_id()),
            tickets,
            limits,
            lease,
            prefault: false,
            tenants: Arc::default(),
            g1_faults: None,
        }
    }

    /// Sets the tenants registrations are checked against (`[[tenants]]`).
    pub fn with_tenants(mut self, tenants: Arc<crate::policy::tenants::Tenants>) -> Self {
        self.tenants = tenants;
        self
    }

    /// Sets the G1 fault switches (`inject_faults`): with `[g1] emulate`, engines registered
    /// with shared memory are served as emulated GPUs.
    pub fn with_g1_faults(mut self, g1: Option<Arc<crate::faults::G1Faults>>) -> Self {
        self.g1_faults = g1;
        self
    }

    /// The tenants registrations are checked against.
    pub fn tenants(&self) -> &crate::policy::tenants::Tenants {
        &self.tenants
    }

    /// Whether shared-memory regions are mapped with their page tables filled at register
    /// (`engines.prefault_memory`).
    pub fn prefault_memory(mut self, on: bool) -> Self {
        self.prefault = on;
        self
    }

    /// Attaches an engine for `owner` (process `pid`, whose descriptor tickets it redeems): the
    /// request checked, the engine counted against `owner`'s limits (engines, mapped memory),
    /// its memory mapped, then its namespace checked against the trust model and bound
    /// (`tenants.rs`), and only then its resident pages prefaulted. The trust check comes after
    /// everything else that can fail, so a refusal for another tenant's salt is the only answer
    /// that names it.
    pub fn register(
        &self,
        req: &pb::RegisterRequest,
        owner: Principal,
        pid: Option<i32>,
    ) -> Result<Arc<Engine>, ServerError> {
        let checked = Checked::new(req)?;
        // Random, unguessable and never 0; not derived from the time, so a restarted daemon
        // does not hand out its previous life's ids either. Distinct counters give distinct ids
        // but for a 2^-64 hash collision.
        let id = loop {
            let id = std::hash::BuildHasher::hash_one(&self.ids, self.next_id.fetch_add(1, Ordering::Relaxed));
            if id != 0 && !self.engines.read().contains_key(&id) {
                break id;
            }
        };
        let Principal::Uid(uid) = owner else {
            return Err(ServerError::Attach("engines attach over the Unix socket only".into()));
        };
        let region = Region::take(req, checked.size, &self.tickets, uid, pid)?;
        // The owner's memory registered already (another KV-cache group over the same
        // allocation) is shared, not mapped and counted again.
        let (memory, sharer) = match self.shared_memory(owner, &region.identity(), region.needs(checked.map_bytes))? {
            Some(m) => (m, Some(self.limits.sharer(owner)?)),
            None => {
                let held = self.limits.engine(owner, checked.map_bytes)?;
                let opened = SharedMemory::open(region, checked.map_bytes, held, self.g1_faults.as_ref(), id)?;
                (SharedUse::first(opened), None)
            }
        };
        let fresh = sharer.is_none();
        let mut e = Engine::attach(Attaching { id, req, owner, uid, pid, memory, sharer }, checked, &self.tickets)?;
        e.may_write = self.tenants.rights(owner, &e.namespace)?.write;
        self.tenants.bind(owner, &e.namespace)?;
        if self.prefault && fresh {
            let t = Instant::now();
            let filled = e.prefault(PREFAULT_BUDGET);
            tracing::debug!(
                engine = id,
                filled,
                mapped = e.mapped_bytes(),
                ms = t.elapsed().as_millis() as u64,
                "prefaulted"
            );
        }
        let e = Arc::new(e);
        let mut engines = self.engines.write();
        engines.insert(id, Arc::clone(&e));
        let attached = engines.len();
        drop(engines);
        metrics::gauge!("kvcached_engines_attached").set(attached as f64);
        tracing::info!(
            engine = id,
            name = %e.name,
            owner = %owner,
            namespace = %e.namespace_id,
            may_write = e.may_write,
            mapped = e.mapped_bytes(),
            shared = !fresh,
            "engine attached"
        );
        Ok(e)
    }

    /// `owner`'s memory `identity`, held by one of its engines with at least `needs` bytes
    /// usable, if any, held for one more registration (until that hold drops); refused when
    /// [`MAX_SHARERS`] registrations hold it already.
    fn shared_memory(
        &self,
        owner: Principal,
        identity: &MemoryIdentity,
        needs: u64,
    ) -> Result<Option<SharedUse>, ServerError> {
        let engines = self.engines.read();
        let Some(m) =
            engines.values().filter(|e| e.owner == owner).map(|e| &e.memory).find(|m| m.fits(identity, needs))
        else {
            return Ok(None);
        };
        match m.another() {
            Some(hold) => Ok(Some(hold)),
            None => Err(ServerError::Exhausted(format!(
                "this KV memory is registered {MAX_SHARERS} times already (one registration per KV-cache group \
                 and rank): unregister some first"
            ))),
        }
    }

    /// Engine `id`, if `who` registered it (to anyone else it does not exist: the same answer as
    /// for an id never given out, so ids reveal nothing).
    pub fn get(&self, id: u64, who: Principal) -> Result<Arc<Engine>, ServerError> {
        let e =
            self.engines.read().get(&id).filter(|e| e.owner == who).cloned().ok_or(ServerError::UnknownEngine(id))?;
        e.touch();
        Ok(e)
    }

    pub fn unregister(&self, id: u64, who: Principal) -> Result<Arc<Engine>, ServerError> {
        let mut engines = self.engines.write();
        if engines.get(&id).is_none_or(|e| e.owner != who) {
            return Err(ServerError::UnknownEngine(id));
        }
        let e = engines.remove(&id).ok_or(ServerError::UnknownEngine(id))?;
        metrics::gauge!("kvcached_engines_attached").set(engines.len() as f64);
        drop(engines);
        tracing::info!(engine = id, name = %e.name, "engine detached");
        Ok(e)
    }

    /// The block size of an attached engine of `namespace`, if any is attached.
    pub fn block_bytes_of(&self, namespace: &kvproto::NamespaceId) -> Option<u64> {
        self.engines.read().values().find(|e| e.namespace_id == *namespace).map(|e| e.block_bytes())
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
        metrics::gauge!("kvcached_engines_attached").set(map.len() as f64);
        drop(map);
        self.tickets.expire();
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
        metrics::gauge!("kvcached_engines_attached").set(0.0);
    }
}

/// For the engine modules' tests: a temporary directory holding one file, `name`, of `bytes`;
/// the directory (the file goes with it) and the file's path.
#[cfg(test)]
fn temp_file(name: &str, bytes: &[u8]) -> (tempfile::TempDir, std::path::PathBuf) {
    #![allow(clippy::unwrap_used)]
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    (dir, path)
}
