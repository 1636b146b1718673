"""kvstore's SGLang HiCache backend vs SGLang's own file backend, side by side.

    python -m benchmarks.sglang_backends [--dir DIR] [--pages N] [--batch B] [--out FILE]

Pages of 64 tokens of Llama-3-8B (32 layers, 8 KV heads, head dim 128, bf16): 8 MiB a
page (K and V, all layers).  Both backends are built by SGLang's own factory from the
installed sglang package (tests/integrations/install_sglang.sh) and fed from one host
pool laid out as SGLang's ``MHATokenToKVPoolHost`` ``page_first``:

* kvstore: ``batch_set_v1`` / ``batch_get_v1`` (``"interface_v1": 1``), zero copy;
  every batch durable (fdatasync + commit) before the call returns;
* ``HiCacheFile`` (``--hicache-storage-backend file``): ``batch_set`` / ``batch_get``
  of flat pages, as SGLang's controller calls it (``get_data_page`` /
  ``get_dummy_flat_data_page`` + ``set_from_flat_data_page``); it does not fsync, so its
  set time includes one final ``sync`` (DESIGN.md, "Performance targets").

Gets are cold: kvstore reads with O_DIRECT, and the file backend's pages are dropped from
the page cache (``posix_fadvise(DONTNEED)``) before its gets.  Bytes on disk: allocated
blocks of each directory (``st_blocks``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

LAYERS, HEADS, HEAD_DIM, PAGE = 32, 8, 128, 64
PAGE_BYTES = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 2


class PageFirstPool:
    """SGLang's MHATokenToKVPoolHost, page_first layout (pool_host/mha.py)."""

    layout = "page_first"

    def __init__(self, pages: int) -> None:
        self.page_size, self.layer_num, self.head_num, self.head_dim = PAGE, LAYERS, HEADS, HEAD_DIM
        self.dtype, self.device, self.pin_memory = torch.bfloat16, "cpu", False
        self.size = pages * PAGE
        self.kv_buffer = torch.empty((2, self.size, LAYERS, HEADS, HEAD_DIM), dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index : index + self.page_size, :, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, LAYERS, PAGE, HEADS, HEAD_DIM), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, index : index + self.page_size, :, :, :] = data_page.reshape(
            2, PAGE, LAYERS, HEADS, HEAD_DIM)


def _config(extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="meta-llama/Meta-Llama-3-8B", extra_config=extra)


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def _drop_cache(path: Path) -> None:
    for p in path.rglob("*.bin"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run(base: Path, pages: int, batch: int) -> dict[str, dict[str, float]]:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    pool = PageFirstPool(batch)
    torch.manual_seed(0)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(torch.bfloat16))
    idx = torch.arange(batch * PAGE, dtype=torch.int64)
    batches = [[f"{b:08x}{i:056x}" for i in range(batch)] for b in range(pages // batch)]
    total = len(batches) * batch * PAGE_BYTES
    results: dict[str, dict[str, float]] = {}

    kv_dir = base / "kvstore"

    def open_kvstore() -> Any:
        """The backend as SGLang's server makes it (the factory, then the host pool)."""
        backend = StorageBackendFactory.create_backend("dynamic", _config({
            "backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
            "class_name": "KVStoreHiCache", "interface_v1": 1, "path": str(kv_dir)}), pool)
        backend.register_mem_pool_host(pool)
        return backend

    kv = open_kvstore()
    t0 = time.perf_counter()
    for keys in batches:
        assert all(kv.batch_set_v1(keys, idx))
    t_set = time.perf_counter() - t0
    kv.close()
    kv = open_kvstore()  # reopened: the gets are cold (O_DIRECT) and read what persisted
    t0 = time.perf_counter()
    for keys in batches:
        assert all(kv.batch_get_v1(keys, idx))
    t_get = time.perf_counter() - t0
    stats = kv.get_stats().kvstore
    kv.close()
    results["kvstore (batch_*_v1)"] = {
        "set_gbps": total / t_set / 1e9, "get_gbps": total / t_get / 1e9,
        "disk_bytes": _disk_bytes(kv_dir), "stored_bytes": stats["stored_bytes"]}

    file_dir = base / "file"
    fb = StorageBackendFactory.create_backend(
        "file", _config({"file_storage_path": str(file_dir)}), pool)
    fb.register_mem_pool_host(pool)
    t0 = time.perf_counter()
    for keys in batches:
        assert fb.batch_set(keys, [pool.get_data_page(i * PAGE) for i in range(batch)])
    os.sync()
    t_set = time.perf_counter() - t0
    _drop_cache(file_dir)
    t0 = time.perf_counter()
    for keys in batches:
        got = fb.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        for i, page in enumerate(got):
            assert page is not None
            pool.set_from_flat_data_page(i * PAGE, page)
    t_get = time.perf_counter() - t0
    size = _disk_bytes(file_dir)
    results["SGLang HiCacheFile (batch_set/get)"] = {
        "set_gbps": total / t_set / 1e9, "get_gbps": total / t_get / 1e9,
        "disk_bytes": size, "stored_bytes": size}
    return results


def report(results: dict[str, dict[str, float]], pages: int, batch: int) -> str:
    lines = [f"{pages} pages of {PAGE_BYTES >> 20} MiB (Llama-3-8B shape, 64 tokens, bf16), "
             f"batches of {batch} pages; throughput in GB/s of page bytes.", "",
             "| backend | set GB/s (durable) | cold get GB/s | disk bytes | stored bytes |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['set_gbps']:.2f} | {r['get_gbps']:.2f} | "
                     f"{int(r['disk_bytes']):,} | {int(r['stored_bytes']):,} |")
    kv, fb = results["kvstore (batch_*_v1)"], results["SGLang HiCacheFile (batch_set/get)"]
    lines += ["", f"kvstore / file: set {kv['set_gbps'] / fb['set_gbps']:.2f}x, "
              f"get {kv['get_gbps'] / fb['get_gbps']:.2f}x"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="sglang-bench-", dir=args.dir))
    try:
        text = report(run(base, args.pages, args.batch), args.pages, args.batch)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
