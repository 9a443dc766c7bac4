//! What each client holds, counted per uid, and the refusals when a limit is reached
//! (`[limits]` in the configuration; docs/operations/security-limits.md, "Limits"). Every count
//! is taken by a guard and given back when the guard drops, on every path.
//!
//! One uid reaching its limits never keeps another from being served: connections, engines,
//! the engine memory the daemon maps, loads in flight and bytes of requests still arriving are
//! bounded per uid, and the totals are bounded below what the process can hold (file
//! descriptors, `engines.max_engines`). Nor can a set of uids, each within its own limits, lock
//! a new one out of the totals ([`Share`]): the last eighth of each total is kept for uids that
//! hold almost none of it yet (fewer than [`STARTER_CONNECTIONS`] connections, no engine), and
//! root and the daemon's own uid have an eighth of their own beyond it.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::config::LimitsConfig;
use crate::error::ServerError;

/// Who is asking: the uid of a Unix-socket peer, or a TCP client (no uid).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Principal {
    Uid(u32),
    /// A TCP client (until authentication exists, it may only ask for Health).
    Tcp,
}

impl std::fmt::Display for Principal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Principal::Uid(u) => write!(f, "uid {u}"),
            Principal::Tcp => f.write_str("a TCP client"),
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Use {
    connections: usize,
    engines: usize,
    /// Registrations sharing the memory of one of this uid's engines (`engine::memory`): each
    /// counts against `engines.max_engines` (it holds a token area and a registration of its
    /// own), not against the uid's engines.
    sharers: usize,
    /// Bytes of engine memory mapped for this uid's engines.
    engine_bytes: u64,
    pending_loads: usize,
    buffered: u64,
}

impl Use {
    fn is_zero(&self) -> bool {
        self.connections == 0
            && self.engines == 0
            && self.sharers == 0
            && self.engine_bytes == 0
            && self.pending_loads == 0
            && self.buffered == 0
    }
}

/// Connections a uid may take from the reserve: what one engine needs to start (its gRPC
/// connection, an ATTACH exchange, a LOOKUP connection or two).
pub const STARTER_CONNECTIONS: usize = 4;

/// Who may take one more of a total (connections, engines) of `max`, `reserve` of which are
/// kept back: uids that already hold some take from `max - reserve`; a uid that holds almost
/// none yet may take from all of `max` (so no set of uids at their own limits locks a new one
/// out); root and the daemon's own uid ([`Limits::privileged`]) have `reserve` more beyond `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Share {
    Shared,
    Newcomer,
    Privileged,
}

impl Share {
    /// Whether a holder of this share may take one more when `total` are taken.
    pub fn admits(self, total: usize, max: usize) -> bool {
        let reserve = reserve_of(max);
        match self {
            Share::Shared => total < max - reserve,
            Share::Newcomer => total < max,
            Share::Privileged => total < max + reserve,
        }
    }
}

/// The part of a total of `max` kept back from uids that already hold some: an eighth, at
/// least one (none of a total of 1).
pub fn reserve_of(max: usize) -> usize {
    if max <= 1 { 0 } else { (max / 8).max(1) }
}

/// The counts and the limits.
#[derive(Debug)]
pub struct Limits {
    pub cfg: LimitsConfig,
    /// Connections over every listener may not pass this (the configured limit, or half the
    /// descriptors the process may open, whichever is lower).
    pub max_connections: usize,
    /// Engines attached at once (`engines.max_engines`).
    pub max_engines: usize,
    /// Bytes of engine memory one uid's engines may have mapped
    /// (`limits.max_engine_memory_bytes_per_uid`, 0 there: a quarter of the machine's memory).
    pub max_engine_bytes: u64,
    /// The daemon's own uid (with root, [`Share::Privileged`]).
    own_uid: u32,
    inner: Mutex<Inner>,
    refused: metrics::Counter,
}

#[derive(Debug, Default)]
struct Inner {
    connections: usize,
    engines: usize,
    per: HashMap<Principal, Use>,
}

/// Which limit refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Connections,
    ConnectionsPerUid,
    EnginesPerUid,
    EngineMemoryPerUid,
    Engines,
    LoadsPerUid,
    BufferedPerUid,
}

