//! Write-through: blocks put into G2 are copied to each tier below in the background, in
//! batches, by one named thread per tier (`kv-writethrough-g3`, `kv-writethrough-g4`) fed by
//! its own bounded channel, so a slow object store never holds back the disk. A full queue
//! drops that tier's write-through (counted; the block stays in G2) rather than blocking the
//! engine's save.
//!
//! A block evicted from G2 before a lower tier's writer reached it is read from a tier above
//! that one (G4's writer reads G3). Only the first lower tier's writer marks a G2 block clean:
//! until then G2 keeps it for that tier (up to `dirty_wait`, see [`crate::host`]).

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender, TrySendError, bounded};
use kvproto::{BlockKey, TierKind};
use parking_lot::{Condvar, Mutex};

use crate::block::BlockMeta;
use crate::buf::BlockBuf;
use crate::error::TierError;
use crate::host::{HeldBlock, HostTier};
use crate::stats::Count;
use crate::tier::{PartsRef, Tier, TierExt};

/// Tuning of one tier's write-through.
#[derive(Debug, Clone, Copy)]
pub struct WriteThroughConfig {
    /// Blocks that may wait; beyond this a write-through is dropped and counted.
    pub queue: usize,
    /// Blocks written per batch (G3: one fsync and one index batch; G4: requests in flight).
    pub batch: usize,
}

impl Default for WriteThroughConfig {
    fn default() -> Self {
        Self { queue: 4096, batch: 32 }
    }
}

/// Counters of one tier's write-through; metric handles registered when the store opens.
#[derive(Debug)]
pub(crate) struct WtCounters {
    pub written: Count,
    pub dropped: Count,
    /// Blocks gone from every tier above before the writer reached them.
    pub vanished: Count,
    /// Blocks the tier refused for their owner's quota ([`crate::quota`]).
    pub over_quota: Count,
    pub errors: Count,
    depth: metrics::Gauge,
    lag: metrics::Gauge,
}

impl WtCounters {
    fn new(tier: TierKind) -> Self {
        let t = tier.label();
        Self {
            written: Count::labelled("kvcached_writethrough_blocks_total", &[("tier", t)]),
            dropped: Count::labelled("kvcached_writethrough_dropped_total", &[("tier", t), ("reason", "queue_full")]),
            vanished: Count::labelled(
                "kvcached_writethrough_dropped_total",
                &[("tier", t), ("reason", "gone_before_write")],
            ),
            over_quota: Count::labelled(
                "kvcached_writethrough_dropped_total",
                &[("tier", t), ("reason", "over_quota")],
            ),
            errors: Count::labelled("kvcached_writethrough_errors_total", &[("tier", t)]),
            depth: metrics::gauge!("kvcached_writethrough_queue_depth", "tier" => t),
            lag: metrics::gauge!("kvcached_writethrough_lag_seconds", "tier" => t),
        }
    }
}

#[derive(Debug)]
struct Pending {
    n: Mutex<u64>,
    idle: Condvar,
}

/// Holds a writer before its next batch while set (see [`WriteThrough::pause`]).
#[derive(Debug, Default)]
struct Gate {
    paused: Mutex<bool>,
    open: Condvar,
}

impl Gate {
    fn wait_open(&self) {
        let mut paused = self.paused.lock();
        while *paused {
            self.open.wait(&mut paused);
        }
    }

    fn set(&self, paused: bool) {
        *self.paused.lock() = paused;
        if !paused {
            self.open.notify_all();
        }
    }
}

/// Handle of one tier's write-through thread.
#[derive(Debug)]
pub(crate) struct WriteThrough {
    pub tier: TierKind,
    tx: Option<Sender<(BlockKey, Instant)>>,
    pending: Arc<Pending>,
    gate: Arc<Gate>,
    thread: Option<JoinHandle<()>>,
    pub counters: Arc<WtCounters>,
}

/// What one writer writes to and reads from.
pub(crate) struct Writer {
    pub g2: Arc<HostTier>,
    /// The tier written.
    pub target: Arc<dyn Tier>,
    /// Tiers between G2 and the target, read when a block already left G2.
    pub above: Vec<Arc<dyn Tier>>,
    /// Whether this writer marks G2 blocks clean once written (the first lower tier's does).
    pub marks_clean: bool,
}

impl WriteThrough {
    pub fn start(cfg: WriteThroughConfig, w: Writer) -> std::io::Result<Self> {
        let tier = w.target.kind();
        let (tx, rx) = bounded(cfg.queue.max(1));
        let pending = Arc::new(Pending { n: Mutex::new(0), idle: Condvar::new() });
        let counters = Arc::new(WtCounters::new(tier));
        let gate = Arc::new(Gate::default());
        let (p, c, g) = (Arc::clone(&pending), Arc::clone(&counters), Arc::clone(&gate));
        let batch = cfg.batch.max(1);
        let thread = std::thread::Builder::new()
            .name(format!("kv-writethrough-{}", tier.label()))
            .spawn(move || writer_loop(&rx, batch, &w, &p, &c, &g))?;
        Ok(Self { tier, tx: Some(tx), pending, gate, thread: Some(thread), counters })
    }

