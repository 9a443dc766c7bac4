//! The daemon's request logic, independent of the transport: save, lookup, load and their
//! bookkeeping. Copies run on blocking threads; the gRPC layer (`service.rs`) only translates.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvproto::{BlockKey, KeySource, TierKind, pb};
use kvtiers::copy::{Copy, CopyEngine, CopyQueue, Direction};
use kvtiers::{BlockMeta, BlockStore};
use parking_lot::Mutex;
use tokio::sync::watch;

use crate::engine::key_memo::KeyMemo;
use crate::engine::prefix_probe::{PrefixProber, Probing};
use crate::engine::{Engine, Registry, copy_failed};
use crate::error::ServerError;
use crate::export::reports::{GpuChange, Reports};
use crate::export::vllm_export::DynamoTag;
use crate::peer::{Incoming, Peers};
use crate::policy::limits::{Held, Limits, Principal};

mod load;

/// What a prefetch started (`POST /prefetch`'s answer).
#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct PrefetchStarted {
    /// Blocks of the chain this node holds (brought up into G2 where below it).
    pub local: usize,
    /// Blocks being pulled from peers.
    pub pulling: usize,
}

/// How long blocks being loaded stay pinned at most (a crashed load releases them after this).
const LOAD_LEASE: Duration = Duration::from_secs(30);

/// Blocks of a load brought up from G3 in one batch read (bounds the buffers a load holds).
const LOAD_CHUNK: usize = 16;

/// Blocks of a GPU engine's save in flight on its streams at once: enough to keep the copy
/// engines busy while the next blocks' pages are reserved (a block is 0.25-2 MiB).
pub(crate) const SAVE_DEPTH: usize = 16;
/// Peers one load may name.
const MAX_SOURCES: usize = 8;

/// A load in progress or finished.
#[derive(Debug)]
struct Op {
    engine: u64,
    status: watch::Receiver<pb::LoadStatus>,
}

/// One engine's loads: how many are pending, and its finished ones oldest first (each with the
/// time it finished), kept for `Wait` up to the retention and at most `max_pending` of them.
#[derive(Debug, Default)]
struct EngineOps {
    pending: usize,
    finished: std::collections::VecDeque<(u64, Instant)>,
}

/// Every engine's loads, bounded per engine: at most `max_pending` pending and `max_pending`
/// finished (so a client that loads fast cannot grow them for the retention's length), counted
/// per engine so that starting a load does not scan them.
#[derive(Debug, Default)]
struct Ops {
    by_id: HashMap<u64, Op>,
    per_engine: HashMap<u64, EngineOps>,
}

impl Ops {
    fn start(&mut self, op: u64, engine: u64, status: watch::Receiver<pb::LoadStatus>) {
        self.by_id.insert(op, Op { engine, status });
        self.per_engine.entry(engine).or_default().pending += 1;
    }

    fn finish(&mut self, op: u64, keep: usize) {
        let Some(engine) = self.by_id.get(&op).map(|o| o.engine) else { return };
        let e = self.per_engine.entry(engine).or_default();
        e.pending = e.pending.saturating_sub(1);
        e.finished.push_back((op, Instant::now()));
        while e.finished.len() > keep {
            if let Some((old, _)) = e.finished.pop_front() {
                self.by_id.remove(&old);
            }
        }
    }

    /// Loads not yet finished, over every engine.
    fn pending(&self) -> usize {
        self.per_engine.values().map(|e| e.pending).sum()
    }

    /// Forgets finished loads older than `retention`, and engines with no load left.
    fn expire(&mut self, now: Instant, retention: Duration) {
        let by_id = &mut self.by_id;
        self.per_engine.retain(|_, e| {
            while e.finished.front().is_some_and(|(_, t)| now.duration_since(*t) >= retention) {
                if let Some((old, _)) = e.finished.pop_front() {
                    by_id.remove(&old);
                }
            }
            e.pending > 0 || !e.finished.is_empty()
        });
    }
}

