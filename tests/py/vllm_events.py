"""An independent vLLM KV-event publisher / subscriber for kvrouter's interop tests.

The structs below are written from vLLM's published event schema
(vllm/distributed/kv_events.py: EventBatch, BlockStored, BlockRemoved, AllBlocksCleared), once
with msgspec's array_like tuple encoding (what vLLM sends) and once as tagged maps. Hashes are
recomputed here with the `xxhash` package (Dynamo: XXH3-64, seed 1337, chained), not with any
kvcached code.

  publish [replay [topic] [rport N]] [port N] [heartbeat]
            binds a PUB socket (on port N if given; with "heartbeat", libzmq's ZMTP PING commands
            every 100 ms), prints its port, and once a subscriber is there (an XPUB socket, which
            sends like vLLM's PUB but sees subscriptions, so that tests know which batches a router
            heard) sends an empty batch every 50 ms until told on stdin to send the scenario's
            batches ("stored", "removed", "cleared"), exits on "quit". With "replay" it
            also binds a ROUTER replay socket as vLLM's ZmqEventPublisher does (`replay_endpoint`:
            a request `[b"", start_seq]` is answered with `[b"", seq, payload]` for every buffered
            batch from start_seq on, then `[b"", END_SEQ, b""]`; with "topic", the later vLLM form
            with the topic frame before seq), prints both ports, and takes "lost" (a batch that is
            buffered but never published, as a PUB socket drops it) and "unbuffered" (a sequence
            number neither published nor buffered); "setseq N" makes the next batch number N.
  replay ENDPOINT START  asks a replay socket (vLLM's protocol) for the batches from START on
            with a DEALER, decodes each, prints one JSON line with their sequence numbers and
            stored-block counts.
  subscribe ENDPOINT  connects a SUB socket, decodes batches until it has verified one in each
            encoding, prints one JSON line per verified batch, then "DONE".
"""
import json
import select
import struct
import sys
import time
from typing import Any, Optional, Union

import msgspec
import xxhash
import zmq

ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


# The same schema as tagged maps (msgspec's default for tagged structs).
class MapStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None


class MapRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[ExternalBlockHash]
    medium: Optional[str] = None


class MapCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class MapBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Union[MapStored, MapRemoved, MapCleared]]
    data_parallel_rank: Optional[int] = None


def dynamo_hashes(tokens, block_size, parent=None):
    out = []
    for i in range(0, len(tokens) - len(tokens) % block_size, block_size):
        local = xxhash.xxh3_64_intdigest(struct.pack("<%dI" % block_size, *tokens[i:i + block_size]), seed=1337)
        seq = local if parent is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, local), seed=1337)
        out.append(seq)
        parent = seq
    return out


BLOCK = 4
TOKENS = list(range(1000, 1012))  # 3 blocks of 4


END_SEQ = (-1).to_bytes(8, "big", signed=True)


