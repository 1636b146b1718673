"""Calls from other threads onto the event loop of a blocking facade
(:mod:`kvstore.blocking`): in the order they were handed over, and each one either runs
or reports itself cancelled, never both.

* A call's :class:`concurrent.futures.Future` goes from pending to running in the step
  the loop takes the call (``set_running_or_notify_cancel``, the state machine
  ``concurrent.futures`` executors use): a ``cancel()`` that returned True means the
  call never started and never will; once it started, ``cancel()`` returns False, the
  call runs to its end and its future gets its outcome.  (anyio's portal ran a call
  whose future had been cancelled while it waited for the loop: its cancel scope only
  acted at the call's first await, after the call had taken effect.)
* Order: a call handed over ``at_once`` (``submit``) is queued for a thread of this
  module's, which hands the queue to the loop in order and may wait for a busy loop
  meanwhile; the caller returns at once.  A call a thread waits for anyway goes to the
  loop directly when nothing is queued, and otherwise joins the queue behind what is
  there: a thread's ``submit(put(K))`` then ``delete(K)`` reach the loop in that order.
  The loop starts tasks in the order it is handed them (asyncio's ready queue, the
  facade's loop), and each call registers what orders it against others
  (``kvstore/core/key_order.py``) in its first step.
"""

from __future__ import annotations

import inspect
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from contextlib import suppress
from typing import Any

from anyio.from_thread import BlockingPortal

__all__ = ["Handoff"]

Call = Callable[[], Any]  # returns the outcome or an awaitable of it


class Handoff:
    """Hands calls to ``portal``'s loop (see the module docstring)."""

    def __init__(self, portal: BlockingPortal) -> None:
        self._portal = portal
        self._lock = threading.Lock()  # guards _queued, the queue's order and _starter
        self._queued = 0  # queued calls not yet taken into the loop's hands
        self._starts: queue.SimpleQueue[tuple[Call, Future[Any]] | None] = queue.SimpleQueue()
        self._starter: threading.Thread | None = None

    def hand_over(self, call: Call, future: Future[Any], *, at_once: bool) -> None:
        """Run ``call`` on the loop, its outcome into ``future`` (pending, not yet
        handed over).  ``at_once``: return without waiting for the loop; otherwise this
        may wait until the loop takes the hand-over (not for the call to end)."""
        with self._lock:
            queued = at_once or self._queued > 0
            if queued:
                self._queued += 1
                self._starts.put((call, future))
                if self._starter is None:
                    self._starter = threading.Thread(
                        target=self._start_queued, daemon=True, name="kvstore-blocking-submit")
                    self._starter.start()
        if not queued:
            self._portal.start_task_soon(_take, call, future)

    def stop(self) -> None:
        """End the hand-over thread, once everything queued before was handed over (call
        it when no call can be handed over any more); idempotent."""
        with self._lock:
            starter, self._starter = self._starter, None
        if starter is not None:
            self._starts.put(None)
            starter.join()

    def _start_queued(self) -> None:
        """The hand-over thread: queued calls to the loop, in order."""
        while (item := self._starts.get()) is not None:
            call, future = item
            try:
                if future.cancelled():  # never runs: tell its waiters now
                    future.set_running_or_notify_cancel()
                else:
                    self._portal.start_task_soon(_take, call, future)
            except BaseException as e:  # noqa: BLE001 - the caller's future carries it
                with suppress(InvalidStateError):  # (cancelled meanwhile: nobody wants it)
                    future.set_exception(e)
            finally:
                with self._lock:
                    self._queued -= 1


async def _take(call: Call, future: Future[Any]) -> None:
    """On the loop: the call starts now, unless its future was cancelled first (then it
    never runs).  From this step on ``cancel()`` returns False."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        value = call()
        if inspect.isawaitable(value):
            value = await value
    except BaseException as e:
        future.set_exception(e)
        if not isinstance(e, Exception):
            raise
    else:
        future.set_result(value)
