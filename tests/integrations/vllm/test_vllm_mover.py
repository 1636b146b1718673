"""The connector's worker moves KV through the data mover (kvstore/cuda/mover.py): no
host synchronisation and no device -> host copy on its save and load paths, saves
copied out only after the layer's write, loads read only after their layer's event;
FP8 loads dequantised on the GPU from device staging; the step's presence lookup never
waited for in the forward; nothing enqueued during a CUDA graph capture.

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
from typing import Any

import pytest

from tests.integrations.vllm.test_vllm import REPO, VLLM_PYTHON

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}")


def probe(tmp_path: Path, mode: str, *extra: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([str(VLLM_PYTHON), str(HERE / "worker_probe.py"), mode,
                           str(tmp_path / "store"), *extra], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The kernels' host code, built once (the stand-in's FP8 "kernels")."""
    from kvstore.cuda.build import build, find_nvcc

    if find_nvcc() is None:
        pytest.skip("nvcc not installed: the kernels' host code cannot be built")
    return str(build(tmp_path_factory.mktemp("kvcuda") / "libkvcuda.so").path)


@pytest.fixture(scope="module")
def on_a_gpu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return probe(tmp_path_factory.mktemp("gpu"), "gpu", "--capture", "--caps")


def test_worker_on_a_gpu_never_synchronises_and_orders_copies_by_events(
        on_a_gpu: dict[str, Any]) -> None:
    r = on_a_gpu
    assert r["mover_cuda"] is True and r["device_loads"] is False   # raw: host staging
    assert r["save_syncs"] == [] and r["save_host_copies"] == []
    assert r["load_syncs"] == [] and r["load_host_copies"] == []
    assert r["saved_ok"] is True          # the copy-out ran after each layer's write
    assert r["read_ahead_hit"] == 2
    assert r["read_before_load_event"] == 0   # attention waited for the load's event
    assert r["load_ok"] is True and r["load_errors"] == []


def test_the_forward_never_waits_for_the_steps_presence_lookup(
        on_a_gpu: dict[str, Any]) -> None:
    """Step 1 ran with the store's event loop blocked: the forward (every save_kv_layer)
    still finished, its blocks all copied out (the lookup counted late).  Step 2's
    lookup had answered: of its three blocks, the two stored ones were not copied."""
    r = on_a_gpu
    assert r["forward_while_store_busy"] is True
    assert r["dedup_step_copied_blocks"] == 1
    # Step 3, late again, with two stored blocks and a new one: all three copied out,
    # the put wrote one and deduplicated two; every block counted once.
    assert r["late_step_copied_blocks"] == 3
    assert r["late_step_counters"] == {"save_blocks": 3, "saved_blocks": 1,
                                       "save_dedup_blocks": 2, "save_lookup_late_steps": 1}


def test_nothing_is_enqueued_into_a_cuda_graph_capture(on_a_gpu: dict[str, Any]) -> None:
    """A save step and a load step while the engine's stream captures: no copy, event
    or wait of kvstore's reached the capture (the stand-in records any), the save was
    skipped and counted as dropped, the load reported failed (vLLM recomputes)."""
    r = on_a_gpu
    assert r["captured"] == [] and r["capture_syncs"] == []
    assert r["capture_skipped_saves"] == 1
    assert r["capture_load_errors"] == [11]
    assert r["counters"]["loaded_blocks"] == 2 and r["counters"]["load_failed_blocks"] == 1


def test_the_copy_out_caps_drop_a_steps_save_whole_and_count_it(
        on_a_gpu: dict[str, Any]) -> None:
    """max_save_bytes_per_s 3.5 blocks, max_save_bytes_per_step 3 blocks, on the
    worker's clock (moved by the probe, never slept on): per step, [blocks copied out,
    blocks dropped]."""
    r = on_a_gpu
    assert r["caps"] == [[3, 0],    # a full bucket: taken, half a block left
                         [0, 1],    # no time passed: over the rate, dropped
                         [0, 4],    # a second later, but over the step's cap
                         [1, 0]]    # the refilled bucket: taken
    # every step's blocks counted once: 3 + 1 + 3 before, 1 in the capture, 9 here
    assert r["counters"] == {"save_blocks": 16, "saved_blocks": 8, "save_dropped_blocks": 6,
                             "save_dedup_blocks": 2, "save_lookup_late_steps": 2,
                             "loaded_blocks": 2, "load_failed_blocks": 1}


@pytest.mark.parametrize("loads", ["sync", "async"])
def test_worker_on_a_cpu_engine_runs_the_same_calls(tmp_path: Path, loads: str) -> None:
    r = probe(tmp_path, "cpu", *(["--async"] if loads == "async" else []))
    assert r["mover_cuda"] is False
    assert r["saved_ok"] is True and r["load_ok"] is True
    assert r["forward_while_store_busy"] is True and r["dedup_step_copied_blocks"] == 1
    assert r["late_step_copied_blocks"] == 3
    assert r["counters"] == {"save_blocks": 6, "saved_blocks": 4, "save_dropped_blocks": 0,
                             "save_dedup_blocks": 2, "save_lookup_late_steps": 2,
                             "loaded_blocks": 2, "load_failed_blocks": 0}


