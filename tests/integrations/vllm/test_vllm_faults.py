"""Engine lives (vLLM on CPU) for issue 35: a weight update in place, and blocks that
cannot be read.  Each life is a fresh process (see test_vllm.py); in order, on one store:

* ``ref``   no connector: the prompts on the original weights, then ``reload_weights``
            from other weights (same architecture and files, another seed) and the
            prompts again: the two references.
* ``W``     fresh store: the prompts computed and saved; the same weight update, then
            ``reset_prefix_cache(reset_connector=True)`` and the prompts again: they
            must equal the new weights' reference (before the fix every one was
            answered with the old weights' KV).
* ``W2``    a new engine on the new weights' files: finds what ``W`` saved after the
            update (the connector's new scope is derived from the files) and matches
            the new reference.
* ``O``     a new engine on the original weights: the original reference, every
            prompt block from the store (nothing of the new weights leaked into it).
* ``T1``    the extent truncated inside its second block while no engine ran: every
            request finishes with the reference output, the blocks past the cut are
            quarantined and recomputed.
* ``T2``    restart: no load fails (the failed blocks are no hits any more).
* ``D1``    the extent file deleted: the store still opens; every block of it is
            quarantined as read, recomputed, saved again elsewhere.
* ``D2``    restart: no load fails, the prompts come from the store again.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest

import kvstore
from kvstore.disk.extents import extent_path
from kvstore.testing import parts
from tests.integrations.vllm.test_vllm import (
    HERE,
    PROMPTS,
    REPO,
    VLLM_PYTHON,
    life,
    prompt_blocks,
    started,
    tokens,
)

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv")


def _after(result: dict[str, Any]) -> list[list[int]]:
    return [out["tokens"] for out in result["outputs_after_update"]]


async def _extents(store: Path) -> list[tuple[int, int, int]]:
    """(extent, offset, slot_len) of every stored block."""
    async with kvstore.open(store) as s:
        return [(e.extent, e.offset, e.slot_len) for _, e in parts(s).index.iter_entries()]


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-faults")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    models = {}
    for seed in (0, 1):
        models[seed] = tmp / f"tiny-llama-{seed}"
        subprocess.run([str(VLLM_PYTHON), str(HERE / "tiny_llama.py"), str(models[seed]),
                        str(seed)], env=env, check=True, capture_output=True, timeout=300)
    store = tmp / "store"
    lives: dict[str, Any] = {"store": store}
    update = {"weight_update": str(models[1])}
    lives["ref"] = started(life(tmp, "ref", models[0], None, **update), "ref")
    lives["W"] = started(life(tmp, "W", models[0], store, **update), "W")
    lives["W2"] = started(life(tmp, "W2", models[1], store), "W2")
    lives["O"] = started(life(tmp, "O", models[0], store), "O")
    slots = anyio.run(_extents, store)
    (extent,) = {e for e, _, _ in slots}
    offsets = sorted(o for _, o, _ in slots)
    # Every block but the first is past the end (W saved the original weights' blocks
    # first, the new weights' after them).
    cut = offsets[1]
    os.truncate(extent_path(str(store), extent), cut + 100)
    lives["cut_blocks"] = sum(o >= cut for o in offsets)
    lives["T1"] = started(life(tmp, "T1", models[0], store), "T1")
    lives["T2"] = started(life(tmp, "T2", models[0], store), "T2")
    os.unlink(extent_path(str(store), extent))
    lives["D1"] = started(life(tmp, "D1", models[0], store), "D1")
    lives["D2"] = started(life(tmp, "D2", models[0], store), "D2")
    return lives


def test_the_weight_update_changes_the_output(faults: dict[str, Any]) -> None:
    ref = faults["ref"]
    assert ref["reset"] is True
    assert tokens(ref) != _after(ref), "the two weights must give other outputs"


def test_after_a_weight_update_no_stored_kv_of_the_old_weights_is_used(
        faults: dict[str, Any]) -> None:
    w, ref = faults["W"], faults["ref"]
    assert tokens(w) == tokens(ref)
    assert w["reset"] is True  # the connector implements reset_cache, and it held
    assert _after(w) == _after(ref)
    # Nothing was loaded after the update: vLLM's own cache is reset before each
    # prompt, so every cached token came from kvstore, and there were none.
    assert all(out["num_cached_tokens"] == 0 for out in w["outputs_after_update"][:1])


def test_a_new_engine_on_the_new_weight_files_shares_what_was_saved_after_the_update(
        faults: dict[str, Any]) -> None:
    w2, ref = faults["W2"], faults["ref"]
    assert tokens(w2) == _after(ref)
    assert w2["connector"]["loaded_blocks"] > 0
    assert w2["connector"]["load_failed_blocks"] == 0


def test_a_new_engine_on_the_original_weights_gets_the_original_kv(
        faults: dict[str, Any]) -> None:
    o, ref = faults["O"], faults["ref"]
    assert tokens(o) == tokens(ref)
    assert o["connector"]["loaded_blocks"] == sum(prompt_blocks(out) for out in o["outputs"])


def test_a_truncated_extent_finishes_every_request_and_quarantines_the_cut_blocks(
        faults: dict[str, Any]) -> None:
    t1, ref = faults["T1"], faults["ref"]
    assert tokens(t1) == tokens(ref)
    store = t1["connector"]["store"]
    assert store["quarantined_blocks"] >= 1 and store["read_errors"] >= 1
    assert t1["connector"]["load_failed_blocks"] >= 1
    # Each failed block failed once: no load -> fail -> reschedule loop.
    assert t1["connector"]["load_failed_blocks"] <= faults["cut_blocks"] * len(PROMPTS)
    assert "failed verification" in t1["stderr"] or "could not be read" in t1["stderr"]


def test_after_the_truncation_a_restart_loads_no_failed_block(faults: dict[str, Any]) -> None:
    t2, ref = faults["T2"], faults["ref"]
    assert tokens(t2) == tokens(ref)
    assert t2["connector"]["load_failed_blocks"] == 0
    assert t2["connector"]["loaded_blocks"] == sum(prompt_blocks(o) for o in t2["outputs"])


def test_a_deleted_extent_opens_and_every_request_finishes(faults: dict[str, Any]) -> None:
    d1, ref = faults["D1"], faults["ref"]
    assert tokens(d1) == tokens(ref)
    assert d1["connector"]["store"]["quarantined_blocks"] >= 1
    assert "missing" in d1["stderr"]


def test_after_the_deleted_extent_a_restart_loads_no_failed_block(
        faults: dict[str, Any]) -> None:
    d2, ref = faults["D2"], faults["ref"]
    assert tokens(d2) == tokens(ref)
    assert d2["connector"]["load_failed_blocks"] == 0
    assert d2["connector"]["loaded_blocks"] == sum(prompt_blocks(o) for o in d2["outputs"])
