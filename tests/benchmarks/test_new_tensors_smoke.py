"""``benchmarks/new_tensors.py`` runs end to end (tiny sizes) and reports every kind of
read with the pool's ratios; the pool's bound is restored afterwards."""

from __future__ import annotations

import argparse
from pathlib import Path

import anyio

from benchmarks import new_tensors
from kvstore.codecs import result_buffers


def test_every_kind_of_read_is_measured_and_the_bound_restored(tmp_path: Path) -> None:
    before = result_buffers._pool.max_bytes
    args = argparse.Namespace(blocks=4, block_mib=0.5, reps=3)
    rows = anyio.run(new_tensors.measure, str(tmp_path), args)
    assert result_buffers._pool.max_bytes == before
    assert len(rows) == 6 and all(len(r["mbs"]) == 3 and len(r["cpu"]) == 3
                                  for r in rows.values())
    lines = new_tensors.report(rows, args, str(tmp_path))
    assert sum("pool on / off throughput" in line for line in lines) == 2
    assert sum(line.startswith("| disk, cold: new, pool on |") for line in lines) == 1