impl Limit {
    /// Every limit.
    pub(crate) const ALL: [Limit; 7] = [
        Limit::Connections,
        Limit::ConnectionsPerUid,
        Limit::EnginesPerUid,
        Limit::EngineMemoryPerUid,
        Limit::Engines,
        Limit::LoadsPerUid,
        Limit::BufferedPerUid,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Limit::Connections => "connections",
            Limit::ConnectionsPerUid => "connections_per_uid",
            Limit::EnginesPerUid => "engines_per_uid",
            Limit::EngineMemoryPerUid => "engine_memory_bytes_per_uid",
            Limit::Engines => "max_engines",
            Limit::LoadsPerUid => "pending_loads_per_uid",
            Limit::BufferedPerUid => "buffered_bytes_per_uid",
        }
    }
}

impl Limits {
    /// The limits of `cfg`, with at most `max_engines` engines and half of `fd_limit`
    /// connections.
    pub fn new(cfg: LimitsConfig, fd_limit: u64, max_engines: usize) -> Arc<Self> {
        // Room for the privileged share beyond the total: the total is at most 8/9 of half the
        // descriptors.
        let fd_room = usize::try_from(fd_limit / 2).unwrap_or(usize::MAX);
        let fd_room = fd_room - reserve_of(fd_room);
        let max_connections = cfg.max_connections.min(fd_room).max(1);
        let max_engine_bytes = match cfg.max_engine_memory_bytes_per_uid {
            0 => physical_memory() / 4,
            n => n,
        };
        Arc::new(Self {
            cfg,
            max_connections,
            max_engines: max_engines.max(1),
            max_engine_bytes,
            // SAFETY: geteuid has no failure mode.
            own_uid: unsafe { libc::geteuid() },
            inner: Mutex::new(Inner::default()),
            refused: metrics::counter!("kvcached_limit_refusals_total"),
        })
    }

    /// Whether `who` is root or the daemon's own uid.
    pub fn privileged(&self, who: Principal) -> bool {
        matches!(who, Principal::Uid(u) if u == 0 || u == self.own_uid)
    }

    /// The share of a total `who` takes from, holding `held` of it now, `starter` of which
    /// still count as a newcomer's.
    fn share(&self, who: Principal, held: usize, starter: usize) -> Share {
        if self.privileged(who) {
            Share::Privileged
        } else if held < starter {
            Share::Newcomer
        } else {
            Share::Shared
        }
    }

    fn refuse(&self, limit: Limit, who: Principal, have: u64, max: u64) -> ServerError {
        self.refused.increment(1);
        metrics::counter!("kvcached_limit_refusals_by_limit_total", "limit" => limit.label()).increment(1);
        ServerError::Exhausted(format!("{who} holds {have} of its {max} {} (limits)", limit.label().replace('_', " ")))
    }

    fn refuse_total(&self, have: u64) -> ServerError {
        self.refused.increment(1);
        metrics::counter!("kvcached_limit_refusals_by_limit_total", "limit" => Limit::Connections.label()).increment(1);
        ServerError::Exhausted(format!(
            "the daemon holds {have} of its {} connections (limits.max_connections, at most half the open-file \
             limit; the last {} are kept for uids that hold none)",
            self.max_connections,
            reserve_of(self.max_connections)
        ))
    }

    /// A refusal by a limit kept elsewhere (`engines.max_engines`, `engines.max_pending_loads`,
    /// ATTACH tickets), counted with the others.
    pub fn count_refusal(&self, limit: &'static str) {
        self.refused.increment(1);
        metrics::counter!("kvcached_limit_refusals_by_limit_total", "limit" => limit).increment(1);
    }

    fn with_use<T>(&self, who: Principal, f: impl FnOnce(&mut Use) -> T) -> T {
        let mut g = self.inner.lock();
        let u = g.per.entry(who).or_default();
        let out = f(u);
        if u.is_zero() {
            g.per.remove(&who);
        }
        out
    }

