"""SGLang 0.5.23's own HiCache controller and host pools, on CPU, for the backend tests.

``HybridCacheController`` (``sglang/srt/mem_cache/hybrid_cache/hybrid_cache_controller.py``)
is the controller SGLang runs; its import chain reaches two model-config modules that
import torchvision (``configs/deepseek_ocr.py``, ``multimodal/internvl_utils.py``), whose
compiled ops PyPI publishes only as CUDA builds.  A stand-in package is importable under
that name while the controller is imported, and gone afterwards; nothing of it runs on
the cache paths the tests drive.  The rest is real: ``MHATokenToKVPoolHost`` and
``MambaPoolHost`` built on CPU, ``HostPoolGroup``, and the controller's own
``attach_storage_backend``, ``_page_backup_or_log``, ``_storage_hit_query``,
``_sync_prefetch_hit_query`` and ``_page_transfer``, called in the order its threads call
them (the threads are stopped: each step runs on the test's thread, no sleeps).

Needs tests/integrations/install_sglang.sh (it installs the controller's pure-Python
imports too); skipped when they are missing, failing instead with
``KVSTORE_REQUIRE_SGLANG=1``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from queue import Queue
from typing import Any

import pytest
import torch


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:  # any attribute: another stand-in
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _StandIn(f"{self.__name__}.{name}")
        setattr(self, name, sub)
        return sub

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _StandIn(f"{self.__name__}()")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"  # parsed where the package is looked up
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


@contextmanager
def _torchvision_stand_in() -> Iterator[None]:
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    import transformers.utils.import_utils  # noqa: F401 - its availability flags: truthful
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]


try:
    with _torchvision_stand_in():
        from sglang.srt.mem_cache.device_pool_info import (
            KVBufferLayout,
            KVBuffers,
            MambaStateBufferInfo,
            MHABufferInfo,
        )
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
            PrefetchOperation,
            StorageOperation,
        )
        from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
        from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.utils import get_storage_hash_str
        from sglang.srt.runtime_context import get_parallel
except Exception as e:  # noqa: BLE001 - any import failure means: not installed here
    if os.environ.get("KVSTORE_REQUIRE_SGLANG") == "1":
        raise RuntimeError(f"KVSTORE_REQUIRE_SGLANG=1 but SGLang's HiCache controller does "
                           f"not import: {e!r}; run tests/integrations/install_sglang.sh") from e
    pytest.skip(f"SGLang's HiCache controller does not import ({e!r}); install it with "
                "tests/integrations/install_sglang.sh", allow_module_level=True)

from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402

__all__ = ["HostPoolGroup", "MHATokenToKVPoolHost", "MambaPoolHost", "PoolEntry",
           "PoolHitPolicy", "PoolName", "PoolTransfer", "PrefetchOperation", "StorageOperation", "attach", "backup",
           "get_storage_hash_str", "hit_query", "mamba_pool", "mha_pool", "prefetch"]


def mha_pool(tokens: int, page: int, layers: int, heads: int = 2, head_dim: int = 16,
             dtype: torch.dtype = torch.bfloat16) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool (``page_first``) of ``tokens`` tokens over ``layers`` layers:
    the KV anchor (full attention) or the SWA sidecar (the sliding-window layers)."""
    k = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))

    def pointers(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=pointers(k), v_data_ptrs=pointers(v),
                          layout=KVBufferLayout.NHD),
        page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dtype,
        device=torch.device("cpu"))
    # host size = 1.0 x the device pool's tokens (host_size 0: by the ratio)
    return MHATokenToKVPoolHost(info, 1.0, 0, page, "page_first", pin_memory=False,
                                device="cpu", device_capacity_tokens=tokens, start_layer=0,
                                end_layer=layers)


def mamba_pool(slots: int, layers: int = 2, ssm_dtype: torch.dtype = torch.float32,
               ssm: tuple[int, ...] = (4, 16, 8)) -> MambaPoolHost:
    """SGLang's Mamba state host pool (one SSM and one conv state per slot and layer,
    shaped as a Mamba2 / gated-delta-net layer's)."""
    info = MambaStateBufferInfo(temporal=torch.zeros(layers, slots, *ssm, dtype=ssm_dtype),
                                conv=(torch.zeros(layers, slots, 3, 64),))
    return MambaPoolHost(info, 1.0, 0, device_capacity=slots, pin_memory=False,
                         device="cpu", layout="page_first")


