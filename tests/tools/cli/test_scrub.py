"""``python -m kvstore scrub`` (kvstore/tools/cli/scrub.py): checks every block, exit 1 with the
damaged ones quarantined, a JSON report, rates in human units, resuming by default; and
``stats`` says when a pass last completed."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import torch

import kvstore
from kvstore.testing import parts
from kvstore.tools.cli.scrub import parse_rate
from tests.conformance import SMALL_EXTENT, flip_payload_bit, keys, make_tensor
from tests.tools.cli.conftest import Run


def _fill(path: Path, n: int) -> list[kvstore.disk.format.IndexEntry]:
    async def run() -> list[kvstore.disk.format.IndexEntry]:
        async with kvstore.open(path, extent_bytes=SMALL_EXTENT) as store:
            await store.put_many(keys(n), [make_tensor(torch.float16, (4096,), i)
                                           for i in range(n)])
            entries = parts(store).index.get_entries(keys(n))
        return [e for e in entries if e is not None]

    return anyio.run(run)


def test_scrub_reports_and_quarantines_damage(cli: Callable[..., Run], tmp_path: Path) -> None:
    entries = _fill(tmp_path, 12)
    clean = cli("scrub", str(tmp_path))
    assert clean.returncode == 0, clean.stderr
    assert clean.stdout.startswith(f"scrubbed {tmp_path}: 12 blocks (")
    assert "0 failed" in clean.stdout and "now 12 blocks stored, 0 quarantined" in clean.stdout
    assert "last complete pass: never" not in cli("stats", str(tmp_path)).stdout

    flip_payload_bit(tmp_path, entries[3])
    damaged = cli("scrub", str(tmp_path), "--rate", "0", "--json")
    assert damaged.returncode == 1
    doc = json.loads(damaged.stdout)
    assert (doc["checked_blocks"], doc["failed_blocks"], doc["quarantined"], doc["blocks"],
            doc["complete"], doc["exit_code"]) == (12, 1, 1, 11, True, 1)
    again = cli("scrub", str(tmp_path), "--restart")  # the quarantined one: read again
    assert again.returncode == 0 and "1 quarantined read again, 0 restored" in again.stdout


def test_scrub_of_what_is_not_a_store_cannot_run(cli: Callable[..., Run], tmp_path: Path) -> None:
    res = cli("scrub", str(tmp_path / "nothing"))
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_rates_in_binary_units() -> None:
    assert parse_rate("64M") == 64 << 20
    assert parse_rate("1.5GiB/s") == 1.5 * (1 << 30)
    assert parse_rate("4096") == 4096
    assert parse_rate("0") is None
    with pytest.raises(argparse.ArgumentTypeError, match="bytes per second"):
        parse_rate("fast")
