"""Shared fixtures: both anyio backends, Hypothesis profiles (zarr-style tiers), and
temporary files kept under pytest's base temp directory."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

# Profiles (docs/development.md, "Property tests"): `default` is what a plain
# `python -m pytest` draws (random, a new seed each run); `ci` is derandomised, the same
# examples every run; `random` is CI's second, randomised pass: `default`'s draws with a
# larger budget, no example database, so that `--hypothesis-seed=N` alone replays a run;
# `nightly` runs long.  No deadline and no too_slow check anywhere: a shared 2-core
# machine makes timing a flake, never a finding.
# The base is Hypothesis' own default profile, not whatever is current: with CI set in
# the environment Hypothesis loads its built-in `ci` profile (derandomised), and a
# profile built on that would ignore --hypothesis-seed.
_NO_TIMING = settings(settings.get_profile("default"), deadline=None,
                      suppress_health_check=[HealthCheck.too_slow,
                                             HealthCheck.function_scoped_fixture])
settings.register_profile("ci", _NO_TIMING, derandomize=True, max_examples=30, database=None,
                          print_blob=True)
settings.register_profile("default", _NO_TIMING, max_examples=50)
settings.register_profile("random", _NO_TIMING, max_examples=100, database=None, print_blob=True)
settings.register_profile("nightly", _NO_TIMING, max_examples=2000)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default")
settings.load_profile(PROFILE)


def pytest_report_header(config: pytest.Config) -> str:
    """Which examples the property tests draw, and how to draw them again."""
    current = settings.get_profile(PROFILE)
    seed = config.getoption("hypothesis_seed", None)
    how = "derandomised" if current.derandomize else \
        f"seed {seed}" if seed is not None else "a new random seed per test"
    replay = f"; replay any of its tests: HYPOTHESIS_PROFILE={PROFILE} python -m pytest " \
             f"TEST --hypothesis-seed={seed}" if seed is not None and not current.derandomize \
        else ""
    return f"hypothesis: profile {PROFILE!r}, {current.max_examples} examples, {how}{replay}"


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
