"""The blocking facade (kvstore/blocking.py): what a synchronous script sees."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import kvstore
from tests.conformance import NS, SMALL_EXTENT

ROOT = Path(__file__).resolve().parents[1]


def test_blocking_roundtrip(tmp_path: Path) -> None:
    key = NS.chain_keys(list(range(16)))[0]
    value = torch.arange(64, dtype=torch.float16)
    with kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        assert store.put(key, value)
        assert store.contains(key)
        got = store.get(key)
        assert got is not None and torch.equal(got, value)
        assert store.stats().blocks == 1


def test_script_that_never_closes_exits_and_keeps_its_puts(tmp_path: Path) -> None:
    """A script that opens with open_blocking() and exits without close() used to hang at
    interpreter exit; it must exit 0, with its acknowledged put stored and the lock free."""
    script = textwrap.dedent(f"""
        import sys, torch, kvstore
        from tests.conformance import NS
        store = kvstore.open_blocking(sys.argv[1], namespace=NS, extent_bytes={SMALL_EXTENT})
        store.put(NS.chain_keys(list(range(16)))[0], torch.arange(64, dtype=torch.float16))
        print("put acknowledged", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "put acknowledged" in proc.stdout
    # closed at exit: the lock is free and the block reads back
    with kvstore.open_blocking(tmp_path, namespace=NS, create=False) as store:
        got = store.get(NS.chain_keys(list(range(16)))[0])
        assert got is not None and torch.equal(got, torch.arange(64, dtype=torch.float16))