/// Shared state of one daemon.
#[derive(Debug)]
pub struct Daemon {
    pub store: Arc<BlockStore>,
    pub engines: Registry,
    pub reports: Arc<Reports>,
    pub limits: Arc<Limits>,
    ops: Mutex<Ops>,
    next_op: AtomicU64,
    max_pending: usize,
    retention: Duration,
    pub saves: AtomicU64,
    pub loads: AtomicU64,
    /// Whether lookups ask G4 past what the tiers' indexes know (`g4.lookup_probe`).
    pub g4_lookup_probe: bool,
    /// G4's write-through queue capacity (0: no G4), for `/healthz`.
    pub g4_queue: usize,
    /// Peer daemons this one pulls from (and their measured links).
    pub peers: Option<Arc<Peers>>,
    /// The queue carrying the tiers' changes (and saves' vLLM records) to the hit reports,
    /// when reports or a vLLM export are on.
    pub changes: Option<Arc<crate::export::changes::Changes>>,
    namespace_mismatch: metrics::Counter,
    key_memo: KeyMemo,
    /// Probes long prompts' keys while lookups derive them (thread `kv-probe`).
    prober: PrefixProber,
    /// Matched prefixes whose G2 blocks a lookup marks used, for thread `kv-g2-touch`: the
    /// recency update (~0.15 ms for 8192 blocks here) happens after the reply, not before.
    /// Bounded; when it is full (or the thread is gone) the lookup touches them itself.
    touch_later: Option<std::sync::mpsc::SyncSender<Vec<kvproto::BlockKey>>>,
    /// Joined when the daemon is dropped: the thread holds the store, and a store closed on it
    /// while the process exits raced RocksDB's teardown (a rare SIGABRT after a clean SIGTERM).
    toucher: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.touch_later = None; // its loop ends once the queue is empty
        if let Some(t) = self.toucher.take() {
            let _ = t.join();
        }
    }
}

/// Lookups whose recency updates may wait for `kv-g2-touch` at once.
const TOUCH_QUEUE: usize = 64;

