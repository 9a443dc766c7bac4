//! One I/O operation, the engines that execute batches of them, and the progress they report:
//! what the G3 I/O threads ([`super::io`]) run and the pread/pwrite ([`super::psync`]) and
//! io_uring ([`super::uring`]) engines implement.
//!
//! An op names memory by address so a batch can cross threads; that is why running one is
//! `unsafe` ([`IoEngine::run`]'s contract).

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    Read,
    Write,
}

/// One aligned transfer between memory at `addr` and the file at `offset`.
#[derive(Debug, Clone, Copy)]
pub struct IoOp {
    pub kind: IoKind,
    pub offset: u64,
    /// Memory address (a raw pointer as an integer so ops can cross threads).
    pub addr: usize,
    pub len: usize,
}

/// Told about a batch while it runs, so that the submitter can overlap its own work (checksums)
/// with the I/O.
pub trait IoProgress {
    /// The batch's first ops are in flight (the pread/pwrite engine: it is about to run them).
    /// Called at most once, before any `completed`; for reads run on an I/O thread, as the first
    /// completion arrives. An engine that fails before starting reports nothing.
    fn started(&mut self);
    /// Op `index` of the batch finished: all its bytes moved (`ok`), or it failed or could not
    /// be queued. An op never reported did not complete either.
    fn completed(&mut self, index: usize, ok: bool);
}

/// Progress nobody listens to.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProgress;

impl IoProgress for NoProgress {
    fn started(&mut self) {}
    fn completed(&mut self, _index: usize, _ok: bool) {}
}

/// Memory an engine may register with the kernel once (io_uring fixed buffers: G2's pool),
/// so that transfers into or out of it skip pinning its pages on every op. Pinning shared
/// pages took ~200 us of a 2 MiB G3 read into G2 and a fifth of the write-through thread's CPU
/// (docs/benchmarks.md). Kept alive, with what owns the mapping, while any engine holds it.
pub struct FixedMemory {
    base: usize,
    len: usize,
    /// The ring that registered the memory (the pages are pinned once, there); engines share
    /// its registration. Declared before `_owner`: dropped while the mapping still exists.
    source: std::sync::OnceLock<FixedSource>,
    /// What keeps the mapping alive (the G2 tier) while a ring has it registered.
    _owner: Arc<dyn std::any::Any + Send + Sync>,
    ops: AtomicU64,
}

/// The ring holding a [`FixedMemory`]'s registration, by descriptor, and the ring itself.
struct FixedSource {
    fd: RawFd,
    _ring: Box<dyn std::any::Any + Send + Sync>,
}

impl std::fmt::Debug for FixedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FixedMemory").field("len", &self.len).finish()
    }
}

impl FixedMemory {
    /// The kernel takes one registered buffer of at most 1 GiB: the memory is registered as
    /// consecutive pieces of this size.
    pub const PIECE: usize = 1 << 30;

    /// `len` bytes at `base`, mapped for as long as `owner` lives.
    ///
    /// # Safety
    /// `base..base + len` is one mapping, readable and writable, that stays mapped (the same
    /// pages: never remapped, truncated or hole-punched) while `owner` is alive.
    pub unsafe fn new(base: *const u8, len: usize, owner: Arc<dyn std::any::Any + Send + Sync>) -> Self {
        Self { base: base as usize, len, source: std::sync::OnceLock::new(), _owner: owner, ops: AtomicU64::new(0) }
    }

    /// Records the ring (descriptor `fd`) that registered the memory; false if one already did.
    pub(crate) fn set_source(&self, fd: RawFd, ring: Box<dyn std::any::Any + Send + Sync>) -> bool {
        self.source.set(FixedSource { fd, _ring: ring }).is_ok()
    }

    /// The descriptor of the ring that registered the memory, once one has.
    pub fn source_fd(&self) -> Option<RawFd> {
        self.source.get().map(|s| s.fd)
    }

