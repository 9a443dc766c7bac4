//! The 64-bit chained block hash NVIDIA Dynamo and the Mooncake RFC #1527 events use.
//!
//! `local[i] = XXH3-64(tokens of block i as little-endian u32, seed)`;
//! `seq[0] = local[0]`, `seq[i] = XXH3-64(le_u64(seq[i-1]) || le_u64(local[i]), seed)`.
//! Dynamo uses seed 1337. These are for interop (events, routers) only: block storage uses the
//! 128-bit keyed [`crate::BlockKey`].

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Dynamo's seed.
pub const DYNAMO_SEED: u64 = 1337;

/// The seed of a request's local block hashes in Dynamo 1.6.1 (`compute_salt_hash`): 1337, plus
/// `XXH3-64(lora_name, seed 0)` with an adapter, plus `XXH3-64(cache_namespace, seed 1)` with a
/// cache namespace (the request's cache salt), wrapping. Empty values count as absent. The
/// chain step keeps [`DYNAMO_SEED`].
pub fn request_seed(lora_name: Option<&[u8]>, cache_namespace: Option<&[u8]>) -> u64 {
    let mut seed = DYNAMO_SEED;
    if let Some(l) = lora_name.filter(|l| !l.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(l, 0));
    }
    if let Some(n) = cache_namespace.filter(|n| !n.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(n, 1));
    }
    seed
}

/// Sequence hashes of every full block of `tokens` for a request whose local hashes are seeded
/// with `local_seed` ([`request_seed`]); the chain step uses [`DYNAMO_SEED`].
pub fn request_sequence_hashes(tokens: &[u32], block_size: usize, local_seed: u64) -> Vec<u64> {
    chained(tokens, block_size, local_seed, DYNAMO_SEED)
}

/// Hash of one block's tokens alone.
pub fn local_block_hash(block_tokens: &[u32], seed: u64) -> u64 {
    let mut bytes = Vec::with_capacity(block_tokens.len() * 4);
    for t in block_tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, seed)
}

/// The rolling sequence hash of a block given its parent's sequence hash.
pub fn chain(parent_seq: Option<u64>, local: u64, seed: u64) -> u64 {
    match parent_seq {
        None => local,
        Some(p) => {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&p.to_le_bytes());
            b[8..].copy_from_slice(&local.to_le_bytes());
            xxh3_64_with_seed(&b, seed)
        }
    }
}

/// Sequence hashes of every full block of `tokens`.
pub fn sequence_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<u64> {
    chained(tokens, block_size, seed, seed)
}

fn chained(tokens: &[u32], block_size: usize, local_seed: u64, chain_seed: u64) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = None;
    for block in tokens.chunks_exact(block_size) {
        let s = chain(parent, local_block_hash(block, local_seed), chain_seed);
        out.push(s);
        parent = Some(s);
    }
    out
}
