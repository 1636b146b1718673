"""End to end: what the connector's key scope covers, on a real vLLM engine (CPU).

A namespace change must be a clean miss, never a load.  One store, one model
directory; every engine life after the first changes one thing that changes the KV
(and that a model path or dtype string does not show) and must produce exactly the
output of an engine without the connector, with nothing taken from kvstore:

* ``save``     saves ``LONG`` and ``SP_A``, then serves ``LONG`` again from kvstore (its
               positive control: same scope, full hit).
* ``rope``     ``hf_overrides`` changing the RoPE base (``rope_theta``).
* ``e4m3`` / ``e5m2``  an FP8 KV cache in each FP8 format (both are uint8 tensors):
               ``e5m2`` must not load what ``e4m3`` saved.  vLLM runs an FP8 KV cache
               on CPU only with AVX-512 or AMX: elsewhere these three lives are left
               out (and their test skipped, saying so); the configuration-level test
               below covers the FP8 variants on every machine.
* ``new``      other weights written to the same model directory (a retrained model).

Each ``*_ref`` life is the same engine without the connector.  Eight engine lives
(five without AVX-512; about 3-6 minutes here).

The configuration-level test builds vLLM's real ``VllmConfig`` for many variants
(``scope_probe.py``, one process, no engine) and checks which ones share a scope.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.test_vllm import HERE, LONG, REPO, SP_A, VLLM_PYTHON, life, tokens

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv")

ROPE = {"hf_overrides": {"rope_parameters": {"rope_theta": 1000.0, "rope_type": "default"}}}
PROMPTS = [LONG, SP_A]


def _cpu_runs_fp8_kv() -> bool:
    """vLLM's CPU attention stores an FP8 KV cache only with AVX-512 or AMX."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512f" in flags or "amx_tile" in flags


FP8_KV = _cpu_runs_fp8_kv()


def _build_model(model: Path, seed: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([str(VLLM_PYTHON), str(HERE / "tiny_llama.py"), str(model), str(seed)],
                   env=env, check=True, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def lives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-scope")
    model, store = tmp / "model", tmp / "store"
    _build_model(model, seed=0)
    out: dict[str, Any] = {}

    def run(name: str, with_store: bool, **extra: Any) -> None:
        out[name] = life(tmp, name, model, store if with_store else None,
                         **{"prompts": PROMPTS, **extra})

    run("save", True, prompts=[LONG, SP_A, LONG])
    run("rope_ref", False, llm=ROPE)
    run("rope", True, llm=ROPE)
    if FP8_KV:
        run("e4m3", True, llm={"kv_cache_dtype": "fp8_e4m3"})
        run("e5m2_ref", False, llm={"kv_cache_dtype": "fp8_e5m2"})
        run("e5m2", True, llm={"kv_cache_dtype": "fp8_e5m2"})
    _build_model(model, seed=1)  # new weights, same path, same file names and sizes
    run("new_ref", False)
    run("new", True)
    return out


def _clean_miss(result: dict[str, Any]) -> None:
    assert [o["num_cached_tokens"] for o in result["outputs"]] == [0] * len(PROMPTS)
    conn = result["connector"]
    assert conn["lookup_hit_blocks"] == 0 and conn["load_blocks"] == 0, conn
    assert result["metrics"].get("vllm:prompt_tokens_by_source[external_kv_transfer]", 0) == 0


def test_same_scope_hits(lives: dict[str, Any]) -> None:
    """The control: with nothing changed, the second LONG is served from kvstore."""
    save = lives["save"]
    assert tokens(save)[2] == tokens(save)[0]
    assert save["outputs"][2]["num_cached_tokens"] > 0
    assert save["connector"]["loaded_blocks"] > 0


@pytest.mark.parametrize("name", [
    "rope", "new",
    pytest.param("e5m2", marks=pytest.mark.skipif(
        not FP8_KV, reason="vLLM runs an FP8 KV cache on CPU only with AVX-512/AMX; "
        "test_scopes_of_real_engine_configs covers the FP8 variants"))])
def test_a_scope_change_is_a_clean_miss(lives: dict[str, Any], name: str) -> None:
    _clean_miss(lives[name])
    assert tokens(lives[name]) == tokens(lives[f"{name}_ref"])


def test_the_changes_do_change_the_output(lives: dict[str, Any]) -> None:
    """Each change matters: loading across it would have served other tokens."""
    base = tokens(lives["save"])[:2]
    assert tokens(lives["rope_ref"]) != base
    assert tokens(lives["new_ref"]) != base
    if FP8_KV:
        assert tokens(lives["e5m2_ref"]) != tokens(lives["e4m3"])
        assert [o["num_cached_tokens"] for o in lives["e4m3"]["outputs"]] == [0, 0]


@pytest.fixture(scope="module")
def scopes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-scope-probe")
    model, copy = tmp / "model", tmp / "elsewhere" / "model-copy"
    _build_model(model, seed=0)
    shutil.copytree(model, copy)
    fp8 = {"kv_cache_dtype": "fp8_e4m3"}
    variants: dict[str, Any] = {
        "base": {}, "again": {}, "copy": {"model": str(copy)},
        "zstd": {"extra": {"codec": "zstd"}},
        "fp8_codec": {"extra": {"codec": "fp8_e4m3"}},
        "kv_e4m3": {"engine": fp8},
        "kv_e5m2": {"engine": {"kv_cache_dtype": "fp8_e5m2"}},
        "kv_scales": {"engine": {**fp8, "calculate_kv_scales": True}},
        "rope": {"engine": ROPE},
        "impl": {"engine": {"model_impl": "transformers"}},
        "model_id": {"extra": {"model_id": "build-1234"}},
        "full": {"extra": {"weights_fingerprint": "full"}},
    }
    for v in variants.values():
        v.setdefault("model", str(model))
    spec, result = tmp / "variants.json", tmp / "scopes.json"
    spec.write_text(json.dumps(variants))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([str(VLLM_PYTHON), str(HERE / "scope_probe.py"), str(spec),
                           str(result)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    out: dict[str, Any] = json.loads(result.read_text())
    return out


def test_scopes_of_real_engine_configs(scopes: dict[str, Any]) -> None:
    errors = {k: v["error"] for k, v in scopes.items() if "error" in v and k != "kv_scales"}
    assert not errors
    digest = {k: v["digest"] for k, v in scopes.items() if "digest" in v}
    # The same weights and config share blocks, wherever the weights lie; so do the
    # lossless codecs.
    assert digest["again"] == digest["copy"] == digest["zstd"] == digest["base"]
    # Every change that alters the KV bytes is another scope.
    changed = ["fp8_codec", "kv_e4m3", "kv_e5m2", "rope", "impl", "model_id", "full"]
    assert len({digest[k] for k in [*changed, "base"]}) == len(changed) + 1
    assert scopes["kv_e5m2"]["scope"]["kv_cache_dtype"] == "fp8_e5m2"
    assert scopes["model_id"]["scope"]["weights"] == "id:build-1234"
    # RoPE overrides reach the config digest (vLLM applied them), not only the raw list.
    assert scopes["rope"]["scope"]["hf_config"] != scopes["base"]["scope"]["hf_config"]


def test_fp8_kv_with_computed_scales_is_refused(scopes: dict[str, Any]) -> None:
    assert "calculate_kv_scales" in scopes["kv_scales"].get("error", ""), scopes["kv_scales"]
