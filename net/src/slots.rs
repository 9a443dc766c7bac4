//! A listener's connection slots, for listeners that must stay answerable under a flood of
//! connections that hold a slot and do nothing (half-open, a byte now and then): when the
//! listener is full, a newcomer takes the place of the connection that has been idle longest
//! and has no request in flight ([`Slots::evict_idle`]), which is closed, rather than being
//! refused. A flood can then only displace itself: a real client's connection is the newest,
//! and it is busy as soon as its request has arrived.
//!
//! Each connection holds a [`Slot`] (given back when it drops) and notes what it does through
//! it: bytes read ([`Activity::touch`]) and requests from their start to their answer's end
//! ([`Activity::busy`]). One that was evicted sees it ([`Slot::poll_closed`], [`Slot::closed`])
//! and ends. A slot may carry what it holds elsewhere (`P`, a count of another table): an
//! eviction hands it to the newcomer, so the count stays exact.
//!
//! A connection that has never been touched (a handshake not yet done) was idle since it was
//! accepted: among those, the oldest is evicted first.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use parking_lot::Mutex;

/// Microseconds since the first call (a clock for "idle since").
fn now_us() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    u64::try_from(EPOCH.get_or_init(Instant::now).elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// What one connection does, shared by its slot, its I/O and its requests.
#[derive(Debug, Default)]
struct State {
    /// When it last read a byte, or a request of it started or ended ([`now_us`]).
    last: AtomicU64,
    /// Requests started and not yet answered in full.
    in_flight: AtomicUsize,
    /// Evicted: the connection must end.
    closed: AtomicBool,
    /// Who waits for `closed`.
    waker: Mutex<Option<Waker>>,
}

impl State {
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        let w = self.waker.lock().take();
        if let Some(w) = w {
            w.wake();
        }
    }

    fn poll_closed(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.closed.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        {
            let mut w = self.waker.lock();
            match &mut *w {
                Some(old) if old.will_wake(cx.waker()) => {}
                other => *other = Some(cx.waker().clone()),
            }
        }
        // Closed between the first look and the waker's registration: `close` may have found no
        // waker to wake.
        if self.closed.load(Ordering::Acquire) { Poll::Ready(()) } else { Poll::Pending }
    }
}

#[derive(Debug)]
struct Table<P> {
    next: u64,
    /// By id, i.e. in the order they were accepted.
    open: BTreeMap<u64, (Arc<State>, P)>,
}

/// The open connections of one listener. Cloning gives another handle on the same table.
#[derive(Debug)]
pub struct Slots<P> {
    table: Arc<Mutex<Table<P>>>,
}

impl<P> Clone for Slots<P> {
    fn clone(&self) -> Self {
        Self { table: Arc::clone(&self.table) }
    }
}

impl<P> Default for Slots<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P> Slots<P> {
    pub fn new() -> Self {
        Self { table: Arc::new(Mutex::new(Table { next: 0, open: BTreeMap::new() })) }
    }

    /// Connections holding a slot now.
    pub fn len(&self) -> usize {
        self.table.lock().open.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A slot for a new connection, carrying `held` until the slot drops or is evicted. The
    /// caller decides whether there is room ([`Self::len`], [`Self::evict_idle`]).
    pub fn insert(&self, held: P) -> Slot<P> {
        let state = Arc::new(State { last: AtomicU64::new(now_us()), ..State::default() });
        let mut t = self.table.lock();
        let id = t.next;
        t.next += 1;
        t.open.insert(id, (Arc::clone(&state), held));
        Slot { id, state, table: Arc::clone(&self.table) }
    }

    /// Closes the connection idle longest with no request in flight (the oldest among equals)
    /// and returns what its slot carried, for the newcomer; `None` when every connection has a
    /// request in flight.
    pub fn evict_idle(&self) -> Option<P> {
        let (state, held) = {
            let mut t = self.table.lock();
            let victim = t
                .open
                .iter()
                .filter(|(_, (s, _))| s.in_flight.load(Ordering::Acquire) == 0)
                .min_by_key(|(id, (s, _))| (s.last.load(Ordering::Acquire), **id))
                .map(|(id, _)| *id)?;
            t.open.remove(&victim)?
        };
        state.close();
        Some(held)
    }
}

/// One connection's place in its [`Slots`]; given back when dropped.
#[derive(Debug)]
pub struct Slot<P> {
    id: u64,
    state: Arc<State>,
    table: Arc<Mutex<Table<P>>>,
}

impl<P> Slot<P> {
    /// A handle for the connection's I/O and requests to note what they do.
    pub fn activity(&self) -> Activity {
        Activity(Arc::clone(&self.state))
    }

