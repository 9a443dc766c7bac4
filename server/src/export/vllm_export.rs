//! This node's tiers in vLLM's KV-event wire format (docs/router.md section 7, "Export"), for
//! routers that already consume vLLM events (Dynamo, llm-d): a ZMQ PUB socket sending
//! `BlockStored` / `BlockRemoved` with Dynamo's XXH3-64 chained hashes (seed 1337) and `medium`
//! set to the tier (`CPU_PINNED` for G2, `DISK` for G3).
//!
//! vLLM events carry the blocks' tokens and hashes derived from them, which our 128-bit keys do
//! not reveal. So a save records, for each block it stores, its Dynamo hash, its parent's, and
//! its tokens ([`VllmExport::note_save`]); the tier notifications then turn into events. The
//! record of a block lives while some tier holds it. The records of G3's blocks are also kept in
//! a file next to G3 ([`crate::export::vllm_origins`]), so the blocks G3 keeps across a restart are
//! exported again; a block with no record (saved by a daemon without the export, or whose record
//! a crash lost) is not exported: counted in `kvcached_vllm_export_unknown_total`.
//!
//! A PUB socket drops what it sent before a subscriber joined, so a router that starts (or
//! reconnects) after blocks were stored would never see them. Each time a subscriber connects,
//! the exporter therefore sends every block it holds a record of, parents before children
//! (`BlockStored` per tier; counted in `kvcached_vllm_export_snapshots_total`), paced so that the
//! socket does not drop it. Subscribers that were already there receive those events again,
//! which for a `BlockStored` changes nothing. No snapshot goes out before the daemon has
//! announced the blocks its tiers kept across a restart ([`VllmExport::announced`]): the socket
//! is bound earlier, and a subscriber joining in between would otherwise be sent a snapshot
//! without them, then only their live events, children before parents (which a consumer
//! drops as orphans).
//!
//! Tier notifications arrive under a tier's lock: they only append to a bounded channel
//! (`try_send`; a full channel drops the event and counts it in
//! `kvcached_vllm_export_dropped_total`); a task batches and sends.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvproto::vllm::{Encoding, ExtHash, VllmEvent, medium_of};
use kvproto::{BlockKey, TierKind};
use tokio::sync::{mpsc, watch};

use crate::error::ServerError;
use crate::export::vllm_origins::{self, Origin, OriginLog, Origins};
use crate::export::zmq_export::VllmExporter;

/// How a save's blocks are hashed for the export: the seed of their local hashes (Dynamo's
/// adapter seeding, [`kvproto::dynamo::request_seed`]), the adapter's name (sent as vLLM's
/// `lora_name`, so that a consumer recomputing hashes from the tokens seeds them too), and the
/// first block not exported (`kvcached_vllm_export_unknown_total`): one whose key binds a
/// multimodal input or a per-block extra, which Dynamo's hash cannot express, rather than
/// exported under the hash of other tokens' KV; and every block of a salted request, whose salt
/// vLLM's events would carry in the clear.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynamoTag {
    pub seed: u64,
    pub upto: usize,
    pub lora: Option<Arc<str>>,
}

impl DynamoTag {
    /// The tag of a save of `blocks` full blocks under `ctx`.
    pub fn of(ctx: Option<&kvproto::KeyContext>, tokens_per_block: usize, blocks: usize) -> Self {
        let Some(ctx) = ctx else { return Self { seed: kvproto::dynamo::DYNAMO_SEED, upto: usize::MAX, lora: None } };
        let upto = if ctx.cache_salt.is_some() {
            0
        } else {
            ctx.first_per_block_extra(tokens_per_block, blocks).unwrap_or(usize::MAX)
        };
        Self { seed: ctx.dynamo_seed(), upto, lora: ctx.adapter.as_ref().map(|a| Arc::from(a.name.as_str())) }
    }
}

