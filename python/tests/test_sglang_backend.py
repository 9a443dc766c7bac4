"""kvcached as SGLang HiCache's storage backend, with SGLang 0.5.x's own host pools on CPU and a
real daemon (see sglang_harness for how SGLang's controller drives a backend)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from sglang_harness import (  # isort: skip
    PAGE, backend, fill_pages, mha_pool, mla_pool, page_bytes, page_hashes, storage_config,
)  # fmt: skip
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402  isort: skip

import kvcached


def test_sglang_page_hashes_are_the_daemons():
    """SGLang's native page hash is the chain the daemon derives for scheme "sglang"."""
    tokens = list(range(1000, 1000 + 4 * PAGE + 3))
    ours = [h.hex() for h in kvcached.EngineHashes.sglang_page_hashes(tokens, PAGE)]
    assert ours == page_hashes(tokens)


@pytest.mark.parametrize(
    ("make", "layout", "allocator", "order", "in_place"),
    [
        (mha_pool, "layer_first", "shm", "sglang", True),
        (mha_pool, "page_first_direct", "shm", "sglang", True),
        (mha_pool, "layer_first", "default", "sglang", False),
        (mha_pool, "page_first", "shm", "sglang", False),
        (mha_pool, "page_head", "default", "sglang", False),
        (mha_pool, "layer_first", "shm", "vllm", False),
        (mla_pool, "layer_first", "shm", "sglang", True),
        (mla_pool, "page_first_direct", "shm", "sglang", True),
        (mla_pool, "page_first", "default", "sglang", False),
    ],
)
def test_pages_round_trip_between_two_engines(own_daemon, make, layout, allocator, order, in_place):
    """One engine's pages saved through the backend are found and loaded, byte for byte, by
    another engine into other pages of its own pool; the pool is registered in place where
    its layout and allocator allow."""
    mla = make is mla_pool
    a_pool, b_pool = make(layout, allocator), make(layout, allocator)
    a = backend(a_pool, own_daemon.socket, mla=mla, **{"kvcached.page_order": order})
    b = backend(b_pool, own_daemon.socket, mla=mla, **{"kvcached.page_order": order})
    assert a.in_place is in_place
    tokens = list(range(7, 7 + 5 * PAGE))
    keys = page_hashes(tokens)
    assert b.batch_exists(keys) == 0
    a_idx = fill_pages(a_pool, 5, seed=1)
    assert a.batch_set_v1(keys, a_idx) == [True] * 5
    # The other engine: the hit query, then the pages into other slots of its own pool.
    fill_pages(b_pool, 3, seed=2)  # pages it already uses elsewhere
    assert b.batch_exists(keys) == 5
    assert b.batch_exists(keys[:2] + page_hashes(list(range(99, 99 + 3 * PAGE)))[2:]) == 2
    b_idx = b_pool.alloc(5 * PAGE)
    assert b.batch_get_v1(keys, b_idx) == [True] * 5
    assert page_bytes(b_pool, b_idx, 5) == page_bytes(a_pool, a_idx, 5)
    # What was never saved is a miss from its first page.
    other = page_hashes(list(range(500, 500 + 2 * PAGE)))
    assert b.batch_get_v1(keys[:1] + other, b_pool.alloc(3 * PAGE)) == [True, False, False]
    assert a.counts["stored"] == 5
    a.close()
    b.close()


