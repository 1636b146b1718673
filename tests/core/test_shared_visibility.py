"""A block another process stored is a hit here on the next lookup, even in an extent
file this process has never opened (issue 43, DESIGN.md 6.7): the read opens the extent
when an entry first names it; only a file that does not exist is missing.  Before,
every extent unknown to this process was "missing": the block was answered as a miss
and quarantined.

The other process is a real one.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import kvstore
from kvstore.testing import parts
from kvstore.tools import fsck
from tests.conformance import NS, keys

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 300_000  # three per 1 MiB extent

OTHER = textwrap.dedent("""
    import sys, torch, kvstore, kvstore.core.owners
    from tests.conformance import NS, keys
    from kvstore.testing import parts
    with kvstore.open_blocking(sys.argv[1], namespace=NS, engine="threads") as store:
        ks = keys(8)[1:]
        store.put_many(ks, [torch.full((300_000,), i, dtype=torch.uint8)
                            for i in range(1, 8)])
        print(*sorted(parts(store).fds))
""")


def test_a_block_another_process_stored_in_a_new_extent_is_a_hit(tmp_path: Path) -> None:
    ks = keys(8)
    with kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=1 << 20,
                               engine="threads") as store:
        store.put_many(ks[:1], [torch.zeros(BLOCK, dtype=torch.uint8)])
        assert sorted(parts(store).fds) == [1]
        run = subprocess.run([sys.executable, "-c", OTHER, str(tmp_path)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        theirs = [int(x) for x in run.stdout.split()]
        assert len(theirs) >= 3  # it added extents this process never opened
        got = store.get_many(ks)
        assert [g is not None for g in got] == [True] * 8
        for i, g in enumerate(got):
            assert g is not None and torch.equal(g, torch.full((BLOCK,), i, dtype=torch.uint8))
        assert store.stats().quarantined_blocks == 0
        assert sorted(parts(store).fds) == theirs  # opened as entries named them
    assert fsck.check(str(tmp_path)).problems == []


LIVE_WRITER = textwrap.dedent("""
    import sys, torch, kvstore, kvstore.core.owners
    from tests.conformance import NS, keys
    with kvstore.open_blocking(sys.argv[1], namespace=NS) as store:
        for i, k in enumerate(keys(int(sys.argv[2]))):
            sys.stdin.readline()
            store.put(k, torch.full((4096,), i, dtype=torch.uint8))
            print("acked", flush=True)
        sys.stdin.readline()
""")


def test_a_put_acknowledged_in_a_live_process_is_a_hit_at_the_next_lookup(tmp_path: Path
                                                                         ) -> None:
    """Both processes stay open: each block the other one acknowledges is a hit here at
    the very next lookup (no reopen, no wait), and was a miss at the lookup before."""
    n = 5
    ks = keys(n)
    with kvstore.open_blocking(tmp_path, namespace=NS) as store:
        writer = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, str(tmp_path), str(n)],
                                  cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        assert writer.stdin is not None and writer.stdout is not None
        try:
            for i, k in enumerate(ks):
                assert store.contains_many([k]) == [False]
                writer.stdin.write("\n")
                writer.stdin.flush()
                assert writer.stdout.readline().strip() == "acked"
                assert store.contains_many([k]) == [True], f"block {i} not seen"
                got = store.get(k)
                assert got is not None and torch.equal(
                    got, torch.full((4096,), i, dtype=torch.uint8))
            writer.stdin.write("\n")
            writer.stdin.flush()
            assert writer.wait(timeout=120) == 0
        finally:
            writer.kill()
