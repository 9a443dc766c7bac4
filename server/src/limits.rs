//! What each client holds, counted per uid, and the refusals when a limit is reached
//! (`[limits]` in the configuration; docs/operations.md, "Security"). Every count is taken by a
//! guard and given back when the guard drops, on every path.
//!
//! One uid reaching its limits never keeps another from being served: connections, engines,
//! loads in flight and bytes of requests still arriving are bounded per uid, and the totals are
//! bounded below what the process can hold (file descriptors, `engines.max_engines`).

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
    pending_loads: usize,
    buffered: u64,
}

impl Use {
    fn is_zero(&self) -> bool {
        self.connections == 0 && self.engines == 0 && self.pending_loads == 0 && self.buffered == 0
    }
}

/// The counts and the limits.
#[derive(Debug)]
pub struct Limits {
    pub cfg: LimitsConfig,
    /// Connections over every listener may not pass this (the configured limit, or half the
    /// descriptors the process may open, whichever is lower).
    pub max_connections: usize,
    inner: Mutex<Inner>,
    refused: metrics::Counter,
}

#[derive(Debug, Default)]
struct Inner {
    connections: usize,
    per: HashMap<Principal, Use>,
}

/// Which limit refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Connections,
    ConnectionsPerUid,
    EnginesPerUid,
    LoadsPerUid,
    BufferedPerUid,
}

impl Limit {
    fn label(self) -> &'static str {
        match self {
            Limit::Connections => "connections",
            Limit::ConnectionsPerUid => "connections_per_uid",
            Limit::EnginesPerUid => "engines_per_uid",
            Limit::LoadsPerUid => "pending_loads_per_uid",
            Limit::BufferedPerUid => "buffered_bytes_per_uid",
        }
    }
}

impl Limits {
    pub fn new(cfg: LimitsConfig, fd_limit: u64) -> Arc<Self> {
        let max_connections = cfg.max_connections.min(usize::try_from(fd_limit / 2).unwrap_or(usize::MAX)).max(1);
        Arc::new(Self {
            cfg,
            max_connections,
            inner: Mutex::new(Inner::default()),
            refused: metrics::counter!("kvcached_limit_refusals_total"),
        })
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
            "the daemon holds {have} of its {} connections (limits.max_connections, at most half the open-file limit)",
            self.max_connections
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
        if g.connections >= self.max_connections {
            let n = g.connections;
            drop(g);
            return Err(self.refuse_total(n as u64));
        }
        // TCP clients count as one principal: until TCP is authenticated they cannot hold more
        // than one uid may.
        let per = self.cfg.max_connections_per_uid;
        let u = g.per.entry(who).or_default();
        if u.connections >= per {
            let n = u.connections;
            drop(g);
            return Err(self.refuse(Limit::ConnectionsPerUid, who, n as u64, per as u64));
        }
        u.connections += 1;
        g.connections += 1;
        metrics::gauge!("kvcached_connections").set(g.connections as f64);
        Ok(Held { limits: Arc::clone(self), who, what: Holding::Connection })
    }

    /// An engine of `who` attaches.
    pub fn engine(self: &Arc<Self>, who: Principal) -> Result<Held, ServerError> {
        let max = self.cfg.max_engines_per_uid;
        self.with_use(who, |u| {
            if u.engines >= max {
                return Err(u.engines);
            }
            u.engines += 1;
            Ok(())
        })
        .map_err(|n| self.refuse(Limit::EnginesPerUid, who, n as u64, max as u64))?;
        Ok(Held { limits: Arc::clone(self), who, what: Holding::Engine })
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

#[derive(Debug, Clone, Copy)]
enum Holding {
    Connection,
    Engine,
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
        if matches!(what, Holding::Connection) {
            let mut g = self.limits.inner.lock();
            g.connections = g.connections.saturating_sub(1);
            metrics::gauge!("kvcached_connections").set(g.connections as f64);
        }
        self.limits.with_use(self.who, |u| match what {
            Holding::Connection => u.connections = u.connections.saturating_sub(1),
            Holding::Engine => u.engines = u.engines.saturating_sub(1),
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
        let l = Limits::new(cfg, 1 << 20);
        let a = Principal::Uid(1000);
        let (c1, c2) = (l.connect(a).unwrap(), l.connect(a).unwrap());
        assert!(l.connect(a).is_err());
        let b = l.connect(Principal::Uid(1001)).unwrap();
        let e = l.connect(Principal::Uid(1002)).unwrap_err().to_string();
        assert!(e.contains("the daemon holds 3 of its 3 connections"), "{e}");
        drop((c1, b));
        assert!(l.connect(a).is_ok());
        let e = l.engine(a).unwrap();
        assert!(l.engine(a).is_err() && l.engine(Principal::Uid(1001)).is_ok());
        drop(e);
        assert!(l.engine(a).is_ok());
        l.buffer(a, l.cfg.max_buffered_bytes_per_uid).unwrap();
        assert!(l.buffer(a, 1).is_err() && l.buffer(Principal::Uid(7), 1).is_ok());
        l.unbuffer(a, l.cfg.max_buffered_bytes_per_uid);
        assert!(l.buffer(a, 1).is_ok());
        drop(c2);
    }

    #[test]
    fn the_fd_limit_bounds_connections() {
        let l = Limits::new(LimitsConfig::default(), 100);
        assert_eq!(l.max_connections, 50);
        assert!(raise_fd_limit() >= 1024);
    }
}