fn to_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl Daemon {
    pub fn new(
        store: Arc<BlockStore>,
        engines: Registry,
        reports: Arc<Reports>,
        limits: Arc<Limits>,
        max_pending: usize,
        retention: Duration,
        key_memo_bytes: usize,
    ) -> Self {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<kvproto::BlockKey>>(TOUCH_QUEUE);
        let toucher = Arc::clone(&store);
        let touch_later = std::thread::Builder::new()
            .name("kv-g2-touch".into())
            .spawn(move || {
                // Ends when the daemon (the only sender) is dropped.
                while let Ok(keys) = rx.recv() {
                    toucher.touch_prefix(&keys);
                }
            })
            .map_err(|e| tracing::warn!("lookups will mark their blocks used inline: {e}"))
            .ok();
        let prober = PrefixProber::start(Arc::clone(&store));
        let (touch_later, toucher) = match touch_later {
            Some(t) => (Some(tx), Some(t)),
            None => (None, None),
        };
        Self {
            store,
            engines,
            reports,
            limits,
            ops: Mutex::new(Ops::default()),
            // Like engine ids, op ids start from a time-derived value: a client that asks a
            // restarted daemon about a load of its previous life gets "unknown load", never the
            // status of another load that happens to have the same number.
            next_op: AtomicU64::new(crate::engine::time_seeded_id()),
            max_pending,
            retention,
            saves: AtomicU64::new(0),
            loads: AtomicU64::new(0),
            g4_lookup_probe: true,
            g4_queue: 0,
            peers: None,
            changes: None,
            namespace_mismatch: metrics::counter!("kvcached_load_mismatch_total"),
            key_memo: KeyMemo::new(key_memo_bytes),
            prober,
            touch_later,
            toucher,
        }
    }

    /// Keys of every full block of `tokens` (wire form) in `engine`'s namespace, reusing the
    /// keys of a recent request for the same prompt where its tokens agree.
    fn keys(&self, engine: &Engine, tokens: &[u8]) -> Result<Vec<kvproto::BlockKey>, ServerError> {
        kvproto::check_tokens_le(tokens)?;
        Ok(self.key_memo.keys(&engine.fingerprint, engine.namespace.layout.tokens_per_block as usize, tokens))
    }

    /// [`Daemon::keys`] of a request with a key context (`docs/block-keys.md` section 6),
    /// derived directly (the memo holds plain chains only).
    fn keys_in(&self, engine: &Engine, tokens: &[u8], src: &KeySource) -> Result<Vec<kvproto::BlockKey>, ServerError> {
        let tpb = engine.namespace.layout.tokens_per_block as usize;
        match src {
            KeySource::Plain => self.keys(engine, tokens),
            KeySource::Context(ctx) => {
                kvproto::check_tokens_le(tokens)?;
                let keys = kvproto::context_keys_le(&engine.fingerprint, tpb, tokens, ctx);
                metrics::counter!("kvcached_block_keys_total", "source" => "context").increment(keys.len() as u64);
                Ok(keys)
            }
            KeySource::Hashes(h) => {
                kvproto::check_tokens_le(tokens)?;
                let keys = h.keys_le(&engine.fingerprint, tpb, tokens)?;
                metrics::counter!("kvcached_block_keys_total", "source" => "engine_hashes")
                    .increment(keys.len() as u64);
                Ok(keys)
            }
        }
    }

    /// Checks that `first + ids.len()` blocks are covered by the full blocks of `tokens`.
    fn span(engine: &Engine, keys: usize, first: u32, ids: &[u32]) -> Result<(), ServerError> {
        engine.check_slots(ids)?;
        let end = first as usize + ids.len();
        if end > keys {
            return Err(ServerError::Invalid(format!(
                "blocks {first}..{end} named, but the tokens hold only {keys} full blocks of {} tokens",
                engine.namespace.layout.tokens_per_block
            )));
        }
        Ok(())
    }

    /// Saves engine blocks into the store (gathering each block's segments in one copy).
    pub fn save(&self, req: &pb::SaveRequest, who: Principal) -> Result<pb::SaveResponse, ServerError> {
        let engine = self.engines.get(req.engine_id, who)?;
        if !engine.may_write {
            // The trust model (`tenants.rs`): its tenant reads this namespace, another writes it.
            metrics::counter!("kvcached_namespace_refused_total", "op" => "save").increment(1);
            return Err(ServerError::Denied(format!(
                "{} may read namespace {} but not write it: its writers are named in [[namespaces]] \
                 (docs/operations/security-clients.md, \"Who may read and write a namespace\")",
                self.engines.tenants().tenant_of(who),
                engine.namespace_id
            )));
        }
        let src = kvproto::convert::key_source(req.context.as_ref(), req.engine_hashes.as_ref())?;
        let keys = self.keys_in(&engine, &req.tokens, &src)?;
        Self::span(&engine, keys.len(), req.first_block, &req.block_ids)?;
        let end = req.first_block as usize + req.block_ids.len();
        // The vLLM export's records of these blocks, made on the reporting thread (of a token
        // chain: engine hashes carry no tokens to hash the vLLM way).
        let export = self.changes.as_ref().filter(|c| c.exports_vllm() && src.is_token_chain());
        // The blocks are charged to the saver's tenant: where it has a quota, the tiers make
        // its room among its own blocks (`kvtiers::quota`).
        let owner = self.engines.tenants().index_of(who).and_then(|t| u32::try_from(t).ok());
        if let Some(c) = export {
            let tpb = engine.namespace.layout.tokens_per_block as usize;
            let tag = DynamoTag::of(src.context(), tpb, keys.len());
            c.saving(&keys, kvproto::tokens_from_le(&req.tokens)?, tpb, req.first_block as usize, end, tag);
        }
        // A token chain's block has its prefix as its parent; an engine hash's stands alone (a
        // vLLM offloading job may hold chunks of several requests).
        let chained = src.is_token_chain();
        let blocks = SaveBlocks { engine: &engine, keys: &keys, req, owner, chained };
        let resp = match engine.device() {
            Some(dev) => self.save_queued(&blocks, dev),
            None => self.save_copied(&blocks),
        };
        if let Some(c) = export
            && resp.failed > 0
        {
            c.unstored(&keys[req.first_block as usize..end]);
        }
        self.saves.fetch_add(1, Ordering::Relaxed);
        Ok(resp)
    }

    /// A CPU engine's save: each block gathered from the engine's mapped segments straight
    /// into its G2 pages, one copy, block after block.
    fn save_copied(&self, b: &SaveBlocks<'_>) -> pb::SaveResponse {
        let mut resp = pb::SaveResponse::default();
        let mut over_quota = false;
        for (i, &slot) in b.req.block_ids.iter().enumerate() {
            // Past a block the quota refused, the rest of the chain could only be stored by
            // removing its own prefix: refused too, without asking.
            if over_quota {
                resp.failed += 1;
                continue;
            }
            let (key, meta) = b.block(i);
            let put = self.store.put_with(key, meta, |dst| {
                b.engine.read_slot_into(slot, dst).map_err(|e| kvtiers::TierError::Fill(e.to_string()))
            });
            crate::sched::between_copies(meta.len);
            tally(&mut resp, put, &mut over_quota);
        }
        resp
    }

    /// A GPU engine's save: each block's G2 pages reserved and its copies queued on the
    /// engine's streams, up to [`SAVE_DEPTH`] blocks in flight, the next block prepared while
    /// the DMA engines move the last. A block becomes visible only once its copies completed;
    /// one whose copy failed is dropped, never served, and counted
    /// (`kvcached_g1_copy_failures_total`).
    fn save_queued(&self, b: &SaveBlocks<'_>, dev: &dyn CopyEngine) -> pb::SaveResponse {
        let resp = std::cell::RefCell::new(pb::SaveResponse::default());
        let mut over_quota = false;
        let mut queue = CopyQueue::new(dev, SAVE_DEPTH, |fill: kvtiers::Filling, copied: kvtiers::Result<()>| {
            let put = match copied {
                Ok(()) => self.store.finish_put(fill),
                Err(e) => {
                    self.store.fail_put(fill);
                    Err(copy_failed("save", b.engine.id, &e))
                }
            };
            tally(&mut resp.borrow_mut(), put, &mut false);
        });
        // Keys queued by this save: a key named twice (engine hashes may repeat a chunk) waits
        // for its first copy, which only this thread can finish.
        let mut queued = std::collections::HashSet::with_capacity(b.req.block_ids.len());
        for (i, &slot) in b.req.block_ids.iter().enumerate() {
            if over_quota {
                resp.borrow_mut().failed += 1;
                continue;
            }
            let (key, meta) = b.block(i);
            if !queued.insert(key) {
                queue.drain();
            }
            let fill = match self.store.begin_put(key, meta) {
                Ok(Some(fill)) => fill,
                Ok(None) => {
                    resp.borrow_mut().already_present += 1;
                    continue;
                }
                Err(e) => {
                    tally(&mut resp.borrow_mut(), Err(e), &mut over_quota);
                    continue;
                }
            };
            let host: Vec<(usize, usize)> = fill.pieces().iter().map(|&(p, n)| (p as usize, n)).collect();
            match Copy::zip(Direction::ToHost, &b.engine.segment_ranges(slot), &host) {
                // SAFETY: the copies land in the reservation's own pages, which the queue keeps
                // (as `fill`) until they completed; nobody else sees them before `finish_put`.
                Ok(copies) => unsafe { queue.push(&copies, fill) },
                Err(e) => {
                    self.store.fail_put(fill);
                    tally(&mut resp.borrow_mut(), Err(e), &mut over_quota);
                }
            }
        }
        drop(queue);
        resp.into_inner()
    }

    pub fn lookup(&self, req: &pb::LookupRequest, who: Principal) -> Result<pb::LookupResponse, ServerError> {
        let engine = self.engines.get(req.engine_id, who)?;
        let mut tokens = engine.request_tokens(&req.tokens, req.tokens_at.as_ref())?;
        if !tokens.len().is_multiple_of(4) {
            return Err(kvproto::ProtoError::TokenBytes(tokens.len()).into());
        }
        let src = kvproto::convert::key_source(req.context.as_ref(), req.engine_hashes.as_ref())?;
        if req.first_block > 0 {
            return self.lookup_from(&engine, &mut tokens, &src, req.first_block as usize);
        }
        let (keys, m) = if req.route_id.is_some() || !src.is_plain() {
            // The outcome report needs the keys past the engine's own G1 blocks: all of them.
            // A copy that faulted is not remembered by the key memo either: checked first.
            // A key context's chain is derived whole too (the memo holds plain chains), and so
            // are engine hashes' keys.
            let keys = self.keys_in(&engine, tokens.all_checked()?, &src)?;
            let m = BlockStore::count_prefix(&self.store.held_prefix(&keys));
            (keys, m)
        } else {
            // Keys only as far as the cached prefix reaches: a prompt whose first blocks are not
            // cached derives one chunk, not its whole chain.
            let (mut held, mut missed) = (Vec::<u8>::new(), false);
            let tpb = engine.namespace.layout.tokens_per_block as usize;
            let blocks = tokens.len() / (4 * tpb);
            // The first chunk is probed here (a prompt not cached at all stops after it); the
            // chunks after it by `kv-probe` while the chain goes on, where it is free.
            let mut shared: Option<Probing<'_>> = None;
            let keys = self.key_memo.keys_while(&engine.fingerprint, tpb, &mut tokens, |keys| {
                if let Some(p) = shared.as_mut() {
                    return p.publish(keys);
                }
                let fresh = &keys[held.len()..];
                let h = self.store.held_prefix(fresh);
                missed = h.len() < fresh.len();
                held.extend(h);
                if !missed {
                    shared = self.prober.begin(&self.store, keys.len(), blocks);
                }
                !missed
            });
            if let Some(p) = shared {
                let h = p.finish(&keys);
                missed = held.len() + h.len() < keys.len();
                held.extend(h);
            }
            // Keys derived (or reused) after the last question: the prompt's tail.
            if !missed && held.len() < keys.len() {
                let h = self.store.held_prefix(&keys[held.len()..]);
                held.extend(h);
            }
            (keys, BlockStore::count_prefix(&held))
        };
        // Past what the tiers' indexes know, G4 may hold more (other daemons' writes): asked in
        // a few round trips, with every key of the prompt.
        let (keys, m) = self.probe_g4(&engine, &mut tokens, &src, keys, m)?;
        // Keys derived from a copy that faulted are not the engine's prompt's: no answer.
        tokens.check()?;
        if let Some(route_id) = req.route_id {
            let found = self.found_blocks(&keys, req.g1_blocks as usize);
            self.reports.outcome(&engine, route_id, found);
        }
        let mut keys = keys;
        keys.truncate(m.blocks);
        if keys.capacity() > 2 * keys.len() + 64 {
            keys.shrink_to_fit(); // a queued touch holds only the matched prefix
        }
        self.touch_soon(keys);
        metrics::histogram!("kvcached_lookup_hit_blocks").record(m.blocks as f64);
        Ok(Self::answer(&engine, &m, m.blocks))
    }

    /// A lookup's answer: the run `m` ending `end` blocks into the prompt (counted).
    fn answer(engine: &Engine, m: &kvtiers::PrefixMatch, end: usize) -> pb::LookupResponse {
        let result = if m.blocks > 0 { "hit" } else { "miss" };
        metrics::counter!("kvcached_lookups_total", "result" => result, "kv_namespace" => engine.kv_label.clone())
            .increment(1);
        pb::LookupResponse {
            matched_blocks: to_u32(m.blocks),
            matched_tokens: to_u32(end * engine.namespace.layout.tokens_per_block as usize),
            g2_blocks: to_u32(m.fastest[TierKind::G2Host.index()]),
            g3_blocks: to_u32(m.fastest[TierKind::G3Disk.index()]),
            g4_blocks: to_u32(m.fastest[TierKind::G4Object.index()]),
        }
    }

    /// A lookup of the cached run that starts at block `first` of the prompt (what a
    /// sliding-window group's window reads), rather than at its first block.
    fn lookup_from(
        &self,
        engine: &Engine,
        tokens: &mut crate::engine::token_area::PromptTokens<'_>,
        src: &KeySource,
        first: usize,
    ) -> Result<pb::LookupResponse, ServerError> {
        let keys = self.keys_in(engine, tokens.all_checked()?, src)?;
        tokens.check()?;
        let run = keys.get(first..).unwrap_or_default();
        let mut m = BlockStore::count_prefix(&self.store.held_prefix(run));
        if self.g4_lookup_probe && self.store.has_remote_tier() && m.blocks < run.len() {
            self.extend_from_g4(engine, run, &mut m);
        }
        self.touch_soon(run[..m.blocks].to_vec());
        Ok(Self::answer(engine, &m, if m.blocks > 0 { first + m.blocks } else { 0 }))
    }

    /// Extends a matched prefix `m` of `keys` with what G4 holds beyond it (when G4 is
    /// configured, `g4.lookup_probe` is on, and the prompt has blocks past `m`).
    fn probe_g4(
        &self,
        engine: &Engine,
        tokens: &mut crate::engine::token_area::PromptTokens<'_>,
        src: &KeySource,
        keys: Vec<kvproto::BlockKey>,
        mut m: kvtiers::PrefixMatch,
    ) -> Result<(Vec<kvproto::BlockKey>, kvtiers::PrefixMatch), ServerError> {
        // Engine hashes' keys are all derived already; a token chain's may stop at its prefix.
        let blocks = match src {
            KeySource::Hashes(_) => keys.len(),
            _ => tokens.len() / (4 * engine.namespace.layout.tokens_per_block as usize),
        };
        if !self.g4_lookup_probe || !self.store.has_remote_tier() || m.blocks >= blocks {
            return Ok((keys, m));
        }
        let keys = if keys.len() < blocks { self.keys_in(engine, tokens.all_checked()?, src)? } else { keys };
        self.extend_from_g4(engine, &keys, &mut m);
        Ok((keys, m))
    }

    /// Extends the run `m` of `keys` with the blocks right after it that G4 holds.
    fn extend_from_g4(&self, engine: &Engine, keys: &[kvproto::BlockKey], m: &mut kvtiers::PrefixMatch) {
        let more = self.store.probe_lower(engine.namespace_id, &keys[m.blocks..]);
        let g4 = TierKind::G4Object.index();
        m.blocks += more;
        m.fastest[g4] += more;
        m.resident[g4] += more;
    }

    /// Marks a matched prefix's G2 blocks used: by `kv-g2-touch` after the reply when it has
    /// room, else now.
    fn touch_soon(&self, keys: Vec<kvproto::BlockKey>) {
        if keys.is_empty() {
            return;
        }
        let keys = match &self.touch_later {
            Some(tx) => match tx.try_send(keys) {
                Ok(()) => return,
                Err(std::sync::mpsc::TrySendError::Full(k) | std::sync::mpsc::TrySendError::Disconnected(k)) => k,
            },
            None => keys,
        };
        self.store.touch_prefix(&keys);
    }

    /// Prefix blocks of `keys` per tier as a routed request finds them: the first `g1` the
    /// engine holds itself, then each following block from its fastest tier here, up to the
    /// first block found nowhere.
    fn found_blocks(&self, keys: &[kvproto::BlockKey], g1: usize) -> [u32; 4] {
        let g1 = g1.min(keys.len());
        let mut found = [to_u32(g1), 0, 0, 0];
        for tier in self.store.fastest_tiers(&keys[g1..]) {
            found[tier.index()] += 1;
        }
        found
    }

    /// An engine's report about its GPU memory (G1), published to routers.
    pub fn gpu_blocks(&self, req: &pb::GpuBlocksRequest, who: Principal) -> Result<pb::GpuBlocksResponse, ServerError> {
        use pb::gpu_blocks_request::Change;
        let engine = self.engines.get(req.engine_id, who)?;
        let change = match Change::try_from(req.change) {
            Ok(Change::Stored) => GpuChange::Stored,
            Ok(Change::Removed) => GpuChange::Removed,
            Ok(Change::Cleared) => GpuChange::Cleared,
            Err(_) => return Err(ServerError::Invalid(format!("unknown GPU block change {}", req.change))),
        };
        let (parent, keys) = if req.keys.is_empty() {
            let src = kvproto::convert::key_source(req.context.as_ref(), None)?;
            let all = self.keys_in(&engine, &req.tokens, &src)?;
            let first = req.first_block as usize;
            if change != GpuChange::Cleared && first > all.len() {
                return Err(ServerError::Invalid(format!(
                    "first_block {first} is past the {} full blocks of the tokens",
                    all.len()
                )));
            }
            let first = first.min(all.len());
            (first.checked_sub(1).map(|p| all[p]), all[first..].to_vec())
        } else {
            if change == GpuChange::Stored {
                return Err(ServerError::Invalid("STORED names its blocks by tokens (keys carry no parent)".into()));
            }
            let keys = req
                .keys
                .iter()
                .map(|k| {
                    <[u8; 16]>::try_from(k.as_slice())
                        .map(kvproto::BlockKey)
                        .map_err(|_| ServerError::Invalid(format!("a block key has {} bytes, not 16", k.len())))
                })
                .collect::<Result<Vec<_>, _>>()?;
            (None, keys)
        };
        let event_id = self.reports.gpu_blocks(&engine, change, parent, keys.clone());
        Ok(pb::GpuBlocksResponse { keys: keys.iter().map(|k| k.0.to_vec()).collect(), event_id })
    }

    /// Checks a load, registers it and returns its id, the receiver of its status, and the
    /// count it holds against its owner's `limits.max_pending_loads_per_uid`. A load that names
    /// slots or blocks it cannot have is refused here (INVALID_ARGUMENT), before it starts.
    pub fn start_load(
        &self,
        req: &pb::LoadRequest,
        who: Principal,
    ) -> Result<(u64, Arc<Engine>, watch::Sender<pb::LoadStatus>, Held), ServerError> {
        let engine = self.engines.get(req.engine_id, who)?;
        kvproto::check_tokens_le(&req.tokens)?;
        let src = kvproto::convert::key_source(req.context.as_ref(), req.engine_hashes.as_ref())?;
        let tpb = engine.namespace.layout.tokens_per_block as usize;
        let full_blocks = match &src {
            // Refused here, before the load takes a slot (hashes beside tokens, a scheme the
            // daemon cannot derive): the load derives them again.
            KeySource::Hashes(h) => h.keys_le(&engine.fingerprint, tpb, &req.tokens)?.len(),
            _ => req.tokens.len() / (4 * tpb),
        };
        Self::span(&engine, full_blocks, req.first_block, &req.block_ids)?;
        Engine::check_distinct_slots(&req.block_ids)?;
        let held = self.limits.load(who)?;
        let mut ops = self.ops.lock();
        let pending = ops.per_engine.get(&engine.id).map_or(0, |e| e.pending);
        if pending >= self.max_pending {
            self.limits.count_refusal("max_pending_loads");
            return Err(ServerError::Exhausted(format!(
                "{pending} loads pending for engine {} (engines.max_pending_loads)",
                engine.id
            )));
        }
        let id = self.next_op.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = watch::channel(pb::LoadStatus { op_id: id, ..Default::default() });
        ops.start(id, engine.id, rx);
        drop(ops);
        Ok((id, engine, tx, held))
    }

    /// Starts bringing the chain `keys` of `namespace` into G2 before an engine asks: what
    /// this node holds below G2 (G3, and G4 as far as a probe finds it) is promoted, the rest
    /// pulled from `sources` (when an engine of the namespace is attached here: its block size
    /// is what a pull checks). Runs on a blocking thread; the pull itself continues in the
    /// background.
    pub fn prefetch(
        &self,
        namespace: kvproto::NamespaceId,
        keys: Vec<kvproto::BlockKey>,
        sources: &[String],
    ) -> PrefetchStarted {
        let mut held = self.store.held_prefix(&keys).len();
        // Past what the tiers' indexes know, G4 may hold more (other daemons' writes), as a
        // lookup would find.
        if held < keys.len() && self.g4_lookup_probe && self.store.has_remote_tier() {
            held += self.store.probe_lower(namespace, &keys[held..]);
        }
        for chunk in keys[..held].chunks(64) {
            if let Err(e) = self.store.promote_batch(chunk) {
                tracing::debug!("prefetch: promotion stopped: {e}");
                break;
            }
        }
        let mut pulling = 0;
        let block_len = self.engines.block_bytes_of(&namespace);
        if let (Some(peers), Some(len)) = (&self.peers, block_len)
            && held < keys.len()
        {
            let deadline = Instant::now() + Duration::from_millis(peers.config().pull_deadline_ms);
            let local = crate::peer::handoff::local_end(&self.store, &keys);
            if let Some(inc) = Incoming::plan(peers, namespace, &keys, local, len, sources, deadline) {
                pulling = keys.len() - inc.offset;
            }
        }
        metrics::counter!("kvcached_prefetch_total", "result" => if pulling > 0 { "pulling" } else { "local" })
            .increment(1);
        PrefetchStarted { local: held, pulling }
    }

    /// The status of a load, waiting up to `timeout` for it to finish or (`until_blocks` > 0)
    /// to have that many blocks in the engine's slots.
    pub async fn wait(
        &self,
        engine: u64,
        op: u64,
        timeout: Duration,
        until_blocks: u32,
        who: Principal,
    ) -> Result<pb::LoadStatus, ServerError> {
        self.engines.get(engine, who)?;
        let mut rx = match self.ops.lock().by_id.get(&op) {
            Some(o) if o.engine == engine => o.status.clone(),
            _ => return Err(ServerError::UnknownOp(op)),
        };
        let pending = pb::load_status::State::Pending as i32;
        if !timeout.is_zero() {
            let enough =
                |s: &pb::LoadStatus| s.state != pending || (until_blocks > 0 && s.loaded_blocks >= until_blocks);
            let _ = tokio::time::timeout(timeout, rx.wait_for(enough)).await;
        }
        let s = rx.borrow().clone();
        Ok(s)
    }

    /// Forgets finished loads past their retention and drops engines past their lease.
    pub fn housekeeping(&self) {
        let now = Instant::now();
        self.ops.lock().expire(now, self.retention);
        for e in self.engines.reap() {
            self.reports.detached(&e);
        }
    }

    /// Loads not yet finished.
    pub fn pending_loads(&self) -> usize {
        self.ops.lock().pending()
    }

    pub fn stats(&self) -> pb::StatsResponse {
        let s = self.store.stats();
        pb::StatsResponse {
            tiers: s
                .tiers
                .iter()
                .map(|(k, t)| pb::TierStats {
                    tier: k.label().to_string(),
                    hits: t.hits,
                    misses: t.misses,
                    used_bytes: t.usage.used_bytes,
                    capacity_bytes: t.usage.capacity_bytes,
                    blocks: t.usage.blocks as u64,
                    evictions: t.evictions,
                    checksum_failures: t.checksum_failures,
                })
                .collect(),
            engines: to_u32(self.engines.len()),
            saves: self.saves.load(Ordering::Relaxed),
            loads: self.loads.load(Ordering::Relaxed),
            writethrough_dropped: s.writethrough_dropped + s.writethrough_evicted_before_write,
        }
    }

    /// Whether this node can serve its engines (`ok`, with `reasons` why not: its own tiers),
    /// and its degraded neighbours (`warnings`: peers, the object store, routers), which never make it
    /// unready: one dead node must not take every node that lists it out of service. Sets
    /// `kvcached_ready` and `kvcached_degraded_neighbours{kind}` on the way.
    pub fn health(&self, queue_capacity: usize) -> pb::HealthResponse {
        let s = self.store.stats();
        let mut reasons = Vec::new();
        let mut warnings = Vec::new();
        if queue_capacity > 0 && s.writethrough_queued as usize * 10 >= queue_capacity * 9 {
            reasons.push(format!(
                "write-through backlog: {} of {queue_capacity} queued (G3 is slower than saves)",
                s.writethrough_queued
            ));
        }
        let mut g4 = false;
        for (tier, queued) in self.store.writethrough_queued() {
            if tier == TierKind::G4Object && self.g4_queue > 0 && queued as usize * 10 >= self.g4_queue * 9 {
                g4 = true;
                warnings.push(format!(
                    "G4 write-through backlog: {queued} of {} queued (the object store is slower than saves)",
                    self.g4_queue
                ));
            }
        }
        for (tier, why) in self.store.degraded() {
            if tier == TierKind::G4Object {
                g4 = true;
                warnings.push(why);
            } else {
                reasons.push(why);
            }
        }
        let mut peers = 0usize;
        if let Some(p) = &self.peers {
            let mut bad = p.book.bad_peers();
            bad.sort();
            peers = bad.len();
            warnings.extend(bad.into_iter().map(|(peer, why)| {
                format!("peer {peer} failed and is not asked for now: {}", kvproto::limits::clip(&why, 200))
            }));
        }
        let routers = self.reports.failing_targets();
        let failing_routers = routers.len();
        warnings.extend(routers.into_iter().map(|(target, why)| {
            format!(
                "{target} is not taking this node's reports (routers will replay them once it is back): {}",
                kvproto::limits::clip(&why, 200)
            )
        }));
        metrics::gauge!("kvcached_ready").set(if reasons.is_empty() { 1.0 } else { 0.0 });
        metrics::gauge!("kvcached_degraded_neighbours", "kind" => "peer").set(peers as f64);
        metrics::gauge!("kvcached_degraded_neighbours", "kind" => "g4").set(f64::from(u8::from(g4)));
        metrics::gauge!("kvcached_degraded_neighbours", "kind" => "router").set(failing_routers as f64);
        pb::HealthResponse { ok: reasons.is_empty(), reasons, warnings }
    }
}

