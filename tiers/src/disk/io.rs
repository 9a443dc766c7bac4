//! G3 I/O: engines that execute batches of aligned reads and writes, run on dedicated named
//! threads fed by a bounded channel.
//!
//! The backend is chosen at run time: io_uring where the kernel allows it, else pread/pwrite
//! (the choice is logged). Callers block until their batch completes, so buffers they pass
//! stay valid for the whole operation.

use std::io;
use std::os::fd::RawFd;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, bounded};

pub use super::op::{FixedMemory, IoEngine, IoKind, IoOp, IoProgress, NoProgress};
use super::psync::PsyncEngine;
use super::uring::UringEngine;

/// Which engine to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoBackend {
    /// io_uring if it can be set up, else psync.
    Auto,
    IoUring,
    Psync,
}

/// Builds engines for the I/O threads; a hook so tests can inject faults.
pub type EngineFactory = std::sync::Arc<dyn Fn() -> io::Result<Box<dyn IoEngine>> + Send + Sync>;

/// The standard factory for `backend` with io_uring queue depth `depth`.
pub fn engine_factory(backend: IoBackend, depth: u32) -> EngineFactory {
    std::sync::Arc::new(move || -> io::Result<Box<dyn IoEngine>> {
        match backend {
            IoBackend::Psync => Ok(Box::new(PsyncEngine)),
            IoBackend::IoUring => Ok(Box::new(UringEngine::new(depth)?)),
            IoBackend::Auto => match UringEngine::new(depth) {
                Ok(u) => Ok(Box::new(u)),
                Err(e) => {
                    tracing::warn!("io_uring unavailable ({e}); G3 uses pread/pwrite");
                    Ok(Box::new(PsyncEngine))
                }
            },
        }
    })
}

struct Batch {
    fd: RawFd,
    ops: Vec<IoOp>,
    /// Progress and the final result, back to the submitter. Sized to hold every event of the
    /// batch, so an I/O thread never waits on a slow submitter.
    events: Sender<Event>,
}

enum Event {
    Started,
    Completed(usize, bool),
    Finished(io::Result<()>),
}

/// Forwards an I/O thread's progress to the submitter. `Started` goes only to submitters of
/// writes, who hash their blocks while the writes run; a reader has nothing to do before its
/// data arrives, and the event would cost it one more wake-up. (Hashing right after handing the
/// batch over, without waiting for `Started`, measured slower: the busy submitter delayed the
/// I/O thread's wake-up on a two-core machine.)
struct Forward<'a> {
    events: &'a Sender<Event>,
    send_started: bool,
}

impl IoProgress for Forward<'_> {
    fn started(&mut self) {
        if self.send_started {
            let _ = self.events.send(Event::Started);
        }
    }
    fn completed(&mut self, index: usize, ok: bool) {
        let _ = self.events.send(Event::Completed(index, ok));
    }
}

/// How long an I/O thread looks for the next batch before it sleeps. Back-to-back batches (a
/// busy write-through queue, a chain read block by block) then skip the wake-up, which costs
/// tens of microseconds on a virtual machine; an idle thread costs this much CPU once.
const SPIN_FOR_NEXT: std::time::Duration = std::time::Duration::from_micros(30);

fn next_batch(rx: &Receiver<Batch>) -> Option<Batch> {
    let t0 = std::time::Instant::now();
    loop {
        match rx.try_recv() {
            Ok(b) => return Some(b),
            Err(crossbeam_channel::TryRecvError::Disconnected) => return None,
            Err(crossbeam_channel::TryRecvError::Empty) if t0.elapsed() < SPIN_FOR_NEXT => std::hint::spin_loop(),
            Err(crossbeam_channel::TryRecvError::Empty) => return rx.recv().ok(),
        }
    }
}

/// Default of `inline_read_max` and `inline_write_max` ([`IoThreads::start`]): batches of reads
/// (or of writes) of at most this many bytes in all run on the calling thread even when there
/// are I/O threads. The caller waits for its batch either way, and the two thread wake-ups of
/// the hop cost tens of microseconds each on a virtual machine: a quarter of a 256 KiB read and
/// a third of a 256 KiB write here (docs/benchmarks.md). An engine run on the caller reports
/// each completion to it as the threads' do, so checksums still overlap the I/O.
pub const INLINE_MAX: usize = 32 << 20;

