"""Prefill context parallelism through vLLM 0.33's real Scheduler on the CPU, against a real
daemon. vLLM's model runner spreads a prompt's prefill over the ranks; the scheduler counts
blocks of block_size tokens as without it, and every rank has a page of each block. Whatever
of the block's KV a rank's page holds, each rank saves and loads its pages in a namespace of its
own, keyed by the scheduler's blocks, so no rank is ever given another's bytes."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm_harness import BLOCK, ranks_round_trip  # noqa: E402


def test_each_prefill_context_parallel_rank_saves_and_loads_its_own_pages(daemon, make_pcp_engine):
    prompt = [t + 71_000 for t in range(3 * BLOCK + 5)]
    ranks_round_trip(make_pcp_engine, prompt, daemon.socket, prefix_caching=False, batched_tokens=256)


def test_ranks_and_an_unsplit_engine_never_share_blocks(daemon, make_pcp_engine, make_engine):
    split = make_pcp_engine(daemon.socket, prefix_caching=False)
    whole = make_engine(daemon.socket, prefix_caching=False)
    ids = {w.worker.namespace.id for w, _ in split.stages}
    assert len(ids) == 2 and whole.worker.worker.namespace.id not in ids


def test_every_prefill_and_decode_context_parallel_rank_has_a_namespace_of_its_own(daemon, model_dir):
    """With both (vLLM's DCP spanning the PCP axis), each worker's pages of the scheduler's
    blocks (block_size x DCP tokens) are a namespace of its own: its TP, DCP and PCP ranks."""
    from vllm_harness import kv_cache_config, vllm_config

    from kvcached.vllm.config import ConnectorConfig, kv_groups, namespace

    ids = {}
    for pcp, dcp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        cfg = vllm_config(daemon.socket, model_dir=model_dir)
        cfg.parallel_config.tensor_parallel_size = 2
        cfg.parallel_config.prefill_context_parallel_size = pcp
        cfg.parallel_config.decode_context_parallel_size = dcp
        kcfg = kv_cache_config(cfg, 8)
        (g,) = kv_groups(cfg, kcfg)
        assert g.block_tokens == BLOCK * dcp
        cc = ConnectorConfig.from_extra({})
        for tp in range(2):
            for d in range(dcp):
                for p in range(pcp):
                    ids[(pcp, dcp, tp, d, p)] = namespace(cfg, kcfg, cc, tp, 2, g, dcp_rank=d, pcp_rank=p).id
    assert len(set(ids.values())) == len(ids) == 2 + 4 + 4 + 8
