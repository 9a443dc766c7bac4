//! The client's token area: a shared-memory file the engine writes a long prompt's token ids
//! into before a lookup, which then carries only their span (proto/kvcached.proto, TOKENS; the
//! daemon's side is server/src/engine/token_area.rs). A 128k-token lookup's 512 KiB of tokens then no
//! longer pass through HTTP/2 frames, encoders and decoders on both sides.
//!
//! The area is cut into [`SLOTS`] equal slots so that concurrent requests of one client do not
//! wait for each other: a request takes a free slot (an atomic bit), and a prompt that finds
//! none free, or is longer than a slot, goes inline as before. A request that is cancelled (its
//! future dropped) frees its slot at once, while the daemon may still be reading it: that
//! request's answer, which nobody waits for, may then be for a prompt torn by the next one.
//!
//! The area is an anonymous shared-memory file (memfd) handed to the daemon as a descriptor
//! (ATTACH): nothing is left behind when the client's process ends, however it ends.

use std::fs::File;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use kvproto::pb;
use memmap2::{MmapOptions, MmapRaw};

/// Slots per area.
pub const SLOTS: usize = 4;

/// Prompts with fewer token bytes than this go inline (16k tokens: below it, the copy through
/// HTTP/2 costs little).
pub const STAGE_MIN_BYTES: usize = 64 << 10;

/// Default area size: 4 MiB, slots of 1 MiB (262,144 tokens).
pub const DEFAULT_BYTES: usize = 4 << 20;

/// A shared-memory file of [`SLOTS`] slots. The file is removed on drop.
#[derive(Debug)]
pub struct TokenArea {
    file: Arc<File>,
    map: MmapRaw,
    slot_bytes: usize,
    /// Bit `i` set: slot `i` is in use.
    used: AtomicU32,
}

/// A prompt's tokens written into a slot; the slot is free again on drop (after the request).
#[derive(Debug)]
pub struct Staged {
    area: Arc<TokenArea>,
    slot: usize,
    pub span: pb::TokenSpan,
}

impl Drop for Staged {
    fn drop(&mut self) {
        self.area.used.fetch_and(!(1 << self.slot), Ordering::Release);
    }
}

impl TokenArea {
    /// Creates an area of `bytes` (rounded down to whole 4-byte slots).
    pub fn create(bytes: usize) -> std::io::Result<Self> {
        let slot_bytes = bytes / SLOTS / 4 * 4;
        if slot_bytes == 0 || (slot_bytes * SLOTS) as u64 > kvproto::limits::TOKEN_AREA_MAX_BYTES {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "a token area of {bytes} bytes: give {} to {}",
                    SLOTS * 4,
                    kvproto::limits::TOKEN_AREA_MAX_BYTES
                ),
            ));
        }
        let file = crate::memory::memfd("kvcached-tokens", (slot_bytes * SLOTS) as u64)?;
        let map = MmapOptions::new().len(slot_bytes * SLOTS).map_raw(&file)?;
        Ok(Self { file: Arc::new(file), map, slot_bytes, used: AtomicU32::new(0) })
    }

    /// The descriptor handed to the daemon.
    pub fn file(&self) -> &Arc<File> {
        &self.file
    }

    /// The registration's description of the area (its ticket is filled in when the descriptor
    /// has been handed over).
    pub fn request(&self) -> pb::TokenArea {
        pb::TokenArea { size_bytes: (self.slot_bytes * SLOTS) as u64, ..Default::default() }
    }

    /// Writes `tokens` into a free slot, when they are long enough to be worth it, fit a slot and
    /// a slot is free.
    pub fn stage(self: &Arc<Self>, tokens: &[u32]) -> Option<Staged> {
        let n = std::mem::size_of_val(tokens);
        if n < STAGE_MIN_BYTES || n > self.slot_bytes {
            return None;
        }
        let slot = loop {
            let used = self.used.load(Ordering::Acquire);
            let free = (0..SLOTS).find(|i| used & (1 << i) == 0)?;
            if self.used.compare_exchange(used, used | (1 << free), Ordering::AcqRel, Ordering::Acquire).is_ok() {
                break free;
            }
        };
        let at = slot * self.slot_bytes;
        // SAFETY: slot `slot` is ours until `Staged` drops (its `used` bit), and `n` bytes from
        // `at` lie inside it (checked above).
        unsafe {
            let dst = self.map.as_mut_ptr().add(at);
            for (i, t) in tokens.iter().enumerate() {
                dst.add(4 * i).cast::<[u8; 4]>().write_unaligned(t.to_le_bytes());
            }
        }
        Some(Staged { area: Arc::clone(self), slot, span: pb::TokenSpan { offset: at as u64, len: n as u64 } })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn read(area: &TokenArea, span: &pb::TokenSpan) -> Vec<u8> {
        // SAFETY: the span lies inside the mapping (asserted by the callers' expectations).
        unsafe { std::slice::from_raw_parts(area.map.as_ptr().add(span.offset as usize), span.len as usize).to_vec() }
    }

    #[test]
    fn long_prompts_take_free_slots_and_give_them_back() {
        let area = Arc::new(TokenArea::create(1 << 20).unwrap());
        assert_eq!(area.file().metadata().unwrap().len(), 1 << 20);
        assert_eq!(area.request().size_bytes, 1 << 20);
        let tokens: Vec<u32> = (0..32_768u32).map(|t| t.wrapping_mul(0x9e37_79b9)).collect();
        let le: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        // Slots of 256 KiB. Short prompts and prompts longer than a slot go inline.
        assert!(area.stage(&tokens[..1000]).is_none());
        assert!(area.stage(&[1u32; 65_537]).is_none());
        let staged: Vec<Staged> = (0..SLOTS).map(|_| area.stage(&tokens).unwrap()).collect();
        let mut offsets: Vec<u64> = staged.iter().map(|s| s.span.offset).collect();
        offsets.dedup();
        assert_eq!(offsets.len(), SLOTS, "every request has a slot of its own");
        for s in &staged {
            assert_eq!(read(&area, &s.span), le);
        }
        assert!(area.stage(&tokens).is_none(), "no slot free: inline");
        drop(staged);
        assert!(area.stage(&tokens).is_some());
    }

    #[test]
    fn areas_too_small_or_too_large_are_refused() {
        assert!(TokenArea::create(8).is_err());
        assert!(TokenArea::create(2 * kvproto::limits::TOKEN_AREA_MAX_BYTES as usize).is_err());
    }
}
