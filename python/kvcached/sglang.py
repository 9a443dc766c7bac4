"""kvcached as SGLang HiCache's storage backend (SGLang 0.5.x).

SGLang keeps KV in GPU memory, then in its host pool, then in a storage backend. With this
backend the storage is the node's kvcached daemon, shared by every engine on the node (SGLang's
and vLLM's), with its disk and object-store tiers, its peers and the cluster router:

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvcached",
            "module_path": "kvcached.sglang", "class_name": "KvcachedStorage",
            "interface_v1": 1, "allocator": "shm"}'

- `interface_v1: 1` (recommended): SGLang hands the backend host-pool page indices
  (`batch_get_v1` / `batch_set_v1`), and the daemon copies those pages itself. Without it
  SGLang's generic path hands over each page as a flat copy (`batch_get` / `batch_set`), which
  the backend moves through its staging area: the same keys and namespace, one copy more.
- `allocator: "shm"` (recommended): SGLang allocates its host pool in a memfd, which the
  backend registers with the daemon, so with the `layer_first` and `page_first_direct` layouts
  the daemon reads and writes the pool's pages in place (no copy in the engine). Any other
  layout or allocator, and the page order "vllm", go through a staging area of the backend's
  own (one host copy per page).
- `kvcached.page_order`: the byte order of a stored MHA page: `"sglang"` (default: each
  layer's K page, then its V page, as SGLang's pools hold them) or `"vllm"` (each layer's page
  as vLLM 0.33 holds it, `[tokens, heads, K|V]`), with which a vLLM engine of the same model
  with `kvcached.key_scheme: "sglang"` shares blocks both ways. MLA pages are the same bytes in
  both engines.
- `kvcached.socket`, `kvcached.model_id` (default SGLang's model name), `kvcached.tenant_salt`
  (default `$KVCACHED_TENANT_SALT`), `kvcached.namespace_extra`, `kvcached.staging_pages`
  (default SGLang's batch, at most 256 MiB), `kvcached.reconnect_for` (seconds, default 0.5),
  `kvcached.retry_after` (seconds, default 5).

SGLang's hybrid models (`batch_exists_v2`, `batch_get_v2`, `batch_set_v2`): each sidecar pool
beside the KV pool (Mamba state, sliding-window KV, indexers) is a namespace of its own, keyed by
the same page hashes, its pages staged as the pool's flat data pages. With SGLang's storage
metrics on, `get_stats` returns them.

Pages are keyed by SGLang's own page hashes (`docs/block-keys.md` section 7, scheme "sglang"),
in the namespace of `kvcached.shared_pages`, which names the bytes: engines share blocks only
where they hold the same bytes. Every tensor-parallel rank registers its own pages (its heads);
an MLA model's latent is the same on every rank, so its ranks share one namespace and only
SGLang's writer rank saves.
"""

from __future__ import annotations

import logging
import os
import threading
from functools import partial
import time
from dataclasses import dataclass
from typing import Any

import torch

import kvcached
from kvcached.breaker import Breaker, unregister
from kvcached.shared_pages import shared_namespace

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
except ImportError as e:  # pragma: no cover - only without SGLang
    raise ImportError(f"kvcached.sglang needs SGLang 0.5.x installed ({e})") from e

log = logging.getLogger("kvcached.sglang")

PREFIX = "kvcached."
KEYS = (
    "socket", "model_id", "tenant_salt", "namespace_extra", "page_order", "staging_pages", "reconnect_for",
    "retry_after",
)  # fmt: skip
# SGLang's batch of pages per backend call (cache_controller.py, STORAGE_BATCH_SIZE).
SGLANG_BATCH = 128
# Prefix lengths a hybrid hit query tries, from the longest back, for one where every
# trailing pool (a Mamba state, a window) holds its pages; and how many restorable ones it
# reports (SGLang intersects them across ranks).
MAX_PROBES = 64
RESTORABLE = 4
# The attributes of a sidecar host pool that shape its flat data pages (whichever it has).
_POOL_SHAPE = (
    "layout", "page_size", "size_per_token", "dtype", "layer_num", "head_num", "head_dim", "v_head_dim",
    "kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim", "num_mamba_layers", "conv_state_shapes",
    "temporal_state_shape", "conv_dtype", "temporal_dtype",
)  # fmt: skip
# A staging area of at most this many bytes per direction, unless `kvcached.staging_pages` says.
STAGING_BYTES = 256 << 20


def page_key(key: str) -> bytes | None:
    """SGLang's page hash (SHA-256, 64 hex digits) as the 32 bytes the daemon keys by; None for
    any other key (SGLang's XXH3-64 keys, suffixed keys of its unified scheme): scheme "sglang"
    names SHA-256 page hashes only, and a 64-bit hash is too short to key a node's blocks by."""
    if len(key) != 64:
        return None
    try:
        return bytes.fromhex(key)
    except ValueError:
        return None