def test_page_orders_and_ranks_never_share(own_daemon):
    """Pages of another byte order, another tensor-parallel rank or another dtype are other
    bytes: never found. An MLA latent is the same on every rank: found from any rank."""
    tokens = list(range(3, 3 + 2 * PAGE))
    keys = page_hashes(tokens)
    pool = mha_pool("layer_first", "shm")
    saver = backend(pool, own_daemon.socket)
    assert saver.batch_set_v1(keys, fill_pages(pool, 2, seed=3)) == [True, True]
    assert backend(mha_pool("layer_first", "shm"), own_daemon.socket).batch_exists(keys) == 2
    assert (
        backend(mha_pool("layer_first"), own_daemon.socket, **{"kvcached.page_order": "vllm"}).batch_exists(keys) == 0
    )
    assert backend(mha_pool("layer_first", "shm"), own_daemon.socket, tp=(1, 2)).batch_exists(keys) == 0

    assert backend(mha_pool("layer_first", "shm", dtype=torch.float16), own_daemon.socket).batch_exists(keys) == 0
    assert (
        backend(mha_pool("layer_first", "shm"), own_daemon.socket, **{"kvcached.model_id": "other"}).batch_exists(keys)
        == 0
    )
    # MLA: SGLang's writer rank saves, every rank finds and loads the same latent.
    mpool = mla_pool("layer_first", "shm")
    writer = backend(mpool, own_daemon.socket, mla=True, tp=(0, 4))
    idx = fill_pages(mpool, 2, seed=4)
    assert writer.batch_set_v1(keys, idx) == [True, True]
    r3_pool = mla_pool("layer_first", "shm")
    r3 = backend(r3_pool, own_daemon.socket, mla=True, tp=(3, 4))
    got = r3_pool.alloc(2 * PAGE)
    assert r3.batch_exists(keys) == 2 and r3.batch_get_v1(keys, got) == [True, True]
    assert page_bytes(r3_pool, got, 2) == page_bytes(mpool, idx, 2)


@pytest.mark.parametrize(
    ("make", "layout"), [(mha_pool, "page_first"), (mha_pool, "page_head"), (mla_pool, "layer_first")]
)
def test_the_generic_interface_shares_the_zero_copy_ones_blocks(own_daemon, make, layout):
    """Without interface_v1 SGLang's controller hands over flat pages (`_generic_page_set`:
    `batch_set(keys, [get_data_page(i)...])`; `_generic_page_get`: `batch_get(keys, [dummy
    pages])`, then `set_from_flat_data_page`): the same keys and bytes as the zero-copy path."""
    mla = make is mla_pool
    g_pool, z_pool = make(layout, "default"), make("layer_first", "shm")
    generic = backend(g_pool, own_daemon.socket, mla=mla, interface_v1=0)
    zero_copy = backend(z_pool, own_daemon.socket, mla=mla)
    keys = page_hashes(list(range(40, 40 + 3 * PAGE)))
    g_idx = fill_pages(g_pool, 3, seed=21)
    assert generic.batch_set(keys, [g_pool.get_data_page(int(g_idx[i * PAGE])) for i in range(3)]) is True
    assert zero_copy.batch_exists(keys) == 3
    z_idx = z_pool.alloc(3 * PAGE)
    assert zero_copy.batch_get_v1(keys, z_idx) == [True] * 3
    # Saved in place, read back through the generic path into other pages.
    other = page_hashes(list(range(90, 90 + 2 * PAGE)))
    assert zero_copy.batch_set_v1(other, z_idx[: 2 * PAGE]) == [True, True]
    got = generic.batch_get(
        other + page_hashes(list(range(5, 5 + PAGE))), [g_pool.get_dummy_flat_data_page() for _ in range(3)]
    )
    assert got[2] is None and all(t is not None for t in got[:2])
    back = g_pool.alloc(2 * PAGE)
    for i in range(2):
        g_pool.set_from_flat_data_page(int(back[i * PAGE]), got[i])
    assert page_bytes(g_pool, back, 2) == page_bytes(g_pool, g_idx, 2)
    assert generic.get(keys[0], g_pool.get_dummy_flat_data_page()) is not None
    assert generic.set(page_hashes(list(range(7, 7 + PAGE)))[0], g_pool.get_data_page(int(g_idx[0]))) is True


