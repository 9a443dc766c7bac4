"""Decode context parallelism through vLLM 0.33's real Scheduler on the CPU, against a real daemon:
vLLM's scheduler counts blocks of block_size x ranks tokens, and each rank's worker holds its
share of a block's tokens (interleaved) in a page of block_size slots. Each rank saves and loads
its pages in a namespace of its own, keyed by the scheduler's blocks."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm_harness import BLOCK, dcp_engine, finish, request  # noqa: E402


@pytest.fixture
def make_dcp_engine(model_dir):
    from conftest import _engines

    yield from _engines(dcp_engine, model_dir)


def counts(e) -> list[dict]:
    return [w.worker.counts for w, _ in e.stages]


@pytest.mark.parametrize("interleave", [1, BLOCK])
def test_each_decode_context_parallel_rank_saves_and_loads_its_share(daemon, make_dcp_engine, interleave):
    a = make_dcp_engine(daemon.socket, prefix_caching=False, batched_tokens=256, interleave=interleave)
    sched = a.connector.scheduler
    assert sched.block_size == 2 * BLOCK
    ns = [w.worker.namespace.id for w, _ in a.stages]
    assert len(set(ns)) == 2 and sched.namespace.id == ns[0]
    span = 2 * BLOCK
    prompt = [t + 61_000 + 1000 * interleave for t in range(3 * span + 5)]
    a.add(request("D1", prompt, block=span))
    out, _ = a.step()
    assert [(t.first_block, len(t.slots)) for t in out.kv_connector_metadata.saves] == [(0, 3)]
    assert [c["saved"] for c in counts(a)] == [3, 3]
    finish(a, "D1")

    b = make_dcp_engine(daemon.socket, prefix_caching=False, batched_tokens=256, interleave=interleave)
    b.add(request("D2", prompt, block=span))
    out, _ = b.step()
    assert [(t.first_block, len(t.slots)) for t in out.kv_connector_metadata.loads] == [(0, 3)]
    assert out.num_scheduled_tokens["D2"] == len(prompt) - 3 * span
    assert [(c["loaded"], c["load_failed"]) for c in counts(b)] == [(3, 0), (3, 0)]
    ids = b.scheduler.kv_cache_manager.get_blocks("D2").get_block_ids()[0]
    for rank in range(2):
        for i in range(3):
            assert b.rank_block_kv(rank, ids[i]) == b.expected_rank_block_kv(rank, prompt, i), f"rank {rank} block {i}"
    finish(b, "D2")


def test_ranks_and_an_unsplit_engine_never_share_blocks(daemon, make_dcp_engine, make_engine):
    split = make_dcp_engine(daemon.socket, prefix_caching=False)
    whole = make_engine(daemon.socket, prefix_caching=False)
    ids = {w.worker.namespace.id for w, _ in split.stages}
    assert whole.worker.worker.namespace.id not in ids
    interleaved = make_dcp_engine(daemon.socket, prefix_caching=False, interleave=BLOCK)
    assert not ids & {w.worker.namespace.id for w, _ in interleaved.stages}, "an interleave size is bytes too"
