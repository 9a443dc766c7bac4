//! What G3 tells `/healthz` and the metrics about its disk: blocks whose reads or writes failed
//! (an I/O error, ENOSPC, the index refusing a write), blocks that failed verification, and
//! batches slower than [`SLOW_BATCH`]. Each failure is served around (a miss, or the block
//! staying in G2 only), so nothing else would show that the disk is failing.
//!
//! The tier is degraded from the first failure until [`QUIET`] passes without another; the
//! reason counts the failures of that episode and quotes the last.

use std::time::{Duration, Instant};

use metrics::Counter;
use parking_lot::Mutex;

/// How long after its last failure G3 is reported degraded.
pub const QUIET: Duration = Duration::from_secs(30);

/// A batch (its I/O, fdatasync and index write) slower than this is a sick disk: NVMe answers in
/// milliseconds, and even a saturated one within a second.
pub const SLOW_BATCH: Duration = Duration::from_secs(5);

#[derive(Debug, Default)]
struct Episode {
    since: Option<Instant>,
    last: Option<Instant>,
    reads: u64,
    writes: u64,
    corrupt: u64,
    slow: u64,
    slowest: Duration,
    why: String,
}

/// G3's recent failures and their counters.
#[derive(Debug)]
pub(super) struct DiskHealth {
    episode: Mutex<Episode>,
    read_errors: Counter,
    write_errors: Counter,
    slow_batches: Counter,
}

impl Default for DiskHealth {
    fn default() -> Self {
        Self {
            episode: Mutex::new(Episode::default()),
            read_errors: metrics::counter!("kvcached_g3_io_errors_total", "op" => "read"),
            write_errors: metrics::counter!("kvcached_g3_io_errors_total", "op" => "write"),
            slow_batches: metrics::counter!("kvcached_g3_slow_batches_total"),
        }
    }
}

impl DiskHealth {
    fn record(&self, why: String, count: impl FnOnce(&mut Episode)) {
        let now = Instant::now();
        let mut e = self.episode.lock();
        if e.last.is_none_or(|t| now.duration_since(t) >= QUIET) {
            *e = Episode { since: Some(now), ..Episode::default() };
        }
        e.last = Some(now);
        count(&mut e);
        e.why = why;
    }

    /// A block could not be read (`io`: the read failed) or did not verify.
    pub(super) fn read_failed(&self, io: bool, why: &str) {
        if io {
            self.read_errors.increment(1);
        }
        self.record(format!("read: {why}"), |e| if io { e.reads += 1 } else { e.corrupt += 1 });
    }

    /// `blocks` blocks could not be written (or indexed).
    pub(super) fn write_failed(&self, blocks: usize, why: &str) {
        self.write_errors.increment(blocks as u64);
        self.record(format!("write: {why}"), |e| e.writes += blocks as u64);
    }

    /// A batch took `took`; recorded when slower than [`SLOW_BATCH`].
    pub(super) fn took(&self, op: &str, took: Duration) {
        if took < SLOW_BATCH {
            return;
        }
        self.slow_batches.increment(1);
        self.record(format!("a {op} batch took {:.1} s", took.as_secs_f64()), |e| {
            e.slow += 1;
            e.slowest = e.slowest.max(took);
        });
    }

    /// Why G3 is degraded now, if it is.
    pub(super) fn degraded(&self) -> Option<String> {
        let e = self.episode.lock();
        let (since, last) = (e.since?, e.last?);
        if last.elapsed() >= QUIET {
            return None;
        }
        let mut parts = Vec::new();
        for (n, what) in [
            (e.reads, "block reads failed"),
            (e.writes, "block writes failed"),
            (e.corrupt, "blocks failed verification"),
            (e.slow, "batches slower than 5 s"),
        ] {
            if n > 0 {
                parts.push(format!("{n} {what}"));
            }
        }
        Some(format!(
            "{} in the last {} s (last {} s ago: {})",
            parts.join(", "),
            since.elapsed().as_secs().max(1),
            last.elapsed().as_secs(),
            kvproto::limits::clip(&e.why, 300)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_make_an_episode_that_names_them() {
        let h = DiskHealth::default();
        assert_eq!(h.degraded(), None);
        h.took("read", Duration::from_millis(10));
        assert_eq!(h.degraded(), None, "a fast batch is not a failure");
        h.read_failed(true, "Input/output error (os error 5)");
        h.read_failed(false, "checksum mismatch");
        h.write_failed(3, "No space left on device (os error 28)");
        h.took("write", Duration::from_secs(6));
        let why = h.degraded().unwrap_or_default();
        for part in [
            "1 block reads failed",
            "3 block writes failed",
            "1 blocks failed verification",
            "1 batches slower than 5 s",
            "a write batch took 6.0 s",
        ] {
            assert!(why.contains(part), "{part:?} missing from {why:?}");
        }
        // Quiet long enough: healthy again.
        h.episode.lock().last = Instant::now().checked_sub(QUIET);
        assert_eq!(h.degraded(), None);
    }
}
