//! The block index: for every indexed block key, which holders hold it in which tier.
//!
//! Blocks are stored in **runs**: consecutive blocks of one chain (keys are chained, each names
//! its whole prefix) that have the same holder set. A run keeps its keys contiguously and one
//! holder set ([`Slots`]: up to three `(holder, tier)` pairs packed in a `u32` each, inline,
//! more on the heap) for all of them. A store of a chain the index has not seen is one new run
//! (or an append to the run its parent ends); where a store, a removal or a new holder diverges
//! from a run, the run is split so that every run keeps a single holder set.
//!
//! A [`KeyTable`] locates every block: key -> (run, offset), 12 bytes per slot, holding no key
//! (it compares the run's copy). So a single block can still be found, removed or given a new
//! holder. A second, small table holds each run's first key: a lookup finds a prompt's first
//! block there, compares the prompt's keys with the run's contiguous keys and probes again only
//! where the run ends or diverges (with chained keys, the next key can only start a run).
//! State per block: its 16-byte key in its run plus 12 bytes over the key table's load (40-80%).
//!
//! Holders are interned to 30-bit indices ([`HolderTable`]); a dropped holder's index is reused
//! only after every slot naming it has been removed.

use std::collections::HashMap;

use kvproto::events::Holder;
use kvproto::{BlockKey, NamespaceId, TierKind};

use crate::keytable::{KeyTable, Loc};

/// Largest holder index (30 bits; the top 2 bits of a [`Slot`] carry the tier).
pub const MAX_HOLDERS: u32 = (1 << 30) - 1;

/// A `(holder, tier)` pair packed in 32 bits: tier in the top 2 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot(u32);

impl Slot {
    /// Packs a holder index (< 2^30) and a tier.
    pub fn new(holder: u32, tier: TierKind) -> Self {
        Self(((tier.index() as u32) << 30) | (holder & MAX_HOLDERS))
    }
    /// The holder index.
    pub fn holder(self) -> u32 {
        self.0 & MAX_HOLDERS
    }
    /// The tier.
    pub fn tier(self) -> TierKind {
        TierKind::ALL[(self.0 >> 30) as usize]
    }
}

const EMPTY: u32 = u32::MAX;

/// The holders of one block: up to three inline, more on the heap.
#[derive(Debug, Clone)]
pub enum Slots {
    Inline([u32; 3]),
    Heap(Box<Vec<u32>>),
}

impl Default for Slots {
    fn default() -> Self {
        Slots::Inline([EMPTY; 3])
    }
}

impl Slots {
    /// Just `s`.
    fn one(s: Slot) -> Self {
        Slots::Inline([s.0, EMPTY, EMPTY])
    }

    /// Whether `s` is one of the slots.
    pub fn contains(&self, s: Slot) -> bool {
        match self {
            Slots::Inline(a) => a.contains(&s.0),
            Slots::Heap(v) => v.contains(&s.0),
        }
    }

    /// Whether `s` is the only slot.
    fn is_only(&self, s: Slot) -> bool {
        let mut it = self.iter();
        it.next() == Some(s) && it.next().is_none()
    }

    /// Adds a slot; false when it was already there.
    fn insert(&mut self, s: Slot) -> bool {
        match self {
            Slots::Inline(a) => {
                if a.contains(&s.0) {
                    return false;
                }
                if let Some(free) = a.iter_mut().find(|x| **x == EMPTY) {
                    *free = s.0;
                } else {
                    let mut v = a.to_vec();
                    v.push(s.0);
                    *self = Slots::Heap(Box::new(v));
                }
                true
            }
            Slots::Heap(v) => {
                if v.contains(&s.0) {
                    return false;
                }
                v.push(s.0);
                true
            }
        }
    }

    /// Removes every slot matching `pred`; returns how many were removed.
    fn remove_where(&mut self, mut pred: impl FnMut(Slot) -> bool) -> usize {
        match self {
            Slots::Inline(a) => {
                let mut n = 0;
                for x in a.iter_mut() {
                    if *x != EMPTY && pred(Slot(*x)) {
                        *x = EMPTY;
                        n += 1;
                    }
                }
                n
            }
            Slots::Heap(v) => {
                let before = v.len();
                v.retain(|x| !pred(Slot(*x)));
                let n = before - v.len();
                if v.len() <= 3 {
                    let mut a = [EMPTY; 3];
                    a[..v.len()].copy_from_slice(v);
                    *self = Slots::Inline(a);
                }
                n
            }
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Slots::Inline(a) => a.iter().all(|x| *x == EMPTY),
            Slots::Heap(v) => v.is_empty(),
        }
    }

    /// Iterates the slots.
    pub fn iter(&self) -> impl Iterator<Item = Slot> + '_ {
        let s: &[u32] = match self {
            Slots::Inline(a) => a,
            Slots::Heap(v) => v,
        };
        s.iter().filter(|x| **x != EMPTY).map(|x| Slot(*x))
    }

    fn heap_bytes(&self) -> usize {
        match self {
            Slots::Inline(_) => 0,
            Slots::Heap(v) => std::mem::size_of::<Vec<u32>>() + v.capacity() * 4,
        }
    }
}

