#!/usr/bin/env python3
"""Independent reference implementation of kvcached block keys and the Dynamo hash.

Written from docs/block-keys.md alone (it does not call or read the Rust code). It checks every
vector of proto/tests/data/block_keys.json, context_keys.json, dynamo_hashes.json and
engine_hashes.json and exits non-zero on any mismatch.

    python3 -m venv .venv && .venv/bin/pip install blake3 xxhash
    .venv/bin/python proto/tests/reference_keys.py [DATA_DIR]
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

try:
    import blake3
    import xxhash
except ImportError as e:  # pragma: no cover
    sys.exit(f"missing package ({e}); run: pip install blake3 xxhash")

# --- section 2: namespace encoding -------------------------------------------------------------

ENCODING_VERSION = 0x02
DTYPE_CODES = {"f16": 0x01, "bf16": 0x02, "f32": 0x03, "fp8_e4m3": 0x04, "fp8_e5m2": 0x05, "int8": 0x06}
LAYOUT_KIND_CODES = {"layer_separate": 0x01, "contiguous": 0x02}
U32_MAX = 0xFFFFFFFF

FINGERPRINT_CONTEXT = "kvcached 2026-11-30 namespace fingerprint v2"
ID_CONTEXT = "kvcached 2026-11-30 namespace id v2"


DYNAMO_SEED = 1337


def u32le(x: int) -> bytes:
    if not 0 <= x <= U32_MAX:
        raise ValueError(f"{x} does not fit in u32")
    return struct.pack("<I", x)


def u64le(x: int) -> bytes:
    return struct.pack("<Q", x)


def enc_bytes(b: bytes) -> bytes:
    return u32le(len(b)) + b


def enc_opt(b: bytes | None) -> bytes:
    return b"\x00" if b is None else b"\x01" + enc_bytes(b)


DTYPE_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}


class Refused(ValueError):
    """A namespace the spec refuses; `field` is the field at fault (or `layout`)."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


def hex_field(ns: dict, field: str) -> bytes | None:
    if ns[field] is None:
        return None
    try:
        return bytes.fromhex(ns[field])
    except ValueError as e:
        raise Refused(field, f"not hex: {e}") from None


def canonical_bytes(ns: dict) -> bytes:
    model = ns["model_id"].encode("utf-8")
    if not model:
        raise Refused("model_id", "must not be empty")
    for f in ("num_layers", "kv_heads", "head_dim", "tokens_per_block"):
        if not 0 < ns[f] <= U32_MAX:
            raise Refused(f, "out of range")
    if ns["dtype"] not in DTYPE_CODES:
        raise Refused("dtype", "unknown name")
    if ns["layout_kind"] not in LAYOUT_KIND_CODES:
        raise Refused("layout_kind", "unknown name")
    block_bytes = (ns["tokens_per_block"] * ns["kv_heads"] * ns["head_dim"] * DTYPE_BYTES[ns["dtype"]]
                   * ns["num_layers"] * 2)
    if block_bytes > 2**64 - 1:
        raise Refused("layout", "bytes per block overflow 64 bits")
    salt = hex_field(ns, "tenant_salt_hex")
    adapter = None if ns["adapter_id"] is None else ns["adapter_id"].encode("utf-8")
    extra = hex_field(ns, "extra_hex")
    return (
        bytes([ENCODING_VERSION])
        + enc_bytes(model)
        + u32le(ns["num_layers"])
        + u32le(ns["kv_heads"])
        + u32le(ns["head_dim"])
        + bytes([DTYPE_CODES[ns["dtype"]]])
        + u32le(ns["tokens_per_block"])
        + bytes([LAYOUT_KIND_CODES[ns["layout_kind"]]])
        + enc_opt(salt)
        + enc_opt(adapter)
        + enc_opt(extra)
    )


# --- sections 3 and 4: fingerprint and id ------------------------------------------------------


def fingerprint(canonical: bytes) -> bytes:
    return blake3.blake3(canonical, derive_key_context=FINGERPRINT_CONTEXT).digest()


def namespace_id(fp: bytes) -> bytes:
    return blake3.blake3(fp, derive_key_context=ID_CONTEXT).digest()[:16]


# --- section 5: block keys ---------------------------------------------------------------------


def tokens_le(tokens: list[int]) -> bytes:
    return b"".join(u32le(t) for t in tokens)


