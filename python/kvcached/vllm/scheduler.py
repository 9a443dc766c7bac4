"""The connector's scheduler half: asks the daemon how much of a request is cached, plans loads
into the blocks vLLM allocated, and plans saves of the blocks each step fills.

It keeps no copy of the cache's contents: each `get_num_new_matched_tokens` is a lookup on the
daemon (no block data moves). The scheduler process has no KV memory, but the daemon answers
lookups only for a registered engine, so this half registers one slot of its namespace's layout
(the namespace of tensor-parallel rank 0 of pipeline stage 0, whose saves it counts on). Every
rank and stage saves the same blocks of its own share of the KV; one that lacks a block found
here fails that block's load, and vLLM recomputes it (`kv_load_failure_policy`).
"""

from __future__ import annotations

import logging
import math
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import kvcached
from kvcached.breaker import Breaker, unregister
from kvcached.vllm.config import ConnectorConfig, KvGroup, _unsupported, kv_groups, namespace
from kvcached.vllm.keys import AdapterHashes, ContextArgs, key_kwargs, request_context
from kvcached.vllm.meta import KvcachedConnectorMetadata, Transfer

log = logging.getLogger("kvcached.vllm")

# Block boundaries, from where the attention hit ends back, at which a lookup asks whether the
# state groups hold a state: a saved state lies where an earlier prompt's last whole block
# before its last token ended, which for a request extending that prompt is where the hit ends
# or a block before it.
STATE_PROBES = 4


@dataclass
class _Req:
    request: Any
    # Why kvcached does not serve this request (None: it does).
    unsupported: str | None
    # What its keys bind besides its tokens (adapter, salt, images, prompt embeddings; None:
    # nothing), as data for the workers and as the client's KeyContext, per block size of the
    # KV-cache groups (a prompt embedding's rows are hashed per block).
    contexts: dict[int, tuple[ContextArgs | None, Any]] = field(default_factory=dict)
    # Tokens vLLM had locally when it asked us (block-aligned), and whether its load is async.
    local_tokens: int = 0
    load_async: bool = False
    # vLLM's block ids of the request, per KV-cache group.
    block_ids: list[list[int]] = field(default_factory=list)
    # Tokens from the start of the prompt already in kvcached (saved, loaded or planned).
    saved_upto: int = 0
    # A load of it failed (`failed_recving`): vLLM computes it, not looked up again.
    load_failed: bool = False
    # (state group, block boundary in tokens) of the state blocks saved.
    states_saved: set[tuple[int, int]] = field(default_factory=set)
    scheduled: bool = False
    # Of the last lookup's hit, tokens whose fastest copy is on disk (G3 or G4).
    disk_tokens: int = 0
    # The request's leading token ids as uint32, converted once (a lookup, a load and a save
    # of the same request hand over the same prefix).
    tokens: array = field(default_factory=lambda: array("I"))


@dataclass
class SchedulerStats:
    """Counters of this half, for tests and benchmarks."""

    lookups: int = 0
    lookup_seconds: float = 0.0
    hit_tokens: int = 0
    loads_planned: int = 0
    blocks_to_load: int = 0
    saves_planned: int = 0
    blocks_to_save: int = 0
    daemon_errors: int = 0


class SchedulerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig, transfer_config: Any):
        self.groups = kv_groups(vllm_config, kv_cache_config)
        # vLLM's scheduler holds pipeline stage 0's KV-cache config: the stage whose namespaces
        # lookups ask.
        empty = [g.index for g in self.groups if not g.layers]
        if empty:
            raise _unsupported(f"KV-cache groups {empty} without layers on pipeline stage 0 (lookups ask stage 0's)")
        # What vLLM's scheduler aligns hits and computed tokens to: the least common multiple of
        # the groups' blocks (each group's blocks as vLLM counts them: with decode context
        # parallelism, the spec's block size times the ranks). A hit is whole blocks of every
        # group.
        self.block_size: int = math.lcm(*(g.block_tokens for g in self.groups))
        self.cfg = cfg
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        # State groups (Mamba) restore a prefix from one block, which vLLM reads only when the
        # load finished before the request's first step (loads of several groups are
        # asynchronous: `get_num_new_matched_tokens`).
        self.states = [g for g in self.groups if g.state]
        # Each KV-cache group's blocks are keyed in a namespace of their own (rank 0's of stage 0).
        self.namespaces = [namespace(vllm_config, kv_cache_config, cfg, 0, tp_size, g) for g in self.groups]
        self.namespace = self.namespaces[0]
        self.consumer = bool(transfer_config.is_kv_consumer)
        self.producer = bool(transfer_config.is_kv_producer)
        self.engine_name = f"vllm-scheduler-{transfer_config.engine_id}"[:128]
        self.stats = SchedulerStats()
        self._clients: list[kvcached.Client] | None = None
        # Any failed call stops lookups for `retry_after` (the scheduler's step must not stall).
        self._breaker = Breaker(cfg.retry_after, log, "tokens", trips_on=(kvcached.KvcachedError,))
        self._reqs: dict[str, _Req] = {}
        self._loads: list[Transfer] = []
        self._async_loads: list[Transfer] = []
        self._unplanned: list[str] = []
        self._unplanned_blocks: list[int] = []
        self._told: set[str] = set()
        self._adapters = AdapterHashes()
        self._connect()

    # -- the daemon --------------------------------------------------------------------------

    @property
    def _client(self) -> kvcached.Client | None:
        """The first group's client (None until registered)."""
        return self._clients[0] if self._clients else None

    def _connect(self) -> list[kvcached.Client] | None:
        """A registered client per KV-cache group (the daemon answers lookups in a namespace
        only to an engine registered in it), or None while the daemon is away."""
        if not self._breaker.up():
            return None
        if self._clients is None:
            clients = []
            try:
                # Every group's slot in one memory: the daemon counts registrations of one
                # memory as one engine (`limits.max_engines_per_uid`).
                slots = [kvcached.SlotLayout.for_layout(ns.layout, 1) for ns in self.namespaces]
                # The largest first: the daemon maps the memory as far as the first
                # registration's slot reaches, and shares that with the others.
                order = sorted(range(len(slots)), key=lambda i: -slots[i].extent)
                shared = kvcached.KvMemory.with_slots(slots[order[0]])
                clients_by_group: dict[int, kvcached.Client] = {}
                for i in order:
                    g, ns = self.groups[i], self.namespaces[i]
                    client = self.cfg.connect(self.cfg.scheduler_reconnect_for)
                    suffix = f"-g{g.index}" if g.count > 1 else ""
                    memory = kvcached.KvMemory.from_fd(shared.fd, slots[i])
                    clients.append(client)
                    client.register((self.engine_name + suffix)[:128], ns, memory)
                    clients_by_group[i] = client
                self._clients = [clients_by_group[i] for i in range(len(slots))]
                clients = self._clients
                log.info("kvcached connector (scheduler): namespaces %s at %s",
                         [ns.id for ns in self.namespaces], clients[0].socket)  # fmt: skip
            except kvcached.KvcachedError as e:
                for c in clients:
                    unregister(c, log)
                self._down("registration", None, e)
                return None
        return self._clients

    def _down(self, what: str, n: int | None, e: Exception) -> None:
        """The daemon failed a call: serve without it for `retry_after` seconds rather than
        stall every scheduler step on it."""
        self.stats.daemon_errors += 1
        self._breaker.failed(what, n, e)

    def _track(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            contexts: dict[int, tuple[ContextArgs | None, Any]] = {}
            why = None
            for bs in sorted({g.block_tokens for g in self.groups}):
                context, why = request_context(request, self._adapters, bs)
                key_context = None
                if context is not None:
                    try:
                        key_context = context.make()
                    except ValueError as e:
                        context, why = None, f"a key context kvcached refuses ({e})"
                if why:
                    break
                contexts[bs] = (context, key_context)
            st = _Req(request, why, contexts)
            self._reqs[request.request_id] = st
            if st.unsupported and st.unsupported not in self._told:
                self._told.add(st.unsupported)
                log.info("kvcached connector: requests with %s are neither looked up nor saved", st.unsupported)
        return st

    def _keys(self, st: _Req, g: KvGroup) -> dict[str, Any]:
        """What keys a lookup of `st` in group `g`'s namespace."""
        return key_kwargs(st.contexts[g.block_tokens][1], self.cfg.key_scheme)

    @staticmethod
    def _context(st: _Req, g: KvGroup) -> ContextArgs | None:
        """The key context of `st`'s transfers in group `g` (its blocks' size)."""
        return st.contexts[g.block_tokens][0]

    def _tokens(self, st: _Req, end: int) -> array:
        """The request's first `end` token ids, as a new array (a transfer keeps its own)."""
        have = st.tokens
        if len(have) < end:
            have.extend(st.request.all_token_ids[len(have) : end])
        return have[:end]

    # -- vLLM's scheduler calls ----------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        # The prompt's ids converted as the request arrives, not while schedule() admits it.
        st = self._track(request)
        if not st.unsupported:
            self._tokens(st, len(request.all_token_ids))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._track(request)
        st.local_tokens = num_computed_tokens
        st.load_async = False
        if not self.consumer or st.unsupported or st.load_failed:
            return 0, False
        bs = self.block_size
        # vLLM computes at least the last token itself: a hit may cover every block before it.
        limit = (request.num_tokens - 1) // bs * bs
        # A load starts where vLLM's own hit ends, at a block of every group.
        if limit <= num_computed_tokens or num_computed_tokens % bs:
            return 0, False
        clients = self._connect()
        if clients is None:
            return 0, False
        start = time.perf_counter()
        try:
            found, disk = self._hit(clients, st, self._tokens(st, limit))
        except kvcached.KvcachedError as e:
            self._down("lookup", limit, e)
            return 0, False
        self.stats.lookups += 1
        self.stats.lookup_seconds += time.perf_counter() - start
        n = max(0, min(found, limit) - num_computed_tokens)
        self.stats.hit_tokens += n
        st.disk_tokens = disk
        # With several KV-cache groups vLLM takes a failed load only as a whole request that
        # waited for it (`failed_recving`), so such a model's loads are asynchronous.
        st.load_async = (self.cfg.load_async or len(self.groups) > 1) and n > 0
        return n, st.load_async

    def _windowed(self) -> bool:
        """Whether window groups save only their windows (they then need a full-attention
        group to say where a hit ends)."""
        return self.cfg.window_saves == "window" and any(g.window_blocks is None and not g.state for g in self.groups)

    def _hit(self, clients: list[kvcached.Client], st: _Req, tokens: Any) -> tuple[int, int]:
        """The cached prefix every group can serve, in tokens (whole blocks of every group), and
        how many of them are on disk (G3/G4): the shortest of the full-attention groups' cached
        prefixes, where every window group also holds the blocks its window reads before it
        (saved windows end where earlier prompts ended). With `window_saves = "all"` (or no
        full-attention group) every group's prefix is looked up from the first block. With state
        groups (Mamba) the hit ends at the longest boundary, at most `STATE_PROBES` back from
        there, where every state group holds the state too."""
        windowed = self._windowed()
        bs = self.block_size
        end, disk = None, 0
        for g, c in zip(self.groups, clients, strict=True):
            if g.state or (windowed and g.window_blocks is not None):
                continue
            h = c.lookup(tokens if end is None else tokens[:end], **self._keys(st, g))
            t = h.matched_tokens // bs * bs
            if end is None or t < end:
                end, disk = t, (h.g3_blocks + h.g4_blocks) * g.block_tokens
            if end == 0:
                return 0, 0
        if end is None:
            if not self.states:
                return 0, 0
            end = len(tokens) // bs * bs  # state groups alone (no attention): the state decides
        if windowed and not self._windows_hold(clients, st, tokens, end):
            return 0, 0
        if not self.states:
            return end, min(disk, end)
        # The hit ends where every state group holds the state: at most STATE_PROBES boundaries
        # back from where attention's ends (and the windows hold there too).
        for b in range(end, max(0, end - STATE_PROBES * bs), -bs):
            if not self._states_hold(clients, st, tokens, b):
                continue
            if b < end and windowed and not self._windows_hold(clients, st, tokens, b):
                continue
            return b, min(disk, b)
        return 0, 0

    def _windows_hold(self, clients: list[kvcached.Client], st: _Req, tokens: Any, end: int) -> bool:
        """Whether every window group holds the blocks its window reads before token `end`."""
        for g, c in zip(self.groups, clients, strict=True):
            if g.window_blocks is None or g.state:
                continue
            last = end // g.block_tokens
            first = max(0, last - g.window_blocks)
            run = c.lookup(tokens[:end], first_block=first, **self._keys(st, g))
            if first + run.matched_blocks < last:
                return False  # the window before the hit point is not all there
        return True

    def _states_hold(self, clients: list[kvcached.Client], st: _Req, tokens: Any, end: int) -> bool:
        """Whether every state group holds the state after the first `end` tokens (its block
        ending there)."""
        for g in self.states:
            run = clients[g.index].lookup(tokens[:end], first_block=end // g.block_tokens - 1, **self._keys(st, g))
            if run.matched_blocks < 1:
                return False
        return True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._track(request)
        if num_external_tokens <= 0:
            return  # build_connector_meta takes the block ids of the request it schedules
        st.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        # Tokens: where vLLM's own hit ends, and where the load ends (whole blocks of every
        # group: both are multiples of the scheduler's block).
        start = st.local_tokens
        stop = start + -(-num_external_tokens // self.block_size) * self.block_size
        tokens = self._tokens(st, stop)
        planned = []
        for g in self.groups:
            bs = g.block_tokens
            first, count = start // bs, (stop - start) // bs
            if g.state:
                # The state after the hit, into the block vLLM reads it from (its others are
                # its null block).
                at = stop // bs - 1
                ids = st.block_ids[g.index]
                if len(ids) <= at or ids[at] == 0:
                    self._unplannable(st, start, stop, "no block for its state")
                    return
                planned.append(Transfer(request.request_id, tokens, at, [ids[at]], self._context(st, g), g.index))
                continue
            slots = st.block_ids[g.index][first : first + count]
            if len(slots) != count:
                self._unplannable(st, start, stop, f"{len(slots)} blocks where a load needs {count}")
                return
            # A window group holds blocks (vLLM's others are its null block, 0) only where its
            # window reads, a chunked group only in the current chunk: those are loaded, the
            # blocks before them are not needed.
            skip = 0
            if g.window_blocks is not None or g.chunked:
                while skip < len(slots) and slots[skip] == 0:
                    skip += 1
            if 0 in slots[skip:]:
                self._unplannable(st, start, stop, "no block for part of a load")
                return
            if skip < len(slots):
                planned.append(
                    Transfer(request.request_id, tokens, first + skip, slots[skip:], self._context(st, g), g.index)
                )
        (self._async_loads if st.load_async else self._loads).extend(planned)
        # Loaded blocks are in kvcached already: saves start after them.
        st.saved_upto = max(st.saved_upto, stop)
        self.stats.loads_planned += 1
        self.stats.blocks_to_load += sum(len(t.slots) for t in planned)

    def _unplannable(self, st: _Req, start: int, stop: int, why: str) -> None:
        """A load of tokens `start..stop` vLLM counts on that cannot be planned: reported failed
        (the request's, when it waits for its loads; else its blocks'), so that vLLM computes
        them."""
        log.error("kvcached connector: %s: %s; vLLM computes it", st.request.request_id, why)
        if st.load_async:
            self._unplanned.append(st.request.request_id)
        else:
            bs = self.groups[0].block_tokens
            ids = st.block_ids[0] if st.block_ids else []
            self._unplanned_blocks.extend(b for b in ids[start // bs : stop // bs] if b)

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        """The external hit split into host memory (G2) and disk (G3/G4) tokens. The lookup
        counts blocks per tier without saying which ones; a chain's tail is the usual part to
        have left G2 for disk, and the loaded part is the tail of the hit, so the disk blocks
        are counted against it first."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        if num_external_tokens <= 0:
            return {}
        st = self._reqs.get(request.request_id)
        disk = min(num_external_tokens, st.disk_tokens if st else 0)
        out = {CacheHitSource.HOST: num_external_tokens - disk, CacheHitSource.DISK: disk}
        return {k: v for k, v in out.items() if v}

    def build_connector_meta(self, scheduler_output: Any) -> KvcachedConnectorMetadata:
        meta = KvcachedConnectorMetadata(
            loads=self._loads,
            async_loads=self._async_loads,
            unplanned=self._unplanned,
            unplanned_blocks=self._unplanned_blocks,
        )
        self._loads, self._async_loads, self._unplanned, self._unplanned_blocks = [], [], [], []
        if not self.producer:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        spec = scheduler_output.scheduled_spec_decode_tokens
        for r in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(r.req_id)
            if st is None or st.unsupported:
                continue
            st.block_ids = [list(ids) for ids in r.block_ids]
            if not st.scheduled:
                st.scheduled = True
                params = st.request.kv_transfer_params or {}
                # A prefill handing off to a decode engine saves the whole prompt, cached
                # prefix included, so the decode side finds all of it (blocks already present
                # cost the daemon a key lookup, not a copy). Otherwise blocks vLLM had cached
                # were saved when they were computed.
                if not params.get("do_remote_decode"):
                    st.saved_upto = max(st.saved_upto, r.num_computed_tokens // self.block_size * self.block_size)
            done = r.num_computed_tokens + scheduled[r.req_id] - len(spec.get(r.req_id, ()))
            self._plan_save(meta, st, done)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None or st.unsupported:
                continue
            new = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = [list(ids) for ids in new] if new is not None else []
            elif new is not None:
                for have, more in zip(st.block_ids, new, strict=True):
                    have.extend(more)
            done = cached.num_computed_tokens[i] + scheduled[rid] - len(spec.get(rid, ()))
            self._plan_save(meta, st, done)
        if self.states:
            self._plan_state_saves(meta, scheduler_output)
        return meta

    def _plan_state_saves(self, meta: KvcachedConnectorMetadata, scheduler_output: Any) -> None:
        """Saves of the state blocks vLLM offers this step: the state groups' blocks at the
        block boundaries its prefix cache keeps (by exact block id: a state group's block table
        is not append-only). They are written by this step's forward pass, and saved after it
        (`wait_for_save`), before vLLM may reuse them."""
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = block_state.boundary_state_offloads if block_state is not None else {}
        for rid, entries in offers.items():
            st = self._reqs.get(rid)
            if st is None or st.unsupported:
                continue
            req = st.request
            limit = req.num_tokens if self.cfg.save_decode else req.num_prompt_tokens
            for group, block_id, boundary in entries:
                if not (0 <= group < len(self.groups) and self.groups[group].state):
                    continue
                g = self.groups[group]
                if block_id == 0 or boundary <= 0 or boundary % g.block_tokens or boundary > limit:
                    continue
                if (group, boundary) in st.states_saved or boundary > len(req.all_token_ids):
                    continue
                st.states_saved.add((group, boundary))
                meta.saves.append(Transfer(rid, self._tokens(st, boundary), boundary // g.block_tokens - 1,
                                           [block_id], self._context(st, g), group))  # fmt: skip
                self.stats.blocks_to_save += 1

    def _plan_save(self, meta: KvcachedConnectorMetadata, st: _Req, done_tokens: int) -> None:
        bs = self.block_size
        req = st.request
        limit = req.num_tokens if self.cfg.save_decode else req.num_prompt_tokens
        # Only tokens already known (async scheduling may count one not sampled yet).
        end = min(done_tokens, limit, len(req.all_token_ids)) // bs * bs
        if end <= st.saved_upto:
            return
        if len(st.block_ids) != len(self.groups):
            return
        tokens = self._tokens(st, end)
        saves = []
        windowed = self._windowed()
        for g in self.groups:
            if g.state:
                continue  # saved as vLLM offers their blocks (`_plan_state_saves`)
            gbs = g.block_tokens
            first, last = st.saved_upto // gbs, end // gbs
            slots = st.block_ids[g.index][first:last]
            if len(slots) != last - first:
                return
            # The blocks a window group still holds (a block it already dropped, vLLM's null
            # block 0, cannot be saved: its run restarts after it). With windowed saves, only
            # those the window of the saved prefix's end reads (and one more, for a later
            # request whose hit must stop a token short of it).
            skip = max((i + 1 for i, s in enumerate(slots) if s == 0), default=0)
            if windowed and g.window_blocks is not None:
                skip = max(skip, limit // gbs - g.window_blocks - 1 - first)
            if skip < len(slots):
                saves.append(
                    Transfer(req.request_id, tokens, first + skip, slots[skip:], self._context(st, g), g.index)
                )
        meta.saves.extend(saves)
        st.saved_upto = end
        self.stats.saves_planned += 1
        self.stats.blocks_to_save += sum(len(t.slots) for t in saves)

    def update_connector_output(self, output: Any) -> None:
        """The workers' report of a step: a request whose load failed (vLLM computes it from
        the start) is not looked up again, or it would wait for the same failing load anew."""
        for rid in getattr(output, "failed_recving", None) or ():
            st = self._reqs.get(rid)
            if st is not None:
                st.load_failed = True
                log.warning("kvcached connector: a load of %s failed; vLLM computes it", rid)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        params = request.kv_transfer_params or {}
        if self.producer and params.get("do_remote_decode"):
            # The step that finished the request saved its blocks before vLLM got here (the
            # worker's wait_for_save returns when they are stored), so the blocks can be freed
            # now and the decode engine finds them by looking the prompt up.
            return False, {
                "do_remote_prefill": True,
                "kvcached_tokens": st.saved_upto if st else 0,
                "kvcached_namespace": self.namespace.id,
            }
        return False, None

    def shutdown(self) -> None:
        for c in self._clients or []:
            unregister(c, log)
