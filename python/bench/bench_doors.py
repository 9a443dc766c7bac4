"""kvcached behind SGLang's HiCache and behind vLLM's native offloading, beside what those engines
use without it, in one run (docs/benchmarks.md, "SGLang and vLLM's offloading").

    KVCACHED_SGLANG_PATH=DIR python python/bench/bench_doors.py [--kvcached BIN] [--pages N]

- SGLang: the same prefix-reuse workload (a prompt's pages written back, then the hit query and
  the pages read into other slots, as SGLang's HiCache controller calls its backend) through
  SGLang's own file backend (`HiCacheFile`, on /dev/shm and on disk) and through kvcached (the
  host pool registered in place, page order "sglang"; and staged in vLLM's page order). Beside
  them, torch's copy of the same pages within the pool: the memory bandwidth bound.
- vLLM: the offloading tier's chunks stored into kvcached and promoted back (the cascade and the
  promotion jobs, `submit_store` / `submit_load`), and a reuse workload whose prompts are four
  times the CPU tier: the chunks served from the CPU tier alone, and from the CPU tier with
  kvcached beneath it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from bench_python import start_daemon, stop  # noqa: E402

# Qwen3-8B's KV per TP rank at TP 2: 36 layers, 4 KV heads of 128, bf16; 16-token pages.
LAYERS, HEADS, DIM, PAGE = 36, 4, 128, 16


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def sglang_side(sock: str, pages: int, rounds: int) -> list[tuple[str, float, float, float]]:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang_harness import fill_pages, page_hashes, storage_config

    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo  # isort: skip
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # isort: skip
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # isort: skip

    def pool(allocator: str):
        dev = 2 * pages * PAGE
        k = tuple(torch.zeros(dev, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
        v = tuple(torch.zeros(dev, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
        info = MHABufferInfo(
            buffers=KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
                              v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
                              layout=KVBufferLayout.NHD),
            page_size=PAGE, head_num=HEADS, head_dim=DIM, v_head_dim=DIM, dtype=torch.bfloat16,
            device=torch.device("cpu"))  # fmt: skip
        return MHATokenToKVPoolHost(info, 1.5, 0, PAGE, "layer_first", pin_memory=False, device="cpu",
                                    device_capacity_tokens=dev, start_layer=0, end_layer=LAYERS - 1,
                                    allocator_type=allocator)  # fmt: skip

    page_bytes = 2 * LAYERS * PAGE * HEADS * DIM * 2
    total = pages * page_bytes
    rows = []

    def run(name, make, set_fn, get_fn, exists_fn):
        sets, gets, exists = [], [], []
        for r in range(rounds):
            p, b = make()
            keys = page_hashes(list(range(r * 100_000, r * 100_000 + pages * PAGE)), PAGE)
            src = fill_pages(p, pages, seed=r)
            t0 = time.perf_counter()
            assert set_fn(b, keys, src)
            t1 = time.perf_counter()
            # The hit query of a backend in use (its connection open): the median of 10.
            assert exists_fn(b, keys) == pages
            for _ in range(10):
                q = time.perf_counter()
                assert exists_fn(b, keys) == pages
                exists.append(time.perf_counter() - q)
            t2 = time.perf_counter()
            dst = p.alloc(pages * PAGE)
            assert get_fn(b, p, keys, dst)
            t3 = time.perf_counter()
            sets.append(t1 - t0)
            gets.append(t3 - t2)
            if hasattr(b, "close"):
                b.close()
        rows.append((name, total / median(sets) / 1e9, median(sets) * 1e3, median(exists) * 1e6,
                     total / median(gets) / 1e9, median(gets) * 1e3))  # fmt: skip

    # The bound: torch copying the pages into other pages of the pool (one read and one write of
    # each byte, as a store or a load at best does), "written" out and "read" back.
    def copy_pages(p, src, dst, n):
        for i in range(n):
            s, d = int(src[i * PAGE]), int(dst[i * PAGE])
            p.kv_buffer[:, :, d : d + PAGE].copy_(p.kv_buffer[:, :, s : s + PAGE])

    def copy_set(b, keys, src):
        b["src"], b["out"] = src, b["pool"].alloc(len(keys) * PAGE)
        copy_pages(b["pool"], src, b["out"], len(keys))
        return True

    def copy_get(b, p, keys, dst):
        copy_pages(p, b["out"], dst, len(keys))
        return True

    def copy_make():
        p = pool("default")
        return p, {"pool": p}

    run("memory copy of the pages (torch, bound)", copy_make, copy_set, copy_get, lambda b, k: len(k))

    # SGLang's file backend, driven as the controller's generic path drives it.
    def file_backend(root: str):
        def make():
            d = tempfile.mkdtemp(dir=root)
            cfg = storage_config(sock, model="bench")
            cfg.extra_config = {"file_storage_path": d}
            p = pool("default")
            b = HiCacheFile(cfg)
            b.register_mem_pool_host(p)
            return p, b

        return make

    def generic_set(b, keys, src):
        return b.batch_set(keys, [b.mem_pool_host.get_data_page(int(src[i * PAGE])) for i in range(len(keys))])

    def generic_get(b, p, keys, dst):
        got = b.batch_get(keys, [p.get_dummy_flat_data_page() for _ in keys])
        for i, t in enumerate(got):
            p.set_from_flat_data_page(int(dst[i * PAGE]), t)
        return all(t is not None for t in got)

    for root, name in (
        ("/dev/shm", "SGLang HiCacheFile on /dev/shm"),
        (tempfile.gettempdir(), "SGLang HiCacheFile on disk"),
    ):
        run(name, file_backend(root), generic_set, generic_get, lambda b, k: b.batch_exists(k))

    def ours(order: str, allocator: str):
        def make():
            p = pool(allocator)
            cfg = storage_config(sock, model=f"bench-{uuid.uuid4().hex[:6]}", **{"kvcached.page_order": order})
            b = StorageBackendFactory.create_backend("dynamic", cfg, p)
            b.register_mem_pool_host(p)
            return p, b

        return make

    v1_set = lambda b, keys, src: all(b.batch_set_v1(keys, src))  # noqa: E731
    v1_get = lambda b, p, keys, dst: all(b.batch_get_v1(keys, dst))  # noqa: E731
    run("kvcached, pool in place (order sglang)", ours("sglang", "shm"), v1_set, v1_get, lambda b, k: b.batch_exists(k))
    run("kvcached, staged (order vllm)", ours("vllm", "default"), v1_set, v1_get, lambda b, k: b.batch_exists(k))
    return rows


def vllm_side(sock: str, chunks: int, rounds: int) -> tuple[list[tuple[str, float, float]], list[tuple[str, int, int]]]:
    from test_vllm_offload_tier import lookup_until_hit, step
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.base import TransferJob

    import numpy as np

    chunk = 2 << 20  # a 16-token block of Llama-3-8B's KV (32 layers x 8 heads x 128, bf16)

    def manager(cpu_chunks: int, tiers: list):
        cfg = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
            worker_kv_bytes_per_block=chunk, enable_kv_cache_events=False,
            extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_chunks * chunk,
                          "secondary_tiers": tiers},
            engine_id=f"bench-{uuid.uuid4().hex[:8]}", model=OffloadingModelConfig(name="bench", dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                              data_parallel_index=0, data_parallel_size=1,
                                              data_parallel_rank_local=None, is_parallelism_agnostic=True),
        )  # fmt: skip
        m = OffloadingSpecFactory.create_spec(cfg).get_manager()
        return m, m.primary_tier.get_kv_memoryview()

    def store(m, view, keys, fill: int, req: str) -> None:
        """A request's new chunks written into the CPU tier (the worker's copy) and completed."""
        ctx = ReqContext(req_id=req)
        m.on_new_request(ctx)
        out = m.prepare_store(keys, ctx)
        assert out is not None, "the CPU tier had no room"
        flat = view.cast("B")
        for i, cid in enumerate(out.store_spec.chunk_ids):
            flat[int(cid) * chunk : int(cid) * chunk + 4096] = bytes([fill + i]) * 4096
        flat.release()
        m.complete_store(out.keys_to_store, ctx)
        m.on_request_finished(ctx)

    tier_cfg = [{"type": "KvcachedTier", "module_path": "kvcached.vllm.offload_tier", "socket": sock}]
    rows = []
    # Store and promotion jobs straight into the tier (what the cascade and promotion submit).
    mgr, view = manager(chunks, tier_cfg)
    tier = mgr.secondary_tiers[0]
    flat = view.cast("B")
    flat[:] = os.urandom(len(flat)) if len(flat) < (64 << 20) else bytes(len(flat))
    flat.release()
    stores, loads = [], []
    for r in range(rounds):
        keys = [make_offload_key(uuid.uuid4().bytes * 2, 0) for _ in range(chunks)]
        ids = np.arange(chunks, dtype=np.int64)
        ctx = ReqContext(req_id=f"b{r}")
        t0 = time.perf_counter()
        tier.submit_store(
            TransferJob(job_id=10_000 + 2 * r, keys=keys, chunk_ids=ids, is_promotion=False, req_context=ctx)
        )
        tier.drain_jobs()
        t1 = time.perf_counter()
        tier.submit_load(
            TransferJob(job_id=10_001 + 2 * r, keys=keys, chunk_ids=ids, is_promotion=True, req_context=ctx)
        )
        tier.drain_jobs()
        t2 = time.perf_counter()
        assert all(j.success for j in tier.get_finished_jobs())
        stores.append(t1 - t0)
        loads.append(t2 - t1)
    # The bound: the chunks' bytes copied out of the CPU region and back (numpy).
    region = np.frombuffer(view, dtype=np.uint8)[: chunks * chunk]
    other = np.empty_like(region)
    outs, ins = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(other, region)
        t1 = time.perf_counter()
        np.copyto(region, other)
        outs.append(t1 - t0)
        ins.append(time.perf_counter() - t1)
    del region
    for name, outs_, ins_ in (("memory copy of the chunks (numpy, bound)", outs, ins),
                              (f"kvcached tier, {chunks} chunks of 2 MiB", stores, loads)):  # fmt: skip
        rows.append((name, chunks * chunk / median(outs_) / 1e9, median(outs_) * 1e3,
                     chunks * chunk / median(ins_) / 1e9, median(ins_) * 1e3))  # fmt: skip
    mgr.shutdown()

    # Reuse: 4 prompts of 4 chunks each stored one after another, the CPU tier holding 8 chunks
    # (two prompts); then each prompt's chunks looked up and loaded again.
    cpu, per = 8, 4
    served = []
    for name, tiers in (("CPU tier alone", []), ("CPU tier + kvcached", tier_cfg)):
        m, v = manager(cpu, tiers)
        prompts = [[make_offload_key(bytes([p, i]) * 16, 0) for i in range(per)] for p in range(4)]
        for p, keys in enumerate(prompts):
            with m.lock:
                store(m, v, keys, 0x10, f"s{p}")
                step(m)
            for t in m.secondary_tiers:
                t.drain_jobs()
            with m.lock:
                step(m)
        hits = 0
        for p, keys in enumerate(prompts):
            for i, k in enumerate(keys):
                ctx, seen = lookup_until_hit(m, m.secondary_tiers[0] if m.secondary_tiers else _NoTier(), k, f"r{p}{i}")
                hits += seen[-1].name == "HIT"
                with m.lock:
                    if seen[-1].name == "HIT":
                        m.prepare_load([k], ctx)
                        m.complete_load([k], ctx)
                    m.on_request_finished(ctx)
        served.append((name, hits, 4 * per))
        m.shutdown()
    return rows, served


class _NoTier:
    def drain_jobs(self) -> None:
        return


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvcached", default=None)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from conftest import kvcached_bin  # noqa: E402

    binary = args.kvcached or kvcached_bin()
    import sglang_harness  # noqa: F401  (puts SGLang on the path)

    root = Path(tempfile.mkdtemp(prefix="kvcached-doors-"))
    page_bytes = 2 * LAYERS * PAGE * HEADS * DIM * 2
    p = start_daemon(binary, root, g2=max(1 << 30, 6 * args.pages * page_bytes), memo_off=False)
    try:
        rows = sglang_side(str(root / "kvcached.sock"), args.pages, args.rounds)
        shape = f"{LAYERS} layers x {HEADS} KV heads x {DIM}, bf16, {PAGE} tokens"
        print(
            f"\nSGLang HiCache backends: {args.pages} pages of {page_bytes / 2**20:.2f} MiB ({shape}), "
            f"median of {args.rounds}"
        )
        print(
            f"{'backend':44} {'write GB/s':>10} {'write ms':>9} {'hit query us':>13} {'read GB/s':>10} {'read ms':>8}"
        )
        for name, w, w_ms, e, r, r_ms in rows:
            print(f"{name:44} {w:10.2f} {w_ms:9.1f} {e:13.0f} {r:10.2f} {r_ms:8.1f}")
        tier_rows, served = vllm_side(str(root / "kvcached.sock"), 32, args.rounds)
        print("\nvLLM offloading tier: store (cascade) and promotion jobs")
        print(f"{'tier':44} {'store GB/s':>10} {'store ms':>9} {'promote GB/s':>13} {'promote ms':>11}")
        for name, store_gbs, store_ms, load_gbs, load_ms in tier_rows:
            print(f"{name:44} {store_gbs:10.2f} {store_ms:9.1f} {load_gbs:13.2f} {load_ms:11.1f}")
        print("\nvLLM reuse of 4 prompts of 4 chunks, CPU tier of 8 chunks")
        for name, hits, total in served:
            print(f"{name:44} chunks served {hits}/{total}")
    finally:
        stop(p, 15, 30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
