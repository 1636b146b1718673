"""The ``tags`` table's lifetime (kvstore/index/tags.py), at the index: a tag lives while its
key has a block or a quarantine record, whatever order those go in."""

from __future__ import annotations

from typing import Any

from kvstore.index.index import Index
from kvstore.index.tags import check_tags
from kvstore.index.writer import IndexWriter
from tests.index.test_journal import entry, index, key  # noqa: F401 - index: a fixture


def test_no_tags_or_only_nones_is_none_and_views_become_bytes() -> None:
    assert check_tags(None, 3) is None
    assert check_tags([None, None], 2) is None
    assert check_tags((bytearray(b"a"), None), 2) == [b"a", None]
    assert check_tags(iter([b"", None]), 2) == [b"", None]


def test_a_tag_outlives_its_block_only_while_a_quarantined_copy_may_come_back(
        index: Index) -> None:  # noqa: F811
    writer = IndexWriter(index)
    tags = index.tags
    try:
        def run(fn: Any) -> Any:
            return writer.run_sync(fn)

        # a block quarantined keeps its tag; stored again (no tag given) and deleted,
        # the tag stays for the quarantined copy
        run(lambda txn: index.add_block(txn, key(1), entry(1), tag=b"one"))
        run(lambda txn: index.remove_block(txn, key(1), entry(1), quarantine=True))
        assert tags.read_many([key(1)]) == {key(1): b"one"} and tags.orphans() == []
        run(lambda txn: index.add_block(txn, key(1), entry(5)))
        run(lambda txn: index.remove_block(txn, key(1), entry(5), quarantine=False))
        assert tags.read_many([key(1)]) == {key(1): b"one"} and tags.orphans() == []
        # the record goes (a repair's drop, an older build's): the tag is an orphan
        run(lambda txn: txn.delete(key(1), db=index.quarantine))
        assert tags.orphans() == [key(1)]
        assert run(tags.drop_orphans) == 1 and tags.count() == 0
        # a block without a quarantined copy takes its tag along
        run(lambda txn: index.add_block(txn, key(2), entry(2), tag=b"two"))
        run(lambda txn: index.remove_block(txn, key(2), entry(2), quarantine=False,
                                           evicted=True))
        assert tags.count() == 0
    finally:
        writer.close()
