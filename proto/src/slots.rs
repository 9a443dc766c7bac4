//! Where an engine's block slots lie in its KV memory: one definition for the client that lays
//! its memory out and the daemon that copies in and out of it.
//!
//! A block is `segments.len()` segments of `segment_bytes` each, in block byte order (layer 0 K,
//! layer 0 V, layer 1 K, ... for [`LayoutKind::LayerSeparate`]; one segment for
//! [`LayoutKind::Contiguous`]). Segment `i` of slot `b` starts at `offset_i + b * stride_i`.
//! [`SlotLayout::check`] refuses a layout whose slots leave the region, whose segments do not add
//! up to the layout's block, or whose slots overlap one another (two slots aliasing the same bytes
//! would let one block's load overwrite another's).

use crate::ProtoError;
use crate::namespace::{KvLayout, LayoutKind};

/// One segment of every slot: where slot 0's copy starts, and the distance between slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub offset: u64,
    pub stride: u64,
}

/// The slots of an engine's KV memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotLayout {
    pub segments: Vec<Segment>,
    pub segment_bytes: u64,
    pub num_blocks: u32,
}

fn bad(field: &'static str, reason: impl Into<String>) -> ProtoError {
    ProtoError::InvalidLayout { field, reason: reason.into() }
}

impl SlotLayout {
    /// vLLM's layout: one tensor `[num_blocks, segment]` per layer and K/V, back to back (layer 0
    /// K, layer 0 V, layer 1 K, ...).
    pub fn layer_separate(layout: &KvLayout, num_blocks: u32) -> Self {
        let seg = layout.segment_bytes();
        let tensor = u64::from(num_blocks).saturating_mul(seg);
        let segments = (0..u64::from(layout.num_layers) * 2)
            .map(|t| Segment { offset: t.saturating_mul(tensor), stride: seg })
            .collect();
        Self { segments, segment_bytes: seg, num_blocks }
    }

    /// Fully contiguous blocks: slot `b` is bytes `[b * block, (b + 1) * block)`.
    pub fn contiguous(layout: &KvLayout, num_blocks: u32) -> Self {
        let block = layout.block_bytes();
        Self { segments: vec![Segment { offset: 0, stride: block }], segment_bytes: block, num_blocks }
    }

    /// The layout's kind's standard slots.
    pub fn for_layout(layout: &KvLayout, num_blocks: u32) -> Self {
        match layout.kind {
            LayoutKind::LayerSeparate => Self::layer_separate(layout, num_blocks),
            LayoutKind::Contiguous => Self::contiguous(layout, num_blocks),
        }
    }

    /// Bytes from the region's start to the end of its last slot (the region must be at least
    /// this long); `None` on overflow.
    pub fn extent(&self) -> Option<u64> {
        let last = u64::from(self.num_blocks.checked_sub(1)?);
        self.segments.iter().try_fold(0u64, |end, s| {
            let e = last.checked_mul(s.stride)?.checked_add(s.offset)?.checked_add(self.segment_bytes)?;
            Some(end.max(e))
        })
    }

    /// Checks the slots against `layout` and a region of `region_bytes`.
    pub fn check(&self, layout: &KvLayout, region_bytes: u64) -> Result<(), ProtoError> {
        let want = match layout.kind {
            LayoutKind::LayerSeparate => layout.num_layers as usize * 2,
            LayoutKind::Contiguous => 1,
        };
        if self.segments.len() != want {
            return Err(bad(
                "segments",
                format!(
                    "layout {} with {} layers needs {want} segments, got {}",
                    layout.kind.name(),
                    layout.num_layers,
                    self.segments.len()
                ),
            ));
        }
        let block_bytes = layout.block_bytes();
        if self.segment_bytes.checked_mul(want as u64) != Some(block_bytes) {
            return Err(bad(
                "segment_bytes",
                format!(
                    "{} x {want} segments != {block_bytes} bytes per block for this layout ({} layers, {} KV heads, \
                     head dim {}, {}, {} tokens per block)",
                    self.segment_bytes,
                    layout.num_layers,
                    layout.kv_heads,
                    layout.head_dim,
                    layout.dtype.name(),
                    layout.tokens_per_block
                ),
            ));
        }
        if self.num_blocks == 0 {
            return Err(bad("num_blocks", "must be at least 1"));
        }
        let last = self.num_blocks - 1;
        for (i, s) in self.segments.iter().enumerate() {
            let end = u64::from(last)
                .checked_mul(s.stride)
                .and_then(|x| x.checked_add(s.offset))
                .and_then(|x| x.checked_add(self.segment_bytes));
            if end.is_none_or(|e| e > region_bytes) {
                return Err(bad(
                    "segments",
                    format!(
                        "segment {i} (offset {}, stride {}) of block {last} ends past the region's {region_bytes} bytes",
                        s.offset, s.stride
                    ),
                ));
            }
        }
        self.check_disjoint()
    }

