//! An engine's token area: a shared-memory file the engine writes long prompts' token ids into
//! and the daemon maps read-only, so that a lookup of a 128k-token prompt carries a span instead
//! of 512 KiB of tokens (proto/kvcached.proto, TOKENS).
//!
//! The engine may write the file at any time, also while the daemon reads a span, so the daemon
//! never hands out a reference into the mapping: it copies the span out through raw pointers
//! and derives keys from its own copy. A client that rewrites a span mid-request gets an answer
//! for whatever bytes the daemon copied: for its own request only, like sending other tokens.

use std::fs::OpenOptions;

use kvproto::pb;
use memmap2::{MmapOptions, MmapRaw};

use crate::error::ServerError;

/// Largest token area the daemon maps (64 MiB: 16M tokens; a client asks for a few MiB).
pub const MAX_BYTES: u64 = 64 << 20;

/// A mapped token area.
#[derive(Debug)]
pub struct TokenArea {
    map: MmapRaw,
    len: usize,
}

// SAFETY: the mapping is only read, through raw pointers, into memory the reader owns.
unsafe impl Send for TokenArea {}
// SAFETY: as above.
unsafe impl Sync for TokenArea {}

impl TokenArea {
    /// Maps the area a registration names; the error says why not.
    pub fn open(req: &pb::TokenArea) -> Result<Self, String> {
        let path = &req.shm_path;
        if req.size_bytes == 0 || req.size_bytes > MAX_BYTES {
            return Err(format!("token area {path}: size {} is not in 1..={MAX_BYTES}", req.size_bytes));
        }
        let file =
            OpenOptions::new().read(true).open(path).map_err(|e| format!("cannot open token area {path}: {e}"))?;
        let len = file.metadata().map_err(|e| format!("token area {path}: {e}"))?.len();
        if len < req.size_bytes {
            return Err(format!("token area {path} has {len} bytes, the registration says {}", req.size_bytes));
        }
        let map = MmapOptions::new()
            .len(req.size_bytes as usize)
            .map_raw_read_only(&file)
            .map_err(|e| format!("cannot map token area {path}: {e}"))?;
        Ok(Self { map, len: req.size_bytes as usize })
    }

    /// A copy of the tokens at `span` (little-endian u32s, as in a request's `tokens`).
    pub fn tokens(&self, span: &pb::TokenSpan) -> Result<Vec<u8>, ServerError> {
        let end = span.offset.checked_add(span.len).filter(|e| *e <= self.len as u64).ok_or_else(|| {
            ServerError::Invalid(format!(
                "tokens_at (offset {}, len {}) does not lie inside the {}-byte token area",
                span.offset, span.len, self.len
            ))
        })?;
        if !span.len.is_multiple_of(4) {
            return Err(kvproto::ProtoError::TokenBytes(span.len as usize).into());
        }
        let (start, n) = (span.offset as usize, (end - span.offset) as usize);
        let mut out = Vec::with_capacity(n);
        // SAFETY: `[start, start + n)` lies inside the mapping (checked above) and `out` has room
        // for `n` bytes, which the copy initialises before `set_len`. The source may change while
        // it is copied (see the module documentation); the copy is plain bytes either way.
        unsafe {
            std::ptr::copy_nonoverlapping(self.map.as_ptr().add(start), out.as_mut_ptr(), n);
            out.set_len(n);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn area(dir: &std::path::Path, bytes: &[u8], declared: u64) -> Result<TokenArea, String> {
        let path = dir.join("tokens");
        std::fs::write(&path, bytes).unwrap();
        TokenArea::open(&pb::TokenArea { shm_path: path.display().to_string(), size_bytes: declared })
    }

    #[test]
    fn spans_inside_the_area_are_copied_and_others_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let bytes: Vec<u8> = (0..64u8).collect();
        let a = area(dir.path(), &bytes, 64).unwrap();
        assert_eq!(a.tokens(&pb::TokenSpan { offset: 8, len: 16 }).unwrap(), bytes[8..24]);
        assert_eq!(a.tokens(&pb::TokenSpan { offset: 64, len: 0 }).unwrap(), Vec::<u8>::new());
        for (offset, len) in [(60, 8), (u64::MAX, 4), (4, u64::MAX), (65, 0)] {
            let e = a.tokens(&pb::TokenSpan { offset, len }).unwrap_err().to_string();
            assert!(e.contains("does not lie inside"), "{e}");
        }
        let e = a.tokens(&pb::TokenSpan { offset: 0, len: 6 }).unwrap_err().to_string();
        assert!(e.contains("not a whole number of 4-byte"), "{e}");
    }

    #[test]
    fn areas_that_cannot_be_mapped_say_why() {
        let dir = tempfile::tempdir().unwrap();
        assert!(area(dir.path(), &[0; 16], 64).unwrap_err().contains("has 16 bytes"));
        assert!(area(dir.path(), &[0; 16], 0).unwrap_err().contains("not in 1..="));
        assert!(area(dir.path(), &[0; 16], MAX_BYTES + 1).unwrap_err().contains("not in 1..="));
        let missing = TokenArea::open(&pb::TokenArea { shm_path: "/nonexistent/kv".into(), size_bytes: 4 });
        assert!(missing.unwrap_err().contains("cannot open"));
    }
}
