//! ATTACH on the daemon's side (proto/kvcached.proto, ATTACH): an engine hands the descriptors of
//! its KV memory and token area over the Unix socket, and gets a ticket for each that its
//! Register redeems. The daemon never opens a file on a client's behalf: what it maps is what the
//! client itself had open, so it cannot be made to read or write anything the client could not.
//!
//! A ticket is bound to the sending process (uid and pid from the socket's peer credentials),
//! redeemable once, for [`attach::TICKET_TTL_MS`]; a uid may hold [`MAX_PER_UID`] at once.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use kvproto::attach::{self, HEADER_BYTES, MAX_FDS, Ticket};
use parking_lot::Mutex;
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::UnixStream;

use crate::error::ServerError;

/// Tickets one uid may hold unredeemed.
pub const MAX_PER_UID: usize = 16;
/// Tickets held unredeemed over every uid.
pub const MAX_TOTAL: usize = 1024;

/// A descriptor handed over and not yet redeemed.
#[derive(Debug)]
struct Pending {
    file: File,
    uid: u32,
    pid: Option<i32>,
    expires: Instant,
}

/// The descriptors engines handed over, by ticket.
#[derive(Debug, Default)]
pub struct Tickets {
    pending: Mutex<HashMap<Ticket, Pending>>,
    /// (device, inode) of the daemon's own files (the G2 pool, G3's data file): a client that can
    /// open one must still not make the daemon map it as KV memory.
    own_files: Vec<(u64, u64)>,
    ids: std::collections::hash_map::RandomState,
    counter: std::sync::atomic::AtomicU64,
}

/// A redeemed descriptor.
#[derive(Debug)]
pub struct Redeemed {
    pub file: File,
    /// Open for writing too (KV memory must be: loads write into it).
    pub writable: bool,
}

impl Tickets {
    /// Tickets refusing the daemon's own files (`paths` that exist; the files directly inside a
    /// directory).
    pub fn new(own: impl IntoIterator<Item = std::path::PathBuf>) -> Self {
        use std::os::unix::fs::MetadataExt;
        let mut own_files = Vec::new();
        for p in own {
            let files: Vec<std::path::PathBuf> = if p.is_dir() {
                std::fs::read_dir(&p).into_iter().flatten().flatten().map(|e| e.path()).collect()
            } else {
                vec![p]
            };
            for f in files {
                if let Some(m) = std::fs::metadata(&f).ok().filter(|m| m.is_file()) {
                    own_files.push((m.dev(), m.ino()));
                }
            }
        }
        Self { own_files, ..Default::default() }
    }

    fn new_ticket(&self) -> Ticket {
        let mut t = [0u8; 16];
        let mut n = self.counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        for half in t.chunks_mut(8) {
            n = std::hash::BuildHasher::hash_one(&self.ids, (n, 0x6b76_6664u64));
            half.copy_from_slice(&n.to_le_bytes());
        }
        t
    }

    /// Grants tickets for `files` handed over by process `pid` of `uid`.
    pub fn grant(&self, files: Vec<File>, uid: u32, pid: Option<i32>) -> Result<Vec<Ticket>, String> {
        use std::os::unix::fs::MetadataExt;
        for (i, f) in files.iter().enumerate() {
            let m = f.metadata().map_err(|e| format!("descriptor {i}: {e}"))?;
            if !m.is_file() {
                return Err(format!("descriptor {i} is not a regular file or memfd"));
            }
            if self.own_files.contains(&(m.dev(), m.ino())) {
                return Err(format!("descriptor {i} is kvcached's own storage: an engine registers its own KV memory"));
            }
        }
        let now = Instant::now();
        let mut g = self.pending.lock();
        g.retain(|_, p| p.expires > now);
        let mine = g.values().filter(|p| p.uid == uid).count();
        if mine + files.len() > MAX_PER_UID || g.len() + files.len() > MAX_TOTAL {
            return Err(format!(
                "uid {uid} holds {mine} unredeemed descriptors (at most {MAX_PER_UID}): register with them first"
            ));
        }
        let expires = now + Duration::from_millis(attach::TICKET_TTL_MS);
        Ok(files
            .into_iter()
            .map(|file| {
                let t = self.new_ticket();
                g.insert(t, Pending { file, uid, pid, expires });
                t
            })
            .collect())
    }

    /// The descriptor `ticket` names, for a Register from process `pid` of `uid` (the process
    /// that handed it over).
    pub fn redeem(&self, ticket: &[u8], uid: u32, pid: Option<i32>) -> Result<Redeemed, ServerError> {
        let unknown = || {
            ServerError::Attach(
                "unknown, expired or already used fd ticket (ATTACH the descriptor again, then register within 30 s \
                 from the same process)"
                    .into(),
            )
        };
        let t: Ticket = ticket.try_into().map_err(|_| unknown())?;
        let mut g = self.pending.lock();
        match g.get(&t) {
            Some(p) if p.uid == uid && (p.pid.is_none() || p.pid == pid) && p.expires > Instant::now() => {}
            _ => return Err(unknown()),
        }
        let p = g.remove(&t).ok_or_else(unknown)?;
        drop(g);
        // SAFETY: F_GETFL on a descriptor we own.
        let flags = unsafe { libc::fcntl(p.file.as_raw_fd(), libc::F_GETFL) };
        Ok(Redeemed { writable: flags >= 0 && flags & libc::O_ACCMODE == libc::O_RDWR, file: p.file })
    }