def test_refusals_are_clear(own_daemon):
    with pytest.raises(ValueError, match="kvcached.page_ordr"):
        backend(mha_pool("layer_first"), own_daemon.socket, **{"kvcached.page_ordr": "vllm"})
    b = backend(mha_pool("layer_first"), own_daemon.socket)
    with pytest.raises(ValueError, match="one target page per key"):
        b.batch_get(["00" * 32])
    # Keys that are not SGLang's SHA-256 page hashes (XXH3-64, suffixed): nothing stored.
    pool = b.mem_pool_host
    idx = fill_pages(pool, 2, seed=5)
    for odd in (["0123456789abcdef", "fedcba9876543210"], [k + "_L0-1" for k in page_hashes(list(range(2 * PAGE)))]):
        assert b.batch_set_v1(odd, idx) == [False, False]
        assert b.batch_exists(odd) == 0
    # Pipeline and context parallelism, and fp8 pages stored as bytes, are refused at start.
    cfg = storage_config(own_daemon.socket)
    cfg.pp_size = 2
    with pytest.raises(NotImplementedError, match="pipeline parallelism"):
        StorageBackendFactory.create_backend("dynamic", cfg, pool)

    with pytest.raises(NotImplementedError, match="fp8"):
        backend(mha_pool("layer_first", dtype=torch.uint8), own_daemon.socket)
    # A daemon away: answered at once as a miss and as nothing stored, for `retry_after`.
    keys = page_hashes(list(range(60, 60 + PAGE)))
    own_daemon.kill()
    assert b.batch_exists(keys) == 0 and b.batch_set_v1(keys, idx[:PAGE]) == [False]
    t0 = time.monotonic()
    assert b.batch_exists(keys) == 0 and b.batch_get_v1(keys, idx[:PAGE]) == [False]
    assert time.monotonic() - t0 < 0.2


def test_storage_metrics_and_batches_larger_than_the_staging_area(own_daemon):
    """With SGLang's storage metrics on, `get_stats` is what SGLang's scheduler logs
    (unified_radix_cache.py 3702-3707: `get_stats()`, `prefetch_stats` set on it, then
    `StorageMetricsCollector.log_storage_metrics`, which asserts a `StorageMetrics`): each get's
    and set's pages and GB/s since the last call. A batch larger than the staging area moves
    through it in turns, byte for byte."""
    from sglang.srt.observability.metrics_collector import StorageMetrics, StorageMetricsCollector

    a_pool, b_pool = mha_pool("page_first"), mha_pool("page_first")
    a = backend(a_pool, own_daemon.socket, metrics=True, **{"kvcached.staging_pages": 2})
    b = backend(b_pool, own_daemon.socket, metrics=True, **{"kvcached.staging_pages": 2})
    assert not a.in_place and a.staging_pages == 2
    keys = page_hashes(list(range(300, 300 + 5 * PAGE)))
    a_idx = fill_pages(a_pool, 5, seed=31)
    assert a.batch_set_v1(keys, a_idx) == [True] * 5
    b_idx = b_pool.alloc(5 * PAGE)
    assert b.batch_get_v1(keys, b_idx) == [True] * 5
    assert page_bytes(b_pool, b_idx, 5) == page_bytes(a_pool, a_idx, 5)
    # The generic interface's batches go through the same turns.
    g = backend(mha_pool("page_first"), own_daemon.socket, interface_v1=0, **{"kvcached.staging_pages": 2})
    flat = g.batch_get(keys, [g.mem_pool_host.get_dummy_flat_data_page() for _ in range(5)])
    assert all(t is not None for t in flat)
    assert [t.contiguous().view(torch.uint8).numpy().tobytes() for t in flat] == page_bytes(a_pool, a_idx, 5)

    stats = a.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [5] and stats.prefetch_pgs == [] and stats.backup_bandwidth[0] > 0
    got = b.get_stats()
    assert got.prefetch_pgs == [5] and got.backup_pgs == [] and got.prefetch_bandwidth[0] > 0
    assert a.get_stats().backup_pgs == []  # since the last call
    got.prefetch_stats = {}  # what SGLang's scheduler sets before logging
    StorageMetricsCollector({"backend": "kvcached"}).log_storage_metrics(got)
    # Metrics off (SGLang's default): None, which SGLang replaces with an empty StorageMetrics.
    assert backend(mha_pool("layer_first"), own_daemon.socket).get_stats() is None


