"""kvstore/events.py: the event calls of ``Store`` and ``BlockingStore`` (the stream and
the snapshot themselves: tests/core/test_events.py, tests/core/test_snapshot.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvstore
from tests.conformance import NS
from tests.core.test_events import chain, value


def test_a_blocking_snapshot_refuses_bad_arguments_and_a_closed_store(tmp_path: Path) -> None:
    blocking = kvstore.open_blocking(tmp_path / "store", namespace=NS, extent_bytes=1 << 20,
                                     staging_bytes=1 << 20)
    with blocking:
        ks = chain(5)
        blocking.put_many(ks, [value(i) for i in range(5)], parents=[None, *ks[:-1]])
        with pytest.raises(ValueError, match="page_blocks"):
            blocking.snapshot(page_blocks=0)
        pages = list(blocking.snapshot(page_blocks=2, order="parents_first"))
        assert [len(p) for p in pages] == [2, 2, 1]
        assert [b.key for p in pages for b in p] == ks
    with pytest.raises(kvstore.StoreClosedError):
        blocking.snapshot()
    with pytest.raises(kvstore.StoreClosedError):
        blocking.subscribe()


def test_a_blocking_subscription_is_read_from_another_thread(tmp_path: Path) -> None:
    import threading

    with kvstore.open_blocking(tmp_path / "store", namespace=NS, extent_bytes=1 << 20,
                               staging_bytes=1 << 20) as blocking:
        events = blocking.subscribe(max_events=2)
        ks = chain(3)
        blocking.put_many(ks, [value(i) for i in range(3)], parents=[None, *ks[:-1]])
        got: list[object] = []
        reader = threading.Thread(target=lambda: got.extend(
            iter(events.next_nowait, None)))
        reader.start()
        reader.join()
        assert [(e.seq, e.key) for e in got[:2]] == [(1, ks[0]), (2, ks[1])]  # type: ignore[attr-defined]
        assert got[2:] == [kvstore.EventGap(3, 3, 1)]
        events.close()
        assert blocking.stats().event_subscribers == 0
