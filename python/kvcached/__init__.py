"""kvcached's Python client: attach KV memory to the node's kvcached daemon, then save, look up
and load KV blocks by prompt tokens.

    import kvcached

    layout = kvcached.KvLayout(num_layers=28, kv_heads=8, head_dim=128, dtype="bf16",
                               tokens_per_block=16)
    ns = kvcached.Namespace("Qwen/Qwen3-0.6B", layout)
    mem = kvcached.KvMemory.anonymous(layout, num_blocks=1024)   # a memfd the daemon maps
    kv = mem.numpy()                                              # the same bytes, no copy
    client = kvcached.Client()                                    # $KVCACHED_SOCKET or default
    client.register("engine-0", ns, mem)
    client.save(tokens, 0, slots)                                 # after prefill
    hit = client.lookup(tokens)                                   # on a new request
    client.load_now(tokens, 0, free_slots[:hit.matched_blocks])

Every call releases the GIL while it waits; `kvcached.aio.AsyncClient` is the asyncio variant.
Errors are `KvcachedError` subclasses. `kvcached.vllm.KvcachedConnector` is the vLLM v1 KV
connector. See docs/python.md.
"""

from kvcached._native import (
    AttachError,
    AttachRefusedError,
    Client,
    ClientIOError,
    EngineHashes,
    GpuKvMemory,
    InvalidArgumentError,
    KeyContext,
    KvcachedError,
    KvLayout,
    KvMemory,
    LimitReachedError,
    LoadFailedError,
    LoadOp,
    LoadStatus,
    LookupResult,
    Namespace,
    NoCudaDeviceError,
    NotRegisteredError,
    PermissionDeniedError,
    Registration,
    RpcError,
    SaveResult,
    SlotLayout,
    UnknownEngineError,
    UnknownOpError,
    UnreachableError,
    default_socket,
    synthetic_block,
)

__version__ = "0.1.0"

__all__ = [
    "AttachError",
    "AttachRefusedError",
    "Client",
    "ClientIOError",
    "EngineHashes",
    "GpuKvMemory",
    "InvalidArgumentError",
    "KeyContext",
    "KvcachedError",
    "KvLayout",
    "KvMemory",
    "LimitReachedError",
    "LoadFailedError",
    "LoadOp",
    "LoadStatus",
    "LookupResult",
    "Namespace",
    "NoCudaDeviceError",
    "NotRegisteredError",
    "PermissionDeniedError",
    "Registration",
    "RpcError",
    "SaveResult",
    "SlotLayout",
    "UnknownEngineError",
    "UnknownOpError",
    "UnreachableError",
    "default_socket",
    "synthetic_block",
]
