//! Probing a long prompt's keys while they are still being derived.
//!
//! The first lookup of a 128k-token prompt derives 8192 keys, one dependent chain, and probes
//! every tier for each. The chain cannot be split; the probes can. Thread `kv-probe` probes each chunk of keys as soon as the lookup has derived
//! it, while the lookup goes on deriving the next. The chunks the helper has not taken when the
//! chain ends the lookup probes itself, so a helper that is busy with another lookup, or slow to
//! wake, costs the lookup nothing but the wake-up call.
//!
//! A miss the helper finds stops the derivation at the next chunk, as the lookup's own probes
//! would have (a prompt cached only in part derives at most a chunk or two more than it needs).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::thread::JoinHandle;

use kvproto::BlockKey;
use kvtiers::BlockStore;

/// Keys per chunk one probe call takes (the key memo's derivation chunk).
const CHUNK: usize = crate::engine::key_memo::LAZY_CHUNK;

/// Idle polls of a job before the helper starts yielding its CPU between polls.
const SPINS_BEFORE_YIELD: u32 = 2_000;

/// The helper thread; dropping it ends the thread once its current job is done.
#[derive(Debug)]
pub struct PrefixProber {
    jobs: Option<SyncSender<Arc<Job>>>,
    thread: Option<JoinHandle<()>>,
}

/// The keys of one lookup past its first, synchronously probed chunk, shared with the helper.
#[derive(Debug)]
struct Job {
    /// Index of the first key of chunk 0.
    base: usize,
    /// Keys as two little-endian halves; `keys[i]` is valid once `derived > i`.
    keys: Box<[[AtomicU64; 2]]>,
    derived: AtomicUsize,
    /// Set once the lookup derives no more (`derived` is final).
    finished: AtomicBool,
    /// Chunks taken for probing so far (by either thread); chunk `c` covers keys
    /// `base + c * CHUNK ..`.
    taken: AtomicUsize,
    /// Chunks whose probe results are in `held`.
    probed: AtomicUsize,
    /// Tier bits per key (as [`BlockStore::held_prefix`] gives them; 0 past a miss).
    held: Box<[AtomicU8]>,
    /// Lowest key index known to be held nowhere (`usize::MAX`: none yet).
    miss: AtomicUsize,
}

impl Job {
    fn new(base: usize, blocks: usize) -> Self {
        let n = blocks - base;
        Self {
            base,
            keys: (0..n).map(|_| [AtomicU64::new(0), AtomicU64::new(0)]).collect(),
            derived: AtomicUsize::new(base),
            finished: AtomicBool::new(false),
            taken: AtomicUsize::new(0),
            probed: AtomicUsize::new(0),
            held: (0..n).map(|_| AtomicU8::new(0)).collect(),
            miss: AtomicUsize::new(usize::MAX),
        }
    }

    /// Key `i` (valid once `derived > i`).
    fn key(&self, i: usize) -> BlockKey {
        let [lo, hi] = &self.keys[i - self.base];
        let mut k = [0u8; 16];
        k[..8].copy_from_slice(&lo.load(Ordering::Relaxed).to_le_bytes());
        k[8..].copy_from_slice(&hi.load(Ordering::Relaxed).to_le_bytes());
        BlockKey(k)
    }

    /// Writes key `i` (published to the other thread by the next store of `derived`).
    fn set_key(&self, i: usize, k: &BlockKey) {
        let [lo, hi] = &self.keys[i - self.base];
        let (a, b) = k.0.split_at(8);
        lo.store(u64::from_le_bytes(a.try_into().unwrap_or_default()), Ordering::Relaxed);
        hi.store(u64::from_le_bytes(b.try_into().unwrap_or_default()), Ordering::Relaxed);
    }

    /// Takes the next chunk whose keys are all derived (or, once the lookup is finished, whose
    /// first key is) and lies before any known miss. Returns its key range.
    fn take(&self) -> Option<(usize, usize)> {
        loop {
            let c = self.taken.load(Ordering::Acquire);
            // Read `finished` before `derived`: a finished lookup's `derived` is final.
            let finished = self.finished.load(Ordering::Acquire);
            let derived = self.derived.load(Ordering::Acquire);
            let start = self.base + c * CHUNK;
            let end = (start + CHUNK).min(self.base + self.keys.len());
            let ready = if finished { start < derived } else { end <= derived };
            if !ready || start >= end || start >= self.miss.load(Ordering::Acquire) {
                return None;
            }
            if self.taken.compare_exchange(c, c + 1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                return Some((start, end.min(derived)));
            }
        }
    }

    /// Probes keys `start..end` (taken with [`Job::take`]) and records what it found.
    fn probe(&self, store: &BlockStore, (start, end): (usize, usize)) {
        // Counted as probed however it ends: a probe that panics leaves a miss at its first key
        // (fewer blocks matched, never more), and the lookup waiting for it goes on.
        let done = ProbeDone { job: self, start, finished: false };
        let keys: Vec<BlockKey> = (start..end).map(|i| self.key(i)).collect();
        let held = store.held_prefix(&keys);
        for (i, &h) in held.iter().enumerate() {
            self.held[start - self.base + i].store(h, Ordering::Relaxed);
        }
        if held.len() < keys.len() {
            self.miss.fetch_min(start + held.len(), Ordering::AcqRel);
        }
        done.finish();
    }

