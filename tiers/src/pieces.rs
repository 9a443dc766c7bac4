//! Copies between block pieces: a block's bytes are a sequence of contiguous pieces (G2 page
//! runs, an engine's per-layer segments), and the two sides of a copy are cut differently.

/// Copies a sequence of source pieces into a sequence of destination pieces of the same total
/// length (gather/scatter in one pass). Used for puts into the pool and for loads into an
/// engine's memory: the destination is memory that has left the cache and that this process
/// will not read soon, so on x86_64 large pieces are written with non-temporal stores (no read-for-ownership of the destination: 1.4x a plain memcpy into
/// a prefaulted 1 GiB shared-memory region on this VM, `docs/benchmarks.md`).
///
/// # Safety
/// Every source piece must be readable and every destination piece writable for its length,
/// and no destination may overlap a source.
pub unsafe fn copy_pieces(src: impl Iterator<Item = (*const u8, usize)>, dst: impl Iterator<Item = (*mut u8, usize)>) {
    let src = src.map(|(p, n)| (p as usize, n));
    let dst = dst.map(|(p, n)| (p as usize, n));
    let _ = zip_pieces(src, dst, |s, d, n| {
        // SAFETY: guaranteed by the caller; `n` stays within both pieces.
        unsafe { copy_streaming(s as *const u8, d as *mut u8, n) };
        Ok::<(), std::convert::Infallible>(())
    });
    fence();
}

/// Walks two sequences of contiguous pieces (address or offset, length) in step, calling
/// `f(src, dst, n)` for each run where a source piece and a destination piece overlap, in
/// order. Stops at the first error of `f`; returns `Ok(false)` if the destination ran out
/// before the source (the rest is not visited).
pub fn zip_pieces<E>(
    src: impl IntoIterator<Item = (usize, usize)>,
    dst: impl IntoIterator<Item = (usize, usize)>,
    mut f: impl FnMut(usize, usize, usize) -> Result<(), E>,
) -> Result<bool, E> {
    let mut dst = dst.into_iter();
    let mut cur: Option<(usize, usize)> = None;
    for (mut s, mut slen) in src {
        while slen > 0 {
            let (d, dlen) = match cur.take() {
                Some(c) if c.1 > 0 => c,
                _ => match dst.next() {
                    Some(c) => c,
                    None => return Ok(false),
                },
            };
            let n = slen.min(dlen);
            f(s, d, n)?;
            s += n;
            slen -= n;
            cur = Some((d + n, dlen - n));
        }
    }
    Ok(true)
}

/// Pieces shorter than this are copied with plain stores.
const STREAM_MIN: usize = 4096;

/// Copies `n` bytes with non-temporal stores where the CPU has them (SSE2 is part of x86_64).
///
/// # Safety
/// As `copy_nonoverlapping`; the caller calls [`fence`] before publishing the bytes.
unsafe fn copy_streaming(src: *const u8, dst: *mut u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if n >= STREAM_MIN {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        // Plain-copy up to a 16-byte aligned destination, stream 64 bytes at a time, plain-copy
        // the tail.
        let head = dst.align_offset(16).min(n);
        // SAFETY: in bounds of both pieces (head <= n); the streamed range is 16-byte aligned
        // at the destination and within both pieces; unaligned loads are allowed.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            let (s, d) = (src.add(head), dst.add(head));
            let body = (n - head) / 64 * 64;
            let mut i = 0;
            while i < body {
                let a = _mm_loadu_si128(s.add(i).cast::<__m128i>());
                let b = _mm_loadu_si128(s.add(i + 16).cast::<__m128i>());
                let c = _mm_loadu_si128(s.add(i + 32).cast::<__m128i>());
                let e = _mm_loadu_si128(s.add(i + 48).cast::<__m128i>());
                _mm_stream_si128(d.add(i).cast::<__m128i>(), a);
                _mm_stream_si128(d.add(i + 16).cast::<__m128i>(), b);
                _mm_stream_si128(d.add(i + 32).cast::<__m128i>(), c);
                _mm_stream_si128(d.add(i + 48).cast::<__m128i>(), e);
                i += 64;
            }
            std::ptr::copy_nonoverlapping(s.add(body), d.add(body), n - head - body);
        }
        return;
    }
    // SAFETY: guaranteed by the caller.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
}

/// Orders non-temporal stores before the stores that publish them (the commit under the lock).
fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a store fence has no preconditions.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}
