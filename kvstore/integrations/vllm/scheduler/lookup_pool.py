"""The scheduler's prefix lookups, answered within a wait budget.

vLLM asks a connector how many tokens of a waiting request it holds on the scheduler's
own thread (``get_num_new_matched_tokens``), and a slow answer stalls the next step of
every running request.  A lookup that goes past the local index, to the remote tier (an
S3 round trip per chain, up to the tier's deadline), can take tens of milliseconds.  vLLM
lets a connector answer ``None``, "ask again later": the request is skipped for this step
and the others are scheduled.

:class:`LookupPool` runs each request's lookup on a small pool of worker threads and waits
for it at most ``wait_s``.  A lookup still running then is *deferred*: the scheduler gets
``None`` and the lookup goes on; the request's next ask with the same query takes its
answer (once).  A different query (the request's local hit moved) or the request's end
drops the old lookup, whose answer is then never used.  With ``wait_s=None`` every lookup
runs on the caller's thread, as it did before this existed (a local-only store: an LMDB
read, sub-millisecond).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

__all__ = ["LookupPool"]

# Lookups in flight or answered but not yet asked for; past this the oldest is dropped
# (vLLM asks about a handful of waiting requests per step; this only bounds a leak).
MAX_PENDING = 4096


@dataclass
class _Pending:
    query: tuple[bytes, ...]
    future: Future[int]


class LookupPool:
    """Per-request lookups with a wait budget (see the module docstring)."""

    def __init__(self, match: Callable[[list[bytes]], int], wait_s: float | None,
                 *, workers: int = 2) -> None:
        if wait_s is not None and wait_s < 0:
            raise ValueError(f"the lookup wait must be >= 0 seconds or None, got {wait_s!r}")
        self._match = match
        self.wait_s = wait_s
        self._pool = None if wait_s is None else ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="kvstore-lookup")
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._lock = threading.Lock()
        self.deferred = 0  # asks answered None: the lookup outlived the wait

    def ask(self, request_id: str, hashes: Sequence[bytes]) -> int | None:
        """How many leading ``hashes`` are stored, or None if the lookup for them is
        still running after the wait (ask again with the same hashes later).  Raises
        what the lookup raised (once; the next ask starts a new lookup)."""
        if self._pool is None:
            return self._match(list(hashes))
        query = tuple(hashes)
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is None or pending.query != query:
                if pending is not None:
                    pending.future.cancel()  # not started: never runs; else ignored
                pending = _Pending(query, self._pool.submit(self._match, list(query)))
                self._pending[request_id] = pending
                self._pending.move_to_end(request_id)
                while len(self._pending) > MAX_PENDING:
                    self._pending.popitem(last=False)[1].future.cancel()
        done, _ = wait_futures([pending.future], timeout=self.wait_s)
        if not done:
            with self._lock:
                self.deferred += 1
            return None
        with self._lock:
            if self._pending.get(request_id) is pending:
                del self._pending[request_id]
        return pending.future.result()

    def running(self, request_id: str) -> Future[int] | None:
        """The lookup held for ``request_id`` (running or answered, not yet asked for)."""
        with self._lock:
            pending = self._pending.get(request_id)
        return None if pending is None else pending.future

    def forget(self, request_id: str) -> None:
        """The request ended: its lookup's answer is never used."""
        with self._lock:
            pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending.future.cancel()

    def forget_all(self) -> None:
        """Drop every held lookup (the key scope moved: their answers are of the old
        one); lookups already running finish, and their answers are never used."""
        with self._lock:
            held, self._pending = list(self._pending.values()), OrderedDict()
        for pending in held:
            pending.future.cancel()

    def close(self) -> None:
        """Drop every held lookup and wait for the ones already running to return;
        later asks are answered on the caller's thread."""
        with self._lock:
            held, self._pending = list(self._pending.values()), OrderedDict()
        for pending in held:
            pending.future.cancel()
        pool, self._pool = self._pool, None  # later asks run on the caller's thread
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
