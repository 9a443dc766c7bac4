"""An engine written against the stock Python gRPC client (grpcio), with stubs generated from
proto/kvcached.proto: no channel options, descriptors handed over with socket.send_fds (ATTACH),
then register, save, lookup, load and a byte-exact check. Usage: grpcio_engine.py SOCKET STUBS_DIR.
Prints "ok <matched blocks>" and exits 0 when everything checked out."""

import mmap
import os
import socket
import sys

SOCKET, STUBS = sys.argv[1], sys.argv[2]
sys.path.insert(0, STUBS)

import grpc  # noqa: E402
import kvcached_pb2 as pb  # noqa: E402
import kvcached_pb2_grpc as rpc  # noqa: E402


def recv_exact(s, n):
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise RuntimeError("the daemon closed the ATTACH connection")
        out += chunk
    return out


def attach(fds):
    """ATTACH: hands `fds` to the daemon and returns one 16-byte ticket per descriptor."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(SOCKET)
        socket.send_fds(s, [b"KVFD\x01" + bytes([len(fds)]) + b"\x00\x00"], fds)
        head = recv_exact(s, 8)
        if head[:5] != b"KVFD\x01":
            raise RuntimeError(f"not an ATTACH reply: {head!r}")
        if head[5] != 0:
            why = recv_exact(s, int.from_bytes(head[6:8], "little"))
            raise RuntimeError(f"ATTACH refused: {why.decode()}")
        return [recv_exact(s, 16) for _ in fds]


LAYERS, HEADS, HEAD_DIM, TOKENS_PER_BLOCK, SLOTS = 2, 2, 64, 16, 8
SEGMENT = TOKENS_PER_BLOCK * HEADS * HEAD_DIM * 2  # bf16
TENSOR = SLOTS * SEGMENT
SIZE = 2 * LAYERS * TENSOR

fd = os.memfd_create("kv")
os.ftruncate(fd, SIZE)
kv = mmap.mmap(fd, SIZE)


def slot_ranges(slot):
    return [(t * TENSOR + slot * SEGMENT, SEGMENT) for t in range(2 * LAYERS)]


def write_block(slot, seed):
    for i, (off, n) in enumerate(slot_ranges(slot)):
        kv[off:off + n] = bytes((seed * 31 + i * 7 + j) % 251 for j in range(n))


def read_block(slot):
    return b"".join(kv[off:off + n] for off, n in slot_ranges(slot))


stub = rpc.KvcachedStub(grpc.insecure_channel(f"unix:{SOCKET}"))
assert stub.Health(pb.Empty(), timeout=5).ok

(ticket,) = attach([fd])
namespace = pb.NamespaceSpec(
    model_id="python/engine",
    layout=pb.Layout(num_layers=LAYERS, kv_heads=HEADS, head_dim=HEAD_DIM, dtype="bf16",
                     tokens_per_block=TOKENS_PER_BLOCK, kind="layer_separate"),
)
reg = stub.Register(pb.RegisterRequest(
    engine_name="python-engine",
    namespace=namespace,
    region=pb.MemoryRegion(fd_ticket=ticket, size_bytes=SIZE),
    segments=[pb.Segment(offset=off, block_stride=SEGMENT) for off, _ in slot_ranges(0)],
    segment_bytes=SEGMENT,
    num_blocks=SLOTS,
), timeout=5)

tokens = b"".join(((i * 2654435761) % 150000).to_bytes(4, "little") for i in range(2 * TOKENS_PER_BLOCK))
write_block(0, 1)
write_block(1, 2)
saved = stub.Save(pb.SaveRequest(engine_id=reg.engine_id, tokens=tokens, first_block=0, block_ids=[0, 1]), timeout=5)
assert saved.stored == 2 and saved.failed == 0, saved
hit = stub.Lookup(pb.LookupRequest(engine_id=reg.engine_id, tokens=tokens), timeout=5)
assert hit.matched_blocks == 2, hit
done = stub.Load(pb.LoadRequest(engine_id=reg.engine_id, tokens=tokens, first_block=0, block_ids=[4, 5], wait=True),
                 timeout=5)
assert done.state == pb.LoadStatus.DONE and done.loaded_blocks == 2, done
assert read_block(4) == read_block(0) and read_block(5) == read_block(1), "loaded bytes differ"
# A path instead of a descriptor is refused, with the reason.
try:
    stub.Register(pb.RegisterRequest(engine_name="p", namespace=namespace,
                                     region=pb.MemoryRegion(shm_path="/etc/passwd", size_bytes=SIZE)), timeout=5)
    raise AssertionError("a path was accepted")
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "paths are not accepted" in e.details(), e
stub.Unregister(pb.EngineRef(engine_id=reg.engine_id), timeout=5)
print("ok", hit.matched_blocks)
