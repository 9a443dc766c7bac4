"""Costs of kvcached from Python and of its vLLM connector's scheduler half, beside LMCache's
MP connector in the same run (docs/benchmarks.md, "Python and vLLM connector").

    python python/bench/bench_python.py [--kvcached BIN] [--kvbench BIN] [--lmcache-path DIR]

- API: `Client.lookup` / `load_now` of 4 blocks of 2 MiB (Llama-3-8B's KV block, 16 tokens) and
  the lookup of a fully cached 128k-token prompt with the daemon's key memo off, as
  `kvbench socket` measures them from Rust (`--kvbench` runs it against the same daemon).
- Scheduler: vLLM's real Scheduler on the CPU (python/tests/vllm_harness.py), one new request per
  step; the connector's `get_num_new_matched_tokens` and the whole `schedule()` call, for a
  miss and a hit, beside the same Scheduler without a connector, and beside LMCache's
  `LMCacheMPConnector` against an LMCache server when `--lmcache-path` names an install of the
  lmcache package (its lookups are asynchronous: the time until the scheduler had its answer,
  and how many `schedule()` calls passed meanwhile).
- LMCache's own `lmcache bench server --mode cpu` for the same 2 MiB block shape (its store and
  retrieve run only there on a CPU machine: the connector's worker half is CUDA-only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import kvcached  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def us(xs: list[float]) -> str:
    return f"{pct(xs, 0.5) * 1e6:.0f} / {pct(xs, 0.99) * 1e6:.0f}"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(binary: str, root: Path, g2: int, memo_off: bool) -> subprocess.Popen:
    """A daemon on `root/kvcached.sock`, returned once its G2 pool is prefaulted: while the
    background prefault runs, it takes one of the two vCPUs and the calls measured would wait
    for it (as `kvbench socket` waits)."""
    import urllib.request

    sock = root / "kvcached.sock"
    metrics = f"127.0.0.1:{free_port()}"
    args = [binary, "--socket", str(sock), "--metrics-addr", metrics, "--g2-capacity-bytes", str(g2),
            "--g2-shm-dir", "/dev/shm", "--g3-enabled", "false"]  # fmt: skip
    if memo_off:
        cfg = root / "c.toml"
        cfg.write_text("[engines]\nkey_memo_bytes = 0\n")
        args += ["--config", str(cfg)]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(root / "daemon.log", "wb"))
    deadline = time.monotonic() + 30
    while not sock.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((root / "daemon.log").read_text())
        time.sleep(0.05)
    deadline = time.monotonic() + 300
    while True:
        with contextlib.suppress(OSError):
            text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
            if "kvcached_g2_prefault_done 1" in text.splitlines():
                return p
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the daemon's G2 prefault did not finish: " + (root / "daemon.log").read_text())
        time.sleep(0.2)


def api_costs(sock: str, samples: int) -> dict[str, str]:
    big = kvcached.KvLayout(32, 8, 128, "bf16", 16)  # 2 MiB per block
    mem = kvcached.KvMemory.anonymous(big, 16)
    mem.numpy()[:] = 1
    c = kvcached.Client(sock)
    c.register("bench-api", kvcached.Namespace("bench/api", big), mem)
    out = {}
    lookups, loads = [], []
    for i in range(samples):
        toks = [(i * 131 + t) % 30000 for t in range(4 * 16)]
        c.save(toks, 0, [0, 1, 2, 3])
        t0 = time.perf_counter()
        assert c.lookup(toks).matched_blocks == 4
        t1 = time.perf_counter()
        assert c.load_now(toks, 0, [8, 9, 10, 11]).loaded_blocks == 4
        t2 = time.perf_counter()
        lookups.append(t1 - t0)
        loads.append(t2 - t1)
    out["lookup, 4 blocks of 2 MiB"] = us(lookups)
    out["load_now, 4 blocks of 2 MiB"] = us(loads)
    c.unregister()

    small = kvcached.KvLayout(2, 2, 32, "bf16", 16)
    mem = kvcached.KvMemory.anonymous(small, 8192)
    c = kvcached.Client(sock)
    c.register("bench-128k", kvcached.Namespace("bench/128k", small), mem)
    toks = [(t * 7919) % 50000 for t in range(131072)]
    c.save(toks, 0, list(range(8192)))
    arr = np.array(toks, dtype=np.uint32)
    as_list, as_array, never = [], [], []
    for i in range(samples):
        t0 = time.perf_counter()
        assert c.lookup(toks).matched_blocks == 8192
        t1 = time.perf_counter()
        assert c.lookup(arr).matched_blocks == 8192
        t2 = time.perf_counter()
        other = arr.copy()
        other[0] = 50001 + i
        t3 = time.perf_counter()
        assert c.lookup(other).matched_blocks == 0
        t4 = time.perf_counter()
        as_list.append(t1 - t0)
        as_array.append(t2 - t1)
        never.append(t4 - t3)
    out["lookup, 128k tokens cached, keys not remembered, tokens as a list"] = us(as_list)
    out["the same, tokens as a NumPy uint32 array"] = us(as_array)
    out["lookup, 128k tokens never seen (uint32 array)"] = us(never)
    t0 = time.perf_counter()
    for _ in range(20):
        np.array(toks, dtype=np.uint32)
    out["(list of 128k ints -> uint32 array, for scale)"] = f"{(time.perf_counter() - t0) / 20 * 1e6:.0f}"
    c.unregister()
    return out


# Requests scheduled before each scheduler's measured ones (its first connections, imports).
WARMUP = 3


def scheduler_costs(sock: str, tokens: int, rounds: int, lmcache: dict | None) -> dict[str, str]:
    import vllm_harness as h
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    md = h.tiny_model_dir()
    out: dict[str, str] = {}
    lookups: list[float] = []

    def make(connector: str | None):
        cfg = h.vllm_config(sock, model_dir=md, prefix_caching=False, batched_tokens=max(tokens, 64))
        cfg.scheduler_config.max_model_len = tokens + 64
        if connector is None:
            cfg.kv_transfer_config = None
        elif connector == "lmcache":
            from vllm.config import KVTransferConfig

            cfg.kv_transfer_config = KVTransferConfig(
                kv_connector="LMCacheMPConnector", kv_role="kv_both",
                kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": lmcache["port"]},
            )  # fmt: skip
        kcfg = h.kv_cache_config(cfg, tokens // h.BLOCK + 64)
        s = Scheduler(vllm_config=cfg, kv_cache_config=kcfg, log_stats=False,
                      structured_output_manager=StructuredOutputManager(cfg), block_size=h.BLOCK)  # fmt: skip
        return s

    def drain(s, rid: str, sending: bool = False) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        for _ in range(4):
            if rid not in s.requests:
                return
            o = s.schedule()
            ids = list(o.num_scheduled_tokens)
            kvo = KVConnectorOutput(finished_sending={rid}) if sending else None
            s.update_from_output(o, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[h.EOS] for _ in ids], logprobs=None, prompt_logprobs_dict={},
                pooler_output=None, kv_connector_output=kvo))  # fmt: skip

    def run(s, label: str, prompt_of, sending: bool = False) -> None:
        steps, polls, waits = [], [], []
        for i in range(WARMUP + rounds):
            if i == WARMUP:
                steps, polls, waits = [], [], []
                lookups.clear()
            rid = f"{label}-{i}"
            s.add_request(h.request(rid, prompt_of(i), max_tokens=1))
            t0 = time.perf_counter()
            n = 0
            while True:
                ts = time.perf_counter()
                o = s.schedule()
                n += 1
                if rid in o.num_scheduled_tokens:
                    steps.append(time.perf_counter() - ts)
                    break
                if n > 100000:
                    raise RuntimeError(f"{rid} never scheduled")
            waits.append(time.perf_counter() - t0)
            polls.append(n - 1)
            from vllm.v1.outputs import ModelRunnerOutput

            s.update_from_output(o, ModelRunnerOutput(
                req_ids=[rid], req_id_to_index={rid: 0}, sampled_token_ids=[[h.EOS]], logprobs=None,
                prompt_logprobs_dict={}, pooler_output=None))  # fmt: skip
            drain(s, rid, sending)
        out[f"{label}: schedule() that admits the request"] = us(steps)
        if label.startswith("LMCache"):
            out[f"{label}: add_request -> admitted (answer pending meanwhile)"] = us(waits)
            out[f"{label}: schedule() calls before the answer, median"] = f"{statistics.median(polls):.0f}"

    def prompt(seed: int):
        return lambda i: [(seed * 1_000_003 + i * 7919 + t * 31) % 1000 + 3 for t in range(tokens)]

    base = make(None)
    run(base, "no connector", prompt(1))
    s = make("kvcached")
    sched = s.connector.scheduler
    connect = sched._connect

    class Timed:
        """The scheduler's client, with each lookup timed (tokens handed over included)."""

        def __init__(self, c):
            self.c = c

        def lookup(self, tokens):
            t0 = time.perf_counter()
            try:
                return self.c.lookup(tokens)
            finally:
                lookups.append(time.perf_counter() - t0)

    sched._connect = lambda: (lambda c: c if c is None else Timed(c))(connect())
    run(s, "kvcached, miss", prompt(2))
    miss = us(lookups)
    # Hits: the prompts' blocks saved under the scheduler's own namespace beforehand.
    c = kvcached.Client(sock)
    nb = tokens // h.BLOCK
    c.register("bench-sched", sched.namespace, kvcached.KvMemory.anonymous(sched.namespace.layout, nb))
    for i in range(rounds):
        c.save(prompt(3)(i), 0, list(range(nb)))
    run(s, "kvcached, hit", prompt(3))
    out["kvcached: the connector's Client.lookup, miss"] = miss
    out["kvcached: the connector's Client.lookup, hit"] = us(lookups)
    c.unregister()
    s.connector.shutdown()
    if lmcache is not None:
        ls = make("lmcache")
        out["LMCache connector class"] = f"{type(ls.connector).__module__}.{type(ls.connector).__name__}"
        run(ls, "LMCache, miss", prompt(4), sending=True)
    return out


