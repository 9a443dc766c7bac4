//! Namespaces: what binds every block key.
//!
//! Two engines share KV only when every field here is equal. The canonical byte encoding is
//! specified in `docs/block-keys.md` (section "Namespace encoding"); change it only together with
//! [`ENCODING_VERSION`].

use std::fmt;

use crate::ProtoError;

/// Version byte that starts the canonical namespace encoding.
pub const ENCODING_VERSION: u8 = 2;
/// BLAKE3 `derive_key` context for the namespace fingerprint.
pub const FINGERPRINT_CONTEXT: &str = "kvcached 2026-11-30 namespace fingerprint v2";
/// BLAKE3 `derive_key` context for the public namespace id.
pub const ID_CONTEXT: &str = "kvcached 2026-11-30 namespace id v2";

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    F16,
    Bf16,
    F32,
    Fp8E4m3,
    Fp8E5m2,
    Int8,
}

impl Dtype {
    /// Bytes per element.
    pub fn bytes(self) -> u32 {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Fp8E4m3 | Self::Fp8E5m2 | Self::Int8 => 1,
        }
    }
    /// Code used in the canonical encoding.
    pub fn code(self) -> u8 {
        match self {
            Self::F16 => 1,
            Self::Bf16 => 2,
            Self::F32 => 3,
            Self::Fp8E4m3 => 4,
            Self::Fp8E5m2 => 5,
            Self::Int8 => 6,
        }
    }
    /// Lowercase name (`bf16`, `fp8_e4m3`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::F32 => "f32",
            Self::Fp8E4m3 => "fp8_e4m3",
            Self::Fp8E5m2 => "fp8_e5m2",
            Self::Int8 => "int8",
        }
    }
    /// Parses [`Dtype::name`] (also accepts `float16`, `bfloat16`, `float32`).
    pub fn parse(s: &str) -> Result<Self, ProtoError> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f16" | "fp16" | "float16" => Self::F16,
            "bf16" | "bfloat16" => Self::Bf16,
            "f32" | "fp32" | "float32" => Self::F32,
            "fp8_e4m3" | "float8_e4m3fn" => Self::Fp8E4m3,
            "fp8_e5m2" | "float8_e5m2" => Self::Fp8E5m2,
            "int8" => Self::Int8,
            _ => return Err(ProtoError::Unknown { what: "dtype", value: s.to_string() }),
        })
    }
}

/// How one block's bytes are arranged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayoutKind {
    /// One tensor per layer and K/V (vLLM's paged layout): a block is `layers x 2` segments.
    LayerSeparate,
    /// The whole block (all layers, K and V) is one contiguous range.
    Contiguous,
}

impl LayoutKind {
    /// Code used in the canonical encoding.
    pub fn code(self) -> u8 {
        match self {
            Self::LayerSeparate => 1,
            Self::Contiguous => 2,
        }
    }
    /// Lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            Self::LayerSeparate => "layer_separate",
            Self::Contiguous => "contiguous",
        }
    }
    /// Parses [`LayoutKind::name`].
    pub fn parse(s: &str) -> Result<Self, ProtoError> {
        match s.to_ascii_lowercase().as_str() {
            "layer_separate" => Ok(Self::LayerSeparate),
            "contiguous" => Ok(Self::Contiguous),
            _ => Err(ProtoError::Unknown { what: "layout kind", value: s.to_string() }),
        }
    }
}

/// The KV layout of a model as the engine stores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    pub num_layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype: Dtype,
    pub tokens_per_block: u32,
    pub kind: LayoutKind,
}

impl KvLayout {
    /// Llama-3-8B's KV (32 layers): [`KvLayout::bf16_8x128`].
    pub fn llama3_8b(tokens_per_block: u32) -> Self {
        Self::bf16_8x128(32, tokens_per_block)
    }

    /// Qwen3-0.6B's KV (28 layers): [`KvLayout::bf16_8x128`].
    pub fn qwen3_0_6b(tokens_per_block: u32) -> Self {
        Self::bf16_8x128(28, tokens_per_block)
    }

    /// `num_layers` layers of 8 KV heads of 128 dimensions, bf16, layer-separate: the layout of
    /// common grouped-query-attention models, as examples, tests and benches use it.
    pub fn bf16_8x128(num_layers: u32, tokens_per_block: u32) -> Self {
        KvLayout {
            num_layers,
            kv_heads: 8,
            head_dim: 128,
            dtype: Dtype::Bf16,
            tokens_per_block,
            kind: LayoutKind::LayerSeparate,
        }
    }

    /// A layout from its fields with the dtype and kind by name (`"bf16"`, `"layer_separate"`),
    /// as configuration files and the wire carry them. Not validated: see [`KvLayout::validate`].
    pub fn from_names(
        num_layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype: &str,
        tokens_per_block: u32,
        kind: &str,
    ) -> Result<Self, ProtoError> {
        Ok(KvLayout {
            num_layers,
            kv_heads,
            head_dim,
            dtype: Dtype::parse(dtype)?,
            tokens_per_block,
            kind: LayoutKind::parse(kind)?,
        })
    }

    /// Checks every field is non-zero and the block size fits in 64 bits. The byte-size
    /// helpers below assume a validated layout (they saturate instead of overflowing).
    pub fn validate(&self) -> Result<(), ProtoError> {
        for (field, v) in [
            ("num_layers", self.num_layers),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("tokens_per_block", self.tokens_per_block),
        ] {
            if v == 0 {
                return Err(ProtoError::InvalidLayout { field, reason: "must be > 0".into() });
            }
        }
        let bytes = [self.kv_heads, self.head_dim, self.dtype.bytes(), self.num_layers, 2]
            .iter()
            .try_fold(u64::from(self.tokens_per_block), |acc, &v| acc.checked_mul(u64::from(v)));
        if bytes.is_none() {
            return Err(ProtoError::InvalidLayout {
                field: "layout",
                reason: "bytes per block overflow 64 bits".into(),
            });
        }
        Ok(())
    }

