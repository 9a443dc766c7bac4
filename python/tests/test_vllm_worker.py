"""The connector's worker half on KV tensors laid out as vLLM 0.33 lays them out (its own planner
and allocator, on the CPU), for each physical layout it supports, against a real daemon."""

from __future__ import annotations

from array import array

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm_harness import BLOCK, LAYERS  # noqa: E402

from kvcached.vllm import KvcachedConnectorMetadata, Transfer  # noqa: E402


def run_step(e, meta: KvcachedConnectorMetadata) -> tuple[set[int], object]:
    """One worker step as vLLM's model runner makes it, without a model."""
    w = e.worker
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    for name in LAYERS:
        w.wait_for_layer_load(name)
        w.save_kv_layer(name, e.kv[name], None)
    w.wait_for_save()
    res = w.get_transfer_results(set())
    invalid = w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()
    return invalid, res


def fill(e, block: int, seed: int) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for name in LAYERS:
        page = e.kv[name][block].view(torch.uint8)
        page.copy_(torch.randint(0, 256, page.shape, generator=g, dtype=torch.uint8))
        out.append(e.kv[name][block].contiguous().view(torch.uint8).numpy().tobytes())
    return out


TOKENS = array("I", range(500, 500 + 4 * BLOCK))


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC", "LHBNC", "BHLNC"])
def test_blocks_round_trip_in_each_layout(daemon, make_engine, layout):
    extra = {"kvcached.namespace_extra": f"worker-{layout}"}
    a = make_engine(daemon.socket, extra=extra, layout=layout)
    b = make_engine(daemon.socket, extra=extra, layout=layout)
    wa = a.worker.worker
    # vLLM's tensors are kvcached's shared memory: the allocation went through our context.
    assert wa.region is not None and all(
        wa.region.tensor.data_ptr() <= a.kv[n].data_ptr() < wa.region.tensor.data_ptr() + wa.region.size for n in LAYERS
    )
    src = [5, 9, 2, 30]
    written = [fill(a, blk, seed=i) for i, blk in enumerate(src[:3])]
    invalid, _ = run_step(a, KvcachedConnectorMetadata(saves=[Transfer("r", TOKENS[: 3 * BLOCK], 0, src[:3])]))
    assert not invalid and wa.counts["saved"] == 3

    dst = [7, 3, 11, 12]
    invalid, _ = run_step(b, KvcachedConnectorMetadata(loads=[Transfer("r", TOKENS, 0, dst)]))
    for i in range(3):
        assert b.block_kv(dst[i]) == written[i], f"block {i} in {layout}"
    # Block 3 was never saved: the load stops there and vLLM is told which block is missing.
    assert invalid == {12}
    assert b.worker.worker.counts == {**b.worker.worker.counts, "loaded": 3, "load_failed": 1}


