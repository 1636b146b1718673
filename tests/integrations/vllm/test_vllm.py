"""End to end: a real vLLM engine (CPU) with the kvstore connector, across restarts.

Every engine life is a fresh process of the vLLM venv's python running
``engine_life.py`` (vLLM is not installed in the test venv).  The scenario, in order,
sharing one store:

* ``ref``   no connector: the reference greedy outputs.
* ``A``     fresh store: ``LONG`` is computed and saved; ``SP_A`` saves the shared
            system-prompt blocks, which ``SP_B`` then loads from kvstore (vLLM's own
            prefix cache is reset before every prompt).
* ``B``     restart: every full prompt block comes from kvstore.
* tamper    flip a payload byte of ``LONG``'s block 1; delete ``LONG``'s block 4 and
            ``SP_A``'s block 2.
* ``C``     restart: ``LONG``'s hit ends before block 4; block 1 fails its checksum, the
            connector loads only block 0 and reports the rest failed, vLLM recomputes.
            Loads are asynchronous: the failure is known before ``LONG`` runs, so no
            forward reads an unloaded block.  ``SP_A``'s hit ends before block 2.
            Outputs equal the reference.
* ``D``     restart: the recomputed blocks were saved again (and right: the outputs
            still equal the reference): full hits again.
* ``E``     restart with vLLM's multiprocess engine (its default; on CPU the worker is a
            process of its own): the scheduler asks the worker over the lookup socket;
            same hits, same outputs.
* ``bad``   a store path that is a regular file: the engine refuses to start, saying so.
* ``F``     ``LONG``'s block 1 corrupted again; ``LONG`` is submitted, stepped once (its
            load fails) and aborted before it recomputes, then sent again without a
            prefix-cache reset: a block that failed to load must not be a local cache hit.
* ``G``     restart: the outputs still equal the reference (nothing wrong was saved).
            First ``LONG`` is submitted and its load held in flight (its read completes
            only when the test opens a gate); it is aborted while held and ``SP_B`` is
            served meanwhile; then the gate opens and the prompts are served.
* ``S``     (``sync_scenario``) restart with ``async_loads`` off, ``LONG``'s block 1
            corrupted again: the lookup reads and verifies, the hit stops before it.
* ``X``     the store served by a multiprocess engine that stays up while ``Y1`` and
            ``Y2`` run, each in a mount namespace of its own where the same store path is
            another (empty) directory, as containers sharing the host's network namespace
            see it: ``Y1`` must find no hits (its lookups must not reach ``X``'s worker);
            ``Y2``, configured with ``X``'s engine id, must refuse to start.

Thirteen engine lives of ~30-50 s each on two cores (about 8-10 minutes in all).  The
vLLM venv comes from
``tests/integrations/install_vllm_env.sh``; its python is ``$KVSTORE_VLLM_PYTHON``
(default ``.venv-vllm/bin/python`` in the repository).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import anyio
import pytest

import kvstore
from kvstore.disk.extents import extent_path
from kvstore.disk.format import SLOT_HEADER_BYTES
from kvstore.testing import parts

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
VLLM_PYTHON = Path(os.environ.get("KVSTORE_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
BLOCK = 32  # engine_life.BLOCK_SIZE
MAX_TOKENS = 16
SMALL_EXTENT = 4 << 20
READY = "KVSTORE-ENGINE-LIFE-READY"  # engine_life.py's line when a held life is up

SYSTEM = ("you are a helpful assistant . answer the question of the user in one short "
          "sentence . a store keeps blocks of attention keys and values on disk so that an "
          "engine restart does not throw every computed prefix away . ") * 2  # 82 tokens
SP_A = SYSTEM + "what is the capital of france ? paris is the capital of france . the quick brown"
SP_B = SYSTEM + "how many legs has a spider ? a spider has eight legs . the lazy dog jumps over"
LONG = ("tell me a story about a cat and a mouse who live in an old house by the river , and "
        "the winter when the river froze . ") * 6
PROMPTS = [LONG, SP_A, SP_B]

_MISSING = (f"no vLLM venv at {VLLM_PYTHON}: run tests/integrations/install_vllm_env.sh "
            "or set KVSTORE_VLLM_PYTHON")
if not VLLM_PYTHON.exists() and os.environ.get("KVSTORE_REQUIRE_VLLM"):
    raise RuntimeError(f"KVSTORE_REQUIRE_VLLM is set but there is {_MISSING}")
pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=_MISSING)


def _life_command(tmp: Path, name: str, model: Path, store: Path | None,
                  multiprocessing: bool, prefix: list[str], env_extra: dict[str, str] | None = None,
                  **spec_extra: Any) -> tuple[list[str], dict[str, str], Path]:
    spec = {"model": str(model), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "store": None if store is None else str(store),
            "extra": {"extent_bytes": SMALL_EXTENT}, **spec_extra}
    spec_path, result_path = tmp / f"{name}.spec.json", tmp / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    # pickle for engine_life's collective_rpc of its own functions (settle_saves, the
    # per-rank stats), which vLLM's msgpack encoder refuses otherwise
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else "0",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1", PYTHONPATH=str(REPO),
               **(env_extra or {}))
    return ([*prefix, str(VLLM_PYTHON), str(HERE / "engine_life.py"), str(spec_path),
             str(result_path)], env, result_path)


def life(tmp: Path, name: str, model: Path, store: Path | None,
         multiprocessing: bool = False, prefix: Sequence[str] = (),
         env_extra: dict[str, str] | None = None, **spec_extra: Any) -> dict[str, Any]:
    """Run one engine life in a new process (after ``prefix``, e.g. ``unshare``) and
    return its JSON result, with the tail of its stderr as ``stderr``."""
    cmd, env, result_path = _life_command(tmp, name, model, store, multiprocessing,
                                          list(prefix), env_extra, **spec_extra)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and result_path.exists(), \
        f"engine life {name} failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    result: dict[str, Any] = json.loads(result_path.read_text())
    result["stderr"] = proc.stderr[-20000:]
    return result


def _why_not_started(result: dict[str, Any]) -> str:
    """vLLM's reason, with the last error lines its processes logged (the engine core
    and the workers report the root cause on stderr, the exception only says 'failed')."""
    lines = [ln for ln in result["stderr"].splitlines()
             if "Error" in ln or "error" in ln or "Exception" in ln]
    return f"{result['error']} | " + " | ".join(lines[-6:])


def started(result: dict[str, Any], name: str) -> dict[str, Any]:
    """``result``, once it is sure the engine was built (else fail with vLLM's reason)."""
    assert "error" not in result, \
        f"engine life {name}: the engine did not start: {_why_not_started(result)}\n" \
        f"{result['stderr'][-6000:]}"
    return result


@contextmanager
def held_life(tmp: Path, name: str, model: Path, store: Path, **spec_extra: Any
              ) -> Iterator[dict[str, Any]]:
    """An engine life that stays up (multiprocess) until the block ends."""
    cmd, env, result_path = _life_command(tmp, name, model, store, True, [], hold=True,
                                          **spec_extra)
    ready = threading.Event()

    def drain(stream: IO[str]) -> None:
        # vLLM logs to stdout too: watch for the marker and keep reading to the end, so
        # the engine never blocks on a full pipe while it is held.
        for line in stream:
            if line.strip() == READY:
                ready.set()
        ready.set()  # ended (early, if the marker never came)

    with subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        reader = threading.Thread(target=drain, args=(proc.stdout,), daemon=True)
        reader.start()
        try:
            assert ready.wait(900) and proc.poll() is None, \
                f"held engine life {name} ended early (rc {proc.poll()})"
            yield json.loads(result_path.read_text())
        finally:
            proc.stdin.close()
            proc.wait(timeout=300)
            reader.join(timeout=60)


def in_own_mount_namespace(store: Path, other_dir: Path) -> list[str]:
    """A command prefix running the rest with ``other_dir`` mounted over ``store``:
    the same path, another directory (as in a container)."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'mount --bind "{other_dir}" "{store}" && exec "$@"', "sh"]


async def _tamper(store_path: Path, corrupt: bytes, delete: list[bytes]) -> None:
    async with kvstore.open(store_path) as store:
        (entry,) = parts(store).index.get_entries([corrupt])
        assert entry is not None, "the block to corrupt is not stored"
        assert await store.delete_many(delete) == len(delete)
    with open(extent_path(str(store_path), entry.extent), "r+b") as f:
        f.seek(entry.offset + SLOT_HEADER_BYTES + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


async def _present(store_path: Path, keys: list[bytes]) -> list[bool]:
    async with kvstore.open(store_path) as store:
        return await store.contains_many(keys)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("model") / "tiny-llama"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([str(VLLM_PYTHON), str(HERE / "tiny_llama.py"), str(model)], env=env,
                   check=True, capture_output=True, timeout=300)
    return model


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm")
    model = tiny_model
    store = tmp / "store"
    lives: dict[str, Any] = {"store": store}
    lives["ref"] = life(tmp, "ref", model, None)
    lives["A"] = life(tmp, "A", model, store)
    lives["B"] = life(tmp, "B", model, store)
    keys = [[bytes.fromhex(k) for k in out["keys"]] for out in lives["B"]["outputs"]]
    lives["keys"] = keys
    lives["present_after_B"] = anyio.run(_present, store, [k for ks in keys for k in ks])
    anyio.run(_tamper, store, keys[0][1], [keys[0][4], keys[1][2]])
    lives["C"] = life(tmp, "C", model, store)
    lives["D"] = life(tmp, "D", model, store)
    lives["E"] = life(tmp, "E", model, store, multiprocessing=True)
    bad = tmp / "not-a-directory"
    bad.write_text("a file where the store directory should be")
    lives["bad"] = life(tmp, "bad", model, bad)
    # A failed load, then an abort before the recompute, then the same prompt again.
    anyio.run(_tamper, store, keys[0][1], [])
    lives["F"] = life(tmp, "F", model, store, abort_first={"0": 1})
    # LONG's load held in flight and the request aborted meanwhile; SP_B served while
    # it is held; then LONG again.
    lives["G"] = life(tmp, "G", model, store, abort_in_flight=[0, 2])
    # Another engine whose store path is another directory (its own mount namespace).
    with held_life(tmp, "X", model, store, engine_id="kvstore-test-engine-x") as x:
        lives["X"] = x
        for name, extra in (("Y1", {}), ("Y2", {"engine_id": "kvstore-test-engine-x"})):
            other = tmp / f"store-{name}"
            other.mkdir()
            lives[name] = life(tmp, name, model, store, multiprocessing=True,
                               prefix=in_own_mount_namespace(store, other), **extra)
    return lives


def prompt_blocks(out: dict[str, Any]) -> int:
    """Full blocks vLLM may take from a cache: one prompt token is always computed."""
    return (len(out["prompt_token_ids"]) - 1) // BLOCK


def tokens(result: dict[str, Any]) -> list[list[int]]:
    return [out["tokens"] for out in result["outputs"]]


def test_prompts_span_several_blocks(scenario: dict[str, Any]) -> None:
    lengths = [len(out["prompt_token_ids"]) for out in scenario["ref"]["outputs"]]
    assert [n // BLOCK for n in lengths] == [5, 3, 3], lengths  # LONG, SP_A, SP_B
    # the system prompt fills two blocks; the third differs between SP_A and SP_B
    a, b = (scenario["ref"]["outputs"][i]["prompt_token_ids"] for i in (1, 2))
    assert a[:2 * BLOCK] == b[:2 * BLOCK] and a[2 * BLOCK:3 * BLOCK] != b[2 * BLOCK:3 * BLOCK]


def test_first_life_computes_saves_and_matches_reference(scenario: dict[str, Any]) -> None:
    a = scenario["A"]
    assert tokens(a) == tokens(scenario["ref"])
    long, sp_a, sp_b = a["outputs"]
    assert long["num_cached_tokens"] == 0 and sp_a["num_cached_tokens"] == 0
    c = a["connector"]
    assert c["load_failed_blocks"] == 0 and c["save_failed_blocks"] == 0
    # LONG 5 + SP_A 3 + SP_B's own third block (its two system-prompt blocks were
    # loaded, not computed); the outputs fill no further block.
    assert c["saved_blocks"] == 5 + 3 + 1
    assert c["store"]["blocks"] == c["saved_blocks"]
    # The keys derived independently from vLLM's hash function name stored blocks.
    assert all(scenario["present_after_B"][:prompt_blocks(long)])


def test_shared_system_prompt_blocks_come_from_kvstore(scenario: dict[str, Any]) -> None:
    """SP_B, in the same life as SP_A and with vLLM's own prefix cache reset, takes the
    two system-prompt blocks SP_A stored; its output equals the run without connector."""
    a = scenario["A"]
    sp_b = a["outputs"][2]
    assert sp_b["num_cached_tokens"] == 2 * BLOCK
    assert a["connector"]["loaded_blocks"] == 2
    assert a["metrics"]["vllm:prompt_tokens_by_source[external_kv_transfer]"] == 2 * BLOCK
    assert a["metrics"]["vllm:prompt_tokens_cached_by_source[disk]"] == 2 * BLOCK
    assert tokens(a)[2] == tokens(scenario["ref"])[2]


def test_restart_serves_prompts_from_kvstore(scenario: dict[str, Any]) -> None:
    a, b = scenario["A"], scenario["B"]
    assert tokens(b) == tokens(scenario["ref"]) == tokens(a)
    want = [prompt_blocks(out) * BLOCK for out in b["outputs"]]
    assert [out["num_cached_tokens"] for out in b["outputs"]] == want
    total = sum(len(out["prompt_token_ids"]) for out in b["outputs"])
    by_source = {k: v for k, v in b["metrics"].items() if "prompt_tokens_by_source" in k}
    assert by_source == {
        "vllm:prompt_tokens_by_source[local_compute]": total - sum(want),
        "vllm:prompt_tokens_by_source[local_cache_hit]": 0,
        "vllm:prompt_tokens_by_source[external_kv_transfer]": sum(want)}
    assert sum(want) > 0.8 * total  # most prompt tokens were not computed
    assert b["metrics"]["vllm:prompt_tokens_cached_by_source[disk]"] == sum(want)
    c = b["connector"]
    assert c["loaded_blocks"] == c["lookup_hit_blocks"] == sum(want) // BLOCK
    assert c["load_failed_blocks"] == 0 and c["saved_blocks"] == 0


def test_corrupt_and_missing_blocks_are_recomputed(scenario: dict[str, Any]) -> None:
    b, c = scenario["B"], scenario["C"]
    assert tokens(c) == tokens(scenario["ref"])
    long, sp_a, sp_b = c["outputs"]
    assert prompt_blocks(long) == 5
    conn = c["connector"]
    # LONG's hit stops before the deleted block 4: vLLM schedules 4 blocks from kvstore.
    # Block 1 fails its checksum: only block 0 is loaded, blocks 1..3 are reported failed
    # and recomputed.  (vLLM's counters still include them: it counts hits when it
    # schedules, before the load; connector_stats counts what was loaded.)
    assert long["num_cached_tokens"] == 4 * BLOCK
    assert conn["load_failed_blocks"] == 3
    assert conn["store"]["corrupt_blocks"] == 1 and conn["store"]["quarantined"] == 1
    # SP_A's block 2 is gone: its hit stops before it.
    assert sp_a["num_cached_tokens"] == 2 * BLOCK
    assert sp_b["num_cached_tokens"] == prompt_blocks(sp_b) * BLOCK
    external = "vllm:prompt_tokens_by_source[external_kv_transfer]"
    assert c["metrics"][external] == b["metrics"][external] - 2 * BLOCK
    # Fewer blocks were loaded than after a clean restart: LONG 1 instead of 5, SP_A 2
    # instead of 3.
    assert conn["loaded_blocks"] == b["connector"]["loaded_blocks"] - 4 - 1
    # Loads finish before their request runs: no forward read the failed blocks, so no
    # save was dropped.  LONG's blocks 1 and 4 and SP_A's block 2 were saved again.
    assert conn["save_dropped_blocks"] == 0
    assert conn["saved_blocks"] == 3


def test_store_heals_after_recompute(scenario: dict[str, Any]) -> None:
    b, d = scenario["B"], scenario["D"]
    assert tokens(d) == tokens(scenario["ref"])
    assert [o["num_cached_tokens"] for o in d["outputs"]] == \
        [o["num_cached_tokens"] for o in b["outputs"]]
    assert d["connector"]["loaded_blocks"] == b["connector"]["loaded_blocks"]
    assert d["connector"]["load_failed_blocks"] == 0


def test_multiprocess_engine_finds_blocks_through_the_worker(scenario: dict[str, Any]) -> None:
    b, e = scenario["B"], scenario["E"]
    assert e["connector"] is None  # the store is open in the worker process, not here
    assert tokens(e) == tokens(scenario["ref"])
    assert [o["num_cached_tokens"] for o in e["outputs"]] == \
        [o["num_cached_tokens"] for o in b["outputs"]]
    for source in ("vllm:prompt_tokens_by_source[external_kv_transfer]",
                   "vllm:prompt_tokens_cached_by_source[disk]"):
        assert e["metrics"][source] == b["metrics"][source] > 0


def test_unopenable_store_fails_at_start_with_a_clear_error(scenario: dict[str, Any]) -> None:
    error = scenario["bad"].get("error", "")
    assert "kvstore connector: cannot open the store at" in error, error
    assert "not-a-directory" in error


def test_a_failed_load_is_never_a_prefix_cache_hit(scenario: dict[str, Any]) -> None:
    """LONG's load fails (block 1 corrupt) and the request is aborted before it
    recomputes; sent again, it must not take the unloaded blocks from vLLM's own prefix
    cache, and nothing computed from them may reach the store (life G)."""
    f, g = scenario["F"], scenario["G"]
    assert tokens(f) == tokens(scenario["ref"])
    assert tokens(g) == tokens(scenario["ref"])
    assert f["connector"]["load_failed_blocks"] >= 3  # the corruption was met
    assert f["connector"]["store"]["corrupt_blocks"] == 1


def test_an_abort_while_the_load_is_in_flight_leaks_nothing_and_copies_nothing_wrong(
        scenario: dict[str, Any]) -> None:
    """vLLM keeps an aborted request's blocks until the worker reports its load done:
    the held load lands in them, not in blocks given to ``SP_B`` meanwhile, and they are
    freed once it is reported (the block pool is whole again; the connector tracks no
    load)."""
    g, ref = scenario["G"], scenario["ref"]
    held = g["abort_in_flight"]
    assert held["loading_while_held"] == 1
    assert held["free_while_held"] < held["free_before"]  # the aborted request's blocks
    assert held["other_tokens"] == tokens(ref)[2]  # SP_B, served while the load was held
    assert held["free_after"] == held["free_before"]
    assert held["loading_after"] == 0
    assert tokens(g) == tokens(ref)
    assert g["connector"]["load_failed_blocks"] == 0


def test_a_second_engine_on_the_same_path_never_sees_the_first_ones_blocks(
        scenario: dict[str, Any]) -> None:
    """Y1's store starts empty, as A's did: it must see exactly A's hits (SP_B's
    system-prompt blocks, saved by SP_A in the same life); any more came from X."""
    y1, a = scenario["Y1"], scenario["A"]
    assert tokens(y1) == tokens(scenario["ref"])
    assert [o["num_cached_tokens"] for o in y1["outputs"]] == \
        [o["num_cached_tokens"] for o in a["outputs"]] == [0, 0, 2 * BLOCK]
    external = "vllm:prompt_tokens_by_source[external_kv_transfer]"
    assert y1["metrics"][external] == a["metrics"][external] == 2 * BLOCK
    assert tokens(scenario["X"]) == tokens(scenario["ref"])


def test_an_engine_that_cannot_serve_its_lookups_refuses_to_start(
        scenario: dict[str, Any]) -> None:
    """Y2 has X's engine id: its worker cannot own the lookup socket, so it refuses."""
    y2 = scenario["Y2"]
    assert "outputs" not in y2, "the engine started although its lookups go elsewhere"
    assert "kvstore connector: cannot serve lookups" in y2.get("error", "") + y2["stderr"]


