"""The index writer's journal (kvstore/index/journal.py): a transaction's content changes
reach the sink after its commit, in order, without those of a job that failed (its
nested transaction aborted), and nothing is journaled while the sink wants nothing."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvstore.disk.format import IndexEntry
from kvstore.errors import StoreFullError
from kvstore.index.index import Index
from kvstore.index.journal import Record
from kvstore.index.writer import IndexWriter


class Sink:
    def __init__(self, wants: bool = True) -> None:
        self.on = wants
        self.published: list[list[Record]] = []

    def wants(self) -> bool:
        return self.on

    def publish(self, records: Sequence[Record]) -> None:
        self.published.append(list(records))


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def entry(i: int, parent: bytes | None = None) -> IndexEntry:
    return IndexEntry(extent=1, offset=4096 * (i + 1), slot_len=4096, payload_len=64,
                      raw_len=64, codec=0, dtype=0, payload_crc=0, seq=i, last_use=i,
                      parent=parent)


@pytest.fixture
def index(tmp_path: Path) -> Any:
    idx = Index(str(tmp_path / "index"), map_size=4 << 20, sync=False)
    yield idx
    idx.close()


def one_transaction(writer: IndexWriter, jobs: list[Any]) -> list[Any]:
    """Run ``jobs`` in one transaction: queued while the writer is held by a first job."""
    held, release = threading.Event(), threading.Event()
    first = writer.submit(lambda txn: (held.set(), release.wait(30)))
    assert held.wait(30)
    futures = [writer.submit(job) for job in jobs]
    release.set()
    first.result(30)
    return [f.exception(30) for f in futures]


def test_a_failed_job_leaves_no_record_and_the_rest_are_published_after_commit(
        index: Index) -> None:
    sink = Sink()
    writer = IndexWriter(index, sink=sink)
    try:
        def ok(i: int) -> Any:
            return lambda txn: index.add_block(txn, key(i), entry(i, key(i - 1) if i else None),
                                               tag=b"tag%d" % i)

        def fails(txn: Any) -> None:
            index.add_block(txn, key(7), entry(7), tag=b"tag7")
            raise RuntimeError("the job fails after indexing")

        def fills_the_map(txn: Any) -> None:
            index.add_block(txn, key(8), entry(8))
            txn.put(key(99), b"\0" * (8 << 20), db=index.meta)  # past the 4 MiB limit

        def removes(txn: Any) -> None:
            index.remove_block(txn, key(1), entry(1, key(0)), quarantine=False, evicted=True)
            index.remove_block(txn, key(0), entry(0), quarantine=True)

        errors = one_transaction(writer, [ok(0), fails, ok(1), fills_the_map, removes])
        assert [type(e) for e in errors] == [type(None), RuntimeError, type(None),
                                             StoreFullError, type(None)]
        # (the holding job's transaction had no content change: nothing published for it)
        assert sink.published == [[("stored", key(0), None, b"tag0"),
                                    ("stored", key(1), key(0), b"tag1"),
                                    ("evicted", key(1), key(0), b"tag1"),
                                    ("quarantined", key(0), None, b"tag0")]]
        assert index.journal is None
        # the aborted job's tag is gone with it; the evicted block's went with the block;
        # the quarantined one's stays
        assert index.tags.read_many([key(i) for i in range(9)]) == {key(0): b"tag0"}
    finally:
        writer.close()


def test_nothing_is_journaled_while_the_sink_wants_nothing(index: Index) -> None:
    sink = Sink(wants=False)
    writer = IndexWriter(index, sink=sink)
    try:
        journals = writer.run_sync(lambda txn: (index.add_block(txn, key(1), entry(1)),
                                                index.journal)[1])
        assert journals is None and sink.published == []
        # (a quarantined block's tag stayed in the table: its restore carries it)
        writer.run_sync(lambda txn: index.tags.put(txn, key(2), b"kept"))
        sink.on = True
        writer.run_sync(lambda txn: index.add_block(txn, key(2), entry(2, key(1)),
                                                    restored=True))
        assert sink.published == [[("restored", key(2), key(1), b"kept")]]
    finally:
        writer.close()
