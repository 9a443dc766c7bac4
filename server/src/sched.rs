//! How a save's copy shares the cores with the threads answering requests.
//!
//! A save's copy into G2 keeps a core busy for as long as its bytes take (2 GiB: about a third
//! of a second here). On a machine with as many busy threads as cores, a lookup's thread woken
//! meanwhile waited for the copy's time slice to end (Linux's EEVDF scheduler lets a running
//! task finish its slice, 1.4 ms on this two-core VM, before a task it woke preempts it), and
//! so did the engine's thread woken by the answer. So a save offers its core every
//! [`YIELD_EVERY`] bytes ([`between_copies`]): a thread waiting for it runs first, and when none
//! waits the copy goes on at once (`docs/benchmarks.md`, "Lookups beside a bulk save").

use std::cell::Cell;

/// Bytes a thread copies between two offers of its core (0.1-0.2 ms of copying here).
pub const YIELD_EVERY: u64 = 1 << 20;

thread_local! {
    /// Bytes this thread copied since it last offered its core.
    static SINCE_YIELD: Cell<u64> = const { Cell::new(0) };
}

/// After copying `bytes` (one block of a save): once this thread has copied [`YIELD_EVERY`]
/// bytes since it last did, lets a thread waiting for its core run first (`sched_yield`, which
/// returns at once when none waits).
pub fn between_copies(bytes: u64) {
    SINCE_YIELD.with(|s| {
        let n = s.get().saturating_add(bytes);
        if n >= YIELD_EVERY {
            std::thread::yield_now();
            s.set(0);
        } else {
            s.set(n);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_offers_its_core_once_per_mib_copied() {
        // Each test runs on a thread of its own: the count starts at 0.
        let since = || SINCE_YIELD.with(Cell::get);
        between_copies(YIELD_EVERY / 2);
        assert_eq!(since(), YIELD_EVERY / 2);
        between_copies(YIELD_EVERY / 4);
        assert_eq!(since(), 3 * YIELD_EVERY / 4, "no offer before a MiB");
        between_copies(YIELD_EVERY / 4);
        assert_eq!(since(), 0, "offered at a MiB");
        between_copies(2 << 20);
        assert_eq!(since(), 0, "a block over a MiB offers after it");
    }
}
