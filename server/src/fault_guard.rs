//! Engine memory that shrinks under the daemon: a SIGBUS guard.
//!
//! The daemon maps each CPU engine's KV memory file and copies to and from it. If the engine (a
//! bug, or a hostile client) truncates the file, the next access to a page past its new end
//! raises SIGBUS, which would kill the daemon and every engine's service with it. Instead, the
//! daemon watches the address range of every engine mapping: a SIGBUS inside one is answered by
//! mapping anonymous memory over the rest of that range (the faulting copy then completes on
//! zeros) and marking the range faulted; the request whose copy faulted, and every later one of
//! that engine, fails with an error that says what happened, and nothing it copied is kept. This
//! is how Wayland compositors survive clients that shrink their shared-memory pools.
//!
//! A SIGBUS outside every watched range is not ours: the handler puts back the previous
//! disposition and returns, so the access faults again and the process dies as it would have.

use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Ranges watched at once; `engines.max_engines` is capped to this.
pub const MAX_WATCHED: usize = 1024;

struct Watched {
    /// `[start, end)`; `end == 0`: a free entry.
    start: AtomicUsize,
    end: AtomicUsize,
    faulted: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Watched = Watched { start: AtomicUsize::new(0), end: AtomicUsize::new(0), faulted: AtomicBool::new(false) };
static WATCHED: [Watched; MAX_WATCHED] = [FREE; MAX_WATCHED];
/// Serialises the claiming of entries (the handler only reads).
static CLAIM: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

static INSTALL: Once = Once::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// The disposition before ours, put back for a SIGBUS that is not ours.
static mut PREVIOUS: std::mem::MaybeUninit<libc::sigaction> = std::mem::MaybeUninit::uninit();

fn page_size() -> usize {
    // SAFETY: plain syscall.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    for w in &WATCHED {
        let (start, end) = (w.start.load(Ordering::Acquire), w.end.load(Ordering::Acquire));
        if end == 0 || addr < start || addr >= end {
            continue;
        }
        let from = addr & !(page_size() - 1);
        // SAFETY: `[from, end)` lies inside a mapping this process made and still holds (an
        // entry is freed before its mapping is unmapped); replacing it with anonymous pages is
        // what the engine memory's readers and writers expect after a fault (see the module
        // documentation). mmap is a plain system call, safe to make from a signal handler.
        let p = unsafe {
            libc::mmap(
                from as *mut libc::c_void,
                end - from,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            w.faulted.store(true, Ordering::Release);
            return;
        }
    }
    // Not ours (or the remap failed): the previous disposition handles the repeated fault.
    // SAFETY: PREVIOUS was written before this handler was installed.
    unsafe { libc::sigaction(libc::SIGBUS, std::ptr::addr_of!(PREVIOUS).cast(), std::ptr::null_mut()) };
}

fn install() -> bool {
    INSTALL.call_once(|| {
        // SAFETY: sigaction with a zeroed, then filled, struct; PREVIOUS is written once, here,
        // before the handler that reads it can run.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigbus as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut sa.sa_mask);
            let previous = std::ptr::addr_of_mut!(PREVIOUS).cast::<libc::sigaction>();
            if libc::sigaction(libc::SIGBUS, &sa, previous) == 0 {
                INSTALLED.store(true, Ordering::Release);
            }
        }
    });
    INSTALLED.load(Ordering::Acquire)
}

/// A watched range; dropping it stops the watch (drop it before unmapping the range).
#[derive(Debug)]
pub struct FaultGuard {
    index: usize,
}

impl FaultGuard {
    /// Watches `[start, start + len)`; an error when the handler cannot be installed or every
    /// entry is taken.
    pub fn watch(start: usize, len: usize) -> Result<Self, String> {
        if !install() {
            return Err(format!("cannot install the SIGBUS handler: {}", std::io::Error::last_os_error()));
        }
        let _claim = CLAIM.lock();
        let index = WATCHED
            .iter()
            .position(|w| w.end.load(Ordering::Acquire) == 0)
            .ok_or_else(|| format!("more than {MAX_WATCHED} engine memory mappings"))?;
        let w = &WATCHED[index];
        w.faulted.store(false, Ordering::Release);
        w.start.store(start, Ordering::Release);
        w.end.store(start.saturating_add(len), Ordering::Release);
        Ok(Self { index })
    }

    /// Whether an access to the range has faulted (sticky: the range is anonymous memory now).
    pub fn faulted(&self) -> bool {
        WATCHED[self.index].faulted.load(Ordering::Acquire)
    }
}

impl Drop for FaultGuard {
    fn drop(&mut self) {
        let _claim = CLAIM.lock();
        let w = &WATCHED[self.index];
        w.end.store(0, Ordering::Release);
        w.start.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_truncated_file_mapping_reads_zeros_and_is_marked_faulted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kv");
        let page = page_size();
        std::fs::write(&path, vec![7u8; 4 * page]).unwrap();
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        let map = memmap2::MmapOptions::new().len(4 * page).map_raw(&file).unwrap();
        let guard = FaultGuard::watch(map.as_ptr() as usize, 4 * page).unwrap();
        // SAFETY: inside the mapping.
        let read = |at: usize| unsafe { std::ptr::read_volatile(map.as_ptr().add(at)) };
        assert_eq!(read(3 * page), 7);
        assert!(!guard.faulted());
        file.set_len(page as u64).unwrap();
        assert_eq!(read(0), 7, "the part that is left is still the file");
        assert_eq!(read(2 * page + 5), 0, "past the new end: zeros, not SIGBUS");
        assert!(guard.faulted());
        // SAFETY: inside the mapping (now anonymous past the first page).
        unsafe { std::ptr::write_volatile(map.as_mut_ptr().add(3 * page), 1) };
        assert_eq!(read(3 * page), 1);
        drop(guard);
        let again = FaultGuard::watch(1, 1).unwrap();
        assert!(!again.faulted(), "a reused entry starts clean");
    }
}
