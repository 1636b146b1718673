"""vLLM's KV events with the kvstore connector, through ``vllm serve``: what a router
subscribed to the engine learns of the disk.

Two lives of one server (CPU, the tiny Llama, block 32, ``--kv-events-config`` with a
ZMQ publisher), one store of 7 blocks' capacity, a subscriber in the vLLM venv
(``kv_events_probe.py``: a SUB socket, vLLM's own ``KVEventBatch`` decoder, gaps filled
from the replay endpoint).

* Life 1: ``LONG`` is served: kvstore announces (``BlockStored``, medium ``STORAGE``)
  exactly the blocks the GPU tier announced, with the same hashes, parents and tokens.
  ``OTHER`` is served: the store evicts ``LONG``'s tail, announced as ``BlockRemoved``.
  After the life, what the store holds is what was announced and not removed.
* Between the lives: a block of another key scope is put into the store, and a block
  of ``LONG`` is corrupted on disk.
* Life 2: the start-up replay announces every stored block of the scope and nothing
  else; ``LONG`` is served again, its corrupt block fails its checksum, is quarantined
  and is announced removed.  Then a weight update's reset (``reset_prefix_cache``
  with ``reset_external``) withdraws every block announced.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import kvstore
from kvstore.integrations.vllm import block_tags
from kvstore.integrations.vllm.block_tags import BlockInfo, scoped_tag
from kvstore.testing import parts
from tests.conformance import flip_payload_bit
from tests.integrations.vllm.test_vllm import (
    _CPUS,
    BLOCK,
    HERE,
    LONG,
    REPO,
    TP_ENV,
    VLLM_PYTHON,
    tiny_model,
)
from tests.integrations.vllm.test_vllm_metrics import Server, _free_port, _http, serve

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv")
__all__ = ["tiny_model"]

OTHER = ("a list of rivers : the nile , the amazon , the danube , the rhine , the volga , "
         "the mekong , the thames , the seine . ") * 5
SLOT = 36864  # a block of the tiny Llama: 2 layers x K,V x 32 tokens x 2 heads x 32 x fp32
WAIT_S = 300


def low64(h: bytes) -> int:
    """vLLM's published form of a block hash (``maybe_convert_block_hash``)."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


