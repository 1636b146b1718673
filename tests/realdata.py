"""Where the tests' real KV data is: ``tests/data/kv`` (bundled, 1.38 MB; see its
README), or ``KVSTORE_TEST_DATA``.  In CI (``CI`` set) missing data is a failure, never
a silent skip, as ``KVSTORE_REQUIRE_VLLM=1`` is for the engine tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

BUNDLED = Path(__file__).resolve().parent / "data" / "kv"
FILES = ("smollm2_sample_meta.json", "smollm2_sample_Q_fp16.npy", "smollm2_sample_K_fp16.npy",
         "smollm2_sample_V_fp16.npy", "smollm2_sample_K_bf16bits.npy",
         "smollm2_sample_V_bf16bits.npy")


def kv_dir() -> Path:
    env = os.environ.get("KVSTORE_TEST_DATA")
    return Path(env) if env else BUNDLED


def require_kv_dir() -> Path:
    """The data directory; skips the test when files are missing, fails in CI."""
    d = kv_dir()
    missing = [f for f in FILES if not (d / f).is_file()]
    if missing:
        why = (f"real KV data not found in {d} (missing {', '.join(missing)}); it ships in "
               "tests/data/kv, or set KVSTORE_TEST_DATA to a directory holding it")
        if os.environ.get("CI"):
            pytest.fail(f"{why}; in CI this is an error, not a skip", pytrace=False)
        pytest.skip(why)
    return d