    /// Queues `key`; false (and counted) if the queue is full or closed.
    pub fn enqueue(&self, key: BlockKey) -> bool {
        let Some(tx) = &self.tx else { return false };
        let mut n = self.pending.n.lock();
        match tx.try_send((key, Instant::now())) {
            Ok(()) => {
                *n += 1;
                self.counters.depth.set(*n as f64);
                true
            }
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.counters.dropped.add(1);
                false
            }
        }
    }

    /// Blocks until every queued block has been written (or failed).
    pub fn wait_idle(&self) {
        let mut n = self.pending.n.lock();
        while *n > 0 {
            // A writer that died (a bug) must not hang shutdown: check it is still there.
            if self.thread.as_ref().is_none_or(|t| t.is_finished()) {
                tracing::error!(queued = *n, tier = %self.tier, "write-through thread is gone; queued blocks stay in G2 only");
                return;
            }
            self.pending.idle.wait_for(&mut n, std::time::Duration::from_millis(100));
        }
    }

    pub fn queued(&self) -> u64 {
        *self.pending.n.lock()
    }

    /// Holds (true) or lets go (false) the writer before its next batch; what is queued
    /// meanwhile waits, up to the queue's bound.
    pub fn pause(&self, paused: bool) {
        self.gate.set(paused);
    }
}

impl Drop for WriteThrough {
    fn drop(&mut self) {
        // Closing the channel lets the writer drain what is queued, then exit.
        self.tx = None;
        // A pause guard borrows the store, so only one forgotten (`mem::forget`) is still held.
        self.gate.set(false);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Where a block being written through is read from.
enum Source {
    /// G2's own pages, held: written out as they are, no copy.
    G2(HeldBlock),
    /// Gone from G2: read into this buffer from a tier above the target.
    Above(BlockMeta, usize),
}

fn writer_loop(
    rx: &Receiver<(BlockKey, Instant)>,
    batch: usize,
    w: &Writer,
    pending: &Pending,
    counters: &WtCounters,
    gate: &Gate,
) {
    let mut bufs: Vec<BlockBuf> = Vec::new();
    while let Ok(first) = rx.recv() {
        gate.wait_open();
        let mut keys = vec![first];
        while keys.len() < batch {
            match rx.try_recv() {
                Ok(k) => keys.push(k),
                Err(_) => break,
            }
        }
        counters.lag.set(keys.iter().map(|(_, t)| t.elapsed().as_secs_f64()).fold(0.0, f64::max));
        bufs.resize_with(keys.len().max(bufs.len()), BlockBuf::new);
        let mut found: Vec<(BlockKey, Source)> = Vec::new();
        for (i, (k, _)) in keys.iter().enumerate() {
            if let Some(held) = w.g2.hold_uncounted(k, true) {
                found.push((*k, Source::G2(held)));
                continue;
            }
            match w.above.iter().find_map(|t| t.get(k, &mut bufs[i]).ok().flatten()) {
                Some(meta) => found.push((*k, Source::Above(meta, i))),
                None => counters.vanished.add(1),
            }
        }
        let parts: Vec<(BlockMeta, Vec<&[u8]>)> = found
            .iter()
            .map(|(_, src)| match src {
                Source::G2(held) => (held.meta, held.parts()),
                Source::Above(meta, i) => (*meta, vec![&bufs[*i][..]]),
            })
            .collect();
        let refs: Vec<PartsRef<'_>> = found
            .iter()
            .zip(&parts)
            .map(|((key, _), (meta, p))| PartsRef { key: *key, meta: *meta, parts: p })
            .collect();
        let mut ok = 0u64;
        for (j, r) in w.target.put_batch_parts(&refs).into_iter().enumerate() {
            match r {
                Ok(_) => ok += 1,
                // The owner is at its quota there: a policy's choice, not a failure.
                Err(TierError::OverQuota { .. }) => counters.over_quota.add(1),
                Err(e) => {
                    counters.errors.add(1);
                    tracing::debug!(key = %refs[j].key, "write-through to {} failed: {e}", w.target.kind());
                }
            }
        }
        counters.written.add(ok);
        // The holds go before the blocks turn clean: a save waiting for G2 space evicts a
        // block as soon as it is clean, and its pages are free only once nothing holds it.
        let done: Vec<BlockKey> = found.iter().map(|(k, _)| *k).collect();
        drop(refs);
        drop(parts);
        drop(found);
        // A failed write-through leaves the block clean too: retrying a full or broken tier
        // would only pin G2. The failure is counted above.
        if w.marks_clean {
            for k in &done {
                w.g2.mark_clean(k);
            }
        }
        let mut n = pending.n.lock();
        *n = n.saturating_sub(keys.len() as u64);
        counters.depth.set(*n as f64);
        if *n == 0 {
            counters.lag.set(0.0);
            pending.idle.notify_all();
        }
    }
}
