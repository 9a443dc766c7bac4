"""A vLLM 0.33 engine without a model, on the CPU: the real Scheduler (which builds our
connector's scheduler half through vLLM's factory, from `kv_connector_module_path`), the real KV
cache planner and allocator, and our connector's worker half on the CPU tensors vLLM allocates.
The "forward pass" writes deterministic KV for each token it computes, a function of the
prompt's tokens up to it and of the layer, so a test can check every byte a load brought.

Adapted from vLLM's tests/v1/kv_connector/unit/utils.py (create_vllm_config, create_scheduler,
create_request, create_model_runner_output); changes: the model is a local directory holding
only a tiny Llama config.json (no weights, no tokenizer, nothing downloaded), the connector is
loaded by module path as a deployment loads it, and the KV tensors are real.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvcached.vllm import KvcachedConnector

BLOCK = 16
EOS = 2
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)

_none_hash = False


def tiny_model_dir() -> str:
    d = tempfile.mkdtemp(prefix="tiny-llama-")
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": EOS,
        "tie_word_embeddings": False,
    }  # fmt: skip
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def vllm_config(
    socket: str,
    role: str = "kv_both",
    extra: dict[str, Any] | None = None,
    *,
    model_dir: str,
    prefix_caching: bool = True,
    layout: str = "LBHNC",
    batched_tokens: int = 64,
    hybrid: bool = False,
    mamba: bool = False,
) -> VllmConfig:
    cache = CacheConfig(
        block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=prefix_caching
    )
    if mamba:
        # Mamba state kept at block boundaries (what a hybrid Mamba model runs with prefix caching).
        cache.mamba_cache_mode = "align"
    cache.kv_cache_layout = layout  # the engine core resolves it in a real engine
    transfer = KVTransferConfig(
        kv_connector="KvcachedConnector",
        kv_connector_module_path="kvcached.vllm",
        kv_role=role,
        kv_connector_extra_config={"kvcached.socket": socket, "kvcached.model_id": "tiny-llama", **(extra or {})},
        kv_load_failure_policy="recompute",
    )
    cfg = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=batched_tokens,
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=True,
        ),  # fmt: skip
        model_config=ModelConfig(model=model_dir, dtype="bfloat16", seed=42, skip_tokenizer_init=True),
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    if hybrid:
        # vLLM turns its hybrid manager off on the CPU platform; the manager and the scheduler
        # themselves run on any, so a hybrid test turns it back on after the platform check.
        cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    return cfg


def kv_cache_config(cfg: VllmConfig, num_blocks: int, spec: Any = SPEC, groups: list | None = None):
    """vLLM's KV-cache config for `spec` on every layer, or for `groups` ([(layers, spec)]: one
    KV-cache group each, as the hybrid manager makes them)."""
    cfg.cache_config.num_gpu_blocks_override = num_blocks
    groups = groups or [(LAYERS, spec)]
    per_tensor = max(len(layers) for layers, _ in groups)
    kcfg = get_kv_cache_config_from_groups(
        cfg, [KVCacheGroupSpec(list(layers), sp) for layers, sp in groups],
        max(sp.page_size_bytes for _, sp in groups) * per_tensor * num_blocks,
    )  # fmt: skip
    cfg.cache_config.num_gpu_blocks = kcfg.num_blocks
    return kcfg


def request(
    rid: str, tokens: list[int], max_tokens: int = 2, params: dict | None = None, block: int = BLOCK, **kw: Any
) -> Request:
    global _none_hash
    if not _none_hash:
        init_none_hash(sha256)
        _none_hash = True
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, EOS)
    kw.setdefault("mm_features", None)
    req = Request(
        request_id=rid, prompt_token_ids=tokens, sampling_params=sp, pooling_params=None,
        block_hasher=get_request_block_hasher(block, sha256), **kw,
    )  # fmt: skip
    req.kv_transfer_params = params
    return req


def context_tag(req: Request) -> str:
    """What besides its tokens a request's KV depends on in this fake model: its adapter (name
    and path), its cache salt (vLLM keeps salted caches apart, as if the KV differed), the
    multimodal inputs it has reached, its prompt embeddings."""
    lora = req.lora_request
    parts = [f"lora={lora.lora_name}@{lora.lora_path}"] if lora else []
    parts += [f"salt={req.cache_salt}"] if req.cache_salt else []
    parts += [f"mm={f.identifier}@{f.mm_position.offset}" for f in req.mm_features]
    if req.prompt_embeds is not None:
        parts.append(hashlib.blake2b(req.prompt_embeds.numpy().tobytes(), digest_size=8).hexdigest())
    return ";".join(parts)


def window(tokens: int) -> SlidingWindowSpec:
    """A sliding-window spec of `tokens` with SPEC's heads (a hybrid model's window layers)."""
    return SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=tokens
    )


def finish(e: Engine, rid: str, steps: int = 6) -> None:
    """Steps until request `rid` has finished (its next token EOS)."""
    for _ in range(steps):
        if rid not in e.scheduler.requests:
            return
        e.step(token=EOS)
    assert rid not in e.scheduler.requests


def assert_group_kv(e: Engine, rid: str, tokens: list[int], group: int, blocks: Any) -> None:
    """Request `rid`'s blocks `blocks` of KV-cache `group` hold, in that group's layers, what the
    forward pass writes for `tokens`."""
    ids = e.scheduler.kv_cache_manager.get_blocks(rid).get_block_ids()[group]
    layers = [i for i, name in enumerate(LAYERS) if e.layer_groups.get(name, (0,))[0] == group]
    for b in blocks:
        have, want = e.block_kv(ids[b]), e.expected_block_kv(tokens, b)
        for li in layers:
            assert have[li] == want[li], f"group {group} block {b} layer {li}"


def loaded_then_scheduled(e: Engine, rid: str) -> tuple[list, Any]:
    """A request with a hit whose loads are asynchronous (kvcached.load_async, or a hybrid
    model's): it waits for them, then is scheduled. Returns its planned loads as (group, first
    block, blocks), sorted, and the output of the step that scheduled it."""
    out, _ = e.step()
    assert rid not in out.num_scheduled_tokens
    assert e.scheduler.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not out.kv_connector_metadata.loads
    loads = sorted((t.group, t.first_block, len(t.slots)) for t in out.kv_connector_metadata.async_loads)
    for _ in range(20):
        out, _ = e.step()
        if rid in out.num_scheduled_tokens:
            break
    return loads, out


def is_state(spec: Any) -> bool:
    """Whether `spec` is a state group's (Mamba / linear attention)."""
    return isinstance(spec, MambaSpec)


