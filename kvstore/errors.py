"""Every exception kvstore raises on purpose.

One base class, :class:`KVStoreError`, so an engine can catch everything the store
says in one clause.  Standard-library bases are mixed in where they fit, so code
that already handles ``KeyError``/``TypeError``/``OSError`` keeps working.

Corruption (bytes on disk that fail their checksum or do not parse) is kept apart
from I/O failure (the kernel reported an error): the first is quarantined and
answered as a miss, the second stops the store from acknowledging writes.
"""

from __future__ import annotations

import errno as _errno

__all__ = [
    "KVStoreError",
    "StoreClosedError",
    "StoreForkedError",
    "StoreLockedError",
    "FormatVersionError",
    "NamespaceMismatchError",
    "OptionMismatchError",
    "InvalidKeyError",
    "InvalidTagError",
    "UnsupportedTensorError",
    "OutputMismatchError",
    "BlockTooLargeError",
    "StoreFullError",
    "CapacityError",
    "StoreIOError",
    "ReadOnlyError",
    "CorruptionError",
    "IndexCorruptionError",
    "InsecurePermissionsError",
    "UnsafePathError",
    "RemoteError",
    "RemoteAuthError",
]


class KVStoreError(Exception):
    """Base class of every error raised by kvstore."""


class StoreClosedError(KVStoreError, RuntimeError):
    """Raised by every store call made after ``close()`` (or after its ``async with`` exited)."""


class StoreForkedError(StoreClosedError):
    """Raised by every call on a store that a forked child inherited from its parent.

    The store (its event loop thread, its lock, its files) belongs to the process that
    opened it; a child of ``fork()`` has a copy of the object but none of the machinery
    behind it.  Open a store of your own in the child (on another path: the parent
    holds the lock on this one).  ``close()`` in the child releases nothing and returns;
    at exit the child leaves the parent's store alone.
    """


class StoreLockedError(KVStoreError, BlockingIOError):
    """Raised by ``open()`` when the store is held in a way this open cannot share: open
    exclusively (``open(..., exclusive=True)`` or fsck's repairs) by another owner, open
    by another owner while this open asks for it exclusively, or (where the native fence
    helper of the read marks is not built) open at all by another owner.  fsck (``--repair``, ``--rebuild-index``) raises it when the store is in use.
    The message names the holders' pids.  Close the other owner, or open another path.
    (A store open by default, without ``exclusive``, is shared: other opens succeed.)
    """


class OptionMismatchError(KVStoreError, ValueError):
    """Raised by ``open()`` when an option every process sharing a store must agree on
    differs from the one the store's live owners opened it with (``sync``: an owner
    committing without LMDB's fsync could corrupt the index for all of them after a
    system crash).  The message names the option and the other owners' pids."""


class FormatVersionError(KVStoreError, ValueError):
    """Raised by ``open()`` and by decoders when on-disk bytes carry a format version this
    build does not know.  Upgrade kvstore (or run ``python -m kvstore fsck`` with the version
    that wrote the store); nothing was modified."""


class NamespaceMismatchError(KVStoreError, ValueError):
    """Raised by ``open()`` when the store was created for another model/layout namespace.

    Blocks of one model are meaningless (and dangerous) to another.  Pass
    ``allow_new_namespace=True`` to keep several namespaces in one store on purpose.
    """


class InvalidKeyError(KVStoreError, TypeError):
    """Raised by every call taking keys when a key is not 16 ``bytes``, or by key
    derivation when token ids / extra keys cannot be encoded canonically."""


class InvalidTagError(KVStoreError, ValueError):
    """Raised by ``put_many(tags=...)`` before any I/O when ``tags`` is not one ``bytes``
    or ``None`` per key, or a tag is longer than ``MAX_TAG_BYTES`` (4096); the message
    names the tag's index."""


class UnsupportedTensorError(KVStoreError, TypeError):
    """Raised by ``put_many`` when a value is not a tensor kvstore can store byte-exactly
    (unsupported dtype, meta/sparse/quantized tensor, too many dimensions)."""


class OutputMismatchError(KVStoreError, ValueError):
    """Raised by ``get_many(out=...)`` when a caller-provided tensor does not have the
    stored block's dtype and number of elements.  Nothing is written into it."""


class BlockTooLargeError(KVStoreError, ValueError):
    """Raised by ``put_many`` when one block does not fit the staging arena or an extent.
    Raise ``staging_bytes`` / ``extent_bytes`` in ``open()``."""


