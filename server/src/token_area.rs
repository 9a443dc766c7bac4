//! An engine's token area: a shared-memory file the engine writes long prompts' token ids into
//! and the daemon reads, so that a lookup of a 128k-token prompt carries a span instead of
//! 512 KiB of tokens (proto/kvcached.proto, TOKENS).
//!
//! The daemon reads a span with `pread` into memory of its own and derives keys from that copy.
//! Not a mapping: the engine may rewrite or even truncate the file at any time, and a read of a
//! truncated mapping would kill the daemon with SIGBUS, where `pread` just comes up short (a
//! clear error). A client that rewrites a span mid-request gets an answer for whatever bytes
//! were read: for its own request only, like sending other tokens.

use std::fs::File;
use std::os::unix::fs::FileExt;

use kvproto::pb;

use crate::error::ServerError;

/// Largest token area the daemon accepts (64 MiB: 16M tokens; a client asks for a few MiB).
pub const MAX_BYTES: u64 = 64 << 20;

/// An engine's token area, open for reading.
#[derive(Debug)]
pub struct TokenArea {
    file: File,
    path: String,
    len: u64,
}

impl TokenArea {
    /// Opens the area a registration names; the error says why not.
    pub fn open(req: &pb::TokenArea) -> Result<Self, String> {
        let path = &req.shm_path;
        if req.size_bytes == 0 || req.size_bytes > MAX_BYTES {
            return Err(format!("token area {path}: size {} is not in 1..={MAX_BYTES}", req.size_bytes));
        }
        let file = crate::engine::open_client_file(path, false).map_err(|e| format!("token area {e}"))?;
        let len = file.metadata().map_err(|e| format!("token area {path}: {e}"))?.len();
        if len < req.size_bytes {
            return Err(format!("token area {path} has {len} bytes, the registration says {}", req.size_bytes));
        }
        Ok(Self { file, path: path.clone(), len: req.size_bytes })
    }

    /// The tokens at `span` (little-endian u32s, as in a request's `tokens`), read now.
    pub fn tokens(&self, span: &pb::TokenSpan) -> Result<Vec<u8>, ServerError> {
        if span.offset.checked_add(span.len).is_none_or(|end| end > self.len) {
            return Err(ServerError::Invalid(format!(
                "tokens_at (offset {}, len {}) does not lie inside the {}-byte token area",
                span.offset, span.len, self.len
            )));
        }
        if !span.len.is_multiple_of(4) {
            return Err(kvproto::ProtoError::TokenBytes(span.len as usize).into());
        }
        let mut out = vec![0u8; span.len as usize];
        self.file.read_exact_at(&mut out, span.offset).map_err(|e| {
            ServerError::Invalid(format!(
                "cannot read tokens_at (offset {}, len {}) from token area {}: {e}",
                span.offset, span.len, self.path
            ))
        })?;
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
    fn a_truncated_area_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let a = area(dir.path(), &[7; 64], 64).unwrap();
        std::fs::OpenOptions::new().write(true).open(dir.path().join("tokens")).unwrap().set_len(16).unwrap();
        let e = a.tokens(&pb::TokenSpan { offset: 8, len: 16 }).unwrap_err().to_string();
        assert!(e.contains("cannot read tokens_at"), "{e}");
        assert_eq!(a.tokens(&pb::TokenSpan { offset: 0, len: 16 }).unwrap(), [7; 16]);
    }

    #[test]
    fn areas_that_cannot_be_opened_say_why() {
        let dir = tempfile::tempdir().unwrap();
        assert!(area(dir.path(), &[0; 16], 64).unwrap_err().contains("has 16 bytes"));
        assert!(area(dir.path(), &[0; 16], 0).unwrap_err().contains("not in 1..="));
        assert!(area(dir.path(), &[0; 16], MAX_BYTES + 1).unwrap_err().contains("not in 1..="));
        let missing = TokenArea::open(&pb::TokenArea { shm_path: "/nonexistent/kv".into(), size_bytes: 4 });
        assert!(missing.unwrap_err().contains("cannot open"));
        // Neither a directory nor a FIFO (whose read-only open would wait for a writer forever).
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.display().to_string()).unwrap();
        // SAFETY: plain syscall with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for p in [fifo, dir.path().to_path_buf()] {
            let e = TokenArea::open(&pb::TokenArea { shm_path: p.display().to_string(), size_bytes: 4 }).unwrap_err();
            assert!(e.contains("not a regular file"), "{e}");
        }
    }
}