def state_bytes(tokens: list[int], end: int, layer: int, spec: Any, tag: str = "") -> torch.Tensor:
    """A state layer's state after the first `end` tokens (its page's bytes, unpadded): a
    function of those tokens, as a Mamba layer's conv and SSM states are."""
    seed = int.from_bytes(hashlib.blake2b(repr(("state", tokens[:end], layer, tag)).encode(), digest_size=8).digest())
    g = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    return torch.randint(0, 256, (spec.real_page_size_bytes,), generator=g, dtype=torch.uint8)


def token_kv(tokens: list[int], pos: int, layer: int, tag: str = "", spec: Any = SPEC) -> torch.Tensor:
    """KV bytes of token `pos` in `layer` ([heads, K|V] as int16): a function of the prompt up
    to and including the token, as real KV is (and of what `tag` names besides the tokens; the
    multimodal inputs only from the first one the token has reached)."""
    tag = ";".join(p for p in tag.split(";") if not p.startswith("mm=") or int(p.rsplit("@", 1)[1]) <= pos)
    seed = int.from_bytes(hashlib.blake2b(repr((tokens[: pos + 1], layer, tag)).encode(), digest_size=8).digest())
    g = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    row = (spec.head_size + spec.head_size_v) * spec.dtype.itemsize
    return torch.randint(0, 256, (spec.num_kv_heads, row), generator=g, dtype=torch.uint8)


