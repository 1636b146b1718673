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
prefix, covering the LoRA adapter's name, multimodal inputs and cache salt).  The
scheduler side sees those hashes; it carries ``(block id, block hash)`` pairs to the
worker in the step metadata, and both sides turn a hash into a store key with
:meth:`Namespace.engine_key`.  The namespace holds what makes KV of one engine unusable
by another (:mod:`kvstore.integrations.vllm_scope` lists it): a fingerprint of the
weights loaded, the model config as vLLM applied it (overrides, RoPE, quantisation),
model and KV cache dtypes, the codec class, block size, the physical layout of the paged
KV tensors (shape, stride order, platform), the layer names, the tensor-parallel rank
and vLLM's hash algorithm (reproducible across processes with the default sha256, so a
restarted engine finds its blocks again).  A request with a LoRA adapter has its hashes
bound to a fingerprint of the adapter's files (vLLM hashes only its name and path).

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
(:mod:`kvstore.integrations.vllm_lookup`), which answers only the scheduler of its own
engine and key scope.

*Tensor/pipeline parallel.*  Each rank (worker process) keeps its own shard of every
block in a store of its own, ``path/rank-R-of-W`` (:mod:`kvstore.integrations.vllm_ranks`
says why directories, not namespaces in one store).  The scheduler asks every rank's
lookup server and takes the minimum: a block is a hit only when every rank has it.  Each
rank loads its shard and reports its own failed blocks; vLLM unions them and finishes a
request's load only when every rank reported it, then recomputes from the first block
any rank failed.

