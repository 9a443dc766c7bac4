//! KV memory an engine registers: a shared-memory file (a memfd, or a named file in
//! `/dev/shm`) that the daemon maps too, handed to it as a descriptor, and where each block slot
//! lies in it ([`SlotLayout`], the one definition the daemon checks against).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvproto::slots::SlotLayout;
use kvproto::{KvLayout, pb};

/// A shared-memory KV region with its slot layout. A named file is removed on drop.
#[derive(Debug)]
pub struct KvMemory {
    path: Option<PathBuf>,
    file: Arc<File>,
    map: memmap2::MmapMut,
    slots: SlotLayout,
}

/// An anonymous shared-memory file (memfd) of `size` bytes.
pub(crate) fn memfd(name: &str, size: u64) -> std::io::Result<File> {
    let name = std::ffi::CString::new(name).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: memfd_create with a NUL-terminated name; the descriptor is ours.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    file.set_len(size)?;
    Ok(file)
}

impl KvMemory {
    /// vLLM-style memory in a named file at `path`: one tensor `[num_blocks, segment]` per layer
    /// and K/V, laid out layer 0 K, layer 0 V, layer 1 K, ...
    pub fn create_layer_separate(path: impl AsRef<Path>, layout: &KvLayout, num_blocks: u32) -> std::io::Result<Self> {
        Self::create(path.as_ref(), SlotLayout::layer_separate(layout, num_blocks))
    }

    /// Fully contiguous blocks in a named file: block `b` is bytes `[b * block, (b + 1) * block)`.
    pub fn create_contiguous(path: impl AsRef<Path>, layout: &KvLayout, num_blocks: u32) -> std::io::Result<Self> {
        Self::create(path.as_ref(), SlotLayout::contiguous(layout, num_blocks))
    }

    /// For the layout's kind, in a named file.
    pub fn create_for(path: impl AsRef<Path>, layout: &KvLayout, num_blocks: u32) -> std::io::Result<Self> {
        Self::create(path.as_ref(), SlotLayout::for_layout(layout, num_blocks))
    }

    /// For the layout's kind, in an anonymous shared-memory file (memfd): nothing to clean up,
    /// nothing another process can open by name.
    pub fn anonymous(layout: &KvLayout, num_blocks: u32) -> std::io::Result<Self> {
        Self::anonymous_with(SlotLayout::for_layout(layout, num_blocks))
    }

    /// Any slot layout (e.g. the one an engine's KV tensors already have), in a memfd sized to
    /// hold every slot.
    pub fn anonymous_with(slots: SlotLayout) -> std::io::Result<Self> {
        let size = extent(&slots)?;
        Self::map(None, memfd("kvcached-kv", size)?, slots)
    }

    /// Memory the engine already has in `file` (a memfd or a shared-memory file it opened for
    /// reading and writing), laid out as `slots`.
    pub fn from_file(file: File, slots: SlotLayout) -> std::io::Result<Self> {
        Self::map(None, file, slots)
    }

    fn create(path: &Path, slots: SlotLayout) -> std::io::Result<Self> {
        let size = extent(&slots)?;
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).mode(0o600).open(path)?;
        file.set_len(size)?;
        Self::map(Some(path.to_path_buf()), file, slots)
    }

    fn map(path: Option<PathBuf>, file: File, slots: SlotLayout) -> std::io::Result<Self> {
        let size = extent(&slots)?;
        if file.metadata()?.len() < size {
            return Err(invalid_slots(&format!("the file is shorter than the {size} bytes its slots need")));
        }
        let len = usize::try_from(size).map_err(|_| invalid_slots("larger than the address space"))?;
        // SAFETY: the file is the engine's and sized; the daemon maps it too, which is the point.
        let map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(&file)? };
        Ok(Self { path, file: Arc::new(file), map, slots })
    }

    /// The named file, if the memory is one (an anonymous memfd has no path).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The descriptor handed to the daemon.
    pub fn file(&self) -> &Arc<File> {
        &self.file
    }

    pub fn num_blocks(&self) -> u32 {
        self.slots.num_blocks
    }

    /// Where the slots lie.
    pub fn slots(&self) -> &SlotLayout {
        &self.slots
    }

    /// The whole region.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The whole region, writable (the engine's own KV writes).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }

    /// Byte ranges of block `b`'s segments, in block byte order.
    pub fn block_ranges(&self, b: u32) -> Vec<std::ops::Range<usize>> {
        self.slots.ranges(b).map(|(start, n)| start..start + n).collect()
    }

    /// Block `b`'s bytes in block order (a copy; for tests and verification).
    pub fn read_block(&self, b: u32) -> Vec<u8> {
        self.block_ranges(b).into_iter().flat_map(|r| self.map[r].iter().copied()).collect()
    }

    /// Writes `data` (one block, in block order) into slot `b`.
    pub fn write_block(&mut self, b: u32, data: &[u8]) {
        let mut at = 0;
        for r in self.block_ranges(b) {
            let n = r.len().min(data.len() - at);
            self.map[r.start..r.start + n].copy_from_slice(&data[at..at + n]);
            at += n;
        }
    }

    /// The registration message fields describing this region (its ticket is filled in when the
    /// descriptor has been handed over).
    pub(crate) fn to_request(&self, engine_name: &str, ns: &kvproto::Namespace) -> pb::RegisterRequest {
        let kind = pb::memory_region::Kind::FdTicket(Vec::new());
        let region = pb::MemoryRegion { kind: Some(kind), size_bytes: self.map.len() as u64, cuda_device: 0 };
        register_request(engine_name, ns, region, &self.slots)
    }
}

