"""A vLLM (v1) KV connector that keeps the prefix cache in a kvstore store.

Turn it on with one config entry::

    LLM(model, kv_transfer_config={
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"path": "/nvme/kvstore"},
    })

Design
------
*Keys.*  vLLM already hashes every full block of a request (a chained hash over the
prefix, covering LoRA, multimodal inputs and cache salt).  The scheduler side sees those
hashes; it carries ``(block id, block hash)`` pairs to the worker in the step metadata,
and both sides turn a hash into a store key with :meth:`Namespace.engine_key`.  The
namespace holds what makes KV of one engine unusable by another: model (and revision),
KV dtype, block size, the physical layout of the paged KV tensors (shape, stride order,
platform), the layer names and the tensor-parallel rank.  vLLM's hash algorithm is in
it too: block hashes are reproducible across processes with the default sha256, so a
restarted engine finds its blocks again.

*One stored block per vLLM block*, holding that block of every layer
(``[layers, *block shape]``): a hit means the whole block is there for all layers, and a
chain is ``parent``-linked in the store, so eviction never leaves holes.

*One store, opened by the worker.*  A store directory is locked by one ``Store``; the
worker opens it (so a path that cannot be opened stops the engine at start, saying
why) and sets the namespace when its KV tensors are registered, from their real shape
and strides.  The scheduler asks how many blocks after its local prefix-cache hit are
stored (``match_prefix``: an index lookup, no data read) without ever computing a key:
when the worker is in the same process (vLLM's default for one GPU worker, or
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) it shares the worker's handle; otherwise (the
multiprocess executor, vLLM's default on CPU) it asks the worker over a local socket
(:mod:`kvstore.integrations.vllm_lookup`).  Engines with more than one worker
(tensor/pipeline parallel) are refused at start: each rank would need its own store.

*Saves* never wait for the disk: the scheduler lists the blocks that become full in a
step; the worker drops those already stored and copies the rest out of the paged KV
(per layer in ``save_kv_layer``, once the layer's attention ran; any layer not seen
there in ``wait_for_save``) into a staging tensor it hands to a background
``put_many``.  The step waits only for that copy.  The copy frees vLLM to
reuse the blocks at once, so ``request_finished`` never delays freeing.  Pending saves
are bounded (``max_pending_save_bytes``); at shutdown and at exit they are finished.

*Loads* are synchronous (``start_load_kv`` reads, verifies and scatters before the
forward runs), since a stored block holds every layer and must be read whole anyway.
kvstore answers a block that fails its checksum as a miss (and quarantines it).  The
worker copies only the verified leading blocks of each request and reports the first
failed block and everything after it through ``get_block_ids_with_load_errors``; vLLM
then recomputes from there (this needs ``kv_load_failure_policy="recompute"``, checked
at start) and discards that step's output.  That step's forward did read the unloaded
blocks, so nothing it computed is saved; the recompute saves the blocks again.  Wrong
KV therefore never reaches a served token or the store.

Hits are reported with the ``disk`` cache-hit source, so vLLM's
``prompt_tokens_by_source`` and connector prefix-cache metrics show them.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.errors import KVStoreError
from kvstore.integrations.vllm_config import ConnectorConfig
from kvstore.integrations.vllm_lookup import LookupClient, LookupServer, socket_name
from kvstore.keys import Namespace
from kvstore.store import PutResult, Store
from kvstore.store import open as open_store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["ConnectorConfig", "KVStoreConnector", "KVStoreConnectorMetadata", "connector_stats"]

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- shared store

_COUNTERS = ("lookups", "lookup_hit_blocks", "load_blocks", "loaded_blocks",
             "load_failed_blocks", "save_blocks", "saved_blocks", "save_dedup_blocks",
             "save_failed_blocks", "save_dropped_blocks", "saved_bytes",
             # nanoseconds: the forward waiting on save copies / on loads; background puts
             "save_stall_ns", "load_ns", "save_io_ns")


class _SharedStore:
    """One open store for every connector of this process using that directory.

    The store runs on an event loop in a portal thread; lookups and loads are blocking
    calls into it, saves are tasks whose futures are kept until they finish.
    """

    def __init__(self, config: ConnectorConfig) -> None:
        self.config = config
        self._portal_cm: AbstractContextManager[BlockingPortal] = start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        try:
            self._store_cm = self.portal.wrap_async_context_manager(
                open_store(config.path, **config.open_options()))
            self.store: Store = self._store_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self.namespace: Namespace | None = None
        self.users = 0
        self.closed = False
        self._lock = threading.Lock()
        self._pending: list[tuple[Future[PutResult], int]] = []
        self._pending_bytes = 0
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.server: LookupServer | None = None

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self.counters[name] += n

    def match_hashes(self, hashes: list[bytes]) -> int:
        """How many leading vLLM block hashes name stored blocks (0 before the worker
        registered its KV tensors: without a namespace there are no keys)."""
        ns = self.namespace
        if ns is None or not hashes:
            return 0
        return self.portal.call(self.store.match_prefix, ns.engine_keys(hashes))

    def serve_lookups(self) -> None:
        """Answer a scheduler in another process (see :mod:`.vllm_lookup`)."""
        if self.server is None:
            try:
                self.server = LookupServer(socket_name(self.config.path), self.match_hashes)
            except OSError as e:  # another engine serves this name: it would hold the store
                _warn_once("serve", "kvstore connector: cannot serve lookups for %s: %s; "
                           "a scheduler in another process will see no hits",
                           self.config.path, e)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.portal.call(self.store.contains_many, keys)

    def get_many(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]
                 ) -> list[torch.Tensor | None]:
        return self.portal.call(self.store.get_many, keys, out)

    def submit_put(self, keys: list[bytes], values: list[torch.Tensor],
                   parents: list[bytes | None], nbytes: int) -> None:
        """Start a put in the background; wait only if too much is already pending."""
        self._reap(block_until=self.config.max_pending_save_bytes - nbytes)

        async def put() -> PutResult:
            start = time.perf_counter_ns()
            try:
                return await self.store.put_many(keys, values, parents=parents)
            finally:
                self.count(save_io_ns=time.perf_counter_ns() - start)

        future = self.portal.start_task_soon(put)
        future.add_done_callback(lambda f: self._done(f, len(keys)))
        with self._lock:
            self._pending.append((future, nbytes))
            self._pending_bytes += nbytes

    def _done(self, future: Future[PutResult], n: int) -> None:
        if future.cancelled():
            self.count(save_failed_blocks=n)
            return
        error = future.exception()
        if error is None:
            result = future.result()
            self.count(saved_blocks=result.written, save_dedup_blocks=result.deduplicated,
                       saved_bytes=result.bytes_written)
        else:
            # A full or read-only store loses a cache fill, never correctness.
            self.count(save_failed_blocks=n)
            _warn_once(type(error).__name__, "kvstore connector: saving %d blocks failed "
                       "(%s: %s); later saves may fail the same way",
                       n, type(error).__name__, error)

    def _reap(self, block_until: int | None = None) -> None:
        """Drop finished saves; with ``block_until``, wait for the oldest until at most
        that many bytes are pending (None: wait for all)."""
        while True:
            with self._lock:
                self._pending = [(f, b) for f, b in self._pending if not f.done()]
                self._pending_bytes = sum(b for _, b in self._pending)
                if not self._pending or (block_until is not None
                                         and self._pending_bytes <= max(block_until, 0)):
                    return
                oldest = self._pending[0][0]
            with suppress(Exception):  # a failed save is counted and logged by _done
                oldest.result()

    def flush(self) -> None:
        self._reap(block_until=None)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.server is not None:
            self.server.close()
        try:
            self.flush()
            self._store_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)


_STORES: dict[str, _SharedStore] = {}
_STORES_LOCK = threading.Lock()
_WARNED: set[str] = set()


def _warn_once(what: str, message: str, *args: object) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        logger.warning(message, *args)


def _join(shared: _SharedStore, config: ConnectorConfig) -> _SharedStore:
    """One more user of an open store (caller holds ``_STORES_LOCK``)."""
    if shared.config != config:
        raise ValueError(f"kvstore connector: the store at {config.path!r} is already "
                         f"open in this process with other options ({shared.config})")
    shared.users += 1
    return shared


def _find(config: ConnectorConfig) -> _SharedStore | None:
    """The store a worker of this process opened at ``config.path``, if any."""
    with _STORES_LOCK:
        shared = _STORES.get(os.path.realpath(config.path))
        return None if shared is None else _join(shared, config)


def _acquire(config: ConnectorConfig) -> _SharedStore:
    key = os.path.realpath(config.path)
    with _STORES_LOCK:
        shared = _STORES.get(key)
        if shared is None:
            try:
                shared = _SharedStore(config)
            except (KVStoreError, OSError, ValueError) as e:
                raise RuntimeError(
                    f"kvstore connector: cannot open the store at {config.path!r}: "
                    f"{type(e).__name__}: {e}. Check kv_connector_extra_config['path'] "
                    "(a writable directory, not open in another process).") from e
            _STORES[key] = shared
            shared.users += 1
            return shared
        return _join(shared, config)


def _release(shared: _SharedStore) -> None:
    with _STORES_LOCK:
        shared.users -= 1
        if shared.users > 0:
            return
        for key, value in list(_STORES.items()):
            if value is shared:
                del _STORES[key]
    shared.close()


@atexit.register
def _close_all() -> None:
    """Finish pending saves and close the stores when the interpreter exits, in case
    vLLM did not call ``shutdown()`` (e.g. an ``LLM`` that was never deleted)."""
    with _STORES_LOCK:
        stores = list(_STORES.values())
        _STORES.clear()
    for shared in stores:
        try:
            shared.close()
        except Exception as e:  # exiting anyway; say why the last saves may be missing
            logger.warning("kvstore connector: closing %s failed: %s", shared.config.path, e)


def connector_stats(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Counters of the connector(s) using the store at ``path`` in this process, and the
    store's own ``stats()``; waits for pending saves first so the numbers are final.

    ``lookup_hit_blocks`` are blocks the scheduler claimed as hits; ``loaded_blocks``
    the ones actually read, verified and copied into vLLM's KV cache;
    ``load_failed_blocks`` the ones reported back to vLLM for recomputation.
    """
    with _STORES_LOCK:
        shared = _STORES.get(os.path.realpath(os.fspath(path)))
    if shared is None:
        raise KeyError(f"no kvstore connector has the store at {os.fspath(path)!r} open "
                       "in this process")
    shared.flush()
    with shared._lock:
        counters: dict[str, Any] = dict(shared.counters)
    counters["namespace"] = None if shared.namespace is None else \
        shared.namespace.canonical_json()
    counters["store"] = shared.portal.call(_stats, shared.store)
    return counters