def publish(replay=False, topic_frame=False, port=None, heartbeat=False, replay_port=None):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.XPUB_VERBOSE, 1)
    if heartbeat:
        # libzmq then sends ZMTP PING commands between messages.
        sock.setsockopt(zmq.HEARTBEAT_IVL, 100)
    if port is None:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
    else:
        sock.bind("tcp://127.0.0.1:%d" % port)
    router = None
    if replay:
        router = ctx.socket(zmq.ROUTER)
        if replay_port is None:
            replay_port = router.bind_to_random_port("tcp://127.0.0.1")
        else:
            router.bind("tcp://127.0.0.1:%d" % replay_port)
        print(port, replay_port, flush=True)
    else:
        print(port, flush=True)
    seq = 0
    buffered = []  # (seq, payload), as vLLM's deque of the last `buffer_steps` batches
    tuple_enc = msgspec.msgpack.Encoder()

    def send(batch, publish=True, buffer=True):
        nonlocal seq
        payload = tuple_enc.encode(batch)
        if publish:
            sock.send_multipart([b"", struct.pack(">Q", seq), payload])
        if buffer:
            buffered.append((seq, payload))
        seq += 1

    def serve_replay():
        while router.poll(0):
            frame = router.recv_multipart()
            client, _, start = frame
            start = int.from_bytes(start, "big")
            topic = [b""] if topic_frame else []
            for s, payload in buffered:
                if s >= start:
                    router.send_multipart([client, b""] + topic + [s.to_bytes(8, "big"), payload])
            router.send_multipart([client, b""] + topic + [END_SEQ, b""])

    subscribed = False
    while True:
        if router is not None:
            serve_replay()
        while sock.poll(0):
            if sock.recv()[:1] == b"\x01":
                subscribed = True
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        if not ready:
            if subscribed:
                send(KVEventBatch(ts=time.time(), events=[]))
            continue
        cmd = sys.stdin.readline().strip()
        if cmd in ("", "quit"):
            return
        if cmd == "lost":
            send(KVEventBatch(ts=time.time(), events=[BlockStored(
                block_hashes=[111, 222], parent_block_hash=None, token_ids=TOKENS[:8],
                block_size=BLOCK, lora_id=None, medium="GPU")]), publish=False)
        elif cmd.startswith("setseq "):
            seq = int(cmd.split()[1])
        elif cmd == "unbuffered":
            send(KVEventBatch(ts=time.time(), events=[]), publish=False, buffer=False)
        elif cmd == "stored":
            # vLLM's own hashes (opaque ints / bytes): the router must recompute from tokens.
            send(KVEventBatch(ts=time.time(), events=[BlockStored(
                block_hashes=[111, 222], parent_block_hash=None, token_ids=TOKENS[:8],
                block_size=BLOCK, lora_id=None, medium="GPU")]))
            send(MapBatch(ts=time.time(), events=[MapStored(
                block_hashes=[b"\x03" * 32], parent_block_hash=222, token_ids=TOKENS[8:12],
                block_size=BLOCK, medium="CPU")]))
        elif cmd == "removed":
            send(MapBatch(ts=time.time(), events=[MapRemoved(block_hashes=[111], medium="GPU")]))
        elif cmd == "cleared":
            send(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        elif cmd == "badsize":
            send(KVEventBatch(ts=time.time(), events=[BlockStored(
                block_hashes=[999], parent_block_hash=None, token_ids=list(range(16)),
                block_size=16, lora_id=None, medium="GPU")]))
        print("sent " + cmd, flush=True)


def subscribe(endpoint):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVTIMEO, 20000)
    sock.connect(endpoint)
    print("READY", flush=True)
    tuple_dec = msgspec.msgpack.Decoder(KVEventBatch)
    map_dec = msgspec.msgpack.Decoder(MapBatch)
    seen = set()
    last_seq = None
    while len(seen) < 2:
        topic, seq_b, payload = sock.recv_multipart()
        assert len(seq_b) == 8, seq_b
        seq = struct.unpack(">Q", seq_b)[0]
        assert last_seq is None or seq > last_seq, (last_seq, seq)
        last_seq = seq
        try:
            batch, enc = tuple_dec.decode(payload), "tuple"
        except msgspec.ValidationError:
            batch, enc = map_dec.decode(payload), "map"
        stored = [e for e in batch.events if type(e).__name__ in ("BlockStored", "MapStored")]
        report = {"encoding": enc, "seq": seq, "topic": topic.decode(), "events": []}
        for e in stored:
            want = dynamo_hashes(e.token_ids, e.block_size, e.parent_block_hash)
            assert list(e.block_hashes) == want, (e.block_hashes, want)
            report["events"].append({"medium": e.medium, "blocks": len(e.block_hashes),
                                     "parent": e.parent_block_hash, "hashes": want})
        if enc not in seen and stored:
            seen.add(enc)
            print(json.dumps(report), flush=True)
    print("DONE", flush=True)


def replay(endpoint, start):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 20000)
    sock.connect(endpoint)
    sock.send_multipart([b"", int(start).to_bytes(8, "big")])
    tuple_dec = msgspec.msgpack.Decoder(KVEventBatch)
    seqs, stored = [], []
    while True:
        frames = sock.recv_multipart()
        assert frames[0] == b"", frames
        seq_b, payload = frames[-2], frames[-1]
        if seq_b == END_SEQ:
            assert payload == b""
            break
        seqs.append(int.from_bytes(seq_b, "big"))
        batch = tuple_dec.decode(payload)
        for e in batch.events:
            if isinstance(e, BlockStored):
                assert list(e.block_hashes) == dynamo_hashes(e.token_ids, e.block_size, e.parent_block_hash)
                stored.append(len(e.block_hashes))
    print(json.dumps({"seqs": seqs, "stored": stored}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "publish":
        args = sys.argv[2:]
        port = int(args[args.index("port") + 1]) if "port" in args else None
        rport = int(args[args.index("rport") + 1]) if "rport" in args else None
        publish(replay="replay" in args, topic_frame="topic" in args, port=port, heartbeat="heartbeat" in args,
                replay_port=rport)
    elif sys.argv[1] == "replay":
        replay(sys.argv[2], sys.argv[3])
    else:
        subscribe(sys.argv[2])
