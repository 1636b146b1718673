"""The vLLM connector worker's background loads (``async_loads``, the default): each
request's blocks read from the store into the data mover's load staging while other
requests run, copied into the paged KV cache once read (``get_finished``).  Part of the
worker's loads (:class:`~kvstore.integrations.vllm.worker.loads.StepLoads`), which end
every load, in the background or not, one way (``land``).

*Staging.*  The load staging (``load_staging_bytes``) is bounded.  A lookup claims no
more blocks than it holds (:meth:`.OpenStore.match_hashes`), so every load fits it
when it is empty; a load that finds no room *now* (other loads in flight hold it) waits
for room, in arrival order, started at a later step once loads before it have been
copied in (``load_deferred_blocks``).  Failing it instead would make vLLM recompute or
look the request up again, only to find the staging as busy: with staging for two
blocks and a few requests at once that was most lookups and most claimed blocks failed
for every block loaded.  The request simply stays in vLLM's ``WAITING_FOR_REMOTE_KVS``
a little longer, holding its KV blocks, as it would for a slow disk.

*Failure.*  vLLM recomputes what a load reports failed (``errors``): the first block
that did not arrive and every block after it.  A load read under a key scope the
connector has left since (a weight update) is failed whole, as is one asked for while
the engine captures a CUDA graph (reported once the capture is over).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import suppress
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstore.cuda.mover import LoadBatch
from kvstore.integrations.vllm.metadata import Load
from kvstore.integrations.vllm.worker.store import WorkerStore

__all__ = ["BackgroundLoads", "Land", "arrived"]

# How long a step that runs no forward waits for a background load before returning
# (vLLM calls again at once while a request waits for its KV: this keeps that loop from
# spinning, and costs nothing while other requests run, since they never wait).
IDLE_WAIT_S = 0.05

Read = Callable[[], Sequence["torch.Tensor | None"]]


class Land(Protocol):
    """The end of a load (:meth:`~kvstore.integrations.vllm.worker.loads.StepLoads.land`):
    its blocks read (``read``; raises what the read raised) into ``blocks`` (lying in
    ``staging``), the leading ones that arrived copied into the KV cache, the rest
    recorded as failed; returns the block ids that failed."""

    def __call__(self, load: Load, keys: list[bytes] | None, read: Read,
                 blocks: torch.Tensor | None, staging: LoadBatch | None, started_ns: int,
                 *, sample: bool) -> list[int]: ...


def arrived(got: Sequence[torch.Tensor | None]) -> int:
    """How many leading blocks of a load arrived (``got`` may be shorter than the load:
    the prefix its staging held)."""
    return next((i for i, g in enumerate(got) if g is None), len(got))


@dataclass
class _InFlight:
    load: Load
    keys: list[bytes] | None
    scope_epoch: int  # the key scope it is read under
    started_ns: int
    buffer: torch.Tensor | None = None
    future: Future[list[torch.Tensor | None]] | None = None  # None: waits for staging
    staging: LoadBatch | None = None  # the mover's staging ``buffer`` lies in


class BackgroundLoads:
    """Background loads of one worker (module docstring).  The worker hands it the
    operations it needs: ``land`` (the end of a load) and ``capturing`` (a CUDA graph
    capture is under way)."""

    def __init__(self, store: WorkerStore, land: Land, capturing: Callable[[], bool]) -> None:
        self.store, self._open = store, store.open
        self._land, self._capturing = land, capturing
        # In arrival order: those waiting for staging start in that order.
        self.loading: OrderedDict[str, _InFlight] = OrderedDict()
        self.errors: set[int] = set()  # block ids that failed to load, for vLLM

    def start(self, load: Load) -> None:
        """Start reading ``load``'s blocks, or queue it until the staging has room."""
        n = len(load.block_ids)
        self._open.count(load_blocks=n)
        keys = self._open.keys(load.hashes)
        inflight = _InFlight(load, keys, self._open.scope_epoch, time.perf_counter_ns())
        self.loading[load.req_id] = inflight
        if keys is None or not n or self._capturing():
            self._fail_now(inflight)   # no KV registered, nothing to load, a capture
            return
        self._start_waiting()
        if inflight.future is None:
            self._open.count(load_deferred_blocks=n)

    def _fail_now(self, inflight: _InFlight) -> None:
        """Nothing of it is read: no block arrives, none is doubted."""
        inflight.future = Future()
        inflight.future.set_result([])

    def _start_waiting(self) -> None:
        """Start the loads waiting for staging, in order, while it has room."""
        store, open_store = self.store, self._open
        for inflight in self.loading.values():
            if inflight.future is not None:
                continue
            if inflight.scope_epoch != open_store.scope_epoch or open_store.suspended:
                self._fail_now(inflight)   # its keys are of weights no longer loaded
                continue
            n = len(inflight.load.block_ids)
            target = store.load_target(n, defer=True)
            if target is None:
                return
            inflight.buffer, inflight.staging = target  # (the prefix the staging holds)
            assert inflight.keys is not None
            inflight.future = store.start_get(inflight.keys[:len(inflight.buffer)],
                                              list(inflight.buffer.unbind(0)))

    def finished(self, idle: bool) -> set[str] | None:
        """The requests whose load is done, their arrived blocks copied into the KV
        cache (the rest in ``errors``).  ``idle``: the step runs no forward, so wait a
        little for a load rather than have vLLM call again at once."""
        if not self.loading or self._capturing():  # (copied in after the capture)
            return None
        self._start_waiting()
        futures = [f.future for f in self.loading.values() if f.future is not None]
        if idle and futures and not any(f.done() for f in futures):
            wait(futures, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        done = [req_id for req_id, f in self.loading.items()
                if f.future is not None and f.future.done()]
        for req_id in done:
            self._finish(self.loading.pop(req_id))
        if done:
            self._start_waiting()   # into the staging those loads gave back
        return set(done) or None

    def _finish(self, inflight: _InFlight) -> None:
        """Land a finished load (its verified leading blocks into the KV cache, the
        first failed block and everything after it recorded as load errors)."""
        future = inflight.future
        assert future is not None
        # Read under the keys of weights no longer loaded: nothing of it is used.
        moved = inflight.scope_epoch != self._open.scope_epoch or \
            self._open.suspended is not None
        self.errors.update(self._land(
            inflight.load, inflight.keys, (lambda: []) if moved else future.result,
            inflight.buffer, inflight.staging, inflight.started_ns, sample=True))

    def close(self) -> None:
        """Wait for the reads in flight (their buffers, not vLLM's blocks) and give their
        staging back; forget the loads waiting for staging."""
        for inflight in self.loading.values():
            if inflight.future is not None:
                with suppress(Exception):  # a failed load frees its buffer too
                    inflight.future.result()
            if inflight.staging is not None:
                inflight.staging.release()
        self.loading.clear()