def block_keys(fp: bytes, block_size: int, tokens: list[int]) -> list[bytes]:
    keys: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):  # full blocks only
        block = tokens[start : start + block_size]
        hash_key = keys[-1] + fp[16:] if keys else fp
        keys.append(blake3.blake3(tokens_le(block), key=hash_key).digest()[:16])
    return keys


# --- section 6: key contexts ------------------------------------------------------------------


def context_of(c: dict) -> dict:
    """The context of a vector, checked against every rule of section 6 (Refused otherwise)."""

    def unhex(field: str, h: str) -> bytes:
        try:
            return bytes.fromhex(h)
        except ValueError as e:
            raise Refused(field, f"not hex: {e}") from None

    name = c["adapter_name"]
    adapter_hash = unhex("adapter_hash", c["adapter_hash_hex"])
    if name is None and adapter_hash:
        raise Refused("adapter_hash", "a hash without an adapter name")
    if name is not None:
        if not 1 <= len(name.encode("utf-8")) <= 1024:
            raise Refused("adapter.name", "must be 1..1024 bytes")
        if len(adapter_hash) > 64:
            raise Refused("adapter.content_hash", "at most 64 bytes")
    salt = None if c["cache_salt_hex"] is None else unhex("cache_salt", c["cache_salt_hex"])
    if salt is not None and not 1 <= len(salt) <= 4096:
        raise Refused("cache_salt", "must be 1..4096 bytes")
    if len(c["mm"]) > 65536:
        raise Refused("mm", "too many inputs")
    mm = []
    end = 0
    for m in c["mm"]:
        h = unhex("mm.hash", m["hash_hex"])
        if not 1 <= len(h) <= 64:
            raise Refused("mm.hash", "must be 1..64 bytes")
        if m["length"] == 0 or m["offset"] + m["length"] > U32_MAX:
            raise Refused("mm.length", "zero, or ends past 2^32 - 1")
        if m["offset"] < end:
            raise Refused("mm.offset", "out of order or overlapping")
        end = m["offset"] + m["length"]
        mm.append((h, m["offset"], m["length"]))
    if len(c["block_extras"]) > 1 << 20:
        raise Refused("block_extras", "too many entries")
    extras = {}
    prev = -1
    for e in c["block_extras"]:
        d = unhex("block_extras.data", e["data_hex"])
        if not 1 <= len(d) <= 64:
            raise Refused("block_extras.data", "must be 1..64 bytes")
        if e["block"] <= prev:
            raise Refused("block_extras.block", "not strictly increasing")
        prev = e["block"]
        extras[e["block"]] = d
    return {"adapter": None if name is None else (name.encode("utf-8"), adapter_hash), "salt": salt, "mm": mm,
            "extras": extras}


def block_extras(ctx: dict, i: int, block_size: int) -> bytes:
    out = b""
    if i == 0 and ctx["adapter"] is not None:
        out += b"\x01" + enc_bytes(ctx["adapter"][0]) + enc_bytes(ctx["adapter"][1])
    if i == 0 and ctx["salt"] is not None:
        out += b"\x02" + enc_bytes(ctx["salt"])
    for h, offset, length in ctx["mm"]:
        if offset < (i + 1) * block_size and offset + length > i * block_size:
            out += b"\x03" + enc_bytes(h) + u32le(offset) + u32le(length)
    if i in ctx["extras"]:
        out += b"\x04" + enc_bytes(ctx["extras"][i])
    return out


def context_keys(fp: bytes, block_size: int, tokens: list[int], ctx: dict) -> tuple[list[bytes], dict[int, bytes]]:
    keys: list[bytes] = []
    extras: dict[int, bytes] = {}
    for i, start in enumerate(range(0, len(tokens) - block_size + 1, block_size)):
        e = block_extras(ctx, i, block_size)
        if e:
            extras[i] = e
        hash_key = keys[-1] + fp[16:] if keys else fp
        keys.append(blake3.blake3(tokens_le(tokens[start : start + block_size]) + e, key=hash_key).digest()[:16])
    return keys, extras


# --- section 9: Dynamo hash --------------------------------------------------------------------


def xxh3(data: bytes, seed: int) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=seed)


def dynamo_hashes(tokens: list[int], block_size: int, seed: int) -> tuple[list[int], list[int]]:
    local: list[int] = []
    seq: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = xxh3(tokens_le(tokens[start : start + block_size]), seed)
        local.append(h)
        seq.append(h if not seq else xxh3(u64le(seq[-1]) + u64le(h), seed))
    return local, seq


