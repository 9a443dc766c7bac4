#!/usr/bin/env python3
"""The GPU checks of `scripts/gpu-check`, against a running kvcached daemon ($KVCACHED_SOCKET).

    python3 checks.py --device cuda   # on a machine with an NVIDIA GPU (what gpu-check runs)
    python3 checks.py --device cpu    # the same flow on CPU memory (scripts/test runs it)

Each check prints one row of the summary table; the exit status is 0 only if every check that
ran passed. With `--device cpu` the engines' KV is shared memory registered by descriptor instead
of CUDA memory registered by IPC handle, so the checks' own logic (engines in other processes,
byte comparisons, the kill, the timings) is exercised where no GPU is.

Checks:
- `ipc_two_engines`: engine A (this process) saves a long prompt's blocks from its KV; engine B
  (another process) loads them into other slots and compares every byte on its device with what
  A wrote (regenerated from the same seed there).
- `copy_rate_<size>`: save (G1 -> G2) and load (G2 -> G1) rates of blocks of 256 KiB and 2 MiB and
  of the whole prompt, one block per call and all in one call, beside torch's pinned
  `copy_(non_blocking=True)` (cudaMemcpyAsync) of the same bytes in the same run.
- `kill_mid_load`: an engine process is killed with SIGKILL while a long load runs; a new engine
  on the same device registers, loads and gets the right bytes within a second, and the daemon
  stays healthy.
- `bad_registration`: a registration naming memory that does not exist (a corrupted IPC handle on
  CUDA, a descriptor of the wrong size on CPU) is refused with a clear error, and the daemon
  serves the next engine.
- `injected_copy_failure`: with the daemon's fault file (`inject_faults` `[g1] fail_every`) failing
  every n-th copy between the engine's memory and G2, a save drops those blocks (and says so) and
  serves none of them, a load fails naming why, and with the faults off every byte is right. On
  CPU the engine's shared memory is served as an emulated device's (`[g1] emulate`), so the same
  queued copies are the ones that fail.
- `g3_to_g1`: a prompt of 2 MiB blocks saved through a second daemon, flushed to its G3 as it
  stops, loaded after its restart (G2 empty: every block from G3) into the engine's memory, beside
  an O_DIRECT read of the same number of bytes of the G3 file into pinned memory, each piece copied
  on to the device (goal >= 0.8x).
- `vllm_worker`: the vLLM connector's worker half (`kvcached.vllm.worker.WorkerSide`) driven with
  the calls vLLM's model runner makes (KV cache registration, a step's loads and saves), with the
  KV as vLLM 0.33 allocates and views it on the device; one worker saves blocks, another loads
  them into other blocks and every byte is compared on the device. vLLM itself is used where it
  is installed (the CPU run); on the GPU machine, where it is not, `vllm_stand_in/` provides the
  few names the connector imports (checked against vLLM by `python/tests/test_vllm_stand_in.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

import kvcached
from kvcached.torch_utils import cuda_ipc_region, shared_empty

RESULTS: list[tuple[str, bool, str]] = []


@dataclass(frozen=True)
class Shape:
    """A KV layout for the checks: `layers` x (K, V) segments of `tokens` x `heads` x `dim` bf16."""

    layers: int
    heads: int
    dim: int
    tokens: int

    def layout(self) -> kvcached.KvLayout:
        return kvcached.KvLayout(
            num_layers=self.layers, kv_heads=self.heads, head_dim=self.dim, dtype="bf16", tokens_per_block=self.tokens
        )

    @property
    def segment(self) -> int:
        return self.tokens * self.heads * self.dim * 2

    @property
    def block(self) -> int:
        return 2 * self.layers * self.segment


class Engine:
    """One engine's KV (`slots` blocks of `shape`) on `device`, registered with the daemon."""

    def __init__(
        self, name: str, shape: Shape, slots: int, device: str, model: str = "gpu-check", socket: str | None = None
    ):
        self.shape, self.slots, self.device = shape, slots, device
        layout = shape.layout()
        self.slot_layout = kvcached.SlotLayout.layer_separate(layout, slots)
        size = 2 * shape.layers * slots * shape.segment
        self.client = kvcached.Client(socket, reconnect_for=5.0)
        ns = kvcached.Namespace(model, layout)
        if device == "cuda":
            self.kv = torch.zeros(size, dtype=torch.uint8, device="cuda")
            ipc = cuda_ipc_region(self.kv)
            mem = kvcached.GpuKvMemory(ipc.handle, ipc.device, ipc.size, self._shifted(ipc.storage_offset))
            self.client.register_gpu(name, ns, mem)
        else:
            region = shared_empty(size, name)
            self.kv = region.tensor.view(torch.uint8)
            mem = kvcached.KvMemory.from_fd(region.fd, self.slot_layout)
            region.close()
            self.client.register(name, ns, mem)
        self.memory = mem

    def _shifted(self, offset: int) -> kvcached.SlotLayout:
        """The slot layout with every segment moved by where the tensor starts in its allocation."""
        segs = [(o + offset, s) for o, s in self.slot_layout.segments]
        return kvcached.SlotLayout(segs, self.slot_layout.segment_bytes, self.slots)

    def blocks(self) -> torch.Tensor:
        """The KV as [segments, slots, segment bytes] (layer_separate: segment-major)."""
        return self.kv.view(2 * self.shape.layers, self.slots, self.shape.segment)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def content(shape: Shape, blocks: int, seed: int, device: str) -> torch.Tensor:
    """Deterministic KV for `blocks` blocks ([segments, blocks, segment bytes]), the same on every
    process of the same device kind."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(
        0, 256, (2 * shape.layers, blocks, shape.segment), generator=g, device=device, dtype=torch.uint8
    )


def saved_engine(name: str, shape: Shape, blocks: int, seed: int, device: str) -> tuple[Engine, object, float]:
    """An engine whose `blocks` slots hold `content(seed)`, saved as prompt `seed`; the save's
    result and seconds."""
    e = Engine(name, shape, blocks, device)
    e.blocks().copy_(content(shape, blocks, seed, device))
    e.sync()
    t0 = time.perf_counter()
    saved = e.client.save(prompt(seed, blocks, shape), 0, list(range(blocks)))
    return e, saved, time.perf_counter() - t0


def prompt(seed: int, blocks: int, shape: Shape) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 128_000 for i in range(blocks * shape.tokens)]


def record(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


# -- ipc_two_engines -------------------------------------------------------------------------


def _loader(shape: Shape, blocks: int, seed: int, device: str, q) -> None:
    """Engine B: loads the prompt into slots after A's and compares every byte on its device."""
    try:
        e = Engine("gpu-check-b", shape, 2 * blocks, device)
        tokens = prompt(seed, blocks, shape)
        t0 = time.perf_counter()
        status = e.client.load_now(tokens, 0, list(range(blocks, 2 * blocks)))
        e.sync()
        took = time.perf_counter() - t0
        want = content(shape, blocks, seed, device)
        same = bool(torch.equal(e.blocks()[:, blocks:], want))
        e.client.unregister()
        q.put((status.loaded_blocks, same, took))
    except Exception as ex:  # reported to the parent, which fails the check
        q.put((0, False, f"{type(ex).__name__}: {ex}"))


