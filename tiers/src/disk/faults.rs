//! Fault injection for G3's I/O, for the fault suites (`tests/faults.rs`) and nothing else: an
//! [`IoEngine`] decorator ([`FaultyEngine`]) around the real engine, driven by switches shared
//! with whoever injects ([`DiskFaults`]; the daemon's `inject_faults` file). The tier opens its
//! engines through it only when [`super::DiskTierConfig::faults`] is set, which no default does.
//!
//! What it can do to a batch, op by op (fractions: 0 never, 1 every op):
//! - EIO on reads or writes, ENOSPC on writes: the op is not run and fails;
//! - a torn write: only the first half of the op reaches the file and the op is reported whole
//!   (a device that lies, or a crash between the halves); the block's checksum must catch it;
//! - a short write: the first half reaches the file and the op fails;
//! - a latency spike: the batch waits `latency_ms` before it runs.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::io::EngineFactory;
use super::op::{IoEngine, IoKind, IoOp, IoProgress};
use crate::buf::ALIGN;

/// What to inject: fractions of ops (or batches, for latency) from 0 to 1.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DiskFaultSpec {
    pub read_eio: f64,
    pub write_eio: f64,
    pub enospc: f64,
    pub torn_write: f64,
    pub short_write: f64,
    /// Fraction of batches delayed by `latency_ms`.
    pub latency: f64,
    pub latency_ms: u64,
}

/// Parts per million: fractions kept in atomics so that switching them needs no lock on the
/// I/O path.
const PPM: f64 = 1_000_000.0;

fn ppm(f: f64) -> u32 {
    (f.clamp(0.0, 1.0) * PPM).round() as u32
}

/// The switches, shared between the injector and every engine of the tier.
#[derive(Debug, Default)]
pub struct DiskFaults {
    read_eio: AtomicU32,
    write_eio: AtomicU32,
    enospc: AtomicU32,
    torn_write: AtomicU32,
    short_write: AtomicU32,
    latency: AtomicU32,
    latency_ms: AtomicU64,
    injected: AtomicU64,
}

impl DiskFaults {
    /// Injects `spec` from now on (batches already running keep what they drew).
    pub fn set(&self, spec: &DiskFaultSpec) {
        self.read_eio.store(ppm(spec.read_eio), Ordering::Relaxed);
        self.write_eio.store(ppm(spec.write_eio), Ordering::Relaxed);
        self.enospc.store(ppm(spec.enospc), Ordering::Relaxed);
        self.torn_write.store(ppm(spec.torn_write), Ordering::Relaxed);
        self.short_write.store(ppm(spec.short_write), Ordering::Relaxed);
        self.latency.store(ppm(spec.latency), Ordering::Relaxed);
        self.latency_ms.store(spec.latency_ms, Ordering::Relaxed);
    }

    /// Faults injected so far (ops failed, torn or cut short; batches delayed).
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    fn count(&self, fault: &'static str) {
        self.injected.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("kvcached_g3_injected_faults_total", "fault" => fault).increment(1);
    }
}

/// `factory`'s engines wrapped in [`FaultyEngine`]s driven by `faults`.
pub fn wrap(factory: EngineFactory, faults: &Arc<DiskFaults>) -> EngineFactory {
    tracing::warn!("G3 fault injection is on (inject_faults): for tests only");
    let faults = Arc::clone(faults);
    let seeds = Arc::new(AtomicU64::new(0x9E37_79B9_7F4A_7C15));
    Arc::new(move || -> io::Result<Box<dyn IoEngine>> {
        let inner = factory()?;
        let seed = seeds.fetch_add(0x6A09_E667_F3BC_C909, Ordering::Relaxed) | 1;
        Ok(Box::new(FaultyEngine { inner, faults: Arc::clone(&faults), rng: seed }))
    })
}

/// An engine that injects the faults its switches name, and runs everything else for real.
#[derive(Debug)]
pub struct FaultyEngine {
    inner: Box<dyn IoEngine>,
    faults: Arc<DiskFaults>,
    rng: u64,
}

/// What happens to one op of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Run for real, reported as it went.
    Real,
    /// Its first part runs; reported whole (torn) or failed (short).
    Torn,
    Short,
}