    /// Notes activity now (bytes read).
    pub fn touch(&self) {
        self.state.last.store(now_us(), Ordering::Release);
    }

    /// Whether the connection was evicted.
    pub fn is_closed(&self) -> bool {
        self.state.closed.load(Ordering::Acquire)
    }

    /// Ready once the connection has been evicted; wakes the last task that polled it.
    pub fn poll_closed(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.state.poll_closed(cx)
    }

    /// Resolves once the connection has been evicted.
    pub async fn closed(&self) {
        std::future::poll_fn(|cx| self.poll_closed(cx)).await;
    }
}

impl<P> Drop for Slot<P> {
    fn drop(&mut self) {
        // What the slot carried is dropped after the lock is released (it may take others).
        let gone = self.table.lock().open.remove(&self.id);
        drop(gone);
    }
}

/// What a connection does, noted from its I/O and its requests.
#[derive(Debug, Clone)]
pub struct Activity(Arc<State>);

impl Activity {
    /// Notes activity now (bytes read).
    pub fn touch(&self) {
        self.0.last.store(now_us(), Ordering::Release);
    }

    /// A request in flight until the guard drops (when its answer has been sent in full, or
    /// abandoned): the connection is not evicted meanwhile.
    pub fn busy(&self) -> Busy {
        self.touch();
        self.0.in_flight.fetch_add(1, Ordering::AcqRel);
        Busy(Arc::clone(&self.0))
    }
}

/// A request in flight ([`Activity::busy`]).
#[derive(Debug)]
pub struct Busy(Arc<State>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.last.store(now_us(), Ordering::Release);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn wait() {
        // The clock counts microseconds: make the next note later than the last.
        std::thread::sleep(std::time::Duration::from_millis(2));
    }

    #[test]
    fn the_idle_longest_without_a_request_in_flight_is_evicted_and_hands_over_what_it_held() {
        let slots = Slots::new();
        let a = slots.insert("a");
        wait();
        let b = slots.insert("b");
        wait();
        let c = slots.insert("c");
        wait();
        a.touch();
        let busy = b.activity().busy();
        assert_eq!(slots.len(), 3);
        // b is the oldest but busy; c was idle since before a's last read.
        assert_eq!(slots.evict_idle(), Some("c"));
        assert!(c.is_closed() && !a.is_closed() && !b.is_closed());
        assert_eq!(slots.len(), 2);
        assert_eq!(slots.evict_idle(), Some("a"));
        assert_eq!(slots.evict_idle(), None, "the only one left has a request in flight");
        drop(busy);
        assert_eq!(slots.evict_idle(), Some("b"));
        assert!(slots.is_empty());
        // Dropping an evicted slot gives back nothing more.
        drop((a, b, c));
        assert!(slots.is_empty());
    }

    #[test]
    fn a_dropped_slot_gives_back_what_it_held() {
        let slots = Slots::new();
        let held = Arc::new(());
        let s = slots.insert(Arc::clone(&held));
        assert_eq!(Arc::strong_count(&held), 2);
        drop(s);
        assert_eq!(Arc::strong_count(&held), 1);
        assert!(slots.is_empty());
    }

    #[tokio::test]
    async fn eviction_wakes_the_connection() {
        let slots = Slots::new();
        let s = slots.insert(());
        let waiting = tokio::spawn(async move {
            s.closed().await;
            s.is_closed()
        });
        tokio::task::yield_now().await;
        assert_eq!(slots.evict_idle(), Some(()));
        let closed = tokio::time::timeout(std::time::Duration::from_secs(5), waiting).await.unwrap().unwrap();
        assert!(closed);
    }
}