/// Events waiting for the sending task.
const QUEUE: usize = 65_536;
/// Most events per ZMQ message.
const BATCH: usize = 512;
/// How long after a subscriber connects its snapshot goes out: its subscription has to arrive
/// first (a PUB socket sends a peer nothing before), and subscribers connecting together share
/// one snapshot.
const SNAPSHOT_DELAY: Duration = Duration::from_millis(300);
/// A second snapshot this long after a subscriber connects, for one whose subscription arrived
/// after the first went out (the socket does not say when it does): under load that is more
/// than [`SNAPSHOT_DELAY`]. A consumer that got the first reads the same blocks stored again.
const SNAPSHOT_AGAIN: Duration = Duration::from_secs(3);
/// Events per snapshot message, and the pause between two: ~64k events/s (~20 MB/s of 16-token
/// blocks), which a subscriber's socket drains without the PUB socket dropping messages.
const SNAPSHOT_CHUNK: usize = 64;
const SNAPSHOT_PACE: Duration = Duration::from_millis(1);
/// After this long without a message an empty batch goes out, so that subscribers can tell a
/// quiet exporter from a dropped connection (kvrouter connects afresh to a source silent for
/// its `idle_reconnect_s`, 5 s by default, and a new connection costs a snapshot here).
const KEEPALIVE: Duration = Duration::from_secs(1);

/// A block's record as a `BlockStored` of `tier`.
trait StoredEvent {
    fn stored_event(&self, tier: TierKind) -> VllmEvent;
}

impl StoredEvent for Origin {
    fn stored_event(&self, tier: TierKind) -> VllmEvent {
        VllmEvent::BlockStored {
            block_hashes: vec![ExtHash::Int(i128::from(self.hash))],
            parent_block_hash: self.parent.map(|p| ExtHash::Int(i128::from(p))),
            token_ids: self.tokens.to_vec(),
            block_size: self.tokens.len() as u32,
            lora_id: None,
            medium: Some(medium_of(tier).to_string()),
            lora_name: self.lora.as_deref().map(str::to_string),
            extra_keys: Vec::new(),
        }
    }
}

/// The exporter's state shared with the tier listener.
#[derive(Debug)]
pub struct VllmExport {
    origins: Arc<Origins>,
    /// Where the records of G3's blocks are kept across restarts (none without G3), and its
    /// writer once started ([`VllmExport::announced`]).
    log_path: Option<PathBuf>,
    log: OnceLock<OriginLog>,
    tx: mpsc::Sender<VllmEvent>,
    /// Set once the blocks kept across a restart are announced: snapshots wait for it.
    announced: watch::Sender<bool>,
    endpoint: String,
    replay_endpoint: Option<String>,
    dropped: metrics::Counter,
    unknown: metrics::Counter,
}

impl VllmExport {
    /// Binds the PUB socket at `endpoint` (e.g. `tcp://0.0.0.0:5557`) and starts the sending
    /// task on the current runtime. With `log_path` (next to G3), the records of the blocks G3
    /// kept across a restart are read back: those G3 still holds are exported again once it
    /// announces them; call [`VllmExport::announced`] after that (no snapshot goes out before).
    pub async fn start(
        endpoint: &str,
        topic: &str,
        replay: Option<(&str, u64)>,
        log_path: Option<PathBuf>,
    ) -> Result<Self, ServerError> {
        let mut exporter = VllmExporter::bind(endpoint, topic, Encoding::Tuple).await.map_err(|e| {
            ServerError::Config { field: "router.vllm_export".into(), reason: format!("cannot bind {endpoint}: {e}") }
        })?;
        let bound = exporter.endpoint().to_string();
        let replay_bound = match replay {
            Some((at, bytes)) => {
                let keep = usize::try_from(bytes).unwrap_or(usize::MAX);
                Some(exporter.serve_replay(at, keep).await.map_err(|e| ServerError::Config {
                    field: "router.vllm_export_replay".into(),
                    reason: format!("cannot bind {at}: {e}"),
                })?)
            }
            None => None,
        };
        let (tx, rx) = mpsc::channel::<VllmEvent>(QUEUE);
        let origins: Arc<Origins> = Arc::default();
        if let Some(path) = &log_path {
            let records = vllm_origins::load(path);
            let mut o = origins.lock();
            for r in records {
                o.entry(r.key).or_insert(Origin {
                    hash: r.hash,
                    parent: r.parent,
                    tokens: r.tokens,
                    lora: r.lora,
                    tiers: 0,
                });
            }
        }
        let joins = exporter.subscriber_joins(SNAPSHOT_AGAIN);
        let (announced, ready) = watch::channel(false);
        tokio::spawn(send_loop(exporter, rx, joins, Arc::clone(&origins), ready));
        tracing::info!(endpoint = %bound, replay = ?replay_bound, "exporting tier events in vLLM's format");
        Ok(Self {
            origins,
            log_path,
            log: OnceLock::new(),
            tx,
            announced,
            endpoint: bound,
            replay_endpoint: replay_bound,
            dropped: metrics::counter!("kvcached_vllm_export_dropped_total"),
            unknown: metrics::counter!("kvcached_vllm_export_unknown_total"),
        })
    }

