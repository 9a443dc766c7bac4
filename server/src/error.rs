//! The daemon's error enum, mapped to `tonic::Status` only at the gRPC edge.

use kvproto::ProtoError;
use kvtiers::TierError;

/// Everything a request or the daemon's start can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// A request field is wrong; the message says which and why.
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error(transparent)]
    Proto(#[from] ProtoError),
    /// The engine id is unknown (never registered, unregistered, or its lease expired).
    #[error("engine {0} is not registered (re-register after a daemon restart or a missed heartbeat)")]
    UnknownEngine(u64),
    #[error("load operation {0} is unknown or expired")]
    UnknownOp(u64),
    /// A limit was reached (engines, pending operations).
    #[error("resource exhausted: {0}")]
    Exhausted(String),
    #[error(transparent)]
    Tier(#[from] TierError),
    /// The caller's tenant may not do this in this namespace (the trust model,
    /// docs/operations/security-clients.md): another tenant's salt, a namespace it may not read or
    /// write.
    #[error("permission denied: {0}")]
    Denied(String),
    /// Engine memory could not be attached.
    #[error("cannot attach engine memory: {0}")]
    Attach(String),
    #[error("configuration: {field}: {reason}")]
    Config { field: String, reason: String },
    /// A ZMQ socket (the vLLM-format export) failed.
    #[error("zmq: {0}")]
    Zmq(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

impl From<ServerError> for tonic::Status {
    fn from(e: ServerError) -> Self {
        use kvproto::reason::{METADATA_KEY, Reason};
        let reason = match &e {
            ServerError::UnknownEngine(_) => Some(Reason::UnknownEngine),
            ServerError::UnknownOp(_) => Some(Reason::UnknownOp),
            ServerError::Exhausted(_) => Some(Reason::LimitReached),
            ServerError::Denied(_) => Some(Reason::NotTrusted),
            _ => None,
        };
        let mut status = status_of(e);
        if let Some(v) = reason.and_then(|r| r.name().parse().ok()) {
            status.metadata_mut().insert(METADATA_KEY, v);
        }
        status
    }
}

fn status_of(e: ServerError) -> tonic::Status {
    {
        let msg = e.to_string();
        match e {
            ServerError::Invalid(_) | ServerError::Proto(_) => tonic::Status::invalid_argument(msg),
            ServerError::UnknownEngine(_) | ServerError::UnknownOp(_) => tonic::Status::not_found(msg),
            ServerError::Exhausted(_) => tonic::Status::resource_exhausted(msg),
            ServerError::Attach(_) => tonic::Status::failed_precondition(msg),
            ServerError::Denied(_) => tonic::Status::permission_denied(msg),
            ServerError::Tier(TierError::Full { .. }) => tonic::Status::resource_exhausted(msg),
            ServerError::Tier(TierError::LengthMismatch { .. }) => tonic::Status::invalid_argument(msg),
            ServerError::Tier(_) | ServerError::Config { .. } | ServerError::Io(_) | ServerError::Zmq(_) => {
                tonic::Status::internal(msg)
            }
        }
    }
}
