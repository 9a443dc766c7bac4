//! KV memory an engine registers: a shared-memory file the daemon maps too, and where each
//! block's segments sit in it.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use kvproto::{KvLayout, LayoutKind, pb};
use memmap2::MmapMut;

/// A shared-memory KV region with its segment layout. The file is removed on drop.
#[derive(Debug)]
pub struct KvMemory {
    path: PathBuf,
    map: MmapMut,
    segments: Vec<(u64, u64)>,
    segment_bytes: u64,
    num_blocks: u32,
}

impl KvMemory {
    /// vLLM-style memory: one tensor `[num_blocks, segment]` per layer and K/V, laid out
    /// layer 0 K, layer 0 V, layer 1 K, ...
    pub fn create_layer_separate(path: impl AsRef<Path>, layout: &KvLayout, num_blocks: u32) -> std::io::Result<Self> {
        let seg = layout.segment_bytes();
        let tensors = u64::from(layout.num_layers) * 2;
        let segments = (0..tensors).map(|t| (t * u64::from(num_blocks) * seg, seg)).collect();
        Self::create(path.as_ref(), segments, seg, num_blocks, tensors * u64::from(num_blocks) * seg)
    }

    /// Fully contiguous blocks: block `b` is bytes `[b * block, (b + 1) * block)`.
    pub fn create_contiguous(path: impl AsRef<Path>, layout: &KvLayout, num_blocks: u32) -> std::io::Result<Self> {
        let block = layout.block_bytes();
        Self::create(path.as_ref(), vec![(0, block)], block, num_blocks, block * u64::from(num_blocks))
    }

    /// For the layout's kind.
    pub fn create_for(path: impl AsRef<Path>, layout: &KvLayout, num_blocks: u32) -> std::io::Result<Self> {
        match layout.kind {
            LayoutKind::LayerSeparate => Self::create_layer_separate(path, layout, num_blocks),
            LayoutKind::Contiguous => Self::create_contiguous(path, layout, num_blocks),
        }
    }

    fn create(
        path: &Path,
        segments: Vec<(u64, u64)>,
        segment_bytes: u64,
        num_blocks: u32,
        size: u64,
    ) -> std::io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).mode(0o660).open(path)?;
        file.set_len(size)?;
        // SAFETY: the file is ours and sized; the daemon maps it too, which is the point.
        let map = unsafe { MmapMut::map_mut(&file)? };
        Ok(Self { path: path.to_path_buf(), map, segments, segment_bytes, num_blocks })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
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
        self.segments
            .iter()
            .map(|&(off, stride)| {
                let start = (off + u64::from(b) * stride) as usize;
                start..start + self.segment_bytes as usize
            })
            .collect()
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

    /// The registration message fields describing this region.
    pub(crate) fn to_request(&self, engine_name: &str, ns: &kvproto::Namespace) -> pb::RegisterRequest {
        let kind = pb::memory_region::Kind::ShmPath(self.path.to_string_lossy().into_owned());
        let region = pb::MemoryRegion { kind: Some(kind), size_bytes: self.map.len() as u64, cuda_device: 0 };
        register_request(engine_name, ns, region, &self.segments, self.segment_bytes, self.num_blocks)
    }
}

/// A registration of `region` laid out in `segments` (offset of block 0, stride) per segment.
fn register_request(
    engine_name: &str,
    ns: &kvproto::Namespace,
    region: pb::MemoryRegion,
    segments: &[(u64, u64)],
    segment_bytes: u64,
    num_blocks: u32,
) -> pb::RegisterRequest {
    pb::RegisterRequest {
        engine_name: engine_name.to_string(),
        namespace: Some(pb::NamespaceSpec::from(ns)),
        region: Some(region),
        segments: segments.iter().map(|&(offset, block_stride)| pb::Segment { offset, block_stride }).collect(),
        segment_bytes,
        num_blocks,
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
    segments: Vec<(u64, u64)>,
    segment_bytes: u64,
    num_blocks: u32,
}

impl GpuKvMemory {
    /// vLLM-style tensors laid out back to back in one allocation: `[num_blocks, segment]` per
    /// layer and K/V, layer 0 K, layer 0 V, layer 1 K, ...
    pub fn layer_separate(handle: [u8; 64], device: u32, layout: &KvLayout, num_blocks: u32) -> Self {
        let seg = layout.segment_bytes();
        let tensors = u64::from(layout.num_layers) * 2;
        let segments = (0..tensors).map(|t| (t * u64::from(num_blocks) * seg, seg)).collect();
        Self::with_segments(handle, device, tensors * u64::from(num_blocks) * seg, segments, seg, num_blocks)
    }

    /// Any layout: per segment of a block (in block byte order), the offset of block 0's
    /// segment and the stride between blocks; `size` is the allocation's length.
    pub fn with_segments(
        handle: [u8; 64],
        device: u32,
        size: u64,
        segments: Vec<(u64, u64)>,
        segment_bytes: u64,
        num_blocks: u32,
    ) -> Self {
        Self { handle: handle.to_vec(), device, size, segments, segment_bytes, num_blocks }
    }

    pub(crate) fn to_request(&self, engine_name: &str, ns: &kvproto::Namespace) -> pb::RegisterRequest {
        let kind = pb::memory_region::Kind::CudaIpcHandle(self.handle.clone());
        let region = pb::MemoryRegion { kind: Some(kind), size_bytes: self.size, cuda_device: self.device };
        register_request(engine_name, ns, region, &self.segments, self.segment_bytes, self.num_blocks)
    }
}

impl Drop for KvMemory {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
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