# Each host layout's buffer with an axis of pages ("n"): its axes, by name. "2" is K and V.
_MHA_AXES = {"layer_first": "2LnPHD", "page_first": "2nPLHD", "page_first_direct": "2nLPHD", "page_head": "2nHPLD"}
_MLA_AXES = {"layer_first": "LnPD", "page_first": "nPLD", "page_first_direct": "nLPD"}
# A block's bytes, pages first: vLLM's order (each layer's page [tokens, heads, K|V], as vLLM
# 0.33 keeps it), SGLang's (each layer's K page, then its V page), MLA's (each layer's latent).
_ORDERS = {"vllm": "nLPH2D", "sglang": "nL2PHD", "mla": "nLPD"}


@dataclass(frozen=True)
class Pages:
    """Where a host pool's pages lie, and how they map to the bytes of a kvcached block in the
    page order `order` ("vllm" or "sglang"; MLA pages have one order)."""

    attention: str
    layout: str
    order: str
    layers: int
    page_size: int
    num_pages: int
    heads: int
    dim: int
    itemsize: int

    @staticmethod
    def of(pool: Any, is_mla: bool, order: str) -> Pages:
        layout = str(pool.layout)
        axes = _MLA_AXES if is_mla else _MHA_AXES
        if layout not in axes:
            raise NotImplementedError(
                f"kvcached's HiCache backend does not know the host layout {layout!r} (it knows {list(axes)})"
            )
        if is_mla:
            heads, dim = 1, int(pool.kv_cache_dim)
        else:
            if int(getattr(pool, "v_head_dim", pool.head_dim)) != int(pool.head_dim):
                raise NotImplementedError("K and V of different head sizes in SGLang's host pool")
            heads, dim = int(pool.head_num), int(pool.head_dim)
        size, p = int(pool.size), int(pool.page_size)
        return Pages(
            attention="mla" if is_mla else "mha",
            layout=layout,
            order="mla" if is_mla else order,
            layers=int(pool.layer_num),
            page_size=p,
            num_pages=size // p,
            heads=heads,
            dim=dim,
            itemsize=int(pool.dtype.itemsize),
        )

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's page (K and V together for MHA)."""
        n = self.page_size * self.heads * self.dim * self.itemsize
        return n if self.attention == "mla" else 2 * n

    def in_place(self) -> kvcached.SlotLayout | None:
        """The pool's own pages as kvcached slots (slot = page index), two segments per layer
        in block byte order; None where the pool does not hold a block's layers in that order."""
        if self.layout not in ("layer_first", "page_first_direct") or self.order == "vllm":
            return None
        L, P, S = self.layers, self.page_size, self.num_pages * self.page_size
        seg = self.page_bytes // 2
        tok = self.heads * self.dim * self.itemsize
        segments: list[tuple[int, int]] = []
        for layer in range(L):
            for half in range(2):
                if self.attention == "mha" and self.layout == "layer_first":  # (2, L, S, H, D)
                    segments.append(((half * L * S + layer * S) * tok, P * tok))
                elif self.attention == "mha":  # page_first_direct: (2, S/P, L, P, H, D)
                    segments.append(((half * S * L + layer * P) * tok, L * P * tok))
                elif self.layout == "layer_first":  # MLA (L, S, 1, dim): a layer's page in halves
                    segments.append((layer * S * tok + half * seg, P * tok))
                else:  # MLA page_first_direct: (S/P, L, P, 1, dim)
                    segments.append((layer * P * tok + half * seg, L * P * tok))
        return kvcached.SlotLayout(segments, seg, self.num_pages)

    def staging_slots(self, n: int) -> kvcached.SlotLayout:
        """`n` slots of whole blocks one after another, two segments per layer."""
        seg = self.page_bytes // 2
        block = seg * 2 * self.layers
        return kvcached.SlotLayout([(i * seg, block) for i in range(2 * self.layers)], seg, n)

    def _sizes(self, n: int) -> dict[str, int]:
        return {"2": 2, "L": self.layers, "n": n, "P": self.page_size, "H": self.heads, "D": self.dim}

    def _axes(self) -> str:
        """The axes of the pool's buffer, by name, with "n" its pages."""
        return (_MLA_AXES if self.attention == "mla" else _MHA_AXES)[self.layout]

    def _page_perm(self) -> tuple[int, ...]:
        """The permutation from one page of the pool's buffer (its axes without "n") to a block
        in the block order."""
        page_axes = self._axes().replace("n", "")
        return tuple(page_axes.index(a) for a in _ORDERS[self.order][1:])

    def _page_view(self, buf: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The pool's buffer with an axis of pages, and that axis."""
        axes, size = self._axes(), self._sizes(self.num_pages)
        return buf.view(*(size[a] for a in axes)), axes.index("n")

    def flat_page(self, flat: torch.Tensor) -> torch.Tensor:
        """One page as SGLang's `get_data_page(flat=True)` gives it, as a view in the block order."""
        size = self._sizes(1)
        return flat.view(*(size[a] for a in self._axes().replace("n", ""))).permute(self._page_perm())

    def blocks(self, staging: torch.Tensor, n: int) -> torch.Tensor:
        """The first `n` staging slots as pages in the block order."""
        size = self._sizes(n)
        return staging[: n * self.layers * self.page_bytes // self.itemsize].view(
            *(size[a] for a in _ORDERS[self.order])
        )

    # Page by page: one strided copy per page is ~2.5x torch's copy of all pages' permutation
    # at once (measured on CPU for 36 layers x 4 heads x 128, bf16).
    def gather(self, buf: torch.Tensor, pages: torch.Tensor, out: torch.Tensor) -> None:
        """Copies the pool's `pages` into `out` (block order)."""
        (view, axis), perm = self._page_view(buf), self._page_perm()
        for i, page in enumerate(pages.tolist()):
            out[i].copy_(view.select(axis, page).permute(perm))

    def scatter(self, buf: torch.Tensor, pages: torch.Tensor, src: torch.Tensor) -> None:
        """Copies `src` (block order) into the pool's `pages`."""
        (view, axis), perm = self._page_view(buf), self._page_perm()
        for i, page in enumerate(pages.tolist()):
            view.select(axis, page).permute(perm).copy_(src[i])


def _pool_name(name: Any) -> str:
    """A pool's name as SGLang's PoolName or a string gives it."""
    return str(getattr(name, "value", name))


@dataclass
class _Sidecar:
    """One of a hybrid model's host pools beside the KV pool (Mamba state, sliding-window KV,
    an indexer), by its name: a namespace and a registration of its own, its pages staged as the
    pool's flat data pages (`get_data_page(flat=True)` / `set_from_flat_data_page`, as SGLang's
    own backends move them), keyed by the same page hashes as the KV pages they belong to."""

    name: str
    pool: Any
    page_size: int
    page_bytes: int
    dtype: Any
    namespace: kvcached.Namespace
    client: kvcached.Client
    memory: kvcached.KvMemory
    staging: torch.Tensor  # [slots, bytes per slot], uint8
    lock: threading.Lock


def _keys(hashes: list[bytes]) -> kvcached.EngineHashes:
    return kvcached.EngineHashes("sglang", hashes)


def _matched(client: kvcached.Client, hashes: list[bytes]) -> int:
    """How many of `hashes`, from the first, the namespace of `client` holds."""
    return int(client.lookup((), hashes=_keys(hashes)).matched_blocks) if hashes else 0


def _load(client: kvcached.Client, hashes: list[bytes], slots: list[int]) -> int:
    """Loads the pages of `hashes` into `slots`; how many from the first were loaded."""
    return int(client.load_now((), 0, slots, hashes=_keys(hashes)).loaded_blocks)


def _save(client: kvcached.Client, hashes: list[bytes], slots: list[int], what: str) -> Any:
    """Stores the pages in `slots` under `hashes`; the daemon's answer (a failure logged)."""
    r = client.save((), 0, slots, hashes=_keys(hashes))
    if r.failed:
        # Which pages failed is not said: SGLang is told none of the batch was stored.
        log.warning("kvcached: %d of %d %s not stored: %s", r.failed, len(slots), what, r.error)
    return r


def _load_chunks(load: Any, hashes: list[bytes], per: int, base: int, unstage: Any) -> int:
    """Loads `hashes` through `per` staging slots from slot `base` on, a chunk at a time
    (`load(chunk, slots)`), each chunk's loaded pages taken out by `unstage(at, n)`; how many
    from the first were loaded."""
    got = 0
    for at in range(0, len(hashes), per):
        chunk = hashes[at : at + per]
        n = load(chunk, list(range(base, base + len(chunk))))
        if n:
            unstage(at, n)
        got += n
        if n < len(chunk):
            break
    return got


def _save_chunks(save: Any, hashes: list[bytes], per: int, stage: Any) -> bool:
    """Stores `hashes` through `per` staging slots from slot 0 on, a chunk at a time, each
    chunk's pages put in by `stage(at, n)` (`save(chunk, slots)`); True when every page is."""
    for at in range(0, len(hashes), per):
        chunk = hashes[at : at + per]
        stage(at, len(chunk))
        if not save(chunk, list(range(len(chunk)))):
            return False
    return True


def _staging_slots(block: int) -> int:
    """Staging slots of `block` bytes per direction: SGLang's batch, at most STAGING_BYTES."""
    return max(1, min(SGLANG_BATCH, STAGING_BYTES // block))


def _pool_offset(pool: Any) -> int | None:
    """Where the pool's buffer starts in its memfd (None when it is not in one)."""
    fd, mm = getattr(pool, "fd", None), getattr(getattr(pool, "allocator", None), "mm", None)
    if fd is None or mm is None:
        return None
    import ctypes

    c = ctypes.c_char.from_buffer(mm)
    base = ctypes.addressof(c)
    del c  # no export of SGLang's mapping left behind
    off = int(pool.kv_buffer.data_ptr()) - base
    return off if 0 <= off < len(mm) else None


class KvcachedStorage(HiCacheStorage):
    """SGLang's HiCache storage backend over the node's kvcached daemon (see the module)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        # SGLang's zero-copy interface (host-pool page indices) or its generic one (flat pages).
        self.v1 = bool(int(extra.get("interface_v1", 0) or 0))
        unknown = sorted(k for k in extra if k.startswith(PREFIX) and k[len(PREFIX) :] not in KEYS)
        if unknown:
            raise ValueError(f"unknown kvcached settings {unknown}; known: {[PREFIX + k for k in KEYS]}")

        def get(key: str, default: Any = None) -> Any:
            return extra.get(PREFIX + key, default)

        for what, size in (
            ("pipeline parallelism", getattr(storage_config, "pp_size", 1)),
            ("attention context parallelism", getattr(storage_config, "attn_cp_size", 1)),
            ("decode context parallelism", getattr(storage_config, "dcp_size", 1)),
        ):
            if int(size or 1) > 1:
                # Their ranks hold other layers or other slices of a page under the same page
                # hashes: sharing a namespace would serve one rank another's bytes.
                raise NotImplementedError(f"kvcached's HiCache backend with {what} ({size} ranks)")
        self.config = storage_config
        self.model_id = str(get("model_id") or storage_config.model_name or "")
        if not self.model_id:
            raise ValueError("kvcached's HiCache backend needs the model's name (kvcached.model_id)")
        salt = get("tenant_salt", os.environ.get("KVCACHED_TENANT_SALT"))
        self.tenant_salt = salt.encode() if isinstance(salt, str) and salt else (salt or None)
        self.namespace_extra = str(get("namespace_extra", ""))
        self.page_order = str(get("page_order", "sglang"))
        if self.page_order not in ("sglang", "vllm"):
            raise ValueError(f'kvcached.page_order must be "sglang" or "vllm", not {self.page_order!r}')
        staging = get("staging_pages")
        self.staging_pages = max(1, int(staging)) if staging is not None else None
        # SGLang's prefetch and backup threads wait on each call: a daemon away costs them at
        # most `reconnect_for` once, then `retry_after` seconds of misses without asking.
        self.client_reconnect_for = float(get("reconnect_for", 0.5))
        self.client = kvcached.Client(get("socket", os.environ.get("KVCACHED_SOCKET")),
                                      reconnect_for=self.client_reconnect_for)  # fmt: skip
        self._breaker = Breaker(float(get("retry_after", 5.0)), log, "pages")
        self._told: set[str] = set()
        self.pages: Pages | None = None
        self.namespace: kvcached.Namespace | None = None
        self.memory: kvcached.KvMemory | None = None
        # Staging (pools not registered in place): one half for gets, one for sets, each under
        # its lock (SGLang's prefetch and backup threads call at once).
        self.staging: torch.Tensor | None = None
        self._locks = (threading.Lock(), threading.Lock())
        self.in_place = False
        self.counts = {"exists": 0, "hit_pages": 0, "get_pages": 0, "got_pages": 0, "set_pages": 0, "stored": 0}
        # SGLang's storage metrics (`--enable-metrics`): pages and GB/s of each get and set
        # since the last `get_stats`, as SGLang's own backends keep them.
        self.metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._stats_lock = threading.Lock()
        self._prefetch: list[tuple[int, float]] = []
        self._backup: list[tuple[int, float]] = []
        # A hybrid model's pools beside the KV pool, by name; those registered but not yet made
        # (until SGLang's `on_host_pools_registered`), and the memory they share.
        self._sidecars: dict[str, _Sidecar] = {}
        self._pending: dict[str, Any] = {}
        self._burst_over = False
        self._sidecar_region: kvcached.KvMemory | None = None

    # -- registration ------------------------------------------------------------------------

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang's hybrid models register every host pool here (hybrid_cache_controller.py
        355-357: the KV anchor, which `register_mem_pool_host` registered, and its sidecars),
        then call `on_host_pools_registered`. Each sidecar gets a namespace and a registration
        of its own; the burst's sidecars share one memory (the daemon counts them as one engine
        of the uid). A registration the daemon refuses fails SGLang's attach."""
        name = _pool_name(host_pool_name)
        if host_pool is getattr(self, "mem_pool_host", None) or name == "kv":
            return
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        old = self._sidecars.pop(name, None)
        if old is not None:
            unregister(old.client, log)
        self._pending[name] = host_pool
        if self._burst_over:  # a pool SGLang adds later arrives alone
            self.on_host_pools_registered()

    def on_host_pools_registered(self) -> None:
        """The pools registered so far get their namespaces and registrations, over one memory."""
        self._burst_over = True
        pending, self._pending = list(self._pending.items()), {}
        if not pending:
            return
        plans = []
        at = 0
        for name, pool in pending:
            flat = pool.get_dummy_flat_data_page()
            page_bytes = flat.numel() * flat.element_size()
            block = page_bytes + page_bytes % 2  # two halves of whole bytes
            slots = _staging_slots(block)
            layout = kvcached.SlotLayout([(at, block), (at + block // 2, block)], block // 2, slots)
            plans.append((name, pool, flat.dtype, page_bytes, layout, at, slots * block))
            at += -(-slots * block // 4096) * 4096  # each pool's staging on its own pages
        whole = kvcached.KvMemory.with_slots(plans[-1][4], size=at)
        region = whole.torch(torch.uint8)
        region.zero_()  # faulted in now
        # The pool reaching furthest first: the daemon maps the memory that far for the first
        # registration and shares the mapping with the others.
        for name, pool, dtype, page_bytes, layout, off, length in reversed(plans):
            memory = kvcached.KvMemory.from_fd(whole.fd, layout)
            staging = region[off : off + length].view(layout.num_blocks, layout.block_bytes)
            self._sidecars[name] = self._sidecar(name, pool, dtype, page_bytes, memory, staging)
        self._sidecar_region = whole

    def _sidecar(
        self, name: str, pool: Any, dtype: Any, page_bytes: int, memory: kvcached.KvMemory, staging: torch.Tensor
    ) -> _Sidecar:
        """Pool `name`'s namespace (the pool, its class, every field that shapes its pages, the
        rank) and registration over `memory`."""
        shape = ";".join(f"{a}={getattr(pool, a)!r}" for a in _POOL_SHAPE if hasattr(pool, a))
        extra = (
            f"sglang-pool-v1;pool={name};class={type(pool).__name__};{shape};bytes={page_bytes};"
            f"tp={self.config.tp_rank}/{self.config.tp_size};user={self.namespace_extra}"
        )
        block = staging.shape[1]
        layout = kvcached.KvLayout(1, 1, block // 2, "int8", tokens_per_block=1)
        namespace = kvcached.Namespace(self.model_id, layout, tenant_salt=self.tenant_salt, extra=extra.encode())
        client = kvcached.Client(self.client.socket, reconnect_for=self.client_reconnect_for)
        reg = client.register(f"sglang-{os.getpid()}-tp{self.config.tp_rank}-{name}"[:128], namespace, memory)
        log.info("kvcached: SGLang %s pool registered (%d-byte pages, staged), namespace %s", name, page_bytes,
                 reg.namespace_id)  # fmt: skip
        page_size = int(getattr(pool, "page_size", 1) or 1)
        return _Sidecar(name, pool, page_size, page_bytes, dtype, namespace, client, memory, staging,
                        threading.Lock())  # fmt: skip

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        if pool.dtype in (torch.uint8, torch.int8):
            # An fp8 KV cache is stored as bytes: the pool does not say which format, and
            # e4m3 and e5m2 pages must never meet.
            raise NotImplementedError(
                f"kvcached's HiCache backend with a KV cache stored as {pool.dtype} (fp8: the host pool does not "
                "name its format)"
            )
        self.pages = pages = Pages.of(pool, bool(self.config.is_mla_model), self.page_order)
        self.namespace = shared_namespace(
            self.model_id,
            attention=pages.attention,  # type: ignore[arg-type]
            num_layers=pages.layers,
            kv_heads=pages.heads,
            head_dim=pages.dim,
            dtype=pool.dtype,
            page_size=pages.page_size,
            order=pages.order,
            tp_rank=int(self.config.tp_rank),
            tp_size=int(self.config.tp_size),
            tenant_salt=self.tenant_salt,
            user=self.namespace_extra,
        )
        if self.staging_pages is None:
            self.staging_pages = _staging_slots(pages.layers * pages.page_bytes)
        slots = pages.in_place() if self.v1 else None
        offset = _pool_offset(pool)
        if slots is not None and offset == 0:
            self.memory = kvcached.KvMemory.from_fd(pool.fd, slots)
            self.in_place = True
        else:
            self.memory = kvcached.KvMemory.with_slots(pages.staging_slots(2 * self.staging_pages))
            self.staging = self.memory.torch(pool.dtype)
            self.staging.zero_()  # faulted in now, not on the first pages SGLang moves
            why = (
                "SGLang's generic interface (interface_v1 off)"
                if not self.v1
                else f"{pages.layout}, page order {pages.order}"
                if slots is None
                else "not in a memfd (allocator: shm)"
            )
            log.info("kvcached: SGLang's host pool is staged (%s): one host copy per page", why)
        name = f"sglang-{os.getpid()}-tp{self.config.tp_rank}"
        reg = self.client.register(name, self.namespace, self.memory)
        log.info(
            "kvcached: SGLang host pool registered (%s, %d pages of %d tokens, %s), namespace %s",
            pages.layout, pages.num_pages, pages.page_size, "in place" if self.in_place else "staged",
            reg.namespace_id,
        )  # fmt: skip

    def _hashes(self, keys: list[str]) -> list[bytes] | None:
        """The keys' page hashes, or None (told once) when SGLang's keys are not its SHA-256
        page hashes."""
        hashes = [page_key(k) for k in keys]
        if any(h is None for h in hashes):
            bad = next(k for k, h in zip(keys, hashes, strict=True) if h is None)
            if "keys" not in self._told:
                self._told.add("keys")
                log.error(
                    "kvcached: SGLang page key %r is not a SHA-256 page hash (64 hex digits): kvcached stores "
                    "none of these pages (unset SGLANG_USE_XXH3_HASH; use SGLang's default key scheme)",
                    bad,
                )
            return None
        return hashes  # type: ignore[return-value]  # no None left

    def _up(self) -> bool:
        """Whether to ask the daemon now (not within `retry_after` of finding it away)."""
        return self._breaker.up()

    def _failed(self, what: str, n: int, e: Exception) -> None:
        self._breaker.failed(what, n, e)

    def _page_ids(self, keys: list[str], host_indices: torch.Tensor) -> torch.Tensor:
        assert self.pages is not None
        p = self.pages.page_size
        first = host_indices.view(-1)[: len(keys) * p : p].to(torch.int64)
        return torch.div(first, p, rounding_mode="floor")

    # -- interface v1 --------------------------------------------------------------------------
    #
    # Every call answers: a failure of any kind is a miss (or pages not stored), logged, never an
    # exception into SGLang's prefetch and backup threads, which it does not restart.

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        hashes = self._hashes(keys) if keys else None
        return self._exists(hashes) if hashes is not None else 0

    def _exists(self, hashes: list[bytes]) -> int:
        """How many of the KV pages of `hashes`, from the first, are stored."""
        if self.pages is None or not self._up():
            return 0
        try:
            n = _matched(self.client, hashes)
        except Exception as e:  # noqa: BLE001 - see above
            self._failed("lookup", len(hashes), e)
            return 0
        self.counts["exists"] += 1
        self.counts["hit_pages"] += n
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        got = self._get(keys, lambda at, n, base: None, host_indices) if keys else 0
        return [True] * got + [False] * (len(keys) - got)

    def _get(self, keys: list[str], deliver: Any, host_indices: torch.Tensor | None) -> int:
        """Loads the pages of `keys` (in place, or through the staging area and `deliver(at, n,
        base)` for generic calls); how many from the first were loaded."""
        if self.pages is None or not self._up():
            return 0
        hashes = self._hashes(keys)
        if hashes is None:
            return 0
        self.counts["get_pages"] += len(keys)
        got, t0 = 0, time.perf_counter()
        try:
            if self.in_place and host_indices is not None:
                got = self._load(hashes, self._page_ids(keys, host_indices).tolist())
            else:
                assert self.staging_pages is not None
                pages = self._page_ids(keys, host_indices) if host_indices is not None else None
                base = self.staging_pages  # the gets' half

                def unstage(at: int, n: int) -> None:
                    assert self.pages is not None
                    if pages is None:
                        deliver(at, n, base)
                    else:
                        src = self.pages.blocks(self._staged(base), n)
                        self.pages.scatter(self.mem_pool_host.kv_buffer, pages[at : at + n], src)

                with self._locks[0]:
                    got = _load_chunks(self._load, hashes, self.staging_pages, base, unstage)
        except Exception as e:  # noqa: BLE001 - a miss, never an exception into SGLang
            self._failed("load", len(keys), e)
        self.counts["got_pages"] += got
        self._timed(self._prefetch, got, time.perf_counter() - t0)
        return got

    def _load(self, hashes: list[bytes], slots: list[int]) -> int:
        return _load(self.client, hashes, slots)

    def _staged(self, slot: int) -> torch.Tensor:
        assert self.staging is not None and self.pages is not None
        per = self.pages.layers * self.pages.page_bytes // self.pages.itemsize
        return self.staging[slot * per :]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        ok = bool(keys) and self._set(keys, None, host_indices)
        return [ok] * len(keys)

    def _set(self, keys: list[str], values: Any, host_indices: torch.Tensor | None) -> bool:
        """Stores the pages of `keys` (in place, or through the staging area from the pool's
        pages or from flat `values`); True when every page is stored (or was already)."""
        if self.pages is None or not self._up():
            return False
        hashes = self._hashes(keys)
        if hashes is None:
            return False
        self.counts["set_pages"] += len(keys)
        t0 = time.perf_counter()
        ok = self._set_pages(keys, hashes, values, host_indices)
        self._timed(self._backup, len(keys) if ok else 0, time.perf_counter() - t0)
        return ok

    def _set_pages(self, keys: list[str], hashes: list[bytes], values: Any, host_indices: torch.Tensor | None) -> bool:
        assert self.pages is not None
        try:
            if self.in_place and host_indices is not None:
                return self._save(hashes, self._page_ids(keys, host_indices).tolist())
            assert self.staging_pages is not None
            pages = self._page_ids(keys, host_indices) if host_indices is not None else None

            def stage(at: int, n: int) -> None:
                assert self.pages is not None
                out = self.pages.blocks(self._staged(0), n)
                if pages is not None:
                    self.pages.gather(self.mem_pool_host.kv_buffer, pages[at : at + n], out)
                else:
                    for i in range(n):
                        out[i].copy_(self.pages.flat_page(values[at + i].reshape(-1)))

            with self._locks[1]:
                return _save_chunks(self._save, hashes, self.staging_pages, stage)
        except Exception as e:  # noqa: BLE001 - pages not stored, never an exception into SGLang
            self._failed("save", len(keys), e)
            return False

    def _save(self, hashes: list[bytes], slots: list[int]) -> bool:
        r = _save(self.client, hashes, slots, "pages")
        self.counts["stored"] += int(r.stored)
        return r.failed == 0

    # -- interface v2: a hybrid model's pools ----------------------------------------------------
    #
    # As SGLang's hybrid controller calls them: `batch_exists_v2` for the hit query with the
    # sidecars' transfers (hybrid_cache_controller.py 1438), `batch_get_v2` of the sidecars'
    # pages after the KV pages (1651; KV-derived pools per KV batch, cache_controller.py 1239),
    # `batch_set_v2` before the KV pages' write-back (1711). The KV pages move through v1.

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """The longest prefix of `keys` whose KV pages are stored and at whose end every
        sidecar pool holds what its hit policy asks: every page before it (ALL_PAGES), or its
        last `len(transfer.keys)` pages (TRAILING_PAGES: a Mamba state, a window), and the
        prefix lengths that are restorable (with a trailing pool the longest few, found in up
        to MAX_PROBES tries back from the hit). A BLOCK_GROUPS pool gives its own verdict,
        which kvcached does not: it neither gates the hit nor is reported."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransferResult

        hashes = self._hashes(keys) if keys else None
        kv_pages = self._exists(hashes) if hashes is not None else 0
        if not kv_pages or hashes is None:
            return PoolTransferResult(0, {}, [])
        hits: dict[Any, int] = {PoolName.KV: kv_pages}
        limit, trailing = kv_pages, []
        try:
            for t in pool_transfers or []:
                sc = self._sidecars.get(_pool_name(t.name))
                if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                    run = self._run(sc, hashes[:limit]) if sc is not None else 0
                    limit = min(limit, run)
                    if run:
                        hits[t.name] = run
                elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    trailing.append((t.name, sc, max(1, len(t.keys) if t.keys else 1)))
                else:
                    self._tell(f"policy {t.hit_policy}", f"kvcached: pool {_pool_name(t.name)}'s hit policy "
                               f"{t.hit_policy} gets no verdict from kvcached")  # fmt: skip
            if not trailing:
                restorable = list(range(1, limit + 1))
            else:
                restorable = self._trailing(hashes, limit, [(sc, w) for _, sc, w in trailing])
                for name, _, _ in trailing:
                    if restorable:
                        hits[name] = restorable[-1]
        except Exception as e:  # noqa: BLE001 - a miss, never an exception into SGLang
            self._failed("sidecar lookup", len(keys), e)
            return PoolTransferResult(0, {}, [])
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def _trailing(self, hashes: list[bytes], limit: int, pools: list[tuple[_Sidecar | None, int]]) -> list[int]:
        """The longest (up to RESTORABLE) prefix lengths of at most `limit` pages at whose end
        every pool `sc` holds its last `w` pages, ascending. A page found missing rules out
        every length whose window holds it: the next length tried is where it starts."""
        if any(sc is None for sc, _ in pools):
            return []
        found: list[int] = []
        n = limit
        for _ in range(MAX_PROBES):
            if n <= 0 or len(found) == RESTORABLE:
                break
            for sc, w in pools:
                lo = max(0, n - w)
                run = self._run(sc, hashes[lo:n])  # type: ignore[arg-type]  # none is None
                if run < n - lo:
                    n = lo + run  # page lo + run is missing: no length above it can end here
                    break
            else:
                found.append(n)
                n -= 1
        return found[::-1]

    def _run(self, sc: _Sidecar, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, pool `sc` holds."""
        return _matched(sc.client, hashes) if self._up() else 0

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Each sidecar transfer's pages into its host pool's `host_indices`; per transfer,
        True for the leading pages loaded."""
        return {t.name: self._sidecar_io(t, self._sidecar_get) for t in transfers}

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Each sidecar transfer's pages from its host pool stored; per transfer, all True when
        every page is stored."""
        return {t.name: self._sidecar_io(t, self._sidecar_set) for t in transfers}

    def _sidecar_io(self, t: Any, io: Any) -> list[bool]:
        keys = list(t.keys or [])
        sc = self._sidecars.get(_pool_name(t.name))
        hashes = self._hashes(keys) if keys and sc is not None and self._up() else None
        if sc is None or hashes is None or t.host_indices is None or t.host_indices.numel() != len(keys) * sc.page_size:
            if sc is None and keys:
                self._tell(f"pool {t.name}", f"kvcached: no host pool {_pool_name(t.name)} was registered")
            return [False] * len(keys)
        pages = t.host_indices.view(-1)[:: sc.page_size].tolist()
        try:
            with sc.lock:
                return io(sc, hashes, pages)
        except Exception as e:  # noqa: BLE001 - pages not moved, never an exception into SGLang
            self._failed(f"{sc.name} transfer", len(keys), e)
            return [False] * len(keys)

    @staticmethod
    def _sidecar_get(sc: _Sidecar, hashes: list[bytes], pages: list[int]) -> list[bool]:
        def unstage(at: int, n: int) -> None:
            for i in range(n):
                sc.pool.set_from_flat_data_page(pages[at + i], sc.staging[i, : sc.page_bytes].view(sc.dtype))

        got = _load_chunks(partial(_load, sc.client), hashes, sc.staging.shape[0], 0, unstage)
        return [True] * got + [False] * (len(hashes) - got)

    @staticmethod
    def _sidecar_set(sc: _Sidecar, hashes: list[bytes], pages: list[int]) -> list[bool]:
        def stage(at: int, n: int) -> None:
            for i in range(n):
                page = sc.pool.get_data_page(pages[at + i], flat=True)
                sc.staging[i, : sc.page_bytes].copy_(page.contiguous().view(torch.uint8).reshape(-1))

        def save(chunk: list[bytes], slots: list[int]) -> bool:
            return _save(sc.client, chunk, slots, f"{sc.name} pages").failed == 0

        ok = _save_chunks(save, hashes, sc.staging.shape[0], stage)
        return [ok] * len(hashes)

    def _tell(self, what: str, message: str) -> None:
        """Logs `message` once per `what`."""
        if what not in self._told:
            self._told.add(what)
            log.error("%s", message)

    # -- the generic interface (flat pages; SGLang's controller without interface_v1) ----------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        """Each page into its target (a flat page, as `get_dummy_flat_data_page` makes), or None
        from the first page not cached on."""
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("batch_get needs one target page per key (SGLang's generic path passes them)")
        out: list[torch.Tensor | None] = [None] * len(keys)
        if not keys or self.staging is None:
            return out

        def deliver(at: int, n: int, base: int) -> None:
            assert self.pages is not None
            staged = self.pages.blocks(self._staged(base), n)
            for i in range(n):
                self.pages.flat_page(target_locations[at + i]).copy_(staged[i])
                out[at + i] = target_locations[at + i]

        self._get(keys, deliver, None)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Stores each page given flat (as `get_data_page` gives it); True when all are stored."""
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set needs one page per key (SGLang's generic path passes them)")
        if not keys or self.staging is None:
            return False
        return self._set(keys, values, None)

    def clear(self) -> None:
        # The node's cache is shared with every other engine: SGLang's "clear" does not empty it.
        log.info("kvcached: clear() leaves the node's shared cache as it is")

    def _timed(self, into: list[tuple[int, float]], pages: int, seconds: float) -> None:
        """One get's or set's pages and seconds, for SGLang's storage metrics."""
        if self.metrics and pages and self.pages is not None:
            with self._stats_lock:
                into.append((pages, seconds))

    def get_stats(self) -> Any:
        """SGLang's storage metrics since the last call (pages and GB/s of each prefetch and
        backup), as `StorageMetrics`, which SGLang's scheduler logs with `--enable-metrics`;
        None without them. The backend's own counters are `counts`."""
        if not self.metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        out = StorageMetrics()
        block = self.pages.layers * self.pages.page_bytes if self.pages is not None else 0
        with self._stats_lock:
            taken = ((self._prefetch, out.prefetch_pgs, out.prefetch_bandwidth),
                     (self._backup, out.backup_pgs, out.backup_bandwidth))  # fmt: skip
            for have, pgs, bandwidth in taken:
                for pages, seconds in have:
                    pgs.append(pages)
                    bandwidth.append(pages * block / max(seconds, 1e-9) / 1e9)
                have.clear()
        return out

    def close(self) -> None:
        for c in [self.client, *(sc.client for sc in self._sidecars.values())]:
            unregister(c, log)
        self._sidecars.clear()
