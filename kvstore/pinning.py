"""How the store pins its staging arena for device DMA: a hook the store calls, so that
the store does not depend on the optional CUDA package (kvstore.cuda sits above it).

``kvstore/__init__.py`` installs :func:`kvstore.cuda.pinned.pin_arena` as the default
(importing ``kvstore.store`` imports the package first, so every store gets it); a test
or an embedding engine with its own pinning can install another with
:func:`set_default_pinner`.  Without one, the arena is plain host memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvstore.io.arena import Arena

__all__ = ["ArenaPin", "ArenaPinner", "default_pinner", "set_default_pinner"]


class ArenaPin(Protocol):
    """What pinning an arena gave: ``status`` is what ``Store.stats().cuda`` shows;
    ``close()`` unpins it before the arena is unmapped (idempotent)."""

    status: str

    def close(self) -> None: ...


ArenaPinner = Callable[[Arena, "bool | None"], ArenaPin]
"""``pinner(arena, mode)``: ``mode`` is ``open(pin_staging=...)``: True must pin or
raise, None pins where it can, False never pins."""


class _Unpinned:
    def __init__(self, status: str) -> None:
        self.status = status

    def close(self) -> None:
        return


def _no_pinning(arena: Arena, mode: bool | None) -> ArenaPin:
    if mode:
        raise ValueError("pin_staging=True, but no arena pinner is installed "
                         "(kvstore.cuda is not available)")
    return _Unpinned("cuda: not used (no arena pinner installed)")


_default: ArenaPinner = _no_pinning


def set_default_pinner(pinner: ArenaPinner) -> None:
    global _default
    _default = pinner


def default_pinner() -> ArenaPinner:
    return _default
