//! The block index's key table: block key -> where the key lives (run and offset), 12 bytes per
//! slot, open addressing with linear probing.
//!
//! A slot does not hold the key: it holds 32 bits of the key's hash, the run index and the offset
//! inside the run. A probe compares hash bits and, on a match, asks the caller whether the run's
//! key at that offset is the key (the runs hold every key exactly once). The home slot is the
//! hash's top bits, so growing re-inserts from the slots' own hash bits in nearly sequential
//! order, without reading a key. A removal leaves no tombstone: the later entries of its probe
//! run that may move are shifted back over the hole (backward-shift deletion), so a table under
//! churn (stores and removals at a steady size) never needs a rehash to clear tombstones. The
//! table grows when it passes 80% full.
//!
//! The hash is a seeded 128-bit multiply of the key's two halves (the keys are themselves hashes;
//! the per-instance seed keeps a publisher from aiming keys at one probe sequence).

use kvproto::BlockKey;

/// Where a key lives: run index and absolute offset inside the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loc {
    pub run: u32,
    pub off: u16,
}

/// `run` of an empty slot (all-zero, so a new table is a zeroed allocation).
const EMPTY: u32 = 0;
/// Largest run index (slots store `run + 1`; `u32::MAX` is left unused).
pub const MAX_RUN: u32 = u32::MAX - 2;

/// A slot: `[hash, run + 1, offset]` (`run + 1` is [`EMPTY`] for a free slot).
type Entry = [u32; 3];

const VACANT: Entry = [0; 3];

/// The location in an occupied slot.
#[inline]
fn loc_of(e: Entry) -> Loc {
    Loc { run: e[1].wrapping_sub(1), off: e[2] as u16 }
}

#[inline]
fn entry(hash: u32, loc: Loc) -> Entry {
    [hash, loc.run + 1, u32::from(loc.off)]
}

/// See the module documentation.
#[derive(Debug)]
pub struct KeyTable {
    slots: Vec<Entry>,
    /// `32 - log2(slots.len())`: the home slot is `hash >> shift`.
    shift: u32,
    len: usize,
    seed: (u64, u64),
}

impl Default for KeyTable {
    fn default() -> Self {
        let s = std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), 0x6b74_u64);
        Self { slots: Vec::new(), shift: 32, len: 0, seed: (s | 1, s.rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15) }
    }
}

impl KeyTable {
    /// The key's hash (callers that probe a key more than once compute it once).
    #[inline]
    pub fn hash(&self, k: &BlockKey) -> u32 {
        let (a, b) = k.0.split_at(8);
        let a = u64::from_le_bytes(a.try_into().unwrap_or([0; 8])) ^ self.seed.0;
        let b = u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) ^ self.seed.1;
        let p = u128::from(a) * u128::from(b);
        (((p as u64) ^ ((p >> 64) as u64)) >> 32) as u32
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    #[inline]
    fn home(&self, h: u32) -> usize {
        // `checked_shr`: an empty table has shift 32 (and is never probed).
        h.checked_shr(self.shift).unwrap_or(0) as usize
    }

