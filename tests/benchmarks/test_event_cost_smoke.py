"""``benchmarks/event_cost.py`` runs end to end: both modes measured each repetition, the
subscriber read every event the store published while it was on, nothing dropped.  No
timing is asserted (a shared machine makes time meaningless)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import event_cost


def test_event_cost_measures_both_ways_and_reads_every_event(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    rc = event_cost.main(["--dir", str(tmp_path), "--block", "64K", "--capacity", "4M",
                          "--batch", "4", "--callers", "2", "--seconds", "0.05",
                          "--reps", "2", "--out-dir", str(out)])
    assert rc == 0
    [doc_path] = out.glob("event_put_cost_64KiB_at_*.json")
    doc = json.loads(doc_path.read_text())
    assert len(doc["reps"]) == 2
    for rep in doc["reps"]:
        assert rep["alone"]["put_MBps"] > 0 and rep["subscribed"]["put_MBps"] > 0
        assert rep["alone"]["events"] == 0 < rep["subscribed"]["events"]
        assert rep["subscribed"]["cpu_s_per_GB"] > 0
    # every event published reached the one subscriber
    assert sum(r["subscribed"]["events"] for r in doc["reps"]) == doc["events_published"]
    assert doc["events_dropped"] == 0
    assert 0 < doc["ratio"]["min"] <= doc["ratio"]["median"] <= doc["ratio"]["max"]
    assert (out / doc_path.name.replace(".json", ".md")).read_text().startswith(
        "# What one event subscriber costs durable puts")


def test_event_cost_puts_tagged_blocks_when_asked(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    rc = event_cost.main(["--dir", str(tmp_path), "--block", "64K", "--capacity", "4M",
                          "--batch", "4", "--seconds", "0.05", "--reps", "1", "--tags", "200",
                          "--out-dir", str(out)])
    assert rc == 0
    [doc_path] = out.glob("event_put_cost_64KiB_tags200_at_*.json")
    doc = json.loads(doc_path.read_text())
    assert doc["tag_bytes"] == 200 and doc["reps"][0]["subscribed"]["events"] > 0
    assert "each with a 200-byte tag" in (out / doc_path.name.replace(".json", ".md")).read_text()
