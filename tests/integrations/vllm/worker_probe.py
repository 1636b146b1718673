"""Drive the vLLM connector's worker (``WorkerSide``) through save steps and a load step
without an engine, in vLLM's order of calls, and print what happened as JSON.  Run with
the vLLM venv's python (tests/integrations/vllm/test_vllm_mover.py does)::

    python tests/integrations/vllm/worker_probe.py MODE STORE_DIR [LIBKVCUDA] [--async] [--capture] [--caps]

(or one of the flags that runs a case of its own: ``--small-load-staging``,
``--busy-load-staging``, ``--too-small``, ``--below-a-block``: see their functions and
tests/integrations/vllm/test_vllm_mover.py)

``gpu``: the KV cache is "on a GPU" that is the recording stand-in
(tests/cuda/standin.py, ``StandInGpu``: streams run only when told, in CUDA's order,
host-blocking calls recorded), the cache tensors are host memory that says it is on
``cuda:0`` and records every call that would copy device memory to the host (``.to``,
``.cpu``, ``.item``, ``.tolist``, ``.numpy``): the worker's save and load paths must
make none of either.  ``cpu``: a CPU engine, the same calls, plain copies.  ``gpu-fp8``:
``gpu`` with the store's codec ``fp8_e4m3``: saves quantised on the (stand-in) GPU by
the built library's kernel code (LIBKVCUDA, its host twins), stored as the payload;
loads staged in device memory (``device_loads`` "auto"), the payload copied there from
the store's arena and dequantised there, read back exactly as the CPU codec decodes.

Loads are synchronous (the scheduler's lookup reads them ahead, ``start_load_kv``
scatters them) or, with ``--async``, background reads finished in ``get_finished``.
The first save step runs with the store's event loop blocked (the step's presence
lookup cannot answer: the forward must not wait for it); the second after its lookup
answered (blocks stored already are not copied out).  ``--capture``: one more step
while the engine's stream "captures a CUDA graph" (the stand-in's; this torch has no
CUDA, so torch's capture query is answered from it).  ``--caps``: the copy-out caps
(``max_save_bytes_per_step`` three blocks, ``max_save_bytes_per_s`` 3.5 blocks) and a
few more save steps on the worker's rate-cap clock, which the probe moves (10 s before
each step of the flow above, so that the caps do not bite there).
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvstore.codecs import pipeline as codecs
from kvstore.cuda import _lib, copies, mover_core, paged
from kvstore.cuda import fp8 as gpu_fp8
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.metadata import KVStoreConnectorMetadata, Load, Save
from kvstore.integrations.vllm.worker.side import WorkerSide
from tests.cuda.standin import OnDevice, StandInGpu

NUM_BLOCKS, LAYERS = 12, 3
SHAPE = (2, NUM_BLOCKS, 4, 2, 8)   # [2, blocks, block_size, heads, head_dim]
COMPUTE = 0                        # the engine's stream (torch without CUDA: stream 0)
# Only bounds a failure: a forward that waits for the blocked store would hang the probe.
HANG_S = 120


class Conn:
    meta: KVStoreConnectorMetadata | None = None

    def _get_connector_metadata(self) -> KVStoreConnectorMetadata:
        assert self.meta is not None
        return self.meta

    def has_connector_metadata(self) -> bool:
        return self.meta is not None


BLOCK_BYTES = LAYERS * 2 * 4 * 2 * 8 * 2   # one block of every layer, float16


class Probe:
    def __init__(self, mode: str, path: str, lib: str | None, async_loads: bool,
                 caps: bool = False, **options: Any) -> None:
        self.gpu = StandInGpu() if mode.startswith("gpu") else None
        if self.gpu is not None:
            if mode == "gpu-fp8":
                assert lib is not None
                self.gpu.host = _lib.Library(Path(lib))
            _lib.reset_for_tests(self.gpu.runtime(devices=1, device=0))
            # torch's answer to "is the current stream capturing?" (no CUDA here)
            gpu = self.gpu
            mover_core.torch_capturing = lambda: gpu.is_capturing(COMPUTE)
        g = torch.Generator().manual_seed(0)
        self.plain = [torch.zeros(SHAPE, dtype=torch.float16) for _ in range(LAYERS)]
        self.layers = [t.as_subclass(OnDevice) if self.gpu is not None else t
                       for t in self.plain]
        self.fresh = [torch.randn(SHAPE, generator=g).to(torch.float16)
                      for _ in range(LAYERS)]
        self.names = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
        vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=4),
            model_config=SimpleNamespace(model="probe-model"),
            parallel_config=SimpleNamespace(rank=0, world_size=1))
        extra: dict[str, Any] = {"path": path, "extent_bytes": 4 << 20,
                                 "async_loads": async_loads,
                                 "max_pending_save_bytes": 1 << 20,
                                 "load_staging_bytes": 1 << 20}
        if mode == "gpu-fp8":
            extra["codec"] = "fp8_e4m3"
        if caps:
            extra.update(max_save_bytes_per_step=3 * BLOCK_BYTES,
                         max_save_bytes_per_s=3.5 * BLOCK_BYTES)
        extra.update(options)
        self.now = 0.0   # the rate cap's clock, in seconds
        self.conn = Conn()
        self.ws = WorkerSide(vllm_config,  # type: ignore[arg-type]
                             SimpleNamespace(num_blocks=NUM_BLOCKS),
                             ConnectorConfig.from_extra(extra), (("weights", "w"),),
                             b"\0" * 16, "probe")
        self.ws.clock = lambda: self.now
        self.ws.register_kv_caches(dict(zip(self.names, self.layers)))
        self.run_gpu()
        self.clear()

    def run_gpu(self, streams: list[int] | None = None) -> None:
        if self.gpu is not None:
            self.gpu.run(streams)

    def clear(self) -> None:
        OnDevice.log.clear()
        if self.gpu is not None:
            self.gpu.syncs.clear()
            self.gpu.copied.clear()

    def syncs(self) -> list[str]:
        return list(self.gpu.syncs) if self.gpu is not None else []

    def device_work(self, fn: Any) -> None:  # the engine's own kernel on its stream
        if self.gpu is not None:
            self.gpu.enqueue(COMPUTE, fn)
        else:
            fn()

    def step(self, meta: KVStoreConnectorMetadata) -> None:
        """vLLM's order: bind, start_load_kv, per layer: wait for its load, the forward
        writes it, save_kv_layer; then wait_for_save.  The step's presence lookup has
        answered by the first save_kv_layer (the store is idle here: made certain)."""
        self.now += 10
        self.conn.meta = meta
        self.ws.bind_connector_metadata(meta)
        lookup = self.ws.saves._lookup
        if lookup is not None:
            lookup[1].result()
        self.forward(meta)
        self.ws.wait_for_save(self.conn.meta)

    def forward(self, meta: KVStoreConnectorMetadata) -> None:
        self.ws.start_load_kv(meta)
        for li, name in enumerate(self.names):
            self.ws.wait_for_layer_load(name)
            self.device_work(lambda li=li: self.plain[li].copy_(self.fresh[li]))
            self.ws.save_kv_layer(meta, name)

    def mover_stats(self) -> dict[str, int]:
        assert self.ws.mover is not None
        return {k: v for k, v in vars(self.ws.mover.stats()).items() if isinstance(v, int)}


def save_with_the_store_busy(p: Probe, meta: KVStoreConnectorMetadata,
                             out: dict[str, Any]) -> None:
    """The step's lookup cannot answer (the store's loop is held): the forward still
    runs to its end, and the step's blocks are all copied out."""
    gate, entered = threading.Event(), threading.Event()

    async def hold_the_loop() -> None:
        entered.set()
        gate.wait()   # blocks the store's event-loop thread itself

    p.now += 10
    held = p.ws.store.blocking.submit(hold_the_loop)
    entered.wait()
    forward_done = threading.Event()

    def watchdog() -> None:   # frees the loop only if the forward hung on it
        if not forward_done.wait(HANG_S):
            gate.set()

    threading.Thread(target=watchdog, daemon=True).start()
    p.conn.meta = meta
    p.ws.bind_connector_metadata(meta)
    p.forward(meta)
    out["forward_while_store_busy"] = not gate.is_set()
    forward_done.set()
    gate.set()
    held.result()
    p.ws.wait_for_save(p.conn.meta)


