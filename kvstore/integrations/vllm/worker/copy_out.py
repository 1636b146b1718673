"""The vLLM connector's worker-side copy-out of each step's new blocks for saving: when the step's metadata is
bound (before the forward) the store is asked, off the worker's thread, which of the
step's blocks it holds already; in the step's first ``save_kv_layer`` the blocks it
lacks get the data mover's staging, each layer's copy out of the KV cache is enqueued
as the forward reaches it, and ``wait_for_save`` hands the step's blocks to a
background put that starts once their copies are done
(:class:`~kvstore.integrations.vllm.worker.background_puts.BackgroundPuts`).  Part of
:class:`~kvstore.integrations.vllm.worker.side.WorkerSide`; kept apart from the loads.

The forward never waits for that lookup: should it not have answered by the first
``save_kv_layer`` (the store's loop busy), every block of the step is copied out
(counted in ``save_lookup_late_steps``) and the put deduplicates the ones stored
already (``save_dedup_blocks``).  Copying a stored block out again costs PCIe bytes and
staging for one step; skipping the step's blocks instead would lose the new ones,
which the engine would then recompute on their next use.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future

from kvstore.cuda.mover import Mover, SaveBatch
from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.block_tags import scoped_tag
from kvstore.integrations.vllm.metadata import KVStoreConnectorMetadata, Save
from kvstore.integrations.vllm.open_store import warn_once
from kvstore.integrations.vllm.worker.store import WorkerStore

__all__ = ["StepCopyOut"]


def _distinct(saves: Sequence[Save]) -> list[Save]:
    """The first save of each hash (two requests may fill the same block in a step)."""
    first: dict[bytes, Save] = {}
    for save in saves:
        first.setdefault(save.hash, save)
    return list(first.values())


class StepCopyOut:
    """One worker's copy-out for saves.  ``mover`` is the worker's data mover, set once
    vLLM registered the KV caches."""

    def __init__(self, store: WorkerStore) -> None:
        self._store = store
        self._open = store.open
        self.mover: Mover | None = None
        self._staging: SaveBatch | None = None
        self._staging_meta: KVStoreConnectorMetadata | None = None
        self._saves: list[Save] = []
        # The presence lookup of a step's blocks, started when its metadata was bound.
        self._lookup: tuple[KVStoreConnectorMetadata, Future[list[bool]]] | None = None

    def look_up(self, meta: KVStoreConnectorMetadata) -> None:
        """The step's metadata was bound (before its forward): start asking the store
        which of its blocks it holds, on the store's loop; nothing waits for it."""
        self._lookup = None
        if not meta.saves or self._open.suspended is not None:
            return
        keys = self._open.keys([s.hash for s in _distinct(meta.saves)])
        if keys:
            try:
                self._lookup = (meta, self._store.submit_contains(keys))
            except RuntimeError:  # the store is closing: its saves are refused anyway
                return

    def _present(self, meta: KVStoreConnectorMetadata, n: int) -> list[bool]:
        """Which of the step's ``n`` distinct blocks the store holds, as far as the
        lookup answered by now (module docstring: never waited for)."""
        lookup, self._lookup = self._lookup, None
        if lookup is None or lookup[0] is not meta or not lookup[1].done():
            self._open.count(save_lookup_late_steps=1)
            return [False] * n
        try:
            present = lookup[1].result()
        except Exception:  # noqa: BLE001 - a store that cannot answer: the put dedups
            return [False] * n
        return present if len(present) == n else [False] * n

    def _step_saves(self, meta: KVStoreConnectorMetadata) -> list[Save]:
        """This step's saves less blocks the store already has (or that two requests
        fill in one step): copying those out of the KV cache would be wasted."""
        if self._staging_meta is meta:
            return self._saves
        saves = _distinct(meta.saves)
        keys = self._open.keys([s.hash for s in saves])
        if keys is None:
            saves = []
        elif keys:
            present = self._present(meta, len(keys))
            saves = [s for s, p in zip(saves, present) if not p]
        self.drop()
        self._staging_meta, self._saves = meta, saves
        if saves:
            assert self.mover is not None
            # Staging for the step's blocks, or None: no room, the save is dropped
            # (counted), the step does not wait.
            self._staging = self.mover.begin_save([s.block_id for s in saves])
            if self._staging is None:
                self._open.count(save_blocks=len(saves), save_dropped_blocks=len(saves))
                self._saves = []
        return self._saves

    def drop(self) -> None:
        """Forget the step's save; its staging goes back once its copies are done."""
        if self._staging is not None:
            self._staging.release()
        self._staging_meta = self._staging = None

    def save_layer(self, meta: KVStoreConnectorMetadata, layer_index: int) -> None:
        """Enqueue the copy-out of this step's blocks of one layer (returns at once)."""
        start = time.perf_counter_ns()
        self._step_saves(meta)
        if self._staging is not None:
            assert self.mover is not None
            self.mover.save_layer(self._staging, layer_index)
        self._open.count(save_stall_ns=time.perf_counter_ns() - start)

    def end_step(self, meta: KVStoreConnectorMetadata, discard: bool) -> None:
        """The step's forward is over: hand its blocks to a background put, or with
        ``discard`` (or the connector suspended) drop them, counted."""
        if discard or self._open.suspended is not None:
            self._open.count(save_dropped_blocks=len(meta.saves))
            self.drop()
            return
        start = time.perf_counter_ns()
        saves = self._step_saves(meta)
        self._open.count(save_steps=1)
        staging = self._staging
        ns = self._open.namespace
        if staging is not None and ns is not None:
            assert self.mover is not None
            self.mover.end_save(staging)  # layers not saved yet, then the copy-done event
            self._staging_meta = self._staging = None
            if staging.skipped:  # the compute stream was capturing a CUDA graph
                self._open.count(save_blocks=len(saves), save_dropped_blocks=len(saves))
                staging.release()
                self._open.count(save_stall_ns=time.perf_counter_ns() - start)
                return
            keys = ns.engine_keys([s.hash for s in saves])
            parents = [None if s.parent_hash is None else ns.engine_key(s.parent_hash)
                       for s in saves]
            # The scope first: snapshot(tag_prefix=) lists this rank's scope's blocks.
            tags = [None if s.info is None else scoped_tag(ns.digest, s.info) for s in saves]
            self._open.count(save_blocks=len(keys))
            try:
                self._store.submit_save(staging, keys, parents, tags)
            except (KVStoreError, RuntimeError) as e:
                staging.release()
                warn_once("save", "kvstore connector: save failed: %s", e)
        else:
            self.drop()
        self._open.count(save_stall_ns=time.perf_counter_ns() - start)
