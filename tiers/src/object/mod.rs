//! G4: object storage (S3 and S3-compatible stores, or a shared filesystem) through the
//! `object_store` crate, the tier every node of a cluster shares.
//!
//! - One object per block at `<prefix>/<namespace id>/<key>`, in the format of [`format`]
//!   (header verified on every read: a mismatch is a miss, counted, and the object deleted).
//! - An in-memory index of the objects this daemon knows exist ([`ObjectTier::contains`] reads
//!   only it): filled by its own writes, by listing the prefix at start (in the background), and
//!   by [`ObjectTier::probe`], which asks the store how far a prefix reaches in a few round trips
//!   ([`probe`]). Objects other daemons wrote are known once probed; an object deleted by
//!   another daemon or a lifecycle rule stays known until a read finds it gone (a miss).
//! - Requests run on the tier's own runtime (threads `kv-g4-N`); the [`crate::Tier`] methods
//!   block the calling thread (the store's callers are blocking threads), with batches of
//!   requests in flight together (`concurrency`).
//! - Capacity: with `capacity_bytes` set, the least recently used objects this daemon knows are
//!   deleted once the known bytes pass it; otherwise a bucket lifecycle rule bounds the prefix
//!   (docs/operations/capacity.md, "G4").

pub mod faults;
pub mod format;
pub mod probe;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use kvproto::{BlockKey, NamespaceId, TierKind};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use parking_lot::Mutex;

use crate::block::{BlockMeta, LeaseId};
use crate::buf::BlockBuf;
use crate::error::{Result, TierError};
use crate::eviction::EvictionPolicy;
use crate::listener::{ListenerSlot, TierListener};
use crate::lru_policy::LruPolicy;
use crate::residency::{Residency, SlotBytes};
use crate::room::Room;
use crate::stats::{Count, TierCounters, TierStats, TierUsage};
use crate::tier::{BlockRef, Extensions, Medium, PrefixProbe, Reports, Tier};

const TIER: TierKind = TierKind::G4Object;

/// Configuration of G4.
#[derive(Debug, Clone)]
pub struct ObjectTierConfig {
    /// `s3://bucket/prefix`, `file:///absolute/path` (a shared mount), or `memory://` (this
    /// process only, for tests).
    pub url: String,
    /// An S3-compatible endpoint (`https://host:port`); none: AWS.
    pub endpoint: Option<String>,
    pub region: String,
    /// Allow `http://` endpoints.
    pub allow_http: bool,
    /// `bucket.host` addressing instead of path style (`host/bucket`).
    pub virtual_hosted_style: bool,
    /// Bytes of objects this daemon keeps under the prefix before it deletes the least recently
    /// used ones; 0: no budget (a lifecycle rule bounds the prefix).
    pub capacity_bytes: u64,
    /// Requests in flight at once per batch.
    pub concurrency: usize,
    /// The longest one request may take.
    pub request_timeout: Duration,
    /// How long a failing request is retried (with backoff) before it fails.
    pub retry_deadline: Duration,
    /// Keys asked per round trip of a probe.
    pub probe_fanout: usize,
    /// A key a probe found absent is not asked again for this long.
    pub absent_ttl: Duration,
    /// Most objects the index holds (a larger prefix is known only as far as probed).
    pub index_max_entries: usize,
    /// Added to every request (a slow or distant store, for tests and benchmarks: the
    /// [`faults::FaultyStore`] decorator); none in production.
    pub inject_latency: Option<Duration>,
    /// Switches of injected failures (fault tests); none in production.
    pub faults: Option<Arc<faults::Faults>>,
    /// Owners' quotas in this tier, owner `i` having `quotas[i]` ([`crate::quota`]); empty:
    /// none.
    pub quotas: Vec<crate::quota::Quota>,
}

impl ObjectTierConfig {
    /// Defaults for `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            endpoint: None,
            region: "us-east-1".into(),
            allow_http: false,
            virtual_hosted_style: false,
            capacity_bytes: 0,
            concurrency: 16,
            request_timeout: Duration::from_secs(10),
            retry_deadline: Duration::from_secs(10),
            probe_fanout: 16,
            absent_ttl: Duration::from_secs(2),
            index_max_entries: 4 << 20,
            inject_latency: None,
            faults: None,
            quotas: Vec::new(),
        }
    }
}

fn config_err(field: &'static str, reason: impl Into<String>) -> TierError {
    TierError::Config { field, reason: reason.into() }
}

