"""Type stubs of kvcached's extension module (python/src/*.rs). Re-exported by `kvcached`."""

from collections.abc import Sequence
from os import PathLike
from pathlib import Path
from typing import Any, Literal

from typing_extensions import Buffer  # collections.abc.Buffer is 3.12+

# A prompt's token ids: a sequence of ints, or any buffer of uint32 (NumPy uint32 array,
# array.array("I")), which is read without converting each element.
Tokens = Sequence[int] | Buffer

DType = Literal["bf16", "f16", "f32", "fp8_e4m3", "fp8_e5m2", "int8"]
Kind = Literal["layer_separate", "contiguous"]

class KvLayout:
    """The KV layout of a model as the engine stores it. Raises ValueError on a zero field or
    an unknown dtype/kind (dtype also accepts "bfloat16", "float16", "float32", ...)."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: str = "bf16",
        tokens_per_block: int = 16,
        kind: str = "layer_separate",
    ) -> None: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> DType: ...
    @property
    def tokens_per_block(self) -> int: ...
    @property
    def kind(self) -> Kind: ...
    @property
    def segment_bytes(self) -> int:
        """Bytes of K (or V) of one layer of one block."""
    @property
    def block_bytes(self) -> int:
        """Bytes of one block: layers x 2 x segment_bytes."""
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class Namespace:
    """Everything that binds a block key; engines share KV only within an equal namespace."""

    def __init__(
        self,
        model_id: str,
        layout: KvLayout,
        *,
        tenant_salt: bytes | None = None,
        adapter_id: str | None = None,
        extra: bytes | None = None,
    ) -> None: ...
    @property
    def model_id(self) -> str: ...
    @property
    def layout(self) -> KvLayout: ...
    @property
    def adapter_id(self) -> str | None: ...
    @property
    def extra(self) -> bytes | None: ...
    @property
    def has_tenant_salt(self) -> bool: ...
    @property
    def id(self) -> str:
        """The namespace's public id, hex."""
    def block_keys(self, tokens: Sequence[int]) -> list[bytes]:
        """16-byte keys of every full block of `tokens`, as the daemon derives them."""
    def __eq__(self, other: object) -> bool: ...

class KeyContext:
    """What a request's block keys bind besides its tokens (docs/block-keys.md section 6): a LoRA
    adapter (name and weights hash) and a cache salt bind every key; multimodal inputs
    (hash, offset, length), in token order and not overlapping, bind the blocks they overlap;
    block_extras (block, bytes) bind one block each. Raises ValueError for a context out of bounds."""

    def __init__(
        self,
        *,
        adapter_name: str | None = None,
        adapter_hash: bytes = b"",
        cache_salt: bytes | None = None,
        mm: Sequence[tuple[bytes, int, int]] = (),
        block_extras: Sequence[tuple[int, bytes]] = (),
    ) -> None: ...
    @property
    def is_empty(self) -> bool: ...
    def block_keys(self, namespace: Namespace, tokens: Sequence[int]) -> list[bytes]:
        """16-byte keys of every full block of `tokens` in `namespace` under this context."""
    def __eq__(self, other: object) -> bool: ...

class EngineHashes:
    """A request's keys as its engine's own page hashes (docs/block-keys.md section 7): SGLang's
    storage page hashes (scheme "sglang") or vLLM's block hashes as its offloading tiers see
    them ("vllm"), one per block in order, 1..64 bytes each. With none, the daemon derives the
    scheme's hashes from the request's tokens ("sglang" only). Raises ValueError out of bounds."""

    def __init__(self, scheme: Literal["sglang", "vllm"], hashes: Sequence[bytes] = ()) -> None: ...
    @property
    def scheme(self) -> Literal["sglang", "vllm"]: ...
    def __len__(self) -> int: ...
    def block_keys(self, namespace: Namespace, tokens: Sequence[int] = ()) -> list[bytes]:
        """16-byte keys as the daemon derives them (of the scheme's hashes of tokens when empty)."""
    @staticmethod
    def sglang_page_hashes(tokens: Sequence[int], page_size: int) -> list[bytes]:
        """SGLang's page hashes of the full pages of tokens (SHA-256 chained)."""
    def __eq__(self, other: object) -> bool: ...

