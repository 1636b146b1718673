"""``benchmarks/marks_cost.py`` runs end to end and reports every call it times.  No
timing is asserted (a shared machine makes time meaningless)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import marks_cost
from kvstore.io import marks


@pytest.mark.skipif(not marks.native()[0], reason=marks.native()[1])
def test_marks_cost_reports_every_call(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert marks_cost.main(["--dir", str(tmp_path), "--rounds", "3", "--calls", "100",
                            "--out-dir", str(out)]) == 0
    [doc_path] = out.glob("marks_cost_at_*.json")
    doc = json.loads(doc_path.read_text())
    assert len(doc["ns_per_call"]) == 4
    assert all(v["median"] > 0 for v in doc["ns_per_call"].values())
    assert list(tmp_path.iterdir()) == [out]  # its scratch directory is gone
