"""vLLM 0.33's attention specs, as far as kvcached's worker half reads them: a plain
full-attention page of `block_size` tokens x `num_kv_heads` x (K of `head_size` + V of
`head_size_v`) elements of `dtype`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch


class KVQuantMode(IntEnum):
    NONE = 0
    FP8_PER_TENSOR = 1


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    head_size_v: int = None  # type: ignore[assignment]
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
    page_size_padded: int | None = None
    num_head_slots: int | None = None
    state_content_bytes: int | None = None
    tokens_per_state: int = 1
    max_tp_shards: int | None = None

    def __post_init__(self):
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    @property
    def real_page_size_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_heads * self.block_size * (self.head_size + self.head_size_v) * itemsize

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.real_page_size_bytes


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int
    extra_retained_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    pass
