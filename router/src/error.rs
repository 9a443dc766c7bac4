//! The one error enum of `kvrouter`.

/// Everything that can go wrong in the router.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouterError {
    /// A request or event is malformed (bad JSON field, unknown namespace, invalid holder/tier).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The caller's identity may not do this (a namespace it has no grant of).
    #[error("{0}")]
    Forbidden(String),
    /// No worker can take the request (none registered, none alive, or none in the candidate set).
    #[error("no worker available: {0}")]
    NoWorker(String),
    /// The configuration is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A publisher's recovery API failed (replay or snapshot).
    #[error("recovery from publisher {publisher} failed: {reason}")]
    Recovery { publisher: String, reason: String },
    /// A ZMQ socket failed.
    #[error("zmq: {0}")]
    Zmq(String),
    /// A vLLM event batch could not be decoded.
    #[error("vLLM event decode: {0}")]
    Decode(String),
    /// Socket or file I/O.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// An HTTP client call failed.
    #[error("http: {0}")]
    Http(String),
}

impl From<kvproto::ProtoError> for RouterError {
    fn from(e: kvproto::ProtoError) -> Self {
        match e {
            kvproto::ProtoError::Decode(why) => Self::Decode(why),
            e => Self::Invalid(e.to_string()),
        }
    }
}

impl From<kvrouter_core::CoreError> for RouterError {
    fn from(e: kvrouter_core::CoreError) -> Self {
        match e {
            kvrouter_core::CoreError::Config(why) => Self::Config(why),
            kvrouter_core::CoreError::Invalid(why) => Self::Invalid(why),
            e => Self::Invalid(e.to_string()),
        }
    }
}
