"""A reusable page-aligned buffer for reads that bypass the page cache (O_DIRECT needs
an aligned destination), grown to the largest size asked for.

Why reusable: a reader that allocates a fresh buffer per read pays the kernel to fault
in and zero every page of it (~0.65 core-s per GiB here), as much as the read itself.
"""

from __future__ import annotations

import mmap

from kvstore.disk.format import round_up


class AlignedBuffer:
    """One reader's buffer: ``view(n)`` is valid until that reader's next ``view``."""

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None

    def view(self, nbytes: int) -> memoryview:
        """A writable, page-aligned view of ``nbytes`` (the buffer's earlier contents
        are not kept when it grows)."""
        if self._map is None or len(self._map) < nbytes:
            # An earlier, smaller map is dropped, not closed: a view of it may still be
            # alive somewhere (it is freed with the last one).
            self._map = mmap.mmap(-1, max(round_up(nbytes), mmap.PAGESIZE))
        return memoryview(self._map)[:nbytes]
