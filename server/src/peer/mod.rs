//! Peer transfer: daemons move blocks to each other. A decode node's daemon pulls the blocks it
//! lacks from the daemon that holds them (the prefill node's), in prompt order, each verified by
//! checksum as it arrives straight into G2; the load that asked copies each block on into engine
//! memory as soon as it is in, while later ones are still on the wire. A peer that is gone,
//! stalls or sends wrong bytes ends the pull: the rest comes from G4 or is a miss (recompute),
//! never wrong bytes. The same pulls serve prefetch (a router's hint that a request is coming).
//!
//! - [`protocol`]: the wire format.
//! - [`server`]: the `peer.listen` endpoint (authenticated by [`kvnet::Guard`]).
//! - [`pull`]: the puller, its connections and its progress.
//! - [`handoff`]: a load's (or prefetch's) use of pulls.
//! - [`sources`]: which addresses a load or a hint may make this daemon dial.
//! - this file: link rates and peer health (the `[peer]` settings are [`PeerConfig`]).

pub mod handoff;
pub mod protocol;
pub mod pull;
pub mod server;
pub mod sources;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

pub use crate::config::PeerConfig;
pub use handoff::Incoming;
pub use pull::{Peers, Pull};

/// A link's measured throughput (bytes a second), as a moving average of real transfers and
/// probes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkRate {
    pub bytes_per_s: f64,
    pub samples: u64,
    pub measured: Instant,
}

/// Weight of the newest sample in a link's average.
const LINK_EWMA: f64 = 0.3;
/// Transfers shorter than this measure latency, not throughput: not counted.
pub const MIN_SAMPLE_BYTES: u64 = 1 << 20;

/// The first bar of a peer that failed; each further failure in a row doubles it.
pub const FIRST_BAR: Duration = Duration::from_secs(1);

/// How a peer failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Unreachable, refused, or the connection closed or reset: perhaps passing (a restart, a
    /// blip), so barred briefly at first.
    Transient,
    /// Stalled while connected (silent past `peer.io_timeout_ms`) or sent wrong bytes (a
    /// checksum that fails, a block not asked for): barred for the longest bar at once.
    Faulty,
}

/// A failed peer: not asked until `until`; `streak` failures in a row.
#[derive(Debug, Clone)]
struct Bar {
    until: Instant,
    why: String,
    streak: u32,
}

/// Health and link rates of the peers this daemon has pulled from.
#[derive(Debug, Default)]
pub struct PeerBook {
    links: Mutex<HashMap<String, LinkRate>>,
    bad: Mutex<HashMap<String, Bar>>,
}

impl PeerBook {
    /// Records a transfer of `bytes` from `peer` that took `took`.
    pub fn sample(&self, peer: &str, bytes: u64, took: Duration) {
        if bytes < MIN_SAMPLE_BYTES || took.is_zero() {
            return;
        }
        let rate = bytes as f64 / took.as_secs_f64();
        let mut links = self.links.lock();
        let e = links.entry(peer.to_string()).or_insert(LinkRate {
            bytes_per_s: rate,
            samples: 0,
            measured: Instant::now(),
        });
        // A sample off by more than 2x is a changed link (rerouted, reshaped, congested), not
        // noise: the average starts over from it.
        let changed = e.samples > 0 && !(0.5..=2.0).contains(&(rate / e.bytes_per_s));
        if e.samples == 0 || changed {
            e.bytes_per_s = rate;
            e.samples = 0;
        } else {
            e.bytes_per_s = LINK_EWMA * rate + (1.0 - LINK_EWMA) * e.bytes_per_s;
        }
        e.samples += 1;
        e.measured = Instant::now();
        let rate = e.bytes_per_s;
        drop(links);
        metrics::gauge!("kvcached_peer_link_bytes_per_second", "peer" => peer.to_string()).set(rate);
    }

    /// When `peer`'s link was last measured.
    pub fn measured(&self, peer: &str) -> Option<Instant> {
        self.links.lock().get(peer).map(|l| l.measured)
    }

    /// Every measured link.
    pub fn links(&self) -> Vec<(String, LinkRate)> {
        self.links.lock().iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    /// Bars `peer` after a failure of kind `how`, with why: for [`FIRST_BAR`] doubled per
    /// failure in a row, at most `longest` (all of it for a faulty peer). Returns the bar.
    pub fn failed(&self, peer: &str, why: &str, how: Failure, longest: Duration) -> Duration {
        let bar = {
            let mut bad = self.bad.lock();
            // A bar over for longer than the longest bar ends its run: forgotten, so that the
            // table holds only peers that failed lately (loads may name many sources).
            let now = Instant::now();
            bad.retain(|_, b| b.until + longest > now);
            let e = bad.entry(peer.to_string()).or_insert(Bar { until: Instant::now(), why: String::new(), streak: 0 });
            e.streak = e.streak.saturating_add(1);
            let bar = match how {
                Failure::Faulty => longest,
                Failure::Transient => FIRST_BAR.saturating_mul(1 << (e.streak - 1).min(20)).min(longest),
            };
            e.until = Instant::now() + bar;
            e.why = why.to_string();
            bar
        };
        tracing::warn!(peer, "peer failed: {why}; not asked again for {} ms", bar.as_millis());
        metrics::counter!("kvcached_peer_failures_total", "peer" => peer.to_string()).increment(1);
        bar
    }

    /// Clears `peer`'s bar and its run of failures: it answered.
    pub fn succeeded(&self, peer: &str) {
        self.bad.lock().remove(peer);
    }

    /// Whether `peer` is barred now.
    pub fn is_bad(&self, peer: &str) -> bool {
        self.bad.lock().get(peer).is_some_and(|b| b.until > Instant::now())
    }

    /// Peers barred now, with why (for `/healthz`).
    pub fn bad_peers(&self) -> Vec<(String, String)> {
        let now = Instant::now();
        self.bad.lock().iter().filter(|(_, b)| b.until > now).map(|(p, b)| (p.clone(), b.why.clone())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transient failure bars for a second, doubling per failure in a row up to the
    /// longest; wrong bytes bar for the longest at once; a success clears the run.
    #[test]
    fn bars_grow_with_failures_in_a_row_and_a_success_clears_them() {
        let book = PeerBook::default();
        let longest = Duration::from_secs(30);
        let bars: Vec<u64> = (0..7).map(|_| book.failed("a", "x", Failure::Transient, longest).as_secs()).collect();
        assert_eq!(bars, [1, 2, 4, 8, 16, 30, 30]);
        assert!(book.is_bad("a"));
        book.succeeded("a");
        assert!(!book.is_bad("a") && book.bad_peers().is_empty());
        assert_eq!(book.failed("a", "x", Failure::Transient, longest), FIRST_BAR);
        assert_eq!(book.failed("b", "sum", Failure::Faulty, longest), longest);
        assert_eq!(book.bad_peers().len(), 2);
    }
}
