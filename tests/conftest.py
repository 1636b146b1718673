"""Shared fixtures: both anyio backends, Hypothesis profiles (zarr-style tiers), and
temporary files kept under pytest's base temp directory."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, max_examples=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("default", max_examples=50, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture])
settings.register_profile("nightly", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))


@pytest.fixture(scope="session", autouse=True)
def _temp_files_under_basetemp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every store a test makes lives under pytest's base temp directory: tests use
    ``tmp_path``, and whatever still asks ``tempfile`` (the Hypothesis state machines,
    subprocesses through ``TMPDIR``) lands there too.  ``pytest_sessionfinish`` below
    removes it all at the end of the run."""
    tmp = tmp_path_factory.mktemp("tempfile", numbered=False)
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(tmp)
    try:
        yield
    finally:
        if saved[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Test stores never outlive the run, failed or not.  pytest's own policy ("failed",
    pyproject.toml) keeps failed tests' directories and, after any failure, every
    session-scoped one (stores of hundreds of MiB), for the last three runs.  To keep a
    run's stores for a look, pass ``--basetemp=DIR``: a given base temp is left alone."""
    if session.config.option.basetemp:
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    base = getattr(factory, "_basetemp", None)  # None: no test asked for a temp dir
    if base is not None:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def pytest_terminal_summary(terminalreporter: object) -> None:
    """Print what the crash tests explored, so CI logs show it."""
    import sys

    for module, title in (("tests.test_crash", "crash consistency (exhaustive)"),
                          ("tests.test_stateful", "crash consistency (stateful)"),
                          ("tests.test_concurrent_stateful", "concurrent state machine")):
        stats = getattr(sys.modules.get(module), "STATS", None)
        if stats and any(stats.values()):
            line = ", ".join(f"{k}={v}" for k, v in stats.items())
            terminalreporter.write_line(f"{title}: {line}")  # type: ignore[attr-defined]
