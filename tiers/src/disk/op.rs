//! One I/O operation, the engines that execute batches of them, and the progress they report:
//! what the G3 I/O threads ([`super::io`]) run and the pread/pwrite ([`super::psync`]) and
//! io_uring ([`super::uring`]) engines implement.
//!
//! An op names memory by address so a batch can cross threads; that is why running one is
//! `unsafe` ([`IoEngine::run`]'s contract).

use std::io;
use std::os::fd::RawFd;

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

/// Executes batches of I/O on one file descriptor.
pub trait IoEngine: Send + std::fmt::Debug {
    /// Short name for logs and metrics (`io_uring`, `psync`).
    fn name(&self) -> &'static str;
    /// Runs every op to completion, reporting each to `progress`; the first failure is
    /// returned. When it returns, no op is in flight any more.
    ///
    /// # Safety
    /// For every op, `addr..addr + len` is memory the caller owns for the whole call: writable
    /// for a read (the kernel writes it, possibly by DMA), readable for a write, aligned as the
    /// file's O_DIRECT needs, and not accessed by anything else until the call returns.
    unsafe fn run(&mut self, fd: RawFd, ops: &[IoOp], progress: &mut dyn IoProgress) -> io::Result<()>;
}
