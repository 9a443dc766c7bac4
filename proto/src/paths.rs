//! Where the daemon's Unix socket is by default: the one path an engine and the daemon must
//! agree on without configuration (docs/configuration.md, `socket`).

use std::path::PathBuf;

/// The daemon's default socket: `$XDG_RUNTIME_DIR/kvcached/kvcached.sock`, else
/// `<temp dir>/kvcached-<uid>/kvcached.sock`.
pub fn default_socket() -> PathBuf {
    runtime_dir().join("kvcached.sock")
}

/// The directory of the default socket.
pub fn runtime_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR") {
        return PathBuf::from(d).join("kvcached");
    }
    // SAFETY: getuid never fails.
    let uid = unsafe { libc::getuid() };
    std::env::temp_dir().join(format!("kvcached-{uid}"))
}
