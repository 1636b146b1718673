"""``python -m kvstore bench --smoke`` runs end to end and writes a sane report.

No timing is asserted (the shared CI machine makes time meaningless); what is checked is
that every part of the benchmark ran, measured something positive, read back exactly
what was written, and reported it in the JSON, the markdown and (with matplotlib) the
PNG.  LMCache is not installed in CI: it must be skipped with a note, not fail the run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench
from kvstore.tools.cli.main import main as cli_main

KVSTORE = ["kvstore io_uring raw", "kvstore io_uring fp8", "kvstore threads raw",
           "kvstore threads fp8"]
FILE_PEERS = ["file-per-block", "torch.save", "numpy"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench-out")
    scratch = tmp_path_factory.mktemp("bench-scratch")
    # through the CLI, as a user runs it; LMCache pointed at a path that does not exist
    rc = cli_main(["bench", "--smoke", "--quiet", "--out", str(out), "--dir", str(scratch),
                   "--lmcache-python", str(scratch / "no-such-venv" / "bin" / "python")])
    assert rc == 0
    doc = json.loads((out / "bench.json").read_text())
    return out, doc


def test_every_system_measured_both_ways_and_read_back_exactly(
        smoke: tuple[Path, dict[str, Any]]) -> None:
    _, doc = smoke
    blocks = doc["config"]["block_sizes"]
    assert blocks == list(bench.SMOKE_BLOCKS)
    systems = KVSTORE + FILE_PEERS + (["fio"] if shutil.which("fio") else [])
    for system in systems:
        for op in ("put", "get"):
            got = [s for s in doc["samples"] if (s["system"], s["op"]) == (system, op)]
            assert sorted(s["block_bytes"] for s in got) == sorted(blocks), (system, op)
            for s in got:
                assert s["seconds"] > 0 and s["MB_s"] > 0
                assert s["bytes"] == s["blocks"] * s["block_bytes"] > 0
                assert s.get("bad", 0) == 0, (system, op, s)
    if shutil.which("fio"):  # the page-cache reference read
        assert sorted(s["block_bytes"] for s in doc["samples"]
                      if s["system"] == "fio buffered") == sorted(blocks)
    assert not doc["notes"], doc["notes"]  # no failures, no wrong bytes
    for row in doc["summary"]:
        mb = row["MB_s"]
        assert 0 < mb["min"] <= mb["median"] <= mb["max"]


def test_missing_peers_are_skipped_with_a_note(smoke: tuple[Path, dict[str, Any]]) -> None:
    _, doc = smoke
    assert not any(s["system"] == "lmcache" for s in doc["samples"])
    assert any(n.startswith("lmcache: not installed") and "--install-peers" in n
               for n in doc["skipped"])
    if shutil.which("fio") is None:
        assert any(n.startswith("fio: not found") for n in doc["skipped"])


def test_latency_scale_and_targets_are_reported(smoke: tuple[Path, dict[str, Any]]) -> None:
    out, doc = smoke
    lat = {(r["system"], r["op"]): r for r in doc["latency"]}
    for system in ("kvstore io_uring raw", "kvstore threads raw", "file-per-block"):
        for op in ("put", "get"):
            r = lat[(system, op)]
            assert r["batches"] == 2 and len(r["samples_ms"]) == 2
            assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
    (row,) = doc["scale"]
    assert row["blocks"] == 500 and row["chain"] == 500
    assert row["open_cold_s"] > 0 and row["open_warm_s"] > 0
    assert 0 < row["match_prefix_ms"]["min"] <= row["match_prefix_ms"]["median"]
    assert row["rss_after_open"] >= row["rss_before_open"] > 0
    names = {t["target"] for t in doc["targets"]}
    assert "put 1 MiB >= 0.9x fio" in names or shutil.which("fio") is None
    assert "store 64 KiB >= 3x file-per-block" in names
    assert any(n.startswith("open() of 500 blocks") for n in names)
    for t in doc["targets"]:
        assert t["met"] in (True, False)
        assert t["value"] >= 0 if t.get("reported") else t["value"] > 0, t
    md = (out / "bench.md").read_text()
    assert "## Targets" in md and "## Store (durable), MB/s" in md and "| numpy |" in md
    if doc["plot"]:
        assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert any(n.startswith("plot: matplotlib") for n in doc["skipped"])


def test_one_caller_vs_four_with_cpu_cost_is_reported(
        smoke: tuple[Path, dict[str, Any]]) -> None:
    out, doc = smoke
    part = doc["callers"]
    blocks = list(bench.SMOKE_CALLER_BLOCKS)
    assert part["config"]["block_sizes"] == blocks and part["config"]["callers"] == [1, 4]
    systems = ["kvstore"] + (["fio"] if shutil.which("fio") else [])
    for system in systems:
        for callers in (1, 4):
            for op in ("put", "get"):
                got = [s for s in part["samples"]
                       if (s["system"], s["callers"], s["op"]) == (system, callers, op)]
                assert sorted(s["block_bytes"] for s in got) == blocks, (system, callers, op)
                for s in got:
                    assert s["MB_s"] > 0 and s["cpu_s"] >= 0 and s.get("bad", 0) == 0, s
                    assert s["bytes"] == s["blocks"] * s["block_bytes"]
                    assert s["blocks"] % 4 == 0  # 1 and 4 callers move the same blocks
    kv_samples = [s for s in part["samples"] if s["system"] == "kvstore"]
    assert all(s["rss_peak"] >= s["rss_before"] > 0 for s in kv_samples)
    assert len(part["summary"]) == 2 * len(blocks) * 2  # op x block x callers
    names = {t["target"] for t in doc["targets"]}
    for callers in ("1 caller", "4 concurrent callers"):
        assert f"put 64 KiB >= 0.5x fio IOPS, {callers}" in names or not shutil.which("fio")
        assert f"get 1 MiB >= 0.9x fio, {callers}" in names or not shutil.which("fio")
    assert {"CPU cost of put: kvstore core-seconds per GB (reported)",
            "CPU cost of get: kvstore core-seconds per GB (reported)"} <= names
    assert any(n.startswith("memory: largest RSS growth") for n in names)
    md = (out / "bench.md").read_text()
    assert "## One caller vs 4 concurrent callers, CPU cost, memory" in md
    assert "| put | 64 KiB | 4 (" in md and "| reported |" in md


def test_mixed_load_latency_is_reported(smoke: tuple[Path, dict[str, Any]]) -> None:
    out, doc = smoke
    m = doc["mixed"]
    assert m["bad"] == 0
    for phase in ("idle", "loaded"):
        p = m[phase]
        assert p["batches"] == 2 == len(p["samples_ms"])  # 2 batches, 1 repetition
        assert 0 < p["p50_ms"] <= p["p99_ms"] <= p["max_ms"]
    assert m["p99_ratio"] == m["loaded"]["p99_ms"] / m["idle"]["p99_ms"]
    (stream,) = m["streams"]
    assert stream["bg_bytes"] > 0 and stream["bg_MB_s"] >= 0
    assert any(t["target"] == "foreground get p99 under a put stream <= 1.5x idle"
               for t in doc["targets"])
    assert "## Foreground gets under a background put stream" in (out / "bench.md").read_text()
