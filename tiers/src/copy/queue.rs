//! [`CopyQueue`]: blocks' copies in flight on a device's lanes, each block's memory kept alive
//! until its fence completes.

use std::collections::VecDeque;

use super::{Copy, CopyEngine, Fence};
use crate::error::Result;

/// Blocks in flight on a [`CopyEngine`]: each [`CopyQueue::push`] queues one block's copies
/// on the next lane (round robin) and returns at once, so the caller prepares the next block
/// while the device copies this one. At most `depth` blocks are in flight: a push past that
/// waits for the oldest. Each block comes back to `done` with its outcome, in the order the
/// blocks were pushed, once its fence completed (early, without waiting, where the device is
/// already through with it): only then is its memory (`K`: a G2 reservation, a held G2 block)
/// released or made visible.
///
/// Dropping the queue waits for every block still in flight (and hands each to `done`), so
/// no copy outlives the memory it touches.
pub struct CopyQueue<'e, K, F: FnMut(K, Result<()>)> {
    engine: &'e dyn CopyEngine,
    depth: usize,
    lane: usize,
    in_flight: VecDeque<(Fence, K)>,
    done: F,
}

impl<K, F: FnMut(K, Result<()>)> std::fmt::Debug for CopyQueue<'_, K, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyQueue")
            .field("engine", &self.engine.describe())
            .field("depth", &self.depth)
            .field("in_flight", &self.in_flight.len())
            .finish()
    }
}

impl<'e, K, F: FnMut(K, Result<()>)> CopyQueue<'e, K, F> {
    /// A queue on `engine` with at most `depth` (at least 1) blocks in flight.
    pub fn new(engine: &'e dyn CopyEngine, depth: usize, done: F) -> Self {
        Self { engine, depth: depth.max(1), lane: 0, in_flight: VecDeque::with_capacity(depth.max(1)), done }
    }

    /// Queues one block's `copies`, keeping `keep` until they are done. A block the device
    /// refuses to queue goes to `done` at once, with the error (after the blocks before it).
    ///
    /// # Safety
    /// Every copy's host range must lie in memory that `keep` keeps valid, or that outlives
    /// the queue, and that nobody else reads or writes until the block reaches `done`
    /// ([`CopyEngine::submit`]'s contract).
    pub unsafe fn push(&mut self, copies: &[Copy], keep: K) {
        // What the device is through with is finished now, without waiting; then room is made.
        while self.in_flight.front().is_some_and(|(f, _)| self.engine.is_done(f)) {
            self.finish_oldest();
        }
        while self.in_flight.len() >= self.depth {
            self.finish_oldest();
        }
        let lanes = self.engine.lanes().max(1);
        let lane = self.lane % lanes;
        self.lane = (lane + 1) % lanes;
        // SAFETY: the host ranges stay valid until the fence is waited for: `keep` is held
        // until then (the caller's promise), and the queue waits before dropping it.
        match unsafe { self.engine.submit(lane, copies) } {
            Ok(fence) => self.in_flight.push_back((fence, keep)),
            Err(e) => {
                // The blocks before it finish first, so `done` sees them in order.
                self.drain();
                (self.done)(keep, Err(e));
            }
        }
    }

    /// Blocks in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Waits for every block in flight, handing each to `done`.
    pub fn drain(&mut self) {
        while !self.in_flight.is_empty() {
            self.finish_oldest();
        }
    }

    fn finish_oldest(&mut self) {
        if let Some((fence, keep)) = self.in_flight.pop_front() {
            let r = self.engine.wait(fence);
            (self.done)(keep, r);
        }
    }
}

