//! Small fixtures the integration tests share: the two-layer KV layout most of them use.

use kvproto::{Dtype, KvLayout, LayoutKind};

/// 2 layers x 2 KV heads x 64 dims, bf16, 16 tokens a block, layer-separate: 8 KiB blocks.
pub fn small_layout() -> KvLayout {
    KvLayout {
        num_layers: 2,
        kv_heads: 2,
        head_dim: 64,
        dtype: Dtype::Bf16,
        tokens_per_block: 16,
        kind: LayoutKind::LayerSeparate,
    }
}
