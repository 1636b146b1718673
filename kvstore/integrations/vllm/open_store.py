"""The vLLM connector's open store: one per store directory and process, shared by the
connectors of that process that use it.  The worker opens it (one per rank); a
scheduler in the same process finds it (:func:`find`) to answer its lookups, one in
another process asks over the worker's lookup socket
(:mod:`kvstore.integrations.vllm.lookup_socket`), which this module serves.

What both sides use lives here: the store on its event-loop thread
(:func:`kvstore.open_blocking`), the key scope (namespace, epoch, suspension), the lookup
(:meth:`OpenStore.match_hashes`), the keys whose load failed (answered as misses from
then on), the connector's counters and the registry behind :func:`connector_stats`.
What only the worker has (the read-ahead of synchronous loads, the saves in flight)
it hands in through :class:`WorkerPort`: this module imports neither side.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from kvstore.blocking import open_blocking
from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.groups import GroupPlan, longest_hit
from kvstore.integrations.vllm.lookup_socket import LookupServer, socket_name
from kvstore.integrations.vllm.metrics import GROUP_COUNTERS, SCHEDULER_COUNTERS
from kvstore.keys import Namespace

__all__ = ["OpenStore", "WorkerPort", "acquire", "all_connector_stats", "connector_stats",
           "find", "release", "warn_once"]

logger = logging.getLogger("kvstore.integrations.vllm")

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
             "save_lookup_late_steps",
             # a hybrid model's parts per kind of group
             *GROUP_COUNTERS)
_MAX_LOAD_SAMPLES = 4096  # load durations kept for vLLM's histogram between two steps
_MAX_FAILED_KEYS = 1 << 16  # keys whose load failed, answered as misses


class WorkerPort(Protocol):
    """What the worker side hands the open store (:attr:`OpenStore.worker`)."""

    def read_ahead(self, keys: list[bytes]) -> int:
        """A synchronous load's lookup: read and verify the leading stored ``keys`` now,
        keep them for the load; the verified prefix is the hit."""

    def forget_reads(self) -> None:
        """Drop what :meth:`read_ahead` kept (the key scope moved)."""

    def flush(self) -> None:
        """Wait for every save in flight."""

    def close(self) -> None:
        """The store closes: drop what is kept, finish the saves in flight."""


class OpenStore:
    """One open store for every connector of this process using that directory (the
    module docstring says what it holds)."""

    def __init__(self, config: ConnectorConfig, engine_id: str) -> None:
        self.config = config
        self.engine_id = engine_id
        # The store on its loop thread (kvstore.blocking: closed at interpreter exit,
        # saves in flight finished first, should vLLM not call shutdown()).  The remote
        # tier is attached once the key scope is known (attach_remote).
        self.blocking = open_blocking(config.path, config.store, namespace=None, remote=None)
        self.namespace: Namespace | None = None
        # The worker's, once it has its KV layout: the read-ahead and the saves.
        self.worker: WorkerPort | None = None
        # The most blocks the worker's load staging holds (0: no limit): a lookup
        # claims no more.
        self.load_max_blocks = 0
        # A hybrid model's KV cache groups (set by the worker): a lookup's hit then
        # needs every group's parts (kvstore.integrations.vllm.groups).
        self.groups: GroupPlan | None = None
        self.failed_keys: set[bytes] = set()  # loads that failed: misses from now on
        # Moves to a new key scope since start (a weight update: KVStoreConnector
        # .reset_cache); lookups of another epoch are answered 0.
        self.scope_epoch = 0
        # Why lookups, loads and saves are off (the weights changed and no new scope
        # is known yet); None: on.
        self.suspended: str | None = None
        self.users = 0
        self.closed = False
        self._remote_attached = False
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._load_seconds: list[float] = []  # drained into vLLM's stats each step
        self.server: LookupServer | None = None

    # ------------------------------------------------------------------ counters

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self._counters[name] += n

    def record_load(self, seconds: float) -> None:
        with self._lock:
            if len(self._load_seconds) < _MAX_LOAD_SAMPLES:
                self._load_seconds.append(seconds)

    @property
    def counters(self) -> dict[str, int]:
        """The connector's counters now (a copy)."""
        with self._lock:
            return dict(self._counters)

    def take_worker_counts(self) -> tuple[dict[str, int], list[float]]:
        """The worker's counters (the scheduler's left out: it reports its own) and
        the load durations since the last call, taken."""
        with self._lock:
            counts = {k: v for k, v in self._counters.items() if k not in SCHEDULER_COUNTERS}
            samples, self._load_seconds = self._load_seconds, []
        return counts, samples

    # ------------------------------------------------------------------ key scope

    def keys(self, hashes: Sequence[bytes]) -> list[bytes] | None:
        """The store keys of vLLM block ``hashes`` (None before the worker has a
        namespace)."""
        ns = self.namespace
        return None if ns is None else ns.engine_keys(hashes)

    def rescope(self, epoch: int, namespace: Namespace) -> None:
        """The connector moved to a new key scope (``epoch``): keys come from
        ``namespace`` from now on; reads kept for the old keys are dropped."""
        with self._lock:
            self.namespace, self.scope_epoch, self.suspended = namespace, epoch, None
            self.failed_keys.clear()
        if self.worker is not None:
            self.worker.forget_reads()

    def suspend(self, why: str) -> None:
        """No lookups, loads or saves until the next :meth:`rescope`."""
        self.suspended = why
        if self.worker is not None:
            self.worker.forget_reads()

    # ------------------------------------------------------------------ lookups

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
        if self.groups is not None:
            return self._match_groups(ns, hashes, self.groups)
        keys = ns.engine_keys(hashes)
        with self._lock:
            # A load that failed would be retried by vLLM forever if the same keys
            # stayed hits.
            cut = next((i for i, k in enumerate(keys) if k in self.failed_keys), len(keys))
        keys = keys[:cut]
        if not keys:
            return 0
        if not self.config.async_loads:
            return 0 if self.worker is None else self.worker.read_ahead(keys)
        # A background load can take no more than the staging holds: claim no more
        # (vLLM computes the rest) rather than a load that fails in part.
        cap = self.load_max_blocks or len(keys)
        if not self.config.store.memory_bytes or not self.config.prefetch:
            hit = self.blocking.match_prefix(keys)
        else:
            hit = self.blocking.call(self._match_and_prefetch, keys, cap)
        if hit > cap:
            self.count(load_no_staging_blocks=hit - cap)
        return min(hit, cap)

    def _match_groups(self, ns: Namespace, hashes: list[bytes], plan: GroupPlan) -> int:
        """A hybrid model's hit: the most leading blocks (up to what the load staging
        holds) at which every group's parts are stored and none failed to load."""
        hashes = hashes[:self.load_max_blocks or len(hashes)]

        def present(group_hashes: list[bytes]) -> list[bool]:
            keys = ns.engine_keys(group_hashes)
            stored = self.blocking.contains_many(keys)
            with self._lock:
                return [s and k not in self.failed_keys for k, s in zip(keys, stored)]

        return longest_hit(plan, hashes, present)

    async def _match_and_prefetch(self, keys: list[bytes], cap: int) -> int:
        store = self.blocking.store  # (on its loop: BlockingStore.call)
        hit = await store.match_prefix(keys)
        if hit:
            # (only what will be loaded) runs on; bounded by prefetch_share
            store.prefetch(keys[:min(hit, cap)])
        return hit

    def load_failed(self, keys: Sequence[bytes] | None, ok: int, read: int,
                    error: BaseException | None = None) -> None:
        """The one record of a load that fell short: of ``keys``, ``read`` were read
        and the first ``ok`` arrived, or the read raised ``error``.  Keys that failed
        are answered as misses for this engine life (bounded: forgotten after
        ``_MAX_FAILED_KEYS``), so that vLLM computes them once instead of loading them
        again and again: every key of a read that raised; the first block that did not
        arrive if the store still holds it (it quarantines a block it cannot read in
        the same pass, which then is a plain miss; a read-only store cannot)."""
        if keys is None:
            return
        if error is not None:
            warn_once("load", "kvstore connector: load failed: %s: %s",
                      type(error).__name__, error)
            failed = list(keys)
        elif ok < min(read, len(keys)) and self.suspended is None:
            try:
                still = self.blocking.contains_many([keys[ok]])[0]
            except Exception:  # noqa: BLE001 - a store that cannot answer: keep it out
                still = True
            if not still:
                return
            warn_once("unloadable", "kvstore connector: block %s of the store at %s "
                      "failed to load but stays stored (read-only store?); answered as a "
                      "miss from now on", keys[ok].hex()[:32], self.config.path)
            failed = [keys[ok]]
        else:
            return
        with self._lock:
            if len(self.failed_keys) + len(failed) > _MAX_FAILED_KEYS:
                self.failed_keys.clear()
            self.failed_keys.update(failed)

    def serve_lookups(self, scope: bytes) -> None:
        """Answer this engine's scheduler in another process (see
        :mod:`kvstore.integrations.vllm.lookup_socket`).

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

    # ------------------------------------------------------------------ the store

    def attach_remote(self, namespace: Namespace) -> None:
        """With the ``remote`` option: the shared S3 tier behind this rank's store, under
        the namespace just learnt (remote objects are named by it).  Refused
        credentials stop the engine at start, saying why (or, with
        ``on_auth_error="disable"``, leave the tier disabled)."""
        remote = self.config.remote
        if remote is None or self._remote_attached:
            return
        try:
            self.blocking.attach_remote(remote, namespace)
        except ImportError as e:
            raise RuntimeError("kvstore connector: the remote option needs obstore: "
                               "pip install 'kvstore[remote]'") from e
        self._remote_attached = True

    def flush(self) -> None:
        """Wait for every save in flight."""
        if self.worker is not None:
            self.worker.flush()

    def stats(self) -> dict[str, Any]:
        """The store's own ``stats()``, as a dict."""
        return self.blocking.stats().as_dict()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.server is not None:
            self.server.close()
        try:
            if self.worker is not None:
                self.worker.close()
        finally:
            self.blocking.close()


