"""The package's API against a real daemon: values, zero-copy views, byte-exact round trips
between two engines, loads, errors mapped to exceptions, the GIL released during calls,
reconnection after a daemon restart."""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest

import kvcached

TPB = 16
LAYOUT = kvcached.KvLayout(num_layers=2, kv_heads=2, head_dim=64, dtype="bf16", tokens_per_block=TPB)


def prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(blocks * TPB)]


_registered: list[kvcached.Client] = []


@pytest.fixture(autouse=True)
def _unregister():
    """Engines registered by a test are unregistered after it (the daemon limits engines per
    uid; a dropped client's would linger until its lease ran out)."""
    yield
    while _registered:
        c = _registered.pop()
        if c.engine_id is not None:
            try:
                c.unregister()
            except kvcached.KvcachedError:
                pass  # the test stopped its daemon


def engine(daemon, name: str, model: str, slots: int = 32):
    mem = kvcached.KvMemory.anonymous(LAYOUT, slots)
    c = kvcached.Client(daemon.socket)
    c.register(name, kvcached.Namespace(model, LAYOUT), mem)
    _registered.append(c)
    return c, mem


def fill_random(mem: kvcached.KvMemory, slots: range) -> dict[int, bytes]:
    """Writes random bytes into slots through a NumPy view (as an engine's kernels would)."""
    view = mem.numpy()
    out = {}
    for s in slots:
        data = os.urandom(mem.block_bytes)
        at = 0
        for off, n in mem.block_ranges(s):
            view[off : off + n] = np.frombuffer(data[at : at + n], dtype=np.uint8)
            at += n
        out[s] = data
    return out


def test_layout_and_namespace_values():
    assert LAYOUT.segment_bytes == TPB * 2 * 64 * 2
    assert LAYOUT.block_bytes == 2 * 2 * LAYOUT.segment_bytes
    assert (LAYOUT.dtype, LAYOUT.kind) == ("bf16", "layer_separate")
    assert kvcached.KvLayout(2, 2, 64, dtype="bfloat16") == LAYOUT
    with pytest.raises(ValueError, match="num_layers"):
        kvcached.KvLayout(0, 2, 64)
    with pytest.raises(ValueError, match="dtype"):
        kvcached.KvLayout(2, 2, 64, dtype="bf17")
    a = kvcached.Namespace("m", LAYOUT)
    salted = kvcached.Namespace("m", LAYOUT, tenant_salt=b"secret-salt")
    assert a.id == kvcached.Namespace("m", LAYOUT).id and a.id != salted.id
    assert "secret-salt" not in repr(salted) and "<secret>" in repr(salted)
    keys = a.block_keys(prompt(1, 3) + [1, 2, 3])  # the partial block has no key
    assert len(keys) == 3 and all(len(k) == 16 for k in keys)
    assert a.block_keys(prompt(1, 3))[:2] == a.block_keys(prompt(1, 2))
    assert salted.block_keys(prompt(1, 3)) != keys


def test_slot_layout_checks_like_the_daemon():
    s = kvcached.SlotLayout.layer_separate(LAYOUT, 8)
    assert len(s.segments) == 4 and s.extent == 8 * LAYOUT.block_bytes
    s.check(LAYOUT, s.extent)
    with pytest.raises(ValueError, match="ends past"):
        s.check(LAYOUT, s.extent - 1)
    seg = LAYOUT.segment_bytes
    aliasing = kvcached.SlotLayout([(0, seg), (0, seg), (2 * seg, seg), (3 * seg, seg)], seg, 8)
    with pytest.raises(ValueError, match="overlap"):
        aliasing.check(LAYOUT, 1 << 20)
    assert s.ranges(1) == [(o + seg, seg) for o, _ in s.segments]


def test_views_share_the_memory_without_copying():
    torch = pytest.importorskip("torch")

    mem = kvcached.KvMemory.anonymous(LAYOUT, 4)
    arr = mem.numpy()
    t = mem.torch("uint8")
    bf = mem.torch(torch.bfloat16)
    assert arr.size == t.numel() == mem.size == len(mem) and bf.numel() == mem.size // 2
    arr[10] = 77
    assert t[10].item() == 77 and memoryview(mem)[10] == 77
    t[11] = 78
    assert arr[11] == 78
    data = os.urandom(mem.block_bytes)
    mem.write_block(3, data)
    assert mem.read_block(3) == data
    first_off, n = mem.block_ranges(3)[0]
    assert arr[first_off : first_off + n].tobytes() == data[:n]
    # A view keeps the mapping alive after the KvMemory object itself is gone.
    del mem
    gc.collect()
    assert arr[first_off : first_off + n].tobytes() == data[:n]
    with pytest.raises(ValueError, match="block is"):
        kvcached.KvMemory.anonymous(LAYOUT, 1).write_block(0, b"short")
    with pytest.raises(IndexError):
        kvcached.KvMemory.anonymous(LAYOUT, 1).read_block(1)
    # CUDA tensors are registered by IPC handle; without a CUDA device that is a clear error.
    from kvcached.torch_utils import cuda_ipc_region

    if not torch.cuda.is_available():
        with pytest.raises(kvcached.NoCudaDeviceError, match="no CUDA device"):
            cuda_ipc_region(torch.zeros(4))


