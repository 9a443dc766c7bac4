"""An SGLang engine (kvcached's HiCache backend, page order "vllm") and a vLLM engine (the
connector with `kvcached.key_scheme: "sglang"`) of the same model share blocks both ways
through one daemon, byte for byte: SGLang keys pages by its own page hashes, the daemon derives
the same hashes from the vLLM request's tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from sglang_harness import (  # noqa: E402
    MLA_DIM, backend, fill_pages, mha_pool, mla_pool, page_bytes, page_hashes, vllm_order,
)  # fmt: skip
from vllm_harness import BLOCK, EOS, SPEC, request  # noqa: E402

MODEL = "shared-tiny-llama"
SHARED = {"kvcached.key_scheme": "sglang", "kvcached.model_id": MODEL}


def finish(e, rid: str) -> None:
    for _ in range(4):
        if rid not in e.scheduler.requests:
            return
        e.step(token=EOS)


def vllm_pages(e, blocks: list[int], n: int) -> list[list[bytes]]:
    """Blocks of the vLLM engine as its LBNHC layout holds each layer's page: `[tokens, heads,
    K|V]` (the logical [heads, tokens, K|V] view, permuted)."""
    return [[kv[b].permute(1, 0, 2).contiguous().view(torch.uint8).numpy().tobytes() for kv in e.kv.values()]
            for b in blocks[:n]]  # fmt: skip


def sglang(own_daemon):
    pool = mha_pool("layer_first", "shm", heads=SPEC.num_kv_heads, dim=SPEC.head_size, page=BLOCK, device_tokens=256)
    return pool, backend(pool, own_daemon.socket, model=MODEL, **{"kvcached.page_order": "vllm"})


def test_vllm_saves_and_sglang_loads(own_daemon, make_engine):
    e = make_engine(own_daemon.socket, prefix_caching=False, layout="LBNHC", extra=SHARED)
    prompt = list(range(300, 300 + 3 * BLOCK + 2))
    e.add(request("V1", prompt))
    e.step()
    blocks = e.scheduler.kv_cache_manager.get_blocks("V1").get_block_ids()[0]
    want = vllm_pages(e, blocks, 3)
    finish(e, "V1")
    pool, b = sglang(own_daemon)
    keys = page_hashes(prompt, BLOCK)
    assert b.batch_exists(keys) == 3
    idx = pool.alloc(3 * BLOCK)
    assert b.batch_get_v1(keys, idx) == [True] * 3
    assert vllm_order(pool, idx, 3) == want


def test_sglang_saves_and_vllm_loads(own_daemon, make_engine):
    pool, b = sglang(own_daemon)
    prompt = list(range(700, 700 + 2 * BLOCK + 9))
    idx = fill_pages(pool, 2, seed=11)
    assert b.batch_set_v1(page_hashes(prompt, BLOCK), idx) == [True, True]
    e = make_engine(own_daemon.socket, prefix_caching=False, layout="LBNHC", extra=SHARED)
    e.add(request("V2", prompt))
    out, _ = e.step()
    assert [(t.first_block, len(t.slots)) for t in out.kv_connector_metadata.loads] == [(0, 2)]
    assert out.num_scheduled_tokens["V2"] == len(prompt) - 2 * BLOCK
    blocks = e.scheduler.kv_cache_manager.get_blocks("V2").get_block_ids()[0]
    assert vllm_pages(e, blocks, 2) == vllm_order(pool, idx, 2)
    finish(e, "V2")


def test_other_page_bytes_are_never_shared(own_daemon, make_engine):
    """SGLang's own page order, and vLLM's CPU layout (LBHNC, another byte order), are other
    bytes: nothing is shared, and the connector refuses the scheme on a layout it cannot share."""
    pool = mha_pool("layer_first", "shm", heads=SPEC.num_kv_heads, dim=SPEC.head_size, page=BLOCK, device_tokens=256)
    b = backend(pool, own_daemon.socket, model=MODEL)  # page order "sglang"
    prompt = list(range(900, 900 + 2 * BLOCK))
    assert b.batch_set_v1(page_hashes(prompt, BLOCK), fill_pages(pool, 2, seed=12)) == [True, True]
    e = make_engine(own_daemon.socket, prefix_caching=False, layout="LBNHC", extra=SHARED)
    e.add(request("V3", prompt + [1]))
    out, _ = e.step()
    assert not out.kv_connector_metadata.loads
    finish(e, "V3")
    with pytest.raises(NotImplementedError, match="LBHNC"):
        make_engine(own_daemon.socket, layout="LBHNC", extra=SHARED)


def test_mla_latents_are_shared_both_ways(own_daemon, make_engine):
    """An MLA latent is the same bytes in both engines (each layer's page `[tokens, latent]`):
    a vLLM engine's saved latents load into SGLang's MLA pool, and SGLang's into vLLM's."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=MLA_DIM, dtype=torch.bfloat16)
    e = make_engine(own_daemon.socket, prefix_caching=False, layout="LBNHC", spec=spec, extra=SHARED)
    pool = mla_pool("layer_first", "shm", page=BLOCK, device_tokens=256)
    b = backend(pool, own_daemon.socket, mla=True, model=MODEL, **{"kvcached.page_order": "vllm"})
    assert b.in_place  # MLA pages have one order: the pool's own pages are the stored bytes

    prompt = list(range(1300, 1300 + 2 * BLOCK + 3))
    e.add(request("M1", prompt))
    e.step()
    blocks = e.scheduler.kv_cache_manager.get_blocks("M1").get_block_ids()[0]
    want = [b"".join(layer) for layer in vllm_pages(e, blocks, 2)]
    finish(e, "M1")
    keys = page_hashes(prompt, BLOCK)
    idx = pool.alloc(2 * BLOCK)
    assert b.batch_exists(keys) == 2 and b.batch_get_v1(keys, idx) == [True, True]
    assert page_bytes(pool, idx, 2) == want

    other = list(range(1700, 1700 + 2 * BLOCK + 5))
    src = fill_pages(pool, 2, seed=13)
    assert b.batch_set_v1(page_hashes(other, BLOCK), src) == [True, True]
    e.add(request("M2", other))
    out, _ = e.step()
    assert [(t.first_block, len(t.slots)) for t in out.kv_connector_metadata.loads] == [(0, 2)]
    blocks = e.scheduler.kv_cache_manager.get_blocks("M2").get_block_ids()[0]
    assert [b"".join(layer) for layer in vllm_pages(e, blocks, 2)] == page_bytes(pool, src, 2)
    finish(e, "M2")
