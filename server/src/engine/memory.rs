//! An engine's KV memory as the daemon holds it: a shared-memory file mapped into the daemon, or
//! a GPU allocation opened over CUDA IPC.
//!
//! One memory may be registered more than once by the same owner: vLLM's hybrid models (full
//! attention beside sliding-window layers) keep every KV-cache group's layers in one allocation,
//! and the connector registers each group over it with its own slots and namespace. Those
//! registrations share one [`SharedMemory`]: the file is mapped once (the GPU allocation opened
//! once), and counted once against the owner's limits (`limits.max_engines_per_uid`, engine
//! memory), until the last of them goes. Memory is the same when it is the same file (device
//! and inode, however the engine opened it) or the same CUDA IPC handle on the same device;
//! memory of another owner is never shared.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvproto::pb;
use kvtiers::copy::CopyEngine;
use memmap2::{MmapOptions, MmapRaw};

use crate::engine::attach::Tickets;
use crate::engine::fault_guard::FaultGuard;
use crate::error::ServerError;
use crate::policy::limits::Held;

/// Registrations one memory may serve at once (a hybrid model's KV-cache groups; vLLM makes a
/// handful). Past it a registration of the same memory is refused.
pub const MAX_SHARERS: usize = 64;

/// Streams (or emulated lanes) a device engine's copies are spread over.
const DEVICE_LANES: usize = kvtiers::cuda::LANES;

/// The KV memory of one engine, mapped into the daemon.
#[derive(Debug)]
pub(crate) enum EngineMemory {
    /// A shared-memory file; `guard` (dropped before `map`, fields drop in order) turns a
    /// SIGBUS from a file the engine truncated into an error (`fault_guard`).
    Shm {
        guard: FaultGuard,
        map: MmapRaw,
        /// What the memory is, for errors ("KV memory (memfd)", ...).
        path: String,
    },
    /// A GPU's memory (CUDA IPC), or under fault injection a shared-memory region served as
    /// one ([`kvtiers::copy::fake::FakeDevice`], `[g1] emulate`): copied to and from by
    /// queued DMA.
    Device(Box<dyn CopyEngine>),
}

/// An engine's shared memory kept mapped, and guarded, under an emulated device.
struct Mapped {
    _guard: FaultGuard,
    _map: MmapRaw,
}

// SAFETY: the mapping and its guard are only kept alive here (dropped in order: guard first);
// the emulated device copies through raw pointers into them, as the daemon does.
unsafe impl Send for Mapped {}
// SAFETY: as above; nothing here is read or written through `&Mapped`.
unsafe impl Sync for Mapped {}

/// What makes two registrations' memory the same memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum MemoryIdentity {
    /// A file, by device and inode: every descriptor of it, however the engine opened it.
    File { dev: u64, ino: u64 },
    /// A CUDA allocation, by its IPC handle and device.
    Cuda { handle: Vec<u8>, device: u32 },
}

/// A registration's region, handed over (its descriptor redeemed) and not yet mapped.
#[derive(Debug)]
pub(crate) enum Region {
    File { file: File, identity: MemoryIdentity },
    Cuda { handle: Vec<u8>, device: u32, len: usize },
}

impl Region {
    /// Takes the region `req` names for owner `uid` (process `pid`, whose tickets it redeems),
    /// `size` bytes as the registration gives it: a descriptor must be open for writing and
    /// hold `size` bytes.
    pub(crate) fn take(
        req: &pb::RegisterRequest,
        size: u64,
        tickets: &Tickets,
        uid: u32,
        pid: Option<i32>,
    ) -> Result<Self, ServerError> {
        let region = req.region.as_ref().ok_or_else(|| ServerError::Invalid("region is missing".into()))?;
        #[allow(deprecated)]
        match &region.kind {
            Some(pb::memory_region::Kind::FdTicket(t)) => {
                let r = tickets.redeem(t, uid, pid)?;
                let what = "KV memory (descriptor)";
                if !r.writable {
                    return Err(ServerError::Attach(format!(
                        "the {what} is open read-only: loads write into it, pass it open for reading and writing"
                    )));
                }
                let meta = r.file.metadata().map_err(|e| ServerError::Attach(format!("{what}: {e}")))?;
                if meta.len() < size {
                    return Err(ServerError::Attach(format!(
                        "the {what} has {} bytes, the registration says {size}",
                        meta.len()
                    )));
                }
                Ok(Self::File { file: r.file, identity: MemoryIdentity::File { dev: meta.dev(), ino: meta.ino() } })
            }
            Some(pb::memory_region::Kind::CudaIpcHandle(handle)) => {
                let len = usize::try_from(size)
                    .map_err(|_| ServerError::Invalid("region size exceeds the address space".into()))?;
                Ok(Self::Cuda { handle: handle.clone(), device: region.cuda_device, len })
            }
            _ => Err(ServerError::Invalid("region has neither fd_ticket nor cuda_ipc_handle".into())),
        }
    }

    pub(crate) fn identity(&self) -> MemoryIdentity {
        match self {
            Self::File { identity, .. } => identity.clone(),
            Self::Cuda { handle, device, .. } => MemoryIdentity::Cuda { handle: handle.clone(), device: *device },
        }
    }

    /// Bytes from the region's start a registration needs of memory it shares: what it would
    /// map of a file (`map_bytes`), the whole of a GPU allocation (opened whole).
    pub(crate) fn needs(&self, map_bytes: u64) -> u64 {
        match self {
            Self::File { .. } => map_bytes,
            Self::Cuda { len, .. } => *len as u64,
        }
    }
}