def test_memory_the_engine_already_has(daemon):
    """KvMemory.from_fd: the engine's own memfd, mapped by Python too; the daemon loads into it."""
    import mmap

    slots = kvcached.SlotLayout.layer_separate(LAYOUT, 4)
    fd = os.memfd_create("engine-kv")
    os.ftruncate(fd, slots.extent + 4096)  # larger than the slots need: fine
    own = mmap.mmap(fd, slots.extent + 4096)
    mem = kvcached.KvMemory.from_fd(fd, slots)
    assert mem.fd != fd and mem.size == slots.extent + 4096
    os.close(fd)  # the KvMemory keeps its own descriptor
    with pytest.raises(OSError):
        kvcached.KvMemory.from_fd(fd, slots)
    with pytest.raises(ValueError, match="reach byte"):
        small = os.memfd_create("small")
        os.ftruncate(small, 100)
        try:
            kvcached.KvMemory.from_fd(small, slots)
        finally:
            os.close(small)
    a, mem_a = engine(daemon, "py-fd-a", "from-fd")
    tokens = prompt(9, 2)
    written = fill_random(mem_a, range(2))
    a.save(tokens, 0, [0, 1])
    c = kvcached.Client(daemon.socket)
    c.register("py-fd-b", kvcached.Namespace("from-fd", LAYOUT), mem)
    _registered.append(c)
    assert c.load_now(tokens, 0, [2, 3]).loaded_blocks == 2
    for i, s in enumerate((2, 3)):
        got = b"".join(own[off : off + n] for off, n in slots.ranges(s))
        assert got == written[i]


def test_two_engines_round_trip_bytes_exactly(daemon):
    a, mem_a = engine(daemon, "py-prefill", "round-trip")
    b, mem_b = engine(daemon, "py-decode", "round-trip")
    tokens = prompt(1, 8)
    written = fill_random(mem_a, range(8))
    saved = a.save(tokens, 0, list(range(8)))
    assert (saved.stored, saved.failed) == (8, 0), saved
    assert a.save(tokens, 0, list(range(8))).already_present == 8

    hit = b.lookup(tokens + [1, 2, 3])
    assert (hit.matched_blocks, hit.matched_tokens, hit.g2_blocks) == (8, 8 * TPB, 8)
    other = tokens[: 5 * TPB] + [t + 1 for t in tokens[5 * TPB :]]
    assert b.lookup(other).matched_blocks == 5
    assert b.lookup(np.array(tokens, dtype=np.uint32)).matched_blocks == 8

    status = b.load_now(tokens, 0, list(range(20, 28)))
    assert (status.state, status.loaded_blocks, status.from_g2) == ("done", 8, 8)
    for i in range(8):
        assert mem_b.read_block(20 + i) == written[i], f"block {i}"
    # Blocks 2..5 alone, into other slots (a load names its first block).
    assert b.load_now(tokens, 2, [10, 11, 12]).loaded_blocks == 3
    assert [mem_b.read_block(s) for s in (10, 11, 12)] == [written[2], written[3], written[4]]