    /// A connection of `who` opens; refused past the total or the per-uid limit.
    pub fn connect(self: &Arc<Self>, who: Principal) -> Result<Held, ServerError> {
        let mut g = self.inner.lock();
        let holds = g.per.get(&who).map_or(0, |u| u.connections);
        if !self.share(who, holds, STARTER_CONNECTIONS).admits(g.connections, self.max_connections) {
            let n = g.connections;
            drop(g);
            return Err(self.refuse_total(n as u64));
        }
        // TCP clients count as one principal: until TCP is authenticated they cannot hold more
        // than one uid may.
        let per = self.cfg.max_connections_per_uid;
        if holds >= per {
            drop(g);
            return Err(self.refuse(Limit::ConnectionsPerUid, who, holds as u64, per as u64));
        }
        g.per.entry(who).or_default().connections += 1;
        g.connections += 1;
        metrics::gauge!("kvcached_connections").set(g.connections as f64);
        Ok(Held { limits: Arc::clone(self), who, what: Holding::Connection })
    }

    /// An engine of `who` attaches, mapping `bytes` of its memory into the daemon (0 for memory
    /// the daemon does not map into its own address space, a GPU's). Refused past the uid's
    /// engines or engine memory, or past its share of `engines.max_engines`.
    pub fn engine(self: &Arc<Self>, who: Principal, bytes: u64) -> Result<Held, ServerError> {
        let (max, max_bytes) = (self.cfg.max_engines_per_uid, self.max_engine_bytes);
        let mut g = self.inner.lock();
        let u = g.per.get(&who).copied().unwrap_or_default();
        let refusal = if !self.admits_engine(who, &u, g.engines) {
            Some((Limit::Engines, g.engines as u64, self.max_engines as u64))
        } else if u.engines >= max {
            Some((Limit::EnginesPerUid, u.engines as u64, max as u64))
        } else if u.engine_bytes.saturating_add(bytes) > max_bytes {
            Some((Limit::EngineMemoryPerUid, u.engine_bytes, max_bytes))
        } else {
            None
        };
        if let Some((limit, have, max)) = refusal {
            drop(g);
            return Err(match limit {
                Limit::Engines => self.refuse_engines(have, max),
                Limit::EngineMemoryPerUid => {
                    self.refused.increment(1);
                    metrics::counter!("kvcached_limit_refusals_by_limit_total", "limit" => limit.label()).increment(1);
                    ServerError::Exhausted(format!(
                        "{who}'s engines map {have} bytes and this one {bytes} more, past its {max} \
                         (limits.max_engine_memory_bytes_per_uid)"
                    ))
                }
                _ => self.refuse(limit, who, have, max),
            });
        }
        g.engines += 1;
        let u = g.per.entry(who).or_default();
        u.engines += 1;
        u.engine_bytes += bytes;
        Ok(Held { limits: Arc::clone(self), who, what: Holding::Engine(bytes) })
    }

    /// A registration of `who` sharing the memory of one of its engines attaches: counted
    /// against `engines.max_engines` and the uid's share of it, not against its engines or
    /// engine memory (the memory's first registration holds those).
    pub fn sharer(self: &Arc<Self>, who: Principal) -> Result<Held, ServerError> {
        let mut g = self.inner.lock();
        let u = g.per.get(&who).copied().unwrap_or_default();
        if !self.admits_engine(who, &u, g.engines) {
            let have = g.engines as u64;
            drop(g);
            return Err(self.refuse_engines(have, self.max_engines as u64));
        }
        g.engines += 1;
        g.per.entry(who).or_default().sharers += 1;
        Ok(Held { limits: Arc::clone(self), who, what: Holding::Sharer })
    }

    /// Whether `who`, using `u`, may attach one more engine or sharing registration while
    /// `engines` are attached: its share of `engines.max_engines` counts both.
    fn admits_engine(&self, who: Principal, u: &Use, engines: usize) -> bool {
        self.share(who, u.engines + u.sharers, 1).admits(engines, self.max_engines)
    }