class Events:
    """The subscriber's lines, as they arrive."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.items: list[dict[str, Any]] = []
        self.server: Server | None = None  # the engine's log, shown when a wait fails
        self._cond = threading.Condition()
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.items.append(json.loads(line))
                self._cond.notify_all()

    def wait(self, done: Any, what: str) -> list[dict[str, Any]]:
        """The events once ``done(events)`` holds (waiting for more as they come)."""
        deadline = time.monotonic() + WAIT_S
        with self._cond:
            while not done(self.items):
                left = deadline - time.monotonic()
                log = "".join(self.server.lines[-60:]) if self.server else ""
                assert left > 0 and (self.server is None or self.server.proc.poll() is None), \
                    f"never saw {what}; events: {self.items}\n{log}"
                self._cond.wait(min(left, 5.0))  # (and look at the engine again)
            return list(self.items)


def storage(events: list[dict[str, Any]], kind: str) -> list[int]:
    return [h for e in events if e["type"] == kind and e["medium"] == "STORAGE"
            for h in e["hashes"]]


def view(events: list[dict[str, Any]]) -> set[int]:
    """What a router believes the disk holds, from the events in order."""
    held: set[int] = set()
    for e in events:
        if e["medium"] == "STORAGE":
            if e["type"] == "BlockStored":
                held.update(e["hashes"])
            else:
                held.difference_update(e["hashes"])
    return held


def gpu_stored(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """GPU-tier blocks: hash -> (parent, tokens)."""
    out = {}
    for e in events:
        if e["type"] == "BlockStored" and e["medium"] == "GPU":
            parent = e["parent"]
            for i, h in enumerate(e["hashes"]):
                out[h] = {"parent": parent, "tokens": e["token_ids"][i * BLOCK:(i + 1) * BLOCK]}
                parent = h
    return out


def storage_stored(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out = {}
    for e in events:
        if e["type"] == "BlockStored" and e["medium"] == "STORAGE":
            assert e["locality"] == "LOCAL" and e["ownership"] == "kvstore"
            assert e["group_idx"] == 0 and e["kind"] == "full_attention"
            parent = e["parent"]
            for i, h in enumerate(e["hashes"]):
                out[h] = {"parent": parent, "tokens": e["token_ids"][i * BLOCK:(i + 1) * BLOCK]}
                parent = h
    return out


@contextmanager
def serving(tmp: Path, model: Path, store: Path, capacity: int = 7 * SLOT,
            args: tuple[str, ...] = (), env_extra: dict[str, str] | None = None
            ) -> Iterator[tuple[Server, Events]]:
    port = _free_port()
    # vLLM binds ipc:// (and tcp://*) endpoints, and connects to any other.
    pub, rep = f"ipc://{tmp}/events", f"ipc://{tmp}/events-replay"
    config = {"kv_connector": "KVStoreConnector",
              "kv_connector_module_path": "kvstore.integrations.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"path": str(store), "extent_bytes": 4 << 20,
                                            "capacity_bytes": capacity}}
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": pub, "replay_endpoint": rep}
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
           str(model), "--served-model-name", "tiny", "--host", "127.0.0.1", "--port",
           str(port), "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK),
           "--max-model-len", "1024", "--max-num-seqs", "4", "--enable-prefix-caching",
           "--kv-cache-memory-bytes", str(64 << 20), "--kv-transfer-config",
           json.dumps(config), "--kv-events-config", json.dumps(events_config), *args]
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_SERVER_DEV_MODE="1", **(env_extra or {}))
    probe = subprocess.Popen(  # subscribed before the engine starts: it misses nothing
        [str(VLLM_PYTHON), str(HERE / "kv_events_probe.py"), pub, rep], env=env,
        stdout=subprocess.PIPE, text=True)
    try:
        events = Events(probe)
        with serve(cmd, env, tmp, port) as srv:
            events.server = srv
            yield srv, events
    finally:
        probe.kill()
        probe.wait()


def held(store: Path) -> dict[int, bytes]:
    """What the store holds of the engine's scope (low-64 hash -> key), from its tags;
    the engine's scope is the one most blocks are tagged with."""
    with kvstore.open_blocking(store, create=False) as s:
        blocks = [b for page in s.snapshot() for b in page if b.tag is not None]
    scopes = [b.tag[:block_tags.SCOPE_BYTES] for b in blocks if b.tag]
    scope = max(set(scopes), key=scopes.count)
    return {low64(block_tags.decode(b.tag[block_tags.SCOPE_BYTES:]).hash): b.key
            for b in blocks if b.tag and b.tag.startswith(scope)}


