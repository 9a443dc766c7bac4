"""The connector's worker half: registers vLLM's KV cache with the daemon once, runs the loads
the scheduler planned before the forward pass reads them, and the saves after it has written the
blocks.

Where the KV lives. The daemon does every copy, so it must map vLLM's KV memory. On CPU, vLLM
allocates its whole KV cache as one `torch.zeros(size, dtype=int8)` buffer (then views it per
layer), inside the context `get_mem_pool_context()` returns; this half's context makes that one
allocation a tensor over an anonymous shared-memory file (memfd), which it then registers with
the daemon by descriptor. vLLM's tensors are the shared memory: no staging copy. On CUDA the
buffer is one CUDA allocation, registered by its IPC handle (not exercised here: no GPU).

Blocks. vLLM 0.33 views each layer as `[blocks, heads, tokens, K|V]` in one of several physical
orders; in the ones with a layer's page of a block in one run (LBHNC on CPU, LBNHC on CUDA, and
the block-major BL** orders) the connector registers each layer's page as two segments (its two
halves) at the layer's offset, strided by the block stride. The bytes round-trip exactly; the
order inside a page goes into the namespace (config.py). In the layouts whose pages are split by
head (LHBNC, BHLNC) each head slot's run is two segments.

Layer by layer. The daemon copies a block's layers together (one gather per save, one scatter
per load), so a load cannot be waited for per layer nor a save started per layer. By default
loads are waited for in `start_load_kv` and saves made in `wait_for_save`; with
`kvcached.layerwise` the wait moves to the first attention layer and the saves start in the
background when the last layer has written its KV, overlapping what follows it (final norm,
logits, sampling), and vLLM keeps attention out of CUDA graphs so those calls happen.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import kvcached
from kvcached.torch_utils import SharedRegion, cuda_ipc_region, shared_empty
from kvcached.vllm.config import (
    HEAD_SPLIT_LAYOUTS,
    ConnectorConfig,
    KvGroup,
    dcp_size,
    kv_groups,
    layout_name,
    namespace,
    page_bytes,
    page_runs,
    pcp_size,
    pp_size,
)
from kvcached.vllm.keys import ContextArgs, key_kwargs
from kvcached.vllm.meta import KvcachedConnectorMetadata, Transfer

log = logging.getLogger("kvcached.vllm")

# How long a step waits for a load before taking its blocks as failed.
LOAD_DEADLINE_S = 60.0


@functools.lru_cache(maxsize=256)
def _key_context(args: ContextArgs | None) -> kvcached.KeyContext | None:
    """The client's KeyContext of a transfer's context (a request's loads and saves share it)."""
    return None if args is None else args.make()


def _vllm_group(name: str) -> tuple[int, int] | None:
    """This process's (rank, size) in vLLM's `name` parallel group ("tp", "pp", "dcp", "pcp"), or None
    outside a vLLM process whose parallel state is set up (tests, the GPU check's stand-in)."""
    try:
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            group = getattr(parallel_state, f"get_{name}_group")()
            return int(group.rank_in_group), int(group.world_size)
    except (ImportError, AssertionError, AttributeError):
        pass
    return None


def _tp() -> tuple[int, int] | None:
    return _vllm_group("tp")


def _pp_stage(vllm_config: Any, layers: list[str]) -> int:
    """This worker's pipeline stage: vLLM's pipeline group rank, or (outside a vLLM process) the
    stage vLLM's layer partition gives the first of `layers`."""
    pp = pp_size(vllm_config)
    if pp == 1:
        return 0
    if (group := _vllm_group("pp")) is not None:
        return group[0]
    from vllm.distributed.utils import get_pp_indices

    total = vllm_config.model_config.get_total_num_hidden_layers()
    first = min(_layer_order(n) for n in layers)
    for stage in range(pp):
        lo, hi = get_pp_indices(total, stage, pp)
        if lo <= first < hi:
            return stage
    return 0


def _dcp_rank(vllm_config: Any, tp_rank: int) -> int:
    """This worker's decode-context-parallel rank: vLLM's DCP group rank, or (outside a vLLM
    process) the one its tensor-parallel rank gives (vLLM's DCP groups are runs of consecutive
    TP ranks)."""
    dcp = dcp_size(vllm_config)
    if dcp == 1:
        return 0
    group = _vllm_group("dcp")
    return group[0] if group is not None else tp_rank % dcp


def _pcp_rank(vllm_config: Any) -> int:
    """This worker's prefill-context-parallel rank: vLLM's PCP group rank (0 without prefill
    context parallelism, or outside a vLLM process)."""
    if pcp_size(vllm_config) == 1:
        return 0
    group = _vllm_group("pcp")
    return group[0] if group is not None else 0


class _SharedKvAllocation(TorchFunctionMode):
    """While active, the KV cache's one backing allocation (`torch.zeros(n, dtype=torch.int8,
    device=cpu)` in vLLM's `allocate_kv_cache`) is made in shared memory; every other torch call
    runs as it would."""

    def __init__(self, worker: WorkerSide):
        super().__init__()
        self.worker = worker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func is torch.zeros
            and self.worker.region is None
            and len(args) == 1
            and isinstance(args[0], int)
            and kwargs.get("dtype") is torch.int8
            and torch.device(kwargs.get("device") or "cpu").type == "cpu"
            and set(kwargs) <= {"dtype", "device"}
        ):
            self.worker.region = shared_empty(args[0], "kvcached-vllm-kv")
            return self.worker.region.tensor
        return func(*args, **kwargs)


