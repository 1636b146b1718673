"""The tests' real KV data ships with them (tests/realdata.py, tests/data/kv)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.realdata import BUNDLED, FILES, require_kv_dir


def test_the_sample_ships_in_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTORE_TEST_DATA", raising=False)
    assert require_kv_dir() == BUNDLED
    assert all((BUNDLED / f).is_file() for f in FILES)
    assert np.load(BUNDLED / "smollm2_sample_K_fp16.npy").shape == (4, 128, 3, 64)
    assert sum((BUNDLED / f).stat().st_size for f in FILES) < 1_500_000


def test_missing_data_skips_locally_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    monkeypatch.setenv("KVSTORE_TEST_DATA", str(tmp_path))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="real KV data not found"):
        require_kv_dir()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="in CI this is an error, not a skip"):
        require_kv_dir()