fn obj_err(op: &'static str, e: impl std::fmt::Display) -> TierError {
    TierError::io(TIER, op, std::io::Error::other(e.to_string()))
}

/// The store and the prefix inside it that `cfg.url` names. Credentials for S3 come from the
/// environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, ...) and are
/// never part of the configuration.
fn open_store(cfg: &ObjectTierConfig) -> Result<(Arc<dyn ObjectStore>, ObjPath)> {
    let (store, root) = open_plain_store(cfg)?;
    if cfg.inject_latency.is_none() && cfg.faults.is_none() {
        return Ok((store, root));
    }
    let latency = cfg.inject_latency.unwrap_or_default();
    let faults = cfg.faults.clone().unwrap_or_default();
    Ok((Arc::new(faults::FaultyStore::new(store, latency, faults)), root))
}

fn open_plain_store(cfg: &ObjectTierConfig) -> Result<(Arc<dyn ObjectStore>, ObjPath)> {
    let url = cfg.url.trim();
    if let Some(rest) = url.strip_prefix("s3://") {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(config_err("g4.url", format!("{url:?} names no bucket (s3://BUCKET/PREFIX)")));
        }
        let retry = object_store::RetryConfig {
            retry_timeout: cfg.retry_deadline,
            max_retries: 10,
            backoff: object_store::BackoffConfig::default(),
        };
        let options = object_store::ClientOptions::new()
            .with_timeout(cfg.request_timeout)
            .with_connect_timeout(cfg.request_timeout.min(Duration::from_secs(5)))
            .with_allow_http(cfg.allow_http);
        let mut b = object_store::aws::AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_region(&cfg.region)
            .with_allow_http(cfg.allow_http)
            .with_virtual_hosted_style_request(cfg.virtual_hosted_style)
            .with_retry(retry)
            .with_client_options(options);
        if let Some(e) = &cfg.endpoint {
            b = b.with_endpoint(e);
        }
        let s3 = b.build().map_err(|e| config_err("g4.url", e.to_string()))?;
        return Ok((Arc::new(s3), ObjPath::from(prefix)));
    }
    if let Some(path) = url.strip_prefix("file://") {
        if !path.starts_with('/') {
            return Err(config_err("g4.url", format!("{url:?}: use an absolute path, file:///mnt/shared/kvcached")));
        }
        std::fs::create_dir_all(path).map_err(|e| config_err("g4.url", format!("cannot create {path}: {e}")))?;
        let fs = object_store::local::LocalFileSystem::new_with_prefix(path)
            .map_err(|e| config_err("g4.url", e.to_string()))?;
        return Ok((Arc::new(fs), ObjPath::from("")));
    }
    if url == "memory://" {
        return Ok((Arc::new(object_store::memory::InMemory::new()), ObjPath::from("")));
    }
    Err(config_err("g4.url", format!("{url:?}: use s3://BUCKET/PREFIX or file:///PATH")))
}

/// A verified read: the block's metadata and bytes, or a miss.
/// What the index keeps of one object: the bytes it counts against the budget (the block's
/// data; the header is not counted, so budgets and sizes read as block bytes).
#[derive(Debug)]
struct ObjSlot {
    len: u64,
}

impl SlotBytes for ObjSlot {
    fn slot_bytes(&self) -> u64 {
        self.len
    }
}

/// The index: every object this daemon knows, their recency, pins and children (the same
/// bookkeeping as G2 and G3, [`Residency`]), the bytes counted, and keys probes found absent.
#[derive(Debug)]
struct Index {
    res: Residency<ObjSlot>,
    used: u64,
    absent: HashMap<BlockKey, Instant, kvproto::BlockKeyBuildHasher>,
    /// While the start-up listing runs: keys this daemon put meanwhile. It knows them already,
    /// and one it has removed since (evicted, over quota) must not come back from a listing
    /// that saw its object before the delete.
    put_while_listing: Option<HashSet<BlockKey, kvproto::BlockKeyBuildHasher>>,
}

impl Index {
    fn new() -> Self {
        Self {
            res: Residency::new(Box::new(LruPolicy::new()) as Box<dyn EvictionPolicy>),
            used: 0,
            absent: HashMap::default(),
            put_while_listing: None,
        }
    }

    /// Records an object known to exist (listed, probed, or written and committed).
    fn insert_ready(&mut self, key: BlockKey, meta: BlockMeta) -> bool {
        if self.res.has_entry(&key) {
            return false;
        }
        self.absent.remove(&key);
        self.res.insert_ready(key, meta, Arc::new(ObjSlot { len: meta.len }));
        self.used += meta.len;
        true
    }

