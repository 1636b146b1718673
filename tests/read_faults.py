"""Read faults injected at each real engine's own read call, so that what the engine does
with them (merging neighbours into one request, spreading its result) is the engine's
real code, not a stand-in:

* threads: the ``preadv`` the thread pool issues (``kvstore.io.threads``' ``os``), one
  call per merged range;
* io_uring: the completions of the ring (``UringEngine._submit``'s results), one per
  merged range, before the engine spreads them over its ops;
* simulated: its own fault queue (``SimulatedDisk.faults``) for a transient fault (the
  next read op fails once), and, for a persistent one, a failing range checked per op
  (the simulated disk never merges).

A :class:`ReadFaults` names slots (file offset ranges of one extent) whose reads fail:
``times`` reads each (None: every read, a dead sector).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import kvstore
from kvstore.disk.extents import extent_path
from kvstore.disk.format import IndexEntry
from kvstore.io.coalesce import Merged
from kvstore.io.protocol import EngineWrapper, IOEngine, IoOp
from kvstore.io.simulated import SimulatedDisk, SimulatedEngine
from tests.concurrency import real_engine

ENGINES = ["io_uring", "threads", "simulated"]


def eio() -> OSError:
    return OSError(errno.EIO, "Input/output error (injected)")


@dataclass
class ReadFaults:
    """Reads that touch ``[offset, offset + length)`` of the extent file ``path`` fail,
    ``times`` times (None: always).  ``failed`` records each failed request's length."""

    path: str | None = None
    offset: int = 0
    length: int = 0
    times: int | None = None
    failed: list[int] = field(default_factory=list)

    def hits(self, fd: int, offset: int, length: int) -> bool:
        if self.path is None or (self.times is not None and len(self.failed) >= self.times):
            return False
        if not os.path.samefile(f"/proc/self/fd/{fd}", self.path):
            return False
        if offset < self.offset + self.length and self.offset < offset + length:
            self.failed.append(length)
            return True
        return False

    def aim(self, path: str, entry: IndexEntry, times: int | None = None) -> None:
        """Fail reads of ``entry``'s slot in the store at ``path``, ``times`` times (None:
        always)."""
        self.path = extent_path(path, entry.extent)
        self.offset, self.length, self.times = entry.offset, entry.slot_len, times

    def clear(self) -> None:
        self.path = None


class _FaultyOs:
    """``os`` as ``kvstore.io.threads`` sees it: ``preadv`` fails where told."""

    def __init__(self, faults: ReadFaults) -> None:
        self._faults = faults

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        if self._faults.hits(fd, offset, sum(len(memoryview(b)) for b in buffers)):
            raise eio()
        return os.preadv(fd, buffers, offset)


class _FailingOps(EngineWrapper):
    """The simulated engine's reads, failing per op where told (it merges nothing)."""

    def __init__(self, inner: IOEngine, faults: ReadFaults) -> None:
        super().__init__(inner)
        self._faults = faults

    async def read(self, ops: Sequence[IoOp]) -> list[int | OSError]:
        results = await self.inner.read(ops)
        return [eio() if self._faults.hits(op.fd, op.offset, op.run.length) else r
                for op, r in zip(ops, results)]


def faulty_engine(kind: str, path: Path, faults: ReadFaults,
                  monkeypatch: pytest.MonkeyPatch) -> IOEngine:
    """A fresh engine of ``kind`` whose reads fail as ``faults`` says (see the module
    docstring); ``faults`` may be filled in after the store opened."""
    if kind == "simulated":
        return _FailingOps(SimulatedEngine(SimulatedDisk(seed=3)), faults)
    engine = real_engine(kind, path)
    if kind == "threads":
        import kvstore.io.threads

        monkeypatch.setattr(kvstore.io.threads, "os", _FaultyOs(faults))
        return engine
    from kvstore.io.uring import UringEngine, _prep_read

    assert isinstance(engine, UringEngine)
    submit = engine._submit

    async def failing_submit(preps: Sequence[tuple[Any, object]]) -> list[int | OSError]:
        results = await submit(preps)
        return [eio() if getattr(prep, "func", None) is _prep_read and isinstance(keep, Merged)
                and faults.hits(keep.fd, keep.offset, keep.length) else r
                for (prep, keep), r in zip(preps, results)]

    monkeypatch.setattr(engine, "_submit", failing_submit)
    return engine


def open_faulty(kind: str, path: Path, faults: ReadFaults, monkeypatch: pytest.MonkeyPatch,
                **options: Any) -> AbstractAsyncContextManager[kvstore.Store]:
    """``kvstore.open(path, **options)`` on :func:`faulty_engine`."""
    return kvstore.open(path, engine=faulty_engine(kind, path, faults, monkeypatch), **options)
