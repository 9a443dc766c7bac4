"""Hybrid models with Mamba / linear-attention layers (Jamba, Nemotron-H, Qwen3-Next: vLLM's
MambaSpec groups) through vLLM 0.33's real Scheduler on the CPU, against a real daemon, with
vLLM's prefix caching in align mode (the state kept at block boundaries).

The fake forward pass runs a state layer as vLLM's kernels do in align mode: it starts from the
state in block `(start - 1) // block_size` of the request's state group and leaves the state
after the step in block `cdiv(end, block_size) - 1`, and it fails the test when the state it
starts from is not the prefix's (a state loaded into the wrong block, or the wrong bytes)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402
from vllm_harness import BLOCK, LAYERS, SPEC, assert_group_kv, finish, loaded_then_scheduled, request  # noqa: E402


def mamba(mode: str = "align") -> MambaSpec:
    # A Mamba2 layer's conv state (3 x 64 bf16) and SSM state (2 heads x 8 x 16 f32), its page
    # padded to the attention page, as vLLM pads it.
    return MambaSpec(
        block_size=BLOCK,
        shapes=((3, 64), (2, 8, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=SPEC.page_size_bytes,
        mamba_cache_mode=mode,
    )


def hybrid(make_engine, socket: str, **kw):
    return make_engine(socket, batched_tokens=64, groups=[([LAYERS[0]], SPEC), ([LAYERS[1]], mamba())], **kw)


def run(e, rid: str, tokens: list[int]):
    """Adds a request and steps until its prompt is computed (loads finished first)."""
    r = e.add(request(rid, tokens))
    for _ in range(12):
        if r.num_computed_tokens >= len(tokens):
            break
        e.step()
    assert r.num_computed_tokens >= len(tokens), r.status
    return r


def test_a_mamba_hybrid_saves_the_state_at_the_prompts_boundary_and_another_engine_resumes_there(daemon, make_engine):
    prompt = [t + 51_000 for t in range(6 * BLOCK + 4)]  # the state is kept after 96 tokens
    a = hybrid(make_engine, daemon.socket)
    sched = a.connector.scheduler
    assert [g.state for g in sched.groups] == [False, True]
    assert len({ns.id for ns in sched.namespaces}) == 2
    run(a, "A1", prompt)
    # Six attention blocks and one state: the state after the prompt's last whole block before
    # its last token, the one vLLM offers (its prefix cache keeps that one).
    assert a.worker.worker.counts["saved"] == 6 + 1
    assert sched.stats.blocks_to_save == 7
    finish(a, "A1")

    # Another engine (vLLM's own prefix cache empty): the state and the attention blocks before
    # it are loaded, before the request's first step reads them.
    b = hybrid(make_engine, daemon.socket)
    b.add(request("B1", prompt))
    loads, out = loaded_then_scheduled(b, "B1")
    assert loads == [(0, 0, 6), (1, 5, 1)], loads
    # The forward pass checked the state it resumed from; the request computes the last 4.
    assert out.num_scheduled_tokens["B1"] == len(prompt) - 6 * BLOCK
    assert_group_kv(b, "B1", prompt, 0, range(6))
    assert b.worker.worker.counts["loaded"] == 7 and b.worker.worker.counts["load_failed"] == 0
    finish(b, "B1")

    # The next turn of the conversation (the prompt, more tokens): resumed from the same state.
    c = hybrid(make_engine, daemon.socket)
    longer = prompt + [t + 52_000 for t in range(40)]
    run(c, "C1", longer)
    assert c.worker.worker.counts["loaded"] == 7
    assert c.connector.scheduler.stats.hit_tokens == 6 * BLOCK
    finish(c, "C1")


def test_a_prefix_without_a_saved_state_is_not_a_hit(daemon, make_engine):
    """Attention blocks alone restore nothing of a Mamba layer: a prompt sharing only the first
    4 blocks of a saved one (whose state was kept after 6) finds no state there and is computed."""
    prompt = [t + 53_000 for t in range(6 * BLOCK + 4)]
    a = hybrid(make_engine, daemon.socket)
    run(a, "S1", prompt)
    finish(a, "S1")
    b = hybrid(make_engine, daemon.socket)
    other = prompt[: 4 * BLOCK] + [t + 54_000 for t in range(3 * BLOCK)]
    b.add(request("S2", other))
    out, _ = b.step()
    assert not out.kv_connector_metadata.async_loads and not out.kv_connector_metadata.loads
    assert b.connector.scheduler.stats.hit_tokens == 0
    finish(b, "S2")


def test_mamba_state_without_align_mode_is_refused_by_name(daemon, make_engine):
    with pytest.raises(NotImplementedError, match="mamba_cache_mode 'align'"):
        make_engine(daemon.socket, prefix_caching=False, groups=[([LAYERS[0]], SPEC), ([LAYERS[1]], mamba("none"))])