    fn remove(&mut self, key: &BlockKey) -> bool {
        match self.res.remove(key) {
            Some(e) => {
                self.used -= e.slot.len;
                true
            }
            None => false,
        }
    }

    fn namespace(&mut self, key: &BlockKey) -> Option<NamespaceId> {
        self.res.get(key, false).map(|(_, m)| m.namespace)
    }
}

/// Recent failures of the store: what `/healthz` says while it is degraded.
#[derive(Debug, Default)]
struct Health {
    last_error: Option<(Instant, String)>,
    last_ok: Option<Instant>,
}

impl Health {
    /// The last request failed and none succeeded since.
    fn is_degraded(&self) -> bool {
        match (&self.last_error, self.last_ok) {
            (Some((at, _)), Some(ok)) => ok <= *at,
            (Some(_), None) => true,
            (None, _) => false,
        }
    }
}

/// How often a degraded G4 checks whether the store answers again.
const RECHECK: Duration = Duration::from_secs(5);

/// The G4 tier.
pub struct ObjectTier {
    cfg: ObjectTierConfig,
    store: Arc<dyn ObjectStore>,
    root: ObjPath,
    rt: Option<tokio::runtime::Runtime>,
    index: Arc<Mutex<Index>>,
    health: Arc<Mutex<Health>>,
    counters: Arc<TierCounters>,
    deleted_corrupt: Count,
    stale: Count,
    listener: ListenerSlot,
    listed: Arc<AtomicBool>,
}

impl std::fmt::Debug for ObjectTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectTier").field("url", &self.cfg.url).field("store", &self.store.to_string()).finish()
    }
}

impl Drop for ObjectTier {
    fn drop(&mut self) {
        // Not a blocking drop: the tier may be dropped on a runtime's thread.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl ObjectTier {
    /// Opens G4: builds the client (a configuration error is an error now), checks that the
    /// store answers (an unreachable store or wrong credentials are logged and make the tier
    /// degraded, not the daemon fail: the other tiers serve meanwhile), and lists what the
    /// prefix holds in the background.
    pub fn open(cfg: &ObjectTierConfig) -> Result<Self> {
        if cfg.concurrency == 0 || cfg.probe_fanout == 0 {
            return Err(config_err("g4.concurrency", "concurrency and probe_fanout must be at least 1"));
        }
        let (store, root) = open_store(cfg)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kv-g4")
            .enable_all()
            .build()
            .map_err(|e| TierError::io(TIER, "start its runtime", e))?;
        let t = Self {
            cfg: cfg.clone(),
            store,
            root,
            rt: Some(rt),
            index: Arc::new(Mutex::new({
                let mut idx = Index::new();
                idx.res.set_quotas(crate::quota::Quotas::new(TIER, &cfg.quotas));
                idx
            })),
            health: Arc::default(),
            counters: Arc::new(TierCounters::new(TIER, cfg.capacity_bytes)),
            deleted_corrupt: Count::labelled("kvcached_g4_corrupt_deleted_total", &[]),
            stale: Count::labelled("kvcached_g4_stale_total", &[]),
            listener: ListenerSlot::default(),
            listed: Arc::new(AtomicBool::new(false)),
        };
        match t.block_on(t.store.list_with_delimiter(Some(&t.root))) {
            Ok(_) => t.ok(),
            Err(e) => {
                let why = format!("G4 store {} does not answer: {e}", t.cfg.url);
                tracing::error!("{why}; the daemon serves from G2/G3 until it does");
                t.failed(why);
            }
        }
        t.list_in_background();
        t.recheck_in_background();
        Ok(t)
    }

    /// While G4 is degraded, asks the store every [`RECHECK`] whether it answers again (one
    /// HEAD of an object that need not exist: "not found" is an answer), so that the degraded
    /// state ends when the store is back, even with no traffic, and not before.
    fn recheck_in_background(&self) {
        let (store, health) = (Arc::clone(&self.store), Arc::clone(&self.health));
        let probe = self.root.clone().join("kvcached-health-check");
        self.rt().spawn(async move {
            loop {
                tokio::time::sleep(RECHECK).await;
                if !health.lock().is_degraded() {
                    continue;
                }
                match tokio::time::timeout(RECHECK, store.head(&probe)).await {
                    Ok(Ok(_)) | Ok(Err(object_store::Error::NotFound { .. })) => {
                        tracing::info!("G4 store answers again");
                        health.lock().last_ok = Some(Instant::now());
                    }
                    Ok(Err(e)) => tracing::debug!("G4 store still does not answer: {e}"),
                    Err(_) => tracing::debug!("G4 store still does not answer within {} s", RECHECK.as_secs()),
                }
            }
        });
    }

    fn rt(&self) -> &tokio::runtime::Runtime {
        // Present from open until drop.
        self.rt.as_ref().unwrap_or_else(|| unreachable!("the G4 runtime lives as long as the tier"))
    }

    /// Runs `f` on the tier's runtime and waits for it. Callers are blocking threads (or
    /// `block_in_place` sections), never async tasks of the tier's own runtime.
    fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt().block_on(f)
    }