    /// The bound endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay socket's bound endpoint, if one is served.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Waits until the records of G3's blocks queued so far are in the log (at shutdown, after
    /// the write-through has drained into G3).
    pub fn flush_log(&self, timeout: Duration) {
        if let Some(log) = self.log.get()
            && !log.flush(timeout)
        {
            tracing::warn!("the vLLM export's G3 records were not all written at shutdown");
        }
    }

    /// Once the tiers' blocks are announced: lets snapshots go out, forgets the records read
    /// back for blocks G3 no longer holds, rewrites the log with the rest and starts appending
    /// to it. A log that cannot be written is logged; the export itself goes on.
    pub fn announced(&self) {
        self.announced.send_replace(true);
        let Some(path) = &self.log_path else { return };
        self.origins.lock().retain(|_, o| o.tiers != 0);
        match OriginLog::start(path.clone(), Arc::clone(&self.origins)) {
            Ok(log) => {
                let _ = self.log.set(log);
            }
            Err(e) => tracing::warn!(
                path = %path.display(),
                "cannot keep the vLLM export's G3 records: {e}; G3 blocks will not be exported after a restart"
            ),
        }
    }

    /// Records the Dynamo hashes and tokens of blocks `keys[first..end]` of `tokens` (whole
    /// blocks of `tokens_per_block`), before they are saved; only those before `tag.upto`
    /// (the blocks after it have no Dynamo hash: they are not exported).
    pub fn note_save(
        &self,
        keys: &[BlockKey],
        tokens: &[u32],
        tokens_per_block: usize,
        first: usize,
        end: usize,
        tag: DynamoTag,
    ) {
        let seed = kvproto::dynamo::DYNAMO_SEED;
        let upto = end.min(keys.len()).min(tag.upto);
        let blocks: Vec<&[u32]> = tokens.chunks_exact(tokens_per_block.max(1)).take(upto).collect();
        // Hash the chain with no lock held; record only the blocks being saved.
        let mut parent = None;
        let mut fresh = Vec::with_capacity(blocks.len().saturating_sub(first));
        for (i, block) in blocks.iter().enumerate() {
            let hash = kvproto::dynamo::chain(parent, kvproto::dynamo::local_block_hash(block, tag.seed), seed);
            if i >= first {
                fresh.push((
                    keys[i],
                    Origin { hash, parent, tokens: (*block).into(), lora: tag.lora.clone(), tiers: 0 },
                ));
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
        let bit = 1 << tier.index();
        if tier == TierKind::G3Disk
            && o.tiers & bit == 0
            && let Some(log) = self.log.get()
        {
            log.append(*key, o);
        }
        o.tiers |= bit;
        let ev = o.stored_event(tier);
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

/// Sends the tiers' events as they come and, for each subscriber that joins, a snapshot of the
/// held blocks: built on a blocking thread, sent in small chunks at a bounded pace between live
/// batches (a PUB socket drops what a peer's queue cannot take, and a burst would crowd out the
/// live events of the subscribers already there). One snapshot at a time: subscribers joining
/// while one is built or sent get one more afterwards. None is built before `ready` (the
/// blocks kept across a restart are announced).
async fn send_loop(
    mut exporter: VllmExporter,
    mut rx: mpsc::Receiver<VllmEvent>,
    mut joins: mpsc::Receiver<()>,
    held: Arc<Origins>,
    ready: watch::Receiver<bool>,
) {
    let snapshots = metrics::counter!("kvcached_vllm_export_snapshots_total");
    let mut batch = Vec::with_capacity(BATCH);
    let mut building: Option<tokio::task::JoinHandle<Vec<VllmEvent>>> = None;
    let mut pending: std::collections::VecDeque<Vec<VllmEvent>> = std::collections::VecDeque::new();
    let mut again = false;
    let mut pace = tokio::time::interval(SNAPSHOT_PACE);
    pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let quiet = tokio::time::sleep(KEEPALIVE);
    tokio::pin!(quiet);
    let build = |held: &Arc<Origins>| {
        let held = Arc::clone(held);
        let mut ready = ready.clone();
        tokio::spawn(async move {
            // A closed channel (the export is going away) builds what there is.
            let _ = ready.wait_for(|r| *r).await;
            tokio::time::sleep(SNAPSHOT_DELAY).await;
            tokio::task::spawn_blocking(move || snapshot(&held)).await.unwrap_or_default()
        })
    };
    loop {
        tokio::select! {
            n = rx.recv_many(&mut batch, BATCH) => {
                if n == 0 {
                    break;
                }
                // A short pause gathers the rest of a save's events into the same message (only
                // what is there by then: waiting for more would hold this batch until the next
                // event, however late).
                tokio::time::sleep(Duration::from_millis(2)).await;
                while batch.len() < BATCH {
                    let Ok(ev) = rx.try_recv() else { break };
                    batch.push(ev);
                }
                if let Err(e) = exporter.publish(std::mem::take(&mut batch), None).await {
                    tracing::warn!("vLLM event export failed: {e}");
                }
                quiet.as_mut().reset(tokio::time::Instant::now() + KEEPALIVE);
            }
            () = &mut quiet => {
                // Nothing to say for a while: an empty batch tells subscribers the connection
                // is alive (kvrouter reconnects a source that stays silent).
                if let Err(e) = exporter.publish(Vec::new(), None).await {
                    tracing::warn!("vLLM event export failed: {e}");
                }
                quiet.as_mut().reset(tokio::time::Instant::now() + KEEPALIVE);
            }
            Some(()) = joins.recv() => {
                while joins.try_recv().is_ok() {}
                if building.is_some() || !pending.is_empty() {
                    again = true;
                } else {
                    building = Some(build(&held));
                }
            }
            built = async {
                match building.as_mut() {
                    Some(h) => h.await.unwrap_or_default(),
                    None => std::future::pending().await,
                }
            }, if building.is_some() => {
                building = None;
                snapshots.increment(1);
                tracing::info!(events = built.len(), "a subscriber joined: sending it the blocks held");
                let mut events = built.into_iter().peekable();
                while events.peek().is_some() {
                    pending.push_back(events.by_ref().take(SNAPSHOT_CHUNK).collect());
                }
            }
            _ = pace.tick(), if !pending.is_empty() => {
                if let Some(chunk) = pending.pop_front()
                    && let Err(e) = exporter.publish(chunk, None).await
                {
                    tracing::warn!("vLLM event export failed: {e}");
                }
                quiet.as_mut().reset(tokio::time::Instant::now() + KEEPALIVE);
            }
        }
        // A snapshot finished (built empty, or sent): the subscribers that joined meanwhile
        // get theirs now.
        if building.is_none() && pending.is_empty() && std::mem::take(&mut again) {
            building = Some(build(&held));
        }
    }
}

/// `BlockStored` for every block with a record and each tier holding it, parents before
/// children (a consumer links a block to its parent by hash).
fn snapshot(origins: &Origins) -> Vec<VllmEvent> {
    // Clones are cheap (the tokens are shared): the records' lock is held for a refcount each.
    let held: Vec<Origin> = origins.lock().values().filter(|o| o.tiers != 0).cloned().collect();
    // Depth of each block along the parents that are themselves held; iterative, as chains run
    // to thousands of blocks.
    let parent_of: HashMap<u64, Option<u64>> = held.iter().map(|h| (h.hash, h.parent)).collect();
    let mut depth: HashMap<u64, usize> = HashMap::with_capacity(held.len());
    for h in &held {
        let mut path = Vec::new();
        let mut at = h.hash;
        let base = loop {
            if let Some(&d) = depth.get(&at) {
                break d + 1;
            }
            path.push(at);
            match parent_of.get(&at).copied().flatten() {
                // The length bound stops a cycle (possible only through a hash collision).
                Some(p) if parent_of.contains_key(&p) && path.len() <= parent_of.len() => at = p,
                _ => break 0,
            }
        };
        for (i, k) in path.iter().rev().enumerate() {
            depth.insert(*k, base + i);
        }
    }
    let mut held = held;
    held.sort_by_key(|h| depth.get(&h.hash).copied().unwrap_or(0));
    let mut events = Vec::with_capacity(held.len());
    for h in held {
        for tier in TierKind::ALL.iter().filter(|t| h.tiers & (1 << t.index()) != 0) {
            events.push(h.stored_event(*tier));
        }
    }
    events
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use parking_lot::Mutex;

    fn key(i: u8) -> BlockKey {
        BlockKey([i; 16])
    }

    #[test]
    fn a_snapshot_sends_parents_before_children_once_per_tier() {
        let origins: Origins = Mutex::new(HashMap::default());
        // Chain 10 -> 11 -> ... -> 14 (hash = 10 + i), recorded children first; 11 is in G2 and
        // G3. A second, one-block chain 50; a record no tier holds (60) is left out.
        {
            let mut o = origins.lock();
            for i in (0..5u8).rev() {
                let parent = (i > 0).then(|| 10 + u64::from(i) - 1);
                let tiers = if i == 1 { 0b110 } else { 0b010 };
                o.insert(
                    key(i),
                    Origin {
                        hash: 10 + u64::from(i),
                        parent,
                        tokens: vec![u32::from(i); 16].into(),
                        lora: None,
                        tiers,
                    },
                );
            }
            o.insert(
                key(50),
                Origin { hash: 50, parent: Some(49), tokens: vec![5; 16].into(), lora: None, tiers: 0b010 },
            );
            o.insert(key(60), Origin { hash: 60, parent: None, tokens: vec![6; 16].into(), lora: None, tiers: 0 });
        }
        let events = snapshot(&origins);
        let stored: Vec<(u64, Option<u64>, String)> = events
            .iter()
            .map(|e| match e {
                VllmEvent::BlockStored { block_hashes, parent_block_hash, medium, .. } => {
                    let h = |x: &ExtHash| match x {
                        ExtHash::Int(v) => *v as u64,
                        other => panic!("unexpected hash {other:?}"),
                    };
                    (h(&block_hashes[0]), parent_block_hash.as_ref().map(h), medium.clone().unwrap_or_default())
                }
                other => panic!("unexpected event {other:?}"),
            })
            .collect();
        assert_eq!(stored.len(), 7, "{stored:?}");
        for (at, (hash, parent, _)) in stored.iter().enumerate() {
            if let Some(p) = parent.filter(|p| (10..15).contains(p)) {
                let parent_at = stored.iter().position(|(h, _, _)| *h == p).unwrap();
                assert!(parent_at < at, "{hash} before its parent {p}: {stored:?}");
            }
        }
        let media: Vec<&str> = stored.iter().filter(|(h, _, _)| *h == 11).map(|(_, _, m)| m.as_str()).collect();
        assert_eq!(media.len(), 2);
        assert!(media.contains(&medium_of(TierKind::G2Host)) && media.contains(&medium_of(TierKind::G3Disk)));
        assert!(!stored.iter().any(|(h, _, _)| *h == 60));
    }

    /// A save with a key context is recorded with Dynamo's hashes of that request: the adapter
    /// seeds the local hashes and is exported as `lora_name`; from the first block that binds an
    /// image nothing is recorded (Dynamo's hash cannot name it), so nothing is exported under
    /// another KV's hash; a salted request is not exported at all (its salt would travel).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn saves_with_key_contexts_are_recorded_with_their_own_dynamo_hashes() {
        use kvproto::{Adapter, KeyContext, MmInput};
        let export = VllmExport::start("tcp://127.0.0.1:0", "", None, None).await.unwrap();
        let tokens: Vec<u32> = (0..6 * 16).collect();
        let ctx = KeyContext {
            adapter: Some(Adapter { name: "sql".into(), content_hash: vec![9; 32] }),
            mm: vec![MmInput { hash: vec![1; 32], offset: 70, length: 10 }],
            ..Default::default()
        };
        let tag = DynamoTag::of(Some(&ctx), 16, 6);
        let seed = kvproto::dynamo::request_seed(Some(b"sql"), None);
        assert_eq!(tag, DynamoTag { seed, upto: 4, lora: Some("sql".into()) });
        let keys: Vec<BlockKey> = (0..6).map(key).collect();
        export.note_save(&keys, &tokens, 16, 0, 6, tag);
        let want = kvproto::dynamo::request_sequence_hashes(&tokens, 16, seed);
        {
            let origins = export.origins.lock();
            for (i, k) in keys.iter().enumerate() {
                match origins.get(k) {
                    Some(o) if i < 4 => {
                        assert_eq!(o.hash, want[i], "block {i}");
                        let VllmEvent::BlockStored { lora_name, .. } = o.stored_event(TierKind::G2Host) else {
                            panic!("not a BlockStored")
                        };
                        assert_eq!(lora_name.as_deref(), Some("sql"));
                    }
                    None if i >= 4 => {}
                    other => panic!("block {i}: {:?}", other.map(|o| o.hash)),
                }
            }
        }
        assert_ne!(want[0], kvproto::dynamo::sequence_hashes(&tokens, 16, kvproto::dynamo::DYNAMO_SEED)[0]);
        // A salted request: nothing recorded, so nothing exported.
        let salted = KeyContext { cache_salt: Some(b"tenant-a".to_vec()), ..Default::default() };
        let other: Vec<BlockKey> = (100..106).map(key).collect();
        export.note_save(&other, &tokens, 16, 0, 6, DynamoTag::of(Some(&salted), 16, 6));
        assert!(other.iter().all(|k| !export.origins.lock().contains_key(k)));
    }

    /// An export on a free port holding records (and no tier yet) of a chain of `n` blocks of
    /// 16 tokens.
    async fn export_with_records(n: u8) -> (VllmExport, Vec<BlockKey>) {
        let export = VllmExport::start("tcp://127.0.0.1:0", "", None, None).await.unwrap();
        let keys: Vec<BlockKey> = (0..n).map(key).collect();
        let tokens: Vec<u32> = (0..u32::from(n) * 16).collect();
        export.note_save(&keys, &tokens, 16, 0, n as usize, DynamoTag::of(None, 16, n as usize));
        (export, keys)
    }

    /// A subscriber whose subscription arrives after the first snapshot went out (a PUB socket
    /// sends a peer nothing before its subscription) gets the blocks from the second.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_subscriber_subscribing_late_is_sent_the_blocks_held_by_the_second_snapshot() {
        use zeromq::{Socket, SocketRecv};
        let (export, keys) = export_with_records(5).await;
        for k in &keys {
            export.stored(TierKind::G2Host, k);
        }
        export.announced();
        let mut sub = zeromq::SubSocket::new();
        sub.connect(export.endpoint()).await.unwrap();
        // Connected, but subscribed only after the first snapshot went out.
        tokio::time::sleep(SNAPSHOT_DELAY * 3).await;
        sub.subscribe("").await.unwrap();
        let mut seen = std::collections::HashSet::new();
        let deadline = tokio::time::Instant::now() + SNAPSHOT_AGAIN + Duration::from_secs(3);
        while seen.len() < keys.len() {
            let Ok(m) = tokio::time::timeout_at(deadline, sub.recv()).await else {
                panic!("{} of {} blocks after the second snapshot's time", seen.len(), keys.len());
            };
            for e in kvproto::vllm::decode_batch(m.unwrap().get(2).unwrap()).unwrap().events {
                if let VllmEvent::BlockStored { block_hashes, .. } = e {
                    seen.extend(block_hashes);
                }
            }
        }
    }

    /// A subscriber that joins while a restarted daemon is still starting (the socket is bound
    /// before the tiers' blocks are announced) is sent them all, parents first, once they are:
    /// not an empty snapshot followed by live events in key order, children before parents,
    /// which a consumer drops as orphans.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_subscriber_joining_before_the_announce_is_sent_the_kept_blocks_in_order() {
        use zeromq::{Socket, SocketRecv};
        // A chain of 5 blocks with records and no tier yet: what a restart reads back from the log.
        let (export, keys) = export_with_records(5).await;
        let mut sub = zeromq::SubSocket::new();
        sub.connect(export.endpoint()).await.unwrap();
        sub.subscribe("").await.unwrap();
        // Well past the snapshot's delay after the join, then the announce, children first.
        tokio::time::sleep(SNAPSHOT_DELAY * 3).await;
        for k in keys.iter().rev() {
            export.stored(TierKind::G3Disk, k);
        }
        export.announced();
        // A consumer as kvrouter's: a block whose parent it does not know is dropped.
        let mut known = std::collections::HashSet::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while known.len() < keys.len() {
            let Ok(m) = tokio::time::timeout_at(deadline, sub.recv()).await else {
                panic!("only {} of {} blocks linked to their parents", known.len(), keys.len());
            };
            let m = m.unwrap();
            for e in kvproto::vllm::decode_batch(m.get(2).unwrap()).unwrap().events {
                if let VllmEvent::BlockStored { block_hashes, parent_block_hash, .. } = e
                    && parent_block_hash.as_ref().is_none_or(|p| known.contains(p))
                {
                    known.extend(block_hashes);
                }
            }
        }
    }
}
