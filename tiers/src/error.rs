//! The one error enum of `kvtiers`.

use kvproto::TierKind;

/// Errors from the tiers and the block store. A miss is not an error (`Ok(None)`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TierError {
    /// The tier cannot make room: every block is pinned, in use, or the block is larger than
    /// the tier.
    #[error("{tier} is full: need {needed} bytes, {free} free and nothing evictable")]
    Full { tier: TierKind, needed: u64, free: u64 },
    /// Configuration that cannot work, with the field at fault.
    #[error("invalid configuration: {field}: {reason}")]
    Config { field: &'static str, reason: String },
    /// An I/O error of a tier's medium (disk, shared memory file).
    #[error("{tier} I/O error during {op}: {source}")]
    Io {
        tier: TierKind,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The durable index of G3 failed.
    #[error("G3 index error: {0}")]
    Index(String),
    /// The data is not what was described (wrong length).
    #[error("block length mismatch: metadata says {expected} bytes, data has {actual}")]
    LengthMismatch { expected: u64, actual: u64 },
    /// The store is shutting down.
    #[error("the block store is shutting down")]
    ShuttingDown,
    /// A put's fill (a copy from memory the store does not own, e.g. an engine's) failed.
    #[error("copying the block in failed: {0}")]
    Fill(String),
    /// The block's owner is at its quota in this tier and its own blocks cannot make room.
    #[error("over the tenant's {} quota ({why})", tier.label().to_uppercase())]
    OverQuota { tier: TierKind, why: crate::quota::OverQuota },
    /// CUDA is needed for the operation and no device or driver is present.
    #[error("no CUDA device: {0}")]
    NoCuda(String),
    /// A copy between an engine's device memory and host memory failed, or could not be
    /// queued: the bytes it was to move are not to be trusted.
    #[error("device copy failed: {0}")]
    Device(String),
}

impl TierError {
    pub(crate) fn io(tier: TierKind, op: &'static str, source: std::io::Error) -> Self {
        Self::Io { tier, op, source }
    }
}

/// Result alias of this crate.
pub type Result<T, E = TierError> = std::result::Result<T, E>;
