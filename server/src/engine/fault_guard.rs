//! Engine memory that shrinks under the daemon: a SIGBUS guard.
//!
//! The daemon maps each CPU engine's KV memory file and copies to and from it, and maps each
//! engine's token area and copies prompts out of it. If the engine (a
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

/// Ranges watched at once.
pub const MAX_WATCHED: usize = 2048;
/// Engines attached at once at most (`engines.max_engines`): each maps its KV memory and its
/// token area.
pub const MAX_ENGINES: usize = MAX_WATCHED / 2;

struct Watched {
    /// Even while the entry is stable, odd while it is being written (a sequence lock: the
    /// handler, which may run in the middle of an update, uses an entry only if it read the
    /// same even generation before and after reading the range).
    generation: AtomicUsize,
    /// `[start, end)`; `end == 0`: a free entry.
    start: AtomicUsize,
    end: AtomicUsize,
    faulted: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Watched = Watched {
    generation: AtomicUsize::new(0),
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    faulted: AtomicBool::new(false),
};
static WATCHED: [Watched; MAX_WATCHED] = [FREE; MAX_WATCHED];
/// Serialises the writers of entries (the handler only reads).
static CLAIM: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

static INSTALL: Once = Once::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// The page size, read before the handler is installed (sysconf is not async-signal-safe).
static PAGE: AtomicUsize = AtomicUsize::new(4096);
/// The disposition before ours, put back for a SIGBUS that is not ours.
static mut PREVIOUS: std::mem::MaybeUninit<libc::sigaction> = std::mem::MaybeUninit::uninit();

fn page_size() -> usize {
    // SAFETY: plain syscall.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

impl Watched {
    /// The range, if the entry is in use and was not being written while it was read.
    fn range(&self) -> Option<(usize, usize)> {
        let g = self.generation.load(Ordering::Acquire);
        let (start, end) = (self.start.load(Ordering::Acquire), self.end.load(Ordering::Acquire));
        std::sync::atomic::fence(Ordering::Acquire);
        (g.is_multiple_of(2) && self.generation.load(Ordering::Relaxed) == g && end != 0).then_some((start, end))
    }

    fn write(&self, start: usize, end: usize) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.start.store(start, Ordering::Release);
        self.end.store(end, Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }
}

/// Maps anonymous pages over `[from, end)`; false if the kernel refused.
fn replace(from: usize, end: usize) -> bool {
    // SAFETY: the caller passes a range inside a live engine mapping (see `on_sigbus`); the
    // mapping's readers and writers expect it to turn into anonymous pages after a fault.
    // mmap is a plain system call, safe to make from a signal handler.
    let p = unsafe {
        libc::mmap(
            from as *mut libc::c_void,
            end - from,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    p != libc::MAP_FAILED
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    // Only a fault the kernel raised has an address; a SIGBUS sent with kill() gets the
    // default action, as it would without this handler.
    if code > 0 {
        for w in &WATCHED {
            let Some((start, end)) = w.range() else { continue };
            if addr < start || addr >= end {
                continue;
            }
            // Marked before the pages are replaced: a copy on another thread that reads the
            // new zero pages without faulting must see the mark when it checks after copying.
            w.faulted.store(true, Ordering::SeqCst);
            // The engine's pages are 4 KiB, or huge pages (a huge mapping cannot be split).
            for align in [PAGE.load(Ordering::Relaxed), 2 << 20, 1 << 30] {
                let from = (addr & !(align - 1)).max(start);
                if replace(from, end) {
                    return;
                }
            }
        }
    }
    // Not ours (or the replacement failed): the previous disposition handles the fault, which
    // repeats when this returns; a sent signal is raised again with the default action.
    // SAFETY: PREVIOUS was written before this handler was installed; sigaction and raise are
    // async-signal-safe.
    unsafe {
        if code > 0 {
            libc::sigaction(libc::SIGBUS, std::ptr::addr_of!(PREVIOUS).cast(), std::ptr::null_mut());
        } else {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
            libc::raise(libc::SIGBUS);
        }
    }
}

fn install() -> bool {
    INSTALL.call_once(|| {
        PAGE.store(page_size(), Ordering::Relaxed);
        // SAFETY: sigaction with a zeroed, then filled, struct. PREVIOUS is read out before
        // the handler that uses it is installed.
        unsafe {
            let previous = std::ptr::addr_of_mut!(PREVIOUS).cast::<libc::sigaction>();
            if libc::sigaction(libc::SIGBUS, std::ptr::null(), previous) != 0 {
                return;
            }
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigbus as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) == 0 {
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
            .ok_or_else(|| format!("more than {MAX_WATCHED} engine mappings"))?;
        let w = &WATCHED[index];
        w.faulted.store(false, Ordering::Release);
        w.write(start, start.saturating_add(len).max(1));
        Ok(Self { index })
    }

    /// Whether an access to the range has faulted (sticky: the range is anonymous memory now).
    /// Call it after a copy to know whether the copy saw the file: the fence keeps the check
    /// from being ordered before the copy's own accesses.
    pub fn faulted(&self) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        WATCHED[self.index].faulted.load(Ordering::SeqCst)
    }
}

impl Drop for FaultGuard {
    fn drop(&mut self) {
        let _claim = CLAIM.lock();
        WATCHED[self.index].write(0, 0);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_truncated_file_mapping_reads_zeros_and_is_marked_faulted() {
        let page = page_size();
        let (_dir, path) = crate::engine::temp_file("kv", &vec![7u8; 4 * page]);
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
