"""Other owners' idle claims come back when a put needs them (issue 43,
kvstore/core/claim_requests.py): a live owner gives them back when asked, a dead one is
recovered by the asking owner (no reopen), and one that cannot answer (stopped) leaves
the put refused with an error that names what it holds, until it runs again.  A put
waiting for space that a dead owner's read mark holds probes for dead owners after
100 ms (kvstore/core/free_space.py) and goes on."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import torch

import kvstore
from kvstore.index.space_counters import CLAIMED
from kvstore.testing import parts
from kvstore.tools import fsck
from tests.conformance import NS, keys, same
from tests.core.test_owners import script_running

EXTENT = 64 << 10
CAPACITY = 24 * 4096  # a quantum is a quarter of it: 6 pages
BLOCK = 2048  # floats: a 12 KiB slot (3 pages)


def open_here(path: Path) -> kvstore.BlockingStore:
    return kvstore.open_blocking(path, namespace=NS, extent_bytes=EXTENT, engine="threads",
                                 capacity_bytes=CAPACITY)


def value(i: int) -> torch.Tensor:
    return torch.full((BLOCK,), float(i))


def claimed_by(store: kvstore.BlockingStore) -> tuple[int, int]:
    """(bytes in the owner's claims rows, the store's claimed_bytes counter)."""
    index, owner = parts(store).index, parts(store).owner.id
    with index.begin() as txn:
        mine = sum(length for _, _, length in index.space.claims_of(txn, owner))
        return mine, index.space.read(txn)[CLAIMED] or 0


def put_under(store: kvstore.BlockingStore, parent: bytes, n: int) -> list[bytes]:
    """A chain of ``n`` blocks under ``parent`` (which the put protects: not evictable)."""
    ks = keys(n + 1)[1:]
    store.put_many(ks, [value(i) for i in range(1, n + 1)],
                   parents=kvstore.chain_parents(ks, parent))
    return ks


def test_an_idle_owners_claims_come_back_when_another_needs_them(tmp_path: Path) -> None:
    """A put one block and holds the rest of its quantum (3 idle pages); B's chain of 7
    blocks under it needs 21 of the 24 pages, and A's block, their parent, cannot be
    evicted: B asks, A's listener gives its idle claims back, B's put is stored (it was
    refused before the requests: the capacity lacked A's idle pages)."""
    with open_here(tmp_path) as a, open_here(tmp_path) as b:
        first = keys(1)[0]
        a.put_many([first], [value(0)])
        assert claimed_by(a)[0] == 3 * 4096  # idle: a quantum of 6 pages, 3 used
        ks = put_under(b, first, 7)
        assert parts(a).allocator.requests.answered == 1  # type: ignore[union-attr]
        assert parts(b).allocator.requests.asked == 1  # type: ignore[union-attr]
        assert claimed_by(a)[0] == 0
        assert all(same(g, value(i)) for i, g in zip(range(1, 8), a.get_many(ks)))
        assert same(b.get_many([first])[0], value(0))
        assert b.used_bytes <= CAPACITY
    assert fsck.check(str(tmp_path)).findings == []


CLAIMER = textwrap.dedent("""
    import sys, torch, kvstore
    from tests.conformance import NS, keys
    store = kvstore.open_blocking(sys.argv[1], namespace=NS, extent_bytes=64 << 10,
                                  engine="threads")
    store.put_many(keys(1), [torch.full((2048,), 0.0)])
    print("claimed", flush=True)
    sys.stdin.readline()
    store.close()
    print("closed", flush=True)
""")


def claimer(path: Path) -> AbstractContextManager[subprocess.Popen[str]]:
    """Another process that put keys(1)[0] (holding 3 idle claimed pages) and waits on
    its stdin; killed at the end if it is still running."""
    return script_running(CLAIMER, path, "claimed\n")


def test_a_dead_owners_claims_are_recovered_by_the_owner_that_needs_them(
        tmp_path: Path) -> None:
    """The other process holds idle claims and is SIGKILLed: B (open all along, so no
    open recovers it) finds it dead when its put lacks room, recovers it in one
    transaction and stores its chain; the dead owner's block stays."""
    with open_here(tmp_path) as b:
        with claimer(tmp_path) as proc:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        first = keys(1)[0]
        assert claimed_by(b) == (0, 3 * 4096)  # the dead owner's idle claims
        ks = put_under(b, first, 7)
        assert parts(b).owner.recovered == 1
        assert claimed_by(b)[1] == claimed_by(b)[0]  # nobody else holds any
        assert all(same(g, value(i)) for i, g in zip(range(8), b.get_many([first, *ks])))
    assert fsck.check(str(tmp_path)).findings == []


def test_an_owner_that_cannot_answer_leaves_the_put_refused_naming_its_claims(
        tmp_path: Path) -> None:
    """The other process is stopped (SIGSTOP): B's put waits for an answer, then is
    refused with a CapacityError naming the bytes the other owners hold, and B's store
    is as before; once the process runs again (SIGCONT) the same put is stored."""
    with open_here(tmp_path) as b, claimer(tmp_path) as proc:
        first = keys(1)[0]
        requests = parts(b).allocator.requests
        assert requests is not None
        requests.answer_wait_s = 0.5
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(kvstore.CapacityError, match="12288 bytes are claimed by "
                               "other owners of the store that did not give them back"):
                put_under(b, first, 7)
            assert b.contains_many(keys(8)) == [True] + [False] * 7
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        requests.answer_wait_s = 60.0  # (the listener answers within 50 ms once it runs)
        ks = put_under(b, first, 7)
        assert all(same(g, value(i)) for i, g in zip(range(1, 8), b.get_many(ks)))
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "closed\n"
    assert fsck.check(str(tmp_path)).findings == []


MARKER = textwrap.dedent("""
    import sys, kvstore
    from kvstore.testing import parts
    from tests.conformance import NS
    store = kvstore.open_blocking(sys.argv[1], namespace=NS, extent_bytes=64 << 10,
                                  engine="threads")
    parts(store).owner.marks.begin()  # a read that never ends: its mark stays
    print("marked", flush=True)
    sys.stdin.readline()
""")


def test_space_a_dead_owners_mark_holds_comes_back_to_a_waiting_put(tmp_path: Path
                                                                      ) -> None:
    """Another process publishes a read mark and is SIGKILLed with it in place; A's
    blocks, deleted after the mark, stay pending (a reader may still copy them), and
    A's next put needs their space (nothing else to evict: it waits for them).  After
    100 ms of waiting it finds the dead owner, recovers it (its mark cleared), and the
    put is stored; before, it waited for ever."""
    with open_here(tmp_path) as a:
        old = keys(7)
        a.put_many(old, [value(i) for i in range(7)])
        with script_running(MARKER, tmp_path, "marked\n") as proc:
            assert a.delete_many(old) == 7
            assert parts(a).allocator.pending_free_bytes == 7 * 3 * 4096
            os.kill(proc.pid, signal.SIGKILL)  # its mark stays in place
        new = keys(14)[7:]
        a.put_many(new, [value(10 + i) for i in range(7)])
        assert parts(a).owner.recovered == 1
        assert parts(a).counters["evicted_blocks"] == 0  # it waited, it did not evict
        assert all(same(g, value(10 + i)) for i, g in enumerate(a.get_many(new)))
        assert a.contains_many(old) == [False] * 7
    assert fsck.check(str(tmp_path)).findings == []