*Saves* never wait for the disk: the scheduler keeps, per request, how far its blocks
were planned for saving, and lists every full block after that mark whose KV is
computed by the end of the step and whose hash is known (with async scheduling a
decode block's hash is known a step later: it is planned then); the worker drops those
already stored and copies the rest out of the paged KV
(per layer in ``save_kv_layer``, once the layer's attention ran; any layer not seen
there in ``wait_for_save``) into a staging tensor it hands to a background
``put_many``.  The step waits only for that copy.  The copy frees vLLM to
reuse the blocks at once, so ``request_finished`` never delays freeing.  Pending saves
are bounded (``max_pending_save_bytes``); at shutdown and at exit they are finished.

*Loads* are asynchronous: a request with a hit waits in vLLM's
``WAITING_FOR_REMOTE_KVS`` while other requests keep running; the worker reads its blocks
in the background (``start_load_kv`` starts the read into a private buffer), and once
the read is done (``get_finished``) copies the verified leading blocks into the paged KV
cache and reports the request finished.  kvstore answers a block that fails its
checksum as a miss (and quarantines it); the first failed block and everything after it
are reported through ``get_block_ids_with_load_errors`` in the same step, and vLLM
recomputes from there (this needs ``kv_load_failure_policy="recompute"``, checked at
start).  vLLM registers an async-loaded request's blocks in its own prefix cache only
when the load is finished, and only up to the verified prefix: a block that failed to
load is never a local cache hit for a later request, even if its own request is aborted
before recomputing it (with synchronous loads vLLM caches the blocks when it allocates
them).  No forward ever reads a block that failed to load, so nothing computed from one
is saved.  Wrong KV therefore never reaches a served token or the store.

With ``async_loads`` off, loads are synchronous: the lookup itself reads and verifies
the hit blocks (the scheduler waits; with the multiprocess engine the worker's lookup
server reads them) and claims only the verified prefix, since vLLM adds a synchronously
loaded request's blocks to its own prefix cache when it allocates them, before the load.
The worker copies those blocks into the paged KV in ``start_load_kv``, before the
forward of the step that scheduled the request.  Should a read-ahead be gone by then
(not in vLLM's order of calls), the blocks are read there, and a failed one is reported
through ``get_block_ids_with_load_errors`` as above; nothing that step computed is saved.

With the memory tier (``memory_bytes``) and ``prefetch`` on, a lookup that finds stored
blocks starts bringing them into memory at once (``Store.prefetch``), so the load that
vLLM schedules later is served from RAM.  Saves are droppable by default
(``background_saves``): under write backpressure (``backlog_bytes``) a save is dropped
whole and counted, never waited for.

*Metrics.*  Hits are reported with the ``disk`` cache-hit source, so vLLM's
``prompt_tokens_by_source`` and connector prefix-cache metrics show them; the connector's
own numbers (lookups, loaded/failed blocks, load time, save outcomes, bytes, store use,
corruption) reach vLLM's ``/metrics`` and its "KV Transfer metrics" log line through
vLLM's connector stats hooks (:mod:`kvstore.integrations.vllm_metrics`).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
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
from kvstore.integrations.vllm_async_lookup import Lookups
from kvstore.integrations.vllm_config import ConnectorConfig
from kvstore.integrations.vllm_lookup import (
    LookupClient,
    LookupServer,
    RankLookups,
    socket_name,
)
from kvstore.integrations.vllm_metrics import (
    SCHEDULER_COUNTERS,
    STORE_COUNTERS,
    STORE_GAUGES,
    KVStoreConnectorStats,
    KVStorePromMetrics,
)
from kvstore.integrations.vllm_ranks import rank_config, rank_dirs
from kvstore.integrations.vllm_saves import SaveMark, plan_saves
from kvstore.integrations.vllm_scope import LoraScopes, model_scope, scope_digest, scoped_hash
from kvstore.keys import Namespace
from kvstore.store import PutResult, Store
from kvstore.store import open as open_store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["ConnectorConfig", "KVStoreConnector", "KVStoreConnectorMetadata",
           "all_connector_stats", "connector_stats"]

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- shared store

# The scheduler's (lookups) and the worker's; both reach vLLM's metrics
# (kvstore.integrations.vllm_metrics).
_COUNTERS = (*SCHEDULER_COUNTERS, "load_blocks", "loaded_blocks", "loaded_bytes",
             "load_failed_blocks", "save_blocks", "saved_blocks", "save_dedup_blocks",
             "save_failed_blocks", "save_dropped_blocks", "saved_bytes",
             # nanoseconds: the forward waiting on save copies / on loads; background puts
             "save_stall_ns", "load_ns", "save_io_ns")
_MAX_LOAD_SAMPLES = 4096  # load durations kept for vLLM's histogram between two steps
_MAX_FAILED_KEYS = 1 << 16  # keys whose load raised, answered as misses


class _SharedStore:
    """One open store for every connector of this process using that directory.

    The store runs on an event loop in a portal thread; lookups and loads are blocking
    calls into it, saves are tasks whose futures are kept until they finish.
    """

    def __init__(self, config: ConnectorConfig, engine_id: str) -> None:
        self.config = config
        self.engine_id = engine_id
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
        # (layers, block shape, dtype) of a stored block, set with the namespace: the
        # lookup of a synchronous load reads into a buffer of that shape.
        self.layout: tuple[int, tuple[int, ...], torch.dtype] | None = None
        self._prepared: dict[bytes, _Prepared] = {}  # sync loads, by first key
        self.failed_keys: set[bytes] = set()  # loads that raised: misses from now on
        # Moves to a new key scope since start (a weight update: KVStoreConnector
        # .reset_cache); lookups of another epoch are answered 0.
        self.scope_epoch = 0
        # Why lookups, loads and saves are off (the weights changed and no new scope
        # is known yet); None: on.
        self.suspended: str | None = None
        self._generation = 0  # worker steps (start_load_kv) seen, to age them out
        self.users = 0
        self.closed = False
        self._lock = threading.Lock()
        self._pending: list[tuple[Future[PutResult], int]] = []
        self._pending_bytes = 0
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.load_seconds: list[float] = []  # drained into vLLM's stats each step
        self.server: LookupServer | None = None

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self.counters[name] += n

    def record_load(self, seconds: float) -> None:
        with self._lock:
            if len(self.load_seconds) < _MAX_LOAD_SAMPLES:
                self.load_seconds.append(seconds)

    def rescope(self, epoch: int, namespace: Namespace) -> None:
        """The connector moved to a new key scope (``epoch``): keys come from
        ``namespace`` from now on; reads kept for the old keys are dropped."""
        with self._lock:
            self.namespace, self.scope_epoch, self.suspended = namespace, epoch, None
            self._prepared.clear()
            self.failed_keys.clear()

    def suspend(self, why: str) -> None:
        """No lookups, loads or saves until the next :meth:`rescope`."""
        with self._lock:
            self.suspended = why
            self._prepared.clear()

    def match_hashes(self, hashes: list[bytes], epoch: int = 0) -> int:
        """How many leading vLLM block hashes name stored blocks (0 before the worker
        registered its KV tensors: without a namespace there are no keys).

        With the memory tier and ``prefetch`` on, the hit blocks start coming into
        memory at once: vLLM schedules their load a step or more later (after
        allocating blocks for the request, possibly after other requests), and the
        load's ``get_many`` then waits only for reads still in flight."""
        ns = self.namespace
        if ns is None or not hashes or epoch != self.scope_epoch or self.suspended:
            return 0
        keys = ns.engine_keys(hashes)
        with self._lock:
            # A load that raised (not a checksum miss: that block is quarantined) would
            # be retried by vLLM forever if the same keys stayed hits.
            cut = next((i for i, k in enumerate(keys) if k in self.failed_keys), len(keys))
        keys = keys[:cut]
        if not keys:
            return 0
        if not self.config.async_loads:
            return self._read_ahead(keys)
        if self.store.memory is None or not self.config.prefetch:
            return self.portal.call(self.store.match_prefix, keys)
        return self.portal.call(self._match_and_prefetch, keys)

    def _read_ahead(self, keys: list[bytes]) -> int:
        """Synchronous loads: read and verify the stored leading blocks now and keep
        them for the worker's ``start_load_kv``; the hit is the verified prefix only.

        vLLM adds a synchronously loaded request's blocks to its own prefix cache when
        it allocates them, before the load: a block claimed as a hit that then failed
        to load would be a local cache hit for a later request if this one were aborted
        or preempted before recomputing it.  Claiming only blocks already read and
        verified closes that: a corrupt block is a plain miss here."""
        layout = self.layout
        if layout is None:
            return 0
        with self._lock:
            held = self._prepared.get(keys[0])
            if held is not None and held.keys == keys[:len(held.keys)]:
                # The same request asking again (it waited for free blocks): what was
                # read is still right, whatever happened in the store since.
                held.generation = self._generation
                return len(held.keys)
        start = time.perf_counter_ns()
        hit = self.portal.call(self.store.match_prefix, keys)
        if not hit:
            return 0
        layers, shape, dtype = layout
        buffer = _load_buffer((hit, layers, *shape), dtype)
        try:
            got = self.portal.call(self.store.get_many, keys[:hit], list(buffer.unbind(0)))
        except Exception as e:  # a failed read is a miss: vLLM computes
            self.load_raised(keys[:hit], e)
            return 0
        ok = next((i for i, g in enumerate(got) if g is None), hit)
        elapsed = time.perf_counter_ns() - start
        self.count(load_ns=elapsed)
        self.record_load(elapsed / 1e9)
        if ok:
            with self._lock:
                self._prepared[keys[0]] = _Prepared(keys[:ok], buffer[:ok], self._generation)
        return ok

    def load_raised(self, keys: Sequence[bytes], error: Exception) -> None:
        """A read of ``keys`` raised: answer them as misses in this engine life (bounded:
        forgotten after ``_MAX_FAILED_KEYS``), so that vLLM computes instead of loading
        them again and again."""
        _warn_once("load", "kvstore connector: load failed: %s: %s", type(error).__name__,
                   error)
        with self._lock:
            if len(self.failed_keys) + len(keys) > _MAX_FAILED_KEYS:
                self.failed_keys.clear()
            self.failed_keys.update(keys)

    def load_failed(self, key: bytes) -> None:
        """A load found ``key`` missing or unreadable.  The store quarantines a block it
        cannot read in the same pass; should it still be stored (a read-only store
        cannot quarantine), it is answered as a miss for this engine life, so that
        vLLM recomputes it once instead of loading it again and again."""
        try:
            still = self.portal.call(self.store.contains_many, [key])[0]
        except Exception:  # noqa: BLE001 - a store that cannot answer: keep it out
            still = True
        if still:
            _warn_once("unloadable", "kvstore connector: block %s of the store at %s "
                       "failed to load but stays stored (read-only store?); answered as a "
                       "miss from now on", key.hex()[:32], self.config.path)
            with self._lock:
                if len(self.failed_keys) >= _MAX_FAILED_KEYS:
                    self.failed_keys.clear()
                self.failed_keys.add(key)

    def take_prepared(self, keys: list[bytes]) -> torch.Tensor | None:
        """The blocks :meth:`_read_ahead` read for a load of ``keys`` (None if it
        holds fewer), forgotten once taken."""
        if not keys:
            return None
        with self._lock:
            held = self._prepared.pop(keys[0], None)
        if held is None or held.keys[:len(keys)] != keys:
            return None
        return held.buffer[:len(keys)]

    def next_step(self) -> None:
        """A worker step began: forget reads no load took for a few steps (their
        request was not scheduled, or aborted; vLLM looks it up again if it comes
        back).  A lookup's load comes in the step the scheduler built with it, or with
        async scheduling the one after."""
        with self._lock:
            self._generation += 1
            stale = [k for k, p in self._prepared.items()
                     if p.generation < self._generation - _PREPARED_STEPS]
            for k in stale:
                del self._prepared[k]

    async def _match_and_prefetch(self, keys: list[bytes]) -> int:
        hit = await self.store.match_prefix(keys)
        if hit:
            self.store.prefetch(keys[:hit])  # runs on; bounded by prefetch_share
        return hit

    def attach_remote(self, namespace: Namespace) -> None:
        """With the ``remote`` option: the shared S3 tier behind this rank's store, under
        the namespace just learnt (remote objects are named by it).  Refused
        credentials stop the engine at start, saying why (or, with
        ``on_auth_error="disable"``, leave the tier disabled)."""
        remote = self.config.remote
        if remote is None or self.store.remote is not None:
            return
        try:
            self.portal.call(self.store.attach_remote, remote, namespace)
        except ImportError as e:
            raise RuntimeError("kvstore connector: the remote option needs obstore: "
                               "pip install 'kvstore[remote]'") from e

    def serve_lookups(self, scope: bytes) -> None:
        """Answer this engine's scheduler in another process (see :mod:`.vllm_lookup`).

        The name is this engine's own; if it is taken, another engine of the same id
        serves the same path (a copied config with a fixed ``engine_id``): starting would
        let one engine's scheduler count the other's blocks, so this engine refuses.
        """
        if self.server is None:
            name = socket_name(self.config.path, self.engine_id)
            try:
                self.server = LookupServer(name, self.match_hashes, self.engine_id, scope,
                                           epoch=lambda: self.scope_epoch)
            except OSError as e:
                raise RuntimeError(
                    f"kvstore connector: cannot serve lookups for the store at "
                    f"{self.config.path!r} as engine {self.engine_id!r}: {e}. Another "
                    "engine with the same kv_transfer_config engine_id uses a store at this "
                    "path (another mount namespace?); give each engine its own engine_id "
                    "(or leave it unset) and its own store path") from e

    def start_get(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]
                  ) -> Future[list[torch.Tensor | None]]:
        """Read blocks in the background; the future's result is ``get_many``'s."""
        return self.portal.start_task_soon(self.store.get_many, keys, out)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.portal.call(self.store.contains_many, keys)

    def get_many(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]
                 ) -> list[torch.Tensor | None]:
        return self.portal.call(self.store.get_many, keys, out)

    def submit_put(self, keys: list[bytes], values: list[torch.Tensor],
                   parents: list[bytes | None], nbytes: int) -> None:
        """Start a put in the background; wait only if too much is already pending."""
        self._reap(block_until=self.config.max_pending_save_bytes - nbytes)

        background = self.config.background_saves

        async def put() -> PutResult:
            start = time.perf_counter_ns()
            try:
                return await self.store.put_many(keys, values, parents=parents,
                                                 background=background)
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
            # A droppable save the store refused under backpressure: a later miss.
            self.count(saved_blocks=result.written, save_dedup_blocks=result.deduplicated,
                       saved_bytes=result.bytes_written, save_dropped_blocks=result.dropped)
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
        self._prepared.clear()
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


