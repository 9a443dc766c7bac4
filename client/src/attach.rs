//! The client's side of ATTACH (proto/kvcached.proto): hands the daemon the descriptors of the
//! engine's KV memory and token area over its Unix socket and gets a ticket for each, which the
//! registration then names. The daemon maps what the engine itself has open; it never opens a
//! path for it.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use kvproto::attach::{self, HEADER_BYTES, MAX_FDS, TICKET_BYTES, Ticket};

use crate::error::ClientError;

/// Hands `files` to the daemon at `socket`; returns their tickets in order. Blocking (a local
/// socket: a few tens of microseconds).
pub fn attach(socket: &Path, files: &[&File]) -> Result<Vec<Ticket>, ClientError> {
    let err = |why: String| ClientError::Attach(why);
    if files.is_empty() || files.len() > MAX_FDS {
        return Err(err(format!("ATTACH carries 1 to {MAX_FDS} descriptors, not {}", files.len())));
    }
    let mut stream = UnixStream::connect(socket)
        .map_err(|e| ClientError::Unreachable { socket: socket.display().to_string(), reason: e.to_string() })?;
    let timeout = Some(Duration::from_secs(5));
    stream
        .set_read_timeout(timeout)
        .and_then(|()| stream.set_write_timeout(timeout))
        .map_err(|e| err(e.to_string()))?;
    send_with_fds(&stream, &attach::request(files.len()), files)
        .map_err(|e| err(format!("sending descriptors: {e}")))?;
    let mut head = [0u8; HEADER_BYTES];
    stream.read_exact(&mut head).map_err(|e| err(format!("reading the daemon's answer: {e}")))?;
    match attach::parse_reply(&head).map_err(err)? {
        Ok(()) => {
            let mut tickets = vec![[0u8; TICKET_BYTES]; files.len()];
            for t in &mut tickets {
                stream.read_exact(t).map_err(|e| err(format!("reading tickets: {e}")))?;
            }
            Ok(tickets)
        }
        Err(len) => {
            let mut why = vec![0u8; len];
            stream.read_exact(&mut why).map_err(|e| err(e.to_string()))?;
            Err(err(format!("the daemon refused the descriptors: {}", String::from_utf8_lossy(&why))))
        }
    }
}

/// One sendmsg of `bytes` with `files` as SCM_RIGHTS.
fn send_with_fds(stream: &UnixStream, bytes: &[u8], files: &[&File]) -> std::io::Result<()> {
    let fds: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
    let payload = std::mem::size_of_val(fds.as_slice());
    // SAFETY: sendmsg from our buffers; the control buffer is CMSG_SPACE bytes for the
    // descriptors, written through the CMSG macros.
    let sent = unsafe {
        let space = libc::CMSG_SPACE(payload as u32) as usize;
        let mut cbuf = vec![0u8; space];
        let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut _, iov_len: bytes.len() };
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(payload as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast::<i32>(), fds.len());
        libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if (sent as usize) < bytes.len() {
        // The descriptors went with the first byte; the rest of the header follows plainly.
        (&*stream).write_all(&bytes[sent as usize..])?;
    }
    Ok(())
}
