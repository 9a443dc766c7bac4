//! Copies between an engine's device memory (G1) and host memory (G2's pages), queued on the
//! device's streams and waited for by fence, so that many blocks are in flight at once and the
//! daemon does the next block's bookkeeping while the DMA engines move the last one.
//!
//! # Layout
//! - [`CopyEngine`]: the one small trait a device implements: queue a block's copies on a lane
//!   (a CUDA stream), get a [`Fence`] that completes after them, wait for it. The CUDA
//!   implementation is [`crate::cuda::DeviceRegion`]; [`fake::FakeDevice`] runs the same
//!   contract on worker threads over host memory, with delays, for the tests of everything
//!   above it.
//! - [`CopyQueue`] (`queue.rs`): the scheduling: blocks spread over the lanes, at most `depth`
//!   in flight, each one's memory (a G2 reservation, a held G2 block) kept alive until its
//!   fence completes and then handed back with the outcome, in the order the blocks went in.
//! - [`fake`]: the fake device.
//! - [`faults`]: a decorator failing any device's copies on demand (torn half way), for the
//!   fault suites and the GPU checks.

pub mod fake;
pub mod faults;
mod queue;

pub use queue::CopyQueue;

use crate::error::{Result, TierError};

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Device memory to host memory (a save: G1 -> G2).
    ToHost,
    /// Host memory to device memory (a load: G2 -> G1).
    ToDevice,
}

/// One copy of `len` bytes between offset `device` of the device memory and host address
/// `host`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    pub dir: Direction,
    pub device: usize,
    pub host: usize,
    pub len: usize,
}

impl Copy {
    /// The copies that move a block between device segments and host pieces, both in block
    /// byte order (they need not split at the same places); fails if their lengths differ.
    pub fn zip(dir: Direction, device: &[(usize, usize)], host: &[(usize, usize)]) -> Result<Vec<Copy>> {
        let (d, h): (usize, usize) = (device.iter().map(|p| p.1).sum(), host.iter().map(|p| p.1).sum());
        if d != h {
            return Err(TierError::Device(format!(
                "a block's device segments ({d} bytes) and host pieces ({h} bytes) differ in length"
            )));
        }
        let mut out = Vec::with_capacity(device.len().max(host.len()));
        crate::pieces::zip_pieces(device.iter().copied(), host.iter().copied(), |d, h, n| {
            out.push(Copy { dir, device: d, host: h, len: n });
            Ok::<(), TierError>(())
        })?;
        Ok(out)
    }
}

/// A point on a lane after some copies: complete once they are. Made by
/// [`CopyEngine::submit`] and consumed by [`CopyEngine::wait`] (a CUDA event, returned to
/// its pool there).
#[derive(Debug, PartialEq, Eq)]
pub struct Fence(pub(crate) u64);

/// A device whose memory the daemon copies to and from asynchronously.
pub trait CopyEngine: Send + Sync + std::fmt::Debug {
    /// Lanes (streams) copies may be spread over; at least 1. Copies on one lane run in the
    /// order they were queued; lanes run independently.
    fn lanes(&self) -> usize;

    /// Bytes of device memory; every copy must lie inside it.
    fn len(&self) -> usize;

    /// Whether the device memory is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues `copies` on `lane`, in order, and returns a fence that completes after them. A
    /// copy outside the device memory fails here, before anything of it is queued.
    ///
    /// # Safety
    /// Each copy's host range must stay valid (for writes going [`Direction::ToHost`], for
    /// reads going [`Direction::ToDevice`]) and untouched by anyone else until the fence was
    /// waited for ([`CopyEngine::wait`] returned): the device writes or reads it meanwhile.
    unsafe fn submit(&self, lane: usize, copies: &[Copy]) -> Result<Fence>;

    /// Blocks until `fence` is complete. An error means a copy before it failed: the bytes it
    /// was to move are not to be trusted (for a save, the block must not become visible).
    fn wait(&self, fence: Fence) -> Result<()>;

    /// Whether `fence` is complete, without blocking (an error is reported by `wait`).
    fn is_done(&self, fence: &Fence) -> bool;

    /// What the memory is, for errors ("CUDA device 0", ...).
    fn describe(&self) -> String;

    /// Queues `copies` and waits for them: one block, synchronously (a copy back for
    /// promotion, a fallback).
    ///
    /// # Safety
    /// As [`CopyEngine::submit`], for the length of this call.
    unsafe fn copy_now(&self, copies: &[Copy]) -> Result<()> {
        // SAFETY: the caller keeps the host ranges valid for this call, which waits for them.
        let fence = unsafe { self.submit(0, copies)? };
        self.wait(fence)
    }
}

/// Checks that `copies` lie inside `len` bytes of device memory.
pub(crate) fn check_ranges(copies: &[Copy], len: usize) -> Result<()> {
    for c in copies {
        match c.device.checked_add(c.len) {
            Some(end) if end <= len => {}
            _ => {
                return Err(TierError::Device(format!(
                    "device range {}+{} outside the {len}-byte region",
                    c.device, c.len
                )));
            }
        }
    }
    Ok(())
}