    /// Bytes of K (or V) for one layer of one block.
    pub fn segment_bytes(&self) -> u64 {
        u64::from(self.tokens_per_block)
            .saturating_mul(u64::from(self.kv_heads))
            .saturating_mul(u64::from(self.head_dim))
            .saturating_mul(u64::from(self.dtype.bytes()))
    }

    /// Bytes of one whole block: layers x 2 (K and V) x segment.
    pub fn block_bytes(&self) -> u64 {
        (u64::from(self.num_layers) * 2).saturating_mul(self.segment_bytes())
    }
}

/// Everything that binds a block key. Equal namespaces give equal keys for equal tokens.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Namespace {
    /// Model identity, e.g. `meta-llama/Llama-3.1-8B-Instruct@<revision>`.
    pub model_id: String,
    pub layout: KvLayout,
    /// A tenant's secret salt: tenants with different salts never share blocks, and without the
    /// salt no one can compute (or collide with) that tenant's keys.
    pub tenant_salt: Option<Vec<u8>>,
    /// LoRA / adapter identity.
    pub adapter_id: Option<String>,
    /// Extra key bytes, e.g. hashes of multimodal inputs.
    pub extra: Option<Vec<u8>>,
}

impl fmt::Debug for Namespace {
    // The salt is a secret: never print it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Namespace")
            .field("model_id", &self.model_id)
            .field("layout", &self.layout)
            .field("tenant_salt", &self.tenant_salt.as_ref().map(|_| "<secret>"))
            .field("adapter_id", &self.adapter_id)
            .field("extra", &self.extra.as_ref().map(hex::encode))
            .finish()
    }
}

/// The 32-byte secret root of every key chain of a namespace (the BLAKE3 key).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct NamespaceFingerprint(pub [u8; 32]);

impl fmt::Debug for NamespaceFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Printing the fingerprint would let a reader forge keys of a salted tenant.
        f.write_str("NamespaceFingerprint(<secret>)")
    }
}

/// A public 16-byte name of a namespace, safe to log, export and compare across processes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NamespaceId(pub [u8; 16]);

impl fmt::Debug for NamespaceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NamespaceId({self})")
    }
}

impl fmt::Display for NamespaceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    // Lengths are u32: a longer field is rejected by `validate` before encoding.
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

fn put_opt(out: &mut Vec<u8>, b: Option<&[u8]>) {
    match b {
        None => out.push(0),
        Some(b) => {
            out.push(1);
            put_bytes(out, b);
        }
    }
}

impl Namespace {
    /// A namespace with no salt, adapter or extra bytes.
    pub fn new(model_id: impl Into<String>, layout: KvLayout) -> Self {
        Self { model_id: model_id.into(), layout, tenant_salt: None, adapter_id: None, extra: None }
    }

    /// Checks the layout and field sizes.
    pub fn validate(&self) -> Result<(), ProtoError> {
        self.layout.validate()?;
        if self.model_id.is_empty() {
            return Err(ProtoError::InvalidNamespace { field: "model_id", reason: "must not be empty".into() });
        }
        let too_long = |n: usize| n > u32::MAX as usize;
        if too_long(self.model_id.len())
            || self.tenant_salt.as_ref().is_some_and(|s| too_long(s.len()))
            || self.adapter_id.as_ref().is_some_and(|s| too_long(s.len()))
            || self.extra.as_ref().is_some_and(|s| too_long(s.len()))
        {
            return Err(ProtoError::InvalidNamespace {
                field: "namespace",
                reason: "a field is longer than 2^32-1 bytes".into(),
            });
        }
        Ok(())
    }

    /// The canonical encoding (docs/block-keys.md, "Namespace encoding"). Call
    /// [`Namespace::validate`] first on any namespace that crossed a process boundary: a field
    /// longer than 2^32-1 bytes cannot be encoded.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let l = &self.layout;
        let mut out = Vec::with_capacity(64 + self.model_id.len());
        out.push(ENCODING_VERSION);
        put_bytes(&mut out, self.model_id.as_bytes());
        for v in [l.num_layers, l.kv_heads, l.head_dim] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.push(l.dtype.code());
        out.extend_from_slice(&l.tokens_per_block.to_le_bytes());
        out.push(l.kind.code());
        put_opt(&mut out, self.tenant_salt.as_deref());
        put_opt(&mut out, self.adapter_id.as_ref().map(String::as_bytes));
        put_opt(&mut out, self.extra.as_deref());
        out
    }

    /// The secret 32-byte root of this namespace's key chains.
    pub fn fingerprint(&self) -> NamespaceFingerprint {
        NamespaceFingerprint(blake3::derive_key(FINGERPRINT_CONTEXT, &self.canonical_bytes()))
    }

    /// The public id of this namespace.
    pub fn id(&self) -> NamespaceId {
        self.fingerprint().id()
    }

    /// Keys of every full block of `tokens` in this namespace, at its own block size.
    pub fn block_keys(&self, tokens: &[u32]) -> Vec<crate::BlockKey> {
        crate::block_keys(&self.fingerprint(), self.layout.tokens_per_block as usize, tokens)
    }
}

impl NamespaceFingerprint {
    /// The public id derived from this fingerprint (one-way).
    pub fn id(&self) -> NamespaceId {
        let full = blake3::derive_key(ID_CONTEXT, &self.0);
        let mut id = [0u8; 16];
        id.copy_from_slice(&full[..16]);
        NamespaceId(id)
    }
}
