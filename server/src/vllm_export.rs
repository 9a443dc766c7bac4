//! This node's tiers in vLLM's KV-event wire format (docs/router.md section 7, "Export"), for
//! routers that already consume vLLM events (Dynamo, llm-d): a ZMQ PUB socket sending
//! `BlockStored` / `BlockRemoved` with Dynamo's XXH3-64 chained hashes (seed 1337) and `medium`
//! set to the tier (`CPU_PINNED` for G2, `DISK` for G3).
//!
//! vLLM events carry the blocks' tokens and hashes derived from them, which our 128-bit keys do
//! not reveal. So a save records, for each block it stores, its Dynamo hash, its parent's, and
//! its tokens ([`VllmExport::note_save`]); the tier notifications then turn into events. The
//! record of a block lives while some tier holds it. Blocks this daemon did not see saved (the
//! G3 contents kept across a restart) are not exported: counted in
//! `kvcached_vllm_export_unknown_total`.
//!
//! Tier notifications arrive under a tier's lock: they only append to a bounded channel
//! (`try_send`; a full channel drops the event and counts it in
//! `kvcached_vllm_export_dropped_total`); a task batches and sends.

use std::collections::HashMap;
use std::time::Duration;

use kvproto::{BlockKey, TierKind};
use kvrouter::vllm::{Encoding, ExtHash, VllmEvent, medium_of};
use kvrouter::zmq::VllmExporter;
use parking_lot::Mutex;
use tokio::sync::mpsc;

use crate::error::ServerError;

/// Events waiting for the sending task.
const QUEUE: usize = 65_536;
/// Most events per ZMQ message.
const BATCH: usize = 512;

#[derive(Debug)]
struct Origin {
    hash: u64,
    parent: Option<u64>,
    tokens: Box<[u32]>,
    /// Tiers holding the block (bit per `TierKind::index`).
    tiers: u8,
}

/// The exporter's state shared with the tier listener.
#[derive(Debug)]
pub struct VllmExport {
    origins: Mutex<HashMap<BlockKey, Origin, kvproto::key::BlockKeyBuildHasher>>,
    tx: mpsc::Sender<VllmEvent>,
    endpoint: String,
    dropped: metrics::Counter,
    unknown: metrics::Counter,
}

impl VllmExport {
    /// Binds the PUB socket at `endpoint` (e.g. `tcp://0.0.0.0:5557`) and starts the sending
    /// task on the current runtime.
    pub async fn start(endpoint: &str, topic: &str) -> Result<Self, ServerError> {
        let mut exporter = VllmExporter::bind(endpoint, topic, Encoding::Tuple).await.map_err(|e| {
            ServerError::Config { field: "router.vllm_export".into(), reason: format!("cannot bind {endpoint}: {e}") }
        })?;
        let bound = exporter.endpoint().to_string();
        let (tx, mut rx) = mpsc::channel::<VllmEvent>(QUEUE);
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(BATCH);
            while rx.recv_many(&mut batch, BATCH).await > 0 {
                // A short pause gathers the rest of a save's events into the same message.
                tokio::time::sleep(Duration::from_millis(2)).await;
                let room = BATCH.saturating_sub(batch.len());
                if room > 0 {
                    let _ = rx.recv_many(&mut batch, room).await;
                }
                if let Err(e) = exporter.publish(std::mem::take(&mut batch), None).await {
                    tracing::warn!("vLLM event export failed: {e}");
                }
            }
        });
        tracing::info!(endpoint = %bound, "exporting tier events in vLLM's format");
        Ok(Self {
            origins: Mutex::new(HashMap::default()),
            tx,
            endpoint: bound,
            dropped: metrics::counter!("kvcached_vllm_export_dropped_total"),
            unknown: metrics::counter!("kvcached_vllm_export_unknown_total"),
        })
    }

    /// The bound endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Records the Dynamo hashes and tokens of blocks `keys[first..end]` of `tokens` (whole
    /// blocks of `tokens_per_block`), before they are saved.
    pub fn note_save(&self, keys: &[BlockKey], tokens: &[u32], tokens_per_block: usize, first: usize, end: usize) {
        let seed = kvproto::dynamo::DYNAMO_SEED;
        let blocks: Vec<&[u32]> = tokens.chunks_exact(tokens_per_block.max(1)).take(end.min(keys.len())).collect();
        // Hash the chain with no lock held; record only the blocks being saved.
        let mut parent = None;
        let mut fresh = Vec::with_capacity(blocks.len().saturating_sub(first));
        for (i, block) in blocks.iter().enumerate() {
            let hash = kvproto::dynamo::chain(parent, kvproto::dynamo::local_block_hash(block, seed), seed);
            if i >= first {
                fresh.push((keys[i], Origin { hash, parent, tokens: (*block).into(), tiers: 0 }));
            }
            parent = Some(hash);
        }
        let mut origins = self.origins.lock();
        for (k, o) in fresh {
            origins.entry(k).or_insert(o);
        }
    }

    /// Forgets records of blocks that no tier took (their save failed).
    pub fn forget_unstored(&self, keys: &[BlockKey]) {
        let mut origins = self.origins.lock();
        for k in keys {
            if origins.get(k).is_some_and(|o| o.tiers == 0) {
                origins.remove(k);
            }
        }
    }

    fn send(&self, ev: VllmEvent) {
        if self.tx.try_send(ev).is_err() {
            self.dropped.increment(1);
        }
    }

    /// A tier now holds `key`.
    pub fn stored(&self, tier: TierKind, key: &BlockKey) {
        let mut origins = self.origins.lock();
        let Some(o) = origins.get_mut(key) else {
            self.unknown.increment(1);
            return;
        };
        o.tiers |= 1 << tier.index();
        let ev = VllmEvent::BlockStored {
            block_hashes: vec![ExtHash::Int(i128::from(o.hash))],
            parent_block_hash: o.parent.map(|p| ExtHash::Int(i128::from(p))),
            token_ids: o.tokens.to_vec(),
            block_size: o.tokens.len() as u32,
            lora_id: None,
            medium: Some(medium_of(tier).to_string()),
        };
        drop(origins);
        self.send(ev);
    }

    /// A tier no longer holds `keys`.
    pub fn removed(&self, tier: TierKind, keys: &[BlockKey]) {
        let mut hashes = Vec::new();
        {
            let mut origins = self.origins.lock();
            for k in keys {
                let Some(o) = origins.get_mut(k) else { continue };
                if o.tiers & (1 << tier.index()) != 0 {
                    hashes.push(ExtHash::Int(i128::from(o.hash)));
                }
                o.tiers &= !(1 << tier.index());
                if o.tiers == 0 {
                    origins.remove(k);
                }
            }
        }
        if !hashes.is_empty() {
            self.send(VllmEvent::BlockRemoved { block_hashes: hashes, medium: Some(medium_of(tier).to_string()) });
        }
    }

    /// Blocks with a record (held by some tier, or being saved).
    pub fn records(&self) -> usize {
        self.origins.lock().len()
    }
}
