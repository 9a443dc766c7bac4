"""asyncio variant of `kvcached.Client`.

Each coroutine runs the blocking call in a thread of the loop's default executor (or the one
given); the call releases the GIL while it waits on the daemon, so the event loop and other
calls keep running. Several coroutines on one `AsyncClient` may be in flight at once.

    client = await AsyncClient.connect(socket)
    await client.register("engine", ns, mem)
    hit = await client.lookup(tokens)
    op = await client.load(tokens, 0, slots)
    ...                                   # other work while the daemon copies
    status = await client.wait(op)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from os import PathLike
from typing import Any, TypeVar

from kvcached._native import (
    Client,
    GpuKvMemory,
    KeyContext,
    KvMemory,
    LoadOp,
    LoadStatus,
    LookupResult,
    Namespace,
    Registration,
    SaveResult,
)

T = TypeVar("T")
Tokens = Sequence[int] | Any  # a sequence of ints, or a buffer of uint32


class AsyncClient:
    """`kvcached.Client` with coroutine methods; `client.sync` is the blocking client."""

    def __init__(self, client: Client, executor: concurrent.futures.Executor | None = None):
        self.sync = client
        self._executor = executor

    @classmethod
    async def connect(
        cls,
        socket: str | PathLike[str] | None = None,
        *,
        reconnect_for: float = 30.0,
        token_area_bytes: int | None = None,
        executor: concurrent.futures.Executor | None = None,
    ) -> AsyncClient:
        """Connects without blocking the event loop."""
        loop = asyncio.get_running_loop()
        make = functools.partial(Client, socket, reconnect_for=reconnect_for, token_area_bytes=token_area_bytes)
        return cls(await loop.run_in_executor(executor, make), executor)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    @property
    def engine_id(self) -> int | None:
        return self.sync.engine_id

    async def register(self, name: str, namespace: Namespace, memory: KvMemory) -> Registration:
        return await self._run(self.sync.register, name, namespace, memory)

    async def register_worker(
        self, name: str, namespace: Namespace, memory: KvMemory, address: str, role: str
    ) -> Registration:
        return await self._run(self.sync.register_worker, name, namespace, memory, address, role)

    async def register_gpu(
        self, name: str, namespace: Namespace, memory: GpuKvMemory, address: str = "", role: str = ""
    ) -> Registration:
        return await self._run(self.sync.register_gpu, name, namespace, memory, address, role)

    async def save(
        self, tokens: Tokens, first_block: int, slots: Sequence[int], *, context: KeyContext | None = None
    ) -> SaveResult:
        return await self._run(functools.partial(self.sync.save, context=context), tokens, first_block, list(slots))

    async def lookup(self, tokens: Tokens, *, context: KeyContext | None = None, first_block: int = 0) -> LookupResult:
        return await self._run(functools.partial(self.sync.lookup, context=context, first_block=first_block), tokens)

    async def load(
        self,
        tokens: Tokens,
        first_block: int,
        slots: Sequence[int],
        sources: Sequence[str] = (),
        *,
        context: KeyContext | None = None,
    ) -> LoadOp:
        return await self._run(
            functools.partial(self.sync.load, context=context), tokens, first_block, list(slots), list(sources)
        )

    async def load_now(
        self, tokens: Tokens, first_block: int, slots: Sequence[int], *, context: KeyContext | None = None
    ) -> LoadStatus:
        return await self._run(functools.partial(self.sync.load_now, context=context), tokens, first_block, list(slots))

    async def wait(self, op: LoadOp, timeout: float = 30.0, blocks: int = 0) -> LoadStatus:
        return await self._run(self.sync.wait, op, timeout, blocks)

    async def poll(self, op: LoadOp) -> LoadStatus:
        return await self._run(self.sync.poll, op)

    async def stats(self) -> dict[str, Any]:
        return await self._run(self.sync.stats)

    async def health(self) -> tuple[bool, list[str]]:
        return await self._run(self.sync.health)

    async def unregister(self) -> None:
        await self._run(self.sync.unregister)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.sync.engine_id is not None:
            await self.unregister()
