"""The vLLM connector's saves in flight: background puts on the store's loop
(:meth:`kvstore.blocking.BlockingStore.submit`) of blocks the data mover copied out,
kept until they finish and counted into the connector's counters.  They are bounded
where they start, not here: a save that finds no room in the mover's save staging
(``max_pending_save_bytes``) is dropped before its copy-out, and a put holds that
staging until it is over.  Part of the worker's
:class:`~kvstore.integrations.vllm.worker.store.WorkerStore`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import suppress

import torch

from kvstore.blocking import BlockingStore
from kvstore.codecs.tensors import encoded_block
from kvstore.cuda.mover import SaveBatch
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.stats import PutResult

__all__ = ["BackgroundPuts"]


class BackgroundPuts:
    """A connector's background puts until they are over.

    ``count(**deltas)`` adds to the connector's counters; ``warn(what, message, *args)``
    logs a failure once per kind."""

    def __init__(self, store: BlockingStore, config: ConnectorConfig,
                 count: Callable[..., None], warn: Callable[..., None]) -> None:
        self._blocking = store
        self._config = config
        self._count = count
        self._warn = warn
        self._lock = threading.Lock()
        self._pending: list[Future[PutResult]] = []

    def submit_save(self, batch: SaveBatch, keys: list[bytes], parents: list[bytes | None],
                    tags: list[bytes | None]) -> None:
        """Put a step's blocks once the mover's copy-out of ``batch`` is done (awaited on
        the store's loop through the copy-done eventfd); never waits itself: the staging
        bound is the backpressure (a save that found none was dropped at its start).
        The staging goes back when the put is over, whatever became of it."""
        store, background = self._blocking.store, self._config.background_saves

        async def put() -> PutResult:
            try:
                await batch.wait()
                start = time.perf_counter_ns()
                try:
                    values = _values(batch, len(keys))
                    n = len(values)
                    if n < len(keys):
                        self._count(save_dropped_blocks=len(keys) - n)
                    return await store.put_many(keys[:n], values, parents=parents[:n],
                                                background=background, tags=tags[:n])
                finally:
                    self._count(save_io_ns=time.perf_counter_ns() - start)
            finally:
                batch.release()

        self._keep(self._blocking.submit(put), len(keys))

    def _keep(self, future: Future[PutResult], n: int) -> None:
        future.add_done_callback(lambda f: self._done(f, n))
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(future)

    def _done(self, future: Future[PutResult], n: int) -> None:
        if future.cancelled():
            self._count(save_failed_blocks=n)
            return
        error = future.exception()
        if error is None:
            result = future.result()
            # A droppable save the store refused under backpressure: a later miss.
            self._count(saved_blocks=result.written, save_dedup_blocks=result.deduplicated,
                        saved_bytes=result.bytes_written, save_dropped_blocks=result.dropped)
        else:
            # A full or read-only store loses a cache fill, never correctness.
            self._count(save_failed_blocks=n)
            self._warn(type(error).__name__, "kvstore connector: saving %d blocks failed "
                       "(%s: %s); later saves may fail the same way",
                       n, type(error).__name__, error)

    def busy(self) -> bool:
        """Whether a save is still in flight (its events are still to come)."""
        with self._lock:
            return any(not f.done() for f in self._pending)

    def flush(self) -> None:
        """Wait for every save in flight."""
        while True:
            with self._lock:
                self._pending = [f for f in self._pending if not f.done()]
                if not self._pending:
                    return
                oldest = self._pending[0]
            with suppress(Exception):  # a failed save is counted and logged by _done
                oldest.result()


def _values(batch: SaveBatch, n: int) -> list[torch.Tensor]:
    """A finished save's values, for its first ``n`` keys: its staged blocks, or,
    quantised on the GPU, their FP8 payloads (``EncodedBlock``: stored as they are,
    byte-identical to the store's own encoder); a block FP8 cannot take (the codec
    would store it raw) is left out, and so are the blocks after it in its chain (the
    caller puts the leading keys the values cover)."""
    mover = batch.mover
    if not (mover.cuda and mover.codec is not None):
        return batch.blocks()
    values: list[torch.Tensor] = []
    for payload in batch.payloads()[:n]:
        if payload is None:
            break
        values.append(encoded_block(payload[0], payload[1], mover.dtype, mover.block_shape))
    return values