_STORES: dict[str, OpenStore] = {}
_STORES_LOCK = threading.Lock()
_WARNED: set[str] = set()


def warn_once(what: str, message: str, *args: object) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        logger.warning(message, *args)


def _join(store: OpenStore, config: ConnectorConfig, engine_id: str) -> OpenStore:
    """One more user of an open store (caller holds ``_STORES_LOCK``)."""
    if store.engine_id != engine_id:
        raise ValueError(f"kvstore connector: the store at {config.path!r} is already "
                         f"used by engine {store.engine_id!r} in this process; give each "
                         "engine a store directory of its own")
    if store.config != config:
        raise ValueError(f"kvstore connector: the store at {config.path!r} is already "
                         f"open in this process with other options ({store.config})")
    store.users += 1
    return store


def find(config: ConnectorConfig, engine_id: str) -> OpenStore | None:
    """The store a worker of this engine opened at ``config.path`` in this process."""
    with _STORES_LOCK:
        store = _STORES.get(os.path.realpath(config.path))
        return None if store is None else _join(store, config, engine_id)


def acquire(config: ConnectorConfig, engine_id: str) -> OpenStore:
    key = os.path.realpath(config.path)
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is None:
            try:
                store = OpenStore(config, engine_id)
            except (KVStoreError, OSError, ValueError) as e:
                raise RuntimeError(
                    f"kvstore connector: cannot open the store at {config.path!r}: "
                    f"{type(e).__name__}: {e}. Check kv_connector_extra_config['path'] "
                    "(a writable directory, not open in another process).") from e
            _STORES[key] = store
            store.users += 1
            return store
        return _join(store, config, engine_id)


