//! The JSON schema of the test vectors in `proto/tests/data/`, shared by the generator
//! (`proto/examples/gen_vectors.rs`) and the checker (`proto/tests/vectors.rs`).
//! The format is described in `docs/block-keys.md`, section "Test vectors".

#![allow(dead_code)]

use serde::{Deserialize, Serialize};

/// One run of generated tokens: `token[i] = (start + i * mul) mod modulus` for `i` in
/// `0..count`, computed with exact (unbounded) integer arithmetic.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct TokenSegment {
    pub count: u64,
    pub start: u64,
    pub mul: u64,
    #[serde(rename = "mod")]
    pub modulus: u64,
}

impl TokenSegment {
    pub fn new(count: u64, start: u64, mul: u64, modulus: u64) -> Self {
        Self { count, start, mul, modulus }
    }

    /// `count` tokens from a full-range (mod 2^32) generator.
    pub fn full(count: u64, start: u64, mul: u64) -> Self {
        Self::new(count, start, mul, 1 << 32)
    }

    /// Expands the segment into token ids.
    pub fn expand(&self) -> Vec<u32> {
        assert!(self.modulus >= 1 && self.modulus <= 1 << 32, "mod must be in 1..=2^32");
        (0..self.count)
            .map(|i| {
                let v = (u128::from(self.start) + u128::from(i) * u128::from(self.mul)) % u128::from(self.modulus);
                u32::try_from(v).expect("value < mod <= 2^32")
            })
            .collect()
    }
}

/// Concatenation of every segment.
pub fn expand_tokens(segments: &[TokenSegment]) -> Vec<u32> {
    segments.iter().flat_map(TokenSegment::expand).collect()
}

/// The namespace fields of a block-key vector.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NamespaceSpec {
    pub model_id: String,
    pub num_layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype: String,
    pub tokens_per_block: u32,
    pub layout_kind: String,
    /// `null` = no salt; `""` = a present, empty salt (encoded differently from `null`).
    pub tenant_salt_hex: Option<String>,
    pub adapter_id: Option<String>,
    pub extra_hex: Option<String>,
}

/// One block-key vector.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BlockKeyVector {
    pub name: String,
    pub namespace: NamespaceSpec,
    pub canonical_hex: String,
    pub fingerprint_hex: String,
    pub namespace_id_hex: String,
    pub tokens: Vec<TokenSegment>,
    pub token_count: u64,
    /// One key per full block, in order; a trailing partial block has none.
    pub keys: Vec<String>,
}

/// A namespace the spec refuses: no canonical bytes, no fingerprint, no keys.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RejectionVector {
    pub name: String,
    pub namespace: NamespaceSpec,
    /// The field at fault: a field of `namespace`, or `layout` (bytes per block overflow).
    pub field: String,
    /// What is wrong, for a reader.
    pub reason: String,
}

/// `proto/tests/data/block_keys.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BlockKeyFile {
    pub description: String,
    pub format_version: u32,
    pub token_generator: String,
    pub vectors: Vec<BlockKeyVector>,
    pub rejections: Vec<RejectionVector>,
}

/// The namespace a spec names, or the field at fault and why (what a rejection vector lists).
pub fn to_namespace(spec: &NamespaceSpec) -> Result<kvproto::Namespace, (String, String)> {
    use kvproto::ProtoError;
    let at = |field: &str, e: &dyn std::fmt::Display| (field.to_string(), e.to_string());
    let dtype = kvproto::Dtype::parse(&spec.dtype).map_err(|e| at("dtype", &e))?;
    let kind = kvproto::LayoutKind::parse(&spec.layout_kind).map_err(|e| at("layout_kind", &e))?;
    let hex = |field: &str, h: &Option<String>| -> Result<Option<Vec<u8>>, (String, String)> {
        h.as_deref().map(hex::decode).transpose().map_err(|e| at(field, &e))
    };
    let ns = kvproto::Namespace {
        model_id: spec.model_id.clone(),
        layout: kvproto::KvLayout {
            num_layers: spec.num_layers,
            kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
            dtype,
            tokens_per_block: spec.tokens_per_block,
            kind,
        },
        tenant_salt: hex("tenant_salt_hex", &spec.tenant_salt_hex)?,
        adapter_id: spec.adapter_id.clone(),
        extra: hex("extra_hex", &spec.extra_hex)?,
    };
    match ns.validate() {
        Ok(()) => Ok(ns),
        Err(e @ (ProtoError::InvalidLayout { field, .. } | ProtoError::InvalidNamespace { field, .. })) => {
            Err(at(field, &e))
        }
        Err(e) => Err(at("?", &e)),
    }
}

/// One Dynamo-hash vector. Hashes are u64 written as decimal strings and as 16 lowercase hex
/// digits of the number (most significant first).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DynamoVector {
    pub name: String,
    pub block_size: u32,
    pub seed: u64,
    pub tokens: Vec<TokenSegment>,
    pub token_count: u64,
    pub local_hashes_hex: Vec<String>,
    pub sequence_hashes_dec: Vec<String>,
    pub sequence_hashes_hex: Vec<String>,
}

