//! A request's key context: what a block's KV depends on besides its tokens and the namespace.
//!
//! One engine serves many kinds of request in one namespace: with and without a LoRA adapter,
//! with a per-request cache salt (vLLM's `cache_salt`), with images or audio whose embeddings
//! stand where placeholder tokens are, with prompt embeddings instead of token ids. Their KV is
//! not a function of the token ids alone, so their keys must bind the rest. A [`KeyContext`]
//! turns it into *extra bytes* of some blocks' key messages ([`KeyContext::block_extras`]):
//!
//! - the adapter (name and content hash) and the cache salt go into block 0, and so, through the
//!   chain, into every key of the request;
//! - each multimodal input (its content hash, first token position and length) goes into every
//!   block its placeholder tokens overlap, so the text before the first input is shared with
//!   requests without it and a different image at the same place is a different key from there;
//! - `block_extras` are per-block bytes the engine computes itself (a hash of a block's prompt
//!   embeddings).
//!
//! A block without extras keeps exactly its key of `docs/block-keys.md` section 5, so an empty
//! context is the plain chain. The encoding is specified in `docs/block-keys.md` section 6.

use std::collections::BTreeMap;

use crate::{BlockKey, NamespaceFingerprint, ProtoError};

/// Longest adapter name, in bytes.
pub const MAX_ADAPTER_NAME: usize = 1024;
/// Longest content hash (adapter or multimodal input) and per-block extra, in bytes.
pub const MAX_HASH: usize = 64;
/// Longest cache salt, in bytes.
pub const MAX_SALT: usize = 4096;
/// Most multimodal inputs in one request.
pub const MAX_MM: usize = 65_536;
/// Most per-block extras in one request (a 16M-token prompt of 16-token blocks).
pub const MAX_BLOCK_EXTRAS: usize = 1 << 20;

/// Item tags of a block's extras.
const TAG_ADAPTER: u8 = 0x01;
const TAG_SALT: u8 = 0x02;
const TAG_MM: u8 = 0x03;
const TAG_BLOCK: u8 = 0x04;

/// A LoRA (or other) adapter a request runs with.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Adapter {
    /// The adapter's name as the engine knows it (vLLM's `lora_name`).
    pub name: String,
    /// A hash of the adapter's weights (empty when the engine cannot compute one: then the name
    /// alone must identify the weights).
    pub content_hash: Vec<u8>,
}

/// One multimodal input: its content hash and the token positions of its placeholders.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct MmInput {
    /// The input's content hash (vLLM's `mm_hash` / feature identifier), 1..=64 bytes.
    pub hash: Vec<u8>,
    /// Position of its first placeholder token in the prompt.
    pub offset: u32,
    /// Number of placeholder tokens (> 0).
    pub length: u32,
}

/// What a request's keys bind besides its tokens; see the module docs.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct KeyContext {
    pub adapter: Option<Adapter>,
    /// vLLM's `cache_salt` (non-empty when present).
    pub cache_salt: Option<Vec<u8>>,
    /// Multimodal inputs, in token order, none overlapping another.
    pub mm: Vec<MmInput>,
    /// Per-block extra bytes (block index, 1..=64 bytes), by strictly increasing block index.
    pub block_extras: Vec<(u32, Vec<u8>)>,
}

