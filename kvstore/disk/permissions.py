"""Who may read a store: the permissions of everything kvstore creates, and their audit.

KV blocks are the attention state of users' prompts (they can be inverted back into
text) and the index says which prefixes exist, so a store is private to the user that
runs the engine, as a database's data directory is.

1. The store's *file mode* ``M`` (default ``0o600``) is read/write bits only, always
   includes the owner's ``rw`` and never lets other users write.  Directories get ``M``
   plus search (``x``) wherever ``M`` grants read: ``0o600 -> 0o700``, ``0o640 -> 0o750``,
   ``0o660 -> 0o770`` (:func:`dir_mode`).
2. Creation: files are created with ``M`` and then ``fchmod``-ed to ``M``; directories
   are ``mkdir``-ed with their mode and then ``chmod``-ed.  The umask can only remove
   bits from the creation mode, so a path is never more open than ``M`` at any moment;
   the explicit ``chmod`` restores bits a strict umask took away (the owner needs
   ``rw`` to reopen a file).  LMDB's two files are created the same way (empty, by
   kvstore, before LMDB opens them: :func:`kvstore.index.file.open_environment`).
   Nothing is created or opened through a symbolic link (``O_EXCL``, ``O_NOFOLLOW``;
   :mod:`kvstore.disk.store_files`).
3. A mode other than the default is recorded in the index (meta record ``file_mode``,
   FORMAT.md) so that later opens and fsck know what the operator chose.
4. :func:`audit` lists every path under the store (not following symlinks) that grants
   group or other users more than ``M`` allows (directories: ``dir_mode(M)``), or that
   belongs to another user while ``M`` is owner-only.  ``open()`` logs them with the
   command that fixes them (or refuses, ``strict_permissions=True``); fsck reports them
   and ``--repair`` sets them to ``M`` (:func:`set_mode`).
"""

from __future__ import annotations

import logging
import os
import shlex
import stat
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvstore.errors import IndexCorruptionError, InsecurePermissionsError

__all__ = [
    "FILE_MODE", "META_FILE_MODE", "LoosePath", "audit", "check_file_mode", "create_file",
    "describe", "dir_mode", "fix_command", "make_dirs", "open_file", "encode_mode",
    "decode_mode", "set_mode", "settle",
]

logger = logging.getLogger("kvstore.permissions")  # a stable name for log filters

FILE_MODE = 0o600            # owner read/write, nobody else
META_FILE_MODE = b"file_mode"  # u32 LE; absent means FILE_MODE
_MODE = struct.Struct("<I")
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_SHOWN = 10  # loose paths named in a warning (a store has 8 entries and its extents); the rest are counted


def check_file_mode(mode: object) -> int:
    """``mode`` if it is a usable store file mode, else ValueError saying why."""
    if isinstance(mode, bool) or not isinstance(mode, int):
        raise ValueError(f"file_mode must be an int such as 0o600 or 0o660, got {mode!r}")
    if mode & ~0o666:
        raise ValueError(f"file_mode {mode:#o} has bits other than read/write (0o666); "
                         "store files are data: use e.g. 0o600 (owner only) or 0o660 (group)")
    if mode & 0o600 != 0o600:
        raise ValueError(f"file_mode {mode:#o} must let the owner read and write (0o600)")
    if mode & 0o002:
        raise ValueError(f"file_mode {mode:#o} would let every local user rewrite the store; "
                         "share it through a group instead (0o660)")
    return mode


def dir_mode(file_mode: int) -> int:
    """The directory mode that goes with ``file_mode``: search wherever read is granted."""
    return file_mode | (file_mode & 0o444) >> 2


# ---------------------------------------------------------------------------- creation

def make_dirs(path: str, file_mode: int = FILE_MODE) -> None:
    """Create ``path`` and its missing parents with ``dir_mode(file_mode)`` (exactly,
    whatever the umask).  Directories that already exist are left as they are."""
    mode = dir_mode(file_mode)
    missing: list[str] = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            if os.path.isdir(d):
                continue  # made meanwhile by someone else: not ours to change
            raise
        set_mode(d, mode)


