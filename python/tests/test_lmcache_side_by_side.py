"""kvcached's connector beside LMCache's MP connector in the same vLLM scheduler test, against an
LMCache server (`lmcache server`, which runs on the CPU) and a kvcached daemon.

Runs where $KVCACHED_LMCACHE_PATH names a directory holding the lmcache package (scripts/test
installs lmcache 0.5.6 there without its dependencies: its server and its scheduler-side adapter
need nothing the vLLM environment lacks but `sortedcontainers`). Only the scheduler sides meet
here: LMCache's worker half is CUDA-only. Figures: python/bench/bench_python.py.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
LMCACHE = os.environ.get("KVCACHED_LMCACHE_PATH")
if not LMCACHE:
    pytest.skip("KVCACHED_LMCACHE_PATH is not set", allow_module_level=True)

sys.path.append(LMCACHE)  # vLLM imports the connector's module in this process
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
os.environ.update(LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", LMCACHE_DISABLE_BANNER="1")

import vllm_harness as h  # noqa: E402
from bench_python import lmcache_server, stop  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lmcache():
    port, http = free_port(), free_port()
    p = lmcache_server(LMCACHE, port, http)
    yield port
    stop(p, signal.SIGINT, 20)


def scheduler(sock: str, model_dir: str, transfer: KVTransferConfig | None) -> Scheduler:
    cfg = h.vllm_config(sock, model_dir=model_dir, prefix_caching=False, batched_tokens=1024)
    if transfer is not None:
        cfg.kv_transfer_config = transfer
    kcfg = h.kv_cache_config(cfg, 256)
    return Scheduler(
        vllm_config=cfg,
        kv_cache_config=kcfg,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=h.BLOCK,
    )


def admit(s: Scheduler, rid: str, tokens: list[int]) -> tuple[int, float]:
    """Adds a request and calls schedule() until it is admitted: (calls before, seconds)."""
    s.add_request(h.request(rid, tokens, max_tokens=1))
    t0 = time.perf_counter()
    calls = 0
    while rid not in (out := s.schedule()).num_scheduled_tokens:
        calls += 1
        assert calls < 100_000, f"{rid} was never admitted"
    waited = time.perf_counter() - t0
    assert out.num_scheduled_tokens[rid] == len(tokens), "nothing was cached: all of it computed"
    # Finish it (EOS); LMCache holds a finished request's blocks until the worker reports it
    # "sent", which the next step's output does.
    sending = None
    for _ in range(3):
        ids = list(out.num_scheduled_tokens)
        s.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[h.EOS] for _ in ids],
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=None,
                kv_connector_output=KVConnectorOutput(finished_sending=sending) if sending else None,
            ),
        )
        if rid not in s.requests:
            break
        sending = {rid}
        out = s.schedule()
    return calls, waited


def test_both_connectors_answer_the_same_scheduler(daemon, model_dir, lmcache):
    ours = scheduler(daemon.socket, model_dir, None)
    theirs = scheduler(
        daemon.socket,
        model_dir,
        KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": lmcache},
        ),
    )
    assert type(theirs.connector).__module__.startswith("lmcache."), type(theirs.connector)
    rows = []
    for i in range(5):
        tokens = [(i * 7919 + t * 31) % 1000 + 3 for t in range(1024)]
        ours_calls, ours_s = admit(ours, f"k{i}", tokens)
        theirs_calls, theirs_s = admit(theirs, f"l{i}", tokens)
        rows.append((ours_s, theirs_s, theirs_calls))
        # kvcached answers within the schedule() call that asks. LMCache's lookup is
        # asynchronous: vLLM is told to ask again until its reply is in (how many calls that
        # takes depends on the machine: reported, not asserted).
        assert ours_calls == 0
    stats = ours.connector.scheduler.stats
    assert stats.lookups == 5 and stats.hit_tokens == 0
    print("\nadmitted after (s): kvcached / LMCache (schedule() calls before):")
    for o, t, n in rows:
        print(f"  {o:.6f} / {t:.6f} ({n})")
    ours.connector.shutdown()
