//! What a tier stores next to a block's bytes.

use kvproto::{BlockKey, NamespaceId};
use xxhash_rust::xxh3::xxh3_64;

/// Metadata of one stored block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockMeta {
    /// Public id of the namespace the key was derived in.
    pub namespace: NamespaceId,
    /// The previous block of the chain (None for the first block). Eviction uses it to keep a
    /// parent while any of its children is cached.
    pub parent: Option<BlockKey>,
    /// Length of the block's bytes.
    pub len: u64,
}

/// The checksum G3 (and every medium that can corrupt) stores and verifies: XXH3-64.
pub fn checksum(data: &[u8]) -> u64 {
    xxh3_64(data)
}

/// [`checksum`] over bytes that arrive piece by piece, in order (equal to `checksum` of their
/// concatenation).
pub type StreamingChecksum = xxhash_rust::xxh3::Xxh3;

/// Identifies a set of pins taken together; released together or expiring together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub u64);
