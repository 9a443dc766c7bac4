//! Write-through: blocks put into G2 are copied to the tiers below in the background, in
//! batches, by one named thread fed by a bounded channel. A full queue drops the write-through
//! (counted; the block stays in G2) rather than blocking the engine's save.

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TrySendError, bounded};
use kvproto::BlockKey;
use parking_lot::{Condvar, Mutex};

use crate::block::BlockMeta;
use crate::buf::BlockBuf;
use crate::host::HostTier;
use crate::stats::Count;
use crate::tier::{BlockRef, Tier};

/// Tuning of the write-through path.
#[derive(Debug, Clone, Copy)]
pub struct WriteThroughConfig {
    /// Blocks that may wait; beyond this a write-through is dropped and counted.
    pub queue: usize,
    /// Blocks written per batch (one fsync and one index batch each).
    pub batch: usize,
}

impl Default for WriteThroughConfig {
    fn default() -> Self {
        Self { queue: 4096, batch: 32 }
    }
}

/// Counters of the write-through path; metric handles are registered when the store opens.
#[derive(Debug)]
pub(crate) struct WtCounters {
    pub written: Count,
    pub dropped: Count,
    pub errors: Count,
    depth: metrics::Gauge,
}

impl WtCounters {
    fn new() -> Self {
        Self {
            written: Count::labelled("kvcached_writethrough_blocks_total", &[]),
            dropped: Count::labelled("kvcached_writethrough_dropped_total", &[("reason", "queue_full")]),
            errors: Count::labelled("kvcached_writethrough_errors_total", &[]),
            depth: metrics::gauge!("kvcached_writethrough_queue_depth"),
        }
    }
}

#[derive(Debug)]
struct Pending {
    n: Mutex<u64>,
    idle: Condvar,
}

/// Handle of the write-through thread.
#[derive(Debug)]
pub(crate) struct WriteThrough {
    tx: Option<Sender<BlockKey>>,
    pending: Arc<Pending>,
    thread: Option<JoinHandle<()>>,
    pub counters: Arc<WtCounters>,
}

impl WriteThrough {
    pub fn start(cfg: WriteThroughConfig, g2: Arc<HostTier>, lower: Arc<Vec<Arc<dyn Tier>>>) -> std::io::Result<Self> {
        let (tx, rx) = bounded(cfg.queue.max(1));
        let pending = Arc::new(Pending { n: Mutex::new(0), idle: Condvar::new() });
        let counters = Arc::new(WtCounters::new());
        let (p, c) = (Arc::clone(&pending), Arc::clone(&counters));
        let batch = cfg.batch.max(1);
        let thread = std::thread::Builder::new()
            .name("kv-writethrough".into())
            .spawn(move || writer_loop(&rx, batch, &g2, &lower, &p, &c))?;
        Ok(Self { tx: Some(tx), pending, thread: Some(thread), counters })
    }

    /// Queues `key`; false (and counted) if the queue is full or closed.
    pub fn enqueue(&self, key: BlockKey) -> bool {
        let Some(tx) = &self.tx else { return false };
        let mut n = self.pending.n.lock();
        match tx.try_send(key) {
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
                tracing::error!(queued = *n, "write-through thread is gone; queued blocks stay in G2 only");
                return;
            }
            self.pending.idle.wait_for(&mut n, std::time::Duration::from_millis(100));
        }
    }

    pub fn queued(&self) -> u64 {
        *self.pending.n.lock()
    }
}

impl Drop for WriteThrough {
    fn drop(&mut self) {
        // Closing the channel lets the writer drain what is queued, then exit.
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn writer_loop(
    rx: &Receiver<BlockKey>,
    batch: usize,
    g2: &HostTier,
    lower: &[Arc<dyn Tier>],
    pending: &Pending,
    counters: &WtCounters,
) {
    let mut bufs: Vec<BlockBuf> = Vec::new();
    while let Ok(first) = rx.recv() {
        let mut keys = vec![first];
        while keys.len() < batch {
            match rx.try_recv() {
                Ok(k) => keys.push(k),
                Err(_) => break,
            }
        }
        // Copy out of G2 (the block may have been evicted or removed meanwhile: skip it).
        bufs.resize_with(keys.len().max(bufs.len()), BlockBuf::new);
        let mut found: Vec<(BlockKey, BlockMeta, usize)> = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let buf = &mut bufs[i];
            let got = g2.with_block_uncounted(k, |meta, pieces| {
                buf.resize(meta.len as usize);
                let mut off = 0;
                for p in pieces {
                    buf[off..off + p.len()].copy_from_slice(p);
                    off += p.len();
                }
                *meta
            });
            if let Some(meta) = got {
                found.push((*k, meta, i));
            }
        }
        let refs: Vec<BlockRef<'_>> =
            found.iter().map(|(key, meta, i)| BlockRef { key: *key, meta: *meta, data: &bufs[*i] }).collect();
        let mut all_ok = vec![true; refs.len()];
        for tier in lower {
            for (j, r) in tier.put_batch(&refs).into_iter().enumerate() {
                if let Err(e) = r {
                    all_ok[j] = false;
                    counters.errors.add(1);
                    tracing::debug!(key = %refs[j].key, "write-through to {} failed: {e}", tier.kind());
                }
            }
        }
        let ok = all_ok.iter().filter(|o| **o).count() as u64;
        counters.written.add(ok);
        // A failed write-through leaves the block clean too: retrying a full or broken disk
        // would only pin G2. The failure is counted above.
        for (k, _, _) in &found {
            g2.mark_clean(k);
        }
        let mut n = pending.n.lock();
        *n = n.saturating_sub(keys.len() as u64);
        counters.depth.set(*n as f64);
        if *n == 0 {
            pending.idle.notify_all();
        }
    }
}
