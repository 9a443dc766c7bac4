//! The client's token area: a shared-memory file the engine writes a long prompt's token ids
//! into before a lookup, which then carries only their span (proto/kvcached.proto, TOKENS; the
//! daemon's side is server/src/token_area.rs). A 128k-token lookup saves ~0.3 ms here: the
//! 512 KiB of tokens no longer pass through HTTP/2 frames, encoders and decoders on both sides.
//!
//! The area is cut into [`SLOTS`] equal slots so that concurrent requests of one client do not
//! wait for each other: a request takes a free slot (an atomic bit), and a prompt that finds
//! none free, or is longer than a slot, goes inline as before. A request that is cancelled (its
//! future dropped) frees its slot at once, while the daemon may still be reading it: that
//! request's answer, which nobody waits for, may then be for a prompt torn by the next one.
//!
//! The file is removed when the client is dropped. A client process that dies leaves it behind;
//! the next area created on the node removes the areas of processes that no longer exist
//! (`kvcached-tokens-<pid>-<time>-<n>`).

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
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
    path: PathBuf,
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
    /// Creates an area of `bytes` (rounded down to whole 4-byte slots) in `dir`, readable by the
    /// daemon as the engine's KV memory is (mode 0660).
    pub fn create(dir: &Path, bytes: usize) -> std::io::Result<Self> {
        let slot_bytes = bytes / SLOTS / 4 * 4;
        if slot_bytes == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "token area too small"));
        }
        remove_stale(dir);
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let nonce =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{PREFIX}{}-{nonce:x}-{n}", std::process::id()));
        let file = OpenOptions::new().read(true).write(true).create_new(true).mode(0o660).open(&path)?;
        let created = (|| {
            file.set_len((slot_bytes * SLOTS) as u64)?;
            MmapOptions::new().len(slot_bytes * SLOTS).map_raw(&file)
        })();
        match created {
            Ok(map) => Ok(Self { path, map, slot_bytes, used: AtomicU32::new(0) }),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// The registration's description of the area.
    pub fn request(&self) -> pb::TokenArea {
        pb::TokenArea {
            shm_path: self.path.to_string_lossy().into_owned(),
            size_bytes: (self.slot_bytes * SLOTS) as u64,
        }
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

impl Drop for TokenArea {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// File names: `kvcached-tokens-<pid>-<time>-<n>`.
const PREFIX: &str = "kvcached-tokens-";

/// Removes the areas in `dir` of processes that no longer exist (best effort: a pid that has
/// been reused keeps its file until that process is gone too).
fn remove_stale(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)).and_then(|r| r.split('-').next()) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if pid != std::process::id() && !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Where areas go: `/dev/shm` where it exists (memory, like the KV regions), else the
/// temporary directory.
pub fn default_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() }
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
        let dir = tempfile::tempdir().unwrap();
        let area = Arc::new(TokenArea::create(dir.path(), 1 << 20).unwrap());
        let path = PathBuf::from(area.request().shm_path);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 1 << 20);
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
        drop(area);
        assert!(!path.exists(), "the file goes with the area");
    }

    #[test]
    fn a_new_area_removes_those_of_dead_processes() {
        let dir = tempfile::tempdir().unwrap();
        // A pid above the kernel's limit (pid_max is at most 2^22) never belongs to a live
        // process; this process's own areas and unrelated files stay.
        let dead = dir.path().join(format!("{PREFIX}{}-1f-0", 1u32 << 23));
        let unrelated = dir.path().join("kvcached-tokens-notapid");
        std::fs::write(&dead, b"x").unwrap();
        std::fs::write(&unrelated, b"x").unwrap();
        let first = TokenArea::create(dir.path(), 1 << 20).unwrap();
        let second = TokenArea::create(dir.path(), 1 << 20).unwrap();
        assert!(!dead.exists());
        assert!(unrelated.exists());
        assert_ne!(first.request().shm_path, second.request().shm_path, "two areas of one process at once");
        assert!(Path::new(&first.request().shm_path).exists());
    }
}