impl Slots {
    /// Replaces the slots with `distinct` (slots the caller knows are distinct), keeping a heap
    /// allocation for the next time: a buffer refilled block after block.
    pub fn refill(&mut self, distinct: impl Iterator<Item = Slot>) {
        if let Slots::Heap(v) = self {
            v.clear();
            v.extend(distinct.map(|s| s.0));
            return;
        }
        let mut a = [EMPTY; 3];
        let mut n = 0;
        let mut distinct = distinct.peekable();
        while n < 3 {
            match distinct.next() {
                Some(s) => a[n] = s.0,
                None => break,
            }
            n += 1;
        }
        *self = if distinct.peek().is_some() {
            Slots::Heap(Box::new(a.iter().copied().chain(distinct.map(|s| s.0)).collect()))
        } else {
            Slots::Inline(a)
        };
    }
}

impl FromIterator<Slot> for Slots {
    fn from_iter<I: IntoIterator<Item = Slot>>(iter: I) -> Self {
        let mut slots = Slots::default();
        for s in iter {
            slots.insert(s);
        }
        slots
    }
}

/// Absolute offsets inside a run fit the key table's 16 bits.
const RUN_MAX: usize = 1 << 16;

/// A freed run keeps its key vector for the next run made at its index up to this capacity.
const KEEP_FREED_KEYS: usize = 256;

/// How many keys ahead a store prefetches key-table slots.
const PREFETCH: usize = 8;

/// A run: consecutive blocks of one chain (each key's parent is the key before it) held by the
/// same holder set. `start` is the absolute offset of its first live key (the key table stores
/// absolute offsets, so dropping a run's first keys moves nothing else).
#[derive(Debug, Default)]
struct Run {
    /// The run's keys after the first `skip`, which are dead: keys dropped from the front are
    /// only counted, and compacted away once they outnumber the live ones, so a run eaten from
    /// the front one block at a time does not copy its rest each time.
    keys: Vec<BlockKey>,
    skip: u32,
    start: u32,
    holders: Slots,
}

impl Run {
    /// The run's keys (offsets `start..end()`).
    fn live(&self) -> &[BlockKey] {
        self.keys.get(self.skip as usize..).unwrap_or(&[])
    }

    fn end(&self) -> usize {
        self.start as usize + self.live().len()
    }

    fn key(&self, off: u16) -> Option<&BlockKey> {
        self.live().get((off as usize).wrapping_sub(self.start as usize))
    }

    /// Drops the first `n` live keys (amortised O(1) a key).
    fn drop_front(&mut self, n: usize) {
        self.skip += n as u32;
        self.start += n as u32;
        if self.skip as usize * 2 > self.keys.len() {
            self.keys.drain(..self.skip as usize);
            self.skip = 0;
        }
    }

    /// Drops every live key from absolute offset `off` on.
    fn truncate(&mut self, off: usize) {
        self.keys.truncate(self.skip as usize + off - self.start as usize);
    }

    /// Gives back spare capacity when there is much of it (dead keys included).
    fn trim(&mut self, slack: usize) {
        let live = self.live().len();
        if self.keys.capacity() > live + slack {
            self.keys.drain(..self.skip as usize);
            self.skip = 0;
            self.keys.shrink_to_fit();
        }
    }

    /// How many of `keys` equal this run's keys from absolute offset `off` on.
    fn matching(&self, off: u16, keys: &[BlockKey]) -> usize {
        let base = (off as usize).saturating_sub(self.start as usize);
        keys.iter().zip(self.live().get(base..).unwrap_or(&[])).take_while(|(a, b)| a == b).count()
    }