def open_file(path: str, flags: int, file_mode: int = FILE_MODE) -> int:
    """``os.open`` creating the file if missing; a file this call creates has exactly
    ``file_mode`` (an existing file keeps its mode: that is :func:`audit`'s business)."""
    while True:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW, file_mode)
        except FileExistsError:
            try:
                return os.open(path, (flags & ~os.O_CREAT) | _NOFOLLOW)
            except FileNotFoundError:
                continue  # removed between the two opens: create it after all
        return _fchmod_or_close(fd, file_mode)


def create_file(path: str, flags: int, file_mode: int = FILE_MODE) -> int:
    """``os.open`` of a file this call (re)writes from scratch (``O_TRUNC`` in ``flags``):
    created if missing, and its mode set to ``file_mode`` either way."""
    return _fchmod_or_close(os.open(path, flags | os.O_CREAT | _NOFOLLOW, file_mode), file_mode)


def _fchmod_or_close(fd: int, mode: int) -> int:
    try:
        os.fchmod(fd, mode)  # the umask may have removed bits ``mode`` asks for
    except BaseException:
        os.close(fd)
        raise
    return fd


def set_mode(path: str, mode: int, *, follow: bool = False) -> None:
    """chmod ``path`` through a descriptor opened without following a symlink (a link
    swapped in cannot redirect the chmod), falling back to a plain chmod for a file its
    owner cannot even read."""
    is_dir = stat.S_ISDIR(os.stat(path).st_mode if follow else os.lstat(path).st_mode)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW) \
        | (os.O_DIRECTORY if is_dir else 0)
    try:
        fd = os.open(path, flags)
    except PermissionError:  # e.g. 0o200: not a link (checked above), so chmod by name
        os.chmod(path, mode)
        return
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- the mode record

def decode_mode(raw: bytes | None) -> int | None:
    """The store's recorded file mode from its ``file_mode`` record as stored (None:
    never recorded, the default applies); written by :func:`encode_mode`."""
    if raw is None:
        return None
    try:
        if len(raw) != _MODE.size:
            raise ValueError(f"{len(raw)} bytes")
        return check_file_mode(_MODE.unpack(raw)[0])
    except ValueError as e:
        raise IndexCorruptionError(
            f"the store's file_mode record is damaged ({e}); run `python -m kvstore fsck "
            "--repair` to drop it (the store then defaults to owner-only 0o600)") from None


def encode_mode(mode: int) -> bytes:
    """The ``file_mode`` record of ``mode`` (the index stores it:
    ``Index.meta_records.record_file_mode``)."""
    return _MODE.pack(check_file_mode(mode))


# ---------------------------------------------------------------------------- audit

@dataclass(frozen=True)
class LoosePath:
    """A path under a store that other users can reach more than the store's mode allows."""

    path: str
    is_dir: bool
    mode: int                  # its permission bits now
    want: int                  # what the store's mode gives it
    uid: int                   # its owner
    store_uid: int | None      # the store's user, where ownership matters (owner-only mode)

    @property
    def extra_bits(self) -> int:
        """Group/other bits it has beyond ``want`` (a chmod to ``want`` removes them)."""
        return self.mode & 0o077 & ~self.want

    @property
    def foreign(self) -> bool:
        """Owned by another user: that user can change it whatever its mode."""
        return self.store_uid is not None and self.uid != self.store_uid

    def describe(self) -> str:
        why = []
        if self.foreign:
            assert self.store_uid is not None
            why.append(f"owned by {_user(self.uid)}, not {_user(self.store_uid)}")
        for name, shift in (("group", 3), ("others", 0)):
            bits = self.extra_bits >> shift & 0o7
            verbs = [verb for verb, bit in (("read", 4), ("write", 2),
                                            ("search" if self.is_dir else "execute", 1))
                     if bits & bit]
            if verbs:
                why.append(f"{name} can {'+'.join(verbs)}")
        return f"{self.path} ({self.mode:04o}: {', '.join(why)}; want {self.want:04o})"


