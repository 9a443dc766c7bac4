"""kvcached as a tier of vLLM 0.33's native KV offloading: the real tiered spec and manager
(`TieringOffloadingSpec`, its CPU tier in a shared-memory region) with `KvcachedTier` loaded
from its module path as vLLM loads out-of-tree tiers, against a real daemon.

The GPU side of vLLM's offloading worker runs only on CUDA platforms (`CPUOffloadingSpec.
get_worker`), so the scheduler side is driven as vLLM's offloading scheduler drives it:
`prepare_store`, bytes written into the chunks (what the worker's GPU-to-CPU copy does),
`complete_store` (which cascades to the secondary tiers), `lookup` until HIT, and
`prepare_load` of the promoted chunks.
"""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

CHUNK = 4096  # bytes of one chunk (one 16-token block of this small model)
CHUNKS = 4  # the CPU tier's chunks


def manager(socket: str, model: str = "test/offload-model", **tier: object):
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=CHUNK,
        enable_kv_cache_events=True,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": CHUNKS * CHUNK,
            "secondary_tiers": [
                {"type": "KvcachedTier", "module_path": "kvcached.vllm.offload_tier", "socket": socket, **tier}
            ],
        },
        engine_id=f"test-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),  # fmt: skip
    )
    mgr = OffloadingSpecFactory.create_spec(cfg).get_manager()
    return mgr, mgr.secondary_tiers[0], mgr.primary_tier.get_kv_memoryview()


def step(mgr) -> None:
    mgr.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def store(mgr, view, keys: list, fill: int, req: str) -> None:
    """What the offloading scheduler and its worker do for a request's new chunks."""
    ctx = ReqContext(req_id=req)
    mgr.on_new_request(ctx)
    out = mgr.prepare_store(keys, ctx)
    flat = view.cast("B")
    for i, cid in enumerate(out.store_spec.chunk_ids):
        flat[int(cid) * CHUNK : (int(cid) + 1) * CHUNK] = bytes([fill + i]) * CHUNK
    flat.release()
    mgr.complete_store(out.keys_to_store, ctx)
    mgr.on_request_finished(ctx)


def load(mgr, view, key, ctx) -> bytes:
    """A hit chunk's bytes as the worker's CPU-to-GPU copy reads them (`prepare_load`)."""
    cid = int(mgr.prepare_load([key], ctx).chunk_ids[0])
    flat = view.cast("B")
    got = bytes(flat[cid * CHUNK : (cid + 1) * CHUNK])
    flat.release()
    mgr.complete_load([key], ctx)
    return got


def lookup_until_hit(mgr, tier, key, req: str, steps: int = 200):
    """The scheduler's lookups of one chunk, a step apart, until the manager answers HIT."""
    import time

    ctx = ReqContext(req_id=req)
    mgr.on_new_request(ctx)
    seen = []
    for _ in range(steps):
        with mgr.lock:
            r = mgr.lookup(key, ctx)
            seen.append(r)
            if r is LookupResult.HIT:
                return ctx, seen
            if r is LookupResult.MISS:
                return ctx, seen
            step(mgr)
        tier.drain_jobs()
        time.sleep(0.005)
    return ctx, seen


def test_chunks_cascade_to_kvcached_and_come_back(own_daemon):
    mgr, tier, view = manager(own_daemon.socket)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(3)]
    with mgr.lock:
        store(mgr, view, keys, 0x10, "r0")
        step(mgr)
    tier.drain_jobs()
    with mgr.lock:
        step(mgr)
        # Evict them from the CPU tier: it fills with other chunks.
        store(mgr, view, [make_offload_key(bytes([100 + i]) * 32, 0) for i in range(CHUNKS)], 0x40, "r1")
        step(mgr)
    tier.drain_jobs()
    with mgr.lock:
        step(mgr)
        assert mgr.primary_tier.lookup(keys[0], ReqContext(req_id="x")) is not LookupResult.HIT
    ctx, seen = lookup_until_hit(mgr, tier, keys[0], "r2")
    assert seen[-1] is LookupResult.HIT, seen
    assert LookupResult.RETRY in seen or LookupResult.HIT_PENDING in seen  # asked kvcached, then promoted
    with mgr.lock:
        assert load(mgr, view, keys[0], ctx) == bytes([0x10]) * CHUNK
        mgr.on_request_finished(ctx)
    # A chunk kvcached never had is a miss.
    ctx, seen = lookup_until_hit(mgr, tier, make_offload_key(b"\x77" * 32, 0), "r3")
    assert seen[-1] is LookupResult.MISS, seen
    mgr.shutdown()


