"""The vLLM connector driven by vLLM 0.33's real Scheduler on the CPU, against a real daemon: the
scheduler half's lookups and plans, the worker half's loads and saves into the KV tensors vLLM
allocated (in kvcached's shared memory), every loaded byte checked."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import BLOCK, assert_group_kv, finish, loaded_then_scheduled, request, window  # noqa: E402

import kvcached  # noqa: E402

PROMPT = list(range(100, 100 + 3 * BLOCK + 5))  # 3 full blocks and 5 tokens


def assert_prompt_kv(e, rid_blocks: list[int], tokens: list[int], count: int) -> None:
    for i in range(count):
        assert e.block_kv(rid_blocks[i]) == e.expected_block_kv(tokens, i), f"block {i}"


def test_a_second_request_loads_the_first_ones_blocks(daemon, make_engine):
    # Prefix caching off, so the second request's hit can only come from kvcached.
    e = make_engine(daemon.socket, prefix_caching=False)
    sched = e.connector.scheduler
    e.add(request("A1", PROMPT))
    out, _ = e.step()
    assert out.num_scheduled_tokens["A1"] == len(PROMPT)  # cold: everything computed
    meta = out.kv_connector_metadata
    assert not meta.loads and [(s.first_block, len(s.slots)) for s in meta.saves] == [(0, 3)]
    assert e.worker.worker.counts["saved"] == 3
    finish(e, "A1")

    r2 = e.add(request("A2", PROMPT))
    out, _ = e.step()
    meta = out.kv_connector_metadata
    assert [(t.first_block, len(t.slots)) for t in meta.loads] == [(0, 3)]
    assert out.num_scheduled_tokens["A2"] == len(PROMPT) - 3 * BLOCK
    assert out.has_sync_kv_loads
    blocks = e.scheduler.kv_cache_manager.get_blocks("A2").get_block_ids()[0]
    assert_prompt_kv(e, blocks, PROMPT, 3)  # the loaded blocks, byte for byte
    assert e.worker.worker.counts["loaded"] == 3 and e.worker.worker.counts["load_failed"] == 0
    assert r2.num_computed_tokens == len(PROMPT)
    assert sched.stats.lookups >= 2 and sched.stats.hit_tokens == 3 * BLOCK
    finish(e, "A2")


def test_local_prefix_hits_are_not_looked_up_again(daemon, make_engine):
    e = make_engine(daemon.socket, prefix_caching=True)
    prompt = [t + 7 for t in PROMPT]
    e.add(request("L1", prompt))
    e.step()
    finish(e, "L1")
    before = e.connector.scheduler.stats.lookups
    e.add(request("L2", prompt))
    out, _ = e.step()
    # vLLM's own cache holds all 3 blocks: nothing beyond them to ask kvcached for.
    assert not out.kv_connector_metadata.loads
    assert e.connector.scheduler.stats.lookups == before
    finish(e, "L2")


def test_prefill_decode_handoff_through_the_store(daemon, make_engine):
    prompt = [t + 1000 for t in PROMPT]
    p = make_engine(daemon.socket, "kv_producer")
    d = make_engine(daemon.socket, "kv_consumer", {"kvcached.load_async": True})

    p.add(request("P1", prompt, max_tokens=1, params={"do_remote_decode": True}))
    out, eco = p.step()
    outs = [o for e in eco.values() for o in e.outputs]
    params = outs[0].kv_transfer_params
    assert params["do_remote_prefill"] and params["kvcached_tokens"] == 3 * BLOCK
    assert params["kvcached_namespace"] == d.connector.scheduler.namespace.id
    assert "P1" not in p.scheduler.requests  # saved before finishing: blocks freed at once

    r = d.add(request("D1", prompt, params=params))
    out, _ = d.step()
    assert "D1" not in out.num_scheduled_tokens
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [(t.first_block, len(t.slots)) for t in out.kv_connector_metadata.async_loads] == [(0, 3)]
    # The worker reports the load in the step it finishes; then the request computes the rest.
    for _ in range(20):
        out, _ = d.step()
        if "D1" in out.num_scheduled_tokens:
            break
    assert out.num_scheduled_tokens["D1"] == len(prompt) - 3 * BLOCK
    blocks = d.scheduler.kv_cache_manager.get_blocks("D1").get_block_ids()[0]
    assert_prompt_kv(d, blocks, prompt, 3)
    # The consumer never saves.
    assert d.worker.worker.counts["saved"] == 0 and not out.kv_connector_metadata.saves
    finish(d, "D1")


def test_chunked_prefill_saves_each_chunk_and_decode_blocks_on_request(daemon, make_engine):
    prompt = [(t * 3) % 1000 for t in range(5 * BLOCK + 3)]
    e = make_engine(daemon.socket, batched_tokens=2 * BLOCK, extra={"kvcached.save_decode": True})
    e.add(request("C1", prompt, max_tokens=2 * BLOCK))
    saves = []
    for _ in range(3):
        out, _ = e.step()
        saves += [(s.first_block, len(s.slots)) for s in out.kv_connector_metadata.saves]
    assert saves == [(0, 2), (2, 2), (4, 1)], saves
    # Decoding fills block 5 (tokens 80..95); with save_decode it is saved when full.
    for _ in range(2 * BLOCK):
        out, _ = e.step(token=11)
        saves += [(s.first_block, len(s.slots)) for s in out.kv_connector_metadata.saves]
        if (5, 1) in saves:
            break
    assert (5, 1) in saves, saves
    other = kvcached.Client(daemon.socket)
    ns = e.connector.scheduler.namespace
    other.register("py-check", ns, kvcached.KvMemory.anonymous(ns.layout, 1))
    full = prompt + [7] + [11] * (2 * BLOCK)
    assert other.lookup(full[: 6 * BLOCK]).matched_blocks == 6
    other.unregister()
    finish(e, "C1")


def _adapter(tmp_path, name: str, weights: bytes) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text('{"r": 8, "target_modules": ["k_proj", "v_proj"]}')
    (d / "adapter_model.safetensors").write_bytes(weights)
    return str(d)


def _served(e, req, tokens: list[int], tag_of) -> int:
    """Adds `req`, runs its first step; checks every loaded byte against the KV of `tag_of(req)`
    and returns how many blocks were loaded."""
    e.add(req)
    out, _ = e.step()
    loads = out.kv_connector_metadata.loads
    n = sum(len(t.slots) for t in loads)
    blocks = e.scheduler.kv_cache_manager.get_blocks(req.request_id).get_block_ids()[0]
    for i in range(n):
        assert e.block_kv(blocks[i]) == e.expected_block_kv(tokens, i, tag_of(req)), f"block {i}"
    finish(e, req.request_id)
    return n


def test_lora_and_salted_requests_never_hit_each_others_blocks(daemon, make_engine, tmp_path):
    from vllm.lora.request import LoRARequest
    from vllm_harness import context_tag

    e = make_engine(daemon.socket, prefix_caching=False)
    sched = e.connector.scheduler
    prompt = [t + 2000 for t in PROMPT]
    sql = _adapter(tmp_path, "sql", b"weights-1")
    moved = _adapter(tmp_path, "sql-copy", b"weights-1")  # the same weights elsewhere
    retrained = _adapter(tmp_path, "sql-v2", b"weights-2")
    kinds = {
        "lora": dict(lora_request=LoRARequest("sql", 1, sql)),
        "salt": dict(cache_salt="tenant-a"),
        "plain": {},
        "lora+salt": dict(lora_request=LoRARequest("sql", 1, sql), cache_salt="tenant-a"),
    }
    # Each kind saves its own blocks; none finds another kind's.
    for i, (kind, kw) in enumerate(kinds.items()):
        assert _served(e, request(f"{kind}-1", prompt, **kw), prompt, context_tag) == 0, kind
        assert e.worker.worker.counts["saved"] == 3 * (i + 1), kind
    # Each finds its own again, every byte its own.
    for kind, kw in kinds.items():
        assert _served(e, request(f"{kind}-2", prompt, **kw), prompt, context_tag) == 3, kind
    # The adapter is keyed by its weights: the same files under another path hit, retrained
    # weights under the same name do not, nor does another tenant's salt.
    assert (
        _served(
            e,
            request("moved", prompt, lora_request=LoRARequest("sql", 2, moved)),
            prompt,
            lambda r: context_tag(request("x", prompt, lora_request=LoRARequest("sql", 1, sql))),
        )
        == 3
    )
    assert _served(e, request("v2", prompt, lora_request=LoRARequest("sql", 3, retrained)), prompt, context_tag) == 0
    assert _served(e, request("b", prompt, cache_salt="tenant-b"), prompt, context_tag) == 0
    assert sched.stats.daemon_errors == 0


def test_an_image_shares_the_text_before_it_and_nothing_after(daemon, make_engine):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm_harness import context_tag

    e = make_engine(daemon.socket, prefix_caching=False)
    prompt = [t + 5000 for t in range(6 * BLOCK + 3)]

    def image(ident: str):
        # Placeholders at tokens 40..69: blocks 2, 3 and 4.
        return [
            MultiModalFeatureSpec(data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(40, 30))
        ]

    assert _served(e, request("I1", prompt, mm_features=image("cat")), prompt, context_tag) == 0
    assert _served(e, request("I2", prompt, mm_features=image("cat")), prompt, context_tag) == 6
    # Another image at the same place: only the two blocks before it are the same KV.
    assert _served(e, request("I3", prompt, mm_features=image("dog")), prompt, context_tag) == 2
    # The text alone shares those two blocks too, and nothing from the image on.
    assert _served(e, request("T1", prompt), prompt, context_tag) == 2


def test_prompt_embeddings_are_keyed_by_the_embeddings(daemon, make_engine):
    import torch
    from vllm_harness import context_tag

    e = make_engine(daemon.socket, prefix_caching=False)
    n = 3 * BLOCK + 5
    emb = torch.arange(n * 8, dtype=torch.float32).reshape(n, 8)
    other = emb.clone()
    other[2 * BLOCK + 1, 0] = -1.0  # one value in block 2
    zeros = [0] * n  # vLLM's token ids of an embeddings-only prompt

    def req(rid, t):
        return request(rid, None, prompt_embeds=t)

    assert _served(e, req("E1", emb), zeros, context_tag) == 0
    assert _served(e, req("E2", emb), zeros, context_tag) == 3
    assert _served(e, req("E3", other), zeros, lambda r: context_tag(req("x", emb))) == 2


def test_requests_the_daemon_cannot_key_are_neither_looked_up_nor_saved(daemon, make_engine):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    e = make_engine(daemon.socket, prefix_caching=False)
    sched = e.connector.scheduler
    before = sched.stats.lookups
    overlapping = [
        MultiModalFeatureSpec(data=None, modality="image", identifier=i, mm_position=PlaceholderRange(o, 20))
        for i, o in (("a", 0), ("b", 10))
    ]
    e.add(request("S1", [t + 2000 for t in PROMPT], mm_features=overlapping))
    out, _ = e.step()
    assert sched.stats.lookups == before and not out.kv_connector_metadata.saves
    finish(e, "S1")


def test_the_engine_serves_without_the_daemon(own_daemon, make_engine):
    e = make_engine(own_daemon.socket, prefix_caching=False, extra={"kvcached.retry_after": 60})
    own_daemon.kill()
    e.add(request("N1", [t + 3000 for t in PROMPT]))
    out, _ = e.step()
    assert out.num_scheduled_tokens["N1"] == len(PROMPT)  # no hit, and no exception
    assert e.connector.scheduler.stats.daemon_errors == 1
    assert e.worker.worker.counts["save_failed"] == 3
    finish(e, "N1")
    e.add(request("N2", [t + 3000 for t in PROMPT]))
    e.step()  # within retry_after: not asked again
    assert e.connector.scheduler.stats.daemon_errors == 1
    finish(e, "N2")


def test_an_engine_started_before_the_daemon_attaches_when_it_comes(own_daemon, make_engine):
    own_daemon.kill()
    e = make_engine(own_daemon.socket, prefix_caching=False, extra={"kvcached.retry_after": 0})
    assert e.worker.worker.client is None and e.connector.scheduler._client is None
    prompt = [t + 4000 for t in PROMPT]
    e.add(request("B1", prompt))
    out, _ = e.step()
    assert out.num_scheduled_tokens["B1"] == len(prompt)  # served without kvcached
    finish(e, "B1")
    own_daemon.start()
    e.add(request("B2", prompt))
    e.step()  # both halves register now; B2's blocks are saved
    assert e.worker.worker.counts["saved"] == 3
    finish(e, "B2")
    e.add(request("B3", prompt))
    out, _ = e.step()
    assert [(t.first_block, len(t.slots)) for t in out.kv_connector_metadata.loads] == [(0, 3)]
    blocks = e.scheduler.kv_cache_manager.get_blocks("B3").get_block_ids()[0]
    assert_prompt_kv(e, blocks, prompt, 3)
    finish(e, "B3")


def test_a_hybrid_model_saves_and_loads_full_and_sliding_window_groups(daemon, make_engine):
    """vLLM's hybrid KV-cache manager on (as for Gemma 3, gpt-oss): a full-attention group and a
    sliding-window group, each in its own namespace. The full group saves every block, the
    window group the blocks the window of the prompt's end reads (and one more); a later request
    is served as far as the full group holds the prefix and the window group its window, which
    is all the window group loads (vLLM gives it no block before it)."""
    from vllm_harness import LAYERS, SPEC

    swa = window(2 * BLOCK)
    e = make_engine(
        daemon.socket, prefix_caching=False, batched_tokens=256, groups=[([LAYERS[0]], SPEC), ([LAYERS[1]], swa)]
    )
    sched = e.connector.scheduler
    assert [g.window_blocks for g in sched.groups] == [None, 2]
    assert len({ns.id for ns in sched.namespaces}) == 2
    prompt = [t + 7000 for t in range(6 * BLOCK + 3)]
    e.add(request("H1", prompt))
    out, _ = e.step()
    assert sorted((t.group, t.first_block, len(t.slots)) for t in out.kv_connector_metadata.saves) == [
        (0, 0, 6),
        (1, 3, 3),
    ]
    assert e.worker.worker.counts["saved"] == 9
    finish(e, "H1")

    e.add(request("H2", prompt))
    loads, out = loaded_then_scheduled(e, "H2")
    # The window (32 tokens) of the first token computed (96) starts in block 4.
    assert loads == [(0, 0, 6), (1, 4, 2)], loads
    assert out.num_scheduled_tokens["H2"] == len(prompt) - 6 * BLOCK
    assert_group_kv(e, "H2", prompt, 0, range(6))
    assert_group_kv(e, "H2", prompt, 1, (4, 5))
    assert e.worker.worker.counts["load_failed"] == 0
    finish(e, "H2")

    # A prompt sharing only the first 3 blocks: the window before block 3 was never saved.
    e.add(request("H4", prompt[: 3 * BLOCK] + [1] * 40))
    out, _ = e.step()
    assert not out.kv_connector_metadata.async_loads and "H4" in out.num_scheduled_tokens
    finish(e, "H4")
    # A prompt only the full group holds (its window blocks were never saved): no hit at all.
    other = [t + 9000 for t in range(3 * BLOCK + 1)]
    full_only = e.worker.worker.regs[0].client
    full_only.save(other, 0, [1, 2, 3])
    e.add(request("H3", other))
    out, _ = e.step()
    assert not out.kv_connector_metadata.async_loads and "H3" in out.num_scheduled_tokens
    finish(e, "H3")


def test_groups_of_different_block_sizes_are_each_keyed_at_their_own(daemon, make_engine):
    """KV-cache groups whose blocks differ in size (vLLM makes a group's blocks longer where its
    layers' pages per token are smaller, so that every page is the same size): full attention in
    16-token blocks beside a one-head window group in 32-token blocks. vLLM's scheduler aligns
    to 32 (their least common multiple); each group's blocks are keyed in its own namespace at
    its own size, and a hit is whole blocks of both."""
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    from vllm_harness import LAYERS, SPEC

    swa = SlidingWindowSpec(
        block_size=2 * BLOCK, num_kv_heads=1, head_size=32, dtype=torch.bfloat16, sliding_window=2 * BLOCK
    )
    assert swa.page_size_bytes == SPEC.page_size_bytes
    e = make_engine(
        daemon.socket, prefix_caching=False, batched_tokens=256, groups=[([LAYERS[0]], SPEC), ([LAYERS[1]], swa)]
    )
    sched = e.connector.scheduler
    assert sched.block_size == 2 * BLOCK and [g.block_tokens for g in sched.groups] == [BLOCK, 2 * BLOCK]
    prompt = [t + 7100 for t in range(7 * BLOCK + 3)]
    e.add(request("M1", prompt))
    out, _ = e.step()
    # Saved up to token 96 (whole 32-token blocks): the full group's 16-token blocks 0-5, the
    # window group's 32-token blocks its window of the prompt's end reads, and one more.
    assert sorted((t.group, t.first_block, len(t.slots)) for t in out.kv_connector_metadata.saves) == [
        (0, 0, 6),
        (1, 1, 2),
    ]
    finish(e, "M1")

    e.add(request("M2", prompt))
    loads, out = loaded_then_scheduled(e, "M2")
    # The window (32 tokens) of token 96 lies in the window group's block 2.
    assert loads == [(0, 0, 6), (1, 2, 1)], loads
    assert out.num_scheduled_tokens["M2"] == len(prompt) - 6 * BLOCK
    assert_group_kv(e, "M2", prompt, 0, range(6))
    assert_group_kv(e, "M2", prompt, 1, (2,))
    finish(e, "M2")

    # A prompt sharing 5 full blocks (80 tokens): the hit ends at 64, a block of both groups.
    e.add(request("M3", prompt[: 5 * BLOCK] + [3] * 40))
    loads, out = loaded_then_scheduled(e, "M3")
    assert loads == [(0, 0, 4), (1, 1, 1)], loads
    assert_group_kv(e, "M3", prompt, 0, range(4))
    assert_group_kv(e, "M3", prompt, 1, (1,))
    assert e.worker.worker.counts["load_failed"] == 0
    finish(e, "M3")


def test_a_hybrid_prefill_hands_off_to_a_hybrid_decode_engine(daemon, make_engine):
    from vllm_harness import LAYERS, SPEC

    swa = window(BLOCK + 1)
    groups = [([LAYERS[0]], SPEC), ([LAYERS[1]], swa)]
    p = make_engine(daemon.socket, "kv_producer", groups=groups, batched_tokens=256)
    d = make_engine(daemon.socket, "kv_consumer", {"kvcached.load_async": True}, groups=groups, batched_tokens=256)
    prompt = [t + 11000 for t in range(5 * BLOCK + 2)]
    p.add(request("HP", prompt, max_tokens=1, params={"do_remote_decode": True}))
    _, eco = p.step()
    params = [o for e in eco.values() for o in e.outputs][0].kv_transfer_params
    assert params["do_remote_prefill"] and params["kvcached_tokens"] == 5 * BLOCK
    r = d.add(request("HD", prompt, params=params))
    out, _ = d.step()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    loads = sorted((t.group, t.first_block, len(t.slots)) for t in out.kv_connector_metadata.async_loads)
    assert loads == [(0, 0, 5), (1, 4, 1)], loads  # the 17-token window of token 80 reads block 4
    for _ in range(20):
        out, _ = d.step()
        if "HD" in out.num_scheduled_tokens:
            break
    assert out.num_scheduled_tokens["HD"] == len(prompt) - 5 * BLOCK
    ids = d.scheduler.kv_cache_manager.get_blocks("HD").get_block_ids()
    for i in range(5):
        assert d.block_kv(ids[0][i])[0] == d.expected_block_kv(prompt, i)[0], f"full block {i}"
    assert d.block_kv(ids[1][4])[1] == d.expected_block_kv(prompt, 4)[1]
    assert all(b == 0 for b in ids[1][:4])  # vLLM holds no block before the window
    finish(d, "HD")


def test_a_hybrid_model_saving_whole_window_groups_serves_shorter_shared_prefixes(daemon, make_engine):
    """`kvcached.window_saves: "all"`: the window group saves every block it computes, so a
    request sharing only the start of an earlier prompt is served too (its window there)."""
    from vllm_harness import LAYERS, SPEC

    swa = window(2 * BLOCK)
    extra = {"kvcached.window_saves": "all", "kvcached.namespace_extra": "all-windows"}
    groups = [([LAYERS[0]], SPEC), ([LAYERS[1]], swa)]
    e = make_engine(daemon.socket, prefix_caching=False, batched_tokens=256, extra=extra, groups=groups)
    prompt = [t + 13000 for t in range(6 * BLOCK + 3)]
    e.add(request("W1", prompt))
    out, _ = e.step()
    saves = sorted((t.group, t.first_block, len(t.slots)) for t in out.kv_connector_metadata.saves)
    assert saves == [(0, 0, 6), (1, 0, 6)]
    finish(e, "W1")
    e.add(request("W2", prompt[: 3 * BLOCK] + [1] * 40))
    loads, _ = loaded_then_scheduled(e, "W2")
    assert loads == [(0, 0, 3), (1, 1, 2)], loads
    ids = e.scheduler.kv_cache_manager.get_blocks("W2").get_block_ids()
    for i in (1, 2):
        assert e.block_kv(ids[1][i])[1] == e.expected_block_kv(prompt, i)[1], f"window block {i}"
    finish(e, "W2")


def test_a_hybrid_engines_groups_count_as_one_engine(tmp_path, make_engine):
    """Each KV-cache group registers vLLM's one KV allocation with its own slots and namespace
    (the scheduler's groups one anonymous slot); the daemon maps each memory once and counts
    its registrations as one engine. So a hybrid engine of two groups, four registrations, fits
    a uid allowed two engines, and its groups are served."""
    from conftest import configured_daemon
    from vllm_harness import LAYERS, SPEC

    with configured_daemon(tmp_path, "[limits]\nmax_engines_per_uid = 2\n") as d:
        swa = window(2 * BLOCK)
        e = make_engine(
            d.socket, prefix_caching=False, batched_tokens=256, groups=[([LAYERS[0]], SPEC), ([LAYERS[1]], swa)]
        )
        assert all(r.client is not None for r in e.worker.worker.regs), "a group was not registered"
        assert e.connector.scheduler._connect() is not None, "the scheduler's groups were not registered"
        prompt = [t + 41_000 for t in range(4 * BLOCK + 1)]
        e.add(request("C1", prompt))
        e.step()
        assert e.worker.worker.counts["saved"] == 4 + 3 and e.worker.worker.counts["save_failed"] == 0
        finish(e, "C1")
        e.add(request("C2", prompt))
        loads, _ = loaded_then_scheduled(e, "C2")
        assert loads == [(0, 0, 4), (1, 2, 2)], loads
        assert e.worker.worker.counts["load_failed"] == 0
        finish(e, "C2")
        e.close()


def saved_hybrid(make_engine, socket: str, rid: str, base: int):
    """A hybrid engine (full attention and a 32-token window) that saved a 4-block prompt."""
    from vllm_harness import LAYERS, SPEC

    groups = [([LAYERS[0]], SPEC), ([LAYERS[1]], window(2 * BLOCK))]
    e = make_engine(socket, prefix_caching=False, batched_tokens=256, groups=groups)
    prompt = [t + base for t in range(4 * BLOCK + 3)]
    e.add(request(rid, prompt))
    e.step()
    finish(e, rid)
    return e, prompt


def test_a_hybrid_models_failed_load_fails_its_request_and_vllm_recomputes_it(daemon, make_engine):
    """vLLM 0.33 cannot map block ids back to requests when a model has several KV-cache groups
    (it raises on `invalid_block_ids`): a hybrid model's failed load is reported as its
    request's (`failed_recving`), and vLLM computes the whole prompt again."""
    e, prompt = saved_hybrid(make_engine, daemon.socket, "F1", 43_000)
    # Fault injection: the window group's load cannot start (its daemon connection is gone).
    worker = e.worker.worker
    start = worker._start
    worker._start = lambda t: None if t.group == 1 else start(t)
    r = e.add(request("F2", prompt))
    loads, out = loaded_then_scheduled(e, "F2")
    assert loads == [(0, 0, 4), (1, 2, 2)], loads
    assert worker.counts["load_failed"] == 2
    # Computed again from the start, every byte right.
    assert out.num_scheduled_tokens["F2"] == len(prompt)
    assert r.num_computed_tokens == len(prompt)
    assert_group_kv(e, "F2", prompt, 0, range(4))
    worker._start = start
    finish(e, "F2")


def test_chunked_local_attention_loads_the_current_chunk(daemon, make_engine):
    """Chunked local attention (Llama 4: tokens attend within their chunk) beside full
    attention: the chunked group saves each block as it is computed (vLLM frees a past chunk's
    blocks), and a later request loads only the blocks of its hit's chunk, where vLLM holds
    blocks for it."""
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec
    from vllm_harness import LAYERS, SPEC

    chunked = ChunkedLocalAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, attention_chunk_size=4 * BLOCK
    )
    e = make_engine(
        daemon.socket, prefix_caching=False, batched_tokens=256, groups=[([LAYERS[0]], SPEC), ([LAYERS[1]], chunked)]
    )
    sched = e.connector.scheduler
    assert [g.chunked for g in sched.groups] == [False, True]
    prompt = [t + 45_000 for t in range(6 * BLOCK + 3)]
    e.add(request("K1", prompt))
    out, _ = e.step()
    saves = sorted((t.group, t.first_block, len(t.slots)) for t in out.kv_connector_metadata.saves)
    assert saves == [(0, 0, 6), (1, 0, 6)], saves
    finish(e, "K1")
    e.add(request("K2", prompt))
    loads, out = loaded_then_scheduled(e, "K2")
    # The hit ends at token 96, in the chunk of tokens 64-127: the chunked group loads blocks 4-5.
    assert loads == [(0, 0, 6), (1, 4, 2)], loads
    assert out.num_scheduled_tokens["K2"] == len(prompt) - 6 * BLOCK
    assert_group_kv(e, "K2", prompt, 1, (4, 5))
    ids = e.scheduler.kv_cache_manager.get_blocks("K2").get_block_ids()
    assert all(b == 0 for b in ids[1][:4])  # vLLM holds no block of the past chunk
    finish(e, "K2")


def test_a_hybrid_load_that_cannot_be_planned_fails_its_request_instead_of_leaving_it_waiting(daemon, make_engine):
    """A hybrid model's request waits for its loads (WAITING_FOR_REMOTE_KVS): when the plan
    cannot be made (vLLM's blocks are not where the load needs them), the request is reported
    failed, and vLLM computes it, rather than waiting for loads never started."""
    from types import SimpleNamespace

    e, prompt = saved_hybrid(make_engine, daemon.socket, "U1", 47_000)
    # Fault injection: the full group's block table shows a hole where the load must go.
    sched = e.connector.scheduler
    plan = sched.update_state_after_alloc

    def holed(request, blocks, n):
        ids = [list(b) for b in blocks.get_block_ids()]
        ids[0][1] = 0
        plan(request, SimpleNamespace(get_block_ids=lambda: tuple(ids)), n)

    sched.update_state_after_alloc = holed
    r = e.add(request("U2", prompt))
    loads, out = loaded_then_scheduled(e, "U2")
    sched.update_state_after_alloc = plan
    assert loads == []  # nothing planned
    assert out.num_scheduled_tokens["U2"] == len(prompt)  # computed from the start
    assert r.num_computed_tokens == len(prompt)
    assert_group_kv(e, "U2", prompt, 0, range(4))
    finish(e, "U2")