def _join(shared: _SharedStore, config: ConnectorConfig, engine_id: str) -> _SharedStore:
    """One more user of an open store (caller holds ``_STORES_LOCK``)."""
    if shared.engine_id != engine_id:
        raise ValueError(f"kvstore connector: the store at {config.path!r} is already "
                         f"used by engine {shared.engine_id!r} in this process; give each "
                         "engine a store directory of its own")
    if shared.config != config:
        raise ValueError(f"kvstore connector: the store at {config.path!r} is already "
                         f"open in this process with other options ({shared.config})")
    shared.users += 1
    return shared


def _find(config: ConnectorConfig, engine_id: str) -> _SharedStore | None:
    """The store a worker of this engine opened at ``config.path`` in this process."""
    with _STORES_LOCK:
        shared = _STORES.get(os.path.realpath(config.path))
        return None if shared is None else _join(shared, config, engine_id)


def _acquire(config: ConnectorConfig, engine_id: str) -> _SharedStore:
    key = os.path.realpath(config.path)
    with _STORES_LOCK:
        shared = _STORES.get(key)
        if shared is None:
            try:
                shared = _SharedStore(config, engine_id)
            except (KVStoreError, OSError, ValueError) as e:
                raise RuntimeError(
                    f"kvstore connector: cannot open the store at {config.path!r}: "
                    f"{type(e).__name__}: {e}. Check kv_connector_extra_config['path'] "
                    "(a writable directory, not open in another process).") from e
            _STORES[key] = shared
            shared.users += 1
            return shared
        return _join(shared, config, engine_id)


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


