"""What one write transaction changed of the store's content, for the event stream.

The index writer (:mod:`kvstore.index.writer`) is the one place the store's content
changes, so it is where events come from: while an event sink has subscribers, each
transaction gets a :class:`Journal` that :meth:`Index.add_block
<kvstore.index.index.Index.add_block>` and ``remove_block`` append to.  A job whose
nested transaction aborts truncates the journal back to where the job began (a put that
failed leaves no record), and the writer hands the records to the sink only after the
transaction committed (a commit that fails hands nothing over).  Given the put's commit
order (fdatasync before commit), a ``stored`` record is a durable block.

Without subscribers no journal is made: the index's hooks test one attribute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["DELETED", "EVICTED", "KINDS", "QUARANTINED", "RESTORED", "STORED", "Journal",
           "JournalSink", "Record"]

STORED = "stored"  # a put committed the block (durable)
EVICTED = "evicted"  # eviction took it out for room
DELETED = "deleted"  # delete_many took it out
QUARANTINED = "quarantined"  # a read of it failed: out of the index, kept to re-read
RESTORED = "restored"  # a quarantined copy verified when read again: back in the index
KINDS = (STORED, EVICTED, DELETED, QUARANTINED, RESTORED)

Record = tuple[str, bytes, bytes | None, bytes | None]  # (kind, key, parent key, tag)


class Journal:
    """The records of one write transaction, in the order they were made."""

    __slots__ = ("records",)

    def __init__(self) -> None:
        self.records: list[Record] = []

    def add(self, kind: str, key: bytes, parent: bytes | None, tag: bytes | None) -> None:
        self.records.append((kind, key, parent, tag))

    def mark(self) -> int:
        return len(self.records)

    def truncate(self, mark: int) -> None:
        """Forget what a job that aborted recorded (it began at ``mark``)."""
        del self.records[mark:]


class JournalSink(Protocol):
    """Where committed records go (:class:`kvstore.core.events.EventHub`).  Both are
    called on the writer thread: ``wants`` before each transaction, ``publish`` after
    its commit, and neither may block."""

    def wants(self) -> bool: ...

    def publish(self, records: Sequence[Record]) -> None: ...
