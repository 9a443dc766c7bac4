"""Pipeline parallelism through vLLM 0.33's real Scheduler on the CPU, against a real daemon: each
stage's worker holds its own layers' KV and saves and loads it in a namespace of the stage's own;
the scheduler, which vLLM gives stage 0's KV-cache config, looks blocks up in stage 0's. A stage
that lacks a block the scheduler found fails that block's load, and vLLM recomputes it."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm_harness import BLOCK, finish, request  # noqa: E402


def counts(e) -> list[dict]:
    return [w.worker.counts for w, _ in e.stages]


def prompt_kv_is_right(e, rid: str, tokens: list[int], blocks: int) -> None:
    ids = e.scheduler.kv_cache_manager.get_blocks(rid).get_block_ids()[0]
    for i in range(blocks):
        assert e.block_kv(ids[i]) == e.expected_block_kv(tokens, i), f"block {i}"


def test_each_pipeline_stage_saves_and_loads_its_own_layers(daemon, make_pp_engine):
    a = make_pp_engine(daemon.socket, prefix_caching=False)
    stage_ns = [w.worker.namespace.id for w, _ in a.stages]
    assert len(set(stage_ns)) == 2, "each stage keys its layers apart"
    assert a.connector.scheduler.namespace.id == stage_ns[0], "the scheduler looks up stage 0's"
    assert [w.worker.regs[0].engine_name.rsplit("-", 2)[1] for w, _ in a.stages] == ["pp0", "pp1"]
    prompt = [t + 31_000 for t in range(3 * BLOCK + 5)]
    a.add(request("P1", prompt))
    out, _ = a.step()
    assert [(t.first_block, len(t.slots)) for t in out.kv_connector_metadata.saves] == [(0, 3)]
    assert [c["saved"] for c in counts(a)] == [3, 3]
    finish(a, "P1")

    # Another engine of the same model and split: each stage loads its own layers' blocks.
    b = make_pp_engine(daemon.socket, prefix_caching=False)
    b.add(request("P2", prompt))
    out, _ = b.step()
    assert [(t.first_block, len(t.slots)) for t in out.kv_connector_metadata.loads] == [(0, 3)]
    assert out.num_scheduled_tokens["P2"] == len(prompt) - 3 * BLOCK
    assert [(c["loaded"], c["load_failed"]) for c in counts(b)] == [(3, 0), (3, 0)]
    prompt_kv_is_right(b, "P2", prompt, 3)
    finish(b, "P2")


def test_a_split_engine_and_an_unsplit_one_never_share_blocks(daemon, make_pp_engine, make_engine):
    """The same model without pipeline parallelism holds both layers in each block: its blocks
    are other bytes than a stage's, and neither finds the other's."""
    prompt = [t + 33_000 for t in range(2 * BLOCK + 1)]
    split = make_pp_engine(daemon.socket, prefix_caching=False)
    split.add(request("S1", prompt))
    split.step()
    assert [c["saved"] for c in counts(split)] == [2, 2]
    finish(split, "S1")
    whole = make_engine(daemon.socket, prefix_caching=False)
    assert whole.worker.worker.namespace.id not in {w.worker.namespace.id for w, _ in split.stages}
    whole.add(request("S2", prompt))
    out, _ = whole.step()
    assert not out.kv_connector_metadata.loads
    finish(whole, "S2")

    other = [t + 34_000 for t in range(2 * BLOCK + 1)]
    whole.add(request("S3", other))
    whole.step()
    finish(whole, "S3")
    split.add(request("S4", other))
    out, _ = split.step()
    assert not out.kv_connector_metadata.loads
    finish(split, "S4")


def test_a_stage_missing_a_block_fails_its_load_and_vllm_recomputes_it(daemon, make_pp_engine):
    a = make_pp_engine(daemon.socket, prefix_caching=False)
    # Fault injection: stage 1's saves are lost (its daemon connection dropped them, say).
    a.stages[1][0].worker._save_all = lambda saves, ready=None: None
    prompt = [t + 35_000 for t in range(3 * BLOCK + 2)]
    a.add(request("M1", prompt))
    a.step()
    assert [c["saved"] for c in counts(a)] == [3, 0]
    finish(a, "M1")

    b = make_pp_engine(daemon.socket, prefix_caching=False)
    r = b.add(request("M2", prompt))
    out, _ = b.step()
    # Stage 0 holds the prefix: the scheduler plans its load on every stage.
    assert [(t.first_block, len(t.slots)) for t in out.kv_connector_metadata.loads] == [(0, 3)]
    assert [(c["loaded"], c["load_failed"]) for c in counts(b)] == [(3, 0), (0, 3)]
    # vLLM (kv_load_failure_policy "recompute") computes the blocks stage 1 could not load.
    for _ in range(4):
        if r.num_computed_tokens >= len(prompt):
            break
        b.step()
    assert r.num_computed_tokens >= len(prompt)
    prompt_kv_is_right(b, "M2", prompt, 3)
    finish(b, "M2")
