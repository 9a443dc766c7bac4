"""Drives an LMCache 0.5.6 multi-process server with LMCache's own client, for `kvbench replay
--lmcache` (benches/src/peers/lmcache.rs writes this file out and runs it).

The client is the one `lmcache bench server --mode cpu --transfer-mode engine_driven` uses
(`ServerBenchClient`: KV tensors in this process in vLLM's layout, copied through the server's
shared memory), so what is measured is LMCache's own best CPU path. Requests carry the tokens
kvbench derives from the trace's hash ids (the same SplitMix64 stream as
`kvbench::replay::block_tokens`), so LMCache's chunk hashes see the same prefixes as kvcached's
keys.

    python lmcache_driver.py PLAN.json RESULT.json

PLAN: rpc_url, http_url, shape_spec, num_pages, page_tokens, tokens_per_hash, warm_ids (one
request each), requests (lists of hash ids). RESULT: versions, warm-up seconds, and per request
the chunks found, and the seconds and tokens of its lookup, retrieve and store.
"""

import json
import sys
import time

M64 = (1 << 64) - 1
VOCAB = 128_000


def block_tokens(h: int, n: int) -> list[int]:
    out = []
    s = h & M64
    for _ in range(n):
        s = (s + 0x9E3779B97F4A7C15) & M64
        z = s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        z ^= z >> 31
        out.append((z >> 32) % VOCAB)
    return out


def main() -> None:
    plan = json.load(open(sys.argv[1]))
    import torch
    import lmcache
    from lmcache.cli.commands.bench.server_bench.client import RequestContext, ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    cfg = BenchConfig(
        rpc_url=plan["rpc_url"],
        http_url=plan["http_url"],
        mode="cpu",
        transfer_mode="engine_driven",
        tp_size=1,
        use_mla=False,
        num_tokens=plan["num_pages"] * plan["page_tokens"],
        kvcache_shape_spec=plan["shape_spec"],
        num_blocks=plan["num_pages"],
        block_size=plan["page_tokens"],
    )
    client = ServerBenchClient(cfg, log=lambda _s: None)
    client.start()
    tph = plan["tokens_per_hash"]
    cache: dict[int, list[int]] = {}

    def tokens(ids: list[int]) -> tuple[int, ...]:
        out: list[int] = []
        for h in ids:
            if h not in cache:
                cache[h] = block_tokens(h, tph)
            out += cache[h]
        return tuple(out)

    chunk = None
    seq = 0

    def request(ids: list[int]) -> dict:
        nonlocal chunk, seq
        t = tokens(ids)
        seq += 1
        rid = f"kvbench-{seq}"
        if chunk is None:
            chunk = client._chunk_size  # the server's, read at start
        req = RequestContext(
            sequence_id=seq,
            request_id=rid,
            request_kind="replay",
            token_ids=t,
            num_full_tokens=len(t) // chunk * chunk,
            total_chunks=len(t) // chunk,
            chunk_size=chunk,
            block_offset=0,
            num_blocks=len(t) // plan["page_tokens"],
        )
        out = {"chunks": req.total_chunks, "chunk_tokens": chunk}
        t0 = time.perf_counter()
        lk = client.lookup(req)
        out["lookup_s"] = time.perf_counter() - t0
        out["hit_chunks"] = lk.hit_chunks
        out["error"] = lk.error
        hit_tokens = lk.hit_chunks * chunk
        if hit_tokens:
            t0 = time.perf_counter()
            r = client.retrieve(req, 0, hit_tokens)
            out["retrieve_s"] = time.perf_counter() - t0
            out["retrieve_tokens"] = hit_tokens if r is not None and r.succeeded else 0
        if hit_tokens < req.num_full_tokens:
            t0 = time.perf_counter()
            s = client.store(req, hit_tokens, req.num_full_tokens - hit_tokens)
            out["store_s"] = time.perf_counter() - t0
            out["store_tokens"] = req.num_full_tokens - hit_tokens if s is not None and s.succeeded else 0
        client.end_session(req)
        return out

    t0 = time.perf_counter()
    for h in plan["warm_ids"]:
        request([h])  # stored
        request([h])  # retrieved
    warm = time.perf_counter() - t0
    results = [request(ids) for ids in plan["requests"]]
    client.close()
    json.dump(
        {
            "lmcache": getattr(lmcache, "__version__", "?"),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "warmup_s": warm,
            "requests": results,
        },
        open(sys.argv[2], "w"),
    )


if __name__ == "__main__":
    main()