/// `proto/tests/data/dynamo_hashes.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DynamoFile {
    pub description: String,
    pub format_version: u32,
    pub token_generator: String,
    pub vectors: Vec<DynamoVector>,
}

/// The `token_generator` text of both files.
pub const TOKEN_GENERATOR: &str = "tokens = concatenation of the segments in order; segment {count, start, mul, mod} \
yields token[i] = (start + i * mul) mod mod for i = 0..count-1, computed with exact integer \
arithmetic (no wrap-around before the final mod); every token is a u32 (mod <= 2^32)";

/// A multimodal input of a key-context vector.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MmSpec {
    pub hash_hex: String,
    pub offset: u32,
    pub length: u32,
}

/// A per-block extra of a key-context vector.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BlockExtraSpec {
    pub block: u32,
    pub data_hex: String,
}

/// The key context of a vector (`docs/block-keys.md` section 6).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ContextSpec {
    /// `null`: no adapter.
    pub adapter_name: Option<String>,
    pub adapter_hash_hex: String,
    /// `null`: no cache salt.
    pub cache_salt_hex: Option<String>,
    pub mm: Vec<MmSpec>,
    pub block_extras: Vec<BlockExtraSpec>,
}

/// The extra bytes of one block, for a reader checking an implementation step by step.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExtrasOf {
    pub block: u64,
    pub hex: String,
}

/// One key-context vector: a namespace, a context and tokens; the blocks' extras and keys.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ContextVector {
    pub name: String,
    pub namespace: NamespaceSpec,
    pub context: ContextSpec,
    pub tokens: Vec<TokenSegment>,
    pub token_count: u64,
    /// The blocks with extras, in block order (the others have none).
    pub extras: Vec<ExtrasOf>,
    pub keys: Vec<String>,
}

/// A context the spec refuses, at `field`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ContextRejection {
    pub name: String,
    pub context: ContextSpec,
    pub field: String,
    pub reason: String,
}

/// A Dynamo request-seed vector: the local seed for an adapter and a cache namespace, and the
/// sequence hashes of tokens under it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DynamoSeedVector {
    pub name: String,
    pub lora_name: Option<String>,
    pub cache_namespace: Option<String>,
    pub local_seed_dec: String,
    pub block_size: u32,
    pub tokens: Vec<TokenSegment>,
    pub token_count: u64,
    pub sequence_hashes_hex: Vec<String>,
}

/// `context_keys.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ContextFile {
    pub description: String,
    pub format_version: u32,
    pub token_generator: String,
    pub vectors: Vec<ContextVector>,
    pub rejections: Vec<ContextRejection>,
    pub dynamo_seeds: Vec<DynamoSeedVector>,
}

/// One engine-hash vector (section 7): the keys of given hashes, or of the scheme's hashes of
/// tokens (`tokens` non-empty, `hashes_hex` then the hashes the daemon derives).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineHashVector {
    pub name: String,
    pub namespace: NamespaceSpec,
    pub scheme: String,
    pub tokens: Vec<TokenSegment>,
    pub token_count: u64,
    pub derived: bool,
    pub hashes_hex: Vec<String>,
    pub keys: Vec<String>,
}

/// `engine_hashes.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineHashFile {
    pub description: String,
    pub format_version: u32,
    pub token_generator: String,
    pub vectors: Vec<EngineHashVector>,
}

/// The context a spec names, or the field at fault.
pub fn to_context(spec: &ContextSpec) -> Result<kvproto::KeyContext, (String, String)> {
    use kvproto::ProtoError;
    let hex_of = |field: &str, h: &str| hex::decode(h).map_err(|e| (field.to_string(), e.to_string()));
    if spec.adapter_name.is_none() && !spec.adapter_hash_hex.is_empty() {
        return Err(("adapter_hash".into(), "given without an adapter name".into()));
    }
    let adapter = match &spec.adapter_name {
        Some(name) => {
            Some(kvproto::Adapter { name: name.clone(), content_hash: hex_of("adapter_hash", &spec.adapter_hash_hex)? })
        }
        None => None,
    };
    let cache_salt = spec.cache_salt_hex.as_deref().map(|h| hex_of("cache_salt", h)).transpose()?;
    let mut mm = Vec::new();
    for m in &spec.mm {
        mm.push(kvproto::MmInput { hash: hex_of("mm.hash", &m.hash_hex)?, offset: m.offset, length: m.length });
    }
    let mut block_extras = Vec::new();
    for b in &spec.block_extras {
        block_extras.push((b.block, hex_of("block_extras.data", &b.data_hex)?));
    }
    let ctx = kvproto::KeyContext { adapter, cache_salt, mm, block_extras };
    match ctx.validate() {
        Ok(()) => Ok(ctx),
        Err(ProtoError::InvalidContext { field, reason }) => Err((field.to_string(), reason)),
        Err(e) => Err(("context".into(), e.to_string())),
    }
}
