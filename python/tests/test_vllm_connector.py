"""The vLLM connector driven by vLLM 0.33's real Scheduler on the CPU, against a real daemon: the
scheduler half's lookups and plans, the worker half's loads and saves into the KV tensors vLLM
allocated (in kvcached's shared memory), every loaded byte checked."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import BLOCK, EOS, request  # noqa: E402

import kvcached  # noqa: E402

PROMPT = list(range(100, 100 + 3 * BLOCK + 5))  # 3 full blocks and 5 tokens


def finish(e, rid: str) -> None:
    for _ in range(4):
        if rid not in e.scheduler.requests:
            return
        e.step(token=EOS)
    assert rid not in e.scheduler.requests


def assert_prompt_kv(e, rid_blocks: list[int], tokens: list[int], count: int) -> None:
    for i in range(count):
        assert e.block_kv(rid_blocks[i]) == e.expected_block_kv(tokens, i), f"block {i}"


def test_a_second_request_loads_the_first_ones_blocks(daemon, make_engine):
    # Prefix caching off, so the second request's hit can only come from kvcached.
    e = make_engine(daemon.socket, prefix_caching=False)
    sched = e.connector.scheduler
    e.add(request("A1", PROMPT))
    out, _ = e.step()
    assert out.num_scheduled_tokens["A1"] == len(PROMPT)  # cold: everything computed
    meta = out.kv_connector_metadata
    assert not meta.loads and [(s.first_block, len(s.slots)) for s in meta.saves] == [(0, 3)]
    assert e.worker.worker.counts["saved"] == 3
    finish(e, "A1")

    r2 = e.add(request("A2", PROMPT))
    out, _ = e.step()
    meta = out.kv_connector_metadata
    assert [(t.first_block, len(t.slots)) for t in meta.loads] == [(0, 3)]
    assert out.num_scheduled_tokens["A2"] == len(PROMPT) - 3 * BLOCK
    assert out.has_sync_kv_loads
    blocks = e.scheduler.kv_cache_manager.get_blocks("A2").get_block_ids()[0]
    assert_prompt_kv(e, blocks, PROMPT, 3)  # the loaded blocks, byte for byte
    assert e.worker.worker.counts["loaded"] == 3 and e.worker.worker.counts["load_failed"] == 0
    assert r2.num_computed_tokens == len(PROMPT)
    assert sched.stats.lookups >= 2 and sched.stats.hit_tokens == 3 * BLOCK
    finish(e, "A2")


def test_local_prefix_hits_are_not_looked_up_again(daemon, make_engine):
    e = make_engine(daemon.socket, prefix_caching=True)
    prompt = [t + 7 for t in PROMPT]
    e.add(request("L1", prompt))
    e.step()
    finish(e, "L1")
    before = e.connector.scheduler.stats.lookups
    e.add(request("L2", prompt))
    out, _ = e.step()
    # vLLM's own cache holds all 3 blocks: nothing beyond them to ask kvcached for.
    assert not out.kv_connector_metadata.loads
    assert e.connector.scheduler.stats.lookups == before
    finish(e, "L2")


def test_prefill_decode_handoff_through_the_store(daemon, make_engine):
    prompt = [t + 1000 for t in PROMPT]
    p = make_engine(daemon.socket, "kv_producer")
    d = make_engine(daemon.socket, "kv_consumer", {"kvcached.load_async": True})

    p.add(request("P1", prompt, max_tokens=1, params={"do_remote_decode": True}))
    out, eco = p.step()
    outs = [o for e in eco.values() for o in e.outputs]
    params = outs[0].kv_transfer_params
    assert params["do_remote_prefill"] and params["kvcached_tokens"] == 3 * BLOCK
    assert params["kvcached_namespace"] == d.connector.scheduler.namespace.id
    assert "P1" not in p.scheduler.requests  # saved before finishing: blocks freed at once

    r = d.add(request("D1", prompt, params=params))
    out, _ = d.step()
    assert "D1" not in out.num_scheduled_tokens
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [(t.first_block, len(t.slots)) for t in out.kv_connector_metadata.async_loads] == [(0, 3)]
    # The worker reports the load in the step it finishes; then the request computes the rest.
    for _ in range(20):
        out, _ = d.step()
        if "D1" in out.num_scheduled_tokens:
            break
    assert out.num_scheduled_tokens["D1"] == len(prompt) - 3 * BLOCK
    blocks = d.scheduler.kv_cache_manager.get_blocks("D1").get_block_ids()[0]
    assert_prompt_kv(d, blocks, prompt, 3)
    # The consumer never saves.
    assert d.worker.worker.counts["saved"] == 0 and not out.kv_connector_metadata.saves
    finish(d, "D1")


def test_chunked_prefill_saves_each_chunk_and_decode_blocks_on_request(daemon, make_engine):
    prompt = [(t * 3) % 1000 for t in range(5 * BLOCK + 3)]
    e = make_engine(daemon.socket, batched_tokens=2 * BLOCK, extra={"kvcached.save_decode": True})
    e.add(request("C1", prompt, max_tokens=2 * BLOCK))
    saves = []
    for _ in range(3):
        out, _ = e.step()
        saves += [(s.first_block, len(s.slots)) for s in out.kv_connector_metadata.saves]
    assert saves == [(0, 2), (2, 2), (4, 1)], saves
    # Decoding fills block 5 (tokens 80..95); with save_decode it is saved when full.
    for _ in range(2 * BLOCK):
        out, _ = e.step(token=11)
        saves += [(s.first_block, len(s.slots)) for s in out.kv_connector_metadata.saves]
        if (5, 1) in saves:
            break
    assert (5, 1) in saves, saves
    other = kvcached.Client(daemon.socket)
    ns = e.connector.scheduler.namespace
    other.register("py-check", ns, kvcached.KvMemory.anonymous(ns.layout, 1))
    full = prompt + [7] + [11] * (2 * BLOCK)
    assert other.lookup(full[: 6 * BLOCK]).matched_blocks == 6
    other.unregister()
    finish(e, "C1")


def test_unsupported_requests_are_neither_looked_up_nor_saved(daemon, make_engine):
    e = make_engine(daemon.socket, prefix_caching=False)
    sched = e.connector.scheduler
    before = sched.stats.lookups
    e.add(request("S1", [t + 2000 for t in PROMPT], cache_salt="tenant-a"))
    out, _ = e.step()
    assert sched.stats.lookups == before and not out.kv_connector_metadata.saves
    finish(e, "S1")


def test_the_engine_serves_without_the_daemon(own_daemon, make_engine):
    e = make_engine(own_daemon.socket, prefix_caching=False, extra={"kvcached.retry_after": 60})
    own_daemon.kill()
    e.add(request("N1", [t + 3000 for t in PROMPT]))
    out, _ = e.step()
    assert out.num_scheduled_tokens["N1"] == len(PROMPT)  # no hit, and no exception
    assert e.connector.scheduler.stats.daemon_errors == 1
    assert e.worker.worker.counts["save_failed"] == 3
    finish(e, "N1")
    e.add(request("N2", [t + 3000 for t in PROMPT]))
    e.step()  # within retry_after: not asked again
    assert e.connector.scheduler.stats.daemon_errors == 1
    finish(e, "N2")


def test_an_engine_started_before_the_daemon_attaches_when_it_comes(own_daemon, make_engine):
    own_daemon.kill()
    e = make_engine(own_daemon.socket, prefix_caching=False, extra={"kvcached.retry_after": 0})
    assert e.worker.worker.client is None and e.connector.scheduler._client is None
    prompt = [t + 4000 for t in PROMPT]
    e.add(request("B1", prompt))
    out, _ = e.step()
    assert out.num_scheduled_tokens["B1"] == len(prompt)  # served without kvcached
    finish(e, "B1")
    own_daemon.start()
    e.add(request("B2", prompt))
    e.step()  # both halves register now; B2's blocks are saved
    assert e.worker.worker.counts["saved"] == 3
    finish(e, "B2")
    e.add(request("B3", prompt))
    out, _ = e.step()
    assert [(t.first_block, len(t.slots)) for t in out.kv_connector_metadata.loads] == [(0, 3)]
    blocks = e.scheduler.kv_cache_manager.get_blocks("B3").get_block_ids()[0]
    assert_prompt_kv(e, blocks, prompt, 3)
    finish(e, "B3")
