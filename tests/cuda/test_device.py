"""kvstore/cuda/device.py: a waiter never hangs on a failed stream, and ``on_device``
always gives the thread its current device back.

The CUDA runtime cannot run here, so these use the stand-in at the ctypes boundary
(tests/cuda/standin.py) for what only a GPU does: run the stream callback with a status,
or never run it.  The eventfd, the event loop and the waiting logic are the real ones;
tests/gpu/test_gpu.py makes a real sticky error on a GPU.
"""

from __future__ import annotations

import os

import anyio
import pytest

from kvstore.cuda import CudaError
from kvstore.cuda.device import on_device, wait_stream
from tests.cuda.standin import ILLEGAL_ADDRESS, StandInLibrary

pytestmark = pytest.mark.anyio


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


async def test_wait_stream_returns_when_the_callback_reports_success(
        standin: StandInLibrary) -> None:
    before = _open_fds()
    await wait_stream(7, standin)  # type: ignore[arg-type]
    assert ("kvc_notify_eventfd", 0) in standin.calls
    assert _open_fds() <= before  # the eventfd was closed


async def test_wait_stream_raises_the_error_the_callback_reports(
        standin: StandInLibrary) -> None:
    # A sticky error (a kernel's illegal address): the stream callback still runs and is
    # passed the error; the waiter raises it instead of sleeping for ever.
    standin.stream_status = ILLEGAL_ADDRESS
    before = _open_fds()
    with anyio.fail_after(30), pytest.raises(CudaError) as e:
        await wait_stream(7, standin)  # type: ignore[arg-type]
    assert e.value.code == ILLEGAL_ADDRESS
    assert "stand-in CUDA error 700" in str(e.value)
    assert _open_fds() <= before


async def test_wait_stream_gives_up_when_the_stream_failed_and_no_callback_runs(
        standin: StandInLibrary) -> None:
    # A driver that never runs the callback (a lost GPU): cudaStreamQuery reports the
    # error and the waiter stops.  The fd stays open: the callback could still write.
    standin.run_callbacks = False
    standin.stream_status = ILLEGAL_ADDRESS
    with anyio.fail_after(30), pytest.raises(CudaError) as e:
        await wait_stream(7, standin, check_every=0.01)  # type: ignore[arg-type]
    assert e.value.code == ILLEGAL_ADDRESS
    (fd,) = standin.pending_fds
    os.fstat(fd)  # still open: no other file can get this number
    os.close(fd)
    assert ("kvc_stream_query", 0) in standin.calls


async def test_wait_stream_keeps_waiting_while_the_stream_runs(
        standin: StandInLibrary) -> None:
    # No callback yet and cudaStreamQuery says "not ready": the waiter keeps waiting
    # until the callback runs, then returns.
    standin.run_callbacks = False
    standin.stream_status = 600  # cudaErrorNotReady, as cudaStreamQuery says while busy
    queried = anyio.Event()
    query = standin._kvc_stream_query

    def query_then_signal(stream: int) -> int:
        queried.set()
        return query(stream)

    standin._kvc_stream_query = query_then_signal  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_stream, 7, standin, 0.01)
        with anyio.fail_after(30):
            await queried.wait()
        (fd,) = standin.pending_fds
        os.eventfd_write(fd, 1)  # the stream finished: its callback writes 1


async def test_cancelled_wait_waits_for_the_callback_before_closing_the_fd(
        standin: StandInLibrary) -> None:
    standin.run_callbacks = False
    standin.stream_status = 600
    async with anyio.create_task_group() as tg:
        done = anyio.Event()

        async def waiter() -> None:
            try:
                await wait_stream(7, standin, check_every=0.01)  # type: ignore[arg-type]
            finally:
                done.set()

        tg.start_soon(waiter)
        with anyio.fail_after(30):
            while not standin.pending_fds:
                await anyio.lowlevel.checkpoint()
        (fd,) = standin.pending_fds
        tg.cancel_scope.cancel()
        with anyio.CancelScope(shield=True):
            # cancelled, but still waiting (shielded): the fd is open
            for _ in range(20):
                await anyio.lowlevel.checkpoint()
            assert not done.is_set()
            os.fstat(fd)
            os.eventfd_write(fd, 1)  # the callback runs at last
            with anyio.fail_after(30):
                await done.wait()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed once the callback had written


def test_on_device_switches_and_restores(standin: StandInLibrary) -> None:
    with on_device(1, standin):  # type: ignore[arg-type]
        assert standin.current == 1
    assert standin.current == 0
    with pytest.raises(ValueError), on_device(1, standin):  # type: ignore[arg-type]
        raise ValueError("the block failed")
    assert standin.current == 0


def test_on_device_leaves_the_device_alone_when_none_or_already_current(
        standin: StandInLibrary) -> None:
    with on_device(None, standin):  # type: ignore[arg-type]
        pass
    with on_device(0, standin):  # type: ignore[arg-type]
        pass
    assert [n for n, _ in standin.calls] == ["kvc_get_device"]


def test_on_device_failing_restore_does_not_hide_the_blocks_error(
        standin: StandInLibrary) -> None:
    with pytest.raises(ValueError, match="the block"), on_device(1, standin):  # type: ignore[arg-type]
        standin.fail["kvc_set_device"] = ILLEGAL_ADDRESS  # the context died in the block
        raise ValueError("the block failed")