# ---------------------------------------------------------------------------- sync loads

@pytest.fixture(scope="module")
def sync_scenario(scenario: dict[str, Any], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[str, Any]:
    """``S``: a restart with ``async_loads`` off, on the store the scenario left (every
    prompt block stored), ``LONG``'s block 1 corrupted once more.  One engine life."""
    store, keys = scenario["store"], scenario["keys"]
    anyio.run(_tamper, store, keys[0][1], [])
    tmp = tmp_path_factory.mktemp("vllm-sync")
    return life(tmp, "S", tiny_model, store,
                extra={"extent_bytes": SMALL_EXTENT, "async_loads": False})


def test_sync_loads_serve_a_restart_from_kvstore(sync_scenario: dict[str, Any],
                                                 scenario: dict[str, Any]) -> None:
    s = sync_scenario
    assert tokens(s) == tokens(scenario["ref"])
    long, sp_a, sp_b = s["outputs"]
    # SP_A and SP_B: every prompt block from kvstore, loaded in the step that runs them.
    assert sp_a["num_cached_tokens"] == prompt_blocks(sp_a) * BLOCK == 3 * BLOCK
    assert sp_b["num_cached_tokens"] == prompt_blocks(sp_b) * BLOCK == 3 * BLOCK
    assert s["metrics"]["vllm:prompt_tokens_cached_by_source[disk]"] == 7 * BLOCK


def test_sync_loads_recompute_a_corrupt_block_mid_chain(sync_scenario: dict[str, Any],
                                                        scenario: dict[str, Any]) -> None:
    """The lookup reads and verifies the hit before claiming it: LONG's block 1 fails
    its checksum there, so the hit is block 0 only and vLLM computes blocks 1..4 (no
    block is reported failed after vLLM cached it).  The outputs equal the reference,
    and the recomputed block 1 is stored again."""
    s = sync_scenario
    assert tokens(s) == tokens(scenario["ref"])
    long = s["outputs"][0]
    assert long["num_cached_tokens"] == 1 * BLOCK
    conn = s["connector"]
    assert conn["store"]["corrupt_blocks"] == 1
    assert conn["loaded_blocks"] == conn["lookup_hit_blocks"] == 1 + 3 + 3
    assert conn["load_failed_blocks"] == 0 and conn["save_dropped_blocks"] == 0
    assert conn["saved_blocks"] == 1  # LONG's blocks 2..4 are still stored


# ---------------------------------------------------------------------------- tensor parallel

TP = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
# One core per rank (vLLM's CPU workers), from the CPUs this process may run on (a
# container's may not be 0 and 1).
_CPUS = sorted(os.sched_getaffinity(0))
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in _CPUS[:2])}


