//! Block keys from an engine's own page hashes (`docs/block-keys.md` section 7).
//!
//! Two doors into the node cache never see a request's tokens, only the hashes their engine
//! computed of each page: SGLang's HiCache storage backends (a SHA-256 chain over each page's
//! token ids) and vLLM's native KV offloading tiers (vLLM's block hashes). Their blocks are keyed
//! by those hashes, each bound to the namespace and to the hash's **scheme**:
//!
//! ```text
//! hash_key = BLAKE3-derive_key("kvcached 2026-12-06 engine page hash v1", fingerprint)
//! key_i    = first16(BLAKE3-keyed(hash_key, str(scheme) || bytes(hash_i)))
//! ```
//!
//! The key is a different PRF key from any token chain's, so an engine hash never names a block
//! saved by tokens, and a hash of one scheme never names another scheme's block. The engine's
//! hashes already chain their prefix, so each key stands alone.
//!
//! SGLang's scheme is a function of the tokens ([`sglang_page_hashes_le`]): a request that
//! carries tokens may ask for its keys in that scheme, which is how a vLLM engine finds the
//! blocks an SGLang engine of the same model and layout saved, and the other way round.

use crate::{BlockKey, NamespaceFingerprint, ProtoError};

/// Longest engine hash, in bytes.
pub const MAX_ENGINE_HASH: usize = 64;
/// Most hashes in one request (a 16M-token prompt of 16-token pages).
pub const MAX_ENGINE_HASHES: usize = 1 << 20;

const HASH_KEY_CONTEXT: &str = "kvcached 2026-12-06 engine page hash v1";

/// Whose hashes a request's keys are made of.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum HashScheme {
    /// SGLang's storage page hash: `sha256(previous page's digest || tokens_le(page))`, the
    /// first page without a previous digest (`sglang.srt.mem_cache.utils.get_hash_str`).
    Sglang,
    /// vLLM's block hashes as its offloading tiers see them (`OffloadKey`: the block hash and
    /// the KV-cache group). They depend on vLLM's hash function and `PYTHONHASHSEED`, so the
    /// daemon cannot derive them from tokens.
    Vllm,
}

impl HashScheme {
    /// Parses a scheme's name ("sglang", "vllm").
    pub fn parse(name: &str) -> Result<Self, ProtoError> {
        match name {
            "sglang" => Ok(Self::Sglang),
            "vllm" => Ok(Self::Vllm),
            _ => Err(ProtoError::InvalidContext {
                field: "engine_hashes.scheme",
                reason: format!("{name:?} is not a hash scheme (\"sglang\" or \"vllm\")"),
            }),
        }
    }

    /// The scheme's name, as it enters the key.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sglang => "sglang",
            Self::Vllm => "vllm",
        }
    }
}

/// A request's keys as engine hashes: given one per block, or (`hashes` empty) derived from
/// the request's tokens where the scheme is a function of them.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct EngineHashes {
    pub scheme: HashScheme,
    pub hashes: Vec<Vec<u8>>,
}

impl EngineHashes {
    /// Checks the bounds of section 7.
    pub fn validate(&self) -> Result<(), ProtoError> {
        if self.hashes.len() > MAX_ENGINE_HASHES {
            return Err(ProtoError::InvalidContext {
                field: "engine_hashes.hashes",
                reason: format!("{} hashes, at most {MAX_ENGINE_HASHES}", self.hashes.len()),
            });
        }
        if let Some(h) = self.hashes.iter().find(|h| h.is_empty() || h.len() > MAX_ENGINE_HASH) {
            return Err(ProtoError::InvalidContext {
                field: "engine_hashes.hashes",
                reason: format!("a hash of {} bytes (1..={MAX_ENGINE_HASH})", h.len()),
            });
        }
        Ok(())
    }

    /// The keys of the request: of `hashes`, or of the scheme's hashes of `le` (tokens in
    /// wire form, whole tokens) when `hashes` is empty. Refuses tokens beside given hashes,
    /// and a scheme the daemon cannot derive from tokens.
    pub fn keys_le(
        &self,
        fp: &NamespaceFingerprint,
        tokens_per_block: usize,
        le: &[u8],
    ) -> Result<Vec<BlockKey>, ProtoError> {
        self.validate()?;
        if !self.hashes.is_empty() {
            if !le.is_empty() {
                return Err(ProtoError::InvalidContext {
                    field: "engine_hashes.hashes",
                    reason: "given beside tokens: a request names its blocks by one or the other".into(),
                });
            }
            return Ok(engine_hash_keys(fp, self.scheme, &self.hashes));
        }
        match self.scheme {
            HashScheme::Sglang => Ok(engine_hash_keys(fp, self.scheme, &sglang_page_hashes_le(tokens_per_block, le))),
            HashScheme::Vllm => Err(ProtoError::InvalidContext {
                field: "engine_hashes.hashes",
                reason: "empty: vLLM's block hashes depend on its hash function and PYTHONHASHSEED, so \
                         the daemon cannot derive them from tokens; pass them"
                    .into(),
            }),
        }
    }
}

/// What a request's keys are made of besides its namespace: its tokens alone, its tokens with a
/// key context (section 6), or its engine's page hashes (section 7).
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub enum KeySource {
    #[default]
    Plain,
    Context(crate::KeyContext),
    Hashes(EngineHashes),
}

impl KeySource {
    /// The key context, if the keys are a token chain with one.
    pub fn context(&self) -> Option<&crate::KeyContext> {
        match self {
            Self::Context(c) => Some(c),
            _ => None,
        }
    }

    /// Whether the keys are the plain token chain (the key memo's and the prefix probe's).
    pub fn is_plain(&self) -> bool {
        matches!(self, Self::Plain)
    }

