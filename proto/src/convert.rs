//! Conversions between the gRPC messages and the typed vocabulary, with validation: every
//! namespace that crosses a process boundary goes through here.

use crate::pb;
use crate::{Adapter, KeyContext, KvLayout, MmInput, Namespace, ProtoError};

impl TryFrom<&pb::Layout> for KvLayout {
    type Error = ProtoError;
    fn try_from(l: &pb::Layout) -> Result<Self, ProtoError> {
        let layout = KvLayout::from_names(l.num_layers, l.kv_heads, l.head_dim, &l.dtype, l.tokens_per_block, &l.kind)?;
        layout.validate()?;
        Ok(layout)
    }
}

impl From<&KvLayout> for pb::Layout {
    fn from(l: &KvLayout) -> Self {
        pb::Layout {
            num_layers: l.num_layers,
            kv_heads: l.kv_heads,
            head_dim: l.head_dim,
            dtype: l.dtype.name().to_string(),
            tokens_per_block: l.tokens_per_block,
            kind: l.kind.name().to_string(),
        }
    }
}

impl TryFrom<&pb::NamespaceSpec> for Namespace {
    type Error = ProtoError;
    fn try_from(s: &pb::NamespaceSpec) -> Result<Self, ProtoError> {
        let layout =
            s.layout.as_ref().ok_or(ProtoError::InvalidNamespace { field: "layout", reason: "is missing".into() })?;
        let ns = Namespace {
            model_id: s.model_id.clone(),
            layout: KvLayout::try_from(layout)?,
            tenant_salt: s.tenant_salt.clone(),
            adapter_id: s.adapter_id.clone(),
            extra: s.extra.clone(),
        };
        ns.validate()?;
        Ok(ns)
    }
}

impl From<&Namespace> for pb::NamespaceSpec {
    fn from(n: &Namespace) -> Self {
        pb::NamespaceSpec {
            model_id: n.model_id.clone(),
            layout: Some(pb::Layout::from(&n.layout)),
            tenant_salt: n.tenant_salt.clone(),
            adapter_id: n.adapter_id.clone(),
            extra: n.extra.clone(),
        }
    }
}

impl TryFrom<&pb::KeyContext> for KeyContext {
    type Error = ProtoError;
    fn try_from(c: &pb::KeyContext) -> Result<Self, ProtoError> {
        if c.adapter_name.is_empty() && !c.adapter_hash.is_empty() {
            return Err(ProtoError::InvalidContext {
                field: "adapter_hash",
                reason: "given without an adapter_name".into(),
            });
        }
        let ctx = KeyContext {
            adapter: (!c.adapter_name.is_empty())
                .then(|| Adapter { name: c.adapter_name.clone(), content_hash: c.adapter_hash.clone() }),
            cache_salt: c.cache_salt.clone(),
            mm: c.mm.iter().map(|m| MmInput { hash: m.hash.clone(), offset: m.offset, length: m.length }).collect(),
            block_extras: c.block_extras.iter().map(|b| (b.block, b.data.clone())).collect(),
        };
        ctx.validate()?;
        Ok(ctx)
    }
}

impl From<&KeyContext> for pb::KeyContext {
    fn from(c: &KeyContext) -> Self {
        pb::KeyContext {
            adapter_name: c.adapter.as_ref().map(|a| a.name.clone()).unwrap_or_default(),
            adapter_hash: c.adapter.as_ref().map(|a| a.content_hash.clone()).unwrap_or_default(),
            cache_salt: c.cache_salt.clone(),
            mm: c.mm.iter().map(|m| pb::MmInput { hash: m.hash.clone(), offset: m.offset, length: m.length }).collect(),
            block_extras: c.block_extras.iter().map(|(b, d)| pb::BlockExtra { block: *b, data: d.clone() }).collect(),
        }
    }
}

impl TryFrom<&pb::EngineHashes> for crate::EngineHashes {
    type Error = ProtoError;
    fn try_from(h: &pb::EngineHashes) -> Result<Self, ProtoError> {
        let e = crate::EngineHashes { scheme: crate::HashScheme::parse(&h.scheme)?, hashes: h.hashes.clone() };
        e.validate()?;
        Ok(e)
    }
}

impl From<&crate::EngineHashes> for pb::EngineHashes {
    fn from(h: &crate::EngineHashes) -> Self {
        pb::EngineHashes { scheme: h.scheme.name().to_string(), hashes: h.hashes.clone() }
    }
}

/// What a request's keys are made of: its key context or its engine hashes (never both).
pub fn key_source(
    context: Option<&pb::KeyContext>,
    hashes: Option<&pb::EngineHashes>,
) -> Result<crate::KeySource, ProtoError> {
    let ctx = key_context(context)?;
    match (ctx, hashes) {
        (Some(_), Some(_)) => Err(ProtoError::InvalidContext {
            field: "engine_hashes",
            reason: "given beside a key context: an engine's hashes already bind what its KV depends on".into(),
        }),
        (None, Some(h)) => Ok(crate::KeySource::Hashes(crate::EngineHashes::try_from(h)?)),
        (Some(c), None) => Ok(crate::KeySource::Context(c)),
        (None, None) => Ok(crate::KeySource::Plain),
    }
}

/// The key context a request carries: `None` when absent or empty (the plain chain).
pub fn key_context(c: Option<&pb::KeyContext>) -> Result<Option<KeyContext>, ProtoError> {
    match c {
        None => Ok(None),
        Some(c) => {
            let ctx = KeyContext::try_from(c)?;
            Ok((!ctx.is_empty()).then_some(ctx))
        }
    }
}