def all_connector_stats() -> list[dict[str, Any]]:
    """:func:`connector_stats` of every store a connector has open in this process (a
    worker's: one; for ``LLM.collective_rpc`` when the workers are processes of their
    own)."""
    with _STORES_LOCK:
        paths = [shared.config.path for shared in _STORES.values()]
    return [connector_stats(p) for p in paths]


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
    """One step's work for the worker: requests whose blocks to load (per request, in
    chain order), blocks to save (full, computed by the end of the step, not planned
    before), and whether the step runs no forward (the worker may then wait a little
    for loads instead of returning at once)."""

    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)
    idle: bool = False
    # The scheduler's key scope: how often it moved (reset_cache) and the weights item
    # of the scope now.  The worker moves with it before this step's loads and saves.
    scope_epoch: int = 0
    weights: str = ""


@dataclass
class _RequestState:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    lookup_from: int = 0  # block-aligned local hit passed to the last lookup
    saves: SaveMark = field(default_factory=SaveMark)
    # Known when the key scope moved (a weight update): its KV so far may mix both
    # weights, so none of it is ever saved.
    frozen: bool = False


@dataclass
class _Prepared:
    keys: list[bytes]  # the verified leading keys of a lookup
    buffer: torch.Tensor  # their blocks, [len(keys), layers, *block shape]
    generation: int