    fn refuse_engines(&self, have: u64, max: u64) -> ServerError {
        self.refused.increment(1);
        metrics::counter!("kvcached_limit_refusals_by_limit_total", "limit" => Limit::Engines.label()).increment(1);
        ServerError::Exhausted(format!(
            "{have} engines attached (engines.max_engines {max}, registrations sharing one memory included; the \
             last {} are kept for uids that hold none)",
            reserve_of(max as usize)
        ))
    }

    /// A load of `who` starts.
    pub fn load(self: &Arc<Self>, who: Principal) -> Result<Held, ServerError> {
        let max = self.cfg.max_pending_loads_per_uid;
        self.with_use(who, |u| {
            if u.pending_loads >= max {
                return Err(u.pending_loads);
            }
            u.pending_loads += 1;
            Ok(())
        })
        .map_err(|n| self.refuse(Limit::LoadsPerUid, who, n as u64, max as u64))?;
        Ok(Held { limits: Arc::clone(self), who, what: Holding::Load })
    }

    /// `n` more bytes of `who`'s requests arrived and wait for the rest; refused (and not
    /// counted) past the per-uid limit.
    pub fn buffer(&self, who: Principal, n: u64) -> Result<(), ServerError> {
        let max = self.cfg.max_buffered_bytes_per_uid;
        self.with_use(who, |u| {
            if u.buffered.saturating_add(n) > max {
                return Err(u.buffered);
            }
            u.buffered += n;
            Ok(())
        })
        .map_err(|have| self.refuse(Limit::BufferedPerUid, who, have, max))
    }

    /// [`Self::buffer`], the bytes held until the guard drops (a whole request read at once).
    pub fn buffer_held(self: &Arc<Self>, who: Principal, n: u64) -> Result<Held, ServerError> {
        self.buffer(who, n)?;
        Ok(Held { limits: Arc::clone(self), who, what: Holding::Buffered(n) })
    }

    /// `n` buffered bytes of `who` were consumed or dropped.
    pub fn unbuffer(&self, who: Principal, n: u64) {
        self.with_use(who, |u| u.buffered = u.buffered.saturating_sub(n));
    }

    /// Connections open now.
    pub fn connections(&self) -> usize {
        self.inner.lock().connections
    }
}

/// Bytes of physical memory (1 GiB where it cannot be read).
pub fn physical_memory() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let (pages, size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    if pages <= 0 || size <= 0 { 1 << 30 } else { pages as u64 * size as u64 }
}

#[derive(Debug, Clone, Copy)]
enum Holding {
    Connection,
    Engine(u64),
    Sharer,
    Load,
    Buffered(u64),
}

/// One connection, engine, load or request's bytes counted for its principal until dropped.
#[derive(Debug)]
pub struct Held {
    limits: Arc<Limits>,
    who: Principal,
    what: Holding,
}

impl Held {
    pub fn principal(&self) -> Principal {
        self.who
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let what = self.what;
        match what {
            Holding::Connection => {
                let mut g = self.limits.inner.lock();
                g.connections = g.connections.saturating_sub(1);
                metrics::gauge!("kvcached_connections").set(g.connections as f64);
            }
            Holding::Engine(_) | Holding::Sharer => {
                let mut g = self.limits.inner.lock();
                g.engines = g.engines.saturating_sub(1);
            }
            _ => {}
        }
        self.limits.with_use(self.who, |u| match what {
            Holding::Connection => u.connections = u.connections.saturating_sub(1),
            Holding::Engine(bytes) => {
                u.engines = u.engines.saturating_sub(1);
                u.engine_bytes = u.engine_bytes.saturating_sub(bytes);
            }
            Holding::Sharer => u.sharers = u.sharers.saturating_sub(1),
            Holding::Load => u.pending_loads = u.pending_loads.saturating_sub(1),
            Holding::Buffered(n) => u.buffered = u.buffered.saturating_sub(n),
        });
    }
}