def copy_out_caps(p: Probe) -> list[list[int]]:
    """Save steps against the caps, the clock moved only where said: per step, the
    blocks the mover copied out and the connector's dropped blocks."""
    seen: list[list[int]] = []
    fresh = iter(range(0x10, 0x40))

    def step(ids: list[int], advance: float) -> None:
        p.now += advance - 10   # (step() moves the clock 10 s on its own)
        before, dropped = p.mover_stats()["saved_blocks"], p.ws.open.counters["save_dropped_blocks"]
        p.step(KVStoreConnectorMetadata(saves=[Save(b, bytes([next(fresh)]) * 16, None)
                                               for b in ids]))
        p.run_gpu()
        p.ws.store.flush()
        seen.append([p.mover_stats()["saved_blocks"] - before,
                     p.ws.open.counters["save_dropped_blocks"] - dropped])

    step([0, 1, 2], 10)    # a full bucket (3.5 blocks): taken, 0.5 left
    step([4], 0)           # no time passed: 1 block is over the rate: dropped
    step([4, 6, 8, 11], 1)  # refilled, but 4 blocks are over the step's cap of 3
    step([0], 0)           # the 3.5 blocks of that second: taken
    return seen


def load_larger_than_the_staging(mode: str, path: str, async_loads: bool) -> dict[str, Any]:
    """Load staging of one block (``cap``), a stored chain of ``cap + 1``:
    the read-ahead claims the prefix the staging holds; a background load of the whole
    chain loads that prefix and reports the last block as a load error (vLLM computes
    it); before, either load failed whole."""
    p = Probe(mode, path, None, async_loads, load_staging_bytes=BLOCK_BYTES)
    ws = p.ws
    assert ws.mover is not None
    cap = ws.open.load_max_blocks   # (one: the option as given, not the page it takes)
    n = cap + 1
    assert 2 * n <= NUM_BLOCKS, (cap, NUM_BLOCKS)
    hashes = [bytes([i + 1]) * 16 for i in range(n)]
    p.step(KVStoreConnectorMetadata(saves=[
        Save(i, h, hashes[i - 1] if i else None) for i, h in enumerate(hashes)]))
    p.run_gpu()
    ws.store.flush()
    out: dict[str, Any] = {"cap": cap}
    counters = dict(ws.open.counters)
    targets = list(range(n, 2 * n))
    if async_loads:
        p.conn.meta = KVStoreConnectorMetadata(loads=[Load("r", targets, hashes)])
        ws.bind_connector_metadata(p.conn.meta)
        ws.start_load_kv(p.conn.meta)
        ws.loads.background.loading["r"].future.result()   # the background read is done
        out["finished"] = sorted(ws.get_finished(p.conn.meta)[1] or ())
    else:
        out["read_ahead_hit"] = hit = ws.open.match_hashes(hashes)
        targets = targets[:hit]             # what vLLM schedules for that hit
        p.conn.meta = KVStoreConnectorMetadata(loads=[Load("r", targets, hashes[:hit])])
        ws.bind_connector_metadata(p.conn.meta)
        ws.start_load_kv(p.conn.meta)
    p.run_gpu()
    out["load_errors"] = [b - n for b in sorted(ws.get_block_ids_with_load_errors())]
    out["loaded_ok"] = torch.equal(paged.gather_reference(p.plain, targets[:cap], "kv_first"),
                                   paged.gather_reference(p.fresh, list(range(cap)),
                                                          "kv_first"))
    out["counters"] = {k: ws.open.counters[k] - counters[k] for k in (
        "loaded_blocks", "load_failed_blocks", "load_no_staging_blocks")}
    out["failed_keys"] = len(ws.open.failed_keys)   # none: no block was doubted
    p.conn.meta = None
    ws.shutdown()
    return out