def dynamo_request_seed(lora_name: str | None, cache_namespace: str | None) -> int:
    seed = DYNAMO_SEED
    if lora_name:
        seed = (seed + xxh3(lora_name.encode("utf-8"), 0)) % 2**64
    if cache_namespace:
        seed = (seed + xxh3(cache_namespace.encode("utf-8"), 1)) % 2**64
    return seed


def dynamo_request_hashes(tokens: list[int], block_size: int, local_seed: int) -> list[int]:
    seq: list[int] = []
    for h in dynamo_hashes(tokens, block_size, local_seed)[0]:
        seq.append(h if not seq else xxh3(u64le(seq[-1]) + u64le(h), DYNAMO_SEED))
    return seq


# --- section 11: token generator ---------------------------------------------------------------


def expand(segments: list[dict]) -> list[int]:
    out: list[int] = []
    for s in segments:
        m = s["mod"]
        if not 1 <= m <= 1 << 32:
            raise ValueError(f"bad mod {m}")
        out.extend((s["start"] + k * s["mul"]) % m for k in range(s["count"]))
    return out


# --- checks ------------------------------------------------------------------------------------


class Checker:
    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0

    def check(self, what: str, got, want) -> None:
        if got == want:
            self.passed += 1
        else:
            self.failed += 1
            print(f"FAIL {what}\n  expected {want!r}\n  computed {got!r}")


