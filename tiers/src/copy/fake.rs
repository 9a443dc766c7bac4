//! A [`CopyEngine`] over host memory with a worker thread per lane: the contract of a GPU's
//! streams (copies queued, done later, in order per lane, waited for by fence) without a GPU,
//! so that the queue and everything above it run in tests on any machine. It can delay each
//! submission's copies (to hold many in flight); failures come from
//! [`super::faults::FaultyCopies`] around it, as around a real device.
//!
//! For tests and fault injection only (the daemon uses it only under `inject_faults`).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::{Copy, CopyEngine, Direction, Fence, check_ranges};
use crate::error::{Result, TierError};

/// Jobs a lane holds before a submit waits (the channel's bound).
const LANE_BACKLOG: usize = 256;

/// How slow the fake device is, changeable while it runs (shared by every device made with
/// it).
#[derive(Debug, Default)]
pub struct FakeFaults {
    delay_us: AtomicU64,
}

impl FakeFaults {
    /// Each submission's copies start this long after the lane reaches them.
    pub fn set_delay(&self, d: Duration) {
        self.delay_us.store(d.as_micros() as u64, Ordering::Relaxed);
    }
}

/// What the device saw.
#[derive(Debug, Clone, Default)]
pub struct FakeStats {
    /// The most submissions queued and not yet complete at once.
    pub max_in_flight: usize,
    pub submits_per_lane: Vec<u64>,
}

#[derive(Debug, Default)]
struct Fences {
    next: u64,
    /// Complete fences, until waited for (a fake copy cannot fail: `FaultyCopies` fails them).
    done: HashSet<u64>,
    in_flight: usize,
    stats: FakeStats,
}

#[derive(Debug)]
struct Job {
    fence: u64,
    copies: Vec<Copy>,
    delay: Duration,
}

/// Host memory posing as a device's, copied to and from on worker threads.
#[derive(Debug)]
pub struct FakeDevice {
    base: usize,
    len: usize,
    /// The memory it copies in, kept alive as long as the device (dropped after its lanes
    /// stopped: fields drop after `Drop::drop`).
    _keep: Box<dyn std::any::Any + Send + Sync>,
    lanes: Vec<SyncSender<Job>>,
    workers: Vec<JoinHandle<()>>,
    fences: Arc<(Mutex<Fences>, Condvar)>,
    faults: Arc<FakeFaults>,
}

impl FakeDevice {
    /// A zeroed device memory of `len` bytes with `lanes` lanes.
    pub fn new(len: usize, lanes: usize) -> Result<Self> {
        // A Vec's buffer stays where it is when the Vec moves into the box.
        let mut mem = vec![0u8; len];
        let base = mem.as_mut_ptr() as usize;
        Self::start(base, len, Box::new(mem), lanes, Arc::default())
    }

    /// A device whose memory is `[base, base+len)` of the caller's (an engine's mapped shared
    /// memory, for the daemon's emulation), kept alive by `keep`, with fault switches shared
    /// with other devices.
    ///
    /// # Safety
    /// The range must be valid for reads and writes for as long as `keep` lives; the device
    /// writes it from its worker threads.
    pub unsafe fn over(
        base: *mut u8,
        len: usize,
        keep: Box<dyn std::any::Any + Send + Sync>,
        lanes: usize,
        faults: Arc<FakeFaults>,
    ) -> Result<Self> {
        Self::start(base as usize, len, keep, lanes, faults)
    }

    fn start(
        base: usize,
        len: usize,
        keep: Box<dyn std::any::Any + Send + Sync>,
        lanes: usize,
        faults: Arc<FakeFaults>,
    ) -> Result<Self> {
        let lanes = lanes.max(1);
        let fences = Arc::new((Mutex::new(Fences::default()), Condvar::new()));
        fences.0.lock().unwrap_or_else(|p| p.into_inner()).stats.submits_per_lane = vec![0; lanes];
        let mut senders = Vec::with_capacity(lanes);
        let mut workers: Vec<JoinHandle<()>> = Vec::with_capacity(lanes);
        for lane in 0..lanes {
            let (tx, rx) = sync_channel::<Job>(LANE_BACKLOG);
            let f = Arc::clone(&fences);
            let worker = std::thread::Builder::new()
                .name(format!("kv-fake-dev{lane}"))
                .spawn(move || {
                    for job in rx {
                        run_job(base, &job);
                        let (m, cv) = &*f;
                        let mut st = m.lock().unwrap_or_else(|p| p.into_inner());
                        st.done.insert(job.fence);
                        st.in_flight -= 1;
                        cv.notify_all();
                    }
                })
                .map_err(|e| TierError::Device(format!("starting a fake device lane: {e}")));
            let worker = match worker {
                Ok(w) => w,
                Err(e) => {
                    // The device is not made: the lanes started so far stop (their senders
                    // drop) before the memory (`keep`) goes.
                    drop(senders);
                    for w in workers {
                        let _ = w.join();
                    }
                    drop(keep);
                    return Err(e);
                }
            };
            senders.push(tx);
            workers.push(worker);
        }
        Ok(Self { base, len, _keep: keep, lanes: senders, workers, fences, faults })
    }

