//! The one error enum of `kvrouter-core`.

/// What the router's core refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CoreError {
    /// A value in a request or a namespace spec is malformed (bad hex, unknown key scheme).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The configuration is unusable; the message names the field.
    #[error("invalid configuration: {0}")]
    Config(String),
}

impl From<kvproto::ProtoError> for CoreError {
    fn from(e: kvproto::ProtoError) -> Self {
        Self::Invalid(e.to_string())
    }
}
