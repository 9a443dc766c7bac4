//! The io_uring engine: each I/O thread owns one ring and keeps up to `depth` ops of a batch in
//! flight, submitting the next op as each completes.

use std::io;
use std::os::fd::RawFd;

use io_uring::{IoUring, opcode, types};

use super::op::{IoEngine, IoKind, IoOp, IoProgress};
use super::psync::finish_short;

/// One io_uring instance.
pub struct UringEngine {
    ring: IoUring,
    depth: usize,
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
        Ok(Self { ring: IoUring::new(depth)?, depth: depth as usize })
    }

    /// Queues op `index`; false when the submission queue has no room.
    fn push(&mut self, fd: RawFd, op: &IoOp, index: usize) -> io::Result<bool> {
        let len = u32::try_from(op.len).map_err(|_| io::Error::other("G3 op over 4 GiB"))?;
        let sqe = match op.kind {
            IoKind::Read => opcode::Read::new(types::Fd(fd), op.addr as *mut u8, len).offset(op.offset).build(),
            IoKind::Write => opcode::Write::new(types::Fd(fd), op.addr as *const u8, len).offset(op.offset).build(),
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
