"""A put's commit never overwrites an entry another process committed (issue 43).

Two processes put one key at once: both decide it is absent and write a slot each; the
second commit must not index the key again (its first slot would leak, its LRU row stay
behind, its parent count twice).  ``commit_puts`` looks in its own write transaction,
which LMDB serializes across processes, and skips a key indexed since the put decided:
its slot is not taken from the free map, and the key is returned (the put counts it as
deduplicated late, DESIGN.md 8.2).  The check came with the quarantine-restore race
(55ef9c5) as a redo of the whole put; here it is shown across real processes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.disk.format import PAGE, IndexEntry, unpack_count
from kvstore.index.index import Index, IndexWriter

ROOT = Path(__file__).resolve().parents[2]
KEY, PARENT = b"k" * 16, b"p" * 16

OTHER = textwrap.dedent("""
    import sys
    from kvstore.disk.format import IndexEntry
    from kvstore.index.index import Index, IndexWriter
    index = Index(sys.argv[1], map_size=1 << 24, sync=False)
    writer = IndexWriter(index)
    entry = IndexEntry(extent=2, offset=4096, slot_len=4096, payload_len=1, raw_len=1,
                       codec=0, dtype=0, payload_crc=0, seq=2, last_use=2, parent=b"p" * 16)
    writer.run_sync(lambda txn: index.commit_puts(txn, [(b"k" * 16, entry)], {}))
    writer.close()
    index.close()
""")


def entry(extent: int, seq: int) -> IndexEntry:
    return IndexEntry(extent=extent, offset=PAGE, slot_len=PAGE, payload_len=1, raw_len=1,
                      codec=0, dtype=0, payload_crc=0, seq=seq, last_use=seq, parent=PARENT)


@pytest.fixture
def index(tmp_path: Path) -> Iterator[tuple[Index, IndexWriter]]:
    ix = Index(str(tmp_path / "index"), map_size=1 << 24, sync=False)
    writer = IndexWriter(ix)
    try:
        writer.run_sync(lambda txn: ix.give_range(txn, 1, PAGE, 4 * PAGE))
        writer.run_sync(lambda txn: ix.give_range(txn, 2, PAGE, 4 * PAGE))
        yield ix, writer
    finally:
        writer.close()
        ix.close()


def test_a_commit_skips_a_key_another_process_committed(
        index: tuple[Index, IndexWriter]) -> None:
    ix, writer = index
    # This process decided KEY is absent and wrote its slot in extent 1; meanwhile
    # another process committed KEY in extent 2.
    assert not ix.present([KEY])
    run = subprocess.run([sys.executable, "-c", OTHER, ix.path], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    other = b"o" * 16
    mine = IndexEntry(extent=1, offset=2 * PAGE, slot_len=PAGE, payload_len=1, raw_len=1,
                      codec=0, dtype=0, payload_crc=0, seq=4, last_use=4, parent=None)
    skipped = writer.run_sync(lambda txn: ix.commit_puts(
        txn, [(KEY, entry(1, 3)), (other, mine)], {}))
    assert skipped.late == [KEY] and skipped.evicted == []
    assert ix.get_entries([other]) == [mine]  # the rest of the batch is indexed
    assert ix.get_entries([KEY]) == [entry(2, 2)]  # the other process's, untouched
    # KEY's slot (extent 1 at PAGE) not taken; the other block's is
    assert ix.free_runs() == [(1, PAGE, PAGE), (1, 3 * PAGE, 2 * PAGE), (2, 2 * PAGE, 3 * PAGE)]
    with ix.begin() as txn:
        assert unpack_count(txn.get(PARENT, db=ix.children)) == 1
        assert txn.stat(ix.lru)["entries"] == 2