impl std::fmt::Debug for KeyContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The salt is a tenant's secret: never printed.
        f.debug_struct("KeyContext")
            .field("adapter", &self.adapter.as_ref().map(|a| a.name.as_str()))
            .field("cache_salt", &self.cache_salt.as_ref().map(|_| "<secret>"))
            .field("mm", &self.mm.len())
            .field("block_extras", &self.block_extras.len())
            .finish()
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ProtoError {
    ProtoError::InvalidContext { field, reason: reason.into() }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    // Every length is bounded by the MAX_* constants, far below 2^32.
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

impl KeyContext {
    /// Whether the context adds nothing (every key is the plain chain's).
    pub fn is_empty(&self) -> bool {
        self.adapter.is_none() && self.cache_salt.is_none() && self.mm.is_empty() && self.block_extras.is_empty()
    }

    /// Checks every bound of `docs/block-keys.md` section 6; a context that fails has no keys.
    pub fn validate(&self) -> Result<(), ProtoError> {
        if let Some(a) = &self.adapter {
            if a.name.is_empty() || a.name.len() > MAX_ADAPTER_NAME {
                return Err(invalid("adapter.name", format!("must be 1..={MAX_ADAPTER_NAME} bytes")));
            }
            if a.content_hash.len() > MAX_HASH {
                return Err(invalid("adapter.content_hash", format!("must be at most {MAX_HASH} bytes")));
            }
        }
        if let Some(s) = &self.cache_salt
            && (s.is_empty() || s.len() > MAX_SALT)
        {
            return Err(invalid("cache_salt", format!("must be 1..={MAX_SALT} bytes when present")));
        }
        if self.mm.len() > MAX_MM {
            return Err(invalid("mm", format!("{} inputs, at most {MAX_MM}", self.mm.len())));
        }
        // Inputs in order and apart: each block then carries at most the inputs that start or
        // end in it, and a request's extras are bounded by its blocks plus its inputs.
        let mut end = 0u64;
        for (i, m) in self.mm.iter().enumerate() {
            if m.hash.is_empty() || m.hash.len() > MAX_HASH {
                return Err(invalid("mm.hash", format!("input {i}: must be 1..={MAX_HASH} bytes")));
            }
            if m.length == 0 || m.offset.checked_add(m.length).is_none() {
                return Err(invalid("mm.length", format!("input {i}: must be > 0 and end before 2^32")));
            }
            if u64::from(m.offset) < end {
                return Err(invalid("mm.offset", format!("input {i}: inputs must come in order and not overlap")));
            }
            end = u64::from(m.offset) + u64::from(m.length);
        }
        if self.block_extras.len() > MAX_BLOCK_EXTRAS {
            return Err(invalid(
                "block_extras",
                format!("{} entries, at most {MAX_BLOCK_EXTRAS}", self.block_extras.len()),
            ));
        }
        let mut prev: Option<u32> = None;
        for (block, data) in &self.block_extras {
            if data.is_empty() || data.len() > MAX_HASH {
                return Err(invalid("block_extras.data", format!("block {block}: must be 1..={MAX_HASH} bytes")));
            }
            if prev.is_some_and(|p| p >= *block) {
                return Err(invalid("block_extras.block", "block indices must strictly increase"));
            }
            prev = Some(*block);
        }
        Ok(())
    }

    /// The first of the first `blocks` blocks whose extras bind a multimodal input or a
    /// per-block extra (what a Dynamo hash cannot express; the adapter and salt of block 0 it
    /// can), if any.
    pub fn first_per_block_extra(&self, tokens_per_block: usize, blocks: usize) -> Option<usize> {
        let mm = self.mm.first().map(|m| m.offset as usize / tokens_per_block.max(1));
        let extra = self.block_extras.first().map(|(b, _)| *b as usize);
        mm.into_iter().chain(extra).min().filter(|&b| b < blocks)
    }

    /// The seed of this request's Dynamo local hashes ([`crate::dynamo::request_seed`] of its
    /// adapter's name and its salt).
    pub fn dynamo_seed(&self) -> u64 {
        crate::dynamo::request_seed(self.adapter.as_ref().map(|a| a.name.as_bytes()), self.cache_salt.as_deref())
    }

    /// The extra bytes of each block among the first `blocks` blocks of `tokens_per_block`
    /// tokens that has any (blocks not in the map have none). The context must be valid.
    pub fn block_extras(&self, tokens_per_block: usize, blocks: usize) -> BTreeMap<usize, Vec<u8>> {
        let mut out: BTreeMap<usize, Vec<u8>> = BTreeMap::new();
        if blocks == 0 || tokens_per_block == 0 {
            return out;
        }
        if let Some(a) = &self.adapter {
            let e = out.entry(0).or_default();
            e.push(TAG_ADAPTER);
            put_bytes(e, a.name.as_bytes());
            put_bytes(e, &a.content_hash);
        }
        if let Some(s) = &self.cache_salt {
            let e = out.entry(0).or_default();
            e.push(TAG_SALT);
            put_bytes(e, s);
        }
        for m in &self.mm {
            let first = m.offset as usize / tokens_per_block;
            let end = (m.offset as usize + m.length as usize).div_ceil(tokens_per_block).min(blocks);
            for b in first..end {
                let e = out.entry(b).or_default();
                e.push(TAG_MM);
                put_bytes(e, &m.hash);
                e.extend_from_slice(&m.offset.to_le_bytes());
                e.extend_from_slice(&m.length.to_le_bytes());
            }
        }
        for (block, data) in &self.block_extras {
            let b = *block as usize;
            if b < blocks {
                let e = out.entry(b).or_default();
                e.push(TAG_BLOCK);
                put_bytes(e, data);
            }
        }
        out
    }
}

/// The key of one full block whose message carries `extras` after its tokens (section 6 of
/// `docs/block-keys.md`); with empty `extras` it is [`crate::next_block_key_le`].
pub fn next_block_key_extra(
    fp: &NamespaceFingerprint,
    parent: Option<&BlockKey>,
    block_le: &[u8],
    extras: &[u8],
) -> BlockKey {
    if extras.is_empty() {
        return crate::next_block_key_le(fp, parent, block_le);
    }
    let hash_key = match parent {
        None => fp.0,
        Some(p) => {
            let mut k = fp.0;
            k[..16].copy_from_slice(&p.0);
            k
        }
    };
    let mut h = blake3::Hasher::new_keyed(&hash_key);
    h.update(block_le);
    h.update(extras);
    let mut key = [0u8; 16];
    key.copy_from_slice(&h.finalize().as_bytes()[..16]);
    BlockKey(key)
}

/// Keys of every full block of `le` (tokens in wire form, whole tokens: checked by the caller)
/// under `ctx`. Runs of blocks without extras go through the plain chain's fast path.
pub fn context_keys_le(
    fp: &NamespaceFingerprint,
    tokens_per_block: usize,
    le: &[u8],
    ctx: &KeyContext,
) -> Vec<BlockKey> {
    if tokens_per_block == 0 {
        return Vec::new();
    }
    let block_bytes = 4 * tokens_per_block;
    let blocks = le.len() / block_bytes;
    let extras = ctx.block_extras(tokens_per_block, blocks);
    let mut keys: Vec<BlockKey> = Vec::with_capacity(blocks);
    let mut at = 0usize;
    for (&b, e) in &extras {
        if b > at {
            let run = crate::chain_keys_le(fp, keys.last(), tokens_per_block, &le[at * block_bytes..b * block_bytes]);
            keys.extend(run);
        }
        let k = next_block_key_extra(fp, keys.last(), &le[b * block_bytes..(b + 1) * block_bytes], e);
        keys.push(k);
        at = b + 1;
    }
    if at < blocks {
        let run = crate::chain_keys_le(fp, keys.last(), tokens_per_block, &le[at * block_bytes..blocks * block_bytes]);
        keys.extend(run);
    }
    keys
}

/// [`context_keys_le`] of token ids.
pub fn context_keys(
    fp: &NamespaceFingerprint,
    tokens_per_block: usize,
    tokens: &[u32],
    ctx: &KeyContext,
) -> Vec<BlockKey> {
    context_keys_le(fp, tokens_per_block, &crate::tokens_to_le(tokens), ctx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp() -> NamespaceFingerprint {
        NamespaceFingerprint([7; 32])
    }

    fn toks(n: u32) -> Vec<u32> {
        (0..n).collect()
    }

    #[test]
    fn an_empty_context_is_the_plain_chain() {
        let t = toks(16 * 70 + 5);
        assert_eq!(context_keys(&fp(), 16, &t, &KeyContext::default()), crate::block_keys(&fp(), 16, &t));
    }

    #[test]
    fn an_adapter_or_a_salt_changes_every_key_and_they_differ_from_each_other() {
        let t = toks(64);
        let plain = crate::block_keys(&fp(), 16, &t);
        let lora = KeyContext {
            adapter: Some(Adapter { name: "sql".into(), content_hash: vec![1; 32] }),
            ..Default::default()
        };
        let salt = KeyContext { cache_salt: Some(b"tenant-a".to_vec()), ..Default::default() };
        let other_weights = KeyContext {
            adapter: Some(Adapter { name: "sql".into(), content_hash: vec![2; 32] }),
            ..Default::default()
        };
        let (a, b, c) = (
            context_keys(&fp(), 16, &t, &lora),
            context_keys(&fp(), 16, &t, &salt),
            context_keys(&fp(), 16, &t, &other_weights),
        );
        for i in 0..4 {
            assert!(a[i] != plain[i] && b[i] != plain[i] && a[i] != b[i] && a[i] != c[i], "block {i}");
        }
    }

    #[test]
    fn an_image_changes_keys_from_the_first_block_it_overlaps() {
        let t = toks(16 * 8);
        let plain = crate::block_keys(&fp(), 16, &t);
        let img = |h: u8| KeyContext {
            mm: vec![MmInput { hash: vec![h; 32], offset: 40, length: 30 }],
            ..Default::default()
        };
        let (a, b) = (context_keys(&fp(), 16, &t, &img(1)), context_keys(&fp(), 16, &t, &img(2)));
        assert_eq!(a[..2], plain[..2], "blocks before the image are shared");
        assert_eq!(b[..2], plain[..2]);
        for i in 2..8 {
            assert!(a[i] != plain[i] && a[i] != b[i], "block {i}");
        }
        // Blocks 2, 3 and 4 (tokens 32..80) hold placeholders of the image at 40..70.
        assert_eq!(img(1).block_extras(16, 8).keys().copied().collect::<Vec<_>>(), vec![2, 3, 4]);
    }

    #[test]
    fn invalid_contexts_are_refused_at_their_field() {
        let bad = [
            (
                KeyContext {
                    adapter: Some(Adapter { name: String::new(), content_hash: vec![] }),
                    ..Default::default()
                },
                "adapter.name",
            ),
            (KeyContext { cache_salt: Some(vec![]), ..Default::default() }, "cache_salt"),
            (KeyContext { mm: vec![MmInput { hash: vec![], offset: 0, length: 1 }], ..Default::default() }, "mm.hash"),
            (
                KeyContext { mm: vec![MmInput { hash: vec![1], offset: 0, length: 0 }], ..Default::default() },
                "mm.length",
            ),
            (
                KeyContext { mm: vec![MmInput { hash: vec![1], offset: u32::MAX, length: 1 }], ..Default::default() },
                "mm.length",
            ),
            (
                KeyContext {
                    mm: vec![
                        MmInput { hash: vec![1], offset: 9, length: 1 },
                        MmInput { hash: vec![1], offset: 8, length: 1 },
                    ],
                    ..Default::default()
                },
                "mm.offset",
            ),
            (KeyContext { block_extras: vec![(3, vec![1]), (3, vec![2])], ..Default::default() }, "block_extras.block"),
            (KeyContext { block_extras: vec![(3, vec![0; 65])], ..Default::default() }, "block_extras.data"),
        ];
        for (ctx, field) in bad {
            match ctx.validate() {
                Err(ProtoError::InvalidContext { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_salt_is_never_printed() {
        let ctx = KeyContext { cache_salt: Some(b"hunter2".to_vec()), ..Default::default() };
        assert!(!format!("{ctx:?}").contains("hunter2"));
    }
}
