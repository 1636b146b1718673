"""Drive the vLLM connector's worker (``WorkerSide``) through a save step and a load
step without an engine, and print what happened as JSON.  Run with the vLLM venv's
python (tests/integrations/test_vllm_mover.py does)::

    python tests/integrations/worker_probe.py gpu|cpu|gpu-fp8 STORE_DIR [LIBKVCUDA]

``gpu``: the KV cache is "on a GPU" that is the recording stand-in
(tests/cuda/standin.py, ``StandInGpu``: streams run only when told, in CUDA's order,
host-blocking calls recorded), the cache tensors are host memory that says it is on
``cuda:0`` and records every call that would copy device memory to the host (``.to``,
``.cpu``, ``.item``, ``.tolist``, ``.numpy``): the worker's save and load paths must
make none of either.  ``cpu``: a CPU engine, the same calls, plain copies.  ``gpu-fp8``:
``gpu`` with the store's codec ``fp8_e4m3``: saves quantised on the (stand-in) GPU by
the built library's kernel code (LIBKVCUDA, its host twins), stored as the payload, read
back exactly as the CPU codec's payload decodes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvstore import codecs
from kvstore.cuda import _lib, paged
from kvstore.integrations.vllm_config import ConnectorConfig
from kvstore.integrations.vllm_metadata import KVStoreConnectorMetadata, Load, Save
from kvstore.integrations.vllm_worker import WorkerSide
from tests.cuda.standin import OnDevice, StandInGpu

NUM_BLOCKS, LAYERS = 12, 3
SHAPE = (2, NUM_BLOCKS, 4, 2, 8)   # [2, blocks, block_size, heads, head_dim]
COMPUTE = 0                        # the engine's stream (torch without CUDA: stream 0)


class Conn:
    meta: KVStoreConnectorMetadata | None = None

    def _get_connector_metadata(self) -> KVStoreConnectorMetadata:
        assert self.meta is not None
        return self.meta

    def has_connector_metadata(self) -> bool:
        return self.meta is not None


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    gpu = StandInGpu() if mode.startswith("gpu") else None
    if mode == "gpu-fp8":
        assert gpu is not None
        gpu.host = _lib.Library(Path(sys.argv[3]))
    if gpu is not None:
        _lib.reset_for_tests(gpu.runtime(devices=1, device=0))

    def run_gpu(streams: list[int] | None = None) -> None:
        if gpu is not None:
            gpu.run(streams)

    def device_work(fn: Any) -> None:  # the engine's own kernel on its stream
        if gpu is not None:
            gpu.enqueue(COMPUTE, fn)
        else:
            fn()

    g = torch.Generator().manual_seed(0)
    plain = [torch.zeros(SHAPE, dtype=torch.float16) for _ in range(LAYERS)]
    layers = [t.as_subclass(OnDevice) if gpu is not None else t for t in plain]
    fresh = [torch.randn(SHAPE, generator=g).to(torch.float16) for _ in range(LAYERS)]
    names = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=4),
        model_config=SimpleNamespace(model="probe-model"),
        parallel_config=SimpleNamespace(rank=0, world_size=1))
    extra: dict[str, Any] = {"path": path, "extent_bytes": 4 << 20, "async_loads": False,
                             "max_pending_save_bytes": 1 << 20}
    if mode == "gpu-fp8":
        extra["codec"] = "fp8_e4m3"
    config = ConnectorConfig.from_extra(extra)
    conn = Conn()
    ws = WorkerSide(conn, vllm_config, SimpleNamespace(num_blocks=NUM_BLOCKS),  # type: ignore[arg-type]
                    config, (("weights", "w"),), b"\0" * 16, "probe")
    ws.register_kv_caches(dict(zip(names, layers)))
    if gpu is not None:
        run_gpu()
        gpu.syncs.clear()
    mover = getattr(ws, "mover", None)  # (a worker without the mover: none)
    out: dict[str, Any] = {"mover_cuda": mover is not None and mover.cuda}

    # ---- a save step: the forward writes each layer, then save_kv_layer
    hashes = [bytes([i]) * 16 for i in (1, 2)]
    ids = [3, 7]
    conn.meta = KVStoreConnectorMetadata(saves=[Save(3, hashes[0], None),
                                                Save(7, hashes[1], hashes[0])])
    for li, name in enumerate(names):
        device_work(lambda li=li: plain[li].copy_(fresh[li]))
        ws.save_kv_layer(name, layers[li], None)  # type: ignore[arg-type]
    ws.wait_for_save()
    out["save_syncs"] = list(gpu.syncs) if gpu is not None else []
    out["save_host_copies"] = list(OnDevice.log)
    run_gpu()                      # the GPU gets there: copies, copy-done callback
    ws.store.flush()
    keys = ws._keys(hashes)
    assert keys is not None
    got = ws.store.get_many(keys, [None, None])  # type: ignore[list-item]
    want = paged.gather_reference(fresh, ids, "kv_first")
    spec = ws.store.store.codec
    if spec is not None:   # what the CPU codec's payload of the same values decodes to
        want = torch.stack([codecs.decode(*codecs.encode(w, spec), w.dtype, tuple(w.shape))
                            for w in want])
        out["fp8_copied_out_bytes"] = ws.mover.stats().copied_out_bytes if ws.mover else 0
        out["raw_bytes"] = len(ids) * want[0].numel() * want.element_size()
    out["saved_ok"] = all(g is not None and torch.equal(g.reshape(want[i].shape), want[i])
                          for i, g in enumerate(got))

    # ---- a load step into other blocks; attention reads each layer after its wait
    OnDevice.log.clear()
    if gpu is not None:
        gpu.syncs.clear()
    conn.meta = KVStoreConnectorMetadata(loads=[Load("r1", [9, 10], hashes)])
    ws.bind_connector_metadata(conn.meta)
    ws.start_load_kv(None)  # type: ignore[arg-type]
    seen: list[torch.Tensor] = []
    for li, name in enumerate(names):
        ws.wait_for_layer_load(name)
        device_work(lambda li=li: seen.append(
            paged.gather_reference([plain[li]], [9, 10], "kv_first")[:, 0].clone()))
    out["load_syncs"] = list(gpu.syncs) if gpu is not None else []
    out["load_host_copies"] = list(OnDevice.log)
    run_gpu([COMPUTE])
    out["read_before_load_event"] = len(seen)
    run_gpu()
    out["load_ok"] = len(seen) == LAYERS and all(
        torch.equal(seen[li], want[:, li]) for li in range(LAYERS))
    conn.meta = None
    ws.shutdown()
    stats = ws.store.counters
    out["counters"] = {k: stats[k] for k in ("save_blocks", "saved_blocks",
                                             "save_dropped_blocks", "loaded_blocks",
                                             "load_failed_blocks")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
