"""Per-rank store directories of a tensor/pipeline-parallel engine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import kvstore
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.ranks import rank_config, rank_dir, rank_dirs


def test_one_worker_keeps_the_configured_directory(tmp_path: Path) -> None:
    config = ConnectorConfig.from_extra({"path": str(tmp_path / "s"), "capacity_bytes": 1 << 30})
    assert rank_config(config, 0, 1) is config
    assert rank_dir(config.path, 0, 1) == config.path


def test_each_rank_gets_its_directory_and_share(tmp_path: Path) -> None:
    config = ConnectorConfig.from_extra({"path": str(tmp_path / "s"), "capacity_bytes": 1 << 30,
                                         "memory_bytes": 64 << 20})
    ranks = [rank_config(config, r, 4) for r in range(4)]
    assert [r.path for r in ranks] == rank_dirs(config.path, 4) == [
        str(tmp_path / "s" / f"rank-{r}-of-4") for r in range(4)]
    assert {(r.store.capacity_bytes, r.store.memory_bytes) for r in ranks} == {(1 << 28, 16 << 20)}
    assert not (tmp_path / "s").exists()  # made when a rank's store opens


def test_default_capacity_is_a_share_of_the_free_space(tmp_path: Path) -> None:
    config = ConnectorConfig.from_extra({"path": str(tmp_path / "s")})
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    one, two = (rank_config(config, 0, n).store.capacity_bytes for n in (2, 4))
    assert one is not None and two is not None
    # each rank: 90% of the free space divided by the world size (the test's own files
    # may change free space a little between the calls)
    assert abs(one - 0.9 * free / 2) < 0.01 * free and abs(two - 0.9 * free / 4) < 0.01 * free


def test_rank_stores_open_side_by_side(tmp_path: Path) -> None:
    """Each rank directory is a store of its own (its own lock): both open at once."""
    config = ConnectorConfig.from_extra({"path": str(tmp_path / "s"), "extent_bytes": 4 << 20,
                                         "capacity_bytes": 64 << 20})
    a, b = (rank_config(config, r, 2) for r in range(2))
    with kvstore.open_blocking(a.path, **a.open_options()) as sa, \
            kvstore.open_blocking(b.path, **b.open_options()) as sb:
        assert sa.stats().capacity_bytes == sb.stats().capacity_bytes == 32 << 20
    # the directory above them made by the stores, private as their own
    assert os.stat(tmp_path / "s").st_mode & 0o077 == 0


@pytest.mark.parametrize("rank, world", [(2, 2), (-1, 2), (0, 0)])
def test_bad_ranks_are_refused(tmp_path: Path, rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="rank"):
        rank_dir(str(tmp_path), rank, world)
