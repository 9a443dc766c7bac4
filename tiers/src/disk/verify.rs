//! Checksums computed while G3 I/O runs.
//!
//! A block read from disk lands in memory the CPU has not seen, so its checksum is bound by
//! memory bandwidth, a large share of a read's time on a fast drive. Reads are therefore split
//! into pieces that are all in flight at once; each piece is hashed as soon as it and every
//! piece before it have arrived, while the later pieces are still on their way.
//! Writes hash their source once the I/O has started.

use super::op::{IoKind, IoOp, IoProgress};
use crate::block::{StreamingChecksum, SumKind, checksum};
use crate::buf::{ALIGN, align_up};

/// A block's read is cut into pieces of `max(len / PIECES, MIN_PIECE)` bytes (rounded up to
/// [`ALIGN`]) within each of its page runs, so at most this many pieces per run, the last piece
/// of a run possibly shorter. On the virtual disk measured in docs/benchmarks.md the pieces of a
/// 256 KiB read arrive together (nothing to overlap) and splitting it only made it slower.
const PIECES: usize = 8;
const MIN_PIECE: usize = 256 << 10;

/// Bytes per read piece of a block of `len` bytes: a multiple of [`ALIGN`].
fn piece_len(len: usize) -> usize {
    align_up(len.div_ceil(PIECES)).max(MIN_PIECE)
}

/// One read op's place in its block.
#[derive(Debug, Clone, Copy)]
struct Piece {
    block: usize,
    /// Where the op's bytes land and how many of them belong to the block (the op itself is
    /// padded to [`ALIGN`]).
    addr: usize,
    valid: usize,
}

struct BlockRead {
    /// The block's ops end before `end`; `next` is its first op not yet hashed (its ops are
    /// consecutive in the batch).
    next: usize,
    end: usize,
    failed: bool,
    sum: StreamingChecksum,
}

impl std::fmt::Debug for BlockRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockRead").field("next", &self.next).field("end", &self.end).finish_non_exhaustive()
    }
}

/// The read ops of a batch of blocks and their checksums, built up as pieces complete.
#[derive(Debug, Default)]
pub(super) struct VerifiedReads {
    ops: Vec<IoOp>,
    pieces: Vec<Piece>,
    arrived: Vec<bool>,
    blocks: Vec<BlockRead>,
}

impl VerifiedReads {
    /// Adds a block of `len` bytes stored in `runs` (file offset, bytes) to be read into the
    /// memory `dest` names: (start, bytes of the block there) in block order, covering `len`
    /// bytes. Every start must be [`ALIGN`]ed, every piece but the last a multiple of
    /// [`ALIGN`] long, and the last must have room up to the next multiple of [`ALIGN`] (the
    /// padded tail); all of it valid until the batch is done. Returns the block's index.
    pub(super) fn add(
        &mut self,
        dest: &[(*mut u8, usize)],
        len: usize,
        runs: impl Iterator<Item = (u64, usize)>,
        kind: SumKind,
    ) -> usize {
        let block = self.blocks.len();
        let first = self.ops.len();
        let piece = piece_len(len);
        let (mut seg, mut seg_off) = (0usize, 0usize);
        let mut off = 0usize;
        for (file_off, run_len) in runs {
            let run_bytes = (len - off).min(run_len);
            let mut at = 0usize;
            // An empty block still reads one (padding) page, so it has an op like any other.
            while at < run_bytes || (run_bytes == 0 && at == 0) {
                while seg + 1 < dest.len() && seg_off >= dest[seg].1 {
                    seg += 1;
                    seg_off = 0;
                }
                let Some(&(base, seg_len)) = dest.get(seg) else { break };
                let valid = (run_bytes - at).min(piece).min(seg_len - seg_off);
                let addr = base as usize + seg_off;
                self.ops.push(IoOp {
                    kind: IoKind::Read,
                    offset: file_off + at as u64,
                    addr,
                    len: align_up(valid.max(1)),
                });
                self.pieces.push(Piece { block, addr, valid });
                at += valid.max(ALIGN);
                seg_off += valid;
            }
            off += run_bytes;
        }
        self.arrived.resize(self.ops.len(), false);
        self.blocks.push(BlockRead {
            next: first,
            end: self.ops.len(),
            failed: false,
            sum: StreamingChecksum::new(kind),
        });
        block
    }

    /// The ops to run (taken: the batch owns them from here on).
    pub(super) fn take_ops(&mut self) -> Vec<IoOp> {
        std::mem::take(&mut self.ops)
    }

    /// Whether a read op of block `block` completed with an error (as opposed to not having
    /// run at all, when the batch failed before its ops went out).
    pub(super) fn failed(&self, block: usize) -> bool {
        self.blocks[block].failed
    }

