"""Decode context parallelism through vLLM 0.33's real Scheduler on the CPU, against a real daemon:
vLLM's scheduler counts blocks of block_size x ranks tokens, and each rank's worker holds its
share of a block's tokens (interleaved) in a page of block_size slots. Each rank saves and loads
its pages in a namespace of its own, keyed by the scheduler's blocks."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm_harness import BLOCK, ranks_round_trip  # noqa: E402


@pytest.mark.parametrize("interleave", [1, BLOCK])
def test_each_decode_context_parallel_rank_saves_and_loads_its_share(daemon, make_dcp_engine, interleave):
    span = 2 * BLOCK
    prompt = [t + 61_000 + 1000 * interleave for t in range(3 * span + 5)]
    ranks_round_trip(
        make_dcp_engine, prompt, daemon.socket, prefix_caching=False, batched_tokens=256, interleave=interleave
    )


def test_ranks_and_an_unsplit_engine_never_share_blocks(daemon, make_dcp_engine, make_engine):
    split = make_dcp_engine(daemon.socket, prefix_caching=False)
    whole = make_engine(daemon.socket, prefix_caching=False)
    ids = {w.worker.namespace.id for w, _ in split.stages}
    assert whole.worker.worker.namespace.id not in ids
    interleaved = make_dcp_engine(daemon.socket, prefix_caching=False, interleave=BLOCK)
    assert not ids & {w.worker.namespace.id for w, _ in interleaved.stages}, "an interleave size is bytes too"