impl<K, F: FnMut(K, Result<()>)> Drop for CopyQueue<'_, K, F> {
    fn drop(&mut self) {
        self.drain();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::copy::Direction;
    use crate::copy::fake::FakeDevice;
    use crate::copy::faults::{CopyFaults, FaultyCopies};

    fn block_copies(dir: Direction, block: usize, bytes: usize, host: &mut [u8]) -> Vec<Copy> {
        // Two segments per block (K and V), as an engine's layout splits them.
        let half = bytes / 2;
        let base = host.as_mut_ptr() as usize;
        vec![
            Copy { dir, device: block * bytes, host: base, len: half },
            Copy { dir, device: block * bytes + half, host: base + half, len: bytes - half },
        ]
    }

    /// Blocks go round the lanes, several are in flight at once but never more than the depth,
    /// each comes back in order with every byte, and the memory of each is kept until then.
    #[test]
    fn blocks_overlap_on_the_lanes_in_order_and_whole() {
        let (blocks, bytes, depth) = (32usize, 4096usize, 6usize);
        let dev = FakeDevice::new(blocks * bytes, 3).unwrap();
        let src: Vec<u8> = (0..blocks * bytes).map(|i| (i * 7 + i / 4096) as u8).collect();
        dev.write(0, &src);
        dev.faults().set_delay(Duration::from_millis(2));
        let mut back: Vec<(usize, Vec<u8>)> = Vec::new();
        {
            let mut q = CopyQueue::new(&dev, depth, |(i, buf): (usize, Vec<u8>), r: Result<()>| {
                r.expect("copy");
                back.push((i, buf));
            });
            for i in 0..blocks {
                let mut buf = vec![0u8; bytes];
                let copies = block_copies(Direction::ToHost, i, bytes, &mut buf);
                // SAFETY: the copies land in `buf`, which the queue keeps until they are done
                // (a Vec's heap buffer does not move when the Vec does).
                unsafe { q.push(&copies, (i, buf)) };
                assert!(q.in_flight() <= depth);
            }
        }
        assert_eq!(back.iter().map(|(i, _)| *i).collect::<Vec<_>>(), (0..blocks).collect::<Vec<_>>());
        for (i, buf) in &back {
            assert_eq!(&buf[..], &src[i * bytes..(i + 1) * bytes], "block {i}");
        }
        let st = dev.stats();
        assert!(st.max_in_flight > 1, "copies overlapped: {st:?}");
        assert!(st.max_in_flight <= depth, "never more than the depth: {st:?}");
        assert!(st.submits_per_lane.iter().all(|&n| n == blocks as u64 / 3 || n == blocks as u64 / 3 + 1), "{st:?}");
    }

    /// A copy the device fails reports that block (and only it) as failed; the blocks around
    /// it arrive whole; the torn bytes of the failed one are the caller's to throw away.
    #[test]
    fn a_failed_copy_fails_its_block_only() {
        let (blocks, bytes) = (12usize, 1024usize);
        let faults = Arc::new(CopyFaults::default());
        let dev = FaultyCopies::new(Box::new(FakeDevice::new(blocks * bytes, 2).unwrap()), Arc::clone(&faults));
        let mut host = vec![0u8; blocks * bytes];
        host.iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8);
        faults.fail_every(5);
        let mut outcomes = Vec::new();
        {
            let mut q = CopyQueue::new(&dev, 4, |i: usize, r: Result<()>| outcomes.push((i, r.is_ok())));
            for i in 0..blocks {
                let copies = block_copies(Direction::ToDevice, i, bytes, &mut host[i * bytes..(i + 1) * bytes]);
                // SAFETY: `host` outlives the queue and is not touched until it is dropped.
                unsafe { q.push(&copies, i) };
            }
        }
        let failed: Vec<usize> = outcomes.iter().filter(|(_, ok)| !ok).map(|(i, _)| *i).collect();
        assert_eq!(failed, vec![4, 9], "the 5th and 10th submissions fail");
        // Read back through the device itself: the torn blocks' second halves never arrived.
        let mut back = vec![0u8; blocks * bytes];
        let all = [Copy { dir: Direction::ToHost, device: 0, host: back.as_mut_ptr() as usize, len: back.len() }];
        faults.fail_every(0);
        // SAFETY: `back` outlives the call, which waits.
        unsafe { dev.copy_now(&all) }.unwrap();
        for i in 0..blocks {
            let same = back[i * bytes..(i + 1) * bytes] == host[i * bytes..(i + 1) * bytes];
            assert_eq!(same, !failed.contains(&i), "block {i}");
        }
        assert_eq!(faults.failed(), 2);
    }

    /// A block the device will not queue (outside its memory) comes back failed at once, after
    /// the blocks before it, and nothing of it is copied.
    #[test]
    fn a_refused_block_comes_back_in_order() {
        let dev = FakeDevice::new(4096, 2).unwrap();
        let mut host = vec![1u8; 8192];
        let base = host.as_mut_ptr() as usize;
        let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let o = Arc::clone(&order);
        let mut q = CopyQueue::new(&dev, 8, move |i: usize, r: Result<()>| o.lock().push((i, r.is_ok())));
        let ok = [Copy { dir: Direction::ToDevice, device: 0, host: base, len: 4096 }];
        let bad = [Copy { dir: Direction::ToDevice, device: 4000, host: base, len: 4096 }];
        // SAFETY: `host` outlives the queue (dropped below, before `host`).
        unsafe {
            q.push(&ok, 0);
            q.push(&bad, 1);
        }
        drop(q);
        assert_eq!(*order.lock(), vec![(0, true), (1, false)]);
        drop(host);
    }
}
