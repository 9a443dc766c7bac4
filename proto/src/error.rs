//! The one error enum of `kvproto`.

/// Errors from validating namespaces, layouts and keys.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// A layout field is out of range (zero, or the block size overflows).
    #[error("invalid KV layout: {field} {reason}")]
    InvalidLayout { field: &'static str, reason: String },
    /// A namespace field is malformed.
    #[error("invalid namespace: {field} {reason}")]
    InvalidNamespace { field: &'static str, reason: String },
    /// A request's key context breaks a bound of `docs/block-keys.md` section 6.
    #[error("invalid key context: {field} {reason}")]
    InvalidContext { field: &'static str, reason: String },
    /// A string does not parse as a block key (32 hex digits).
    #[error("invalid block key {0:?}: expected 32 hex digits")]
    InvalidKey(String),
    /// An unknown dtype or layout-kind name or code.
    #[error("unknown {what} {value:?}")]
    Unknown { what: &'static str, value: String },
    /// Token ids given as little-endian bytes whose length is not a multiple of 4.
    #[error("tokens are {0} bytes, not a whole number of 4-byte little-endian u32 token ids")]
    TokenBytes(usize),
    /// A vLLM KV-event batch (msgpack) could not be decoded.
    #[error("vLLM event decode: {0}")]
    Decode(String),
}
