//! 128-bit chained block keys.
//!
//! `key(0) = BLAKE3-keyed(fingerprint, tokens_le)[..16]` and
//! `key(i) = BLAKE3-keyed(key(i-1) || fingerprint[16..32], tokens_le)[..16]`: the parent key is
//! half of the hash key, so a block of 16 tokens (64 bytes) costs one BLAKE3 compression. The
//! exact encoding is in `docs/block-keys.md`. Only full blocks have keys.

use std::fmt;
use std::hash::Hasher;
use std::str::FromStr;

use crate::{NamespaceFingerprint, ProtoError};

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
    with_tokens_le(block_tokens, |le| next_block_key_le(fp, parent, le))
}

/// [`next_block_key`] of a block given as its tokens' little-endian bytes.
pub fn next_block_key_le(fp: &NamespaceFingerprint, parent: Option<&BlockKey>, block_le: &[u8]) -> BlockKey {
    // The hash key: the whole fingerprint for a root block; the parent key and the fingerprint's
    // second half for a child. The message is only the tokens, so a 16-token block is exactly one
    // 64-byte BLAKE3 block: one compression on the sequential path of a prompt.
    let hash_key = match parent {
        None => fp.0,
        Some(p) => {
            let mut k = fp.0;
            k[..16].copy_from_slice(&p.0);
            k
        }
    };
    let full = blake3::keyed_hash(&hash_key, block_le);
    let mut key = [0u8; 16];
    key.copy_from_slice(&full.as_bytes()[..16]);
    BlockKey(key)
}

/// Token ids as their wire form: little-endian u32, 4 bytes each.
pub fn tokens_to_le(tokens: &[u32]) -> bytes::Bytes {
    with_tokens_le(tokens, bytes::Bytes::copy_from_slice)
}

/// Checks that token bytes in wire form ([`tokens_to_le`]) are whole tokens.
pub fn check_tokens_le(le: &[u8]) -> Result<(), ProtoError> {
    if le.len().is_multiple_of(4) { Ok(()) } else { Err(ProtoError::TokenBytes(le.len())) }
}

/// Token ids from their wire form ([`tokens_to_le`]).
pub fn tokens_from_le(le: &[u8]) -> Result<Vec<u32>, ProtoError> {
    check_tokens_le(le)?;
    Ok(le.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// Calls `f` with the tokens as little-endian u32 bytes (a view on little-endian hosts).
#[cfg(target_endian = "little")]
fn with_tokens_le<R>(tokens: &[u32], f: impl FnOnce(&[u8]) -> R) -> R {
    // SAFETY: u32 has no padding and any byte is a valid u8; the view covers exactly the
    // slice's memory, which on a little-endian host already is the little-endian encoding.
    let bytes = unsafe { std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens)) };
    f(bytes)
}

/// Calls `f` with the tokens as little-endian u32 bytes (a converted copy on big-endian hosts).
#[cfg(not(target_endian = "little"))]
fn with_tokens_le<R>(tokens: &[u32], f: impl FnOnce(&[u8]) -> R) -> R {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    f(&bytes)
}

/// Keys of every full block of `tokens` (a trailing partial block has no key).
pub fn block_keys(fp: &NamespaceFingerprint, tokens_per_block: usize, tokens: &[u32]) -> Vec<BlockKey> {
    with_tokens_le(tokens, |le| chain_keys_le(fp, None, tokens_per_block, le))
}

/// [`block_keys`] of tokens in their wire form ([`tokens_to_le`]); an error if the bytes are not
/// whole tokens.
pub fn block_keys_le(
    fp: &NamespaceFingerprint,
    tokens_per_block: usize,
    le: &[u8],
) -> Result<Vec<BlockKey>, ProtoError> {
    check_tokens_le(le)?;
    Ok(chain_keys_le(fp, None, tokens_per_block, le))
}

/// Keys of the full blocks of `le` (tokens in wire form) continuing the chain after `parent`
/// (`None`: `le` starts the prompt).
pub fn chain_keys_le(
    fp: &NamespaceFingerprint,
    parent: Option<&BlockKey>,
    tokens_per_block: usize,
    le: &[u8],
) -> Vec<BlockKey> {
    if tokens_per_block == 0 {
        return Vec::new();
    }
    let block_bytes = 4 * tokens_per_block;
    let mut keys = Vec::with_capacity(le.len() / block_bytes);
    if crate::key_chain::chain(&fp.0, parent, block_bytes, le, &mut keys) {
        return keys;
    }
    let mut parent = parent.copied();
    for block in le.chunks_exact(block_bytes) {
        let k = next_block_key_le(fp, parent.as_ref(), block);
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