    /// The block op `index` reads.
    pub(super) fn block_of(&self, index: usize) -> Option<usize> {
        self.pieces.get(index).map(|p| p.block)
    }

    /// The checksum of block `block`'s bytes, or None when a piece of it failed to arrive.
    pub(super) fn checksum_of(&self, block: usize) -> Option<u64> {
        let b = &self.blocks[block];
        (!b.failed && b.next == b.end).then(|| b.sum.digest())
    }
}

impl IoProgress for VerifiedReads {
    fn started(&mut self) {}

    fn completed(&mut self, index: usize, ok: bool) {
        let Some(piece) = self.pieces.get(index).copied() else { return };
        let b = &mut self.blocks[piece.block];
        if !ok {
            b.failed = true;
            return;
        }
        self.arrived[index] = true;
        while !b.failed && b.next < b.end && self.arrived[b.next] {
            let p = self.pieces[b.next];
            // SAFETY: the piece's bytes have arrived (its op completed) and nothing writes them
            // again in this batch; its memory is valid for `valid` bytes (see `add`).
            let bytes = unsafe { std::slice::from_raw_parts(p.addr as *const u8, p.valid) };
            b.sum.update(bytes);
            b.next += 1;
        }
    }
}

/// [`VerifiedReads`]' progress that also reports each block as soon as the last of its pieces
/// is hashed and the sum matches the one expected of it, while later blocks of the batch are
/// still in flight, so that a load can copy it on while it is in cache. A block is reported
/// only once every op of it has completed (nothing writes its memory after), and so once: its
/// sum is finished by the completion of its last op, and no op of it completes after that.
pub(super) struct ReportMatches<'a, F: FnMut(usize)> {
    pub(super) reads: &'a mut VerifiedReads,
    /// The checksum expected of each block, by block index.
    pub(super) expected: &'a [u64],
    pub(super) on_match: F,
}

impl<F: FnMut(usize)> IoProgress for ReportMatches<'_, F> {
    fn started(&mut self) {
        self.reads.started();
    }

    fn completed(&mut self, index: usize, ok: bool) {
        self.reads.completed(index, ok);
        let Some(b) = self.reads.block_of(index) else { return };
        if let (Some(sum), Some(&want)) = (self.reads.checksum_of(b), self.expected.get(b))
            && sum == want
        {
            (self.on_match)(b);
        }
    }
}

/// Checksums of blocks being written, computed once their writes are in flight.
#[derive(Debug)]
pub(super) struct WriteSums<'a> {
    /// Each block's bytes, as pieces in order.
    blocks: Vec<Vec<&'a [u8]>>,
    /// Block of each op, so that a failed op fails only its block.
    op_block: Vec<usize>,
    sums: Vec<Option<u64>>,
    /// Ops of each block not yet completed; `usize::MAX` once one failed.
    left: Vec<usize>,
}

/// The checksum G3 stores of a block given as pieces.
fn sum_of(parts: &[&[u8]]) -> u64 {
    match parts {
        [one] => checksum(one),
        _ => {
            let mut sum = StreamingChecksum::new(SumKind::Crc64);
            for p in parts {
                sum.update(p);
            }
            sum.digest()
        }
    }
}

impl<'a> WriteSums<'a> {
    pub(super) fn new() -> Self {
        Self { blocks: Vec::new(), op_block: Vec::new(), sums: Vec::new(), left: Vec::new() }
    }

    /// Adds a block (its bytes as pieces in order) whose write ops are the next `ops` of the
    /// batch.
    pub(super) fn add(&mut self, parts: Vec<&'a [u8]>, ops: usize) {
        let block = self.blocks.len();
        self.blocks.push(parts);
        self.op_block.extend(std::iter::repeat_n(block, ops));
        self.sums.push(None);
        self.left.push(ops);
    }

    /// Block `block`'s checksum, or None unless every one of its writes completed.
    pub(super) fn result(&mut self, block: usize) -> Option<u64> {
        if self.left[block] != 0 {
            return None;
        }
        Some(*self.sums[block].get_or_insert_with(|| sum_of(&self.blocks[block])))
    }
}

