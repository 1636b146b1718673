"""The ``tags`` table: a caller's opaque bytes per block (``put_many(..., tags=)``).

An engine's connector keeps what it needs to announce a block again after a restart
(its own block hash, the parent's, token ids...) next to the block, so a snapshot or an
event carries it without a second read.  The store never interprets a tag.

Lifetime (FORMAT.md, "tags"): a tag lives as long as its key has a block in the
``blocks`` table or a record in ``quarantine``:

- written by the transaction that indexes the block (``commit_puts``), so a put that
  fails or is cancelled before its commit leaves none;
- a deduplicated put writes nothing, its tag included: the stored tag (or the absence
  of one) stays.  A key is a digest of the engine's identifiers, so two tags for one key
  say the same thing, and the first one stored wins;
- dropped with the block (delete, eviction), unless the key has a quarantined copy,
  which may go back into the index with it;
- kept while the block is quarantined, and there again when the block is restored.

The table is optional and additive: an older build neither opens nor writes it.  Its
puts leave no tag, and its evictions and deletes leave *orphans* (a tag whose key has
no block and no quarantine record): harmless, as a key's tag says the same thing
whenever the key is stored again, but space.  fsck reports orphans (reclaimable) and
``--repair`` drops them (:meth:`TagTable.drop_orphans`).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import Any

from kvstore.errors import InvalidTagError

__all__ = ["MAX_TAG_BYTES", "TagTable", "check_tags"]

Txn = Any  # lmdb.Transaction (untyped module)

MAX_TAG_BYTES = 4096
"""The largest tag a put accepts: a tag is a block's identity for its caller (a hash,
its parent's, a block's token ids: about 250 bytes for vLLM), not a place for data."""


def check_tags(tags: object, n: int) -> list[bytes | None] | None:
    """``tags`` as a list of ``bytes | None``, one per key (``n`` keys), or None when no
    key has one; :class:`InvalidTagError` otherwise, before any I/O."""
    if tags is None:
        return None
    if isinstance(tags, (bytes, bytearray, memoryview, str)):
        raise InvalidTagError("tags is a sequence with one tag (bytes or None) per key, "
                              f"not a single {type(tags).__name__}")
    try:
        items = list(tags)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidTagError(f"tags must be a sequence of bytes or None, got "
                              f"{type(tags).__name__}") from None
    if len(items) != n:
        raise InvalidTagError(f"{n} keys but {len(items)} tags")
    out: list[bytes | None] = []
    for i, tag in enumerate(items):
        if tag is not None:
            if isinstance(tag, (bytearray, memoryview)):
                tag = bytes(tag)
            if not isinstance(tag, bytes):
                raise InvalidTagError(f"tag {i} must be bytes or None, got {type(tag).__name__}")
            if len(tag) > MAX_TAG_BYTES:
                raise InvalidTagError(f"tag {i} is {len(tag)} bytes; a tag holds at most "
                                      f"{MAX_TAG_BYTES}")
        out.append(tag)
    return out if any(t is not None for t in out) else None


class TagTable:
    """The tags of one open index; writes run in the index writer's transactions."""

    def __init__(self, begin: Any, tags: Any, blocks: Any, quarantine: Any) -> None:
        self._begin, self._tags = begin, tags
        self._blocks, self._quarantine = blocks, quarantine

    def put(self, txn: Txn, key: bytes, tag: bytes) -> None:
        txn.put(key, tag, db=self._tags)

    def get(self, txn: Txn, key: bytes) -> bytes | None:
        tag = txn.get(key, db=self._tags)
        return None if tag is None else bytes(tag)

    def drop(self, txn: Txn, key: bytes) -> bytes | None:
        """The block of ``key`` leaves the index for good (deleted, evicted): its tag goes
        with it, unless a quarantined copy of the key may come back.  Returns the tag."""
        tag = txn.get(key, db=self._tags)
        if tag is None:  # (the common case without tags: one lookup in an empty table)
            return None
        tag = bytes(tag)
        if txn.get(key, db=self._quarantine) is None:
            txn.delete(key, db=self._tags)
        return tag

    def read_many(self, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        """The tags of those of ``keys`` that have one (one read transaction)."""
        with self._begin() as txn, txn.cursor(self._tags) as cur:
            return {bytes(k): bytes(v) for k, v in cur.getmulti(keys)}

    def tagged_rows_after(self, after: bytes | None, limit: int
                          ) -> list[tuple[bytes, bytes, bytes | None]]:
        """Up to ``limit`` undecoded rows of the blocks table after key ``after`` (None:
        from the first), in key order, each with its key's tag: one read transaction, so
        a row and its tag are of one instant (the snapshot's page)."""
        with self._begin() as txn, txn.cursor(self._blocks) as cur, \
                txn.cursor(self._tags) as tags:
            if not (cur.set_range(after) if after is not None else cur.first()):
                return []
            rows = islice(((bytes(k), bytes(v)) for k, v in cur if k != after), limit)
            return [(k, v, None if (t := tags.get(k)) is None else bytes(t)) for k, v in rows]

    def count(self) -> int:
        with self._begin() as txn:
            return int(txn.stat(self._tags)["entries"])

    def orphans(self, txn: Txn | None = None) -> list[bytes]:
        """Keys with a tag but neither a block nor a quarantine record (in ``txn``, or a
        read transaction of its own)."""
        if txn is None:
            with self._begin() as own:
                return self.orphans(own)
        with txn.cursor(self._blocks) as blocks, txn.cursor(self._quarantine) as held:
            return [bytes(k) for k in txn.cursor(self._tags).iternext(values=False)
                    if not blocks.set_key(k) and not held.set_key(k)]

    def drop_orphans(self, txn: Txn) -> int:
        """fsck's repair: drop every orphan tag (after the repairs that dropped blocks)."""
        doomed = self.orphans(txn)
        for key in doomed:
            txn.delete(key, db=self._tags)
        return len(doomed)