class StoreFullError(KVStoreError, OSError):
    """Raised by ``put_many`` (and ``delete_many``, ``pin``, ``unpin``) when the file
    system has no room (ENOSPC, EDQUOT, EFBIG: for a new extent, or for the index to
    commit) or the store's size limit is reached.  Nothing already stored is lost, the
    store does not turn read-only, and the failed batch is not acknowledged: retry it
    once space is freed."""


class CapacityError(StoreFullError):
    """Raised by ``put_many`` when the batch does not fit ``capacity_bytes`` even after
    evicting every evictable block (the rest are pinned, have stored children, or are
    being written).  Nothing stored is lost; unpin blocks or raise the capacity."""


class StoreIOError(KVStoreError, OSError):
    """Raised when the kernel reports an I/O error on the store's files; ``errno`` is
    the kernel's (EIO, EROFS, EACCES, ...).  A failed write or fdatasync of the extents
    or of the index commit also turns the store read-only (:class:`ReadOnlyError`)."""


class ReadOnlyError(KVStoreError, RuntimeError):
    """Raised by write calls once the store has stopped acknowledging writes.

    After a failed write or fdatasync the kernel may have dropped dirty pages, so the
    store cannot promise durability any more (guarantee G5).  Reads keep working.
    Reopen the store after the underlying problem is fixed; run ``fsck`` first.
    """


class CorruptionError(KVStoreError, ValueError):
    """Raised by on-disk decoders when bytes fail their magic, length or checksum checks.

    ``get_many`` never lets it escape: a corrupt block is counted, quarantined and
    answered as a miss.  Tools (fsck, fuzz targets) see it directly.
    """


class IndexCorruptionError(CorruptionError):
    """Raised by ``open()`` when the LMDB index cannot be read.  Run
    ``python -m kvstore fsck PATH --rebuild-index`` to rebuild it from the extent files,
    which describe themselves."""


class InsecurePermissionsError(KVStoreError, PermissionError):
    """Raised by ``open(strict_permissions=True)`` when files of the store can be read or
    written by other users, or belong to another user.  The message names them and the
    ``chmod`` that fixes them (``python -m kvstore fsck PATH --repair`` does the same);
    nothing was changed."""


class UnsafePathError(KVStoreError, OSError):
    """Raised by ``open()`` (and by fsck, which then exits 2) when a path inside the
    store is a symbolic link, or not the regular file or directory the store made
    (``LOCK``, ``index/``, ``index/data.mdb``, ``index/lock.mdb``, ``extents/`` and its
    extent files).  kvstore reads and writes nothing outside its directory, so it
    follows no link there; nothing was changed.  The message names the path and the
    fix: put the real file in place of the link, or remove the link
    (``python -m kvstore fsck PATH --repair`` removes a linked extent file, never its
    target, and the blocks of that extent are then lost)."""


class RemoteError(KVStoreError, OSError):
    """Raised by ``open(remote=...)`` when the remote tier's configuration cannot work
    (no such bucket, an invalid endpoint) and by ``python -m kvstore remote check``.
    A remote that is merely unreachable is not an error: the store opens, its remote
    calls are fast misses until the cluster answers again (the circuit breaker)."""


class RemoteAuthError(RemoteError, PermissionError):
    """Raised by ``open(remote=RemoteConfig(...))`` when the S3 cluster refuses the
    credentials (wrong key, no permission on the bucket).  Fix the AWS environment or
    config, or pass ``on_auth_error="disable"`` to open with the remote tier disabled
    (``store.remote.stats().state == "disabled"``, with the reason)."""


_NO_ROOM = (_errno.ENOSPC, _errno.EDQUOT, _errno.EFBIG)


def from_os_error(e: OSError, what: str, *, full_hint: str = "free disk space or delete "
                  "blocks, then retry") -> KVStoreError:
    """The typed error for an ``OSError`` on the store's files (not public API: the
    translation every path uses, so no errno is lost or guessed).  No room
    (ENOSPC, EDQUOT, EFBIG) is :class:`StoreFullError`, a link where a store file
    should be (ELOOP from ``O_NOFOLLOW``) :class:`UnsafePathError`, anything else
    :class:`StoreIOError` with the kernel's errno.  ``what`` says what was being
    done, e.g. ``"cannot create /p/extents/00000002.kvx"``."""
    if isinstance(e, KVStoreError):
        return e
    code = e.errno or _errno.EIO
    reason = e.strerror or str(e)
    if code in _NO_ROOM:
        return StoreFullError(code, f"{what}: {reason}; {full_hint}")
    if code == _errno.ELOOP:
        return UnsafePathError(code, f"{what}: it is a symbolic link; kvstore follows no "
                               "link inside its directory. Put the real file in its place.")
    return StoreIOError(code, f"{what}: {reason}")
