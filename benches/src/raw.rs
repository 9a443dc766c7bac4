//! Physical-limit baselines measured beside the tiers: raw O_DIRECT file I/O.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use kvtiers::BlockBuf;

/// A preallocated file opened with O_DIRECT, read and written in `block`-sized slots.
#[derive(Debug)]
pub struct RawDirectFile {
    file: File,
    slots: u64,
    block: usize,
    next: u64,
}

impl RawDirectFile {
    /// Creates `path` with `slots` slots of `block` bytes (a multiple of 4096).
    pub fn create(path: &Path, block: usize, slots: u64) -> io::Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)?;
        // SAFETY: plain syscall on an owned fd.
        let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, (block as u64 * slots) as libc::off_t) };
        if r != 0 {
            return Err(io::Error::from_raw_os_error(r));
        }
        Ok(Self { file, slots, block, next: 0 })
    }

    fn slot(&mut self) -> u64 {
        let s = self.next % self.slots;
        self.next += 1;
        s * self.block as u64
    }

    /// Writes `buf` (aligned, `block` bytes) to the next slot.
    pub fn write_next(&mut self, buf: &BlockBuf) -> io::Result<()> {
        self.fits(buf)?;
        let off = self.slot();
        // SAFETY: `buf` holds at least `block` bytes (checked), only read by a write.
        unsafe { self.io(buf.as_ptr().cast_mut(), off, true) }
    }

    /// Reads the next slot into `buf`.
    pub fn read_next(&mut self, buf: &mut BlockBuf) -> io::Result<()> {
        self.fits(buf)?;
        let off = self.slot();
        // SAFETY: `buf` holds at least `block` bytes (checked), borrowed mutably here.
        unsafe { self.io(buf.as_mut_ptr(), off, false) }
    }

    /// Refuses a buffer shorter than a block (the I/O would run past it).
    fn fits(&self, buf: &BlockBuf) -> io::Result<()> {
        match buf.len() >= self.block {
            true => Ok(()),
            false => Err(io::Error::other(format!("buffer of {} bytes for blocks of {}", buf.len(), self.block))),
        }
    }

    /// Reads the next `bufs.len()` slots into `bufs` with every read in flight at once through
    /// `ring` (io_uring, as the tier's batched reads): the device's limit at that queue depth.
    pub fn read_batch(&mut self, ring: &mut io_uring::IoUring, bufs: &mut [BlockBuf]) -> io::Result<()> {
        bufs.iter().try_for_each(|b| self.fits(b))?;
        // SAFETY: every buffer holds at least `block` bytes (checked) and is borrowed mutably
        // for the whole call.
        unsafe { self.batch(ring, bufs.iter_mut().map(|b| b.as_mut_ptr()), false) }
    }

    /// Writes `bufs` to the next `bufs.len()` slots with every write in flight at once through
    /// `ring`: the limit of a batched G3 write at that queue depth.
    pub fn write_batch(&mut self, ring: &mut io_uring::IoUring, bufs: &[BlockBuf]) -> io::Result<()> {
        bufs.iter().try_for_each(|b| self.fits(b))?;
        // SAFETY: every buffer holds at least `block` bytes (checked) and is borrowed for the
        // whole call; a write only reads it.
        unsafe { self.batch(ring, bufs.iter().map(|b| b.as_ptr().cast_mut()), true) }
    }

    /// One read (or write) of `block` bytes at `bufs` per buffer, each to the next slot, all in
    /// flight at once through `ring`.
    ///
    /// # Safety
    /// Each pointer is valid for `block` bytes (writable for a read) until this returns.
    unsafe fn batch(
        &mut self,
        ring: &mut io_uring::IoUring,
        bufs: impl ExactSizeIterator<Item = *mut u8>,
        write: bool,
    ) -> io::Result<()> {
        use io_uring::{opcode, types};
        let len = u32::try_from(self.block).map_err(|_| io::Error::other("block over 4 GiB"))?;
        let n = bufs.len();
        if n > ring.params().sq_entries() as usize {
            return Err(io::Error::other("io_uring submission queue smaller than the batch"));
        }
        let fd = types::Fd(self.file.as_raw_fd());
        for (i, buf) in bufs.enumerate() {
            let off = self.slot();
            let sqe = if write {
                opcode::Write::new(fd, buf, len).offset(off).build()
            } else {
                opcode::Read::new(fd, buf, len).offset(off).build()
            };
            // SAFETY: `buf` outlives the I/O: this function reaps every completion before it
            // returns (the caller's contract). The queue has room (checked above, and it is
            // empty between calls).
            unsafe { ring.submission().push(&sqe.user_data(i as u64)) }
                .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        }
        self.reap(ring, n, if write { "write" } else { "read" })
    }

    fn reap(&self, ring: &mut io_uring::IoUring, n: usize, what: &str) -> io::Result<()> {
        let (mut left, mut short) = (n, None);
        while left > 0 {
            ring.submit_and_wait(1)?;
            for cqe in ring.completion() {
                left -= 1;
                if usize::try_from(cqe.result()).ok() != Some(self.block) {
                    short = Some(cqe.result());
                }
            }
        }
        match short {
            Some(r) => Err(io::Error::other(format!("raw batched {what} returned {r}"))),
            None => Ok(()),
        }
    }

    /// One block's pread or pwrite at `off`, to or from `p`.
    ///
    /// # Safety
    /// `p` must be valid for `block` bytes: readable for a write, writable for a read.
    unsafe fn io(&self, p: *mut u8, off: u64, write: bool) -> io::Result<()> {
        let mut done = 0usize;
        while done < self.block {
            // SAFETY: `p` points to at least `block` bytes (the caller's contract).
            let r = unsafe {
                let at = p.add(done).cast();
                let o = (off + done as u64) as libc::off_t;
                if write {
                    libc::pwrite(self.file.as_raw_fd(), at, self.block - done, o)
                } else {
                    libc::pread(self.file.as_raw_fd(), at, self.block - done, o)
                }
            };
            if r <= 0 {
                return Err(io::Error::last_os_error());
            }
            done += r as usize;
        }
        Ok(())
    }
}