@pytest.mark.parametrize("loads", ["sync", "async"])
def test_worker_on_a_gpu_with_fp8_quantises_saves_and_dequantises_loads_there(
        tmp_path: Path, library: str, loads: str) -> None:
    """With the store's codec fp8_e4m3, the worker's saves are quantised on the GPU (the
    kernels' own element code: the built library's host twins behind the stand-in), half
    the bytes copied out, stored as the payload.  Its loads (read ahead by the lookup,
    or in the background) stage in device memory: each payload goes there from the
    store's arena (its scales and codes: the bytes copied in) and is dequantised there;
    no sync, no host copy; the cache then holds exactly what the CPU codec decodes."""
    r = probe(tmp_path, "gpu-fp8", library, "--capture",
              *(["--async"] if loads == "async" else []))
    assert r["mover_cuda"] is True and r["device_loads"] is True
    assert r["save_syncs"] == [] and r["save_host_copies"] == []
    assert r["saved_ok"] is True
    assert 0 < r["fp8_copied_out_bytes"] < 0.7 * r["raw_bytes"]
    assert r["load_syncs"] == [] and r["load_host_copies"] == []
    assert r["fp8_decoded"] == 2
    low, high = r["load_copied_in_expected"]
    assert low <= r["load_copied_in_bytes"] <= high and low < 0.7 * r["raw_bytes"]
    assert r["read_before_load_event"] == 0 and r["load_ok"] is True   # decoded, loaded
    assert r["counters"]["loaded_blocks"] == 2
    # a step in a CUDA graph capture: nothing captured, its save dropped, its load
    # failed (background loads: reported once the capture is over)
    assert r["captured"] == [] and r["capture_syncs"] == []
    assert r["capture_skipped_saves"] == 1 and r["capture_load_errors"] == [11]
    if loads == "async":
        assert r["capture_finished"] == ["r2"]


def test_caps_and_staging_that_cannot_hold_one_block_stop_the_start(tmp_path: Path) -> None:
    r = probe(tmp_path, "gpu", "--too-small")
    assert r["error"] == ("kvstore connector: max_save_bytes_per_step=767 cannot hold one "
                          "block (768 bytes: one vLLM block of all 3 layers)")


@pytest.mark.parametrize("loads", ["sync", "async"])
def test_a_load_larger_than_the_load_staging_loads_the_prefix_that_fits(
        tmp_path: Path, loads: str) -> None:
    """A stored chain one block longer than the load staging holds (``cap``): the prefix
    that fits is loaded, the last block computed; before, the load failed whole."""
    r = probe(tmp_path, "cpu", "--small-load-staging", *(["--async"] if loads == "async" else []))
    cap = r["cap"]
    assert cap >= 1 and r["loaded_ok"] is True and r["failed_keys"] == 0
    if loads == "sync":   # the read-ahead claims only what it could read and hold
        assert r["read_ahead_hit"] == cap and r["load_errors"] == []
        assert r["counters"] == {"loaded_blocks": cap, "load_failed_blocks": 0,
                                 "load_no_staging_blocks": 1}
    else:                 # the prefix loaded, the last block computed by vLLM
        assert r["finished"] == ["r"] and r["load_errors"] == [cap]
        assert r["counters"] == {"loaded_blocks": cap, "load_failed_blocks": 1,
                                 "load_no_staging_blocks": 1}


def test_background_loads_wait_for_busy_load_staging_instead_of_failing(
        tmp_path: Path) -> None:
    """Load staging for two blocks: a lookup claims no more than that (the third stored
    block is computed); of two loads in one step the second waits for the staging and
    is loaded once the first was copied in; a load still waiting when the key scope
    moves fails whole, unread.  Before, the second load failed (vLLM looked its request
    up again, to find the staging as busy) and a lookup claimed all three."""
    r = probe(tmp_path, "cpu", "--busy-load-staging")
    assert r["cap"] == 2 and r["lookup_hit"] == 2
    assert r["waiting_after_start"] == ["b"] and r["loaded_ok"] is True
    assert r["waiting_before_move"] == ["d"]
    assert r["finished"] == [["a"], ["b"], ["c", "d"]]
    assert r["load_errors"] == [4, 5, 10, 11]      # c and d, read under the old scope
    assert r["counters"] == {"load_blocks": 8, "loaded_blocks": 4, "load_failed_blocks": 4,
                             "load_deferred_blocks": 4, "load_no_staging_blocks": 1}


def test_staging_sizes_are_checked_as_given(tmp_path: Path) -> None:
    """767 bytes of staging make a page that holds five 768-byte blocks; the options
    still say less than one block, and are refused so."""
    r = probe(tmp_path, "cpu", "--below-a-block")
    assert r["error"] == (
        "kvstore connector: max_pending_save_bytes=767 cannot hold one block (768 bytes: "
        "one vLLM block of all 3 layers); load_staging_bytes=767 cannot hold one block "
        "(768 bytes: one vLLM block of all 3 layers)")