def check_ipc_two_engines(device: str, tokens: int) -> None:
    shape = Shape(layers=4, heads=8, dim=64, tokens=16)
    blocks = tokens // shape.tokens
    seed = 11
    a, saved, took_save = saved_engine("gpu-check-a", shape, blocks, seed, device)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_loader, args=(shape, blocks, seed, device, q))
    p.start()
    loaded, same, took_load = q.get(timeout=300)
    p.join(30)
    a.client.unregister()
    gib = blocks * shape.block / 2**30
    ok = saved.stored == blocks and loaded == blocks and same
    detail = (
        f"{tokens} tokens, {blocks} blocks of {shape.block >> 10} KiB ({gib:.2f} GiB): saved {saved.stored} "
        f"in {took_save:.2f} s ({gib / took_save:.2f} GiB/s), loaded {loaded} in another process"
    )
    if isinstance(took_load, float):
        detail += f" in {took_load:.2f} s ({gib / took_load:.2f} GiB/s), bytes {'equal' if same else 'DIFFER'}"
    else:
        detail += f": {took_load}"
    record("ipc_two_engines", ok, detail)


# -- copy rates ------------------------------------------------------------------------------


def _baseline(nbytes: int, per_call: int, device: str) -> tuple[float, float]:
    """GiB/s of device -> pinned host and back for `nbytes`, `per_call` bytes per copy, all
    copies queued before one synchronize (cudaMemcpyAsync on the current stream)."""
    if device != "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        for o in range(0, nbytes, per_call):
            dst[o : o + per_call].copy_(src[o : o + per_call])
        r = nbytes / (time.perf_counter() - t0) / 2**30
        return r, r
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = []
    for to_host in (True, False):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for o in range(0, nbytes, per_call):
            if to_host:
                host[o : o + per_call].copy_(dev[o : o + per_call], non_blocking=True)
            else:
                dev[o : o + per_call].copy_(host[o : o + per_call], non_blocking=True)
        torch.cuda.synchronize()
        rates.append(nbytes / (time.perf_counter() - t0) / 2**30)
    return rates[0], rates[1]


