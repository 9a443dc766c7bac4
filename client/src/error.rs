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
    /// A local problem: the KV memory file, the runtime.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}