/// Calling threads running batches inline at once, at most, when there are I/O threads (each
/// holds an engine; beyond this, batches take the threads).
const INLINE_CALLERS_MAX: usize = 4;

/// The pool of named I/O threads, or (with zero threads) engines lent to calling threads.
pub struct IoThreads {
    tx: Option<Sender<Batch>>,
    threads: Vec<JoinHandle<()>>,
    backend: &'static str,
    /// Engines lent to calling threads, created on demand: every batch in inline mode, small
    /// reads with threads.
    idle: parking_lot::Mutex<Vec<Box<dyn IoEngine>>>,
    /// Inline slots taken now, with threads (bounded by [`INLINE_CALLERS_MAX`]).
    lent: std::sync::atomic::AtomicUsize,
    /// Set once no engine of the threads' backend could be made for a caller.
    inline_off: std::sync::atomic::AtomicBool,
    /// With threads, read (write) batches of at most this many bytes run on the caller (0: none).
    inline_read_max: usize,
    inline_write_max: usize,
    factory: EngineFactory,
    /// Memory offered to every engine for registration before its next batch.
    fixed: Fixed,
    /// Whether memory was offered (only the first offer counts).
    fixed_offered: std::sync::atomic::AtomicBool,
    /// Why the offered memory could not be registered.
    fixed_refused: std::sync::Arc<parking_lot::Mutex<Option<String>>>,
}

/// The memory offered to the engines (none until [`IoThreads::offer_fixed`]).
type Fixed = std::sync::Arc<parking_lot::RwLock<Option<std::sync::Arc<FixedMemory>>>>;

/// Offers the current fixed memory, if any, to `engine`.
fn offer(fixed: &Fixed, engine: &mut dyn IoEngine) {
    if let Some(m) = fixed.read().as_ref() {
        engine.use_fixed(m);
    }
}

impl std::fmt::Debug for IoThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoThreads").field("threads", &self.threads.len()).field("backend", &self.backend).finish()
    }
}

impl IoThreads {
    /// Starts `n` threads named `kv-g3-io-N`, each with its own engine, fed by a channel of
    /// `queue` batches. With `n == 0` there are no threads: each caller runs its batch itself
    /// on an engine borrowed from an idle list. That saves two thread wake-ups per batch
    /// (tens of microseconds each on a virtual machine, measured in docs/benchmarks.md) at the
    /// price of blocking the caller, which the store's callers (write-through thread, blocking
    /// load tasks) do anyway.
    ///
    /// With threads, batches of reads of at most `inline_read_max` bytes in all, and of writes
    /// of at most `inline_write_max`, still run on the caller ([`INLINE_MAX`] is the default; 0
    /// sends every such batch to the threads).
    pub fn start(
        n: usize,
        queue: usize,
        (inline_read_max, inline_write_max): (usize, usize),
        factory: &EngineFactory,
    ) -> io::Result<Self> {
        if n == 0 {
            let engine = factory()?;
            let backend = engine.name();
            tracing::info!(backend, "G3 I/O runs on the calling threads");
            return Ok(Self {
                tx: None,
                threads: Vec::new(),
                backend,
                idle: parking_lot::Mutex::new(vec![engine]),
                lent: std::sync::atomic::AtomicUsize::new(0),
                inline_off: std::sync::atomic::AtomicBool::new(false),
                inline_read_max,
                inline_write_max,
                factory: std::sync::Arc::clone(factory),
                fixed: Fixed::default(),
                fixed_offered: Default::default(),
                fixed_refused: Default::default(),
            });
        }
        let fixed = Fixed::default();
        let (tx, rx) = bounded::<Batch>(queue.max(1));
        let mut threads = Vec::new();
        let mut backend = "none";
        for i in 0..n.max(1) {
            let mut engine = factory()?;
            backend = engine.name();
            let rx: Receiver<Batch> = rx.clone();
            let fixed = std::sync::Arc::clone(&fixed);
            threads.push(std::thread::Builder::new().name(format!("kv-g3-io-{i}")).spawn(move || {
                while let Some(b) = next_batch(&rx) {
                    offer(&fixed, engine.as_mut());
                    let send_started = b.ops.iter().any(|op| op.kind == IoKind::Write);
                    let r =
                        // SAFETY: the submitter (`run`, whose caller vouches for the ops' memory)
                        // waits for `Finished` before it returns.
                        abort_on_unwind(|| unsafe {
                            engine.run(b.fd, &b.ops, &mut Forward { events: &b.events, send_started })
                        });
                    let _ = b.events.send(Event::Finished(r));
                }
            })?);
        }
        tracing::info!(threads = threads.len(), backend, "G3 I/O threads started");
        Ok(Self {
            tx: Some(tx),
            threads,
            backend,
            idle: parking_lot::Mutex::new(Vec::new()),
            lent: std::sync::atomic::AtomicUsize::new(0),
            inline_off: std::sync::atomic::AtomicBool::new(false),
            inline_read_max,
            inline_write_max,
            factory: std::sync::Arc::clone(factory),
            fixed,
            fixed_offered: Default::default(),
            fixed_refused: Default::default(),
        })
    }