    /// Keys in the table.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no key is in the table.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Slots (free or not).
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Heap bytes.
    pub fn bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Entry>()
    }

    /// Makes room for `additional` more keys (rehashing into a larger table when they would
    /// fill more than 80% of it).
    pub fn reserve(&mut self, additional: usize) {
        if (self.len + additional) * 5 > self.slots.len() * 4 {
            self.rehash(self.len + additional);
        }
    }

    /// Rehashes into a table sized for `n` keys (at least those it holds; at most 70% full):
    /// grows or shrinks.
    pub fn rehash(&mut self, n: usize) {
        let n = n.max(self.len);
        let mut want = (n * 5 / 4 + 1).max(16).next_power_of_two();
        if n * 10 > want * 7 {
            want *= 2;
        }
        let old = std::mem::replace(&mut self.slots, vec![VACANT; want]);
        self.shift = 32 - want.trailing_zeros();
        let mask = self.mask();
        // Old slots in order have nearly increasing home slots, so the writes are nearly
        // sequential.
        for e in old.into_iter().filter(|e| e[1] != EMPTY) {
            let mut i = self.home(e[0]);
            while self.slots[i][1] != EMPTY {
                i = (i + 1) & mask;
            }
            self.slots[i] = e;
        }
    }

    /// Asks the CPU to load the home slot of hash `h` ahead of a later probe (a hint; probes are
    /// memory-latency bound, and a prefetch lets several misses overlap).
    #[inline]
    pub fn prefetch(&self, h: u32) {
        if self.slots.is_empty() {
            return;
        }
        let i = self.home(h);
        #[cfg(target_arch = "x86_64")]
        {
            let p = self.slots.as_ptr().wrapping_add(i);
            // SAFETY: a prefetch is only a hint: it never faults and never writes (and `i` is in
            // bounds anyway).
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast()) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = i;
    }

    /// The location of the key of hash `h`; `is_key(loc)` says whether the key stored at `loc`
    /// is that key.
    #[inline]
    pub fn find(&self, h: u32, is_key: impl Fn(Loc) -> bool) -> Option<Loc> {
        self.probe(h, |e| is_key(loc_of(e))).map(|i| loc_of(self.slots[i]))
    }

    /// The first slot on `h`'s probe sequence that holds hash `h` and satisfies `hit`, up to the
    /// first empty slot.
    #[inline]
    fn probe(&self, h: u32, hit: impl Fn(Entry) -> bool) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(h);
        loop {
            let e = self.slots[i];
            if e[1] == EMPTY {
                return None;
            }
            if e[0] == h && hit(e) {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// Finds the key of hash `h` (as [`KeyTable::find`]), or inserts it at `loc` and returns
    /// `None`. Call [`KeyTable::reserve`] first.
    #[inline]
    pub fn find_or_insert(&mut self, h: u32, is_key: impl Fn(Loc) -> bool, loc: Loc) -> Option<Loc> {
        let mask = self.mask();
        let mut i = self.home(h);
        loop {
            let e = self.slots[i];
            if e[1] == EMPTY {
                break;
            }
            if e[0] == h && is_key(loc_of(e)) {
                return Some(loc_of(e));
            }
            i = (i + 1) & mask;
        }
        self.slots[i] = entry(h, loc);
        self.len += 1;
        None
    }

    fn slot_of(&self, k: &BlockKey, loc: Loc) -> Option<usize> {
        self.slot_of_hash(self.hash(k), loc)
    }

    fn slot_of_hash(&self, h: u32, loc: Loc) -> Option<usize> {
        self.probe(h, |e| loc_of(e) == loc)
    }

    /// Moves key `k` from `old` to `new` (no-op if `k` is not at `old`).
    pub fn repoint(&mut self, k: &BlockKey, old: Loc, new: Loc) {
        if let Some(i) = self.slot_of(k, old) {
            self.slots[i] = entry(self.slots[i][0], new);
        }
    }

    /// Removes key `k` stored at `loc` (no-op if it is not there).
    pub fn remove(&mut self, k: &BlockKey, loc: Loc) {
        self.remove_hash(self.hash(k), loc);
    }

    /// Removes the keys of a whole run (`keys[j]` at offset `start + j` of run `run`), with the
    /// slots of later keys prefetched while earlier ones are removed: the slots are random
    /// accesses into a table larger than the caches, and this lets their misses overlap.
    pub fn remove_run(&mut self, keys: &[BlockKey], run: u32, start: usize) {
        const AHEAD: usize = 16;
        let hashes: Vec<u32> = keys.iter().map(|k| self.hash(k)).collect();
        for h in hashes.iter().take(AHEAD) {
            self.prefetch(*h);
        }
        for (j, h) in hashes.iter().enumerate() {
            if let Some(next) = hashes.get(j + AHEAD) {
                self.prefetch(*next);
            }
            self.remove_hash(*h, Loc { run, off: (start + j) as u16 });
        }
    }

    fn remove_hash(&mut self, h: u32, loc: Loc) {
        let Some(mut hole) = self.slot_of_hash(h, loc) else { return };
        self.len -= 1;
        // Backward shift: an entry later in the probe run moves into the hole when its home is
        // not between the hole and itself (cyclically); otherwise a probe from its home would
        // now stop at the hole. The run ends at the first empty slot.
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let e = self.slots[j];
            if e[1] == EMPTY {
                break;
            }
            let home = self.home(e[0]);
            let stays = if hole <= j { hole < home && home <= j } else { hole < home || home <= j };
            if !stays {
                self.slots[hole] = e;
                hole = j;
            }
        }
        self.slots[hole] = VACANT;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u32) -> BlockKey {
        let mut b = [0u8; 16];
        b[..4].copy_from_slice(&i.to_le_bytes());
        b[8..12].copy_from_slice(&i.wrapping_mul(2_654_435_761).to_le_bytes());
        BlockKey(b)
    }

    fn is(keys: &[BlockKey], q: BlockKey) -> impl Fn(Loc) -> bool + '_ {
        move |l: Loc| keys[l.run as usize] == q
    }

    /// Removals shift later entries back instead of leaving tombstones: under churn at ~80%
    /// load (long probe runs, runs that wrap past the table's end), every key stays findable
    /// at its location and no removed key is found.
    #[test]
    fn churn_with_backward_shift_keeps_every_key_findable() {
        let mut t = KeyTable::default();
        t.reserve(40); // 64 slots: probe runs often wrap past the end
        let slots = t.slots();
        let keys: Vec<BlockKey> = (0..2000).map(k).collect();
        let mut live: Vec<usize> = Vec::new();
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..20_000 {
            let fill = live.len() * 5 < slots * 4 - 5;
            if fill && (live.is_empty() || next() % 2 == 0) {
                let i = (next() % keys.len() as u64) as usize;
                if live.contains(&i) {
                    continue;
                }
                let loc = Loc { run: i as u32, off: 3 };
                t.reserve(1); // as the index does before each insert
                assert_eq!(t.find_or_insert(t.hash(&keys[i]), is(&keys, keys[i]), loc), None);
                live.push(i);
            } else {
                let at = (next() % live.len() as u64) as usize;
                let i = live.swap_remove(at);
                t.remove(&keys[i], Loc { run: i as u32, off: 3 });
                assert_eq!(t.find(t.hash(&keys[i]), is(&keys, keys[i])), None, "step {step}");
            }
            assert_eq!(t.len(), live.len());
            assert_eq!(t.slots(), slots, "churn below 80% never rehashes");
            for &i in &live {
                let want = Some(Loc { run: i as u32, off: 3 });
                assert_eq!(t.find(t.hash(&keys[i]), is(&keys, keys[i])), want, "step {step}");
            }
        }
    }

    #[test]
    fn insert_find_repoint_remove() {
        let mut t = KeyTable::default();
        t.reserve(1000);
        let keys: Vec<BlockKey> = (0..1000).map(k).collect();
        for (i, key) in keys.iter().enumerate() {
            let loc = Loc { run: i as u32, off: 7 };
            assert_eq!(t.find(t.hash(key), is(&keys, *key)), None);
            assert_eq!(t.find_or_insert(t.hash(key), is(&keys, *key), loc), None);
        }
        assert_eq!(t.len(), 1000);
        for (i, key) in keys.iter().enumerate() {
            assert_eq!(t.find(t.hash(key), is(&keys, *key)), Some(Loc { run: i as u32, off: 7 }));
        }
        assert_eq!(
            t.find_or_insert(t.hash(&keys[5]), is(&keys, keys[5]), Loc { run: 0, off: 0 }),
            Some(Loc { run: 5, off: 7 })
        );
        t.repoint(&keys[5], Loc { run: 5, off: 7 }, Loc { run: 5, off: 9 });
        assert_eq!(t.find(t.hash(&keys[5]), is(&keys, keys[5])), Some(Loc { run: 5, off: 9 }));
        for (i, key) in keys.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
            let off = if i == 5 { 9 } else { 7 };
            t.remove(key, Loc { run: i as u32, off });
        }
        assert_eq!(t.len(), 500);
        t.rehash(10); // grows back to fit the 500 it holds
        assert_eq!(t.len(), 500);
        for (i, key) in keys.iter().enumerate() {
            let off = if i == 5 { 9 } else { 7 };
            let want = (i % 2 == 1).then_some(Loc { run: i as u32, off });
            assert_eq!(t.find(t.hash(key), is(&keys, *key)), want);
        }
    }
}
