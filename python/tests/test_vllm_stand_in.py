"""The GPU check's stand-in for vLLM (`scripts/gpu/vllm_stand_in`, used where vLLM is not
installed) against vLLM 0.33 itself: from the configuration the check gives the connector's
worker half (`scripts/gpu/checks.py`, `vllm_configs`), both derive the same KV-cache group, page
size and namespace (its id and its block keys), so the check drives the worker as vLLM would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

GPU = Path(__file__).resolve().parents[2] / "scripts" / "gpu"

PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import checks
import vllm
from kvcached.vllm.config import ConnectorConfig, kv_groups, namespace, page_bytes
vc, kc = checks.vllm_configs(sys.argv[2], 64)
g = kv_groups(vc, kc)[0]
ns = namespace(vc, kc, ConnectorConfig.from_extra({"kvcached.namespace_extra": "gpu-check"}), 0, 1, g)
print(json.dumps({
    "vllm": vllm.__file__, "layers": list(g.layers), "window": g.window_blocks, "page": page_bytes(g.spec),
    "id": ns.id, "keys": [k.hex() for k in ns.block_keys(list(range(64)))],
}))
"""


def probe(layout: str, stand_in: bool) -> dict:
    env = dict(os.environ)
    if stand_in:
        env["PYTHONPATH"] = os.pathsep.join([str(GPU / "vllm_stand_in"), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(GPU), layout], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_the_stand_in_derives_what_vllm_derives(layout):
    real, stand_in = probe(layout, False), probe(layout, True)
    assert "vllm_stand_in" in stand_in.pop("vllm") and "vllm_stand_in" not in real.pop("vllm")
    assert stand_in == real
    assert real["page"] == 16 * 8 * 256 * 2 and len(real["keys"]) == 4
