"""``AlignedBuffer``: page-aligned, reused while big enough, grown when not, and usable
as an O_DIRECT destination."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest

from kvstore.io.aligned import AlignedBuffer


def address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_views_are_page_aligned_reused_and_grown() -> None:
    buffer = AlignedBuffer()
    first = buffer.view(5000)
    assert len(first) == 5000 and address(first) % mmap.PAGESIZE == 0
    smaller = buffer.view(100)
    assert address(smaller) == address(first)  # the same memory, reused
    first[:4] = b"keep"
    bigger = buffer.view(3 * mmap.PAGESIZE + 1)
    assert address(bigger) % mmap.PAGESIZE == 0 and len(bigger) == 3 * mmap.PAGESIZE + 1
    assert bytes(first[:4]) == b"keep"  # an older view stays valid after a growth


def test_an_o_direct_read_lands_in_it(tmp_path: Path) -> None:
    path = tmp_path / "f"
    data = os.urandom(3 * mmap.PAGESIZE)
    path.write_bytes(data)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("no O_DIRECT on this file system")
    try:
        view = AlignedBuffer().view(2 * mmap.PAGESIZE)
        assert os.preadv(fd, [view], mmap.PAGESIZE) == 2 * mmap.PAGESIZE
    finally:
        os.close(fd)
    assert bytes(view) == data[mmap.PAGESIZE:]
