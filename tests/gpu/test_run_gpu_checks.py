"""tests/gpu/run_gpu_checks.sh stops within its first second, with a clear message and
its own exit code, when a prerequisite is missing, before it installs or builds
anything.  Runs here (no GPU needed): KVSTORE_GPU_FAKE_NO_GPU=1 makes the script act as
on a machine without a GPU even where one is, so this never starts the full run.  No
network: the preflight uses none, and a dead proxy would stop any attempt."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "run_gpu_checks.sh"
RESULTS = ROOT / "benchmarks" / "results" / "cuda_gpu_checks.md"
NO_GPU = 4
MISSING_DEPENDENCY = 6


def _run(tmp_path: Path, python: str, *args: str) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "carry").mkdir()
    env = dict(os.environ, KVSTORE_GPU_FAKE_NO_GPU="1", PYTHON=python,
               KVSTORE_GPU_CARRY=str(tmp_path / "carry"), KVSTORE_GPU_SITE=str(tmp_path / "site"),
               OUT=str(out), https_proxy="http://127.0.0.1:9", http_proxy="http://127.0.0.1:9",
               PIP_NO_INDEX="1")
    env.pop("PYTHONPATH", None)  # on the GPU machine it holds the carried packages
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def _results_state() -> tuple[bool, float]:
    return RESULTS.exists(), RESULTS.stat().st_mtime if RESULTS.exists() else 0.0


def test_no_gpu_stops_at_once_with_a_clear_message(tmp_path: Path) -> None:
    results = _results_state()
    proc = _run(tmp_path, sys.executable)
    assert proc.returncode == NO_GPU, proc.stdout + proc.stderr
    assert "missing prerequisite: no GPU visible" in proc.stdout
    assert "nothing else was run" in proc.stdout
    assert "step wheels" not in proc.stdout             # stopped before installing
    assert not (tmp_path / "site").exists()
    assert _results_state() == results                  # no results file (re)written
    log = (tmp_path / "out" / "gpu_checks.log").read_text()
    assert "no GPU visible" in log                      # the log comes back from $OUT


def test_every_missing_prerequisite_is_named(tmp_path: Path) -> None:
    # A Python without site-packages lacks lmdb & co, and the carried folder is empty:
    # the script names each missing package and what to do, then stops with the code of
    # the first problem found (no GPU).
    python = tmp_path / "bare-python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    proc = _run(tmp_path, str(python))
    assert proc.returncode == NO_GPU, proc.stdout + proc.stderr
    assert "no GPU visible" in proc.stdout
    for req in ("lmdb==3.0.0", "zstandard==0.25.0", "crc32c==2.9.post0", "trio==0.35.0"):
        assert f"{req} is not installed on this machine and not in" in proc.stdout
    assert "run tests/gpu/prepare_device_wheels.sh" in proc.stdout
    assert "liburing==2024.5.3 dynamic-import==2024.5.2: neither installed nor carried; " \
           "the store uses its thread engine" in proc.stdout


def test_wheels_only_mode_stops_on_a_missing_wheel(tmp_path: Path) -> None:
    python = tmp_path / "bare-python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    proc = _run(tmp_path, str(python), "--wheels-only")
    assert proc.returncode == MISSING_DEPENDENCY, proc.stdout + proc.stderr
    assert "no GPU" not in proc.stdout                  # this mode needs none
    assert "lmdb==3.0.0 is not installed" in proc.stdout


def test_the_mover_step_runs_end_to_end_on_cpu_tensors(tmp_path: Path) -> None:
    # The script's mover step (benchmarks/cuda_mover.py) in its CPU smoke mode: the same
    # code (engine steps, saves through the mover into a real store, loads back, the
    # report) on CPU tensors with tiny shapes, so a GPU run is not its first run.
    out = tmp_path / "cuda_mover.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda_mover.py"),
                           "--cpu-smoke", "--steps", "2", "--reps", "1", "--new-tokens", "16",
                           "--prefix-tokens", "16", "--staging-mib", "1",
                           "--dir", str(tmp_path / "work"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = out.read_text()
    assert "| FP8 payloads byte-identical to kvstore.codecs | True |" in text
    assert '| synchronising torch calls (sync debug mode "error") | 0 | 0 |' in text
    assert (tmp_path / "cuda_mover.json").exists()
