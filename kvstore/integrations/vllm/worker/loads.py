"""The vLLM connector worker's loads, per step: in the background (``async_loads``, the
default: :mod:`kvstore.integrations.vllm.worker.background_loads`) or synchronously, the
blocks the scheduler's lookup read and verified (:meth:`.WorkerStore.read_ahead`)
copied into the KV cache in ``start_load_kv``, before the forward.  Part of
:class:`~kvstore.integrations.vllm.worker.side.WorkerSide`; kept apart from the saves.

Every load ends one way (:meth:`StepLoads.land`): the leading blocks that arrived are
copied into the KV cache through the data mover, the first that did not and every block
after it are reported to vLLM as load errors (it recomputes them), the failure is
recorded once with the open store (:meth:`.OpenStore.load_failed`: keys that keep
failing are answered as misses), and the load is counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from kvstore.cuda.mover import LoadBatch
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.metadata import KVStoreConnectorMetadata, Load
from kvstore.integrations.vllm.open_store import warn_once
from kvstore.integrations.vllm.worker.background_loads import BackgroundLoads, Read, arrived
from kvstore.integrations.vllm.worker.store import WorkerStore

__all__ = ["StepLoads"]

CopyIn = Callable[[torch.Tensor, "LoadBatch | None", list[int]], None]


class StepLoads:
    """One worker's loads.  The worker hands it ``copy_in`` (staged blocks into the KV
    cache at block ids, through the mover), ``block_bytes`` (one block of every layer)
    and ``capturing`` (a CUDA graph capture is under way)."""

    def __init__(self, store: WorkerStore, config: ConnectorConfig, copy_in: CopyIn,
                 block_bytes: Callable[[], int], capturing: Callable[[], bool]) -> None:
        self._store, self._open, self._config = store, store.open, config
        self._copy_in, self._block_bytes, self._capturing = copy_in, block_bytes, capturing
        self.background = BackgroundLoads(store, self.land, capturing)
        self._errors: set[int] = set()  # of synchronous loads
        # A synchronous load failed in this step: its forward read unloaded blocks.
        self.step_failed = False

    def start(self, meta: KVStoreConnectorMetadata) -> None:
        """Start this step's loads in the background, or with ``async_loads`` off copy
        them into the KV cache now, before the forward."""
        if self._config.async_loads:
            # (In a CUDA graph capture such a load fails, reported in finished()
            # after the capture, and is recomputed.)
            for load in meta.loads:
                self.background.start(load)
            return
        self.step_failed = False
        if self._capturing():
            self._refuse_in_capture(meta)
            return
        self._store.next_step()
        for load in meta.loads:
            self._load_now(load)

    def _refuse_in_capture(self, meta: KVStoreConnectorMetadata) -> None:
        """Synchronous loads asked for during a graph capture (vLLM's own dummy steps
        bring none) fail: vLLM recomputes their blocks."""
        if not meta.loads:
            return
        warn_once("capture-loads", "kvstore connector: %d loads asked for while the "
                  "engine captures a CUDA graph; their blocks are recomputed",
                  len(meta.loads))
        self.step_failed = True
        for load in meta.loads:
            n = len(load.block_ids)
            self._open.count(load_blocks=n, load_failed_blocks=n)
            self._errors.update(load.block_ids)

    def _load_now(self, load: Load) -> None:
        """A synchronous load: the blocks its lookup read and verified.  Should they be
        gone (never, in vLLM's order of calls), they are read now; blocks that fail are
        load errors: vLLM recomputes them and drops this step's output of the request;
        this step saves nothing."""
        n = len(load.block_ids)
        start = time.perf_counter_ns()
        self._open.count(load_blocks=n)
        keys = self._open.keys(load.hashes)
        if self._open.suspended is not None:
            keys = None  # the weights changed under these keys: nothing is loaded
        prepared = None if keys is None else self._store.take_prepared(keys)
        target = prepared if prepared is not None or keys is None or not n else \
            self._store.load_target(n)
        blocks, staging = (None, None) if target is None else target

        def read() -> Sequence[torch.Tensor | None]:
            if blocks is None or keys is None:
                return []
            if prepared is not None:
                return list(blocks.unbind(0))  # read and verified by the lookup
            # (the prefix the load staging holds; the rest is computed)
            return self._store.get_many(keys[:len(blocks)], list(blocks.unbind(0)))

        failed = self.land(load, keys, read, blocks, staging, start, sample=False)
        if failed:
            self.step_failed = True
            self._errors.update(failed)

    def land(self, load: Load, keys: list[bytes] | None, read: Read,
             blocks: torch.Tensor | None, staging: LoadBatch | None, started_ns: int,
             *, sample: bool) -> list[int]:
        """The end of every load (module docstring): ``read`` gives the blocks read into
        ``blocks`` (lying in ``staging``, which goes back), or raises what the read
        raised (a miss: vLLM computes).  ``sample``: the load's time goes into vLLM's
        histogram (a synchronous load's read was sampled by its lookup).  Returns the
        block ids that failed."""
        error: Exception | None = None
        try:
            got = read()
        except Exception as e:  # noqa: BLE001 - a failed read is a miss, recorded
            got, error = [], e
        ok = arrived(got)
        self._open.load_failed(keys, ok, len(got), error)
        if ok:
            assert blocks is not None
            self._copy_in(blocks, staging, load.block_ids[:ok])
        elif staging is not None:
            staging.release()
        failed = load.block_ids[ok:]
        elapsed = time.perf_counter_ns() - started_ns
        self._open.count(loaded_blocks=ok, load_failed_blocks=len(failed), load_ns=elapsed,
                         loaded_bytes=ok * self._block_bytes())
        if sample:
            self._open.record_load(elapsed / 1e9)
        return failed

    def finished(self, idle: bool) -> set[str] | None:
        """The requests whose background load is done (:meth:`BackgroundLoads.finished`)."""
        return self.background.finished(idle)

    def take_errors(self) -> set[int]:
        """The block ids whose load failed since the last call, of every load."""
        errors = self._errors | self.background.errors
        self._errors, self.background.errors = set(), set()
        return errors

    def close(self) -> None:
        self.background.close()
