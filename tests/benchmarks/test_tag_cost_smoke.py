"""``benchmarks/tag_cost.py`` runs end to end and reports every mode.  No timing is
asserted (a shared machine makes time meaningless)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import tag_cost


def test_tag_cost_reports_the_four_modes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert tag_cost.main(["--dir", str(tmp_path), "--rounds", "3", "--tag", "64",
                          "--out-dir", str(out)]) == 0
    [doc_path] = out.glob("tag_cost_at_*.json")
    doc = json.loads(doc_path.read_text())
    assert set(doc["us_per_block"]) == {"none journal=off", "none journal=on",
                                        "tagged journal=off", "tagged journal=on"}
    assert all(v["median"] >= 0 for v in doc["us_per_block"].values())
    assert doc["tag_bytes"] == 64
    assert list(tmp_path.iterdir()) == [out]  # its scratch index is gone
