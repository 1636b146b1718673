"""The vLLM connector's open store, shared by every connector of one process that uses
the same directory (the scheduler side finds the worker's when they share a process):
the store on its event-loop thread (:func:`kvstore.open_blocking`), lookups and loads as
blocking calls into it, saves as tasks whose futures are kept until they finish
(:mod:`kvstore.integrations.vllm.worker.background_saves`), the connector's counters, and the registry behind
:func:`connector_stats`.  Role-free: both
:mod:`kvstore.integrations.vllm.scheduler.side` and :mod:`kvstore.integrations.vllm.worker.side`
use it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.blocking import open_blocking
from kvstore.cuda.mover import CaptureError, LoadBatch, SaveBatch
from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.lookup import LookupServer, socket_name
from kvstore.integrations.vllm.metrics import SCHEDULER_COUNTERS
from kvstore.integrations.vllm.worker.background_saves import BackgroundSaves
from kvstore.keys import Namespace
from kvstore.store import Store

__all__ = ["SharedStore", "acquire", "all_connector_stats", "connector_stats", "find",
           "load_buffer", "release", "warn_once"]

logger = logging.getLogger("kvstore.integrations.vllm")

@dataclass
class _Prepared:
    keys: list[bytes]  # the verified leading keys of a lookup
    buffer: torch.Tensor  # their blocks, [len(keys), layers, *block shape]
    generation: int
    staging: LoadBatch | None = None  # the mover's staging the buffer lies in

    def drop(self) -> None:
        """Not taken by a load: its staging goes back (after any copy using it)."""
        if self.staging is not None:
            self.staging.release()
            self.staging = None


def load_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A buffer ``get_many`` fills on the store's thread.  vLLM runs the worker's hooks
    under ``torch.inference_mode``; a tensor made there is an inference tensor, which
    the memory tier's in-place copy (outside inference mode) may not write."""
    with torch.inference_mode(False):
        return torch.empty(shape, dtype=dtype)


# Worker steps a synchronous load's read-ahead is kept for its load (see next_step).
_PREPARED_STEPS = 3


# The scheduler's (lookups) and the worker's; both reach vLLM's metrics
# (kvstore.integrations.vllm.metrics).
_COUNTERS = (*SCHEDULER_COUNTERS, "load_blocks", "loaded_blocks", "loaded_bytes",
             "load_failed_blocks", "save_blocks", "saved_blocks", "save_dedup_blocks",
             "save_failed_blocks", "save_dropped_blocks", "saved_bytes",
             # nanoseconds: the forward waiting on save copies / on loads; background puts
             "save_stall_ns", "load_ns", "save_io_ns",
             # steps whose forward had blocks to save (save_stall_ns / save_steps: the
             # forward's wait for saves per such step)
             "save_steps",
             # stored blocks not loaded for want of load staging (computed), and blocks
             # of background loads that waited for it
             "load_no_staging_blocks", "load_deferred_blocks",
             # steps whose presence lookup had not answered by their first save_kv_layer
             # (all their blocks copied out; the put deduplicates)
             "save_lookup_late_steps")
_MAX_LOAD_SAMPLES = 4096  # load durations kept for vLLM's histogram between two steps
_MAX_FAILED_KEYS = 1 << 16  # keys whose load raised, answered as misses


