//! 128-bit chained block keys.
//!
//! `key(i) = BLAKE3-keyed(fingerprint, 0x01 || parent16 || n_tokens_le32 || tokens_le32...)[..16]`
//! with the parent field absent and the tag byte 0x00 for the first block; the exact encoding is
//! in `docs/block-keys.md`. Only full blocks have keys.

use std::fmt;
use std::hash::Hasher;
use std::str::FromStr;

use crate::{NamespaceFingerprint, ProtoError};

/// Tag byte of the first block of a chain (no parent).
pub const ROOT_TAG: u8 = 0x00;
/// Tag byte of every later block (the parent key follows).
pub const CHILD_TAG: u8 = 0x01;

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

/// Derives the key of one full block from its parent's key (None for the first block).
pub fn next_block_key(fp: &NamespaceFingerprint, parent: Option<&BlockKey>, block_tokens: &[u32]) -> BlockKey {
    // The hashed bytes: tag, parent key (children only), token count, tokens as LE u32.
    // Blocks of up to ONE_SHOT_TOKENS tokens are laid out on the stack and hashed in one call
    // (no streaming hasher state: ~2x faster for 16-token blocks); longer ones stream the same
    // bytes.
    const ONE_SHOT_TOKENS: usize = 256;
    let mut buf = [0u8; 1 + 16 + 4 + 4 * ONE_SHOT_TOKENS];
    let mut n = 0;
    match parent {
        None => {
            buf[0] = ROOT_TAG;
            n += 1;
        }
        Some(p) => {
            buf[0] = CHILD_TAG;
            buf[1..17].copy_from_slice(&p.0);
            n += 17;
        }
    }
    buf[n..n + 4].copy_from_slice(&(block_tokens.len() as u32).to_le_bytes());
    n += 4;
    let full = if block_tokens.len() <= ONE_SHOT_TOKENS {
        for t in block_tokens {
            buf[n..n + 4].copy_from_slice(&t.to_le_bytes());
            n += 4;
        }
        blake3::keyed_hash(&fp.0, &buf[..n])
    } else {
        let mut h = blake3::Hasher::new_keyed(&fp.0);
        h.update(&buf[..n]);
        let mut chunk_buf = [0u8; 4 * ONE_SHOT_TOKENS];
        for chunk in block_tokens.chunks(ONE_SHOT_TOKENS) {
            for (i, t) in chunk.iter().enumerate() {
                chunk_buf[4 * i..4 * i + 4].copy_from_slice(&t.to_le_bytes());
            }
            h.update(&chunk_buf[..4 * chunk.len()]);
        }
        h.finalize()
    };
    let mut key = [0u8; 16];
    key.copy_from_slice(&full.as_bytes()[..16]);
    BlockKey(key)
}

/// Keys of every full block of `tokens` (a trailing partial block has no key).
pub fn block_keys(fp: &NamespaceFingerprint, tokens_per_block: usize, tokens: &[u32]) -> Vec<BlockKey> {
    if tokens_per_block == 0 {
        return Vec::new();
    }
    let mut keys = Vec::with_capacity(tokens.len() / tokens_per_block);
    let mut parent: Option<BlockKey> = None;
    for block in tokens.chunks_exact(tokens_per_block) {
        let k = next_block_key(fp, parent.as_ref(), block);
        keys.push(k);
        parent = Some(k);
    }
    keys
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
