"""Run ``python -m kvstore ARGS`` in this process (a subprocess costs seconds of imports)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvstore.tools.cli.main import main


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    """``python -m kvstore ARGS`` in this process (subprocesses cost seconds of imports)."""
    def run(*args: str) -> Run:
        try:
            code = main(list(args))
        except SystemExit as e:  # --help, --version
            code = int(e.code or 0)
        out, err = capsys.readouterr()
        return Run(code, out, err)

    return run
