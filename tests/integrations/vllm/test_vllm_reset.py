"""Engine lives (vLLM on CPU): weight updates while requests run, and loads through a
load staging of two blocks.  Each life is a fresh process (see test_vllm.py); in order,
on one store, with chunked prefill of 128 tokens per step:

* ``ref``      no connector, on the new weights M2: the prompts one at a time (vLLM's
               prefix cache reset before each) and all at once.
* ``refused``  on M1: ``FIRST`` (whose first 128 tokens are the prefix ``P`` that three
               prompts share) is served; the long prompt ``L`` is submitted and stepped
               once (a chunk of its prefill); the weights are reloaded from M2 and
               ``reset_prefix_cache(reset_connector=True)`` is called: vLLM refuses (L
               holds blocks) and keeps ``P``'s M1 blocks in its prefix cache.  Then the
               three ``P`` prompts and the unrelated ``U`` run beside ``L``: each ``P``
               prompt hits M1's ``P`` in vLLM's cache and computes the rest on M2.  None
               of that may be saved, nor ``L``; ``U`` (no local hit) is saved.  Then all
               prompts again, stepped twice, and a reset that preempts them (accepted),
               and once they ended, all prompts at once on a clear cache.
* ``accepted`` on M1: ``FIRST`` served; the weights reloaded from M2 and the reset
               accepted (nothing runs); all prompts at once, saved under M2's scope.
* ``fresh``    a new engine on M2's files: loads what was saved under M2's scope; the
               outputs equal ``ref``.  Before the fix ``refused`` saved 9 blocks after
               the reset it was refused, of which ``accepted`` loaded the mixed ones
               (two of its outputs differed) and so did ``fresh`` (three).
* ``storm``    on M2, ``load_staging_bytes`` two blocks, asynchronous loads, all prompts
               at once: every lookup claims at most what the staging holds, and loads
               that find it busy wait for it instead of failing.  Measured at bbcf7f0:
               5 lookups, 10 blocks claimed, 10 loaded, 0 failed (8 deferred); before,
               19 lookups, 113 claimed, 105 failed for 8 loaded.

Five engine lives of ~30-60 s each, and ``scheduler_probe.py`` (the scheduler side with
vLLM's real block pool, requests and scheduler outputs, no engine: a reset that cannot
see vLLM's cache, sub-block local hits, a preempted request resumed).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.test_vllm import HERE, REPO, VLLM_PYTHON, life, started

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv")

BLOCK_BYTES = 2 * 2 * 32 * 2 * 32 * 4  # tiny_llama: layers x K,V x tokens x heads x dim, fp32
P = "you are a helpful assistant . answer the question of the user in one sentence . " * 8
FIRST = P + "what is the capital of france ?"
QS = [P + s for s in (
    "what is the capital of france ? paris is the capital of france . the quick brown fox "
    "jumps over the lazy dog . a store keeps blocks of attention keys and values on disk "
    "so that an engine restart does not throw every computed prefix away . how many legs "
    "has a spider ? a spider has eight legs . the lazy dog .",
    "how many legs has a spider ? a spider has eight legs . tell me a story about a cat and "
    "a mouse who live in an old house by the river , and the winter when the river froze . "
    "the quick brown fox jumps over the lazy dog . what is the capital of france ? "
    "paris is the capital of france .",
    "tell me a story about a cat and a mouse . the quick brown fox jumps over the lazy dog . "
    "what is the capital of france ? paris is the capital of france . how many legs has a "
    "spider ? a spider has eight legs . a store keeps blocks of attention keys and values "
    "on disk . that is the end .")]
L = ("tell me a story about a cat and a mouse who live in an old house by the river , and "
     "the winter when the river froze . ") * 15
U = ("the quick brown fox jumps over the lazy dog . " * 8
     + "how many legs has a spider ? a spider has eight legs .")
PROMPTS = [*QS, L, U]
LONG_INDEX = 3
LLM = {"max_num_batched_tokens": 128}


def _tokens(outputs: list[dict[str, Any]]) -> list[list[int]]:
    return [o["tokens"] for o in outputs]


@pytest.fixture(scope="module")
def lives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-reset")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    m1, m2 = tmp / "tiny-llama-1", tmp / "tiny-llama-2"
    for model, seed in ((m1, 0), (m2, 1)):
        subprocess.run([str(VLLM_PYTHON), str(HERE / "tiny_llama.py"), str(model), str(seed)],
                       env=env, check=True, capture_output=True, timeout=300)
    store = tmp / "store"
    out: dict[str, Any] = {}

    def run(name: str, model: Path, with_store: bool, **spec: Any) -> None:
        out[name] = started(life(tmp, name, model, store if with_store else None,
                                 **{"prompts": PROMPTS, "llm": LLM, **spec}), name)

    run("ref", m2, False, batch=True)
    update = {"weights": str(m2), "first": FIRST}
    run("refused", m1, True, prompts_in_turn=False,
        update_while_running={**update, "running": LONG_INDEX, "again": True})
    run("accepted", m1, True, prompts_in_turn=False,
        update_while_running={**update, "running": None})
    run("fresh", m2, True)
    run("storm", m2, True, prompts_in_turn=False, batch=True,
        extra={"extent_bytes": 4 << 20, "load_staging_bytes": 2 * BLOCK_BYTES})
    return out


def test_the_prompts_share_what_the_scenario_needs(lives: dict[str, Any]) -> None:
    outs = lives["ref"]["outputs"]
    lengths = [len(o["prompt_token_ids"]) for o in outs]
    assert len(P.split()) == 128
    assert all(n >= 128 + 2 * 32 for n in lengths[:3]), lengths  # P + two blocks of its own
    assert lengths[LONG_INDEX] > 3 * 128                      # chunked over several steps
    assert _tokens(outs) == _tokens(lives["ref"]["batch_outputs"])


def test_a_reset_vllm_refuses_saves_nothing_computed_on_its_stale_prefix_cache(
        lives: dict[str, Any]) -> None:
    update = lives["refused"]["update"]
    assert update["reset"] is False           # vLLM's own reset refused (L holds blocks)
    # The P prompts hit M1's P in vLLM's cache: neither looked up nor saved; L ran
    # across the reset (chunked): never saved again; U, computed on M2 alone, was saved.
    before, after = update["counters_at_reset"], update["counters"]
    assert after["reset_stale_requests"] - before["reset_stale_requests"] == len(QS)
    u = update["outputs"][4]
    u_blocks = (len(u["prompt_token_ids"]) + len(u["tokens"]) - 1) // 32
    assert after["save_blocks"] - before["save_blocks"] == u_blocks
    assert after["lookups"] - before["lookups"] == 1      # U's; L's was before the reset
    # A reset that preempts the running requests (vLLM's pause with clear_cache) is
    # accepted: the connector says so (vLLM would raise otherwise), the requests
    # resume; then vLLM's cache is clear and the connector saves again (in a scope of
    # its own: the weight files did not change).
    assert update["reset_again"] is True
    assert update["resumed_counters"]["reset_stale_requests"] == \
        update["counters_at_reset_again"]["reset_stale_requests"]
    assert _tokens(update["again_outputs"]) == _tokens(lives["ref"]["batch_outputs"])
    assert update["again_counters"]["saved_blocks"] > update["resumed_counters"]["saved_blocks"]


def test_a_reset_vllm_accepts_saves_under_the_new_weights_scope(
        lives: dict[str, Any]) -> None:
    update = lives["accepted"]["update"]
    assert update["reset"] is True
    assert _tokens(update["outputs"]) == _tokens(lives["ref"]["batch_outputs"])
    assert update["counters"]["reset_stale_requests"] == 0
    assert update["counters"]["saved_blocks"] > 0


def test_a_new_engine_on_the_new_weights_loads_only_right_kv(lives: dict[str, Any]) -> None:
    fresh = lives["fresh"]
    assert _tokens(fresh["outputs"]) == _tokens(lives["ref"]["outputs"])
    conn = fresh["connector"]
    assert conn["loaded_blocks"] > 0 and conn["load_failed_blocks"] == 0, conn
    assert all(o["num_cached_tokens"] > 0 for o in fresh["outputs"])


def test_small_load_staging_with_async_loads_defers_instead_of_failing(
        lives: dict[str, Any]) -> None:
    storm = lives["storm"]
    assert _tokens(storm["batch_outputs"]) == _tokens(lives["ref"]["batch_outputs"])
    conn = storm["connector"]
    loaded, failed, lookups = conn["loaded_blocks"], conn["load_failed_blocks"], conn["lookups"]
    print(f"storm: {lookups} lookups, {conn['lookup_hit_blocks']} blocks claimed, "
          f"{loaded} loaded, {failed} failed, {conn['load_deferred_blocks']} deferred")
    assert loaded >= len(PROMPTS)          # each prompt loaded the blocks the staging holds
    assert failed == 0
    # One lookup per request: none was rescheduled for a load that could not start.
    assert lookups == len(PROMPTS)
    assert conn["lookup_hit_blocks"] == loaded <= 2 * len(PROMPTS)
    assert conn["load_deferred_blocks"] > 0      # (the staging was busy at times)


@pytest.fixture(scope="module")
def scheduler_probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-scheduler-probe")
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    subprocess.run([str(VLLM_PYTHON), str(HERE / "tiny_llama.py"), str(tmp / "model")],
                   env=env, check=True, capture_output=True, timeout=300)
    proc = subprocess.run([str(VLLM_PYTHON), str(HERE / "scheduler_probe.py"),
                           str(tmp / "model"), str(tmp / "store")], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_a_reset_that_cannot_see_vllms_cache_moves_to_a_fresh_scope(
        scheduler_probe: dict[str, Any]) -> None:
    r = scheduler_probe
    assert r["unbound_reset"] is True and r["unbound_warned"] is True
    assert r["unbound_weights"] == "update"      # a fresh scope, not the files' one


def test_while_vllms_cache_is_stale_only_requests_without_a_local_hit_are_saved(
        scheduler_probe: dict[str, Any]) -> None:
    """With vLLM's real block pool, requests and scheduler outputs (scheduler_probe.py)."""
    r = scheduler_probe
    assert r["refused_reset"] is False and r["refused_warned"] is True
    assert r["hit_lookup"] == [0, False]          # a local hit: not looked up
    assert r["tail_saves"] == []                  # a sub-block local hit: not saved
    assert r["clean_saves"] == r["clean_ids"][:3]   # no local hit: its three full blocks
    # resumed after a preemption with a local hit: neither looked up nor saved again
    assert r["resumed_lookup"] == [0, False]
    assert r["resumed_saves"] == [] and r["resumed_next_saves"] == []
    assert r["stale_requests"] == 3


def test_a_reset_vllm_accepts_ends_the_stale_cache(scheduler_probe: dict[str, Any]) -> None:
    r = scheduler_probe
    assert r["pool_reset"] is True and r["accepted_reset"] is True
    assert r["after_saves"] == r["after_ids"][1:3]   # saved from its local hit on
    assert r["stale_requests_after"] == r["stale_requests"]
