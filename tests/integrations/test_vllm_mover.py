"""The connector's worker moves KV through the data mover (kvstore/cuda/mover.py): no
host synchronisation and no device -> host copy on its save and load paths, saves
copied out only after the layer's write, loads read only after their layer's event.

Each case is one run of ``worker_probe.py`` in the vLLM venv (vLLM is not installed in
the test venv): ``gpu`` puts the KV cache on the recording stand-in GPU
(tests/cuda/standin.py) behind tensors that say they are on ``cuda:0`` -- the worker
before the mover failed here (its ``.to("cpu")`` per layer and its block index built on
the device); ``cpu`` is a CPU engine through the same calls.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.integrations.test_vllm import REPO, VLLM_PYTHON

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}")


def probe(tmp_path: Path, mode: str, *extra: str) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([str(VLLM_PYTHON), str(HERE / "worker_probe.py"), mode,
                           str(tmp_path / "store"), *extra], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_worker_on_a_gpu_never_synchronises_and_orders_copies_by_events(
        tmp_path: Path) -> None:
    r = probe(tmp_path, "gpu")
    assert r["mover_cuda"] is True
    assert r["save_syncs"] == [] and r["save_host_copies"] == []
    assert r["load_syncs"] == [] and r["load_host_copies"] == []
    assert r["saved_ok"] is True          # the copy-out ran after each layer's write
    assert r["read_before_load_event"] == 0   # attention waited for the load's event
    assert r["load_ok"] is True
    assert r["counters"] == {"save_blocks": 2, "saved_blocks": 2, "save_dropped_blocks": 0,
                             "loaded_blocks": 2, "load_failed_blocks": 0}


def test_worker_on_a_cpu_engine_runs_the_same_calls(tmp_path: Path) -> None:
    r = probe(tmp_path, "cpu")
    assert r["mover_cuda"] is False
    assert r["saved_ok"] is True and r["load_ok"] is True
    assert r["counters"] == {"save_blocks": 2, "saved_blocks": 2, "save_dropped_blocks": 0,
                             "loaded_blocks": 2, "load_failed_blocks": 0}


def test_worker_on_a_gpu_with_fp8_stores_the_payload_quantised_there(tmp_path: Path) -> None:
    """With the store's codec fp8_e4m3, the worker's saves are quantised on the GPU (the
    kernels' own element code: the built library's host twins behind the stand-in), half
    the bytes copied out, stored as the payload: read back, each block is exactly what
    the CPU codec's payload of the same values decodes to."""
    from kvstore.cuda.build import build, find_nvcc

    if find_nvcc() is None:
        pytest.skip("nvcc not installed: the kernels' host code cannot be built")
    lib = build(tmp_path / "libkvcuda.so").path
    r = probe(tmp_path, "gpu-fp8", str(lib))
    assert r["mover_cuda"] is True
    assert r["save_syncs"] == [] and r["save_host_copies"] == []
    assert r["saved_ok"] is True
    assert 0 < r["fp8_copied_out_bytes"] < 0.7 * r["raw_bytes"]  # type: ignore[operator]
    assert r["read_before_load_event"] == 0 and r["load_ok"] is True   # decoded, loaded
