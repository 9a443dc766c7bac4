"""The connector's settings (`kv_connector_extra_config`) and the kvcached namespace a vLLM
engine's KV lives in.

Both halves of the connector (the scheduler's and each worker's) derive the namespace from the
same vLLM configuration, so that what a worker saves is what the scheduler finds. Everything that
changes the bytes of a block goes into it: the model, the KV layout (layers, heads, head size,
element type, tokens per block), vLLM's physical KV layout name (LBHNC on CPU, LBNHC on CUDA: the
same KV in another byte order), the tensor-parallel rank (each rank holds other heads) and, with
pipeline parallelism, the layers of the rank's stage (each stage holds other layers). Engines
whose namespaces differ never exchange KV.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import torch

import kvcached

# torch element types -> kvcached dtype names. The namespace also carries vLLM's own names of
# the KV dtype and cache dtype, so two fp8 variants stored as uint8 stay apart.
_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float32: "f32",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
    torch.int8: "int8",
    torch.uint8: "int8",
}

PREFIX = "kvcached."


def _choice(key: str, v: Any, choices: tuple[str, ...]) -> str:
    v = str(v).strip().lower()
    if v not in choices:
        raise ValueError(f"{PREFIX}{key} must be one of {list(choices)}, not {v!r}")
    return v


def _flag(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


@dataclass(frozen=True)
class ConnectorConfig:
    """`kv_connector_extra_config` keys (all optional):

    - `kvcached.socket`: the daemon's socket (default `$KVCACHED_SOCKET`, then the daemon's
      default path).
    - `kvcached.model_id`: the model's identity in the namespace (default: vLLM's model name or
      path, `@revision` when one is set).
    - `kvcached.tenant_salt`: a tenant's secret salt (default `$KVCACHED_TENANT_SALT`; prefer
      the variable, which keeps the secret out of the command line).
    - `kvcached.namespace_extra`: more key material (e.g. a hash of `hf_overrides` that change
      the model's KV).
    - `kvcached.load_async`: load between scheduler steps (the request waits in
      WAITING_FOR_REMOTE_KVS) instead of before the step's forward pass. Default false.
    - `kvcached.save_decode`: also save blocks filled during decode. Default false (prompt
      blocks only).
    - `kvcached.layerwise`: wait for loads at the first attention layer and start saves at the
      last one, instead of in `start_load_kv` / `wait_for_save`; vLLM then keeps attention out of
      CUDA graphs (piecewise graphs). Default false.
    - `kvcached.window_saves`: what a sliding-window group of a hybrid model saves: `"window"`
      (default) only the blocks the window of the saved prefix's end reads, `"all"` every block
      it computes (more hits for shorter shared prefixes, more bytes stored).
    - `kvcached.key_scheme`: `"tokens"` (default: kvcached's own keys) or `"sglang"`: requests
      without a key context are keyed by SGLang's page hashes of their tokens, in the namespace
      `kvcached.shared_pages` names, so that SGLang engines of the same model with kvcached's
      HiCache backend (`kvcached.page_order: "vllm"`) share blocks with this engine both ways.
      Needs a full-attention page in vLLM's LBNHC or BLNHC layout (the CUDA backends'), or MLA,
      and one KV-cache group; set `kvcached.model_id` to the same name on both engines.
    - `kvcached.scheduler_reconnect_for`: seconds a scheduler-side call keeps retrying while the
      daemon is away (default 0.5; the scheduler then answers "nothing cached" for
      `kvcached.retry_after` seconds, default 5, instead of stalling the engine).
    - `kvcached.worker_reconnect_for`: the same for the workers' calls (default 5).
    """

    socket: str | None
    model_id: str | None
    tenant_salt: bytes | None
    namespace_extra: str
    load_async: bool
    save_decode: bool
    layerwise: bool
    window_saves: str
    key_scheme: str
    scheduler_reconnect_for: float
    worker_reconnect_for: float
    retry_after: float

    KEYS = (
        "socket",
        "model_id",
        "tenant_salt",
        "namespace_extra",
        "load_async",
        "save_decode",
        "layerwise",
        "window_saves",
        "key_scheme",
        "scheduler_reconnect_for",
        "worker_reconnect_for",
        "retry_after",
    )

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k.startswith(PREFIX) and k[len(PREFIX) :] not in cls.KEYS)
        if unknown:
            raise ValueError(f"unknown kvcached connector settings {unknown}; known: {[PREFIX + k for k in cls.KEYS]}")

        def get(key: str, default: Any = None) -> Any:
            return extra.get(PREFIX + key, default)

        salt = get("tenant_salt", os.environ.get("KVCACHED_TENANT_SALT"))
        return cls(
            socket=get("socket", os.environ.get("KVCACHED_SOCKET")),
            model_id=get("model_id"),
            tenant_salt=salt.encode() if isinstance(salt, str) and salt else (salt or None),
            namespace_extra=str(get("namespace_extra", "")),
            load_async=_flag(get("load_async", False)),
            save_decode=_flag(get("save_decode", False)),
            layerwise=_flag(get("layerwise", False)),
            window_saves=_choice("window_saves", get("window_saves", "window"), ("window", "all")),
            key_scheme=_choice("key_scheme", get("key_scheme", "tokens"), ("tokens", "sglang")),
            scheduler_reconnect_for=float(get("scheduler_reconnect_for", 0.5)),
            worker_reconnect_for=float(get("worker_reconnect_for", 5.0)),
            retry_after=float(get("retry_after", 5.0)),
        )

    def connect(self, reconnect_for: float) -> kvcached.Client:
        return kvcached.Client(self.socket, reconnect_for=reconnect_for)


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"kvcached's vLLM connector does not support {what}: it handles KV-cache groups of "
        "attention whose blocks hold their tokens' KV (full attention, sliding window, MLA, "
        "quantized or padded pages) and Mamba / linear-attention state kept at block boundaries "
        "(mamba_cache_mode 'align'), with tensor, pipeline and decode or prefill context parallelism"
    )


@dataclass(frozen=True)
class KvGroup:
    """One KV-cache group: its index, spec and layers (this pipeline stage's: none where the
    stage holds no layer of the group), and for a sliding-window group the blocks before a point
    that attention there reads (`window_blocks`; None: every block, full attention). A state
    group (`state`: Mamba / linear attention in vLLM's align mode) holds in block `i` the
    layers' state after the first `(i + 1) x block_size` tokens, not those tokens' KV: one
    block restores a prefix."""

    index: int
    count: int
    spec: Any
    layers: tuple[str, ...]
    window_blocks: int | None
    # Tokens of one block as vLLM's scheduler counts them (its hashes, its block ids): the
    # spec's block size, times the decode context parallel size (each rank holds a share of a
    # block's tokens in a page of the spec's block size).
    block_tokens: int
    state: bool = False
    # Chunked local attention (Llama 4): vLLM holds only the blocks of the current chunk.
    chunked: bool = False


def kv_groups(vllm_config: Any, kv_cache_config: Any) -> list[KvGroup]:
    """The KV-cache groups, or NotImplementedError naming what is not served.

    Any attention spec whose block pages hold the KV of the block's own tokens is served: full
    attention (FullAttentionSpec, with or without a recorded sliding window: with the hybrid
    manager off every block is kept), MLA's latent pages (MLAAttentionSpec), quantized pages
    (fp8 with per-tensor scales, or with per-token-head scales inside the page), padded pages,
    K and V of different head sizes; with vLLM's hybrid KV-cache manager, sliding-window groups
    (SlidingWindowSpec) beside full-attention ones. The connector copies a page's bytes as they
    are; what they mean goes into the namespace (`namespace`). With pipeline parallelism each
    stage's groups hold that stage's layers (vLLM's projection of the model's groups). Mamba and
    linear-attention groups (MambaSpec) are served in vLLM's align mode (`--mamba-cache-mode
    align`, which keeps their state at block boundaries), as state groups."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    try:
        from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec
    except ImportError:  # a vLLM without chunked or state groups
        ChunkedLocalAttentionSpec = MambaSpec = None  # noqa: N806

    dcp = dcp_size(vllm_config)
    groups = kv_cache_config.kv_cache_groups
    out = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        state = chunked = False
        # Only specs vLLM shards over the DCP ranks (attention's) span N pages per block.
        block_tokens = spec.block_size * (dcp if _dcp_sharded(spec) else 1)
        if isinstance(spec, FullAttentionSpec):
            window = None
        elif ChunkedLocalAttentionSpec is not None and type(spec) is ChunkedLocalAttentionSpec:
            # Saved block by block as computed (before vLLM frees a past chunk), looked up as a
            # prefix, loaded where vLLM holds blocks (the current chunk's).
            window, chunked = None, True
        elif type(spec) is SlidingWindowSpec:
            window = -(-(spec.sliding_window - 1 + spec.extra_retained_tokens) // block_tokens)
        elif MambaSpec is not None and isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "align":
                raise _unsupported(
                    f"Mamba / linear-attention state without mamba_cache_mode 'align' (KV-cache group {i}: "
                    f"mode {spec.mamba_cache_mode!r} keeps no state at block boundaries; start vLLM with "
                    "--mamba-cache-mode align and prefix caching on)"
                )
            window, state = None, True
        else:
            raise _unsupported(f"{type(spec).__name__} layers (KV-cache group {i} of {len(groups)})")
        if not getattr(spec, "has_layer_views", True):
            raise _unsupported(f"{type(spec).__name__} layers without per-layer KV views")
        out.append(KvGroup(i, len(groups), spec, tuple(g.layer_names), window, block_tokens, state, chunked))
    # Groups may have blocks of different sizes (vLLM's scheduler then aligns to their least
    # common multiple): each group's blocks are keyed in its own namespace, at its own size.
    return out


def _dcp_sharded(spec: Any) -> bool:
    """Whether vLLM deals a block's tokens over the decode-context-parallel ranks for `spec`
    (attention: `dcp_sharded`; a Mamba state is every rank's whole)."""
    return bool(getattr(spec, "dcp_sharded", True))


def dcp_size(vllm_config: Any) -> int:
    """The decode-context-parallel size (1: none)."""
    return int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)


def pcp_size(vllm_config: Any) -> int:
    """The prefill-context-parallel size (1: none)."""
    return int(getattr(vllm_config.parallel_config, "prefill_context_parallel_size", 1) or 1)


def pp_size(vllm_config: Any) -> int:
    """The pipeline-parallel size (1: no pipeline parallelism)."""
    return int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)


def stage_digest(layers: tuple[str, ...] | list[str]) -> str:
    """What names a pipeline stage's share of a KV-cache group in its namespace: a digest of the
    group's layers on the stage. The scheduler (whose KV-cache config is stage 0's) and the
    stage's workers derive it from the same names."""
    return hashlib.sha256("\n".join(layers).encode()).hexdigest()[:16]


def kv_spec(vllm_config: Any, kv_cache_config: Any) -> tuple[Any, list[str]]:
    """The first KV-cache group's spec and layers (`kv_groups` checks every group)."""
    g = kv_groups(vllm_config, kv_cache_config)[0]
    return g.spec, list(g.layers)


def _plain(spec: Any) -> bool:
    """A dense full-attention page of K and V of one head size in a plain element type: its
    namespace names heads, head size and dtype (the encoding every earlier release used)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    return (
        type(spec) is FullAttentionSpec
        and spec.kv_quant_mode == KVQuantMode.NONE
        and spec.page_size_padded in (None, spec.real_page_size_bytes)
        and spec.num_head_slots is None
        and spec.state_content_bytes is None
        and spec.tokens_per_state == 1
        and spec.head_size_v == spec.head_size
        and spec.dtype in _DTYPES
    )


def page_bytes(spec: Any) -> int:
    """The bytes of one layer's page of one block that the connector copies: the page without
    its padding. A state page (Mamba: its conv and SSM states) is copied rounded up to whole
    units of 2 x block_size bytes (its namespace's layout is tokens of two halves), which vLLM's
    padding (to the attention page) leaves room for."""
    real = int(spec.real_page_size_bytes)
    if getattr(spec, "mamba_cache_mode", None) is None:
        return real
    unit = 2 * spec.block_size
    rounded = -(-real // unit) * unit
    if rounded > spec.page_size_bytes:
        raise _unsupported(
            f"a Mamba state page of {real} bytes in a {spec.page_size_bytes}-byte page (no room to copy it "
            f"in whole units of 2 x {spec.block_size} bytes)"
        )
    return rounded


def tp_shard(spec: Any, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Which of the distinct KV shards across tensor-parallel ranks this rank holds, and how
    many there are. MLA's latent is the same on every rank (`max_tp_shards` 1): one shard, so
    every rank's blocks are the same blocks, stored once."""
    shards = getattr(spec, "max_tp_shards", None)
    if shards is None and type(spec).__name__.startswith("MLA"):
        shards = 1
    if shards is None or shards >= tp_size:
        return tp_rank, tp_size
    return tp_rank % shards, shards


# vLLM's layouts whose head axis lies outside a block's tokens (LHBNC: outside the blocks of the
# layer; BHLNC: outside the layers of the block): a layer's page of a block is one run of bytes
# per head slot.
HEAD_SPLIT_LAYOUTS = ("LHBNC", "BHLNC")


def page_runs(vllm_config: Any, kv_cache_config: Any, spec: Any) -> int:
    """How many runs of bytes a layer's page of one block is in vLLM's physical layout: one per
    head slot (the spec's `num_head_slots`, else its KV heads) in a head-split layout, else
    one. A state page (Mamba) is not laid out by head."""
    if getattr(spec, "mamba_cache_mode", None) is not None:
        return 1
    if layout_name(vllm_config, kv_cache_config).rsplit(".", 1)[-1] not in HEAD_SPLIT_LAYOUTS:
        return 1
    return int(getattr(spec, "num_head_slots", None) or spec.num_kv_heads)


def layout_name(vllm_config: Any, kv_cache_config: Any) -> str:
    """vLLM's physical KV layout (`LBHNC`, `LBNHC`, ...), resolved by the engine core."""
    name = getattr(kv_cache_config, "kv_cache_layout", None) or vllm_config.cache_config.kv_cache_layout
    if name is None:
        raise RuntimeError("vLLM has not resolved its KV cache layout yet (cache_config.kv_cache_layout is None)")
    return str(name)


def namespace(
    vllm_config: Any,
    kv_cache_config: Any,
    cfg: ConnectorConfig,
    tp_rank: int,
    tp_size: int,
    group: KvGroup | None = None,
    dcp_rank: int = 0,
    pcp_rank: int = 0,
) -> kvcached.Namespace:
    """The namespace of tensor-parallel rank `tp_rank`'s KV of KV-cache `group` (default: the
    first). With several groups each has its own: its layers, its spec and its index. With
    pipeline parallelism each stage's share of a group has its own too (`stage_digest`); with
    decode context parallelism each rank's share of a block's tokens (`dcp_rank`), a page of
    the spec's block size keyed by blocks of the scheduler's (`block_tokens`); with prefill
    context parallelism each rank's pages of the scheduler's blocks (`pcp_rank`), whatever of a
    block's KV the rank holds."""
    group = group or kv_groups(vllm_config, kv_cache_config)[0]
    spec, layers = group.spec, group.layers
    if not layers:
        raise ValueError(f"KV-cache group {group.index} has no layers on this pipeline stage: it has no namespace here")
    if cfg.key_scheme == "sglang":
        return _shared_namespace(vllm_config, kv_cache_config, cfg, tp_rank, tp_size, group)
    if group.state:
        return _state_namespace(vllm_config, kv_cache_config, cfg, tp_rank, tp_size, group, pcp_rank)
    dcp = dcp_size(vllm_config) if _dcp_sharded(spec) else 1
    runs = page_runs(vllm_config, kv_cache_config, spec)
    if _plain(spec) and dcp == 1 and runs == 1:
        layout = kvcached.KvLayout(
            num_layers=len(layers),
            kv_heads=spec.num_kv_heads,
            head_dim=spec.head_size,
            dtype=_DTYPES[spec.dtype],
            tokens_per_block=spec.block_size,
            kind="layer_separate",
        )
        spec_desc = f"spec={type(spec).__name__}"
    else:
        # Any other page: its bytes as int8, in two halves per layer (per head slot's run, in a
        # head-split layout), with the spec's fields in `extra` (so an fp8 page and a bf16 page,
        # or MLA and full attention, never share keys).
        page, bs = page_bytes(spec), group.block_tokens
        if page % runs or (page // runs) % (2 * bs):
            raise _unsupported(
                f"a KV page of {page} bytes in {runs} runs (not a multiple of 2 x {bs} tokens per block each)"
            )
        layout = _bytes_layout(len(layers) * runs, page // runs, bs)
        spec_desc = f"spec={spec!r}"
    tp_rank, tp_size = tp_shard(spec, tp_rank, tp_size)
    extra = ";".join(
        [
            "vllm-v1-kv",
            f"layout={layout_name(vllm_config, kv_cache_config)}",
            spec_desc,
            f"head_size={spec.head_size}/{spec.head_size_v}",
            f"dtype={spec.dtype}",
            f"cache_dtype={vllm_config.cache_config.cache_dtype}",
            f"tp={tp_rank}/{tp_size}",
            f"user={cfg.namespace_extra}",
        ]
        + ([f"group={group.index}/{group.count}"] if group.count > 1 else [])
        + _stage_tags(vllm_config, layers)
        + ([f"dcp={dcp_rank}/{dcp}", f"interleave={_interleave(vllm_config)}"] if dcp > 1 else [])
        + _pcp_tags(vllm_config, pcp_rank)
    )
    return kvcached.Namespace(_model_id(vllm_config, cfg), layout, tenant_salt=cfg.tenant_salt, extra=extra.encode())


def _model_id(vllm_config: Any, cfg: ConnectorConfig) -> str:
    """The model's identity in the namespace: `kvcached.model_id`, else vLLM's model name or
    path (`@revision` when one is set)."""
    mc = vllm_config.model_config
    return cfg.model_id or (f"{mc.model}@{mc.revision}" if mc.revision else str(mc.model))


def _bytes_layout(num_layers: int, page: int, tokens_per_block: int) -> kvcached.KvLayout:
    """A layout of `page`-byte pages per layer as int8 bytes in two halves (any page that is not
    a dense K/V page named by its heads: its meaning goes into the extra key bytes)."""
    return kvcached.KvLayout(
        num_layers=num_layers, kv_heads=1, head_dim=page // (2 * tokens_per_block), dtype="int8",
        tokens_per_block=tokens_per_block, kind="layer_separate",
    )  # fmt: skip


def _stage_tags(vllm_config: Any, layers: tuple[str, ...]) -> list[str]:
    """The extra key bytes naming a pipeline stage's share of a group (none without pipeline
    parallelism)."""
    pp = pp_size(vllm_config)
    return [f"pp={pp}", f"stage={stage_digest(layers)}"] if pp > 1 else []


def _pcp_tags(vllm_config: Any, pcp_rank: int) -> list[str]:
    """The extra key bytes naming a prefill-context-parallel rank's pages (none without prefill
    context parallelism): each rank's pages of a block are its own, however vLLM spreads a
    block's KV over the ranks."""
    pcp = pcp_size(vllm_config)
    return [f"pcp={pcp_rank}/{pcp}"] if pcp > 1 else []


def _interleave(vllm_config: Any) -> int:
    """Tokens in a row on one decode-context-parallel rank (vLLM's `cp_kv_cache_interleave_size`)."""
    return int(getattr(vllm_config.parallel_config, "cp_kv_cache_interleave_size", 1) or 1)


def _state_namespace(
    vllm_config: Any,
    kv_cache_config: Any,
    cfg: ConnectorConfig,
    tp_rank: int,
    tp_size: int,
    group: KvGroup,
    pcp_rank: int = 0,
) -> kvcached.Namespace:
    """The namespace of a state group's blocks (Mamba / linear attention): each block is a
    layer's state page (conv and SSM states, unpadded) as int8 bytes in two halves, with
    vLLM's whole spec (shapes, dtypes, kind) in the extra bytes."""
    spec, layers, bs = group.spec, group.layers, group.spec.block_size
    layout = _bytes_layout(len(layers), page_bytes(spec), bs)
    extra = ";".join(
        [
            "vllm-v1-state",
            f"layout={layout_name(vllm_config, kv_cache_config)}",
            f"spec={spec!r}",
            f"cache_dtype={vllm_config.cache_config.cache_dtype}",
            f"tp={tp_rank}/{tp_size}",
            f"user={cfg.namespace_extra}",
            f"group={group.index}/{group.count}",
        ]
        + _stage_tags(vllm_config, layers)
        + _pcp_tags(vllm_config, pcp_rank)
    )
    return kvcached.Namespace(_model_id(vllm_config, cfg), layout, tenant_salt=cfg.tenant_salt, extra=extra.encode())


def _shared_namespace(
    vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig, tp_rank: int, tp_size: int, group: KvGroup
) -> kvcached.Namespace:
    """The namespace `kvcached.shared_pages` names for this rank's pages (`kvcached.key_scheme`
    "sglang"): where vLLM's page holds the bytes SGLang's backend stores, else a refusal."""
    from kvcached.shared_pages import shared_namespace

    spec, layers = group.spec, group.layers
    if group.count > 1:
        raise _unsupported('kvcached.key_scheme "sglang" with more than one KV-cache group')
    if pp_size(vllm_config) > 1 or pcp_size(vllm_config) > 1:
        # SGLang's page keys name no pipeline stage nor context-parallel rank: each one's pages
        # would share them.
        raise _unsupported('kvcached.key_scheme "sglang" with pipeline or prefill context parallelism')
    mla = type(spec).__name__.startswith("MLA")
    layout = layout_name(vllm_config, kv_cache_config).rsplit(".", 1)[-1]
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    quant = getattr(spec, "kv_quant_mode", None)
    if cache_dtype != "auto" or (quant is not None and getattr(quant, "name", str(quant)) != "NONE"):
        # SGLang's host pool stores fp8 KV as bytes without naming its format.
        raise _unsupported(f'kvcached.key_scheme "sglang" with a quantized KV cache (cache_dtype={cache_dtype})')
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    if mla:
        width, rem = divmod(page_bytes(spec), spec.block_size * itemsize)
        if rem:
            raise _unsupported(f"an MLA page of {page_bytes(spec)} bytes for {spec.block_size} tokens")
        heads, head_dim = 1, width
    elif _plain(spec) and layout in ("LBNHC", "BLNHC"):
        heads, head_dim = spec.num_kv_heads, spec.head_size
    else:
        raise _unsupported(
            f'kvcached.key_scheme "sglang" with a {type(spec).__name__} page in the {layout} layout (SGLang\'s '
            "pages are the bytes of a full-attention page in the LBNHC or BLNHC layout, or MLA's)"
        )
    tp_rank, tp_size = tp_shard(spec, tp_rank, tp_size)
    return shared_namespace(
        _model_id(vllm_config, cfg),
        attention="mla" if mla else "mha",
        num_layers=len(layers),
        kv_heads=heads,
        head_dim=head_dim,
        dtype=spec.dtype,
        page_size=spec.block_size,
        order="vllm",
        tp_rank=tp_rank,
        tp_size=tp_size,
        tenant_salt=cfg.tenant_salt,
        user=cfg.namespace_extra,
    )