impl IoProgress for WriteSums<'_> {
    fn started(&mut self) {
        for (sum, parts) in self.sums.iter_mut().zip(&self.blocks) {
            sum.get_or_insert_with(|| sum_of(parts));
        }
    }

    fn completed(&mut self, index: usize, ok: bool) {
        let Some(&b) = self.op_block.get(index) else { return };
        if self.left[b] != usize::MAX {
            self.left[b] = if ok { self.left[b].saturating_sub(1) } else { usize::MAX };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_block_and_hash_to_its_checksum_in_any_arrival_order() {
        for len in [0usize, 1, 4095, 4096, 100_000, 256 << 10, (2 << 20) + 17] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8).collect();
            let mut buf = crate::BlockBuf::zeroed(len);
            buf.copy_from_slice(&data);
            let base = buf.full_mut().as_mut_ptr();
            // Two runs: the first 64 KiB-aligned part and the rest, at unrelated file offsets.
            let split = (len / 2) / MIN_PIECE * MIN_PIECE;
            let runs = [(1 << 30, split), (5 << 20, len - split)];
            let mut r = VerifiedReads::default();
            let b = r.add(&[(base, len)], len, runs.into_iter().filter(|&(_, n)| n > 0 || len == 0), SumKind::Crc64);
            let ops = r.take_ops();
            let covered: usize = r.pieces.iter().map(|p| p.valid).sum();
            assert_eq!(covered, len);
            assert!(ops.iter().all(|o| o.len.is_multiple_of(ALIGN) && o.addr >= base as usize));
            assert!(ops.len() <= 2 * PIECES, "{len}: {} ops", ops.len());
            // Pieces arrive last first: nothing is hashed until the first one arrives.
            for i in (0..ops.len()).rev() {
                r.completed(i, true);
            }
            assert_eq!(r.checksum_of(b), Some(checksum(&data)), "len {len}");
        }
    }

    #[test]
    fn a_block_read_into_scattered_pages_arrives_whole_and_verified() {
        // The block's bytes on "disk" in two runs; its memory in 64 KiB pages laid out in
        // reverse order (as G2's free pages may be), the last one partly used.
        let page = 64 << 10;
        for len in [4096usize, 100_000, 256 << 10, (2 << 20) + 4096 + 17] {
            let data: Vec<u8> = (0..len).map(|i| (i * 13 % 251) as u8).collect();
            let split = (len / 2) / page * page;
            let runs = [(1u64 << 20, split), (8u64 << 20, len - split)];
            let mut file = vec![0u8; 16 << 20];
            file[1 << 20..(1 << 20) + split].copy_from_slice(&data[..split]);
            file[8 << 20..(8 << 20) + len - split].copy_from_slice(&data[split..]);
            let pages = len.div_ceil(page);
            let mut mem = crate::BlockBuf::zeroed(pages * page);
            let base = mem.full_mut().as_mut_ptr();
            let dest: Vec<(*mut u8, usize)> =
                (0..pages).map(|i| (base.wrapping_add((pages - 1 - i) * page), page.min(len - i * page))).collect();
            let mut r = VerifiedReads::default();
            let b = r.add(&dest, len, runs.into_iter().filter(|&(_, n)| n > 0), SumKind::Crc64);
            let ops = r.take_ops();
            for (i, op) in ops.iter().enumerate() {
                assert!(op.addr.is_multiple_of(ALIGN) && op.len.is_multiple_of(ALIGN), "{len}: op {i}");
                let seg = dest.iter().find(|(p, n)| op.addr >= *p as usize && op.addr < *p as usize + n.max(&1));
                let (p, _) = seg.expect("op lands in a destination page");
                assert!(op.addr + op.len <= *p as usize + page, "{len}: op {i} leaves its page");
                let from = op.offset as usize;
                // SAFETY: inside `mem` (checked just above).
                unsafe { std::ptr::copy_nonoverlapping(file[from..].as_ptr(), op.addr as *mut u8, op.len) };
            }
            for i in (0..ops.len()).rev() {
                r.completed(i, true);
            }
            assert_eq!(r.checksum_of(b), Some(checksum(&data)), "len {len}");
            let got: Vec<u8> = dest
                .iter()
                .flat_map(|(p, n)| {
                    // SAFETY: each piece lies inside `mem`.
                    unsafe { std::slice::from_raw_parts(*p as *const u8, *n) }.to_vec()
                })
                .collect();
            assert!(got == data, "len {len}: bytes differ");
        }
    }

    #[test]
    fn a_failed_piece_fails_only_its_block() {
        let mut bufs = [crate::BlockBuf::zeroed(300_000), crate::BlockBuf::zeroed(300_000)];
        let mut r = VerifiedReads::default();
        let a = r.add(
            &[(bufs[0].full_mut().as_mut_ptr(), 300_000)],
            300_000,
            [(0u64, 300_000usize)].into_iter(),
            SumKind::Crc64,
        );
        let b = r.add(
            &[(bufs[1].full_mut().as_mut_ptr(), 300_000)],
            300_000,
            [(1u64 << 20, 300_000usize)].into_iter(),
            SumKind::Crc64,
        );
        let n = r.take_ops().len();
        let a_ops = r.pieces.iter().filter(|p| p.block == a).count();
        for i in 0..n {
            r.completed(i, i != 1);
        }
        assert!(a_ops > 1);
        assert_eq!(r.checksum_of(a), None);
        assert_eq!(r.checksum_of(b), Some(checksum(&bufs[1][..])));
    }
}
