//! [`BlockKey`], a block's 128-bit key, and the seeded hasher of maps keyed by it. How keys are
//! derived is in [`crate::key`] (and its fast path, [`crate::key_chain`]).

use std::fmt;
use std::hash::Hasher;
use std::str::FromStr;

use crate::ProtoError;

/// A block's 128-bit key: a hash of its namespace and the tokens of its whole prefix.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct BlockKey(pub [u8; 16]);

impl BlockKey {
    /// The key's 16 bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
    /// The first 8 bytes as a little-endian u64 (already uniformly distributed).
    pub fn low64(&self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.0[..8]);
        u64::from_le_bytes(b)
    }
}

impl std::hash::Hash for BlockKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // One write of the 16 bytes (no length prefix): equal keys hash equally.
        state.write(&self.0);
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({self})")
    }
}

impl FromStr for BlockKey {
    type Err = ProtoError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = [0u8; 16];
        hex::decode_to_slice(s, &mut out).map_err(|_| ProtoError::InvalidKey(s.to_string()))?;
        Ok(Self(out))
    }
}

/// A `Hasher` for maps keyed by [`BlockKey`]: XXH3-64 of the key bytes with a per-map random
/// seed. Fast (one XXH3 of 16 bytes), and a client that can compute keys of an unsalted
/// namespace still cannot grind keys that collide in a map's buckets, because it does not know
/// the seed.
#[derive(Debug, Clone, Copy)]
pub struct BlockKeyHasher {
    seed: u64,
    state: u64,
}

impl Hasher for BlockKeyHasher {
    fn finish(&self) -> u64 {
        self.state
    }
    fn write(&mut self, bytes: &[u8]) {
        self.state = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.seed ^ self.state);
    }
}

/// `BuildHasher` for `HashMap<BlockKey, _, BlockKeyBuildHasher>`, randomly seeded per instance.
#[derive(Debug, Clone, Copy)]
pub struct BlockKeyBuildHasher {
    seed: u64,
}

impl Default for BlockKeyBuildHasher {
    fn default() -> Self {
        // RandomState is seeded from the OS once per process and varied per instance.
        let seed = std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), 0x6b76_u64);
        Self { seed }
    }
}

impl std::hash::BuildHasher for BlockKeyBuildHasher {
    type Hasher = BlockKeyHasher;
    fn build_hasher(&self) -> BlockKeyHasher {
        BlockKeyHasher { seed: self.seed, state: 0 }
    }
}
