"""What ``python -m kvstore fsck`` reports: findings, each *reclaimable* (what a crash
legitimately leaves behind), *damage* (what the store never produces on its own: a bad
sector, a bug, a file edited by hand) or a *note* (listed, not a problem), and the
report with the process exit code they make (kvstore/tools/fsck.py runs the checks)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["DAMAGE", "NOTE", "RECLAIMABLE", "Finding", "ProgressFn", "Report"]

RECLAIMABLE = "reclaimable"
DAMAGE = "damage"
NOTE = "note"  # listed (and cleaned by --repair) but not a problem: does not change the exit code

ProgressFn = Callable[[str, int, int], None]


@dataclass
class Finding:
    kind: str
    severity: str
    detail: str
    extent: int | None = None
    offset: int | None = None
    length: int | None = None
    key: str | None = None
    fixed: bool = False
    errno: int | None = None  # the kernel's, for what could not be read or written


@dataclass
class Report:
    path: str
    deep: bool
    repair: bool
    blocks: int = 0
    quarantined: int = 0
    extents: int = 0
    payloads_verified: int = 0
    chain_holes: int = 0  # stored blocks whose parent is not stored (step 8)
    chain_hole_examples: list[str] = field(default_factory=list)
    # beside live processes (the check shares the store): their pids, and the slots that
    # failed but whose key's entry names another slot now (reused meanwhile: not damage)
    live_owners: list[int] = field(default_factory=list)
    slots_changed: int = 0
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def damage(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == DAMAGE]

    @property
    def reclaimable(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == RECLAIMABLE]

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.severity != NOTE]

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["exit_code"] = self.exit_code
        return d
