//! The crate's error enum.

use std::path::PathBuf;

/// What went wrong setting up or running an authenticated endpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NetError {
    /// A certificate, key or token file that cannot be read or parsed.
    #[error("{what} {path}: {why}")]
    File { what: &'static str, path: PathBuf, why: String },
    /// A configuration that cannot work (a key without a certificate, an open endpoint on the
    /// network nobody said may be open).
    #[error("{0}")]
    Config(String),
    /// TLS refused the connection (handshake failure, a certificate not trusted or expired).
    #[error("TLS: {0}")]
    Tls(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// An HTTP call failed: no connection, a timeout, a status other than success, a body that
    /// does not parse. The message names the URL.
    #[error("{0}")]
    Http(String),
    /// The NATS event plane refused or failed a request (no connection, no stream, no ack).
    #[error("{0}")]
    Bus(String),
}
