"""A real kvcached daemon for the tests, started as a process on a socket in a temp directory
(as tests/daemon_e2e.rs does), with a small G2 pool and a G3 directory of its own.

The binary is $KVCACHED_BIN, else the debug (then release) build under $CARGO_TARGET_DIR
(default ~/.cache/kvcached/target): scripts/test builds it before running these tests.
"""

from __future__ import annotations

import contextlib

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def kvcached_bin() -> str:
    if b := os.environ.get("KVCACHED_BIN"):
        return b
    target = Path(os.environ.get("CARGO_TARGET_DIR", Path.home() / ".cache/kvcached/target"))
    for p in (target / "debug/kvcached", target / "release/kvcached"):
        if p.is_file():
            return str(p)
    pytest.exit("no kvcached binary: run `cargo build -p kvcached` or set KVCACHED_BIN", 2)


class Daemon:
    """A kvcached process; `stop`, `kill` and `start` again on the same socket and G3."""

    def __init__(self, root: Path, g2_bytes: int = 64 << 20, extra: list[str] | None = None):
        self.root = root
        self.extra = extra or []
        self.socket = str(root / "kvcached.sock")
        self.g2_bytes = g2_bytes
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "daemon.log"

    def start(self) -> None:
        args = [
            kvcached_bin(),
            "--socket", self.socket,
            "--metrics-addr", "127.0.0.1:0",
            "--g2-capacity-bytes", str(self.g2_bytes),
            "--g2-shm-dir", str(self.root),
            "--g3-dir", str(self.root / "g3"),
            "--g3-capacity-bytes", str(128 << 20),
            "--g3-fsync", "false",
            "--engine-lease-ms", "5000",
            *self.extra,
        ]  # fmt: skip
        log = open(self.log, "ab")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        deadline = time.monotonic() + 30
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvcached exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvcached did not start:\n{self.log.read_text()}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        # A killed daemon leaves its socket file: the next start binds anew.
        Path(self.socket).unlink(missing_ok=True)


@contextlib.contextmanager
def configured_daemon(tmp_path: Path, toml: str):
    """A kvcached process with `toml` as its configuration file, stopped after the block."""
    config = tmp_path / "kvcached.toml"
    config.write_text(toml)
    root = tmp_path / "daemon"
    root.mkdir()
    d = Daemon(root, extra=["--config", str(config)])
    d.start()
    try:
        yield d
    finally:
        d.stop()


def _daemon(prefix: str):
    root = Path(tempfile.mkdtemp(prefix=prefix))
    d = Daemon(root)
    d.start()
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def daemon():
    """One daemon for the session: tests keep apart by model id (namespace)."""
    yield from _daemon("kvcached-py-")


@pytest.fixture
def own_daemon():
    """A daemon of the test's own, which it may stop, kill and start again."""
    yield from _daemon("kvcached-py-own-")


@pytest.fixture
def peer_pair():
    """Two daemons: the first serves its blocks on a loopback peer channel (its address is
    `.peer`), the second pulls from it."""
    import socket as so

    with so.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    roots = [Path(tempfile.mkdtemp(prefix=f"kvcached-py-peer{i}-")) for i in range(2)]
    # A single-user test node: its peer channel opened explicitly (a peer channel without
    # credentials does not start otherwise, loopback included).
    open_peer = roots[0] / "open-peer.toml"
    open_peer.write_text("[peer.auth]\nopen = true\n")
    a = Daemon(roots[0], extra=["--config", str(open_peer), "--peer-listen", f"127.0.0.1:{port}"])
    a.peer = f"127.0.0.1:{port}"
    # The second dials only sources it allows (peer.allowed_sources).
    b = Daemon(roots[1], extra=["--peer-allowed-sources", a.peer])
    a.start()
    b.start()
    try:
        yield a, b
    finally:
        for d in (a, b):
            d.stop()
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)


@pytest.fixture(scope="session")
def model_dir():
    """A model directory holding only a tiny Llama config.json (vllm_harness.py)."""
    from vllm_harness import tiny_model_dir

    d = tiny_model_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _engines(build, model_dir):
    """Engines `build(*args, model_dir=model_dir, **kw)` makes, closed after the test."""
    made = []

    def make(*args, **kw):
        e = build(*args, model_dir=model_dir, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.fixture
def make_engine(model_dir):
    """`make_engine(socket, role, extra, **kw)`: a vllm_harness.Engine, closed after the test."""
    from vllm_harness import engine

    yield from _engines(engine, model_dir)


@pytest.fixture
def make_dcp_engine(model_dir):
    """`make_dcp_engine(socket, ..., dcp=, interleave=)`: a vllm_harness.DcpEngine, closed after
    the test."""
    from vllm_harness import dcp_engine

    yield from _engines(dcp_engine, model_dir)


@pytest.fixture
def make_pcp_engine(model_dir):
    """`make_pcp_engine(socket, ..., pcp=)`: a vllm_harness.PcpEngine, closed after the test."""
    from vllm_harness import pcp_engine

    yield from _engines(pcp_engine, model_dir)


@pytest.fixture
def make_pp_engine(model_dir):
    """`make_pp_engine(socket, role, extra, **kw)`: a vllm_harness.Engine of two pipeline
    stages, closed after the test."""
    from vllm_harness import pp_engine

    yield from _engines(pp_engine, model_dir)
