"""Human-readable sizes for the CLI (binary units, as ``ls -h`` / ``du -h`` print them)."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; exact below 1 KiB; three significant digits above."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.3g} {unit}" if abs(value) >= 100 else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def disk_usage(path: str) -> int:
    """Bytes allocated on disk under ``path`` (``du``: preallocated extents count in full,
    sparse holes do not)."""
    import os

    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total