class SharedStore:
    """One open store for every connector of this process using that directory.

    The store runs on an event loop in a thread of its own (:func:`kvstore.open_blocking`);
    lookups and loads are blocking calls into it, saves are tasks whose futures are kept
    until they finish (:class:`~kvstore.integrations.vllm.worker.background_saves.BackgroundSaves`).
    """

    def __init__(self, config: ConnectorConfig, engine_id: str) -> None:
        self.config = config
        self.engine_id = engine_id
        # The store on its loop thread (kvstore.blocking: closed at interpreter exit,
        # saves in flight finished first, should vLLM not call shutdown()); ``store``
        # is the async Store behind it, for what runs on that loop.  The remote tier is
        # attached once the key scope is known (attach_remote).
        self.blocking = open_blocking(config.path, config.store, namespace=None, remote=None)
        self.store: Store = self.blocking.store
        self.namespace: Namespace | None = None
        # (layers, block shape, dtype) of a stored block, set with the namespace: the
        # lookup of a synchronous load reads into a buffer of that shape.
        self.layout: tuple[int, tuple[int, ...], torch.dtype] | None = None
        self._prepared: dict[bytes, _Prepared] = {}  # sync loads, by first key
        # The worker's data mover's load staging (Mover.begin_load), once it has one:
        # loads are read into page-locked staging and scattered from there.
        self.load_staging: Callable[[int], LoadBatch | None] | None = None
        # The most blocks the load staging holds (0: no limit): a lookup claims no more.
        self.load_max_blocks = 0
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
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.saves = BackgroundSaves(self.blocking, config, self.count, warn_once)
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
            self._drop_prepared()
            self.failed_keys.clear()

    def suspend(self, why: str) -> None:
        """No lookups, loads or saves until the next :meth:`rescope`."""
        with self._lock:
            self.suspended = why
            self._drop_prepared()

    def _drop_prepared(self) -> None:
        """(With the lock) forget every read-ahead, its staging back."""
        for held in self._prepared.values():
            held.drop()
        self._prepared.clear()

    def load_target(self, n: int, *, defer: bool = False
                    ) -> tuple[torch.Tensor, LoadBatch | None] | None:
        """Where a load of ``n`` blocks is read (``[k, layers, *block shape]``): the
        worker's mover's load staging (page-locked, or device memory with
        ``device_loads``: the store's reads land there from its arena, FP8 blocks
        dequantised on the GPU), or a plain buffer before the worker has a mover; None
        when the staging has no room now (counted in ``load_no_staging_blocks``, unless
        the caller will ``defer`` the load until there is room).  ``k`` is ``n``, or
        what the staging holds at most when a load is larger: the prefix that fits is
        loaded, the rest computed (counted so too)."""
        layout = self.layout
        assert layout is not None
        layers, shape, dtype = layout
        make = self.load_staging
        if make is None:
            return load_buffer((n, layers, *shape), dtype), None
        k = min(n, self.load_max_blocks) if self.load_max_blocks else n
        try:
            batch = make(k)
        except CaptureError:  # the engine captures a CUDA graph: load later (vLLM asks)
            return None
        if batch is None:
            if not defer:
                self.count(load_no_staging_blocks=n)
            return None
        if k < n:
            self.count(load_no_staging_blocks=n - k)
        return batch.staged(), batch

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
        # A background load can take no more than the staging holds: claim no more
        # (vLLM computes the rest) rather than a load that fails in part.
        cap = self.load_max_blocks or len(keys)
        if not self.store.options.memory_bytes or not self.config.prefetch:  # no memory tier
            hit = self.blocking.match_prefix(keys)
        else:
            hit = self.blocking.call(self._match_and_prefetch, keys, cap)
        if hit > cap:
            self.count(load_no_staging_blocks=hit - cap)
        return min(hit, cap)

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
        hit = self.blocking.match_prefix(keys)
        if not hit:
            return 0
        target = self.load_target(hit)
        if target is None:
            return 0
        buffer, staging = target
        hit = len(buffer)   # (the prefix the load staging holds: the hit claimed)
        try:
            got = self.blocking.get_many(keys[:hit], list(buffer.unbind(0)))
        except Exception as e:  # a failed read is a miss: vLLM computes
            if staging is not None:
                staging.release()
            self.load_raised(keys[:hit], e)
            return 0
        ok = next((i for i, g in enumerate(got) if g is None), hit)
        elapsed = time.perf_counter_ns() - start
        self.count(load_ns=elapsed)
        self.record_load(elapsed / 1e9)
        if ok:
            with self._lock:
                old = self._prepared.pop(keys[0], None)
                if old is not None:
                    old.drop()
                self._prepared[keys[0]] = _Prepared(keys[:ok], buffer[:ok], self._generation,
                                                    staging)
        elif staging is not None:
            staging.release()
        return ok

    def load_raised(self, keys: Sequence[bytes], error: Exception) -> None:
        """A read of ``keys`` raised: answer them as misses in this engine life (bounded:
        forgotten after ``_MAX_FAILED_KEYS``), so that vLLM computes instead of loading
        them again and again."""
        warn_once("load", "kvstore connector: load failed: %s: %s", type(error).__name__,
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
            still = self.blocking.contains_many([key])[0]
        except Exception:  # noqa: BLE001 - a store that cannot answer: keep it out
            still = True
        if still:
            warn_once("unloadable", "kvstore connector: block %s of the store at %s "
                       "failed to load but stays stored (read-only store?); answered as a "
                       "miss from now on", key.hex()[:32], self.config.path)
            with self._lock:
                if len(self.failed_keys) >= _MAX_FAILED_KEYS:
                    self.failed_keys.clear()
                self.failed_keys.add(key)

    def take_prepared(self, keys: list[bytes]
                      ) -> tuple[torch.Tensor, LoadBatch | None] | None:
        """The blocks :meth:`_read_ahead` read for a load of ``keys`` (None if it
        holds fewer), forgotten once taken, and the staging they lie in (the caller
        releases it)."""
        if not keys:
            return None
        with self._lock:
            held = self._prepared.pop(keys[0], None)
        if held is None:
            return None
        if held.keys[:len(keys)] != keys:
            held.drop()
            return None
        return held.buffer[:len(keys)], held.staging

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
                self._prepared.pop(k).drop()

    async def _match_and_prefetch(self, keys: list[bytes], cap: int) -> int:
        hit = await self.store.match_prefix(keys)
        if hit:
            # (only what will be loaded) runs on; bounded by prefetch_share
            self.store.prefetch(keys[:min(hit, cap)])
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
            self.blocking.attach_remote(remote, namespace)
        except ImportError as e:
            raise RuntimeError("kvstore connector: the remote option needs obstore: "
                               "pip install 'kvstore[remote]'") from e

    def serve_lookups(self, scope: bytes) -> None:
        """Answer this engine's scheduler in another process (see :mod:`kvstore.integrations.vllm.lookup`).

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
        return self.blocking.submit(self.store.get_many, keys, out)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.blocking.contains_many(keys)

    def submit_contains(self, keys: Sequence[bytes]) -> Future[list[bool]]:
        """``contains_many(keys)`` on the store's loop; returns at once, also while the
        loop is busy (:meth:`kvstore.blocking.BlockingStore.submit`)."""
        return self.blocking.submit(self.store.contains_many, list(keys))

    def get_many(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]
                 ) -> list[torch.Tensor | None]:
        return self.blocking.get_many(keys, out)

    def submit_save(self, batch: SaveBatch, keys: list[bytes], parents: list[bytes | None],
                    nbytes: int) -> None:
        """Put a step's blocks once the mover's copy-out of ``batch`` is done
        (:meth:`BackgroundSaves.submit_save`)."""
        self.saves.submit_save(batch, keys, parents, nbytes)

    def flush(self) -> None:
        """Wait for every save in flight."""
        self.saves.flush()

    def stats(self) -> dict[str, Any]:
        """The store's own ``stats()``, as a dict."""
        return self.blocking.stats().as_dict()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.server is not None:
            self.server.close()
        with self._lock:
            self._drop_prepared()
        try:
            self.flush()
        finally:
            self.blocking.close()


_STORES: dict[str, SharedStore] = {}
_STORES_LOCK = threading.Lock()
_WARNED: set[str] = set()


def warn_once(what: str, message: str, *args: object) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        logger.warning(message, *args)


def _join(shared: SharedStore, config: ConnectorConfig, engine_id: str) -> SharedStore:
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


def find(config: ConnectorConfig, engine_id: str) -> SharedStore | None:
    """The store a worker of this engine opened at ``config.path`` in this process."""
    with _STORES_LOCK:
        shared = _STORES.get(os.path.realpath(config.path))
        return None if shared is None else _join(shared, config, engine_id)


def acquire(config: ConnectorConfig, engine_id: str) -> SharedStore:
    key = os.path.realpath(config.path)
    with _STORES_LOCK:
        shared = _STORES.get(key)
        if shared is None:
            try:
                shared = SharedStore(config, engine_id)
            except (KVStoreError, OSError, ValueError) as e:
                raise RuntimeError(
                    f"kvstore connector: cannot open the store at {config.path!r}: "
                    f"{type(e).__name__}: {e}. Check kv_connector_extra_config['path'] "
                    "(a writable directory, not open in another process).") from e
            _STORES[key] = shared
            shared.users += 1
            return shared
        return _join(shared, config, engine_id)


def release(shared: SharedStore) -> None:
    with _STORES_LOCK:
        shared.users -= 1
        if shared.users > 0:
            return
        for key, value in list(_STORES.items()):
            if value is shared:
                del _STORES[key]
    shared.close()


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
    counters["store"] = shared.stats()
    return counters


def all_connector_stats() -> list[dict[str, Any]]:
    """:func:`connector_stats` of every store a connector has open in this process (a
    worker's: one; for ``LLM.collective_rpc`` when the workers are processes of their
    own)."""
    with _STORES_LOCK:
        paths = [shared.config.path for shared in _STORES.values()]
    return [connector_stats(p) for p in paths]