    /// The device's fault switches.
    pub fn faults(&self) -> &FakeFaults {
        &self.faults
    }

    /// What the device saw so far.
    pub fn stats(&self) -> FakeStats {
        self.fences.0.lock().unwrap_or_else(|p| p.into_inner()).stats.clone()
    }

    /// Copies `data` into the device memory at `offset` (the test's "engine writes its KV").
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len, "outside the fake device");
        // SAFETY: inside the device memory (checked); the test does not race its own copies.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), (self.base + offset) as *mut u8, data.len()) };
    }

    /// The device memory's bytes at `offset`.
    pub fn read(&self, offset: usize, n: usize) -> Vec<u8> {
        assert!(offset + n <= self.len, "outside the fake device");
        let mut out = vec![0u8; n];
        // SAFETY: as in `write`.
        unsafe { std::ptr::copy_nonoverlapping((self.base + offset) as *const u8, out.as_mut_ptr(), n) };
        out
    }
}

/// Runs one submission's copies.
fn run_job(base: usize, job: &Job) {
    if !job.delay.is_zero() {
        std::thread::sleep(job.delay);
    }
    for c in &job.copies {
        let n = c.len;
        let dev = (base + c.device) as *mut u8;
        // SAFETY: the device range was checked at submit; the host range is valid until the
        // fence is waited for (`CopyEngine::submit`'s contract), which is after this.
        unsafe {
            match c.dir {
                Direction::ToHost => std::ptr::copy_nonoverlapping(dev, c.host as *mut u8, n),
                Direction::ToDevice => std::ptr::copy_nonoverlapping(c.host as *const u8, dev, n),
            }
        }
    }
}

impl CopyEngine for FakeDevice {
    fn lanes(&self) -> usize {
        self.lanes.len()
    }

    fn len(&self) -> usize {
        self.len
    }

    unsafe fn submit(&self, lane: usize, copies: &[Copy]) -> Result<Fence> {
        check_ranges(copies, self.len)?;
        let lane = lane % self.lanes.len();
        let delay = Duration::from_micros(self.faults.delay_us.load(Ordering::Relaxed));
        let fence = {
            let mut st = self.fences.0.lock().unwrap_or_else(|p| p.into_inner());
            st.next += 1;
            st.in_flight += 1;
            st.stats.max_in_flight = st.stats.max_in_flight.max(st.in_flight);
            st.stats.submits_per_lane[lane] += 1;
            st.next
        };
        let job = Job { fence, copies: copies.to_vec(), delay };
        if self.lanes[lane].send(job).is_err() {
            let mut st = self.fences.0.lock().unwrap_or_else(|p| p.into_inner());
            st.in_flight -= 1;
            return Err(TierError::Device(format!("{}: lane {lane} stopped", self.describe())));
        }
        Ok(Fence(fence))
    }

    fn wait(&self, fence: Fence) -> Result<()> {
        let (m, cv) = &*self.fences;
        let mut st = m.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if st.done.remove(&fence.0) {
                return Ok(());
            }
            st = cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn is_done(&self, fence: &Fence) -> bool {
        self.fences.0.lock().unwrap_or_else(|p| p.into_inner()).done.contains(&fence.0)
    }

    fn describe(&self) -> String {
        format!("fake device ({} lanes)", self.lanes.len())
    }
}

impl Drop for FakeDevice {
    fn drop(&mut self) {
        // The lanes finish what they hold, then stop; only then is the memory released.
        self.lanes.clear();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        let st = self.stats();
        tracing::info!(
            submissions = st.submits_per_lane.iter().sum::<u64>(),
            max_in_flight = st.max_in_flight,
            "fake device closed"
        );
    }
}
