"""The worker's part of the open store (:class:`~kvstore.integrations.vllm.open_store.OpenStore`):
what only a worker has, handed to the open store as its
:class:`~kvstore.integrations.vllm.open_store.WorkerPort`: where loads are read (the
data mover's load staging), the read-ahead of synchronous loads (a lookup reads and
verifies the blocks it claims; the load takes them), the reads and presence lookups
started off the worker's thread, and the saves in flight
(:class:`~kvstore.integrations.vllm.worker.background_puts.BackgroundPuts`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvstore.cuda.mover import CaptureError, LoadBatch, SaveBatch
from kvstore.integrations.vllm.open_store import OpenStore, warn_once
from kvstore.integrations.vllm.worker.background_puts import BackgroundPuts

__all__ = ["WorkerStore", "load_buffer"]

# Worker steps a synchronous load's read-ahead is kept for its load (see next_step).
_PREPARED_STEPS = 3


def load_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A buffer ``get_many`` fills on the store's thread.  vLLM runs the worker's hooks
    under ``torch.inference_mode``; a tensor made there is an inference tensor, which
    the memory tier's in-place copy (outside inference mode) may not write."""
    with torch.inference_mode(False):
        return torch.empty(shape, dtype=dtype)


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


class WorkerStore:
    """The worker's part of ``open`` (module docstring); made once per open store
    (:meth:`of`)."""

    def __init__(self, open_store: OpenStore) -> None:
        self.open = open_store
        self.blocking = open_store.blocking
        # (layers, block shape, dtype) of a stored block, set with the namespace: the
        # read-ahead of a synchronous load reads into a buffer of that shape.
        self.layout: tuple[int, tuple[int, ...], torch.dtype] | None = None
        # The worker's data mover's load staging (Mover.begin_load), once it has one:
        # loads are read into page-locked staging and scattered from there.
        self.load_staging: Callable[[int], LoadBatch | None] | None = None
        self._prepared: dict[bytes, _Prepared] = {}  # sync loads, by first key
        self._generation = 0  # worker steps (start_load_kv) seen, to age them out
        self._lock = threading.Lock()
        self.puts = BackgroundPuts(self.blocking, open_store.config, open_store.count,
                                   warn_once)

    @classmethod
    def of(cls, open_store: OpenStore) -> WorkerStore:
        """The worker's part of ``open_store``, made and handed to it the first time."""
        if isinstance(open_store.worker, WorkerStore):
            return open_store.worker
        worker = cls(open_store)
        open_store.worker = worker
        return worker

    # ------------------------------------------------------------------ reads

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
        cap = self.open.load_max_blocks
        k = min(n, cap) if cap else n
        try:
            batch = make(k)
        except CaptureError:  # the engine captures a CUDA graph: load later (vLLM asks)
            return None
        if batch is None:
            if not defer:
                self.open.count(load_no_staging_blocks=n)
            return None
        if k < n:
            self.open.count(load_no_staging_blocks=n - k)
        return batch.staged(), batch

    def read_ahead(self, keys: list[bytes]) -> int:
        """Synchronous loads: read and verify the stored leading blocks now and keep
        them for the worker's ``start_load_kv``; the hit is the verified prefix only.

        vLLM adds a synchronously loaded request's blocks to its own prefix cache when
        it allocates them, before the load: a block claimed as a hit that then failed
        to load would be a local cache hit for a later request if this one were aborted
        or preempted before recomputing it.  Claiming only blocks already read and
        verified closes that: a corrupt block is a plain miss here."""
        if self.layout is None:
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
        target = self.load_target(hit) if hit else None
        if target is None:
            return 0
        buffer, staging = target
        keys = keys[:len(buffer)]  # (the prefix the load staging holds: the hit claimed)
        try:
            got = self.blocking.get_many(keys, list(buffer.unbind(0)))
        except Exception as e:  # a failed read is a miss: vLLM computes
            if staging is not None:
                staging.release()
            self.open.load_failed(keys, 0, 0, e)
            return 0
        ok = next((i for i, g in enumerate(got) if g is None), len(got))
        self.open.load_failed(keys, ok, len(got))
        elapsed = time.perf_counter_ns() - start
        self.open.count(load_ns=elapsed)
        self.open.record_load(elapsed / 1e9)
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

    def take_prepared(self, keys: list[bytes]
                      ) -> tuple[torch.Tensor, LoadBatch | None] | None:
        """The blocks :meth:`read_ahead` read for a load of ``keys`` (None if it
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

    def forget_reads(self) -> None:
        """Forget every read-ahead, its staging back."""
        with self._lock:
            for held in self._prepared.values():
                held.drop()
            self._prepared.clear()

    def start_get(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]
                  ) -> Future[list[torch.Tensor | None]]:
        """Read blocks in the background; the future's result is ``get_many``'s."""
        return self.blocking.submit(self.blocking.store.get_many, keys, out)

    def get_many(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]
                 ) -> list[torch.Tensor | None]:
        return self.blocking.get_many(keys, out)

    def submit_contains(self, keys: Sequence[bytes]) -> Future[list[bool]]:
        """``contains_many(keys)`` on the store's loop; returns at once, also while the
        loop is busy (:meth:`kvstore.blocking.BlockingStore.submit`)."""
        return self.blocking.submit(self.blocking.store.contains_many, list(keys))

    # ------------------------------------------------------------------ saves

    def submit_save(self, batch: SaveBatch, keys: list[bytes], parents: list[bytes | None],
                    tags: list[bytes | None]) -> None:
        """Put a step's blocks (tagged for vLLM's KV events) once the mover's copy-out
        of ``batch`` is done (:meth:`BackgroundPuts.submit_save`)."""
        self.puts.submit_save(batch, keys, parents, tags)

    def flush(self) -> None:
        """Wait for every save in flight."""
        self.puts.flush()

    def close(self) -> None:
        self.forget_reads()
        self.flush()