    fn ok(&self) {
        self.health.lock().last_ok = Some(Instant::now());
    }

    fn failed(&self, why: String) {
        self.health.lock().last_error = Some((Instant::now(), why));
    }

    /// Why G4 is degraded: the last request failed and none succeeded since (a request, or the
    /// check every 5 s while degraded).
    pub fn degraded(&self) -> Option<String> {
        let h = self.health.lock();
        let (at, why) = h.last_error.as_ref()?;
        h.is_degraded().then(|| format!("{why} ({} s ago)", at.elapsed().as_secs()))
    }

    /// Whether the listing of the prefix at start has finished.
    pub fn listed(&self) -> bool {
        self.listed.load(Ordering::Relaxed)
    }

    fn path(&self, namespace: &NamespaceId, key: &BlockKey) -> ObjPath {
        self.root.clone().join(hex_of(&namespace.0)).join(key.to_string())
    }

    /// Where a block's object lives in the store (`<prefix>/<namespace hex>/<key hex>`).
    pub fn object_path(&self, namespace: &NamespaceId, key: &BlockKey) -> String {
        self.path(namespace, key).to_string()
    }

    /// Lists `<prefix>/` into the index (at most `index_max_entries`), oldest objects least
    /// recently used.
    fn list_in_background(&self) {
        let (store, root, index, listed) =
            (Arc::clone(&self.store), self.root.clone(), Arc::clone(&self.index), Arc::clone(&self.listed));
        let max = self.cfg.index_max_entries;
        let counters = Arc::clone(&self.counters);
        self.index.lock().put_while_listing = Some(HashSet::default());
        self.rt().spawn(async move {
            let mut found: Vec<(BlockKey, BlockMeta, i64)> = Vec::new();
            let mut stream = store.list(Some(&root));
            while let Some(item) = stream.next().await {
                let Ok(meta) = item else { break };
                if found.len() >= max {
                    break;
                }
                let mut parts: Vec<String> = meta.location.parts().map(|p| p.as_ref().to_string()).collect();
                let (Some(key), Some(ns)) = (parts.pop(), parts.pop()) else { continue };
                let (Ok(key), Some(ns)) = (key.parse::<BlockKey>(), ns_of(&ns)) else { continue };
                let len = meta.size.saturating_sub(format::HEADER_BYTES as u64);
                let m = BlockMeta { namespace: ns, parent: None, len, owner: None };
                found.push((key, m, meta.last_modified.timestamp_millis()));
            }
            // Oldest first: they are the least recently used.
            found.sort_by_key(|(_, _, t)| *t);
            let mut idx = index.lock();
            let put_meanwhile = idx.put_while_listing.take().unwrap_or_default();
            for (key, m, _) in found {
                if !put_meanwhile.contains(&key) {
                    idx.insert_ready(key, m);
                }
            }
            counters.set_usage(idx.used, idx.res.len());
            drop(idx);
            listed.store(true, Ordering::Relaxed);
        });
    }

    /// How many leading blocks of `keys` (a chain of `namespace`) G4 holds, asking the store in
    /// a few round trips ([`probe::longest_prefix`]); the blocks found join the index. Keys the
    /// index already knows are not asked.
    pub fn probe(&self, namespace: NamespaceId, keys: &[BlockKey]) -> usize {
        self.probe_rounds(namespace, keys).0
    }

