//! Block-key chains with BLAKE3's compression function inlined (x86-64, 16-token blocks).
//!
//! A prompt's keys are a chain: key `i` is half the BLAKE3 key of block `i + 1`'s hash, so
//! deriving them is one compression after another, each waiting for the last. Through the
//! `blake3` crate's public `keyed_hash` a 16-token block (one 64-byte BLAKE3 block) costs ~70 ns
//! here, while the compression's own dependency chain is ~52 ns. This module runs the chain with
//! the compression inlined. It is the same function (docs/block-keys.md, section 5): the keyed
//! hash of one 64-byte block is a single compression under the key with chunk counter 0, block
//! length 64 and flags `CHUNK_START | CHUNK_END | ROOT | KEYED_HASH`, and the key's 16 bytes are
//! the first four words of its output.
//!
//! Two details shorten the dependency chain: rotations are single instructions where AVX-512VL
//! is present (`vprord`), and the diagonal step of each round keeps row `b` in place and moves
//! rows `a`, `c` and `d` instead (`b` is the last row a G function produces, so no shuffle waits
//! on it). Every backend is checked against the `blake3` crate (tests below), and the checked-in
//! test vectors go through this path wherever it runs.

use crate::block_key::BlockKey;

/// The block size with a fast path: 16 tokens, one 64-byte BLAKE3 block (vLLM's default block
/// size, and the size at which the chain is longest for a given prompt). Larger blocks take
/// several compressions per key, where the `blake3` crate's own per-call overhead matters less.
pub(crate) const BLOCK_BYTES: usize = 64;

/// Appends to `out` the keys of the whole blocks of `le` (tokens in wire form, `block_bytes`
/// each), continuing the chain after `parent`, when this machine has a fast path for blocks of
/// that size; returns false (and appends nothing) when it has none.
pub(crate) fn chain(
    fp: &[u8; 32],
    parent: Option<&BlockKey>,
    block_bytes: usize,
    le: &[u8],
    out: &mut Vec<BlockKey>,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if block_bytes != BLOCK_BYTES {
            return false;
        }
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512vl") {
            // SAFETY: the CPU has the features the function is compiled for (checked above).
            unsafe { x86::chain_avx512(fp, parent, le, out) };
            return true;
        }
        if std::arch::is_x86_feature_detected!("sse4.1") {
            // SAFETY: as above.
            unsafe { x86::chain_sse41(fp, parent, le, out) };
            return true;
        }
    }
    let _ = (fp, parent, block_bytes, le, out);
    false
}