def check_copy_rates(device: str, tokens: int) -> None:
    for label, shape in (
        ("256KiB", Shape(layers=4, heads=8, dim=128, tokens=16)),
        ("2MiB", Shape(layers=4, heads=8, dim=128, tokens=128)),
    ):
        blocks = max(8, min(tokens // shape.tokens, (1 << 30) // shape.block))
        e = Engine(f"gpu-check-rate-{label}", shape, 2 * blocks, device, model=f"gpu-check-{label}")
        e.blocks()[:, :blocks].copy_(content(shape, blocks, 3, device))
        e.sync()
        tokens_ = prompt(3, blocks, shape)
        nbytes = blocks * shape.block
        # One block per call, then all blocks in one call (the daemon's own batching).
        t0 = time.perf_counter()
        for b in range(blocks):
            e.client.save(tokens_[: (b + 1) * shape.tokens], b, [b])
        save_one = nbytes / (time.perf_counter() - t0) / 2**30
        t0 = time.perf_counter()
        for b in range(blocks):
            e.client.load_now(tokens_[: (b + 1) * shape.tokens], b, [blocks + b])
        e.sync()
        load_one = nbytes / (time.perf_counter() - t0) / 2**30
        e2 = Engine(f"gpu-check-rate2-{label}", shape, 2 * blocks, device, model=f"gpu-check-{label}-all")
        e2.blocks()[:, :blocks].copy_(e.blocks()[:, :blocks])
        e2.sync()
        t0 = time.perf_counter()
        e2.client.save(tokens_, 0, list(range(blocks)))
        save_all = nbytes / (time.perf_counter() - t0) / 2**30
        t0 = time.perf_counter()
        st = e2.client.load_now(tokens_, 0, list(range(blocks, 2 * blocks)))
        e2.sync()
        load_all = nbytes / (time.perf_counter() - t0) / 2**30
        same = bool(torch.equal(e2.blocks()[:, blocks:], e2.blocks()[:, :blocks])) and st.loaded_blocks == blocks
        same = same and bool(torch.equal(e.blocks()[:, blocks:], e.blocks()[:, :blocks]))
        b_down, b_up = _baseline(shape.block, shape.block, device)
        a_down, a_up = _baseline(nbytes, shape.block, device)
        e.client.unregister()
        e2.client.unregister()
        record(
            f"copy_rate_{label}",
            same,
            f"{blocks} blocks: save {save_one:.2f} GiB/s one per call, {save_all:.2f} all in one "
            f"(memcpy to pinned {b_down:.2f} / {a_down:.2f}: {save_all / a_down:.2f}x); load {load_one:.2f} / "
            f"{load_all:.2f} (memcpy from pinned {b_up:.2f} / {a_up:.2f}: {load_all / a_up:.2f}x)",
        )


# -- kill_mid_load ---------------------------------------------------------------------------


def _victim(shape: Shape, blocks: int, seed: int, device: str, ready) -> None:
    e = Engine("gpu-check-victim", shape, blocks, device)
    e.client.load(prompt(seed, blocks, shape), 0, list(range(blocks)))
    ready.set()
    time.sleep(60)  # killed long before


def check_kill_mid_load(device: str, tokens: int) -> None:
    shape = Shape(layers=4, heads=8, dim=64, tokens=16)
    blocks = tokens // shape.tokens
    seed = 23
    a, _, _ = saved_engine("gpu-check-owner", shape, blocks, seed, device)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_victim, args=(shape, blocks, seed, device, ready))
    p.start()
    ready.wait(120)
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    t0 = time.perf_counter()
    b = Engine("gpu-check-after", shape, blocks, device)
    st = b.client.load_now(prompt(seed, blocks, shape), 0, list(range(blocks)))
    b.sync()
    took = time.perf_counter() - t0
    same = bool(torch.equal(b.blocks(), content(shape, blocks, seed, device)))
    healthy, reasons = b.client.health()
    for e in (a, b):
        e.client.unregister()
    ok = same and st.loaded_blocks == blocks and healthy
    record(
        "kill_mid_load",
        ok,
        f"engine killed (SIGKILL) mid-load of {blocks} blocks; a new engine registered and loaded "
        f"{st.loaded_blocks} in {took:.2f} s, bytes {'equal' if same else 'DIFFER'}, daemon "
        f"{'healthy' if healthy else 'unhealthy: ' + '; '.join(reasons)}",
    )


# -- injected_copy_failure -------------------------------------------------------------------


def _set_faults(text: str) -> None:
    """Writes the daemon's fault file (`inject_faults`, which scripts/gpu-check sets) and waits
    until it has been read (the daemon looks every 50 ms)."""
    path = os.environ["KVCACHED_GPU_CHECK_FAULTS"]
    with open(path + ".new", "w") as f:
        f.write(text)
    os.replace(path + ".new", path)
    time.sleep(0.5)


def check_injected_copy_failure(device: str, tokens: int) -> None:
    if not os.environ.get("KVCACHED_GPU_CHECK_FAULTS"):
        record("injected_copy_failure", False, "no fault file: run through scripts/gpu-check")
        return
    shape = Shape(layers=4, heads=8, dim=64, tokens=16)
    blocks, seed = 64, 31
    # On CPU the engine's shared memory is served as an emulated device's (chosen when it
    # registers), so the same queued copies fail; on CUDA the engine's own GPU memory.
    g1 = "[g1]\n" + ("emulate = true\n" if device == "cpu" else "")
    _set_faults(g1)
    e = Engine("gpu-check-faults", shape, 2 * blocks, device, model="gpu-check-faults")
    want = content(shape, blocks, seed, device)
    e.blocks()[:, :blocks].copy_(want)
    e.sync()
    tokens_ = prompt(seed, blocks, shape)
    slots_b = list(range(blocks, 2 * blocks))

    def load() -> tuple[int, bool]:
        e.blocks()[:, blocks:].fill_(0xA5)
        e.sync()
        st = e.client.load_now(tokens_, 0, slots_b)
        e.sync()
        n = st.loaded_blocks
        return n, bool(torch.equal(e.blocks()[:, blocks : blocks + n], want[:, :n]))

    # A save whose every 7th copy fails: those blocks are dropped, never served.
    _set_faults(g1 + "fail_every = 7\n")
    saved = e.client.save(tokens_, 0, list(range(blocks)))
    _set_faults(g1)
    served, served_right = load()
    save_ok = saved.failed >= 1 and saved.stored + saved.failed == blocks and "GPU memory" in saved.error
    save_ok = save_ok and served < blocks and served_right
    # The dropped blocks saved again; then a load whose every 5th copy fails fails, naming why.
    e.client.save(tokens_, 0, list(range(blocks)))
    _set_faults(g1 + "fail_every = 5\n")
    try:
        e.client.load_now(tokens_, 0, slots_b)
        load_failed, why = False, "the load was reported whole"
    except Exception as ex:
        load_failed, why = "GPU memory" in str(ex), str(ex)[:140]
    _set_faults(g1)
    after, after_right = load()
    e.client.unregister()
    ok = save_ok and load_failed and after == blocks and after_right
    record(
        "injected_copy_failure",
        ok,
        f"save with every 7th copy failing: {saved.stored} stored, {saved.failed} dropped "
        f"({saved.error[:80]!r}), then {served} of {blocks} served, bytes {'equal' if served_right else 'DIFFER'}; "
        f"load with every 5th failing: {'failed' if load_failed else 'NOT failed'} ({why}); faults off: "
        f"{after} loaded, bytes {'equal' if after_right else 'DIFFER'}",
    )


# -- g3_to_g1 --------------------------------------------------------------------------------


class _Daemon:
    """A second kvcached (the binary scripts/gpu-check runs) on its own socket, G2 and G3."""

    def __init__(self, root: str, g2_bytes: int):
        self.root, self.g2_bytes = root, g2_bytes
        self.socket = os.path.join(root, "g3check.sock")
        self.starts = 0
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.starts += 1
        log_path = os.path.join(self.root, f"g3check-{self.starts}.log")
        g2 = os.path.join(self.root, f"g2-{self.starts}")
        os.makedirs(g2, exist_ok=True)
        cmd = [os.environ["KVCACHED_GPU_CHECK_DAEMON"], "--socket", self.socket, "--metrics-addr", "127.0.0.1:0"]
        cmd += ["--g2-capacity-bytes", str(self.g2_bytes), "--g2-shm-dir", g2]
        cmd += ["--g3-dir", os.path.join(self.root, "g3")]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        deadline = time.time() + 60
        while "kvcached serving" not in open(log_path, errors="replace").read():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the second kvcached did not start: {open(log_path).read()[-600:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM: the daemon drains and flushes its write-through to G3 before it exits."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(180)
            self.proc = None


def _raw_read_rate(path: str, nbytes: int, device: str) -> tuple[float, str]:
    """GiB/s of reading `nbytes` of `path` with O_DIRECT in 8 MiB pieces into two page-aligned
    host buffers (pinned on CUDA), each piece copied on to the device while the next is read."""
    chunk = 8 << 20
    nbytes = min(nbytes, os.path.getsize(path)) // 4096 * 4096
    how = "O_DIRECT"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd, how = os.open(path, os.O_RDONLY), "buffered, cache dropped (O_DIRECT refused here)"
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    if device == "cuda":
        bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        views = [memoryview(b.numpy()) for b in bufs]
    else:
        maps = [mmap.mmap(-1, chunk) for _ in range(2)]
        views = [memoryview(m) for m in maps]
        bufs = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    done = [None, None]
    try:
        t0 = time.perf_counter()
        off, i = 0, 0
        while off < nbytes:
            k = i % 2
            if done[k] is not None:
                done[k].synchronize()
            n = os.preadv(fd, [views[k][: min(chunk, nbytes - off)]], off)
            if n <= 0:
                break
            dst[off : off + n].copy_(bufs[k][:n], non_blocking=True)
            if device == "cuda":
                done[k] = torch.cuda.Event()
                done[k].record()
            off, i = off + n, i + 1
        if device == "cuda":
            torch.cuda.synchronize()
        return off / (time.perf_counter() - t0) / 2**30, how
    finally:
        os.close(fd)


def check_g3_to_g1(device: str, tokens: int) -> None:
    if not os.environ.get("KVCACHED_GPU_CHECK_DAEMON"):
        record("g3_to_g1", False, "no daemon binary named: run through scripts/gpu-check")
        return
    shape = Shape(layers=4, heads=8, dim=128, tokens=128)  # 2 MiB blocks
    blocks, seed = max(8, tokens // shape.tokens), 41
    nbytes = blocks * shape.block
    root = tempfile.mkdtemp(prefix="g3check-", dir=os.environ.get("KVCACHED_GPU_CHECK_TMP"))
    d = _Daemon(root, max(2 * nbytes, 256 << 20))
    try:
        # Saved through one daemon life, flushed to G3 at its stop; the next life's G2 is empty.
        d.start()
        a = Engine("gpu-check-g3-a", shape, blocks, device, model="gpu-check-g3", socket=d.socket)
        want = content(shape, blocks, seed, device)
        a.blocks().copy_(want)
        a.sync()
        saved = a.client.save(prompt(seed, blocks, shape), 0, list(range(blocks)))
        a.client.unregister()
        d.stop()
        d.start()
        b = Engine("gpu-check-g3-b", shape, blocks, device, model="gpu-check-g3", socket=d.socket)
        b.blocks().fill_(0xA5)
        b.sync()
        t0 = time.perf_counter()
        st = b.client.load_now(prompt(seed, blocks, shape), 0, list(range(blocks)))
        b.sync()
        took = time.perf_counter() - t0
        same = bool(torch.equal(b.blocks(), want))
        b.client.unregister()
        d.stop()
        data = max(
            (os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(root, "g3")) for f in fs), key=os.path.getsize
        )
        raw, how = _raw_read_rate(data, nbytes, device)
        rate = nbytes / took / 2**30
        ok = saved.stored == blocks and st.loaded_blocks == blocks and st.from_g3 == blocks and same
        record(
            "g3_to_g1",
            ok,
            f"{blocks} blocks of {shape.block >> 20} MiB ({nbytes / 2**30:.2f} GiB) only in G3: loaded "
            f"{st.loaded_blocks} ({st.from_g3} from G3) in {took:.2f} s, {rate:.2f} GiB/s, bytes "
            f"{'equal' if same else 'DIFFER'}; raw read ({how}) + {'pinned copy' if device == 'cuda' else 'copy'} "
            f"of the G3 file: {raw:.2f} GiB/s ({rate / raw:.2f}x, goal >= 0.8x)",
        )
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


# -- vllm_worker -----------------------------------------------------------------------------

VLLM_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def _vllm():
    """vLLM where it is installed (the CPU run), else the stand-in of its names the connector's
    worker half uses (`vllm_stand_in/`, the GPU machine)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_stand_in"))
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec


def vllm_configs(layout: str, blocks: int) -> tuple[object, object]:
    """vLLM's configuration as the worker half reads it, for a plain full-attention model of 4
    layers of 8 KV heads of 128 bf16 elements, 16 tokens per block, its KV in `layout`:
    (vllm_config, kv_cache_config). `python/tests/test_vllm_stand_in.py` derives the namespace
    from these with vLLM and with the stand-in."""
    from types import SimpleNamespace

    spec = _vllm()(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    parallel = SimpleNamespace(
        pipeline_parallel_size=1,
        tensor_parallel_size=1,
        decode_context_parallel_size=1,
        prefill_context_parallel_size=1,
    )
    vllm_config = SimpleNamespace(
        parallel_config=parallel,
        model_config=SimpleNamespace(model="gpu-check/vllm-worker", revision=None),
        cache_config=SimpleNamespace(kv_cache_layout=layout, cache_dtype="auto"),
        device_config=SimpleNamespace(device_type="cpu" if layout == "LBHNC" else "cuda"),
    )
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=VLLM_LAYERS)
    return vllm_config, SimpleNamespace(num_blocks=blocks, kv_cache_groups=[group], kv_cache_layout=layout)


def _vllm_worker(engine_id: str, device: str, blocks: int):
    """The connector's worker half as vLLM 0.33's model runner makes and feeds it
    ([`vllm_configs`]): its KV cache one int8 allocation viewed per layer in vLLM's layout for
    the device (LBNHC on CUDA, LBHNC on CPU), registered with the daemon. Returns the worker and
    the layer views ([blocks, heads, tokens, K|V])."""
    from types import SimpleNamespace

    from kvcached.vllm.config import ConnectorConfig
    from kvcached.vllm.worker import WorkerSide

    layout = "LBNHC" if device == "cuda" else "LBHNC"
    vllm_config, kv_cache_config = vllm_configs(layout, blocks)
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    cfg = ConnectorConfig.from_extra({"kvcached.namespace_extra": "gpu-check"})
    w = WorkerSide(vllm_config, kv_cache_config, cfg, SimpleNamespace(engine_id=engine_id))
    page = spec.real_page_size_bytes
    # vLLM's allocate_kv_cache: one int8 tensor for every layer (on CPU inside the connector's
    # memory-pool context, which puts it in shared memory), then a view per layer.
    with w.mem_pool_context() or contextlib.nullcontext():
        buf = torch.zeros(len(VLLM_LAYERS) * blocks * page, dtype=torch.int8, device=device)
    heads, tokens, content = spec.num_kv_heads, spec.block_size, 2 * spec.head_size
    views = {}
    for i, name in enumerate(VLLM_LAYERS):
        raw = buf[i * blocks * page : (i + 1) * blocks * page].view(torch.bfloat16)
        if layout == "LBNHC":
            views[name] = raw.view(blocks, tokens, heads, content).permute(0, 2, 1, 3)
        else:
            views[name] = raw.view(blocks, heads, tokens, content)
    w.register_kv_caches(views)
    return w, views


def _vllm_step(w, meta) -> set[int]:
    """One step of vLLM's model runner with the connector's worker: loads started before the
    forward pass and waited for at each layer, saves taken after it; the blocks that failed."""
    w.start_load_kv(meta)
    for name in VLLM_LAYERS:
        w.wait_for_layer_load(name)
        w.save_kv_layer(name)
    w.wait_for_save(meta)
    return w.take_invalid_blocks()


def check_vllm_worker(device: str, tokens: int) -> None:
    from array import array

    slots = 256
    a, kv_a = _vllm_worker("gpu-check-vllm-a", device, slots)
    from kvcached.vllm.meta import KvcachedConnectorMetadata, Transfer

    n = 64
    src, dst = list(range(0, 2 * n, 2)), list(range(2 * n, 3 * n))
    g = torch.Generator(device=device).manual_seed(51)
    for name in VLLM_LAYERS:
        v = kv_a[name]
        v[src] = torch.randn(v[src].shape, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    toks = array("I", [(7919 * i) % 50_000 for i in range((n + 1) * 16)])
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    bad_save = _vllm_step(a, KvcachedConnectorMetadata(saves=[Transfer("r", toks[: n * 16], 0, src)]))
    took_save = time.perf_counter() - t0
    b, kv_b = _vllm_worker("gpu-check-vllm-b", device, slots)
    t0 = time.perf_counter()
    # One block more than was saved: the load stops there and names it.
    invalid = _vllm_step(b, KvcachedConnectorMetadata(loads=[Transfer("r", toks, 0, dst + [3 * n])]))
    if device == "cuda":
        torch.cuda.synchronize()
    took_load = time.perf_counter() - t0
    same = all(bool(torch.equal(kv_b[name][dst], kv_a[name][src])) for name in VLLM_LAYERS)
    counts = dict(a.counts), dict(b.counts)
    a.shutdown()
    b.shutdown()
    ok = not bad_save and counts[0]["saved"] == n and counts[1]["loaded"] == n and invalid == {3 * n} and same
    record(
        "vllm_worker",
        ok,
        f"the connector's worker on {device} KV in vLLM's {'LBNHC' if device == 'cuda' else 'LBHNC'} layout "
        f"({'vLLM stand-in' if 'vllm_stand_in' in sys.modules['vllm'].__file__ else 'vLLM'}): {n} blocks saved in "
        f"{took_save * 1e3:.0f} ms, loaded by another worker in {took_load * 1e3:.0f} ms, bytes "
        f"{'equal' if same else 'DIFFER'}, the unsaved block reported {sorted(invalid)}",
    )


# -- bad_registration ------------------------------------------------------------------------


def check_bad_registration(device: str, tokens: int) -> None:
    shape = Shape(layers=2, heads=2, dim=64, tokens=16)
    layout = shape.layout()
    c = kvcached.Client(reconnect_for=2.0)
    ns = kvcached.Namespace("gpu-check-bad", layout)
    try:
        if device == "cuda":
            mem = kvcached.GpuKvMemory(bytes(64), 0, 1 << 20, kvcached.SlotLayout.layer_separate(layout, 4))
            c.register_gpu("gpu-check-bad", ns, mem)
        else:
            region = shared_empty(4096, "gpu-check-bad")  # far smaller than its slots claim
            mem = kvcached.KvMemory.from_fd(region.fd, kvcached.SlotLayout.layer_separate(layout, 64))
            c.register("gpu-check-bad", ns, mem)
        refused, why = False, "registered"
    except (kvcached.KvcachedError, ValueError) as ex:
        refused, why = True, f"{type(ex).__name__}: {str(ex)[:160]}"
    e = Engine("gpu-check-next", shape, 4, device)
    e.blocks().copy_(content(shape, 4, 5, device))
    e.sync()
    ok_next = e.client.save(prompt(5, 4, shape), 0, [0, 1, 2, 3]).stored == 4
    e.client.unregister()
    record("bad_registration", refused and ok_next, f"refused ({why}); the next engine served: {ok_next}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tokens", type=int, default=131072, help="prompt length of the long-prompt checks")
    ap.add_argument("--only", nargs="*", help="run only these checks")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: torch.cuda.is_available() is False")
        return 0
    checks = {
        "ipc_two_engines": check_ipc_two_engines,
        "copy_rates": check_copy_rates,
        "kill_mid_load": check_kill_mid_load,
        "bad_registration": check_bad_registration,
        "injected_copy_failure": check_injected_copy_failure,
        "g3_to_g1": check_g3_to_g1,
        "vllm_worker": check_vllm_worker,
    }
    for name, f in checks.items():
        if args.only and name not in args.only:
            continue
        try:
            f(args.device, args.tokens)
        except Exception as ex:
            record(name, False, f"{type(ex).__name__}: {ex}")
    print()
    print(f"| check ({args.device}) | result | figures |")
    print("|---|---|---|")
    for name, ok, detail in RESULTS:
        print(f"| {name} | {'pass' if ok else 'FAIL'} | {detail} |")
    print()
    return 0 if all(ok for _, ok, _ in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
