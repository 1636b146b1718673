"""One owner's read mark (issue 43's DESIGN 7.1; the file: :mod:`kvstore.io.marks`).

Every disk read of a stored slot (a get, a prefetch, the scrub, a re-read of a
quarantined slot, the remote tier's upload read) runs between :meth:`ReadMarks.begin`,
called *before* the index lookup that names the slot, and :meth:`ReadMarks.end`, after
its last byte was copied.  ``begin`` takes ``h`` = the newest LMDB transaction id less one
(read from the environment's meta pages before the lookup: the lookup's snapshot is at
least the transaction before the newest, whose meta page may still be being written) and, if
``h`` lowers this owner's published mark, publishes it with a full fence; ``end``
publishes the oldest ``h`` still in flight, or 0.  So while a read runs the owner's
slot holds a mark no newer than the snapshot it looked up under, and a range a later
transaction ``t`` freed stays pending while ``t > min(marks)`` (:meth:`horizon`): no
other owner reuses a slot this one may still copy (kvstore/core/free_space.py gates
its own reuse by the same horizon).

Without the native helper (or before registration) there is no file: ``begin`` and
``end`` only count, :meth:`horizon` is :data:`~kvstore.io.marks.NO_MARK`, and the
owner's local read epochs alone hold freed space, which is right while it is the only
owner (a second one is then refused: kvstore/core/owners.py).  Event-loop state only:
no locks, no awaits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvstore.io.marks import NO_MARK, MarksFile

__all__ = ["ReadMarks"]


class ReadMarks:
    """The mark of one owner (see the module docstring)."""

    def __init__(self, file: MarksFile | None, slot: int, newest: Callable[[], int]) -> None:
        self._file, self._slot, self._newest = file, slot, newest
        self._held: Counter[int] = Counter()
        self.published = 0  # what the slot holds (0: no mark)
        self.enabled = file is not None  # (a test seam: False publishes nothing)

    def begin(self) -> int:
        """A read is about to look its slots up: returns its mark (pass it to :meth:`end`)."""
        if not self.enabled:
            return 0
        # One below the newest meta page: a commit's meta page is seen here before its
        # O_DSYNC write returns, while a read transaction begun meanwhile still takes
        # the snapshot before it (LMDB publishes mti_txnid after the write), and at
        # most one commit is in flight (LMDB's write mutex).
        h = max(self._newest() - 1, 1)
        self._held[h] += 1
        if not self.published or h < self.published:
            self._publish(h)
        return h

    def end(self, mark: int) -> None:
        """That read copied its last byte (or failed, or was cancelled)."""
        if not mark or not self._held[mark]:
            return
        self._held[mark] -= 1
        if not self._held[mark]:
            del self._held[mark]
            if mark == self.published:
                self._publish(min(self._held) if self._held else 0)

    def horizon(self) -> int:
        """After a full fence, the oldest mark of any owner (:data:`NO_MARK`: none)."""
        return self._file.minimum() if self._file is not None else NO_MARK

    def newest(self) -> int:
        """The newest LMDB snapshot id (a transaction committed before this call has one
        at most this)."""
        return self._newest()

    def detach(self) -> None:
        """The owner closes its marks file: publish nothing into it from now on (a read
        ending after that has nothing left to withdraw: the close cleared the slot)."""
        self._file, self.enabled = None, False

    def _publish(self, value: int) -> None:
        if self._file is not None:
            self._file.publish(self._slot, value)
        self.published = value
