"""One remote read (``RemoteTier.fetch``): a few worker threads that each take the next
key, GET it, verify it and hand it to the caller's decode, until the keys run out.

Why threads that loop rather than a task per key: every block used to cost the event
loop a task, a capacity-limiter round and two thread hand-offs; on a host whose cores
are busy (the cluster's own processes, an engine) that bookkeeping, with the GIL it
holds, was a fifth of a read's CPU.  Here the loop starts up to ``concurrency``
threads per fetch, one per free request slot, and waits; everything per block happens
on them.

* Order: keys are taken in order.  For a chain (``chain=True``) the first miss stops
  the taking of later keys (those already in flight are discarded): the result is a
  prefix, as a chain walk needs, without waiting for a window of requests to finish.
* Slots: each thread is started with a request slot the event loop took for it
  (``kvstore.tiers.remote.request_slots``) and gives it back when it ends, after its last request
  returned: a thread whose request outlived the deadline keeps its slot until then, so
  the requests in flight at the cluster never exceed ``concurrency``.
* Deadline: the caller cancels (``read_deadline_s``) and calls ``close()``; a thread in
  a request finishes it alone and then takes nothing more, and whatever it gets after
  ``close()`` is dropped, never written into the results, nor told to the breaker.
  ``close()`` says how many requests were still out: if none of the fetch's requests
  had returned by then (the cluster did not answer within a whole deadline), each of
  them is a failure to the breaker; a fetch that got answers but ran out of time (more
  blocks than a deadline carries) is not the cluster's fault and counts nothing.
  A half-open breaker's probe that has not answered by the deadline fails.
* The breaker is asked before every request and told how it went (it is thread-safe);
  a request the breaker refuses is a fast miss.
* Counters are kept here and added to the tier's stats by the event loop afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvstore.errors import CorruptionError, FormatVersionError, RemoteError
from kvstore.tiers.remote import objects
from kvstore.tiers.remote.blocks import Finish, RemoteBlock
from kvstore.tiers.remote.breaker import CircuitBreaker
from kvstore.tiers.remote.client import ObjectClient, Refused, Unavailable
from kvstore.tiers.remote.request_slots import RequestSlot


class FetchRun:
    """The shared state of one fetch; ``work`` runs on each of its threads."""

    def __init__(self, keys: Sequence[bytes], names: Sequence[str], *, chain: bool,
                 client: ObjectClient, breaker: CircuitBreaker,
                 verify: Callable[[bytes, objects.ObjectBytes], RemoteBlock],
                 then: Finish | None) -> None:
        self.keys, self.names, self.chain = keys, names, chain
        self._client, self._breaker, self._verify, self._then = client, breaker, verify, then
        self._lock = threading.Lock()
        self._next = 0
        self._stop_at = len(keys)  # a chain's first miss: nothing after it is taken
        self._closed = False
        self.results: list[RemoteBlock | None] = [None] * len(keys)
        self.done = [False] * len(keys)
        self.requests = self.request_errors = self.fast_misses = self.bad_objects = 0
        self.refused = 0  # requests refused with a client error about their object
        self._out: set[int] = set()  # keys whose request is out now
        self._returned = 0  # requests that returned before close()

    def untaken(self) -> bool:
        """Whether keys are left that no thread has taken (another thread could help)."""
        with self._lock:
            return not self._closed and self._next < self._stop_at

    def close(self) -> tuple[int, bool]:
        """The fetch is over (finished or past its deadline): threads still in a request
        take no more keys and keep what they get to themselves.  Returns the number of
        requests still out, and whether no request of this fetch returned at all."""
        with self._lock:
            self._closed = True
            return len(self._out), self._returned == 0

    def work(self, slot: RequestSlot) -> None:
        """On a worker thread: take keys until none is left (or the fetch is closed);
        ``slot`` is given back when the last request returned."""
        if not slot.claim():
            return  # the fetch gave this thread up before it started
        try:
            while (i := self._take()) is not None:
                if not self._breaker.allow():
                    self._finish(i, None, fast_miss=True)
                    continue
                block = self._request(i)
                self._finish(i, block)
        finally:
            slot.release()

    def _take(self) -> int | None:
        with self._lock:
            if self._closed or self._next >= self._stop_at:
                return None
            self._next += 1
            return self._next - 1

    def _returns(self, i: int) -> bool:
        """The request for key ``i`` returned: True if in time (before ``close()``)."""
        with self._lock:
            self._out.discard(i)
            self._returned += not self._closed
            return not self._closed

    def _request(self, i: int) -> RemoteBlock | None:
        """GET, verify and decode key ``i``: the block, or None (absent, no answer, bad,
        late: counted)."""
        with self._lock:
            if self._closed:  # the deadline passed since the key was taken: not sent
                closed = True
            else:
                closed = False
                self.requests += 1
                self._out.add(i)
        if closed:
            self._breaker.release_probe()  # if allow() made this the probe
            return None
        try:
            data = self._client.get(self.names[i])
        except (Unavailable, RemoteError) as e:
            # credentials revoked (or the bucket deleted) while open count like an
            # unreachable cluster: stop asking
            if self._returns(i):
                with self._lock:
                    self.request_errors += 1
                self._breaker.failure(str(e))
            return None
        except Refused:
            # about this object only: a miss; the cluster answered (its neighbours in
            # this fetch, and other reads, go on asking)
            if self._returns(i):
                with self._lock:
                    self.refused += 1
                self._breaker.success()
            return None
        except BaseException:
            self._returns(i)
            self._breaker.release_probe()  # a half-open probe must not stay claimed
            raise
        if not self._returns(i):
            return None  # late: dropped, and the breaker already counted it
        self._breaker.success()
        if data is None:
            return None
        try:
            block = self._verify(self.keys[i], data)
            if self._then is not None:
                self._then(i, block)  # checks the payload CRC32C while it decodes
        except (CorruptionError, FormatVersionError):
            with self._lock:
                self.bad_objects += 1
            return None
        return block

    def _finish(self, i: int, block: RemoteBlock | None, *, fast_miss: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self.done[i] = True
            self.results[i] = block
            self.fast_misses += fast_miss
            if block is None and self.chain:
                self._stop_at = min(self._stop_at, i)
