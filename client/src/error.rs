//! The client's one error enum.

/// What a client call can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The daemon could not be reached (after retrying with backoff).
    #[error("cannot reach kvcached at {socket}: {reason}")]
    Unreachable { socket: String, reason: String },
    /// The daemon answered with an error (bad request, unknown engine, ...).
    #[error("kvcached refused the call: {0}")]
    Rpc(#[from] tonic::Status),
    /// A call that needs a registered engine came before `register`.
    #[error("no engine registered on this client: call register first")]
    NotRegistered,
    /// A load finished with an error on the daemon.
    #[error("load {op} failed: {error}")]
    LoadFailed { op: u64, error: String },
    /// Handing the KV memory's or token area's descriptors to the daemon (ATTACH) failed.
    #[error("attach: {0}")]
    Attach(String),
    /// A local problem: the KV memory file, the runtime.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl ClientError {
    /// The daemon's machine-readable reason for refusing the call, when it gave one.
    pub fn reason(&self) -> Option<kvproto::reason::Reason> {
        match self {
            ClientError::Rpc(s) => reason_of(s),
            _ => None,
        }
    }
}

/// The reason a status carries (`kvproto::reason`).
pub fn reason_of(s: &tonic::Status) -> Option<kvproto::reason::Reason> {
    s.metadata()
        .get(kvproto::reason::METADATA_KEY)
        .and_then(|v| v.to_str().ok())
        .and_then(kvproto::reason::Reason::from_name)
}