    /// [`ObjectTier::probe`], with the number of round trips it took.
    pub fn probe_rounds(&self, namespace: NamespaceId, keys: &[BlockKey]) -> (usize, usize) {
        if keys.is_empty() {
            return (0, 0);
        }
        // What the index knows answers without a request.
        let (known_prefix, first_absent) = {
            let idx = self.index.lock();
            let n = keys.iter().take_while(|k| idx.res.contains(k)).count();
            let absent = keys.get(n).and_then(|k| idx.absent.get(k)).is_some_and(|t| t.elapsed() < self.cfg.absent_ttl);
            (n, absent)
        };
        if known_prefix == keys.len() || first_absent {
            return (known_prefix, 0);
        }
        let rest = &keys[known_prefix..];
        let store = &self.store;
        let asked_paths: Vec<ObjPath> = rest.iter().map(|k| self.path(&namespace, k)).collect();
        let fanout = self.cfg.probe_fanout;
        let found: Mutex<Vec<(usize, u64)>> = Mutex::new(Vec::new());
        let absent: Mutex<Vec<usize>> = Mutex::new(Vec::new());
        let failed: Mutex<Option<String>> = Mutex::new(None);
        let (n, rounds) = self.block_on(probe::longest_prefix(rest.len(), fanout, |asked: Vec<usize>| {
            let heads: Vec<_> = asked
                .into_iter()
                .map(|i| {
                    let p = asked_paths[i].clone();
                    async move { (i, store.head(&p).await) }
                })
                .collect();
            let (found, absent, failed) = (&found, &absent, &failed);
            async move {
                let answers = futures_util::future::join_all(heads).await;
                answers
                    .into_iter()
                    .map(|(i, r)| match r {
                        Ok(meta) => {
                            found.lock().push((i, meta.size));
                            true
                        }
                        Err(object_store::Error::NotFound { .. }) => {
                            absent.lock().push(i);
                            false
                        }
                        Err(e) => {
                            *failed.lock() = Some(e.to_string());
                            false
                        }
                    })
                    .collect()
            }
        }));
        metrics::histogram!("kvcached_g4_probe_rounds").record(rounds as f64);
        match failed.into_inner() {
            Some(e) => self.failed(format!("G4 probe failed: {e}")),
            None => self.ok(),
        }
        let mut idx = self.index.lock();
        // Every key of the prefix joins the index: the asked ones with their sizes, the ones
        // between them (present, since the prefix is closed) with the sizes of those asked
        // (blocks of a namespace have one size; a read corrects it).
        let found = found.into_inner();
        let mut sizes: Vec<Option<u64>> = vec![None; n];
        for &(i, size) in &found {
            if i < n {
                sizes[i] = Some(size.saturating_sub(format::HEADER_BYTES as u64));
            }
        }
        let typical = found.iter().map(|(_, s)| s.saturating_sub(format::HEADER_BYTES as u64)).max().unwrap_or(0);
        for (i, len) in sizes.into_iter().enumerate() {
            let mut parent = i.checked_sub(1).map(|p| rest[p]);
            if i == 0 {
                parent = known_prefix.checked_sub(1).map(|p| keys[p]);
            }
            idx.insert_ready(rest[i], BlockMeta { namespace, parent, len: len.unwrap_or(typical), owner: None });
        }
        let now = Instant::now();
        for i in absent.into_inner() {
            if idx.absent.len() < 1 << 16 {
                idx.absent.insert(rest[i], now);
            }
        }
        if idx.absent.len() >= 1 << 16 {
            let ttl = self.cfg.absent_ttl;
            idx.absent.retain(|_, t| t.elapsed() < ttl);
        }
        self.counters.set_usage(idx.used, idx.res.len());
        (known_prefix + n, rounds)
    }

    /// Makes room for `need` more bytes under the budget: the least recently used objects go,
    /// descendants before ancestors, never a pinned one (removed from the index here; their
    /// objects are deleted by the caller). `Err` when the budget cannot hold `need`.
    fn make_room(&self, idx: &mut Index, need: u64) -> Result<Vec<(BlockKey, NamespaceId)>> {
        let cap = self.cfg.capacity_bytes;
        if cap == 0 {
            return Ok(Vec::new());
        }
        let room = Room::budget(TIER, cap);
        let evict = room.bytes_to_evict(idx.used, cap.saturating_sub(idx.used), need)?;
        if evict == 0 {
            return Ok(Vec::new());
        }
        let (victims, enough) = idx.res.evict(evict, Instant::now(), true);
        let out: Vec<(BlockKey, NamespaceId)> = victims
            .into_iter()
            .map(|(k, e)| {
                idx.used -= e.slot.len;
                (k, e.meta.namespace)
            })
            .collect();
        // Counted here; the listener hears of them once their objects are deleted.
        self.counters.evictions.add(out.len() as u64);
        if !enough {
            // What went is gone from the index; its objects are still deleted.
            return Err(room.full(need, cap.saturating_sub(idx.used)));
        }
        Ok(out)
    }