def release(store: OpenStore) -> None:
    with _STORES_LOCK:
        store.users -= 1
        if store.users > 0:
            return
        for key, value in list(_STORES.items()):
            if value is store:
                del _STORES[key]
    store.close()


def connector_stats(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Counters of the connector(s) using the store at ``path`` in this process, and the
    store's own ``stats()``; waits for pending saves first so the numbers are final.

    ``lookup_hit_blocks`` are blocks the scheduler claimed as hits; ``loaded_blocks``
    the ones actually read, verified and copied into vLLM's KV cache;
    ``load_failed_blocks`` the ones reported back to vLLM for recomputation.
    """
    with _STORES_LOCK:
        store = _STORES.get(os.path.realpath(os.fspath(path)))
    if store is None:
        raise KeyError(f"no kvstore connector has the store at {os.fspath(path)!r} open "
                       "in this process")
    store.flush()
    counters: dict[str, Any] = store.counters
    counters["namespace"] = None if store.namespace is None else \
        store.namespace.canonical_json()
    counters["store"] = store.stats()
    return counters


def all_connector_stats() -> list[dict[str, Any]]:
    """:func:`connector_stats` of every store a connector has open in this process (a
    worker's: one; for ``LLM.collective_rpc`` when the workers are processes of their
    own)."""
    with _STORES_LOCK:
        paths = [store.config.path for store in _STORES.values()]
    return [connector_stats(p) for p in paths]
