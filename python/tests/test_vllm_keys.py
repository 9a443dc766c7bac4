"""What a vLLM request's key context binds (kvcached/vllm/keys.py), without a scheduler."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvcached.vllm.keys import AdapterHashes, request_context  # noqa: E402


def _adapter(path, weights: bytes) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write('{"r": 8}')
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(weights)
    return str(path)


def _req(**kw):
    base = dict(lora_request=None, cache_salt=None, mm_features=[], prompt_embeds=None)
    return SimpleNamespace(**{**base, **kw})


def test_adapters_are_keyed_by_their_weights_not_their_path(tmp_path):
    h = AdapterHashes()
    a = h.of("sql", _adapter(tmp_path / "a", b"w1"))
    assert h.of("sql", _adapter(tmp_path / "b", b"w1")) == a  # same files elsewhere
    assert h.of("sql", _adapter(tmp_path / "c", b"w2")) != a  # other weights
    # Rewritten in place (another size): hashed again, not served from the memo.
    _adapter(tmp_path / "a", b"w1-retrained")
    assert h.of("sql", str(tmp_path / "a")) != a
    # Not a local directory (a hub id the workers resolve): keyed by the path, as vLLM does.
    assert h.of("sql", "org/sql-lora") == h.of("sql", "org/sql-lora") != h.of("sql", "org/other")


def test_request_contexts():
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    h = AdapterHashes()
    assert request_context(_req(), h, 16) == (None, None)
    ctx, why = request_context(_req(lora_request=LoRARequest("sql", 1, "org/sql"), cache_salt="t"), h, 16)
    assert why is None and ctx.adapter_name == "sql" and ctx.cache_salt == b"t" and len(ctx.adapter_hash) == 32

    def feat(ident, off, n):
        return MultiModalFeatureSpec(
            data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(off, n)
        )

    # Inputs in any order are keyed in token order; a long identifier is hashed to 32 bytes.
    ctx, _ = request_context(_req(mm_features=[feat("b" * 100, 40, 4), feat("a", 2, 3)]), h, 16)
    assert [(m[1], m[2]) for m in ctx.mm] == [(2, 3), (40, 4)] and len(ctx.mm[1][0]) == 32
    assert ctx.make().block_keys  # a valid KeyContext
    _, why = request_context(_req(mm_features=[feat("a", 0, 10), feat("b", 5, 10)]), h, 16)
    assert why and "overlap" in why


def test_prompt_embeddings_are_hashed_per_block():
    import torch

    emb = torch.arange(40 * 4, dtype=torch.float32).reshape(40, 4)
    ctx, _ = request_context(_req(prompt_embeds=emb), AdapterHashes(), 16)
    assert [b for b, _ in ctx.block_extras] == [0, 1]  # full blocks only
    other = emb.clone()
    other[20, 0] = -1
    ctx2, _ = request_context(_req(prompt_embeds=other), AdapterHashes(), 16)
    assert ctx.block_extras[0] == ctx2.block_extras[0] and ctx.block_extras[1] != ctx2.block_extras[1]
