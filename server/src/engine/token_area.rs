//! An engine's token area: a shared-memory file the engine writes long prompts' token ids into
//! and the daemon reads, so that a lookup of a 128k-token prompt carries a span instead of
//! 512 KiB of tokens (proto/kvcached.proto, TOKENS).
//!
//! The daemon maps the area read-only and copies a span into memory of its own as far as the
//! request uses it ([`PromptTokens`]): a chunk at a time, just before the key chain reads it,
//! with the next chunk prefetched. So the copy runs under the chain instead of before it
//! (docs/benchmarks.md has the cold 128k lookup), and everything the daemon derives or
//! remembers comes from its own copy: an engine that rewrites a span mid-request gets an answer
//! for whatever bytes were copied, for its own request only, like sending other tokens. An
//! engine that truncates its area does not kill the daemon with SIGBUS: the mapping is watched
//! by the [`FaultGuard`], and its requests fail with an error that says so.

use memmap2::{MmapOptions, MmapRaw};

use kvproto::pb;

use crate::engine::attach::Tickets;
use crate::engine::fault_guard::FaultGuard;
use crate::error::ServerError;

/// Largest token area the daemon accepts (a client asks for a few MiB).
pub const MAX_BYTES: u64 = kvproto::limits::TOKEN_AREA_MAX_BYTES;

/// Bytes copied ahead of the chain's needs and prefetched past them: a key memo chunk of
/// 16-token blocks (256 x 64 bytes).
const COPY_AHEAD: usize = 16 << 10;

/// An engine's token area, mapped for reading.
#[derive(Debug)]
pub struct TokenArea {
    // Declared before the mapping: the watch ends before the range is unmapped.
    guard: FaultGuard,
    map: MmapRaw,
    path: String,
}

impl TokenArea {
    /// Maps the area a registration hands over (its descriptor's ticket, redeemed for process
    /// `pid` of `uid`); the error says why not.
    pub fn open(req: &pb::TokenArea, tickets: &Tickets, uid: u32, pid: Option<i32>) -> Result<Self, String> {
        #[allow(deprecated)]
        if !req.shm_path.is_empty() {
            return Err(
                "token_area.shm_path: paths are not accepted; pass the descriptor (ATTACH) and its fd_ticket".into()
            );
        }
        if req.size_bytes == 0 || req.size_bytes > MAX_BYTES {
            return Err(format!("token area size {} is not in 1..={MAX_BYTES}", req.size_bytes));
        }
        let file = tickets.redeem(&req.fd_ticket, uid, pid).map_err(|e| format!("token area: {e}"))?.file;
        Self::map(&file, req.size_bytes, "token area (descriptor)")
    }

    /// Maps `size` bytes of `file` read-only under the fault guard.
    pub(crate) fn map(file: &std::fs::File, size: u64, what: &str) -> Result<Self, String> {
        let len = file.metadata().map_err(|e| format!("{what}: {e}"))?.len();
        if len < size {
            return Err(format!("{what} has {len} bytes, the registration says {size}"));
        }
        let map = MmapOptions::new()
            .len(size as usize)
            .map_raw_read_only(file)
            .map_err(|e| format!("cannot map the {what}: {e}"))?;
        let guard = FaultGuard::watch(map.as_ptr() as usize, map.len())?;
        Ok(Self { guard, map, path: what.to_string() })
    }

    /// The tokens at `span`, to be copied in as they are used.
    pub fn tokens(&self, span: &pb::TokenSpan) -> Result<PromptTokens<'_>, ServerError> {
        let len = self.map.len() as u64;
        if span.offset.checked_add(span.len).is_none_or(|end| end > len) {
            return Err(ServerError::Invalid(format!(
                "tokens_at (offset {}, len {}) does not lie inside the {len}-byte token area",
                span.offset, span.len
            )));
        }
        if !span.len.is_multiple_of(4) {
            return Err(kvproto::ProtoError::TokenBytes(span.len as usize).into());
        }
        self.check()?;
        let len = span.len as usize;
        // SAFETY: the span lies inside the mapping (checked above).
        let src = unsafe { self.map.as_ptr().add(span.offset as usize) };
        Ok(PromptTokens { kind: Kind::Area { area: self, src, len, copy: Vec::with_capacity(len) } })
    }

    /// An error once a copy out of the area has faulted (the engine shrank its file).
    fn check(&self) -> Result<(), ServerError> {
        if self.guard.faulted() {
            return Err(ServerError::Invalid(format!(
                "{} shrank under the daemon: its tokens cannot be read (register again)",
                self.path
            )));
        }
        Ok(())
    }
}

