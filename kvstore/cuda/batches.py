"""The data mover's batches (:mod:`kvstore.cuda.mover`): one step's blocks on their way
out (:class:`SaveBatch`) or in (:class:`LoadBatch`), each holding a staging lease until
its copy-done notice fired."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch

from kvstore.cuda.device import Notice
from kvstore.cuda.mover_core import MoverCore
from kvstore.cuda.staging import DeviceLease, Lease

__all__ = ["LoadBatch", "SaveBatch"]

U8 = npt.NDArray[np.uint8]


class _Batch:
    def __init__(self, mover: MoverCore, lease: Lease | DeviceLease, n: int) -> None:
        self.mover, self.lease, self.n = mover, lease, n
        self.notice: Notice | None = None
        self.released = False
        self.enqueued = 0   # the stream its copies were enqueued on (0: none)
        self.host_ids: list[int] = []   # the CPU path's cache block ids
        self._staged: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        """The batch's copies have completed (always, on the CPU path)."""
        return self.notice is None or self.notice.poll()

    async def wait(self) -> None:
        """Until the batch's copies have completed, awaited through the eventfd (a
        cancelled wait still lets the copies finish before anything is reused)."""
        if self.notice is not None:
            await self.notice.wait()

    def release(self) -> None:
        """Hand the staging back: now if the copies are done, else once they are (an
        aborted save, whose ``end_save`` never came, first gets a notice after the
        copies it enqueued)."""
        if not self.released:
            self.released = True
            if self.notice is None and self.enqueued:
                self.notice = self.mover.notice_after(self.enqueued)
            self.mover.retire(self.lease, self.notice)

    def staged(self) -> torch.Tensor:
        """The staging as ``[n, num_layers, *per_block]`` (a page-locked CPU view; read it
        only once :meth:`wait` returned)."""
        if self._staged is None:
            m = self.mover
            self._staged = self.lease.tensor(m.dtype, (self.n, *m.block_shape))
        return self._staged

    def blocks(self) -> list[torch.Tensor]:
        """The staged blocks, ``[num_layers, *per_block]`` each."""
        return list(self.staged().unbind(0))


class SaveBatch(_Batch):
    """One step's blocks on their way out (see :mod:`kvstore.cuda.mover`).  ``encode``
    makes :meth:`payloads` (the save side's)."""

    def __init__(self, mover: MoverCore, lease: Lease | DeviceLease, block_ids: list[int],
                 encode: Callable[[SaveBatch], list[tuple[int, U8] | None]]) -> None:
        super().__init__(mover, lease, len(block_ids))
        self.block_ids = self.host_ids = block_ids
        self.layers_done: set[int] = set()
        self.ended = False
        # Not (wholly) copied out: the compute stream was capturing a CUDA graph at one
        # of its calls; the caller drops it (counted in MoverStats.capture_skipped_*).
        self.skipped = False
        self._encode = encode

    def payloads(self) -> list[tuple[int, U8] | None]:
        """``(codec id, payload)`` per block, as :func:`kvstore.codecs.pipeline.encode` makes
        them from the same values (after :meth:`wait`); needs a mover with a codec.
        ``None`` for a block the codec would store losslessly (a finite value FP8
        scales cannot reach: the GPU path does not keep its raw bytes; counted in
        ``MoverStats.fp8_lossless_dropped``, the caller drops it)."""
        return self._encode(self)


class LoadBatch(_Batch):
    """Staging for ``n`` blocks coming in: ``blocks()`` is where the store reads them
    (device memory on the GPU path: the reads land there straight from the arena)."""