def mamba_pool(seed_layers: int = 2) -> Any:
    """SGLang's Mamba state host pool on the CPU (a conv state and a temporal state per layer,
    one state per page)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(seed_layers, 9, 4, 8, dtype=torch.float32),
        conv=(torch.zeros(seed_layers, 9, 6, 3, dtype=torch.bfloat16),),
    )
    return MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, device="cpu", layout="page_first")


def hybrid(socket: str) -> tuple[Any, dict[str, Any]]:
    """A hybrid model's backend as SGLang's hybrid controller attaches it (hybrid_cache_controller.py
    355-357): the KV pool through `register_mem_pool_host`, then every pool (the KV anchor among
    them) through `register_mem_host_pool_v2`, then `on_host_pools_registered`."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    pools = {"kv": mha_pool("layer_first", "shm"), "mamba": mamba_pool(), "swa": mha_pool("page_first")}
    b = backend(pools["kv"], socket)
    for name, pool in pools.items():
        b.register_mem_host_pool_v2(pool, PoolName(name))
    b.on_host_pools_registered()
    return b, pools


def fill_flat(pool: Any, n: int, seed: int) -> torch.Tensor:
    """`n` pages of `pool` allocated and filled with random bytes through its flat pages; their
    host indices (`page_size` per page)."""
    idx = pool.alloc(n * pool.page_size)
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        flat = pool.get_dummy_flat_data_page()
        raw = torch.randint(0, 256, (flat.numel() * flat.element_size(),), generator=g, dtype=torch.uint8)
        pool.set_from_flat_data_page(int(idx[i * pool.page_size]), raw.view(flat.dtype))
    return idx


def flat_bytes(pool: Any, idx: torch.Tensor, n: int) -> list[bytes]:
    return [
        pool.get_data_page(int(idx[i * pool.page_size]), flat=True).contiguous().view(torch.uint8).numpy().tobytes()
        for i in range(n)
    ]


def test_a_hybrid_models_sidecar_pools_round_trip_with_its_kv(own_daemon):
    """A hybrid model's Mamba state and sliding-window pages (SGLang's v2 interface) are saved
    beside its KV pages, each pool in a namespace of its own, and found and loaded by another
    engine only where the hit policy holds: the KV prefix, with the state at its last page
    (TRAILING_PAGES 1) and the window's last 2 pages (TRAILING_PAGES 2)."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    trailing = PoolHitPolicy.TRAILING_PAGES
    a, ap = hybrid(own_daemon.socket)
    b, bp = hybrid(own_daemon.socket)
    assert len({a.namespace.id, *(sc.namespace.id for sc in a._sidecars.values())}) == 3
    keys = page_hashes(list(range(4000, 4000 + 4 * PAGE)))
    # The write-back: sidecars first (batch_set_v2), then the KV pages (batch_set_v1).
    state, window = fill_flat(ap["mamba"], 1, seed=41), fill_flat(ap["swa"], 2, seed=42)
    saved = a.batch_set_v2([
        PoolTransfer(name=PoolName.MAMBA, host_indices=state, keys=keys[3:], hit_policy=trailing),
        PoolTransfer(name=PoolName.SWA, host_indices=window, keys=keys[2:], hit_policy=trailing),
    ])  # fmt: skip
    assert saved == {PoolName.MAMBA: [True], PoolName.SWA: [True, True]}
    assert a.batch_set_v1(keys, fill_pages(ap["kv"], 4, seed=43)) == [True] * 4

    def query(ks: list[str]) -> Any:
        return b.batch_exists_v2(ks, [
            PoolTransfer(name=PoolName.MAMBA, keys=ks[-1:], hit_policy=trailing),
            PoolTransfer(name=PoolName.SWA, keys=ks[-2:], hit_policy=trailing),
        ])  # fmt: skip

    hit = query(keys + page_hashes(list(range(4000, 4000 + 5 * PAGE)))[4:])
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (4, [4])
    assert hit.extra_pool_hit_pages == {PoolName.KV: 4, PoolName.MAMBA: 4, PoolName.SWA: 4}
    # A prompt sharing only 3 pages: no state was kept at its third page, so no hit.
    short = query(keys[:3] + page_hashes(list(range(4000, 4000 + 3 * PAGE)) + [9] * PAGE)[3:])
    assert (short.kv_hit_pages, short.restorable_prefix_pages) == (0, [])

    # The read: the KV pages (v1), then the sidecars' (batch_get_v2) into other slots.
    got_state, got_window = bp["mamba"].alloc(1), bp["swa"].alloc(2 * PAGE)
    assert b.batch_get_v1(keys, bp["kv"].alloc(4 * PAGE)) == [True] * 4
    loaded = b.batch_get_v2([
        PoolTransfer(name=PoolName.MAMBA, host_indices=got_state, keys=keys[3:], hit_policy=trailing),
        PoolTransfer(name=PoolName.SWA, host_indices=got_window, keys=keys[2:], hit_policy=trailing),
    ])  # fmt: skip
    assert loaded == {PoolName.MAMBA: [True], PoolName.SWA: [True, True]}
    assert flat_bytes(bp["mamba"], got_state, 1) == flat_bytes(ap["mamba"], state, 1)
    assert flat_bytes(bp["swa"], got_window, 2) == flat_bytes(ap["swa"], window, 2)
    # The state under another page's key is not there; a pool never registered moves nothing.
    assert b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=got_state, keys=keys[2:3])]) == {
        PoolName.MAMBA: [False]
    }
    assert b.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=got_state, keys=keys[:1])]) == {
        PoolName.INDEXER: [False]
    }
    # An engine without the sidecars (the KV pool alone) finds the KV pages only.
    plain = backend(mha_pool("layer_first", "shm"), own_daemon.socket)
    assert plain.batch_exists(keys) == 4
    hit = plain.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=trailing)])
    assert hit.kv_hit_pages == 0
    for x in (a, b, plain):
        x.close()


def test_a_state_at_the_end_of_a_long_prefix_is_found(own_daemon):
    """SGLang keeps a trailing pool's pages only at a node's end: a state after page 100 of a
    100-page prefix makes the whole prefix restorable, however many pages before it have none."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    a, ap = hybrid(own_daemon.socket)
    keys = page_hashes(list(range(9000, 9000 + 101 * PAGE)))
    idx = fill_pages(ap["kv"], 20, seed=51)
    for at in range(0, 100, 20):  # the KV pages' bytes do not matter here, their presence does
        assert a.batch_set_v1(keys[at : at + 20], idx) == [True] * 20
    state = fill_flat(ap["mamba"], 1, seed=52)
    mamba = PoolTransfer(
        name=PoolName.MAMBA, host_indices=state, keys=keys[99:100], hit_policy=PoolHitPolicy.TRAILING_PAGES
    )
    assert a.batch_set_v2([mamba]) == {PoolName.MAMBA: [True]}
    query = PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    hit = a.batch_exists_v2(keys, [query])
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (100, [100])
    a.close()


