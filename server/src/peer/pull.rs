//! The puller: blocks asked from peers arrive straight into G2 pages, verified on the way, in
//! prompt order; [`Pull`] tells a waiting load how far they have come. One thread per pull
//! (`kv-peer-pull`, at most `peer.max_pulls`), blocking sockets, idle connections kept per peer.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvnet::{Connector, SyncStream};
use kvproto::{BlockKey, NamespaceId};
use kvtiers::{BlockMeta, BlockStore, TierError};
use parking_lot::{Condvar, Mutex};

use super::protocol::{self as p, BlockHeader};
use super::{Failure, PeerBook, PeerConfig};
use crate::error::ServerError;

fn peer_err(op: &'static str) -> TierError {
    TierError::Io {
        tier: kvproto::TierKind::G2Host,
        op,
        source: std::io::Error::other("the peer's block was not kept"),
    }
}

/// Idle connections kept per peer.
const POOL_PER_PEER: usize = 4;

/// A kept connection idle this long is not used again: the serving side closes connections
/// idle for 60 s (`server.rs`), and one it is closing must not be the one a pull depends on.
const POOL_IDLE: Duration = Duration::from_secs(30);

/// Whether the peer has neither closed `c` nor sent anything unasked on it (a connection
/// between pulls has nothing to read): a non-blocking peek of one byte that would block.
fn still_open(c: &SyncStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut b = [0u8; 1];
    // SAFETY: recv peeks at most one byte into a local buffer, without blocking.
    let r = unsafe { libc::recv(c.tcp().as_raw_fd(), b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    r < 0 && matches!(std::io::Error::last_os_error().kind(), std::io::ErrorKind::WouldBlock)
}

/// How a pull ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullEnd {
    /// Every block asked for arrived.
    Complete,
    /// The peers had only a prefix (or nothing).
    Partial,
    /// Stopped by an error (unreachable, stalled, wrong bytes, G2 full): the text says which.
    Failed(String),
}

#[derive(Debug, Default)]
struct Progress {
    /// Blocks of `keys` (from the first) in G2.
    arrived: usize,
    end: Option<PullEnd>,
}

/// One pull's progress.
#[derive(Debug)]
pub struct Pull {
    pub namespace: NamespaceId,
    pub keys: Vec<BlockKey>,
    state: Mutex<Progress>,
    moved: Condvar,
}

impl Pull {
    /// Waits until block `i` of the pull is in G2 (true), or the pull ended short of it or
    /// `deadline` passed (false).
    pub fn wait_for(&self, i: usize, deadline: Instant) -> bool {
        let mut s = self.state.lock();
        loop {
            if s.arrived > i {
                return true;
            }
            if s.end.is_some() || Instant::now() >= deadline {
                return false;
            }
            self.moved.wait_until(&mut s, deadline);
        }
    }

    /// Blocks arrived so far, and how the pull ended if it has.
    pub fn progress(&self) -> (usize, Option<PullEnd>) {
        let s = self.state.lock();
        (s.arrived, s.end.clone())
    }

    fn arrived(&self, n: usize) {
        self.state.lock().arrived = n;
        self.moved.notify_all();
    }

    fn end(&self, how: PullEnd) {
        self.state.lock().end = Some(how);
        self.moved.notify_all();
    }
}

/// The peers this daemon pulls from: credentials, idle connections, link rates and health, and
/// the pulls in flight (so a load waits for a prefetch's pull instead of starting another).
#[derive(Debug)]
pub struct Peers {
    cfg: PeerConfig,
    sources: super::sources::SourcePolicy,
    /// Refused sources, logged at most every 10 s.
    refused_log: Mutex<crate::rate_log::RateLog>,
    connector: Connector,
    pub book: PeerBook,
    /// Connections between pulls, with the time each was put back.
    idle: Mutex<HashMap<String, Vec<(SyncStream, Instant)>>>,
    inflight: Mutex<HashMap<BlockKey, (Arc<Pull>, usize)>>,
    running: AtomicUsize,
    /// Weak: the probe thread may hold the peers while the process exits, and must not be the
    /// one that closes the store (G3's RocksDB) then.
    store: std::sync::Weak<BlockStore>,
}

/// What a pull from each of its sources in turn shares: where the blocks go, which, how long.
#[derive(Clone, Copy)]
struct Job<'a> {
    store: &'a BlockStore,
    pull: &'a Pull,
    block_len: u64,
}