def controller(group: HostPoolGroup, page: int) -> HybridCacheController:
    """The controller without its ``__init__`` (which needs a device KV pool and its
    allocator): the attributes its attach, backup and prefetch code read."""
    cc = object.__new__(HybridCacheController)
    cc.tp_group = cc.attn_cp_group = cc.attn_tp_group = cc.pp_group = None
    cc.host_memory_mode = "cache"
    cc.prefetch_hits_sync_groups, cc.prefetch_completion_sync_groups = [], []
    cc.mem_pool_host = group
    cc.storage_host_pool = group.anchor_entry.host_pool
    cc.page_size = page
    cc.enable_storage = False
    cc.storage_backend = cc.storage_backend_type = None
    cc.enable_storage_metrics = False
    cc.storage_stop_event = threading.Event()
    cc.extra_host_mem_release_queues = {}
    cc.pp_prefetch_command_group = cc.pp_prefetch_command_thread = None
    cc.pp_prefetch_command_queue = Queue()
    cc.pp_prefetch_state_lock = threading.Lock()
    cc.pp_prefetch_states, cc.pp_prefetch_decisions = {}, {}
    cc.mem_pool_device = types.SimpleNamespace()  # only checked for MLA (it is not)
    return cc


def attach(group: HostPoolGroup, page: int, extra: dict[str, Any],
           model: str = "tiny/hybrid") -> HybridCacheController:
    """The controller's own attach (the dynamic backend, then every pool of the group,
    then ``on_host_pools_registered``), with its storage threads stopped again so the
    test runs each step on its own thread."""
    cc = controller(group, page)
    try:
        with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0,
                                     tp_size=1, pp_rank=0, pp_size=1):
            cc.attach_storage_backend("dynamic", model_name=model,
                                      storage_backend_extra_config=dict(extra),
                                      host_pools=group.entries)
    finally:  # also when the attach failed after starting them (a pool refused)
        cc._stop_storage_threads()
    return cc


def backup(cc: HybridCacheController, host_indices: torch.Tensor, tokens: list[int],
           hashes: list[str], prefix_keys: list[str] | None = None,
           pool_transfers: list[Any] | None = None) -> StorageOperation:
    """One backup operation through the controller's backup code (what its backup
    thread runs for one queued operation)."""
    op = StorageOperation(host_indices, tokens, hash_value=hashes, prefix_keys=prefix_keys,
                          pool_transfers=pool_transfers)
    cc._page_backup_or_log(op)
    return op


def hit_query(cc: HybridCacheController, tokens: list[int],
              pool_transfers: list[Any] | None = None) -> int:
    """The controller's hit query for ``tokens`` and its rank reduction (its prefetch
    thread's first steps): the usable prefix in tokens."""
    op = PrefetchOperation(CacheRequestHandle("r", 0), tokens, None,
                           pool_transfers=pool_transfers)
    return int(cc._sync_prefetch_hit_query(op, cc._storage_hit_query(op)[1]))


def prefetch(cc: HybridCacheController, tokens: list[int], host_start: int,
             pool_transfers: list[Any] | None = None,
             prefix_keys: list[str] | None = None) -> tuple[int, PrefetchOperation, list[Any]]:
    """The controller's prefetch of ``tokens``: its hit query and the rank reduction
    (its prefetch thread), then the transfer into host pages from ``host_start`` on
    (its I/O thread).  Returns the hit in tokens, the operation and the acks the
    transfer queued for the scheduler."""
    op = PrefetchOperation(CacheRequestHandle("r", 0), tokens, None, prefix_keys=prefix_keys,
                           pool_transfers=pool_transfers)
    hashes, hit = cc._storage_hit_query(op)
    hit = cc._sync_prefetch_hit_query(op, hit)
    op.hash_value, op.storage_hit_count = hashes[:hit // cc.page_size], hit
    op.host_indices = torch.arange(host_start, host_start + hit, dtype=torch.int64)
    cc.prefetch_sync_queue = Queue()
    acks = []
    if hit:
        cc._page_transfer(op)
        while not cc.prefetch_sync_queue.empty():
            acks.append(cc.prefetch_sync_queue.get())
    return hit, op, acks
