//! Conversions between the gRPC messages and the typed vocabulary, with validation: every
//! namespace that crosses a process boundary goes through here.

use crate::pb;
use crate::{KvLayout, Namespace, ProtoError};

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
