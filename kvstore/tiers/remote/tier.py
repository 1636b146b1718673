"""The remote tier: a bounded upload queue behind local durable puts, verified reads on
local misses under a deadline, and a circuit breaker in front of both.

* Writes (:mod:`kvstore.tiers.remote.uploads`, :class:`~kvstore.tiers.remote.uploads.Uploads`):
  ``enqueue(keys)`` after a put committed locally queues the keys (not the bytes); a
  worker reads each block back from the local store, verified, and writes it with a
  conditional PUT (``If-None-Match: *``), so concurrent stores never overwrite each
  other.  Keys known to be in the bucket are not queued again.  Local eviction and
  delete never touch the bucket.
* Reads: ``fetch(keys, chain=...)`` GETs objects on ``concurrency`` worker threads that
  each take the next key (``kvstore.tiers.remote.fetch``), verify it
  (``kvstore.tiers.remote.objects.verify``) and decode it there, and gives up at
  ``read_deadline_s``; with ``chain=True`` nothing after the first miss is taken.  A
  bad object is a miss, counted, never returned.
* The breaker (``kvstore.tiers.remote.breaker``): while it is open, every call is a fast miss
  and uploads wait; the local store is never slowed down by an unreachable cluster.
* Request slots (``kvstore.tiers.remote.request_slots``): at most ``concurrency``
  requests are in flight at the cluster, reads and uploads together, counted until
  each request returns: a request a read abandoned at its deadline keeps its slot (and
  its thread) until the cluster answers it or ``request_timeout_s`` ends it.  A read waits for a slot within
  its deadline; uploads never take the last one.

What a slow cluster costs a get: at most one ``read_deadline_s`` (a get never waits
longer for the remote), and only until the breaker opens.  Requests unanswered at
their read's deadline are breaker failures (one per request, when the read got no
answer at all; a read that got answers but ran out of time is not the cluster's
fault), and so is a read that found every slot held for longer than a deadline by
such requests.  After ``breaker_failures`` of them (one get of ``breaker_failures``
blocks or more, or that many single-block gets) the breaker opens, and every get is a
miss at once, without a request, a thread or a wait, for ``breaker_reset_s``; then one
get sends one probe (a due probe that finds no free slot is a fast miss too).  Answers
that come after their read gave up are dropped and tell the breaker nothing.  Threads
and connections a slow cluster can tie up: at most ``concurrency``, plus one for the
access check at open.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import anyio
import anyio.abc

from kvstore.errors import RemoteError
from kvstore.tiers.remote import objects
from kvstore.tiers.remote.blocks import Finish, RemoteBlock
from kvstore.tiers.remote.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kvstore.tiers.remote.client import ObjectClient, Unavailable
from kvstore.tiers.remote.config import RemoteConfig
from kvstore.tiers.remote.fetch import FetchRun
from kvstore.tiers.remote.request_slots import RequestSlot, RequestSlots
from kvstore.tiers.remote.stats import RemoteStats
from kvstore.tiers.remote.uploads import BreakerOpen, KnownKeys, SlotReader, Uploads, breaker_open

__all__ = ["BreakerOpen", "InFlight", "RemoteTier", "SlotReader"]


class InFlight:
    """One key being fetched by a read: a second read of it waits for this one instead
    of sending its own request.  ``block`` once ``done`` is set (None: a miss, a bad
    object, or the deadline); ``abandoned``: the fetching read gave the key up without
    an answer (it was cancelled, or its chain walk stopped before it): the waiter
    fetches the key itself.  ``done`` is set as soon as the answer is known, before the
    fetching read promotes the block; the key stays registered until that promotion
    started (or, for a prefetch, landed), so a read in between is answered too."""

    __slots__ = ("done", "block", "abandoned")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.block: RemoteBlock | None = None
        self.abandoned = True  # until the fetch answers

    def finish(self, block: RemoteBlock | None) -> None:
        self.block, self.abandoned = block, False
        self.done.set()

    def give_up(self) -> None:
        self.done.set()


class RemoteTier:
    def __init__(self, config: RemoteConfig, namespace_digest: bytes,
                 read_slot: SlotReader) -> None:
        self.config = config
        self.namespace_digest = namespace_digest
        self.client = ObjectClient(config)
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_reset_s)
        self._slots = RequestSlots(config.concurrency)
        self._stats = RemoteStats()
        self.disabled_reason: str | None = None
        self._known = KnownKeys()
        self._limiter: anyio.CapacityLimiter | None = None
        self._uploads = Uploads(config, namespace_digest, self.client, self.breaker,
                                self._slots, self._stats, self._known, read_slot,
                                self._wake_if_idle)
        # Fetched blocks whose local put (promotion) runs in the background: served from
        # here meanwhile (kvstore/tiers/remote/adapter.py), so a get right after a match_prefix
        # does not fetch them again.
        self.promoting: dict[bytes, RemoteBlock] = {}
        self._promotions = 0  # background promotions running
        # Keys a read is fetching now: another read of them waits for that fetch
        # (kvstore/tiers/remote/adapter.py), so concurrent lookups of a shared prefix send one
        # request per block, not one each.
        self.fetching: dict[bytes, InFlight] = {}
        self._idle: anyio.Event | None = None

    # ------------------------------------------------------------------ open, close

    def check_access(self) -> None:
        """At open (blocking): refused credentials or a missing bucket raise (or disable
        the tier with ``on_auth_error="disable"``); an unreachable cluster does not: it
        opens the breaker, and the store opens with fast misses until it answers.  Nor
        does a cluster that does not answer within ``connect_timeout_s +
        read_deadline_s``: open waits no longer, the breaker opens, and the probe's
        request finishes alone on its thread (holding its slot), its answer dropped."""
        cfg = self.config
        prefix = objects.namespace_prefix(cfg.prefix, self.namespace_digest)
        slot = self._slots.take_nowait()
        assert slot is not None, "check_access runs before any other request"
        answered = threading.Event()
        outcome: list[BaseException | None] = []

        def probe() -> None:
            slot.claim()
            try:
                self.client.probe(prefix)
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - handed to check_access
                outcome.append(e)
            finally:
                slot.release()
                answered.set()

        self._stats.requests += 1
        threading.Thread(target=probe, name="kvstore-remote-probe", daemon=True).start()
        try:
            if not answered.wait(cfg.connect_timeout_s + cfg.read_deadline_s):
                raise Unavailable(f"no answer to the access check within "
                                  f"{cfg.connect_timeout_s + cfg.read_deadline_s:g} s "
                                  f"(connect_timeout_s + read_deadline_s)")
            if outcome[0] is not None:
                raise outcome[0]
        except Unavailable as e:
            self._stats.request_errors += 1
            self.breaker.failure(str(e), cfg.breaker_failures)
        except RemoteError as e:  # RemoteAuthError included
            if self.config.on_auth_error == "disable":
                self.disabled_reason = str(e)
            else:
                raise

    async def run(self, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """The upload workers, until ``aclose``; started in the store's task group."""
        self._limiter = anyio.CapacityLimiter(self.config.concurrency)
        await self._uploads.run(self._limiter, task_status)

    async def aclose(self) -> None:
        """Wait up to ``close_drain_s`` for queued uploads, then stop; what is still
        queued is dropped (counted)."""
        if not self._uploads.started:
            return
        with anyio.move_on_after(self.config.close_drain_s):
            await self.flush()
        await self._uploads.stop()

    async def flush(self) -> None:
        """Wait until every queued upload is done (uploaded, found, or given up) and
        every fetched block's promotion has landed (stored locally, or dropped)."""
        while self._uploads.pending or self._promotions:
            self._idle = anyio.Event()
            await self._idle.wait()

    def promotion_started(self, blocks: Sequence[RemoteBlock]) -> None:
        self._promotions += 1
        for block in blocks:
            self.promoting[block.key] = block

    def promotion_done(self, blocks: Sequence[RemoteBlock]) -> None:
        for block in blocks:
            if self.promoting.get(block.key) is block:  # not a later fetch's
                del self.promoting[block.key]
        self._promotions -= 1
        self._wake_if_idle()

    def held(self, key: bytes) -> RemoteBlock | InFlight | None:
        """A block of ``key`` this tier already has or is getting: being promoted (the
        verified block), being fetched by another read (its :class:`InFlight`), or
        None."""
        block = self.promoting.get(key)
        if block is not None:
            return block
        inflight = self.fetching.get(key)
        if inflight is None or (inflight.abandoned and inflight.done.is_set()):
            return None  # given up: not an answer to wait for
        return inflight

    def start_fetching(self, key: bytes) -> InFlight:
        self.fetching[key] = inflight = InFlight()
        return inflight

    def end_fetching(self, key: bytes, inflight: InFlight) -> None:
        """The fetching read is over (answered and its promotion started or landed, or
        cancelled): the key leaves ``fetching``, never before it is in ``promoting`` or
        stored, so a read never finds it in neither place while it is on its way."""
        if self.fetching.get(key) is inflight:
            del self.fetching[key]
        inflight.give_up()  # if not answered: its waiters ask themselves

    def _wake_if_idle(self) -> None:
        if not self._uploads.pending and not self._promotions and self._idle is not None:
            self._idle.set()

    # ------------------------------------------------------------------ stats

    def count_promotions(self, *, written: int = 0, dropped: int = 0) -> None:
        """Fetched blocks stored locally, or not (:mod:`kvstore.tiers.remote.promotion`)."""
        self._stats.promoted_blocks += written
        self._stats.promotion_dropped += dropped

    def count_joined(self) -> None:
        """A block a read took from another read's fetch (not requested twice)."""
        self._stats.joined += 1

    def stats(self) -> RemoteStats:
        s = RemoteStats(**self._stats.as_dict())
        b = self.breaker
        s.breaker_trips = b.trips
        if self.disabled_reason is not None:
            s.state, s.reason = "disabled", self.disabled_reason
        elif b.state == OPEN:
            s.state, s.reason, s.retry_in_s = "unreachable", b.last_error, b.retry_in()
        elif b.state == HALF_OPEN:
            s.state, s.reason = "probing", b.last_error
        s.promoting_blocks = len(self.promoting)
        s.requests_in_flight = self._slots.in_flight
        s.upload_queue_blocks = self._uploads.queued()
        return s

    @property
    def usable(self) -> bool:
        return self.disabled_reason is None

    # ------------------------------------------------------------------ requests

    async def _fetch_thread(self, run: FetchRun, slot: RequestSlot) -> None:
        try:
            # abandon_on_cancel: a deadline returns at once; a thread in a request
            # finishes it alone, takes nothing more and then gives its slot back
            await anyio.to_thread.run_sync(run.work, slot, limiter=self._limiter,
                                           abandon_on_cancel=True)
        finally:
            slot.drop()  # gives it back only if its thread never started

    # ------------------------------------------------------------------ reads

    async def fetch(self, keys: Sequence[bytes], *, chain: bool, then: Finish | None = None
                    ) -> list[RemoteBlock | None]:
        """Fetch and verify ``keys`` (``concurrency`` requests at a time, under the read
        deadline; ``kvstore.tiers.remote.fetch``); None for a miss.  ``chain``: keys are one
        chain in order; stop at the first miss (the result is then a prefix).
        ``then(index, block)`` runs on a worker thread for each object whose header
        verified; it must check the payload CRC32C (``objects.decode(...,
        check=True)``) and may raise only ``CorruptionError`` (the object is then a bad
        one, a miss); keep other errors for later."""
        if not keys or not self.usable:
            return [None] * len(keys)
        self._stats.gets += len(keys)
        if breaker_open(self.breaker):
            self._stats.fast_misses += len(keys)
            self._stats.misses += len(keys)
            return [None] * len(keys)
        assert self._limiter is not None, "RemoteTier.run() was not started"
        digest, hmac_key = self.namespace_digest, self.config.hmac_key

        def verify(key: bytes, data: objects.ObjectBytes) -> RemoteBlock:
            header = objects.verify(data, key, namespace_digest=digest, hmac_key=hmac_key,
                                    payload=then is None)
            return RemoteBlock(key, header, data)

        run = FetchRun(keys, [objects.object_name(self.config.prefix, digest, k)
                              for k in keys], chain=chain, client=self.client,
                       breaker=self.breaker, verify=verify, then=then)
        # A breaker due for a probe (not closed) sends one request, on one thread, and
        # waits for nothing: with no free slot (every one held by an unanswered
        # request) the fetch is a fast miss.
        probing = self.breaker.state != CLOSED
        first = self._slots.take_nowait()
        if first is None and probing:
            self._stats.fast_misses += len(keys)
            self._stats.misses += len(keys)
            return [None] * len(keys)
        want = 1 if probing else min(self.config.concurrency, len(keys))
        started = 0
        slot: RequestSlot | None = first
        try:
            with anyio.move_on_after(self.config.read_deadline_s):
                async with anyio.create_task_group() as tg:
                    # a thread per slot, as slots come free, while keys are left that
                    # no thread took; the wait for a slot is within the deadline
                    while started < want and run.untaken():
                        if slot is None:
                            slot = self._slots.take_nowait() or await self._slots.take()
                            if not run.untaken():
                                break
                        tg.start_soon(self._fetch_thread, run, slot)
                        slot = None
                        started += 1
        finally:
            if slot is not None:
                slot.drop()
            late, silent = run.close()
        if late and (silent or self.breaker.state == HALF_OPEN):
            # no answer within a whole deadline: each request still out is a failure
            self.breaker.failure(f"{late} GET(s) unanswered at the read deadline "
                                 f"({self.config.read_deadline_s:g} s)", late)
        elif not started and self._slots.oldest_s() >= self.config.read_deadline_s:
            # no slot within the deadline, every one held by a request older than one
            self.breaker.failure(f"no request slot free within the read deadline "
                                 f"({self.config.read_deadline_s:g} s): "
                                 f"{self._slots.in_flight} request(s) unanswered")
        results = run.results
        st = self._stats
        st.requests += run.requests
        st.request_errors += run.request_errors
        st.fast_misses += run.fast_misses
        st.bad_objects += run.bad_objects
        st.refused_objects += run.refused
        st.deadline_misses += sum(not d for d in run.done)
        got = sum(r is not None for r in results)
        if chain:  # only the prefix counts
            got = next((i for i, r in enumerate(results) if r is None), len(results))
            results[got:] = [None] * (len(results) - got)
        st.hits += got
        st.misses += len(keys) - got
        st.read_bytes += sum(len(r.data) for r in results if r is not None)
        self._known.remember(r.key for r in results if r is not None)
        return results

    # ------------------------------------------------------------------ writes

    def enqueue(self, keys: Sequence[bytes]) -> None:
        """Queue locally durable blocks for upload (never waits; drops when full;
        :mod:`kvstore.tiers.remote.uploads`)."""
        if self.usable:
            self._uploads.enqueue(keys)