    /// No two (slot, segment) pairs share a byte. Segments are arithmetic progressions of
    /// intervals; two of them are disjoint when their extents are, or when they share a stride
    /// and sit at offsets at least a segment apart modulo it. Layouts that interleave segments of
    /// different strides are refused as unsupported (no engine lays KV out that way).
    fn check_disjoint(&self) -> Result<(), ProtoError> {
        let len = self.segment_bytes;
        let n = u64::from(self.num_blocks);
        // Within one segment: consecutive slots must not overlap.
        for (i, s) in self.segments.iter().enumerate() {
            if n > 1 && s.stride < len {
                return Err(bad(
                    "segments",
                    format!("segment {i}'s stride {} is shorter than a segment ({len} bytes): slots overlap", s.stride),
                ));
            }
        }
        // (n - 1) * stride + len fits: `check` verified it against the region first.
        let extent = |s: &Segment| (s.offset, s.offset + (n - 1) * s.stride + len);
        for (i, a) in self.segments.iter().enumerate() {
            let (a0, a1) = extent(a);
            for (j, b) in self.segments.iter().enumerate().skip(i + 1) {
                let (b0, b1) = extent(b);
                if a1 <= b0 || b1 <= a0 {
                    continue;
                }
                let disjoint = a.stride == b.stride && {
                    let d = b.offset.abs_diff(a.offset) % a.stride.max(1);
                    d >= len && a.stride - d >= len
                };
                if !disjoint {
                    return Err(bad(
                        "segments",
                        format!(
                            "segments {i} (offset {}, stride {}) and {j} (offset {}, stride {}) overlap: slots would alias",
                            a.offset, a.stride, b.offset, b.stride
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Segment byte ranges `(offset, len)` of slot `block`, in block byte order. In range for a
    /// layout that passed [`SlotLayout::check`] and `block < num_blocks`.
    pub fn ranges(&self, block: u32) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.segments
            .iter()
            .map(move |s| ((s.offset + u64::from(block) * s.stride) as usize, self.segment_bytes as usize))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::namespace::Dtype;

    fn layout(kind: LayoutKind) -> KvLayout {
        KvLayout { num_layers: 2, kv_heads: 2, head_dim: 64, dtype: Dtype::Bf16, tokens_per_block: 16, kind }
    }

    #[test]
    fn standard_layouts_pass_and_fill_their_region() {
        for kind in [LayoutKind::LayerSeparate, LayoutKind::Contiguous] {
            let l = layout(kind);
            let s = SlotLayout::for_layout(&l, 8);
            let extent = s.extent().unwrap_or(0);
            assert_eq!(extent, 8 * l.block_bytes());
            assert_eq!(s.check(&l, extent), Ok(()));
            assert!(s.check(&l, extent - 1).is_err());
            let total: usize = s.ranges(7).map(|(_, n)| n).sum();
            assert_eq!(total as u64, l.block_bytes());
        }
    }

    /// Block-major interleaving (a block's segments side by side, one stride per block) is fine;
    /// segments at offset 0 with stride 0, or a shifted copy of another segment, alias.
    #[test]
    fn aliasing_slots_are_refused() {
        let l = layout(LayoutKind::LayerSeparate);
        let seg = l.segment_bytes();
        let region = 4 * 8 * seg;
        let with =
            |segments: Vec<Segment>| SlotLayout { segments, segment_bytes: seg, num_blocks: 8 }.check(&l, region);
        let interleaved = (0..4).map(|i| Segment { offset: i * seg, stride: 4 * seg }).collect();
        assert_eq!(with(interleaved), Ok(()));
        let all_zero = vec![Segment { offset: 0, stride: 0 }; 4];
        assert!(with(all_zero).is_err_and(|e| e.to_string().contains("overlap")));
        let mut shifted: Vec<Segment> = (0..4).map(|i| Segment { offset: i * 8 * seg, stride: seg }).collect();
        shifted[1].offset = seg / 2; // inside segment 0's tensor
        assert!(with(shifted).is_err_and(|e| e.to_string().contains("alias")));
        let mixed = vec![
            Segment { offset: 0, stride: 2 * seg },
            Segment { offset: seg, stride: 3 * seg },
            Segment { offset: 24 * seg, stride: seg },
            Segment { offset: 16 * seg, stride: seg },
        ];
        assert!(with(mixed).is_err());
    }

    #[test]
    fn wrong_counts_and_sizes_name_the_field() {
        let l = layout(LayoutKind::LayerSeparate);
        let mut s = SlotLayout::layer_separate(&l, 4);
        s.segments.pop();
        assert!(s.check(&l, u64::MAX).is_err_and(|e| e.to_string().contains("needs 4 segments")));
        let mut s = SlotLayout::layer_separate(&l, 4);
        s.segment_bytes += 1;
        assert!(s.check(&l, u64::MAX).is_err_and(|e| e.to_string().contains("segment_bytes")));
        let mut s = SlotLayout::layer_separate(&l, 4);
        s.num_blocks = 0;
        assert!(s.check(&l, u64::MAX).is_err_and(|e| e.to_string().contains("num_blocks")));
        let mut s = SlotLayout::layer_separate(&l, 4);
        s.segments[3].stride = u64::MAX;
        assert!(s.check(&l, u64::MAX).is_err_and(|e| e.to_string().contains("ends past")));
    }
}