async def _stats(store: Store) -> dict[str, Any]:
    return store.stats().as_dict()


# ---------------------------------------------------------------------------- metadata

@dataclass
class _Load:
    req_id: str
    block_ids: list[int]
    hashes: list[bytes]


@dataclass
class _Save:
    block_id: int
    hash: bytes
    parent_hash: bytes | None


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker: blocks to load before the forward (per request,
    in chain order) and blocks that become full in it and are not stored yet."""

    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)


@dataclass
class _RequestState:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    lookup_from: int = 0  # block-aligned local hit passed to the last lookup


# ---------------------------------------------------------------------------- connector

class KVStoreConnector(KVConnectorBase_V1):
    """The connector class vLLM instantiates (once per role)."""

    _cache_hit_source = CacheHitSource.DISK

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to preemption is a later cache miss, so a
        # preempted request need not be recomputed on its account.
        return False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self._config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        if transfer.kv_load_failure_policy != "recompute":
            raise ValueError(
                "kvstore connector: set kv_transfer_config kv_load_failure_policy="
                "'recompute'. A block that fails its checksum is answered as a miss; vLLM "
                "must recompute it rather than fail the request.")
        parallel = vllm_config.parallel_config
        if parallel.world_size > 1:
            raise ValueError(
                "kvstore connector: one worker per engine only (tensor/pipeline parallel "
                f"size 1, got world size {parallel.world_size}); a store directory is "
                "served by one process")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError(
                "kvstore connector: models with several KV cache groups (hybrid "
                "attention) are not supported; one stored block holds every layer")
        self._block_size = vllm_config.cache_config.block_size
        self._shared: _SharedStore | None = None
        self._client: LookupClient | None = None
        self._released = False
        self._counts = dict.fromkeys(("lookups", "lookup_hit_blocks"), 0)
        if role == KVConnectorRole.WORKER:
            self._shared = _acquire(self._config)
        else:
            # vLLM builds the worker (which opens the store) before the scheduler: find
            # it in this process, or ask it over its lookup socket.
            self._shared = _find(self._config)
            if self._shared is None:
                try:
                    self._client = LookupClient(socket_name(self._config.path))
                except OSError as e:
                    raise RuntimeError(
                        f"kvstore connector: no worker serves the store at "
                        f"{self._config.path!r}, neither in this process nor over its lookup "
                        f"socket ({e}); the worker opens the store and must start first"
                    ) from e
        # scheduler side
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: list[_Load] = []
        # worker side
        self._layers: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._block_axis = 0
        self._block_shape: tuple[int, ...] = ()
        self._dtype = torch.float32
        self._staging: torch.Tensor | None = None
        self._staging_meta: KVStoreConnectorMetadata | None = None
        self._saves: list[_Save] = []
        self._step_load_failed = False
        self._staged_layers: set[int] = set()
        self._load_errors: set[int] = set()

    # ------------------------------------------------------------------ helpers

    def _count(self, **deltas: int) -> None:
        """Scheduler-side counters: into the shared store's when it is in this process."""
        if self._shared is not None:
            self._store.count(**deltas)
        else:
            for name, n in deltas.items():
                self._counts[name] += n

    @property
    def _store(self) -> _SharedStore:
        if self._shared is None:
            raise RuntimeError("kvstore connector: worker method called on the scheduler side")
        return self._shared

    def _keys(self, hashes: Sequence[bytes]) -> list[bytes] | None:
        ns = self._store.namespace
        return None if ns is None else ns.engine_keys(hashes)

    def _hashes(self, request: Request) -> list[bytes]:
        """The request's full-block hashes, or none if they are not per vLLM block
        (a hybrid model hashing at a finer granularity)."""
        hashes = list(request.block_hashes)
        if len(hashes) > request.num_tokens // self._block_size:
            _warn_once("granularity", "kvstore connector: block hashes are finer than "
                       "blocks (hybrid model?); connector disabled")
            return []
        return [bytes(h) for h in hashes]

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        state = self._requests.setdefault(request.request_id, _RequestState(request))
        state.request, state.lookup_from = request, num_computed_tokens
        hashes = self._hashes(request)
        first = num_computed_tokens // self._block_size
        # At least one prompt token must be computed (it yields the first logits).
        last = min(len(hashes), (request.num_tokens - 1) // self._block_size)
        if last <= first:
            return 0, False
        try:
            if self._client is not None:
                hit = self._client.match(hashes[first:last])
            else:
                hit = self._store.match_hashes(hashes[first:last])
        except (KVStoreError, OSError, ValueError) as e:
            _warn_once("lookup", "kvstore connector: lookup failed (no hits until it "
                       "works again): %s", e)
            return 0, False
        self._count(lookups=1)
        return min(hit, last - first) * self._block_size, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        state = self._requests.setdefault(request.request_id, _RequestState(request))
        state.request = request
        if num_external_tokens <= 0:
            return
        block_ids = list(blocks.get_block_ids()[0])
        first = state.lookup_from // self._block_size
        n = num_external_tokens // self._block_size
        hashes = self._hashes(request)[first:first + n]
        self._pending_loads.append(_Load(request.request_id, block_ids[first:first + n], hashes))
        self._count(lookup_hit_blocks=n)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._plan_saves(state, new.num_computed_tokens, scheduled[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._plan_saves(state, cached.num_computed_tokens[i], scheduled[req_id], meta)
        return meta

    def _plan_saves(self, state: _RequestState, computed: int, scheduled: int,
                    meta: KVStoreConnectorMetadata) -> None:
        """Blocks that become full in this step (their hash is known once all their
        tokens are; speculative tokens have none yet, so they are never saved)."""
        hashes = self._hashes(state.request)
        end = min((computed + scheduled) // self._block_size, len(hashes), len(state.block_ids))
        for idx in range(computed // self._block_size, end):
            meta.saves.append(_Save(state.block_ids[idx], hashes[idx],
                                    hashes[idx - 1] if idx else None))

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        # Saves copied their blocks out during the steps: nothing holds them now.
        self._requests.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not kv_caches:
            raise ValueError("kvstore connector: the engine registered no KV cache tensors")
        num_blocks = self._kv_cache_config.num_blocks
        names = list(kv_caches)
        first = kv_caches[names[0]]
        axes = [i for i, s in enumerate(first.shape) if s == num_blocks]
        if len(axes) != 1:
            raise ValueError(f"kvstore connector: cannot tell the block axis of KV cache "
                             f"shape {tuple(first.shape)} ({num_blocks} blocks)")
        axis = axes[0]
        for name in names:
            t = kv_caches[name]
            if t.shape != first.shape or t.dtype != first.dtype or t.stride() != first.stride():
                raise ValueError(f"kvstore connector: layer {name} has KV cache shape "
                                 f"{tuple(t.shape)} {t.dtype}, unlike {names[0]}; "
                                 "models with mixed layer shapes are not supported")
        self._layers = dict(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(names)}
        self._block_axis = axis
        self._block_shape = tuple(s for i, s in enumerate(first.shape) if i != axis)
        self._dtype = first.dtype
        self._store.namespace = self._namespace(first, axis, names)
        self._store.serve_lookups()

    def _namespace(self, t: torch.Tensor, axis: int, names: list[str]) -> Namespace:
        from vllm.platforms import current_platform

        dims = ["B" if i == axis else str(s) for i, s in enumerate(t.shape)]
        order = sorted(range(t.dim()), key=lambda i: -t.stride()[i])
        layout = (f"vllm-v1;{current_platform.device_type};shape={'x'.join(dims)};"
                  f"order={','.join(map(str, order))}")
        model = self._vllm_config.model_config
        cache = self._vllm_config.cache_config
        parallel = self._vllm_config.parallel_config
        return Namespace(
            model=str(model.model), dtype=str(t.dtype).removeprefix("torch."),
            block_size=self._block_size, layout=layout, tp_rank=parallel.rank,
            tp_size=parallel.world_size,
            extra=(("revision", str(model.revision)), ("layers", ",".join(names)),
                   ("vllm_hash", str(cache.prefix_caching_hash_algo))))

    def _block_index(self, block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=device)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        self._step_load_failed = False
        if meta.loads:
            start = time.perf_counter_ns()
            self._load(meta)
            self._store.count(load_ns=time.perf_counter_ns() - start)

    def _load(self, meta: KVStoreConnectorMetadata) -> None:
        loads = [load for load in meta.loads if load.block_ids]
        keys = self._keys([h for load in loads for h in load.hashes])
        if not loads:
            return
        n = sum(len(load.block_ids) for load in loads)
        self._store.count(load_blocks=n)
        if keys is None:  # no KV registered: nothing can be loaded
            self._fail([bid for load in loads for bid in load.block_ids])
            return
        buf = torch.empty((n, len(self._layers), *self._block_shape), dtype=self._dtype)
        try:
            got = self._store.get_many(keys, list(buf.unbind(0)))
        except KVStoreError as e:
            _warn_once("load", "kvstore connector: load failed: %s", e)
            got = [None] * n
        rows: list[int] = []
        dest: list[int] = []
        pos = 0
        for load in loads:
            ok = next((i for i, g in enumerate(got[pos:pos + len(load.block_ids)]) if g is None),
                      len(load.block_ids))
            # Only a verified prefix is usable: vLLM recomputes from the first failure.
            rows.extend(range(pos, pos + ok))
            dest.extend(load.block_ids[:ok])
            self._fail(load.block_ids[ok:])
            pos += len(load.block_ids)
        if rows:
            self._scatter(buf[torch.tensor(rows, dtype=torch.long)], dest)
        self._store.count(loaded_blocks=len(rows))

    def _fail(self, block_ids: Sequence[int]) -> None:
        if block_ids:
            self._step_load_failed = True
        self._load_errors.update(block_ids)
        self._store.count(load_failed_blocks=len(block_ids))

    def _scatter(self, blocks: torch.Tensor, block_ids: list[int]) -> None:
        axis = self._block_axis
        for li, layer in enumerate(self._layers.values()):
            index = self._block_index(block_ids, layer.device)
            layer.index_copy_(axis, index, blocks[:, li].to(layer.device).movedim(0, axis))

    def wait_for_layer_load(self, layer_name: str) -> None:
        # start_load_kv finished every layer: a stored block holds all of them.
        return

    def _step_saves(self, meta: KVStoreConnectorMetadata) -> list[_Save]:
        """This step's saves less blocks the store already has (or that two requests
        fill in one step): copying those out of the KV cache would be wasted."""
        if self._staging_meta is meta:
            return self._saves
        first: dict[bytes, _Save] = {}
        for save in meta.saves:
            first.setdefault(save.hash, save)
        saves = list(first.values())
        keys = self._keys([s.hash for s in saves])
        if keys is None:
            saves = []
        elif keys:
            try:
                present = self._store.contains_many(keys)
            except KVStoreError:
                present = [False] * len(keys)
            saves = [s for s, p in zip(saves, present) if not p]
        self._staging_meta, self._saves, self._staged_layers = meta, saves, set()
        self._staging = torch.empty((len(saves), len(self._layers), *self._block_shape),
                                    dtype=self._dtype) if saves else None
        return saves

    def _stage(self, meta: KVStoreConnectorMetadata, layer_index: int) -> None:
        """Copy this step's blocks of one layer out of the paged KV cache."""
        saves = self._step_saves(meta)
        if self._staging is None or layer_index in self._staged_layers:
            return
        layer = list(self._layers.values())[layer_index]
        index = self._block_index([s.block_id for s in saves], layer.device)
        self._staging[:, layer_index] = layer.index_select(self._block_axis, index) \
            .movedim(self._block_axis, 0).to("cpu")
        self._staged_layers.add(layer_index)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        if meta.saves and layer_name in self._layer_index and not self._step_load_failed:
            start = time.perf_counter_ns()
            self._stage(meta, self._layer_index[layer_name])
            self._store.count(save_stall_ns=time.perf_counter_ns() - start)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        if not meta.saves:
            return
        # vLLM calls this from a `finally`, so also when the forward raised: layers not
        # reached this step still hold another request's (or no) KV.  Saving them would
        # persist wrong bytes under the blocks' real hashes.
        forward_failed = sys.exc_info()[1] is not None
        if self._step_load_failed or forward_failed:
            # (Or) this step's forward read KV that failed to load (vLLM discards its
            # output and recomputes): blocks computed in it may hold KV derived from
            # garbage.  Dropping them costs a cache fill; the recompute plans them again.
            self._store.count(save_dropped_blocks=len(meta.saves))
            self._staging_meta = self._staging = None
            return
        start = time.perf_counter_ns()
        saves = self._step_saves(meta)
        for li in range(len(self._layers)):
            self._stage(meta, li)
        staging = self._staging
        self._staging_meta = self._staging = None
        ns = self._store.namespace
        if staging is not None and ns is not None:
            keys = ns.engine_keys([s.hash for s in saves])
            parents = [None if s.parent_hash is None else ns.engine_key(s.parent_hash)
                       for s in saves]
            self._store.count(save_blocks=len(keys))
            try:
                self._store.submit_put(keys, list(staging.unbind(0)), parents,
                                       staging.numel() * staging.element_size())
            except KVStoreError as e:
                _warn_once("save", "kvstore connector: save failed: %s", e)
        self._store.count(save_stall_ns=time.perf_counter_ns() - start)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ both

    def shutdown(self) -> None:
        if self._released:
            return
        self._released = True
        if self._client is not None:
            self._client.close()
        if self._shared is not None:
            _release(self._shared)