def _specs():
    """Attention specs as vLLM 0.33's layers make them for each family (the fields vLLM's
    attention layers set; the model's weights are not needed for the KV cache)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MLAAttentionSpec

    return {
        # DeepSeek-V3 / Kimi K2: one latent of kv_lora_rank 512 + qk_rope_head_dim 64 per token.
        "mla": MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
        # --kv-cache-dtype fp8: e4m3 pages with per-tensor scales (in the model, not the page).
        "fp8": FullAttentionSpec(
            block_size=BLOCK,
            num_kv_heads=2,
            head_size=32,
            dtype=torch.float8_e4m3fn,
            kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
        ),  # fmt: skip
        # K and V of different head sizes (e.g. MiniCPM3-style heads).
        "uneven_kv": FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=32, head_size_v=16, dtype=torch.bfloat16
        ),
        # A page padded to a size the hybrid manager chose.
        "padded": FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, page_size_padded=4096 + 512
        ),
    }


@pytest.mark.parametrize("kind", ["mla", "fp8", "uneven_kv", "padded"])
def test_blocks_of_other_attention_specs_round_trip(daemon, make_engine, kind):
    spec = _specs()[kind]
    a = make_engine(daemon.socket, spec=spec)
    b = make_engine(daemon.socket, spec=spec, layout="LBNHC")
    c = make_engine(daemon.socket, spec=spec)
    assert a.worker.worker.namespace.id == c.worker.worker.namespace.id
    src, dst = [3, 8], [20, 21]
    written = [fill(a, blk, seed=40 + i) for i, blk in enumerate(src)]
    invalid, _ = run_step(a, KvcachedConnectorMetadata(saves=[Transfer("s", TOKENS[: 2 * BLOCK], 0, src)]))
    assert not invalid and a.worker.worker.counts["saved"] == 2
    invalid, _ = run_step(c, KvcachedConnectorMetadata(loads=[Transfer("s", TOKENS[: 2 * BLOCK], 0, dst)]))
    assert not invalid and [c.block_kv(d) for d in dst] == written
    # Another byte order of the same spec is another namespace (for MLA, where heads are one,
    # the two orders are the same bytes but vLLM's layout name still tells them apart).
    invalid, _ = run_step(b, KvcachedConnectorMetadata(loads=[Transfer("s", TOKENS[: 2 * BLOCK], 0, dst)]))
    assert invalid == set(dst)


def test_specs_never_share_blocks(daemon, make_engine):
    ids = {kind: make_engine(daemon.socket, spec=spec).worker.worker.namespace.id for kind, spec in _specs().items()}
    ids["bf16"] = make_engine(daemon.socket).worker.worker.namespace.id
    assert len(set(ids.values())) == len(ids), ids


def test_mla_blocks_are_stored_once_for_every_tensor_parallel_rank(model_dir):
    from vllm_harness import kv_cache_config, vllm_config

    from kvcached.vllm.config import ConnectorConfig, namespace

    mla, full = _specs()["mla"], _specs()["uneven_kv"]
    ids = {}
    for name, spec in (("mla", mla), ("full", full)):
        cfg = vllm_config("/nonexistent.sock", model_dir=model_dir)
        cfg.parallel_config.tensor_parallel_size = 4
        kcfg = kv_cache_config(cfg, 8, spec)
        cc = ConnectorConfig.from_extra({})
        ids[name] = {namespace(cfg, kcfg, cc, rank, 4).id for rank in range(4)}
    assert len(ids["mla"]) == 1  # every rank holds the same latent: one namespace, saved once
    assert len(ids["full"]) == 4  # every rank holds other heads


def test_layouts_do_not_share_blocks(daemon, make_engine):
    """The same KV in another byte order is another namespace: never loaded as this one."""
    extra = {"kvcached.namespace_extra": "cross-layout"}
    cpu = make_engine(daemon.socket, extra=extra, layout="LBHNC")
    gpu_order = make_engine(daemon.socket, extra=extra, layout="LBNHC")
    assert cpu.worker.worker.namespace.id != gpu_order.worker.worker.namespace.id
    fill(cpu, 1, seed=1)
    run_step(cpu, KvcachedConnectorMetadata(saves=[Transfer("x", TOKENS[:BLOCK], 0, [1])]))
    invalid, _ = run_step(gpu_order, KvcachedConnectorMetadata(loads=[Transfer("x", TOKENS[:BLOCK], 0, [4])]))
    assert invalid == {4}


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_head_split_layouts_register_a_run_per_head(daemon, make_engine, layout):
    """In LHBNC (ROCm's attention) and BHLNC a layer's page of a block is one run per head, the
    runs apart by the blocks (or the layers) between them: each head's run is two segments, and
    the namespace counts the runs as its layers (its layout name keeps it apart)."""
    e = make_engine(daemon.socket, layout=layout)
    w = e.worker.worker
    heads = e.spec.num_kv_heads
    slots = w.regs[0].memory.slots
    assert len(slots.segments) == 2 * len(LAYERS) * heads
    assert w.namespace.layout.num_layers == len(LAYERS) * heads
    # Each head's run of block 5 (of layer 1) is where vLLM's view puts it.
    view = e.kv[LAYERS[1]]
    base = e.kv[LAYERS[0]][0, 0].data_ptr() - slots.segments[0][0]  # the region's start
    ranges = slots.ranges(5)[2 * heads :]
    run = view[5, 0].numel() * view.element_size()
    for h in range(heads):
        assert ranges[2 * h] == (view[5, h].data_ptr() - base, run // 2)
        assert ranges[2 * h + 1] == (view[5, h].data_ptr() - base + run // 2, run // 2)


def test_async_loads_are_reported_when_done(daemon, make_engine):
    extra = {"kvcached.namespace_extra": "async"}
    a = make_engine(daemon.socket, extra=extra)
    b = make_engine(daemon.socket, extra=extra)
    written = [fill(a, blk, seed=10 + blk) for blk in (1, 2)]
    run_step(a, KvcachedConnectorMetadata(saves=[Transfer("q", TOKENS[: 2 * BLOCK], 0, [1, 2])]))
    _, res = run_step(b, KvcachedConnectorMetadata(async_loads=[Transfer("q", TOKENS[: 2 * BLOCK], 0, [8, 9])]))
    done = set(res.finished_recving)
    for _ in range(100):
        if "q" in done:
            break
        _, res = run_step(b, KvcachedConnectorMetadata())
        done |= res.finished_recving
    assert "q" in done and not res.failed_recving
    assert [b.block_kv(8), b.block_kv(9)] == written
    # A load of blocks nobody saved finishes as failed, so vLLM recomputes (or fails) it.
    _, res = run_step(b, KvcachedConnectorMetadata(async_loads=[Transfer("z", array("I", [9] * BLOCK), 0, [10])]))
    for _ in range(100):
        if "z" in res.finished_recving:
            break
        _, res = run_step(b, KvcachedConnectorMetadata())
    assert "z" in res.finished_recving and "z" in res.failed_recving


def test_layerwise_waits_at_the_first_layer_and_saves_after_the_last(daemon, make_engine):
    extra = {"kvcached.namespace_extra": "layerwise", "kvcached.layerwise": True}
    a = make_engine(daemon.socket, extra=extra)
    b = make_engine(daemon.socket, extra=extra)
    wa, wb = a.worker.worker, b.worker.worker
    written = fill(a, 3, seed=3)
    meta = KvcachedConnectorMetadata(saves=[Transfer("l", TOKENS[:BLOCK], 0, [3])])
    a.worker.bind_connector_metadata(meta)
    a.worker.start_load_kv(None)
    a.worker.save_kv_layer(LAYERS[0], a.kv[LAYERS[0]], None)
    assert wa._saving is None  # not before the last layer has written its KV
    a.worker.save_kv_layer(LAYERS[1], a.kv[LAYERS[1]], None)
    assert wa._saving is not None  # started in the background
    a.worker.wait_for_save()
    assert wa.counts["saved"] == 1
    a.worker.clear_connector_metadata()

    b.worker.bind_connector_metadata(KvcachedConnectorMetadata(loads=[Transfer("l", TOKENS[:BLOCK], 0, [6])]))
    b.worker.start_load_kv(None)
    assert wb._sync  # started, not yet waited for
    b.worker.wait_for_layer_load(LAYERS[0])
    assert not wb._sync and b.block_kv(6) == written
    b.worker.wait_for_save()
    b.worker.clear_connector_metadata()
    assert type(a.worker).requires_piecewise_for_cudagraph(extra)