/// The blocks one SAVE names, and what each block's key and metadata are made of.
struct SaveBlocks<'a> {
    engine: &'a Engine,
    keys: &'a [BlockKey],
    req: &'a pb::SaveRequest,
    /// The saver's tenant, charged for the blocks.
    owner: Option<u32>,
    /// Whether a block's parent is the block before it (a token chain).
    chained: bool,
}

impl SaveBlocks<'_> {
    /// The key and metadata of the request's `i`-th block.
    fn block(&self, i: usize) -> (BlockKey, BlockMeta) {
        let idx = self.req.first_block as usize + i;
        let parent = idx.checked_sub(1).filter(|_| self.chained).map(|p| self.keys[p]);
        let meta = BlockMeta {
            namespace: self.engine.namespace_id,
            parent,
            len: self.engine.block_bytes(),
            owner: self.owner,
        };
        (self.keys[idx], meta)
    }
}

/// Counts one block's put into a SAVE's answer; a quota refusal sets `over_quota`.
fn tally(resp: &mut pb::SaveResponse, put: kvtiers::Result<bool>, over_quota: &mut bool) {
    match put {
        Ok(true) => resp.stored += 1,
        Ok(false) => resp.already_present += 1,
        Err(e) => {
            *over_quota |= matches!(e, kvtiers::TierError::OverQuota { .. });
            resp.failed += 1;
            if resp.error.is_empty() {
                resp.error = e.to_string();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client that loads fast keeps at most `keep` finished statuses per engine (the oldest
    /// go first), pending loads are counted per engine, and the retention forgets the rest and
    /// the engines with nothing left.
    #[test]
    fn load_statuses_stay_bounded_per_engine() {
        let mut ops = Ops::default();
        let keep = 8;
        let (_tx, rx) = watch::channel(pb::LoadStatus::default());
        for op in 0..100_000u64 {
            ops.start(op, 1, rx.clone());
            ops.finish(op, keep);
        }
        assert_eq!(ops.by_id.len(), keep);
        assert!(ops.by_id.contains_key(&99_999) && !ops.by_id.contains_key(&99_991));
        ops.start(200_000, 1, rx.clone());
        ops.start(200_001, 2, rx.clone());
        assert_eq!((ops.pending(), ops.per_engine[&1].pending, ops.per_engine[&2].pending), (2, 1, 1));
        ops.expire(Instant::now() + Duration::from_secs(61), Duration::from_secs(60));
        assert_eq!(ops.by_id.len(), 2, "only the pending loads stay");
        ops.finish(200_000, keep);
        ops.finish(200_001, keep);
        assert_eq!(ops.pending(), 0);
        ops.expire(Instant::now() + Duration::from_secs(61), Duration::from_secs(60));
        assert!(ops.by_id.is_empty() && ops.per_engine.is_empty());
    }
}