/// Why a block read from a peer is not kept.
enum Reject {
    Io(std::io::Error),
    /// The peer sent wrong bytes.
    Wrong(String),
    /// G2 could not take the block: not the peer's fault.
    Full(String),
}

/// Why a pull from one peer stopped.
#[derive(Debug)]
struct PullErr {
    why: String,
    /// Whether a block had arrived (or an answer had begun) first: the connection was alive.
    after_first: bool,
    how: Failure,
}

impl PullErr {
    /// Before any answer: the connection may have been closed while kept.
    fn transient(why: String) -> Self {
        Self { why, after_first: false, how: Failure::Transient }
    }

    /// After the answer began.
    fn midway(why: String) -> Self {
        Self { why, after_first: true, how: Failure::Transient }
    }

    /// Wrong bytes.
    fn wrong(why: String) -> Self {
        Self { why, after_first: true, how: Failure::Faulty }
    }

    /// An I/O error: a stall (silent past the I/O timeout) is the peer's fault; a closed or
    /// reset connection may be a restart.
    fn io(why: String, e: &std::io::Error, after_first: bool) -> Self {
        let how = if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
            Failure::Faulty
        } else {
            Failure::Transient
        };
        Self { why, after_first, how }
    }
}

impl Peers {
    /// The peers, and (with `peer.probe_idle_s`) thread `kv-peer-probe`, which measures every
    /// link not measured by a transfer for that long; it ends when the peers are dropped.
    pub fn start_probing(self: &Arc<Self>) {
        if self.cfg.probe_idle_s == 0 {
            return;
        }
        let me = Arc::downgrade(self);
        let spawned = std::thread::Builder::new().name("kv-peer-probe".into()).spawn(move || {
            loop {
                std::thread::sleep(Duration::from_millis(500));
                let Some(p) = me.upgrade() else { return };
                p.probe_due();
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("links will be measured by transfers only: {e}");
        }
    }

    /// Probes the configured and known peers whose links are stale.
    fn probe_due(&self) {
        let idle = Duration::from_secs(self.cfg.probe_idle_s);
        let mut peers: Vec<String> = self.cfg.peers.clone();
        peers.extend(self.book.links().into_iter().map(|(p, _)| p));
        peers.sort();
        peers.dedup();
        for peer in peers {
            if self.book.is_bad(&peer) || self.book.measured(&peer).is_some_and(|t| t.elapsed() < idle) {
                continue;
            }
            match self.probe(&peer, self.cfg.probe_bytes) {
                Ok(rate) => tracing::debug!(peer, rate, "link probed"),
                Err(e) => {
                    self.book.failed(&peer, &format!("probe: {e}"), Failure::Transient, self.longest_bar());
                }
            }
        }
    }

    pub fn new(cfg: &PeerConfig, store: Arc<BlockStore>) -> Result<Self, ServerError> {
        let connector = kvnet::Connector::new(&cfg.client, &[])
            .map_err(|e| ServerError::Config { field: "peer.client".into(), reason: e.to_string() })?;
        let sources = super::sources::SourcePolicy::new(&cfg.peers, &cfg.allowed_sources)
            .map_err(|reason| ServerError::Config { field: "peer.allowed_sources".into(), reason })?;
        Ok(Self {
            cfg: cfg.clone(),
            sources,
            refused_log: Mutex::default(),
            connector,
            book: PeerBook::default(),
            idle: Mutex::new(HashMap::new()),
            inflight: Mutex::new(HashMap::new()),
            running: AtomicUsize::new(0),
            store: Arc::downgrade(&store),
        })
    }

    pub fn config(&self) -> &PeerConfig {
        &self.cfg
    }

    /// The pull already bringing `key` in, and its index there.
    pub fn inflight(&self, key: &BlockKey) -> Option<(Arc<Pull>, usize)> {
        self.inflight.lock().get(key).cloned()
    }

    /// Starts pulling `keys` (a chain, in order) of `namespace`, each `block_len` bytes, from
    /// the first of `sources` that has them (the rest from the next). `None` when
    /// `peer.max_pulls` pulls are running or no source is usable.
    pub fn start(
        self: &Arc<Self>,
        namespace: NamespaceId,
        keys: Vec<BlockKey>,
        block_len: u64,
        sources: &[String],
    ) -> Option<Arc<Pull>> {
        let sources: Vec<String> =
            sources.iter().filter(|s| self.allowed(s) && !self.book.is_bad(s)).cloned().collect();
        if keys.is_empty() || sources.is_empty() {
            return None;
        }
        if self.running.fetch_add(1, Ordering::AcqRel) >= self.cfg.max_pulls {
            self.running.fetch_sub(1, Ordering::AcqRel);
            metrics::counter!("kvcached_peer_pulls_refused_total").increment(1);
            return None;
        }
        let pull = Arc::new(Pull { namespace, keys, state: Mutex::new(Progress::default()), moved: Condvar::new() });
        {
            let mut inflight = self.inflight.lock();
            for (i, k) in pull.keys.iter().enumerate() {
                inflight.entry(*k).or_insert_with(|| (Arc::clone(&pull), i));
            }
        }
        let me = Arc::clone(self);
        let job = Arc::clone(&pull);
        let spawned = std::thread::Builder::new().name("kv-peer-pull".into()).spawn(move || {
            let end = me.run(&job, block_len, &sources);
            me.forget(&job);
            job.end(end);
            me.running.fetch_sub(1, Ordering::AcqRel);
        });
        if let Err(e) = spawned {
            tracing::warn!("cannot start a peer pull thread: {e}");
            self.forget(&pull);
            pull.end(PullEnd::Failed(e.to_string()));
            self.running.fetch_sub(1, Ordering::AcqRel);
        }
        Some(pull)
    }

    /// Whether `source` may be dialed; a refusal is counted and logged (rate-limited).
    fn allowed(&self, source: &str) -> bool {
        if self.sources.allows(source) {
            return true;
        }
        metrics::counter!("kvcached_peer_sources_refused_total").increment(1);
        self.refused_log.lock().note_as(
            "a load or hint named a source that is not in peer.peers or peer.allowed_sources: not dialed",
            &kvproto::limits::clip(source, 100),
        );
        false
    }

    fn forget(&self, pull: &Arc<Pull>) {
        let mut inflight = self.inflight.lock();
        for k in &pull.keys {
            if inflight.get(k).is_some_and(|(p, _)| Arc::ptr_eq(p, pull)) {
                inflight.remove(k);
            }
        }
    }

    /// Runs a pull to its end.
    fn run(&self, pull: &Pull, block_len: u64, sources: &[String]) -> PullEnd {
        let Some(store) = self.store.upgrade() else { return PullEnd::Failed("the daemon is stopping".into()) };
        let t0 = Instant::now();
        let mut done = 0usize;
        let mut last_err = None;
        for src in sources {
            if done == pull.keys.len() {
                break;
            }
            let started = Instant::now();
            let before = done;
            match self.pull_from(&Job { store: &store, pull, block_len }, src, &mut done) {
                Ok(()) => self.book.succeeded(src),
                Err(e) => {
                    self.book.failed(src, &e.why, e.how, self.longest_bar());
                    last_err = Some(format!("{src}: {}", e.why));
                }
            }
            let bytes = (done - before) as u64 * block_len;
            self.book.sample(src, bytes, started.elapsed());
            metrics::counter!("kvcached_peer_pulled_blocks_total").increment((done - before) as u64);
            metrics::counter!("kvcached_peer_pulled_bytes_total").increment(bytes);
        }
        metrics::histogram!("kvcached_peer_pull_duration_seconds").record(t0.elapsed().as_secs_f64());
        if done == pull.keys.len() {
            PullEnd::Complete
        } else if let Some(e) = last_err {
            PullEnd::Failed(e)
        } else {
            PullEnd::Partial
        }
    }

    /// The longest a failed peer is barred (`peer.bad_peer_ms`).
    fn longest_bar(&self) -> Duration {
        Duration::from_millis(self.cfg.bad_peer_ms)
    }

    /// A connection to `src` that has passed the hello: an idle one that is still open (and
    /// whether it is one), or a new one. An idle connection kept past [`POOL_IDLE`] (the serving
    /// side closes one idle for 60 s), or one the peer has closed meanwhile (it restarted), is
    /// dropped, not used.
    fn connection(&self, src: &str) -> Result<(SyncStream, bool), String> {
        loop {
            let Some((c, since)) = self.idle.lock().get_mut(src).and_then(Vec::pop) else { break };
            if since.elapsed() < POOL_IDLE && still_open(&c) {
                return Ok((c, true));
            }
        }
        self.fresh(src).map(|c| (c, false))
    }

    /// A new connection to `src`, past the hello.
    fn fresh(&self, src: &str) -> Result<SyncStream, String> {
        let timeout = Duration::from_millis(self.cfg.connect_timeout_ms);
        let mut c = self.connector.connect_blocking(src, timeout).map_err(|e| format!("connect: {e}"))?;
        let token = self.connector.bearer();
        p::write_hello(&mut c, token.as_deref().map(String::as_str)).map_err(|e| format!("hello: {e}"))?;
        match p::read_u8(&mut c).map_err(|e| format!("hello: {e}"))? {
            0 => {
                let _ = p::read_text(&mut c);
                Ok(c)
            }
            _ => Err(format!("refused: {}", p::read_text(&mut c).unwrap_or_default())),
        }
    }

    fn keep(&self, src: &str, c: SyncStream) {
        let mut idle = self.idle.lock();
        let v = idle.entry(src.to_string()).or_default();
        if v.len() < POOL_PER_PEER {
            v.push((c, Instant::now()));
        }
    }

    /// Asks `src` for the keys from `*done` on; each block that arrives intact goes into G2 and
    /// advances `*done`. `Ok` when the peer answered in full (with however many it had).
    fn pull_from(&self, job: &Job<'_>, src: &str, done: &mut usize) -> Result<(), PullErr> {
        let (c, reused) = self.connection(src).map_err(PullErr::transient)?;
        match self.pull_on(c, job, src, done) {
            // A kept connection that failed before the first block (closed by the peer since:
            // an idle timeout, a restart): once more on a new one, and the peer is not blamed.
            Err(e) if reused && !e.after_first => {
                tracing::debug!(src, "a kept peer connection failed ({}); pulling again on a new one", e.why);
                let c = self.fresh(src).map_err(PullErr::transient)?;
                self.pull_on(c, job, src, done)
            }
            r => r,
        }
    }

    /// [`Self::pull_from`] on connection `c`; an error says whether any block had arrived.
    fn pull_on(&self, mut c: SyncStream, job: &Job<'_>, src: &str, done: &mut usize) -> Result<(), PullErr> {
        let Job { store, pull, block_len } = *job;
        let io = Duration::from_millis(self.cfg.io_timeout_ms);
        let _ = c.tcp().set_read_timeout(Some(io));
        let _ = c.tcp().set_write_timeout(Some(io));
        let want = &pull.keys[*done..];
        p::write_pull(&mut c, &pull.namespace, want).map_err(|e| PullErr::transient(format!("request: {e}")))?;
        let mut i = 0usize;
        loop {
            let tag = p::read_u8(&mut c).map_err(|e| PullErr::io(format!("reply: {e}"), &e, i > 0))?;
            match tag {
                p::TAG_BLOCK => {
                    let h =
                        BlockHeader::read(&mut c).map_err(|e| PullErr::io(format!("block header: {e}"), &e, true))?;
                    let Some(expected) = want.get(i) else {
                        return Err(PullErr::wrong("sent more blocks than asked".into()));
                    };
                    if h.key != *expected || h.len != block_len {
                        self.corrupt(src);
                        return Err(PullErr::wrong(format!(
                            "sent block {} ({} bytes) where {} ({block_len} bytes) was next",
                            h.key, h.len, expected
                        )));
                    }
                    match self.receive(store, &mut c, pull.namespace, &h) {
                        Ok(()) => {}
                        Err(Reject::Wrong(why)) => {
                            self.corrupt(src);
                            return Err(PullErr::wrong(why));
                        }
                        Err(Reject::Full(why)) => return Err(PullErr::midway(why)),
                        Err(Reject::Io(e)) => return Err(PullErr::io(format!("mid-block: {e}"), &e, true)),
                    }
                    i += 1;
                    *done += 1;
                    pull.arrived(*done);
                }
                p::TAG_END => {
                    let _ = p::read_u32(&mut c);
                    self.keep(src, c);
                    return Ok(());
                }
                p::TAG_REFUSED => {
                    let why = p::read_text(&mut c).unwrap_or_default();
                    self.keep(src, c);
                    // An answer, not a dead connection: not tried again.
                    return Err(PullErr::midway(format!("refused: {why}")));
                }
                t => return Err(PullErr::wrong(format!("unknown reply tag {t}"))),
            }
        }
    }

    fn corrupt(&self, src: &str) {
        metrics::counter!("kvcached_peer_corrupt_blocks_total", "peer" => src.to_string()).increment(1);
    }

    /// Reads one block's bytes from `c` into G2 pages, hashing as they arrive; a block whose
    /// checksum fails never becomes visible.
    fn receive(
        &self,
        store: &BlockStore,
        c: &mut SyncStream,
        namespace: NamespaceId,
        h: &BlockHeader,
    ) -> Result<(), Reject> {
        let meta = BlockMeta { namespace, parent: h.parent, len: h.len, owner: None };
        let mut outcome: Option<Result<(), Reject>> = None;
        let stored = store.put_with(h.key, meta, |dst| {
            let mut hasher = p::block_sum();
            for piece in dst.iter_mut() {
                for step in piece.chunks_mut(p::HASH_STEP) {
                    if let Err(e) = c.read_exact(step) {
                        outcome = Some(Err(Reject::Io(e)));
                        return Err(peer_err("peer read"));
                    }
                    hasher.update(step);
                }
            }
            match p::read_u64(c) {
                Ok(sum) if sum == hasher.finalize() => {
                    outcome = Some(Ok(()));
                    Ok(())
                }
                Ok(_) => {
                    outcome = Some(Err(Reject::Wrong(format!("block {} failed its checksum", h.key))));
                    Err(peer_err("peer checksum"))
                }
                Err(e) => {
                    outcome = Some(Err(Reject::Io(e)));
                    Err(peer_err("peer read"))
                }
            }
        });
        match (stored, outcome) {
            (_, Some(Err(r))) => Err(r),
            (Ok(_), Some(Ok(()))) => Ok(()),
            // Not filled: already in G2 (a concurrent save or pull), or no room. The bytes are
            // still on the wire: read past them to stay in step.
            (Ok(_), None) => p::skip(c, h.len + 8).map_err(Reject::Io),
            (Err(e), _) => {
                p::skip(c, h.len + 8).map_err(Reject::Io)?;
                Err(Reject::Full(format!("G2 cannot take a pulled block: {e}")))
            }
        }
    }

    /// Measures the link to `src` with a probe of `bytes`.
    pub fn probe(&self, src: &str, bytes: u32) -> Result<f64, String> {
        let (mut c, _) = self.connection(src)?;
        let t0 = Instant::now();
        let mut req = vec![p::OP_PROBE];
        req.extend_from_slice(&bytes.min(p::MAX_PROBE).to_le_bytes());
        c.write_all(&req).and_then(|()| c.flush()).map_err(|e| format!("probe: {e}"))?;
        p::skip(&mut c, u64::from(bytes.min(p::MAX_PROBE))).map_err(|e| format!("probe: {e}"))?;
        if p::read_u8(&mut c).map_err(|e| format!("probe: {e}"))? != p::TAG_END {
            return Err("probe: no END".into());
        }
        let _ = p::read_u32(&mut c);
        let took = t0.elapsed();
        self.keep(src, c);
        self.book.sample(src, u64::from(bytes), took);
        Ok(f64::from(bytes) / took.as_secs_f64())
    }
}