    /// [`Run::matching`] for a lookup, reading few keys: as a key names its whole prefix, if the
    /// `j`-th keys are equal so are all before them, so the length is found by comparing the
    /// last candidate pair, then by bisection.
    fn matching_chain(&self, off: u16, keys: &[BlockKey]) -> usize {
        let base = (off as usize).saturating_sub(self.start as usize);
        let mine = self.live().get(base..).unwrap_or(&[]);
        let n = keys.len().min(mine.len());
        if n == 0 || keys[n - 1] == mine[n - 1] {
            return n;
        }
        // keys[..lo] are known equal, keys[hi - 1] known different.
        let (mut lo, mut hi) = (0, n);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if keys[mid - 1] == mine[mid - 1] {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    fn bytes(&self) -> usize {
        self.keys.capacity() * std::mem::size_of::<BlockKey>() + self.holders.heap_bytes()
    }
}

/// One namespace: the runs, the key table that locates every block in them, and the table of
/// run heads (first keys) that lookups use.
#[derive(Debug, Default)]
struct Space {
    table: KeyTable,
    heads: KeyTable,
    runs: Vec<Run>,
    free: Vec<u32>,
    /// Blocks the key table was sized for up front ([`BlockIndex::reserve`]): it never shrinks
    /// below that, and the namespace stays even when empty.
    reserved: usize,
}

impl Space {
    fn find(&self, k: &BlockKey) -> Option<Loc> {
        self.find_h(self.table.hash(k), k)
    }

    fn find_h(&self, h: u32, k: &BlockKey) -> Option<Loc> {
        let runs = &self.runs;
        self.table.find(h, |l| runs.get(l.run as usize).and_then(|r| r.key(l.off)) == Some(k))
    }

    /// The run whose first key is `k`.
    fn find_head(&self, k: &BlockKey) -> Option<Loc> {
        let runs = &self.runs;
        self.heads.find(self.heads.hash(k), |l| runs.get(l.run as usize).and_then(|r| r.key(l.off)) == Some(k))
    }

    /// Enters run `r`'s first key in the heads table.
    fn add_head(&mut self, r: u32) {
        let Space { heads, runs, .. } = self;
        let run = &runs[r as usize];
        let Some(k) = run.live().first() else { return };
        heads.reserve(1);
        let is_key = |l: Loc| runs.get(l.run as usize).and_then(|r| r.key(l.off)) == Some(k);
        heads.find_or_insert(heads.hash(k), is_key, Loc { run: r, off: run.start as u16 });
    }

    /// Removes run `r`'s first key from the heads table.
    fn drop_head(&mut self, r: u32) {
        let run = &self.runs[r as usize];
        if let Some(k) = run.live().first() {
            self.heads.remove(k, Loc { run: r, off: run.start as u16 });
        }
    }

    fn new_run(&mut self, holders: Slots) -> u32 {
        match self.free.pop() {
            Some(r) => {
                // The freed run's key vector, empty, keeps its capacity for the new run.
                let keys = std::mem::take(&mut self.runs[r as usize].keys);
                self.runs[r as usize] = Run { keys, skip: 0, start: 0, holders };
                r
            }
            None => {
                // Never more than `MAX_RUN` runs: 2^32 runs would need 200 GB for the runs alone.
                debug_assert!(self.runs.len() < crate::keytable::MAX_RUN as usize);
                self.runs.push(Run { keys: Vec::new(), skip: 0, start: 0, holders });
                (self.runs.len() - 1) as u32
            }
        }
    }

    /// Removes a run and its keys.
    fn free_run(&mut self, r: u32) {
        self.drop_head(r);
        let mut run = std::mem::take(&mut self.runs[r as usize]);
        self.table.remove_run(run.live(), r, run.start as usize);
        // Keep a small allocation for the run that reuses this index (churn frees and makes
        // runs of the same sizes over and over); a large one goes back (a dropped holder's
        // long runs must not stay allocated until their indices are reused).
        if run.keys.capacity() <= KEEP_FREED_KEYS {
            run.keys.clear();
            self.runs[r as usize].keys = run.keys;
        }
        self.free.push(r);
    }

    /// Moves the keys at absolute offsets `[a, b)` of run `r` (a prefix or a suffix of it) to a
    /// new run with the same holders; returns the new run.
    fn move_out(&mut self, r: u32, a: usize, b: usize) -> u32 {
        let (start, holders) = {
            let run = &self.runs[r as usize];
            (run.start as usize, run.holders.clone())
        };
        let keys: Vec<BlockKey> = self.runs[r as usize].live()[a - start..b - start].to_vec();
        self.drop_head(r);
        let n = self.new_run(holders);
        for (j, k) in keys.iter().enumerate() {
            self.table.repoint(k, Loc { run: r, off: (a + j) as u16 }, Loc { run: n, off: j as u16 });
        }
        self.runs[n as usize].keys = keys;
        let run = &mut self.runs[r as usize];
        if a == start {
            run.drop_front(b - a);
        } else {
            run.truncate(a);
        }
        let slack = run.live().len() + 8;
        run.trim(slack);
        self.add_head(r);
        self.add_head(n);
        n
    }

    /// Splits run `r` so that its absolute offsets `[a, b)` are one run, and returns that run.
    /// The largest piece stays in place, so a run eaten one block at a time costs O(n log n).
    fn isolate(&mut self, r: u32, a: usize, b: usize) -> u32 {
        let (s, e) = {
            let run = &self.runs[r as usize];
            (run.start as usize, run.end())
        };
        let (left, mid, right) = (a - s, b - a, e - b);
        if mid >= left && mid >= right {
            if left > 0 {
                self.move_out(r, s, a);
            }
            if right > 0 {
                self.move_out(r, b, e);
            }
            r
        } else if left >= right {
            if right > 0 {
                self.move_out(r, b, e);
            }
            self.move_out(r, a, b)
        } else {
            if left > 0 {
                self.move_out(r, s, a);
            }
            self.move_out(r, a, b)
        }
    }

    /// Gives memory back after large drops: a table (of keys or of run heads) filled to under
    /// an eighth is rehashed to its size (removals alone never shrink a table).
    fn shrink_if_sparse(&mut self) {
        for (t, floor) in [(&mut self.table, self.reserved), (&mut self.heads, 0)] {
            let keep = t.len().max(floor);
            if keep * 8 < t.slots() && t.slots() > 1024 {
                t.rehash(keep);
            }
        }
    }

    /// Whether the namespace can be dropped: nothing in it, nothing reserved.
    fn is_unused(&self) -> bool {
        self.table.is_empty() && self.reserved == 0
    }

    fn bytes(&self) -> usize {
        self.table.bytes()
            + self.heads.bytes()
            + self.runs.capacity() * std::mem::size_of::<Run>()
            + self.free.capacity() * 4
            + self.runs.iter().map(Run::bytes).sum::<usize>()
    }
}

/// The index of every namespace: per namespace, runs of blocks with one holder set each, and a
/// key table locating every block (see the module documentation).
#[derive(Debug, Default)]
pub struct BlockIndex {
    spaces: HashMap<NamespaceId, Space>,
    /// Number of `(block, holder, tier)` facts per holder index.
    per_holder: Vec<u64>,
    facts: u64,
    /// Scratch: the hashes of a store's keys.
    hashes: Vec<u32>,
}

impl BlockIndex {
    pub fn new() -> Self {
        Self::default()
    }

    fn count(&mut self, holder: u32, delta: i64) {
        let h = holder as usize;
        if self.per_holder.len() <= h {
            self.per_holder.resize(h + 1, 0);
        }
        self.per_holder[h] = self.per_holder[h].saturating_add_signed(delta);
        self.facts = self.facts.saturating_add_signed(delta);
    }

    /// Sizes namespace `ns`'s key table for `blocks` blocks up front (a router configured with
    /// the cluster's expected index size, `[[namespaces]] expected_blocks`): building the index
    /// then never grows the table, whose rehashes and fresh pages were half the time of a build
    /// from empty (docs/router.md, section 10). The table never shrinks below it.
    pub fn reserve(&mut self, ns: NamespaceId, blocks: usize) {
        let sp = self.spaces.entry(ns).or_default();
        sp.reserved = sp.reserved.max(blocks);
        sp.table.reserve(blocks.saturating_sub(sp.table.len()));
    }

    /// Records that `slot` holds every key of `keys` (a chain: each key's parent is the one
    /// before it, the first one's is `parent`) in `ns`.
    pub fn store(&mut self, ns: NamespaceId, parent: Option<&BlockKey>, keys: &[BlockKey], slot: Slot) {
        if keys.is_empty() {
            // Nothing to record, and no namespace to make for it.
            return;
        }
        let sp = self.spaces.entry(ns).or_default();
        sp.table.reserve(keys.len());
        let mut hashes = std::mem::take(&mut self.hashes);
        hashes.clear();
        hashes.extend(keys.iter().map(|k| sp.table.hash(k)));
        for h in hashes.iter().take(PREFETCH) {
            sp.table.prefetch(*h);
        }
        let mut added = 0i64;
        // Where the previous key of the chain lives (the run new keys may be appended to).
        let mut prev = parent.and_then(|p| sp.find(p));
        let mut i = 0;
        while i < keys.len() {
            if let Some(loc) = sp.find_h(hashes[i], &keys[i]) {
                let run = &sp.runs[loc.run as usize];
                let m = run.matching(loc.off, &keys[i..]).max(1);
                let mut last = Loc { run: loc.run, off: loc.off + (m - 1) as u16 };
                if !run.holders.contains(slot) {
                    let mid = sp.isolate(loc.run, loc.off as usize, loc.off as usize + m);
                    sp.runs[mid as usize].holders.insert(slot);
                    added += m as i64;
                    last = Loc { run: mid, off: (sp.runs[mid as usize].end() - 1) as u16 };
                }
                prev = Some(last);
                i += m;
                continue;
            }
            // New keys: appended to the previous key's run when that key ends a run held by
            // exactly `slot`, else a new run; until a key the index already has.
            let append = prev.filter(|l| {
                let r = &sp.runs[l.run as usize];
                l.off as usize + 1 == r.end() && r.end() < RUN_MAX && r.holders.is_only(slot)
            });
            let (r, fresh) = match append {
                Some(l) => {
                    sp.runs[l.run as usize].keys.reserve(keys.len() - i);
                    (l.run, false)
                }
                None => {
                    let r = sp.new_run(Slots::one(slot));
                    sp.runs[r as usize].keys.reserve_exact(keys.len() - i);
                    (r, true)
                }
            };
            let Space { table, runs, .. } = sp;
            while i < keys.len() {
                let off = runs[r as usize].end();
                if off >= RUN_MAX {
                    break;
                }
                if let Some(h) = hashes.get(i + PREFETCH) {
                    table.prefetch(*h);
                }
                let loc = Loc { run: r, off: off as u16 };
                let k = &keys[i];
                let is_key = |l: Loc| runs.get(l.run as usize).and_then(|r| r.key(l.off)) == Some(k);
                if table.find_or_insert(hashes[i], is_key, loc).is_some() {
                    break;
                }
                runs[r as usize].keys.push(*k);
                prev = Some(loc);
                added += 1;
                i += 1;
            }
            let run = &mut runs[r as usize];
            if run.live().is_empty() {
                sp.free_run(r);
                continue;
            }
            let slack = run.live().len() / 8 + 4;
            run.trim(slack);
            if fresh {
                sp.add_head(r);
            }
        }
        self.hashes = hashes;
        self.count(slot.holder(), added);
    }

    /// Records that `slot` no longer holds `keys` in `ns`, or in every namespace when `ns` is
    /// `None` (unknown keys are ignored).
    pub fn remove(&mut self, ns: Option<NamespaceId>, keys: &[BlockKey], slot: Slot) {
        let mut removed = 0i64;
        let spaces: Vec<NamespaceId> = match ns {
            Some(ns) => vec![ns],
            None => self.spaces.keys().copied().collect(),
        };
        for ns in spaces {
            let Some(sp) = self.spaces.get_mut(&ns) else { continue };
            let mut i = 0;
            while i < keys.len() {
                let Some(loc) = sp.find(&keys[i]) else {
                    i += 1;
                    continue;
                };
                let run = &sp.runs[loc.run as usize];
                let m = run.matching(loc.off, &keys[i..]).max(1);
                if run.holders.contains(slot) {
                    let mid = sp.isolate(loc.run, loc.off as usize, loc.off as usize + m);
                    let run = &mut sp.runs[mid as usize];
                    run.holders.remove_where(|s| s == slot);
                    removed += m as i64;
                    if run.holders.is_empty() {
                        sp.free_run(mid);
                    }
                }
                i += m;
            }
            if sp.is_unused() {
                self.spaces.remove(&ns);
            } else {
                sp.shrink_if_sparse();
            }
        }
        self.count(slot.holder(), -removed);
    }

    /// Removes every fact matching `pred` (a scan of the runs; used for `Cleared`, a publisher
    /// restart and dead holders). Returns how many facts were removed.
    pub fn remove_where(&mut self, mut pred: impl FnMut(Slot) -> bool) -> u64 {
        let mut removed_per: HashMap<u32, i64> = HashMap::new();
        for sp in self.spaces.values_mut() {
            let mut freed = false;
            for r in 0..sp.runs.len() {
                let run = &mut sp.runs[r];
                if run.live().is_empty() {
                    continue;
                }
                let len = run.live().len() as i64;
                run.holders.remove_where(|s| {
                    let hit = pred(s);
                    if hit {
                        *removed_per.entry(s.holder()).or_default() += len;
                    }
                    hit
                });
                if run.holders.is_empty() {
                    sp.free_run(r as u32);
                    freed = true;
                }
            }
            if freed {
                sp.shrink_if_sparse();
            }
        }
        self.spaces.retain(|_, sp| !sp.is_unused());
        let mut total = 0;
        for (h, n) in removed_per {
            self.count(h, -n);
            total += n as u64;
        }
        total
    }

    /// Facts (block x holder x tier) the holder has in the index.
    pub fn holder_facts(&self, holder: u32) -> u64 {
        self.per_holder.get(holder as usize).copied().unwrap_or(0)
    }

    /// The holders of `keys`, in order, stopping before the first key nobody holds: calls
    /// `f(position, len, slots)` for each stretch of `len` keys from `position` on that share one
    /// holder set; `f` returns false to stop early.
    pub fn walk(&self, ns: NamespaceId, keys: &[BlockKey], mut f: impl FnMut(usize, usize, &Slots) -> bool) {
        let Some(sp) = self.spaces.get(&ns) else { return };
        let mut pos = 0;
        while pos < keys.len() {
            // A prompt's first key, and the first key past where a run ends or diverges, can
            // only be a run's first key: each key's parent is the key before it in its run.
            let Some(loc) = sp.find_head(&keys[pos]) else { return };
            let run = &sp.runs[loc.run as usize];
            // Where the run ends, the next probe starts: fetch its slot while comparing keys.
            if let Some(next) = keys.get(pos + run.end() - loc.off as usize) {
                sp.heads.prefetch(sp.heads.hash(next));
            }
            let m = run.matching_chain(loc.off, &keys[pos..]).max(1);
            if !f(pos, m, &run.holders) {
                return;
            }
            pos += m;
        }
    }

    /// Number of distinct indexed blocks (over all namespaces).
    pub fn blocks(&self) -> usize {
        self.spaces.values().map(|s| s.table.len()).sum()
    }

    /// Number of runs (stretches of blocks with one holder set) over all namespaces.
    pub fn runs(&self) -> usize {
        self.spaces.values().map(|s| s.runs.len() - s.free.len()).sum()
    }

    /// Number of `(block, holder, tier)` facts.
    pub fn facts(&self) -> u64 {
        self.facts
    }

    /// Heap bytes of the index: key tables, runs (keys at their allocated capacity, spilled
    /// holder lists). Measured against a counting allocator in `benches/index.rs`.
    pub fn approx_bytes(&self) -> usize {
        self.spaces.values().map(Space::bytes).sum()
    }
}

/// Interns holders to dense indices. Index 0 is always [`Holder::Cluster`].
#[derive(Debug)]
pub struct HolderTable {
    by_holder: HashMap<Holder, u32>,
    names: Vec<Option<Holder>>,
    free: Vec<u32>,
}

impl Default for HolderTable {
    fn default() -> Self {
        let mut t = Self { by_holder: HashMap::new(), names: Vec::new(), free: Vec::new() };
        t.intern(&Holder::Cluster);
        t
    }
}

impl HolderTable {
    /// The index of `h`, assigning one if needed (`None` when 2^30 holders exist).
    pub fn intern(&mut self, h: &Holder) -> Option<u32> {
        if let Some(i) = self.by_holder.get(h) {
            return Some(*i);
        }
        let i = match self.free.pop() {
            Some(i) => {
                self.names[i as usize] = Some(h.clone());
                i
            }
            None => {
                let i = u32::try_from(self.names.len()).ok().filter(|i| *i <= MAX_HOLDERS)?;
                self.names.push(Some(h.clone()));
                i
            }
        };
        self.by_holder.insert(h.clone(), i);
        Some(i)
    }

    /// The index of `h` if known.
    pub fn get(&self, h: &Holder) -> Option<u32> {
        self.by_holder.get(h).copied()
    }

    /// The holder at index `i`.
    pub fn name(&self, i: u32) -> Option<&Holder> {
        self.names.get(i as usize).and_then(Option::as_ref)
    }

    /// Forgets `h` (call only after its facts were removed from the index).
    pub fn release(&mut self, h: &Holder) {
        if matches!(h, Holder::Cluster) {
            return;
        }
        if let Some(i) = self.by_holder.remove(h) {
            self.names[i as usize] = None;
            self.free.push(i);
        }
    }

    /// Live holders.
    pub fn len(&self) -> usize {
        self.by_holder.len()
    }

    /// Never true (the cluster holder always exists).
    pub fn is_empty(&self) -> bool {
        self.by_holder.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty index, namespace `[n; 16]`, and holders 1 and 2 in tiers `ta` and `tb`.
    fn two_holders(n: u8, ta: TierKind, tb: TierKind) -> (NamespaceId, BlockIndex, Slot, Slot) {
        (NamespaceId([n; 16]), BlockIndex::new(), Slot::new(1, ta), Slot::new(2, tb))
    }

    fn chain(base: u64, n: u64) -> Vec<BlockKey> {
        (0..n).map(|i| kvproto::events::key_from_u64(base + i)).collect()
    }

    /// A run eaten from the front one block at a time (a second holder storing a shared prefix
    /// one block per event, or removals in chain order): every block is still found where it
    /// is, the counts stay right, and the dead keys are compacted away as they go.
    #[test]
    fn a_run_eaten_from_the_front_stays_right_and_compact() {
        let (ns, mut ix, a, b) = two_holders(5, TierKind::G2Host, TierKind::G2Host);
        let keys = chain(0, 4096);
        ix.store(ns, None, &keys, a);
        for (i, k) in keys.iter().enumerate() {
            ix.store(ns, (i > 0).then(|| &keys[i - 1]), std::slice::from_ref(k), b);
            if i % 512 == 0 || i == keys.len() - 1 {
                let mut seen = Vec::new();
                ix.walk(ns, &keys, |_, len, slots| {
                    seen.push((len, slots.iter().count()));
                    true
                });
                assert_eq!(seen.iter().map(|s| s.0).sum::<usize>(), keys.len(), "after {i}");
                let both: usize = seen.iter().filter(|s| s.1 == 2).map(|s| s.0).sum();
                assert_eq!(both, i + 1, "after {i}: the shared prefix is held by both");
            }
            let sp = &ix.spaces[&ns];
            let live: usize = sp.runs.iter().map(|r| r.live().len()).sum();
            let stored: usize = sp.runs.iter().map(|r| r.keys.len()).sum();
            assert!(stored <= 2 * live + 2, "after {i}: {stored} keys kept for {live}");
        }
        assert_eq!(ix.blocks(), keys.len());
        assert_eq!(ix.facts(), 2 * keys.len() as u64);
        for k in &keys {
            ix.remove(Some(ns), std::slice::from_ref(k), a);
        }
        assert_eq!(ix.facts(), keys.len() as u64);
        let mut seen = Vec::new();
        ix.walk(ns, &keys, |_, len, slots| {
            seen.push((len, slots.iter().count()));
            true
        });
        assert!(seen.iter().all(|s| s.1 == 1), "only b holds them now");
        assert_eq!(seen.iter().map(|s| s.0).sum::<usize>(), keys.len());
    }

    /// A holder dropped from long runs gives their keys' memory back, in a namespace that stays.
    #[test]
    fn a_dropped_holder_gives_its_keys_back() {
        let ns = NamespaceId([6; 16]);
        let mut ix = BlockIndex::new();
        ix.reserve(ns, 200_000);
        let a = Slot::new(1, TierKind::G1Gpu);
        for c in 0..100u64 {
            ix.store(ns, None, &chain(c * 10_000, 1000), a);
        }
        ix.remove_where(|s| s == a);
        let runs: usize = ix.spaces[&ns].runs.iter().map(Run::bytes).sum();
        assert!(runs < 100_000, "{runs} bytes of run keys kept");
    }

    #[test]
    fn an_empty_store_makes_no_namespace() {
        let mut ix = BlockIndex::new();
        ix.store(NamespaceId([7; 16]), None, &[], Slot::new(1, TierKind::G1Gpu));
        assert!(ix.spaces.is_empty());
    }

    fn k(i: u8) -> BlockKey {
        BlockKey([i; 16])
    }

    #[test]
    fn slots_spill_and_shrink() {
        let mut s = Slots::default();
        for h in 0..5 {
            assert!(s.insert(Slot::new(h, TierKind::G2Host)));
        }
        assert!(!s.insert(Slot::new(3, TierKind::G2Host)));
        assert!(matches!(s, Slots::Heap(_)));
        assert_eq!(s.remove_where(|x| x.holder() >= 2), 3);
        assert!(matches!(s, Slots::Inline(_)));
        assert_eq!(s.iter().count(), 2);
        assert_eq!(std::mem::size_of::<Slots>(), 16);
    }

    #[test]
    fn refilled_slots_hold_exactly_the_new_ones() {
        let s = |h: u32| Slot::new(h, TierKind::G1Gpu);
        let mut buf = Slots::default();
        for n in [2usize, 5, 1, 0, 3, 7, 3] {
            buf.refill((0..n as u32).map(s));
            assert_eq!(buf.iter().collect::<Vec<_>>(), (0..n as u32).map(s).collect::<Vec<_>>(), "{n}");
        }
    }

    #[test]
    fn slot_packs_holder_and_tier() {
        for t in TierKind::ALL {
            let s = Slot::new(MAX_HOLDERS, t);
            assert_eq!((s.holder(), s.tier()), (MAX_HOLDERS, t));
        }
    }

    /// The holders of each walked key, one entry per key (expanding stretches).
    fn walked(ix: &BlockIndex, ns: NamespaceId, keys: &[BlockKey]) -> Vec<Vec<Slot>> {
        let mut out = vec![];
        ix.walk(ns, keys, |pos, len, s| {
            assert_eq!(pos, out.len());
            let mut v: Vec<Slot> = s.iter().collect();
            v.sort();
            out.extend(std::iter::repeat_n(v, len));
            true
        });
        out
    }

    #[test]
    fn store_remove_walk_and_counts() {
        let (ns, mut ix, a, b) = two_holders(1, TierKind::G1Gpu, TierKind::G2Host);
        ix.store(ns, None, &[k(1), k(2), k(3)], a);
        ix.store(ns, None, &[k(1), k(2)], b);
        ix.store(ns, None, &[k(1)], a); // duplicate: no new fact
        assert_eq!((ix.blocks(), ix.facts(), ix.holder_facts(1), ix.holder_facts(2)), (3, 5, 3, 2));
        let mut seen = vec![];
        ix.walk(ns, &[k(1), k(2), k(9), k(3)], |i, len, s| {
            seen.push((i, len, s.iter().count()));
            true
        });
        assert_eq!(seen, [(0, 2, 2)]);
        ix.remove(Some(ns), &[k(2), k(7)], a);
        assert_eq!((ix.facts(), ix.holder_facts(1)), (4, 2));
        assert_eq!(ix.remove_where(|s| s.holder() == 2), 2);
        assert_eq!((ix.blocks(), ix.facts()), (2, 2));
        ix.remove(None, &[k(1), k(3)], a);
        assert_eq!((ix.blocks(), ix.facts(), ix.approx_bytes()), (0, 0, 0));
    }

    /// A namespace sized up front keeps its key table through a fill and a drain: no growth
    /// while it fills to the expected size, no shrink when it empties.
    #[test]
    fn a_reserved_namespace_never_grows_to_its_size_nor_shrinks_below_it() {
        let ns = NamespaceId([3; 16]);
        let mut ix = BlockIndex::new();
        ix.reserve(ns, 10_000);
        let slots = ix.spaces[&ns].table.slots();
        assert!(slots >= 12_500, "{slots}");
        let a = Slot::new(1, TierKind::G1Gpu);
        let chains: Vec<Vec<BlockKey>> =
            (0..100u64).map(|c| (0..100).map(|i| kvproto::events::key_from_u64(c * 1000 + i)).collect()).collect();
        for chain in &chains {
            ix.store(ns, None, chain, a);
        }
        assert_eq!((ix.blocks(), ix.spaces[&ns].table.slots()), (10_000, slots));
        for chain in &chains {
            ix.remove(Some(ns), chain, a);
        }
        assert_eq!((ix.blocks(), ix.facts()), (0, 0));
        assert_eq!(ix.spaces[&ns].table.slots(), slots, "kept through the drain");
        // An unreserved namespace grows and, emptied, goes.
        let other = NamespaceId([4; 16]);
        for chain in &chains {
            ix.store(other, None, chain, a);
        }
        assert!(ix.spaces[&other].table.slots() >= 12_500);
        for chain in &chains {
            ix.remove(Some(other), chain, a);
        }
        assert!(!ix.spaces.contains_key(&other));
    }

    #[test]
    fn chains_are_runs_split_on_divergence_and_appended_to() {
        let (ns, mut ix, a, b) = two_holders(1, TierKind::G1Gpu, TierKind::G1Gpu);
        let chain: Vec<BlockKey> = (1..=8).map(k).collect();
        ix.store(ns, None, &chain[..4], a);
        ix.store(ns, Some(&chain[3]), &chain[4..], a); // appended to the same run
        assert_eq!(ix.runs(), 1);
        ix.store(ns, None, &chain[..3], b); // split: [1..3] {a, b}, [4..8] {a}
        assert_eq!(ix.runs(), 2);
        let w = walked(&ix, ns, &chain);
        assert_eq!(w.len(), 8);
        assert_eq!(w[2], vec![a, b]);
        assert_eq!(w[3], vec![a]);
        ix.remove(Some(ns), &chain[5..6], a); // a hole: the walk stops there
        assert_eq!(walked(&ix, ns, &chain).len(), 5);
        assert_eq!((ix.blocks(), ix.facts()), (7, 10));
        // A diverging continuation of the shared prefix is its own run.
        ix.store(ns, Some(&chain[2]), &[k(50), k(51)], b);
        assert_eq!(walked(&ix, ns, &[k(1), k(2), k(3), k(50), k(51)]).len(), 5);
    }

    #[test]
    fn chains_longer_than_a_run() {
        let ns = NamespaceId([2; 16]);
        let mut ix = BlockIndex::new();
        let a = Slot::new(1, TierKind::G3Disk);
        let chain: Vec<BlockKey> = (0..70_000u32)
            .map(|i| {
                let mut b = [0u8; 16];
                b[..4].copy_from_slice(&i.to_le_bytes());
                b[4..8].copy_from_slice(&i.wrapping_mul(0x9e37_79b9).to_le_bytes());
                BlockKey(b)
            })
            .collect();
        ix.store(ns, None, &chain[..40_000], a);
        ix.store(ns, Some(&chain[39_999]), &chain[40_000..], a);
        assert_eq!(ix.runs(), 2);
        assert_eq!(walked(&ix, ns, &chain).len(), 70_000);
        ix.remove(Some(ns), &chain[65_535..65_537], a);
        assert_eq!(walked(&ix, ns, &chain).len(), 65_535);
        assert_eq!((ix.blocks(), ix.facts()), (69_998, 69_998));
        ix.store(ns, Some(&chain[65_534]), &chain[65_535..65_537], a);
        assert_eq!(walked(&ix, ns, &chain).len(), 70_000);
        assert_eq!(ix.remove_where(|s| s == a), 70_000);
        assert_eq!((ix.blocks(), ix.runs(), ix.approx_bytes()), (0, 0, 0));
    }

    /// Random stores / removals / drops against a per-block model.
    #[test]
    fn matches_a_per_block_model() {
        use rand::{Rng, SeedableRng};
        use std::collections::{BTreeSet, HashMap};
        let ns = NamespaceId([3; 16]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut ix = BlockIndex::new();
        let mut model: HashMap<BlockKey, BTreeSet<Slot>> = HashMap::new();
        // Chains over a small tree: key (prefix id) derived from the parent and a branch digit.
        let key_of = |path: &[u8]| {
            let h = blake3::hash(path);
            let mut b = [0u8; 16];
            b.copy_from_slice(&h.as_bytes()[..16]);
            BlockKey(b)
        };
        for step in 0..3000 {
            let slot = Slot::new(rng.random_range(0..6), TierKind::ALL[rng.random_range(0..4)]);
            let len = rng.random_range(1..12);
            let path: Vec<u8> = (0..len).map(|_| rng.random_range(0..3)).collect();
            let chain: Vec<BlockKey> = (1..=len).map(|i| key_of(&path[..i])).collect();
            match rng.random_range(0..10) {
                0..6 => {
                    let from = rng.random_range(0..len);
                    let parent = (from > 0).then(|| chain[from - 1]);
                    ix.store(ns, parent.as_ref(), &chain[from..], slot);
                    for c in &chain[from..] {
                        model.entry(*c).or_default().insert(slot);
                    }
                }
                6..9 => {
                    let mut gone: Vec<BlockKey> = chain.iter().filter(|_| rng.random_bool(0.5)).copied().collect();
                    if rng.random_bool(0.5) {
                        gone.reverse();
                    }
                    ix.remove(if rng.random_bool(0.5) { Some(ns) } else { None }, &gone, slot);
                    for c in &gone {
                        if let Some(e) = model.get_mut(c) {
                            e.remove(&slot);
                        }
                    }
                }
                _ => {
                    let h = slot.holder();
                    ix.remove_where(|s| s.holder() == h);
                    for e in model.values_mut() {
                        e.retain(|s| s.holder() != h);
                    }
                }
            }
            model.retain(|_, e| !e.is_empty());
            if step % 50 == 0 || step == 2999 {
                assert_eq!(ix.blocks(), model.len(), "step {step}");
                let facts: usize = model.values().map(BTreeSet::len).sum();
                assert_eq!(ix.facts(), facts as u64, "step {step}");
                for h in 0..6 {
                    let n = model.values().flatten().filter(|s| s.holder() == h).count();
                    assert_eq!(ix.holder_facts(h), n as u64, "step {step} holder {h}");
                }
            }
            // Every prefix of a random chain walks as the model says.
            let q: Vec<u8> = (0..12).map(|_| rng.random_range(0..3)).collect();
            let qk: Vec<BlockKey> = (1..=12).map(|i| key_of(&q[..i])).collect();
            let want: Vec<Vec<Slot>> =
                qk.iter().map_while(|c| model.get(c).map(|e| e.iter().copied().collect())).collect();
            assert_eq!(walked(&ix, ns, &qk), want, "step {step}");
        }
    }

    #[test]
    fn holder_indices_are_reused_after_release() {
        let mut t = HolderTable::default();
        assert_eq!(t.get(&Holder::Cluster), Some(0));
        let w = Holder::Worker(kvproto::events::WorkerId("w".into()));
        let i = t.intern(&w).unwrap_or(0);
        assert_eq!(i, 1);
        t.release(&w);
        assert_eq!(t.get(&w), None);
        let n = Holder::Node(kvproto::events::NodeId("n".into()));
        assert_eq!(t.intern(&n), Some(1));
        assert_eq!(t.len(), 2);
    }
}
