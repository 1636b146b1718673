"""Latency histograms of store calls: fixed buckets, counted as the calls end.

The store owns one :class:`Latency` (``Store.latency``) and times each public batch call
with it (``get``, ``put``; ``prefetch`` once it exists), failed and cancelled calls
included, so that a histogram's count is the number of calls.  ``kvstore.metrics``
exports :meth:`Latency.snapshot` as Prometheus histograms; nothing here depends on
``prometheus_client``.

Buckets are fixed so that histograms from different processes and runs can be summed
(Prometheus ``histogram_quantile`` over ``le``).  The default ones span what a KV call
takes: ~100 us (a memory-tier hit, a small NVMe read) to 10 s (a large durable batch
on a slow disk); slower calls land in ``+Inf`` and still count in ``sum``.

The counts are guarded by a lock: the event loop observes, and a scrape (an HTTP
server thread) may take a snapshot at the same time.  An observation is a bisect and
two additions, negligible next to the I/O it times.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate

__all__ = ["BUCKETS", "HistogramSnapshot", "Latency"]

BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the default buckets; ``+Inf`` is implied after the last."""


@dataclass(frozen=True)
class HistogramSnapshot:
    """One operation's histogram at a moment, in Prometheus' shape: ``cumulative[i]``
    is the number of calls that took at most ``bounds[i]`` seconds, and the last entry
    (``+Inf``) is every call."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]  # len(bounds) + 1
    sum: float

    @property
    def count(self) -> int:
        return self.cumulative[-1]


class _Histogram:
    def __init__(self, nbuckets: int) -> None:
        self.counts = [0] * (nbuckets + 1)  # per bucket (not cumulative); last is +Inf
        self.sum = 0.0


class Latency:
    """Histograms of call durations for a fixed set of operations.

    ``ops`` are declared up front: each is exported from the start (a zero count says
    "no calls yet", which is true), and observing an undeclared one is a bug, refused.
    """

    def __init__(self, ops: Iterable[str], buckets: Iterable[float] = BUCKETS) -> None:
        self.bounds = tuple(float(b) for b in buckets)
        if not self.bounds or any(b <= a for a, b in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"latency buckets must be increasing and not empty: {self.bounds}")
        self._hists = {op: _Histogram(len(self.bounds)) for op in ops}
        self._lock = threading.Lock()

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(self._hists)

    def observe(self, op: str, seconds: float) -> None:
        hist = self._hists.get(op)
        if hist is None:
            raise ValueError(f"latency op {op!r} is not one of {self.ops}; declare it when "
                             "making the Latency")
        # bisect_left: a value equal to a bound belongs to that bucket (Prometheus ``le``)
        i = bisect_left(self.bounds, seconds)
        with self._lock:
            hist.counts[i] += 1
            hist.sum += seconds

    @contextmanager
    def time(self, op: str) -> Iterator[None]:
        """Time the block as ``op``; it counts however it ends (error, cancellation)."""
        if op not in self._hists:
            self.observe(op, 0.0)  # raises: an unknown op fails before the call runs
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe(op, time.perf_counter() - start)

    def snapshot(self) -> dict[str, HistogramSnapshot]:
        """Every declared op's histogram, consistent per op (taken under the lock)."""
        with self._lock:
            raw = {op: (list(h.counts), h.sum) for op, h in self._hists.items()}
        return {op: HistogramSnapshot(self.bounds, tuple(accumulate(counts)), total)
                for op, (counts, total) in raw.items()}
