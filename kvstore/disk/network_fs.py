"""Whether a store lies on a network file system, where it is never shared (issue 43;
docs/multiprocess.md, "Opening a shared store").

Sharing rests on three things that hold only among the processes of one kernel: LMDB's
lock table (``lock.mdb``: a shared memory map and robust mutexes), the read marks
(``owners/marks``: fenced stores into a shared map) and the owners' ``flock`` locks
(which NFS emulates with byte-range locks, and other network file systems may not hold
at all).  Two hosts sharing one store on NFS, SMB or 9p would write one index, each
under locks the other does not see: it would be corrupted.  LMDB's own documentation
says not to use it on a remote file system.  So an open on one takes ``LOCK``
exclusively (one owner, as ``exclusive=True``) and says why when a second open is
refused (a second host is refused only where the file system honours ``flock`` across
clients); keeping a store there at all is the operator's choice (a local NVMe is what
kvstore is for).

The file system is the one ``/proc/self/mountinfo`` names for the longest mount point
above the store's real path (with FUSE's subtype: ``fuse.sshfs``).
"""

from __future__ import annotations

import os

__all__ = ["NETWORK_FS_TYPES", "network_fs"]

NETWORK_FS_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "afs", "lustre", "gpfs",
    "glusterfs", "beegfs", "orangefs", "gfs2", "ocfs2", "fuse.sshfs", "fuse.glusterfs", "fuse.s3fs",
    "fuse.gcsfuse", "fuse.rclone", "fuse.juicefs", "fuse.ceph-fuse"})


def network_fs(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the network file system ``path`` lies on, or None (a local one, or
    the mount table cannot be read)."""
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in lines:
        # ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPER
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        point = _unescape(parts[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, best_type = point, rest.split()[0]
    return best_type if best_type in NETWORK_FS_TYPES else None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field