/// Which fast path [`chain`] takes on this machine (for benches and logs).
pub fn fast_path() -> Option<&'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512vl") {
            return Some("avx512");
        }
        if std::arch::is_x86_feature_detected!("sse4.1") {
            return Some("sse4.1");
        }
    }
    None
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::BLOCK_BYTES;
    use crate::block_key::BlockKey;

    const IV: [u32; 4] = [0x6A09_E667, 0xBB67_AE85, 0x3C6E_F372, 0xA54F_F53A];
    const CHUNK_START: u32 = 1;
    const CHUNK_END: u32 = 2;
    const ROOT: u32 = 8;
    const KEYED_HASH: u32 = 16;

    /// BLAKE3's message word order for each of the 7 rounds.
    const SCHEDULE: [[usize; 16]; 7] = {
        const PERMUTATION: [usize; 16] = [2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8];
        let mut s = [[0usize; 16]; 7];
        let mut i = 0;
        while i < 16 {
            s[0][i] = i;
            i += 1;
        }
        let mut r = 1;
        while r < 7 {
            let mut i = 0;
            while i < 16 {
                s[r][i] = s[r - 1][PERMUTATION[i]];
                i += 1;
            }
            r += 1;
        }
        s
    };

    /// Which of a round's scheduled words each lane of its four message vectors takes: columns
    /// (0, 2, 4, 6), (1, 3, 5, 7), then the diagonals in the lane order of the `b`-in-place
    /// diagonal step (14, 8, 10, 12), (15, 9, 11, 13).
    const ORDER: [usize; 16] = [0, 2, 4, 6, 1, 3, 5, 7, 14, 8, 10, 12, 15, 9, 11, 13];

    /// 32-bit right rotations of four lanes.
    trait Rotate {
        unsafe fn ror16(x: __m128i) -> __m128i;
        unsafe fn ror12(x: __m128i) -> __m128i;
        unsafe fn ror8(x: __m128i) -> __m128i;
        unsafe fn ror7(x: __m128i) -> __m128i;
    }

    /// `vprord` (AVX-512VL).
    struct Avx512;
    impl Rotate for Avx512 {
        #[inline(always)]
        unsafe fn ror16(x: __m128i) -> __m128i {
            // SAFETY: only called from `chain_avx512`, compiled with avx512f and avx512vl.
            unsafe { _mm_ror_epi32::<16>(x) }
        }
        #[inline(always)]
        unsafe fn ror12(x: __m128i) -> __m128i {
            // SAFETY: as above.
            unsafe { _mm_ror_epi32::<12>(x) }
        }
        #[inline(always)]
        unsafe fn ror8(x: __m128i) -> __m128i {
            // SAFETY: as above.
            unsafe { _mm_ror_epi32::<8>(x) }
        }
        #[inline(always)]
        unsafe fn ror7(x: __m128i) -> __m128i {
            // SAFETY: as above.
            unsafe { _mm_ror_epi32::<7>(x) }
        }
    }

    /// Byte shuffles for 16 and 8, two shifts and an or for 12 and 7 (SSE4.1).
    struct Sse41;
    impl Rotate for Sse41 {
        #[inline(always)]
        unsafe fn ror16(x: __m128i) -> __m128i {
            // SAFETY: only called from `chain_sse41`, compiled with sse4.1 (which implies ssse3).
            unsafe { _mm_shuffle_epi8(x, _mm_setr_epi8(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)) }
        }
        #[inline(always)]
        unsafe fn ror12(x: __m128i) -> __m128i {
            // SAFETY: SSE2, part of x86-64.
            unsafe { _mm_or_si128(_mm_srli_epi32::<12>(x), _mm_slli_epi32::<20>(x)) }
        }
        #[inline(always)]
        unsafe fn ror8(x: __m128i) -> __m128i {
            // SAFETY: as for `ror16`.
            unsafe { _mm_shuffle_epi8(x, _mm_setr_epi8(1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12)) }
        }
        #[inline(always)]
        unsafe fn ror7(x: __m128i) -> __m128i {
            // SAFETY: SSE2, part of x86-64.
            unsafe { _mm_or_si128(_mm_srli_epi32::<7>(x), _mm_slli_epi32::<25>(x)) }
        }
    }

    /// The G function on four columns (or diagonals) at once.
    #[inline(always)]
    unsafe fn g<R: Rotate>(
        a: &mut __m128i,
        b: &mut __m128i,
        c: &mut __m128i,
        d: &mut __m128i,
        mx: __m128i,
        my: __m128i,
    ) {
        // SAFETY: SSE2 arithmetic (part of x86-64) and `R`'s rotations, whose callers hold the
        // features they need.
        unsafe {
            *a = _mm_add_epi32(_mm_add_epi32(*a, mx), *b);
            *d = R::ror16(_mm_xor_si128(*d, *a));
            *c = _mm_add_epi32(*c, *d);
            *b = R::ror12(_mm_xor_si128(*b, *c));
            *a = _mm_add_epi32(_mm_add_epi32(*a, my), *b);
            *d = R::ror8(_mm_xor_si128(*d, *a));
            *c = _mm_add_epi32(*c, *d);
            *b = R::ror7(_mm_xor_si128(*b, *c));
        }
    }

    /// One compression of the 64-byte block `m` (little-endian words) under the chaining value
    /// `(lo, hi)`, chunk counter 0; returns the first eight output words as `(lo, hi)`.
    #[inline(always)]
    unsafe fn compress<R: Rotate>(lo: __m128i, hi: __m128i, m: &[u32; 16], len: u32, flags: u32) -> (__m128i, __m128i) {
        // SAFETY: SSE2 (part of x86-64) and `g::<R>`, see there.
        unsafe {
            let (mut a, mut b) = (lo, hi);
            let mut c = _mm_setr_epi32(IV[0] as i32, IV[1] as i32, IV[2] as i32, IV[3] as i32);
            let mut d = _mm_setr_epi32(0, 0, len as i32, flags as i32);
            for s in &SCHEDULE {
                let w = |i: usize| m[s[ORDER[i]]] as i32;
                let v = |i: usize| _mm_setr_epi32(w(4 * i), w(4 * i + 1), w(4 * i + 2), w(4 * i + 3));
                g::<R>(&mut a, &mut b, &mut c, &mut d, v(0), v(1));
                // Diagonalise with `b` in place: lane j holds a[j-1], b[j], c[j+1], d[j+2].
                a = _mm_shuffle_epi32::<0b10_01_00_11>(a);
                c = _mm_shuffle_epi32::<0b00_11_10_01>(c);
                d = _mm_shuffle_epi32::<0b01_00_11_10>(d);
                g::<R>(&mut a, &mut b, &mut c, &mut d, v(2), v(3));
                a = _mm_shuffle_epi32::<0b00_11_10_01>(a);
                c = _mm_shuffle_epi32::<0b10_01_00_11>(c);
                d = _mm_shuffle_epi32::<0b01_00_11_10>(d);
            }
            (_mm_xor_si128(a, c), _mm_xor_si128(b, d))
        }
    }

    #[inline(always)]
    unsafe fn chain_with<R: Rotate>(fp: &[u8; 32], parent: Option<&BlockKey>, le: &[u8], out: &mut Vec<BlockKey>) {
        const FLAGS: u32 = KEYED_HASH | CHUNK_START | CHUNK_END | ROOT;
        // SAFETY: unaligned loads and stores of 16 bytes from and to 16-byte arrays (SSE2), and
        // `compress::<R>`, see there.
        unsafe {
            let fp_lo = _mm_loadu_si128(fp.as_ptr().cast());
            let fp_hi = _mm_loadu_si128(fp.as_ptr().add(16).cast());
            let mut key = match parent {
                Some(p) => _mm_loadu_si128(p.0.as_ptr().cast()),
                None => fp_lo,
            };
            out.reserve(le.len() / BLOCK_BYTES);
            for block in le.chunks_exact(BLOCK_BYTES) {
                let m: [u32; 16] = std::array::from_fn(|i| {
                    u32::from_le_bytes([block[4 * i], block[4 * i + 1], block[4 * i + 2], block[4 * i + 3]])
                });
                key = compress::<R>(key, fp_hi, &m, BLOCK_BYTES as u32, FLAGS).0;
                let mut k = [0u8; 16];
                _mm_storeu_si128(k.as_mut_ptr().cast(), key);
                out.push(BlockKey(k));
            }
        }
    }

    /// [`super::chain`] with AVX-512VL rotations.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub(super) unsafe fn chain_avx512(fp: &[u8; 32], parent: Option<&BlockKey>, le: &[u8], out: &mut Vec<BlockKey>) {
        // SAFETY: the caller checked the features this function is compiled with.
        unsafe { chain_with::<Avx512>(fp, parent, le, out) }
    }

    /// [`super::chain`] with SSE4.1.
    #[target_feature(enable = "sse4.1")]
    pub(super) unsafe fn chain_sse41(fp: &[u8; 32], parent: Option<&BlockKey>, le: &[u8], out: &mut Vec<BlockKey>) {
        // SAFETY: as above.
        unsafe { chain_with::<Sse41>(fp, parent, le, out) }
    }

    /// A backend's entry point.
    #[cfg(test)]
    pub(super) type ChainFn = unsafe fn(&[u8; 32], Option<&BlockKey>, &[u8], &mut Vec<BlockKey>);

    #[cfg(test)]
    pub(super) fn backends() -> Vec<(&'static str, ChainFn)> {
        let mut v: Vec<(&'static str, ChainFn)> = Vec::new();
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512vl") {
            v.push(("avx512", chain_avx512));
        }
        if std::arch::is_x86_feature_detected!("sse4.1") {
            v.push(("sse4.1", chain_sse41));
        }
        v
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The chain through the `blake3` crate's public API, block by block.
    fn reference(fp: &[u8; 32], parent: Option<&BlockKey>, block_bytes: usize, le: &[u8]) -> Vec<BlockKey> {
        let mut parent = parent.copied();
        le.chunks_exact(block_bytes)
            .map(|b| {
                let mut hk = *fp;
                if let Some(p) = parent {
                    hk[..16].copy_from_slice(&p.0);
                }
                let mut k = [0u8; 16];
                k.copy_from_slice(&blake3::keyed_hash(&hk, b).as_bytes()[..16]);
                parent = Some(BlockKey(k));
                BlockKey(k)
            })
            .collect()
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_backend_matches_the_blake3_crate() {
        let backends = x86::backends();
        assert!(!backends.is_empty(), "x86-64 without SSE4.1: no fast path to check");
        let fp: [u8; 32] = std::array::from_fn(|i| (i as u8).wrapping_mul(37).wrapping_add(11));
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        let le: Vec<u8> = (0..300 * BLOCK_BYTES + 12)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let parent = BlockKey([0xa5; 16]);
        for (name, f) in backends {
            // Whole prompts, a trailing partial block, a single block, nothing.
            for len in [le.len(), 300 * BLOCK_BYTES, BLOCK_BYTES, BLOCK_BYTES - 4, 0] {
                for p in [None, Some(&parent)] {
                    let mut got = Vec::new();
                    // SAFETY: `backends` lists only what this CPU runs.
                    unsafe { f(&fp, p, &le[..len], &mut got) };
                    assert_eq!(got, reference(&fp, p, BLOCK_BYTES, &le[..len]), "{name}, {len} bytes, parent {p:?}");
                }
            }
        }
    }

    #[test]
    fn other_block_sizes_have_no_fast_path() {
        let mut out = Vec::new();
        for bb in [4, 60, 68, 128, 1024] {
            assert!(!chain(&[1; 32], None, bb, &[0; 2048], &mut out));
        }
        assert!(out.is_empty());
    }
}