def test_key_contexts_keep_requests_apart(daemon):
    a, mem_a = engine(daemon, "py-ctx-a", "ctx")
    b, mem_b = engine(daemon, "py-ctx-b", "ctx")
    tokens = prompt(5, 6)
    lora = kvcached.KeyContext(adapter_name="sql", adapter_hash=b"\x01" * 32)
    image = kvcached.KeyContext(mm=[(b"cat", 40, 30)])  # blocks 2, 3, 4
    ns = kvcached.Namespace("ctx", LAYOUT)
    assert kvcached.KeyContext().is_empty and kvcached.KeyContext().block_keys(ns, tokens) == ns.block_keys(tokens)
    assert lora.block_keys(ns, tokens)[0] != ns.block_keys(tokens)[0]
    assert image.block_keys(ns, tokens)[:2] == ns.block_keys(tokens)[:2]
    assert "secret" in repr(kvcached.KeyContext(cache_salt=b"hunter2")) and "hunter2" not in repr(
        kvcached.KeyContext(cache_salt=b"hunter2")
    )
    written = fill_random(mem_a, range(6))
    assert a.save(tokens, 0, list(range(6)), context=lora).stored == 6
    assert b.lookup(tokens, context=lora).matched_blocks == 6
    assert b.lookup(tokens).matched_blocks == 0
    assert b.lookup(tokens, context=kvcached.KeyContext(cache_salt=b"t")).matched_blocks == 0
    status = b.load_now(tokens, 0, list(range(10, 16)), context=lora)
    assert status.loaded_blocks == 6 and [mem_b.read_block(10 + i) for i in range(6)] == [written[i] for i in range(6)]
    op = b.load(tokens, 0, [20], context=lora)
    assert b.wait(op).loaded_blocks == 1
    a.save(tokens, 0, list(range(6)), context=image)
    assert b.lookup(tokens).matched_blocks == 2  # the text before the image
    for bad in (
        dict(mm=[(b"a", 0, 20), (b"b", 10, 5)]),  # overlapping inputs
        dict(cache_salt=b""),
        dict(adapter_hash=b"x"),  # a hash without a name
        dict(block_extras=[(1, b"x" * 65)]),
    ):
        with pytest.raises(ValueError):
            kvcached.KeyContext(**bad)


def test_a_decode_node_pulls_from_the_prefill_nodes_daemon(peer_pair):
    a, b = peer_pair
    prefill, mem_a = engine(a, "py-prefill", "handoff")
    decode, mem_b = engine(b, "py-decode", "handoff")
    tokens = prompt(7, 8)
    written = fill_random(mem_a, range(8))
    assert prefill.save(tokens, 0, list(range(8))).stored == 8
    assert decode.lookup(tokens).matched_blocks == 0
    status = decode.load_from(tokens, 0, list(range(8, 16)), [a.peer])
    assert (status.loaded_blocks, status.from_peer) == (8, 8), status
    for i in range(8):
        assert mem_b.read_block(8 + i) == written[i], f"block {i}"
    # The same as a load that returns at once: wait(blocks=4) answers once the first 4 are in
    # the slots (possibly while later ones still arrive), wait() when all are.
    tokens2 = prompt(8, 8)
    written2 = fill_random(mem_a, range(8, 16))
    assert prefill.save(tokens2, 0, list(range(8, 16))).stored == 8
    op = decode.load(tokens2, 0, list(range(16, 24)), sources=[a.peer])
    early = decode.wait(op, timeout=30, blocks=4)
    assert early.loaded_blocks >= 4, early
    for i in range(4):
        assert mem_b.read_block(16 + i) == written2[8 + i], f"block {i}"
    done = decode.wait(op)
    assert (done.state, done.loaded_blocks, done.from_peer) == ("done", 8, 8), done
    # The rate an engine reports reaches its daemon (no error; routers read it from reports).
    decode.report_load_and_prefill(0, 0, 0, 32, 4096, 0.05)


def test_async_load_wait_poll_and_first_miss(daemon):
    a, mem_a = engine(daemon, "py-async-a", "async")
    b, mem_b = engine(daemon, "py-async-b", "async")
    tokens = prompt(2, 10)
    written = fill_random(mem_a, range(6))
    a.save(tokens, 0, list(range(6)))  # blocks 6..9 never saved
    op = b.load(tokens, 0, list(range(10, 20)))
    assert isinstance(op.id, int)
    done = b.wait(op, timeout=10)
    assert done.finished and done.state == "done" and done.loaded_blocks == 6, done
    assert b.poll(op).loaded_blocks == 6
    assert all(mem_b.read_block(10 + i) == written[i] for i in range(6))


