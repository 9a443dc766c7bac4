"""What the scheduler side tells the workers each step (vLLM pickles it to them).

Token ids travel as `array("I")`: compact to pickle, and read by the client without converting
each element (the buffer path of `kvcached.Client`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvcached.vllm.keys import ContextArgs


@dataclass
class Transfer:
    """Blocks `first_block .. first_block + len(slots)` of a request's tokens, to or from those
    vLLM block ids of KV-cache group `group`. `tokens` covers the prompt up to the end of the last
    block; `context` is what the request's keys bind besides them (None: nothing)."""

    req_id: str
    tokens: array
    first_block: int
    slots: list[int]
    context: ContextArgs | None = None
    group: int = 0


@dataclass
class KvcachedConnectorMetadata(KVConnectorMetadata):
    """One step's loads: `loads` must be done before this step's forward pass reads them;
    `async_loads` belong to requests waiting in WAITING_FOR_REMOTE_KVS, reported done later
    through `get_finished`. `saves` are taken once the forward pass has written the blocks."""

    loads: list[Transfer] = field(default_factory=list)
    async_loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    # Requests whose loads vLLM counts on but which could not be planned (their blocks were not
    # where the plan needed them): asynchronous ones fail as requests (`failed_recving`), the
    # blocks of synchronous ones are reported invalid; vLLM computes them.
    unplanned: list[str] = field(default_factory=list)
    unplanned_blocks: list[int] = field(default_factory=list)