def page_is_one_run(view: torch.Tensor) -> bool:
    """Whether each block's `[heads, tokens, K|V]` page of a layer view is one dense run of
    bytes (its three inner dimensions are a permutation of a contiguous layout)."""
    dims = sorted(zip(view.stride()[1:], view.shape[1:], strict=True))
    expect = 1
    for stride, extent in dims:
        if extent > 1 and stride != expect:
            return False
        expect *= extent
    return True


class _GroupReg:
    """One KV-cache group's registration: its namespace, its slots over vLLM's KV memory (every
    group's layers are views of the same allocation) and its client. A group without layers on
    this pipeline stage has no namespace here: its transfers on this stage move nothing."""

    def __init__(self, group: KvGroup, ns: kvcached.Namespace | None, engine_name: str):
        self.group = group
        self.namespace = ns
        self.engine_name = engine_name
        self.memory: kvcached.KvMemory | kvcached.GpuKvMemory | None = None
        self.client: kvcached.Client | None = None
        self.retry_at = 0.0


def _layer_order(name: str) -> int:
    """A layer's index in the model (its attention runs in this order)."""
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return extract_layer_index(name)
    except (ImportError, AssertionError, ValueError):
        return 0


class WorkerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig, transfer_config: Any):
        self.groups = kv_groups(vllm_config, kv_cache_config)
        # The first group with layers on this pipeline stage (every group, without pipeline
        # parallelism): its registration is the worker's own.
        self.first = next(g.index for g in self.groups if g.layers)
        self.spec, self.layers = self.groups[self.first].spec, list(self.groups[self.first].layers)
        # The layer whose attention runs last: layerwise saves start after it.
        every = [name for g in self.groups for name in g.layers]
        # (of attention: a state layer, Mamba's, is not an attention layer vLLM's runner calls
        # save_kv_layer for)
        attention = [name for g in self.groups if not g.state for name in g.layers] or every
        self.last_layer = max(attention, key=_layer_order) if len(self.groups) > 1 else attention[-1]
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.cfg = cfg
        self.layout = layout_name(vllm_config, kv_cache_config)
        tp = _tp() or (0, vllm_config.parallel_config.tensor_parallel_size)
        stage = f"-pp{_pp_stage(vllm_config, every)}" if pp_size(vllm_config) > 1 else ""
        self.dcp_rank = _dcp_rank(vllm_config, tp[0])
        self.pcp_rank = _pcp_rank(vllm_config)
        cp = f"-dcp{self.dcp_rank}" if dcp_size(vllm_config) > 1 else ""
        cp += f"-pcp{self.pcp_rank}" if pcp_size(vllm_config) > 1 else ""
        name = f"vllm-{transfer_config.engine_id}{stage}-tp{tp[0]}{cp}"
        self.regs = [
            _GroupReg(
                g,
                namespace(vllm_config, kv_cache_config, cfg, *tp, g, dcp_rank=self.dcp_rank, pcp_rank=self.pcp_rank)
                if g.layers
                else None,
                (name + (f"-g{g.index}" if g.count > 1 else ""))[:128],
            )
            for g in self.groups
        ]
        self.namespace = self.regs[self.first].namespace
        self.region: SharedRegion | None = None
        self.cuda = False
        self._sync: list[tuple[kvcached.LoadOp | None, Transfer]] = []
        # A request's async loads (one per KV-cache group), reported done when all are.
        self._async: dict[str, list[tuple[kvcached.LoadOp | None, Transfer]]] = {}
        self._invalid: set[int] = set()
        self._failed_recving: set[str] = set()
        # Requests whose loads the scheduler could not plan: done, and failed, at the next poll.
        self._unplanned: set[str] = set()
        self._saving: concurrent.futures.Future[None] | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.meta: KvcachedConnectorMetadata | None = None
        # Blocks loaded / saved / failed, for tests and benchmarks.
        self.counts = {"loaded": 0, "saved": 0, "already_present": 0, "load_failed": 0, "save_failed": 0}

    # -- registration --------------------------------------------------------------------------

    def mem_pool_context(self) -> TorchFunctionMode | None:
        if self.vllm_config.device_config.device_type != "cpu":
            return None
        return _SharedKvAllocation(self)

    @property
    def client(self) -> kvcached.Client | None:
        """The first group's client (None until registered)."""
        return self.regs[self.first].client

    @property
    def memory(self) -> kvcached.KvMemory | kvcached.GpuKvMemory | None:
        return self.regs[self.first].memory

    def _slots(self, group: KvGroup, views: list[torch.Tensor], base: int, region_bytes: int) -> kvcached.SlotLayout:
        """Each layer's page of a block as two segments (its halves). A view is vLLM's
        `[blocks, heads, tokens, content]` of one layer; the attention kernel's blocks may
        subdivide a manager block (`ratio` kernel blocks per block), which vLLM allows only when
        a block's pages are dense, so a block is still one run of bytes. In a head-split layout
        (LHBNC, BHLNC) a page is one run per head slot: two segments each."""
        spec = group.spec
        page = page_bytes(spec)
        blocks = self.kv_cache_config.num_blocks
        runs = page_runs(self.vllm_config, self.kv_cache_config, spec)
        segments: list[tuple[int, int]] = []
        for name, v in zip(group.layers, views, strict=True):
            es = v.element_size()
            if v.dim() != 4 or v.shape[0] % blocks:
                raise RuntimeError(f"{name}: a {tuple(v.shape)} view, expected [blocks x k, heads, tokens, content]")
            ratio = v.shape[0] // blocks
            if runs > 1:
                segments += self._head_runs(name, v, runs, page, blocks, base, region_bytes)
                continue
            if not page_is_one_run(v):
                raise NotImplementedError(
                    f"kvcached's connector needs each block's page of a layer in one run of bytes, or one per "
                    f"head slot in a head-split layout ({', '.join(HEAD_SPLIT_LAYOUTS)}); vLLM's KV layout "
                    f"{self.layout} lays {name}'s page out otherwise"
                )
            kernel_page = v[0].numel() * es
            if ratio > 1 and v.stride(0) * es != kernel_page:
                raise NotImplementedError(f"{name}: kernel blocks of a block are not adjacent (padded pages)")
            if group.state:
                # The state, rounded up into the page's padding (`page_bytes`).
                if ratio != 1 or kernel_page > page or page > v.stride(0) * es:
                    raise RuntimeError(f"{name}: a {tuple(v.shape)} state view, {page} bytes copied per block")
            elif kernel_page * ratio != page:
                raise RuntimeError(f"{name}: a block page of {kernel_page * ratio} bytes, the spec says {page}")
            block_stride = v.stride(0) * es * ratio
            offset = v.data_ptr() - base
            if offset < 0 or offset + (blocks - 1) * block_stride + page > region_bytes:
                raise RuntimeError(f"{name}'s KV is not inside the registered region")
            segments += [(offset, block_stride), (offset + page // 2, block_stride)]
        return kvcached.SlotLayout(segments, page // runs // 2, blocks)

    @staticmethod
    def _head_runs(
        name: str, v: torch.Tensor, runs: int, page: int, blocks: int, base: int, region_bytes: int
    ) -> list[tuple[int, int]]:
        """A head-split layer view's segments: each head slot's run of `[tokens, content]` of a
        block (dense), in head order, as two halves."""
        es = v.element_size()
        run = v.shape[2] * v.shape[3] * es
        if v.shape[0] != blocks or v.shape[1] != runs or run * runs != page:
            raise NotImplementedError(
                f"{name}: a {tuple(v.shape)} head-split view, expected [{blocks}, {runs}, tokens, content] of "
                f"{page} bytes per block (kernel blocks that split a block are not supported here)"
            )
        if v.stride(3) != 1 or v.stride(2) != v.shape[3]:
            raise NotImplementedError(f"{name}: a head slot's tokens are not one run of bytes")
        block_stride, head_stride = v.stride(0) * es, v.stride(1) * es
        offset = v.data_ptr() - base
        if offset < 0 or offset + (blocks - 1) * block_stride + (runs - 1) * head_stride + run > region_bytes:
            raise RuntimeError(f"{name}'s KV is not inside the registered region")
        out = []
        for h in range(runs):
            at = offset + h * head_stride
            out += [(at, block_stride), (at + run // 2, block_stride)]
        return out

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for g in self.groups for n in g.layers if n not in kv_caches]
        if missing:
            raise RuntimeError(f"vLLM registered no KV cache for layers {missing[:3]}")
        views = [kv_caches[n] for n in self.layers]
        device = views[0].device
        if device.type == "cpu":
            if self.region is None or not (
                self.region.tensor.data_ptr() <= views[0].data_ptr() < self.region.tensor.data_ptr() + self.region.size
            ):
                raise RuntimeError(
                    "vLLM's KV cache is not in kvcached's shared memory: the connector places it there through "
                    "get_mem_pool_context() around vLLM's KV cache allocation, and this vLLM allocated it elsewhere "
                    "(the daemon can only copy memory it can map)"
                )
            base = self.region.tensor.data_ptr()
            for r in self.regs:
                if r.namespace is None:
                    continue
                slots = self._slots(r.group, [kv_caches[n] for n in r.group.layers], base, self.region.size)
                r.memory = kvcached.KvMemory.from_fd(self.region.fd, slots)
            self.region.close()  # each KvMemory holds its own descriptor
        elif device.type == "cuda":
            ipc = cuda_ipc_region(views[0])
            for r in self.regs:
                if r.namespace is None:
                    continue
                slots = self._slots(r.group, [kv_caches[n] for n in r.group.layers], ipc.base_ptr, ipc.size)
                r.memory = kvcached.GpuKvMemory(ipc.handle, ipc.device, ipc.size, slots)
            self.cuda = True
        else:
            raise NotImplementedError(f"kvcached's connector does not support KV on {device.type}")
        for g, r in enumerate(self.regs):
            if r.namespace is not None:
                self._register(g, at_start=True)

    def _furthest(self) -> int | None:
        """The group whose slots reach furthest into the memory: registered first, the daemon
        maps the memory that far and shares the mapping with the others (a group reaching
        further, registered later, is mapped again)."""
        held = [g for g, r in enumerate(self.regs) if r.memory is not None]
        return max(held, key=lambda g: self.regs[g].memory.slots.extent, default=None)

    def _register(self, group: int = 0, at_start: bool = False) -> kvcached.Client | None:
        """Group `group`'s registered client; registers (again at most every `retry_after`
        seconds) when there is none. A daemon that cannot be reached is not an engine failure:
        the engine serves without kvcached meanwhile. At start, a refusal of the registration
        itself (a layout the daemon rejects, memory it cannot attach) is a configuration error
        and raised; later (the daemon came after the engine) it is logged, and the engine goes
        on without."""
        r = self.regs[group]
        if r.client is not None or r.memory is None or time.monotonic() < r.retry_at:
            return r.client
        furthest = self._furthest()
        if furthest is not None and furthest != group and self.regs[furthest].client is None:
            self._register(furthest, at_start)
        try:
            client = self.cfg.connect(self.cfg.worker_reconnect_for)
            if isinstance(r.memory, kvcached.GpuKvMemory):
                reg = client.register_gpu(r.engine_name, r.namespace, r.memory)
            else:
                reg = client.register(r.engine_name, r.namespace, r.memory)
        except kvcached.KvcachedError as e:
            if at_start and not isinstance(e, (kvcached.UnreachableError, kvcached.LimitReachedError)):
                raise
            r.retry_at = time.monotonic() + self.cfg.retry_after
            log.error("kvcached connector (worker %s): not registered (%s); retrying", r.engine_name, e)
            return None
        r.client = client
        log.info(
            "kvcached connector (worker %s): %d blocks of %d bytes registered, namespace %s",
            r.engine_name, r.memory.slots.num_blocks, reg.block_bytes, reg.namespace_id,
        )  # fmt: skip
        return client

    # -- loads ---------------------------------------------------------------------------------

    def _keys(self, t: Transfer) -> dict:
        return key_kwargs(_key_context(t.context), self.cfg.key_scheme)

    def _idle(self, t: Transfer) -> bool:
        """Whether `t` is of a group without layers on this stage (nothing to move here)."""
        return self.regs[t.group].namespace is None

    def _start(self, t: Transfer) -> kvcached.LoadOp | None:
        if self._idle(t):
            return None
        client = self._register(t.group)
        if client is None:
            return None
        try:
            return client.load(t.tokens, t.first_block, t.slots, **self._keys(t))
        except kvcached.KvcachedError as e:
            log.warning("kvcached: load for %s refused: %s", t.req_id, e)
            return None

    def _finish(self, op: kvcached.LoadOp | None, t: Transfer, status: kvcached.LoadStatus | None) -> bool:
        """Records a finished load; False when not every block came. With one KV-cache group
        the blocks that did not come are reported invalid (vLLM recomputes them); with several,
        vLLM 0.33 takes only whole requests as failed (`failed_recving`: block ids are not
        unique across groups), so the caller reports the request."""
        if self._idle(t):
            return True
        got = status.loaded_blocks if status is not None and op is not None else 0
        self.counts["loaded"] += got
        if got < len(t.slots):
            self.counts["load_failed"] += len(t.slots) - got
            if len(self.groups) == 1:
                self._invalid.update(t.slots[got:])
            return False
        return True

    def start_load_kv(self, meta: KvcachedConnectorMetadata) -> None:
        self.meta = meta
        if self.cuda and (meta.loads or meta.async_loads):
            # The daemon writes the blocks by DMA; kernels still queued must not race it.
            torch.cuda.current_stream().synchronize()
        self._unplanned.update(meta.unplanned)
        self._invalid.update(meta.unplanned_blocks)
        self._sync = [(self._start(t), t) for t in meta.loads]
        for t in meta.async_loads:
            self._async.setdefault(t.req_id, []).append((self._start(t), t))
        if not self.cfg.layerwise:
            self.wait_sync_loads()

    def wait_sync_loads(self) -> None:
        pending, self._sync = self._sync, []
        deadline = time.monotonic() + LOAD_DEADLINE_S
        for op, t in pending:
            status = None
            try:
                while op is not None:
                    status = self.regs[t.group].client.wait(op, timeout=max(0.0, deadline - time.monotonic()))
                    if status.finished or time.monotonic() >= deadline:
                        break
            except kvcached.KvcachedError as e:
                log.warning("kvcached: load for %s failed: %s", t.req_id, e)
                status = None
            self._finish(op, t, status if status is not None and status.finished else None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._sync:
            self.wait_sync_loads()

    def poll_async_loads(self) -> set[str]:
        done, self._unplanned = self._unplanned, set()
        self._failed_recving |= done
        for req_id, loads in list(self._async.items()):
            statuses = []
            for op, t in loads:
                try:
                    status = self.regs[t.group].client.poll(op) if op is not None else None
                except kvcached.KvcachedError as e:
                    log.warning("kvcached: load for %s failed: %s", req_id, e)
                    status = None
                statuses.append(status)
            if any(s is not None and not s.finished for s in statuses):
                continue
            for (op, t), status in zip(loads, statuses, strict=True):
                whole = status is None or status.loaded_blocks == 0 or len(self.groups) > 1
                if not self._finish(op, t, status) and whole:
                    self._failed_recving.add(req_id)
            done.add(req_id)
            del self._async[req_id]
        return done

    def take_failed_recving(self) -> set[str]:
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def take_invalid_blocks(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    # -- saves ---------------------------------------------------------------------------------

    def _save_all(self, saves: list[Transfer], ready: Any = None) -> None:
        if ready is not None:
            ready.synchronize()
        for t in saves:
            if self._idle(t):
                continue
            try:
                client = self._register(t.group)
                if client is None:
                    self.counts["save_failed"] += len(t.slots)
                    continue
                r = client.save(t.tokens, t.first_block, t.slots, **self._keys(t))
            except kvcached.KvcachedError as e:
                self.counts["save_failed"] += len(t.slots)
                log.warning("kvcached: save for %s failed: %s", t.req_id, e)
                continue
            self.counts["saved"] += r.stored
            self.counts["already_present"] += r.already_present
            self.counts["save_failed"] += r.failed
            if r.failed:
                log.warning("kvcached: %d blocks of %s not saved: %s", r.failed, t.req_id, r.error)

    def save_kv_layer(self, layer_name: str) -> None:
        meta = self.meta
        if not (self.cfg.layerwise and meta and meta.saves and layer_name == self.last_layer):
            return
        if self._register(self.first) is None or self._saving is not None:
            return
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvcached-save")
        self._saving = self._pool.submit(self._save_all, meta.saves, ready)

    def wait_for_save(self, meta: KvcachedConnectorMetadata) -> None:
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.result()
            return
        if meta.saves and self._register(self.first) is not None:
            if self.cuda:
                torch.cuda.current_stream().synchronize()
            self._save_all(meta.saves)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for r in self.regs:
            if r.client is not None and r.client.engine_id is not None:
                try:
                    r.client.unregister()
                except kvcached.KvcachedError as e:
                    log.debug("kvcached: unregister at shutdown failed: %s", e)