def _load_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A buffer ``get_many`` fills on the store's thread.  vLLM runs the worker's hooks
    under ``torch.inference_mode``; a tensor made there is an inference tensor, which
    the memory tier's in-place copy (outside inference mode) may not write."""
    with torch.inference_mode(False):
        return torch.empty(shape, dtype=dtype)


# Worker steps a synchronous load's read-ahead is kept for its load (see next_step).
_PREPARED_STEPS = 3


@dataclass
class _InFlightLoad:
    load: _Load
    buffer: torch.Tensor
    future: Future[list[torch.Tensor | None]]
    started_ns: int
    scope_epoch: int = 0  # the key scope it was read under


# How long a step that runs no forward waits for a background load before returning
# (vLLM calls again at once while a request waits for its KV: this keeps that loop from
# spinning, and costs nothing while other requests run, since they never wait).
_IDLE_WAIT_S = 0.05


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
        world = parallel.world_size
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError(
                "kvstore connector: models with several KV cache groups (hybrid "
                "attention) are not supported; one stored block holds every layer")
        self._block_size = vllm_config.cache_config.block_size
        self._engine_id = str(transfer.engine_id)
        # Everything but the KV tensor layout: both sides derive it from the config, and
        # compare it at the lookup handshake.
        self._scope = model_scope(vllm_config, self._config)
        self._scope_digest = scope_digest(self._scope)
        # Weight updates (reset_cache): the scope's epoch and weights item now.  The
        # lookup handshake keeps comparing the scope the engine started with.
        self._scope_epoch = 0
        self._weights = dict(self._scope)["weights"]
        # Where the worker's weights came from; reload_weights(weights_path=...) changes
        # it in place (vLLM's model_config), which the worker notices at the next step.
        self._weights_source = str(vllm_config.model_config.model)
        self._lora = LoraScopes(self._config.weights_fingerprint)
        self._shared: _SharedStore | None = None
        self._client: LookupClient | RankLookups | None = None
        self._released = False
        # Scheduler counters, reported to vLLM by this connector (the worker's come from
        # the shared store); also added to the shared store's for connector_stats().
        self._counts = dict.fromkeys(SCHEDULER_COUNTERS, 0)
        self._reported: dict[str, int] = {}  # counters as last reported to vLLM
        self._reported_store: dict[str, int] = {}
        self._rank = str(parallel.rank)
        if role == KVConnectorRole.WORKER:
            # Every rank its own store (kvstore.integrations.vllm_ranks).
            self._shared = _acquire(rank_config(self._config, parallel.rank, world),
                                    self._engine_id)
        else:
            # vLLM builds the workers (which open the stores) before the scheduler: find
            # a single worker in this process, or ask every rank over its lookup socket.
            if world == 1:
                self._shared = _find(self._config, self._engine_id)
            if self._shared is None:
                names = [socket_name(d, self._engine_id)
                         for d in rank_dirs(self._config.path, world)]
                try:
                    self._client = LookupClient(names[0], self._engine_id,
                                                self._scope_digest) if world == 1 else \
                        RankLookups(names, self._engine_id, self._scope_digest)
                except OSError as e:
                    raise RuntimeError(
                        f"kvstore connector: no worker of engine {self._engine_id!r} serves "
                        f"the store at {self._config.path!r} (world size {world}), neither "
                        f"in this process nor over its lookup socket ({e}); the workers "
                        "open the stores and must start first, on this host") from e
        # scheduler side
        self._requests: dict[str, _RequestState] = {}
        self._lookups = Lookups(self._match, self._config.lookup_wait_s()) \
            if role != KVConnectorRole.WORKER else None
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
        self._staged_layers: set[int] = set()
        self._loading: dict[str, _InFlightLoad] = {}
        self._load_errors: set[int] = set()
        # A synchronous load failed in this step: its forward read unloaded blocks.
        self._step_load_failed = False

    # ------------------------------------------------------------------ helpers

    def _count(self, **deltas: int) -> None:
        """Scheduler-side counters (and into the shared store's when it is in this
        process, for connector_stats)."""
        if self._shared is not None:
            self._store.count(**deltas)
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
        """The request's full-block hashes as store keys see them, or none if they are
        not per vLLM block (a hybrid model hashing at a finer granularity) or the
        request's LoRA adapter cannot be fingerprinted."""
        hashes = list(request.block_hashes)
        if len(hashes) > request.num_tokens // self._block_size:
            _warn_once("granularity", "kvstore connector: block hashes are finer than "
                       "blocks (hybrid model?); connector disabled")
            return []
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return [bytes(h) for h in hashes]
        adapter = self._lora.fingerprint(lora)
        if adapter is None:
            _warn_once(f"lora:{getattr(lora, 'lora_path', '')}",
                       "kvstore connector: cannot read LoRA adapter %s to fingerprint it; "
                       "its requests are neither loaded nor saved",
                       getattr(lora, "lora_path", lora))
            return []
        return [scoped_hash(bytes(h), adapter) for h in hashes]

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
        assert self._lookups is not None  # the scheduler side has one
        try:
            hit = self._lookups.ask(request.request_id, hashes[first:last])
        except (KVStoreError, OSError, ValueError) as e:
            _warn_once("lookup", "kvstore connector: lookup failed (no hits until it "
                       "works again): %s", e)
            return 0, False
        if hit is None:  # still running (the remote tier): vLLM asks again next step
            self._count(lookups_deferred=1)
            return None, False
        self._count(lookups=1)
        tokens = min(hit, last - first) * self._block_size
        # Asynchronous: vLLM caches the blocks only once they arrived, and only the
        # verified ones.  Synchronous: the hit was read and verified by the lookup.
        return tokens, tokens > 0 and self._config.async_loads

    def _match(self, hashes: list[bytes]) -> int:
        """A lookup, on a lookup thread (or this one: ``Lookups`` with no wait)."""
        epoch = self._scope_epoch
        if self._client is not None:
            return self._client.match(hashes, epoch)
        return self._store.match_hashes(hashes, epoch)

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
        meta = KVStoreConnectorMetadata(
            loads=self._pending_loads, idle=scheduler_output.total_num_scheduled_tokens == 0,
            scope_epoch=self._scope_epoch, weights=self._weights)
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
        """Plan the request's blocks from its save mark on (:mod:`.vllm_saves`)."""
        if state.frozen:
            return
        hashes = self._hashes(state.request)
        for idx in plan_saves(state.saves, computed, scheduled, self._block_size,
                              len(hashes), len(state.block_ids)):
            meta.saves.append(_Save(state.block_ids[idx], hashes[idx],
                                    hashes[idx - 1] if idx else None))

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, which RL frameworks call
        around a weight update (``reload_weights``, ``update_weights``, a pause with
        ``clear_cache``).  Stored KV is only valid for the weights that computed it, so
        the connector moves to a new key scope: derived from the weight files where
        they changed (another ``weights_path``, files rewritten in place: an engine
        started later on those files shares the blocks), else a fresh one that nothing
        on disk matches (weights sent as tensors: the store is a cold cache for them).
        From now on lookups count nothing of the old scope, the worker moves with the
        next step's metadata (loads still in flight then fail and are recomputed), and
        the requests running now are never saved again (their KV may mix both weights).
        True: the move holds for every later lookup, load and save."""
        if self.role == KVConnectorRole.WORKER:
            return None  # vLLM resets the scheduler's; the worker follows its metadata
        try:
            weights = model_scope(self._vllm_config, self._config)
            new = dict(weights)["weights"]
        except ValueError:  # the new weights cannot be fingerprinted
            new = self._weights
        if new == self._weights:
            # The files say nothing new: the weights came as tensors (or did not change
            # at all: no telling which), so nothing stored may be used for them.
            new = f"update:{uuid.uuid4().hex}"
            _warn_once("reset", "kvstore connector: reset_cache: the weight files did not "
                       "change, so the weights now loaded cannot be identified; moving to a "
                       "fresh key scope (stored KV is not loaded for them)")
        self._scope_epoch += 1
        self._weights = new
        for state in self._requests.values():
            state.frozen = True
        if self._lookups is not None:
            self._lookups.forget_all()
        logger.info("kvstore connector: key scope moved (epoch %d, weights %s)",
                    self._scope_epoch, new)
        return True

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        # Saves copied their blocks out during the steps, and vLLM itself holds the
        # blocks of a request whose load is in flight until the worker reports it
        # finished: nothing here delays freeing.
        self._requests.pop(request.request_id, None)
        if self._lookups is not None:
            self._lookups.forget(request.request_id)
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
        self._store.layout = (len(names), self._block_shape, self._dtype)
        self._store.namespace = self._namespace(first, axis, names)
        self._store.attach_remote(self._store.namespace)
        self._store.serve_lookups(self._scope_digest)

    def _namespace(self, t: torch.Tensor, axis: int, names: list[str]) -> Namespace:
        from vllm.platforms import current_platform

        dims = ["B" if i == axis else str(s) for i, s in enumerate(t.shape)]
        order = sorted(range(t.dim()), key=lambda i: -t.stride()[i])
        layout = (f"vllm-v1;{current_platform.device_type};shape={'x'.join(dims)};"
                  f"order={','.join(map(str, order))}")
        parallel = self._vllm_config.parallel_config
        model = str(self._vllm_config.model_config.model)
        return Namespace(
            # A local directory by its name only: the weights fingerprint identifies the
            # model, so the same weights elsewhere (another mount, a copy) still hit.
            model=os.path.basename(model.rstrip("/")) if os.path.exists(model) else model,
            dtype=str(t.dtype).removeprefix("torch."), block_size=self._block_size,
            layout=layout, tp_rank=parallel.rank, tp_size=parallel.world_size,
            extra=(*self._scope, ("layers", ",".join(names))))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, KVStoreConnectorMetadata) or not self._layers:
            return
        shared = self._store
        if connector_metadata.scope_epoch != shared.scope_epoch:
            self._rescope(connector_metadata)
        elif shared.suspended is None and \
                str(self._vllm_config.model_config.model) != self._weights_source:
            shared.suspend(f"the weights were reloaded from "
                           f"{self._vllm_config.model_config.model!r}")
            logger.warning(
                "kvstore connector: the engine reloaded its weights (from %r) without "
                "reset_prefix_cache(reset_connector=True); the stored KV cannot be told "
                "apart, so the connector loads and saves nothing until that reset",
                self._vllm_config.model_config.model)

    def _rescope(self, meta: KVStoreConnectorMetadata) -> None:
        """Move to the scheduler's new key scope (see :meth:`reset_cache`)."""
        self._scope = tuple(sorted({**dict(self._scope), "weights": meta.weights}.items()))
        self._weights_source = str(self._vllm_config.model_config.model)
        names = list(self._layers)
        namespace = self._namespace(self._layers[names[0]], self._block_axis, names)
        self._staging_meta = self._staging = None
        self._store.rescope(meta.scope_epoch, namespace)
        logger.info("kvstore connector: worker moved to key scope epoch %d (%s)",
                    meta.scope_epoch, namespace.digest.hex()[:16])

    def _block_index(self, block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=device)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads in the background (each into a buffer of its own),
        or with ``async_loads`` off copy them into the KV cache before the forward."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        if self._config.async_loads:
            for load in meta.loads:
                self._start_load(load)
            return
        self._step_load_failed = False
        self._store.next_step()
        for load in meta.loads:
            self._load_now(load)

    def _load_now(self, load: _Load) -> None:
        """A synchronous load: the blocks its lookup read and verified, copied into
        the KV cache.  Should they be gone (never, in vLLM's order of calls), they are
        read now, and blocks that fail are reported as load errors: vLLM recomputes
        them and drops this step's output of the request; this step saves nothing."""
        n = len(load.block_ids)
        start = time.perf_counter_ns()
        self._store.count(load_blocks=n)
        keys = self._keys(load.hashes)
        if self._store.suspended is not None:
            keys = None  # the weights changed under these keys: nothing is loaded
        blocks = None if keys is None else self._store.take_prepared(keys)
        ok = n
        if blocks is None:
            blocks = _load_buffer((n, len(self._layers), *self._block_shape), self._dtype)
            try:
                got: list[torch.Tensor | None] = [None] * n if keys is None or not n else \
                    self._store.get_many(keys, list(blocks.unbind(0)))
            except Exception as e:
                self._store.load_raised(keys or [], e)
                got = [None] * n
            ok = next((i for i, g in enumerate(got) if g is None), n)
            self._note_failed(load, ok)
        if ok:
            self._scatter(blocks[:ok], load.block_ids[:ok])
        failed = load.block_ids[ok:]
        if failed:
            self._step_load_failed = True
            self._load_errors.update(failed)
        self._store.count(loaded_blocks=ok, load_failed_blocks=len(failed),
                          loaded_bytes=ok * blocks[0].nbytes if ok else 0,
                          load_ns=time.perf_counter_ns() - start)

    def _start_load(self, load: _Load) -> None:
        n = len(load.block_ids)
        self._store.count(load_blocks=n)
        keys = self._keys(load.hashes)
        buffer = _load_buffer((n, len(self._layers), *self._block_shape), self._dtype)
        future: Future[list[torch.Tensor | None]]
        if keys is None or n == 0:  # no KV registered: nothing can be loaded
            future = Future()
            future.set_result([None] * n)
        else:
            future = self._store.start_get(keys, list(buffer.unbind(0)))
        self._loading[load.req_id] = _InFlightLoad(load, buffer, future,
                                                   time.perf_counter_ns(),
                                                   self._store.scope_epoch)

    def _finish_load(self, inflight: _InFlightLoad) -> None:
        """Copy a finished load's verified leading blocks into the KV cache and record
        the first failed block and everything after it as load errors."""
        load = inflight.load
        try:
            got = inflight.future.result()
        except Exception as e:  # a failed read is a miss: vLLM recomputes
            keys = self._keys(load.hashes)
            self._store.load_raised(keys or [], e)
            got = [None] * len(load.block_ids)
        if inflight.scope_epoch != self._store.scope_epoch or self._store.suspended:
            got = [None] * len(load.block_ids)  # read under other weights' keys
        ok = next((i for i, g in enumerate(got) if g is None), len(load.block_ids))
        self._note_failed(load, ok)
        if ok:
            self._scatter(inflight.buffer[:ok], load.block_ids[:ok])
        failed = load.block_ids[ok:]
        self._load_errors.update(failed)
        elapsed = time.perf_counter_ns() - inflight.started_ns
        self._store.count(loaded_blocks=ok, load_failed_blocks=len(failed), load_ns=elapsed,
                          loaded_bytes=ok * inflight.buffer[0].nbytes if ok else 0)
        self._store.record_load(elapsed / 1e9)

    def _note_failed(self, load: _Load, ok: int) -> None:
        """The load's block ``ok`` failed (a miss, unreadable, quarantined): make sure
        no lookup promises it again (:meth:`_SharedStore.load_failed`)."""
        keys = self._keys(load.hashes)
        if keys is not None and ok < len(keys) and self._store.suspended is None:
            self._store.load_failed(keys[ok])

    def _scatter(self, blocks: torch.Tensor, block_ids: list[int]) -> None:
        axis = self._block_axis
        for li, layer in enumerate(self._layers.values()):
            index = self._block_index(block_ids, layer.device)
            layer.index_copy_(axis, index, blocks[:, li].to(layer.device).movedim(0, axis))

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Async loads finish before their request is scheduled, sync loads in
        # start_load_kv: a stored block holds all layers.
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose background load is done, their blocks copied into the KV
        cache (the failed ones reported by ``get_block_ids_with_load_errors``, which
        vLLM calls right after this, in the same step)."""
        if not self._loading:
            return None, None
        idle = self.has_connector_metadata() and getattr(
            self._get_connector_metadata(), "idle", False)
        if idle and not any(f.future.done() for f in self._loading.values()):
            wait([f.future for f in self._loading.values()], timeout=_IDLE_WAIT_S,
                 return_when=FIRST_COMPLETED)
        done = {req_id for req_id, f in self._loading.items() if f.future.done()}
        for req_id in done:
            self._finish_load(self._loading.pop(req_id))
        return None, done or None

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
        if meta.saves and layer_name in self._layer_index and not self._step_load_failed \
                and self._store.suspended is None:
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
        # (Or) a synchronous load of this step failed: its forward read unloaded
        # blocks, so blocks computed in it may hold KV derived from garbage; vLLM
        # discards the step's output, and the recompute plans them again.
        if sys.exc_info()[1] is not None or self._step_load_failed or \
                self._store.suspended is not None:
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

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ vLLM metrics

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        """What changed since the last call (vLLM asks every step, on the scheduler and
        on every worker, and sums them: see :mod:`.vllm_metrics`).  None when nothing
        did, so idle steps cost nothing."""
        if self._shared is None or self.role == KVConnectorRole.SCHEDULER:
            counts, rank = dict(self._counts), "scheduler"
            samples: list[float] = []
        else:
            shared = self._shared
            with shared._lock:
                counts = {k: v for k, v in shared.counters.items()
                          if k not in SCHEDULER_COUNTERS}
                samples, shared.load_seconds = shared.load_seconds, []
            rank = self._rank
        delta = {k: v - self._reported.get(k, 0) for k, v in counts.items()
                 if v != self._reported.get(k, 0)}
        if not delta and not samples:
            return None
        self._reported = counts
        stats = KVStoreConnectorStats()
        stats.add(rank, delta, load_seconds=samples)
        if rank != "scheduler":  # the store's own numbers, sampled when something changed
            store = self._store.portal.call(_stats, self._store.store)
            stats.set_gauges(rank, {g: store[g] for g in STORE_GAUGES})
            totals = {c: int(store[c]) for c in STORE_COUNTERS}
            stats.add(rank, {f"store_{c}": n - self._reported_store.get(c, 0)
                             for c, n in totals.items() if n != self._reported_store.get(c, 0)})
            self._reported_store = totals
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVStoreConnectorStats | None:
        return KVStoreConnectorStats(data=data) if data is not None else KVStoreConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames,
                                  per_engine_labelvalues)

    # ------------------------------------------------------------------ both

    def shutdown(self) -> None:
        if self._released:
            return
        self._released = True
        if self._lookups is not None:  # before the client and store they ask
            self._lookups.close()
        if self._client is not None:
            self._client.close()
        for inflight in self._loading.values():  # their buffers, not vLLM's blocks
            with suppress(Exception):
                inflight.future.result()
        self._loading.clear()
        if self._shared is not None:
            _release(self._shared)

