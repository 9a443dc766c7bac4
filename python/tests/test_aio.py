"""kvcached.aio.AsyncClient against a real daemon: coroutines in flight together, the event loop
kept running while calls wait."""

from __future__ import annotations

import asyncio
import os

import pytest

import kvcached
from kvcached.aio import AsyncClient

TPB = 16
LAYOUT = kvcached.KvLayout(num_layers=2, kv_heads=2, head_dim=64, tokens_per_block=TPB)


def test_async_client_round_trip(daemon):
    async def main() -> None:
        ns = kvcached.Namespace("aio", LAYOUT)
        mem_a = kvcached.KvMemory.anonymous(LAYOUT, 16)
        mem_b = kvcached.KvMemory.anonymous(LAYOUT, 16)
        async with await AsyncClient.connect(daemon.socket) as a, await AsyncClient.connect(daemon.socket) as b:
            await asyncio.gather(a.register("aio-a", ns, mem_a), b.register("aio-b", ns, mem_b))
            prompts = [[(i * 31 + t) % 9000 for t in range(2 * TPB)] for i in range(4)]
            data = {s: os.urandom(mem_a.block_bytes) for s in range(8)}
            for s, d in data.items():
                mem_a.write_block(s, d)
            saved = await asyncio.gather(*(a.save(p, 0, [2 * i, 2 * i + 1]) for i, p in enumerate(prompts)))
            assert [s.stored for s in saved] == [2, 2, 2, 2]
            hits = await asyncio.gather(*(b.lookup(p) for p in prompts))
            assert [h.matched_blocks for h in hits] == [2, 2, 2, 2]

            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            tick = asyncio.create_task(ticker())
            ops = await asyncio.gather(*(b.load(p, 0, [8 + 2 * i, 9 + 2 * i]) for i, p in enumerate(prompts)))
            done = await asyncio.gather(*(b.wait(op, 10) for op in ops))
            tick.cancel()
            assert [d.loaded_blocks for d in done] == [2, 2, 2, 2]
            assert ticks > 0, "the event loop ran while the calls waited"
            for s, d in data.items():
                assert mem_b.read_block(8 + s) == d
            assert (await b.poll(ops[0])).state == "done"
            assert (await b.stats())["engines"] >= 2
        assert a.engine_id is None and b.engine_id is None

    asyncio.run(main())


def test_async_errors_propagate(daemon):
    async def main() -> None:
        c = await AsyncClient.connect(daemon.socket)
        with pytest.raises(kvcached.NotRegisteredError):
            await c.lookup([1, 2, 3])
        with pytest.raises(kvcached.UnreachableError):
            await AsyncClient.connect(daemon.socket + ".nobody", reconnect_for=0.1)

    asyncio.run(main())
