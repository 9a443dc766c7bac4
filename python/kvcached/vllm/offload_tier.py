"""kvcached as a tier of vLLM's native KV offloading (vLLM 0.33's tiered offloading spec).

vLLM's OffloadingConnector copies KV between the GPU and a CPU tier of its own (a shared-memory
region of chunks); a tiered spec cascades the CPU tier's chunks to secondary tiers and promotes
them back. This tier is the node's kvcached daemon:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "KvcachedTier", "module_path": "kvcached.vllm.offload_tier"}]}}'

The CPU region's file is registered with the daemon, which copies chunks straight between it
and its own tiers (no copy in the engine). Chunks are keyed by vLLM's own keys (the chunk's
block hash and KV-cache group: `docs/block-keys.md` section 7, scheme "vllm") in a namespace of
the model and of everything that shapes a chunk's bytes, so engines of the same model and
configuration share them (vLLM's default sha256 block hashes are the same in every process;
other hash functions need the same `PYTHONHASHSEED` everywhere).

Tier settings (keys of the tier's entry): `socket`, `model_id` (default vLLM's model name; vLLM's
offloading config does not carry the model's revision, so engines serving several revisions of
one model name each revision here, e.g. `name@revision`), `namespace_extra`, `tenant_salt`
(default `$KVCACHED_TENANT_SALT`),
`threads` (default 4), `retry_after` (seconds the tier answers "not found" and fails transfers
without asking, after a call found the daemon away; default 5), `enable_kv_events` (stored chunks
in vLLM's KV events as STORAGE), `locality`.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

import kvcached
from kvcached.breaker import Breaker, unregister

log = logging.getLogger("kvcached.vllm.offload_tier")

# A run of misses in one request's keys stops the lookups there: the rest are asked again later.
MAX_PROBES = 8


def region_file(view: memoryview) -> tuple[int, int]:
    """A descriptor of the file behind `view` and the view's offset in it: the CPU region,
    found by its address in /proc/self/maps (or /proc/self/map_files once vLLM unlinked it)."""
    import ctypes

    flat = view.cast("B")
    try:
        c = ctypes.c_char.from_buffer(flat)
        addr = ctypes.addressof(c)
        del c  # no export of vLLM's region left behind (it unmaps it at shutdown)
    finally:
        flat.release()
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                path = parts[5].strip() if len(parts) > 5 else ""
                offset = int(parts[2], 16) + addr - lo
                if not path.startswith("/"):
                    raise RuntimeError("the CPU tier's region is not a file mapping (vLLM's shared region is)")
                if not path.endswith(" (deleted)"):
                    return os.open(path, os.O_RDWR), offset
                try:
                    return os.open(f"/proc/self/map_files/{parts[0]}", os.O_RDWR), offset
                except OSError as e:
                    raise RuntimeError(
                        f"vLLM's CPU region {path} is unlinked and this process may not reopen it "
                        f"through /proc/self/map_files ({e}): kvcached cannot register it"
                    ) from e
    raise RuntimeError("the CPU tier's region is not mapped")


def namespace_of(
    spec: Any, chunk_bytes: int, model_id: str | None, extra: str, salt: bytes | None
) -> kvcached.Namespace:
    """The namespace of a chunk: the model and everything that shapes a chunk's bytes."""
    cfg = spec.config
    shape = {
        "groups": [(g.group_id, g.tokens_per_block, list(g.layer_names)) for g in cfg.groups],
        "worker_kv_bytes_per_block": cfg.worker_kv_bytes_per_block,
        "tokens_per_hash": cfg.cache.tokens_per_hash,
        "blocks_per_chunk": cfg.cache.blocks_per_chunk,
        "model_dtype": str(cfg.model.dtype),
        "kv_cache_layout": cfg.kv_cache_layout,
        "canonical": cfg.canonical_layout,
        "replicated": cfg.replicated_layout,
        "parallel": [
            cfg.parallel.world_size,
            cfg.parallel.tp_size,
            cfg.parallel.pp_size,
            cfg.parallel.pcp_size,
            cfg.parallel.dcp_size,
        ],  # fmt: skip
        "chunk_bytes": chunk_bytes,
        "user": extra,
    }
    tokens = cfg.cache.tokens_per_hash * cfg.cache.blocks_per_chunk
    if chunk_bytes % (2 * tokens):
        raise ValueError(f"a chunk of {chunk_bytes} bytes is not a multiple of 2 x {tokens} tokens")
    # A chunk is one contiguous run of bytes: one "layer" of int8 pairs.
    layout = kvcached.KvLayout(1, 1, chunk_bytes // (2 * tokens), "int8", tokens, kind="contiguous")
    model = model_id or str(cfg.model.name)
    body = "vllm-offload-v1;" + json.dumps(shape, sort_keys=True)
    return kvcached.Namespace(model, layout, tenant_salt=salt, extra=body.encode())


def _drain(q: queue.SimpleQueue) -> list:
    """Everything queued in `q` now."""
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


class _Lookups(AsyncLookupManager):
    """vLLM's non-blocking lookups, answered by the daemon in batches (one lookup per run)."""

    def __init__(self, tier_type: str, client: kvcached.Client, breaker: Breaker) -> None:
        self.client = client
        self.breaker = breaker
        super().__init__(tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        found = [False] * len(keys)
        if not self.breaker.up():
            return found
        at, probes = 0, 0
        try:
            while at < len(keys) and probes < MAX_PROBES:
                n = self.client.lookup((), hashes=kvcached.EngineHashes("vllm", list(keys[at:]))).matched_blocks
                probes += 1
                for i in range(at, at + n):
                    found[i] = True
                at += n + 1  # keys[at + n] is missing
        except kvcached.KvcachedError as e:
            self.breaker.failed("lookup", len(keys), e)
        return found


class KvcachedTier(SecondaryTierManager):
    """A secondary tier of vLLM's tiered offloading in the node's kvcached daemon."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        socket: str | None = None,
        model_id: str | None = None,
        namespace_extra: str = "",
        tenant_salt: str | None = None,
        threads: int = 4,
        retry_after: float = 5.0,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: Any = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if locality is not None:
            from vllm.v1.kv_offload.base import Locality

            self.locality = Locality(locality)
        salt = tenant_salt or os.environ.get("KVCACHED_TENANT_SALT")
        chunks, row = primary_kv_view.shape[0], self.block_size_bytes
        self.namespace = namespace_of(offloading_spec, row, model_id, namespace_extra, salt.encode() if salt else None)
        fd, offset = region_file(primary_kv_view)
        try:
            slots = kvcached.SlotLayout([(offset, row)], row, chunks)
            self.memory = kvcached.KvMemory.from_fd(fd, slots)
        finally:
            os.close(fd)  # the KvMemory holds its own descriptor
        # Transfers run on the tier's threads and lookups on vLLM's lookup thread: a daemon away
        # costs each call at most this long, and vLLM answers a lookup RETRY meanwhile.
        self.client = kvcached.Client(socket or os.environ.get("KVCACHED_SOCKET"), reconnect_for=2.0)
        name = f"vllm-offload-{offloading_spec.config.engine_id}-{offloading_spec.config.parallel.rank}"
        reg = self.client.register(name, self.namespace, self.memory)
        log.info("kvcached tier: %d chunks of %d bytes registered, namespace %s", chunks, row, reg.namespace_id)
        self.enable_kv_events = bool(enable_kv_events)
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(threads)), thread_name_prefix="kvcached-tier")
        # Finished jobs, with the keys a load did not find.
        self._finished: queue.SimpleQueue[tuple[JobResult, list[OffloadKey]]] = queue.SimpleQueue()
        self._events: queue.SimpleQueue[OffloadingEvent] = queue.SimpleQueue()
        self._inflight: set[Future] = set()
        self._inflight_lock = threading.Lock()
        self.breaker = Breaker(float(retry_after), log, "chunks")
        self._lookups = _Lookups(tier_type, self.client, self.breaker)

    # -- lookups -------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    # -- transfers -----------------------------------------------------------------------------

    def _submit(self, job: TransferJob, run: Any) -> None:
        fut = self._pool.submit(run, job)
        with self._inflight_lock:
            self._inflight.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: Future) -> None:
        with self._inflight_lock:
            self._inflight.discard(fut)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._load)

    def _store(self, job: TransferJob) -> None:
        keys, t0, ok = list(job.keys), time.monotonic(), False
        try:
            if self.breaker.up():
                chunks = [int(c) for c in job.chunk_ids]
                r = self.client.save((), 0, chunks, hashes=kvcached.EngineHashes("vllm", keys))
                ok = r.failed == 0
                if not ok:
                    log.warning("kvcached tier: %d of %d chunks not stored: %s", r.failed, len(keys), r.error)
        except Exception as e:  # noqa: BLE001 - a job always ends with a result (vLLM pins its chunks)
            self.breaker.failed("store", len(keys), e)
        if ok and self.enable_kv_events:
            self._events.put(OffloadingEvent(keys=keys, medium=Medium.STORAGE, removed=False, locality=self.locality))
        self._finished.put(
            (JobResult(job.job_id, ok, None, time.monotonic() - t0, len(keys) * self.block_size_bytes), [])
        )

    def _load(self, job: TransferJob) -> None:
        keys, t0, n = list(job.keys), time.monotonic(), 0
        try:
            if self.breaker.up():
                chunks = [int(c) for c in job.chunk_ids]
                n = int(self.client.load_now((), 0, chunks, hashes=kvcached.EngineHashes("vllm", keys)).loaded_blocks)
        except Exception as e:  # noqa: BLE001 - a job always ends with a result (vLLM pins its chunks)
            self.breaker.failed("load", len(keys), e)
        ok = n == len(keys)
        result = JobResult(job.job_id, ok, None if ok else keys[:n], time.monotonic() - t0, n * self.block_size_bytes)
        self._finished.put((result, keys[n:]))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out = []
        for result, missing in _drain(self._finished):
            if missing:
                # What a load did not find is gone (evicted meanwhile): a miss from now on.
                self._lookups.mark_miss(missing)
            out.append(result)
        return out

    def has_pending_work(self) -> bool:
        with self._inflight_lock:
            return bool(self._inflight)

    def drain_jobs(self) -> None:
        with self._inflight_lock:
            pending = list(self._inflight)
        for f in pending:
            f.result()

    def take_events(self) -> Iterable[OffloadingEvent]:
        return _drain(self._events)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return  # the daemon's own lookups and loads keep its recency

    def shutdown(self) -> None:
        self.drain_jobs()
        self._pool.shutdown(wait=True)
        self._lookups.shutdown()
        unregister(self.client, log)