class SlotLayout:
    """Where block slots lie in KV memory: segment i of slot b at offset_i + b * stride_i."""

    def __init__(self, segments: Sequence[tuple[int, int]], segment_bytes: int, num_blocks: int) -> None: ...
    @staticmethod
    def layer_separate(layout: KvLayout, num_blocks: int) -> SlotLayout: ...
    @staticmethod
    def contiguous(layout: KvLayout, num_blocks: int) -> SlotLayout: ...
    @staticmethod
    def for_layout(layout: KvLayout, num_blocks: int) -> SlotLayout: ...
    @property
    def segments(self) -> list[tuple[int, int]]:
        """(offset, stride) of each segment."""
    @property
    def segment_bytes(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def extent(self) -> int:
        """The least number of bytes a region holding these slots must have."""
    def check(self, layout: KvLayout, region_bytes: int) -> None:
        """The daemon's check of the slots; raises ValueError naming what is wrong."""
    def ranges(self, block: int) -> list[tuple[int, int]]:
        """(offset, length) of each segment of slot `block`, in block byte order."""
    def __eq__(self, other: object) -> bool: ...

class KvMemory(Buffer):
    """A memfd laid out as slots; the buffer protocol views the whole region, writable, without
    copying (memoryview(mem), numpy.frombuffer(mem, dtype), torch.frombuffer(mem, dtype=...))."""

    @staticmethod
    def anonymous(layout: KvLayout, num_blocks: int) -> KvMemory: ...
    @staticmethod
    def with_slots(slots: SlotLayout, size: int | None = None) -> KvMemory: ...
    @staticmethod
    def from_fd(fd: int, slots: SlotLayout) -> KvMemory:
        """Memory the engine already has open (duplicates `fd`)."""
    @property
    def size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def slots(self) -> SlotLayout: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def fd(self) -> int:
        """The region's descriptor (owned by this object: do not close it)."""
    def block_ranges(self, block: int) -> list[tuple[int, int]]: ...
    def read_block(self, block: int) -> bytes: ...
    def write_block(self, block: int, data: bytes | bytearray) -> None: ...
    def numpy(self, dtype: Any = None) -> Any:
        """The whole region as a 1-D numpy array (default uint8), no copy."""
    def torch(self, dtype: Any = None) -> Any:
        """The whole region as a 1-D torch tensor (a torch.dtype or its name; default uint8), no copy."""
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __len__(self) -> int: ...

class GpuKvMemory:
    """KV memory in GPU memory, named by a 64-byte CUDA IPC handle."""

    def __init__(self, ipc_handle_bytes: bytes, device: int, size: int, slots: SlotLayout) -> None: ...
    @staticmethod
    def layer_separate(ipc_handle_bytes: bytes, device: int, layout: KvLayout, num_blocks: int) -> GpuKvMemory: ...
    @property
    def device(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def slots(self) -> SlotLayout: ...

class LookupResult:
    matched_blocks: int
    matched_tokens: int
    g2_blocks: int
    g3_blocks: int
    g4_blocks: int

class SaveResult:
    stored: int
    already_present: int
    failed: int
    error: str

class LoadStatus:
    op_id: int
    state: Literal["pending", "done", "failed"]
    loaded_blocks: int
    from_g2: int
    from_g3: int
    from_g4: int
    from_peer: int
    error: str
    @property
    def finished(self) -> bool: ...

class Registration:
    engine_id: int
    namespace_id: str
    block_bytes: int
    heartbeat_ms: int
    lease_ms: int
    token_area_accepted: bool

class LoadOp:
    @property
    def id(self) -> int: ...

class Client:
    """A connection to the node's kvcached daemon. Every method releases the GIL while it waits.
    Raises UnreachableError when the daemon cannot be reached."""

    def __init__(
        self,
        socket: str | PathLike[str] | None = None,
        *,
        reconnect_for: float = 30.0,
        token_area_bytes: int | None = None,
    ) -> None: ...
    @property
    def socket(self) -> Path: ...
    @property
    def engine_id(self) -> int | None: ...
    @property
    def token_area_active(self) -> bool: ...
    def register(self, name: str, namespace: Namespace, memory: KvMemory) -> Registration: ...
    def register_worker(
        self, name: str, namespace: Namespace, memory: KvMemory, address: str, role: str
    ) -> Registration: ...
    def register_gpu(
        self, name: str, namespace: Namespace, memory: GpuKvMemory, address: str = "", role: str = ""
    ) -> Registration:
        """Raises NoCudaDeviceError where the daemon's node has no CUDA device."""
    def save(
        self,
        tokens: Tokens,
        first_block: int,
        slots: Sequence[int],
        *,
        context: KeyContext | None = None,
        hashes: EngineHashes | None = None,
    ) -> SaveResult:
        """hashes: keys from the engine's own page hashes (tokens empty when it holds them)."""
    def lookup(
        self,
        tokens: Tokens,
        *,
        context: KeyContext | None = None,
        first_block: int = 0,
        hashes: EngineHashes | None = None,
    ) -> LookupResult:
        """first_block > 0: the cached run starting there (matched_blocks its length)."""
    def lookup_routed(self, tokens: Tokens, route_id: int, g1_blocks: int) -> LookupResult: ...
    def load(
        self,
        tokens: Tokens,
        first_block: int,
        slots: Sequence[int],
        sources: Sequence[str] = (),
        *,
        context: KeyContext | None = None,
        hashes: EngineHashes | None = None,
    ) -> LoadOp:
        """Returns at once; sources: peer daemons that may hold what this node lacks."""
    def load_now(
        self,
        tokens: Tokens,
        first_block: int,
        slots: Sequence[int],
        *,
        context: KeyContext | None = None,
        hashes: EngineHashes | None = None,
    ) -> LoadStatus:
        """Raises LoadFailedError if the load failed."""
    def load_from(self, tokens: Tokens, first_block: int, slots: Sequence[int], sources: Sequence[str]) -> LoadStatus:
        """load_now that pulls what this node lacks from peer daemons ("host:port" of their peer
        channels, e.g. a router's split.prefill_peer)."""
    def wait(self, op: LoadOp, timeout: float = 30.0, blocks: int = 0) -> LoadStatus:
        """Raises LoadFailedError if the load failed; state "pending" if still running. With
        blocks, returns once that many blocks (the first, in order) are in the slots."""
    def poll(self, op: LoadOp) -> LoadStatus: ...
    def stats(self) -> dict[str, Any]:
        """{"engines", "saves", "loads", "writethrough_dropped", "tiers": {name: {"hits",
        "misses", "used_bytes", "capacity_bytes", "blocks", "evictions", "checksum_failures"}}}"""
    def health(self) -> tuple[bool, list[str]]: ...
    def gpu_stored(self, tokens: Tokens, first_block: int) -> list[bytes]: ...
    def gpu_removed(self, tokens: Tokens, first_block: int) -> None: ...
    def gpu_cleared(self) -> None: ...
    def report_load(self, running: int, waiting: int, kv_used_blocks: int, kv_total_blocks: int) -> None: ...
    def report_load_and_prefill(
        self,
        running: int,
        waiting: int,
        kv_used_blocks: int,
        kv_total_blocks: int,
        prefill_tokens: int,
        prefill_seconds: float,
    ) -> None:
        """report_load with the prefill computed since the last report (its rate feeds routers'
        split decisions)."""
    def unregister(self) -> None: ...
    def __enter__(self) -> Client: ...
    def __exit__(self, *exc: object) -> bool: ...

def default_socket() -> Path: ...
def synthetic_block(seed: int, index: int, length: int) -> bytes: ...

class KvcachedError(Exception): ...
class UnreachableError(KvcachedError): ...

class RpcError(KvcachedError):
    code: str
    reason: str | None
    message: str

class InvalidArgumentError(RpcError): ...
class UnknownEngineError(RpcError): ...
class UnknownOpError(RpcError): ...
class LimitReachedError(RpcError): ...
class PermissionDeniedError(RpcError): ...
class AttachRefusedError(RpcError): ...
class NoCudaDeviceError(AttachRefusedError): ...
class AttachError(KvcachedError): ...
class NotRegisteredError(KvcachedError): ...

class LoadFailedError(KvcachedError):
    op: int
    error: str

class ClientIOError(KvcachedError): ...
