//! The io_uring engine: each I/O thread owns one ring and submits a whole batch at once.

use std::io;
use std::os::fd::RawFd;

use io_uring::{IoUring, opcode, types};

use super::io::{IoEngine, IoKind, IoOp, finish_short};

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
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn run(&mut self, fd: RawFd, ops: &[IoOp]) -> io::Result<()> {
        let mut first_err: Option<io::Error> = None;
        for chunk in ops.chunks(self.depth) {
            for (i, op) in chunk.iter().enumerate() {
                let len = u32::try_from(op.len).map_err(|_| io::Error::other("G3 op over 4 GiB"))?;
                let sqe = match op.kind {
                    IoKind::Read => opcode::Read::new(types::Fd(fd), op.addr as *mut u8, len).offset(op.offset).build(),
                    IoKind::Write => {
                        opcode::Write::new(types::Fd(fd), op.addr as *const u8, len).offset(op.offset).build()
                    }
                }
                .user_data(i as u64);
                // SAFETY: the buffer stays valid until its completion is reaped below (the
                // caller blocks on this batch).
                unsafe {
                    self.ring
                        .submission()
                        .push(&sqe)
                        .map_err(|_| io::Error::other("io_uring submission queue full"))?;
                }
            }
            let mut left = chunk.len();
            while left > 0 {
                match self.ring.submit_and_wait(left) {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
                let done: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
                for (idx, res) in done {
                    left -= 1;
                    let op = &chunk[idx as usize];
                    let r = if res < 0 {
                        Err(io::Error::from_raw_os_error(-res))
                    } else if (res as usize) < op.len {
                        finish_short(fd, op, res as usize)
                    } else {
                        Ok(())
                    };
                    if let Err(e) = r {
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}
