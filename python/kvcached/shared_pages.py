"""The namespace engines of different kinds share KV in: SGLang's HiCache backend and vLLM's
connector with `kvcached.key_scheme: "sglang"`.

Blocks are shared only where their bytes are the same, so the namespace names the bytes, not
the engine: the model, the layers, KV heads and head size of this tensor-parallel rank, the
element type, the tokens per page, whether the page is attention K and V or an MLA latent, and
the order of a page's bytes. A block is its layers' pages one after another; a layer's page is
- order "vllm": `[tokens, heads, K|V]`, as vLLM 0.33 holds a full-attention page in its
  LBNHC and BLNHC layouts (the CUDA backends');
- order "sglang": the K page `[tokens, heads, head_dim]`, then the V page, as SGLang's host
  pools hold them;
- MLA (one order): `[tokens, kv_lora_rank + qk_rope_head_dim]`, in both engines.
"""

from __future__ import annotations

import json
from typing import Literal

import kvcached

# torch element type names -> kvcached dtype names.
DTYPES = {
    "torch.bfloat16": "bf16",
    "torch.float16": "f16",
    "torch.float32": "f32",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e5m2": "fp8_e5m2",
    "torch.int8": "int8",
    "torch.uint8": "int8",
}

Attention = Literal["mha", "mla"]


def dtype_name(dtype: object) -> str:
    """kvcached's name of a torch dtype; ValueError for one it cannot store."""
    name = DTYPES.get(str(dtype))
    if name is None:
        raise ValueError(f"a KV element type kvcached does not store: {dtype}")
    return name


def shared_namespace(
    model_id: str,
    *,
    attention: Attention,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: object,
    page_size: int,
    order: str,
    tp_rank: int,
    tp_size: int,
    tenant_salt: bytes | None = None,
    user: str = "",
) -> kvcached.Namespace:
    """The namespace of one rank's pages. For MHA `kv_heads` and `head_dim` are the rank's own
    (its shard of the heads); for MLA `head_dim` is the latent's width (`kv_lora_rank +
    qk_rope_head_dim`), the same on every rank, so every rank is the one shard 0/1 and the
    blocks are stored once. `order` is the MHA page's byte order ("vllm" or "sglang"; "mla" for
    MLA)."""
    name = dtype_name(dtype)
    if attention == "mla":
        itemsize = kvcached.KvLayout(1, 1, 1, name, tokens_per_block=1).segment_bytes
        page = page_size * head_dim * itemsize
        if page % 2:
            raise ValueError(f"an MLA page of {page} bytes cannot be cut in two halves")
        # The latent page as bytes, in two halves per layer (as the vLLM connector keeps MLA).
        layout = kvcached.KvLayout(num_layers, 1, page // (2 * page_size), "int8", page_size)
        tp_rank, tp_size, order = 0, 1, "mla"
    elif attention == "mha":
        if order not in ("vllm", "sglang"):
            raise ValueError(f"an MHA page's order is 'vllm' or 'sglang', not {order!r}")
        layout = kvcached.KvLayout(num_layers, kv_heads, head_dim, name, page_size)
    else:
        raise ValueError(f"attention must be 'mha' or 'mla', not {attention!r}")
    extra = (
        f"kv-pages-v1;attention={attention};order={order};dtype={dtype};head_dim={head_dim};"
        f"tp={tp_rank}/{tp_size};user={user}"
    )
    return kvcached.Namespace(model_id, layout, tenant_salt=tenant_salt, extra=extra.encode())


def router_namespace(name: str, ns: kvcached.Namespace, tenant_salt: bytes | None = None) -> str:
    """The kvrouter `[[namespaces]]` entry (TOML) that routes requests by their tokens to the
    blocks saved in `ns` by SGLang's page hashes (`key_scheme = "sglang-pages-v1"`: the router
    derives the same hashes; docs/router.md). `tenant_salt` must be the salt `ns` was made
    with (a namespace does not give its salt back)."""
    if ns.has_tenant_salt != (tenant_salt is not None):
        raise ValueError("tenant_salt must be given exactly when the namespace has one")
    lay = ns.layout
    lines = [
        "[[namespaces]]",
        f"name = {json.dumps(name)}",
        f"model_id = {json.dumps(ns.model_id)}",
        f"num_layers = {lay.num_layers}",
        f"kv_heads = {lay.kv_heads}",
        f"head_dim = {lay.head_dim}",
        f'dtype = "{lay.dtype}"',
        f"tokens_per_block = {lay.tokens_per_block}",
        f'layout_kind = "{lay.kind}"',
        'key_scheme = "sglang-pages-v1"',
    ]
    if ns.extra:
        lines.append(f'extra_hex = "{ns.extra.hex()}"')
    if tenant_salt is not None:
        lines.append(f'tenant_salt_hex = "{tenant_salt.hex()}"')
    return "\n".join(lines) + "\n"
