"""The connector on the KV-cache groups vLLM itself derives for real model architectures from a
config.json alone (`vllm_model_specs.py`: the model built on torch's meta device, its layers'
specs, vLLM's planner's groups): full attention (Llama), sliding window beside full (Gemma 3,
gpt-oss), MLA (DeepSeek V3), chunked local attention beside full (Llama 4), Mamba and
linear-attention state beside attention (Jamba, Qwen3-Next, Nemotron-H). For each, both halves
of the connector accept the groups and agree on their namespaces, and the blocks of every group
round-trip byte for byte between two workers' KV tensors, allocated by vLLM in its CPU layout."""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402
from vllm_harness import kv_cache_config, vllm_config  # noqa: E402
from vllm_model_specs import CONFIGS, config_json  # noqa: E402

from kvcached.vllm import KvcachedConnector  # noqa: E402
from kvcached.vllm.config import ConnectorConfig, page_bytes  # noqa: E402
from kvcached.vllm.meta import KvcachedConnectorMetadata, Transfer  # noqa: E402
from kvcached.vllm.scheduler import SchedulerSide  # noqa: E402

# What each family's groups are, in vLLM's order ("window": sliding window, "state": Mamba).
KINDS = {
    "llama": ["full"],
    "gemma3": ["window"] * 5 + ["full"],
    "gpt-oss": ["window", "full"],
    "deepseek-v3": ["mla"],
    "llama4": ["chunked"] * 3 + ["full"],
    "jamba": ["state"] * 3 + ["full"],
    "qwen3-next": ["state"] * 3 + ["full"],
    "nemotron-h": ["state"] * 2 + ["full"],
}


@pytest.fixture(scope="module")
def derived() -> dict:
    """Every family's (block size, groups), from one child process (vLLM's distributed state and
    model construction stay out of this one)."""
    here = Path(__file__).parent
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    out = subprocess.run(
        [sys.executable, str(here / "vllm_model_specs.py"), *CONFIGS],
        capture_output=True, text=True, timeout=600, cwd=here, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return pickle.loads(base64.b64decode(out.stdout.strip().splitlines()[-1]))


def kind(g) -> str:
    if g.state:
        return "state"
    if g.chunked:
        return "chunked"
    if g.window_blocks is not None:
        return "window"
    return "mla" if type(g.spec).__name__.startswith("MLA") else "full"


def page(kv: torch.Tensor, block: int, spec) -> bytes:
    """A block's page of one layer, without padding."""
    return kv[block].contiguous().view(torch.uint8).reshape(-1)[: page_bytes(spec)].numpy().tobytes()


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_groups_vllm_derives_for_a_real_model_round_trip(daemon, derived, family, tmp_path):
    block_size, groups = derived[family]
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(__import__("json").dumps(config_json(family)))
    states = any(type(s).__name__ == "MambaSpec" for _, s in groups)
    extra = {"kvcached.model_id": f"specs-{family}"}

    def config(engine: str):
        cfg = vllm_config(daemon.socket, extra=extra, model_dir=str(model_dir), hybrid=len(groups) > 1, mamba=states)
        cfg.cache_config.block_size = block_size
        cfg.kv_transfer_config.engine_id = engine
        return cfg, kv_cache_config(cfg, 16, groups=groups)

    cfg, kcfg = config("a")
    sched = SchedulerSide(cfg, kcfg, ConnectorConfig.from_extra(cfg.kv_transfer_config.kv_connector_extra_config),
                          cfg.kv_transfer_config)  # fmt: skip
    workers, kvs = [], []
    try:
        assert [kind(g) for g in sched.groups] == KINDS[family]
        assert len({ns.id for ns in sched.namespaces}) == len(groups), "every group keyed apart"
        for engine in ("a", "b"):
            cfg, kcfg = config(engine)
            w = KvcachedConnector(cfg, KVConnectorRole.WORKER, kcfg)
            workers.append(w)
            with w.get_mem_pool_context():
                kv = allocate_kv_cache(kcfg, torch.device("cpu"), KVCacheLayout["LBHNC"])
            w.register_kv_caches(kv)
            kvs.append(kv)
        # Both halves derive the same namespaces.
        assert [r.namespace.id for r in workers[0].worker.regs] == [ns.id for ns in sched.namespaces]
        gen = torch.Generator().manual_seed(7)
        for t in {id(v): v for v in kvs[0].values()}.values():
            t.view(torch.uint8).copy_(
                torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8)
            )
        tokens = list(range(1000, 1000 + 3 * block_size))
        from array import array

        toks = array("I", tokens)
        saves = [Transfer("r", toks, 0, [1, 2, 3], None, g) for g in range(len(groups))]
        a, b = workers
        a.bind_connector_metadata(KvcachedConnectorMetadata(saves=saves))
        a.start_load_kv(None)
        a.wait_for_save()
        a.clear_connector_metadata()
        assert a.worker.counts["saved"] == 3 * len(groups) and a.worker.counts["save_failed"] == 0
        loads = [Transfer("r", toks, 0, [5, 6, 7], None, g) for g in range(len(groups))]
        b.bind_connector_metadata(KvcachedConnectorMetadata(loads=loads))
        b.start_load_kv(None)
        b.wait_for_save()
        b.clear_connector_metadata()
        assert b.worker.counts["loaded"] == 3 * len(groups) and b.worker.counts["load_failed"] == 0
        for layers, spec in groups:
            for name in layers:
                for src, dst in ((1, 5), (2, 6), (3, 7)):
                    assert page(kvs[1][name], dst, spec) == page(kvs[0][name], src, spec), f"{name} block {src}"
    finally:
        for w in workers:
            w.shutdown()
        sched.shutdown()
