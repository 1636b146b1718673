"""Another process on the same index grows LMDB's memory map (issue 43): this process
sees it as ``lmdb.MapResizedError`` when its next transaction begins, read or write
(/work/notes/multiproc/results.md, section 1).  The index adopts the recorded size
(``set_mapsize(0)``) and begins again: the reader and the writer both go on, see what the
other process wrote, and no LMDB error (nor a StoreIOError that would stop the store's
writes) reaches them.

The grower is a real second process (LMDB forbids one environment opened twice in a
process); both start with a 1 MiB map, the test's seam for ``INITIAL_MAP_BYTES``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

import kvstore.index.index
from kvstore.index.index import Index, IndexWriter

ROOT = Path(__file__).resolve().parents[2]
SMALL_MAP = 1 << 20
VALUE = 64 << 10

GROWER = textwrap.dedent("""
    import sys
    import kvstore.index.index as ix
    ix.INITIAL_MAP_BYTES = 1 << 20
    index = ix.Index(sys.argv[1], map_size=1 << 26, sync=False)
    writer = ix.IndexWriter(index)
    value = bytes(64 << 10)
    for i in range(int(sys.argv[2])):
        writer.run_sync(lambda txn, i=i: txn.put(b"grower:%d" % i, value, db=index.meta))
    writer.run_sync(lambda txn: txn.put(b"grower:last", b"done", db=index.meta))
    print(index.env.info()["map_size"])
    writer.close()
    index.close()
""")


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Index]:
    monkeypatch.setattr(kvstore.index.index, "INITIAL_MAP_BYTES", SMALL_MAP)
    ix = Index(str(tmp_path / "index"), map_size=1 << 26, sync=False)
    assert ix.env.info()["map_size"] == SMALL_MAP
    try:
        yield ix
    finally:
        ix.close()


def put_meta(index: Index, key: bytes, value: bytes, txn: Any) -> None:
    txn.put(key, value, db=index.meta)


def grow_elsewhere(path: str, entries: int = 64) -> int:
    """Another process writes ``entries`` 64 KiB values (4 MiB: the map doubles from
    1 MiB to 8 MiB there); returns the map size it ended with."""
    run = subprocess.run([sys.executable, "-c", GROWER, path, str(entries)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return int(run.stdout.strip())


def test_a_read_adopts_the_map_another_process_grew(index: Index) -> None:
    grown = grow_elsewhere(index.path)
    assert grown > 4 * SMALL_MAP
    with index.begin() as txn:
        assert txn.get(b"grower:last", db=index.meta) == b"done"
        assert len(txn.get(b"grower:63", db=index.meta)) == VALUE
    assert index.map_adoptions == 1
    assert index.env.info()["map_size"] == grown


def test_a_write_adopts_the_map_another_process_grew(index: Index) -> None:
    writer = IndexWriter(index)
    try:
        writer.run_sync(lambda txn: txn.put(b"mine:0", b"before", db=index.meta))
        grow_elsewhere(index.path)
        # The writer's next begin is the first transaction of this process since.
        writer.run_sync(lambda txn: txn.put(b"mine:1", b"after", db=index.meta))
        assert index.map_adoptions == 1
        with index.begin() as txn:
            assert txn.get(b"grower:last", db=index.meta) == b"done"
            assert txn.get(b"mine:1", db=index.meta) == b"after"
        # and it keeps writing (growing on its own map from the adopted size)
        for i in range(80):
            writer.run_sync(partial(put_meta, index, b"mine:big:%d" % i, bytes(VALUE)))
    finally:
        writer.close()
