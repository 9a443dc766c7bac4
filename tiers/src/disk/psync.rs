//! The pread/pwrite engine: used where io_uring is unavailable.

use std::io;
use std::os::fd::RawFd;

use super::op::{IoEngine, IoKind, IoOp, IoProgress};

/// Synchronous positional I/O, one op at a time.
#[derive(Debug, Default)]
pub struct PsyncEngine;

/// Runs one op to completion (handles EINTR and short transfers).
///
/// # Safety
/// `op`'s memory is valid for the transfer, as [`IoEngine::run`] requires.
pub(super) unsafe fn run_one(fd: RawFd, op: &IoOp) -> io::Result<()> {
    let mut done = 0usize;
    while done < op.len {
        let p = (op.addr + done) as *mut libc::c_void;
        let off = (op.offset + done as u64) as libc::off_t;
        let n = op.len - done;
        // SAFETY: the caller guarantees [addr, addr+len) is valid (and writable for reads) until
        // the batch completes.
        let r = unsafe {
            match op.kind {
                IoKind::Read => libc::pread(fd, p, n, off),
                IoKind::Write => libc::pwrite(fd, p, n, off),
            }
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "G3 file ended before the block"));
        }
        done += r as usize;
    }
    Ok(())
}

impl IoEngine for PsyncEngine {
    fn name(&self) -> &'static str {
        "psync"
    }
    /// One op after the other; a failed op does not stop the others (they may be other
    /// blocks, still servable).
    unsafe fn run(&mut self, fd: RawFd, ops: &[IoOp], progress: &mut dyn IoProgress) -> io::Result<()> {
        progress.started();
        let mut first_err = None;
        for (i, op) in ops.iter().enumerate() {
            // SAFETY: the caller of `run` vouches for every op's memory.
            let r = unsafe { run_one(fd, op) };
            progress.completed(i, r.is_ok());
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

/// Finishes a transfer that completed short, with plain pread/pwrite.
///
/// # Safety
/// As [`run_one`] for `op`.
pub(super) unsafe fn finish_short(fd: RawFd, op: &IoOp, done: usize) -> io::Result<()> {
    let rest = IoOp { kind: op.kind, offset: op.offset + done as u64, addr: op.addr + done, len: op.len - done };
    // SAFETY: `rest` lies inside `op`, which the caller vouches for.
    unsafe { run_one(fd, &rest) }
}