    /// Probes chunks until none is ready; whether any was.
    fn probe_ready(&self, store: &BlockStore) -> bool {
        let mut any = false;
        while let Some(range) = self.take() {
            self.probe(store, range);
            any = true;
        }
        any
    }
}

/// Marks a chunk probed when dropped; unless [`ProbeDone::finish`]ed, as a miss at its start.
struct ProbeDone<'a> {
    job: &'a Job,
    start: usize,
    finished: bool,
}

impl ProbeDone<'_> {
    fn finish(mut self) {
        self.finished = true;
    }
}

impl Drop for ProbeDone<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.job.miss.fetch_min(self.start, Ordering::AcqRel);
        }
        self.job.probed.fetch_add(1, Ordering::Release);
    }
}

impl PrefixProber {
    /// Starts thread `kv-probe` on `store`. Without it (the thread cannot be started), every
    /// lookup probes its own keys.
    pub fn start(store: Arc<BlockStore>) -> Self {
        // A rendezvous: a job is handed over only to a helper that is waiting for one.
        let (tx, rx) = std::sync::mpsc::sync_channel::<Arc<Job>>(0);
        match std::thread::Builder::new().name("kv-probe".into()).spawn(move || help(&store, &rx)) {
            Ok(t) => Self { jobs: Some(tx), thread: Some(t) },
            Err(e) => {
                tracing::warn!("lookups will probe their own keys: cannot start thread kv-probe: {e}");
                Self { jobs: None, thread: None }
            }
        }
    }

    /// Starts probing a lookup of `blocks` keys whose first `probed` keys it has probed itself.
    /// None when there is nothing left to share or the helper is busy: the lookup probes alone.
    pub fn begin<'a>(&self, store: &'a BlockStore, probed: usize, blocks: usize) -> Option<Probing<'a>> {
        let jobs = self.jobs.as_ref()?;
        if blocks.saturating_sub(probed) < 2 * CHUNK {
            return None;
        }
        let job = Arc::new(Job::new(probed, blocks));
        match jobs.try_send(Arc::clone(&job)) {
            Ok(()) => Some(Probing { job, store, published: probed }),
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => None,
        }
    }
}