    /// Bytes of memory.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The pieces to register, in order (piece `i` is fixed buffer `i`).
    pub fn pieces(&self) -> Vec<(usize, usize)> {
        (0..self.len.div_ceil(Self::PIECE))
            .map(|i| (self.base + i * Self::PIECE, Self::PIECE.min(self.len - i * Self::PIECE)))
            .collect()
    }

    /// The fixed buffer holding `addr..addr + len` whole, if one does.
    pub fn index_of(&self, addr: usize, len: usize) -> Option<u16> {
        let off = addr.checked_sub(self.base)?;
        let end = off.checked_add(len)?;
        if end > self.len || len == 0 {
            return None;
        }
        let i = off / Self::PIECE;
        (end <= (i + 1) * Self::PIECE).then(|| u16::try_from(i).ok()).flatten()
    }

    /// Counts an op that went through a fixed buffer.
    pub fn used(&self) {
        self.ops.fetch_add(1, Ordering::Relaxed);
    }

    /// Ops that went through a fixed buffer so far.
    pub fn ops(&self) -> u64 {
        self.ops.load(Ordering::Relaxed)
    }
}

/// Executes batches of I/O on one file descriptor.
pub trait IoEngine: Send + std::fmt::Debug {
    /// Short name for logs and metrics (`io_uring`, `psync`).
    fn name(&self) -> &'static str;
    /// Offers `memory` for registration with the kernel: ops inside it may then go through it
    /// without pinning pages per op. Called before each batch with the current offer; an engine
    /// that cannot (or whose registration failed) ignores it, and ops still work as before.
    fn use_fixed(&mut self, _memory: &Arc<FixedMemory>) {}
    /// Runs every op to completion, reporting each to `progress`; the first failure is
    /// returned. When it returns, no op is in flight any more.
    ///
    /// # Safety
    /// For every op, `addr..addr + len` is memory the caller owns for the whole call: writable
    /// for a read (the kernel writes it, possibly by DMA), readable for a write, aligned as the
    /// file's O_DIRECT needs, and not accessed by anything else until the call returns.
    unsafe fn run(&mut self, fd: RawFd, ops: &[IoOp], progress: &mut dyn IoProgress) -> io::Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory(base: usize, len: usize) -> FixedMemory {
        // SAFETY: never registered: only its arithmetic is used.
        unsafe { FixedMemory::new(base as *const u8, len, Arc::new(())) }
    }

    #[test]
    fn pieces_cover_the_memory_in_registrable_sizes() {
        let p = FixedMemory::PIECE;
        let base = 1 << 40;
        assert_eq!(memory(base, 4096).pieces(), vec![(base, 4096)]);
        assert_eq!(memory(base, p).pieces(), vec![(base, p)]);
        assert_eq!(memory(base, 2 * p + 8192).pieces(), vec![(base, p), (base + p, p), (base + 2 * p, 8192)]);
        assert!(memory(base, 0).pieces().is_empty());
    }

    #[test]
    fn an_op_is_fixed_only_inside_one_piece() {
        let p = FixedMemory::PIECE;
        let base = 1 << 40;
        let m = memory(base, 2 * p + 8192);
        assert_eq!(m.index_of(base, 4096), Some(0));
        assert_eq!(m.index_of(base + p - 4096, 4096), Some(0), "ends exactly at the piece's end");
        assert_eq!(m.index_of(base + p - 4096, 8192), None, "crosses into the next piece");
        assert_eq!(m.index_of(base + p, 4096), Some(1));
        assert_eq!(m.index_of(base + 2 * p, 8192), Some(2), "the short last piece, whole");
        assert_eq!(m.index_of(base + 2 * p, 8193), None, "past the memory's end");
        assert_eq!(m.index_of(base - 4096, 4096), None, "before the memory");
        assert_eq!(m.index_of(base, 0), None);
        assert_eq!(m.index_of(usize::MAX - 10, 4096), None, "an end that overflows");
    }
}
