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
        let off = self.slot();
        self.io(buf.as_ptr() as *mut u8, off, true)
    }

    /// Reads the next slot into `buf`.
    pub fn read_next(&mut self, buf: &mut BlockBuf) -> io::Result<()> {
        let off = self.slot();
        self.io(buf.as_mut_ptr(), off, false)
    }

    /// Reads the next `bufs.len()` slots into `bufs` with every read in flight at once through
    /// `ring` (io_uring, as the tier's batched reads): the device's limit at that queue depth.
    pub fn read_batch(&mut self, ring: &mut io_uring::IoUring, bufs: &mut [BlockBuf]) -> io::Result<()> {
        use io_uring::{opcode, types};
        let len = u32::try_from(self.block).map_err(|_| io::Error::other("block over 4 GiB"))?;
        if bufs.len() > ring.params().sq_entries() as usize {
            return Err(io::Error::other("io_uring submission queue smaller than the batch"));
        }
        for (i, buf) in bufs.iter_mut().enumerate() {
            let off = self.slot();
            let sqe = opcode::Read::new(types::Fd(self.file.as_raw_fd()), buf.as_mut_ptr(), len)
                .offset(off)
                .build()
                .user_data(i as u64);
            // SAFETY: `buf` outlives the read: this function reaps every completion before it
            // returns. The queue has room (checked above, and it is empty between calls).
            unsafe { ring.submission().push(&sqe) }.map_err(|_| io::Error::other("io_uring submission queue full"))?;
        }
        self.reap(ring, bufs.len(), "read")
    }

    /// Writes `bufs` to the next `bufs.len()` slots with every write in flight at once through
    /// `ring`: the limit of a batched G3 write at that queue depth.
    pub fn write_batch(&mut self, ring: &mut io_uring::IoUring, bufs: &[BlockBuf]) -> io::Result<()> {
        use io_uring::{opcode, types};
        let len = u32::try_from(self.block).map_err(|_| io::Error::other("block over 4 GiB"))?;
        if bufs.len() > ring.params().sq_entries() as usize {
            return Err(io::Error::other("io_uring submission queue smaller than the batch"));
        }
        for (i, buf) in bufs.iter().enumerate() {
            let off = self.slot();
            let sqe = opcode::Write::new(types::Fd(self.file.as_raw_fd()), buf.as_ptr(), len)
                .offset(off)
                .build()
                .user_data(i as u64);
            // SAFETY: `buf` outlives the write: this function reaps every completion before it
            // returns. The queue has room (checked above, and it is empty between calls).
            unsafe { ring.submission().push(&sqe) }.map_err(|_| io::Error::other("io_uring submission queue full"))?;
        }
        self.reap(ring, bufs.len(), "write")
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

    fn io(&self, p: *mut u8, off: u64, write: bool) -> io::Result<()> {
        let mut done = 0usize;
        while done < self.block {
            // SAFETY: `p` points to at least `block` bytes owned by the caller's BlockBuf.
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
