//! LOAD: an engine asks for a chain's blocks in its slots. A load is
//! 1. plan: how far this node's own tiers hold the chain, and whether the rest is pulled from
//!    the peers the request names (or joins a pull already bringing it);
//! 2. load what this node holds: one [`BlockStore::load_into`] into the engine's slots
//!    ([`SlotSink`]), each block from the fastest tier holding it;
//! 3. fill the rest from the peers, block by block as each arrives in G2; if the pull comes up
//!    short, what G4 holds of the rest;
//! 4. tally: the status the engine waits for, and the tokens of prefill each tier saved.
//!
//! [`BlockStore::load_into`]: kvtiers::BlockStore::load_into
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvproto::{BlockKey, TierKind, pb};
use kvtiers::copy::{Copy, CopyEngine, CopyQueue, Direction};
use kvtiers::{BlockMeta, BlockStore, Destination, HeldBlock, LoadEnd, LoadError, LoadOptions, LoadReport, LoadSink};
use tokio::sync::watch;

use super::{Daemon, LOAD_CHUNK, LOAD_LEASE, MAX_SOURCES};
use crate::engine::{Engine, copy_failed};
use crate::error::ServerError;
use crate::peer::Incoming;

/// An engine's slots as a load's destination: block `i` of the load goes to slot
/// `slots[i]`. It keeps the load's status (blocks in, and from where) and publishes it as
/// PENDING after each chunk, or after each block while blocks arrive from a peer.
struct SlotSink<'a> {
    engine: &'a Engine,
    slots: &'a [u32],
    progress: &'a watch::Sender<pb::LoadStatus>,
    status: pb::LoadStatus,
    /// Blocks now come from a peer's pull (counted for the peer, whatever tier they landed in).
    pulling: bool,
    /// A GPU engine's copies in flight ([`Queued`]); None for a CPU engine.
    queued: Option<Queued<'a>>,
}

/// The copies of a load into a GPU engine, queued on its streams: each block's G2 pages held
/// until its copy completed; the first failure, reported by the next `fill` or `flush`.
struct Queued<'a> {
    store: &'a BlockStore,
    /// The load's keys (block `i` of the sink is `keys[i]`).
    keys: &'a [BlockKey],
    queue: CopyQueue<'a, HeldBlock, Finished<'a>>,
    failed: Rc<RefCell<Option<kvtiers::TierError>>>,
}

/// What a queued load does with a block whose copy finished.
type Finished<'a> = Box<dyn FnMut(HeldBlock, kvtiers::Result<()>) + 'a>;

impl<'a> Queued<'a> {
    fn new(store: &'a BlockStore, keys: &'a [BlockKey], dev: &'a dyn CopyEngine) -> Self {
        let failed = Rc::new(RefCell::new(None));
        let first = Rc::clone(&failed);
        let done = Box::new(move |_held: HeldBlock, copied: kvtiers::Result<()>| {
            if let Err(e) = copied {
                first.borrow_mut().get_or_insert(e);
            }
        });
        Self { store, keys, queue: CopyQueue::new(dev, LOAD_CHUNK, done), failed }
    }

    /// The first copy that failed, as the load's error.
    fn check(&self, engine: &Engine) -> Result<(), ServerError> {
        match self.failed.borrow_mut().take() {
            Some(e) => Err(copy_failed("load", engine.id, &e).into()),
            None => Ok(()),
        }
    }
}

impl<'a> SlotSink<'a> {
    fn new(engine: &'a Engine, slots: &'a [u32], progress: &'a watch::Sender<pb::LoadStatus>) -> Self {
        Self { engine, slots, progress, status: pb::LoadStatus::default(), pulling: false, queued: None }
    }

    /// Queues the copies of a GPU engine's loads from `store` of `keys` on its streams.
    fn queued(mut self, store: &'a BlockStore, keys: &'a [BlockKey]) -> Self {
        self.queued = self.engine.device().map(|dev| Queued::new(store, keys, dev));
        self
    }
}

impl SlotSink<'_> {
    fn tell(&self) {
        let st = pb::LoadStatus { state: pb::load_status::State::Pending as i32, ..self.status.clone() };
        self.progress.send_replace(st);
    }
}