def stop(p: subprocess.Popen, sig: int, timeout: float) -> int:
    """Sends `sig` to `p` and waits up to `timeout` seconds for it to exit, then kills it: its
    exit status."""
    p.send_signal(sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        return p.wait(timeout=timeout)
    p.kill()
    return p.wait()


def lmcache_server(path: str, port: int, http_port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": path, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
    code = "import sys; sys.argv=['lmcache']+sys.argv[1:]\nfrom lmcache.cli.main import main; main()"
    args = [sys.executable, "-c", code, "server", "--host", "127.0.0.1", "--port", str(port), "--chunk-size", "256",
            "--l1-size-gb", "2", "--eviction-policy", "LRU", "--http-host", "127.0.0.1", "--http-port",
            str(http_port), "--disable-metrics", "--supported-transfer-mode", "auto",
            "--shm-name", f"kvcached-bench-{os.getpid()}"]  # fmt: skip
    p = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    import socket

    while True:
        try:
            socket.create_connection(("127.0.0.1", http_port), timeout=0.5).close()
            return p
        except OSError:
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the LMCache server did not start") from None
            time.sleep(0.5)


def lmcache_bench(path: str, port: int, http_port: int, requests: int) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": path, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
    code = "import sys; sys.argv=['lmcache']+sys.argv[1:]\nfrom lmcache.cli.main import main; main()"
    args = [sys.executable, "-c", code, "bench", "server", "--rpc-url", f"tcp://127.0.0.1:{port}", "--url",
            f"http://127.0.0.1:{http_port}", "--mode", "cpu", "--transfer-mode", "engine_driven",
            "--kvcache-shape-spec", "(2,1024,16,8,128):bfloat16:32", "--num-tokens", "256", "--start", "0",
            "--end", str(requests), "--interval", "0", "--format", "json"]  # fmt: skip
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    text = r.stdout[r.stdout.index("{") : r.stdout.rindex("}") + 1]
    res = json.loads(text)

    def find(d, key):
        if isinstance(d, dict):
            for k, v in d.items():
                if k == key:
                    return v
                got = find(v, key)
                if got is not None:
                    return got
        return None

    out = {}
    for name in ("cold_lookup", "cold_store", "warm_lookup", "warm_retrieve"):
        d = find(res, name) or {}
        out[f"LMCache bench (256 tokens = 16 blocks of 2 MiB): {name} p50 / p99, ms"] = (
            f"{d.get(name + '_p50')} / {d.get(name + '_p99')}"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    target = Path(os.environ.get("CARGO_TARGET_DIR", Path.home() / ".cache/kvcached/target"))
    ap.add_argument("--kvcached", default=str(target / "release/kvcached"))
    ap.add_argument("--kvbench", default=None, help="also run `kvbench socket` against the same daemon")
    ap.add_argument("--lmcache-path", default=None, help="a directory holding the lmcache package")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=50)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvcached-bench-py-"))
    results: dict[str, str] = {}
    daemon = start_daemon(a.kvcached, root, 2 << 30, memo_off=True)
    lm = None
    try:
        sock = str(root / "kvcached.sock")
        results.update(api_costs(sock, a.samples))
        if a.kvbench:
            r = subprocess.run([a.kvbench, "socket", "--socket", sock, "--calls", "2", "--warmup", "0",
                                "--samples", "300"], capture_output=True, text=True, timeout=600)  # fmt: skip
            results["kvbench socket (Rust client, same daemon)"] = "\n" + r.stdout[-3000:]
        if a.lmcache_path:
            os.environ.update(LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1")
            sys.path.append(a.lmcache_path)  # the connector imports lmcache in this process too
            lm = lmcache_server(a.lmcache_path, 5611, 8611)
        for tokens in (1024, 16384):
            lmc = {"port": 5611} if lm else None
            for k, v in scheduler_costs(sock, tokens, a.rounds, lmc).items():
                results[f"[{tokens} tokens] {k}"] = v
        if lm:
            results.update(lmcache_bench(a.lmcache_path, 5611, 8611, 64))
    finally:
        if lm is not None:
            stop(lm, signal.SIGINT, 20)
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
    print("\n| case | p50 / p99 (us unless said) |\n|---|---|")
    for k, v in results.items():
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