    /// Deletes evicted objects and reports them gone.
    async fn delete_all(&self, victims: &[(BlockKey, NamespaceId)]) {
        if victims.is_empty() {
            return;
        }
        let deletes = victims.iter().map(|(k, ns)| {
            let p = self.path(ns, k);
            async move { self.store.delete(&p).await }
        });
        let _: Vec<_> = futures_util::stream::iter(deletes).buffer_unordered(self.cfg.concurrency).collect().await;
        let keys: Vec<BlockKey> = victims.iter().map(|(k, _)| *k).collect();
        self.listener.removed(TIER, &keys);
    }

    /// Reads one object into `out` as its body arrives, checking it on the way: the header
    /// when its 96 bytes are in, the data's checksum at the end. `Ok(None)` for a miss (absent,
    /// stale, or corrupt: a corrupt object is deleted and counted; `out` then holds nothing
    /// usable). Streaming saves the copy that collecting the body first would make and hashes
    /// while the rest is still on the wire.
    async fn read_into(&self, key: BlockKey, namespace: NamespaceId, out: &mut BlockBuf) -> Result<Option<BlockMeta>> {
        let p = self.path(&namespace, &key);
        let got = match self.store.get(&p).await {
            Ok(g) => g,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(obj_err("get", e)),
        };
        let size = got.meta.size;
        let mut body = got.into_stream();
        let mut head = [0u8; format::HEADER_BYTES];
        let mut have_head = 0usize;
        let mut found: Option<BlockMeta> = None;
        let mut at = 0usize;
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| obj_err("get", e))?;
            let mut rest = &chunk[..];
            if have_head < format::HEADER_BYTES {
                let take = rest.len().min(format::HEADER_BYTES - have_head);
                head[have_head..have_head + take].copy_from_slice(&rest[..take]);
                have_head += take;
                rest = &rest[take..];
                if have_head == format::HEADER_BYTES {
                    let why = match format::parse_header(&head) {
                        Ok((k, _)) if k != key => Some(format::Invalid::OtherKey.to_string()),
                        Ok((_, m)) if m.namespace != namespace => Some("the header names another namespace".into()),
                        Ok((_, m)) if size != format::HEADER_BYTES as u64 + m.len => Some(
                            format::Invalid::Truncated {
                                have: size as usize,
                                want: format::HEADER_BYTES + m.len as usize,
                            }
                            .to_string(),
                        ),
                        Ok((_, m)) => {
                            out.resize(m.len as usize);
                            found = Some(m);
                            None
                        }
                        Err(why) => Some(why.to_string()),
                    };
                    if let Some(why) = why {
                        drop(body);
                        self.corrupt(&key, &p, &why).await;
                        return Ok(None);
                    }
                }
            }
            if rest.is_empty() {
                continue;
            }
            let Some(meta) = found else { continue };
            if at + rest.len() > meta.len as usize {
                break;
            }
            out[at..at + rest.len()].copy_from_slice(rest);
            hasher.update(rest);
            at += rest.len();
        }
        let Some(meta) = found else {
            let why = format::Invalid::Truncated { have: have_head, want: format::HEADER_BYTES };
            self.corrupt(&key, &p, &why.to_string()).await;
            return Ok(None);
        };
        if at != meta.len as usize {
            let why = format::Invalid::Truncated {
                have: format::HEADER_BYTES + at,
                want: format::HEADER_BYTES + meta.len as usize,
            };
            self.corrupt(&key, &p, &why.to_string()).await;
            return Ok(None);
        }
        if hasher.digest() != format::data_checksum(&head) {
            self.corrupt(&key, &p, &format::Invalid::DataChecksum.to_string()).await;
            return Ok(None);
        }
        Ok(Some(meta))
    }

    async fn corrupt(&self, key: &BlockKey, p: &ObjPath, why: &str) {
        self.counters.checksum_failures.add(1);
        self.deleted_corrupt.add(1);
        tracing::warn!(%key, object = %p, "G4 object is not the block it should be ({why}): deleted, served as a miss");
        let _ = self.store.delete(p).await;
    }
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn ns_of(s: &str) -> Option<NamespaceId> {
    let mut out = [0u8; 16];
    if s.len() != 32 {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(NamespaceId(out))
}

impl Tier for ObjectTier {
    fn kind(&self) -> TierKind {
        TIER
    }

    /// PUTs the blocks not already known, `concurrency` at a time, each retried with backoff up
    /// to `retry_deadline` (the client's retry policy). Room under the budget is made first;
    /// a block is known (visible) only once its PUT succeeded.
    fn put_batch(&self, blocks: &[BlockRef<'_>]) -> Vec<Result<bool>> {
        let t0 = Instant::now();
        let mut out: Vec<Result<bool>> = blocks.iter().map(|_| Ok(false)).collect();
        let mut todo: Vec<(usize, Arc<ObjSlot>)> = Vec::new();
        let mut victims = Vec::new();
        {
            let mut idx = self.index.lock();
            for (i, b) in blocks.iter().enumerate() {
                if b.data.len() as u64 != b.meta.len {
                    out[i] = Err(TierError::LengthMismatch { expected: b.meta.len, actual: b.data.len() as u64 });
                    continue;
                }
                if idx.res.has_entry(&b.key) {
                    continue;
                }
                // The owner's quota makes its room among its own objects first (deleted with the
                // evicted ones below, and reported once deleted).
                match idx.res.quota_room(&b.meta, Instant::now()) {
                    Ok(own) => {
                        self.counters.evictions.add(own.len() as u64);
                        victims.extend(own.into_iter().map(|(k, e)| {
                            idx.used -= e.slot.len;
                            (k, e.meta.namespace)
                        }));
                    }
                    Err(why) => {
                        out[i] = Err(TierError::OverQuota { tier: TIER, why });
                        continue;
                    }
                }
                match self.make_room(&mut idx, b.meta.len) {
                    Ok(v) => victims.extend(v),
                    Err(e) => {
                        self.counters.put_errors.add(1);
                        out[i] = Err(e);
                        continue;
                    }
                }
                let slot = Arc::new(ObjSlot { len: b.meta.len });
                if let Some(seen) = idx.put_while_listing.as_mut() {
                    seen.insert(b.key);
                }
                if idx.res.reserve(b.key, b.meta, Arc::clone(&slot), false) {
                    idx.used += b.meta.len;
                    todo.push((i, slot));
                }
            }
        }
        let puts = todo.iter().map(|(i, _)| {
            let b = &blocks[*i];
            let head = format::header(&b.key, &b.meta, b.data);
            let payload = PutPayload::from_iter([Bytes::copy_from_slice(&head), Bytes::copy_from_slice(b.data)]);
            let p = self.path(&b.meta.namespace, &b.key);
            async move { (*i, self.store.put(&p, payload).await) }
        });
        let (results, ()) = self.block_on(async {
            futures_util::join!(
                futures_util::stream::iter(puts).buffer_unordered(self.cfg.concurrency).collect::<Vec<_>>(),
                self.delete_all(&victims)
            )
        });
        let mut failure = None;
        let mut idx = self.index.lock();
        for (i, r) in results {
            let b = &blocks[i];
            let Some((_, slot)) = todo.iter().find(|(j, _)| *j == i) else { continue };
            match r {
                Ok(_) => {
                    if idx.res.commit(&b.key, slot) {
                        self.listener.stored(TIER, b.key, &b.meta);
                    }
                    self.counters.bytes_written.add(b.data.len() as u64);
                    out[i] = Ok(true);
                }
                Err(e) => {
                    if idx.res.is_writing(&b.key, slot) {
                        idx.res.abort(&b.key, slot);
                        idx.used -= b.meta.len;
                    }
                    self.counters.put_errors.add(1);
                    failure = Some(e.to_string());
                    out[i] = Err(obj_err("put", e));
                }
            }
        }
        self.counters.set_usage(idx.used, idx.res.len());
        drop(idx);
        if !todo.is_empty() {
            match failure {
                Some(e) => self.failed(format!("G4 writes fail: {e}")),
                None => self.ok(),
            }
        }
        self.counters.put_took(t0.elapsed());
        out
    }

    /// GETs the blocks the index knows, `concurrency` at a time; each is verified. A block the
    /// index knows but the store no longer has (another daemon's budget, a lifecycle rule) is
    /// a miss and leaves the index.
    fn get_batch(&self, keys: &[BlockKey], outs: &mut [BlockBuf]) -> Vec<Result<Option<BlockMeta>>> {
        let t0 = Instant::now();
        let namespaces: Vec<Option<NamespaceId>> = {
            let mut idx = self.index.lock();
            keys.iter().map(|k| idx.namespace(k)).collect()
        };
        // Each block is copied out and verified as its body arrives, while the others are in
        // flight, and outside the index lock.
        let reads = keys.iter().zip(&namespaces).zip(outs.iter_mut()).enumerate().filter_map(|(i, ((k, ns), o))| {
            let ns = (*ns)?;
            Some(async move { (i, self.read_into(*k, ns, o).await) })
        });
        let results: Vec<(usize, Result<Option<BlockMeta>>)> =
            self.block_on(futures_util::stream::iter(reads).buffer_unordered(self.cfg.concurrency).collect());
        let mut out: Vec<Result<Option<BlockMeta>>> = keys.iter().map(|_| Ok(None)).collect();
        // Keys the index does not know are misses without a request (a lookup probes first).
        self.counters.misses.add(namespaces.iter().filter(|n| n.is_none()).count() as u64);
        let mut failure = None;
        let mut gone = Vec::new();
        let mut asked = false;
        let mut idx = self.index.lock();
        for (i, r) in results {
            asked = true;
            match r {
                Ok(Some(meta)) => {
                    self.counters.hits.add(1);
                    self.counters.bytes_read.add(meta.len);
                    // A block a probe or a listing put in the index with a guessed length or no
                    // parent: what its header says replaces that.
                    let indexed = idx.res.get(&keys[i], false).map(|(_, m)| m);
                    if indexed.is_some_and(|m| m.len != meta.len || m.parent != meta.parent) {
                        idx.remove(&keys[i]);
                        idx.insert_ready(keys[i], meta);
                    }
                    idx.res.touch(&keys[i]);
                    out[i] = Ok(Some(meta));
                }
                Ok(None) => {
                    if idx.remove(&keys[i]) {
                        self.stale.add(1);
                        gone.push(keys[i]);
                    }
                    self.counters.misses.add(1);
                }
                Err(e) => {
                    failure = Some(e.to_string());
                    self.counters.misses.add(1);
                    out[i] = Err(e);
                }
            }
        }
        self.counters.set_usage(idx.used, idx.res.len());
        drop(idx);
        self.listener.removed(TIER, &gone);
        if asked {
            match failure {
                Some(e) => self.failed(format!("G4 reads fail: {e}")),
                None => self.ok(),
            }
        }
        self.counters.get_took(t0.elapsed());
        out
    }

    fn contains_each(&self, keys: &[BlockKey]) -> Vec<bool> {
        let idx = self.index.lock();
        keys.iter().map(|k| idx.res.contains(k)).collect()
    }

    fn remove(&self, key: &BlockKey) -> Result<bool> {
        let Some(ns) = self.index.lock().namespace(key) else { return Ok(false) };
        let p = self.path(&ns, key);
        match self.block_on(self.store.delete(&p)) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(obj_err("delete", e)),
        }
        let mut idx = self.index.lock();
        let was = idx.remove(key);
        self.counters.set_usage(idx.used, idx.res.len());
        drop(idx);
        if was {
            self.listener.removed(TIER, &[*key]);
        }
        Ok(was)
    }

    fn pin(&self, lease: LeaseId, keys: &[BlockKey], deadline: Instant) -> usize {
        self.index.lock().res.pin(lease, keys, deadline)
    }

    fn release(&self, lease: LeaseId) {
        self.index.lock().res.release(lease);
    }

    fn usage(&self) -> TierUsage {
        let idx = self.index.lock();
        TierUsage { used_bytes: idx.used, capacity_bytes: self.cfg.capacity_bytes, blocks: idx.res.len() }
    }

    fn stats(&self) -> TierStats {
        self.counters.snapshot(self.usage())
    }

    fn keys(&self) -> Vec<(BlockKey, BlockMeta)> {
        self.index.lock().res.ready_keys()
    }

    fn extensions(&self) -> Extensions<'_> {
        Extensions { probe: Some(self), medium: Some(self), reports: Some(self), ..Extensions::default() }
    }
}

impl PrefixProbe for ObjectTier {
    fn probe_prefix(&self, namespace: NamespaceId, keys: &[BlockKey]) -> usize {
        self.probe(namespace, keys)
    }
}

impl Medium for ObjectTier {
    fn degraded(&self) -> Option<String> {
        ObjectTier::degraded(self)
    }

    /// Nothing to do: a block is known only once its PUT succeeded.
    fn flush(&self) -> Result<()> {
        Ok(())
    }
}

impl Reports for ObjectTier {
    fn set_listener(&self, listener: Arc<dyn TierListener>) -> bool {
        self.listener.set(listener)
    }
}