impl LoadSink for SlotSink<'_> {
    type Error = ServerError;

    fn accepts(&self, _i: usize, meta: &BlockMeta) -> bool {
        // Defence in depth: keys already bind the namespace, but a block of another namespace
        // or size is never copied into an engine.
        meta.namespace == self.engine.namespace_id && meta.len == self.engine.block_bytes()
    }

    fn fill(&mut self, i: usize, pieces: &[&[u8]]) -> Result<(), ServerError> {
        if let Some(q) = self.queued.as_mut() {
            q.check(self.engine)?;
            // Queued where the pieces are the G2 block's own pages, held until the copy is
            // done; pieces of a buffer (a block G2 had no room for, a peer's) are copied
            // synchronously.
            if let Some(held) = q.store.hold(&q.keys[i]).filter(|h| same_memory(&h.ranges(), pieces)) {
                let copies = Copy::zip(Direction::ToDevice, &self.engine.segment_ranges(self.slots[i]), &held.ranges())
                    .map_err(|e| ServerError::Invalid(e.to_string()))?;
                // SAFETY: the copies read the held block's pages, which the queue keeps (as
                // `held`) until they completed; a committed G2 block is never written.
                unsafe { q.queue.push(&copies, held) };
                return Ok(());
            }
        }
        self.engine.write_slot_from(self.slots[i], pieces)
    }

    fn streams(&self) -> bool {
        // A GPU engine's copies are queued from blocks G2 holds: a block coming up from a lower
        // tier is taken once G2 has it, not from its reservation (which could only be copied
        // block by block, synchronously).
        self.queued.is_none()
    }

    fn done(&mut self, _i: usize, from: TierKind) {
        let st = &mut self.status;
        st.loaded_blocks += 1;
        match from {
            _ if self.pulling => st.from_peer += 1,
            TierKind::G4Object => st.from_g4 += 1,
            TierKind::G3Disk => st.from_g3 += 1,
            _ => st.from_g2 += 1,
        }
    }

    fn chunk_done(&mut self) {
        self.tell();
    }

    fn flush(&mut self) -> Result<(), ServerError> {
        match self.queued.as_mut() {
            Some(q) => {
                q.queue.drain();
                q.check(self.engine)
            }
            None => Ok(()),
        }
    }

    fn direct(&self, i: usize) -> Option<Destination<'_>> {
        let pieces = self.engine.slot_memory(self.slots[i])?;
        // SAFETY: the slot's segments are this engine's mapped memory (range-checked at attach
        // and by `check_slots`), mapped for as long as the engine (borrowed for 'a) lives, and
        // the daemon's alone while this load runs (the engine protocol); a page the engine
        // truncates away fails the read or trips the fault guard, which `check` reads right
        // after.
        Some(unsafe { Destination::new(pieces) })
    }

    fn check(&self) -> Result<(), ServerError> {
        self.engine.check_memory()
    }

    fn copy_back(&self, i: usize, dst: &mut [&mut [u8]]) -> bool {
        self.engine.read_slot_into(self.slots[i], dst).is_ok()
    }
}

/// Whether a held block's pages are the very pieces a load was handed.
fn same_memory(held: &[(usize, usize)], pieces: &[&[u8]]) -> bool {
    held.len() == pieces.len() && held.iter().zip(pieces).all(|(&(p, n), q)| p == q.as_ptr() as usize && n == q.len())
}

fn failed<E>(e: LoadError<E>) -> E
where
    E: From<kvtiers::TierError>,
{
    match e {
        LoadError::Sink(e) => e,
        LoadError::Tier(e) => e.into(),
    }
}

