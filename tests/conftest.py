"""Shared fixtures: both anyio backends, Hypothesis profiles (zarr-style tiers)."""

from __future__ import annotations

import os

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
