"""The vLLM connector's worker side: it opens the store (one per rank), learns the KV
layout from the tensors vLLM registers, loads blocks into the paged KV cache (in the
background, or before the forward with ``async_loads`` off), copies the step's new
blocks out for background saves, and follows the scheduler's key scope
(:mod:`kvstore.integrations.vllm.metadata`).

Every copy between the KV cache and host memory goes through the data mover
(:mod:`kvstore.cuda.mover`), on a GPU as on the CPU: ``save_kv_layer`` only enqueues
the layer's copy-out (after the compute stream's write of that layer, on the mover's
own stream), ``wait_for_save`` hands the step's blocks to a background put that starts
when their copy-done event fires, and waits for nothing; loads are read into the
mover's load staging and scattered layer by layer, the compute stream waiting for a
layer's event in ``wait_for_layer_load`` (a GPU-side wait).  The load staging is
page-locked host memory, or with ``device_loads`` (by default with an FP8 codec on a
GPU) device memory: the store's reads copy each block there from its page-locked arena
and an FP8 block is dequantised there, no host copy.  The save staging is bounded by
``max_pending_save_bytes``: a step whose save finds no room drops it
(``save_dropped_blocks``) instead of waiting for the disk; so does a save over
``max_save_bytes_per_s`` or ``max_save_bytes_per_step``.  While the engine captures a
CUDA graph nothing is enqueued: saves are dropped (counted), loads wait or fail
(recomputed).

This class keeps the KV layout and the key scope and hands each call to its concern:
the loads (:mod:`kvstore.integrations.vllm.worker.loads`) or the copy-out for saves
(:mod:`kvstore.integrations.vllm.worker.copy_out`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.cuda import reason as cuda_reason
from kvstore.cuda.mover import LoadBatch, Mover
from kvstore.cuda.paged import Layout
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.groups import GroupPlan
from kvstore.integrations.vllm.metadata import KVStoreConnectorMetadata
from kvstore.integrations.vllm.open_store import acquire, release, warn_once
from kvstore.integrations.vllm.rank_reports import Report, events_enabled
from kvstore.integrations.vllm.ranks import rank_config
from kvstore.integrations.vllm.scope import Scope
from kvstore.integrations.vllm.worker.copy_out import StepCopyOut
from kvstore.integrations.vllm.worker.events import WorkerEvents
from kvstore.integrations.vllm.worker.groups import GroupWorker
from kvstore.integrations.vllm.worker.loads import StepLoads
from kvstore.integrations.vllm.worker.mover import load_blocks, make_mover
from kvstore.integrations.vllm.worker.store import WorkerStore
from kvstore.keys import Namespace

__all__ = ["WorkerSide"]

logger = logging.getLogger("kvstore.integrations.vllm")


class WorkerSide:
    """What vLLM's worker (one per rank) asks of the connector.  The connector hands
    each call the step's metadata it holds (bound before the forward, cleared after)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig,
                 scope: Scope, scope_digest: bytes, engine_id: str,
                 plan: GroupPlan | None = None) -> None:
        self._vllm_config, self._kv_cache_config, self._config = \
            vllm_config, kv_cache_config, config
        self._block_size = vllm_config.cache_config.block_size
        self._scope, self._scope_digest = scope, scope_digest
        # Where the weights came from; reload_weights(weights_path=...) changes it in
        # place (vLLM's model_config), which the worker notices at the next step.
        self._weights_source = str(vllm_config.model_config.model)
        parallel = vllm_config.parallel_config
        # Every rank its own store (kvstore.integrations.vllm.ranks).
        self.open = acquire(rank_config(config, parallel.rank, parallel.world_size),
                            engine_id)
        self.store = WorkerStore.of(self.open)
        self._layers: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._block_axis = 0
        self._block_shape: tuple[int, ...] = ()
        self._dtype = torch.float32
        self.mover: Mover | None = None
        # A hybrid model (several KV cache groups): its groups' movers, saves and loads.
        self._plan = plan if plan is not None and plan.hybrid else None
        self.groups: GroupWorker | None = None
        self.clock = time.monotonic  # the copy-out rate cap's (a test sets its own)
        self.saves = StepCopyOut(self.store)  # save_kv_layer and wait_for_save
        # vLLM's KV events on: the store's content changes of this rank's scope, as
        # reports for the scheduler (worker.events).
        self.events = WorkerEvents(self.open.blocking, parallel.rank, self.store.puts.busy,
                                   replay=config.kv_events_replay) \
            if events_enabled(vllm_config) else None
        self.loads = StepLoads(self.store, config, self._scatter, self._block_bytes,
                               self._capturing)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not kv_caches:
            raise ValueError("kvstore connector: the engine registered no KV cache tensors")
        num_blocks = self._kv_cache_config.num_blocks
        if self._plan is not None:
            self._register_groups(kv_caches, num_blocks)
            return
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
        layout: Layout
        if axis == 1 and first.dim() >= 3 and first.shape[0] == 2:
            layout = "kv_first"
        elif axis == 0:
            layout = "blocks_first"
        else:
            raise ValueError(f"kvstore connector: KV cache shape {tuple(first.shape)} has "
                             f"its blocks on axis {axis}; supported: [2, num_blocks, ...] "
                             "and [num_blocks, ...]")
        if self.mover is not None:  # registered again: the old caches are gone
            self.mover.close()
        self.mover = make_mover(list(kv_caches.values()), layout, self._config,
                                self._config.store.codec, clock=self.clock)
        self.store.load_staging = self.mover.begin_load
        self.open.load_max_blocks = load_blocks(self.mover, self._config)
        self.saves.mover = self.mover
        if first.device.type == "cuda" and not self.mover.cuda:
            warn_once("no-cuda-lib", "kvstore connector: the KV cache is on %s but kvstore's "
                      "CUDA library is not usable (%s): copies to and from it are "
                      "synchronous; run `python -m kvstore cuda build`", first.device,
                      cuda_reason())
        self._layers = dict(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(names)}
        self._block_axis = axis
        self._block_shape = tuple(s for i, s in enumerate(first.shape) if i != axis)
        self._dtype = first.dtype
        self.store.layout = (len(names), self._block_shape, self._dtype)
        namespace = self.open.namespace = self._namespace(first, axis, names)
        self._follow(namespace)

    def _follow(self, namespace: Namespace) -> None:
        """The namespace is known: the remote tier, the lookup server, the events."""
        self.open.attach_remote(namespace)
        self.open.serve_lookups(self._scope_digest)
        if self.events is not None:
            self.events.start(namespace.digest, self.open.scope_epoch)

    def _register_groups(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """A hybrid model's tensors: a mover per group (worker.groups)."""
        assert self._plan is not None
        if self.groups is not None:  # registered again: the old caches are gone
            self.groups.close()
        self.groups = GroupWorker(self._plan, self.store, self._config, kv_caches,
                                  num_blocks, self.clock)
        self._layers = dict(kv_caches)
        names = list(kv_caches)
        first = kv_caches[self._plan.groups[0].layers[0]]
        namespace = self.open.namespace = self._namespace(first, 0, names)
        self.open.groups = self._plan
        self._follow(namespace)

    def _namespace(self, t: torch.Tensor, axis: int, names: list[str]) -> Namespace:
        from vllm.platforms import current_platform

        dims = ["B" if i == axis else str(s) for i, s in enumerate(t.shape)]
        order = sorted(range(t.dim()), key=lambda i: -t.stride()[i])
        layout = (f"vllm-v1;{current_platform.device_type};shape={'x'.join(dims)};"
                  f"order={','.join(map(str, order))}")
        if self.groups is not None:  # every group's kind, window, state shapes, tensors
            layout = f"vllm-v1-hybrid;{current_platform.device_type};{self.groups.layout()}"
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
        """A step's metadata arrived (the connector bound it, before the forward): move
        with the scheduler's key scope, or notice weights reloaded without a reset;
        then start asking the store which of the step's blocks to save it holds (the
        first ``save_kv_layer`` uses the answer if it came, never waits for it)."""
        if not isinstance(connector_metadata, KVStoreConnectorMetadata) or not self._layers:
            return
        if connector_metadata.scope_epoch != self.open.scope_epoch:
            self._rescope(connector_metadata)
        elif self.open.suspended is None and \
                str(self._vllm_config.model_config.model) != self._weights_source:
            self.open.suspend(f"the weights were reloaded from "
                           f"{self._vllm_config.model_config.model!r}")
            logger.warning(
                "kvstore connector: the engine reloaded its weights (from %r) without "
                "reset_prefix_cache(reset_connector=True); the stored KV cannot be told "
                "apart, so the connector loads and saves nothing until that reset",
                self._vllm_config.model_config.model)
        if self.groups is not None:
            self.groups.look_up(connector_metadata)
            return
        self.saves.look_up(connector_metadata)

    def _rescope(self, meta: KVStoreConnectorMetadata) -> None:
        """Move to the scheduler's new key scope (see :meth:`reset_cache`)."""
        self._scope = tuple(sorted({**dict(self._scope), "weights": meta.weights}.items()))
        self._weights_source = str(self._vllm_config.model_config.model)
        names = list(self._layers)
        namespace = self._namespace(self._layers[names[0]], self._block_axis, names)
        self.saves.drop()
        if self.groups is not None:
            self.groups.drop_saves()
        self.open.rescope(meta.scope_epoch, namespace)
        if self.events is not None:  # the new scope's events, and its replay
            self.events.start(namespace.digest, meta.scope_epoch)
        logger.info("kvstore connector: worker moved to key scope epoch %d (%s)",
                    meta.scope_epoch, namespace.digest.hex()[:16])

    def start_load_kv(self, meta: KVStoreConnectorMetadata) -> None:
        """Start this step's loads (:meth:`StepLoads.start`; a hybrid model's:
        :meth:`GroupWorker.start`)."""
        if self.groups is not None:
            self.groups.start(meta.hybrid_loads, self._capturing())
            return
        self.loads.start(meta)

    def _capturing(self) -> bool:
        """The engine is capturing a CUDA graph: the mover may enqueue nothing (its
        copies and events would become nodes of the graph)."""
        if self.groups is not None:
            return any(m.capturing() for m in self.groups.movers)
        return self.mover is not None and self.mover.capturing()

    def _block_bytes(self) -> int:
        return self.mover.block_bytes if self.mover is not None else 0

    def _scatter(self, blocks: torch.Tensor, staging: LoadBatch | None,
                 block_ids: list[int]) -> None:
        """Into the KV cache, through the mover: from its staging on the load stream,
        layer by layer (the staging goes back once those copies are done), or, for a
        plain host buffer on a CPU engine, with plain copies now."""
        assert self.mover is not None
        if staging is not None:
            self.mover.load(staging, block_ids)
            staging.release()
        else:
            self.mover.load_host(blocks, block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """The compute stream waits (on the GPU, not this thread) for the loads into
        this layer enqueued so far; async loads are enqueued before their request is
        scheduled, sync loads in ``start_load_kv``: a stored block holds all layers."""
        if self.groups is not None:
            if not self._capturing():
                self.groups.wait_layer(layer_name)
            return
        index = self._layer_index.get(layer_name)
        # (In a graph capture the wait cannot be captured: loads stay unwaited until
        # this layer's next wait outside one.)
        if index is not None and self.mover is not None and not self._capturing():
            self.mover.wait_layer(index)

    def get_finished(self, meta: KVStoreConnectorMetadata | None
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose background load is done, their blocks copied into the KV
        cache (the failed ones reported by ``get_block_ids_with_load_errors``, which
        vLLM calls right after this, in the same step; a hybrid model's in
        :meth:`take_failed`).  ``meta``: the step's, if one is bound."""
        idle = meta is not None and meta.idle
        if self.groups is not None:  # (landed after a CUDA graph capture, not in it)
            return None, None if self._capturing() else self.groups.finished(idle)
        return None, self.loads.finished(idle)

    def take_failed(self) -> set[str]:
        """A hybrid model's requests whose load failed (vLLM's ``failed_recving``; they
        are among those :meth:`get_finished` reported)."""
        return set() if self.groups is None else self.groups.take_failed()

    def save_kv_layer(self, meta: KVStoreConnectorMetadata, layer_name: str) -> None:
        if self.groups is not None:
            if self.open.suspended is None:
                self.groups.save_layer(meta, layer_name)
            return
        if meta.saves and layer_name in self._layer_index and not self.loads.step_failed \
                and self.open.suspended is None:
            self.saves.save_layer(meta, self._layer_index[layer_name])

    def wait_for_save(self, meta: KVStoreConnectorMetadata | None) -> None:
        if meta is not None and self.groups is not None:
            self.groups.end_step(meta, discard=sys.exc_info()[1] is not None)
            return
        if meta is None or not meta.saves:
            return
        # vLLM calls this from a `finally`, so also when the forward raised: layers not
        # reached this step still hold another request's (or no) KV.  Saving them would
        # persist wrong bytes under the blocks' real hashes.
        # (Or) a synchronous load of this step failed: its forward read unloaded
        # blocks, so blocks computed in it may hold KV derived from garbage; vLLM
        # discards the step's output, and the recompute plans them again.
        self.saves.end_step(meta, discard=sys.exc_info()[1] is not None
                            or self.loads.step_failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.loads.take_errors()

    def take_events(self) -> list[Report] | None:
        """This step's reports for vLLM's KV events (None with events off)."""
        return None if self.events is None else self.events.take()

    def shutdown(self) -> None:
        if self.events is not None:
            self.events.close()
        self.loads.close()
        self.saves.drop()
        self.store.load_staging = None
        self.open.load_max_blocks = 0
        self.store.flush()  # the saves still hold the mover's staging
        if self.groups is not None:
            self.groups.close()
            self.groups = None
        release(self.open)
        if self.mover is not None:
            self.mover.close()
            self.mover = self.saves.mover = None
