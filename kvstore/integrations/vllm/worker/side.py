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
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.cuda import reason as cuda_reason
from kvstore.cuda.mover import LoadBatch, Mover
from kvstore.cuda.paged import Layout
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.metadata import KVStoreConnectorMetadata, Load
from kvstore.integrations.vllm.ranks import rank_config
from kvstore.integrations.vllm.scope import Scope
from kvstore.integrations.vllm.worker.loads import BackgroundLoads, arrived, note_failed
from kvstore.integrations.vllm.worker.mover import load_blocks, make_mover
from kvstore.integrations.vllm.worker.saves import StepSaves, engine_keys
from kvstore.integrations.vllm.worker.shared import (
    SharedStore,
    acquire,
    load_buffer,
    release,
    warn_once,
)
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata

__all__ = ["WorkerSide"]

logger = logging.getLogger("kvstore.integrations.vllm")


class WorkerSide:
    """What vLLM's worker (one per rank) asks of the connector.  ``conn`` is the
    connector object vLLM holds: the step metadata is bound to it."""

    def __init__(self, conn: KVConnectorBase_V1, vllm_config: Any, kv_cache_config: Any,
                 config: ConnectorConfig, scope: Scope, scope_digest: bytes,
                 engine_id: str) -> None:
        self._conn = conn
        self._vllm_config, self._kv_cache_config, self._config = \
            vllm_config, kv_cache_config, config
        self._block_size = vllm_config.cache_config.block_size
        self._scope, self._scope_digest = scope, scope_digest
        # Where the weights came from; reload_weights(weights_path=...) changes it in
        # place (vLLM's model_config), which the worker notices at the next step.
        self._weights_source = str(vllm_config.model_config.model)
        parallel = vllm_config.parallel_config
        # Every rank its own store (kvstore.integrations.vllm.ranks).
        self.store = acquire(rank_config(config, parallel.rank, parallel.world_size),
                             engine_id)
        self._layers: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._block_axis = 0
        self._block_shape: tuple[int, ...] = ()
        self._dtype = torch.float32
        self.mover: Mover | None = None
        self.clock = time.monotonic  # the copy-out rate cap's (a test sets its own)
        self.saves = StepSaves(self.store)  # save_kv_layer and wait_for_save
        self.loads = BackgroundLoads(self.store, self._keys, self._scatter,
                                     self._block_bytes, self._capturing)
        self._load_errors: set[int] = set()  # of synchronous loads
        # A synchronous load failed in this step: its forward read unloaded blocks.
        self._step_load_failed = False

    @property
    def _store(self) -> SharedStore:
        return self.store

    def _keys(self, hashes: Sequence[bytes]) -> list[bytes] | None:
        return engine_keys(self._store, hashes)

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
                                self._store.store.codec, clock=self.clock)
        self._store.load_staging = self.mover.begin_load
        self._store.load_max_blocks = load_blocks(self.mover, self._config)
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
        """A step's metadata arrived (the connector bound it, before the forward): move
        with the scheduler's key scope, or notice weights reloaded without a reset;
        then start asking the store which of the step's blocks to save it holds (the
        first ``save_kv_layer`` uses the answer if it came, never waits for it)."""
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
        self.saves.look_up(connector_metadata)

    def _rescope(self, meta: KVStoreConnectorMetadata) -> None:
        """Move to the scheduler's new key scope (see :meth:`reset_cache`)."""
        self._scope = tuple(sorted({**dict(self._scope), "weights": meta.weights}.items()))
        self._weights_source = str(self._vllm_config.model_config.model)
        names = list(self._layers)
        namespace = self._namespace(self._layers[names[0]], self._block_axis, names)
        self.saves.drop()
        self._store.rescope(meta.scope_epoch, namespace)
        logger.info("kvstore connector: worker moved to key scope epoch %d (%s)",
                    meta.scope_epoch, namespace.digest.hex()[:16])

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads in the background (each into a buffer of its own),
        or with ``async_loads`` off copy them into the KV cache before the forward."""
        meta = self._conn._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        if self._config.async_loads:
            # (In a CUDA graph capture such a load fails, reported in get_finished
            # after the capture, and is recomputed.)
            for load in meta.loads:
                self.loads.start(load)
            return
        self._step_load_failed = False
        if self._capturing():
            self._refuse_in_capture(meta)
            return
        self._store.next_step()
        for load in meta.loads:
            self._load_now(load)

    def _capturing(self) -> bool:
        """The engine is capturing a CUDA graph: the mover may enqueue nothing (its
        copies and events would become nodes of the graph)."""
        return self.mover is not None and self.mover.capturing()

    def _refuse_in_capture(self, meta: KVStoreConnectorMetadata) -> None:
        """Synchronous loads asked for during a graph capture (vLLM's own dummy steps
        bring none) fail: vLLM recomputes their blocks."""
        if not meta.loads:
            return
        warn_once("capture-loads", "kvstore connector: %d loads asked for while the "
                  "engine captures a CUDA graph; their blocks are recomputed",
                  len(meta.loads))
        self._step_load_failed = True
        for load in meta.loads:
            n = len(load.block_ids)
            self._store.count(load_blocks=n, load_failed_blocks=n)
            self._load_errors.update(load.block_ids)

    def _load_now(self, load: Load) -> None:
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
        prepared = None if keys is None else self._store.take_prepared(keys)
        ok = n
        if prepared is not None:
            blocks, staging = prepared
        else:
            target = self._store.load_target(n) if n else None
            blocks, staging = target if target is not None else \
                (load_buffer((0, len(self._layers), *self._block_shape), self._dtype), None)
            try:  # (the prefix the load staging holds; the rest is computed)
                got: list[torch.Tensor | None] = [] if keys is None or target is None else \
                    self._store.get_many(keys[:len(blocks)], list(blocks.unbind(0)))
            except Exception as e:
                self._store.load_raised(keys or [], e)
                got = []
            ok = arrived(got)
            if ok < len(got):  # a block missing or unreadable, not one without staging
                note_failed(self._store, keys, ok)
        if ok:
            self._scatter(blocks, staging, load.block_ids[:ok])
        elif staging is not None:
            staging.release()
        failed = load.block_ids[ok:]
        if failed:
            self._step_load_failed = True
            self._load_errors.update(failed)
        self._store.count(loaded_blocks=ok, load_failed_blocks=len(failed),
                          loaded_bytes=ok * self._block_bytes(), load_ns=time.perf_counter_ns() - start)

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
        index = self._layer_index.get(layer_name)
        # (In a graph capture the wait cannot be captured: loads stay unwaited until
        # this layer's next wait outside one.)
        if index is not None and self.mover is not None and not self._capturing():
            self.mover.wait_layer(index)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose background load is done, their blocks copied into the KV
        cache (the failed ones reported by ``get_block_ids_with_load_errors``, which
        vLLM calls right after this, in the same step)."""
        idle = self._conn.has_connector_metadata() and getattr(
            self._conn._get_connector_metadata(), "idle", False)
        return None, self.loads.finished(bool(idle))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        meta = self._conn._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        if meta.saves and layer_name in self._layer_index and not self._step_load_failed \
                and self._store.suspended is None:
            self.saves.save_layer(meta, self._layer_index[layer_name])

    def wait_for_save(self) -> None:
        if not self._conn.has_connector_metadata():
            return
        meta = self._conn._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        if not meta.saves:
            return
        # vLLM calls this from a `finally`, so also when the forward raised: layers not
        # reached this step still hold another request's (or no) KV.  Saving them would
        # persist wrong bytes under the blocks' real hashes.
        # (Or) a synchronous load of this step failed: its forward read unloaded
        # blocks, so blocks computed in it may hold KV derived from garbage; vLLM
        # discards the step's output, and the recompute plans them again.
        self.saves.end_step(meta, discard=sys.exc_info()[1] is not None
                            or self._step_load_failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._load_errors | self.loads.errors
        self._load_errors, self.loads.errors = set(), set()
        return errors

    def shutdown(self) -> None:
        self.loads.close()
        self.saves.drop()
        self._store.load_staging = None
        self._store.load_max_blocks = 0
        self._store.flush()  # the saves still hold the mover's staging
        release(self.store)
        if self.mover is not None:
            self.mover.close()
            self.mover = self.saves.mover = None