impl Drop for PrefixProber {
    fn drop(&mut self) {
        self.jobs = None; // the helper's loop ends when its channel closes
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn help(store: &BlockStore, jobs: &Receiver<Arc<Job>>) {
    while let Ok(job) = jobs.recv() {
        let mut idle = Backoff::default();
        loop {
            if job.probe_ready(store) {
                idle = Backoff::default();
                continue;
            }
            if job.finished.load(Ordering::Acquire) {
                break;
            }
            idle.snooze();
        }
    }
}

/// Waiting for the other thread of a job: spins a while, then yields the CPU between polls
/// (the thread waited for may need it).
#[derive(Default)]
struct Backoff {
    polls: u32,
}

impl Backoff {
    fn snooze(&mut self) {
        self.polls = self.polls.saturating_add(1);
        if self.polls < SPINS_BEFORE_YIELD {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// One lookup's share of the work with the helper.
#[derive(Debug)]
pub struct Probing<'a> {
    job: Arc<Job>,
    store: &'a BlockStore,
    published: usize,
}

impl Probing<'_> {
    /// Hands over the keys derived since the last call (`keys` holds all of them so far);
    /// false once a key among them is known to be held nowhere (derive no more).
    pub fn publish(&mut self, keys: &[BlockKey]) -> bool {
        let end = keys.len().min(self.job.base + self.job.keys.len());
        for (i, k) in keys.iter().enumerate().take(end).skip(self.published) {
            self.job.set_key(i, k);
        }
        self.published = self.published.max(end);
        self.job.derived.store(self.published, Ordering::Release);
        self.job.miss.load(Ordering::Acquire) >= self.published
    }

    /// Ends the lookup's derivation at `keys` (all derived keys), probes what the helper has
    /// not taken, waits for what it has, and returns the tier bits of the keys from the job's
    /// first up to the first key held nowhere.
    pub fn finish(self, keys: &[BlockKey]) -> Vec<u8> {
        let mut this = self;
        this.publish(keys);
        this.job.finished.store(true, Ordering::Release);
        this.job.probe_ready(this.store);
        // What is taken now is final: wait for the helper's chunk in progress, if any.
        let taken = this.job.taken.load(Ordering::Acquire);
        let mut wait = Backoff::default();
        while this.job.probed.load(Ordering::Acquire) < taken {
            wait.snooze();
        }
        let job = &this.job;
        let end = job.miss.load(Ordering::Acquire).min(this.published);
        job.held[..end.saturating_sub(job.base)]
            .iter()
            .map(|h| h.load(Ordering::Relaxed))
            .take_while(|&h| h != 0)
            .collect()
    }
}

impl Drop for Probing<'_> {
    /// A lookup that ends without [`Probing::finish`] (an error) still releases the helper.
    fn drop(&mut self) {
        self.job.finished.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kvproto::NamespaceFingerprint;
    use kvtiers::{BlockMeta, BlockStoreConfig, HostTierConfig, WriteThroughConfig};

    fn store_with(keys: &[BlockKey]) -> Arc<BlockStore> {
        let dir = tempfile::tempdir().unwrap();
        let cfg = BlockStoreConfig {
            g2: HostTierConfig {
                shm_dir: dir.path().to_path_buf(),
                page_size: 4096,
                ..HostTierConfig::with_capacity(48 << 20)
            },
            g3: None,
            write_through: WriteThroughConfig::default(),
            g4: None,
            g4_write_through: WriteThroughConfig::default(),
        };
        let store = Arc::new(BlockStore::open(&cfg).unwrap());
        for (i, k) in keys.iter().enumerate() {
            let meta = BlockMeta {
                namespace: kvproto::NamespaceId([1; 16]),
                parent: i.checked_sub(1).map(|p| keys[p]),
                len: 64,
                owner: None,
            };
            store.put(*k, meta, &[i as u8; 64]).unwrap();
        }
        store
    }

    /// A chain of `n` keys, all cached, and a helper on that store.
    fn cached_chain(n: usize) -> (Vec<BlockKey>, Arc<BlockStore>, PrefixProber) {
        let keys = chain(n);
        let store = store_with(&keys);
        let prober = PrefixProber::start(Arc::clone(&store));
        (keys, store, prober)
    }

    /// The helper takes a job only while it waits for one: right after its start it may not.
    fn begin_soon<'a>(prober: &PrefixProber, store: &'a BlockStore, blocks: usize) -> Probing<'a> {
        for _ in 0..1000 {
            if let Some(p) = prober.begin(store, CHUNK, blocks) {
                return p;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        panic!("the helper never took a job");
    }

    fn chain(n: usize) -> Vec<BlockKey> {
        let tokens: Vec<u32> = (0..n as u32 * 16).collect();
        kvproto::block_keys(&NamespaceFingerprint([3; 32]), 16, &tokens)
    }

    /// Derives `keys` chunk by chunk the way a lookup does and returns the held bits.
    fn look_up(prober: &PrefixProber, store: &BlockStore, keys: &[BlockKey]) -> (Vec<u8>, usize) {
        let first = store.held_prefix(&keys[..CHUNK]);
        let mut p = begin_soon(prober, store, keys.len());
        let mut derived = CHUNK;
        while derived < keys.len() {
            derived = (derived + CHUNK).min(keys.len());
            if !p.publish(&keys[..derived]) {
                break;
            }
            // A real chain takes longer to derive a chunk than the helper takes to probe one:
            // let the helper catch up (it takes only whole chunks before the lookup finishes).
            let whole = (derived - CHUNK) / CHUNK;
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while p.job.probed.load(Ordering::Acquire) < whole && p.job.miss.load(Ordering::Acquire) == usize::MAX {
                assert!(std::time::Instant::now() < deadline, "the helper never probed");
                std::thread::yield_now();
            }
        }
        let mut held = first;
        held.extend(p.finish(&keys[..derived]));
        (held, derived)
    }

    #[test]
    fn a_shared_lookup_finds_what_a_lookup_alone_finds() {
        let keys = chain(8192);
        for cached in [8192, 8000, 5 * CHUNK, CHUNK + 1, CHUNK] {
            let store = store_with(&keys[..cached]);
            let prober = PrefixProber::start(Arc::clone(&store));
            for _ in 0..20 {
                let (held, derived) = look_up(&prober, &store, &keys);
                assert_eq!(held, store.held_prefix(&keys), "{cached} cached");
                assert_eq!(held.len(), cached);
                // A miss stops the derivation within two chunks of it.
                assert!(derived == keys.len() || derived <= cached + 2 * CHUNK, "{cached}: derived {derived}");
            }
        }
    }

    #[test]
    fn a_busy_helper_leaves_the_lookup_to_probe_alone() {
        let (keys, store, prober) = cached_chain(4 * CHUNK);
        let mut p = begin_soon(&prober, &store, keys.len());
        // The helper works on that job until it is finished: a second lookup probes alone.
        assert!(prober.begin(&store, CHUNK, keys.len()).is_none());
        assert!(p.publish(&keys));
        assert_eq!(p.finish(&keys), store.held_prefix(&keys)[CHUNK..]);
        // Short prompts are not shared at all.
        assert!(prober.begin(&store, CHUNK, 2 * CHUNK).is_none());
    }

    #[test]
    fn a_lookup_dropped_midway_releases_the_helper() {
        let (keys, store, prober) = cached_chain(8 * CHUNK);
        let mut p = begin_soon(&prober, &store, keys.len());
        assert!(p.publish(&keys[..3 * CHUNK]));
        drop(p);
        // The helper is waiting again: the next lookup gets it.
        let next = begin_soon(&prober, &store, keys.len());
        assert_eq!(next.finish(&keys), store.held_prefix(&keys)[CHUNK..]);
        drop(prober); // joins the helper
    }
}
