"""A hybrid model's KV on the vLLM connector's worker side: one data mover per KV cache
group, saves per group, and loads that land all or nothing
(:mod:`kvstore.integrations.vllm.groups` says what a hit needs).

*Layers alias.*  vLLM's groups share one block pool, and a group's layer tensors alias
the other groups' bytes: block b of group g is read and written only through group g's
layers.  So each group has its own mover over its own layers (attention layers
``[blocks, heads, block size, head size]``; a Mamba / linear-attention layer is its
state page as raw bytes, ``[blocks, 1, 1, bytes]``, conv and SSM state in vLLM's order),
and a stored block of group g holds that block of every layer of g.

*Loads* are always asynchronous: vLLM copies a hit's state into the request's running
state block before the connector's ``start_load_kv`` of that step, so a synchronous
load would arrive too late.  Every part of a request's hit is read into its group's
load staging; only when every part arrived and verified are they copied into the KV
cache.  Otherwise nothing is, and the request is reported failed
(``failed_recving``): vLLM forgets its hit and asks the connector again, which now
answers a shorter one (the part that failed is quarantined by the store, or answered
as a miss from then on).  Block-level failures (``get_block_ids_with_load_errors``)
cannot serve here: vLLM refuses them with several groups, whose block ids are not
unique across groups.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import suppress
from dataclasses import dataclass, field

import torch

from kvstore.cuda.mover import CaptureError, LoadBatch, Mover
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.groups import GroupPlan
from kvstore.integrations.vllm.metadata import HybridLoad, KVStoreConnectorMetadata
from kvstore.integrations.vllm.worker.background_loads import IDLE_WAIT_S, arrived
from kvstore.integrations.vllm.worker.copy_out import StepCopyOut
from kvstore.integrations.vllm.worker.mover import load_blocks, make_mover
from kvstore.integrations.vllm.worker.store import WorkerStore

__all__ = ["GroupWorker"]


@dataclass
class _Read:
    group: int
    keys: list[bytes]
    block_ids: list[int]
    batch: LoadBatch | None = None
    future: Future[list[torch.Tensor | None]] | None = None


@dataclass
class _Load:
    load: HybridLoad
    scope_epoch: int
    started_ns: int
    reads: list[_Read] = field(default_factory=list)
    started: bool = False
    refused: bool = False  # failed before any read (no namespace, a graph capture)


class GroupWorker:
    """One worker's movers, saves and loads of a hybrid model (module docstring)."""

    def __init__(self, plan: GroupPlan, store: WorkerStore, config: ConnectorConfig,
                 kv_caches: dict[str, torch.Tensor], num_blocks: int,
                 clock: Callable[[], float]) -> None:
        self.plan, self._store, self._open, self._config = plan, store, store.open, config
        self.movers: list[Mover] = []
        self.saves: list[StepCopyOut] = []
        self.shapes: list[str] = []
        for g in plan.groups:
            missing = [n for n in g.layers if n not in kv_caches]
            if missing:
                raise ValueError(f"kvstore connector: KV cache group {g.index}'s layers "
                                 f"{missing} were not registered")
            layers = [kv_caches[n] for n in g.layers]
            first = layers[0]
            for name, t in zip(g.layers, layers):
                if t.shape != first.shape or t.dtype != first.dtype or \
                        t.stride() != first.stride():
                    raise ValueError(f"kvstore connector: layer {name} of KV cache group "
                                     f"{g.index} has shape {tuple(t.shape)} {t.dtype}, "
                                     f"unlike {g.layers[0]}")
            if first.shape[0] != num_blocks:
                raise ValueError(f"kvstore connector: KV cache group {g.index} has shape "
                                 f"{tuple(first.shape)}; expected [{num_blocks}, ...]")
            mover = make_mover(layers, "blocks_first", config, config.store.codec,
                               clock=clock)
            self.movers.append(mover)
            copy = StepCopyOut(store)
            copy.mover = mover
            self.saves.append(copy)
            self.shapes.append(f"{g.index}:{'x'.join(map(str, first.shape[1:]))}:"
                               f"{str(first.dtype).removeprefix('torch.')}:"
                               f"{','.join(map(str, first.stride()))}")
        # A lookup claims no more blocks than every group's load staging holds.
        store.open.load_max_blocks = min(load_blocks(m, config) for m in self.movers)
        self._loading: OrderedDict[str, _Load] = OrderedDict()
        self._failed: set[str] = set()

    def layout(self) -> str:
        """The groups and their tensors, for the key scope."""
        return f"groups={self.plan.describe()};tensors={';'.join(self.shapes)}"

    # ------------------------------------------------------------------ saves

    def look_up(self, meta: KVStoreConnectorMetadata) -> None:
        for copy, sub in zip(self.saves, meta.groups):
            copy.look_up(sub)

    def save_layer(self, meta: KVStoreConnectorMetadata, layer_name: str) -> None:
        where = self.plan.layer_group.get(layer_name)
        if where is None or not meta.groups:
            return
        group, index = where
        if meta.groups[group].saves:
            self.saves[group].save_layer(meta.groups[group], index)

    def end_step(self, meta: KVStoreConnectorMetadata, discard: bool) -> None:
        """Every group's saves of the step (state groups copy all their layers here:
        their layers have no ``save_kv_layer``)."""
        for g, copy, sub in zip(self.plan.groups, self.saves, meta.groups):
            if sub.saves:
                # (what the group's copy-out hands to the store, stored parts left out)
                before = self._open.counters["save_blocks"]
                copy.end_step(sub, discard)
                handed = self._open.counters["save_blocks"] - before
                if handed:
                    self._open.count(**{f"group_save_{g.kind}": handed})

    def drop_saves(self) -> None:
        for copy in self.saves:
            copy.drop()

    def wait_layer(self, layer_name: str) -> None:
        where = self.plan.layer_group.get(layer_name)
        if where is not None:
            self.movers[where[0]].wait_layer(where[1])

    # ------------------------------------------------------------------ loads

    def start(self, loads: list[HybridLoad], capturing: bool) -> None:
        for load in loads:
            self._open.count(load_blocks=len(load.parts))
            pending = _Load(load, self._open.scope_epoch, time.perf_counter_ns())
            self._loading[load.req_id] = pending
            by_group: dict[int, _Read] = {}
            for part in load.parts:
                read = by_group.setdefault(part.group, _Read(part.group, [], []))
                read.keys.append(part.hash)
                read.block_ids.append(part.block_id)
            for read in by_group.values():
                keys = self._open.keys(read.keys)
                if keys is None:
                    pending.refused = True
                    break
                read.keys = keys
            pending.reads = list(by_group.values())
            if pending.refused or not load.parts or capturing:
                pending.refused = pending.started = True
        self._start_waiting()

    def _start_waiting(self) -> None:
        """Start the loads waiting for staging, in order, while every group has room."""
        for pending in self._loading.values():
            if pending.started:
                continue
            if pending.scope_epoch != self._open.scope_epoch or self._open.suspended:
                pending.refused = pending.started = True
                continue
            for read in pending.reads:
                try:
                    read.batch = self.movers[read.group].begin_load(len(read.keys))
                except CaptureError:
                    read.batch = None
                if read.batch is None:
                    for r in pending.reads:
                        if r.batch is not None:
                            r.batch.release()
                            r.batch = None
                    return
            for read in pending.reads:
                assert read.batch is not None
                read.future = self._store.start_get(read.keys,
                                                    list(read.batch.staged().unbind(0)))
            pending.started = True

    def _done(self, pending: _Load) -> bool:
        return pending.started and all(r.future is None or r.future.done()
                                       for r in pending.reads)

    def finished(self, idle: bool) -> set[str] | None:
        """Requests whose load is over (landed, or failed: :meth:`take_failed`)."""
        if not self._loading:
            return None
        self._start_waiting()
        futures = [r.future for p in self._loading.values() for r in p.reads
                   if r.future is not None and not r.future.done()]
        if idle and futures and not any(self._done(p) for p in self._loading.values()):
            wait(futures, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        done = [req for req, p in self._loading.items() if self._done(p)]
        for req in done:
            self._land(self._loading.pop(req))
        if done:
            self._start_waiting()
        return set(done) or None

    def _land(self, pending: _Load) -> None:
        """All parts into the KV cache, or none and the request failed."""
        ok = not pending.refused and pending.scope_epoch == self._open.scope_epoch \
            and self._open.suspended is None
        results: list[tuple[_Read, list[torch.Tensor | None]]] = []
        for read in pending.reads:
            got: list[torch.Tensor | None] = []
            error: BaseException | None = None
            if ok and read.future is not None:
                try:
                    got = list(read.future.result())
                except Exception as e:  # noqa: BLE001 - a failed read is a miss
                    error = e
            n = arrived(got)
            if ok and n < len(read.keys):
                ok = False
                self._open.load_failed(read.keys, n, len(got), error)
            results.append((read, got))
        for read, _ in results:
            if read.batch is None:
                continue
            if ok:
                self.movers[read.group].load(read.batch, read.block_ids)
            read.batch.release()
        parts = len(pending.load.parts)
        elapsed = time.perf_counter_ns() - pending.started_ns
        loaded = parts if ok else 0
        self._open.count(loaded_blocks=loaded, load_failed_blocks=parts - loaded,
                         load_ns=elapsed,
                         loaded_bytes=sum(self.movers[r.group].block_bytes * len(r.keys)
                                          for r in pending.reads) if ok else 0)
        self._open.record_load(elapsed / 1e9)
        outcome = "loaded" if ok else "failed"
        kinds = Counter(self.plan.groups[p.group].kind for p in pending.load.parts)
        self._open.count(**{f"group_{outcome}_{kind}": n for kind, n in kinds.items()})
        if not ok:
            self._failed.add(pending.load.req_id)

    def take_failed(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

    def close(self) -> None:
        for pending in self._loading.values():
            for read in pending.reads:
                if read.future is not None:
                    with suppress(Exception):
                        read.future.result()
                if read.batch is not None:
                    read.batch.release()
        self._loading.clear()
        self.drop_saves()
        for mover in self.movers:
            mover.close()
        self.movers = []
