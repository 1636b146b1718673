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
by another (:mod:`kvstore.integrations.vllm.scope` lists it): a fingerprint of the
weights loaded, the model config as vLLM applied it (overrides, RoPE, quantisation),
model and KV cache dtypes, the codec class, block size, the physical layout of the paged
KV tensors (shape, stride order, platform), the layer names, the tensor-parallel rank
and vLLM's hash algorithm (reproducible across processes with the default sha256, so a
restarted engine finds its blocks again).  A request with a LoRA adapter has its hashes
bound to a fingerprint of the adapter's files (vLLM hashes only its name and path).

*One stored block per vLLM block*, holding that block of every layer
(``[layers, *block shape]``): a hit means the whole block is there for all layers, and a
chain is ``parent``-linked in the store, so eviction never leaves holes.

*Hybrid models* (several KV cache groups, vLLM's hybrid KV cache manager on: the
connector is ``SupportsHMA``): each group's block is a stored block of its own, keyed by
the group's hash, and a hit is promised only where every group has what resuming there
needs (full-attention blocks, the sliding window's, the Mamba state); loads are
asynchronous and land all or nothing, a failure reported per request
(:mod:`kvstore.integrations.vllm.groups`, :mod:`kvstore.integrations.vllm.worker.groups`).

*One store, opened by the worker.*  A store directory is locked by one ``Store``; the
worker opens it (so a path that cannot be opened stops the engine at start, saying
why) and sets the namespace when its KV tensors are registered, from their real shape
and strides.  The scheduler asks how many blocks after its local prefix-cache hit are
stored (``match_prefix``: an index lookup, no data read) without ever computing a key:
when the worker is in the same process (vLLM's default for one GPU worker, or
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) it shares the worker's handle; otherwise (the
multiprocess executor, vLLM's default on CPU) it asks the worker over a local socket
(:mod:`kvstore.integrations.vllm.lookup_socket`), which answers only the scheduler of its own
engine and key scope.

*Tensor/pipeline parallel.*  Each rank (worker process) keeps its own shard of every
block in a store of its own, ``path/rank-R-of-W`` (:mod:`kvstore.integrations.vllm.ranks`
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
reuse the blocks at once, so ``request_finished`` never delays freeing.  Saves in flight
are bounded by their staging (``max_pending_save_bytes``: a save that finds none is
dropped); at shutdown and at exit they are finished.

*Loads* are asynchronous: a request with a hit waits in vLLM's
``WAITING_FOR_REMOTE_KVS`` while other requests keep running; the worker reads its blocks
in the background (``start_load_kv`` starts the read into a private buffer), and once
the read is done (``get_finished``) copies the verified leading blocks into the paged KV
cache and reports the request finished.  A lookup claims no more blocks than the load
staging holds, and a load that finds the staging busy waits for room instead of failing
(:mod:`kvstore.integrations.vllm.worker.background_loads`).  kvstore answers a block that fails its
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

*Weight updates* (``reset_cache``): the key scope moves to the new weights'; while
vLLM's own prefix cache was not cleared (vLLM refuses its reset while requests hold
blocks), requests that reuse it are neither loaded into nor saved
(:mod:`kvstore.integrations.vllm.scheduler.stale`).

*Metrics.*  Hits are reported with the ``disk`` cache-hit source, so vLLM's
``prompt_tokens_by_source`` and connector prefix-cache metrics show them; the connector's
own numbers (lookups, loaded/failed blocks, load time, save outcomes, bytes, store use,
corruption) reach vLLM's ``/metrics`` and its "KV Transfer metrics" log line through
vLLM's connector stats hooks (:mod:`kvstore.integrations.vllm.metrics`).

*Code.*  This module holds the class vLLM instantiates, :class:`KVStoreConnector`, which
checks the config, derives the key scope and hands each call to its role's half: the
scheduler side in :mod:`kvstore.integrations.vllm.scheduler.side`, the worker side in
:mod:`kvstore.integrations.vllm.worker.side`, which is handed the step metadata the
connector holds.  They share the step metadata vLLM passes between them
(:mod:`kvstore.integrations.vllm.metadata`) and, in one process, the open store with the
connector's counters (:mod:`kvstore.integrations.vllm.open_store`); neither side imports
the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.groups import GroupPlan
from kvstore.integrations.vllm.kv_events import KVStoreKVEvents, SchedulerEvents
from kvstore.integrations.vllm.metadata import KVStoreConnectorMetadata
from kvstore.integrations.vllm.metrics import (
    STORE_COUNTERS,
    STORE_GAUGES,
    KVStoreConnectorStats,
    KVStorePromMetrics,
)
from kvstore.integrations.vllm.open_store import all_connector_stats, connector_stats
from kvstore.integrations.vllm.rank_reports import events_enabled
from kvstore.integrations.vllm.scheduler.side import SchedulerSide
from kvstore.integrations.vllm.scope import model_scope, scope_digest
from kvstore.integrations.vllm.worker.side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
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
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["ConnectorConfig", "KVStoreConnector", "KVStoreConnectorMetadata",
           "all_connector_stats", "connector_stats"]


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """The connector class vLLM instantiates, once per role: it checks the config, derives
    the key scope both roles share, and hands every call to its role's half
    (:class:`~kvstore.integrations.vllm.scheduler.side.SchedulerSide` or
    :class:`~kvstore.integrations.vllm.worker.side.WorkerSide`, handed the step metadata
    bound here), which share the step metadata vLLM passes between them and, in one
    process, the open store."""

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
        config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        if transfer.kv_load_failure_policy != "recompute":
            raise ValueError(
                "kvstore connector: set kv_transfer_config kv_load_failure_policy="
                "'recompute'. A block that fails its checksum is answered as a miss; vLLM "
                "must recompute it rather than fail the request.")
        plan = None
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            # A hybrid model (vLLM's hybrid KV cache manager): every group stored on
            # its own, a hit all or nothing (kvstore.integrations.vllm.groups).
            plan = GroupPlan.of(kv_cache_config, vllm_config.cache_config.block_size)
            if not config.async_loads:
                raise ValueError(
                    "kvstore connector: async_loads must stay on for models with several "
                    "KV cache groups: a load's failure is reported per request, and a "
                    "state must be in place before vLLM copies it at the step's start")
        engine_id = str(transfer.engine_id)
        # Everything but the KV tensor layout: both sides derive it from the config, and
        # compare it at the lookup handshake.
        scope = model_scope(vllm_config, config)
        digest = scope_digest(scope)
        self._rank = str(vllm_config.parallel_config.rank)
        self._released = False
        self._reported: dict[str, int] = {}  # counters as last reported to vLLM
        self._reported_store: dict[str, int] = {}
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._events: SchedulerEvents | None = None
        if role == KVConnectorRole.WORKER:
            self._worker = WorkerSide(vllm_config, kv_cache_config, config, scope, digest,
                                      engine_id, plan)
        else:
            self._scheduler = SchedulerSide(vllm_config, config, scope, digest, engine_id,
                                            plan)
            if events_enabled(vllm_config):  # vLLM's KV events (kv_events)
                self._events = SchedulerEvents(
                    vllm_config.parallel_config.world_size,
                    vllm_config.cache_config.block_size, kv_cache_config,
                    replay=config.kv_events_replay)

    @property
    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("kvstore connector: scheduler method called on a worker")
        return self._scheduler

    @property
    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("kvstore connector: worker method called on the scheduler side")
        return self._worker

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """With vLLM's hybrid KV cache manager on (``SupportsHMA``), in place of
        ``request_finished``: saves were copied out during the steps, nothing delays
        freeing."""
        return self._sched.request_finished(request, block_ids)

    def reset_cache(self) -> bool | None:
        """See :meth:`SchedulerSide.reset_cache`; vLLM resets the scheduler's, and the
        workers follow the step metadata.  With KV events, every block announced is
        withdrawn, and the new scope is replayed."""
        if self._scheduler is None:
            return None
        done = self._scheduler.reset_cache()
        if self._events is not None:
            self._events.reset(self._scheduler.scope_epoch)
        return done

    # ------------------------------------------------------------------ KV events

    def get_kv_connector_kv_cache_events(self) -> KVStoreKVEvents | None:
        """Worker side, every step: this rank's reports (:mod:`kvstore.integrations.vllm.kv_events`)."""
        reports = None if self._worker is None else self._worker.take_events()
        return KVStoreKVEvents(reports) if reports else None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._events is not None:
            self._events.update(connector_output.kv_cache_events)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return () if self._events is None else self._events.take()

    def has_pending_push_work(self) -> bool:
        """Saves in flight or a replay unfinished on some rank: vLLM keeps stepping
        (forward-less steps) so their events leave without waiting for a request."""
        return self._events is not None and self._events.pending

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM's block pool (scheduler side): ``reset_cache`` reads it to know whether
        vLLM's own prefix cache was cleared (:mod:`kvstore.integrations.vllm.scheduler.stale`)."""
        if self._scheduler is not None:
            self._scheduler.bind_pool(gpu_block_pool)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind_connector_metadata(connector_metadata)

    # The worker side is handed the step's metadata bound here (vLLM binds it before
    # the forward and clears it after): it never reaches back into the connector.

    def _bound(self) -> KVStoreConnectorMetadata | None:
        """The step's metadata, if one of ours is bound."""
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVStoreConnectorMetadata) else None

    def _step(self) -> KVStoreConnectorMetadata:
        """The step's metadata (vLLM binds it before the forward's calls)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        return meta

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work.start_load_kv(self._step())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        self._work.save_kv_layer(self._step(), layer_name)

    def wait_for_save(self) -> None:
        self._work.wait_for_save(self._bound())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work.get_finished(self._bound())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``'s loads, and a hybrid model's failed ones (vLLM forgets
        their hit and asks again: the lookup then answers a shorter one)."""
        _, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_recving=set(recving or ()),
                                          failed_recving=self._work.take_failed())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work.get_block_ids_with_load_errors()

    # ------------------------------------------------------------------ vLLM metrics

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        """What changed since the last call (vLLM asks every step, on the scheduler and
        on every worker, and sums them: see :mod:`kvstore.integrations.vllm.metrics`).  None when nothing
        did, so idle steps cost nothing."""
        samples: list[float] = []
        if self._worker is None:
            counts, rank = dict(self._sched.counts), "scheduler"
        else:
            counts, samples = self._worker.open.take_worker_counts()
            rank = self._rank
        delta = {k: v - self._reported.get(k, 0) for k, v in counts.items()
                 if v != self._reported.get(k, 0)}
        if not delta and not samples:
            return None
        self._reported = counts
        stats = KVStoreConnectorStats()
        stats.add(rank, delta, load_seconds=samples)
        if self._worker is not None:  # the store's own numbers, sampled when something changed
            store = self._worker.open.stats()
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
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
