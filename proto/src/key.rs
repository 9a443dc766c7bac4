//! 128-bit chained block keys.
//!
//! `key(0) = BLAKE3-keyed(fingerprint, tokens_le)[..16]` and
//! `key(i) = BLAKE3-keyed(key(i-1) || fingerprint[16..32], tokens_le)[..16]`: the parent key is
//! half of the hash key, so a block of 16 tokens (64 bytes) costs one BLAKE3 compression. The
//! exact encoding is in `docs/block-keys.md`. Only full blocks have keys.

pub use crate::block_key::{BlockKey, BlockKeyBuildHasher, BlockKeyHasher};
use crate::{NamespaceFingerprint, ProtoError};

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