impl FaultyEngine {
    /// True with probability `p` parts per million (xorshift64: cheap, and good enough to
    /// spread faults over ops).
    fn roll(&mut self, p: &AtomicU32) -> bool {
        let p = p.load(Ordering::Relaxed);
        if p == 0 {
            return false;
        }
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % PPM as u64) < u64::from(p)
    }
}

/// Reports the ops of the sub-batch actually run under their indices in the caller's batch.
struct Remap<'a> {
    outer: &'a mut dyn IoProgress,
    /// Per op of the sub-batch: its index in the caller's batch and its fate.
    map: &'a [(usize, Fate)],
    started: bool,
}

impl IoProgress for Remap<'_> {
    fn started(&mut self) {
        self.started = true;
        self.outer.started();
    }
    fn completed(&mut self, index: usize, ok: bool) {
        let Some(&(i, fate)) = self.map.get(index) else { return };
        self.outer.completed(i, ok && fate != Fate::Short);
    }
}

impl IoEngine for FaultyEngine {
    fn name(&self) -> &'static str {
        // The real engine's name: the I/O threads compare names to decide whether an engine made
        // on a calling thread is of their backend.
        self.inner.name()
    }

    fn use_fixed(&mut self, memory: &Arc<super::op::FixedMemory>) {
        self.inner.use_fixed(memory);
    }

    unsafe fn run(&mut self, fd: RawFd, ops: &[IoOp], progress: &mut dyn IoProgress) -> io::Result<()> {
        let f = Arc::clone(&self.faults);
        if self.roll(&f.latency) {
            f.count("latency");
            std::thread::sleep(Duration::from_millis(f.latency_ms.load(Ordering::Relaxed)));
        }
        // The ops that run (the caller's, or their first halves) and, in step, their index in
        // the caller's batch and fate.
        let mut sub = Vec::with_capacity(ops.len());
        let mut map = Vec::with_capacity(ops.len());
        // Ops that fail without running: (index, errno); torn ops with nothing to write.
        let mut failed: Vec<(usize, i32)> = Vec::new();
        let mut torn_unrun: Vec<usize> = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let fate = match op.kind {
                IoKind::Read if self.roll(&f.read_eio) => Err(("read_eio", libc::EIO)),
                IoKind::Read => Ok(Fate::Real),
                IoKind::Write if self.roll(&f.enospc) => Err(("enospc", libc::ENOSPC)),
                IoKind::Write if self.roll(&f.write_eio) => Err(("write_eio", libc::EIO)),
                IoKind::Write if self.roll(&f.torn_write) => Ok(Fate::Torn),
                IoKind::Write if self.roll(&f.short_write) => Ok(Fate::Short),
                IoKind::Write => Ok(Fate::Real),
            };
            match fate {
                Err((fault, errno)) => {
                    f.count(fault);
                    failed.push((i, errno));
                }
                Ok(Fate::Real) => {
                    sub.push(*op);
                    map.push((i, Fate::Real));
                }
                Ok(cut) => {
                    f.count(if cut == Fate::Torn { "torn_write" } else { "short_write" });
                    // The first half, in whole O_DIRECT units; nothing at all for a one-unit op,
                    // which then leaves whatever the pages held before (a stale block's bytes).
                    let part = op.len / 2 / ALIGN * ALIGN;
                    if part > 0 {
                        sub.push(IoOp { len: part, ..*op });
                        map.push((i, cut));
                    } else if cut == Fate::Short {
                        failed.push((i, libc::EIO));
                    } else {
                        torn_unrun.push(i);
                    }
                }
            }
        }
        let cut_short = map.iter().any(|(_, fate)| *fate == Fate::Short);
        let mut remap = Remap { outer: progress, map: &map, started: false };
        let r = if sub.is_empty() {
            Ok(())
        } else {
            // SAFETY: every op of `sub` is one of the caller's ops, or its first part; the
            // caller of `run` vouches for their memory.
            unsafe { self.inner.run(fd, &sub, &mut remap) }
        };
        if !remap.started && (!failed.is_empty() || !torn_unrun.is_empty()) {
            progress.started();
        }
        for &i in &torn_unrun {
            progress.completed(i, true);
        }
        for &(i, _) in &failed {
            progress.completed(i, false);
        }
        r?;
        if let Some(&(_, errno)) = failed.first() {
            return Err(io::Error::from_raw_os_error(errno));
        }
        if cut_short {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "short write (injected)"));
        }
        Ok(())
    }
}