    /// Drops expired tickets (their descriptors close).
    pub fn expire(&self) {
        let now = Instant::now();
        self.pending.lock().retain(|_, p| p.expires > now);
    }
}

/// Reads an ATTACH request and the descriptors sent with it; `Err` is the reason to answer.
async fn receive(stream: &UnixStream) -> Result<Vec<File>, String> {
    let mut head = [0u8; HEADER_BYTES];
    let mut got = 0usize;
    let mut files: Vec<File> = Vec::new();
    let mut truncated = false;
    while got < HEADER_BYTES {
        stream.readable().await.map_err(|e| e.to_string())?;
        let r = stream.try_io(Interest::READABLE, || {
            // SAFETY: recvmsg into our buffers; the descriptors it returns are taken over below.
            unsafe { recv_with_fds(stream.as_raw_fd(), &mut head[got..]) }
        });
        match r {
            Ok((0, _, _)) => return Err("connection closed before the ATTACH header".into()),
            Ok((n, fds, ctrunc)) => {
                got += n;
                truncated |= ctrunc;
                // SAFETY: each descriptor came from SCM_RIGHTS and belongs to nobody else.
                files.extend(fds.into_iter().map(|fd| File::from(unsafe { OwnedFd::from_raw_fd(fd) })));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e.to_string()),
        }
    }
    let n = attach::parse_request(&head)?;
    if truncated || files.len() != n {
        return Err(format!(
            "ATTACH announced {n} descriptors and {} arrived (send them with the header)",
            files.len()
        ));
    }
    Ok(files)
}

/// recvmsg with room for [`MAX_FDS`] descriptors: (bytes, descriptors, whether some were cut).
///
/// # Safety
/// `fd` is a Unix stream socket. The returned descriptors are the caller's to own.
unsafe fn recv_with_fds(fd: RawFd, buf: &mut [u8]) -> std::io::Result<(usize, Vec<RawFd>, bool)> {
    // SAFETY (whole body): plain recvmsg into stack buffers sized by CMSG_SPACE.
    unsafe {
        let space = libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) as usize;
        let mut cbuf = vec![0u8; space];
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let n = libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT);
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut fds = Vec::new();
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(std::ptr::read_unaligned(data.add(i)));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
        Ok((n as usize, fds, msg.msg_flags & libc::MSG_CTRUNC != 0))
    }
}

/// Serves one ATTACH connection: reads the request and its descriptors, answers with tickets or
/// the reason for refusing, and closes.
pub async fn serve(mut stream: UnixStream, tickets: &Tickets, timeout: Duration) {
    let cred = stream.peer_cred().ok();
    let answer = match tokio::time::timeout(timeout, receive(&stream)).await {
        Err(_) => attach::refused("the ATTACH request did not arrive in time"),
        Ok(Err(why)) => attach::refused(&why),
        Ok(Ok(files)) => match cred {
            None => attach::refused("the daemon cannot tell who is connected (no peer credentials)"),
            Some(c) => match tickets.grant(files, c.uid(), c.pid()) {
                Ok(t) => attach::granted(&t),
                Err(why) => attach::refused(&why),
            },
        },
    };
    let _ = tokio::time::timeout(timeout, stream.write_all(&answer)).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn tickets_are_single_use_bound_to_their_process_and_bounded() {
        let (d, own) = crate::engine::temp_file("pool", &[0u8; 64]);
        let t = Tickets::new([own.clone()]);
        let mine =
            || File::options().read(true).write(true).create(true).truncate(false).open(d.path().join("kv")).unwrap();
        let e = t.grant(vec![File::open(&own).unwrap()], 1000, Some(7)).unwrap_err();
        assert!(e.contains("kvcached's own storage"), "{e}");
        assert!(
            t.grant(vec![File::open(d.path()).unwrap()], 1000, Some(7)).unwrap_err().contains("not a regular file")
        );
        let ticket = t.grant(vec![mine()], 1000, Some(7)).unwrap()[0];
        assert!(t.redeem(&ticket, 1001, Some(7)).is_err(), "another uid");
        assert!(t.redeem(&ticket, 1000, Some(8)).is_err(), "another process");
        let r = t.redeem(&ticket, 1000, Some(7)).unwrap();
        assert!(r.writable);
        assert!(t.redeem(&ticket, 1000, Some(7)).is_err(), "used once");
        assert!(t.redeem(b"short", 1000, Some(7)).is_err());
        let ro = File::open(d.path().join("kv")).unwrap();
        let ticket = t.grant(vec![ro], 1000, Some(7)).unwrap()[0];
        assert!(!t.redeem(&ticket, 1000, Some(7)).unwrap().writable);
        let many: Vec<File> = (0..MAX_PER_UID).map(|_| mine()).collect();
        t.grant(many, 1000, Some(7)).unwrap();
        assert!(t.grant(vec![mine()], 1000, Some(7)).unwrap_err().contains("unredeemed"));
        assert!(t.grant(vec![mine()], 1001, Some(9)).is_ok(), "another uid is not held back");
    }
}