    /// Offers `memory` to every engine, each registering it before its next batch. Only the
    /// first offer counts (a store offers G2's pool once).
    ///
    /// The memory is registered first, on a thread of its own (`kv-g3-pin`): pinning a large
    /// pool takes seconds, and the engines meanwhile work as before. It is published to them
    /// only once a second ring has shared the registration, as each engine's ring will (that
    /// needs Linux 6.12). Only io_uring engines use it; a registration that fails is logged,
    /// kept in [`IoThreads::fixed_refused`], and changes nothing else.
    pub fn offer_fixed(&self, memory: std::sync::Arc<FixedMemory>) {
        if self.backend != "io_uring" || memory.is_empty() {
            return;
        }
        if self.fixed_offered.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::debug!("G3 was offered memory to register a second time; kept the first");
            return;
        }
        metrics::gauge!("kvcached_g3_pool_registered").set(0.0);
        let fixed = std::sync::Arc::clone(&self.fixed);
        let refused = std::sync::Arc::clone(&self.fixed_refused);
        let pin = move || {
            let t0 = std::time::Instant::now();
            match super::uring::register_source(&memory) {
                Ok(()) => {
                    tracing::info!(
                        bytes = memory.len(),
                        took_ms = t0.elapsed().as_millis() as u64,
                        "G2 pool registered with io_uring: G3 reads into it and writes from it pin no pages"
                    );
                    metrics::gauge!("kvcached_g3_pool_registered").set(1.0);
                    *fixed.write() = Some(memory);
                }
                Err(e) => {
                    let why = format!(
                        "registering the G2 pool with io_uring failed ({e}; it needs the pool in shared memory, `g2.shm_dir` on tmpfs, CAP_IPC_LOCK or an RLIMIT_MEMLOCK as large as G2, and Linux 6.12 or later)"
                    );
                    tracing::info!("G3 transfers to and from G2 pin its pages per op: {why}");
                    *refused.lock() = Some(why);
                }
            }
        };
        if let Err(e) = std::thread::Builder::new().name("kv-g3-pin".into()).spawn(pin) {
            tracing::info!("G2 pool not registered with io_uring: {e}");
            *self.fixed_refused.lock() = Some(format!("thread kv-g3-pin did not start: {e}"));
        }
    }

    /// Ops that went through the registered memory so far (None: not registered, yet or for
    /// good).
    pub fn fixed_ops(&self) -> Option<u64> {
        self.fixed.read().as_ref().map(|m| m.ops())
    }

    /// Why the offered memory could not be registered, once that is known.
    pub fn fixed_refused(&self) -> Option<String> {
        self.fixed_refused.lock().clone()
    }

    /// The backend in use.
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// An engine from the idle list, or a new one.
    fn take_engine(&self) -> io::Result<Box<dyn IoEngine>> {
        let taken = self.idle.lock().pop();
        match taken {
            Some(e) => Ok(e),
            None => (self.factory)(),
        }
    }

    /// Runs `ops` on this thread with `engine`, then returns it to the idle list.
    fn run_here(
        &self,
        mut engine: Box<dyn IoEngine>,
        fd: RawFd,
        ops: &[IoOp],
        progress: &mut dyn IoProgress,
    ) -> io::Result<()> {
        offer(&self.fixed, engine.as_mut());
        // SAFETY: `run`'s caller vouches for the ops' memory.
        let r = abort_on_unwind(|| unsafe { engine.run(fd, ops, progress) });
        self.idle.lock().push(engine);
        r
    }

    /// Takes one of the [`INLINE_CALLERS_MAX`] inline slots (given back when the guard drops);
    /// `None` when all are taken.
    fn lend(&self) -> Option<LentSlot<'_>> {
        use std::sync::atomic::Ordering;
        self.lent
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < INLINE_CALLERS_MAX).then_some(n + 1))
            .ok()
            .map(|_| LentSlot(&self.lent))
    }

    /// Small batches stop running on the caller (logged once).
    fn inline_fails(&self, why: &str) {
        if !self.inline_off.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::info!("small G3 batches go to the I/O threads from now on: {why}");
        }
    }

    /// Runs `ops` and waits for them, calling `progress` on this thread as they go. A panic
    /// while ops are in flight aborts the process: unwinding would free buffers the kernel may
    /// still write into.
    ///
    /// # Safety
    /// As [`IoEngine::run`]: each op's memory is valid for its transfer, and not accessed by
    /// anything else, until this returns.
    pub unsafe fn run(&self, fd: RawFd, ops: Vec<IoOp>, progress: &mut dyn IoProgress) -> io::Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        if self.threads.is_empty() {
            let engine = self.take_engine()?;
            return self.run_here(engine, fd, &ops, progress);
        }
        if small_batch(&ops, self.inline_read_max, self.inline_write_max)
            && !self.inline_off.load(std::sync::atomic::Ordering::Relaxed)
            && let Some(_slot) = self.lend()
        {
            // An engine that cannot be made here (e.g. no memory for another ring), or only of
            // another backend than the threads', turns small batches on the caller off: they go
            // to the threads from now on, rather than paying a failing setup each time.
            match self.take_engine() {
                Ok(engine) if engine.name() == self.backend => return self.run_here(engine, fd, &ops, progress),
                Ok(engine) => self.inline_fails(&format!("the engine made here is {}", engine.name())),
                Err(e) => self.inline_fails(&e.to_string()),
            }
        }
        let (events, rx) = bounded(ops.len() + 2);
        let tx = self.tx.as_ref().ok_or_else(|| io::Error::other("G3 I/O threads stopped"))?;
        tx.send(Batch { fd, ops, events }).map_err(|_| io::Error::other("G3 I/O threads stopped"))?;
        let in_flight = AbortOnUnwind;
        let mut started = false;
        loop {
            // The I/O thread died mid-batch (it cannot: a panic there aborts): its ring's ops may
            // still be in flight, so returning would free their buffers under them.
            let Ok(event) = rx.recv() else { std::process::abort() };
            // As an engine run here would: `started` once ops are under way, never for a batch
            // that failed before any started.
            if !started && !matches!(event, Event::Finished(_)) {
                started = true;
                progress.started();
            }
            match event {
                Event::Started => {}
                Event::Completed(i, ok) => progress.completed(i, ok),
                Event::Finished(r) => {
                    std::mem::forget(in_flight);
                    return r;
                }
            }
        }
    }
}

/// An inline slot, given back when dropped (on every path, a panic included).
struct LentSlot<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for LentSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Reads of at most `max` bytes in all.
/// Whether a batch runs on the caller: all reads within `read_max` bytes, or all writes within
/// `write_max`.
fn small_batch(ops: &[IoOp], read_max: usize, write_max: usize) -> bool {
    let bytes: usize = ops.iter().map(|op| op.len).sum();
    if ops.iter().all(|op| op.kind == IoKind::Read) {
        bytes <= read_max
    } else {
        ops.iter().all(|op| op.kind == IoKind::Write) && bytes <= write_max
    }
}

/// Runs `f` (which has ops in flight on buffers it does not own) and aborts the process if it
/// panics.
fn abort_on_unwind<T>(f: impl FnOnce() -> T) -> T {
    let in_flight = AbortOnUnwind;
    let r = f();
    std::mem::forget(in_flight);
    r
}

/// Aborts the process if dropped during a panic: held while a batch's ops are in flight.
struct AbortOnUnwind;

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!("panic with G3 I/O in flight; aborting");
            std::process::abort();
        }
    }
}

impl Drop for IoThreads {
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
