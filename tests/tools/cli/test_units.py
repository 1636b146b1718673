"""Human units (kvstore/tools/cli/units.py) and the byte progress bar (kvstore/tools/cli/progress.py)."""

from __future__ import annotations

import pytest

from kvstore.tools.cli.progress import Progress
from kvstore.tools.cli.units import human_bytes


def test_human_units() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 4 << 20, 123 << 30, 2 << 40)] == \
        ["0 B", "1023 B", "1.00 KiB", "1.50 KiB", "4.00 MiB", "123 GiB", "2.00 TiB"]


def test_byte_progress_bar_prints_human_units(capsys: pytest.CaptureFixture[str]) -> None:
    bar = Progress("fsck --deep: payloads", 3 << 30, "bytes")
    bar.advance(1 << 30)
    bar.close()
    err = capsys.readouterr().err
    assert "1.00 GiB of 3.00 GiB" in err and str(1 << 30) not in err
