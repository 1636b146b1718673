"""Importing liburing from several processes at once (the ranks of a tensor-parallel
engine opening their stores): ``kvstore.io.liburing_import`` serialises it, because
liburing's import helper (``dynamic_import``) rebuilds a cache file in the installed
package by remove-then-write whenever the package directory changed, and a concurrent
plain ``import liburing`` can then raise ``FileNotFoundError`` (seen in CI as a vLLM
rank failing to open its store; with plain imports this race fails a few of every
hundred imports here)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import kvstore.io.liburing_import as liburing_import

pytestmark = pytest.mark.skipif(importlib.util.find_spec("liburing") is None,
                                reason="liburing is not installed")
PROCESSES, IMPORTS = 4, 40

# Each racing process loads the helper by path (no `import kvstore`, torch: they reach
# the race at once), then IMPORTS times: forgets liburing, makes its import cache stale
# (the package directory's mtime changes, as when a .pyc is written beside it) and
# imports it again.  It prints how many imports failed.
RACER = """
import importlib.util, os, sys, time
spec = importlib.util.find_spec("liburing")
package = os.path.dirname(spec.origin)
s = importlib.util.spec_from_file_location("liburing_import", sys.argv[1])
helper = importlib.util.module_from_spec(s)
s.loader.exec_module(helper)
sys.stdin.read(1)
failed = 0
for i in range(int(sys.argv[2])):
    for name in [n for n in sys.modules if n.startswith(("liburing", "dynamic_import"))]:
        del sys.modules[name]
    stamp = time.time() + i
    os.utime(package, (stamp, stamp))
    try:
        helper.import_liburing()
    except FileNotFoundError:
        failed += 1
print(failed)
"""


def test_processes_importing_liburing_at_once_all_succeed() -> None:
    procs = [subprocess.Popen([sys.executable, "-c", RACER, liburing_import.__file__,
                               str(IMPORTS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
             for _ in range(PROCESSES)]
    for proc in procs:  # a start line, not a timer: every racer is blocked on stdin
        assert proc.stdin is not None
        proc.stdin.write(b"x")
        proc.stdin.flush()
    failed = []
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0
        failed.append(int(out))
    assert failed == [0] * PROCESSES


def test_the_helper_returns_the_module_and_reuses_it() -> None:
    module = liburing_import.import_liburing()
    assert hasattr(module, "io_uring")
    assert liburing_import.import_liburing() is module
    assert Path(liburing_import._lock_path()).exists()