def check_block_keys(c: Checker, path: Path) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    for v in doc["vectors"]:
        name = v["name"]
        ns = v["namespace"]
        tokens = expand(v["tokens"])
        c.check(f"{name}: token_count", len(tokens), v["token_count"])
        canon = canonical_bytes(ns)
        c.check(f"{name}: canonical bytes", canon.hex(), v["canonical_hex"])
        fp = fingerprint(canon)
        c.check(f"{name}: fingerprint", fp.hex(), v["fingerprint_hex"])
        c.check(f"{name}: namespace id", namespace_id(fp).hex(), v["namespace_id_hex"])
        keys = [k.hex() for k in block_keys(fp, ns["tokens_per_block"], tokens)]
        c.check(f"{name}: number of keys", len(keys), len(tokens) // ns["tokens_per_block"])
        c.check(f"{name}: number of keys in file", len(v["keys"]), len(keys))
        for i, (got, want) in enumerate(zip(keys, v["keys"])):
            c.check(f"{name}: key {i}", got, want)
    for r in doc["rejections"]:
        try:
            canonical_bytes(r["namespace"])
            c.check(f"rejection {r['name']}: refused", "accepted", f"refused at {r['field']}")
        except Refused as e:
            c.check(f"rejection {r['name']}: field at fault", e.field, r["field"])
    print(f"{path.name}: {len(doc['vectors'])} vectors, {len(doc['rejections'])} rejections")


def check_contexts(c: Checker, path: Path) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    for v in doc["vectors"]:
        name = v["name"]
        ns = v["namespace"]
        tokens = expand(v["tokens"])
        c.check(f"{name}: token_count", len(tokens), v["token_count"])
        fp = fingerprint(canonical_bytes(ns))
        keys, extras = context_keys(fp, ns["tokens_per_block"], tokens, context_of(v["context"]))
        c.check(f"{name}: extras", [{"block": b, "hex": e.hex()} for b, e in sorted(extras.items())], v["extras"])
        c.check(f"{name}: keys", [k.hex() for k in keys], v["keys"])
    for r in doc["rejections"]:
        try:
            context_of(r["context"])
            c.check(f"context rejection {r['name']}: refused", "accepted", f"refused at {r['field']}")
        except Refused as e:
            c.check(f"context rejection {r['name']}: field at fault", e.field, r["field"])
    for v in doc["dynamo_seeds"]:
        name = v["name"]
        seed = dynamo_request_seed(v["lora_name"], v["cache_namespace"])
        c.check(f"{name}: local seed", str(seed), v["local_seed_dec"])
        hashes = dynamo_request_hashes(expand(v["tokens"]), v["block_size"], seed)
        c.check(f"{name}: hashes", [f"{h:016x}" for h in hashes], v["sequence_hashes_hex"])
    print(f"{path.name}: {len(doc['vectors'])} vectors, {len(doc['rejections'])} rejections, "
          f"{len(doc['dynamo_seeds'])} Dynamo seeds")


def check_dynamo(c: Checker, path: Path) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    for v in doc["vectors"]:
        name = v["name"]
        tokens = expand(v["tokens"])
        c.check(f"{name}: token_count", len(tokens), v["token_count"])
        local, seq = dynamo_hashes(tokens, v["block_size"], v["seed"])
        c.check(f"{name}: number of hashes", len(seq), len(tokens) // v["block_size"])
        for field, want in (
            ("local_hashes_hex", [f"{h:016x}" for h in local]),
            ("sequence_hashes_hex", [f"{h:016x}" for h in seq]),
            ("sequence_hashes_dec", [str(h) for h in seq]),
        ):
            c.check(f"{name}: number of {field}", len(v[field]), len(want))
            for i, (got, exp) in enumerate(zip(want, v[field])):
                c.check(f"{name}: {field}[{i}]", got, exp)
    print(f"{path.name}: {len(doc['vectors'])} vectors")


def engine_hash_keys(fp: bytes, scheme: str, hashes: list[bytes]) -> list[bytes]:
    """Section 7: each hash's key under the namespace's engine-hash PRF key."""
    key = blake3.blake3(fp, derive_key_context="kvcached 2026-12-06 engine page hash v1").digest()
    return [blake3.blake3(enc_bytes(scheme.encode()) + enc_bytes(h), key=key).digest()[:16] for h in hashes]


def sglang_page_hashes(tokens: list[int], page: int) -> list[bytes]:
    """Section 7, scheme sglang: SHA-256 over the previous page's digest and the page's tokens."""
    out: list[bytes] = []
    for i in range(len(tokens) // page):
        prev = out[-1] if out else b""
        out.append(hashlib.sha256(prev + tokens_le(tokens[i * page : (i + 1) * page])).digest())
    return out


def check_engine_hashes(c: Checker, path: Path) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    for v in doc["vectors"]:
        name = v["name"]
        ns = v["namespace"]
        tokens = expand(v["tokens"])
        c.check(f"{name}: token_count", len(tokens), v["token_count"])
        if v["derived"]:
            hashes = sglang_page_hashes(tokens, ns["tokens_per_block"])
            c.check(f"{name}: hashes", [h.hex() for h in hashes], v["hashes_hex"])
        else:
            hashes = [bytes.fromhex(h) for h in v["hashes_hex"]]
        fp = fingerprint(canonical_bytes(ns))
        c.check(f"{name}: keys", [k.hex() for k in engine_hash_keys(fp, v["scheme"], hashes)], v["keys"])
    print(f"{path.name}: {len(doc['vectors'])} vectors")


def self_test(c: Checker) -> None:
    """Facts from the text of docs/block-keys.md, independent of the JSON files."""
    c.check("u32le(16)", u32le(16).hex(), "10000000")
    c.check("opt(None)", enc_opt(None).hex(), "00")
    c.check("opt(empty)", enc_opt(b"").hex(), "0100000000")
    ns = {
        "model_id": "Qwen/Qwen3-0.6B", "num_layers": 28, "kv_heads": 8, "head_dim": 128,
        "dtype": "bf16", "tokens_per_block": 16, "layout_kind": "layer_separate",
        "tenant_salt_hex": "73616c74", "adapter_id": None, "extra_hex": None,
    }
    canon = canonical_bytes(ns)
    c.check("worked example: canonical", canon.hex(),
            "020f0000005177656e2f5177656e332d302e36421c0000000800000080000000021000000001010400000073616c740000")
    fp = fingerprint(canon)
    c.check("worked example: fingerprint", fp.hex(),
            "feb112d2c498b68cb4c6e77de2c8747527d225cb8100a542e310214c1fe84b9e")
    c.check("worked example: id", namespace_id(fp).hex(), "85ff298061f6d3935da3c13d40dd856c")
    keys = [k.hex() for k in block_keys(fp, 16, list(range(47)))]
    c.check("worked example: keys (47 tokens -> 2 keys)", keys,
            ["87f8e357387eb4638979afd29a96da0c", "be80cd7edee640f9e0cc27b2de94d04d"])
    _, seq = dynamo_hashes(list(range(32)), 16, DYNAMO_SEED)
    c.check("worked example: dynamo", seq, [15310707395893867146, 13769157705258532664])


def main() -> int:
    data = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "data"
    c = Checker()
    self_test(c)
    check_block_keys(c, data / "block_keys.json")
    check_dynamo(c, data / "dynamo_hashes.json")
    check_contexts(c, data / "context_keys.json")
    check_engine_hashes(c, data / "engine_hashes.json")
    print(f"{c.passed} passed, {c.failed} failed")
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