fn invalid_slots(why: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("KV memory: {why}"))
}

fn extent(slots: &SlotLayout) -> std::io::Result<u64> {
    slots.extent().ok_or_else(|| invalid_slots("a region of 0 slots, or larger than 2^64 bytes"))
}

/// A registration of `region` laid out as `slots`.
fn register_request(
    engine_name: &str,
    ns: &kvproto::Namespace,
    region: pb::MemoryRegion,
    slots: &SlotLayout,
) -> pb::RegisterRequest {
    pb::RegisterRequest {
        engine_name: engine_name.to_string(),
        namespace: Some(pb::NamespaceSpec::from(ns)),
        region: Some(region),
        segments: slots.segments.iter().map(|s| pb::Segment { offset: s.offset, block_stride: s.stride }).collect(),
        segment_bytes: slots.segment_bytes,
        num_blocks: slots.num_blocks,
        worker_address: String::new(),
        role: String::new(),
        token_area: None,
    }
}

/// KV memory in the engine's GPU memory, shared with the daemon through a CUDA IPC handle
/// (`cuIpcGetMemHandle` of the allocation holding the KV tensors; offsets are from its base).
/// The daemon copies between it and G2 with DMA; it needs a CUDA driver and device on the node
/// and answers "no CUDA device" otherwise.
#[derive(Debug, Clone)]
pub struct GpuKvMemory {
    handle: Vec<u8>,
    device: u32,
    size: u64,
    slots: SlotLayout,
}

impl GpuKvMemory {
    /// vLLM-style tensors laid out back to back in one allocation: `[num_blocks, segment]` per
    /// layer and K/V, layer 0 K, layer 0 V, layer 1 K, ...
    pub fn layer_separate(handle: [u8; 64], device: u32, layout: &KvLayout, num_blocks: u32) -> Self {
        let slots = SlotLayout::layer_separate(layout, num_blocks);
        let size = slots.extent().unwrap_or(0);
        Self::with_slots(handle, device, size, slots)
    }

    /// Any slot layout; `size` is the allocation's length.
    pub fn with_slots(handle: [u8; 64], device: u32, size: u64, slots: SlotLayout) -> Self {
        Self { handle: handle.to_vec(), device, size, slots }
    }

    pub(crate) fn to_request(&self, engine_name: &str, ns: &kvproto::Namespace) -> pb::RegisterRequest {
        let kind = pb::memory_region::Kind::CudaIpcHandle(self.handle.clone());
        let region = pb::MemoryRegion { kind: Some(kind), size_bytes: self.size, cuda_device: self.device };
        register_request(engine_name, ns, region, &self.slots)
    }
}

impl Drop for KvMemory {
    fn drop(&mut self) {
        if let Some(p) = &self.path {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Deterministic synthetic KV bytes for block `index` of a prompt (examples, tests, benches):
/// any process can regenerate and verify them.
pub fn synthetic_block(seed: u64, index: u32, len: usize) -> Vec<u8> {
    let mut x = seed ^ (u64::from(index) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}
