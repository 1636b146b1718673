"""Stream-ordered copies between host memory and CUDA tensors through torch's own CUDA
API, for a process where kvstore's CUDA library is not usable (not built, the common
case right after ``pip install``): the same promises as :mod:`kvstore.cuda.copies`
with what torch offers.

* Every copy runs on a side stream of kvstore's (one per device, made once), after an
  event recorded on the current torch stream of the thread that enqueues it (so what
  the caller queued into or out of the tensor comes first); never on the caller's
  stream, and nothing waits for the caller's stream as a whole.
* Device -> host copies of a put land in page-locked memory (torch's pinned host
  allocator): a real DMA, not the synchronous bounce through pageable memory that
  ``tensor.to("cpu")`` is.
* Completion: torch has no host callback to hand an eventfd to (the library's
  ``cudaLaunchHostFunc``), so one worker thread waits on the copies' event
  (``cudaEventSynchronize``) while the event loop goes on; the engine's thread and its
  streams never wait.  A cancelled wait still lets the copies finish before the memory
  they use is let go.

Host -> device copies here come from the store's arena, which is page-locked only by
the library; from pageable memory the driver stages each copy itself (correct, slower).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterable, Sequence

import anyio
import numpy as np
import numpy.typing as npt
import torch

__all__ = ["TorchCopies", "to_host", "usable"]

_lock = threading.Lock()
_side_streams: dict[int, torch.cuda.Stream] = {}


def usable() -> bool:
    """Whether torch itself can drive a CUDA device here."""
    return torch.cuda.is_available()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        stream = _side_streams.get(index)
        if stream is None:
            stream = _side_streams[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
        return stream


def _after_caller(t: torch.Tensor, streams: dict[int, torch.cuda.Stream]) -> torch.cuda.Stream:
    """The side stream of ``t``'s device, made to wait (on the GPU) for what the caller's
    current stream queued so far (into ``t``, or reading it) the first time a batch of
    copies (``streams``: device -> stream) uses it."""
    stream = _side_stream(t.device)
    if stream.device_index not in streams:
        stream.wait_stream(torch.cuda.current_stream(t.device))
        streams[stream.device_index] = stream
    return stream


def _host_view(address: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory at ``address`` as a uint8 tensor (no copy)."""
    buffer = (ctypes.c_uint8 * nbytes).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.uint8)


async def _wait_for(streams: Iterable[torch.cuda.Stream]) -> None:
    """Until the work queued on ``streams`` so far has completed: an event recorded on
    each, waited for on one worker thread, not the event loop; a cancelled caller still
    waits (the copies read or write memory it is about to free)."""
    events = []
    for stream in streams:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        events.append(event)

    def wait_all() -> None:
        for event in events:
            event.synchronize()

    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(wait_all)


class TorchCopies:
    """The host -> device copies of one read chunk (``kvstore.io.slots.ToDevice``), awaited
    together by :meth:`wait` before the arena runs they read from are reused."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}   # device -> its side stream
        self._keep: list[object] = []

    def copy(self, out: torch.Tensor, address: int, nbytes: int, keep: object) -> None:
        """Enqueue ``nbytes`` from host ``address`` into contiguous CUDA ``out``."""
        src = _host_view(address, nbytes)
        with torch.cuda.stream(_after_caller(out, self._streams)):
            out.reshape(-1).view(torch.uint8).copy_(src, non_blocking=True)
        self._keep.extend((src, keep))

    def decode(self, out: torch.Tensor, codec: int, payload: npt.NDArray[np.uint8],
               dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
        """No GPU decoder without the library: the caller decodes on the host."""
        return False

    def __bool__(self) -> bool:
        return bool(self._streams)

    @property
    def sink(self) -> TorchCopies:
        return self

    async def wait(self) -> None:
        """Until every copy enqueued so far has completed; then their sources go."""
        if not self._streams:
            return
        streams, self._streams = list(self._streams.values()), {}
        try:
            await _wait_for(streams)
        finally:
            self._keep = []


async def to_host(values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``values`` with every CUDA tensor replaced by a copy of it in page-locked host
    memory (same dtype and shape), by copies on kvstore's side stream, awaited (module
    docstring); other values are returned as they are."""
    out: list[torch.Tensor] = []
    streams: dict[int, torch.cuda.Stream] = {}
    for v in values:
        if not (isinstance(v, torch.Tensor) and v.device.type == "cuda") or v.is_sparse \
                or v.layout != torch.strided or v.is_quantized:
            out.append(v)   # not ours, or host_bytes refuses it with the right error
            continue
        stream = _after_caller(v, streams)
        src = v.detach()
        with torch.cuda.stream(stream):
            host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            host.copy_(src, non_blocking=True)   # a strided source is gathered by the copy
        out.append(host)
    await _wait_for(streams.values())
    return out
