"""The options of a store, in one frozen dataclass validated once: ``kvstore.open()``,
``kvstore.open_blocking()`` and the engine integrations take it (or its fields as
keywords) without restating them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from kvstore.disk.format import PAGE
from kvstore.disk.permissions import check_file_mode
from kvstore.io.probe import ENGINES
from kvstore.io.scheduler import IoSchedule

if TYPE_CHECKING:
    from kvstore.codecs.pipeline import CodecSpec
    from kvstore.io.protocol import IOEngine
    from kvstore.keys import Namespace
    from kvstore.tiers.remote.config import RemoteConfig

# ENGINES (the engine names ``engine`` takes) and check_file_mode (what ``file_mode``
# takes, checked) are here for the engine integrations, which read them from configs.
__all__ = ["ENGINES", "StoreOptions", "check_file_mode"]

# Deprecated option names -> their new names (accepted by ``StoreOptions.of``, so by
# ``open()`` and ``open_blocking()``, for one release).
_RENAMED = {"pin_staging": "page_lock_staging"}


@dataclass(frozen=True)
class StoreOptions:
    """How a store is opened.  Every field has a default; a bad value raises
    ``ValueError`` or ``TypeError`` naming the field when the options are made.

    ``namespace``  the model/layout the caller's keys belong to; recorded at first use, and
                   a different one is refused unless ``allow_new_namespace=True``.
    ``engine``     ``"auto"`` (probe: io_uring if it works here, else threads),
                   ``"io_uring"`` or ``"threads"`` (or an ``IOEngine`` instance, e.g. the
                   crash tests' ``SimulatedEngine``).
    ``sync``       True (default): an acknowledged put has been written, fdatasync'ed and
                   committed (LMDB fsync) - it survives process crash, kernel crash and power
                   loss.  False: no fdatasync and no LMDB fsync - acknowledged blocks survive
                   a crash of the process, but a kernel crash or power loss can lose the
                   most recent ones (never corrupt: what is read back still verifies).
                   Every process sharing a store must open it with the same ``sync``
                   (``OptionMismatchError`` otherwise).
    ``exclusive``  False (default): the store's ``LOCK`` is taken shared, so other
                   processes (and other Stores of this one, and fsck's check) may open the
                   store beside this one, sharing its capacity and its blocks; True:
                   taken exclusively (as fsck's repairs do): every other open is refused
                   with ``StoreLockedError`` while this store is open.  A store on a
                   network file system (NFS, SMB, 9p, ...) is always opened so: its
                   locks do not hold across hosts (kvstore/disk/network_fs.py).
    ``extent_bytes``  size of each preallocated extent file (fixed at creation).
    ``staging_bytes`` size of the aligned host arena all I/O is staged through; bounds the
                   memory used by transfers in flight and the largest block.  Resident
                   from open (faulted in then, on transparent huge pages where the host
                   allows them: ~20 ms per 256 MiB), not page by page during transfers.
    ``queue_depth``   I/O operations in flight at once.
    ``index_map_bytes`` the most the LMDB index may grow to.  Its memory map starts at
                   1 GiB (or this, if smaller) and doubles when full, between
                   transactions; past this limit puts fail with ``StoreFullError`` (reads
                   keep working).  Address space, not disk: the file grows as it fills.
    ``codec``      default :class:`~kvstore.codecs.pipeline.CodecSpec` for puts (None: raw bytes).
                   FP8 is lossy and opt-in; zstd (after FP8, or over bf16/fp16 byte planes)
                   is lossless.  Reads decode whatever each block was written with.
    ``capacity_bytes`` stored bytes (slots, 4 KiB-rounded) never exceed this, even under
                   concurrent puts: least-recently-used blocks without stored children and
                   not pinned are evicted first (durably, like deletes), only as much as a
                   put needs; parents of blocks being written are never evicted, so chains
                   never get holes.  Recorded in the store (every process sharing it
                   applies the same): an open that gives it records it, one that does
                   not (None) takes the recorded one; never given: what the store holds
                   plus 90% of the free disk space.
    ``page_lock_staging`` page-lock the staging arena (register it with CUDA as
                   host memory the GPU can DMA to and from, what torch calls "pinned";
                   :mod:`kvstore.io.page_locking`), so gets land where the GPU copies them
                   from directly: None (default) when CUDA is usable, True requires it
                   (CudaError if not), False never.  Unregistered at close.
                   ``stats().cuda`` says what happened.  ``pin_staging`` is its
                   deprecated old name (``Store.pin`` is the never-evict feature).
    ``file_mode``  permissions of the store's files (directories get search where it
                   grants read), exact whatever the umask: None (default) keeps the
                   store's recorded mode, owner-only ``0o600`` (dirs ``0o700``) for a new
                   one - KV blocks hold users' prompts.  ``0o640``/``0o660`` share the
                   store with the group on purpose; a mode different from the recorded
                   one is recorded and applied to every existing file.  Other users
                   never get write access.
    ``strict_permissions``  opening a store whose files other users can reach (more
                   than ``file_mode`` allows, or owned by another user) logs a warning
                   naming them and the fixing ``chmod``; True refuses instead
                   (:class:`~kvstore.errors.InsecurePermissionsError`).
    ``memory_bytes`` size of the host-memory tier (0, the default: off): verified blocks
                   cached in one region of host RAM (page-locked like the staging arena)
                   in front of the extents, filled by durable puts (lossless codecs) and by
                   gets of CPU tensors; a get served from it does no disk I/O.
                   Least-recently-used leaves are evicted first; pinned blocks (``Store.pin``)
                   stay.  See
                   :mod:`kvstore.tiers.memory.tier`.
    ``prefetch_share`` the most of ``memory_bytes`` that prefetched blocks not yet read
                   by a get may take (``Store.prefetch``).
    ``io_scheduling`` True (default): reads a caller awaits go before background writes,
                   flushes and prefetches, with bounded bytes in flight per class
                   (:mod:`kvstore.io.scheduler`); a :class:`kvstore.IoSchedule` sets
                   those bounds; False hands every transfer to the engine as it comes.
    ``backlog_bytes`` bytes of puts in flight beyond which ``put_many(background=True)``
                   drops its batch whole and foreground puts wait (default 1 GiB).
    ``scrub_bytes_per_s``  0 (default): no background scrub.  N: while the store is
                   open, every stored block is read again and verified (header, payload
                   CRC32C) at most N bytes/s, gets first, a pass after another (at
                   most one a minute), resuming after a restart where it stopped; what
                   fails is quarantined, what heals is put back (:mod:`kvstore.core.scrub`).
                   Pick N as stored bytes / how often every block should be checked
                   (64 MiB/s: 1 TiB in ~4.5 h).  ``Store.scrub`` runs one pass on demand.
    ``remote``     a :class:`~kvstore.remote.RemoteConfig`: the shared S3 tier behind
                   this one (needs ``namespace``; ``pip install kvstore[remote]``).
                   Durable puts are uploaded in the background; local misses of
                   get_many / match_prefix / prefetch are fetched (verified, under a
                   deadline) and promoted here.  Refused credentials raise
                   ``RemoteAuthError`` here; an unreachable cluster does not (fast
                   misses until it answers).  See :mod:`kvstore.tiers.remote.tier`.
    """

    namespace: Namespace | None = None
    allow_new_namespace: bool = False
    engine: str | IOEngine = "auto"
    sync: bool = True
    exclusive: bool = False
    extent_bytes: int = 1 << 30
    staging_bytes: int = 256 << 20
    queue_depth: int = 64
    index_map_bytes: int = 64 << 30
    create: bool = True
    capacity_bytes: int | None = None
    codec: CodecSpec | None = None
    page_lock_staging: bool | None = None
    file_mode: int | None = None
    strict_permissions: bool = False
    memory_bytes: int = 0
    prefetch_share: float = 0.5
    io_scheduling: bool | IoSchedule = True
    backlog_bytes: int = 1 << 30
    scrub_bytes_per_s: int = 0
    remote: RemoteConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.engine, str) and self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)} (or an IOEngine), "
                             f"got {self.engine!r}")
        for name in ("staging_bytes", "queue_depth", "index_map_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.capacity_bytes is not None and self.capacity_bytes < PAGE:
            raise ValueError(f"capacity_bytes must be at least {PAGE} (None: what the store "
                             f"holds plus 90% of the free disk space), got {self.capacity_bytes}")
        if self.extent_bytes % PAGE or self.extent_bytes < 4 * PAGE:
            raise ValueError(f"extent_bytes must be a multiple of {PAGE} and >= {4 * PAGE}, "
                             f"got {self.extent_bytes}")
        if self.memory_bytes < 0:
            raise ValueError(f"memory_bytes must be >= 0 (0 turns the memory tier off), "
                             f"got {self.memory_bytes}")
        if not 0 < self.prefetch_share <= 1:
            raise ValueError(f"prefetch_share must be in (0, 1], got {self.prefetch_share}")
        if self.backlog_bytes <= 0:
            raise ValueError(f"backlog_bytes must be > 0, got {self.backlog_bytes}")
        if isinstance(self.scrub_bytes_per_s, bool) or not isinstance(self.scrub_bytes_per_s, int) \
                or self.scrub_bytes_per_s < 0:
            raise ValueError(f"scrub_bytes_per_s must be an int >= 0 (0: no background "
                             f"scrub), got {self.scrub_bytes_per_s!r}")
        if not isinstance(self.io_scheduling, (bool, IoSchedule)):
            raise TypeError(f"io_scheduling must be True, False or a kvstore.IoSchedule, "
                            f"got {self.io_scheduling!r}")
        if self.file_mode is not None:
            check_file_mode(self.file_mode)

    @property
    def pin_staging(self) -> bool | None:
        """Deprecated name of ``page_lock_staging`` (reading it does not warn)."""
        return self.page_lock_staging

    @classmethod
    def of(cls, options: StoreOptions | None = None, **fields_: Any) -> StoreOptions:
        """``options`` (default: all defaults) with ``fields_`` replaced; an unknown
        field is a ``TypeError`` that lists the known ones.  ``pin_staging=`` (the old
        name of ``page_lock_staging``) still works and warns (``DeprecationWarning``)."""
        for old, new in _RENAMED.items():
            if old in fields_:
                if new in fields_:
                    raise TypeError(f"{old} is the deprecated name of {new}: pass only {new}")
                warnings.warn(f"the store option {old} is deprecated; it is now called {new}",
                              DeprecationWarning, stacklevel=3)
                fields_[new] = fields_.pop(old)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(fields_) - known)
        if unknown:
            raise TypeError(f"unknown store option(s) {', '.join(unknown)}; the options are "
                            f"{', '.join(sorted(known))}")
        return replace(options if options is not None else cls(), **fields_)

    def io_schedule(self) -> IoSchedule | None:
        """The I/O scheduler's bounds, or None for no scheduler."""
        return IoSchedule() if self.io_scheduling is True else self.io_scheduling or None