/// A request's tokens (little-endian u32s), in the daemon's own memory as far as they are used.
pub struct PromptTokens<'a> {
    kind: Kind<'a>,
}

/// Sizes only: a prompt's tokens are the user's text and stay out of logs.
impl std::fmt::Debug for PromptTokens<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let copied = match &self.kind {
            Kind::Inline(b) => b.len(),
            Kind::Area { copy, .. } => copy.len(),
        };
        f.debug_struct("PromptTokens").field("len", &self.len()).field("copied", &copied).finish()
    }
}

enum Kind<'a> {
    /// Carried in the request.
    Inline(&'a [u8]),
    /// A span of a token area: `copy` holds its first `copy.len()` bytes.
    Area { area: &'a TokenArea, src: *const u8, len: usize, copy: Vec<u8> },
}

impl<'a> PromptTokens<'a> {
    /// Tokens carried in a request.
    pub fn inline(bytes: &'a [u8]) -> Self {
        Self { kind: Kind::Inline(bytes) }
    }

    /// Bytes of the tokens.
    pub fn len(&self) -> usize {
        match &self.kind {
            Kind::Inline(b) => b.len(),
            Kind::Area { len, .. } => *len,
        }
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first `end` bytes (at most all of them), copying in what is not yet copied and
    /// prefetching what follows.
    pub fn upto(&mut self, end: usize) -> &[u8] {
        match &mut self.kind {
            Kind::Inline(b) => &b[..end.min(b.len())],
            Kind::Area { src, len, copy, .. } => {
                let end = end.min(*len);
                let have = copy.len();
                if end > have {
                    // SAFETY: `src..src + len` lies inside the mapping, which outlives `self`
                    // (it borrows the area); the spare capacity holds `len - have` bytes. A
                    // page the engine truncated away reads as zeros (the fault guard), which
                    // `check` reports. The engine may write the span meanwhile (a plain copy
                    // of shared memory, as for its KV memory): whatever bytes land in `copy`
                    // are the ones everything after reads.
                    unsafe {
                        std::ptr::copy_nonoverlapping(src.add(have), copy.as_mut_ptr().add(have), end - have);
                        copy.set_len(end);
                    }
                    prefetch(*src, end, (end + COPY_AHEAD).min(*len));
                }
                &copy[..end]
            }
        }
    }

    /// All the tokens.
    pub fn all(&mut self) -> &[u8] {
        self.upto(usize::MAX)
    }

    /// All the tokens, or the error of a copy that faulted.
    pub fn all_checked(&mut self) -> Result<&[u8], ServerError> {
        self.all();
        self.check()?;
        Ok(self.all())
    }

    /// An error when a copy out of the token area faulted: what was copied is not the
    /// engine's tokens, so nothing derived from it may be answered.
    pub fn check(&self) -> Result<(), ServerError> {
        match &self.kind {
            Kind::Inline(_) => Ok(()),
            Kind::Area { area, .. } => area.check(),
        }
    }
}

/// Asks for the cache lines of `src[from..to]`. Prefetches never fault.
fn prefetch(src: *const u8, from: usize, to: usize) {
    #[cfg(target_arch = "x86_64")]
    for at in (from..to).step_by(64) {
        // SAFETY: a prefetch has no architectural effect; the address is inside the mapping.
        unsafe { std::arch::x86_64::_mm_prefetch(src.wrapping_add(at).cast::<i8>(), std::arch::x86_64::_MM_HINT_T0) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (src, from, to);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn area(dir: &std::path::Path, bytes: &[u8], declared: u64) -> Result<TokenArea, String> {
        let path = dir.join("tokens");
        std::fs::write(&path, bytes).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        TokenArea::map(&file, declared, "token area")
    }

    /// Asserts that `a` refuses the span (`offset`, `len`) saying `why`.
    fn refused(a: &TokenArea, offset: u64, len: u64, why: &str) {
        let e = a.tokens(&pb::TokenSpan { offset, len }).unwrap_err().to_string();
        assert!(e.contains(why), "({offset}, {len}): {e}");
    }

    #[test]
    fn spans_inside_the_area_are_copied_and_others_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let bytes: Vec<u8> = (0..64u8).collect();
        let a = area(dir.path(), &bytes, 64).unwrap();
        assert_eq!(a.tokens(&pb::TokenSpan { offset: 8, len: 16 }).unwrap().all(), &bytes[8..24]);
        assert_eq!(a.tokens(&pb::TokenSpan { offset: 64, len: 0 }).unwrap().all(), &[] as &[u8]);
        for (offset, len) in [(60, 8), (u64::MAX, 4), (4, u64::MAX), (65, 0)] {
            refused(&a, offset, len, "does not lie inside");
        }
        refused(&a, 0, 6, "not a whole number of 4-byte");
    }

    #[test]
    fn a_span_is_copied_as_far_as_it_is_used_and_the_copy_is_the_daemons_own() {
        let dir = tempfile::tempdir().unwrap();
        let bytes: Vec<u8> = (0..1u32 << 16).map(|i| (i * 7) as u8).collect();
        let a = area(dir.path(), &bytes, bytes.len() as u64).unwrap();
        let mut t = a.tokens(&pb::TokenSpan { offset: 4, len: 40_000 }).unwrap();
        assert_eq!(t.len(), 40_000);
        assert_eq!(t.upto(100), &bytes[4..104]);
        // The engine rewrites the area: what was copied stays, what was not is read now.
        std::fs::write(dir.path().join("tokens"), vec![1u8; bytes.len()]).unwrap();
        let got = t.upto(200).to_vec();
        assert_eq!(got[..100], bytes[4..104]);
        assert_eq!(got[100..], [1u8; 100]);
        assert_eq!(t.upto(1 << 30).len(), 40_000);
        t.check().unwrap();
    }

    #[test]
    fn a_truncated_area_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let page = 4096;
        let a = area(dir.path(), &vec![7; 3 * page], 3 * page as u64).unwrap();
        std::fs::OpenOptions::new().write(true).open(dir.path().join("tokens")).unwrap().set_len(page as u64).unwrap();
        // What still lies in the file reads as before.
        let mut t = a.tokens(&pb::TokenSpan { offset: 0, len: 16 }).unwrap();
        assert_eq!(t.all(), [7; 16]);
        t.check().unwrap();
        // A span past the new end faults (SIGBUS, caught): the copy is not the engine's tokens.
        let mut t = a.tokens(&pb::TokenSpan { offset: 2 * page as u64, len: 16 }).unwrap();
        assert_eq!(t.all(), [0; 16]);
        let e = t.check().unwrap_err().to_string();
        assert!(e.contains("shrank under the daemon"), "{e}");
        // And every later request of the engine is refused.
        refused(&a, 0, 16, "shrank under the daemon");
    }

    #[test]
    fn areas_that_cannot_be_used_say_why() {
        let dir = tempfile::tempdir().unwrap();
        assert!(area(dir.path(), &[0; 16], 64).unwrap_err().contains("has 16 bytes"));
        let tickets = Tickets::default();
        #[allow(deprecated)]
        let by_path = pb::TokenArea { shm_path: "/etc/shadow".into(), size_bytes: 4, fd_ticket: Vec::new() };
        let e = TokenArea::open(&by_path, &tickets, 0, None).unwrap_err();
        assert!(e.contains("paths are not accepted"), "{e}");
        for size in [0, MAX_BYTES + 1] {
            let r = pb::TokenArea { size_bytes: size, fd_ticket: vec![0; 16], ..Default::default() };
            assert!(TokenArea::open(&r, &tickets, 0, None).unwrap_err().contains("not in 1..="));
        }
        let r = pb::TokenArea { size_bytes: 16, fd_ticket: vec![0; 16], ..Default::default() };
        assert!(TokenArea::open(&r, &tickets, 0, None).unwrap_err().contains("fd ticket"));
    }
}
