"""Subscribe to an engine's KV events as a router does, and print each event as a JSON
line.  Run with the vLLM venv's python (tests/integrations/vllm/test_vllm_kv_events.py
does)::

    python tests/integrations/vllm/kv_events_probe.py PUB_ENDPOINT REPLAY_ENDPOINT

A ZMQ SUB socket on the publisher, each ``KVEventBatch`` decoded with vLLM's own msgspec
classes.  A batch whose sequence number skips ahead (the first ones, published before
this subscription was joined, or any lost on the way) has the missing ones asked for
on the replay (ROUTER) endpoint first, so every batch of the engine's life is printed,
in order.  One line per event: ``{"seq", "type", "medium", "hashes", "parent",
"token_ids", "group_idx", "kind", "locality", "ownership"}``; ``READY`` once subscribed.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch

_END_SEQ = (-1).to_bytes(8, "big", signed=True)


def lines(seq: int, batch: KVEventBatch) -> list[str]:
    out = []
    for e in batch.events:
        out.append(json.dumps({
            "seq": seq, "type": type(e).__name__, "medium": getattr(e, "medium", None),
            "hashes": list(getattr(e, "block_hashes", [])),
            "parent": getattr(e, "parent_block_hash", None),
            "token_ids": list(getattr(e, "token_ids", [])),
            "group_idx": getattr(e, "group_idx", None),
            "kind": getattr(e, "kv_cache_spec_kind", None),
            "locality": getattr(e, "locality", None),
            "ownership": getattr(e, "ownership", None)}))
    return out


def replay(ctx: Any, endpoint: str, start: int, decoder: Any) -> list[tuple[int, KVEventBatch]]:
    """The publisher's buffered batches from ``start`` on."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    while True:
        frames = sock.recv_multipart()
        seq_bytes, payload = frames[-2], frames[-1]
        if seq_bytes == _END_SEQ:
            break
        got.append((int.from_bytes(seq_bytes, "big"), decoder.decode(payload)))
    sock.close()
    return got


def main() -> None:
    pub, replay_endpoint = sys.argv[1], sys.argv[2]
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    print("READY", flush=True)
    expected = 0
    while True:
        _topic, seq_bytes, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if seq < expected:
            continue
        batches = [(seq, decoder.decode(payload))]
        if seq > expected:  # joined late, or lost some: ask for them, as a router does
            batches = [b for b in replay(ctx, replay_endpoint, expected, decoder)
                       if b[0] >= expected] or batches
        for s, batch in batches:
            if s >= expected:
                for line in lines(s, batch):
                    print(line, flush=True)
                expected = s + 1


if __name__ == "__main__":
    main()