@dataclass
class Engine:
    """One engine: vLLM's Scheduler (with our scheduler half inside) and our worker half on
    KV tensors vLLM allocated."""

    scheduler: Scheduler
    worker: KvcachedConnector
    kv: dict[str, torch.Tensor]
    kv_cache_layout: KVCacheLayout
    spec: Any = SPEC
    # Each layer's KV-cache group and spec (one group of `spec` unless hybrid).
    layer_groups: dict[str, tuple[int, Any]] = field(default_factory=dict)
    # With pipeline parallelism: each stage's worker and its layers (`worker` is stage 0's).
    stages: list[tuple[KvcachedConnector, list[str]]] = field(default_factory=list)
    timings: dict[str, list[float]] = field(default_factory=lambda: {"schedule": [], "worker": []})

    @property
    def connector(self) -> KvcachedConnector:
        return self.scheduler.connector  # type: ignore[return-value]

    def close(self) -> None:
        """Unregisters both halves from the daemon (vLLM calls shutdown on each)."""
        for w, _ in self.stages or [(self.worker, LAYERS)]:
            w.shutdown()
        self.connector.shutdown()

    def add(self, req: Request) -> Request:
        self.scheduler.add_request(req)
        return req

    @staticmethod
    def starts(out: Any) -> dict[str, int]:
        """Where each request's step starts (schedule() has already moved num_computed_tokens)."""
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        c = out.scheduled_cached_reqs
        starts.update(zip(c.req_ids, c.num_computed_tokens, strict=True))
        return starts

    def forward(self, out: Any) -> None:
        """Writes KV for every token the step computes, into the request's blocks."""
        s = self.scheduler
        starts = self.starts(out)
        for rid, n in out.num_scheduled_tokens.items():
            req = s.requests[rid]
            start = starts[rid]
            toks = list(req.all_token_ids)
            tag = context_tag(req)
            all_blocks = s.kv_cache_manager.get_blocks(rid).get_block_ids()
            self._forward_states(all_blocks, toks, start, min(start + n, len(toks)), tag)
            for pos in range(start, min(start + n, len(toks))):
                for li, name in enumerate(LAYERS):
                    g, spec = self.layer_groups.get(name, (0, self.spec))
                    if is_state(spec):
                        continue
                    b = all_blocks[g][pos // spec.block_size]
                    assert b != 0, f"{name}: no block for computed token {pos}"
                    slot = pos % spec.block_size
                    self.kv[name][b, :, slot, :].view(torch.uint8).copy_(token_kv(toks, pos, li, tag, spec))

    def _forward_states(self, all_blocks: Any, toks: list[int], start: int, end: int, tag: str) -> None:
        """A state layer's step, as vLLM's Mamba kernels run it in align mode: it starts from
        the state in block `(start - 1) // block_size` (which must be the prefix's: loaded or
        computed) and leaves the state after `end` tokens in block `cdiv(end, block_size) - 1`."""
        for li, name in enumerate(LAYERS):
            g, spec = self.layer_groups.get(name, (0, self.spec))
            if not is_state(spec) or end <= start:
                continue
            if start > 0:
                prev = all_blocks[g][(start - 1) // spec.block_size]
                assert prev != 0, f"{name}: no state block to start from at {start}"
                have = self.kv[name][prev].reshape(-1).view(torch.uint8)[: spec.real_page_size_bytes]
                assert torch.equal(have, state_bytes(toks, start, li, spec, tag)), f"{name}: wrong state at {start}"
            cur = all_blocks[g][-(-end // spec.block_size) - 1]
            assert cur != 0, f"{name}: no state block for {end}"
            self.kv[name][cur].reshape(-1).view(torch.uint8)[: spec.real_page_size_bytes].copy_(
                state_bytes(toks, end, li, spec, tag)
            )

    def step(self, token: int = 7, finished_recving: set[str] | None = None) -> Any:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        if self.stages:
            kvo = self._stages_step(out, finished_recving)
        else:
            kvo = self._worker_step(out, finished_recving)
        t2 = time.perf_counter()
        ids = list(out.num_scheduled_tokens)
        # A step that leaves part of the prompt to compute samples nothing (a prefill chunk).
        reqs = self.scheduler.requests
        sampled = [[token] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in ids]
        mro = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
            pooler_output=None, kv_connector_output=kvo,
        )  # fmt: skip
        eco = self.scheduler.update_from_output(out, mro)
        self.timings["schedule"].append(t1 - t0)
        self.timings["worker"].append(t2 - t1)
        return out, eco

    def _worker_step(self, out: Any, finished_recving: set[str] | None) -> KVConnectorOutput:
        """The one worker's part of a step, as vLLM's model runner calls it."""
        w = self.worker
        w.bind_connector_metadata(out.kv_connector_metadata)
        w.start_load_kv(None)
        for name in LAYERS:
            w.wait_for_layer_load(name)
            if name == LAYERS[0]:
                self.forward(out)  # all layers at once; the KV write happens "inside" layer 0
            w.save_kv_layer(name, self.kv[name], None)
        w.wait_for_save()
        res = w.get_transfer_results(out.finished_req_ids)
        kvo = KVConnectorOutput(
            finished_sending=res.finished_sending or None,
            finished_recving=(res.finished_recving | (finished_recving or set())) or None,
            failed_recving=res.failed_recving or None,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
        )
        w.clear_connector_metadata()
        return kvo

    def _stages_step(self, out: Any, finished_recving: set[str] | None) -> KVConnectorOutput:
        """Every pipeline stage's worker's part of a step: each loads, the forward pass writes
        every layer, each saves its own layers; their outputs combined as vLLM's aggregator
        does (a transfer is finished once every worker finished it; a block any worker failed
        to load is invalid)."""
        for w, _ in self.stages:
            w.bind_connector_metadata(out.kv_connector_metadata)
            w.start_load_kv(None)
        for w, layers in self.stages:
            for name in layers:
                w.wait_for_layer_load(name)
        self.forward(out)
        for w, layers in self.stages:
            for name in layers:
                w.save_kv_layer(name, self.kv[name], None)
            w.wait_for_save()
        results = [w.get_transfer_results(out.finished_req_ids) for w, _ in self.stages]
        recving = set.intersection(*(set(r.finished_recving or ()) for r in results))
        failed = set.union(*(set(r.failed_recving or ()) for r in results))
        invalid = set.union(*(w.get_block_ids_with_load_errors() for w, _ in self.stages))
        for w, _ in self.stages:
            w.clear_connector_metadata()
        return KVConnectorOutput(
            finished_recving=(recving | (finished_recving or set())) or None,
            failed_recving=failed or None,
            invalid_block_ids=invalid,
        )

    def block_kv(self, block: int) -> list[bytes]:
        """The bytes of one block, per layer (a state layer's: its state, unpadded)."""
        out = []
        for name in LAYERS:
            spec = self.layer_groups.get(name, (0, self.spec))[1]
            page = self.kv[name][block].contiguous().view(torch.uint8).reshape(-1)
            out.append((page[: spec.real_page_size_bytes] if is_state(spec) else page).numpy().tobytes())
        return out

    def expected_block_kv(self, tokens: list[int], index: int, tag: str = "") -> list[bytes]:
        """What the forward pass writes for block `index` of `tokens` (of a request whose
        `context_tag` is `tag`), per layer, in the engine's layout (built in a scratch tensor of
        the same view)."""
        out = []
        for li, name in enumerate(LAYERS):
            spec = self.layer_groups.get(name, (0, self.spec))[1]
            if is_state(spec):
                page = state_bytes(tokens, (index + 1) * spec.block_size, li, spec, tag).numpy().tobytes()
                out.append(page)
                continue
            scratch = torch.empty_like(self.kv[name][:1])
            bs = spec.block_size
            for slot in range(bs):
                scratch[0, :, slot, :].view(torch.uint8).copy_(token_kv(tokens, index * bs + slot, li, tag, spec))
            out.append(scratch[0].contiguous().view(torch.uint8).numpy().tobytes())
        return out


def scheduler(cfg: VllmConfig, kcfg: Any, block: int, hash_block: int) -> Scheduler:
    """vLLM's Scheduler as its engine core makes it, aligning to blocks of `block` tokens and
    hashing requests in blocks of `hash_block`, with our connector's scheduler half inside."""
    kcfg.hash_block_size = hash_block
    sched = Scheduler(
        vllm_config=cfg, kv_cache_config=kcfg, log_stats=True, structured_output_manager=StructuredOutputManager(cfg),
        block_size=block, hash_block_size=hash_block,
    )  # fmt: skip
    assert type(sched.connector) is KvcachedConnector, type(sched.connector)
    return sched


def engine(
    *args: Any, num_blocks: int = 64, layout: str = "LBHNC", spec: Any = SPEC, groups: list | None = None, **kwargs: Any
) -> Engine:
    """A scheduler and a worker of `vllm_config(*args, layout=layout, **kwargs)` with the
    kvcached connector, over `num_blocks` blocks of KV in `layout` for the attention `spec` (or
    the KV-cache `groups`, [(layers, spec)], with vLLM's hybrid manager on)."""
    mamba = any(is_state(sp) for _, sp in groups or [])
    cfg = vllm_config(*args, layout=layout, hybrid=groups is not None, mamba=mamba, **kwargs)
    kcfg = kv_cache_config(cfg, num_blocks, spec, groups)
    # Groups of different block sizes: vLLM's engine core gives the scheduler their least
    # common multiple to align to and hashes requests in blocks of their greatest common
    # divisor (`resolve_kv_cache_block_sizes`); requests are then made with `block=` that.
    sizes = [sp.block_size for _, sp in groups or [(LAYERS, spec)]]
    sched = scheduler(cfg, kcfg, math.lcm(*sizes), math.gcd(*sizes))
    # An encoder budget, as a multimodal model's scheduler has, so that requests with images
    # are scheduled past their placeholders (the fake forward pass needs no encoder).
    sched.max_num_encoder_input_tokens = 8192
    sched.encoder_cache_manager = EncoderCacheManager.create_manager(cache_size=8192, vllm_config=cfg)
    kv_layout = KVCacheLayout[layout]
    # As vLLM's model runner does (initialize_kv_cache_tensors, then register_kv_caches).
    [(worker, _)], [kv] = workers(sched, [(cfg, kcfg, None)], kv_layout)
    layer_groups = {name: (g, sp) for g, (layers, sp) in enumerate(groups or [(LAYERS, spec)]) for name in layers}
    return Engine(sched, worker, kv, kv_layout, spec=spec, layer_groups=layer_groups)


def pp_engine(*args: Any, num_blocks: int = 64, layout: str = "LBHNC", **kwargs: Any) -> Engine:
    """An engine of two pipeline stages (one layer each): vLLM's scheduler with stage 0's
    KV-cache config (as vLLM's engine core gives it), and a worker per stage on its own KV
    tensors, each built from the stage's projection of the model's KV-cache group."""
    cfg = vllm_config(*args, layout=layout, **kwargs)
    cfg.parallel_config.pipeline_parallel_size = len(LAYERS)
    kcfgs = [kv_cache_config(cfg, num_blocks, groups=[([name], SPEC)]) for name in LAYERS]
    sched = scheduler(cfg, kcfgs[0], BLOCK, BLOCK)
    kv_layout = KVCacheLayout[layout]
    stages, kvs = workers(sched, [(cfg, kcfg, None) for kcfg in kcfgs], kv_layout)
    kv = {name: t for stage_kv in kvs for name, t in stage_kv.items()}
    return Engine(sched, stages[0][0], kv, kv_layout, stages=stages)


def workers(
    sched: Scheduler, configs: list[tuple[VllmConfig, Any, Any]], kv_layout: KVCacheLayout
) -> tuple[list[tuple[KvcachedConnector, list[str]]], list[dict[str, torch.Tensor]]]:
    """A worker per (config, KV-cache config, patch) on KV tensors vLLM allocates, as each
    rank's model runner makes them (`patch`: a context the worker is built in, or None), with
    its layers; `sched`'s connector and those built are shut down if one fails."""
    from contextlib import nullcontext

    stages: list[tuple[KvcachedConnector, list[str]]] = []
    kvs: list[dict[str, torch.Tensor]] = []
    try:
        for cfg, kcfg, patch in configs:
            with patch or nullcontext():
                worker = KvcachedConnector(cfg, KVConnectorRole.WORKER, kcfg)
            stages.append((worker, [n for g in kcfg.kv_cache_groups for n in g.layer_names]))
            ctx = worker.get_mem_pool_context()
            assert ctx is not None
            with ctx:
                kv = allocate_kv_cache(kcfg, torch.device("cpu"), kv_layout)
            worker.register_kv_caches(kv)
            kvs.append(kv)
    except BaseException:
        for w, _ in stages:
            w.shutdown()
        sched.connector.shutdown()
        raise
    return stages, kvs


@dataclass
class RankedEngine(Engine):
    """An engine of context-parallel ranks: vLLM's scheduler and a worker per rank on its own
    KV tensors (`ranks`), each rank's page of a block holding what the fake forward pass writes
    there (`expected_rank_block_kv`)."""

    ranks: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def rank_block_kv(self, rank: int, block: int) -> list[bytes]:
        """Rank `rank`'s page of block `block`, per layer."""
        return [self.ranks[rank][name][block].contiguous().view(torch.uint8).numpy().tobytes() for name in LAYERS]

    def where(self, pos: int) -> list[tuple[int, int, str]]:
        """(rank, slot in its block, tag of the KV written) of each copy of token `pos`."""
        raise NotImplementedError

    def span(self) -> int:
        """Tokens of one of the scheduler's blocks."""
        return BLOCK

    def forward(self, out: Any) -> None:
        s = self.scheduler
        starts = self.starts(out)
        for rid, n in out.num_scheduled_tokens.items():
            toks = list(s.requests[rid].all_token_ids)
            ids = s.kv_cache_manager.get_blocks(rid).get_block_ids()[0]
            for pos in range(starts[rid], min(starts[rid] + n, len(toks))):
                b = ids[pos // self.span()]
                for rank, slot, tag in self.where(pos):
                    for li, name in enumerate(LAYERS):
                        self.ranks[rank][name][b, :, slot, :].view(torch.uint8).copy_(token_kv(toks, pos, li, tag))

    def expected_rank_block_kv(self, rank: int, tokens: list[int], index: int) -> list[bytes]:
        """What the forward pass writes into rank `rank`'s page of block `index` of `tokens`."""
        out = []
        for li, name in enumerate(LAYERS):
            scratch = torch.empty_like(self.ranks[rank][name][:1])
            for pos in range(index * self.span(), (index + 1) * self.span()):
                for r, slot, tag in self.where(pos):
                    if r == rank:
                        scratch[0, :, slot, :].view(torch.uint8).copy_(token_kv(tokens, pos, li, tag))
            out.append(scratch[0].contiguous().view(torch.uint8).numpy().tobytes())
        return out


@dataclass
class DcpEngine(RankedEngine):
    """An engine of `dcp` decode-context-parallel ranks: vLLM's scheduler with blocks of
    BLOCK x dcp tokens, each rank holding its share of a block's tokens (vLLM's slot mapping:
    token `p` of a block lies on rank `(p // interleave) % dcp`, in slot
    `(p // (dcp x interleave)) x interleave + p % interleave`)."""

    dcp: int = 2
    interleave: int = 1

    def span(self) -> int:
        return BLOCK * self.dcp

    def where(self, pos: int) -> list[tuple[int, int, str]]:
        n, i = self.dcp, self.interleave
        off = pos % (BLOCK * n)
        return [((off // i) % n, (off // (n * i)) * i + off % i, "")]


@dataclass
class PcpEngine(RankedEngine):
    """An engine of prefill-context-parallel ranks: vLLM's scheduler (blocks of BLOCK tokens)
    and every rank a page of each block. What of a block's KV each rank holds is vLLM's model
    runner's business (replicated, or each rank's computed share): the fake forward pass writes
    a rank-specific KV into every rank's pages, so that a test can tell whose bytes a rank got
    back."""

    def where(self, pos: int) -> list[tuple[int, int, str]]:
        return [(rank, pos % BLOCK, f"pcp{rank}") for rank in range(len(self.ranks))]


def ranks_round_trip(make: Any, prompt: list[int], *args: Any, **kwargs: Any) -> None:
    """An engine of ranks (`make(*args, **kwargs)`) saves the prompt's whole blocks, every rank
    its own pages, and another loads them, every rank's pages byte for byte."""
    a = make(*args, **kwargs)
    sched = a.connector.scheduler
    ns = [w.worker.namespace.id for w, _ in a.stages]
    assert len(set(ns)) == len(ns) and sched.namespace.id == ns[0]
    span, ranks = a.span(), len(a.stages)
    blocks = len(prompt) // span
    a.add(request("R1", prompt, block=span))
    out, _ = a.step()
    assert [(t.first_block, len(t.slots)) for t in out.kv_connector_metadata.saves] == [(0, blocks)]
    assert [w.worker.counts["saved"] for w, _ in a.stages] == [blocks] * ranks
    finish(a, "R1")

    b = make(*args, **kwargs)
    b.add(request("R2", prompt, block=span))
    out, _ = b.step()
    assert [(t.first_block, len(t.slots)) for t in out.kv_connector_metadata.loads] == [(0, blocks)]
    assert out.num_scheduled_tokens["R2"] == len(prompt) - blocks * span
    assert [(w.worker.counts["loaded"], w.worker.counts["load_failed"]) for w, _ in b.stages] == [(blocks, 0)] * ranks
    ids = b.scheduler.kv_cache_manager.get_blocks("R2").get_block_ids()[0]
    for rank in range(ranks):
        for i in range(blocks):
            assert b.rank_block_kv(rank, ids[i]) == b.expected_rank_block_kv(rank, prompt, i), f"rank {rank} block {i}"
    finish(b, "R2")


def _ranked(
    cls: type,
    size: int,
    rank_fn: str,
    args: tuple,
    kwargs: dict,
    num_blocks: int,
    block: int,
    config: Any,
    **fields: Any,
) -> Any:
    """An engine `cls` of `size` ranks, each rank's worker built as vLLM's would be on that rank
    (`rank_fn`, the worker module's rank probe, answering the rank vLLM's parallel state gives
    there), over a config `config` adjusted."""
    from unittest import mock

    import kvcached.vllm.worker as worker_mod

    cfg = vllm_config(*args, **kwargs)
    config(cfg.parallel_config)
    kcfg = kv_cache_config(cfg, num_blocks)
    sched = scheduler(cfg, kcfg, block, block)
    ranked = [(cfg, kcfg, mock.patch.object(worker_mod, rank_fn, lambda *_a, r=r: r)) for r in range(size)]
    stages, ranks = workers(sched, ranked, KVCacheLayout["LBHNC"])
    return cls(sched, stages[0][0], ranks[0], KVCacheLayout["LBHNC"], stages=stages, ranks=ranks, **fields)


def dcp_engine(*args: Any, dcp: int = 2, interleave: int = 1, num_blocks: int = 64, **kwargs: Any) -> DcpEngine:
    """An engine of `dcp` decode-context-parallel ranks (`DcpEngine`)."""

    def config(pc: Any) -> None:
        pc.decode_context_parallel_size = dcp
        pc.cp_kv_cache_interleave_size = interleave

    return _ranked(DcpEngine, dcp, "_dcp_rank", args, kwargs, num_blocks, BLOCK * dcp, config, dcp=dcp,
                   interleave=interleave)  # fmt: skip


def pcp_engine(*args: Any, pcp: int = 2, num_blocks: int = 64, **kwargs: Any) -> PcpEngine:
    """An engine of `pcp` prefill-context-parallel ranks (`PcpEngine`)."""

    def config(pc: Any) -> None:
        pc.prefill_context_parallel_size = pcp

    return _ranked(PcpEngine, pcp, "_pcp_rank", args, kwargs, num_blocks, BLOCK, config)
