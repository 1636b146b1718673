"""``python -m kvstore stats`` (kvstore/tools/cli/stats.py, kvstore/tools/index_stats.py):
human units, the store's totals, exact numbers and namespaces as objects in --json; read
from the index beside a live process that has the store open (its pid listed), nothing
written."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import anyio
import torch

import kvstore
from tests.conformance import NS, SMALL_EXTENT, keys, make_tensor
from tests.tools.cli.conftest import Run
from tests.tools.test_fsck import N, build
from tests.tools.test_fsck_live import live_owner, store_state


def test_stats_human_units_totals_and_json(cli: Callable[..., Run], tmp_path: Path) -> None:
    ks = keys(3)
    values = [make_tensor(torch.float16, (65536,), i) for i in range(3)]  # 128 KiB each

    async def fill() -> None:
        async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
            await store.put_many(ks, values)
            await store.put_many(ks[:2], values[:2])  # deduplicated

    anyio.run(fill)
    text = cli("stats", str(tmp_path))
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert "since the store was created (all processes; kept in the index):" in lines
    assert "  puts       2 batches, 3 blocks written (384 KiB)" in lines
    assert "  dedup      2 blocks (256 KiB) not written again; offered / written 1.67x" in lines
    assert "open in      no process" in lines
    assert "4.00 MiB on disk in 1 extent file(s) of 4.00 MiB" in text.stdout

    doc = json.loads(cli("stats", str(tmp_path), "--json").stdout)
    assert doc["namespaces"] == [json.loads(NS.canonical_json())]
    assert doc["totals"]["put_bytes"] == 3 * 131072 and doc["totals"]["dedup_blocks"] == 2
    assert doc["disk_bytes"] == SMALL_EXTENT  # exact numbers in JSON
    assert doc["live_owners"] == [] and "puts" not in doc  # (no counters of its own)
    assert doc["used_bytes"] == doc["stored_bytes"] == 3 * (131072 + 4096)
    assert doc["capacity_bytes"] is None  # never given: not recorded


def test_stats_beside_a_live_owner_lists_it_and_writes_nothing(
        cli: Callable[..., Run], tmp_path: Path) -> None:
    build(tmp_path)
    with live_owner(tmp_path) as owner:
        before = store_state(tmp_path)
        text = cli("stats", str(tmp_path))
        doc = json.loads(cli("stats", str(tmp_path), "--json").stdout)
        assert store_state(tmp_path) == before
    assert text.returncode == 0, text.stderr
    assert f"open in      pid {owner.proc.pid} (owner " in text.stdout
    assert [o["pid"] for o in doc["live_owners"]] == [owner.proc.pid]
    assert doc["blocks"] == N
