//! Page-granular space allocation shared by G2 (memory) and G3 (disk).
//!
//! A tier's space is `total` pages of `page_size` bytes. A block takes `ceil(len / page_size)`
//! pages, not necessarily contiguous, so blocks of different sizes never fail for
//! fragmentation. Allocating and freeing a page is O(1) (a free stack). Pages are handed out in
//! ascending order and returned in the same order, so blocks of one size keep reusing the same
//! contiguous runs and G3 I/O stays sequential.

use std::sync::Arc;

use parking_lot::Mutex;

/// The free list of one tier's pages.
#[derive(Debug)]
pub struct PagePool {
    page_size: usize,
    total: u32,
    free: Mutex<Vec<u32>>,
}

impl PagePool {
    /// A pool of `total` free pages.
    pub fn new(page_size: usize, total: u32) -> Arc<Self> {
        Self::with_used(page_size, total, &[])
    }

    /// A pool where the pages in `used` are already taken (recovery).
    pub fn with_used(page_size: usize, total: u32, used: &[u32]) -> Arc<Self> {
        let mut taken = vec![false; total as usize];
        for &p in used {
            if let Some(t) = taken.get_mut(p as usize) {
                *t = true;
            }
        }
        // Reverse order: pop() yields ascending page numbers.
        let free = (0..total).rev().filter(|&p| !taken[p as usize]).collect();
        Arc::new(Self { page_size, total, free: Mutex::new(free) })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn total_pages(&self) -> u32 {
        self.total
    }

    pub fn free_pages(&self) -> usize {
        self.free.lock().len()
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
        if free.len() < n {
            return None;
        }
        let at = free.len() - n;
        let mut ids: Vec<u32> = free.split_off(at);
        ids.reverse();
        Some(Pages { pool: Arc::clone(self), ids })
    }

    /// Wraps pages already reserved with [`PagePool::with_used`] (recovery).
    pub fn adopt(self: &Arc<Self>, ids: Vec<u32>) -> Pages {
        Pages { pool: Arc::clone(self), ids }
    }

    fn give_back(&self, ids: &[u32]) {
        let mut free = self.free.lock();
        free.extend(ids.iter().rev());
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
        let c = pool.alloc(3).expect("3 free again");
        assert_eq!(c.runs(), vec![(0, 3)]);
        assert!(pool.alloc(4).is_none());
        assert_eq!(pool.free_pages(), 3);
    }

    #[test]
    fn with_used_skips_taken_pages() {
        let pool = PagePool::with_used(4096, 5, &[1, 3]);
        let a = pool.alloc(3).expect("3 free");
        assert_eq!(a.ids(), &[0, 2, 4]);
        assert_eq!(runs_of(&[0, 2, 3, 4, 9]), vec![(0, 1), (2, 3), (9, 1)]);
    }
}
