"""The remote tier's upload side: a bounded queue of keys behind local durable puts, and
the workers that read each block back and write it to the bucket if it is not there.

``enqueue(keys)`` after a put committed locally.  The queue holds keys, not bytes (at
most ``upload_queue_blocks``; beyond it keys are dropped and counted).  A worker reads
the block back from the local store (verified, under a read epoch so the slot cannot be
reused meanwhile: the store's ``SlotReader``) and writes it with a conditional PUT
(``If-None-Match: *``): an object already there is left alone, so concurrent stores
never overwrite each other.  Keys known to be in the bucket (uploaded, found, or
fetched: :class:`KnownKeys`, shared with the read side) are not queued again.  Uploads
wait for a request slot (they never take the last one) and go through the breaker; a
block that could not be uploaded goes to the back of the queue, up to three attempts.
One block's failure is its own: an object the cluster refuses (a 4xx about it) is
given up at once without counting against the breaker, and any other error of one
block is counted (``upload_failed``) and logged, never raised out of the workers.
Local eviction and delete never touch the bucket.  :class:`~kvstore.tiers.remote.tier.RemoteTier`
owns one and starts it in the store's task group.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvstore.disk.format import SlotHeader
from kvstore.errors import RemoteError
from kvstore.io.aligned import AlignedBuffer
from kvstore.tiers.remote import objects
from kvstore.tiers.remote.breaker import OPEN, CircuitBreaker
from kvstore.tiers.remote.client import ObjectClient, Refused, Unavailable
from kvstore.tiers.remote.config import RemoteConfig
from kvstore.tiers.remote.request_slots import RequestSlots
from kvstore.tiers.remote.stats import RemoteStats

__all__ = ["BreakerOpen", "KnownKeys", "SlotReader", "Uploads", "breaker_open"]

T = TypeVar("T")
_log = logging.getLogger("kvstore.remote")
_KNOWN_KEYS = 1 << 16  # keys remembered as present in the bucket
_UPLOAD_ATTEMPTS = 3

# (key, the upload worker's buffer) -> the verified slot bytes in that buffer, or None
SlotReader = Callable[[bytes, AlignedBuffer], Awaitable[tuple[memoryview, SlotHeader] | None]]


class BreakerOpen(Unavailable):
    """No request was sent: the circuit breaker is open."""


def breaker_open(breaker: CircuitBreaker) -> bool:
    """Open and not yet due for a probe: answer without a request."""
    return breaker.state == OPEN and breaker.retry_in() > 0


class KnownKeys:
    """Keys known to be in the bucket (uploaded, found there, or fetched): the most
    recently seen ``_KNOWN_KEYS``."""

    def __init__(self) -> None:
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def remember(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > _KNOWN_KEYS:
            self._keys.popitem(last=False)


class Uploads:
    """The upload queue and its workers.  ``pending`` counts keys queued or being
    uploaded; ``on_idle`` is called whenever it drops (the tier's ``flush`` waits)."""

    def __init__(self, config: RemoteConfig, namespace_digest: bytes, client: ObjectClient,
                 breaker: CircuitBreaker, slots: RequestSlots, stats: RemoteStats,
                 known: KnownKeys, read_slot: SlotReader, on_idle: Callable[[], None]) -> None:
        self.config, self.namespace_digest = config, namespace_digest
        self.client, self.breaker, self._slots = client, breaker, slots
        self._stats, self._known = stats, known
        self._read_slot, self._on_idle = read_slot, on_idle
        self._limiter: anyio.CapacityLimiter | None = None
        self._send: MemoryObjectSendStream[tuple[bytes, int]] | None = None
        self._receive: MemoryObjectReceiveStream[tuple[bytes, int]] | None = None
        self.pending = 0  # queued + being uploaded
        self._scope: anyio.CancelScope | None = None
        self._stopped: anyio.Event | None = None

    @property
    def started(self) -> bool:
        return self._stopped is not None

    def queued(self) -> int:
        """Keys waiting in the queue (not counting those being uploaded)."""
        return self._receive.statistics().current_buffer_used if self._receive is not None else 0

    async def run(self, limiter: anyio.CapacityLimiter,
                  task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The workers, until :meth:`stop`; their request threads share ``limiter``."""
        self._limiter = limiter
        self._send, self._receive = anyio.create_memory_object_stream[tuple[bytes, int]](
            self.config.upload_queue_blocks)
        self._stopped = anyio.Event()
        try:
            with anyio.CancelScope() as self._scope:
                async with anyio.create_task_group() as tg:
                    for _ in range(self.config.upload_workers):
                        tg.start_soon(self._upload_worker, self._receive)
                    task_status.started()
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        """Stop the workers; what is still queued is dropped (counted)."""
        if self._stopped is None:
            return
        if self._scope is not None:
            self._scope.cancel()
        await self._stopped.wait()
        if self._receive is not None:
            while True:
                try:
                    self._receive.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
                self._stats.upload_dropped += 1
        self.pending = 0

    def enqueue(self, keys: Iterable[bytes]) -> None:
        """Queue locally durable blocks for upload (never waits; drops when full)."""
        if self._send is None:
            return
        for key in keys:
            if key in self._known:
                continue
            try:
                self._send.send_nowait((key, 0))
            except anyio.WouldBlock:
                self._stats.upload_dropped += 1
                continue
            self.pending += 1
            self._stats.uploads_queued += 1

    def _done_one(self) -> None:
        self.pending -= 1
        self._on_idle()

    async def _call(self, fn: Callable[[], T]) -> T:
        """One upload request on a worker thread, in an upload slot (waited for: uploads
        have no deadline), through the breaker: ``Unavailable`` if the breaker is open
        or the request got no answer.  Cancelled (at close), the request finishes alone
        on its thread and gives its slot back when it returns."""
        assert self._limiter is not None, "RemoteTier.run() was not started"
        slot = await self._slots.take(upload=True)
        if not self.breaker.allow():
            slot.drop()
            raise BreakerOpen(f"circuit breaker open: {self.breaker.last_error}")
        self._stats.requests += 1

        def in_slot() -> T:
            if not slot.claim():
                raise Unavailable("given up before it was sent")  # (result discarded)
            try:
                return fn()
            finally:
                slot.release()

        try:
            # abandon_on_cancel: close returns at once; the thread finishes alone.  The
            # limiter never makes it wait (every thread holds a slot first); it keeps
            # these threads off anyio's default one, which the store's I/O uses.
            result = await anyio.to_thread.run_sync(in_slot, limiter=self._limiter,
                                                    abandon_on_cancel=True)
        except Unavailable as e:
            self._stats.request_errors += 1
            self.breaker.failure(str(e))
            raise
        except RemoteError as e:  # credentials revoked, bucket deleted while open: stop asking
            self._stats.request_errors += 1
            self.breaker.failure(str(e))
            raise Unavailable(str(e)) from None
        except Refused:  # about this object: the cluster answered
            self._stats.refused_objects += 1
            self.breaker.success()
            raise
        except BaseException:
            # cancelled (close) or another error: a half-open probe must not stay
            # claimed forever
            self.breaker.release_probe()
            raise
        finally:
            slot.drop()  # gives it back only if its thread never started
        self.breaker.success()
        return result

    async def _upload_worker(self, receive: MemoryObjectReceiveStream[tuple[bytes, int]]
                             ) -> None:
        # One buffer per worker, reused for every block it uploads: an unsigned PUT sends
        # from it without a copy (a signed one from a copy with the tag), and the next
        # read-back waits for that PUT to return.  This relies on the S3 store being
        # done with the body when ``put`` returns, which obstore's S3Store is (its
        # in-memory store is not: it keeps the buffer).  A PUT abandoned by
        # cancellation ends the worker, so its buffer is never reused then.
        buffer = AlignedBuffer()
        async for key, attempts in receive:
            failed = False  # given up now, whatever attempts are left
            try:
                retry = await self._upload_one(key, buffer)
            except Unavailable:
                retry = True
            except Refused:  # the cluster will not take this object
                retry = failed = True
            except Exception:  # noqa: BLE001 - one block's failure ends its upload only
                # (raised here it ended every worker and cancelled the store's background
                # task group, and with it the caller's code inside ``open()``)
                _log.exception("kvstore: uploading block %s failed", key.hex())
                retry = failed = True
            if retry and not failed and attempts + 1 < _UPLOAD_ATTEMPTS \
                    and self._send is not None:
                # wait for the breaker, then go to the back of the queue
                await anyio.sleep(min(self.breaker.retry_in(), self.config.breaker_reset_s))
                try:
                    self._send.send_nowait((key, attempts + 1))
                    continue  # still pending
                except anyio.WouldBlock:
                    self._stats.upload_dropped += 1
            elif retry:
                self._stats.upload_failed += 1
            self._done_one()

    async def _upload_one(self, key: bytes, buffer: AlignedBuffer) -> bool:
        """Upload one block (read back into ``buffer``); True to retry later."""
        if breaker_open(self.breaker):
            return True
        slot = await self._read_slot(key, buffer)
        if slot is None:
            self._stats.upload_vanished += 1
            return False
        raw, header = slot
        name = objects.object_name(self.config.prefix, self.namespace_digest, key)

        def upload() -> int:
            """On a worker thread: the object's bytes (HMAC over MBs off the event loop)
            and a conditional PUT.  No HEAD first: ``If-None-Match: *`` already leaves
            an existing object alone, and a HEAD per block cost a round trip on every
            upload to save bandwidth only on the rare block another node uploaded
            first.  The object's length if written, 0 if it existed."""
            body = objects.encode(raw, header, namespace_digest=self.namespace_digest,
                                  hmac_key=self.config.hmac_key)
            return len(body) if self.client.put_if_absent(name, body) else 0

        written = await self._call(upload)
        if written:
            self._stats.uploaded_blocks += 1
            self._stats.uploaded_bytes += written
        else:
            self._stats.upload_existing += 1
        self._known.remember([key])
        return False

