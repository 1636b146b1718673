"""A blocking facade for engines whose worker code is synchronous.

``open_blocking()`` runs the async store on an event loop in a background thread (an
anyio blocking portal) and forwards each call to it; calls from any number of threads
are safe and are served concurrently by that loop.

The same API as :class:`~kvstore.store.Store`: every public method has a synchronous
twin of the same name with the same parameters (``tests/test_blocking.py`` compares the
signatures), and the same properties.  The differences are the ones blocking asks for:

* ``aclose()`` is ``close()`` (and ``with open_blocking(...) as store:``);
* ``prefetch(keys)`` returns a :class:`BlockingPrefetch` instead of an awaitable
  :class:`~kvstore.tiers.memory.prefetch.Prefetch`: ``handle.wait()`` blocks until it ended and
  returns the blocks that arrived, ``handle.cancel()`` stops it.

After ``close()`` every call raises :class:`~kvstore.errors.StoreClosedError`, also one
racing the close from another thread (``close()`` waits for calls already inside);
properties still answer, as ``Store``'s do.

Order and cancellation (:mod:`kvstore._handoff`): calls reach the loop in the order they
were made (one thread's ``submit(put(K))`` and then ``delete(K)``, blocking or
submitted, take effect in that order).  A call whose future's ``cancel()`` returned
True never runs; once the loop has taken a call, ``cancel()`` returns False and the
call runs to its end.  A blocking call interrupted while it waits (``KeyboardInterrupt``)
is cancelled if the loop had not taken it yet, and otherwise raises once it has ended:
the call took no effect, or all of it.

A script that forgets ``close()`` must still exit.  anyio's ``start_blocking_portal``
runs its loop on a non-daemon executor thread, which the interpreter joins *before*
``atexit`` handlers run, so an unclosed store hung the exit forever.  The loop here runs
on a daemon thread instead, and an ``atexit`` handler (daemon threads still run then)
closes every store still open, as ``close()`` would: acknowledged puts are durable
already; closing waits for calls in flight and releases the lock.

Fork: a child of ``fork()`` inherits the ``BlockingStore`` object but not the thread
that runs its loop, so a call forwarded there would wait forever.  In the child every
call raises :class:`~kvstore.errors.StoreForkedError` at once (open a store of your own
there, on another path), ``close()`` returns without releasing anything, and the exit
handler leaves the parent's stores alone: the lock and the files stay the parent's.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, wait
from contextlib import suppress
from functools import partial
from typing import Any, TypeVar, cast

import anyio
import torch
from anyio.from_thread import BlockingPortal

from kvstore._handoff import Handoff

# imported at run time (store.py imports them all anyway), so that the annotations
# resolve for typing.get_type_hints and the API docs
from kvstore.codecs.pipeline import CodecSpec
from kvstore.core.scrub import DEFAULT_SCRUB_BYTES_PER_S, ProgressFn, ScrubReport
from kvstore.errors import StoreClosedError, StoreForkedError
from kvstore.events import BlockingEvents
from kvstore.keys import Namespace
from kvstore.options import StoreOptions
from kvstore.store import PutResult, Store, StoreStats
from kvstore.store import open as open_async
from kvstore.tiers.memory.prefetch import Prefetch
from kvstore.tiers.remote.config import RemoteConfig

T = TypeVar("T")


class BlockingStore(BlockingEvents):
    """Synchronous twin of :class:`~kvstore.store.Store`: the same methods with the same
    parameters and semantics (see the module doc for ``close`` and ``prefetch``)."""

    def __init__(self, path: str | os.PathLike[str], options: StoreOptions | None = None,
                 **fields: Any) -> None:
        self._pid = os.getpid()  # the process whose thread runs the loop
        # guards _closed, _closing, _close_steps, _calls and _submitted
        self._cond = threading.Condition()
        self._closed = False
        self._closing = False  # a thread is in close() now
        self._close_steps = 0  # of close()'s steps, those done (an interrupted close resumes)
        self._calls = 0  # calls admitted and not done (their futures)
        self._submitted: set[Future[Any]] = set()  # submit()'s, until done
        self._closed_done = threading.Event()
        self._portal, self._thread = _start_portal()
        self._handoff = Handoff(self._portal)  # calls onto the loop, in order
        try:
            self._store_cm = self._portal.wrap_async_context_manager(open_async(path, options, **fields))
            self._store: Store = self._store_cm.__enter__()
        except BaseException:
            self._stop_portal()
            raise
        _OPEN.add(self)

    def __enter__(self) -> BlockingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the store, as ``Store.aclose``: new calls raise ``StoreClosedError``,
        calls in flight are waited for (:meth:`submit`'s first, before the store closes:
        a submitted save still waiting for its data is finished, not refused), then the
        files and the lock are released and the loop thread ends.  Idempotent; a second
        caller returns once the store is closed.  A close interrupted (``KeyboardInterrupt``
        while it waits) leaves the store closed to new calls and is finished by the next
        ``close()`` or at interpreter exit.  In a forked child it returns at once: the
        store is the parent's to close."""
        if os.getpid() != self._pid:
            return
        with self._cond:
            self._closed = True
            if self._closing:  # another thread closes: wait for it (or take over)
                self._cond.wait_for(lambda: not self._closing)
            if self._closed_done.is_set():
                return
            self._closing = True
        try:
            self._close_steps_left()
        finally:
            with self._cond:
                self._closing = False
                self._cond.notify_all()

    def _close_steps_left(self) -> None:
        """close()'s steps, each done once (a close interrupted in one resumes there)."""
        steps: list[Callable[[], object]] = [
            # submitted calls first, while the store is open
            lambda: wait(self._submitted_now()),
            lambda: self._store_cm.__exit__(None, None, None),
            # calls let in before the close: out of the portal before it stops
            lambda: self._wait_calls(),
            self._handoff.stop,
            lambda: self._portal.call(self._portal.stop),
            self._thread.join,
        ]
        for step in steps[self._close_steps:]:
            step()
            self._close_steps += 1
        _OPEN.discard(self)
        self._closed_done.set()

    def _submitted_now(self) -> list[Future[Any]]:
        with self._cond:
            return list(self._submitted)

    def _wait_calls(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._calls == 0)

    def _stop_portal(self) -> None:
        self._portal.call(self._portal.stop)
        self._thread.join()

    # ------------------------------------------------------------------ forwarding

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise StoreForkedError(
                f"store {self._store.path} was opened (open_blocking) by process "
                f"{self._pid}; this is a forked child ({os.getpid()}), which has no thread "
                "to run the store on and must not touch the parent's lock or files: open a "
                "store of its own in the child (on another path)")

    def _admit(self, *, submitted: bool = False) -> Future[Any]:
        """The future of one call: refused in a forked child and once closed; counted
        (``close()`` waits for it) until the future is done."""
        self._check_process()
        future: Future[Any] = Future()
        with self._cond:
            if self._closed:
                raise StoreClosedError(f"store {self._store.path} is closed")
            self._calls += 1
            if submitted:
                self._submitted.add(future)
        future.add_done_callback(self._call_done)
        return future

    def _call_done(self, future: Future[Any]) -> None:
        with self._cond:
            self._submitted.discard(future)
            self._calls -= 1
            if not self._calls:
                self._cond.notify_all()

    def _run(self, call: Callable[[], Awaitable[T]]) -> T:
        """One call, waited for.  Interrupted while it waits (``KeyboardInterrupt`` in
        this thread), the call is cancelled if the loop has not taken it yet: it never
        runs.  If it had started, the exception is raised once the call has ended (a
        second interrupt meanwhile is raised at once): either way, when the exception
        reaches the caller, the call took no effect or has taken all of it."""
        if threading.current_thread() is self._thread:
            # it would wait for the loop it blocks (anyio's portal refused this too)
            raise RuntimeError("a BlockingStore call cannot be made from its own event "
                               "loop: await the Store's method there (BlockingStore.store)")
        future = self._admit()
        try:
            self._handoff.hand_over(call, future, at_once=False)
            return cast(T, future.result())
        except BaseException:  # the call's own error, or an interrupt of this wait
            if not future.cancel():  # it started (or ended): let it end first
                wait([future])
            raise

    def _run_sync(self, call: Callable[[], T]) -> T:
        """A synchronous ``Store`` method: run on the loop thread too, which owns the
        store's state (and its anyio primitives).  Wrapped in a coroutine: a result that
        is awaitable itself (a ``Prefetch`` handle) is returned, not awaited."""
        async def on_loop() -> T:
            return call()

        return self._run(on_loop)

    def _read(self, get: Callable[[], T]) -> T:
        """A property: read on the loop while open, directly once closed (no loop left
        to race with), so that properties answer after close as ``Store``'s do."""
        self._check_process()
        if not self._closed_done.is_set():
            try:
                return self._run_sync(get)
            except StoreForkedError:
                raise
            except StoreClosedError:
                self._closed_done.wait()  # closing now: read once it is done
        return get()

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` on the store's loop and block for its result: the way
        in for code that composes several ``Store`` calls into one (an engine
        connector's lookup that also starts a prefetch).  ``fn`` gets the async
        :class:`Store` through :attr:`store`.  Admitted like every call: refused once
        closed and in a forked child; ``close()`` waits for it."""
        return self._run(partial(fn, *args))

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> Future[T]:
        """Start ``fn(*args)`` on the store's loop and return at once with a
        :class:`concurrent.futures.Future` of its result (a save the caller does not
        wait for).  At once also while the loop is busy: the call is handed to the loop
        by a thread of the store's, in the order submitted (the portal's own hand-over
        waits until the loop takes the call, which held an engine's step); a blocking
        call made after it by the same thread reaches the loop after it.  Cancelling:
        ``cancel()`` returns True only while the loop has not taken the call, which then
        never runs; once it started, ``cancel()`` returns False and the call runs to its
        end (``kvstore/_handoff.py``).  Admitted like every call; ``close()`` waits for it
        to finish before it closes the store."""
        future = self._admit(submitted=True)
        self._handoff.hand_over(partial(fn, *args), future, at_once=True)
        return future

    @property
    def store(self) -> Store:
        """The async :class:`Store` behind this facade (its calls belong on the loop
        thread: ``BlockingStore``'s own methods are the way in from other threads)."""
        self._check_process()
        return self._store

    # ------------------------------------------------------------------ Store's API

    def put_many(self, keys: Sequence[bytes], values: Sequence[torch.Tensor], *,
                 parents: Sequence[bytes | None] | None = None,
                 codec: CodecSpec | None = None, background: bool = False,
                 tags: Sequence[bytes | None] | None = None) -> PutResult:
        """:meth:`Store.put_many <kvstore.store.Store.put_many>`, blocking."""
        return self._run(lambda: self._store.put_many(
            keys, values, parents=parents, codec=codec, background=background, tags=tags))

    def get_many(self, keys: Sequence[bytes], out: Sequence[torch.Tensor | None] | None = None
                 ) -> list[torch.Tensor | None]:
        """:meth:`Store.get_many <kvstore.store.Store.get_many>`, blocking."""
        return self._run(lambda: self._store.get_many(keys, out))

    def prefetch(self, keys: Sequence[bytes]) -> BlockingPrefetch:
        """:meth:`Store.prefetch <kvstore.store.Store.prefetch>`: starts bringing the
        blocks into the memory tier and returns at once, with a :class:`BlockingPrefetch`
        (``wait()`` blocks until it ended; ``cancel()`` stops it)."""
        return BlockingPrefetch(self, self._run_sync(lambda: self._store.prefetch(keys)))

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """:meth:`Store.contains_many <kvstore.store.Store.contains_many>`, blocking."""
        return self._run(lambda: self._store.contains_many(keys))

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """:meth:`Store.match_prefix <kvstore.store.Store.match_prefix>`, blocking."""
        return self._run(lambda: self._store.match_prefix(keys))

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """:meth:`Store.delete_many <kvstore.store.Store.delete_many>`, blocking."""
        return self._run(lambda: self._store.delete_many(keys))

    def pin(self, keys: Sequence[bytes]) -> None:
        """:meth:`Store.pin <kvstore.store.Store.pin>`, blocking."""
        self._run(lambda: self._store.pin(keys))

    def unpin(self, keys: Sequence[bytes]) -> None:
        """:meth:`Store.unpin <kvstore.store.Store.unpin>`, blocking."""
        self._run(lambda: self._store.unpin(keys))

    def put(self, key: bytes, value: torch.Tensor, *, parent: bytes | None = None,
            tag: bytes | None = None) -> bool:
        """:meth:`Store.put <kvstore.store.Store.put>`, blocking."""
        return self._run(lambda: self._store.put(key, value, parent=parent, tag=tag))

    def get(self, key: bytes, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """:meth:`Store.get <kvstore.store.Store.get>`, blocking."""
        return self._run(lambda: self._store.get(key, out))

    def contains(self, key: bytes) -> bool:
        """:meth:`Store.contains <kvstore.store.Store.contains>`, blocking."""
        return self._run(lambda: self._store.contains(key))

    def delete(self, key: bytes) -> bool:
        """:meth:`Store.delete <kvstore.store.Store.delete>`, blocking."""
        return self._run(lambda: self._store.delete(key))

    def scrub(self, *, rate_bytes_per_s: float | None = DEFAULT_SCRUB_BYTES_PER_S,
              progress: ProgressFn | None = None, restart: bool = False) -> ScrubReport:
        """:meth:`Store.scrub <kvstore.store.Store.scrub>`, blocking (``progress`` is
        called on the store's loop thread)."""
        return self._run(lambda: self._store.scrub(
            rate_bytes_per_s=rate_bytes_per_s, progress=progress, restart=restart))

    def attach_remote(self, config: RemoteConfig, namespace: Namespace) -> None:
        """:meth:`Store.attach_remote <kvstore.store.Store.attach_remote>`, blocking."""
        self._run(lambda: self._store.attach_remote(config, namespace))

    def stats(self) -> StoreStats:
        """:meth:`Store.stats <kvstore.store.Store.stats>`."""
        return self._run_sync(self._store.stats)

    @property
    def read_only(self) -> bool:
        """:attr:`Store.read_only <kvstore.store.Store.read_only>`."""
        return self._read(lambda: self._store.read_only)

    @property
    def used_bytes(self) -> int:
        """:attr:`Store.used_bytes <kvstore.store.Store.used_bytes>`."""
        return self._read(lambda: self._store.used_bytes)

    @property
    def capacity_bytes(self) -> int:
        """:attr:`Store.capacity_bytes <kvstore.store.Store.capacity_bytes>`."""
        return self._read(lambda: self._store.capacity_bytes)


class BlockingPrefetch:
    """What :meth:`BlockingStore.prefetch` returns: the blocking face of
    :class:`~kvstore.tiers.memory.prefetch.Prefetch` (same counters; ``wait()`` instead of ``await``).

    Once the prefetch has ended, ``wait()`` answers without the store, also after the
    store was closed (closing cancels and ends every prefetch in flight)."""

    def __init__(self, owner: BlockingStore, handle: Prefetch) -> None:
        self._owner = owner
        self._handle = handle

    @property
    def requested(self) -> int:
        """Keys asked for."""
        return self._handle.requested

    @property
    def scheduled(self) -> int:
        """Of which read from disk (stored, not yet in memory)."""
        return self._handle.scheduled

    @property
    def arrived(self) -> int:
        """Of which now in memory because of this prefetch."""
        return self._handle.arrived

    @property
    def cancelled(self) -> bool:
        return self._handle.cancelled

    @property
    def error(self) -> BaseException | None:
        return self._handle.error

    @property
    def done(self) -> bool:
        return self._handle.done

    def wait(self) -> int:
        """Block until it ended (finished, cancelled or failed); the blocks that arrived.
        A failure (an I/O error, the store closing) is raised here."""
        if not self._handle.done:
            try:
                return self._owner._run(self._handle.wait)
            except StoreForkedError:
                raise
            except StoreClosedError:
                self._owner._closed_done.wait()  # closing ends it: answer from the handle
        if self._handle.error is not None:
            raise self._handle.error
        return self._handle.arrived

    def cancel(self) -> None:
        """Stop reading; idempotent.  Blocks already in memory stay there."""
        try:
            self._owner._run_sync(self._handle.cancel)
        except StoreForkedError:
            raise
        except StoreClosedError:
            pass  # closed or closing: that cancels every prefetch still running

    def __repr__(self) -> str:
        return repr(self._handle).replace("<Prefetch", "<BlockingPrefetch", 1)


def _start_portal() -> tuple[BlockingPortal, threading.Thread]:
    """A blocking portal whose event loop runs on a daemon thread (see the module doc)."""
    handoff: queue.Queue[BlockingPortal | BaseException] = queue.Queue(maxsize=1)

    async def serve() -> None:
        async with BlockingPortal() as portal:
            handoff.put(portal)
            await portal.sleep_until_stopped()

    def run() -> None:
        try:
            anyio.run(serve)
        except BaseException as e:  # noqa: BLE001 - handed to the opening thread
            if handoff.empty():
                handoff.put(e)

    thread = threading.Thread(target=run, name="kvstore-blocking-portal", daemon=True)
    thread.start()
    got = handoff.get()
    if isinstance(got, BaseException):
        raise got
    return got, thread


# Stores opened by open_blocking() in this process and not closed yet, closed at
# interpreter exit (held strongly: the portal thread keeps the store open anyway until
# it is closed).
_OPEN: set[BlockingStore] = set()


def _after_fork_in_child() -> None:
    """A forked child: the parent's stores are not this process's to close at exit."""
    _OPEN.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _close_at_exit() -> None:
    pid = os.getpid()
    for store in list(_OPEN):
        if store._pid != pid:  # another process's (fork resets _OPEN; this is a backstop)
            continue
        with suppress(Exception):  # exiting anyway; acknowledged puts are durable
            store.close()


def open_blocking(path: str | os.PathLike[str], options: StoreOptions | None = None,
                  **fields: Any) -> BlockingStore:
    """Open a store for synchronous code; same options as :func:`kvstore.open`: the
    fields of :class:`~kvstore.options.StoreOptions` as keywords, or one
    ``StoreOptions`` (keywords beside it replace its fields).  Use as
    ``with open_blocking(path) as store:`` or call ``close()``; a store still open when
    the interpreter exits is closed then."""
    return BlockingStore(path, options, **fields)
