//! A decorator that fails a device's copies on demand, for the fault suites and the GPU checks
//! (the daemon wraps its engines' devices in it only under `inject_faults`): every n-th
//! submission is torn (only the first half of its first copy is queued, as a DMA that died
//! part way) and its fence reports the failure, so what lies above must drop the block or fail
//! the load, never use the torn bytes.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::{Copy, CopyEngine, Fence};
use crate::error::{Result, TierError};

/// The switches, shared by every device wrapped with them, changeable while they run.
#[derive(Debug, Default)]
pub struct CopyFaults {
    fail_every: AtomicU64,
    submits: AtomicU64,
    failed: AtomicU64,
}

impl CopyFaults {
    /// Every `n`-th submission (counted over every device sharing these switches) fails; 0:
    /// none.
    pub fn fail_every(&self, n: u64) {
        self.fail_every.store(n, Ordering::Relaxed);
    }

    /// Submissions failed so far.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }

    fn next_fails(&self) -> bool {
        let n = self.submits.fetch_add(1, Ordering::Relaxed) + 1;
        let every = self.fail_every.load(Ordering::Relaxed);
        every > 0 && n.is_multiple_of(every)
    }
}

/// `inner` with its copies failed as [`CopyFaults`] say.
#[derive(Debug)]
pub struct FaultyCopies {
    inner: Box<dyn CopyEngine>,
    faults: Arc<CopyFaults>,
    /// Fences of torn submissions, until waited for.
    torn: Mutex<HashSet<u64>>,
}

impl FaultyCopies {
    pub fn new(inner: Box<dyn CopyEngine>, faults: Arc<CopyFaults>) -> Self {
        Self { inner, faults, torn: Mutex::default() }
    }
}

impl CopyEngine for FaultyCopies {
    fn lanes(&self) -> usize {
        self.inner.lanes()
    }

    fn len(&self) -> usize {
        self.inner.len()
    }

    unsafe fn submit(&self, lane: usize, copies: &[Copy]) -> Result<Fence> {
        if !self.faults.next_fails() || copies.is_empty() {
            // SAFETY: the caller's contract, passed on.
            return unsafe { self.inner.submit(lane, copies) };
        }
        super::check_ranges(copies, self.inner.len())?;
        let torn = [Copy { len: copies[0].len / 2, ..copies[0] }];
        // SAFETY: a prefix of the first of the caller's copies, under the caller's contract.
        let fence = unsafe { self.inner.submit(lane, &torn)? };
        self.faults.failed.fetch_add(1, Ordering::Relaxed);
        self.torn.lock().insert(fence.0);
        Ok(fence)
    }

    fn wait(&self, fence: Fence) -> Result<()> {
        // Taken before the wait returns the fence's event to its pool for another submission.
        let torn = self.torn.lock().remove(&fence.0);
        let r = self.inner.wait(fence);
        if torn {
            return Err(TierError::Device(format!("{}: injected copy failure (inject_faults)", self.describe())));
        }
        r
    }

    fn is_done(&self, fence: &Fence) -> bool {
        self.inner.is_done(fence)
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}
