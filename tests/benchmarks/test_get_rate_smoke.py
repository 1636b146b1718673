"""``benchmarks/get_rate.py`` runs end to end, alone and across trees.  No timing is
asserted (a shared machine makes time meaningless)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import get_rate

ROOT = Path(__file__).resolve().parents[2]


def test_get_rate_across_trees_reports_each(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert get_rate.main(["--dir", str(tmp_path), "--calls", "20", "--trees", str(ROOT),
                          "--rounds", "1", "--out-dir", str(out)]) == 0
    [doc_path] = out.glob("get_rate_*.json")
    doc = json.loads(doc_path.read_text())
    assert list(doc["trees"]) == [str(ROOT)]
    assert doc["trees"][str(ROOT)]["median"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # its stores are gone