@pytest.fixture(scope="module")
def tp_scenario(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    """Tensor parallel 2 (vLLM's multiprocess executor, one worker process per rank):

    * ``TA``  fresh store: every rank saves its shard into ``store/rank-R-of-2``.
    * ``TB``  restart: full hits, loaded on both ranks.
    * tamper  rank 1 only: delete ``LONG``'s block 3, corrupt ``SP_A``'s block 1.
    * ``TC``  restart: ``LONG``'s hit stops at 3 blocks (rank 0 still has all 5: the
              scheduler takes the minimum over the ranks); ``SP_A`` is a hit of 3
              blocks on both ranks, but rank 1's load fails at block 1: it reports
              blocks 1 and 2, vLLM recomputes them on both ranks.
    Outputs always equal ``T0``'s: the same engine without the connector, which also
    tells whether vLLM's own tensor parallel starts on this machine at all (if it does
    not, the TP tests skip saying why; test_vllm_ranks.py still covers the multi-rank
    lookups and failures with real worker processes).
    """
    if len(_CPUS) < 2:
        pytest.skip(f"tensor parallel 2 on CPU needs 2 CPUs to bind, this process has {_CPUS}")
    tmp = tmp_path_factory.mktemp("vllm-tp")
    store = tmp / "store"
    t0 = life(tmp, "T0", tiny_model, None, multiprocessing=True, env_extra=TP_ENV, llm=TP)
    if "error" in t0:
        pytest.skip(f"vLLM's tensor parallel does not start here, without kvstore: "
                    f"{_why_not_started(t0)}")
    lives: dict[str, Any] = {"store": store, "T0": t0}
    for name in ("TA", "TB"):
        lives[name] = started(life(tmp, name, tiny_model, store, multiprocessing=True,
                                   env_extra=TP_ENV, llm=TP), name)
    # per rank, per prompt, the store keys of its blocks
    keys = [[[bytes.fromhex(k) for k in out["rank_keys"][rank]]
             for out in lives["TB"]["outputs"]] for rank in range(2)]
    lives["keys"] = keys
    anyio.run(_tamper, store / "rank-1-of-2", keys[1][1][1], [keys[1][0][3]])
    lives["TC"] = started(life(tmp, "TC", tiny_model, store, multiprocessing=True,
                               env_extra=TP_ENV, llm=TP), "TC")
    return lives


def kv_metric(result: dict[str, Any], name: str, **labels: str) -> float:
    """A connector metric of an engine life (``engine_life.metrics`` naming)."""
    key = f"vllm:kvstore_{name}"
    if labels:
        key += "{" + ",".join(f"{k}={labels[k]}" for k in sorted(labels)) + "}"
    return float(result["metrics"].get(key, 0))


def test_tp_each_rank_saves_its_own_shard(tp_scenario: dict[str, Any]) -> None:
    ta, store = tp_scenario["TA"], tp_scenario["store"]
    assert tokens(ta) == tokens(tp_scenario["T0"])  # what the engine computes alone
    assert sorted(p.name for p in store.iterdir()) == ["rank-0-of-2", "rank-1-of-2"]
    k0, k1 = tp_scenario["keys"]
    assert k0[0] != k1[0]  # each rank's namespace (TP rank) seeds its keys
    ranks = ta["ranks"]  # connector_stats() of each worker process, in rank order
    assert [r["store"]["path"] for r in ranks] == [str(store / f"rank-{i}-of-2") for i in
                                                   range(2)]
    assert [r["saved_blocks"] for r in ranks] == [9, 9]
    for rank in range(2):
        # LONG 5 + SP_A 3 + SP_B's third block, on every rank, under its own keys.  (The
        # outcome of the last saves reaches vLLM's metrics only with a later step's stats:
        # connector_stats, which waits for them, counts what was written.)
        assert kv_metric(ta, "save_requested_blocks", rank=str(rank)) == 9
        assert ranks[rank]["store"]["blocks"] == 9
        assert kv_metric(ta, "load_blocks", outcome="loaded", rank=str(rank)) == 2
    assert [o["num_cached_tokens"] for o in ta["outputs"]] == [0, 0, 2 * BLOCK]


def test_tp_restart_loads_every_rank(tp_scenario: dict[str, Any]) -> None:
    ta, tb = tp_scenario["TA"], tp_scenario["TB"]
    assert tokens(tb) == tokens(ta)
    want = [prompt_blocks(o) * BLOCK for o in tb["outputs"]]
    assert [o["num_cached_tokens"] for o in tb["outputs"]] == want == [5 * BLOCK, 3 * BLOCK,
                                                                        3 * BLOCK]
    assert kv_metric(tb, "lookup_hit_blocks") == 11
    for rank in "01":
        assert kv_metric(tb, "load_blocks", outcome="loaded", rank=rank) == 11
        assert kv_metric(tb, "load_blocks", outcome="failed", rank=rank) == 0
        assert kv_metric(tb, "save_requested_blocks", rank=rank) == 0


def test_tp_a_block_is_a_hit_only_when_every_rank_has_it(tp_scenario: dict[str, Any]) -> None:
    ta, tc = tp_scenario["TA"], tp_scenario["TC"]
    assert tokens(tc) == tokens(ta)
    long, sp_a, sp_b = tc["outputs"]
    assert long["num_cached_tokens"] == 3 * BLOCK  # rank 1 lacks block 3, rank 0 has 5
    # LONG 3 + SP_A 3 (its load fails on rank 1 later) + SP_B 3
    assert kv_metric(tc, "lookup_hit_blocks") == 9
    assert kv_metric(tc, "load_blocks", outcome="loaded", rank="0") == 9


def test_tp_a_rank_whose_load_fails_reports_it_and_vllm_recomputes(
        tp_scenario: dict[str, Any]) -> None:
    ta, tc = tp_scenario["TA"], tp_scenario["TC"]
    assert tokens(tc) == tokens(ta)
    # Rank 1 loaded LONG 3, SP_A's block 0 and SP_B 3; SP_A's blocks 1 and 2 failed.
    assert kv_metric(tc, "load_blocks", outcome="loaded", rank="1") == 7
    assert kv_metric(tc, "load_blocks", outcome="failed", rank="1") == 2
    assert kv_metric(tc, "load_blocks", outcome="failed", rank="0") == 0
    assert kv_metric(tc, "corrupt_blocks", rank="1") == 1
    assert kv_metric(tc, "corrupt_blocks", rank="0") == 0
    # Recomputed blocks are saved where a rank lacks them: on rank 1 LONG's block 3
    # (deleted) and SP_A's block 1 (quarantined); rank 0 had them all.
    assert [r["saved_blocks"] for r in tc["ranks"]] == [0, 2]