def _user(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _walk(root: str) -> Iterator[tuple[str, os.stat_result]]:
    yield root, os.stat(root)  # the store directory itself: the caller chose that path
    stack = [root]
    while stack:
        directory = stack.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue  # unreadable: its own entry above already says why if it is loose
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # gone meanwhile (a probe file)
            if stat.S_ISDIR(st.st_mode):
                stack.append(entry.path)
            if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
                yield entry.path, st


def audit(root: str, file_mode: int = FILE_MODE, *, uid: int | None = None) -> list[LoosePath]:
    """Every directory and file under ``root`` (``root`` included, symlinks not
    followed) that grants group/others more than ``file_mode`` allows, or that belongs
    to a user other than ``uid`` while the mode is owner-only.

    ``uid`` defaults to the effective uid; for root, to the owner of ``root`` (root may
    check any user's store; files owned by someone else than that user are flagged).
    """
    root = os.path.abspath(root)
    if uid is None:
        uid = os.geteuid() or os.stat(root).st_uid
    check_owner = file_mode & 0o077 == 0  # a group-shared store may hold other members' files
    loose = []
    for path, st in _walk(root):
        want = dir_mode(file_mode) if stat.S_ISDIR(st.st_mode) else file_mode
        p = LoosePath(path, stat.S_ISDIR(st.st_mode), stat.S_IMODE(st.st_mode), want, st.st_uid,
                      uid if check_owner else None)
        if p.foreign or p.extra_bits:
            loose.append(p)
    return loose


def fix_command(root: str, loose: Sequence[LoosePath], file_mode: int) -> str:
    """A shell command that fixes ``loose``."""
    fixes = []
    foreign = [p for p in loose if p.foreign]
    if foreign:  # first, so that the chmod below is the owner's
        fixes.append(f"sudo chown -R {foreign[0].store_uid} {shlex.quote(root)}")
    if any(p.extra_bits for p in loose):
        if file_mode == FILE_MODE:
            fixes.append(f"chmod -R go= {shlex.quote(root)}")
        else:
            fixes.append(f"find {shlex.quote(root)} -type d -exec chmod {dir_mode(file_mode):o} "
                         f"{{}} + -o -type f -exec chmod {file_mode:o} {{}} +")
    return " && ".join(fixes)


def describe(root: str, loose: Sequence[LoosePath], file_mode: int) -> str:
    """The warning (or refusal) text: which paths, why, and the command that fixes them."""
    lines = [f"kvstore: other users can reach the store at {root} (its KV blocks hold users' "
             f"prompts; the store's mode is {file_mode:04o}):"]
    lines += [f"  {p.describe()}" for p in loose[:_SHOWN]]
    if len(loose) > _SHOWN:
        lines.append(f"  ... and {len(loose) - _SHOWN} more")
    fix = f"fix: {fix_command(root, loose, file_mode)}"
    if any(p.foreign for p in loose):
        fix += "  (check first who wrote the files owned by another user)"
    else:
        fix += f"  (or: python -m kvstore fsck {shlex.quote(root)} --repair)"
    lines.append(fix)
    return "\n".join(lines)


# ---------------------------------------------------------------------------- at open

def settle(root: str, requested: int | None, recorded: int | None,
           record: Callable[[int], None], *, strict: bool) -> int:
    """Decide the store's mode at open and check the store against it; returns the mode.

    ``requested`` (``open(file_mode=...)``) different from the recorded mode is an
    operator's decision: it is recorded and every path of the store owned by this user
    is set to it.  Then any loose path is logged (``strict``: refused with
    :class:`~kvstore.errors.InsecurePermissionsError`; nothing is changed).
    """
    mode = FILE_MODE if recorded is None else recorded
    if requested is not None and requested != mode:
        record(requested)
        mode = requested
        me = os.geteuid()
        for path, st in _walk(os.path.abspath(root)):
            want = dir_mode(mode) if stat.S_ISDIR(st.st_mode) else mode
            if stat.S_IMODE(st.st_mode) != want and me in (0, st.st_uid):
                set_mode(path, want, follow=path == os.path.abspath(root))
        logger.info("kvstore: the store at %s now has file mode %04o", root, mode)
    loose = audit(root, mode)
    if loose:
        text = describe(os.path.abspath(root), loose, mode)
        if strict:
            raise InsecurePermissionsError(
                13, text + "\n(refused: strict_permissions=True; nothing was changed)")
        logger.warning("%s", text)
    return mode
