"""``import liburing``, safe when several processes do it at once.

The PyPI ``liburing`` package (2024.5.3) finds its compiled modules through
``dynamic_import``, which keeps a cache file inside the installed package
(``liburing/__pycache__/__init__.importer-311.pyc``) and rebuilds it whenever the
package directory's modification time changed (a new ``.pyc`` written beside it is
enough): it removes the file, then writes it again.  Two processes importing liburing
at that moment (the ranks of a tensor-parallel engine, each opening its store, in a
fresh environment) race: one removes the file the other is reading or about to remove,
and ``import liburing`` raises ``FileNotFoundError`` — which used to stop a vLLM rank at
start ("cannot open the store").

So the import is serialised across processes with a lock file (``flock``; released
by the kernel if the process dies), and a ``FileNotFoundError`` from a process that
does not take the lock (another program importing liburing) is retried.
"""

from __future__ import annotations

import fcntl
import importlib
import os
import sys
import tempfile
from types import ModuleType

_ATTEMPTS = 5


def _lock_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"kvstore-liburing-import-{os.getuid()}.lock")


def import_liburing() -> ModuleType:
    """The ``liburing`` module; ``ImportError`` if it is not installed."""
    module = sys.modules.get("liburing")
    if module is not None:
        return module
    fd = os.open(_lock_path(), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for attempt in range(_ATTEMPTS):
            try:
                return importlib.import_module("liburing")
            except FileNotFoundError:
                # a process outside this lock rebuilt the cache under us: the failed
                # import left nothing in sys.modules, so try again
                sys.modules.pop("liburing", None)
                if attempt == _ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")
    finally:
        os.close(fd)  # releases the lock
