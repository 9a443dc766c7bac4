//! Page-granular space allocation shared by G2 (memory) and G3 (disk).
//!
//! A tier's space is `total` pages of `page_size` bytes. A block takes `ceil(len / page_size)`
//! pages, not necessarily contiguous, so blocks of different sizes never fail for
//! fragmentation. Free pages are a bitmap scanned *next-fit* from a cursor that moves forward
//! and wraps: consecutive puts get ascending page numbers, so G3 writes of a chain land
//! sequentially on disk and reading the chain back is sequential too (a free stack handed
//! pages back in eviction order, which made both reverse-sequential). Allocation touches one
//! bit per page taken plus the words skipped on the way.

use std::sync::Arc;

use parking_lot::Mutex;

#[derive(Debug)]
struct FreeMap {
    /// Bit set = page free. Bits past `total` are never set.
    words: Vec<u64>,
    free: usize,
    /// Where the next scan starts.
    cursor: usize,
}

impl FreeMap {
    fn take(&mut self, n: usize, total: usize) -> Vec<u32> {
        let mut ids = Vec::with_capacity(n);
        let nwords = self.words.len();
        let start = self.cursor.min(total.saturating_sub(1));
        let (w0, b0) = (start / 64, start % 64);
        // Words from the cursor to the end, then from the start back to the cursor's word
        // (its low bits, skipped the first time, come last).
        for step in 0..=nwords {
            if ids.len() == n {
                break;
            }
            let w = (w0 + step) % nwords;
            let mask = match step {
                0 => !0u64 << b0,
                s if s == nwords => (1u64 << b0).wrapping_sub(1),
                _ => !0u64,
            };
            let mut bits = self.words[w] & mask;
            while bits != 0 && ids.len() < n {
                let b = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                self.words[w] &= !(1u64 << b);
                ids.push((w * 64 + b) as u32);
            }
        }
        self.free -= ids.len();
        if let Some(&last) = ids.last() {
            self.cursor = (last as usize + 1) % total.max(1);
        }
        ids
    }
}

/// The free pages of one tier.
#[derive(Debug)]
pub struct PagePool {
    page_size: usize,
    total: u32,
    free: Mutex<FreeMap>,
}

impl PagePool {
    /// A pool of `total` free pages.
    pub fn new(page_size: usize, total: u32) -> Arc<Self> {
        Self::with_used(page_size, total, &[])
    }

    /// A pool where the pages in `used` are already taken (recovery).
    pub fn with_used(page_size: usize, total: u32, used: &[u32]) -> Arc<Self> {
        let n = total as usize;
        let mut words = vec![!0u64; n.div_ceil(64)];
        if !n.is_multiple_of(64)
            && let Some(last) = words.last_mut()
        {
            *last = (1u64 << (n % 64)) - 1;
        }
        let mut free = n;
        for &p in used {
            if let Some(w) = words.get_mut(p as usize / 64) {
                let bit = 1u64 << (p % 64);
                if *w & bit != 0 {
                    *w &= !bit;
                    free -= 1;
                }
            }
        }
        Arc::new(Self { page_size, total, free: Mutex::new(FreeMap { words, free, cursor: 0 }) })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn total_pages(&self) -> u32 {
        self.total
    }

    pub fn free_pages(&self) -> usize {
        self.free.lock().free
    }

    pub fn used_pages(&self) -> usize {
        self.total as usize - self.free_pages()
    }

    /// Pages needed for `len` bytes (at least one, so that an empty block still has a slot).
    pub fn pages_for(&self, len: u64) -> usize {
        (len.div_ceil(self.page_size as u64) as usize).max(1)
    }

    /// Takes `n` pages, or none if fewer than `n` are free.
    pub fn alloc(self: &Arc<Self>, n: usize) -> Option<Pages> {
        let mut free = self.free.lock();
        if free.free < n {
            return None;
        }
        let ids = free.take(n, self.total as usize);
        debug_assert_eq!(ids.len(), n, "free count and bitmap disagree");
        Some(Pages { pool: Arc::clone(self), ids })
    }

    /// Wraps pages already reserved with [`PagePool::with_used`] (recovery).
    pub fn adopt(self: &Arc<Self>, ids: Vec<u32>) -> Pages {
        Pages { pool: Arc::clone(self), ids }
    }

    fn give_back(&self, ids: &[u32]) {
        let mut free = self.free.lock();
        for &p in ids {
            if let Some(w) = free.words.get_mut(p as usize / 64) {
                let bit = 1u64 << (p % 64);
                if *w & bit == 0 {
                    *w |= bit;
                    free.free += 1;
                }
            }
        }
    }
}

/// Pages owned by one block. Dropping returns them to the pool, so a reader that still holds
/// a block's `Arc<Pages>` keeps its space from being reused under it.
#[derive(Debug)]
pub struct Pages {
    pool: Arc<PagePool>,
    ids: Vec<u32>,
}

impl Pages {
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Contiguous runs as `(first_page, page_count)`.
    pub fn runs(&self) -> Vec<(u32, u32)> {
        runs_of(&self.ids)
    }

