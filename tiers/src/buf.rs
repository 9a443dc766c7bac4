//! `BlockBuf`: a 4 KiB-aligned, growable byte buffer that blocks are read into.
//!
//! G3 reads with O_DIRECT straight into it, so it is aligned and its capacity is always a
//! multiple of [`ALIGN`], past `len()` if needed.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment (and capacity granularity) of every `BlockBuf`: the O_DIRECT sector size.
pub const ALIGN: usize = 4096;

/// Rounds `n` up to a multiple of [`ALIGN`].
pub fn align_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// An aligned byte buffer. Derefs to the first `len()` bytes.
pub struct BlockBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: BlockBuf owns its allocation exclusively, like Vec<u8>.
unsafe impl Send for BlockBuf {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for BlockBuf {}

impl BlockBuf {
    /// An empty buffer (no allocation).
    pub fn new() -> Self {
        Self { ptr: NonNull::dangling(), len: 0, cap: 0 }
    }

    /// A zeroed buffer of `len` bytes.
    pub fn zeroed(len: usize) -> Self {
        let mut b = Self::new();
        b.resize(len);
        b
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice(data: &[u8]) -> Self {
        let mut b = Self::new();
        b.resize(data.len());
        b.copy_from_slice(data);
        b
    }

    /// An aligned buffer holding `parts` concatenated in order (a block given as pieces).
    pub fn from_parts(parts: &[&[u8]]) -> Self {
        let mut b = Self::zeroed(parts.iter().map(|p| p.len()).sum());
        let mut at = 0;
        for p in parts {
            b[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        b
    }

    /// Sets the length, growing the allocation if needed. New bytes are unspecified (zero on a
    /// fresh allocation, old contents otherwise).
    pub fn resize(&mut self, len: usize) {
        let need = align_up(len.max(1));
        if need > self.cap {
            self.release();
            // ALIGN is a power of two and `need` is a non-zero multiple of it.
            let layout = Layout::from_size_align(need, ALIGN)
                .unwrap_or_else(|_| panic!("BlockBuf of {need} bytes exceeds the address space"));
            // SAFETY: layout has non-zero size.
            let p = unsafe { alloc_zeroed(layout) };
            self.ptr = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
            self.cap = need;
        }
        self.len = len;
    }

    /// Capacity: a multiple of [`ALIGN`], at least `len()`.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The whole allocation, including bytes past `len()` (for aligned I/O of a partial page).
    pub fn full_mut(&mut self) -> &mut [u8] {
        if self.cap == 0 {
            return &mut [];
        }
        // SAFETY: ptr is valid for cap bytes and exclusively ours.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }

    fn release(&mut self) {
        if self.cap > 0 {
            // SAFETY: allocated in `resize` with exactly this layout.
            unsafe { dealloc(self.ptr.as_ptr(), Layout::from_size_align_unchecked(self.cap, ALIGN)) };
            self.cap = 0;
            self.ptr = NonNull::dangling();
        }
    }
}

impl Default for BlockBuf {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for BlockBuf {
    fn drop(&mut self) {
        self.release();
    }
}

impl Deref for BlockBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        if self.cap == 0 {
            return &[];
        }
        // SAFETY: ptr valid for cap >= len bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for BlockBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        if self.cap == 0 {
            return &mut [];
        }
        // SAFETY: ptr valid for cap >= len bytes, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl fmt::Debug for BlockBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockBuf").field("len", &self.len).field("cap", &self.cap).finish()
    }
}
