"""Sequence numbers are leased per owner (issue 43, kvstore/core/seq_lease.py): two
owners of one store, in two processes, never hand out the same number; a lease that
runs out is renewed (a batch larger than a lease gets one of its size); a reopened
store numbers after every lease handed out before."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kvstore
import kvstore.core.seq_lease
from kvstore.testing import parts
from tests.conformance import NS, keys

ROOT = Path(__file__).resolve().parents[2]

SECOND_OWNER = textwrap.dedent("""
    import sys, kvstore, kvstore.core.owners
    from tests.conformance import NS
    from kvstore.testing import parts
    # Registration only: this owner writes nothing (space is not shared yet).
    with kvstore.open_blocking(sys.argv[1], namespace=NS, engine="threads") as store:
        lease = parts(store).owner.seqs
        print(lease.next, lease.end)
""")


def open_here(path: Path) -> kvstore.BlockingStore:
    return kvstore.open_blocking(path, namespace=NS, extent_bytes=1 << 20, engine="threads")


def seqs(store: kvstore.BlockingStore) -> list[int]:
    return sorted(e.seq for _, e in parts(store).index.iter_entries())


def test_two_live_owners_lease_disjoint_numbers(tmp_path: Path) -> None:
    with open_here(tmp_path) as store:
        mine = parts(store).owner.seqs
        run = subprocess.run([sys.executable, "-c", SECOND_OWNER, str(tmp_path)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        first, end = map(int, run.stdout.split())
        assert end - first == mine.end - mine.next == kvstore.core.seq_lease.SEQ_LEASE
        assert first >= mine.end  # after every number this owner may hand out
        store.put_many(keys(3), [torch.ones(4)] * 3)
        assert all(mine.next - 3 <= s < mine.end for s in seqs(store))


def test_a_lease_that_runs_out_is_renewed(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvstore.core.seq_lease, "SEQ_LEASE", 4)
    ks = keys(16)
    with open_here(tmp_path) as store:
        for i in range(0, 9, 3):  # three batches of 3 through leases of 4
            store.put_many(ks[i:i + 3], [torch.ones(4)] * 3)
        store.put_many(ks[9:15], [torch.ones(4)] * 6)  # larger than a lease
        got = seqs(store)
        assert len(set(got)) == 15
        recorded = parts(store).index.meta_records.seq()
        assert recorded >= max(got)
    with open_here(tmp_path) as again:
        again.put_many(ks[15:], [torch.ones(4)])
        [last] = [e.seq for k, e in parts(again).index.iter_entries() if k == ks[15]]
        assert last > recorded  # a new owner leases after everything leased before
