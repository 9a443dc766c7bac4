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
    /// Whose quota the block is charged to in each tier that has one for it
    /// ([`crate::quota`]); `None`: no one's. Kept in memory only: a block found in G3 or G4 at
    /// start is no one's.
    pub owner: Option<u32>,
}

/// Which function a stored checksum is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SumKind {
    /// XXH3-64: G3 records of version 1 (and G4 objects).
    Xxh3,
    /// CRC-64/NVME, with the carry-less multiply the CPU offers chosen at run time: what G3
    /// writes now. ~28 GB/s on one core here, against ~12 GB/s for XXH3 built for baseline
    /// x86-64 (its SIMD paths are chosen at compile time); a G3 write sums every byte it
    /// writes and a read every byte it reads (docs/benchmarks.md, "G3 disk tier").
    Crc64,
}

/// The checksum G3 stores for the blocks it writes ([`SumKind::Crc64`]).
pub fn checksum(data: &[u8]) -> u64 {
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc64Nvme, data)
}

/// The checksum of kind `kind` of `data`.
pub fn checksum_of(kind: SumKind, data: &[u8]) -> u64 {
    match kind {
        SumKind::Xxh3 => xxh3_64(data),
        SumKind::Crc64 => checksum(data),
    }
}

/// A checksum over bytes that arrive piece by piece, in order (equal to the checksum of their
/// concatenation).
pub enum StreamingChecksum {
    Xxh3(Box<xxhash_rust::xxh3::Xxh3>),
    Crc64(Box<crc_fast::Digest>),
}

impl std::fmt::Debug for StreamingChecksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Xxh3(_) => "StreamingChecksum(XXH3-64)",
            Self::Crc64(_) => "StreamingChecksum(CRC-64/NVME)",
        })
    }
}

impl StreamingChecksum {
    pub fn new(kind: SumKind) -> Self {
        match kind {
            SumKind::Xxh3 => Self::Xxh3(Box::default()),
            SumKind::Crc64 => Self::Crc64(Box::new(crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc64Nvme))),
        }
    }

    pub fn update(&mut self, bytes: &[u8]) {
        match self {
            Self::Xxh3(h) => h.update(bytes),
            Self::Crc64(d) => d.update(bytes),
        }
    }

    pub fn digest(&self) -> u64 {
        match self {
            Self::Xxh3(h) => h.digest(),
            Self::Crc64(d) => d.finalize(),
        }
    }
}

/// Identifies a set of pins taken together; released together or expiring together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub u64);