impl Daemon {
    /// Runs a load to completion (on a blocking thread) and publishes its status.
    pub fn run_load(&self, op: u64, engine: &Engine, req: &pb::LoadRequest, tx: &watch::Sender<pb::LoadStatus>) {
        // A load that panicked still finishes (failed): its engine's pending count, and the
        // wait at shutdown, must not count it for ever.
        let mut settle = None;
        let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.load_blocks(op, engine, req, tx, &mut settle)
        }))
        .unwrap_or_else(|_| {
            Err(ServerError::Io(std::io::Error::other("the load failed inside kvcached (see its log)")))
        });
        let status = match loaded {
            Ok(s) => s,
            Err(e) => pb::LoadStatus {
                op_id: op,
                state: pb::load_status::State::Failed as i32,
                error: e.to_string(),
                ..Default::default()
            },
        };
        let tpb = u64::from(engine.namespace.layout.tokens_per_block);
        for (tier, blocks) in
            [("g2", status.from_g2), ("g3", status.from_g3), ("g4", status.from_g4), ("peer", status.from_peer)]
        {
            if blocks > 0 {
                metrics::counter!("kvcached_prefill_tokens_saved_total", "tier" => tier, "kv_namespace" => engine.kv_label.clone())
                    .increment(u64::from(blocks) * tpb);
            }
        }
        self.ops.lock().finish(op, self.max_pending);
        self.loads.fetch_add(1, Ordering::Relaxed);
        let _ = tx.send(status);
        // Blocks read from below straight into the engine's slots come up into G2 now, after
        // the engine was told: copied back out of its slots and checked against the sum they
        // were read with (the engine may have written them since; then they stay below).
        if let Some((keys, report)) = settle {
            let sink = SlotSink::new(engine, &req.block_ids, tx);
            self.store.settle(&keys, &report.direct, &sink);
        }
    }

    /// Copies the blocks into the engine's slots (plan, load, fill from peers, tally: see the
    /// module's introduction). Blocks read from a lower tier straight into the slots (not
    /// through G2) are left in `settle` (the keys and the load's report), for the caller to
    /// bring up into G2 once the engine has been told.
    fn load_blocks(
        &self,
        op: u64,
        engine: &Engine,
        req: &pb::LoadRequest,
        progress: &watch::Sender<pb::LoadStatus>,
        settle: &mut Option<(Vec<BlockKey>, LoadReport)>,
    ) -> Result<pb::LoadStatus, ServerError> {
        let src = kvproto::convert::key_source(req.context.as_ref(), req.engine_hashes.as_ref())?;
        let keys = self.keys_in(engine, &req.tokens, &src)?;
        Self::span(engine, keys.len(), req.first_block, &req.block_ids)?;
        let first = req.first_block as usize;
        let wanted = keys[first..first + req.block_ids.len()].to_vec();
        let lease = self.store.pin(&wanted, LOAD_LEASE);
        let status = pb::LoadStatus { op_id: op, state: pb::load_status::State::Done as i32, ..Default::default() };
        let mut sink =
            SlotSink { status, ..SlotSink::new(engine, &req.block_ids, progress) }.queued(&self.store, &wanted);
        // 1. Plan.
        let incoming = self.plan_pulls(engine, req, &wanted);
        let local = incoming.as_ref().map_or(wanted.len(), |inc| inc.offset);
        // Into a CPU engine, blocks below G2 are read straight into its slots (one read and
        // one check, no copy through G2).
        let direct = req.block_ids.first().is_some_and(|&b| engine.slot_memory(b).is_some());
        let opts = LoadOptions { chunk: LOAD_CHUNK, direct };
        // 2. What this node holds.
        let loaded = self.store.load_into(&wanted[..local], 0, &mut sink, &opts);
        let report = match loaded {
            Ok(r) => r,
            Err(e) => {
                self.store.release(lease);
                return Err(failed(e));
            }
        };
        let mut end = report.end;
        if !report.direct.is_empty() {
            *settle = Some((wanted.clone(), report));
        }
        // 3. The rest from the peers (then G4).
        if let (Some(inc), LoadEnd::Whole) = (&incoming, end) {
            end = match self.fill_from_peer(engine, inc, &wanted, &mut sink) {
                Ok(end) => end,
                Err(e) => {
                    self.store.release(lease);
                    return Err(e);
                }
            };
        }
        self.store.release(lease);
        // 4. Tally.
        if end == LoadEnd::Mismatch {
            self.namespace_mismatch.increment(1);
            if let Some(key) = wanted.get(sink.status.loaded_blocks as usize) {
                tracing::warn!(%key, engine = engine.id, "block namespace or size differs from the engine's; served as a miss");
            }
        }
        Ok(sink.status)
    }

    /// The peer part of a load: a pull of the blocks past what this node's own tiers hold,
    /// started from the sources the request names or joined; none when no source is usable.
    /// Without one, what G4 holds of the rest is looked for instead.
    fn plan_pulls(&self, engine: &Engine, req: &pb::LoadRequest, wanted: &[BlockKey]) -> Option<Incoming> {
        let peers = self.peers.as_ref().filter(|_| !req.sources.is_empty())?;
        let sources: Vec<String> = req.sources.iter().take(MAX_SOURCES).cloned().collect();
        let deadline = Instant::now() + Duration::from_millis(peers.config().pull_deadline_ms);
        let local = crate::peer::handoff::local_end(&self.store, wanted);
        let incoming =
            Incoming::plan(peers, engine.namespace_id, wanted, local, engine.block_bytes(), &sources, deadline);
        if incoming.is_none() && local < wanted.len() && self.store.has_remote_tier() {
            // No pull started (each source refused, marked bad, or the pulls busy): what G4
            // holds of the rest is the next best, as after a failed pull.
            self.store.probe_lower(engine.namespace_id, &wanted[local..]);
        }
        incoming
    }

    /// Copies the pulled blocks into the slots as each arrives in G2. When the peer is gone,
    /// stalls, sends wrong bytes or lacks the rest, what G4 has of it is the next best; beyond
    /// that, a miss.
    fn fill_from_peer(
        &self,
        engine: &Engine,
        inc: &Incoming,
        wanted: &[BlockKey],
        sink: &mut SlotSink<'_>,
    ) -> Result<LoadEnd, ServerError> {
        let one = LoadOptions { chunk: 1, direct: false };
        for j in inc.offset..wanted.len() {
            if !inc.wait(j) {
                if self.store.has_remote_tier() {
                    self.store.probe_lower(engine.namespace_id, &wanted[j..]);
                }
                let rest = LoadOptions { chunk: LOAD_CHUNK, direct: false };
                return Ok(self.store.load_into(wanted, j, sink, &rest).map_err(failed)?.end);
            }
            sink.pulling = true;
            let r = self.store.load_into(&wanted[..=j], j, sink, &one).map_err(failed)?;
            sink.pulling = false;
            if r.end != LoadEnd::Whole {
                return Ok(r.end);
            }
        }
        Ok(LoadEnd::Whole)
    }
}
