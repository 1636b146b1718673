"""Where the real SmolLM2 KV sample is, for the kernel tests on real data."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def kv_data_dir() -> Path:
    """``$KVSTORE_TEST_DATA`` (tests/gpu/run_gpu_checks.sh points it at the carried copy:
    shared/ beside a checkout does not travel to the GPU machine), else
    ``../shared/data/kv`` beside the checkout (the project's layout), else
    ``shared/data/kv`` inside it; the first that exists (the tests skip without one)."""
    env = os.environ.get("KVSTORE_TEST_DATA")
    candidates = [Path(env)] if env else []
    candidates += [ROOT.parent / "shared" / "data" / "kv", ROOT / "shared" / "data" / "kv"]
    return next((d for d in candidates if d.is_dir()), candidates[0])