def busy_load_staging(mode: str, path: str) -> dict[str, Any]:
    """Load staging for two blocks, background loads, a stored chain of three blocks:
    the lookup claims the two the staging holds; two loads of two blocks in one step:
    the first is read, the second waits for the staging (deferred, not failed) and is
    read once the first was copied in; a third load waits, the key scope moves (a
    weight update) before it starts: it fails whole, unread."""
    p = Probe(mode, path, None, True, load_staging_bytes=2 * BLOCK_BYTES)
    ws = p.ws
    hashes = [bytes([0x60 + i]) * 16 for i in range(3)]
    p.step(KVStoreConnectorMetadata(saves=[
        Save(i, h, hashes[i - 1] if i else None) for i, h in enumerate(hashes)]))
    p.run_gpu()
    ws.store.flush()
    out: dict[str, Any] = {"cap": ws.open.load_max_blocks}
    counters = dict(ws.open.counters)
    out["lookup_hit"] = ws.open.match_hashes(hashes)
    finished: list[list[str]] = []

    def load_step(loads: list[Load]) -> None:
        p.conn.meta = KVStoreConnectorMetadata(loads=loads)
        ws.bind_connector_metadata(p.conn.meta)
        ws.start_load_kv(p.conn.meta)
        p.run_gpu()

    def finish_ready() -> None:
        for inflight in list(ws.loads.background.loading.values()):
            if inflight.future is not None:
                inflight.future.result()   # the background read is done
        finished.append(sorted(ws.get_finished(p.conn.meta)[1] or ()))
        p.run_gpu()

    load_step([Load("a", [6, 7], hashes[:2]), Load("b", [8, 9], hashes[:2])])
    out["waiting_after_start"] = [r for r, f in ws.loads.background.loading.items() if f.future is None]
    finish_ready()      # a copied in; b started into the staging a gave back
    finish_ready()      # b copied in
    out["loaded_ok"] = all(torch.equal(
        paged.gather_reference(p.plain, ids, "kv_first"),
        paged.gather_reference(p.fresh, [0, 1], "kv_first")) for ids in ([6, 7], [8, 9]))
    load_step([Load("c", [10, 11], hashes[:2]), Load("d", [4, 5], hashes[:2])])
    out["waiting_before_move"] = [r for r, f in ws.loads.background.loading.items() if f.future is None]
    p.conn.meta = KVStoreConnectorMetadata(scope_epoch=1, weights="w2")  # a weight update
    ws.bind_connector_metadata(p.conn.meta)
    finish_ready()
    out["finished"] = finished
    out["load_errors"] = sorted(ws.get_block_ids_with_load_errors())
    out["counters"] = {k: ws.open.counters[k] - counters[k] for k in (
        "load_blocks", "loaded_blocks", "load_failed_blocks", "load_deferred_blocks",
        "load_no_staging_blocks")}
    p.conn.meta = None
    ws.shutdown()
    return out


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    flags = {a for a in sys.argv[1:] if a.startswith("--")}
    mode, path = args[0], args[1]
    if "--small-load-staging" in flags:
        print(json.dumps(load_larger_than_the_staging(mode, path, "--async" in flags)))
        return
    if "--busy-load-staging" in flags:
        print(json.dumps(busy_load_staging(mode, path)))
        return
    if "--too-small" in flags:   # sizes that cannot hold one block stop the start
        try:
            Probe(mode, path, None, False, max_save_bytes_per_step=BLOCK_BYTES - 1)
        except ValueError as e:
            print(json.dumps({"error": str(e)}))
            return
    if "--below-a-block" in flags:   # as given, though a page would hold several
        try:
            Probe(mode, path, None, False, max_pending_save_bytes=BLOCK_BYTES - 1,
                  load_staging_bytes=BLOCK_BYTES - 1)
        except ValueError as e:
            print(json.dumps({"error": str(e)}))
            return
    p = Probe(mode, path, args[2] if len(args) > 2 else None, "--async" in flags,
              caps="--caps" in flags)
    ws, gpu = p.ws, p.gpu
    assert ws.mover is not None
    out: dict[str, Any] = {"mover_cuda": ws.mover.cuda, "device_loads": ws.mover.device_loads}

    # ---- save step 1, the store's loop busy: the forward writes each layer, saves it
    hashes = [bytes([i]) * 16 for i in (1, 2)]
    ids = [3, 7]
    save_with_the_store_busy(p, KVStoreConnectorMetadata(saves=[
        Save(3, hashes[0], None), Save(7, hashes[1], hashes[0])]), out)
    out["save_syncs"] = p.syncs()
    out["save_host_copies"] = list(OnDevice.log)
    p.run_gpu()                      # the GPU gets there: copies, copy-done callback
    ws.store.flush()
    keys = ws.open.keys(hashes)
    assert keys is not None
    got = ws.store.get_many(keys, [None, None])  # type: ignore[list-item]
    want = paged.gather_reference(p.fresh, ids, "kv_first")
    spec = ws.store.blocking.store.codec
    if spec is not None:   # what the CPU codec's payload of the same values decodes to
        want = torch.stack([codecs.decode(*codecs.encode(w, spec), w.dtype, tuple(w.shape))
                            for w in want])
        out["fp8_copied_out_bytes"] = ws.mover.stats().copied_out_bytes
        out["raw_bytes"] = len(ids) * want[0].numel() * want.element_size()
    out["saved_ok"] = all(g is not None and torch.equal(g.reshape(want[i].shape), want[i])
                          for i, g in enumerate(got))

    # ---- save step 2, its lookup answered: the stored blocks are not copied out again
    before = p.mover_stats()
    p.step(KVStoreConnectorMetadata(saves=[Save(3, hashes[0], None),
                                           Save(7, hashes[1], hashes[0]),
                                           Save(5, b"\x03" * 16, hashes[1])]))
    p.run_gpu()
    ws.store.flush()
    after = p.mover_stats()
    out["dedup_step_copied_blocks"] = after["saved_blocks"] - before["saved_blocks"]

    # ---- save step 3, two stored blocks and a new one, the store's loop busy again:
    # all three copied out, the put writes one and deduplicates two (counted so)
    counters = dict(ws.open.counters)
    save_with_the_store_busy(p, KVStoreConnectorMetadata(saves=[
        Save(3, hashes[0], None), Save(7, hashes[1], hashes[0]),
        Save(6, b"\x06" * 16, hashes[1])]), {})
    p.run_gpu()
    ws.store.flush()
    out["late_step_copied_blocks"] = p.mover_stats()["saved_blocks"] - after["saved_blocks"]
    out["late_step_counters"] = {k: ws.open.counters[k] - counters[k] for k in (
        "save_blocks", "saved_blocks", "save_dedup_blocks", "save_lookup_late_steps")}

    # ---- a load step into other blocks; attention reads each layer after its wait
    p.clear()
    decoded = copies.stats().fp8_decoded
    load = Load("r1", [9, 10], hashes)
    if gpu is not None:              # the GPU keeps up with the store's copies; the
        gpu.auto = True              # mover's load stream runs only when told
        gpu.held = {ws.mover.load_stream}
    if "--async" in flags:
        p.conn.meta = KVStoreConnectorMetadata(loads=[load])
        ws.bind_connector_metadata(p.conn.meta)
        ws.start_load_kv(p.conn.meta)
        ws.loads.background.loading["r1"].future.result()   # the background read is done
        finished = ws.get_finished(p.conn.meta)[1]
        out["async_finished"] = sorted(finished or ())
        p.conn.meta = KVStoreConnectorMetadata()   # the request's next step
        ws.bind_connector_metadata(p.conn.meta)
    else:
        # vLLM's scheduler looks the request up first: the hit is read (and verified)
        # ahead, then start_load_kv of the step that scheduled it scatters it.
        out["read_ahead_hit"] = ws.open.match_hashes(hashes)
        p.conn.meta = KVStoreConnectorMetadata(loads=[load])
        ws.bind_connector_metadata(p.conn.meta)
        ws.start_load_kv(p.conn.meta)
    if gpu is not None:
        gpu.auto = False
    seen: list[torch.Tensor] = []
    for li, name in enumerate(p.names):
        ws.wait_for_layer_load(name)
        p.device_work(lambda li=li: seen.append(
            paged.gather_reference([p.plain[li]], [9, 10], "kv_first")[:, 0].clone()))
    out["load_syncs"] = p.syncs()
    out["load_host_copies"] = list(OnDevice.log)
    out["fp8_decoded"] = copies.stats().fp8_decoded - decoded
    out["load_copied_in_bytes"] = 0 if gpu is None else \
        sum(n for _, s, n in gpu.copied if s not in (ws.mover.load_stream, COMPUTE))
    if spec is not None:   # in: each block's scales and codes (its payload less the
        # header), and the decode kernel's row -> scale-group map once per geometry
        payloads = sum(len(codecs.encode(w, spec)[1]) - gpu_fp8._HDR.size for w in
                       paged.gather_reference(p.fresh, ids, "kv_first"))
        row_group = gpu_fp8.scale_groups(ws.mover.block_shape, spec).row_group.nbytes
        out["load_copied_in_expected"] = [payloads, payloads + row_group]
    p.run_gpu([COMPUTE])
    out["read_before_load_event"] = len(seen)
    if gpu is not None:
        gpu.held.clear()
    p.run_gpu()
    out["load_ok"] = len(seen) == LAYERS and all(
        torch.equal(seen[li], want[:, li]) for li in range(LAYERS))
    out["load_errors"] = sorted(ws.get_block_ids_with_load_errors())

    if "--capture" in flags:
        assert gpu is not None
        p.clear()
        gpu.begin_capture(COMPUTE)
        p.step(KVStoreConnectorMetadata(saves=[Save(8, b"\x04" * 16, None)]))
        p.step(KVStoreConnectorMetadata(loads=[Load("r2", [11], [b"\x05" * 16])]))
        out["capture_finished"] = ws.get_finished(p.conn.meta)[1]   # (none in a capture)
        gpu.end_capture(COMPUTE)
        out["captured"] = list(gpu.captured)
        out["capture_syncs"] = p.syncs()
        if "--async" in flags:   # the refused load is reported once the capture ended
            ws.loads.background.loading["r2"].future.result()
            out["capture_finished"] = sorted(ws.get_finished(p.conn.meta)[1] or ())
        out["capture_load_errors"] = sorted(ws.get_block_ids_with_load_errors())
        out["capture_skipped_saves"] = ws.mover.stats().capture_skipped_saves

    if "--caps" in flags:
        out["caps"] = copy_out_caps(p)

    p.conn.meta = None
    ws.shutdown()
    stats = ws.open.counters
    out["counters"] = {k: stats[k] for k in (
        "save_blocks", "saved_blocks", "save_dropped_blocks", "save_dedup_blocks",
        "save_lookup_late_steps", "loaded_blocks", "load_failed_blocks")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