/// Raises the soft limit of open files to the hard limit (a daemon serving many engines needs
/// more than the usual 1024) and returns it.
pub fn raise_fd_limit() -> u64 {
    // SAFETY: getrlimit/setrlimit write and read the struct we pass.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return 1024;
        }
        if r.rlim_cur < r.rlim_max {
            let wanted = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) == 0 {
                r.rlim_cur = r.rlim_max;
            }
        }
        r.rlim_cur
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn one_uid_at_its_limits_leaves_room_for_others_and_guards_give_back() {
        let cfg = LimitsConfig {
            max_connections_per_uid: 2,
            max_engines_per_uid: 1,
            max_connections: 3,
            ..Default::default()
        };
        let l = Limits::new(cfg, 1 << 20, 64);
        let a = Principal::Uid(1000);
        let (c1, c2) = (l.connect(a).unwrap(), l.connect(a).unwrap());
        assert!(l.connect(a).is_err());
        let b = l.connect(Principal::Uid(1001)).unwrap();
        let e = l.connect(Principal::Uid(1002)).unwrap_err().to_string();
        assert!(e.contains("the daemon holds 3 of its 3 connections"), "{e}");
        drop((c1, b));
        assert!(l.connect(a).is_ok());
        let e = l.engine(a, 0).unwrap();
        assert!(l.engine(a, 0).is_err() && l.engine(Principal::Uid(1001), 0).is_ok());
        drop(e);
        assert!(l.engine(a, 0).is_ok());
        l.buffer(a, l.cfg.max_buffered_bytes_per_uid).unwrap();
        assert!(l.buffer(a, 1).is_err() && l.buffer(Principal::Uid(7), 1).is_ok());
        l.unbuffer(a, l.cfg.max_buffered_bytes_per_uid);
        assert!(l.buffer(a, 1).is_ok());
        drop(c2);
    }

    #[test]
    fn the_fd_limit_bounds_connections() {
        // Half the descriptors, less the privileged share that may go beyond the total.
        let l = Limits::new(LimitsConfig::default(), 100, 64);
        assert_eq!(l.max_connections, 44);
        assert!(44 + reserve_of(44) <= 50);
        assert!(raise_fd_limit() >= 1024);
    }

    /// Finding 6 of issue 35: uids each within their own limits filled the totals and locked
    /// root and new uids out. The last eighth is kept for uids that hold none, and root has an
    /// eighth of its own beyond the total.
    #[test]
    fn uids_at_their_limits_leave_room_for_a_new_uid_and_for_root() {
        let cfg = LimitsConfig { max_connections: 64, max_connections_per_uid: 16, ..Default::default() };
        let l = Limits::new(cfg, 1 << 20, 16);
        let mut held = Vec::new();
        // Four uids take what the shared part gives them: 56 of 64.
        for uid in 1000..1004 {
            while let Ok(h) = l.connect(Principal::Uid(uid)) {
                held.push(h);
            }
        }
        assert_eq!(l.connections(), 56);
        // A fifth uid, a sixth: each gets in, from the reserve, as many as an engine needs.
        for uid in [2000, 2001] {
            for _ in 0..STARTER_CONNECTIONS {
                held.push(l.connect(Principal::Uid(uid)).unwrap());
            }
        }
        assert!(l.connect(Principal::Uid(2000)).is_err(), "a uid past its starter takes from the shared part");
        assert_eq!(l.connections(), 64);
        // Root gets in past the total, up to its own eighth beyond it.
        let root: Vec<_> = (0..8).map(|_| l.connect(Principal::Uid(0)).unwrap()).collect();
        assert!(l.connect(Principal::Uid(0)).is_err());
        drop(root);
        // Engines: the same shares of engines.max_engines, and memory per uid.
        let mut engines = Vec::new();
        for uid in 1000..1010 {
            if let Ok(e) = l.engine(Principal::Uid(uid), 1) {
                engines.push(e);
            }
            if let Ok(e) = l.engine(Principal::Uid(uid), 1) {
                engines.push(e);
            }
        }
        assert_eq!(engines.len(), 16, "two each while the shared part lasts, then one each from the reserve");
        let e = l.engine(Principal::Uid(0), 1).unwrap();
        let mem = l.max_engine_bytes;
        let too_big = l.engine(Principal::Uid(0), mem).unwrap_err().to_string();
        assert!(too_big.contains("max_engine_memory_bytes_per_uid"), "{too_big}");
        drop((e, engines, held));
        assert_eq!(l.connections(), 0);
    }
}