/// One engine memory, held for every registration of it; see the module doc.
#[derive(Debug)]
pub(crate) struct SharedMemory {
    pub(crate) memory: EngineMemory,
    pub(crate) identity: MemoryIdentity,
    /// Bytes from the region's start that registrations' slots may use: the mapping's length
    /// (a file), the region's size (a GPU allocation).
    pub(crate) extent: u64,
    /// Registrations holding it (at most [`MAX_SHARERS`]).
    users: AtomicUsize,
    /// Counts it against its owner's `limits.max_engines_per_uid` and engine memory while any
    /// registration of it lives.
    _held: Held,
}

impl SharedMemory {
    /// Maps `region`'s first `map_bytes` (a file) or opens it (a GPU allocation), counted by
    /// `held`. With G1 faults (`inject_faults`), a device's copies go through them, and with
    /// `[g1] emulate` a file is served as an emulated GPU's memory.
    pub(crate) fn open(
        region: Region,
        map_bytes: u64,
        held: Held,
        g1: Option<&Arc<crate::faults::G1Faults>>,
        engine: u64,
    ) -> Result<Self, ServerError> {
        let emulate = g1.filter(|g1| g1.emulate.load(Ordering::Relaxed)).map(|g1| Arc::clone(&g1.device));
        let (memory, identity, extent) = match region {
            Region::File { file, identity } => {
                let what = "KV memory (descriptor)";
                let map_len = usize::try_from(map_bytes)
                    .map_err(|_| ServerError::Invalid("region size exceeds the address space".into()))?;
                let map = MmapOptions::new()
                    .len(map_len)
                    .map_raw(&file)
                    .map_err(|e| ServerError::Attach(format!("cannot map the {what}: {e}")))?;
                let guard = FaultGuard::watch(map.as_ptr() as usize, map.len()).map_err(ServerError::Attach)?;
                let memory = match emulate {
                    None => EngineMemory::Shm { guard, map, path: what.to_string() },
                    Some(faults) => {
                        let (base, len) = (map.as_mut_ptr(), map.len());
                        let keep = Box::new(Mapped { _guard: guard, _map: map });
                        // SAFETY: the mapping is valid for reads and writes while `keep`, which
                        // the device holds, lives.
                        let dev =
                            unsafe { kvtiers::copy::fake::FakeDevice::over(base, len, keep, DEVICE_LANES, faults) }
                                .map_err(|e| ServerError::Attach(e.to_string()))?;
                        tracing::warn!(engine, "engine memory served as an emulated GPU's (inject_faults [g1])");
                        EngineMemory::Device(Box::new(dev))
                    }
                };
                (memory, identity, map_bytes)
            }
            Region::Cuda { handle, device, len } => {
                let identity = MemoryIdentity::Cuda { handle: handle.clone(), device };
                let region = kvtiers::cuda::DeviceRegion::open_ipc(&handle, device, len)
                    .map_err(|e| ServerError::Attach(e.to_string()))?;
                tracing::info!(
                    device = region.cuda_device_ordinal(),
                    bytes = len,
                    "engine KV memory opened over CUDA IPC"
                );
                (EngineMemory::Device(Box::new(region)), identity, len as u64)
            }
        };
        // Under fault injection every device's copies can be made to fail.
        let memory = match (memory, g1) {
            (EngineMemory::Device(dev), Some(g1)) => {
                EngineMemory::Device(Box::new(kvtiers::copy::faults::FaultyCopies::new(dev, Arc::clone(&g1.copies))))
            }
            (m, _) => m,
        };
        Ok(Self { memory, identity, extent, users: AtomicUsize::new(1), _held: held })
    }

    /// Whether a registration of `identity` needing `needs` bytes may share it: the same
    /// memory, room for its slots, and a mapping that has not faulted (a file the engine
    /// truncated: its registrations fail until they register anew, mapping it afresh).
    pub(crate) fn fits(&self, identity: &MemoryIdentity, needs: u64) -> bool {
        let intact = match &self.memory {
            EngineMemory::Shm { guard, .. } => !guard.faulted(),
            EngineMemory::Device(_) => true,
        };
        self.identity == *identity && needs <= self.extent && intact
    }

    /// Bytes mapped into the daemon (none of a GPU's memory).
    pub(crate) fn mapped_bytes(&self) -> u64 {
        match &self.memory {
            EngineMemory::Shm { map, .. } => map.len() as u64,
            EngineMemory::Device(_) => 0,
        }
    }
}

/// One registration's hold on a [`SharedMemory`], counted in its users while it lives (the
/// last one's drop unmaps it).
#[derive(Debug)]
pub(crate) struct SharedUse(Arc<SharedMemory>);

impl SharedUse {
    /// The hold of the registration that opened `memory` (its first user).
    pub(crate) fn first(memory: SharedMemory) -> Self {
        Self(Arc::new(memory))
    }

    /// Another registration's hold; None when [`MAX_SHARERS`] hold it.
    pub(crate) fn another(&self) -> Option<Self> {
        let taken =
            self.0.users.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < MAX_SHARERS).then_some(n + 1));
        taken.is_ok().then(|| Self(Arc::clone(&self.0)))
    }
}

impl std::ops::Deref for SharedUse {
    type Target = SharedMemory;
    fn deref(&self) -> &SharedMemory {
        &self.0
    }
}

impl Drop for SharedUse {
    fn drop(&mut self) {
        self.0.users.fetch_sub(1, Ordering::AcqRel);
    }
}

// SAFETY: the mapping is shared memory accessed through raw pointers only (see `Engine`).
unsafe impl Send for SharedMemory {}
// SAFETY: as above.
unsafe impl Sync for SharedMemory {}