def test_a_hybrid_models_pools_take_two_of_the_uids_engines(tmp_path):
    """The pools beside the KV pool share one memory, which the daemon counts as one engine of
    the uid: a hybrid model with two sidecars attaches to a daemon allowing 2 engines per uid."""
    from conftest import configured_daemon

    with configured_daemon(tmp_path, "[limits]\nmax_engines_per_uid = 2\n") as d:
        b, _ = hybrid(d.socket)
        assert len(b._sidecars) == 2
        b.close()


def test_the_router_namespace_of_a_backends_pages_is_the_daemons(own_daemon):
    """`router_namespace` writes the kvrouter entry that routes requests to the pages a backend
    saves (scheme sglang-pages-v1): its fields make the backend's own namespace, salt included."""
    import tomllib

    from kvcached.shared_pages import router_namespace

    for salt in (None, b"tenant-a"):
        extra = {"kvcached.tenant_salt": salt.decode()} if salt else {}
        b = backend(mha_pool("layer_first", "shm"), own_daemon.socket, tp=(1, 2), **extra)
        (spec,) = tomllib.loads(router_namespace("sglang", b.namespace, salt))["namespaces"]
        assert spec["key_scheme"] == "sglang-pages-v1"
        layout = kvcached.KvLayout(spec["num_layers"], spec["kv_heads"], spec["head_dim"], spec["dtype"],
                                   spec["tokens_per_block"], spec["layout_kind"])  # fmt: skip
        salt_back = bytes.fromhex(spec["tenant_salt_hex"]) if "tenant_salt_hex" in spec else None
        ns = kvcached.Namespace(spec["model_id"], layout, tenant_salt=salt_back, extra=bytes.fromhex(spec["extra_hex"]))
        assert ns.id == b.namespace.id
        with pytest.raises(ValueError, match="tenant_salt"):
            router_namespace("x", b.namespace, None if salt else b"s")
