//! The tiers' changes, taken off their locks and off the request path.
//!
//! Tiers tell their listener of every block they gain and lose while holding their state lock
//! (so that the changes of one key arrive in the order they happened). [`Changes`] is that
//! listener for the hit reports and the vLLM-format export: it only puts each change on a
//! bounded queue, which one thread (`kv-changes`) drains into [`Reports`] (the publisher to
//! routers and the vLLM export, each with locks and queues of their own). A save's vLLM
//! records ([`Changes::saving`], [`Changes::unstored`]) go on the same queue, so a block's
//! record is always there before the tier reports it stored.
//!
//! When the queue is full the tier waits for room (counted in
//! `kvcached_changes_queue_full_total`) rather than lose a change: the thread takes no tier
//! lock, so the wait always ends. Tenants' quotas need no listener: the tiers apply them
//! (`kvtiers::quota`).

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::time::Duration;

use kvproto::{BlockKey, TierKind};
use kvtiers::{BlockMeta, TierListener};

use crate::export::reports::Reports;
use crate::export::vllm_export::DynamoTag;

/// Changes the queue holds at most (each some 80 bytes; a removal's keys apart).
pub const CAPACITY: usize = 64 * 1024;

/// One thing for the reporting thread to pass on.
enum Change {
    Stored {
        tier: TierKind,
        key: BlockKey,
        meta: BlockMeta,
    },
    Removed {
        tier: TierKind,
        keys: Vec<BlockKey>,
    },
    /// A save's blocks `keys[first..end]`, with their tokens, about to be stored.
    Saving {
        keys: Vec<BlockKey>,
        tokens: Vec<u32>,
        tokens_per_block: usize,
        first: usize,
        end: usize,
        tag: DynamoTag,
    },
    /// Blocks a save did not store after all.
    Unstored(Vec<BlockKey>),
    /// Answered once everything queued before it has been passed on.
    Settle(SyncSender<()>),
}

/// The tiers' listener for the hit reports and the vLLM-format export; see the module doc.
pub struct Changes {
    tx: SyncSender<Change>,
    exports_vllm: bool,
    full: metrics::Counter,
}

impl std::fmt::Debug for Changes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Changes").field("exports_vllm", &self.exports_vllm).finish_non_exhaustive()
    }
}

impl Changes {
    /// Starts thread `kv-changes`, passing every change on to `reports` in order. It ends once
    /// the last `Changes` is dropped and the queue is empty.
    pub fn start(reports: Arc<Reports>, capacity: usize) -> std::io::Result<Arc<Self>> {
        let (tx, rx) = std::sync::mpsc::sync_channel(capacity.max(1));
        let exports_vllm = reports.vllm().is_some();
        std::thread::Builder::new().name("kv-changes".into()).spawn(move || pass_on(&rx, &reports))?;
        Ok(Arc::new(Self { tx, exports_vllm, full: metrics::counter!("kvcached_changes_queue_full_total") }))
    }

    /// Whether saves should tell [`Changes::saving`] their tokens (a vLLM-format export is on).
    pub fn exports_vllm(&self) -> bool {
        self.exports_vllm
    }

    /// Blocks `keys[first..end]` of a save, whose `tokens` are whole blocks of
    /// `tokens_per_block`, are about to be stored: their vLLM records are made first. Saves
    /// call this only when [`Changes::exports_vllm`] (they decode the tokens for it).
    pub fn saving(
        &self,
        keys: &[BlockKey],
        tokens: Vec<u32>,
        tokens_per_block: usize,
        first: usize,
        end: usize,
        tag: DynamoTag,
    ) {
        let keys = keys[..end.min(keys.len())].to_vec();
        self.push(Change::Saving { keys, tokens, tokens_per_block, first, end, tag });
    }

    /// Blocks of a save that no tier took: their records go (called as [`Changes::saving`]).
    pub fn unstored(&self, keys: &[BlockKey]) {
        self.push(Change::Unstored(keys.to_vec()));
    }

    /// Waits (at most `timeout`) until every change queued before now has been passed on;
    /// false if it timed out.
    pub fn settle(&self, timeout: Duration) -> bool {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.push(Change::Settle(tx));
        rx.recv_timeout(timeout).is_ok()
    }

    /// Queues `c`, waiting for room when the queue is full (never losing a change).
    fn push(&self, c: Change) {
        match self.tx.try_send(c) {
            Ok(()) | Err(TrySendError::Disconnected(_)) => {}
            Err(TrySendError::Full(c)) => {
                self.full.increment(1);
                // The thread takes no lock a tier holds while calling here: room comes.
                let _ = self.tx.send(c);
            }
        }
    }
}

impl TierListener for Changes {
    fn stored(&self, tier: TierKind, key: BlockKey, meta: &BlockMeta) {
        self.push(Change::Stored { tier, key, meta: *meta });
    }

    fn removed(&self, tier: TierKind, keys: &[BlockKey]) {
        self.push(Change::Removed { tier, keys: keys.to_vec() });
    }
}

/// Thread `kv-changes`.
fn pass_on(rx: &Receiver<Change>, reports: &Reports) {
    while let Ok(c) = rx.recv() {
        match c {
            Change::Stored { tier, key, meta } => reports.stored(tier, key, &meta),
            Change::Removed { tier, keys } => reports.removed(tier, &keys),
            Change::Saving { keys, tokens, tokens_per_block, first, end, tag } => {
                if let Some(v) = reports.vllm() {
                    v.note_save(&keys, &tokens, tokens_per_block, first, end, tag);
                }
            }
            Change::Unstored(keys) => {
                if let Some(v) = reports.vllm() {
                    v.forget_unstored(&keys);
                }
            }
            Change::Settle(done) => {
                let _ = done.send(());
            }
        }
    }
}
