"""What a fetch hands back: a verified remote object (:class:`RemoteBlock`) and the
callback a fetch calls as each one arrives (:data:`Finish`).  Its own module so that
the fetcher (``fetch.py``) and the tier that runs it (``tier.py``) share the types
without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstore.disk.format import SlotHeader
from kvstore.tiers.remote import objects

__all__ = ["Finish", "RemoteBlock"]


@dataclass
class RemoteBlock:
    """A verified object: its bytes (read-only) and header (decode with
    ``objects.decode``)."""

    key: bytes
    header: SlotHeader
    data: objects.ObjectBytes


# (index of the key in the fetch, the block) -> None: a fetch reports each arrival
Finish = Callable[[int, RemoteBlock], None]
