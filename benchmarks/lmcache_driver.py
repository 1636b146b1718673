"""LMCache's local disk backend as a benchmark peer; runs in LMCache's own interpreter.

``python -m benchmarks.lmcache_driver`` (with the repository root on ``PYTHONPATH``)
reads one JSON command per line on stdin and answers one JSON line on stdout.  The
parent (:class:`benchmarks.systems.LMCacheSystem`) sends ``open`` (a fresh backend in an
empty directory over the same blocks as the parent, regenerated from the same seed:
:mod:`benchmarks.data`), ``put``, ``get``, ``verify``, ``drop``, ``close``, ``quit``.

How LMCache is set up (lmcache 0.5.x, ``lmcache/v1/storage_backend/local_disk_backend.py``),
defaults as shipped except where a benchmark needs otherwise:

* ``LocalDiskBackend`` with its default 4 disk I/O threads (``disk_io_threads``) and
  buffered I/O (``use_odirect`` off): one ``KEY.pt`` file per chunk written with
  ``open(path, "wb").write(buffer)`` from a priority thread pool, no fsync, no tmp +
  rename; an in-memory dict is the index (lost on restart: the get below reads from the
  same backend object, after the page cache was emptied by the parent).
* CPU memory objects come from the shipped default allocator (``MixedMemoryAllocator``
  over ``max_local_cpu_size``, here 1 GiB instead of 5 so the host is not pinned down)
  via ``LocalCPUBackend.allocate`` as LMCache's storage manager does; ``local_cpu`` off,
  so blocks are not also kept in the CPU tier and reads come from disk.
* ``max_local_disk_size`` is set to the data volume (its default 0 refuses every put).
* Store: allocate a memory object per block, copy the block in (an engine's GPU->CPU
  copy), ``batched_submit_put_task``; the time ends when every key's disk write has
  completed (``on_complete_callback``) and one ``syncfs`` has flushed the file system.
* Get: ``batched_get_blocking`` (its read pool, ``readinto`` preallocated buffers).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

import torch

from benchmarks.data import block_shape, fingerprint, make_blocks

CPU_BYTES = 1 << 30


def _syncfs(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs failed")
    finally:
        os.close(fd)


class Driver:
    def __init__(self) -> None:
        import lmcache

        self.version = getattr(lmcache, "__version__", None)
        if self.version is None:
            from importlib.metadata import version

            self.version = version("lmcache")
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend  # noqa: F401

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.backend: Any = None
        self.cpu: Any = None
        self.got: dict[int, torch.Tensor | None] = {}

    def open(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        self.close()
        self.block_bytes, self.n, self.seed = cmd["block_bytes"], cmd["n"], cmd["seed"]
        self.distinct = cmd["distinct"]
        self.src = make_blocks(self.block_bytes, self.distinct, self.seed)
        self.shape = torch.Size(block_shape(self.block_bytes))
        self.dir = cmd["dir"]
        os.makedirs(self.dir, exist_ok=True)
        disk_gb = (self.n * self.block_bytes) / (1 << 30) + 1.0
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=256, local_cpu=False, max_local_cpu_size=CPU_BYTES / (1 << 30),
            local_disk=self.dir, max_local_disk_size=disk_gb)
        if self.cpu is None:
            alloc = MixedMemoryAllocator(CPU_BYTES, config=self.config)
            self.cpu = LocalCPUBackend(self.config, memory_allocator=alloc)
        self.backend = LocalDiskBackend(self.config, self.loop, self.cpu, dst_device="cpu")
        self.keys = [CacheEngineKey("bench", 1, 0, i, torch.bfloat16) for i in range(self.n)]
        self.got = {}
        return {"fingerprint": fingerprint(self.src)}

    def put(self, lo: int, hi: int) -> dict[str, Any]:
        from lmcache.v1.memory_management import MemoryFormat

        left = hi - lo
        done = threading.Event()
        lock = threading.Lock()

        def on_done(_key: Any) -> None:
            nonlocal left
            with lock:
                left -= 1
                if left == 0:
                    done.set()

        t0 = time.perf_counter()
        for i in range(lo, hi):
            obj = self.cpu.allocate(self.shape, torch.bfloat16, MemoryFormat.KV_2LTD,
                                    busy_loop=True)
            while obj is None:  # CPU buffer full: wait for earlier writes to free some
                time.sleep(0.001)
                obj = self.cpu.allocate(self.shape, torch.bfloat16, MemoryFormat.KV_2LTD)
            obj.tensor.copy_(self.src[i % self.distinct])
            self.backend.submit_put_task(self.keys[i], obj, on_complete_callback=on_done)
            obj.ref_count_down()  # the backend holds its own reference until written
        if hi > lo:
            done.wait()
        _syncfs(self.dir)
        dt = time.perf_counter() - t0
        missing = sum(not self.backend.contains(self.keys[i]) for i in range(lo, hi))
        if missing:
            raise RuntimeError(f"{missing} of {hi - lo} blocks not stored")
        return {"seconds": dt}

    def get(self, lo: int, hi: int, keep: bool) -> dict[str, Any]:
        keys = self.keys[lo:hi]
        t0 = time.perf_counter()
        objs = self.backend.batched_get_blocking(keys)
        dt = time.perf_counter() - t0
        for i, obj in zip(range(lo, hi), objs):
            if keep:
                self.got[i] = None if obj is None else obj.tensor.clone()
            if obj is not None:
                obj.ref_count_down()
        return {"seconds": dt}

    def verify(self) -> dict[str, Any]:
        bad = 0
        for i, t in self.got.items():
            want = self.src[i % self.distinct]
            bad += t is None or t.view(torch.uint8).numel() != want.view(torch.uint8).numel() \
                or not torch.equal(t.view(torch.bfloat16).reshape(want.shape), want)
        return {"bad": bad}

    def close(self) -> None:
        self.got = {}
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    def config_info(self) -> dict[str, Any]:
        return {"disk_io_threads": 4, "use_odirect": False, "local_cpu": False,
                "max_local_cpu_size_gib": CPU_BYTES / (1 << 30),
                "allocator": "MixedMemoryAllocator (shipped default)",
                "file_write": "open(path, 'wb').write(buffer), no fsync, no rename"}


def main() -> int:
    out = sys.stdout
    try:
        drv = Driver()
    except Exception as e:  # noqa: BLE001 - reported to the parent, which skips this peer
        out.write(json.dumps({"error": f"LMCache cannot be imported here: {e!r}"}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps({"lmcache": drv.version, "config": drv.config_info()}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd["cmd"]
            if op == "quit":
                drv.close()
                out.write(json.dumps({"ok": True}) + "\n")
                out.flush()
                break
            if op == "open":
                reply = drv.open(cmd)
            elif op == "put":
                reply = drv.put(cmd["lo"], cmd["hi"])
            elif op == "get":
                reply = drv.get(cmd["lo"], cmd["hi"], cmd.get("keep", True))
            elif op == "verify":
                reply = drv.verify()
            elif op == "drop":
                drv.got = {}
                reply = {"ok": True}
            elif op == "close":
                drv.close()
                reply = {"ok": True}
            else:
                reply = {"error": f"unknown command {op!r}"}
        except Exception:  # noqa: BLE001 - the parent reports it and stops
            reply = {"error": traceback.format_exc()[-3000:]}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
