"""fsck's checks of the meta records (step 7 of kvstore/tools/fsck.py: the sequence
counter, ``next_extent``, the namespace records) and of the store's permissions (step
9), each finding with the repair it calls for (kvstore/tools/fsck_repairs.py)."""

from __future__ import annotations

import json
from functools import partial

from kvstore.disk import permissions
from kvstore.disk.format import IndexEntry
from kvstore.errors import IndexCorruptionError
from kvstore.tools.fsck_repairs import Repairs
from kvstore.tools.fsck_report import DAMAGE

__all__ = ["check_meta", "check_permissions"]


def check_permissions(checker: Repairs) -> None:
    """Step 9: every path under the store against the store's file mode."""
    try:
        mode = checker.index.meta_records.file_mode() or permissions.FILE_MODE
    except IndexCorruptionError as e:
        checker.find("meta", DAMAGE, str(e))
        checker.fixes.append(checker.index.meta_records.drop_file_mode)
        mode = permissions.FILE_MODE
    for p in permissions.audit(checker.path, mode):
        if p.foreign:
            checker.unfixable.append(checker.find(
                "foreign-owner", DAMAGE, f"{p.describe()}: another user can change it; "
                f"check it, then {permissions.fix_command(checker.path, [p], mode)}"))
        else:
            f = checker.find("loose-permissions", DAMAGE, f"{p.describe()}: other users can "
                          f"reach it; --repair sets {p.want:04o}")
            checker.file_fixes.append((f, partial(permissions.set_mode, p.path, p.want,
                                                  follow=p.path == checker.path)))


def check_meta(checker: Repairs, extents: dict[int, int],
               entries: list[tuple[bytes, IndexEntry, bool]]) -> None:
    """Step 7's meta records: the sequence counter, ``next_extent``, namespaces."""
    meta = checker.index.meta_records
    seq = meta.seq()
    top = max((e.seq for _, e, _ in entries), default=0)
    if seq < top:
        checker.find("meta", DAMAGE, f"sequence counter {seq} is below an entry's {top}")
        checker.fixes.append(partial(meta.raise_seq, seq=top))
    nxt = meta.next_extent()
    if extents and nxt <= max(extents):
        checker.find("meta", DAMAGE, f"next_extent {nxt} is not past extent {max(extents)}")
        checker.fixes.append(partial(meta.set_next_extent, extent_id=max(extents) + 1))
    bad = []
    for k, v in meta.namespace_rows():
        try:
            json.loads(v.decode())
        except (UnicodeDecodeError, ValueError):
            bad.append(k)
    for k in bad:
        checker.find("meta", DAMAGE, f"namespace record {k!r} is not valid JSON")
        checker.fixes.append(partial(meta.drop_namespace, key=k))
