"""SGLang 0.5.x's own host KV pools on CPU, and kvcached's HiCache backend made the way SGLang
makes it.

SGLang is importable where $KVCACHED_SGLANG_PATH names a directory holding it (scripts/test
installs it there, without dependencies, beside vLLM's environment, whose torch it shares).
The backend is created by SGLang's `StorageBackendFactory.create_backend("dynamic", ...)` and
then given the host pool with `register_mem_pool_host`, as `HiCacheController` does; pages then
move as the controller moves them. In sglang 0.5.23's sglang/srt/managers/cache_controller.py:
- 614-617: `create_backend(storage_backend, self.storage_config, self.storage_host_pool)`, then
  `register_mem_pool_host(self.storage_host_pool)`;
- 664: a dynamic backend with `interface_v1` gets the zero-copy page functions;
- 1323: the prefetch's hit query, `batch_exists(batch_hashes, extra_info)`;
- 1113 `_page_get_zero_copy`: `batch_get_v1(hash_values, host_indices, extra_info)`, the leading
  run of True counted; 1410 `_page_set_zero_copy`: `all(batch_set_v1(...))`;
- 1130 `_generic_page_get`: `batch_get(hash_values, [get_dummy_flat_data_page() ...])`, then
  `set_from_flat_data_page` up to the first None; 1403 `_generic_page_set`:
  `batch_set(hash_values, [get_data_page(host_indices[i * page_size]) ...])`;
`host_indices` holds `page_size` token slots per key.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

SGLANG = os.environ.get("KVCACHED_SGLANG_PATH")
if not SGLANG:
    pytest.skip("KVCACHED_SGLANG_PATH is not set", allow_module_level=True)
sys.path.append(SGLANG)
# SGLang's native page hash is built on first use with ninja (installed beside SGLang).
os.environ["PATH"] = f"{os.path.join(SGLANG, 'bin')}:{os.environ.get('PATH', '')}"

import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

LAYERS, HEADS, DIM, PAGE, DEVICE_TOKENS = 2, 2, 8, 4, 64
MLA_DIM = 16


def mha_pool(
    layout: str,
    allocator: str = "default",
    dtype: Any = torch.bfloat16,
    heads: int = HEADS,
    dim: int = DIM,
    page: int = PAGE,
    device_tokens: int = DEVICE_TOKENS,
) -> Any:
    """SGLang's MHA host pool over CPU "device" buffers (no GPU: pin_memory off)."""
    k = tuple(torch.zeros(device_tokens, heads, dim, dtype=dtype) for _ in range(LAYERS))
    v = tuple(torch.zeros(device_tokens, heads, dim, dtype=dtype) for _ in range(LAYERS))
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k,
            v=v,
            k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
            v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
            layout=KVBufferLayout.NHD,
        ),
        page_size=page,
        head_num=heads,
        head_dim=dim,
        v_head_dim=dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info, host_to_device_ratio=2.0, host_size=0, page_size=page, layout=layout, pin_memory=False,
        device="cpu", device_capacity_tokens=device_tokens, start_layer=0, end_layer=LAYERS - 1,
        allocator_type=allocator,
    )  # fmt: skip


def mla_pool(
    layout: str,
    allocator: str = "default",
    dtype: Any = torch.bfloat16,
    page: int = PAGE,
    device_tokens: int = DEVICE_TOKENS,
) -> Any:
    """SGLang's MLA host pool (a 16-wide latent: 12 + 4 rope) over CPU buffers."""
    bufs = tuple(torch.zeros(device_tokens, 1, MLA_DIM, dtype=dtype) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=bufs,
        data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(LAYERS)),
        device_layer_num=LAYERS,
        page_size=page,
        kv_lora_rank=12,
        qk_rope_head_dim=4,
        kv_cache_dim=MLA_DIM,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(
        info, 2.0, 0, page, layout, pin_memory=False, device="cpu", device_capacity_tokens=device_tokens,
        start_layer=0, end_layer=LAYERS - 1, target_layer_num=LAYERS, allocator_type=allocator,
    )  # fmt: skip


def storage_config(
    socket: str,
    *,
    mla: bool = False,
    tp: tuple[int, int] = (0, 1),
    model: str = "test/sglang-model",
    metrics: bool = False,
    **extra: Any,
) -> Any:
    return HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=metrics, is_page_first_layout=False, model_name=model,
        extra_config={
            "backend_name": "kvcached", "module_path": "kvcached.sglang", "class_name": "KvcachedStorage",
            "interface_v1": 1, "kvcached.socket": socket, **extra,
        },
    )  # fmt: skip


def backend(pool: Any, socket: str, **kw: Any) -> Any:
    """kvcached's backend as SGLang's controller makes it: the factory, then the host pool."""
    b = StorageBackendFactory.create_backend("dynamic", storage_config(socket, **kw), pool)
    b.register_mem_pool_host(pool)
    return b


def page_hashes(tokens: list[int], page: int = PAGE) -> list[str]:
    """SGLang's own storage keys of the full pages of `tokens` (its native SHA-256 chain)."""
    from sglang.srt.mem_cache.utils import get_hash_str

    full = tokens[: len(tokens) // page * page]
    return list(get_hash_str(full, None, page_size=page))


def fill_pages(pool: Any, n: int, seed: int) -> torch.Tensor:
    """Allocates `n` pages of `pool`, writes random bytes into each, and returns their token
    indices (`page_size` per page, as the controller passes `host_indices`)."""
    p = pool.page_size
    idx = pool.alloc(n * p)
    assert idx is not None and len(idx) == n * p
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        flat = pool.get_dummy_flat_data_page()
        pool.set_from_flat_data_page(int(idx[i * p]), torch.randn(flat.shape, generator=g).to(flat.dtype))
    return idx


def page_bytes(pool: Any, idx: torch.Tensor, n: int) -> list[bytes]:
    """Each page's bytes as SGLang's own accessor flattens it (whatever the layout)."""
    p = pool.page_size
    return [
        pool.get_data_page(int(idx[i * p]), flat=True).contiguous().view(torch.uint8).numpy().tobytes()
        for i in range(n)
    ]


def vllm_order(pool: Any, idx: torch.Tensor, n: int) -> list[list[bytes]]:
    """Each page of a layer_first MHA pool as vLLM 0.33 holds it, per layer: `[tokens, heads,
    K|V]` (K and V of a head side by side)."""
    p = pool.page_size
    kv = pool.kv_buffer  # (2, L, S, H, D)
    out = []
    for i in range(n):
        at = int(idx[i * p])
        page = kv[:, :, at : at + p]  # (2, L, P, H, D)
        per_layer = page.permute(1, 2, 3, 0, 4).contiguous()  # (L, P, H, 2, D)
        out.append([per_layer[layer].view(torch.uint8).numpy().tobytes() for layer in range(per_layer.shape[0])])
    return out
