//! A request's key context as routing requests carry it (JSON over HTTP, the same fields over
//! gRPC): what its engine's keys bind besides the tokens (`docs/block-keys.md` section 6), so
//! that a request with an adapter, a cache salt or images is placed by the keys its engine
//! saves.

use kvproto::{Adapter, KeyContext, MmInput};
use serde::{Deserialize, Serialize};

use crate::error::CoreError;

/// A multimodal input: its content hash (hex) and placeholder range.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MmSpec {
    pub hash_hex: String,
    pub offset: u32,
    pub length: u32,
}

/// One block's extra bytes (hex).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockExtraSpec {
    pub block: u32,
    pub data_hex: String,
}

/// `context` of a route request. Every field is optional; an empty context is none.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContextSpec {
    #[serde(default)]
    pub adapter_name: Option<String>,
    #[serde(default)]
    pub adapter_hash_hex: Option<String>,
    #[serde(default)]
    pub cache_salt_hex: Option<String>,
    #[serde(default)]
    pub mm: Vec<MmSpec>,
    #[serde(default)]
    pub block_extras: Vec<BlockExtraSpec>,
}

fn unhex(field: &str, h: &str) -> Result<Vec<u8>, CoreError> {
    hex::decode(h).map_err(|e| CoreError::Invalid(format!("context.{field}: {e}")))
}

impl ContextSpec {
    /// The validated key context (`None` when it adds nothing).
    pub fn resolve(&self) -> Result<Option<KeyContext>, CoreError> {
        let adapter_hash = self.adapter_hash_hex.as_deref().map(|h| unhex("adapter_hash_hex", h)).transpose()?;
        let adapter = match (&self.adapter_name, adapter_hash) {
            (Some(name), hash) => Some(Adapter { name: name.clone(), content_hash: hash.unwrap_or_default() }),
            (None, Some(h)) if !h.is_empty() => {
                return Err(CoreError::Invalid("context.adapter_hash_hex given without an adapter_name".into()));
            }
            (None, _) => None,
        };
        let cache_salt = self.cache_salt_hex.as_deref().map(|h| unhex("cache_salt_hex", h)).transpose()?;
        let mm = self
            .mm
            .iter()
            .map(|m| Ok(MmInput { hash: unhex("mm.hash_hex", &m.hash_hex)?, offset: m.offset, length: m.length }))
            .collect::<Result<Vec<_>, CoreError>>()?;
        let block_extras = self
            .block_extras
            .iter()
            .map(|b| Ok((b.block, unhex("block_extras.data_hex", &b.data_hex)?)))
            .collect::<Result<Vec<_>, CoreError>>()?;
        let ctx = KeyContext { adapter, cache_salt, mm, block_extras };
        ctx.validate()?;
        Ok((!ctx.is_empty()).then_some(ctx))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn json_contexts_resolve_and_bad_ones_name_their_field() {
        let ok: ContextSpec = serde_json::from_str(
            r#"{"adapter_name": "sql", "adapter_hash_hex": "0102", "cache_salt_hex": "61",
                "mm": [{"hash_hex": "ff", "offset": 4, "length": 8}]}"#,
        )
        .unwrap();
        let ctx = ok.resolve().unwrap().unwrap();
        assert_eq!(ctx.adapter.unwrap().content_hash, vec![1, 2]);
        assert_eq!(ContextSpec::default().resolve().unwrap(), None);
        for (json, field) in [
            (r#"{"cache_salt_hex": "zz"}"#, "cache_salt_hex"),
            (r#"{"adapter_hash_hex": "01"}"#, "adapter_name"),
            (r#"{"mm": [{"hash_hex": "01", "offset": 4, "length": 0}]}"#, "mm.length"),
        ] {
            let e = serde_json::from_str::<ContextSpec>(json).unwrap().resolve().unwrap_err();
            assert!(e.to_string().contains(field), "{json}: {e}");
        }
        assert!(serde_json::from_str::<ContextSpec>(r#"{"lora": "x"}"#).is_err());
    }
}
