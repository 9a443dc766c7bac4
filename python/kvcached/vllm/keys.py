"""What a vLLM request's blocks depend on besides its token ids, as a `kvcached.KeyContext`
(docs/block-keys.md section 6).

vLLM's own prefix cache keys such requests with extra keys per block
(`vllm/v1/core/kv_cache_utils.py`, `generate_block_hash_extra_keys`): the LoRA adapter's name
and path, each multimodal input's identifier in the blocks it overlaps, the cache salt in the
first block, a hash of each block's prompt embeddings. The connector hands the daemon the same
facts, so that a request's blocks are found only by requests whose KV is the same:

- a LoRA adapter: its name and a hash of its weights (the files of `lora_path` when the
  scheduler can read them; else of the path itself, as vLLM does);
- multimodal inputs: each feature's `identifier` (vLLM's hash of the item, with the adapter's
  prefix when there is one) at its placeholder range `mm_position`;
- `cache_salt`;
- prompt embeddings: SHA-256 of each full block's rows (vLLM's own per-block hash).

Requests with none of them have no context: their keys are the plain chain.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import kvcached

log = logging.getLogger("kvcached.vllm")

# Files of an adapter directory read to hash its weights (vLLM's PEFT loader reads these).
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "new_embeddings.safetensors")
# Identifiers longer than a key-context hash may be (64 bytes) are hashed to 32.
_MAX_HASH = 64


@dataclass(frozen=True)
class ContextArgs:
    """A request's key context as plain data (it travels to the workers pickled, in the step's
    metadata); `make()` builds the `kvcached.KeyContext`."""

    adapter_name: str | None = None
    adapter_hash: bytes = b""
    cache_salt: bytes | None = None
    mm: tuple[tuple[bytes, int, int], ...] = ()
    block_extras: tuple[tuple[int, bytes], ...] = ()

    def make(self) -> Any:
        return kvcached.KeyContext(
            adapter_name=self.adapter_name,
            adapter_hash=self.adapter_hash,
            cache_salt=self.cache_salt,
            mm=list(self.mm),
            block_extras=list(self.block_extras),
        )


class AdapterHashes:
    """Hashes of adapters' weights, computed once per (path, size, mtime) of their files."""

    def __init__(self) -> None:
        self._memo: dict[tuple, bytes] = {}
        self._told: set[str] = set()

    def of(self, name: str, path: str) -> bytes:
        files = []
        if path and os.path.isdir(path):
            for f in _ADAPTER_FILES:
                p = os.path.join(path, f)
                if os.path.isfile(p):
                    st = os.stat(p)
                    files.append((p, st.st_size, st.st_mtime_ns))
        if not files:
            # Not a local adapter directory (a hub id the workers resolve, or none): the path
            # names the weights, as in vLLM's own prefix cache.
            if name not in self._told:
                self._told.add(name)
                log.info("kvcached connector: LoRA %r keyed by its path %r (no adapter files here to hash)", name, path)
            return hashlib.blake2b(b"path\0" + path.encode(), digest_size=32).digest()
        key = tuple(files)
        h = self._memo.get(key)
        if h is None:
            d = hashlib.blake2b(b"files\0", digest_size=32)
            for p, size, _ in files:
                d.update(os.path.basename(p).encode() + b"\0" + size.to_bytes(8, "little"))
                with open(p, "rb") as fh:
                    for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                        d.update(chunk)
            h = d.digest()
            self._memo[key] = h
        return h


def _hash_bytes(identifier: str) -> bytes:
    b = identifier.encode()
    return b if 0 < len(b) <= _MAX_HASH else hashlib.blake2b(b, digest_size=32).digest()


def prompt_embeds_hashes(embeds: Any, block_size: int, blocks: int) -> tuple[tuple[int, bytes], ...]:
    """SHA-256 of each of the first `blocks` full blocks' rows of a request's prompt embeddings."""
    from vllm.v1.utils import tensor_data

    return tuple(
        (i, hashlib.sha256(tensor_data(embeds[i * block_size : (i + 1) * block_size])).digest())
        for i in range(min(blocks, embeds.shape[0] // block_size))
    )


def request_context(request: Any, adapters: AdapterHashes, block_size: int) -> tuple[ContextArgs | None, str | None]:
    """`(context, None)` for a request kvcached serves (`context` None: the plain chain), or
    `(None, reason)` for one it cannot key."""
    lora = getattr(request, "lora_request", None)
    salt = getattr(request, "cache_salt", None)
    features = getattr(request, "mm_features", None) or []
    embeds = getattr(request, "prompt_embeds", None)
    if lora is None and not salt and not features and embeds is None:
        return None, None
    mm = []
    end = 0
    for f in sorted(features, key=lambda f: f.mm_position.offset):
        pos = f.mm_position
        if not f.identifier:
            return None, "a multimodal input without an identifier"
        if pos.length <= 0 or pos.offset < end:
            return None, "multimodal inputs whose placeholder ranges overlap"
        end = pos.offset + pos.length
        mm.append((_hash_bytes(f.identifier), int(pos.offset), int(pos.length)))
    extras: tuple[tuple[int, bytes], ...] = ()
    if embeds is not None:
        extras = prompt_embeds_hashes(embeds, block_size, embeds.shape[0] // block_size)
    salt_b = salt.encode() if isinstance(salt, str) else (bytes(salt) if salt else None)
    if salt_b is not None and len(salt_b) > 4096:
        salt_b = hashlib.blake2b(salt_b, digest_size=32).digest()
    return (
        ContextArgs(
            adapter_name=lora.lora_name if lora is not None else None,
            adapter_hash=adapters.of(lora.lora_name, lora.lora_path) if lora is not None else b"",
            cache_salt=salt_b or None,
            mm=tuple(mm),
            block_extras=extras,
        ),
        None,
    )


# A request's keys as SGLang's page hashes of its tokens, derived by the daemon.
_SGLANG_KEYS = kvcached.EngineHashes("sglang")


def key_kwargs(key_context: Any, key_scheme: str) -> dict[str, Any]:
    """The keyword arguments that key a request's lookups, loads and saves: its key context,
    or (`kvcached.key_scheme` "sglang", a request with no context) SGLang's page hashes of its
    tokens, which SGLang engines with kvcached's HiCache backend key the same blocks by."""
    if key_context is None and key_scheme == "sglang":
        return {"hashes": _SGLANG_KEYS}
    return {"context": key_context}