    pub fn bytes(&self) -> u64 {
        self.ids.len() as u64 * self.pool.page_size as u64
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        self.pool.give_back(&self.ids);
    }
}

/// Groups page ids into contiguous runs, in order.
pub fn runs_of(ids: &[u32]) -> Vec<(u32, u32)> {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &p in ids {
        match runs.last_mut() {
            Some((start, n)) if *start + *n == p => *n += 1,
            _ => runs.push((p, 1)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_is_ascending_and_reuses_runs() {
        let pool = PagePool::new(4096, 8);
        let a = pool.alloc(3).expect("3 free");
        assert_eq!(a.ids(), &[0, 1, 2]);
        let b = pool.alloc(2).expect("2 free");
        assert_eq!(b.ids(), &[3, 4]);
        drop(a);
        // Next-fit: the cursor moves on past the freed pages, then wraps to them.
        let c = pool.alloc(3).expect("3 free again");
        assert_eq!(c.runs(), vec![(5, 3)]);
        assert!(pool.alloc(4).is_none());
        assert_eq!(pool.free_pages(), 3);
        let d = pool.alloc(3).expect("wraps to the freed run");
        assert_eq!(d.runs(), vec![(0, 3)]);
        assert_eq!(pool.free_pages(), 0);
        drop((b, c, d));
        assert_eq!(pool.free_pages(), 8);
    }

    #[test]
    fn scan_wraps_within_the_cursor_word_and_across_many_words() {
        let pool = PagePool::new(4096, 200);
        let all = pool.alloc(200).expect("all free");
        assert_eq!(all.runs(), vec![(0, 200)]);
        assert!(pool.alloc(1).is_none());
        drop(all);
        // Cursor is 0 again after a full wrap; free a few scattered pages around it.
        let a = pool.alloc(70).expect("70");
        let b = pool.alloc(100).expect("100");
        assert_eq!(b.runs(), vec![(70, 100)]);
        drop(a);
        let c = pool.alloc(40).expect("30 at the tail then 10 from the start");
        assert_eq!(c.runs(), vec![(170, 30), (0, 10)]);
        let d = pool.alloc(60).expect("the rest");
        assert_eq!(d.runs(), vec![(10, 60)]);
        assert!(pool.alloc(1).is_none());
    }

    #[test]
    fn with_used_skips_taken_pages() {
        let pool = PagePool::with_used(4096, 5, &[1, 3]);
        let a = pool.alloc(3).expect("3 free");
        assert_eq!(a.ids(), &[0, 2, 4]);
        assert_eq!(runs_of(&[0, 2, 3, 4, 9]), vec![(0, 1), (2, 3), (9, 1)]);
    }
}
