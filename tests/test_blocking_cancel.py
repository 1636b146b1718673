"""Cancellation points and order of the blocking facade (kvstore/blocking.py,
kvstore/_handoff.py): a call whose future says cancelled never takes effect, a call that
started says so (``cancel()`` returns False), and one thread's calls reach the loop in
the order it made them.

The loop is held by a call that blocks its thread until the test lets it go; a thread
that must be interrupted while it waits is signalled once it is seen waiting inside the
facade (its stack, not a clock).  Real stores in tmp_path, real threads, no sleeps.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import anyio
import pytest
import torch

import kvstore
from kvstore import blocking
from tests.conformance import NS, SMALL_EXTENT, keys, make_tensor

DEADLINE = 60.0


def block(i: int) -> torch.Tensor:
    return make_tensor(torch.float16, (2, 4, 64), seed=i)


def open_store(path: Path) -> kvstore.BlockingStore:
    return kvstore.open_blocking(path, namespace=NS, extent_bytes=SMALL_EXTENT)


@contextmanager
def held_loop(store: kvstore.BlockingStore) -> Iterator[threading.Event]:
    """The store's loop thread blocked in a call until the yielded event is set (or the
    block ends): nothing else runs on the loop meanwhile."""
    held, release = threading.Event(), threading.Event()

    async def hold() -> None:
        held.set()
        release.wait(timeout=DEADLINE)  # (the timeout only keeps a regression from hanging)

    holder = store.submit(hold)
    assert held.wait(timeout=DEADLINE)
    try:
        yield release
    finally:
        release.set()
        holder.result(timeout=DEADLINE)


def waiting_in(thread: threading.Thread, names: tuple[str, ...], file: str | None) -> bool:
    """Whether ``thread`` is blocked in a ``threading`` wait inside one of the functions
    ``names`` (of ``file``, or of any file)."""
    frame: FrameType | None = sys._current_frames().get(thread.ident or 0)
    if frame is None or frame.f_code.co_name != "wait" \
            or not frame.f_code.co_filename.endswith("threading.py"):
        return False
    while frame is not None:
        if frame.f_code.co_name in names and file in (None, frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False


def waiting_in_facade(thread: threading.Thread, names: tuple[str, ...]) -> bool:
    return waiting_in(thread, names, blocking.__file__)


def until_handing_over() -> None:
    """Until the facade's submit thread has taken a call and waits for the held loop to
    take it from there (anyio's ``start_task_soon``)."""
    end = time.monotonic() + DEADLINE
    while not any(t.name == "kvstore-blocking-submit"
                  and waiting_in(t, ("start_task_soon",), None)
                  for t in threading.enumerate()):
        assert time.monotonic() < end, "the submit thread never took the call"
        time.sleep(0)  # yields the GIL to the submit thread; not a timed wait


def when_waiting(thread: threading.Thread, names: tuple[str, ...],
                 then: Callable[[], None], ready: Callable[[], bool] = lambda: True
                 ) -> threading.Thread:
    """A helper thread that runs ``then`` once ``thread`` waits inside the facade (and
    ``ready()`` holds)."""
    def watch() -> None:
        end = time.monotonic() + DEADLINE
        while not (ready() and waiting_in_facade(thread, names)):
            assert time.monotonic() < end, "the thread never waited in the facade"
            time.sleep(0)  # yields the GIL to the watched thread; not a timed wait
        then()

    helper = threading.Thread(target=watch, daemon=True)
    helper.start()
    return helper


@contextmanager
def interrupt_main_when_waiting(names: tuple[str, ...], before: Callable[[], None] = lambda: None,
                                ready: Callable[[], bool] = lambda: True) -> Iterator[None]:
    """One ``KeyboardInterrupt`` in the main thread once it waits inside the facade and
    ``ready()`` holds (what a Ctrl-C does), through SIGUSR1 so that pytest's own SIGINT
    handling stays out of it; ``before`` runs in the handler, just before the raise.

    The signal is sent again until the handler ran: one that lands after the thread's
    last check for signals but before its lock acquire blocks is only handled once the
    acquire returns (a lost wake-up; the handler, not a clock, ends the resending)."""
    raised = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        if raised.is_set():  # a resent one, after the first was raised
            return
        raised.set()
        before()
        raise KeyboardInterrupt

    main = threading.main_thread()

    def interrupt() -> None:
        while not raised.is_set():
            signal.pthread_kill(main.ident or 0, signal.SIGUSR1)
            raised.wait(timeout=0.05)

    previous = signal.signal(signal.SIGUSR1, handler)
    helper = when_waiting(main, names, interrupt, ready)
    try:
        yield
    finally:
        raised.set()  # (stops the resending if the test failed before the raise)
        helper.join(DEADLINE)
        signal.signal(signal.SIGUSR1, previous)


# ---------------------------------------------------------------- submit's futures


def test_submitted_calls_cancelled_before_the_loop_took_them_never_run(tmp_path: Path) -> None:
    """Loop held, three deletes submitted and all three cancelled (``cancel()`` True):
    none of them starts, none deletes its key.  Before, the first one (already on its
    way to the held loop) still started, and could delete its key before its first
    await noticed the cancellation.  A wait that timed out first changes nothing."""
    ks = keys(3, 800)
    entered: list[int] = []
    with open_store(tmp_path) as store:
        store.put_many(ks, [block(i) for i in range(3)])

        async def delete(i: int) -> bool:
            entered.append(i)
            return await store.store.delete(ks[i])

        with held_loop(store):
            futures = [store.submit(delete, i) for i in range(3)]
            until_handing_over()  # the first is on its way to the loop
            with pytest.raises(FutureTimeout):
                futures[0].result(timeout=0)
            assert [f.cancel() for f in futures] == [True, True, True]
        assert all(f.cancelled() for f in futures)
    assert entered == []
    with open_store(tmp_path) as store:  # (closing waited for anything left running)
        assert store.contains_many(ks) == [True, True, True]


def test_a_started_call_cannot_be_cancelled_and_says_it_ran(tmp_path: Path) -> None:
    """Once the loop took a submitted call, ``cancel()`` returns False and the call runs
    to its end with its outcome in the future.  Before, ``cancel()`` returned True while
    the call could still have taken effect up to its next await."""
    k, = keys(1, 810)
    running, release = threading.Event(), threading.Event()
    with open_store(tmp_path) as store:
        store.put(k, block(0))

        async def delete_when_let_go() -> bool:
            running.set()
            await anyio.to_thread.run_sync(lambda: release.wait(timeout=DEADLINE))
            return await store.store.delete(k)

        future = store.submit(delete_when_let_go)
        assert running.wait(timeout=DEADLINE)
        assert future.running() and not future.cancel()
        release.set()
        assert future.result(timeout=DEADLINE) is True
        assert not future.cancelled() and not store.contains(k)


def test_calls_cancelled_from_many_threads_never_start(tmp_path: Path) -> None:
    """Eight threads each submit two puts of their own keys while the loop is held and
    cancel them: every ``cancel()`` returns True (none was taken), none starts, nothing
    is stored; a put submitted after them runs as usual."""
    ks = keys(17, 820)
    entered: list[int] = []
    with open_store(tmp_path) as store:
        async def put(i: int) -> kvstore.PutResult:
            entered.append(i)
            return await store.store.put_many([ks[i]], [block(i)])

        futures: list[list[Future[kvstore.PutResult]]] = [[] for _ in range(8)]
        said: list[bool] = []

        def run_threads(target: Callable[[int], None]) -> None:
            threads = [threading.Thread(target=target, args=(t,)) for t in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(DEADLINE)

        with held_loop(store):
            run_threads(lambda t: futures[t].extend(store.submit(put, i)
                                                    for i in (2 * t, 2 * t + 1)))
            until_handing_over()  # one of them is on its way to the loop
            run_threads(lambda t: said.extend(f.cancel() for f in futures[t]))
            last = store.submit(put, 16)
        assert said == [True] * 16
        assert last.result(timeout=DEADLINE).written == 1
    assert entered == [16]
    with open_store(tmp_path) as store:
        assert store.contains_many(ks) == [False] * 16 + [True]


# ---------------------------------------------------------------- order


def test_a_blocking_call_after_a_submit_of_the_same_thread_reaches_the_loop_after_it(
        tmp_path: Path) -> None:
    """``submit(put(K))`` then ``delete(K)`` from one thread, while the submit thread is
    still handing an earlier call to the held loop: the delete must come after the put
    (it returns True and K ends absent).  Before, the blocking call went to the loop
    directly, ahead of the put still queued, found nothing, and the put stored K."""
    k, = keys(1, 840)
    with open_store(tmp_path) as store:
        with held_loop(store) as release:
            async def nothing() -> None:
                return None

            store.submit(nothing)  # the submit thread waits to hand it to the held loop
            put = store.submit(store.store.put_many, [k], [block(0)])  # queued behind
            me = threading.current_thread()
            helper = when_waiting(me, ("_run",), release.set)
            deleted = store.delete(k)
            helper.join(DEADLINE)
        assert put.result(timeout=DEADLINE).written == 1
        assert deleted is True and not store.contains(k)


# ---------------------------------------------------------------- interrupts


def test_a_blocking_call_interrupted_before_the_loop_took_it_never_runs(tmp_path: Path) -> None:
    """Ctrl-C while a blocking delete waits for the held loop: the delete never runs.
    Before, the KeyboardInterrupt reached the caller and the delete ran afterwards."""
    k, = keys(1, 850)
    with open_store(tmp_path) as store:
        store.put(k, block(0))
        with held_loop(store), interrupt_main_when_waiting(("_run",)):
            with pytest.raises(KeyboardInterrupt):
                store.delete(k)
    with open_store(tmp_path) as store:  # (closing waited for anything left running)
        assert store.contains(k)


def test_a_blocking_call_interrupted_after_it_started_raises_once_it_ended(
        tmp_path: Path) -> None:
    """Ctrl-C while a started blocking call runs: the exception reaches the caller only
    once the call has ended, so the caller knows it took all of its effect.  Before, it
    came at once while the call went on behind the caller's back."""
    k, = keys(1, 860)
    started, release, ended = threading.Event(), threading.Event(), threading.Event()
    with open_store(tmp_path) as store:
        store.put(k, block(0))

        async def delete_when_let_go() -> bool:
            started.set()
            await anyio.to_thread.run_sync(lambda: release.wait(timeout=DEADLINE))
            try:
                return await store.store.delete(k)
            finally:
                ended.set()

        with interrupt_main_when_waiting(("_run",), before=release.set, ready=started.is_set):
            with pytest.raises(KeyboardInterrupt):
                store.call(delete_when_let_go)
            assert ended.is_set()
        assert not store.contains(k)


def test_an_interrupted_close_leaves_the_store_closed_to_calls_and_closes_later(
        tmp_path: Path) -> None:
    """Ctrl-C while ``close()`` waits for a submitted put queued behind the held loop:
    new calls are refused, the put still runs, and the next ``close()`` finishes the
    close (before, it waited for ever for the first one).  The put is stored."""
    k, = keys(1, 870)
    store = open_store(tmp_path)
    with held_loop(store):
        put = store.submit(store.store.put_many, [k], [block(0)])
        with interrupt_main_when_waiting(("close",)):
            with pytest.raises(KeyboardInterrupt):
                store.close()
        with pytest.raises(kvstore.StoreClosedError):
            store.contains(k)
    closer = threading.Thread(target=store.close, daemon=True)
    closer.start()
    closer.join(DEADLINE)
    assert not closer.is_alive(), "the second close() hung"
    assert put.result(timeout=0).written == 1
    with open_store(tmp_path) as again:
        assert again.contains(k)


def test_a_blocking_call_from_the_stores_own_loop_is_refused(tmp_path: Path) -> None:
    """Made from the loop thread, a blocking call would wait for the loop it blocks:
    it raises instead, also while submitted calls are queued."""
    k, = keys(1, 880)
    with open_store(tmp_path) as store:
        async def nested() -> bool:
            return store.contains(k)

        with held_loop(store):
            future = store.submit(nested)
            store.submit(store.store.contains, k)  # queued behind it
        with pytest.raises(RuntimeError, match="own event loop"):
            future.result(timeout=DEADLINE)