def test_errors_are_typed(daemon):
    c = kvcached.Client(daemon.socket)
    with pytest.raises(kvcached.NotRegisteredError):
        c.lookup([1, 2, 3])
    with pytest.raises(kvcached.UnreachableError, match="cannot reach"):
        kvcached.Client(daemon.socket + ".nobody", reconnect_for=0.1)
    ns = kvcached.Namespace("errors", LAYOUT)
    # Slots that do not match the layout (3 segments for a 2-layer layer-separate layout).
    seg = LAYOUT.segment_bytes
    wrong = kvcached.KvMemory.with_slots(kvcached.SlotLayout([(0, seg), (8 * seg, seg), (16 * seg, seg)], seg, 8))
    with pytest.raises(kvcached.InvalidArgumentError, match="needs 4 segments") as e:
        c.register("py-wrong", ns, wrong)
    assert e.value.code == "INVALID_ARGUMENT" and e.value.reason is None and "segments" in e.value.message
    c.register("py-errors", ns, kvcached.KvMemory.anonymous(LAYOUT, 4))
    with pytest.raises(kvcached.InvalidArgumentError):
        c.save(prompt(3, 2), 0, [0, 99])  # slot 99 of 4
    with pytest.raises(TypeError, match="not text"):
        c.lookup("hello")
    with pytest.raises(OverflowError):
        c.lookup([-1])
    # CUDA memory on a node without a CUDA device.
    gpu = kvcached.GpuKvMemory.layer_separate(bytes(64), 0, LAYOUT, 8)
    with pytest.raises(kvcached.NoCudaDeviceError, match="no CUDA device") as e:
        kvcached.Client(daemon.socket).register_gpu("py-gpu", ns, gpu)
    assert isinstance(e.value, kvcached.AttachRefusedError) and e.value.code == "FAILED_PRECONDITION"
    with pytest.raises(ValueError, match="64 bytes"):
        kvcached.GpuKvMemory.layer_separate(b"short", 0, LAYOUT, 8)
    c.unregister()
    with pytest.raises(kvcached.NotRegisteredError):
        c.lookup([1])


def test_stats_health_and_context_manager(daemon):
    with kvcached.Client(daemon.socket) as c:
        c.register("py-stats", kvcached.Namespace("stats", LAYOUT), kvcached.KvMemory.anonymous(LAYOUT, 2))
        ok, reasons = c.health()
        assert ok, reasons
        s = c.stats()
        assert s["engines"] >= 1 and "g2" in s["tiers"] and s["tiers"]["g2"]["capacity_bytes"] == 64 << 20
    assert c.engine_id is None  # unregistered on leaving the block


def test_threads_share_one_client(daemon):
    a, mem_a = engine(daemon, "py-threads-a", "threads", slots=64)
    written = fill_random(mem_a, range(8))
    prompts = [prompt(100 + i, 2) for i in range(4)]
    for i, p in enumerate(prompts):
        a.save(p, 0, [2 * i, 2 * i + 1])
    b, mem_b = engine(daemon, "py-threads-b", "threads", slots=64)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(20):
                assert b.lookup(prompts[i]).matched_blocks == 2
                assert b.load_now(prompts[i], 0, [32 + 2 * i, 33 + 2 * i]).loaded_blocks == 2
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(4):
        assert mem_b.read_block(32 + 2 * i) == written[2 * i]


def test_calls_release_the_gil(own_daemon):
    """A call that waits (here: retrying for a killed daemon for `reconnect_for` seconds) lets
    other Python threads run meanwhile; its failure is an UnreachableError."""
    c = kvcached.Client(own_daemon.socket, reconnect_for=1.0)
    c.register("py-gil", kvcached.Namespace("gil", LAYOUT), kvcached.KvMemory.anonymous(LAYOUT, 2))
    own_daemon.kill()
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    t = threading.Thread(target=count, daemon=True)
    t.start()
    start = time.monotonic()
    try:
        c.lookup(prompt(4, 1))
        raised: BaseException | None = None
    except kvcached.KvcachedError as e:
        raised = e
    finally:
        waited = time.monotonic() - start
        stop.set()
        t.join()
    assert isinstance(raised, kvcached.UnreachableError), repr(raised)
    assert waited >= 0.5, waited
    # Held GIL: the counter would not advance at all during the call.
    assert ticks > 100 * waited, (ticks, waited)


def test_restart_reregisters_and_blocks_come_back_from_g3(own_daemon):
    a, mem_a = engine(own_daemon, "py-restart", "restart")
    tokens = prompt(5, 4)
    written = fill_random(mem_a, range(4))
    a.save(tokens, 0, [0, 1, 2, 3])
    first_id = a.engine_id
    own_daemon.stop()  # drains write-through into G3
    own_daemon.start()
    hit = a.lookup(tokens)  # reconnects, hands the memory over again, registers again
    assert a.engine_id != first_id
    assert (hit.matched_blocks, hit.g3_blocks) == (4, 4), hit
    status = a.load_now(tokens, 0, [10, 11, 12, 13])
    assert (status.loaded_blocks, status.from_g3) == (4, 4)
    assert [mem_a.read_block(10 + i) for i in range(4)] == [written[i] for i in range(4)]


def test_a_client_is_not_used_across_fork(daemon):
    c, _ = engine(daemon, "py-fork", "fork")
    pid = os.fork()
    if pid == 0:
        try:
            c.lookup([1, 2, 3])
            os._exit(1)
        except kvcached.KvcachedError as e:
            os._exit(0 if "fork" in str(e) else 2)
        except BaseException:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert c.lookup([1] * TPB).matched_blocks == 0  # the parent's client still works
