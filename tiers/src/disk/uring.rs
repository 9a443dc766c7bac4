//! The io_uring engine: each I/O thread owns one ring and keeps up to `depth` ops of a batch in
//! flight, submitting the next op as each completes.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use io_uring::{IoUring, opcode, types};

use super::op::{FixedMemory, IoEngine, IoKind, IoOp, IoProgress};
use super::psync::finish_short;

/// One io_uring instance.
pub struct UringEngine {
    ring: IoUring,
    depth: usize,
    /// Memory registered with this ring as fixed buffers. Declared after `ring`, so that the
    /// ring (and its registration) is gone before this lets go of the memory.
    fixed: Option<Arc<FixedMemory>>,
    /// The memory whose registration failed (by address): not tried again.
    refused: usize,
}

/// Set once a ring could not share the registration, so that the reason is logged once.
static CLONE_REFUSAL_LOGGED: AtomicBool = AtomicBool::new(false);

/// Registers `memory` with a ring of its own, pinning its pages once, and records that ring
/// in it as the source the engines' rings share.
pub fn register_source(memory: &FixedMemory) -> io::Result<()> {
    let ring = IoUring::new(1)?;
    let iov: Vec<libc::iovec> =
        memory.pieces().into_iter().map(|(base, len)| libc::iovec { iov_base: base as *mut _, iov_len: len }).collect();
    // SAFETY: `FixedMemory::new`'s contract keeps the pieces mapped while the memory is alive,
    // and the memory owns this ring (dropped before the mapping's owner).
    unsafe { ring.submitter().register_buffers(&iov)? };
    // Every engine's ring shares the registration rather than pinning the pages again: try
    // that once here, so that memory no ring can share is never published as registered.
    let probe = IoUring::new(1)?;
    probe.submitter().register_buffers_clone(ring.as_raw_fd())?;
    drop(probe);
    let fd = ring.as_raw_fd();
    if !memory.set_source(fd, Box::new(ring)) {
        return Err(io::Error::other("the memory was registered by another ring already"));
    }
    Ok(())
}

impl std::fmt::Debug for UringEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringEngine").field("depth", &self.depth).finish()
    }
}

impl UringEngine {
    /// A ring of `depth` entries; fails where the kernel forbids io_uring.
    pub fn new(depth: u32) -> io::Result<Self> {
        let depth = depth.clamp(1, 4096);
        Ok(Self { ring: IoUring::new(depth)?, depth: depth as usize, fixed: None, refused: 0 })
    }

    /// Queues op `index`; false when the submission queue has no room.
    fn push(&mut self, fd: RawFd, op: &IoOp, index: usize) -> io::Result<bool> {
        let len = u32::try_from(op.len).map_err(|_| io::Error::other("G3 op over 4 GiB"))?;
        let fixed = self.fixed.as_ref().and_then(|m| m.index_of(op.addr, op.len).map(|i| (m, i)));
        let sqe = match (op.kind, fixed) {
            (IoKind::Read, None) => opcode::Read::new(types::Fd(fd), op.addr as *mut u8, len).offset(op.offset).build(),
            (IoKind::Write, None) => {
                opcode::Write::new(types::Fd(fd), op.addr as *const u8, len).offset(op.offset).build()
            }
            (IoKind::Read, Some((m, i))) => {
                m.used();
                opcode::ReadFixed::new(types::Fd(fd), op.addr as *mut u8, len, i).offset(op.offset).build()
            }
            (IoKind::Write, Some((m, i))) => {
                m.used();
                opcode::WriteFixed::new(types::Fd(fd), op.addr as *const u8, len, i).offset(op.offset).build()
            }
        }
        .user_data(index as u64);
        // SAFETY: the buffer stays valid until its completion is reaped in `run`, which does not
        // return while any op is in flight (the caller blocks on the batch).
        Ok(unsafe { self.ring.submission().push(&sqe).is_ok() })
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn use_fixed(&mut self, memory: &Arc<FixedMemory>) {
        let at = Arc::as_ptr(memory) as usize;
        if self.fixed.as_ref().is_some_and(|m| Arc::ptr_eq(m, memory)) || self.refused == at {
            return;
        }
        let Some(src) = memory.source_fd() else { return };
        if let Some(old) = self.fixed.take() {
            let _ = self.ring.submitter().unregister_buffers();
            drop(old);
        }
        // Shares the source ring's registration: no page is pinned again, and the kernel keeps
        // one table of them however many rings use it.
        match self.ring.submitter().register_buffers_clone(src) {
            Ok(()) => self.fixed = Some(Arc::clone(memory)),
            Err(e) => {
                self.refused = at;
                if !CLONE_REFUSAL_LOGGED.swap(true, Ordering::Relaxed) {
                    tracing::info!(
                        "a G3 I/O ring pins G2's pages per op: sharing the registered pool failed ({e}; Linux 6.12 or later shares it)"
                    );
                }
            }
        }
    }

    unsafe fn run(&mut self, fd: RawFd, ops: &[IoOp], progress: &mut dyn IoProgress) -> io::Result<()> {
        let mut first_err: Option<io::Error> = None;
        let (mut next, mut in_flight, mut started) = (0usize, 0usize, false);
        // Ops that could not be queued at all (over 4 GiB): reported failed once started.
        let mut unqueued = Vec::new();
        let mut failed_enters = 0u32;
        while next < ops.len() || in_flight > 0 {
            // A failed op fails only itself: the rest of the batch keeps going.
            while next < ops.len() && in_flight < self.depth {
                match self.push(fd, &ops[next], next) {
                    Ok(true) => in_flight += 1,
                    Ok(false) => break,
                    Err(e) => {
                        unqueued.push(next);
                        first_err.get_or_insert(e);
                    }
                }
                next += 1;
            }
            if !started {
                // Submit without waiting, so that the caller can work while the first ops run.
                match self.ring.submit() {
                    Ok(_) => {}
                    Err(e) if is_retry(&e) => {
                        std::thread::yield_now();
                        continue;
                    }
                    Err(e) if in_flight == 0 => {
                        first_err.get_or_insert(e);
                        break;
                    }
                    // Queued ops stay queued: the wait below submits them again.
                    Err(_) => {}
                }
                started = true;
                progress.started();
                for &i in &unqueued {
                    progress.completed(i, false);
                }
                unqueued.clear();
            }
            for i in unqueued.drain(..) {
                progress.completed(i, false);
            }
            if in_flight == 0 {
                continue;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => failed_enters = 0,
                Err(e) if is_retry(&e) => std::thread::yield_now(),
                Err(e) => {
                    // Ops are in flight with the caller's buffers: never return before they
                    // complete. A ring that keeps failing here is broken beyond recovery.
                    failed_enters += 1;
                    if failed_enters.is_power_of_two() {
                        tracing::error!(
                            "io_uring wait failed {failed_enters} times with {in_flight} G3 ops in flight: {e}; retrying"
                        );
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            let done: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
            for (idx, res) in done {
                in_flight -= 1;
                let idx = idx as usize;
                let op = &ops[idx];
                let r = if res < 0 {
                    Err(io::Error::from_raw_os_error(-res))
                } else if (res as usize) < op.len {
                    // SAFETY: the caller of `run` vouches for the op's memory.
                    unsafe { finish_short(fd, op, res as usize) }
                } else {
                    Ok(())
                };
                progress.completed(idx, r.is_ok());
                if let Err(e) = r {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

fn is_retry(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY))
}