@pytest.fixture(scope="module")
def lives(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("kv-events")
    store = tmp / "store"
    out: dict[str, Any] = {}
    with serving(tmp, tiny_model, store) as (srv, events):
        srv.complete(LONG)
        gpu = gpu_stored(events.items)
        out["long_gpu"] = events.wait(
            lambda ev: (g := gpu_stored(ev)) and set(g) <= set(storage_stored(ev)),
            "kvstore announcing LONG's blocks")
        gpu = gpu_stored(out["long_gpu"])
        out["long"] = list(gpu)
        srv.complete(OTHER)
        out["life1"] = events.wait(
            lambda ev: set(gpu_stored(ev)) <= set(storage_stored(ev))
            and storage(ev, "BlockRemoved"), "kvstore's evictions")
    out["held1"] = held(store)
    # Another scope's block in the same store, and LONG's first block corrupted.
    other_tag = scoped_tag(b"\x5a" * block_tags.SCOPE_BYTES,
                           block_tags.encode(BlockInfo(b"\x77" * 32, None, (1, 2))))
    first = out["held1"][out["long"][0]]
    with kvstore.open_blocking(store, create=False) as s:
        s.put_many([b"\x01" * 16], [s.get_many([first])[0]], tags=[other_tag])
        entry = parts(s).index.get_entries([first])[0]
    assert entry is not None
    flip_payload_bit(store, entry)
    out["held2"] = held(store)
    with serving(tmp, tiny_model, store) as (srv, events):
        out["replay"] = events.wait(lambda ev: set(storage_stored(ev)) >= set(out["held2"]),
                                    "the replay")
        assert _http(srv.base + "/health", timeout=5) is not None
        srv.complete(LONG)
        out["life2"] = events.wait(lambda ev: out["long"][0] in storage(ev, "BlockRemoved"),
                                   "the quarantined block removed")
        # A weight update's reset: the key scope moves to a fresh one (the weight files
        # did not change), every block announced is withdrawn, and nothing is replayed.
        before = len(events.items)
        out["view_before_reset"] = view(events.items)
        assert json.loads(_http(srv.base + "/reset_prefix_cache?reset_external=true",
                                {}))["success"] is True
        out["reset"] = events.wait(lambda ev: len(ev) > before and not view(ev),
                                   "every announced block withdrawn")[before:]
    return out


def test_kvstore_announces_the_gpu_tiers_blocks_with_the_same_hashes(
        lives: dict[str, Any]) -> None:
    events = lives["long_gpu"]
    gpu, disk = gpu_stored(events), storage_stored(events)
    assert len(lives["long"]) == 5  # LONG's full blocks
    assert set(disk) == set(gpu)
    for h, block in gpu.items():
        assert disk[h] == block  # same parent, same tokens
    assert len(storage(events, "BlockStored")) == len(disk)  # each block once


def test_at_capacity_the_evicted_blocks_are_removed(lives: dict[str, Any]) -> None:
    events = lives["life1"]
    removed = storage(events, "BlockRemoved")
    announced = storage(events, "BlockStored")
    assert set(removed) <= set(lives["long"])  # leaf first: LONG's tail, not OTHER's
    assert lives["long"][-1] in removed
    assert set(announced) - set(removed) == set(lives["held1"])
    assert len(lives["held1"]) <= 7


def test_a_restart_replays_exactly_the_scopes_blocks(lives: dict[str, Any]) -> None:
    replay = lives["replay"]
    first_gpu = min((e["seq"] for e in replay if e["medium"] == "GPU"), default=None)
    before = [e for e in replay if first_gpu is None or e["seq"] < first_gpu]
    replayed = storage_stored(before)
    assert set(replayed) == set(lives["held2"])
    order = storage(before, "BlockStored")
    for h, block in replayed.items():  # each after its parent (routers need it)
        assert block["parent"] is None or order.index(block["parent"]) < order.index(h)
    assert low64(b"\x77" * 32) not in storage(replay, "BlockStored")
    assert len(storage(before, "BlockStored")) == len(lives["held2"])


def test_a_quarantined_block_is_removed(lives: dict[str, Any]) -> None:
    events = lives["life2"]
    assert lives["long"][0] in storage(events, "BlockRemoved")


@pytest.fixture(scope="module")
def tp_life(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> list[dict[str, Any]]:
    """Tensor parallel 2 (one worker process per rank, each with its own store): LONG,
    then OTHER, each until kvstore announced its blocks (the ranks' puts finish at
    different steps)."""
    if len(_CPUS) < 2:
        pytest.skip(f"tensor parallel 2 on CPU needs 2 CPUs to bind, this process has {_CPUS}")
    tmp = tmp_path_factory.mktemp("kv-events-tp")
    with serving(tmp, tiny_model, tmp / "store", 64 * SLOT,
                 ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"),
                 TP_ENV) as (srv, events):
        srv.complete(LONG)
        events.wait(lambda ev: (g := gpu_stored(ev)) and set(g) <= set(storage_stored(ev)),
                    "kvstore announcing LONG's blocks")
        srv.complete(OTHER)  # later steps: a second announcement of LONG's would show
        return events.wait(lambda ev: len(gpu_stored(ev)) > 5
                           and set(gpu_stored(ev)) <= set(storage_stored(ev)),
                           "kvstore announcing OTHER's blocks")


@pytest.mark.slow
def test_tensor_parallel_gives_one_event_per_block(tp_life: list[dict[str, Any]]) -> None:
    gpu, disk = gpu_stored(tp_life), storage_stored(tp_life)
    assert set(disk) == set(gpu) and len(disk) > 5
    for h, block in gpu.items():
        assert disk[h] == block
    announced = storage(tp_life, "BlockStored")
    assert sorted(announced) == sorted(set(announced))  # once, not once per rank
    assert not storage(tp_life, "BlockRemoved")


def test_a_reset_withdraws_every_announced_block(lives: dict[str, Any]) -> None:
    reset = lives["reset"]
    assert lives["view_before_reset"]  # something was announced
    assert set(storage(reset, "BlockRemoved")) >= lives["view_before_reset"]
    assert not storage(reset, "BlockStored")  # the fresh scope holds nothing to replay