def test_another_engine_of_the_same_model_finds_the_chunks(own_daemon):
    """Two engines (two CPU regions, two registrations) of one model share chunks through the
    daemon; an engine of another model, or of another chunk shape, does not see them."""
    a, a_tier, a_view = manager(own_daemon.socket)
    key = make_offload_key(b"\x05" * 32, 0)
    with a.lock:
        store(a, a_view, [key], 0x21, "a0")
        step(a)
    a_tier.drain_jobs()
    b, b_tier, b_view = manager(own_daemon.socket)
    ctx, seen = lookup_until_hit(b, b_tier, key, "b0")
    assert seen[-1] is LookupResult.HIT, seen
    with b.lock:
        assert load(b, b_view, key, ctx) == bytes([0x21]) * CHUNK
    other, o_tier, _ = manager(own_daemon.socket, model="test/another-model")
    _, seen = lookup_until_hit(other, o_tier, key, "o0")
    assert seen[-1] is LookupResult.MISS, seen
    for m in (a, b, other):
        m.shutdown()


def test_stored_chunks_are_vllm_storage_events(own_daemon):
    mgr, tier, view = manager(own_daemon.socket, enable_kv_events=True)
    keys = [make_offload_key(bytes([9, i]) * 16, 0) for i in range(2)]
    with mgr.lock:
        store(mgr, view, keys, 0x30, "e0")
        step(mgr)
    tier.drain_jobs()
    with mgr.lock:
        step(mgr)
        events = list(mgr.take_events())
    stored = [e for e in events if not e.removed and e.medium.name == "STORAGE"]
    assert sorted(k for e in stored for k in e.keys) == sorted(keys)
    mgr.shutdown()


def test_unknown_tier_settings_are_refused(own_daemon):
    with pytest.raises(TypeError, match="sokcet"):
        manager(own_daemon.socket, sokcet="/nowhere")


def test_revisions_named_in_model_id_never_share_chunks(own_daemon):
    """vLLM's offloading config names the model without its revision: an engine of another
    revision says so in `model_id`, and then finds none of the first one's chunks."""
    a, a_tier, a_view = manager(own_daemon.socket, model_id="test/offload-model@r1")
    key = make_offload_key(b"\x0b" * 32, 0)
    with a.lock:
        store(a, a_view, [key], 0x51, "v0")
        step(a)
    a_tier.drain_jobs()
    b, b_tier, _ = manager(own_daemon.socket, model_id="test/offload-model@r2")
    assert b_tier.namespace.model_id == "test/offload-model@r2"
    _, seen = lookup_until_hit(b, b_tier, key, "v1")
    assert seen[-1] is LookupResult.MISS, seen
    for m in (a, b):
        m.shutdown()


def test_a_daemon_away_is_not_waited_on_again(own_daemon):
    """A daemon found away: lookups answer MISS and transfers fail at once for `retry_after`
    seconds, rather than each waiting out the client's reconnect time (2 s)."""
    import time

    mgr, tier, view = manager(own_daemon.socket, retry_after=60)
    key = make_offload_key(b"\x0c" * 32, 0)
    own_daemon.kill()
    _, seen = lookup_until_hit(mgr, tier, key, "d0", steps=2000)  # finds the daemon away
    assert seen[-1] is LookupResult.MISS, seen
    t0 = time.monotonic()
    _, seen = lookup_until_hit(mgr, tier, make_offload_key(b"\x0d" * 32, 0), "d1")
    assert seen[-1] is LookupResult.MISS, seen
    with mgr.lock:
        store(mgr, view, [make_offload_key(b"\x0e" * 32, 0)], 0x61, "d2")
        step(mgr)
    tier.drain_jobs()
    results = list(tier.get_finished_jobs())
    assert results and not any(r.success for r in results)
    assert time.monotonic() - t0 < 1.0
    mgr.shutdown()