    /// Whether the keys are a token chain (plain or with a context), whose blocks chain to
    /// their parents and whose tokens the vLLM export can hash.
    pub fn is_token_chain(&self) -> bool {
        !matches!(self, Self::Hashes(_))
    }
}

/// The PRF key of a namespace's engine-hash keys.
fn hash_key(fp: &NamespaceFingerprint) -> [u8; 32] {
    blake3::derive_key(HASH_KEY_CONTEXT, &fp.0)
}

/// The key of each of `hashes` (scheme `scheme`) in the namespace of `fp`.
pub fn engine_hash_keys<H: AsRef<[u8]>>(fp: &NamespaceFingerprint, scheme: HashScheme, hashes: &[H]) -> Vec<BlockKey> {
    let key = hash_key(fp);
    // One message buffer for every hash: `str(scheme) || bytes(hash)`, one BLAKE3 compression
    // for a 32-byte hash.
    let mut msg = Vec::with_capacity(8 + scheme.name().len() + MAX_ENGINE_HASH);
    put_bytes(&mut msg, scheme.name().as_bytes());
    let at = msg.len();
    hashes
        .iter()
        .map(|h| {
            msg.truncate(at);
            put_bytes(&mut msg, h.as_ref());
            let mut out = [0u8; 16];
            out.copy_from_slice(&blake3::keyed_hash(&key, &msg).as_bytes()[..16]);
            BlockKey(out)
        })
        .collect()
}

/// SGLang's storage hashes of the full pages of `le` (tokens in wire form), pages of
/// `tokens_per_page` tokens: `h_0 = sha256(tokens_le(page 0))`,
/// `h_i = sha256(h_{i-1} || tokens_le(page i))`.
pub fn sglang_page_hashes_le(tokens_per_page: usize, le: &[u8]) -> Vec<[u8; 32]> {
    use sha2::Digest;
    if tokens_per_page == 0 {
        return Vec::new();
    }
    let page_bytes = 4 * tokens_per_page;
    let mut out: Vec<[u8; 32]> = Vec::with_capacity(le.len() / page_bytes);
    for page in le.chunks_exact(page_bytes) {
        let mut h = sha2::Sha256::new();
        if let Some(prev) = out.last() {
            h.update(prev);
        }
        h.update(page);
        out.push(h.finalize().into());
    }
    out
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    // Bounded by the scheme names and MAX_ENGINE_HASH, far below 2^32.
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn fp(b: u8) -> NamespaceFingerprint {
        NamespaceFingerprint([b; 32])
    }

    fn le(n: u32) -> Vec<u8> {
        crate::tokens_to_le(&(0..n).collect::<Vec<_>>()).to_vec()
    }

    #[test]
    fn sglang_hashes_chain_their_prefix() {
        let a = sglang_page_hashes_le(4, &le(12));
        assert_eq!(a.len(), 3);
        // A partial page has no hash; a shared prefix shares its hashes.
        assert_eq!(sglang_page_hashes_le(4, &le(14)), a);
        let mut other = le(12);
        other[0] ^= 1;
        let b = sglang_page_hashes_le(4, &other);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y), "a changed first page changes every hash");
        // The first page's hash is the SHA-256 of its tokens alone.
        use sha2::Digest;
        assert_eq!(a[0], <[u8; 32]>::from(sha2::Sha256::digest(le(4))));
    }

    #[test]
    fn keys_bind_namespace_scheme_and_hash() {
        let h = [vec![1u8; 32], vec![2u8; 32]];
        let k = engine_hash_keys(&fp(1), HashScheme::Sglang, &h);
        assert_ne!(k[0], k[1]);
        assert_ne!(k, engine_hash_keys(&fp(2), HashScheme::Sglang, &h));
        assert_ne!(k, engine_hash_keys(&fp(1), HashScheme::Vllm, &h));
        // Never a token chain's key of the same namespace.
        let toks = crate::block_keys(&fp(1), 8, &(0..16).collect::<Vec<_>>());
        assert!(toks.iter().all(|t| !k.contains(t)));
    }

    #[test]
    fn derived_sglang_keys_equal_given_ones() {
        let hashes = sglang_page_hashes_le(4, &le(8));
        let given = EngineHashes { scheme: HashScheme::Sglang, hashes: hashes.iter().map(|h| h.to_vec()).collect() };
        let derived = EngineHashes { scheme: HashScheme::Sglang, hashes: vec![] };
        assert_eq!(given.keys_le(&fp(3), 4, &[]).unwrap(), derived.keys_le(&fp(3), 4, &le(8)).unwrap());
    }

    #[test]
    fn refusals_name_the_field() {
        let bad = |e: EngineHashes, toks: &[u8]| match e.keys_le(&fp(1), 4, toks) {
            Err(ProtoError::InvalidContext { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(bad(EngineHashes { scheme: HashScheme::Vllm, hashes: vec![] }, &le(8)), "engine_hashes.hashes");
        assert_eq!(bad(EngineHashes { scheme: HashScheme::Vllm, hashes: vec![vec![]] }, &[]), "engine_hashes.hashes");
        assert_eq!(
            bad(EngineHashes { scheme: HashScheme::Vllm, hashes: vec![vec![0; 65]] }, &[]),
            "engine_hashes.hashes"
        );
        assert_eq!(
            bad(EngineHashes { scheme: HashScheme::Sglang, hashes: vec![vec![1]] }, &le(4)),
            "engine_hashes.hashes"
        );
        assert!(matches!(
            HashScheme::parse("lmcache"),
            Err(ProtoError::InvalidContext { field: "engine_hashes.scheme", .. })
        ));
    }
}
