"""Copies between the store's host memory and tensors on a device, as the I/O needs
them: a read chunk's copies into CUDA outputs, a put's device values brought to host
memory.

io/ stays below the optional GPU path: it names what it needs here (:class:`DeviceCopier`)
and the store hands it an implementation (``kvstore._cuda_path.CUDA_COPIER``, which
loads :mod:`kvstore.cuda` on first use) through ``StoreParts`` to
:class:`kvstore.io.transfers.Transfers` and the memory tier.  :data:`HOST_COPIER` is what
a part built without one uses: no device library, torch copies where it can.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvstore.io.slots import ToDevice

__all__ = ["HOST_COPIER", "DeviceCopier", "DeviceCopies", "HostCopier", "HostCopies",
           "on_device"]


class DeviceCopies(Protocol):
    """One read chunk's copies into device outputs: ``sink`` enqueues them (None: the
    chunk's verification copies on the host); :meth:`wait` returns once every enqueued
    copy completed, after which the arena runs they read may be reused.  False when
    nothing was ever enqueued (nothing to wait for on cancellation)."""

    @property
    def sink(self) -> ToDevice | None: ...

    def __bool__(self) -> bool: ...

    async def wait(self) -> None: ...


class DeviceCopier(Protocol):
    """What the store's I/O asks of a device (module docstring)."""

    def copies(self) -> DeviceCopies:
        """A collector for one read chunk's copies into CUDA outputs."""
        ...

    async def to_host(self, values: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """``values`` with each tensor on a device copied to host memory, awaited without
        blocking the event loop (``values`` itself when none is on a device)."""
        ...


def on_device(values: Sequence[torch.Tensor]) -> bool:
    """Whether any of ``values`` is a tensor on a device (not the CPU, not ``meta``)."""
    return any(isinstance(v, torch.Tensor) and v.device.type not in ("cpu", "meta")
               for v in values)


def copied_by_torch(values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``values`` with each one still on a device copied to the CPU by torch, as it can
    (a stand-in device in tests; a device no copier drives)."""
    return [v.detach().to("cpu") if isinstance(v, torch.Tensor)
            and v.device.type not in ("cpu", "meta") else v for v in values]


class HostCopies:
    """No device library drives the outputs: the chunk's verification copies into them
    itself (a tensor that only says it is on a device, e.g. a test's stand-in)."""

    sink = None

    def __bool__(self) -> bool:
        return False

    async def wait(self) -> None:
        return


class HostCopier:
    """The copier of a part built without a device path: host copies only."""

    def copies(self) -> DeviceCopies:
        return HostCopies()

    async def to_host(self, values: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        return copied_by_torch(values) if on_device(values) else values


HOST_COPIER: DeviceCopier = HostCopier()
